#!/usr/bin/env bash
# bench/flash.sh — benchmark a running local dev deployment (started with ./dev up) in one go:
#
#   1. hot-sku: confirmed orders/s on one hot product at 64 and 256 connections;
#   2. pgbench on the same primary: the single-order guarded UPDATE + INSERT on one hot row
#      at -c 1, 8 and 64 (the best is the yardstick for 1.);
#   3. sell-out 60 stock / 5000 buyers / 64 connections;
#   4. availability at 64 connections on one product, next to a pgbench select of that
#      product's row on replica 1 at -c 64;
#   5. peak RSS (VmHWM, since the service started) of the `stockgate serve` process.
# When wrk is installed (apt-get install wrk), rejections after a sell-out and availability are
# also driven by wrk (bench/wrk/orders.lua), a lighter load generator than loadtest.
#
# Prints one markdown table (with the ratios service ÷ pgbench) and writes it to
# bench/results/<YYYY-MM-DD>.md. Loopback only.
#
# Environment: STOCKGATE_LISTEN (where the service listens, default 127.0.0.1:8080),
# STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (the dev cluster, as for ./dev), BENCH_SECONDS (per
# step, default 10), STOCKGATE_ADMIN_TOKEN (default: ./dev token --admin), PGBENCH.
set -euo pipefail
cd "$(dirname "$0")/.."

LISTEN="${STOCKGATE_LISTEN:-127.0.0.1:8080}"
BASE_URL="http://$LISTEN"
PORT="${LISTEN##*:}"
SECS="${BENCH_SECONDS:-10}"
PGBENCH="${PGBENCH:-/usr/lib/postgresql/15/bin/pgbench}"
HOT_ROW=pgbench-hot

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'flash.sh: %s\n' "$*" >&2; exit 1; }

case "${LISTEN%:*}" in
  127.*|localhost|'[::1]') ;;
  *) die "STOCKGATE_LISTEN=$LISTEN is not a loopback address; this benchmark only loads local services" ;;
esac
command -v jq >/dev/null || die "jq is missing (apt-get install jq)"
[ -x "$PGBENCH" ] || die "pgbench not found at $PGBENCH"
curl -fsS --max-time 5 "$BASE_URL/healthz" >/dev/null \
  || die "no stockgate answering at $BASE_URL (start it with ./dev up, or set STOCKGATE_LISTEN)"

eval "$(./dev cluster env | grep -E '^(DATABASE_URL|STOCKGATE_REPLICA_URLS)=' | sed 's/^/export /')"
REPLICA_URL="${STOCKGATE_REPLICA_URLS%%,*}"
export STOCKGATE_ADMIN_TOKEN="${STOCKGATE_ADMIN_TOKEN:-$(./dev token --admin)}"

say "building loadtest (release)"
cargo build --release --quiet -p loadtest
LT="${CARGO_TARGET_DIR:-target}/release/loadtest"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A FAIL verdict (exit 1) still writes its report; only a run that could not start (exit 2)
# leaves no JSON, and its cells show n/a.
lt() {
  local name="$1"; shift
  say "loadtest $*"
  "$LT" "$@" --base-url "$BASE_URL" --json "$work/$name.json" >"$work/$name.txt" || true
  cat "$work/$name.txt" >&2
}
# j FILE FILTER: a number from a report, "n/a" when missing.
j() { jq -r "$2 // \"n/a\"" "$work/$1.json" 2>/dev/null || echo n/a; }
# fmt NUMBER [DECIMALS]
fmt() { case "$1" in n/a|null|'') echo n/a ;; *) LC_ALL=C printf "%.${2:-0}f" "$1" ;; esac; }
# ratio A B: A ÷ B to two decimals
ratio() {
  case "$1$2" in *n/a*|*null*) echo n/a ;; *) LC_ALL=C awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }' ;; esac
}
# pgb URL SCRIPT CLIENTS: tps of one pgbench run
pgb() {
  local jobs=$(( $3 < 2 ? $3 : 2 ))
  say "pgbench -c $3 -j $jobs -T $SECS -f $(basename "$2")"
  "$PGBENCH" -n -M prepared -f "$2" -c "$3" -j "$jobs" -T "$SECS" "$1" >"$work/pgb.txt" 2>&1 \
    || { cat "$work/pgb.txt" >&2; echo n/a; return; }
  local tps
  tps="$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' "$work/pgb.txt" | head -1)"
  echo "${tps:-n/a}"
}

# --- 1. hot-sku ---------------------------------------------------------------------------
lt hot64 hot-sku --seconds "$SECS" --concurrency 64
lt hot256 hot-sku --seconds "$SECS" --concurrency 256

# --- 2. pgbench: the guarded order transaction on one hot row -----------------------------
say "pgbench row $HOT_ROW on the primary"
psql "$DATABASE_URL" -qX -v ON_ERROR_STOP=1 -c "INSERT INTO products (product_id, name, price_cents, available_quantity)
    VALUES ('$HOT_ROW', 'pgbench hot row', 100, 2000000000)
    ON CONFLICT (product_id) DO UPDATE SET available_quantity = 2000000000" >/dev/null
cat >"$work/order.sql" <<SQL
\set uid random(1, 1000000000)
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1 WHERE product_id = '$HOT_ROW' AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) VALUES (gen_random_uuid(), '$HOT_ROW', 'pgb', 1, 100, 100, 'confirmed', 'pgb-' || :uid || '-' || random(), 'x');
COMMIT;
SQL
declare -A order_tps
best_tps=n/a best_c=n/a
for c in 1 8 64; do
  order_tps[$c]="$(pgb "$DATABASE_URL" "$work/order.sql" "$c")"
  if [ "${order_tps[$c]}" != n/a ] && { [ "$best_tps" = n/a ] || awk -v a="${order_tps[$c]}" -v b="$best_tps" 'BEGIN { exit !(a > b) }'; }; then
    best_tps="${order_tps[$c]}" best_c="$c"
  fi
done
psql "$DATABASE_URL" -qX -c "DELETE FROM orders WHERE product_id = '$HOT_ROW' AND user_id = 'pgb'" >/dev/null || true

# --- 3. sell-out --------------------------------------------------------------------------
lt sellout sell-out --stock 60 --buyers 5000 --concurrency 64

# --- 3b. rejections after sell-out with wrk (a lighter load generator): every request a new
#     buyer on a sold-out product; counts the primary transactions they cause.
WRK="$(command -v wrk || true)"
metric() { curl -fsS "$BASE_URL/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }
wrk_rps=n/a wrk_409=n/a wrk_txns=n/a wavail=n/a
if [ -n "$WRK" ]; then
  sold="wrk-sold-$(date +%s)"
  curl -fsS -X POST "$BASE_URL/v1/products" -H "Authorization: Bearer $STOCKGATE_ADMIN_TOKEN" -H 'Content-Type: application/json' \
    -d "{\"product_id\": \"$sold\", \"name\": \"sold out\", \"price_cents\": 100, \"available_quantity\": 60}" >/dev/null
  say "wrk: sell out $sold, then $SECS s of new buyers"
  "$WRK" -t2 -c64 -d2s -s bench/wrk/orders.lua "$BASE_URL" -- "$STOCKGATE_ADMIN_TOKEN" "$sold" >/dev/null
  before="$(metric stockgate_order_transactions_total)"
  "$WRK" -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$BASE_URL" -- "$STOCKGATE_ADMIN_TOKEN" "$sold" >"$work/wrk-sold.txt"
  cat "$work/wrk-sold.txt" >&2
  wrk_txns=$(( $(metric stockgate_order_transactions_total) - before ))
  wrk_rps="$(awk '/^Requests\/sec:/ { print $2 }' "$work/wrk-sold.txt")"
  wrk_409="$(awk '/^status 409:/ { print $3 }' "$work/wrk-sold.txt")"
  wrk_p50="$(awk '$1 == "50%" { print $2 }' "$work/wrk-sold.txt")" wrk_p99="$(awk '$1 == "99%" { print $2 }' "$work/wrk-sold.txt")"
  say "wrk: availability, $SECS s at 64 connections"
  "$WRK" -t2 -c64 -d"${SECS}s" --latency "$BASE_URL/v1/products/$HOT_ROW/availability?qty=1" >"$work/wrk-avail.txt"
  cat "$work/wrk-avail.txt" >&2
  wavail="$(awk '/^Requests\/sec:/ { print $2 }' "$work/wrk-avail.txt")"
  wa_p50="$(awk '$1 == "50%" { print $2 }' "$work/wrk-avail.txt")" wa_p99="$(awk '$1 == "99%" { print $2 }' "$work/wrk-avail.txt")"
fi

# --- 4. availability vs a select of the same row on a replica -----------------------------
lt avail availability --seconds "$SECS" --concurrency 64 --product-id "$HOT_ROW"
cat >"$work/select.sql" <<SQL
SELECT available_quantity FROM products WHERE product_id = '$HOT_ROW';
SQL
select_tps="$(pgb "$REPLICA_URL" "$work/select.sql" 64)"

# --- 5. peak RSS of the service -----------------------------------------------------------
pid="$(ss -ltnpH "sport = :$PORT" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1)"
if [ -z "$pid" ]; then
  pids="$(pgrep -f 'stockgate serve' || true)"
  [ "$(printf '%s\n' "$pids" | grep -c .)" = 1 ] && pid="$pids"
fi
rss=n/a
if [ -n "$pid" ] && [ -r "/proc/$pid/status" ]; then
  rss="$(awk '/^VmHWM:/ { printf "%.1f MiB", $2 / 1024 }' "/proc/$pid/status")"
fi

# --- the table ----------------------------------------------------------------------------
ms() { case "$1" in n/a) echo n/a ;; *) echo "$(fmt "$1" 1) ms" ;; esac; }
hot64="$(j hot64 .confirmed_per_s)" hot256="$(j hot256 .confirmed_per_s)"
avail="$(j avail .requests_per_s)"
day="$(date +%F)"
out="bench/results/$day.md"
mkdir -p bench/results
{
  echo "## stockgate flash benchmark, $day"
  echo
  echo "repo at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, ${SECS} s per step, service $BASE_URL (pid ${pid:-?}); pgbench -M prepared -j 2 on the same machine."
  echo
  echo "| measurement | result | p50 | p99 | errors | service ÷ pgbench |"
  echo "| --- | --- | --- | --- | --- | --- |"
  echo "| hot-sku, 64 connections | $(fmt "$hot64") orders/s | $(ms "$(j hot64 .latency.p50_ms)") | $(ms "$(j hot64 .latency.p99_ms)") | $(j hot64 .errors_total) | $(ratio "$hot64" "$best_tps") |"
  echo "| hot-sku, 256 connections | $(fmt "$hot256") orders/s | $(ms "$(j hot256 .latency.p50_ms)") | $(ms "$(j hot256 .latency.p99_ms)") | $(j hot256 .errors_total) | $(ratio "$hot256" "$best_tps") |"
  for c in 1 8 64; do
    mark=""; [ "$c" = "$best_c" ] && mark=" (best)"
    echo "| pgbench guarded UPDATE+INSERT, primary, -c $c$mark | $(fmt "${order_tps[$c]}") tps | | | | |"
  done
  echo "| sell-out 60 / 5000 buyers / 64: time to sell out | $(ms "$(j sellout .timing.time_to_sell_out_ms)") | | | $(j sellout .orders.errors_total) | |"
  echo "| sell-out: rejections after sell-out | $(fmt "$(j sellout .timing.rejections_per_s_after_sell_out)")/s | $(ms "$(j sellout .latency.orders_rejected_after_sell_out.p50_ms)") | $(ms "$(j sellout .latency.orders_rejected_after_sell_out.p99_ms)") | | |"
  echo "| sell-out: everyone answered / oversold | $(ms "$(j sellout .timing.total_ms)") / $(j sellout .oversold) | | | | |"
  echo "| rejections after sell-out, wrk, 64 connections | $(fmt "$wrk_rps")/s (409: $wrk_409) | ${wrk_p50:-n/a} | ${wrk_p99:-n/a} | | primary transactions caused: $wrk_txns |"
  echo "| availability, wrk, 64 connections | $(fmt "$wavail") req/s | ${wa_p50:-n/a} | ${wa_p99:-n/a} | | $(ratio "$wavail" "$select_tps") |"
  echo "| availability, 64 connections | $(fmt "$avail") req/s | $(ms "$(j avail .latency.p50_ms)") | $(ms "$(j avail .latency.p99_ms)") | $(j avail .errors_total) | $(ratio "$avail" "$select_tps") |"
  echo "| availability: max stale_by_ms / replica answers > 250 ms | $(j avail .max_stale_by_ms) ms / $(j avail .replica_answers_over_limit) | | | | |"
  echo "| pgbench select of the row, replica 1, -c 64 | $(fmt "$select_tps") tps | | | | |"
  echo "| service peak RSS (VmHWM) | $rss | | | | |"
} >"$work/table.md"
cp "$work/table.md" "$out"
cat "$out"
say "written to $out"
