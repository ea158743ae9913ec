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
# order each: a combined statement as the 1,000-product load sends it).
#
# Prints a table and appends it to bench/results/sql-cost-<YYYY-MM-DD>.md.
# Environment: N (default 50), WARM (default 10), SHAPES (default "hot spread"), HOT and
# SPREAD (the shapes' sizes, default 36 and 24), PROFILE (a
# folder: each side's longer callgrind run is kept there, as <shape>-<A|B>.out, for
# `callgrind_annotate --inclusive=yes`).
set -euo pipefail
cd "$(dirname "$0")/.."

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

# The statement for a schema whose newest batch function is $1 (its arguments: v5 and later
# take the requests' locations, here none).
statement() {
  local fn="$1" shape="$2" extra=""
  case "$fn" in take_order_batches_v[1-4]) ;; *) extra=", '{}'::text[], '{}'::int[]" ;; esac
  case "$shape" in
    hot) echo "SELECT t.* FROM (SELECT array_agg(gen_random_uuid()) ids, array_agg('u' || (random() * 1e12)::bigint) us, array_agg(md5(random()::text)) ks, array_agg(1) q, array_agg(md5(random()::text)) fps FROM generate_series(1, $HOT)) a, $fn(ARRAY['hot'], ARRAY[$HOT], a.ids, a.us, a.ks, a.q, a.fps$extra) t;" ;;
    spread) echo "SELECT t.* FROM (SELECT array_agg(p ORDER BY p COLLATE \"C\") ps, array_agg(n::int ORDER BY p COLLATE \"C\") ends, array_agg(gen_random_uuid()) ids, array_agg('u' || (random() * 1e12)::bigint) us, array_agg(md5(random()::text)) ks, array_agg(1) q, array_agg(md5(random()::text)) fps FROM (SELECT p, row_number() OVER (ORDER BY p COLLATE \"C\") n FROM (SELECT DISTINCT 'p' || lpad((1 + floor(random() * 1000))::int::text, 4, '0') p FROM generate_series(1, $SPREAD)) d) x) a, $fn(a.ps, a.ends, a.ids, a.us, a.ks, a.q, a.fps$extra) t;" ;;
    *) echo "sql-cost.sh: unknown shape $shape" >&2; exit 2 ;;
  esac
}

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
  mkdir -p "$WORK/$side" && git archive "$rev" migrations | tar -x -C "$WORK/$side"
  "${PSQL[@]}" -d postgres -c "CREATE DATABASE src_${side,,}"
  for f in "$WORK/$side"/migrations/*.sql; do
    if head -1 "$f" | grep -q -- '-- no-transaction'; then "${PSQL[@]}" -d "src_${side,,}" -f "$f" >/dev/null
    else "${PSQL[@]}" -1 -d "src_${side,,}" -f "$f" >/dev/null; fi
  done
  "${PSQL[@]}" -d "src_${side,,}" -c "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
      SELECT 'hot', 'Hot', 100, 2000000000, 2000000000
      UNION ALL SELECT 'p' || lpad(i::text, 4, '0'), 'P', 100, 1000000000, 1000000000 FROM generate_series(1, 1000) i"
  FN[$side]="$("${PSQL[@]}" -At -d "src_${side,,}" -c "SELECT proname FROM pg_proc WHERE proname LIKE 'take\_order\_batches\_v%' ORDER BY substring(proname FROM '[0-9]+\$')::int DESC LIMIT 1")"
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
    statement "${FN[$side]}" "$shape" > "$WORK/stmt.sql"
    fresh "$side"; a="$(instructions "run_${side,,}" "$WORK/stmt.sql" "$WARM")"
    KEEP="${PROFILE:+$PROFILE/$shape-$side.out}"
    fresh "$side"; b="$(instructions "run_${side,,}" "$WORK/stmt.sql" $((WARM + N)))"
    KEEP=""
    IR[$side]=$(( (b - a) / N ))
  done
  orders=$HOT; [ "$shape" = spread ] && orders=$SPREAD
  awk -v s="$shape" -v o="$orders" -v a="${IR[A]}" -v b="${IR[B]}" 'BEGIN {
    printf "| %s | %s | %d | %d | %.2f | %d | %d |\n", s, (s == "spread" ? "≈" o : o), a, b, b / a, a / o, b / o }' | tee -a "$out"
done
echo "(appended to $out)"
