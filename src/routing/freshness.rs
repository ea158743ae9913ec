//! Staleness arithmetic that cannot lie. Pure: every function takes the time it should
//! reason about, so tests drive it with made-up instants instead of sleeping.
//!
//! The monitor records the primary's WAL position `L` stamped with the moment `t` the
//! query was *sent*: every commit acknowledged before `t` ends at or before `L`. When a
//! replica reports that it has replayed up to `R`, it holds every commit acknowledged before
//! the newest primary sample with `L ≤ R`; that sample's `t` is the replica's `as_of`, and
//! its staleness bound is `now − as_of`. One clock (ours), no timestamps from the servers:
//! an idle primary gives ~0 (nothing new to replay) and a paused, frozen or unreachable
//! replica's bound keeps growing because its `as_of` stops moving.
//!
//! Under Patroni every sample also names its timeline (0 in the static mode). Positions on
//! different timelines are not comparable: a new primary timeline clears the primary's
//! samples, a replica on another timeline than the primary is not fresh (it is `down` with
//! the reason), and a read-your-writes position is judged by [`super::patroni::reached`].

use serde::Serialize;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use crate::lsn::Lsn;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    /// Answering, and within the eviction threshold.
    Healthy,
    /// Answering, but over the eviction threshold (or not yet back under half of it for
    /// long enough). Used only by classes whose budget exceeds the threshold.
    Lagging,
    /// Not answering within its timeout, refusing connections, or never sampled.
    Down,
}

impl ReplicaState {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaState::Healthy => "healthy",
            ReplicaState::Lagging => "lagging",
            ReplicaState::Down => "down",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    /// Staleness over which a healthy replica becomes `lagging`.
    pub evict_after: Duration,
    /// How long a lagging replica must stay under half the threshold to be readmitted.
    pub readmit_after: Duration,
    /// How long primary samples are kept; a replica further behind keeps its last `as_of`.
    pub retention: Duration,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            evict_after: Duration::from_secs(5),
            readmit_after: Duration::from_secs(1),
            retention: Duration::from_secs(900),
        }
    }
}

#[derive(Debug, Clone)]
struct Replica {
    state: ReplicaState,
    replay_lsn: Option<Lsn>,
    as_of: Option<Instant>,
    last_sample: Option<Instant>,
    under_half_since: Option<Instant>,
    ever_admitted: bool,
    last_error: Option<String>,
    /// The timeline its WAL receiver streams (0 in the static mode).
    timeline: u32,
}

/// What is known about one replica at a moment.
#[derive(Debug, Clone)]
pub struct ReplicaView {
    pub state: ReplicaState,
    pub replay_lsn: Option<Lsn>,
    pub as_of: Option<Instant>,
    pub staleness: Option<Duration>,
    pub last_error: Option<String>,
}

#[derive(Debug)]
pub struct Freshness {
    thresholds: Thresholds,
    primary: VecDeque<(Instant, Lsn)>,
    replicas: Vec<Replica>,
    /// The timeline the primary's samples are on (0 in the static mode).
    timeline: u32,
    /// Where each ended timeline switched to the next (Patroni's `/history`).
    history: super::patroni::History,
}

impl Freshness {
    pub fn new(replicas: usize, thresholds: Thresholds) -> Self {
        let fresh = Replica {
            state: ReplicaState::Down,
            replay_lsn: None,
            as_of: None,
            last_sample: None,
            under_half_since: None,
            ever_admitted: false,
            last_error: Some("not sampled yet".into()),
            timeline: 0,
        };
        Freshness {
            thresholds,
            primary: VecDeque::new(),
            replicas: vec![fresh; replicas],
            timeline: 0,
            history: Default::default(),
        }
    }

    /// Records the primary's position on `timeline`: samples from another timeline say
    /// nothing about this one (the same offset is different WAL), so they are dropped.
    pub fn record_primary_on(&mut self, timeline: u32, sent_at: Instant, lsn: Lsn) {
        if timeline != self.timeline {
            self.primary.clear();
            self.timeline = timeline;
        }
        self.record_primary(sent_at, lsn);
    }

    /// Records replica `i`'s replay position on the timeline it streams. A replica on
    /// another timeline than the primary's is not fresh, whatever its offset says.
    pub fn record_replica_on(&mut self, i: usize, timeline: u32, at: Instant, replay_lsn: Lsn) {
        if timeline != self.timeline {
            let primary = self.timeline;
            self.record_replica_error(
                i,
                format!("on timeline {timeline}, the primary is on {primary}"),
            );
            return;
        }
        self.replicas[i].timeline = timeline;
        self.record_replica(i, at, replay_lsn);
    }

    pub fn timeline(&self) -> u32 {
        self.timeline
    }

    pub fn set_history(&mut self, history: super::patroni::History) {
        self.history = history;
    }

    /// Whether replica `i` has replayed `position` (a timeline-tagged position, see
    /// [`super::patroni::position`]).
    pub fn reached(&self, i: usize, position: Lsn) -> bool {
        let r = &self.replicas[i];
        r.replay_lsn.is_some_and(|replay| {
            super::patroni::reached(position, r.timeline, replay, &self.history)
        })
    }

    pub fn thresholds(&self) -> Thresholds {
        self.thresholds
    }

    /// Records the primary's WAL position, stamped with when the query was sent.
    pub fn record_primary(&mut self, sent_at: Instant, lsn: Lsn) {
        if let Some(&(_, last)) = self.primary.back()
            && lsn < last
        {
            // A primary going backwards means a different server (failover, restore): the
            // old samples say nothing about it.
            self.primary.clear();
        }
        self.primary.push_back((sent_at, lsn));
        while self.primary.len() > 1
            && self
                .primary
                .front()
                .is_some_and(|&(t, _)| sent_at.duration_since(t) > self.thresholds.retention)
        {
            self.primary.pop_front();
        }
    }

    pub fn primary_lsn(&self) -> Option<Lsn> {
        self.primary.back().map(|&(_, l)| l)
    }

    /// Records that replica `i` had replayed up to `replay_lsn` when sampled at `at`.
    pub fn record_replica(&mut self, i: usize, at: Instant, replay_lsn: Lsn) {
        let newest_covered = self.primary.partition_point(|&(_, l)| l <= replay_lsn);
        let covered_at = newest_covered.checked_sub(1).map(|k| self.primary[k].0);
        let th = self.thresholds;
        let r = &mut self.replicas[i];
        let went_back = r.replay_lsn.is_some_and(|prev| replay_lsn < prev);
        r.replay_lsn = Some(replay_lsn);
        // Judged by its current position: a standby that restarted at an earlier recovery
        // point has an earlier `as_of`, however fresh it looked before. Moving forward, a
        // position older than every retained sample keeps the `as_of` it had (it cannot
        // have lost what it held).
        r.as_of = match covered_at {
            Some(t) => Some(t),
            None if went_back => None,
            None => r.as_of,
        };
        r.last_sample = Some(at);
        r.last_error = None;
        let staleness = r
            .as_of
            .map(|t| at.saturating_duration_since(t))
            .unwrap_or(Duration::MAX);
        let under_half = staleness <= th.evict_after / 2;
        match r.state {
            ReplicaState::Healthy if staleness > th.evict_after => {
                r.state = ReplicaState::Lagging;
                r.under_half_since = None;
            }
            ReplicaState::Healthy => {}
            ReplicaState::Lagging | ReplicaState::Down => {
                if !under_half {
                    r.under_half_since = None;
                    r.state = ReplicaState::Lagging;
                } else if !r.ever_admitted {
                    // First sight of a replica that is already caught up: no probation.
                    r.state = ReplicaState::Healthy;
                } else {
                    let since = *r.under_half_since.get_or_insert(at);
                    r.state = if at.duration_since(since) >= th.readmit_after {
                        ReplicaState::Healthy
                    } else {
                        ReplicaState::Lagging
                    };
                }
                if r.state == ReplicaState::Healthy {
                    r.ever_admitted = true;
                    r.under_half_since = None;
                }
            }
        }
    }

    /// Replica `i` failed to answer (error, refused, timeout): it is `down` at once.
    pub fn record_replica_error(&mut self, i: usize, error: String) {
        let r = &mut self.replicas[i];
        r.state = ReplicaState::Down;
        r.under_half_since = None;
        r.last_error = Some(error);
    }

    pub fn view(&self, i: usize, now: Instant) -> ReplicaView {
        let r = &self.replicas[i];
        ReplicaView {
            state: r.state,
            replay_lsn: r.replay_lsn,
            as_of: r.as_of,
            staleness: r.as_of.map(|t| now.saturating_duration_since(t)),
            last_error: r.last_error.clone(),
        }
    }

    pub fn replay_lsn(&self, i: usize) -> Option<Lsn> {
        self.replicas[i].replay_lsn
    }

    pub fn as_of(&self, i: usize) -> Option<Instant> {
        self.replicas[i].as_of
    }

    /// Whether replica `i` may serve a read whose staleness budget is `budget` (`None`: any
    /// replica that is not down). Lagging replicas serve only budgets beyond the eviction
    /// threshold, which is what gives readmission its hysteresis.
    pub fn eligible(&self, i: usize, now: Instant, budget: Option<Duration>) -> bool {
        let r = &self.replicas[i];
        match (r.state, budget) {
            (ReplicaState::Down, _) => false,
            (_, None) => true,
            (state, Some(budget)) => {
                let Some(as_of) = r.as_of else { return false };
                if now.saturating_duration_since(as_of) > budget {
                    return false;
                }
                state == ReplicaState::Healthy || budget > self.thresholds.evict_after
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn tracker() -> (Freshness, Instant) {
        (Freshness::new(2, Thresholds::default()), Instant::now())
    }

    /// After a promotion the new leader's offsets continue from the fork; a replica still
    /// streaming the old timeline (or the old leader's leftovers) is not fresh, whatever
    /// its offset, and the old timeline's samples are not used to date the new one's.
    #[test]
    fn a_replica_on_another_timeline_than_the_primary_is_not_fresh() {
        let (mut f, t0) = tracker();
        f.record_primary_on(1, t0, 5_000);
        f.record_replica_on(0, 1, t0 + MS, 5_000);
        f.record_replica_on(1, 1, t0 + MS, 5_000);
        assert!(f.eligible(0, t0 + 2 * MS, Some(250 * MS)));
        // Timeline 2 forked at 4_000 and has written up to 4_500.
        let t1 = t0 + 100 * MS;
        f.record_primary_on(2, t1, 4_500);
        f.record_replica_on(0, 1, t1 + MS, 6_000);
        assert_eq!(f.view(0, t1 + 2 * MS).state, ReplicaState::Down);
        assert!(
            f.view(0, t1 + 2 * MS)
                .last_error
                .is_some_and(|e| e.contains("timeline 1"))
        );
        // A replica that follows timeline 2 is dated by timeline 2's samples only.
        f.record_replica_on(1, 2, t1 + MS, 4_500);
        assert_eq!(f.as_of(1), Some(t1));
        assert!(f.eligible(1, t1 + 2 * MS, Some(250 * MS)));
    }

    #[test]
    fn a_users_position_is_judged_on_its_timeline() {
        use crate::routing::patroni::{History, position};
        let (mut f, t0) = tracker();
        f.record_primary_on(2, t0, 9_000);
        f.record_replica_on(0, 2, t0 + MS, 9_000);
        // Written on timeline 1 past where it ended (lost), and before (kept).
        f.set_history(History::new(vec![(1, 4_000)]));
        assert!(!f.reached(0, position(1, 5_000)));
        assert!(f.reached(0, position(1, 3_000)));
        assert!(f.reached(0, position(2, 9_000)));
        assert!(!f.reached(0, position(2, 9_001)));
        // The static mode: timeline 0 everywhere, bare offsets, as before.
        let (mut s, t) = tracker();
        s.record_primary(t, 100);
        s.record_replica(0, t, 100);
        assert!(s.reached(0, 100) && !s.reached(0, 101));
    }

    #[test]
    fn an_idle_primary_shows_no_false_lag() {
        let (mut f, t0) = tracker();
        // Nothing is written for 10 s: the WAL position never moves.
        for k in 0..200u32 {
            let t = t0 + 50 * MS * k;
            f.record_primary(t, 1000);
            f.record_replica(0, t + MS, 1000);
        }
        let now = t0 + 50 * MS * 200;
        let v = f.view(0, now);
        assert_eq!(v.state, ReplicaState::Healthy);
        assert!(v.staleness.is_some_and(|s| s <= 51 * MS), "{v:?}");
    }

    #[test]
    fn a_paused_replica_grows_stale_by_exactly_the_time_since_its_position() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 100);
        f.record_replica(0, t0 + MS, 100);
        // The replica stops replaying while the primary keeps writing.
        for k in 1..=100u32 {
            let t = t0 + 50 * MS * k;
            f.record_primary(t, 100 + k as u64);
            f.record_replica(0, t + MS, 100);
        }
        let now = t0 + 5_050 * MS;
        assert_eq!(f.view(0, now).staleness, Some(5_050 * MS));
        assert!(!f.eligible(0, now, Some(250 * MS)));
        assert!(
            f.eligible(0, now, Some(30_000 * MS)),
            "the dashboard may still use it"
        );
    }

    #[test]
    fn a_replica_that_stops_answering_grows_stale_without_new_samples() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 5);
        f.record_replica(0, t0, 5);
        assert!(f.eligible(0, t0 + 100 * MS, Some(250 * MS)));
        // No sample arrives (the monitor is stuck on it): the arithmetic alone evicts it.
        assert!(!f.eligible(0, t0 + 300 * MS, Some(250 * MS)));
    }

    #[test]
    fn a_replica_ahead_of_the_newest_sample_gets_that_samples_time_not_later() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 10);
        f.record_replica(0, t0 + 10 * MS, 50);
        assert_eq!(f.view(0, t0 + 10 * MS).as_of, Some(t0));
    }

    #[test]
    fn a_replica_that_restarts_behind_is_judged_by_where_it_is_now() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 10);
        f.record_primary(t0 + 50 * MS, 20);
        f.record_replica(0, t0 + 60 * MS, 20);
        assert_eq!(f.view(0, t0 + 60 * MS).as_of, Some(t0 + 50 * MS));
        // The standby crash-restarts and reopens at an earlier recovery point (10), while
        // the primary writes on.
        for k in 1..=10u32 {
            f.record_primary(t0 + 50 * MS + 30 * MS * k, 20 + u64::from(k));
        }
        let now = t0 + 400 * MS;
        f.record_replica(0, now, 10);
        let v = f.view(0, now);
        assert_eq!(v.as_of, Some(t0), "as_of goes back with the position");
        assert_eq!(v.staleness, Some(400 * MS));
        assert!(
            !f.eligible(0, now, Some(250 * MS)),
            "no longer fit for the gate"
        );
        // Behind every retained sample: no `as_of` at all, fit for nothing with a budget.
        let mut g = Freshness::new(1, Thresholds::default());
        g.record_primary(t0, 100);
        g.record_replica(0, t0, 100);
        g.record_replica(0, t0 + MS, 50);
        assert_eq!(g.view(0, t0 + MS).as_of, None);
        assert!(!g.eligible(0, t0 + MS, Some(300_000 * MS)));
    }

    #[test]
    fn errors_mark_down_and_recovery_needs_time_under_half_the_threshold() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 1);
        f.record_replica(0, t0, 1);
        assert_eq!(f.view(0, t0).state, ReplicaState::Healthy);
        f.record_replica_error(0, "refused".into());
        assert_eq!(f.view(0, t0).state, ReplicaState::Down);
        assert!(!f.eligible(0, t0, None));
        // Back and caught up, but on probation for `readmit_after`.
        let t1 = t0 + 100 * MS;
        f.record_primary(t1, 1);
        f.record_replica(0, t1, 1);
        assert_eq!(f.view(0, t1).state, ReplicaState::Lagging);
        assert!(!f.eligible(0, t1, Some(250 * MS)));
        let t2 = t1 + 1_000 * MS;
        f.record_primary(t2, 1);
        f.record_replica(0, t2, 1);
        assert_eq!(f.view(0, t2).state, ReplicaState::Healthy);
        assert!(f.eligible(0, t2, Some(250 * MS)));
    }

    #[test]
    fn hysteresis_keeps_a_replica_at_the_edge_from_flapping() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 1);
        f.record_replica(0, t0, 1);
        // 6 s behind: lagging.
        let t1 = t0 + 6_000 * MS;
        f.record_primary(t1, 2);
        f.record_replica(0, t1, 1);
        assert_eq!(f.view(0, t1).state, ReplicaState::Lagging);
        // Catches up to 3 s behind: still over half the threshold, still lagging.
        let t2 = t1 + 100 * MS;
        f.record_primary(t2, 3);
        let f_at = |f: &mut Freshness, t: Instant, lsn| {
            f.record_replica(0, t, lsn);
            f.view(0, t).state
        };
        // replay position 2 was the primary's at t1 → 100 ms stale: under half, probation.
        assert_eq!(f_at(&mut f, t2, 2), ReplicaState::Lagging);
    }

    #[test]
    fn a_primary_that_goes_backwards_forgets_old_samples() {
        let (mut f, t0) = tracker();
        f.record_primary(t0, 1_000);
        f.record_primary(t0 + MS, 10);
        assert_eq!(f.primary_lsn(), Some(10));
        f.record_replica(0, t0 + 2 * MS, 10);
        assert_eq!(f.view(0, t0 + 2 * MS).as_of, Some(t0 + MS));
    }
}
