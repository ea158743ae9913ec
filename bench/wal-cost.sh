#!/usr/bin/env bash
# bench/wal-cost.sh REV_A REV_B — the WAL one order writes through each revision's batch
# function, side by side: what the primary writes, its walsenders send and every replica
# replays, per order (instruction counts, bench/sql-cost.sh, do not see it).
#
# For each revision: a database of its own on the dev cluster's primary (./dev up, or the
# cluster STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT name), that revision's migrations applied,
# one hot product and 1,000 quiet ones; per shape (`hot`: 36 orders of the hot product a
# statement; `spread`: about 24 products at random, one order each), 20 statements to warm,
# a CHECKPOINT (so both sides pay the same full-page images), then 200 statements, and the
# WAL position's advance over the orders written. Prints a table and appends it to
# bench/results/wal-cost-<YYYY-MM-DD>.md. Needs nothing else of the cluster: run it while
# nothing else writes there.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
[ $# -eq 2 ] || { echo "usage: bench/wal-cost.sh REV_A REV_B" >&2; exit 2; }
dev_cluster_env
BASE_URL="${DATABASE_URL%/*}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

declare -A BYTES FN REV
for side in A B; do
  rev="$1"; [ "$side" = B ] && rev="$2"
  REV[$side]="$(git rev-parse --short "$rev")"
  db="wal_cost_${side,,}_$$"
  psql -X -q "$BASE_URL/postgres" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
  FN[$side]="$(revision_db "$rev" "$work/$side" psql -X -q -v ON_ERROR_STOP=1 "$BASE_URL/$db")"
  for shape in hot spread; do
    stmt="$(batch_statement "${FN[$side]}" "$shape" 'count(*)')"
    for _ in $(seq 20); do echo "$stmt"; done >"$work/warm.sql"
    for _ in $(seq 200); do echo "$stmt"; done >"$work/run.sql"
    psql -X -q "$BASE_URL/$db" -f "$work/warm.sql" >/dev/null
    psql -X -q "$BASE_URL/$db" -c "CHECKPOINT"
    n0="$(psql -X -At "$BASE_URL/$db" -c "SELECT count(*) FROM orders")"
    l0="$(psql -X -At "$BASE_URL/$db" -c "SELECT pg_current_wal_lsn()")"
    psql -X -q "$BASE_URL/$db" -f "$work/run.sql" >/dev/null
    l1="$(psql -X -At "$BASE_URL/$db" -c "SELECT pg_current_wal_lsn()")"
    n1="$(psql -X -At "$BASE_URL/$db" -c "SELECT count(*) FROM orders")"
    BYTES[$side.$shape]="$(psql -X -At "$BASE_URL/$db" -c "SELECT round(pg_wal_lsn_diff('$l1', '$l0') / ($n1 - $n0))")"
  done
  psql -X -q "$BASE_URL/postgres" -c "DROP DATABASE $db"
done

out="bench/results/wal-cost-$(date -u +%Y-%m-%d).md"
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): A = ${REV[A]} (${FN[A]}), B = ${REV[B]} (${FN[B]})"
  echo "WAL bytes per order over 200 statements after 20 and a CHECKPOINT, on the dev cluster's primary; $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')."
  echo
  echo "| shape | A bytes an order | B bytes an order | B ÷ A |"
  echo "| --- | --- | --- | --- |"
  for shape in hot spread; do
    awk -v s="$shape" -v a="${BYTES[A.$shape]}" -v b="${BYTES[B.$shape]}" 'BEGIN { printf "| %s | %d | %d | %.2f |\n", s, a, b, b / a }'
  done
} | tee -a "$out"
echo "(appended to $out)"
