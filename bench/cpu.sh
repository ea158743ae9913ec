#!/usr/bin/env bash
# bench/cpu.sh — where the two cores go when one hot product is sold by one instance, by four
# instances that are peers (STOCKGATE_PEERS), and by four that are not; and, as the ceiling of
# split stock (docs/design/peers.md), by four instances each selling a product of its own
# (4own: no shared row, no forwarding): CPU per order of the
# service processes, of PostgreSQL (every backend of the dev cluster, replicas included) and
# of the rest (wrk, mostly), the idle share, and the owner's batches.
#
# Each run makes a database of its own on the dev cluster (./dev up, or the cluster up, must
# have run), migrated and never analyzed, with one product of 10^8 units; the instances are
# loaded by one `wrk -t1` each, 64 connections in total (bench/wrk/orders.lua: every request a
# new buyer and key). The four shapes rotate from round to round. CPU comes from /proc
# (utime + stime, and /proc/stat's idle) over the wrk run only.
# Prints a row per run and the medians per shape; appends them to bench/results/cpu-<date>.md.
#
# Environment: ROUNDS (3), BENCH_SECONDS (8), CPU_PORT (first port, 18600), STOCKGATE_BIN
# (target/release/stockgate), CPU_NOTE (a line for the file).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

bench_setup cpu "${CPU_PORT:-18600}"

# ticks PID…: their CPU time (utime + stime) in clock ticks; a process gone meanwhile counts 0
ticks() { for p in "$@"; do cat "/proc/$p/stat" 2>/dev/null || true; done | awk '{ t += $14 + $15 } END { print t + 0 }'; }
# machine: all CPU ticks and idle ticks of /proc/stat
machine() { awk '/^cpu / { s = 0; for (i = 2; i <= NF; i++) s += $i; print s, $5 }' /proc/stat; }

# run SHAPE R: one run (1, 4peers, 4alone) on a new database; prints
# "shape orders/s p99 service pg other idle% batch" (CPU as µs per order)
run() {
  local shape="$1" n=4 peers=0 own=0 db="cpu_${stamp}_$2_${1}"
  [ "$shape" != 1 ] || n=1
  [ "$shape" != 4peers ] || peers=1
  [ "$shape" != 4own ] || own=1
  hot_product_db "$db" 4
  start_instances "$db" "$n" "$peers"
  local pg0 svc0 m0 pg1 svc1 m1 sold
  pg0="$(ticks $(pgrep -u postgres postgres))"; svc0="$(ticks "${instance_pids[@]}")"; m0="$(machine)"
  sold="$(load_instances "$n" "$own")"
  pg1="$(ticks $(pgrep -u postgres postgres))"; svc1="$(ticks "${instance_pids[@]}")"; m1="$(machine)"
  # The owner (or the one instance) ran the most batches; its mean batch size.
  local batch i
  batch="$(for i in $(seq 0 $((n - 1))); do
      curl -fsS "http://127.0.0.1:$((PORT + i))/metrics" | awk '$1 == "stockgate_order_batch_size_count" { c = $2 } $1 == "stockgate_order_batch_size_sum" { s = $2 } END { if (c) printf "%d %.1f\n", c, s / c }'
    done | sort -g | tail -1 | cut -d' ' -f2)"
  stop_instances
  echo "$sold" | LC_ALL=C awk -v secs="$SECS" -v shape="$shape" -v b="$batch" \
    -v svc="$((svc1 - svc0))" -v pg="$((pg1 - pg0))" -v m0="$m0" -v m1="$m1" -v hz="$(getconf CLK_TCK)" '
    {
      split(m0, a, " "); split(m1, z, " "); all = z[1] - a[1]; idle = z[2] - a[2]
      us = 1e6 / hz / ($1 * secs)
      printf "%s %s %s %.1f %.1f %.1f %.0f %s\n", shape, $1, $2, svc * us, pg * us, (all - idle - svc - pg) * us, 100 * idle / all, b }'
  psql "$BASE_URL/postgres" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
}

shapes=(1 4peers 4alone 4own)
rounds run "${shapes[@]}"

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC'): $BIN, one hot product, where the CPU goes"
  [ -z "${CPU_NOTE:-}" ] || echo "$CPU_NOTE"
  echo
  echo "64 connections in total (wrk -t1 per instance), ${SECS} s a run, a new never-analyzed database each, $ROUNDS rounds, order rotating; load average $(cut -d' ' -f1-3 /proc/loadavg). CPU in µs per confirmed order."
  echo
  echo "| shape | orders/s | p99 ms | service µs | PostgreSQL µs | rest (wrk) µs | idle % | owner's mean batch |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
  awk '{ printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8 }' "$work/rows"
  echo
  for s in "${shapes[@]}"; do
    col() { awk -v s="$s" -v c="$1" '$1 == s { print $c }' "$work/rows" | median; }
    printf '**%s (median):** %s orders/s, p99 %s ms; service %s µs, PostgreSQL %s µs, rest %s µs an order; idle %s %%; batch %s.\n' \
      "$s" "$(col 2)" "$(col 3)" "$(col 4)" "$(col 5)" "$(col 6)" "$(col 7)" "$(col 8)"
  done
} | tee -a "bench/results/cpu-$(date -u +%F).md"
