#!/usr/bin/env bash
# bench/fresh.sh SHAPE — one load shape on a fresh deployment, in rounds: each round (or each
# run, for cpu and rows) gets a database of its own on the dev cluster (./dev up, or the
# cluster up, must have run), migrated and never analyzed (autovacuum off on its tables),
# seeded for the shape and dropped after it; the steps of a round rotate from round to round.
# Prints a row per round (per run for cpu and rows) and the medians with min–max, and appends
# them to bench/results/SHAPE-<date>.md.
#
#   shape    port   what a round measures
#   scale    18400  one hot product through 1, 2 and 4 instances (64 connections in total,
#                   one `wrk -t1` per instance), and pgbench's best on the same row: the
#                   guarded UPDATE … WHERE available_quantity >= 1, the order's INSERT, COMMIT;
#                   the ratios 2 ÷ 1, 4 ÷ 1 and 1 ÷ pgbench; one instance's CPU per order
#                   beside pgbench's per transaction, as spread's
#   spread   18396  orders spread over 1,000 products (`spread-1` …) at random, one instance
#                   under `wrk -t2 -c64`, against pgbench's best running the same one-order
#                   transaction over the same rows; the primary transactions per order
#                   the service ran (`stockgate_order_transactions_total`); and CPU per order
#                   side by side: the service's process and the primary's (its postmaster and
#                   every child), against pgbench's own and the primary's per transaction of
#                   pgbench's best run (issue #49: primary ÷ both ≤ 1, service + primary ≤ 1.5)
#   carts    18397  three-line carts over 20 products (`cart-1` …), one instance under
#                   `wrk -t2 -c64`, against pgbench's best running the same cart transaction
#                   with its rows locked in byte order (the lock order every transaction of
#                   the service shares); CPU per cart side by side, as for spread
#   mix      18398  a product `hot` and 1,000 quiet ones on one instance, `wrk -t1 -c32` each:
#                   hot alone, quiet alone, both at once (64 connections); mixed ÷ alone per
#                   class, so neither may starve the other; for every run the machine's idle
#                   share and its CPU per order (every process on the host), the largest ratio
#                   both classes could keep at once at their CPU per order alone, and each
#                   class mixed ÷ what half the machine sells of it alone
#   drops    18390  a flash drop's rules: `drops-free` (no rules), `drops-lim`
#                   (max_per_customer 2) and `drops-soon` (sale_starts_at a day ahead) in
#                   turns on one instance; answers/s (201, or 409 SALE_NOT_STARTED), p99 and
#                   the order transactions per request (rejections before the start are
#                   decided in batches); checks at the end that no table was analyzed
#   cpu      18600  where the two cores go, per confirmed order (µs of the service processes,
#                   of PostgreSQL: every backend of the dev cluster, replicas included, and of
#                   the rest, wrk mostly; /proc over the wrk run), of those the primary's (its
#                   postmaster and every child) and the primary's CPU while the instances
#                   stand idle for IDLE_SECONDS (default 5) before the load (their monitors and
#                   pollers: ms a second, and that rate over the run's orders/s, µs an order),
#                   with the idle share, the owner's mean batch and the row's busy time per
#                   order (every batch transaction's time over the orders, its hand-off to the
#                   combiner and its connection's checkout included) and the time the row was
#                   held per order (stockgate_order_row_held_seconds: from each batch's row
#                   lock to its commit's answer), for one hot
#                   product sold by: 1 instance (1cK: under K connections, not 64); 4peers,
#                   four that are peers (STOCKGATE_PEERS), 2peers two; 4alone, four that are not; 4own, four
#                   each selling a product of its own (no shared row, no forwarding: the
#                   ceiling of split stock, docs/design/peers.md)
#   rows     18690  PostgreSQL alone, no service: pgbench plays the batchers, each
#                   transaction an order batch's shape on the real `orders` table (lock the
#                   stock row, insert B confirmed orders, one guarded UPDATE … >= B, commit):
#                     1x35-row1   one batcher, batches of 35, one stock row (one instance)
#                     4x16-row1   four batchers, batches of 16, one row (four, no peers)
#                     4x16-rows4  four batchers, batches of 16, a row each (stock split)
#                     4x16l-row1  as 4x16-row1, but inserting first and taking the row only
#                                 for the UPDATE (a trial, not the service's shape)
#
# Every order request is a new buyer and key (bench/wrk/orders.lua, an admin token acting for
# the buyer); pgbench runs -j2 at -c8, -c32 and -c64 and counts its best.
#
# BENCH_FSYNC_OFF=1 runs any shape with fsync off on every node of the dev cluster (turned back
# on at exit; the result file says so): the fast-disk limit, where CPU per order decides;
# BENCH_FSYNC_OFF=replicas on the replicas only, which on one host share the primary's disk.
# Bench only: the product, its tests and `./dev up` never turn fsync off.
#
# Environment: ROUNDS (3), BENCH_SECONDS (per run, 8), STOCKGATE_BIN
# (target/release/stockgate), STOCKGATE_DEV_DIR / STOCKGATE_DEV_PORT (as for ./dev);
# <SHAPE>_PORT (the first port, as above), <SHAPE>_NOTE (a line for the file), e.g.
# SCALE_PORT, CARTS_NOTE; SCALE_PEERS (1: the two and four instances are one deployment's
# peers, STOCKGATE_PEERS on ports SCALE_PORT+50…; 0: each on its own); CPU_SHAPES and
# ROWS_SHAPES (which of their shapes to run, space-separated; default all); CPU_RATE (cpu:
# orders arrive at this rate in all, an open rate over CPU_CONNECTIONS, default 256, instead
# of 64 connections each sending as its answer comes); MIX_LANES=1 (mix: how much of the mixed
# run the primary runs each lane's statement, lanes_sample).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

usage() { echo "usage: bench/fresh.sh scale|spread|carts|mix|drops|cpu|rows" >&2; exit 2; }
[ $# -eq 1 ] || usage
SHAPE="$1"

# The table of shapes: the first port, the tools besides wrk, and the results' heading.
case "$SHAPE" in
  scale)  port=18400 tools=pgbench title="one hot product, a new never-analyzed database per round" ;;
  spread) port=18396 tools=pgbench title="1,000 products, a new never-analyzed database per round" ;;
  carts)  port=18397 tools=pgbench title="three-line carts over 20 products, a new never-analyzed database per round" ;;
  mix)    port=18398 tools="" title="one hot product and 1,000 quiet ones, a new never-analyzed database per round" ;;
  drops)  port=18390 tools="" title="a new deployment per round, never-analyzed tables" ;;
  cpu)    port=18600 tools="" title="one hot product, where the CPU goes" ;;
  rows)   port=18690 tools=pgbench title="one hot product's batches in PostgreSQL alone, one row or split" ;;
  *) usage ;;
esac
port_var="${SHAPE^^}_PORT" note_var="${SHAPE^^}_NOTE"
# shellcheck disable=SC2086 # tools: zero or one word
bench_setup "fresh.sh $SHAPE" "${!port_var:-$port}" $tools

# -- what the shapes share ---------------------------------------------------------------

# fresh_db DB SQL: a new never-analyzed database DB, seeded by SQL (products, mostly)
fresh_db() {
  new_unanalyzed_db "$1"
  psql "$BASE_URL/$1" -q >/dev/null <<<"$2"
}
drop_db() { psql "$BASE_URL/postgres" -qc "DROP DATABASE $1 WITH (FORCE)" >/dev/null; }

# products PREFIX N: the SQL of N products PREFIX1 … PREFIXN of 10^8 units at 100 cents
products() {
  echo "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity)
  SELECT '$1' || g, 'product ' || g, 100, 100000000, 100000000 FROM generate_series(1, $2) g;"
}

# rotated R STEP…: the steps, started at the R-th (1-based, cyclic), one a line
rotated() {
  local r="$1" k
  shift
  for k in $(seq 0 $(($# - 1))); do
    k=$(( (k + r - 1) % $# + 1 ))
    echo "${!k}"
  done
}

# wrk_orders OUT [WRK ARGS…] -- ORDERS.LUA ARGS…: wrk for SECS s with bench/wrk/orders.lua on
# the one instance's URL, its output to OUT
wrk_orders() {
  local out="$1"
  shift
  local opts=()
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  wrk "${opts[@]}" -d"${SECS}s" --latency -s bench/wrk/orders.lua "$URL" -- "$ADMIN" "$@" >"$out"
}

# figures OUT [STATUS]: "answers/s p99" of a wrk run: the STATUS (201) answers a second, p99 ms
figures() {
  LC_ALL=C awk -v want="${2:-201}" -v s="$SECS" -v p99="$(wrk_ms "$1" 99%)" '
    $1 == "status" { sub(/:$/, "", $2); if ($2 == want) ok += $3 } END { printf "%.0f %.2f", ok / s, p99 }' "$1"
}

# heading: the file's section heading (the binary's name first, but for rows, which runs none),
# and the note
heading() {
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $([ "$SHAPE" = rows ] || echo "$BIN, ")$title"
  [ -z "${!note_var:-}" ] || echo "${!note_var}"
  echo
}
# conditions TEXT [AFTER]: the run's conditions, the load average, and AFTER
conditions() { echo "$1; load average $(cut -d' ' -f1-3 /proc/loadavg); $(host_line "${STOCKGATE_DEV_DIR:-/tmp/stockgate-dev}").${2:+ $2}"; }

# table HEADER…: a Markdown table of $work/rows, one row a line, a column a HEADER
table() {
  local h head="|" rule="|"
  for h in "$@"; do head="$head $h |"; rule="$rule --- |"; done
  echo "$head"
  echo "$rule"
  awk -v n=$# '{ s = "|"; for (i = 1; i <= n; i++) s = s " " $i " |"; print s }' "$work/rows"
}

col() { awk -v c="$1" '{ print $c }' "$work/rows"; }

# versus_round R SEED SQL SERVICE: round R of SERVICE against pgbench's best running SQL, on a
# new database seeded by SEED, in the order that alternates from round to round. SERVICE prints
# its figures, the first its answers/s, the last two the service's and the primary's CPU per
# answer (µs). Prints "R service… best ratio pgb-pg pgb-own pg-ratio all-ratio": pgbench's best
# tps, the service's first figure ÷ it, the primary's and pgbench's own CPU per transaction of
# that best run (µs), the primary's CPU per order ÷ pgbench and the primary's per transaction,
# and the service and primary together ÷ the same (issue #49's two CPU goals: ≤ 1, ≤ 1.5)
versus_round() {
  local db="${SHAPE}_${stamp}_$1" step
  fresh_db "$db" "$2"
  for step in $(rotated "$1" svc pgb); do
    if [ "$step" = svc ]; then "$4" "$db" >"$work/svc"
    else PGB_CPU="$work/pgb-cpu" pgbench_best "$db" "$3" "$SECS" >"$work/best"; fi
  done
  echo "$1 $(cat "$work/svc") $(cat "$work/best") $(cat "$work/pgb-cpu")" |
    LC_ALL=C awk '{
      svc = $(NF - 4); pg = $(NF - 3); best = $(NF - 2); per = $(NF - 1) + $NF
      line = $1; for (i = 2; i <= NF - 2; i++) line = line " " $i
      printf "%s %.2f %s %s %.2f %.2f\n", line, (best > 0 ? $2 / best : 0), $(NF - 1), $NF,
             (per > 0 ? pg / per : 0), (per > 0 ? (svc + pg) / per : 0) }'
  drop_db "$db"
}

# service_cpu SVC0 PG0: "service µs primary µs" per 201 of $work/wrk.txt since the service's and
# the primary's CPU ticks were SVC0 and PG0
service_cpu() {
  local svc1 pg1
  svc1="$(cpu_ticks "${instance_pids[0]}")" pg1="$(node_ticks primary)"
  LC_ALL=C awk -v svc="$((svc1 - $1))" -v pg="$((pg1 - $2))" -v us="$TICK_US" \
    '/^status 201:/ { ok += $3 } END { if (ok > 0) printf "%.1f %.1f", svc * us / ok, pg * us / ok; else print "0 0" }' "$work/wrk.txt"
}

# -- the shapes --------------------------------------------------------------------------

scale_round() {
  local r="$1" db="scale_${stamp}_$1" s
  declare -A got=()
  hot_product_db "$db"
  local svc0 pg0 svc1 pg1 cpu1=""
  for s in $(rotated "$r" pgb 1 2 4); do
    if [ "$s" = pgb ]; then
      got[pgb]="$(PGB_CPU="$work/pgb-cpu" pgbench_best "$db" "$work/order.sql" "$SECS")"
    else
      start_instances "$db" "$s" "${SCALE_PEERS:-1}"
      svc0="$(ticks "${instance_pids[@]}")" pg0="$(node_ticks primary)"
      got[$s]="$(load_instances "$s")"
      svc1="$(ticks "${instance_pids[@]}")" pg1="$(node_ticks primary)"
      # One instance's CPU per order, the service's and the primary's (issue #49, point 2).
      [ "$s" != 1 ] || cpu1="$((svc1 - svc0)) $((pg1 - pg0))"
      stop_instances
    fi
  done
  drop_db "$db"
  echo "$r ${got[1]} ${got[2]} ${got[4]} ${got[pgb]} $cpu1 $(cat "$work/pgb-cpu")" | LC_ALL=C awk -v us="$TICK_US" -v secs="$SECS" '{
    n = $2 * secs; svc = (n > 0 ? $9 * us / n : 0); pg = (n > 0 ? $10 * us / n : 0); per = $11 + $12
    printf "%s %s %s %s %s %s %s %s %.2f %.2f %.2f %.1f %.1f %s %s %.2f %.2f\n", $1, $2, $3, $4, $5, $6, $7, $8, $4 / $2, $6 / $2, $2 / $8,
      svc, pg, $11, $12, (per > 0 ? pg / per : 0), (per > 0 ? (svc + pg) / per : 0) }'
}
scale_report() {
  heading
  echo "Peers (STOCKGATE_PEERS): $([ "${SCALE_PEERS:-1}" = 1 ] && echo yes || echo no)."
  conditions "64 connections in total (wrk -t1 per instance), pgbench -j2 at -c8/-c32/-c64 (best), ${SECS} s each, $ROUNDS rounds, order rotating"
  echo
  table round "1 instance orders/s" "p99 ms" "2 instances" "p99 ms" "4 instances" "p99 ms" "pgbench best tps" "2 ÷ 1" "4 ÷ 1" "1 ÷ pgbench" \
    "1 instance: service CPU µs/order" "primary CPU µs/order" "pgbench best: primary CPU µs/txn" "pgbench CPU µs/txn" \
    "primary per order ÷ pgbench + primary per txn" "service + primary ÷ the same"
  echo
  printf '**Median:** 1 instance %s orders/s (%s), p99 %s ms (%s); 2 ÷ 1 %s (%s); 4 ÷ 1 %s (%s); 1 ÷ pgbench %s (%s); CPU per order, one instance: primary ÷ (pgbench + primary per transaction) %s (%s), service + primary ÷ the same %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 3 | range)" "$(col 9 | median)" "$(col 9 | range)" \
    "$(col 10 | median)" "$(col 10 | range)" "$(col 11 | median)" "$(col 11 | range)" \
    "$(col 16 | median)" "$(col 16 | range)" "$(col 17 | median)" "$(col 17 | range)"
}

# spread_service DB: one instance under wrk; "orders/s p99 order-transactions-per-order"
spread_service() {
  local before after svc0 pg0 cpu
  start_instances "$1" 1 0
  before="$(metric_at "$URL" stockgate_order_transactions_total)"
  svc0="$(cpu_ticks "${instance_pids[0]}")" pg0="$(node_ticks primary)"
  wrk_orders "$work/wrk.txt" -t2 -c64 -- spread- 1000
  cpu="$(service_cpu "$svc0" "$pg0")"
  after="$(metric_at "$URL" stockgate_order_transactions_total)"
  stop_instances
  echo "$(figures "$work/wrk.txt") $(LC_ALL=C awk -v tx="$((after - before))" -v s="$SECS" \
    '/^status 201:/ { ok += $3 } END { printf "%.3f", (ok > 0 ? tx / ok : 0) }' "$work/wrk.txt") $cpu"
}
spread_round() { versus_round "$1" "$(products spread- 1000)" "$work/order.sql" spread_service; }
spread_report() {
  heading
  conditions "wrk -t2 -c64 against the service and pgbench -j2 at -c8/-c32/-c64 (best) with the same one-order transaction, ${SECS} s each, $ROUNDS rounds, order alternating"
  echo
  table round "service orders/s" "p99 ms" "order transactions per order" "service CPU µs/order" "primary CPU µs/order" "pgbench best tps" "service ÷ pgbench" "primary CPU µs/txn" "pgbench CPU µs/txn" "primary per order ÷ pgbench + primary per txn" "service + primary ÷ the same"
  echo
  printf '**Median:** service %s orders/s (%s), p99 %s ms (%s), pgbench best %s tps (%s), ratio %s (%s); CPU per order: primary ÷ (pgbench + primary per transaction) %s (%s), service + primary ÷ the same %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 3 | range)" \
    "$(col 7 | median)" "$(col 7 | range)" "$(col 8 | median)" "$(col 8 | range)" \
    "$(col 11 | median)" "$(col 11 | range)" "$(col 12 | median)" "$(col 12 | range)"
}

carts_service() {
  local svc0 pg0 cpu
  start_instances "$1" 1 0
  svc0="$(cpu_ticks "${instance_pids[0]}")" pg0="$(node_ticks primary)"
  wrk_orders "$work/wrk.txt" -t2 -c64 -- cart- 20 3
  cpu="$(service_cpu "$svc0" "$pg0")"
  stop_instances
  grep -E '^status' "$work/wrk.txt" >&2 || true
  echo "$(figures "$work/wrk.txt") $cpu"
}
carts_round() { versus_round "$1" "$(products cart- 20)" "$work/cart.sql" carts_service; }
carts_report() {
  heading
  conditions "wrk -t2 -c64 against the service and pgbench -j2 at -c8/-c32/-c64 (best) with the same cart transaction (locks in byte order), ${SECS} s each, $ROUNDS rounds, order alternating"
  echo
  table round "service carts/s" "p99 ms" "service CPU µs/cart" "primary CPU µs/cart" "pgbench best tps" "service ÷ pgbench" "primary CPU µs/txn" "pgbench CPU µs/txn" "primary per cart ÷ pgbench + primary per txn" "service + primary ÷ the same"
  echo
  printf '**Median:** service %s carts/s (%s), p99 %s ms (%s), pgbench best %s tps (%s), ratio %s (%s); CPU per cart: primary ÷ (pgbench + primary per transaction) %s (%s), service + primary ÷ the same %s (%s).\n' \
    "$(col 2 | median)" "$(col 2 | range)" "$(col 3 | median)" "$(col 3 | range)" \
    "$(col 6 | median)" "$(col 6 | range)" "$(col 7 | median)" "$(col 7 | range)" \
    "$(col 10 | median)" "$(col 10 | range)" "$(col 11 | median)" "$(col 11 | range)"
}

# mix_load CLASS OUT: 32 connections of orders for CLASS (hot, quiet) into OUT
mix_load() {
  case "$1" in
    hot) wrk_orders "$2" -t1 -c32 -- hot ;;
    quiet) wrk_orders "$2" -t1 -c32 -- spread- 1000 ;;
  esac
}
# lanes_sample DB: for $SECS s, one session reads pg_stat_activity every 5 ms and prints the
# share of its readings (%) in which the primary runs a one-product order statement (the hot
# product's lane, in the mix) and a combined one (the quiet products'), executing or
# committing; with MIX_LANES=1 only, as it costs the primary a reading every 5 ms
lanes_sample() {
  psql "$BASE_URL/postgres" -qAt <<SQL
CREATE TEMP TABLE s (one bool, combined bool);
DO \$\$ DECLARE stop timestamptz := clock_timestamp() + interval '$SECS s'; BEGIN
  WHILE clock_timestamp() < stop LOOP
    INSERT INTO s SELECT bool_or(query LIKE 'SELECT * FROM take_order_batch%'), bool_or(query LIKE 'SELECT f.* FROM (SELECT set_config%')
      FROM pg_stat_activity WHERE datname = '$1' AND state = 'active';
    PERFORM pg_stat_clear_snapshot();
    PERFORM pg_sleep(0.005);
  END LOOP; END \$\$;
SELECT round(100.0 * count(*) FILTER (WHERE one) / count(*)) || ' ' || round(100.0 * count(*) FILTER (WHERE combined) / count(*)) FROM s;
SQL
}
# mix_ticks: the CPU ticks so far of the service, of the primary and of the two replicas
mix_ticks() { echo "$(cpu_ticks "${instance_pids[0]}") $(node_ticks primary) $(( $(node_ticks replica-1) + $(node_ticks replica-2) ))"; }
# mix_run CLASS…: one run of CLASS (hot, quiet) at once, 32 connections each, each into
# $work/CLASS-alone (one class) or $work/CLASS-mixed (both); prints the machine's idle % and,
# per 201, its busy CPU µs (every process on the host: the service, PostgreSQL's three nodes,
# wrk, the kernel's own), the service's, the primary's and the two replicas'
mix_run() {
  local m0 m1 c pids=() tag=alone t0 t1
  [ $# -eq 1 ] || tag=mixed
  t0="$(mix_ticks)"
  m0="$(machine)"
  for c in "$@"; do mix_load "$c" "$work/$c-$tag" & pids+=($!); done
  [ "${MIX_LANES:-0}" != 1 ] || [ "$tag" != mixed ] || lanes_sample "$db" >>"$work/lanes"
  wait "${pids[@]}"
  m1="$(machine)"
  t1="$(mix_ticks)"
  LC_ALL=C awk -v a="$m0" -v z="$m1" -v t0="$t0" -v t1="$t1" -v secs="$SECS" -v hz="$(getconf CLK_TCK)" \
    -v rate="$(for c in "$@"; do figures "$work/$c-$tag"; echo; done | awk '{ s += $1 } END { print s }')" 'BEGIN {
      split(a, x, " "); split(z, y, " "); all = y[1] - x[1]; idle = y[2] - x[2]
      split(t0, u, " "); split(t1, v, " "); n = rate * secs; us = 1e6 / hz
      if (n <= 0) { print "0 0 0 0 0"; exit }
      printf "%.0f %.0f %.0f %.0f %.0f", 100 * idle / all, (all - idle) * us / n, (v[1] - u[1]) * us / n, (v[2] - u[2]) * us / n, (v[3] - u[3]) * us / n }'
}
mix_round() {
  local db="mix_${stamp}_$1" run cpu_h cpu_q cpu_m
  fresh_db "$db" "$(products spread- 1000)
INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) VALUES ('hot', 'hot', 100, 100000000, 100000000);"
  start_instances "$db" 1 0
  for run in $(rotated "$1" hot quiet both); do
    case "$run" in
      hot) cpu_h="$(mix_run hot)" ;;
      quiet) cpu_q="$(mix_run quiet)" ;;
      both) cpu_m="$(mix_run hot quiet)" ;;
    esac
  done
  stop_instances
  drop_db "$db"
  # The CPU bound: at each class's whole-machine CPU per order alone, the mixed orders/s
  # fill the machine when r_hot · busy_hot + r_quiet · busy_quiet = 1, busy the share of the
  # machine a class kept busy alone; so the largest ratio both can keep at once is
  # 1 / (busy_hot + busy_quiet). A class's half of the machine, at its CPU per order alone,
  # sells alone · 0.5 / busy: mixed ÷ that is the class's "÷ half the machine".
  # Fields: 1 round, 2–9 the four runs' orders/s and p99, 10–14 hot alone's mix_run,
  # 15–19 quiet alone's, 20–24 mixed's.
  echo "$1 $(figures "$work/hot-alone") $(figures "$work/hot-mixed") $(figures "$work/quiet-alone") $(figures "$work/quiet-mixed") $cpu_h $cpu_q $cpu_m" |
    awk '{ bh = 1 - $10 / 100; bq = 1 - $15 / 100
      printf "%s %s %s %s %s %s %s %s %s %.2f %.2f %s %s %s %s %s %s %.2f %.2f %.2f %s %s %s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9,
        ($2 > 0 ? $4 / $2 : 0), ($6 > 0 ? $8 / $6 : 0), $10, $15, $20, $11, $16, $21, (bh + bq > 0 ? 1 / (bh + bq) : 0),
        ($2 > 0 ? $4 * bh / ($2 * 0.5) : 0), ($6 > 0 ? $8 * bq / ($6 * 0.5) : 0), $22, $23, $24 }'
}
mix_report() {
  heading
  conditions "wrk -t1 -c32 per class, alone and both at once (64 connections), ${SECS} s each, $ROUNDS rounds, order rotating"
  echo
  table round "hot alone orders/s" "p99 ms" "hot mixed" "p99 ms" "quiet alone" "p99 ms" "quiet mixed" "p99 ms" "hot mixed ÷ alone" "quiet mixed ÷ alone" \
    "idle % hot alone" "idle % quiet alone" "idle % mixed" "CPU µs/order hot alone" "quiet alone" "mixed" "CPU bound on both ratios" "hot mixed ÷ half the machine" "quiet mixed ÷ half" \
    "mixed µs/order: service" "primary" "replicas"
  echo
  printf '**Median:** hot mixed %s orders/s (%s), p99 %s ms (%s), %s of alone (%s); quiet mixed %s orders/s (%s), p99 %s ms (%s), %s of alone (%s); the machine idle %s %% (%s) while mixed.\n' \
    "$(col 4 | median)" "$(col 4 | range)" "$(col 5 | median)" "$(col 5 | range)" "$(col 10 | median)" "$(col 10 | range)" \
    "$(col 8 | median)" "$(col 8 | range)" "$(col 9 | median)" "$(col 9 | range)" "$(col 11 | median)" "$(col 11 | range)" \
    "$(col 14 | median)" "$(col 14 | range)"
  printf '**The machine:** idle %s %% (%s) with the hot product alone, %s %% (%s) with the quiet ones alone; its CPU per order (every process on the host, busy core-µs per 201) %s µs (%s) hot alone, %s (%s) quiet alone, %s (%s) mixed; at the alone runs'"'"' CPU per order, the largest ratio both classes could keep at once is %s (%s); each class mixed ÷ what half the machine sells of it alone (alone · 0.5 / its busy share): hot %s (%s), quiet %s (%s).\n' \
    "$(col 12 | median)" "$(col 12 | range)" "$(col 13 | median)" "$(col 13 | range)" \
    "$(col 15 | median)" "$(col 15 | range)" "$(col 16 | median)" "$(col 16 | range)" "$(col 17 | median)" "$(col 17 | range)" \
    "$(col 18 | median)" "$(col 18 | range)" "$(col 19 | median)" "$(col 19 | range)" "$(col 20 | median)" "$(col 20 | range)"
  [ ! -s "$work/lanes" ] || printf '**The lanes while mixed** (MIX_LANES=1): the primary runs a one-product order statement (the hot product'"'"'s) in %s %% (%s) of the readings every 5 ms, a combined one (the quiet ones'"'"') in %s %% (%s).\n' \
    "$(cut -d' ' -f1 "$work/lanes" | median)" "$(cut -d' ' -f1 "$work/lanes" | range)" "$(cut -d' ' -f2 "$work/lanes" | median)" "$(cut -d' ' -f2 "$work/lanes" | range)"
  printf '**Mixed, CPU µs per order by whom:** the service %s (%s), the primary %s (%s), the two replicas %s (%s); the rest of the machine'"'"'s (wrk, the kernel'"'"'s own work) is the machine'"'"'s figure less these.\n' \
    "$(col 21 | median)" "$(col 21 | range)" "$(col 22 | median)" "$(col 22 | range)" "$(col 23 | median)" "$(col 23 | range)"
}

drops_products=(drops-free drops-lim drops-soon)
# drops_turn PRODUCT: one measured run; prints "product answers/s p99 transactions/request"
drops_turn() {
  local want=201 before after
  [ "$1" != drops-soon ] || want=409
  before="$(metric_at "$URL" stockgate_order_transactions_total)"
  wrk_orders "$work/wrk.txt" -t2 -c64 -- "$1"
  after="$(metric_at "$URL" stockgate_order_transactions_total)"
  grep -q "^status $want:" "$work/wrk.txt" || { cat "$work/wrk.txt" >&2; echo "fresh.sh drops: no $want answers for $1" >&2; exit 1; }
  echo "$1 $(figures "$work/wrk.txt" "$want") $(LC_ALL=C awk -v tx="$((after - before))" \
    '$1 == "status" { all += $3 } END { printf "%.4f", (all > 0 ? tx / all : 0) }' "$work/wrk.txt")"
}
drops_round() {
  local db="drops_${stamp}_$1" p analyzed rows
  fresh_db "$db" "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity, max_per_customer, sale_starts_at)
  VALUES ('drops-free', 'no rules', 100, 2000000000, 2000000000, NULL, NULL),
         ('drops-lim', 'limit 2', 100, 2000000000, 2000000000, 2, NULL),
         ('drops-soon', 'starts tomorrow', 100, 2000000000, 2000000000, NULL, now() + interval '1 day');"
  start_instances "$db" 1 0
  for p in $(rotated "$(($1 % 3 + 1))" "${drops_products[@]}"); do
    echo "round $1 of $ROUNDS: $p" >&2
    drops_turn "$p"
  done
  stop_instances
  analyzed="$(psql "$BASE_URL/$db" -Atc "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL")"
  rows="$(psql "$BASE_URL/$db" -Atc "SELECT count(*) FROM orders")"
  echo "round $1: orders table $rows rows at the end, $analyzed tables analyzed" | tee -a "$work/rounds" >&2
  drop_db "$db"
}
drops_report() {
  local p m free
  pcol() { awk -v p="$1" -v c="$2" '$1 == p { print $c }' "$work/rows"; }
  heading
  conditions "wrk -t2 -c64, ${SECS} s a turn, $ROUNDS rounds with the turns' order rotating, a fresh buyer and key per request"
  sed 's/^/- /' "$work/rounds"
  echo
  echo "| turn | product | answers/s | p99 ms | order transactions per request |"
  echo "| --- | --- | --- | --- | --- |"
  awk '{ printf "| %d | %s | %s | %s | %s |\n", NR, $1, $2, $3, $4 }' "$work/rows"
  echo
  echo "| product | answers/s, median (min–max) | ÷ drops-free | p99 ms, median (min–max) | transactions per request, median |"
  echo "| --- | --- | --- | --- | --- |"
  free="$(pcol drops-free 2 | median)"
  for p in "${drops_products[@]}"; do
    m="$(pcol "$p" 2 | median)"
    printf '| %s | %s (%s) | %s | %s (%s) | %s |\n' "$p" "$m" "$(pcol "$p" 2 | range)" \
      "$(awk -v a="$m" -v b="$free" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')" \
      "$(pcol "$p" 3 | median)" "$(pcol "$p" 3 | range)" "$(pcol "$p" 4 | median)"
  done
}

# ticks PID…: their CPU time (utime + stime) in clock ticks; a process gone meanwhile counts 0
ticks() { for p in "$@"; do cat "/proc/$p/stat" 2>/dev/null || true; done | awk '{ t += $14 + $15 } END { print t + 0 }'; }
# cluster_ticks: the dev cluster's CPU ticks, its three nodes' postmasters, their children
# and the children they have reaped (cpu_ticks); not the host's other PostgreSQL servers
cluster_ticks() { echo $(( $(node_ticks primary) + $(node_ticks replica-1) + $(node_ticks replica-2) )); }
# machine: all CPU ticks and idle ticks of /proc/stat
machine() { awk '/^cpu / { s = 0; for (i = 2; i <= NF; i++) s += $i; print s, $5 }' /proc/stat; }
# cpu_run SHAPE R: one run (1, 4peers, 4alone, 4own) on a new database; prints
# "shape orders/s p99 service pg other idle% batch primary primary-idle-ms/s idle-per-order
# row-busy-per-order"
# (CPU as µs per order)
cpu_run() {
  local shape="$1" n=4 peers=0 own=0 db="cpu_${stamp}_$2_${1}" total=64
  # CPU_RATE: orders arrive at that rate in all, over CPU_CONNECTIONS (256) connections
  [ -z "${CPU_RATE:-}" ] || total="${CPU_CONNECTIONS:-256}"
  # 1cK: one instance under K connections (its batches as small as peers' owner's, say)
  case "$shape" in 1c*) total="${shape#1c}"; n=1 ;; esac
  [ "$shape" != 1 ] || n=1
  [ "$shape" != 4peers ] || peers=1
  [ "$shape" != 2peers ] || { n=2; peers=1; }
  [ "$shape" != 4own ] || own=1
  hot_product_db "$db" 4
  start_instances "$db" "$n" "$peers"
  local pg0 svc0 m0 pg1 svc1 m1 sold batch busy held i idle0 pr0 pr1
  # The instances idle: what their monitors and pollers cost the primary, with no order.
  idle0="$(node_ticks primary)"; sleep "${IDLE_SECONDS:-5}"; pr0="$(node_ticks primary)"
  pg0="$(cluster_ticks)"; svc0="$(ticks "${instance_pids[@]}")"; m0="$(machine)"
  sold="$(LOAD_RATE="${CPU_RATE:-}" load_instances "$n" "$own" "$total")"
  pg1="$(cluster_ticks)"; svc1="$(ticks "${instance_pids[@]}")"; m1="$(machine)"
  pr1="$(node_ticks primary)"
  # Per instance "batches mean-batch transaction-seconds". The owner (or the one instance)
  # ran the most batches: its mean batch size. The row's busy time: every instance's batch
  # transactions, statement and commit (an upper bound: any wait for the row and the round
  # trip count too).
  for i in $(seq 0 $((n - 1))); do
    curl -fsS "http://127.0.0.1:$((PORT + i))/metrics" | LC_ALL=C awk '
      $1 == "stockgate_order_batch_size_count" { c = $2 } $1 == "stockgate_order_batch_size_sum" { s = $2 }
      $1 == "stockgate_order_batch_seconds_sum" { t = $2 } $1 == "stockgate_order_row_held_seconds_sum" { h = $2 }
      END { printf "%d %.1f %.6f %.6f\n", c, (c ? s / c : 0), t, h }'
  done >"$work/batches"
  batch="$(sort -g "$work/batches" | tail -1 | cut -d' ' -f2)"
  busy="$(LC_ALL=C awk '{ s += $3 } END { printf "%.6f", s }' "$work/batches")"
  held="$(LC_ALL=C awk '{ s += $4 } END { printf "%.6f", s }' "$work/batches")"
  stop_instances
  echo "$sold" | LC_ALL=C awk -v secs="$SECS" -v shape="$shape" -v b="$batch" \
    -v svc="$((svc1 - svc0))" -v pg="$((pg1 - pg0))" -v pr="$((pr1 - pr0))" -v m0="$m0" -v m1="$m1" \
    -v still="$((pr0 - idle0))" -v isecs="${IDLE_SECONDS:-5}" -v busy="$busy" -v held="$held" -v hz="$(getconf CLK_TCK)" '
    {
      split(m0, a, " "); split(m1, z, " "); all = z[1] - a[1]; idle = z[2] - a[2]
      us = 1e6 / hz / ($1 * secs)
      ms = still * 1e3 / hz / isecs
      printf "%s %s %s %.1f %.1f %.1f %.0f %s %.1f %.1f %.1f %.1f %.1f\n", shape, $1, $2, svc * us, pg * us, (all - idle - svc - pg) * us, 100 * idle / all, b,
        pr * us, ms, ms * 1e3 / $1, busy * 1e6 / ($1 * secs), held * 1e6 / ($1 * secs) }'
  drop_db "$db"
}
cpu_report() {
  local s
  heading
  local load="64 connections in total (wrk -t1 per instance)"
  [ -z "${CPU_RATE:-}" ] || load="orders arriving at $CPU_RATE a second in all (an open rate, bench/wrk/orders.lua's WRK_RATE) over ${CPU_CONNECTIONS:-256} connections (wrk -t1 per instance, the rate split evenly)"
  conditions "$load, ${SECS} s a run, a new never-analyzed database each, $ROUNDS rounds, order rotating" \
    "CPU in µs per confirmed order."
  echo
  table shape orders/s "p99 ms" "service µs" "PostgreSQL µs" "rest (wrk) µs" "idle %" "owner's mean batch" \
    "primary µs" "primary idle ms/s" "idle ms/s ÷ orders/s µs" "row busy µs/order" "row held µs/order"
  echo
  for s in "${subshapes[@]}"; do
    scol() { awk -v s="$s" -v c="$1" '$1 == s { print $c }' "$work/rows" | median; }
    printf '**%s (median):** %s orders/s, p99 %s ms; service %s µs, PostgreSQL %s µs (the primary %s µs, of which its idle rate %s µs), rest %s µs an order; idle %s %%; batch %s; primary idle %s ms/s; the row busy %s µs an order, held %s.\n' \
      "$s" "$(scol 2)" "$(scol 3)" "$(scol 4)" "$(scol 5)" "$(scol 9)" "$(scol 11)" "$(scol 6)" "$(scol 7)" "$(scol 8)" "$(scol 10)" "$(scol 12)" "$(scol 13)"
  done
}

# rows_run SHAPE R: prints "shape orders/s tps"
rows_run() {
  local shape="$1" db="rows_${stamp}_$2_${1//-/_}" clients batch rows tps
  local script="$work/batch.sql"
  case "$shape" in *l-*) script="$work/late.sql" ;; esac
  IFS=x- read -r clients batch rows <<<"${shape/row/}"
  batch="${batch%l}"
  rows="${rows#s}"
  hot_product_db "$db" 4
  tps="$(pgbench -n -j1 -c"$clients" -T"$SECS" -D batch="$batch" -D rows="$rows" -f "$script" \
    "$BASE_URL/$db" 2>"$work/pgbench.err" | awk '/^tps/ { print $3 }')"
  [ -n "$tps" ] || { cat "$work/pgbench.err" >&2; exit 1; }
  drop_db "$db"
  LC_ALL=C awk -v s="$shape" -v t="$tps" -v b="$batch" 'BEGIN { printf "%s %.0f %.0f\n", s, t * b, t }'
}
rows_report() {
  local s
  heading
  conditions "pgbench -j1, ${SECS} s a run, a new never-analyzed database each (the real \`orders\` table), replicas streaming, $ROUNDS rounds, order rotating"
  echo
  table shape orders/s batches/s
  echo
  for s in "${subshapes[@]}"; do
    echo "**$s:** median $(awk -v s="$s" '$1 == s { print $2 }' "$work/rows" | median) orders/s ($(awk -v s="$s" '$1 == s { print $2 }' "$work/rows" | range))"
  done
}

# -- the transactions pgbench runs -------------------------------------------------------

cat >"$work/order.sql" <<'SQL'
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1, updated_at = clock_timestamp()
 WHERE product_id = 'hot' AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
 VALUES (gen_random_uuid(), 'hot', 'pgb-' || :client_id, 1, 100, 100, 'confirmed', md5(random()::text), 'hot:1');
COMMIT;
SQL
[ "$SHAPE" != spread ] || cat >"$work/order.sql" <<'SQL'
\set p random(1, 1000)
BEGIN;
UPDATE products SET available_quantity = available_quantity - 1, updated_at = clock_timestamp()
 WHERE product_id = 'spread-' || :p AND available_quantity >= 1;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
 VALUES (gen_random_uuid(), 'spread-' || :p, 'pgb-' || :client_id, 1, 100, 100, 'confirmed', md5(random()::text), 'spread:1');
COMMIT;
SQL
cat >"$work/cart.sql" <<'SQL'
BEGIN;
WITH picked AS (
  SELECT 'cart-' || g AS id FROM generate_series(1, 20) g ORDER BY random() LIMIT 3
), locked AS (
  SELECT p.product_id, p.price_cents FROM products p WHERE p.product_id IN (SELECT id FROM picked)
   ORDER BY p.product_id COLLATE "C" FOR NO KEY UPDATE
), took AS (
  UPDATE products p SET available_quantity = p.available_quantity - 1, updated_at = clock_timestamp()
    FROM locked l WHERE p.product_id = l.product_id AND p.available_quantity >= 1
  RETURNING p.product_id, p.price_cents
), o AS (
  INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint)
  SELECT gen_random_uuid(), NULL, 'pgb-' || :client_id, NULL, 0, (SELECT sum(price_cents) FROM took), 'confirmed', md5(random()::text), 'cart'
  RETURNING order_id
)
INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents)
SELECT o.order_id, took.product_id, 1, took.price_cents FROM o, took;
COMMIT;
SQL
cat >"$work/batch.sql" <<'SQL'
\set row :client_id % :rows
BEGIN;
SELECT available_quantity FROM products WHERE product_id = 'hot-' || :row FOR UPDATE;
INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents,
                    status, idempotency_key, request_fingerprint)
  SELECT gen_random_uuid(), 'hot-' || :row, gen_random_uuid()::text, 1, 100, 100, 'confirmed',
         gen_random_uuid()::text, 'fresh.sh rows' FROM generate_series(1, :batch);
UPDATE products SET available_quantity = available_quantity - :batch
  WHERE product_id = 'hot-' || :row AND available_quantity >= :batch;
COMMIT;
SQL
sed '/FOR UPDATE;$/d' "$work/batch.sql" >"$work/late.sql"

# -- the run -----------------------------------------------------------------------------

case "$SHAPE" in
  cpu) subshapes=(${CPU_SHAPES:-1 4peers 4alone 4own}); rounds cpu_run "${subshapes[@]}" ;;
  rows) subshapes=(${ROWS_SHAPES:-1x35-row1 4x16-row1 4x16-rows4 4x16l-row1}); rounds rows_run "${subshapes[@]}" ;;
  *)
    for r in $(seq "$ROUNDS"); do
      "${SHAPE}_round" "$r" >"$work/round"
      cat "$work/round" >>"$work/rows"
      cat "$work/round" >&2
    done ;;
esac
touch "$work/rows" "$work/rounds"
"${SHAPE}_report" | tee -a "bench/results/$SHAPE-$(date -u +%F).md"
