#!/usr/bin/env bash
# bench/latency.sh — how fast the service reacts to a replica fault and to another instance's
# restock. These were once bounds asserted in tests (issue #26 moved speed targets out of the
# suite); here they are figures, measured on the dev cluster (./dev up must have run, or
# `target/release/devcluster up`) with the release binary on ports of its own.
#
#   1. the stock gate leaving a paused replica: writes flow (so the paused replica falls
#      behind), replica-1 is shown answering the gate, then paused, and availability is
#      polled; the figure is how long after the pause replica-1 last answered the gate (the
#      budget is 250 ms, and the monitor samples every 25 ms);
#   2. a restock on instance A seen by instance B: B answers "sold out" from its gate, A
#      restocks, and B is polled until it says available (the gate's budget is 250 ms);
#   3. reads with replica 1 frozen (SIGSTOP: it still accepts TCP): the slowest of 40 product
#      page reads right after the freeze (the replica timeout is 500 ms);
#   4. a settings write with the primary stopped: how long until its 503 (the primary
#      timeout is 2 s; the monitor makes later ones fail fast), then the primary is started
#      again and the service is shown answering writes.
#
# ROUNDS rounds (default 5); prints the median and max of each, and appends them to
# bench/results/latency-<YYYY-MM-DD>.md. Needs curl and jq.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${ROUNDS:-5}"
BIN="${STOCKGATE_BIN:-target/release/stockgate}"
DC=target/release/devcluster
PORT_A="${LATENCY_PORT:-18480}"
PORT_B=$((PORT_A + 1))
for tool in curl jq; do command -v "$tool" >/dev/null || { echo "latency.sh: $tool is missing" >&2; exit 1; }; done
[ -x "$BIN" ] && [ -x "$DC" ] || { echo "latency.sh: build first (cargo build --release -p stockgate -p devcluster)" >&2; exit 1; }

eval "$($DC env | grep -E '^(DATABASE_URL|STOCKGATE_REPLICA_URLS|STOCKGATE_REDIS_URL)=' | sed 's/^/export /')"
export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret)}"
ADMIN="$("$BIN" token --admin)"
A="http://127.0.0.1:$PORT_A" B="http://127.0.0.1:$PORT_B"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  "$DC" resume 1 >/dev/null 2>&1 || true
  "$DC" thaw 1 >/dev/null 2>&1 || true
}
trap cleanup EXIT
for port in "$PORT_A" "$PORT_B"; do
  STOCKGATE_LISTEN="127.0.0.1:$port" "$BIN" serve >/dev/null 2>&1 &
  pids+=($!)
done
for url in "$A" "$B"; do
  for _ in $(seq 100); do curl -fsS -o /dev/null "$url/healthz" 2>/dev/null && break; sleep 0.1; done
done

now_ms() { date +%s%3N; }
product() { # product ID STOCK
  curl -fsS -o /dev/null -X POST "$A/v1/products" -H "Authorization: Bearer $ADMIN" \
    -H 'Content-Type: application/json' \
    -d "{\"product_id\":\"$1\",\"name\":\"latency\",\"price_cents\":100,\"available_quantity\":$2}"
}
avail() { curl -fsS "$1/v1/products/$2/availability"; }

work="$(mktemp -d)"
for r in $(seq "$ROUNDS"); do
  tag="lat-$(date +%s)-$r"

  # 1. The gate leaving a paused replica, while another product's restocks move the WAL on
  #    (so the paused replica falls behind; the gate's product itself is not written, so its
  #    answers come from the replicas, not from the order path's cache).
  product "$tag-g" 1000
  product "$tag-w" 0
  ( while :; do
      curl -fsS -o /dev/null -X POST "$A/v1/products/$tag-w/restock" -H "Authorization: Bearer $ADMIN" \
        -H 'Content-Type: application/json' -d '{"quantity":1}' || true
      sleep 0.01
    done ) &
  writer=$!
  # Precondition: replica-1 answers the gate before the pause.
  t=$(now_ms)
  until [ "$(avail "$A" "$tag-g" | jq -r .served_by)" = replica-1 ]; do
    [ $(( $(now_ms) - t )) -lt 5000 ] || { echo "latency.sh: replica-1 never answered the gate" >&2; exit 1; }
  done
  "$DC" pause 1 >/dev/null
  paused=$(now_ms) last=$paused
  while [ $(( $(now_ms) - paused )) -lt 2000 ]; do
    [ "$(avail "$A" "$tag-g" | jq -r .served_by)" = replica-1 ] && last=$(now_ms)
  done
  "$DC" resume 1 >/dev/null
  kill "$writer" 2>/dev/null; wait "$writer" 2>/dev/null || true
  echo "gate_left_paused_ms $((last - paused))" >>"$work/rows"

  # 2. A's restock seen by B.
  product "$tag-r" 0
  avail "$B" "$tag-r" >/dev/null
  t=$(now_ms)
  curl -fsS -o /dev/null -X POST "$A/v1/products/$tag-r/restock" -H "Authorization: Bearer $ADMIN" \
    -H 'Content-Type: application/json' -d '{"quantity":5}'
  until [ "$(avail "$B" "$tag-r" | jq -r .available)" = true ]; do :; done
  echo "restock_seen_by_b_ms $(( $(now_ms) - t ))" >>"$work/rows"

  # 3. Product page reads with replica 1 frozen.
  "$DC" freeze 1 >/dev/null
  worst=0
  for _ in $(seq 40); do
    t=$(now_ms); curl -fsS -o /dev/null "$A/v1/products/$tag-r"; d=$(( $(now_ms) - t ))
    [ "$d" -gt "$worst" ] && worst=$d
  done
  "$DC" thaw 1 >/dev/null
  echo "worst_read_frozen_replica_ms $worst" >>"$work/rows"

  # 4. A write with the primary stopped.
  USER_TOKEN="$("$BIN" token --user latency)"
  put() { curl -s -o /dev/null -w '%{http_code}' -X PUT "$A/v1/users/latency/settings" \
    -H "Authorization: Bearer $USER_TOKEN" -H 'Content-Type: application/json' -d '{"settings":{"r":1}}'; }
  "$DC" stop-primary >/dev/null
  t=$(now_ms); code=$(put); d=$(( $(now_ms) - t ))
  [ "$code" = 503 ] || { echo "latency.sh: a write with the primary stopped got $code" >&2; exit 1; }
  echo "write_503_primary_down_ms $d" >>"$work/rows"
  "$DC" start-primary >/dev/null
  t=$(now_ms)
  until [ "$(put)" = 200 ]; do
    [ $(( $(now_ms) - t )) -lt 30000 ] || { echo "latency.sh: writes did not come back" >&2; exit 1; }
    sleep 0.1
  done
  tail -4 "$work/rows" >&2
  sleep 1
done

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, $ROUNDS rounds, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "| figure | median ms | max ms | per round |"
  echo "| --- | --- | --- | --- |"
  for f in gate_left_paused_ms restock_seen_by_b_ms worst_read_frozen_replica_ms write_503_primary_down_ms; do
    vals="$(awk -v f="$f" '$1 == f { print $2 }' "$work/rows" | sort -n)"
    med="$(echo "$vals" | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
    printf '| %s | %s | %s | %s |\n' "$f" "$med" "$(echo "$vals" | tail -1)" "$(echo "$vals" | tr '\n' ' ')"
  done
} | tee -a "bench/results/latency-$(date -u +%F).md"
rm -rf "$work"
