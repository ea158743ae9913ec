#!/usr/bin/env bash
# bench/events.sh — the hot SKU with the event feed's triggers on and off, side by side.
#
# One stockgate binary, one dev cluster (./dev up, or ./dev cluster up and a migrated
# database); turns alternate ON, OFF, ON, OFF, … where OFF disables the orders triggers that
# write `order.confirmed` (so a batch writes no events) and ON enables them. Each turn starts
# the binary, loads it with `wrk -t2 -c64` posting orders with unique keys on one hot product
# (bench/wrk/orders.lua), and, during ON turns, keeps one long-poll reader following the feed
# (`GET /v1/events?wait_ms=1000`) and samples the feed's lag — the age of the newest servable
# event behind the newest written (`stockgate_event_feed_lag_seconds`) — every 200 ms.
#
# Prints a table (one row a turn, then the medians of each side and the ratio ON/OFF) and
# appends it to bench/results/events-<YYYY-MM-DD>.md.
#
# Environment: EV_READER=0 (no long-poll reader), PAIRS (default 3), BENCH_SECONDS (per turn,
# default 8), EV_PORT (default 18290), STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (as for ./dev).
# For a fresh deployment, drop and recreate the `stockgate` database first; the script
# migrates it and says how many rows it held and whether it was ever analyzed.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

BIN="${1:-target/release/stockgate}"
[ -x "$BIN" ] || { echo "events.sh: $BIN is not an executable (cargo build --release)" >&2; exit 1; }
PAIRS="${PAIRS:-3}"
SECS="${BENCH_SECONDS:-8}"
PORT="${EV_PORT:-18290}"
command -v wrk >/dev/null || { echo "events.sh: wrk is missing (apt-get install wrk)" >&2; exit 1; }

dev_cluster_env
export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret)}"
export STOCKGATE_LISTEN="127.0.0.1:$PORT"
"$BIN" migrate >/dev/null
ADMIN="$(./dev token --admin)"
HOT=ev-hot
psql "$DATABASE_URL" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity)
  VALUES ('$HOT', 'events hot row', 100, 2000000000)
  ON CONFLICT (product_id) DO UPDATE SET available_quantity = 2000000000"
events_rows() { psql "$DATABASE_URL" -Atc "SELECT count(*) FROM events"; }

work="$(mktemp -d)"
pid="" reader=""
cleanup() {
  [ -z "$reader" ] || kill "$reader" 2>/dev/null || true
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  psql "$DATABASE_URL" -qc "ALTER TABLE orders ENABLE TRIGGER events_orders_inserted" || true
  rm -rf "$work"
}
trap cleanup EXIT
URL="http://$STOCKGATE_LISTEN"

# follow: a long-poll reader of the feed from its newest event, until killed.
follow() {
  local after
  after="$(curl -fsS -H "Authorization: Bearer $ADMIN" "$URL/v1/events?limit=1000" | sed -E 's/.*"next":"([^"]*)".*/\1/')"
  while :; do
    after="$(curl -fsS -H "Authorization: Bearer $ADMIN" "$URL/v1/events?after=$after&limit=1000&wait_ms=1000" \
      | sed -E 's/.*"next":"([^"]*)".*/\1/')" || sleep 0.2
  done
}

# turn SIDE: one measured run; appends "side orders/s p50 p99 events lag-median-ms lag-max-ms"
turn() {
  local state=ENABLE
  [ "$1" = ON ] || state=DISABLE
  psql "$DATABASE_URL" -qc "ALTER TABLE orders $state TRIGGER events_orders_inserted"
  "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "events.sh: $BIN did not start" >&2; exit 1; }
  local before; before="$(events_rows)"
  : >"$work/lag"
  if [ "$1" = ON ] && [ "${EV_READER:-1}" = 1 ]; then follow & reader=$!; fi
  wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "$HOT" >"$work/wrk.txt" &
  local load=$!
  while kill -0 "$load" 2>/dev/null; do
    metric_at "$URL" stockgate_event_feed_lag_seconds >>"$work/lag" || true
    sleep 0.2
  done
  wait "$load"
  [ -z "$reader" ] || { kill "$reader" 2>/dev/null || true; wait "$reader" 2>/dev/null || true; reader=""; }
  local written=$(( $(events_rows) - before ))
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  local lag_med lag_max
  lag_med="$(awk '{ print $1 * 1000 }' "$work/lag" | sort -g | awk '{ v[NR] = $1 } END { print NR ? v[int((NR + 1) / 2)] : "-" }')"
  lag_max="$(awk '{ print $1 * 1000 }' "$work/lag" | sort -g | tail -1)"
  LC_ALL=C awk -v side="$1" -v s="$SECS" -v ev="$written" -v lm="${lag_med:--}" -v lx="${lag_max:--}" \
    -v p50="$(wrk_ms "$work/wrk.txt" 50%)" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" \
    '/^status 201:/ { ok += $3 } END { printf "%s %.0f %.2f %.2f %d %s %s\n", side, ok / s, p50, p99, ev, lm, lx }' \
    "$work/wrk.txt" >>"$work/rows"
  tail -1 "$work/rows" >&2
}

for p in $(seq "$PAIRS"); do
  echo "pair $p of $PAIRS" >&2
  turn ON
  turn OFF
done

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): events on and off, $BIN ($(git rev-parse --short HEAD))"
  echo
  echo "wrk -t2 -c64, ${SECS} s a turn, $PAIRS alternating pairs, hot SKU with unique keys; $([ "${EV_READER:-1}" = 1 ] && echo "one long-poll reader during ON turns" || echo "no reader"); the database held $(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM orders") orders and $(events_rows) event rows at the end (analyzed: $(psql "$DATABASE_URL" -Atc "SELECT coalesce(max(greatest(last_analyze, last_autoanalyze))::text, 'never') FROM pg_stat_user_tables WHERE relname IN ('orders', 'events')")); load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| turn | orders/s | p50 ms | p99 ms | events written | feed lag median ms | feed lag max ms |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7 }' "$work/rows"
  for side in ON OFF; do
    printf '| median %s |' "$side"
    for col in 2 3 4 5 6 7; do printf ' %s |' "$(awk -v s="$side" -v c="$col" '$1 == s { print $c }' "$work/rows" | median)"; done
    echo
  done
  on="$(awk '$1 == "ON" { print $2 }' "$work/rows" | median)" off="$(awk '$1 == "OFF" { print $2 }' "$work/rows" | median)"
  echo
  echo "orders/s with events ÷ without (medians): $(awk -v a="$on" -v b="$off" 'BEGIN { printf "%.2f", a / b }')"
} | tee -a "bench/results/events-$(date -u +%F).md"
