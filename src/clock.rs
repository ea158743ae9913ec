//! Time, injectable where a rule depends on it.
//!
//! Staleness is measured on the monotonic clock ([`std::time::Instant`]) and turned into
//! wall-clock `as_of` values through one [`TimeBase`] taken at start, so every figure the
//! service prints comes from one clock. Rules with windows (the in-process read-your-writes
//! TTL, the store-epoch pin) ask a [`Clock`] — monotonic too, so an NTP step or a skewed
//! peer can never end a window early — which tests replace with a [`ManualClock`] to move
//! time instead of sleeping. Redis-held windows are Redis's own `PX` expiry: one clock.

use chrono::{DateTime, Utc};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock for windowed rules.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Instant;
}

#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to (from the instant it was made).
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    offset_ns: AtomicU64,
}

impl ManualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(ManualClock {
            start: Instant::now(),
            offset_ns: AtomicU64::new(0),
        })
    }
    pub fn advance(&self, by: Duration) {
        self.offset_ns
            .fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + Duration::from_nanos(self.offset_ns.load(Ordering::SeqCst))
    }
}

/// Maps monotonic instants to UTC through one pair taken at start.
#[derive(Debug, Clone, Copy)]
pub struct TimeBase {
    instant: Instant,
    wall: DateTime<Utc>,
}

impl TimeBase {
    pub fn now() -> Self {
        TimeBase {
            instant: Instant::now(),
            wall: Utc::now(),
        }
    }

    pub fn wall(&self, at: Instant) -> DateTime<Utc> {
        match at.checked_duration_since(self.instant) {
            Some(d) => self.wall + chrono::Duration::from_std(d).unwrap_or_default(),
            None => self.wall - chrono::Duration::from_std(self.instant - at).unwrap_or_default(),
        }
    }
}
