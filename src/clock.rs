//! Time, injectable where a rule depends on it.
//!
//! Staleness is measured on the monotonic clock ([`std::time::Instant`]) and turned into
//! wall-clock `as_of` values through one [`TimeBase`] taken at start, so every figure the
//! service prints comes from one clock. Rules with windows (the read-your-writes TTL) ask a
//! [`Clock`], which tests replace with a [`ManualClock`] to move time instead of sleeping.

use chrono::{DateTime, Utc};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// Wall-clock milliseconds for windowed rules.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> i64;
}

#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        Utc::now().timestamp_millis()
    }
}

/// A clock that moves only when told to.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(ManualClock(AtomicI64::new(Utc::now().timestamp_millis())))
    }
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
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
