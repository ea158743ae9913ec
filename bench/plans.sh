#!/usr/bin/env bash
# bench/plans.sh — one hot product on tables that were never analyzed, at 0, 100k and 1M rows.
#
# A new deployment's `orders` has no statistics until autovacuum gets to it, and the order
# batch's plans are cached per connection. This measures whether the speed depends on that:
# for each size a database of its own on the dev cluster (./dev up must have run), migrated,
# `orders` filled with that many confirmed rows of other products by SQL, autovacuum off on
# every table so nothing analyzes them (checked at the end: no table of the run has
# statistics), then a fresh `stockgate serve` on it and `wrk -t2 -c64` posting orders with
# fresh keys on one hot product (bench/wrk/orders.lua). At 0 rows the table starts empty and
# grows during the run: the case where a plan made on an empty table is kept.
#
# Sizes alternate within each round, ROUNDS rounds (default 3); prints the median orders/s
# and p99 per size with min–max, the ratio of each size to 0 rows, and appends it all to
# bench/results/plans-<YYYY-MM-DD>.md.
#
# PLANS_RESET_FUNCTION=1 resets the batch function's planner settings after migrating (as
# before migration 20261202000002): the same binary with the plans main had, for a side by
# side.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per turn, 8), SIZES ("0 100000 1000000"),
# PLANS_PORT (18380), STOCKGATE_BIN (target/release/stockgate), STOCKGATE_DEV_DIR /
# STOCKGATE_DEV_PORT (as for ./dev), PLANS_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

ROUNDS="${ROUNDS:-3}"
SECS="${BENCH_SECONDS:-8}"
SIZES="${SIZES:-0 100000 1000000}"
PORT="${PLANS_PORT:-18380}"
BIN="${STOCKGATE_BIN:-target/release/stockgate}"
command -v wrk >/dev/null || { echo "plans.sh: wrk is missing (apt-get install wrk)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "plans.sh: $BIN is missing (cargo build --release)" >&2; exit 1; }

bench_service_env "$PORT"
HOT=plans-hot
stamp="$(date -u +%H%M%S)"

work="$(mktemp -d)"
pid=""
cleanup() { [ -z "$pid" ] || kill "$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

db_of() { echo "plans_${stamp}_$1"; }

# fresh SIZE ROUND: a new database for this size, migrated and filled, never analyzed
fresh() {
  local db; db="$(db_of "$1")_$2"
  new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -q >/dev/null <<SQL
$( [ "${PLANS_RESET_FUNCTION:-}" = 1 ] && echo "ALTER FUNCTION take_order_batch(text, uuid[], text[], text[], integer[], text[]) RESET ALL;" )
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
  VALUES ('$HOT', 'hot', 100, 2000000000, 2000000000), ('plans-filler', 'filler', 100, 0, 0);
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, created_at)
  SELECT (lpad(to_hex(1700000000000000 + g), 14, '0') || substr(md5(g::text), 1, 18))::uuid,
         'plans-filler', 'filler-' || (g % 5000), 1, 100, 100, 'confirmed', 'f-' || g, 'plans-filler:1',
         now() - interval '1 day'
    FROM generate_series(1, $1) g;
SQL
  echo "$db"
}

# turn SIZE DB: one measured run against DB; appends "size orders/s p99 rows-after analyzed"
turn() {
  DATABASE_URL="$BASE_URL/$2" \
    STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$2")" \
    "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "plans.sh: the service did not start" >&2; exit 1; }
  wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "$HOT" >"$work/wrk.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  local rows analyzed
  rows="$(psql "$BASE_URL/$2" -Atc "SELECT count(*) FROM orders")"
  analyzed="$(psql "$BASE_URL/$2" -Atc "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL")"
  LC_ALL=C awk -v size="$1" -v s="$SECS" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" -v rows="$rows" -v an="$analyzed" \
    '/^status 201:/ { ok += $3 } END { printf "%s %.0f %.2f %s %s\n", size, ok / s, p99, rows, an }' \
    "$work/wrk.txt" >>"$work/rows"
  tail -1 "$work/rows" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $2 WITH (FORCE)" >/dev/null
}

for r in $(seq "$ROUNDS"); do
  for size in $SIZES; do
    echo "round $r of $ROUNDS: $size rows" >&2
    db="$(fresh "$size" "$r")"
    turn "$size" "$db"
  done
done

base="$(awk '$1 == 0 { print $2 }' "$work/rows" | median)"
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, never-analyzed tables$( [ "${PLANS_RESET_FUNCTION:-}" = 1 ] && echo ', batch function settings reset (as before #31)' )"
  [ -z "${PLANS_NOTE:-}" ] || echo "$PLANS_NOTE"
  echo
  echo "wrk -t2 -c64, ${SECS} s a turn, $ROUNDS rounds with the sizes alternating, one hot product, fresh keys; a database per turn, autovacuum off on its tables; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| turn (rows before) | orders/s | p99 ms | rows after | tables analyzed |"
  echo "| --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$work/rows"
  echo
  echo "| rows before | orders/s, median (min–max) | ÷ 0 rows | p99 ms, median (min–max) |"
  echo "| --- | --- | --- | --- |"
  for size in $SIZES; do
    m="$(awk -v z="$size" '$1 == z { print $2 }' "$work/rows" | median)"
    printf '| %s | %s (%s) | %s | %s (%s) |\n' "$size" "$m" \
      "$(awk -v z="$size" '$1 == z { print $2 }' "$work/rows" | range)" \
      "$(awk -v a="$m" -v b="$base" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')" \
      "$(awk -v z="$size" '$1 == z { print $3 }' "$work/rows" | median)" \
      "$(awk -v z="$size" '$1 == z { print $3 }' "$work/rows" | range)"
  done
} | tee -a "bench/results/plans-$(date -u +%F).md"
