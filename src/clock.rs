//! Time, injectable where a rule depends on it.
//!
//! Staleness is measured on the monotonic clock ([`std::time::Instant`]) and turned into
//! wall-clock `as_of` values through [`TimeBase`], which re-anchors on the wall clock every
//! second and as soon as it sees the wall clock stepped back, so every figure the service
//! prints comes from one clock and a step of the host's clock never dates an answer later
//! than it is. Rules with windows (the in-process read-your-writes
//! TTL, the store-epoch pin) ask a [`Clock`] — monotonic too, so an NTP step or a skewed
//! peer can never end a window early — which tests replace with a [`ManualClock`] to move
//! time instead of sleeping. Redis-held windows are Redis's own `PX` expiry: one clock.

use chrono::{DateTime, Utc};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A monotonic clock for windowed rules.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Instant;
    /// The service's wall clock (a test sets it apart from the primary's).
    fn wall(&self) -> DateTime<Utc> {
        Utc::now()
    }
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

/// Maps monotonic instants to UTC through an anchor, a (monotonic, wall) pair, that is taken
/// again every second and at once when the wall clock is seen behind it. An anchor taken once
/// at start keeps the wall clock of that moment: after the host's clock is stepped back (NTP
/// correcting a fast clock) every later `as_of` would claim moments the answer does not
/// include yet. Every mapping reads the wall clock first and the monotonic clock second, so a
/// thread preempted between the two only makes the wall reading look early: a step back is
/// caught at the next mapping, and a false alarm merely re-anchors. An anchor is taken with
/// the wall reading between two monotonic ones, dated by the later one, so the mapping it
/// gives is never later than the wall clock. Between re-anchorings every mapping uses the same
/// pair, so two `as_of`s of one instant agree (reading the wall clock at every mapping would
/// let a preempted thread date one `as_of` later than another by the time it lost).
#[derive(Clone)]
pub struct TimeBase {
    wall_now: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>,
    anchor: Arc<Mutex<(Instant, DateTime<Utc>)>>,
}

/// How long an anchor serves before it is taken again (a step forward is taken up then).
const REANCHOR_EVERY: Duration = Duration::from_secs(1);
/// How far behind the anchor's mapping the wall clock must read to count as stepped back.
const STEP_TOLERANCE: Duration = Duration::from_millis(1);

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
        let wall_now: Arc<dyn Fn() -> DateTime<Utc> + Send + Sync> = Arc::new(wall_now);
        let anchor = Arc::new(Mutex::new(anchor(&*wall_now)));
        TimeBase { wall_now, anchor }
    }

    pub fn wall(&self, at: Instant) -> DateTime<Utc> {
        let wall = (self.wall_now)();
        let now = Instant::now();
        let pair = {
            let mut a = self.anchor.lock().unwrap_or_else(|p| p.into_inner());
            let stepped_back = wall + STEP_TOLERANCE < map(*a, now);
            if stepped_back || now.saturating_duration_since(a.0) > REANCHOR_EVERY {
                *a = anchor(&*self.wall_now);
            }
            *a
        };
        map(pair, at)
    }
}

/// A (monotonic, wall) pair: the wall clock read between two monotonic readings (taken again
/// while they are far apart), dated by the later one.
fn anchor(wall_now: &dyn Fn() -> DateTime<Utc>) -> (Instant, DateTime<Utc>) {
    let mut pair = (Instant::now(), wall_now());
    for _ in 0..5 {
        let before = Instant::now();
        let wall = wall_now();
        let after = Instant::now();
        pair = (after, wall);
        if after - before < Duration::from_micros(100) {
            break;
        }
    }
    pair
}

fn map((mono, wall): (Instant, DateTime<Utc>), at: Instant) -> DateTime<Utc> {
    match at.checked_duration_since(mono) {
        Some(d) => wall + chrono::Duration::from_std(d).unwrap_or_default(),
        None => wall - chrono::Duration::from_std(mono - at).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's clock is stepped back 10 s after start: an instant from before the step,
    /// and one after it, are both dated by the clock as it reads then, never later.
    #[test]
    fn a_wall_clock_stepped_back_moves_every_later_as_of_with_it() {
        // A wall clock that runs with the monotonic one, plus a step the test sets.
        let (origin, start) = (Instant::now(), Utc::now());
        let step = Arc::new(Mutex::new(chrono::Duration::zero()));
        let clock = {
            let step = step.clone();
            move || {
                start
                    + chrono::Duration::from_std(origin.elapsed()).unwrap_or_default()
                    + *step.lock().expect("step")
            }
        };
        let base = TimeBase::with_wall(clock.clone());
        let before = Instant::now();
        let first = base.wall(before);
        assert!(first <= clock());
        *step.lock().expect("step") = chrono::Duration::seconds(-10);
        let after = Instant::now();
        let (then, now) = (base.wall(before), base.wall(after));
        let reads = clock();
        assert!(
            then <= first - chrono::Duration::seconds(9),
            "{then} did not move with the step ({first})"
        );
        assert!(then <= reads, "{then} > {reads}");
        assert!(now <= reads, "{now} > {reads}");
        // And it is the clock's reading, within the time the calls take.
        assert!(
            reads - now < chrono::Duration::milliseconds(500),
            "{now} vs {reads}"
        );
    }
}
