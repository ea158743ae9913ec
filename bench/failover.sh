#!/usr/bin/env bash
# bench/failover.sh — the cost of running on Patroni, measured in one run on a private HA
# cluster (3 PostgreSQL 15 nodes under Patroni + etcd, started here, stopped at the end):
#
#   1. hot-SKU confirmed orders/s with synchronous_mode on and off, alternated
#      (on, off, on, off) so both see the same machine;
#   2. 1, 2 and 4 stockgate instances behind no balancer (one loadtest per instance, the
#      connections split between them), one hot product: orders/s, monitor queries/s per
#      node (stockgate_monitor_samples_total summed over instances), Redis commands per
#      confirmed order (a private Redis, so nobody else's traffic is counted);
#   3. time from a planned switchover (POST /switchover) to the first 201 from the new
#      leader, and from kill -9 of the leader to the first 201 (one order per 20 ms probe).
#
# Prints one markdown report and writes it to bench/results/failover-<YYYY-MM-DD>.md.
# Environment: BENCH_SECONDS (per step, default 10), BENCH_CONCURRENCY (default 64),
# BENCH_HA_PORT (default 17600), BENCH_DIR (default /tmp/sg-bench-failover).
set -euo pipefail
cd "$(dirname "$0")/.."

SECS="${BENCH_SECONDS:-10}"
CONC="${BENCH_CONCURRENCY:-64}"
export STOCKGATE_DEV_HA_PORT="${BENCH_HA_PORT:-17600}"
export STOCKGATE_DEV_DIR="${BENCH_DIR:-/tmp/sg-bench-failover}"
REDIS_PORT=$((STOCKGATE_DEV_HA_PORT + 90))
APP_PORT=$((STOCKGATE_DEV_HA_PORT + 80))

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'failover.sh: %s\n' "$*" >&2; exit 1; }
command -v jq >/dev/null || die "jq is missing (apt-get install jq)"
command -v patroni >/dev/null && command -v etcd >/dev/null \
  || die "patroni/etcd missing: ./dev up --ha installs them"

say "building (release)"
cargo build --release --quiet -p stockgate -p devcluster -p loadtest
DC=target/release/devcluster
SG=target/release/stockgate
LT=target/release/loadtest
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  "$DC" ha down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

say "HA cluster (synchronous_mode on)"
"$DC" ha up >&2
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --daemonize yes --save '' --appendonly no \
  --dir "$work" --logfile "$work/redis.log" >/dev/null
leader_port() { "$DC" ha status | awk '$6 == "leader" {split($3, a, ":"); print a[2]}'; }
LP=$(leader_port)
psql -h 127.0.0.1 -p "$LP" -U postgres -d postgres -qAtc "DROP DATABASE IF EXISTS bench" -c "CREATE DATABASE bench"
export DATABASE_URL="postgres://postgres@127.0.0.1:$LP/bench"
"$SG" migrate >/dev/null
eval "$("$DC" ha env | grep STOCKGATE_PATRONI_URLS | sed 's/^/export /')"
export STOCKGATE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/"
export STOCKGATE_TOKEN_SECRET="bench-secret-0123456789abcdef"
export RUST_LOG=warn
ADMIN=$("$SG" token --admin)

# start_instances N: N services on APP_PORT, APP_PORT+1, …
start_instances() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  for i in $(seq 0 $(($1 - 1))); do
    STOCKGATE_LISTEN="127.0.0.1:$((APP_PORT + i))" "$SG" serve >"$work/sg-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in $(seq 0 $(($1 - 1))); do
    for _ in $(seq 1 100); do
      curl -fs "http://127.0.0.1:$((APP_PORT + i))/readyz" >/dev/null && break
      sleep 0.1
    done
  done
}
metric_sum() { # metric_sum N NAME: sum of a metric over N instances
  local total=0 v
  for i in $(seq 0 $(($1 - 1))); do
    v=$(curl -fs "http://127.0.0.1:$((APP_PORT + i))/metrics" | awk -v m="$2" '$1 ~ "^"m"({|$)" {s += $2} END {printf "%.0f", s}')
    total=$((total + v))
  done
  echo "$total"
}
redis_cmds() { redis-cli -p "$REDIS_PORT" info stats | awk -F: '/^total_commands_processed/ {print $2+0}'; }
# hot N: one loadtest per instance on one fresh hot product, CONC split between them, for
# SECS; prints confirmed orders
hot() {
  local n=$1 each=$(( CONC / $1 )) lt_pids=() pid="hot-$RANDOM$RANDOM"
  curl -fs -X POST "http://127.0.0.1:$APP_PORT/v1/products" -H "Authorization: Bearer $ADMIN" \
    -H 'Content-Type: application/json' \
    -d "{\"product_id\":\"$pid\",\"name\":\"hot\",\"price_cents\":100,\"available_quantity\":2000000000}" >/dev/null
  for i in $(seq 0 $((n - 1))); do
    "$LT" hot-sku --seconds "$SECS" --concurrency "$each" --base-url "http://127.0.0.1:$((APP_PORT + i))" \
      --product-id "$pid" --existing \
      --admin-token "$ADMIN" --json "$work/hot-$n-$i.json" >"$work/hot-$n-$i.txt" 2>&1 &
    lt_pids+=($!)
  done
  for p in "${lt_pids[@]}"; do wait "$p" || true; done
  local ok=0
  for i in $(seq 0 $((n - 1))); do
    ok=$((ok + $(jq -r '.confirmed_orders // 0' "$work/hot-$n-$i.json" 2>/dev/null || echo 0)))
  done
  echo "$ok"
}

# ---- 1. synchronous_mode on vs off ----------------------------------------------------------
start_instances 1
declare -A rate
for round in 1 2; do
  for mode in on off; do
    "$DC" ha sync "$mode"
    n=$(hot 1)
    rate[$mode-$round]=$(( n / SECS ))
    say "synchronous_mode $mode (round $round): $((n / SECS)) orders/s"
  done
done
"$DC" ha sync on

# ---- 2. 1, 2 and 4 instances -----------------------------------------------------------------
declare -A inst
for n in 1 2 4; do
  start_instances "$n"
  sleep 1
  s0=$(metric_sum "$n" stockgate_monitor_samples_total); r0=$(redis_cmds); t0=$(date +%s.%N)
  ok=$(hot "$n")
  s1=$(metric_sum "$n" stockgate_monitor_samples_total); r1=$(redis_cmds); t1=$(date +%s.%N)
  el=$(echo "$t1 - $t0" | bc -l)
  inst[$n]="| $n | $((ok / SECS)) | $(printf '%.0f' "$(echo "($s1 - $s0) / $el / 3" | bc -l)") | $(printf '%.2f' "$(echo "($r1 - $r0) / ($ok + 0.0001)" | bc -l)") |"
  say "instances $n: ${inst[$n]}"
done

# ---- 3. switchover and kill -9: time to the first 201 from the new leader -------------------
start_instances 1
probe() { # probe SECONDS: one order every 20 ms; prints "epoch_ms status" lines
  local end=$(( $(date +%s) + $1 )) k=0 user tok
  tok=$("$SG" token --user probe)
  curl -fs -X POST "http://127.0.0.1:$APP_PORT/v1/products" -H "Authorization: Bearer $ADMIN" \
    -H 'Content-Type: application/json' \
    -d '{"product_id":"probe","name":"probe","price_cents":1,"available_quantity":1000000}' >/dev/null || true
  while [ "$(date +%s)" -lt $end ]; do
    k=$((k + 1))
    s=$(curl -s -o /dev/null -w '%{http_code}' --max-time 15 -X POST "http://127.0.0.1:$APP_PORT/v1/orders" \
      -H "Authorization: Bearer $tok" -H "Idempotency-Key: p-$$-$k-$RANDOM" \
      -H 'Content-Type: application/json' -d '{"product_id":"probe","quantity":1}')
    echo "$(date +%s%3N) $s"
    sleep 0.02
  done
}
first_201_after() { awk -v t="$2" '$1 > t && $2 == 201 {print $1 - t; exit}' "$1"; }

probe 25 >"$work/switch.txt" & pp=$!
sleep 3
t_sw=$(date +%s%3N)
"$DC" ha switchover >&2
wait $pp
sw_ms=$(first_201_after "$work/switch.txt" "$(awk -v t="$t_sw" '$1 > t && $2 != 201 {print $1; exit}' "$work/switch.txt" || echo "$t_sw")")
sw_total=$(awk -v t="$t_sw" 'BEGIN{g=0} $1 > t && $2 != 201 {last=$1} END{print last}' "$work/switch.txt")
"$DC" ha wait

probe 35 >"$work/kill.txt" & pp=$!
sleep 3
L=$("$DC" ha status | awk '$6 == "leader" {print substr($1, 5)}')
t_kill=$(date +%s%3N)
"$DC" ha kill "$L"
wait $pp
kill_ms=$(first_201_after "$work/kill.txt" "$t_kill")
codes_kill=$(awk -v t="$t_kill" '$1 > t {c[$2]++} END {for (k in c) printf "%s×%d ", k, c[k]}' "$work/kill.txt")
codes_sw=$(awk -v t="$t_sw" '$1 > t {c[$2]++} END {for (k in c) printf "%s×%d ", k, c[k]}' "$work/switch.txt")
"$DC" ha start "$L"

out="bench/results/failover-$(date -u +%F).md"
{
  echo "# Failover and HA cost — $(date -u +%FT%TZ), $(nproc) cores, ${SECS}s per step, $CONC connections"
  echo
  echo "## 1. Hot SKU, synchronous_mode on vs off (one instance, alternated)"
  echo
  echo "| round | on (orders/s) | off (orders/s) |"
  echo "|---|---|---|"
  for round in 1 2; do echo "| $round | ${rate[on-$round]} | ${rate[off-$round]} |"; done
  echo
  echo "## 2. Instances on one hot product (synchronous_mode on)"
  echo
  echo "| instances | confirmed orders/s (all) | monitor queries/s per node (all instances) | Redis commands per confirmed order |"
  echo "|---|---|---|---|"
  for n in 1 2 4; do echo "${inst[$n]}"; done
  echo
  echo "## 3. Writes back after a leader change (one order per ~20 ms)"
  echo
  echo "| event | first 201 from the new leader after | answers after the event |"
  echo "|---|---|---|"
  echo "| planned switchover (POST /switchover) | ${sw_ms:-n/a} ms after the first non-201 | $codes_sw |"
  echo "| kill -9 of the leader's Patroni + postmaster | ${kill_ms:-n/a} ms after the kill | $codes_kill |"
} | tee "$out"
say "written to $out"
