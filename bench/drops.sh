#!/usr/bin/env bash
# bench/drops.sh — what a flash drop's rules cost: one hot product without a limit, one with
# `max_per_customer`, and one whose sale has not started, side by side on a new deployment.
#
# Each round makes a database of its own on the dev cluster (./dev up, or `./dev cluster`
# with the cluster up, must have run), migrated and never analyzed (autovacuum off on its
# tables, checked at the end), with three products of 2·10^9 units: `drops-free` (no rules),
# `drops-lim` (max_per_customer 2) and `drops-soon` (sale_starts_at a day ahead). A fresh
# `stockgate serve` on it takes `wrk -t2 -c64` of orders, each by a fresh buyer with a fresh
# key (bench/wrk/orders.lua, an admin token acting for the buyer), on each product in turn;
# the turns' order rotates from round to round. With fresh buyers every limited order fits
# its allowance: the turn measures what counting costs, not refusals.
#
# Per turn: answers/s (201 for the first two, 409 SALE_NOT_STARTED for the third), p99, and
# the primary transactions the service ran for orders (`stockgate_order_transactions_total`)
# per request: before the start, rejections are decided in batches, not one transaction each.
# Prints the medians with min–max and the limited/free ratio, and appends it all to
# bench/results/drops-<YYYY-MM-DD>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per turn, 8), DROPS_PORT (18390), STOCKGATE_BIN
# (target/release/stockgate), STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (as for ./dev),
# DROPS_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup drops "${DROPS_PORT:-18390}"

# fresh ROUND: a new database, migrated, never analyzed, with the three products
fresh() {
  local db="drops_${stamp}_$1"
  new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -q >/dev/null <<SQL
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity, max_per_customer, sale_starts_at)
  VALUES ('drops-free', 'no rules', 100, 2000000000, 2000000000, NULL, NULL),
         ('drops-lim', 'limit 2', 100, 2000000000, 2000000000, 2, NULL),
         ('drops-soon', 'starts tomorrow', 100, 2000000000, 2000000000, NULL, now() + interval '1 day');
SQL
  echo "$db"
}

# turn PRODUCT DB: one measured run; appends "product answers/s p99 transactions/request"
turn() {
  local want=201 before after
  [ "$1" != drops-soon ] || want=409
  before="$(metric_at "$URL" stockgate_order_transactions_total)"
  wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "$1" >"$work/wrk.txt"
  after="$(metric_at "$URL" stockgate_order_transactions_total)"
  LC_ALL=C awk -v p="$1" -v want="$want" -v s="$SECS" -v p99="$(wrk_ms "$work/wrk.txt" 99%)" -v tx="$((after - before))" '
    $1 == "status" { sub(/:$/, "", $2); all += $3; if ($2 == want) ok += $3 }
    END { printf "%s %.0f %.2f %.4f\n", p, ok / s, p99, (all > 0 ? tx / all : 0) }' \
    "$work/wrk.txt" >>"$work/rows"
  grep -q "^status $want:" "$work/wrk.txt" || { cat "$work/wrk.txt" >&2; echo "drops.sh: no $want answers for $1" >&2; exit 1; }
  tail -1 "$work/rows" >&2
}

products=(drops-free drops-lim drops-soon)
for r in $(seq "$ROUNDS"); do
  db="$(fresh "$r")"
  DATABASE_URL="$BASE_URL/$db" \
    STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$db")" \
    "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "drops.sh: the service did not start" >&2; exit 1; }
  for i in 0 1 2; do
    p="${products[$(((i + r) % 3))]}"
    echo "round $r of $ROUNDS: $p" >&2
    turn "$p" "$db"
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  analyzed="$(psql "$BASE_URL/$db" -Atc "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL")"
  rows="$(psql "$BASE_URL/$db" -Atc "SELECT count(*) FROM orders")"
  echo "round $r: orders table $rows rows at the end, $analyzed tables analyzed" | tee -a "$work/rounds" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
done

col() { awk -v p="$1" -v c="$2" '$1 == p { print $c }' "$work/rows"; }
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, a new deployment per round, never-analyzed tables"
  [ -z "${DROPS_NOTE:-}" ] || echo "$DROPS_NOTE"
  echo
  echo "wrk -t2 -c64, ${SECS} s a turn, $ROUNDS rounds with the turns' order rotating, a fresh buyer and key per request; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  sed 's/^/- /' "$work/rounds"
  echo
  echo "| turn | product | answers/s | p99 ms | order transactions per request |"
  echo "| --- | --- | --- | --- | --- |"
  awk '{ printf "| %d | %s | %s | %s | %s |\n", NR, $1, $2, $3, $4 }' "$work/rows"
  echo
  echo "| product | answers/s, median (min–max) | ÷ drops-free | p99 ms, median (min–max) | transactions per request, median |"
  echo "| --- | --- | --- | --- | --- |"
  free="$(col drops-free 2 | median)"
  for p in "${products[@]}"; do
    m="$(col "$p" 2 | median)"
    printf '| %s | %s (%s) | %s | %s (%s) | %s |\n' "$p" "$m" "$(col "$p" 2 | range)" \
      "$(awk -v a="$m" -v b="$free" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')" \
      "$(col "$p" 3 | median)" "$(col "$p" 3 | range)" "$(col "$p" 4 | median)"
  done
} | tee -a "bench/results/drops-$(date -u +%F).md"
