# bench/lib.sh — what the benchmark scripts share; sourced, not run.

# wrk_ms FILE QUANTILE: a latency quantile ("50%", "99%") of wrk --latency's output, in ms
wrk_ms() {
  awk -v q="$2" '$1 == q {
      v = $2; if (v ~ /us$/) { sub(/us$/, "", v); v /= 1000 } else if (v ~ /ms$/) sub(/ms$/, "", v); else if (v ~ /s$/) { sub(/s$/, "", v); v *= 1000 }
      print v }' "$1"
}

# host_line DIR: the host a run came from: its cores, CPU model, and the time of one 8 kB write
# with fdatasync on DIR's disk (pg_test_fsync, one second a method), the figure group commit's
# edge depends on (a fast disk makes CPU per order decide)
host_line() {
  local us
  us="$(/usr/lib/postgresql/15/bin/pg_test_fsync -s 1 -f "$1/pg_test_fsync.tmp" 2>/dev/null |
    awk '/using one 8kB write/ { one = 1 } one && !done && $1 == "fdatasync" { print $(NF - 1); done = 1 }')" || true
  rm -f "$1/pg_test_fsync.tmp"
  echo "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), one 8 kB write + fdatasync ${us:-?} µs (pg_test_fsync)$(case "${BENCH_FSYNC_OFF:-0}" in 1) echo "; fsync OFF on every node (BENCH_FSYNC_OFF, bench only)" ;; replicas) echo "; fsync OFF on the two replicas, on on the primary (BENCH_FSYNC_OFF=replicas, bench only)" ;; esac)"
}

# fsync_all on|off: sets fsync on every node of the dev cluster ($BASE_URL and $REPLICAS), or on
# the replicas only when BENCH_FSYNC_OFF=replicas, and reloads it. Only for BENCH_FSYNC_OFF
# (bench_setup): 1 shows the fast-disk limit, where CPU per order decides; `replicas` shows what
# the replicas' flushes, which on one host share the primary's disk, add to its commits. With
# fsync off a crash can lose or corrupt committed data, so the product, its tests and `./dev up`
# never turn it off, and this turns it back on at exit.
fsync_all() {
  local url primary="$BASE_URL/postgres"
  [ "${BENCH_FSYNC_OFF:-0}" != replicas ] || primary=""
  for url in $primary $(echo "$REPLICAS" | tr ',' '\n' | sed 's#/[^/]*$#/postgres#'); do
    psql "$url" -qAt -c "ALTER SYSTEM SET fsync = $1" -c "SELECT pg_reload_conf()" >/dev/null
  done
}

# metric_at BASE_URL NAME: a metric's value from a service's /metrics
metric_at() { curl -fsS "$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }

# wait_healthy BASE_URL [SECONDS]: waits up to SECONDS (default 10) for /healthz to answer;
# fails if it never does
wait_healthy() {
  local _
  for _ in $(seq $((${2:-10} * 10))); do
    curl -fsS -o /dev/null "$1/healthz" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# order_load LOAD: the order loads that bench/ab.sh and bench/svc-cost.sh drive with
# bench/wrk/orders.lua: sets `args` (the script's arguments after the token), `products` (a
# SELECT of product_id, name, price_cents, available_quantity, stated_quantity that stocks
# them) and HOT (the hot product's id, for `hot`). `hot`: one product of 2·10⁹ units;
# `spread`: 1,000 products of 10⁸ units, each order one at random; `carts`: three-line carts
# over 20 products of 10⁸ units. Fails on any other LOAD.
order_load() {
  case "$1" in
    hot) HOT=ab-hot; args=("$HOT"); products="SELECT '$HOT', 'ab hot row', 100, 2000000000, 2000000000" ;;
    spread) args=(spread- 1000); products="SELECT 'spread-' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, 1000) g" ;;
    carts) args=(cart- 20 3); products="SELECT 'cart-' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, 20) g" ;;
    *) return 1 ;;
  esac
}

# quantile_ms BASE_URL HISTOGRAM Q: quantile Q (0.5, 0.99) of a histogram on a service's
# /metrics since it started, in ms, by linear interpolation inside the bucket that holds it
quantile_ms() {
  curl -fsS "$1/metrics" | LC_ALL=C awk -v m="${2}_bucket" -v q="$3" '
    index($1, m "{") == 1 { le = $1; sub(/.*le="/, "", le); sub(/".*/, "", le); n++; b[n] = le; c[n] = $2 }
    END {
      if (n == 0 || c[n] == 0) { print "-"; exit }
      want = q * c[n]; lo = 0; below = 0
      for (i = 1; i <= n; i++) {
        if (c[i] >= want) {
          if (b[i] == "+Inf") { printf ">%.1f\n", lo * 1000; exit }
          printf "%.1f\n", (lo + (b[i] - lo) * (want - below) / (c[i] - below)) * 1000; exit
        }
        lo = b[i]; below = c[i]
      }
    }'
}

# dev_cluster_env: exports the dev cluster's DATABASE_URL, STOCKGATE_REPLICA_URLS and
# STOCKGATE_REDIS_URL (./dev up, or the cluster up, must have run)
dev_cluster_env() {
  eval "$(./dev cluster env | grep -E '^(DATABASE_URL|STOCKGATE_REPLICA_URLS|STOCKGATE_REDIS_URL)=' | sed 's/^/export /')"
}

# replicas_on URLS DB: the comma-separated replica URLS, each pointed at database DB
replicas_on() { echo "$1" | sed "s#/[^/,]*\(,\|$\)#/$2\1#g"; }

# bench_service_env PORT: the dev cluster's environment (dev_cluster_env), the token secret,
# STOCKGATE_LISTEN on PORT; sets ADMIN (an admin token, by $BIN), BASE_URL (the primary's URL
# without a database), REPLICAS (the replicas' URLs) and URL (the service's base URL)
bench_service_env() {
  dev_cluster_env
  export STOCKGATE_TOKEN_SECRET="${STOCKGATE_TOKEN_SECRET:-$(cat .dev/token-secret)}"
  export STOCKGATE_LISTEN="127.0.0.1:$1"
  ADMIN="$(STOCKGATE_TOKEN_SECRET="$STOCKGATE_TOKEN_SECRET" "$BIN" token --admin)"
  BASE_URL="${DATABASE_URL%/*}"
  REPLICAS="$STOCKGATE_REPLICA_URLS"
  URL="http://$STOCKGATE_LISTEN"
}

# median: the median of the numbers on stdin, one a line ("-" when there are none; other
# lines are ignored)
median() { grep -E '^-?[0-9.]+$' | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "-"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# new_unanalyzed_db DB: creates database DB on the dev cluster ($BASE_URL), migrates it with
# $BIN, and turns autovacuum off on every table, so it stays as a new deployment's: never
# analyzed (bench_service_env must have run)
new_unanalyzed_db() {
  psql "$BASE_URL/postgres" -qc "CREATE DATABASE $1" >/dev/null
  DATABASE_URL="$BASE_URL/$1" "$BIN" migrate >/dev/null
  psql "$BASE_URL/$1" -q >/dev/null <<'SQL'
DO $$ DECLARE t text; BEGIN
  FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' LOOP
    EXECUTE format('ALTER TABLE %I SET (autovacuum_enabled = off)', t);
  END LOOP;
END $$;
SQL
}

# pgbench_best DB SCRIPT SECONDS: pgbench -j2 running SCRIPT on database DB ($BASE_URL) at -c8,
# -c32 and -c64 for SECONDS each; prints each count's tps to stderr and the best to stdout.
# With PGB_CPU set (a file), writes there the best run's CPU per transaction in µs: the
# primary's (its postmaster and every child, replication included) and pgbench's own.
pgbench_best() {
  local best=0 c out tps txns pg0 pg1 secs cpu=""
  for c in 8 32 64; do
    pg0="$(node_ticks primary)"
    out="$( { TIMEFORMAT='%3U %3S'; time pgbench -n -j2 -c"$c" -T"$3" -f "$2" "$BASE_URL/$1" 2>/dev/null; } 2>&1 )" || true
    pg1="$(node_ticks primary)"
    tps="$(awk '/^tps/ { print int($3) }' <<<"$out")"
    txns="$(awk '/actually processed/ { print $NF }' <<<"$out")"
    secs="$(tail -1 <<<"$out" | awk '{ print $1 + $2 }')"
    echo "  pgbench -c$c: $tps tps" >&2
    if [ "${tps:-0}" -gt "$best" ]; then
      best="$tps"
      cpu="$(LC_ALL=C awk -v pg="$((pg1 - pg0))" -v t="${txns:-0}" -v s="${secs:-0}" -v us="$TICK_US" \
        'BEGIN { if (t > 0) printf "%.1f %.1f", pg * us / t, s * 1e6 / t; else print "0 0" }')"
    fi
  done
  [ -z "${PGB_CPU:-}" ] || echo "${cpu:-0 0}" >"$PGB_CPU"
  echo "$best"
}

# range: the smallest and the largest of the numbers on stdin, as "lo–hi"
range() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%s–%s", lo, hi }'; }

# bench_setup NAME PORT [TOOL…]: the common start of a benchmark (NAME, for its messages, as
# `fresh.sh scale`) that serves on PORT: ROUNDS (3), SECS (BENCH_SECONDS, 8) and BIN
# (STOCKGATE_BIN, target/release/stockgate); wrk, each TOOL and BIN checked; bench_service_env;
# stamp (the start's time, for database names); work (a directory of its own) and pid (the
# service's, once started), which an EXIT trap stops and removes.
bench_setup() {
  local name="$1" tool
  ROUNDS="${ROUNDS:-3}"
  SECS="${BENCH_SECONDS:-8}"
  PORT="$2"
  BIN="${STOCKGATE_BIN:-target/release/stockgate}"
  for tool in wrk "${@:3}"; do
    command -v "$tool" >/dev/null || { echo "$name: $tool is missing (apt-get install wrk postgresql-contrib)" >&2; exit 1; }
  done
  [ -x "$BIN" ] || { echo "$name: $BIN is missing (cargo build --release)" >&2; exit 1; }
  bench_service_env "$PORT"
  [ "${BENCH_FSYNC_OFF:-0}" = 0 ] || fsync_all off
  stamp="$(date -u +%H%M%S)"
  work="$(mktemp -d)"
  pid=""
  trap bench_cleanup EXIT
}
bench_cleanup() {
  [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
  stop_instances
  [ "${BENCH_FSYNC_OFF:-0}" = 0 ] || fsync_all on
  rm -rf "$work"
}

# hot_product_db DB [N]: a new never-analyzed database DB (new_unanalyzed_db) holding one
# product, `hot`, of 10^8 units at 100 cents, and N more like it, `hot-0` … `hot-<N-1>`
hot_product_db() {
  new_unanalyzed_db "$1"
  psql "$BASE_URL/$1" -qc "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
    SELECT 'hot' || coalesce('-' || g, ''), 'a hot one', 100, 100000000, 100000000
      FROM (SELECT NULL::int UNION ALL SELECT generate_series(0, ${2:-0} - 1)) AS s (g)" >/dev/null
}

# rounds FN SHAPE…: $ROUNDS rounds of `FN SHAPE ROUND` for each SHAPE, their order rotating from
# round to round; FN's output lines go to $work/rows and to stderr
rounds() {
  local fn="$1" r k i
  shift
  for r in $(seq "$ROUNDS"); do
    for k in $(seq 0 $(($# - 1))); do
      i=$(( (k + r - 1) % $# + 1 ))
      "$fn" "${!i}" "$r" | tee -a "$work/rows" >&2
    done
  done
}

# The instances a script started (start_instances); stop_instances stops them, as does
# bench_setup's exit.
instance_pids=()

# start_instances DB N PEERS: N `$BIN serve` on database DB ($BASE_URL, replicas $REPLICAS) at
# 127.0.0.1:$PORT, $PORT+1, …, logging to $work/serve-I.log; peers of one another
# (STOCKGATE_PEERS on ports $PORT+50, …) when PEERS is 1 and N > 1. Returns once each is healthy.
start_instances() {
  local db="$1" n="$2" peers="" i
  if [ "$n" -gt 1 ] && [ "$3" = 1 ]; then
    for i in $(seq 0 $((n - 1))); do peers="$peers${peers:+,}http://127.0.0.1:$((PORT + 50 + i))"; done
  fi
  for i in $(seq 0 $((n - 1))); do
    DATABASE_URL="$BASE_URL/$db" STOCKGATE_REPLICA_URLS="$(replicas_on "$REPLICAS" "$db")" \
      STOCKGATE_PEERS="$peers" STOCKGATE_PEER_URL="${peers:+http://127.0.0.1:$((PORT + 50 + i))}" \
      STOCKGATE_LISTEN="127.0.0.1:$((PORT + i))" "$BIN" serve >"$work/serve-$i.log" 2>&1 &
    instance_pids+=($!)
  done
  for i in $(seq 0 $((n - 1))); do
    wait_healthy "http://127.0.0.1:$((PORT + i))" || { cat "$work/serve-$i.log" >&2; exit 1; }
  done
}

stop_instances() {
  local p
  for p in "${instance_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${instance_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  instance_pids=()
}

# load_instances N [OWN] [TOTAL]: one `wrk -t1` per started instance (TOTAL, default 64, / N
# connections each, $SECS s,
# every request a new buyer and key for `hot`, or with OWN = 1 for instance I's own product
# `hot-I`: bench/wrk/orders.lua), all at once; with LOAD_RATE (orders a second in all), each
# sends LOAD_RATE / N a second whatever the latency (an open arrival rate, orders.lua's
# WRK_RATE) instead of a request per connection as each answer comes; prints "orders/s p99"
# (201s only; the worst instance's p99, ms)
load_instances() {
  local n="$1" i loads=() p99=0 v product=hot total="${3:-64}" rate=()
  [ -z "${LOAD_RATE:-}" ] || rate=("WRK_RATE=$((LOAD_RATE / n))")
  for i in $(seq 0 $((n - 1))); do
    [ "${2:-0}" != 1 ] || product="hot-$i"
    env "${rate[@]}" wrk -t1 -c$((total / n)) -d"${SECS}s" --latency -s bench/wrk/orders.lua \
      "http://127.0.0.1:$((PORT + i))" -- "$ADMIN" "$product" >"$work/wrk-$i.txt" &
    loads+=($!)
  done
  wait "${loads[@]}"
  for i in $(seq 0 $((n - 1))); do
    v="$(wrk_ms "$work/wrk-$i.txt" 99%)"
    p99="$(LC_ALL=C awk -v a="$p99" -v b="$v" 'BEGIN { print (b > a ? b : a) }')"
  done
  for i in $(seq 0 $((n - 1))); do cat "$work/wrk-$i.txt"; done \
    | LC_ALL=C awk -v s="$SECS" -v p="$p99" '/^status 201:/ { ok += $3 } END { printf "%.0f %.2f\n", ok / s, p }'
  rm -f "$work"/wrk-*.txt
}

# cpu_ticks PID: utime + stime of a process, of its children (nginx's workers, a postmaster's
# backends) and of the children it has reaped (cutime + cstime), in clock ticks. The reaped
# count is what makes a before and an after of a load true for children that live only inside
# it: pgbench's backends connect after the before and exit before the after, and until
# 2026-12-07 their CPU was counted nowhere (bench/results/README.md, "pgbench's backends").
# A child that exits in between moves its whole time into its parent's reaped count, and the
# part counted in the before as its own is taken off again, so nothing is counted twice.
cpu_ticks() {
  local p t=0
  for p in "$1" $(pgrep -P "$1" || true); do t=$(( t + $(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0) )); done
  echo $(( t + $(awk '{ print $16 + $17 }' "/proc/$1/stat" 2>/dev/null || echo 0) ))
}
TICK_US=$(( 1000000 / $(getconf CLK_TCK) ))

# node_ticks NODE: CPU ticks of a dev-cluster node's postmaster and its children
node_ticks() {
  local pm; pm="$(head -1 "${STOCKGATE_DEV_DIR:-/tmp/stockgate-dev}/$1/postmaster.pid" 2>/dev/null)" || { echo 0; return; }
  cpu_ticks "$pm"
}

# node_ticks_by_pid NODE: "pid kind ticks" for a node's postmaster and each child, the kind
# from the process title (backend for a client connection), and a line `reaped` for the
# children the postmaster has reaped (cpu_ticks): a before and an after of a load, joined by
# pid, say where the node's CPU went (ticks_by_kind: a process that exits in between is
# counted under `reaped`, its time during the load)
node_ticks_by_pid() {
  local pm p kind; pm="$(head -1 "${STOCKGATE_DEV_DIR:-/tmp/stockgate-dev}/$1/postmaster.pid" 2>/dev/null)" || return 0
  echo "reaped-$pm reaped $(awk '{ print $16 + $17 }' "/proc/$pm/stat" 2>/dev/null || echo 0)"
  for p in "$pm" $(pgrep -P "$pm" || true); do
    kind="$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | sed -E 's/^postgres: //; s/ +$//')"
    case "$kind" in
      walsender*) kind=walsender ;; "autovacuum worker"*) kind=autovacuum ;;
      */*|postgres\ -D*|*" -D "*) kind=postmaster ;;
      *\(*\)*|*"[local]"*) kind=backend ;;
    esac
    echo "$p ${kind// /-} $(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)"
  done
}

# ticks_by_kind BEFORE AFTER: each kind's ticks between two node_ticks_by_pid snapshots, as
# "kind=ticks …"
ticks_by_kind() {
  awk 'NR == FNR { t0[$1] = $3; next } { d[$2] += $3 - t0[$1]; seen[$1] = 1 }
       END { for (p in t0) if (!(p in seen)) d["reaped"] -= t0[p]; for (k in d) printf "%s=%d ", k, d[k]; print "" }' "$1" "$2"
}

# -- a revision's order batch statement, for sql-cost.sh and wal-cost.sh -------------------

# revision_db REV DIR PSQL…: applies REV's migrations (unpacked under DIR) through the psql
# command PSQL… (connection and database included) and stocks that database with one hot
# product, `hot`, and 1,000 quiet ones, `p0001` … `p1000`; prints its newest batch function
revision_db() {
  local rev="$1" dir="$2" f
  shift 2
  mkdir -p "$dir" && git archive "$rev" migrations | tar -x -C "$dir"
  for f in "$dir"/migrations/*.sql; do
    if head -1 "$f" | grep -q -- '-- no-transaction'; then "$@" -f "$f" >/dev/null
    else "$@" -1 -f "$f" >/dev/null; fi
  done
  "$@" -c "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
      SELECT 'hot', 'Hot', 100, 2000000000, 2000000000
      UNION ALL SELECT 'p' || lpad(i::text, 4, '0'), 'P', 100, 1000000000, 1000000000 FROM generate_series(1, 1000) i" >/dev/null
  "$@" -At -c "SELECT proname FROM pg_proc WHERE proname LIKE 'take\_order\_batches\_v%' ORDER BY substring(proname FROM '[0-9]+\$')::int DESC LIMIT 1"
}

# batch_statement FN SHAPE SELECT: one statement calling batch function FN (v5 and later take
# the requests' locations, here none) with SELECT as its select list (`t.*`, `count(*)`):
# `hot`, HOT (36) orders of one unit for `hot`, a batch as the hot product's worker sends it;
# `spread`, SPREAD (24) products at random, one order each, a combined statement as the
# 1,000-product load sends it; `plain`, no batch function: SPREAD of pgbench's plain one-order
# transactions (bench/fresh.sh spread's: BEGIN, the guarded UPDATE, the order's INSERT,
# COMMIT, each statement parsed and planned, as pgbench's simple protocol does), each on a
# product at random, the yardstick of issue #49's point 2; `bare`, the same with the schema's
# triggers off (`session_replication_role = replica`: no level follows the count, no event, no
# check that the product exists; not a valid writer, only a bound on what the triggers cost).
# Every order a new buyer and key.
batch_statement() {
  local fn="$1" extra=""
  case "$fn" in take_order_batches_v[1-4]) ;; *) extra=", '{}'::text[], '{}'::int[]" ;; esac
  case "$2" in
    hot) echo "SELECT $3 FROM (SELECT array_agg(gen_random_uuid()) ids, array_agg('u' || (random() * 1e12)::bigint) us, array_agg(md5(random()::text)) ks, array_agg(1) q, array_agg(md5(random()::text)) fps FROM generate_series(1, ${HOT:-36})) a, $fn(ARRAY['hot'], ARRAY[${HOT:-36}], a.ids, a.us, a.ks, a.q, a.fps$extra) t;" ;;
    spread) echo "SELECT $3 FROM (SELECT array_agg(p ORDER BY p COLLATE \"C\") ps, array_agg(n::int ORDER BY p COLLATE \"C\") ends, array_agg(gen_random_uuid()) ids, array_agg('u' || (random() * 1e12)::bigint) us, array_agg(md5(random()::text)) ks, array_agg(1) q, array_agg(md5(random()::text)) fps FROM (SELECT p, row_number() OVER (ORDER BY p COLLATE \"C\") n FROM (SELECT DISTINCT 'p' || lpad((1 + floor(random() * 1000))::int::text, 4, '0') p FROM generate_series(1, ${SPREAD:-24})) d) x) a, $fn(a.ps, a.ends, a.ids, a.us, a.ks, a.q, a.fps$extra) t;" ;;
    plain|bare) LC_ALL=C awk -v n="${SPREAD:-24}" -v q="'" -v bare="$([ "$2" = bare ] && echo 1)" 'BEGIN { srand(); for (i = 0; i < n; i++) {
        p = q sprintf("p%04d", 1 + int(rand() * 1000)) q
        print "BEGIN;"
        if (bare) print "SET LOCAL session_replication_role = replica;"
        print "UPDATE products SET available_quantity = available_quantity - 1, updated_at = clock_timestamp() WHERE product_id = " p " AND available_quantity >= 1;"
        print "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) VALUES (gen_random_uuid(), " p ", " q "pgb-1" q ", 1, 100, 100, " q "confirmed" q ", md5(random()::text), " q "spread:1" q ");"
        print "COMMIT;" } }' ;;
    *) echo "batch_statement: unknown shape $2" >&2; return 2 ;;
  esac
}
