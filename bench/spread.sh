#!/usr/bin/env bash
# bench/spread.sh — a normal day's shape: orders spread over 1,000 products, the service
# against raw PostgreSQL running the same one-order transaction over the same rows.
#
# Each round makes a database of its own on the dev cluster (./dev up, or the cluster up, must
# have run), migrated and never analyzed (autovacuum off on its tables), with 1,000 products
# `spread-1` … `spread-1000` of 10^8 units. Then, in an order that rotates from round to
# round:
#   - pgbench, -j2, at -c8, -c32 and -c64 (the best counts): a random product, its guarded
#     UPDATE … WHERE available_quantity >= 1, the order's INSERT, COMMIT;
#   - a fresh `stockgate serve` under `wrk -t2 -c64`, each request a random product and a
#     fresh buyer and key (bench/wrk/orders.lua).
# Prints per round the service's orders/s and p99, pgbench's best tps, their ratio, and the
# primary transactions per order the service ran (`stockgate_order_transactions_total`); then
# the medians with min–max; appends it all to bench/results/spread-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per run, 8), SPREAD_PORT (18396), STOCKGATE_BIN
# (target/release/stockgate), SPREAD_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup spread "${SPREAD_PORT:-18396}" pgbench

cat >"$work/order.sql" <<'SQL'
\set p random(1, 1000)
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1, updated_at = clock_timestamp()
 WHERE product_id = 'spread-' || :p AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
 VALUES (gen_random_uuid(), 'spread-' || :p, 'pgb-' || :client_id, 1, 100, 100, 'confirmed', md5(random()::text), 'spread:1');
COMMIT;
SQL

fresh() {
  local db="spread_${stamp}_$1"
  new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -q >/dev/null <<SQL
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
  SELECT 'spread-' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, 1000) g;
SQL
  echo "$db"
}


service() {
  DATABASE_URL="$BASE_URL/$1" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$1")" \
    "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "spread.sh: the service did not start" >&2; exit 1; }
  local before after
  before="$(metric_at "$URL" stockgate_order_transactions_total)"
  wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" spread- 1000 >"$work/wrk.txt"
  after="$(metric_at "$URL" stockgate_order_transactions_total)"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  LC_ALL=C awk -v s="$SECS" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" -v tx="$((after - before))" '
    /^status 201:/ { ok += $3 } END { printf "%.0f %.2f %.3f\n", ok / s, p99, (ok > 0 ? tx / ok : 0) }' "$work/wrk.txt"
}

for r in $(seq "$ROUNDS"); do
  db="$(fresh "$r")"
  if [ $((r % 2)) = 1 ]; then
    svc="$(service "$db")"; best="$(pgbench_best "$db" "$work/order.sql" "$SECS")"
  else
    best="$(pgbench_best "$db" "$work/order.sql" "$SECS")"; svc="$(service "$db")"
  fi
  echo "$r $svc $best" | awk '{ printf "%s %s %s %s %s %.2f\n", $1, $2, $3, $4, $5, ($5 > 0 ? $2 / $5 : 0) }' | tee -a "$work/rows" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
done

col() { awk -v c="$1" '{ print $c }' "$work/rows"; }
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, 1,000 products, a new never-analyzed database per round"
  [ -z "${SPREAD_NOTE:-}" ] || echo "$SPREAD_NOTE"
  echo
  echo "wrk -t2 -c64 against the service and pgbench -j2 at -c8/-c32/-c64 (best) with the same one-order transaction, ${SECS} s each, $ROUNDS rounds, order alternating; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| round | service orders/s | p99 ms | order transactions per order | pgbench best tps | service ÷ pgbench |"
  echo "| --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6 }' "$work/rows"
  echo
  printf '**Median:** service %s orders/s (%s), p99 %s ms (%s), pgbench best %s tps (%s), ratio %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 3 | range)" \
    "$(col 5 | median)" "$(col 5 | range)" "$(col 6 | median)" "$(col 6 | range)"
} | tee -a "bench/results/spread-$(date -u +%F).md"
