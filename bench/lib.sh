# bench/lib.sh — what the benchmark scripts share; sourced, not run.

# wrk_ms FILE QUANTILE: a latency quantile ("50%", "99%") of wrk --latency's output, in ms
wrk_ms() {
  awk -v q="$2" '$1 == q {
      v = $2; if (v ~ /us$/) { sub(/us$/, "", v); v /= 1000 } else if (v ~ /ms$/) sub(/ms$/, "", v); else if (v ~ /s$/) { sub(/s$/, "", v); v *= 1000 }
      print v }' "$1"
}

# metric_at BASE_URL NAME: a metric's value from a service's /metrics
metric_at() { curl -fsS "$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }

# wait_healthy BASE_URL: waits up to 10 s for /healthz to answer; fails if it never does
wait_healthy() {
  local _
  for _ in $(seq 100); do
    curl -fsS -o /dev/null "$1/healthz" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}
