//! How fast an import writes: the batch size under AIMD, against the replicas' live
//! staleness.

use super::{Options, fmt_budget, millis};
use crate::routing::Db;
use std::time::Duration;

pub(super) const MIN_BATCH: usize = 50;
const MAX_BATCH: usize = 20_000;

/// The batch size, under AIMD: it grows additively while replicas keep well inside the
/// budget and halves when they near it or the import has to wait for them.
pub(super) struct Throttle {
    pub(super) batch: usize,
    pub(super) floor: usize,
    pub(super) budget: Duration,
}

impl Throttle {
    pub(super) fn new(opts: &Options) -> Throttle {
        let floor = MIN_BATCH.min(opts.batch_size.max(1));
        Throttle {
            batch: opts.batch_size.clamp(floor, MAX_BATCH),
            floor,
            budget: opts.lag_budget,
        }
    }

    pub(super) fn halve(&mut self) {
        self.batch = (self.batch / 2).max(self.floor);
    }

    pub(super) fn grow(&mut self) {
        self.batch = (self.batch + 250).min(MAX_BATCH);
    }

    /// After a batch, from the worst serving staleness (`None`: no replica serving).
    pub(super) fn adapt(&mut self, worst: Option<Duration>) {
        match worst {
            Some(d) if d > self.budget / 2 => self.halve(),
            Some(d) if d < self.budget / 4 => self.grow(),
            None => self.grow(),
            _ => {}
        }
    }
}

/// The replicas as the import sees them before a batch.
pub(super) struct Replicas {
    pub(super) worst_ms: Option<u64>,
    pub(super) down: Vec<String>,
    /// Why the batch must wait: the worst serving replica is over budget, or (with
    /// `--wait-for-down`) one is down. `None`: go.
    pub(super) waiting: Option<String>,
}

impl Replicas {
    pub(super) fn read(db: &Db, opts: &Options) -> Replicas {
        let (worst, down) = db.worst_serving_staleness();
        let waiting = match (&worst, down.first()) {
            (Some((name, d)), _) if *d > opts.lag_budget => Some(format!(
                "{name} at {:.1} s > {} budget",
                d.as_secs_f64(),
                fmt_budget(opts.lag_budget)
            )),
            (_, Some(name)) if opts.wait_for_down => Some(format!("{name} is down")),
            _ => None,
        };
        Replicas {
            worst_ms: worst.map(|(_, d)| millis(d)),
            down,
            waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn batches_halve_near_the_budget_and_grow_well_inside_it() {
        let mut throttle = Throttle::new(&Options {
            lag_budget: Duration::from_secs(4),
            batch_size: 1000,
            skip_invalid: false,
            wait_for_down: false,
        });
        throttle.adapt(Some(Duration::from_secs(3)));
        assert_eq!(throttle.batch, 500, "over half the budget");
        throttle.adapt(Some(Duration::from_millis(1500)));
        assert_eq!(throttle.batch, 500, "between a quarter and a half: kept");
        throttle.adapt(Some(Duration::from_millis(500)));
        assert_eq!(throttle.batch, 750, "under a quarter");
        throttle.adapt(None);
        assert_eq!(throttle.batch, 1000, "no replica serving");
        for _ in 0..10 {
            throttle.halve();
        }
        assert_eq!(throttle.batch, MIN_BATCH, "never below the floor");
    }
}
