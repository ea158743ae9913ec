//! Streaming aggregates for the timed modes: an HDR latency histogram, outcome tallies
//! and per-responder counts, kept per worker and merged at the end.

use crate::samples::Allocated;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;

/// Highest latency the histograms track (µs); anything slower is clamped to it.
const MAX_TRACKED_US: u64 = 3_600_000_000;

/// A latency histogram in microseconds, 3 significant figures.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_TRACKED_US, 3).expect("static histogram bounds are valid")
}

/// Answers from one responder (`served_by`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ServedBy {
    pub answers: u64,
    pub max_stale_by_ms: u64,
    /// Answers with `stale_by_ms` above the run's limit.
    pub over_limit: u64,
}

/// Everything one worker saw.
#[derive(Debug, Clone)]
pub struct Tally {
    pub latency: Histogram<u64>,
    /// Successful requests (201 confirmed for orders, 200 for availability).
    pub ok: u64,
    /// Units confirmed (orders only).
    pub units: u64,
    /// Units of the confirmed orders' allocations, per location (orders only).
    pub allocated: Allocated,
    pub out_of_stock: u64,
    pub errors: BTreeMap<String, u64>,
    pub served_by: BTreeMap<String, ServedBy>,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            latency: histogram(),
            ok: 0,
            units: 0,
            allocated: Allocated::default(),
            out_of_stock: 0,
            errors: BTreeMap::new(),
            served_by: BTreeMap::new(),
        }
    }
}

impl Tally {
    pub fn record_latency(&mut self, us: u64) {
        self.latency.saturating_record(us.max(1));
    }

    pub fn error(&mut self, label: String) {
        *self.errors.entry(label).or_default() += 1;
    }

    pub fn answer(&mut self, served_by: &str, stale_by_ms: u64, limit_ms: u64) {
        let s = self.served_by.entry(served_by.to_string()).or_default();
        s.answers += 1;
        s.max_stale_by_ms = s.max_stale_by_ms.max(stale_by_ms);
        if stale_by_ms > limit_ms {
            s.over_limit += 1;
        }
    }

    pub fn requests(&self) -> u64 {
        self.ok + self.out_of_stock + self.errors_total()
    }

    pub fn errors_total(&self) -> u64 {
        self.errors.values().sum()
    }

    pub fn merge(&mut self, other: Tally) {
        // Same bounds on both sides, so adding cannot fail; clamp defensively anyway.
        if self.latency.add(&other.latency).is_err() {
            for v in other.latency.iter_recorded() {
                self.latency
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
        self.ok += other.ok;
        self.units += other.units;
        self.allocated.merge(other.allocated);
        self.out_of_stock += other.out_of_stock;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (k, v) in other.served_by {
            let s = self.served_by.entry(k).or_default();
            s.answers += v.answers;
            s.max_stale_by_ms = s.max_stale_by_ms.max(v.max_stale_by_ms);
            s.over_limit += v.over_limit;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_adds_counts_and_keeps_maxima() {
        let mut a = Tally {
            ok: 2,
            ..Tally::default()
        };
        a.record_latency(1_000);
        a.error("503 OVERLOADED".into());
        a.answer("replica-1", 10, 250);
        let mut b = Tally {
            ok: 3,
            ..Tally::default()
        };
        b.record_latency(9_000);
        b.error("503 OVERLOADED".into());
        b.error("timeout".into());
        b.answer("replica-1", 300, 250);
        b.answer("primary", 0, 250);
        a.merge(b);
        assert_eq!(a.ok, 5);
        assert_eq!(a.latency.len(), 2);
        assert_eq!(a.errors["503 OVERLOADED"], 2);
        assert_eq!(a.errors_total(), 3);
        assert_eq!(a.requests(), 8);
        assert_eq!(
            a.served_by["replica-1"],
            ServedBy {
                answers: 2,
                max_stale_by_ms: 300,
                over_limit: 1
            }
        );
        assert_eq!(a.served_by["primary"].answers, 1);
    }
}
