#!/usr/bin/env bash
# bench/report.sh — revenue report and orders export over 1,000,000 orders, against a
# running `./dev up`: report time from a replica (and from the primary, for comparison),
# export time and the service's peak RSS while streaming 1M rows. Loopback only.
# Prints a markdown table and writes bench/results/report-<date>.md. Cleans up after itself.
set -euo pipefail
cd "$(dirname "$0")/.."
LISTEN="${STOCKGATE_LISTEN:-127.0.0.1:8080}"
BASE="http://$LISTEN"
ROWS="${ROWS:-1000000}"
curl -fsS --max-time 5 "$BASE/healthz" >/dev/null || { echo "no stockgate at $BASE (./dev up)" >&2; exit 1; }
eval "$(./dev cluster env | grep -E '^DATABASE_URL=' | sed 's/^/export /')"
ADMIN="$(./dev token --admin)"
PID="$(ss -ltnpH "sport = :${LISTEN##*:}" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)"
P="bench-report-$(date +%s)"
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
cleanup() { psql "$DATABASE_URL" -qc "DELETE FROM orders WHERE product_id = '$P'; DELETE FROM products WHERE product_id = '$P'" >/dev/null 2>&1 || true; }
trap cleanup EXIT

say "inserting $ROWS orders for today"
psql "$DATABASE_URL" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity) VALUES ('$P', 'bench', 100, 0)"
psql "$DATABASE_URL" -qc "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, created_at)
  SELECT gen_random_uuid(), '$P', 'u' || g, 1, 100, 100, 'confirmed', 'k' || g, 'x', date_trunc('day', now()) + (g % 3600) * interval '1 second'
  FROM generate_series(1, $ROWS) g"
psql "$DATABASE_URL" -qc "ANALYZE orders"
./dev cluster wait

time_ms() { local s e; s=$(date +%s%N); "$@" >/dev/null; e=$(date +%s%N); echo $(( (e - s) / 1000000 )); }
report() { curl -fsS -H "Authorization: Bearer $ADMIN" "$BASE/v1/reports/revenue$1"; }
say "revenue report, 3 runs each"
served=$(report "" | jq -r .served_by)
r=(); for _ in 1 2 3; do r+=("$(time_ms report "")"); done
p=(); for _ in 1 2 3; do p+=("$(time_ms report "?snapshot=true")"); done
median() { printf '%s\n' "$@" | sort -n | sed -n 2p; }

say "export of all orders, sampling the service's RSS"
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }
base=$(rss); peak=$base
s=$(date +%s%N)
curl -fsS -H "Authorization: Bearer $ADMIN" "$BASE/v1/exports/orders" -o /tmp/stockgate-export.csv &
cpid=$!
while kill -0 $cpid 2>/dev/null; do v=$(rss); [ "$v" -gt "$peak" ] && peak=$v; sleep 0.05; done
wait $cpid
e=$(date +%s%N)
lines=$(($(wc -l < /tmp/stockgate-export.csv) - 1)); bytes=$(stat -c %s /tmp/stockgate-export.csv); rm -f /tmp/stockgate-export.csv

out="## report and export over $ROWS orders, $(date -u +'%Y-%m-%d %H:%M UTC')

2 cores; service pid $PID at $BASE; orders table holds $(psql "$DATABASE_URL" -Atc 'SELECT count(*) FROM orders') rows.

| measurement | result |
|---|---|
| revenue report from $served (median of 3) | $(median "${r[@]}") ms |
| revenue report in a transaction, on the primary (median of 3) | $(median "${p[@]}") ms |
| export: rows / bytes / time | $lines / $bytes / $(( (e - s) / 1000000 )) ms |
| service RSS before export → peak during export | $((base / 1024)) MiB → $((peak / 1024)) MiB |
"
printf '%s' "$out"
mkdir -p bench/results
printf '%s' "$out" > "bench/results/report-$(date +%F).md"
