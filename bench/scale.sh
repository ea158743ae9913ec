#!/usr/bin/env bash
# bench/scale.sh — one hot product on a fresh deployment: one, two and four instances at the
# same total connections, and pgbench's best on the same row, side by side in every round.
#
# Each round makes a database of its own on the dev cluster (./dev up, or the cluster up, must
# have run), migrated and never analyzed (autovacuum off on its tables), with one product of
# 10^8 units. Then, in an order that rotates from round to round:
#   - pgbench -j2 at -c8, -c32, -c64 (best): the guarded UPDATE … WHERE available_quantity >= 1
#     of that row, the order's INSERT, COMMIT;
#   - 1, 2 and 4 `stockgate serve` instances (same binary, database and replicas), loaded by
#     one `wrk -t1` per instance with 64 / N connections each (64 in total); every request a
#     new buyer and key (bench/wrk/orders.lua).
# Prints per round orders/s and p99 (the worst instance's) for each count, pgbench's best, and
# the ratios 2 ÷ 1, 4 ÷ 1 and 1 ÷ pgbench; then medians with min–max; appends it all to
# bench/results/scale-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per run, 8), SCALE_PORT (first port, 18400),
# STOCKGATE_BIN (target/release/stockgate), SCALE_PEERS (1: two and four instances are one
# deployment's peers, STOCKGATE_PEERS on ports SCALE_PORT+50…; 0: each on its own), SCALE_NOTE
# (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

PEERS="${SCALE_PEERS:-1}"
bench_setup scale "${SCALE_PORT:-18400}" pgbench

cat >"$work/order.sql" <<'SQL'
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1, updated_at = clock_timestamp()
 WHERE product_id = 'hot' AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
 VALUES (gen_random_uuid(), 'hot', 'pgb-' || :client_id, 1, 100, 100, 'confirmed', md5(random()::text), 'hot:1');
COMMIT;
SQL

# instances DB N: orders/s of N instances at 64/N connections each, and the worst p99 (ms)
instances() {
  start_instances "$1" "$2" "$PEERS"
  load_instances "$2"
  stop_instances
}

for r in $(seq "$ROUNDS"); do
  db="scale_${stamp}_$r"
  hot_product_db "$db"
  declare -A got=()
  steps=(pgb 1 2 4)
  for k in $(seq 0 3); do
    s="${steps[$(( (k + r - 1) % 4 ))]}"
    if [ "$s" = pgb ]; then got[pgb]="$(pgbench_best "$db" "$work/order.sql" "$SECS")"; else got[$s]="$(instances "$db" "$s")"; fi
  done
  echo "$r ${got[1]} ${got[2]} ${got[4]} ${got[pgb]}" | LC_ALL=C awk '{
      printf "%s %s %s %s %s %s %s %s %.2f %.2f %.2f\n", $1, $2, $3, $4, $5, $6, $7, $8, $4 / $2, $6 / $2, $2 / $8 }' \
    | tee -a "$work/rows" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
done

col() { awk -v c="$1" '{ print $c }' "$work/rows"; }
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, one hot product, a new never-analyzed database per round"
  [ -z "${SCALE_NOTE:-}" ] || echo "$SCALE_NOTE"
  echo
  echo "Peers (STOCKGATE_PEERS): $([ "$PEERS" = 1 ] && echo yes || echo no)."
  echo "64 connections in total (wrk -t1 per instance), pgbench -j2 at -c8/-c32/-c64 (best), ${SECS} s each, $ROUNDS rounds, order rotating; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| round | 1 instance orders/s | p99 ms | 2 instances | p99 ms | 4 instances | p99 ms | pgbench best tps | 2 ÷ 1 | 4 ÷ 1 | 1 ÷ pgbench |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 }' "$work/rows"
  echo
  printf '**Median:** 1 instance %s orders/s (%s), p99 %s ms; 2 ÷ 1 %s (%s); 4 ÷ 1 %s (%s); 1 ÷ pgbench %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 9 | median)" "$(col 9 | range)" \
    "$(col 10 | median)" "$(col 10 | range)" "$(col 11 | median)" "$(col 11 | range)"
} | tee -a "bench/results/scale-$(date -u +%F).md"
