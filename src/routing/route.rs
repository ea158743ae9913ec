//! A routing decision as a value: where a read went, why, and as of when.
//!
//! `stale_by` is restated at the moment an answer is produced ([`Route::restated`]) and
//! rounded *up* to whole milliseconds, while `as_of` is printed truncated to milliseconds:
//! so a printed `stale_by_ms` is never below `now - as_of` as a reader computes it.

use super::policy::QueryClass;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use std::fmt;
use std::time::{Duration, Instant};

/// Why a read went where it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A replica within the class's budget (and past the user's last write, if asked).
    FreshReplica,
    /// The class always reads the primary.
    PrimaryOnly,
    /// The read runs inside a transaction, which only the primary can open.
    InTransaction,
    /// No replica is configured.
    NoReplicas,
    /// Replicas exist but none is within the class's budget.
    NoFreshReplica,
    /// A replica is fresh enough, but none has replayed the user's last write yet.
    ReadYourWrites,
    /// The read-your-writes store could not be read: fail closed to the primary.
    RywStoreUnavailable,
    /// The chosen replica failed mid-read (or missed its timeout); retried elsewhere.
    ReplicaFailed,
    /// Every connection of our own pool to the replica was busy: local congestion, not a
    /// replica failure; retried elsewhere.
    ReplicaBusy,
    /// The replica's answer came back older than the class's budget; retried elsewhere.
    OverBudget,
    /// The replica had no such row (it may be newer than the replica): asked the primary.
    NotOnReplica,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::FreshReplica => "fresh_replica",
            Reason::PrimaryOnly => "primary_only",
            Reason::InTransaction => "in_transaction",
            Reason::NoReplicas => "no_replicas",
            Reason::NoFreshReplica => "no_fresh_replica",
            Reason::ReadYourWrites => "read_your_writes",
            Reason::RywStoreUnavailable => "ryw_store_unavailable",
            Reason::ReplicaFailed => "replica_failed",
            Reason::ReplicaBusy => "replica_busy",
            Reason::OverBudget => "over_budget",
            Reason::NotOnReplica => "not_on_replica",
        }
    }
}

/// Where a read was served and what moment it describes. Only `routing` makes one; the rest
/// of the service reads it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Route {
    pub(super) class: QueryClass,
    /// `"primary"` or the replica's name.
    pub(super) served_by: String,
    pub(super) reason: Reason,
    /// Every commit acknowledged before this moment is included in the answer.
    pub(super) as_of: DateTime<Utc>,
    /// `now − as_of` when the answer was produced.
    #[serde(serialize_with = "ser_ms")]
    pub(super) stale_by: Duration,
    /// `as_of` on the monotonic clock: lets the answer's staleness be restated at the moment
    /// it is produced, and a cached answer expire by it.
    #[serde(skip)]
    pub(super) as_of_instant: Instant,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(ceil_ms(*d))
}

/// Whole milliseconds, rounded up: a stated staleness may overstate, never understate.
pub fn ceil_ms(d: Duration) -> u64 {
    d.as_nanos().div_ceil(1_000_000) as u64
}

impl Route {
    /// The primary's answer as of `at` (`wall` is the same moment on the wall clock).
    pub(super) fn primary(
        class: QueryClass,
        reason: Reason,
        at: Instant,
        wall: DateTime<Utc>,
    ) -> Route {
        Route {
            class,
            served_by: "primary".into(),
            reason,
            as_of: wall,
            stale_by: Duration::ZERO,
            as_of_instant: at,
        }
    }

    /// A route as a test needs it: served by `served_by`, `stale_by` old at `now`.
    #[cfg(test)]
    pub(crate) fn example(
        class: QueryClass,
        served_by: &str,
        now: DateTime<Utc>,
        stale_by: Duration,
    ) -> Route {
        let at = Instant::now();
        Route {
            class,
            served_by: served_by.into(),
            reason: if served_by == "primary" {
                Reason::PrimaryOnly
            } else {
                Reason::FreshReplica
            },
            as_of: now - chrono::Duration::from_std(stale_by).unwrap_or_default(),
            stale_by,
            as_of_instant: at.checked_sub(stale_by).unwrap_or(at),
        }
    }

    /// A route as a test needs it: served by `served_by`, as of `at`, stated at `at`.
    #[cfg(test)]
    pub(crate) fn example_as_of(class: QueryClass, served_by: &str, at: Instant) -> Route {
        Route {
            as_of_instant: at,
            stale_by: Duration::ZERO,
            ..Route::example(class, served_by, Utc::now(), Duration::ZERO)
        }
    }

    /// The same answer as it should be stated at `now`: same `as_of`, staleness measured
    /// afresh.
    pub fn restated(mut self, now: Instant) -> Route {
        self.stale_by = now.saturating_duration_since(self.as_of_instant);
        self
    }

    pub fn served_by(&self) -> &str {
        &self.served_by
    }

    pub fn reason(&self) -> Reason {
        self.reason
    }

    pub fn is_primary(&self) -> bool {
        self.served_by == "primary"
    }

    /// Every commit acknowledged before this moment is included.
    pub fn as_of(&self) -> DateTime<Utc> {
        self.as_of
    }

    /// `as_of` on the monotonic clock.
    pub fn as_of_instant(&self) -> Instant {
        self.as_of_instant
    }

    pub fn stale_by(&self) -> Duration {
        self.stale_by
    }

    pub fn stale_by_ms(&self) -> u64 {
        ceil_ms(self.stale_by)
    }

    pub fn as_of_rfc3339(&self) -> String {
        self.as_of.to_rfc3339_opts(SecondsFormat::Millis, true)
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {} ({}, {} ms stale)",
            self.class,
            self.served_by,
            self.reason.as_str(),
            self.stale_by_ms()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_reads_as_a_sentence() {
        let mut r = Route::primary(
            QueryClass::StockGate,
            Reason::NoFreshReplica,
            Instant::now(),
            Utc::now(),
        );
        assert_eq!(
            r.to_string(),
            "stock_gate -> primary (no_fresh_replica, 0 ms stale)"
        );
        r.served_by = "replica-2".into();
        r.reason = Reason::FreshReplica;
        r.stale_by = Duration::from_millis(12);
        assert_eq!(
            r.to_string(),
            "stock_gate -> replica-2 (fresh_replica, 12 ms stale)"
        );
        assert!(!r.is_primary());
    }

    #[test]
    fn stated_staleness_rounds_up_so_it_never_understates() {
        assert_eq!(ceil_ms(Duration::from_micros(12_001)), 13);
        assert_eq!(ceil_ms(Duration::from_millis(12)), 12);
        assert_eq!(ceil_ms(Duration::ZERO), 0);
        let at = Instant::now();
        let r = Route::primary(QueryClass::StockGate, Reason::PrimaryOnly, at, Utc::now());
        let later = r.restated(at + Duration::from_micros(250_400));
        assert_eq!(later.stale_by_ms(), 251);
    }
}
