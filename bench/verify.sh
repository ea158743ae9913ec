#!/usr/bin/env bash
# bench/verify.sh — `stockgate verify` over 1,000,000 (product, location) pairs: 250,000
# products at 4 locations, each with its opening movement, and 50,000 confirmed orders with
# allocations, loaded set-wise in SQL on a cluster of its own (devcluster, primary + 2
# streaming replicas). Runs the check routed as usual (a fresh replica) and against the
# primary alone, each under /usr/bin/time -v; prints wall time and peak RSS and writes
# bench/results/verify-<date>.md. Stops the cluster afterwards.
#
#   cargo build --release -p stockgate -p devcluster && bench/verify.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PRODUCTS="${PRODUCTS:-250000}"
ORDERS="${ORDERS:-50000}"
export STOCKGATE_DEV_DIR="${STOCKGATE_DEV_DIR:-/tmp/sg-verify}"
export STOCKGATE_DEV_PORT="${STOCKGATE_DEV_PORT:-26432}"
export STOCKGATE_DEV_REDIS_PORT="${STOCKGATE_DEV_REDIS_PORT:-26379}"
BIN=target/release/stockgate
DEVCLUSTER=target/release/devcluster
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
say "cluster in $STOCKGATE_DEV_DIR on port $STOCKGATE_DEV_PORT"
"$DEVCLUSTER" up >&2
trap '"$DEVCLUSTER" down >&2 || true' EXIT
eval "$("$DEVCLUSTER" env | grep -E '^(DATABASE_URL|STOCKGATE_REPLICA_URLS)=' | sed 's/^/export /')"
DB=verify_bench
ADMIN_URL="${DATABASE_URL%/*}/postgres"
psql "$ADMIN_URL" -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null
export DATABASE_URL="${DATABASE_URL%/*}/$DB"
export STOCKGATE_REPLICA_URLS="$(echo "$STOCKGATE_REPLICA_URLS" | sed "s#/[^/,]*\(,\|$\)#/$DB\1#g")"
"$BIN" migrate >&2

say "loading $PRODUCTS products x 4 locations, opening movements, $ORDERS confirmed orders"
load_start=$(date +%s)
psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -q <<SQL
-- This binary's sessions write levels themselves (the triggers for older writers stay out).
SET stockgate.levels = 'on';
INSERT INTO locations (location_id, name, rank) VALUES ('l1', 'One', 10), ('l2', 'Two', 20), ('l3', 'Three', 30);
-- Every level starts at 100; the first $ORDERS products have sold 2 units at l1.
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
SELECT 'b-' || i, 'Bench ' || i, 100, 400 - CASE WHEN i <= $ORDERS THEN 2 ELSE 0 END, 400
  FROM generate_series(1, $PRODUCTS) i;
INSERT INTO stock_levels (product_id, location_id, available_quantity)
SELECT 'b-' || i, l, 100 - CASE WHEN i <= $ORDERS AND l = 'l1' THEN 2 ELSE 0 END
  FROM generate_series(1, $PRODUCTS) i, unnest(ARRAY['default', 'l1', 'l2', 'l3']) l;
INSERT INTO movements (product_id, location_id, delta, reason, available_after)
SELECT product_id, location_id, 100, 'create', available_quantity FROM stock_levels;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status,
                    idempotency_key, request_fingerprint, allocations)
SELECT gen_random_uuid(), 'b-' || i, 'u' || i, 2, 100, 200, 'confirmed', 'k' || i, 'b-' || i || ':2',
       jsonb_build_array(jsonb_build_object('product_id', 'b-' || i, 'location_id', 'l1', 'quantity', 2))
  FROM generate_series(1, $ORDERS) i;
VACUUM ANALYZE;
SQL
load_s=$(( $(date +%s) - load_start ))
"$DEVCLUSTER" wait >&2
pairs=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM stock_levels")

# run LABEL REPLICAS: verify under /usr/bin/time -v; sets WALL, RSS_MB, CODE, SUMMARY
run() {
  local t; t=$(mktemp)
  say "verify: $1"
  set +e
  STOCKGATE_REPLICA_URLS="$2" /usr/bin/time -v "$BIN" verify >"$t.out" 2>"$t.err"
  CODE=$?
  set -e
  WALL=$(awk -F': ' '/Elapsed \(wall clock\)/ { print $2 }' "$t.err")
  RSS_MB=$(awk -F': ' '/Maximum resident set size/ { printf "%.1f", $2 / 1024 }' "$t.err")
  SUMMARY=$(grep '^SUMMARY' "$t.out" || echo "(no summary: $(grep -v '^\s' "$t.err" | head -3))")
  rm -f "$t" "$t.out" "$t.err"
}
run "routed (replicas configured)" "$STOCKGATE_REPLICA_URLS"
r_wall=$WALL r_rss=$RSS_MB r_code=$CODE r_sum=$SUMMARY
run "primary only" ""
p_wall=$WALL p_rss=$RSS_MB p_code=$CODE p_sum=$SUMMARY

pg=$(psql "$DATABASE_URL" -Atc "SHOW server_version")
mem=$(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
out="## stockgate verify over $pairs (product, location) pairs, $(date -u +'%Y-%m-%d %H:%M UTC')

Host: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $mem, PostgreSQL $pg;
primary + 2 streaming replicas from devcluster on this host, shared with other builds.
Data: $PRODUCTS products x 4 locations, one opening movement per pair, $ORDERS confirmed
orders with allocations (loaded set-wise in ${load_s} s, then VACUUM ANALYZE). Release build.

| run | exit | wall time | peak RSS |
|---|---|---|---|
| routed (replicas configured) | $r_code | $r_wall | $r_rss MiB |
| primary only | $p_code | $p_wall | $p_rss MiB |

raw: \`$r_sum\`
raw: \`$p_sum\`
"
printf '%s' "$out"
mkdir -p bench/results
printf '%s' "$out" > "bench/results/verify-$(date +%F).md"
