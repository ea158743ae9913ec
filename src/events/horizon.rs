//! Dating the feed's horizon: how late a feed answer's `as_of` may honestly be.
//!
//! A read serves only events whose transaction id is below its snapshot's `xmin` (see
//! [`super`]). A transaction that began before the read and is still open holds that `xmin`
//! back; meanwhile younger transactions commit, and their events — committed, acknowledged,
//! but at or above `xmin` — are held back with it. So a feed answer is complete only up to the
//! moment the oldest open transaction got its id: its `as_of` may be no later than that, even
//! on the primary (contract, "Events").
//!
//! **The mechanism: the primary's next transaction id, sampled on one clock.** The feed's
//! watcher already asks the primary for its horizon every tick; it also reads
//! `pg_snapshot_xmax(pg_current_snapshot())` — the next id to be assigned — and notes the
//! instant *before* it sent the query. So at that instant, every id at or above the value read
//! was still unassigned. A read whose snapshot has `xmin` X is then dated by the latest sample
//! whose next id is ≤ X: every transaction whose events the read held back (ids ≥ X) got its
//! id, and so committed, after that sample's instant.
//!
//! Why this and not `min(xact_start)` from `pg_stat_activity`: that bound is right only when
//! read *before* the feed's snapshot (a transaction committing in between would be missing
//! from it), so it costs a second statement per read; its `xact_start` is hidden from a role
//! without `pg_read_all_stats`; and on a replica it describes the replica's own sessions, not
//! the primary's transactions at the replayed position. The samples need no privilege, cost
//! no query of the read, and date a replica's snapshot too: a standby's snapshot `xmin` is the
//! primary's as replayed, and the samples are the primary's own ids, on the service's clock,
//! the one every `as_of` is stated on.
//!
//! A snapshot with `xmin` = `xmax` held nothing back: no bound. An `xmin` older than every
//! sample (a transaction open since before this instance started) is dated by the origin the
//! samples are seeded with: the distant past, which is what the service can vouch for.

use std::collections::VecDeque;
use std::time::Instant;

/// Samples kept; past this the older half is thinned to every other sample, so memory stays
/// bounded and old transactions are dated coarsely (earlier, never later).
const CAP: usize = 4096;

/// `(sent_at, next_xid)` samples of the primary, both ascending.
#[derive(Debug)]
pub struct XidClock {
    samples: VecDeque<(Instant, u64)>,
}

impl XidClock {
    /// A clock that knows nothing after `origin`: every id is dated no later than `origin`
    /// until samples arrive.
    pub fn new(origin: Instant) -> Self {
        XidClock {
            samples: VecDeque::from([(origin, 0)]),
        }
    }

    /// The primary answered `next_xid` to a query sent at `sent_at`: no id at or above it had
    /// been assigned then.
    pub fn observe(&mut self, sent_at: Instant, next_xid: u64) {
        // Ids never go back on one timeline; after a failover to a node that lost some, the
        // samples above the new next id are dropped (the dating only gets earlier).
        while self.samples.len() > 1 && self.samples.back().is_some_and(|s| s.1 > next_xid) {
            self.samples.pop_back();
        }
        let seeded_only = self.samples.len() == 1;
        match self.samples.back_mut() {
            Some(last) if sent_at < last.0 => return,
            Some(last) if last.1 == next_xid && !seeded_only => {
                last.0 = sent_at;
            }
            _ => self.samples.push_back((sent_at, next_xid)),
        }
        if self.samples.len() > CAP {
            let older = self.samples.len() / 2;
            let mut i = 0;
            // The origin (index 0) stays: it dates what precedes every sample.
            self.samples.retain(|_| {
                i += 1;
                i == 1 || i > older || i % 2 == 0
            });
        }
    }

    /// The latest instant at which no id ≥ `xid` had been assigned: every transaction with
    /// such an id committed after it.
    pub fn unassigned_at(&self, xid: u64) -> Instant {
        let after = self.samples.partition_point(|s| s.1 <= xid);
        // The origin's next id is 0, so `after` ≥ 1.
        self.samples[after.saturating_sub(1)].0
    }

    /// How late a read's `as_of` may be, given its snapshot's `xmin` and `xmax`: `None` when
    /// the snapshot held nothing back.
    pub fn bound(&self, xmin: u64, xmax: u64) -> Option<Instant> {
        (xmin < xmax).then(|| self.unassigned_at(xmin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(origin: Instant, ms: u64) -> Instant {
        origin + Duration::from_millis(ms)
    }

    #[test]
    fn a_held_back_id_is_dated_by_the_last_sample_that_had_not_yet_assigned_it() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        c.observe(at(o, 100), 500);
        c.observe(at(o, 200), 510);
        c.observe(at(o, 300), 530);
        // xmin 510: ids ≥ 510 were unassigned at 200 ms (and at 100 ms), not at 300 ms.
        assert_eq!(c.bound(510, 540), Some(at(o, 200)));
        assert_eq!(c.bound(529, 540), Some(at(o, 200)));
        assert_eq!(c.bound(530, 540), Some(at(o, 300)));
        assert_eq!(c.bound(505, 540), Some(at(o, 100)));
    }

    #[test]
    fn a_snapshot_that_held_nothing_back_is_not_bounded() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        c.observe(at(o, 100), 500);
        assert_eq!(c.bound(520, 520), None);
    }

    #[test]
    fn an_id_older_than_every_sample_is_dated_by_the_origin() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        c.observe(at(o, 100), 500);
        assert_eq!(c.bound(499, 520), Some(o));
    }

    #[test]
    fn an_unchanged_next_id_moves_its_sample_later() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        c.observe(at(o, 100), 500);
        c.observe(at(o, 350), 500);
        assert_eq!(c.bound(500, 501), Some(at(o, 350)));
        assert_eq!(c.samples.len(), 2);
    }

    #[test]
    fn ids_going_back_after_a_failover_drop_the_samples_above_them() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        c.observe(at(o, 100), 500);
        c.observe(at(o, 200), 600);
        c.observe(at(o, 300), 550);
        assert_eq!(c.bound(560, 570), Some(at(o, 300)));
        assert_eq!(c.bound(549, 570), Some(at(o, 100)));
    }

    #[test]
    fn thinning_keeps_memory_bounded_and_only_dates_earlier() {
        let o = Instant::now();
        let mut c = XidClock::new(o);
        for i in 1..=3 * CAP as u64 {
            c.observe(at(o, i), 10 * i);
        }
        assert!(c.samples.len() <= CAP);
        assert_eq!(c.samples[0], (o, 0));
        // The newest samples are exact; an old id is dated no later than it truly was.
        let n = 3 * CAP as u64;
        assert_eq!(c.bound(10 * n, 10 * n + 1), Some(at(o, n)));
        for xid in [15, 10 * 100 + 5, 10 * 5000] {
            let truth = at(o, xid / 10);
            assert!(c.unassigned_at(xid) <= truth);
        }
        let asc = c.samples.iter().zip(c.samples.iter().skip(1));
        assert!(asc.clone().all(|(a, b)| a.0 < b.0 && a.1 < b.1));
    }
}
