//! Time, injectable where a rule depends on it.
//!
//! Staleness is measured on the monotonic clock ([`std::time::Instant`]) and turned into
//! wall-clock `as_of` values through [`TimeBase`], which reads the wall clock at each mapping,
//! so every figure the service prints comes from one clock and a step of the host's clock
//! never dates an answer later than it is. Rules with windows (the in-process read-your-writes
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

/// Maps monotonic instants to UTC, anchored afresh on the wall clock at every mapping: an
/// instant `d` before now is the wall clock's now minus `d`. An anchor taken once at start
/// would keep the wall clock of that moment: after the host's clock is stepped back (NTP
/// correcting a fast clock), every later `as_of` would claim moments the answer does not
/// include yet. Anchored at each use, a step moves every later `as_of` with the clock at
/// once (two clock reads, tens of nanoseconds); a step forward only makes one earlier, which
/// claims less.
#[derive(Clone)]
pub struct TimeBase {
    wall_now: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
}

impl std::fmt::Debug for TimeBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimeBase").finish_non_exhaustive()
    }
}

impl TimeBase {
    /// The host's wall clock.
    pub fn now() -> Self {
        TimeBase::with_wall(Utc::now)
    }

    /// Another wall clock (a test steps it).
    pub fn with_wall(wall_now: impl Fn() -> DateTime<Utc> + Send + Sync + 'static) -> Self {
        TimeBase {
            wall_now: Arc::new(wall_now),
        }
    }

    pub fn wall(&self, at: Instant) -> DateTime<Utc> {
        let now = Instant::now();
        let wall = (self.wall_now)();
        match now.checked_duration_since(at) {
            Some(d) => wall - chrono::Duration::from_std(d).unwrap_or_default(),
            None => wall + chrono::Duration::from_std(at - now).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The host's clock is stepped back 10 s after start: an instant from before the step,
    /// and one after it, are both dated by the clock as it reads now, never later.
    #[test]
    fn a_wall_clock_stepped_back_moves_every_later_as_of_with_it() {
        let clock = Arc::new(Mutex::new(Utc::now()));
        let reads = clock.clone();
        let base = TimeBase::with_wall(move || *reads.lock().expect("clock"));
        let before = Instant::now();
        assert!(base.wall(before) <= *clock.lock().expect("clock"));
        *clock.lock().expect("clock") -= chrono::Duration::seconds(10);
        let stepped = *clock.lock().expect("clock");
        assert!(
            base.wall(before) <= stepped,
            "{} > {stepped}",
            base.wall(before)
        );
        assert!(base.wall(Instant::now()) <= stepped);
        // And it is the clock's now for the present, within the time the calls take.
        let lag = stepped - base.wall(Instant::now());
        assert!(lag < chrono::Duration::seconds(1), "{lag}");
    }
}
