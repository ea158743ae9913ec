//! The pure routing decision: where a read under a policy goes, given what the monitor
//! knows. Pure, so the routing audit checks every class against staleness it makes up.

use super::freshness::{Freshness, Lsn};
use super::policy::{self, Target, WhenNoFreshReplica};
use super::route::Reason;
use std::time::Instant;

/// A routing decision before it is dressed as a [`Route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Replica `i`, whose answer includes every commit acknowledged before the instant.
    Replica(usize, Instant),
    Primary(Reason),
    /// No replica is fresh enough and the class refuses the primary.
    Refuse,
}

/// Where a read under `policy` goes, given what the monitor knows at `now`. Pure, so the
/// routing audit can check every class against staleness it makes up (a 5-minute budget
/// cannot be waited out in a test). Among eligible replicas the least loaded wins; ties
/// go round-robin from `start`.
pub fn choose(
    policy: &policy::Policy,
    f: &Freshness,
    now: Instant,
    min_lsn: Option<Lsn>,
    loads: &[usize],
    start: usize,
) -> Choice {
    choose_among(policy, f, now, min_lsn, loads, start, |_| false)
}

/// The (target, reason) pairs a class's reads can be counted under in
/// `routing_decisions_total`: what [`choose_among`], a retried read and a read inside a
/// transaction can decide. Reads of a replica-target class that land on the primary are
/// also its fallbacks.
pub fn possible_decisions(p: &policy::Policy) -> Vec<(&'static str, Reason)> {
    let mut out = vec![("primary", Reason::InTransaction)];
    match p.target {
        Target::Primary => out.push(("primary", Reason::PrimaryOnly)),
        Target::Replica => {
            out.push(("replica", Reason::FreshReplica));
            let mut fallbacks = vec![
                Reason::NoReplicas,
                Reason::NoFreshReplica,
                Reason::ReplicaFailed,
                Reason::ReplicaBusy,
                Reason::OverBudget,
                Reason::NotOnReplica,
            ];
            if p.read_your_writes {
                fallbacks.extend([Reason::ReadYourWrites, Reason::RywStoreUnavailable]);
            }
            out.extend(fallbacks.into_iter().map(|r| ("primary", r)));
            if p.when_no_fresh_replica == WhenNoFreshReplica::Refuse {
                out.push(("refused", Reason::NoFreshReplica));
            }
        }
    }
    out
}

/// [`choose`], never picking a replica for which `skip` holds (already tried this read).
pub fn choose_among(
    policy: &policy::Policy,
    f: &Freshness,
    now: Instant,
    min_lsn: Option<Lsn>,
    loads: &[usize],
    start: usize,
    skip: impl Fn(usize) -> bool,
) -> Choice {
    if policy.target == Target::Primary {
        return Choice::Primary(Reason::PrimaryOnly);
    }
    if loads.is_empty() {
        return Choice::Primary(Reason::NoReplicas);
    }
    let mut best: Option<(usize, usize)> = None;
    let mut behind_min_lsn = false;
    for k in 0..loads.len() {
        let i = (start + k) % loads.len();
        if skip(i) || !f.eligible(i, now, policy.budget) {
            continue;
        }
        if let Some(min) = min_lsn
            && !f.reached(i, min)
        {
            behind_min_lsn = true;
            continue;
        }
        if best.is_none_or(|(_, l)| loads[i] < l) {
            best = Some((i, loads[i]));
        }
    }
    match best.and_then(|(i, _)| f.as_of(i).map(|t| (i, t))) {
        Some((i, as_of)) => Choice::Replica(i, as_of),
        None if behind_min_lsn => Choice::Primary(Reason::ReadYourWrites),
        None if policy.when_no_fresh_replica == WhenNoFreshReplica::Refuse => Choice::Refuse,
        None => Choice::Primary(Reason::NoFreshReplica),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::freshness::Thresholds;
    use crate::routing::policy::QueryClass;
    use std::time::Duration;

    /// Two replicas, both `staleness` behind at `now` (healthy or lagging as the state
    /// machine decides), unless `down`.
    fn world(staleness: Duration, down: bool) -> (Freshness, Instant) {
        let mut f = Freshness::new(2, Thresholds::default());
        let t0 = Instant::now();
        f.record_primary(t0, 100);
        for i in 0..2 {
            f.record_replica(i, t0, 100);
        }
        let now = t0 + staleness;
        f.record_primary(now, 200);
        for i in 0..2 {
            if down {
                f.record_replica_error(i, "refused".into());
            } else {
                f.record_replica(i, now, 100);
            }
        }
        (f, now)
    }

    /// The routing audit with made-up staleness, for budgets too long to wait out in a
    /// test: every class, just inside and just outside its budget, and with replicas down.
    #[test]
    fn audit_every_class_against_its_budget() {
        use QueryClass::*;
        const MS: Duration = Duration::from_millis(1);
        // (class, staleness, replicas down, expected)
        let primary = |r| Choice::Primary(r);
        let table: &[(QueryClass, Duration, bool, Option<Reason>)] = &[
            (StockGate, 10 * MS, false, None),
            (StockGate, 251 * MS, false, Some(Reason::NoFreshReplica)),
            (StockGate, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (ProductPage, 4_900 * MS, false, None),
            (ProductPage, 5_100 * MS, false, Some(Reason::NoFreshReplica)),
            (ProductPage, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (OwnData, 4_900 * MS, false, None),
            (OwnData, 5_100 * MS, false, Some(Reason::NoFreshReplica)),
            (OwnData, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (OrderLookup, 10 * MS, false, Some(Reason::PrimaryOnly)),
            (Dashboard, 29_000 * MS, false, None),
            (Dashboard, 31_000 * MS, false, Some(Reason::NoFreshReplica)),
            (Dashboard, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (RevenueReport, 299_000 * MS, false, None),
            (
                RevenueReport,
                301_000 * MS,
                false,
                Some(Reason::NoFreshReplica),
            ),
            (RevenueReport, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Export, 3_600_000 * MS, false, None),
            (Export, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Events, 4_900 * MS, false, None),
            (Events, 5_100 * MS, false, Some(Reason::NoFreshReplica)),
            (Events, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Ledger, 59_000 * MS, false, None),
            (Ledger, 61_000 * MS, false, Some(Reason::NoFreshReplica)),
            (Ledger, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Primary, 10 * MS, false, Some(Reason::PrimaryOnly)),
        ];
        for &(class, staleness, down, expected) in table {
            let (f, now) = world(staleness, down);
            let got = choose(class.policy(), &f, now, None, &[0, 0], 0);
            // Every decision is a series exported from the start.
            let counted_as = match got {
                Choice::Replica(..) => ("replica", Reason::FreshReplica),
                Choice::Primary(r) => ("primary", r),
                Choice::Refuse => ("refused", Reason::NoFreshReplica),
            };
            assert!(
                possible_decisions(class.policy()).contains(&counted_as),
                "{class}: {counted_as:?} is not exported from the start"
            );
            match expected {
                None => assert!(
                    matches!(got, Choice::Replica(..)),
                    "{class} at {staleness:?}: {got:?}"
                ),
                Some(r) => assert_eq!(got, primary(r), "{class} at {staleness:?} down={down}"),
            }
        }
        let audited: std::collections::HashSet<_> = table.iter().map(|t| t.0).collect();
        for class in QueryClass::ALL {
            assert!(audited.contains(class), "{class} has no routing audit row");
        }
    }

    #[test]
    fn read_your_writes_needs_a_replica_past_the_users_position() {
        let (f, now) = world(Duration::from_millis(10), false);
        let policy = QueryClass::OwnData.policy();
        assert!(matches!(
            choose(policy, &f, now, Some(100), &[0, 0], 0),
            Choice::Replica(..)
        ));
        assert_eq!(
            choose(policy, &f, now, Some(101), &[0, 0], 0),
            Choice::Primary(Reason::ReadYourWrites)
        );
    }

    #[test]
    fn the_least_loaded_fresh_replica_wins() {
        let (f, now) = world(Duration::from_millis(10), false);
        let gate = QueryClass::StockGate.policy();
        assert!(matches!(
            choose(gate, &f, now, None, &[5, 1], 0),
            Choice::Replica(1, _)
        ));
        assert!(matches!(
            choose(gate, &f, now, None, &[0, 3], 1),
            Choice::Replica(0, _)
        ));
        assert_eq!(
            choose(gate, &f, now, None, &[], 0),
            Choice::Primary(Reason::NoReplicas)
        );
    }

    #[test]
    fn a_class_may_refuse_instead_of_loading_the_primary() {
        let (f, now) = world(Duration::from_secs(1), false);
        let strict = policy::Policy {
            when_no_fresh_replica: WhenNoFreshReplica::Refuse,
            ..*QueryClass::StockGate.policy()
        };
        assert_eq!(choose(&strict, &f, now, None, &[0, 0], 0), Choice::Refuse);
    }
}
