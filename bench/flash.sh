#!/usr/bin/env bash
# bench/flash.sh — the flash-sale figures, measured from outside, each three times.
#
# Against a running local deployment (./dev up), in rounds, so every ratio compares figures
# taken side by side in the same round:
#   1. pgbench -M prepared -j 2 over TCP to the same primary and database the service uses:
#      the guarded UPDATE + INSERT of one order per transaction on one hot row, at -c 1, 8,
#      32 and 64; the best median is the yardstick;
#   2. hot SKU: confirmed orders/s at 64 connections, with wrk (bench/wrk/orders.lua: every
#      request a new buyer and a new Idempotency-Key) and with loadtest hot-sku;
#   3. availability of that row at 64 connections, with wrk and with loadtest availability;
#   4. the HTTP ceiling: nginx serving the availability answer's exact bytes as a static file,
#      loaded by the same wrk command;
#   5. pgbench selecting that row on replica 1 at -c 32;
#   6. rejections after a sell-out: wrk buyers (new keys) on a product with no stock left,
#      and what each costs the primary (refusal-claim statements, order transactions);
# then, with instances this script starts itself (same binary, cluster and secret):
#   7. 1, 2 and 4 instances ordering the same hot product at 64 connections in total
#      (one wrk per instance, 64/N connections each), three times each;
#   8. RSS of the running service under wrk hot SKU at 256 connections.
# The service's CPU per request (utime + stime of the process ÷ requests answered, from
# /proc) is printed beside each wrk figure: unlike req/s it barely moves with what else runs.
# For the hot-SKU and availability steps it also says where the two cores went: the service,
# the primary (its postmaster and every child), the two replicas, the rest (wrk, the kernel's
# work for them) and idle, as shares of all CPU time in the step (/proc/stat).
#
# Prints the tables and writes them to bench/results/<YYYY-MM-DD>.md. Loopback only.
# Needs wrk and nginx (apt-get install wrk nginx-light), jq, pgbench (postgresql-15).
#
# Environment: STOCKGATE_LISTEN (the running service, default 127.0.0.1:8080),
# STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (the dev cluster, as for ./dev), BENCH_SECONDS (per
# step, default 10), ROUNDS (default 3), STOCKGATE_TOKEN_SECRET (default: ./dev's secret),
# SCALE_PORT (first port of the instances of step 7, default 18180), STOCKGATE_BIN (the binary
# step 7 runs, default target/release/stockgate), PGBENCH, NGINX.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

LISTEN="${STOCKGATE_LISTEN:-127.0.0.1:8080}"
BASE_URL="http://$LISTEN"
PORT="${LISTEN##*:}"
SECS="${BENCH_SECONDS:-10}"
ROUNDS="${ROUNDS:-3}"
SCALE_PORT="${SCALE_PORT:-18180}"
PGBENCH="${PGBENCH:-/usr/lib/postgresql/15/bin/pgbench}"
NGINX="${NGINX:-/usr/sbin/nginx}"
HOT=pgbench-hot

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'flash.sh: %s\n' "$*" >&2; exit 1; }

case "${LISTEN%:*}" in
  127.*|localhost|'[::1]') ;;
  *) die "STOCKGATE_LISTEN=$LISTEN is not a loopback address; this benchmark only loads local services" ;;
esac
for tool in jq wrk curl; do command -v "$tool" >/dev/null || die "$tool is missing (apt-get install $tool)"; done
[ -x "$PGBENCH" ] || die "pgbench not found at $PGBENCH"
[ -x "$NGINX" ] || die "nginx not found at $NGINX (apt-get install nginx-light)"
curl -fsS --max-time 5 "$BASE_URL/healthz" >/dev/null \
  || die "no stockgate answering at $BASE_URL (start it with ./dev up, or set STOCKGATE_LISTEN)"

dev_cluster_env
REPLICA_URL="${STOCKGATE_REPLICA_URLS%%,*}"
export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret)}"
ADMIN="$(./dev token --admin)"
export STOCKGATE_ADMIN_TOKEN="$ADMIN"
SG="${STOCKGATE_BIN:-${CARGO_TARGET_DIR:-target}/release/stockgate}"
# Every step adds orders, and a larger orders table costs more per insert: say how large.
orders_at_start="$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM orders")"

say "building loadtest (release)"
cargo build --release --quiet -p loadtest
LT="${CARGO_TARGET_DIR:-target}/release/loadtest"

work="$(mktemp -d)"
chmod 755 "$work" # nginx's workers run as nobody
scale_pids=() nginx_pid=""
cleanup() {
  for p in "${scale_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -z "$nginx_pid" ] || kill "$nginx_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

pid_on() { ss -ltnpH "sport = :$1" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1; }
# split_now: service primary replicas busy all, in ticks
split_now() {
  echo "$(cpu_ticks "$SVC_PID") $(node_ticks primary) $(( $(node_ticks replica-1) + $(node_ticks replica-2) ))" \
    "$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9 }' /proc/stat)"
}
# split NAME ROUND BEFORE: records the shares of all CPU time since BEFORE (a split_now line)
split() {
  local name="$1" round="$2" part s0 p0 r0 b0 a0 s1 p1 r1 b1 a1
  read -r s0 p0 r0 b0 a0 <<<"$3"
  read -r s1 p1 r1 b1 a1 <<<"$(split_now)"
  # /proc/stat counts in ticks of all CPUs together, as /proc/PID/stat does
  local all=$(( a1 - a0 )) busy=$(( b1 - b0 ))
  for part in "service:$(( s1 - s0 ))" "primary:$(( p1 - p0 ))" "replicas:$(( r1 - r0 ))" \
    "rest:$(( busy - (s1 - s0) - (p1 - p0) - (r1 - r0) ))" "idle:$(( all - busy ))"; do
    record "split.$name.${part%%:*}" "$round" "$(ratio $(( 100 * ${part#*:} )) "$all")"
  done
}
SVC_PID="$(pid_on "$PORT")"
[ -n "$SVC_PID" ] || die "cannot find the process listening on $LISTEN"

# record NAME ROUND VALUE; the values of one figure are kept in $work/fig/NAME
record() { mkdir -p "$work/fig"; echo "$3" >>"$work/fig/$1"; eval "R_${1//[^a-zA-Z0-9]/_}_$2=\$3"; }
got() { local v="R_${1//[^a-zA-Z0-9]/_}_$2"; echo "${!v:-n/a}"; }
# fig NAME [DECIMALS]: "median (min–max)" of a figure's runs
fig() {
  local f="$work/fig/$1"
  [ -s "$f" ] || { echo n/a; return; }
  grep -v '^n/a$' "$f" | sort -g | LC_ALL=C awk -v d="${2:-0}" '
    { v[NR] = $1 } END {
      if (NR == 0) { print "n/a"; exit }
      m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      f = "%." d "f"
      if (NR == 1) printf f "\n", m
      else printf f " (" f "–" f ")\n", m, v[1], v[NR]
    }'
}
median() { fig "$1" "${2:-2}" | awk '{ print $1 }'; }
ratio() {
  case "$1$2" in *n/a*|*null*) echo n/a ;; *) LC_ALL=C awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }' ;; esac
}
wrk_rps() { awk '/^Requests\/sec:/ { print $2 }' "$1"; }
wrk_req() { awk '/requests in/ { print $1 }' "$1"; }
wrk_201() { awk '/^status 201:/ { s += $3 } END { print s + 0 }' "$@"; }

metric() { metric_at "$BASE_URL" "$1"; }

pgb() { # pgb URL SCRIPT CLIENTS -> tps
  local jobs=$(( $3 < 2 ? $3 : 2 ))
  say "pgbench -c $3 -j $jobs -T $SECS -f $(basename "$2")"
  "$PGBENCH" -n -M prepared -f "$2" -c "$3" -j "$jobs" -T "$SECS" "$1" >"$work/pgb.txt" 2>&1 \
    || { cat "$work/pgb.txt" >&2; echo n/a; return; }
  sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' "$work/pgb.txt" | head -1
}

# wrk_svc NAME ROUND PID URL [wrk args...]: one wrk run against a service process; records
# req/s, p50, p99, and the process's CPU µs per request
wrk_svc() {
  local name="$1" round="$2" pid="$3"; shift 3
  say "wrk -t2 -c64 -d${SECS}s $name (round $round)"
  local before after
  before="$(cpu_ticks "$pid")"
  wrk -t2 -c64 -d"${SECS}s" --latency "$@" >"$work/$name.txt"
  after="$(cpu_ticks "$pid")"
  local n; n="$(wrk_req "$work/$name.txt")"
  record "$name" "$round" "$(wrk_rps "$work/$name.txt")"
  record "$name.p50" "$round" "$(wrk_ms "$work/$name.txt" 50%)"
  record "$name.p99" "$round" "$(wrk_ms "$work/$name.txt" 99%)"
  record "$name.cpu_us" "$round" "$(LC_ALL=C awk -v t=$(( (after - before) * TICK_US )) -v n="$n" 'BEGIN { printf "%.1f", t / n }')"
  grep -E '^status [^2]' "$work/$name.txt" >&2 || true
}

lt() { # lt NAME ROUND args...
  local name="$1" round="$2"; shift 2
  say "loadtest $* (round $round)"
  "$LT" "$@" --base-url "$BASE_URL" --json "$work/$name.json" >"$work/$name.txt" 2>&1 || true
}
j() { jq -r "$2 // \"n/a\"" "$work/$1.json" 2>/dev/null || echo n/a; }

# --- setup: the hot row, the pgbench scripts, the nginx ceiling ---------------------------
psql "$DATABASE_URL" -qX -v ON_ERROR_STOP=1 -c "INSERT INTO products (product_id, name, price_cents, available_quantity)
    VALUES ('$HOT', 'pgbench hot row', 100, 2000000000)
    ON CONFLICT (product_id) DO UPDATE SET available_quantity = 2000000000" >/dev/null
# One order per transaction at its best: a time-ordered order id and keys that grow per client,
# as the service writes them, so each insert lands on an index page already in memory (random
# ids and keys were 10-25 % slower on a 4.6 M-row orders table).
cat >"$work/order.sql" <<SQL
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1 WHERE product_id = '$HOT' AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) VALUES ((lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1e6)::bigint), 14, '0') || substr(md5(random()::text), 1, 18))::uuid, '$HOT', 'pgb-' || :client_id, 1, 100, 100, 'confirmed', 'pgb-' || (extract(epoch FROM clock_timestamp()) * 1e6)::bigint, 'x');
COMMIT;
SQL
cat >"$work/select.sql" <<SQL
SELECT available_quantity FROM products WHERE product_id = '$HOT';
SQL
AVAIL_PATH="/v1/products/$HOT/availability?qty=1"
mkdir -p "$work/www/v1/products/$HOT"
curl -fsS "$BASE_URL$AVAIL_PATH" >"$work/www/v1/products/$HOT/availability"
NGINX_PORT=$(( SCALE_PORT + 90 ))
cat >"$work/nginx.conf" <<CONF
worker_processes 2;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
daemon off;
events { worker_connections 1024; }
http {
  access_log off;
  default_type application/json;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$NGINX_PORT; root $work/www; }
}
CONF
"$NGINX" -c "$work/nginx.conf" -e "$work/nginx-error.log" &
nginx_pid=$!
for _ in $(seq 50); do curl -fsS -o /dev/null "http://127.0.0.1:$NGINX_PORT$AVAIL_PATH" 2>/dev/null && break; sleep 0.1; done
cmp -s <(curl -fsS "http://127.0.0.1:$NGINX_PORT$AVAIL_PATH") "$work/www/v1/products/$HOT/availability" \
  || die "nginx does not serve the availability bytes"

# --- rounds -------------------------------------------------------------------------------
for r in $(seq "$ROUNDS"); do
  for c in 1 8 32 64; do record "pgb.c$c" "$r" "$(pgb "$DATABASE_URL" "$work/order.sql" "$c")"; done
  best="$(for c in 1 8 32 64; do got "pgb.c$c" "$r"; done | grep -v n/a | sort -g | tail -1)"
  best="${best:-n/a}"
  record pgb.best "$r" "$best"
  psql "$DATABASE_URL" -qX -c "DELETE FROM orders WHERE product_id = '$HOT' AND user_id = 'pgb'" >/dev/null || true

  before="$(split_now)"
  wrk_svc hot "$r" "$SVC_PID" -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$HOT"
  split hot "$r" "$before"
  record hot.orders "$r" "$(LC_ALL=C awk -v n="$(wrk_201 "$work/hot.txt")" -v s="$SECS" 'BEGIN { printf "%.0f", n / s }')"
  record ratio.hot "$r" "$(ratio "$(got hot.orders "$r")" "$best")"
  lt lthot "$r" hot-sku --seconds "$SECS" --concurrency 64
  record lt.hot "$r" "$(j lthot .confirmed_per_s)"
  record lt.hot.p99 "$r" "$(j lthot .latency.p99_ms)"
  record ratio.lthot "$r" "$(ratio "$(got lt.hot "$r")" "$best")"

  before="$(split_now)"
  wrk_svc avail "$r" "$SVC_PID" "$BASE_URL$AVAIL_PATH"
  split avail "$r" "$before"
  wrk_svc nginx "$r" "$nginx_pid" "http://127.0.0.1:$NGINX_PORT$AVAIL_PATH"
  lt ltavail "$r" availability --seconds "$SECS" --concurrency 64 --product-id "$HOT"
  record lt.avail "$r" "$(j ltavail .requests_per_s)"
  record lt.avail.stale "$r" "$(j ltavail .max_stale_by_ms)"
  record pgb.select "$r" "$(pgb "$REPLICA_URL" "$work/select.sql" 32)"
  sold="sold-$(date +%s)-$r"
  curl -fsS -o /dev/null -X POST "$BASE_URL/v1/products" -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \
    -d "{\"product_id\": \"$sold\", \"name\": \"sold out\", \"price_cents\": 100, \"available_quantity\": 60}"
  wrk -t2 -c64 -d1s -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$sold" >/dev/null
  claims="$(metric stockgate_order_refusal_statements_total)" txs="$(metric stockgate_order_transactions_total)"
  wrk_svc soldout "$r" "$SVC_PID" -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$sold"
  refused="$(awk '/^status 409:/ { print $3 }' "$work/soldout.txt")"
  record soldout.claims "$r" "$(ratio "$refused" "$(( $(metric stockgate_order_refusal_statements_total) - claims ))")"
  record soldout.txs "$r" "$(( $(metric stockgate_order_transactions_total) - txs ))"
  record ratio.ceiling "$r" "$(ratio "$(got avail "$r")" "$(got nginx "$r")")"
  record ratio.select "$r" "$(ratio "$(got avail "$r")" "$(got pgb.select "$r")")"
  record ratio.ltselect "$r" "$(ratio "$(got lt.avail "$r")" "$(got pgb.select "$r")")"
done

# --- instances: 1, 2, 4 at 64 connections in total ----------------------------------------
start_instances() {
  for p in "${scale_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${scale_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  scale_pids=()
  # Several instances are one deployment's peers (docs/design/peers.md).
  local peers="" i
  if [ "$1" -gt 1 ]; then
    for i in $(seq 0 $(( $1 - 1 ))); do peers="$peers${peers:+,}http://127.0.0.1:$(( SCALE_PORT + 50 + i ))"; done
  fi
  for i in $(seq 0 $(( $1 - 1 ))); do
    STOCKGATE_PEERS="$peers" STOCKGATE_PEER_URL="${peers:+http://127.0.0.1:$(( SCALE_PORT + 50 + i ))}" \
      STOCKGATE_LISTEN="127.0.0.1:$(( SCALE_PORT + i ))" "$SG" serve >"$work/scale-$i.log" 2>&1 &
    scale_pids+=($!)
  done
  for i in $(seq 0 $(( $1 - 1 ))); do
    wait_healthy "http://127.0.0.1:$(( SCALE_PORT + i ))" || say "instance $i did not answer /healthz within 10 s"
  done
}
for n in 1 2 4; do
  start_instances "$n"
  for r in $(seq "$ROUNDS"); do
    say "$n instance(s), wrk hot SKU at 64 connections in all (round $r)"
    wrks=()
    for i in $(seq 0 $(( n - 1 ))); do
      wrk -t"$(( n == 1 ? 2 : 1 ))" -c"$(( 64 / n ))" -d"${SECS}s" -s bench/wrk/orders.lua \
        "http://127.0.0.1:$(( SCALE_PORT + i ))" -- "$ADMIN" "$HOT" >"$work/scale-$n-$i.txt" &
      wrks+=($!)
    done
    wait "${wrks[@]}"
    record "scale.$n" "$r" "$(LC_ALL=C awk -v n="$(wrk_201 "$work"/scale-"$n"-*.txt)" -v s="$SECS" 'BEGIN { printf "%.0f", n / s }')"
  done
done
for p in "${scale_pids[@]}"; do kill "$p" 2>/dev/null || true; done
scale_pids=()
for r in $(seq "$ROUNDS"); do
  record ratio.scale2 "$r" "$(ratio "$(got scale.2 "$r")" "$(got scale.1 "$r")")"
  record ratio.scale4 "$r" "$(ratio "$(got scale.4 "$r")" "$(got scale.1 "$r")")"
done

# --- RSS at 256 connections ---------------------------------------------------------------
say "wrk hot SKU at 256 connections, sampling the service's RSS"
wrk -t2 -c256 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$HOT" >"$work/hot256.txt" &
wrk256=$!
rss=0
while kill -0 "$wrk256" 2>/dev/null; do
  now="$(awk '/^VmRSS:/ { print $2 }' "/proc/$SVC_PID/status")"
  [ "$now" -le "$rss" ] || rss="$now"
  sleep 0.2
done
rss_mib="$(LC_ALL=C awk -v k="$rss" 'BEGIN { printf "%.1f", k / 1024 }')"
hot256="$(LC_ALL=C awk -v n="$(wrk_201 "$work/hot256.txt")" -v s="$SECS" 'BEGIN { printf "%.0f", n / s }')"

# --- the tables ---------------------------------------------------------------------------
day="$(date +%F)"
out="bench/results/$day.md"
mkdir -p bench/results
{
  echo "## stockgate flash benchmark, $day $(date +%H:%M) UTC"
  echo
  echo "Commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)'), $(nproc) cores, ${SECS} s per step, $ROUNDS rounds; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); orders table: $orders_at_start rows at the start, $(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM orders") at the end; PostgreSQL shared_buffers $(psql "$DATABASE_URL" -Atc "SHOW shared_buffers")."
  echo "Each cell: median of the rounds (min–max). Ratios are taken within a round, then their median."
  echo "\"CPU µs/req\": the answering process's utime + stime ÷ requests it answered."
  echo
  echo "| figure | median (min–max) | p50 ms | p99 ms | CPU µs/req |"
  echo "| --- | --- | --- | --- | --- |"
  for c in 1 8 32 64; do echo "| pgbench guarded UPDATE + INSERT, one order per txn, -c $c, tps | $(fig "pgb.c$c") | | | |"; done
  echo "| pgbench best of the sweep, per round, tps | $(fig pgb.best) | | | |"
  echo "| hot SKU, wrk, 64 connections, confirmed orders/s | $(fig hot.orders) | $(fig hot.p50 1) | $(fig hot.p99 1) | $(fig hot.cpu_us 1) |"
  echo "| hot SKU, loadtest, 64 connections, confirmed orders/s | $(fig lt.hot) | | $(fig lt.hot.p99 1) | |"
  echo "| hot SKU, wrk, 256 connections, confirmed orders/s (one run) | $hot256 | $(wrk_ms "$work/hot256.txt" 50%) | $(wrk_ms "$work/hot256.txt" 99%) | |"
  echo "| availability, wrk, 64 connections, req/s | $(fig avail) | $(fig avail.p50 2) | $(fig avail.p99 1) | $(fig avail.cpu_us 1) |"
  echo "| availability, loadtest, 64 connections, req/s | $(fig lt.avail) | | | |"
  echo "| availability, loadtest: max stale_by_ms | $(fig lt.avail.stale) | | | |"
  echo "| rejections after a sell-out, wrk, 64 connections, req/s | $(fig soldout) | $(fig soldout.p50 1) | $(fig soldout.p99 1) | $(fig soldout.cpu_us 1) |"
  echo "| sell-out: rejections per refusal-claim statement on the primary / order transactions | $(fig soldout.claims 1) / $(fig soldout.txs) | | | |"
  echo "| HTTP ceiling: nginx, same bytes, same wrk, req/s | $(fig nginx) | $(fig nginx.p50 2) | $(fig nginx.p99 1) | $(fig nginx.cpu_us 1) |"
  echo "| pgbench single-row SELECT on replica 1, -c 32, tps | $(fig pgb.select) | | | |"
  echo "| 1 instance, hot SKU, 64 connections, orders/s | $(fig scale.1) | | | |"
  echo "| 2 instances, 32 connections each, orders/s | $(fig scale.2) | | | |"
  echo "| 4 instances, 16 connections each, orders/s | $(fig scale.4) | | | |"
  echo "| service peak RSS during hot SKU at 256 connections | $rss_mib MiB | | | |"
  echo
  echo "Where the two cores went during the wrk steps, % of all CPU time (median of the rounds):"
  echo
  echo "| step | service | primary | replicas | rest (wrk, kernel) | idle |"
  echo "| --- | --- | --- | --- | --- | --- |"
  for step in hot avail; do
    echo "| $step | $(fig "split.$step.service") | $(fig "split.$step.primary") | $(fig "split.$step.replicas") | $(fig "split.$step.rest") | $(fig "split.$step.idle") |"
  done
  echo
  echo "| goal | median (min–max) of the rounds |"
  echo "| --- | --- |"
  echo "| hot SKU orders/s (wrk) ÷ pgbench best, ≥ 6 | $(fig ratio.hot 2) |"
  echo "| hot SKU orders/s (loadtest) ÷ pgbench best | $(fig ratio.lthot 2) |"
  echo "| availability (wrk) ÷ nginx ceiling, ≥ 0.6 | $(fig ratio.ceiling 2) |"
  echo "| availability (wrk) ÷ pgbench replica SELECT -c 32, ≥ 1 | $(fig ratio.select 2) |"
  echo "| availability (loadtest) ÷ pgbench replica SELECT -c 32 | $(fig ratio.ltselect 2) |"
  echo "| 2 instances ÷ 1, ≥ 0.9 | $(fig ratio.scale2 2) |"
  echo "| 4 instances ÷ 1 | $(fig ratio.scale4 2) |"
  echo "| order p99 at 64 connections (wrk), ≤ 15 ms | $(fig hot.p99 1) |"
  echo "| RSS at 256 connections, ≤ 100 MiB | $rss_mib MiB |"
} >"$work/table.md"
cat "$work/table.md" >>"$out"
echo >>"$out"
cat "$work/table.md"
say "appended to $out"
