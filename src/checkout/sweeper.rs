//! The sweeper: holds past their time end (their units go back exactly once, whichever
//! instance sweeps), and refusals older than the idempotency window are deleted (their keys
//! may be used anew). Every instance sweeps; `SKIP LOCKED` keeps them apart.

use super::{Checkout, holds, refusals};
use std::time::Duration;

/// Stops the sweeper (holds, old refusals) when dropped (with the application).
pub struct SweeperGuard(tokio::task::JoinHandle<()>);

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Checkout {
    /// Sweeps, every `every`, until the guard drops: holds past their time (their units go
    /// back exactly once, whichever instance sweeps, and reopen this instance's gate), and
    /// refusals older than `idempotency_window` (their keys may be used anew).
    pub fn start_sweeper(&self, every: Duration, idempotency_window: Duration) -> SweeperGuard {
        let this = self.clone();
        SweeperGuard(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                this.sweep_holds().await;
                this.purge_refusals(idempotency_window).await;
            }
        }))
    }

    /// Deletes refusals older than `window`, in statements of a thousand, until none is left
    /// (every instance does; `SKIP LOCKED` keeps them apart).
    async fn purge_refusals(&self, window: Duration) {
        const BATCH: i64 = 1000;
        loop {
            match refusals::purge(&self.db, window, BATCH).await {
                Ok((orders, holds)) => {
                    self.metrics
                        .refusals_purged
                        .inc_by(u64::try_from(orders + holds).unwrap_or(0));
                    if orders.max(holds) < BATCH {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not purge old refusals; retrying next tick");
                    break;
                }
            }
        }
    }

    async fn sweep_holds(&self) {
        const BATCH: i64 = 500;
        loop {
            match holds::expire_due(&self.db, BATCH).await {
                Ok((ended, products)) => {
                    self.metrics
                        .holds
                        .with_label_values(&["expired"])
                        .inc_by(ended as u64);
                    self.reopened(&products).await;
                    if ended == 0 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not sweep expired holds; retrying next tick");
                    break;
                }
            }
        }
        if let Ok(held) = holds::units_held(&self.db, i64::MAX).await {
            self.metrics
                .units_held
                .set(held.iter().map(|(_, u)| u).sum());
        }
    }
}
