#!/usr/bin/env bash
# bench/sql-cost.sh REV_A REV_B — what one order batch statement costs PostgreSQL, in
# instructions, for the batch function of two revisions side by side.
#
# Wall-clock figures on these shared two-core hosts move by a fair share from run to run;
# instruction counts do not. For each revision this script applies that revision's
# migrations to a database of its own in a scratch cluster (never analyzed, as a new
# deployment), stocks one hot product and 1,000 quiet ones, and then, per shape, on a fresh
# copy of that database, runs a single-user backend under `valgrind --tool=callgrind` that
# calls the revision's newest `take_order_batches_vN` WARM and then WARM+N times; the
# difference over N is the marginal cost of one statement, its commit included
# (synchronous_commit off: no disk wait is counted, and CPU is what is measured).
#
# Shapes: `hot` (HOT orders, default 36, of one unit for the hot product, one statement: a batch as the
# hot product's worker sends it) and `spread` (SPREAD products at random, default 24, one
# order each: a combined statement as the 1,000-product load sends it) and `plain` (SPREAD
# of pgbench's plain one-order transactions, four statements each: what the service's
# statements are held against; the batch function is not called) and `bare` (the same with
# the schema's triggers off: a bound, not a valid writer).
#
# Prints a table and appends it to bench/results/sql-cost-<YYYY-MM-DD>.md.
# Environment: N (default 50), WARM (default 10), SHAPES (default "hot spread"), HOT and
# SPREAD (the shapes' sizes, default 36 and 24), PROFILE (a
# folder: each side's longer callgrind run is kept there, as <shape>-<A|B>.out, for
# `callgrind_annotate --inclusive=yes`).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

[ $# -eq 2 ] || { echo "usage: bench/sql-cost.sh REV_A REV_B" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "sql-cost.sh: valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
N="${N:-50}" WARM="${WARM:-10}" SHAPES="${SHAPES:-hot spread}" SPREAD="${SPREAD:-24}" HOT="${HOT:-36}"
PGBIN="${PGBIN:-/usr/lib/postgresql/15/bin}"
[ -n "${PROFILE:-}" ] && { mkdir -p "$PROFILE"; PROFILE="$(cd "$PROFILE" && pwd)"; }
KEEP=""
WORK="$(mktemp -d /tmp/sql-cost.XXXXXX)"
chmod 755 "$WORK"
# PostgreSQL refuses to run as root: as root, its processes run as `postgres`.
as_pg() { if [ "$(id -u)" = 0 ]; then setpriv --reuid=postgres --regid=postgres --init-groups "$@"; else "$@"; fi; }
PORT=$((26000 + RANDOM % 2000))
PSQL=(psql -X -q -h "$WORK" -p "$PORT" -U postgres -v ON_ERROR_STOP=1)
cleanup() { as_pg "$PGBIN/pg_ctl" -D "$WORK/data" stop -m immediate >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT

mkdir "$WORK/data"
if [ "$(id -u)" = 0 ]; then chown postgres "$WORK" "$WORK/data"; fi
as_pg "$PGBIN/initdb" -D "$WORK/data" -U postgres -A trust >/dev/null
start() { as_pg "$PGBIN/pg_ctl" -D "$WORK/data" -o "-p $PORT -k $WORK -c autovacuum=off" -l "$WORK/log" -w start >/dev/null; }
stop() { as_pg "$PGBIN/pg_ctl" -D "$WORK/data" -w stop >/dev/null; }

# instructions DB FILE CALLS: the instructions a single-user backend on DB spends on CALLS
# statements of FILE
instructions() {
  local db="$1" file="$2" calls="$3" i
  { echo "SET synchronous_commit = off"; for i in $(seq "$calls"); do cat "$file"; done; } > "$WORK/in"
  chmod 644 "$WORK/in"
  as_pg valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" \
    "$PGBIN/postgres" --single -D "$WORK/data" "$db" < "$WORK/in" > "$WORK/out" 2>&1
  grep -q ERROR "$WORK/out" && { grep -m3 ERROR "$WORK/out" >&2; exit 1; }
  [ -n "${KEEP:-}" ] && cp "$WORK/cg.out" "$KEEP"
  grep -o 'Collected : [0-9]*' "$WORK/out" | awk '{ print $3 }'
}

# fresh SIDE: run_SIDE, a new copy of that side's stocked database
fresh() {
  start
  "${PSQL[@]}" -d postgres -c "DROP DATABASE IF EXISTS run_${1,,}" -c "CREATE DATABASE run_${1,,} TEMPLATE src_${1,,}"
  stop
}

start
declare -A FN
declare -A REV
for side in A B; do
  rev="${1}"; [ "$side" = B ] && rev="$2"
  REV[$side]="$(git rev-parse --short "$rev")"
  "${PSQL[@]}" -d postgres -c "CREATE DATABASE src_${side,,}"
  FN[$side]="$(revision_db "$rev" "$WORK/$side" "${PSQL[@]}" -d "src_${side,,}")"
done
stop

date_utc="$(date -u +%Y-%m-%d)"
out="bench/results/sql-cost-$date_utc.md"
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): A = ${REV[A]} (${FN[A]}), B = ${REV[B]} (${FN[B]})"
  echo "callgrind instructions of one statement (marginal over $N calls after $WARM), single-user backend, fresh never-analyzed database per shape, synchronous_commit off; $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')."
  echo
  echo "| shape | orders a statement | A instructions | B instructions | B ÷ A | A per order | B per order |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
} | tee -a "$out"
for shape in $SHAPES; do
  declare -A IR
  for side in A B; do
    batch_statement "${FN[$side]}" "$shape" 't.*' > "$WORK/stmt.sql"
    fresh "$side"; a="$(instructions "run_${side,,}" "$WORK/stmt.sql" "$WARM")"
    KEEP="${PROFILE:+$PROFILE/$shape-$side.out}"
    fresh "$side"; b="$(instructions "run_${side,,}" "$WORK/stmt.sql" $((WARM + N)))"
    KEEP=""
    IR[$side]=$(( (b - a) / N ))
  done
  orders=$HOT; [ "$shape" = hot ] || orders=$SPREAD
  awk -v s="$shape" -v o="$orders" -v a="${IR[A]}" -v b="${IR[B]}" 'BEGIN {
    printf "| %s | %s | %d | %d | %.2f | %d | %d |\n", s, (s == "spread" ? "≈" o : o), a, b, b / a, a / o, b / o }' | tee -a "$out"
done
echo "(appended to $out)"
