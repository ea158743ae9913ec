#!/usr/bin/env bash
# bench/rows.sh — what PostgreSQL alone does with one hot product's batches, and whether
# splitting its stock across rows would help several instances (issue #31, part 2). No
# service runs: pgbench plays the batchers, each transaction being the shape of an order
# batch (lock the stock row, insert B confirmed orders into the real `orders` table, one
# guarded UPDATE … WHERE available_quantity >= B), one commit.
#
#   1x35-row1   one batcher, batches of 35, one stock row   (one instance's owner, cpu.sh)
#   4x16-row1   four batchers, batches of 16, one stock row (four instances, no peers)
#   4x16-rows4  four batchers, batches of 16, a row each    (four instances, stock split)
#   4x16l-row1  as 4x16-row1, but each transaction locks late: it inserts its orders first and
#               takes the row only with the guarded UPDATE, so the four overlap their inserts
#               and queue only for the UPDATE and the commit (a trial, not the service's shape)
#
# Each run gets a new never-analyzed database (hot_product_db) holding products `hot-0` … `hot-3` of
# 10^8 units; the dev cluster's replicas stream as usual. The shapes rotate from round to
# round. Prints orders/s (tps × batch) per run and the medians; appends them to
# bench/results/rows-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (8), ROWS_SHAPES (which of the shapes above to run,
# space-separated; default all four), STOCKGATE_BIN (target/release/stockgate, for `migrate`),
# ROWS_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup rows 18690 pgbench

cat >"$work/batch.sql" <<'SQL'
\set row :client_id % :rows
BEGIN;
SELECT available_quantity FROM products WHERE product_id = 'hot-' || :row FOR UPDATE;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents,
                    status, idempotency_key, request_fingerprint)
  SELECT gen_random_uuid(), 'hot-' || :row, gen_random_uuid()::text, 1, 100, 100, 'confirmed',
         gen_random_uuid()::text, 'rows.sh' FROM generate_series(1, :batch);
UPDATE products SET available_quantity = available_quantity - :batch
  WHERE product_id = 'hot-' || :row AND available_quantity >= :batch;
COMMIT;
SQL
sed '/FOR UPDATE;$/d' "$work/batch.sql" >"$work/late.sql"

# run SHAPE R: prints "shape orders/s tps"
run() {
  local shape="$1" db="rows_${stamp}_$2_${1//-/_}" clients batch rows tps
  local script="$work/batch.sql"
  case "$shape" in *l-*) script="$work/late.sql" ;; esac
  IFS=x- read -r clients batch rows <<<"${shape/row/}"
  batch="${batch%l}"
  rows="${rows#s}"
  hot_product_db "$db" 4
  tps="$(pgbench -n -j1 -c"$clients" -T"$SECS" -D batch="$batch" -D rows="$rows" -f "$script" \
    "$BASE_URL/$db" 2>"$work/pgbench.err" | awk '/^tps/ { print $3 }')"
  [ -n "$tps" ] || { cat "$work/pgbench.err" >&2; exit 1; }
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
  LC_ALL=C awk -v s="$shape" -v t="$tps" -v b="$batch" 'BEGIN { printf "%s %.0f %.0f\n", s, t * b, t }'
}

shapes=(${ROWS_SHAPES:-1x35-row1 4x16-row1 4x16-rows4 4x16l-row1})
rounds run "${shapes[@]}"

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): one hot product's batches in PostgreSQL alone, one row or split"
  [ -z "${ROWS_NOTE:-}" ] || echo "$ROWS_NOTE"
  echo
  echo "pgbench -j1, ${SECS} s a run, a new never-analyzed database each (the real \`orders\` table), replicas streaming, $ROUNDS rounds, order rotating; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| shape | orders/s | batches/s |"
  echo "| --- | --- | --- |"
  awk '{ printf "| %s | %s | %s |\n", $1, $2, $3 }' "$work/rows"
  echo
  for s in "${shapes[@]}"; do
    col() { awk -v s="$s" '$1 == s { print $2 }' "$work/rows"; }
    echo "**$s:** median $(col | median) orders/s ($(col | range))"
  done
} | tee -a "bench/results/rows-$(date -u +%Y-%m-%d).md"
