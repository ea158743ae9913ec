#!/usr/bin/env bash
# bench/import.sh — 1,000,000-row bulk import against the `./dev up` cluster, unthrottled
# (a budget no replica reaches) and with a 1 s budget, reporting rows/s and the worst replica
# staleness seen during each run. Prints a markdown table and writes
# bench/results/import-<date>.md. Deletes the imported rows afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS="${ROWS:-1000000}"
eval "$(./dev cluster env | sed 's/^/export /')"
export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret 2>/dev/null || echo bench-secret-0123456789)}"
BIN=target/release/stockgate
[ -x "$BIN" ] || cargo build --release --quiet -p stockgate
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
cleanup() { psql "$DATABASE_URL" -qc "DELETE FROM products WHERE product_id LIKE 'imp-%'" >/dev/null 2>&1 || true; rm -f /tmp/stockgate-import-*.csv; }
trap cleanup EXIT
cleanup
for tag in a b; do
  say "generating $ROWS rows ($tag)"
  awk -v n="$ROWS" -v t="$tag" 'BEGIN { print "product_id,name,price_cents,available_quantity"; for (i = 0; i < n; i++) printf "imp-%s-%d,Imported %d,%d,%d\n", t, i, i, 100 + i % 900, i % 1000 }' > "/tmp/stockgate-import-$tag.csv"
done
say "unthrottled (budget 1h)"
un=$("$BIN" import --file /tmp/stockgate-import-a.csv --lag-budget 1h --batch-size 5000 2>/dev/null | tail -1)
./dev cluster wait
say "budget 1s"
th=$("$BIN" import --file /tmp/stockgate-import-b.csv --lag-budget 1s --batch-size 5000 2>/dev/null | tail -1)
rate() { sed -E 's/.*\(([0-9]+) rows\/s\).*/\1/' <<<"$1"; }
worst() { sed -E 's/.*staleness seen ([0-9]+) ms.*/\1/' <<<"$1"; }
waited() { sed -E 's/.*waited ([0-9.]+) s.*/\1/' <<<"$1"; }
out="## bulk import of $ROWS rows, $(date -u +'%Y-%m-%d %H:%M UTC')

2 cores, primary + 2 streaming replicas from ./dev up, batches starting at 5000 rows.

| run | rows/s | waited for replicas | worst replica staleness seen |
|---|---|---|---|
| unthrottled (budget 1 h) | $(rate "$un") | $(waited "$un") s | $(worst "$un") ms |
| budget 1 s | $(rate "$th") | $(waited "$th") s | $(worst "$th") ms |

raw: \`$un\`
raw: \`$th\`
"
printf '%s' "$out"
mkdir -p bench/results
printf '%s' "$out" > "bench/results/import-$(date +%F).md"
