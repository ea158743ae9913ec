#!/usr/bin/env bash
# bench/ab.sh A B — two stockgate binaries side by side on the hot SKU, in alternating pairs.
#
# Machines of this kind swing several-fold between sessions and by a fair share within one,
# so a change is judged only against the binary before it, measured in the same minutes on
# the same cluster: A, B, A, B, … Each turn starts the binary on its own port against the
# dev cluster (./dev up must have run; the service on 8080 may keep running), loads it with
# `wrk -t2 -c64` posting orders with unique keys on one hot product (bench/wrk/orders.lua),
# and reads, besides wrk's figures, from the binary's own /metrics: the mean batch, and the p99 of an
# order's wait in its product's queue and of one batch's transaction on the primary.
#
# With AB_FRESH=1 every turn runs as a new deployment would: on a database of its own, migrated
# by that turn's binary and never analyzed (autovacuum off on its tables), dropped after the
# turn; so two binaries whose migrations differ are each measured on their own schema. Its
# load is AB_LOAD: `hot` (one product, as above), `spread` (1,000 products, each request one
# at random: the `spread` shape of bench/fresh.sh), `carts` (three-line carts over 20
# products: its `carts` shape) or `availability` (reads of the hot product's availability,
# the stock gate's answer; its column is requests/s, every one a 200).
#
# Each turn also reads the CPU the service's process and the primary (its postmaster and every
# child) spent during the load, from /proc, per confirmed order (or answered read): unlike
# orders/s these barely move with what else the host runs. The primary's share is split by
# process kind (client backends, WAL senders, …) under the table, and `orders a transaction`
# (confirmed orders over stockgate_order_transactions_total) says how many orders each
# statement's fixed cost was spread over.
#
# Prints a table (one row a turn, then the medians of each side) and appends it to
# bench/results/ab-<YYYY-MM-DD>.md.
#
# Environment: PAIRS (default 3), BENCH_SECONDS (per turn, default 6), AB_PORT (default
# 18280), STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (as for ./dev), AB_FRESH, AB_LOAD (hot),
# AB_NOTE (a line for the file), AB_LOCATIONS / AB_LOCATIONS_B (with AB_FRESH: each product's
# stock spread over that many locations, for both sides or for B only; a binary with
# locations only).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

[ $# -eq 2 ] || { echo "usage: bench/ab.sh BINARY_A BINARY_B" >&2; exit 2; }
A="$1" B="$2"
for bin in "$A" "$B"; do [ -x "$bin" ] || { echo "ab.sh: $bin is not an executable" >&2; exit 1; }; done
PAIRS="${PAIRS:-3}"
SECS="${BENCH_SECONDS:-6}"
PORT="${AB_PORT:-18280}"
command -v wrk >/dev/null || { echo "ab.sh: wrk is missing (apt-get install wrk)" >&2; exit 1; }

dev_cluster_env
export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret)}"
export STOCKGATE_LISTEN="127.0.0.1:$PORT"
ADMIN="$(./dev token --admin)"
BASE_URL="${DATABASE_URL%/*}" REPLICAS="$STOCKGATE_REPLICA_URLS"
LOAD="${AB_LOAD:-hot}"
order_load "${LOAD/availability/hot}" || { echo "ab.sh: AB_LOAD is hot, spread, carts or availability" >&2; exit 2; }
[ -n "${AB_FRESH:-}" ] || [ "$LOAD" = hot ] || [ "$LOAD" = availability ] || { echo "ab.sh: AB_LOAD=$LOAD needs AB_FRESH=1" >&2; exit 2; }
[ -n "${AB_FRESH:-}" ] || psql "$DATABASE_URL" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity)
  VALUES ('$HOT', 'ab hot row', 100, 2000000000)
  ON CONFLICT (product_id) DO UPDATE SET available_quantity = 2000000000"

work="$(mktemp -d)"
pid=""
db=""
cleanup() {
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  [ -z "$db" ] || psql "$BASE_URL/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

URL="http://$STOCKGATE_LISTEN"

# spread_over_locations DB N: moves every product's stock from `default` to N new locations
# ranked before it (loc-1 first), a share each (a binary with locations only).
spread_over_locations() {
  psql "$1" -q -v ON_ERROR_STOP=1 <<SQL
SET stockgate.levels = 'on';
INSERT INTO locations (location_id, name, rank) SELECT 'loc-' || g, 'bench ' || g, g FROM generate_series(1, $2) g;
INSERT INTO stock_levels (product_id, location_id, available_quantity)
  SELECT s.product_id, 'loc-' || g, s.available_quantity / $2
    FROM stock_levels s, generate_series(1, $2) g WHERE s.location_id = 'default';
UPDATE stock_levels SET available_quantity = 0 WHERE location_id = 'default';
UPDATE products p SET available_quantity = (SELECT sum(available_quantity) FROM stock_levels s WHERE s.product_id = p.product_id);
SQL
}

# turn SIDE BINARY: one measured run; appends "side orders/s p50 p99 batch queue-p99
# batch-p99 service-us primary-us" to $work/rows (queue-p99 and batch-p99 "-" for a binary
# without those histograms; the last two: CPU per order)
turn() {
  local env=()
  if [ -n "${AB_FRESH:-}" ]; then
    db="ab_$(date -u +%H%M%S)_${1,,}"
    BIN="$2" new_unanalyzed_db "$db"
    psql "$BASE_URL/$db" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) $products"
    local spread="${AB_LOCATIONS:-}"
    [ "$1" = B ] && [ -n "${AB_LOCATIONS_B:-}" ] && spread="$AB_LOCATIONS_B"
    [ -z "$spread" ] || spread_over_locations "$BASE_URL/$db" "$spread"
    env=(DATABASE_URL="$BASE_URL/$db" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$db")")
  fi
  env "${env[@]}" "$2" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "ab.sh: $2 did not start" >&2; exit 1; }
  local svc0 pg0 svc1 pg1
  svc0="$(cpu_ticks "$pid")" pg0="$(node_ticks primary)"
  node_ticks_by_pid primary >"$work/kinds0"
  if [ "$LOAD" = availability ]; then
    wrk -t2 -c64 -d"${SECS}s" --latency "$URL/v1/products/$HOT/availability" >"$work/wrk.txt"
    ! grep -q 'Non-2xx' "$work/wrk.txt" || { cat "$work/wrk.txt" >&2; echo "ab.sh: an availability read failed" >&2; exit 1; }
  else
    wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "${args[@]}" >"$work/wrk.txt"
  fi
  svc1="$(cpu_ticks "$pid")" pg1="$(node_ticks primary)"
  node_ticks_by_pid primary >"$work/kinds1"
  local sum count queue batch txns
  sum="$(metric_at "$URL" stockgate_order_batch_size_sum)" count="$(metric_at "$URL" stockgate_order_batch_size_count)"
  queue="$(quantile_ms "$URL" stockgate_order_queue_seconds 0.99)" batch="$(quantile_ms "$URL" stockgate_order_batch_seconds 0.99)"
  txns="$(metric_at "$URL" stockgate_order_transactions_total)"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  if [ -n "$db" ]; then psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null; db=""; fi
  LC_ALL=C awk -v side="$1" -v s="$SECS" -v sum="$sum" -v count="$count" -v queue="$queue" -v batch="$batch" -v txns="${txns:-0}" \
    -v p50="$(wrk_ms "$work/wrk.txt" 50%)" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" \
    -v svc="$(( (svc1 - svc0) * TICK_US ))" -v pg="$(( (pg1 - pg0) * TICK_US ))" -v shape="$LOAD" \
    '/^status 201:/ { ok += $3 } shape == "availability" && /requests in/ { ok += $1 } END { printf "%s %.0f %.2f %.2f %.1f %s %s %.1f %.1f %.1f\n", side, ok / s, p50, p99, (count > 0 ? sum / count : 0), queue, batch, (ok > 0 ? svc / ok : 0), (ok > 0 ? pg / ok : 0), (txns > 0 ? ok / txns : 0) }' \
    "$work/wrk.txt" >>"$work/rows"
  echo "$1 $(ticks_by_kind "$work/kinds0" "$work/kinds1")" >>"$work/kinds"
  tail -1 "$work/rows" >&2
}

for p in $(seq "$PAIRS"); do
  echo "pair $p of $PAIRS" >&2
  turn A "$A"
  turn B "$B"
done

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): A = $A, B = $B"
  [ -z "${AB_NOTE:-}" ] || echo "$AB_NOTE"
  echo
  echo "wrk -t2 -c64, ${SECS} s a turn, $PAIRS alternating pairs, load $LOAD with unique keys$([ -z "${AB_FRESH:-}" ] || echo ", a new never-analyzed database a turn, migrated by its binary"); load average $(cut -d' ' -f1-3 /proc/loadavg); $(host_line "${STOCKGATE_DEV_DIR:-/tmp/stockgate-dev}")."
  echo
  echo "| turn | orders/s | p50 ms | p99 ms | mean batch | p99 ms in the queue | p99 ms of a batch's transaction | service CPU µs/order | primary CPU µs/order | orders a transaction |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 }' "$work/rows"
  for side in A B; do
    printf '| median %s |' "$side"
    for col in 2 3 4 5 6 7 8 9 10; do printf ' %s |' "$(awk -v s="$side" -v c="$col" '$1 == s { print $c }' "$work/rows" | median)"; done
    echo
  done
  echo
  echo "The primary's CPU by process kind, µs per confirmed order, a turn a line (from the process titles; a process that ended during the turn is missing):"
  echo
  paste -d' ' "$work/kinds" <(awk '{ print $2 * '"$SECS"' }' "$work/rows") \
    | LC_ALL=C awk -v us="$TICK_US" '{ printf "- %s:", $1; for (i = 2; i < NF; i++) { split($i, kv, "="); if (kv[2] > 0) printf " %s %.1f", kv[1], kv[2] * us / $NF } print "" }'
} | tee -a "bench/results/ab-$(date -u +%F).md"
