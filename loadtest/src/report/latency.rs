//! Percentiles of one endpoint's latencies, from an HDR histogram of microseconds.

use crate::stats::histogram;
use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one endpoint's latencies, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    /// From a histogram of microseconds.
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p95_ms: ms(h.value_at_quantile(0.95)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }

    pub fn of_us(values: impl IntoIterator<Item = u64>) -> Self {
        let mut h = histogram();
        for v in values {
            h.saturating_record(v.max(1));
        }
        Self::of(&h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_reported_in_ms() {
        let l = LatencySummary::of_us((1..=100).map(|i| i * 1000));
        assert_eq!(l.count, 100);
        assert!((l.p50_ms - 50.0).abs() < 0.1, "{l:?}");
        assert!((l.p95_ms - 95.0).abs() < 0.1, "{l:?}");
        assert!((l.p99_ms - 99.0).abs() < 0.1, "{l:?}");
        assert!((l.max_ms - 100.0).abs() < 0.1, "{l:?}");
        assert_eq!(LatencySummary::of_us([]), LatencySummary::default());
    }
}
