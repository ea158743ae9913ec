//! The per-user order rate (`STOCKGATE_ORDER_RATE_PER_USER`).

use crate::clock::Clock;
use crate::domain::UserId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A token bucket per user: `rate` orders per second, bursts of up to `rate`, refilled by
/// its [`Clock`] (a test moves a manual one rather than racing a 1/`rate` s window).
pub struct RateLimiter {
    rate: f64,
    clock: Arc<dyn Clock>,
    buckets: Mutex<HashMap<UserId, (f64, Instant)>>,
}

impl RateLimiter {
    pub fn with_clock(rate: u32, clock: Arc<dyn Clock>) -> Self {
        RateLimiter {
            rate: f64::from(rate),
            clock,
            buckets: Mutex::default(),
        }
    }

    pub fn allow(&self, user: &UserId) -> bool {
        let now = self.clock.now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() > 100_000 {
            // Full buckets carry no state worth keeping.
            let rate = self.rate;
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * rate < rate
            });
        }
        let (tokens, at) = buckets.entry(user.clone()).or_insert((self.rate, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.rate);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_rate_limiter_allows_a_burst_then_refuses_per_user() {
        let clock = crate::clock::ManualClock::new();
        let l = RateLimiter::with_clock(3, clock.clone());
        let ada = UserId::parse("ada").expect("valid");
        let bob = UserId::parse("bob").expect("valid");
        assert_eq!((0..5).filter(|_| l.allow(&ada)).count(), 3);
        assert!(l.allow(&bob), "another user has their own bucket");
        clock.advance(Duration::from_millis(334));
        assert_eq!(
            (0..3).filter(|_| l.allow(&ada)).count(),
            1,
            "one token per 1/3 s"
        );
    }
}
