#!/usr/bin/env bash
# bench/waits.sh — where the primary's time goes under the hot-SKU load: wait-event sampling.
#
#   bench/waits.sh NAME
#
# Loads the running service at $STOCKGATE_LISTEN with wrk -t2 -c64 (orders with unique keys
# on one hot product, bench/wrk/orders.lua) and, meanwhile, samples pg_stat_activity on the
# primary about every 2 ms from one session: every non-idle backend's state and wait event.
# The sampler writes nothing and commits after every sample, so it holds back no vacuum and
# flushes no WAL. A flamegraph (bench/profile.sh) says where the service's CPU goes; this
# says where a batch's wall time goes on the database side: running (CPU, or waiting for
# one), flushing WAL (IO WALSync), waiting for the client's next statement (Client
# ClientRead, a round trip), waiting for a lock.
#
# Prints a table, also appended to bench/results/waits-<YYYY-MM-DD>.md.
# Needs wrk and psql. Environment: STOCKGATE_LISTEN (default 127.0.0.1:8080),
# STOCKGATE_ADMIN_TOKEN (default ./dev token --admin), BENCH_SECONDS (default 8).
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:?a name for this run}"
BASE_URL="http://${STOCKGATE_LISTEN:-127.0.0.1:8080}"
SECS="${BENCH_SECONDS:-8}"
ADMIN="${STOCKGATE_ADMIN_TOKEN:-$(./dev token --admin)}"
eval "$(./dev cluster env | grep -E '^DATABASE_URL=' | sed 's/^/export /')"
svc="$(ss -ltnpH "sport = :${BASE_URL##*:}" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1)"
[ -n "$svc" ] || { echo "waits.sh: nothing listens on $BASE_URL (start it with ./dev up)" >&2; exit 1; }
product="waits-$name-$(date +%s)"
psql "$DATABASE_URL" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity)
  VALUES ('$product', 'wait sampling', 100, 2000000000)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
samples=$((SECS * 400))
# One sample: every busy backend but this one (background processes in their idle loops
# excluded), as text lines kept in a variable until the end.
psql "$DATABASE_URL" -qAt >"$work/samples" <<SQL &
CREATE TEMP TABLE s (line text);
DO \$\$
DECLARE acc text[] := '{}';
BEGIN
  FOR i IN 1..$samples LOOP
    acc := acc || ARRAY(
      SELECT backend_type || '|' || coalesce(state, '-') || '|'
             || coalesce(wait_event_type || ':' || wait_event, 'running') || '|'
             || CASE WHEN backend_type = 'client backend'
                     THEN regexp_replace(left(query, 24), '\s+', ' ', 'g') ELSE '' END
        FROM pg_stat_activity
       WHERE pid <> pg_backend_pid() AND coalesce(state, '') <> 'idle'
         AND coalesce(wait_event, '') NOT IN ('WalSenderMain', 'CheckpointerMain',
             'BgWriterHibernate', 'BgWriterMain', 'AutoVacuumMain', 'LogicalLauncherMain',
             'WalWriterMain', 'ArchiverMain'));
    COMMIT;
    PERFORM pg_sleep(0.002);
  END LOOP;
  INSERT INTO s SELECT unnest(acc);
  INSERT INTO s VALUES ('#samples|' || $samples);
END
\$\$;
SELECT line FROM s;
SQL
sampler=$!
wrk -t2 -c64 -d"${SECS}s" --latency -s bench/wrk/orders.lua "$BASE_URL" -- "$ADMIN" "$product" >"$work/wrk.txt"
wait "$sampler"
rps="$(awk '/Requests\/sec/ {print $2}' "$work/wrk.txt")"
p99="$(awk '$1 == "99%" {print $2}' "$work/wrk.txt")"
total="$(awk -F'|' '$1 == "#samples" {print $2}' "$work/samples")"
{
  echo "### $name ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  echo "The service: \`$(readlink "/proc/$svc/exe" 2>/dev/null || echo '?')\` (pid $svc), the tree at $(git rev-parse --short HEAD)."
  echo
  echo "wrk -t2 -c64 -d${SECS}s hot SKU: $rps orders/s, p99 $p99. $total samples of the primary's busy backends, ~2 ms apart."
  echo "\"share\": of all samples, how often a backend was in that state (a backend busy all the time is 100 %)."
  echo
  echo "| process | state | running or waiting on | statement | share |"
  echo "| --- | --- | --- | --- | --- |"
  grep -v '^#samples' "$work/samples" | sort | uniq -c | sort -rn | head -14 \
    | awk -v total="$total" '{ n = $1; $1 = ""; sub(/^ /, ""); split($0, f, "|");
        printf "| %s | %s | %s | %s | %.1f %% |\n", f[1], f[2], f[3], f[4], 100 * n / total }'
  echo
} | tee -a "bench/results/waits-$(date -u +%Y-%m-%d).md"
