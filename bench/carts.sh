#!/usr/bin/env bash
# bench/carts.sh — three-line carts over 20 products, the service against raw PostgreSQL
# running the same cart transaction with its locks in the shared product order.
#
# Each round makes a database of its own on the dev cluster (./dev up, or the cluster up, must
# have run), migrated and never analyzed (autovacuum off on its tables), with 20 products
# `cart-1` … `cart-20` of 10^8 units. Then, in an order that alternates from round to round:
#   - pgbench, -j2, at -c8, -c32 and -c64 (the best counts): three distinct random products,
#     their rows locked in byte order (`ORDER BY product_id COLLATE "C" FOR NO KEY UPDATE`, the
#     lock order every transaction of the service shares), one guarded UPDATE of the three,
#     the cart's order row and its three lines, COMMIT;
#   - a fresh `stockgate serve` under `wrk -t2 -c64`, each request a cart of three distinct
#     random products, one unit each, by a fresh buyer and key (bench/wrk/orders.lua with
#     LINES 3).
# Prints per round the service's carts/s and p99, pgbench's best tps and their ratio; then the
# medians with min–max; appends it all to bench/results/carts-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per run, 8), CARTS_PORT (18397), STOCKGATE_BIN
# (target/release/stockgate), CARTS_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup carts "${CARTS_PORT:-18397}" pgbench

cat >"$work/cart.sql" <<'SQL'
BEGIN;
WITH picked AS (
  SELECT 'cart-' || g AS id FROM generate_series(1, 20) g ORDER BY random() LIMIT 3
), locked AS (
  SELECT p.product_id, p.price_cents FROM products p WHERE p.product_id IN (SELECT id FROM picked)
   ORDER BY p.product_id COLLATE "C" FOR NO KEY UPDATE
), took AS (
  UPDATE products p SET available_quantity = p.available_quantity - 1, updated_at = clock_timestamp()
    FROM locked l WHERE p.product_id = l.product_id AND p.available_quantity >= 1
  RETURNING p.product_id, p.price_cents
), o AS (
  INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
  SELECT gen_random_uuid(), NULL, 'pgb-' || :client_id, NULL, 0, (SELECT sum(price_cents) FROM took), 'confirmed', md5(random()::text), 'cart'
  RETURNING order_id
)
INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents)
SELECT o.order_id, took.product_id, 1, took.price_cents FROM o, took;
COMMIT;
SQL

fresh() {
  local db="carts_${stamp}_$1"
  new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -q >/dev/null <<SQL
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
  SELECT 'cart-' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, 20) g;
SQL
  echo "$db"
}

service() {
  DATABASE_URL="$BASE_URL/$1" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$1")" \
    "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "carts.sh: the service did not start" >&2; exit 1; }
  wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" cart- 20 3 >"$work/wrk.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  grep -E '^status' "$work/wrk.txt" >&2 || true
  LC_ALL=C awk -v s="$SECS" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" '
    /^status 201:/ { ok += $3 } END { printf "%.0f %.2f\n", ok / s, p99 }' "$work/wrk.txt"
}

for r in $(seq "$ROUNDS"); do
  db="$(fresh "$r")"
  if [ $((r % 2)) = 1 ]; then
    svc="$(service "$db")"; best="$(pgbench_best "$db" "$work/cart.sql" "$SECS")"
  else
    best="$(pgbench_best "$db" "$work/cart.sql" "$SECS")"; svc="$(service "$db")"
  fi
  echo "$r $svc $best" | awk '{ printf "%s %s %s %s %.2f\n", $1, $2, $3, $4, ($4 > 0 ? $2 / $4 : 0) }' | tee -a "$work/rows" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
done

col() { awk -v c="$1" '{ print $c }' "$work/rows"; }
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, three-line carts over 20 products, a new never-analyzed database per round"
  [ -z "${CARTS_NOTE:-}" ] || echo "$CARTS_NOTE"
  echo
  echo "wrk -t2 -c64 against the service and pgbench -j2 at -c8/-c32/-c64 (best) with the same cart transaction (locks in byte order), ${SECS} s each, $ROUNDS rounds, order alternating; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| round | service carts/s | p99 ms | pgbench best tps | service ÷ pgbench |"
  echo "| --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$work/rows"
  echo
  printf '**Median:** service %s carts/s (%s), p99 %s ms (%s), pgbench best %s tps (%s), ratio %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 3 | range)" \
    "$(col 4 | median)" "$(col 4 | range)" "$(col 5 | median)" "$(col 5 | range)"
} | tee -a "bench/results/carts-$(date -u +%F).md"
