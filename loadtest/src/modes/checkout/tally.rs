//! What one buyer task saw: per-step latencies, the counts, units confirmed per product,
//! the retried and unexpected answers, and when the last hold could end. Kept per worker
//! and merged at the end.

use crate::report::checkout::Counts;
use crate::samples::{Allocated, Allocation};
use crate::stats::histogram;
use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// Everything one worker saw.
pub(super) struct Tally {
    pub(super) hold: Histogram<u64>,
    pub(super) confirm: Histogram<u64>,
    pub(super) release: Histogram<u64>,
    pub(super) counts: Counts,
    pub(super) units: Vec<u64>,
    /// Per product, the units of its confirmed orders' allocations per location.
    pub(super) allocated: Vec<Allocated>,
    pub(super) retried: BTreeMap<String, u64>,
    pub(super) unexpected: BTreeMap<String, u64>,
    /// The latest moment a hold of ours could still be holding units.
    pub(super) last_end: Option<DateTime<Utc>>,
    pub(super) last_answer: Option<Instant>,
    pub(super) started: u64,
}

impl Tally {
    pub(super) fn new(products: usize) -> Self {
        Self {
            hold: histogram(),
            confirm: histogram(),
            release: histogram(),
            counts: Counts::default(),
            units: vec![0; products],
            allocated: vec![Allocated::default(); products],
            retried: BTreeMap::new(),
            unexpected: BTreeMap::new(),
            last_end: None,
            last_answer: None,
            started: 0,
        }
    }

    pub(super) fn unexpected(&mut self, step: Step, label: String) {
        *self
            .unexpected
            .entry(format!("{}: {label}", step.name()))
            .or_default() += 1;
    }

    /// Counts a confirmed order's allocations of our products (`index`) per location.
    pub(super) fn allocate(&mut self, index: &HashMap<String, usize>, allocations: &[Allocation]) {
        for a in allocations {
            if let Some(&i) = index.get(&a.product_id) {
                self.allocated[i].add(&a.product_id, std::slice::from_ref(a));
            }
        }
    }

    pub(super) fn ended(&mut self, at: DateTime<Utc>) {
        self.last_end = self.last_end.max(Some(at));
    }

    pub(super) fn merge(&mut self, o: Tally) {
        for (mine, theirs) in [
            (&mut self.hold, &o.hold),
            (&mut self.confirm, &o.confirm),
            (&mut self.release, &o.release),
        ] {
            // Same bounds on both sides: adding cannot fail.
            let _ = mine.add(theirs);
        }
        let (c, d) = (&mut self.counts, &o.counts);
        c.holds_taken += d.holds_taken;
        c.holds_refused += d.holds_refused;
        c.confirmed += d.confirmed;
        c.confirm_too_late += d.confirm_too_late;
        c.released += d.released;
        c.release_after_expiry += d.release_after_expiry;
        c.abandoned += d.abandoned;
        c.unresolved += d.unresolved;
        for (u, v) in self.units.iter_mut().zip(&o.units) {
            *u += v;
        }
        for (mine, theirs) in self.allocated.iter_mut().zip(o.allocated) {
            mine.merge(theirs);
        }
        for (k, v) in o.retried {
            *self.retried.entry(k).or_default() += v;
        }
        for (k, v) in o.unexpected {
            *self.unexpected.entry(k).or_default() += v;
        }
        self.last_end = self.last_end.max(o.last_end);
        self.last_answer = self.last_answer.max(o.last_answer);
        self.started += o.started;
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    Hold,
    Confirm,
    Release,
}

impl Step {
    pub(super) fn name(self) -> &'static str {
        match self {
            Step::Hold => "hold",
            Step::Confirm => "confirm",
            Step::Release => "release",
        }
    }
}
