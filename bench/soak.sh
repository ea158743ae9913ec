#!/usr/bin/env bash
# bench/soak.sh — back-to-back flash sales on one deployment for SOAK_MINUTES (20): does the
# service sell as fast in the last minute as in the first, while every sale's refusals pile
# up in `orders` (the default 24 h idempotency window keeps them all)?
#
# On a new database of the dev cluster (./dev up, or the cluster up, must have run), never
# analyzed by hand (autovacuum runs as it would in the field), one `stockgate serve`, and
# `loadtest flash-sale` sales one after another: each a fresh product of SOAK_STOCK (500)
# units, SOAK_BUYERS (10,000) buyers, 64 at a time, 2 availability pollers. Any sale that
# oversells, errs or lies stops the soak (loadtest exits non-zero).
#
# Per minute (by each sale's start): the sales, order requests per second over their
# durations, the median and the worst of their order p99s, and the rows in `orders` at the
# minute's end; then the last minute ÷ the first, and the median of the last five minutes ÷
# that of the first five. Appends it all to bench/results/soak-<date>.md.
#
# Environment: SOAK_MINUTES (20), SOAK_STOCK (500), SOAK_BUYERS (10000), SOAK_PORT (18397),
# STOCKGATE_BIN (target/release/stockgate), LOADTEST_BIN (target/release/loadtest),
# SOAK_USER_FIRST (1: after migrating, the key claim's unique index is rebuilt user first, as
# it was before migration 20261203000002, for the side by side), SOAK_NOTE (a line for the
# file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

MINUTES="${SOAK_MINUTES:-20}"
STOCK="${SOAK_STOCK:-500}"
BUYERS="${SOAK_BUYERS:-10000}"
PORT="${SOAK_PORT:-18397}"
BIN="${STOCKGATE_BIN:-target/release/stockgate}"
LOADTEST="${LOADTEST_BIN:-target/release/loadtest}"
for b in "$BIN" "$LOADTEST"; do
  [ -x "$b" ] || { echo "soak.sh: $b is missing (cargo build --release -p stockgate -p loadtest)" >&2; exit 1; }
done

bench_service_env "$PORT"
DB="soak_$(date -u +%H%M%S)"
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

psql "$BASE_URL/postgres" -qc "CREATE DATABASE $DB" >/dev/null
"$BIN" migrate >/dev/null
if [ "${SOAK_USER_FIRST:-0}" = 1 ]; then
  psql "$DATABASE_URL" -q >/dev/null <<'SQL'
ALTER TABLE orders DROP CONSTRAINT orders_user_idempotency_key,
  ADD CONSTRAINT orders_user_idempotency_key UNIQUE (user_id, idempotency_key);
SQL
fi
"$BIN" serve >"$work/serve.log" 2>&1 &
pid=$!
wait_healthy "$URL" || { cat "$work/serve.log" >&2; echo "soak.sh: the service did not start" >&2; exit 1; }

start="$(date +%s)"
end=$((start + MINUTES * 60))
n=0
# one line per sale: minute sent total_ms p99_ms
while [ "$(date +%s)" -lt "$end" ]; do
  n=$((n + 1))
  minute=$(( ($(date +%s) - start) / 60 + 1 ))
  "$LOADTEST" flash-sale --base-url "$URL" --admin-token "$ADMIN" --stock "$STOCK" --buyers "$BUYERS" \
    --concurrency 64 --pollers 2 --json "$work/sale.json" >"$work/sale.txt" 2>&1 \
    || { cat "$work/sale.txt" >&2; echo "soak.sh: sale $n failed; the soak stops" >&2; exit 1; }
  python3 - "$work/sale.json" "$minute" >>"$work/sales" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], d["orders"]["sent"], d["timing"]["total_ms"], d["latency"]["orders"]["p99_ms"])
PY
  if [ ! -f "$work/rows-$minute" ]; then
    psql "$DATABASE_URL" -Atc "SELECT count(*) FROM orders" >"$work/rows-$minute"
    tail -1 "$work/sales" | awk -v r="$(cat "$work/rows-$minute")" '{ printf "minute %d: sale at %s orders/s, p99 %s ms; orders has %s rows\n", $1, ($3 > 0 ? int($2 / $3 * 1000) : 0), $4, r }' >&2
  fi
done
analyzed="$(psql "$DATABASE_URL" -Atc "SELECT coalesce(max(greatest(last_analyze, last_autoanalyze))::text, 'never') FROM pg_stat_user_tables WHERE relname = 'orders'")"
rows="$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM orders")"
echo "$rows" >"$work/rows-$((minute + 1))"

python3 - "$work" "$MINUTES" >"$work/table" <<'PY'
import os, sys, statistics
work, minutes = sys.argv[1], int(sys.argv[2])
by = {}
for line in open(os.path.join(work, "sales")):
    m, sent, ms, p99 = line.split()
    by.setdefault(int(m), []).append((int(sent), float(ms), float(p99)))
print("| minute | sales | order requests/s | p99 ms, median of sales | p99 ms, worst sale | rows in orders after |")
print("| --- | --- | --- | --- | --- | --- |")
rate = {}
for m in sorted(by):
    s = by[m]
    rate[m] = sum(x[0] for x in s) / (sum(x[1] for x in s) / 1000)
    p99s = [x[2] for x in s]
    rows_file = os.path.join(work, f"rows-{m + 1}")
    rows = open(rows_file).read().strip() if os.path.exists(rows_file) else "-"
    print(f"| {m} | {len(s)} | {rate[m]:.0f} | {statistics.median(p99s):.1f} | {max(p99s):.1f} | {rows} |")
ms = sorted(rate)
first, last = ms[0], ms[-1]
print()
print(f"Last minute ÷ first: {rate[last] / rate[first]:.2f} (goal: within 20 %, 0.80–1.20).")
if len(ms) >= 10:
    head, tail = statistics.median(rate[m] for m in ms[:5]), statistics.median(rate[m] for m in ms[-5:])
    print(f"Median of the last five minutes ÷ that of the first five: {tail / head:.2f}.")
PY
{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, $MINUTES minutes of back-to-back flash sales on a new deployment"
  [ -z "${SOAK_NOTE:-}" ] || echo "$SOAK_NOTE"
  echo
  echo "The key claim's unique index: $(psql "$DATABASE_URL" -Atc "SELECT pg_get_indexdef('orders_user_idempotency_key'::regclass)")."
  echo "Each sale: a fresh product of $STOCK units, $BUYERS buyers, 64 at a time, 2 availability pollers (loadtest flash-sale); $n sales, all passed; \`orders\` ended with $rows rows, last analyzed: $analyzed; load average $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  cat "$work/table"
} | tee -a "bench/results/soak-$(date -u +%F).md"
