#!/usr/bin/env bash
# bench/svc-cost.sh BINARY_A BINARY_B — what the service itself spends on one order, in
# instructions, for two stockgate binaries side by side: bench/sql-cost.sh's counterpart for
# the service's side of an order.
#
# CPU time per order moves by several per cent from turn to turn on these shared hosts
# (bench/ab.sh), more than a change of a few per cent in the service; instruction counts do
# not. Each side runs as bench/ab.sh's turns do (AB_FRESH): a new never-analyzed database on
# the dev cluster (./dev up, or the cluster STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT name),
# migrated by that binary, its load (SVC_LOAD: bench/lib.sh's order_load, `spread` by default)
# from wrk -t2 -c64 with unique keys. The binary runs under
# `valgrind --tool=callgrind`, counting only from the moment the load is warm: 10 s idle are
# counted first (the monitors' and pollers' own cost, which is per second, not per order, and
# is subtracted), then SECS (default 20) of load. Under callgrind the service is tens of times
# slower than the database, so its batches are smaller than in a real run (the table says
# how many orders a statement carried): a per-statement cost weighs more here than there.
#
# Prints a table and appends it to bench/results/svc-cost-<YYYY-MM-DD>.md. With PROFILE=DIR,
# each side's callgrind file of the load is kept as DIR/<A|B>.out (callgrind_annotate).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

[ $# -eq 2 ] || { echo "usage: bench/svc-cost.sh BINARY_A BINARY_B" >&2; exit 2; }
for bin in "$1" "$2"; do [ -x "$bin" ] || { echo "svc-cost.sh: $bin is not an executable" >&2; exit 1; }; done
for tool in valgrind callgrind_control wrk; do
  command -v "$tool" >/dev/null || { echo "svc-cost.sh: $tool is missing (apt-get install valgrind wrk)" >&2; exit 1; }
done
SECS="${SECS:-20}" LOAD="${SVC_LOAD:-spread}"
order_load "$LOAD" || { echo "svc-cost.sh: SVC_LOAD is spread, hot or carts" >&2; exit 2; }
[ -n "${PROFILE:-}" ] && mkdir -p "$PROFILE"
work="$(mktemp -d)"
pid="" db=""
cleanup() {
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  [ -z "$db" ] || psql "$BASE_URL/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# side SIDE BINARY: one binary's figures, as "SIDE orders statements instructions-an-order"
side() {
  BIN="$2" bench_service_env "${SVC_PORT:-18390}"
  db="svc_cost_${1,,}_$$"
  BIN="$2" new_unanalyzed_db "$db"
  psql "$BASE_URL/$db" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) $products"
  DATABASE_URL="$BASE_URL/$db" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$db")" \
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/$1.out" \
    "$2" serve >"$work/$1.log" 2>&1 &
  pid=$!
  wait_healthy "$URL" 120 || { cat "$work/$1.log" >&2; echo "svc-cost.sh: $2 did not start" >&2; exit 1; }
  wrk -t2 -c64 -d8s -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "${args[@]}" >/dev/null
  local t0 n0
  t0="$(metric_at "$URL" stockgate_order_transactions_total)"
  callgrind_control -i on "$pid" >/dev/null
  sleep 10
  callgrind_control -d idle "$pid" >/dev/null
  callgrind_control -z "$pid" >/dev/null
  wrk -t2 -c64 -d"${SECS}s" -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "${args[@]}" >"$work/wrk-$1.txt"
  callgrind_control -d load "$pid" >/dev/null
  n0="$(metric_at "$URL" stockgate_order_transactions_total)"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null; db=""
  local idle load ok
  idle="$(awk '/^summary:/ { print $2 }' "$work/$1.out.1")"
  load="$(awk '/^summary:/ { print $2 }' "$work/$1.out.2")"
  ok="$(awk '/^status 201:/ { print $3 }' "$work/wrk-$1.txt")"
  [ -z "${PROFILE:-}" ] || cp "$work/$1.out.2" "$PROFILE/$1.out"
  echo "$1 $ok $((n0 - t0)) $(awk -v l="$load" -v i="$idle" -v o="$ok" -v s="$SECS" 'BEGIN { printf "%.0f", (l - i * s / 10) / o }')" >>"$work/rows"
  tail -1 "$work/rows" >&2
}

side A "$1"
side B "$2"
a="$(awk '$1 == "A" { print $4 }' "$work/rows")" b="$(awk '$1 == "B" { print $4 }' "$work/rows")"
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): A = $1, B = $2"
  [ -z "${SVC_NOTE:-}" ] || echo "$SVC_NOTE"
  echo
  echo "callgrind instructions of the service's process per confirmed order (the idle rate subtracted), wrk -t2 -c64 for ${SECS} s after 8 s of warming, load $LOAD with unique keys, a new never-analyzed database a side; $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')."
  echo
  echo "| side | orders | orders a statement | instructions an order |"
  echo "| --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %.1f | %s |\n", $1, $2, ($3 > 0 ? $2 / $3 : 0), $4 }' "$work/rows"
  echo
  awk -v a="$a" -v b="$b" 'BEGIN { printf "B ÷ A: %.3f\n", b / a }'
} | tee -a "bench/results/svc-cost-$(date -u +%F).md"
