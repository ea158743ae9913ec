#!/usr/bin/env bash
# bench/profile.sh — where a running stockgate spends its CPU under one load, as a flamegraph.
#
#   bench/profile.sh hot-sku|availability NAME
#
# Loads the service at $STOCKGATE_LISTEN with wrk -t2 -c64 (orders with unique keys on one
# hot product, or availability of that product) and samples the `stockgate serve` process
# with perf (cpu-clock: this VM has no hardware counters; DWARF unwinding: release builds
# keep no frame pointers). Writes bench/results/flame-NAME.svg. Needs perf (linux-perf),
# wrk and inferno (cargo install inferno).
#
# Environment: STOCKGATE_LISTEN (default 127.0.0.1:8080), STOCKGATE_ADMIN_TOKEN (default
# ./dev token --admin), PRODUCT (default pgbench-hot, created if missing), SECONDS_ (6).
set -euo pipefail
cd "$(dirname "$0")/.."
load="${1:?hot-sku or availability}" name="${2:?a name for the SVG}"
LISTEN="${STOCKGATE_LISTEN:-127.0.0.1:8080}" BASE_URL="http://${STOCKGATE_LISTEN:-127.0.0.1:8080}"
PRODUCT="${PRODUCT:-pgbench-hot}" SECS="${SECONDS_:-6}"
ADMIN="${STOCKGATE_ADMIN_TOKEN:-$(./dev token --admin)}"
pid="$(ss -ltnpH "sport = :${LISTEN##*:}" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1)"
[ -n "$pid" ] || { echo "profile.sh: nothing listens on $LISTEN" >&2; exit 1; }
curl -fsS -o /dev/null -X POST "$BASE_URL/v1/products" -H "Authorization: Bearer $ADMIN" \
  -H 'Content-Type: application/json' \
  -d "{\"product_id\":\"$PRODUCT\",\"name\":\"hot\",\"price_cents\":100,\"available_quantity\":2000000000}" || true
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
case "$load" in
  hot-sku) wrk -t2 -c64 -d"$((SECS + 2))s" -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$PRODUCT" >"$work/wrk.txt" & ;;
  availability) wrk -t2 -c64 -d"$((SECS + 2))s" "$BASE_URL/v1/products/$PRODUCT/availability?qty=1" >"$work/wrk.txt" & ;;
  *) echo "profile.sh: unknown load $load" >&2; exit 2 ;;
esac
sleep 1
perf record -q -F 250 --call-graph dwarf,16384 -p "$pid" -o "$work/perf.data" -- sleep "$SECS" 2>/dev/null
wait
grep -E 'Requests/sec' "$work/wrk.txt" >&2
mkdir -p bench/results
perf script -i "$work/perf.data" 2>/dev/null | inferno-collapse-perf >"$work/folded"
inferno-flamegraph --title "stockgate $load ($name): $(grep -E 'Requests/sec' "$work/wrk.txt")" \
  <"$work/folded" >"bench/results/flame-$name.svg"
cp "$work/folded" "/tmp/flame-$name.folded"
echo "bench/results/flame-$name.svg" >&2
