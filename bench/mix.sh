#!/usr/bin/env bash
# bench/mix.sh — one hot product and 1,000 quiet ones at once: neither may starve the other.
#
# Each round makes a database of its own on the dev cluster (./dev up, or the cluster up, must
# have run), migrated and never analyzed (autovacuum off on its tables), with a product `hot`
# and 1,000 products `spread-1` … `spread-1000`, all of 10^8 units, and starts a fresh
# `stockgate serve`. Then three runs of BENCH_SECONDS, in an order that rotates from round to
# round, each request a fresh buyer and key (bench/wrk/orders.lua):
#   - hot alone: `wrk -t1 -c32` on `hot`;
#   - quiet alone: `wrk -t1 -c32`, each request a random one of the 1,000;
#   - both: the two at once, 64 connections in all.
# Prints per round each class's orders/s and p99 alone and mixed, and mixed ÷ alone per class;
# then the medians with min–max; appends it all to bench/results/mix-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per run, 8), MIX_PORT (18398), STOCKGATE_BIN
# (target/release/stockgate), MIX_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup mix "${MIX_PORT:-18398}"

fresh() {
  local db="mix_${stamp}_$1"
  new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -q >/dev/null <<SQL
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
  SELECT 'spread-' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, 1000) g
  UNION ALL SELECT 'hot', 'hot', 100, 100000000, 100000000;
SQL
  echo "$db"
}

# load CLASS OUT: 32 connections of orders for CLASS (hot, quiet) for SECS seconds into OUT
load() {
  case "$1" in
    hot) set -- "$2" hot ;;
    quiet) set -- "$2" spread- 1000 ;;
  esac
  local out="$1"; shift
  wrk -t1 -c32 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "$@" >"$out"
}

# figures OUT: "orders/s p99" of a wrk run
figures() {
  LC_ALL=C awk -v s="$SECS" -v p99="$(wrk_ms "$1" 99%)" '
    /^status 201:/ { ok += $3 } END { printf "%.0f %.2f", ok / s, p99 }' "$1"
}

for r in $(seq "$ROUNDS"); do
  db="$(fresh "$r")"
  DATABASE_URL="$BASE_URL/$db" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$db")" \
    "$BIN" serve >"$work/serve.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "mix.sh: the service did not start" >&2; exit 1; }
  runs=(hot quiet both)
  for k in $(seq 0 2); do
    case "${runs[$(((k + r) % 3))]}" in
      hot) load hot "$work/hot-alone" ;;
      quiet) load quiet "$work/quiet-alone" ;;
      both) load hot "$work/hot-mixed" & h=$!; load quiet "$work/quiet-mixed"; wait "$h" ;;
    esac
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  echo "$r $(figures "$work/hot-alone") $(figures "$work/hot-mixed") $(figures "$work/quiet-alone") $(figures "$work/quiet-mixed")" |
    awk '{ printf "%s %s %s %s %s %s %s %s %s %.2f %.2f\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, ($2 > 0 ? $4 / $2 : 0), ($6 > 0 ? $8 / $6 : 0) }' |
    tee -a "$work/rows" >&2
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
done

col() { awk -v c="$1" '{ print $c }' "$work/rows"; }
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, one hot product and 1,000 quiet ones, a new never-analyzed database per round"
  [ -z "${MIX_NOTE:-}" ] || echo "$MIX_NOTE"
  echo
  echo "wrk -t1 -c32 per class, alone and both at once (64 connections), ${SECS} s each, $ROUNDS rounds, order rotating; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "| round | hot alone orders/s | p99 ms | hot mixed | p99 ms | quiet alone | p99 ms | quiet mixed | p99 ms | hot mixed ÷ alone | quiet mixed ÷ alone |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11 }' "$work/rows"
  echo
  printf '**Median:** hot mixed %s orders/s (%s), p99 %s ms (%s), %s of alone (%s); quiet mixed %s orders/s (%s), p99 %s ms (%s), %s of alone (%s).\n' \
    "$(col 4 | median)" "$(col 4 | range)" "$(col 5 | median)" "$(col 5 | range)" "$(col 10 | median)" "$(col 10 | range)" \
    "$(col 8 | median)" "$(col 8 | range)" "$(col 9 | median)" "$(col 9 | range)" "$(col 11 | median)" "$(col 11 | range)"
} | tee -a "bench/results/mix-$(date -u +%F).md"
