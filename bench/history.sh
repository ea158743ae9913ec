#!/usr/bin/env bash
# bench/history.sh — the history check (tests/api/history/) as a soak: the same randomised
# workload (flash drops included: per-customer limits, and a sale that starts a few seconds in)
# on two instances under the same nemesis (paused replicas, Redis restarted empty, the primary
# cut off, an instance restarted), for SOAK_SECONDS (default 600) instead of CI's 30.
# Needs nothing running: the test starts its own private cluster and Redis.
#
# Prints the summary line (operations by answer, 409s by code; faults injected by kind;
# anomalies by class) and writes
# it, with the verdict, to bench/results/history-<date>.md. A failing run prints the offending
# operations and the seed; the full history is in target/tmp/history-<seed>.jsonl.
#
# Environment: SOAK_SECONDS, STOCKGATE_HISTORY_SEED (replays a run's choices; default: a new
# seed, printed), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${SOAK_SECONDS:-600}"
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
say "history soak: ${SECS}s (seed ${STOCKGATE_HISTORY_SEED:-new})"
status=0
STOCKGATE_HISTORY_SECS="$SECS" cargo test -p stockgate --test api -- \
  history::every_answer --nocapture --test-threads 1 2>&1 | tee "$log" >&2 || status=$?
summary="$(grep -m1 '^history seed=' "$log" || echo 'no summary line: the run did not reach its checks')"
verdict=$([ "$status" -eq 0 ] && echo PASS || echo FAIL)
mkdir -p bench/results
out="bench/results/history-$(date -u +%Y-%m-%d).md"
{
  echo "## history soak, $(date -u +'%Y-%m-%d %H:%M UTC'), ${SECS}s: $verdict"
  echo
  echo "$summary"
  echo
} >>"$out"
echo "$verdict: $summary"
echo "(appended to $out)" >&2
exit "$status"
