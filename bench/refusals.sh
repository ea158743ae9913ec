#!/usr/bin/env bash
# bench/refusals.sh — what a million-buyer sale of nothing leaves in `orders`, before and
# after the idempotency window, and whether a second such sale makes the table grow again.
#
# Every 409 is final for its key, so it is a `refused` row. The sweeper deletes refusals older
# than STOCKGATE_IDEMPOTENCY_WINDOW in statements of a thousand (`refusals::purge`); autovacuum
# (or a plain VACUUM) then makes their space reusable, so the table holds the refusals of one
# window, not of every sale ever.
#
# On its own database on the dev cluster (./dev up, or the cluster up, must have run), one
# sold-out product:
#   1. a sale: `stockgate serve` with the default window (24h: nothing is purged during it)
#      under `wrk -t2 -c64` (a fresh buyer and key per request, bench/wrk/orders.lua) in 10 s
#      rounds until REJECTIONS 409s were answered (the service's
#      `stockgate_orders_total{outcome="out_of_stock"}`), every one a row;
#   2. the window passes: the service restarted with STOCKGATE_IDEMPOTENCY_WINDOW=WINDOW (1s)
#      and a wait until no refusal is left; then a plain VACUUM (what autovacuum would do,
#      without waiting for it);
#   3. the same sale again, under the default window: does the table grow past step 1?
# At each step: rows, `pg_total_relation_size('orders')` (heap + indexes) and dead tuples;
# the table goes to bench/results/refusals-<date>.md.
#
# Environment: REJECTIONS (1000000), WINDOW (1s), REFUSALS_PORT (18395), STOCKGATE_BIN
# (target/release/stockgate), STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (as for ./dev).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

WANT="${REJECTIONS:-1000000}"
WINDOW="${WINDOW:-1s}"
PORT="${REFUSALS_PORT:-18395}"
BIN="${STOCKGATE_BIN:-target/release/stockgate}"
command -v wrk >/dev/null || { echo "refusals.sh: wrk is missing (apt-get install wrk)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "refusals.sh: $BIN is missing (cargo build --release)" >&2; exit 1; }

bench_service_env "$PORT"
DB="refusals_$(date -u +%H%M%S)"
export DATABASE_URL="$BASE_URL/$DB"
export STOCKGATE_REPLICA_URLS="$(replicas_on "$STOCKGATE_REPLICA_URLS" "$DB")"

work="$(mktemp -d)"
pid=""
cleanup() {
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  psql "$BASE_URL/postgres" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# serve [WINDOW]: (re)starts the service, with the default idempotency window or WINDOW
serve() {
  [ -z "$pid" ] || { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""; }
  if [ $# -gt 0 ]; then
    STOCKGATE_IDEMPOTENCY_WINDOW="$1" "$BIN" serve >"$work/serve.log" 2>&1 &
  else
    "$BIN" serve >"$work/serve.log" 2>&1 &
  fi
  pid=$!
  wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "refusals.sh: the service did not start" >&2; exit 1; }
}

q() { psql "$DATABASE_URL" -Atc "$1"; }
# step NAME: a row of the table: rows, of them refused, orders' total size in MB, dead tuples
step() {
  local line
  line="$(q "SELECT count(*), count(*) FILTER (WHERE status = 'refused'), round(pg_total_relation_size('orders') / 1048576.0, 1), (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'orders') FROM orders" | tr '|' ' ')"
  echo "$1 $line" | tee -a "$work/steps" >&2
}
# sale NAME: a fresh service, wrk in 10 s rounds until it has answered WANT 409s
sale() {
  local t0 t1 refused=0
  serve
  t0="$(date +%s)"
  while [ "${refused%.*}" -lt "$WANT" ]; do
    wrk -t2 -c64 -d10s -s bench/wrk/orders.lua "$URL" -- "$ADMIN" gone >"$work/wrk.txt"
    grep -q '^status 409:' "$work/wrk.txt" || { cat "$work/wrk.txt" >&2; echo "refusals.sh: no 409s" >&2; exit 1; }
    refused="$(metric_at "$URL" 'stockgate_orders_total{outcome="out_of_stock"}')"
  done
  t1="$(date +%s)"
  echo "$1: ${refused%.*} rejections in $((t1 - t0)) s" | tee -a "$work/notes" >&2
}

psql "$BASE_URL/postgres" -qc "CREATE DATABASE $DB" >/dev/null
"$BIN" migrate >/dev/null
q "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) VALUES ('gone', 'sold out', 100, 0, 0)" >/dev/null
step "new"
sale "first sale"
step "after-1st-sale"
serve "$WINDOW"
t0="$(date +%s)"
until [ "$(q "SELECT count(*) FROM orders WHERE status = 'refused'")" = 0 ]; do sleep 1; done
echo "the window ($WINDOW) passed: every refusal purged $(( $(date +%s) - t0 )) s after the restart, $(metric_at "$URL" stockgate_refusals_purged_total) by this instance" | tee -a "$work/notes" >&2
step "purged"
q "VACUUM orders" >/dev/null
step "vacuumed"
sale "second sale"
step "after-2nd-sale"

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, ${WANT} rejections a sale, then the window ($WINDOW) passes"
  echo
  echo "One sold-out product, wrk -t2 -c64 with a fresh buyer and key per request; a database of its own; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  sed 's/^/- /' "$work/notes"
  echo
  echo "| step | rows in orders | of them refused | orders + indexes, MB | dead tuples |"
  echo "| --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }' "$work/steps"
} | tee -a "bench/results/refusals-$(date -u +%F).md"
