//! The write side of read-your-writes: after a user's write, record the primary's position
//! so that user's reads, on any device and instance, are served only where it is replayed.

use super::Db;
use super::freshness::Lsn;
use super::policy::QueryClass;
use crate::domain::UserId;
use crate::ryw::PRIMARY_ONLY;
use std::time::{Duration, Instant};

impl Db {
    /// Records a user's write for read-your-writes: the primary's position after the
    /// commit. Never turns the committed write into an error: if the position cannot be
    /// read, the user is recorded at [`PRIMARY_ONLY`] (their reads go to the primary for one
    /// TTL); if the shared store cannot record it, this instance remembers it and the write
    /// is acknowledged only once no replica that lacks it can still serve the user's reads
    /// anywhere (each has replayed it, or is past the read-your-writes budget since the
    /// commit). Returns the position for `X-Consistency-Token`, when known.
    pub async fn note_write(&self, user: &UserId) -> Option<Lsn> {
        let committed = Instant::now();
        let lsn = match tokio::time::timeout(
            self.inner.primary_timeout,
            self.inner.primary.current_lsn(),
        )
        .await
        {
            Ok(Ok(lsn)) => Some(lsn),
            Ok(Err(e)) => {
                self.ryw_failed("position", user, &e, "pinning the user to the primary");
                None
            }
            Err(_) => {
                self.ryw_failed(
                    "position",
                    user,
                    &"timed out",
                    "pinning the user to the primary",
                );
                None
            }
        };
        self.pin(user, lsn.unwrap_or(PRIMARY_ONLY), committed).await;
        lsn
    }

    /// Records a user's write whose COMMIT was sent and never answered: it may have landed,
    /// at a position no one knows, so the user is pinned to the primary for one TTL, like a
    /// write whose position could not be read.
    pub async fn note_unknown_write(&self, user: &UserId) {
        self.pin(user, PRIMARY_ONLY, Instant::now()).await;
    }

    /// Records `pin` for `user` in the shared store; if the store cannot, returns only once
    /// no replica without the write can still serve the user's reads anywhere.
    async fn pin(&self, user: &UserId, pin: Lsn, committed: Instant) {
        if let Err(e) = self.inner.ryw.advance(user, pin).await {
            self.ryw_failed(
                "advance",
                user,
                &e,
                "waiting until no replica without the write can serve the user",
            );
            let waited = self.wait_out_replicas_behind(pin, committed).await;
            tracing::info!(user = %user, ?waited, "write acknowledged without the shared store");
        }
    }

    /// The one place a read-your-writes failure is counted and logged: `step` is what
    /// failed (`get`, `advance`, `position`), `then` what the service does instead.
    pub(super) fn ryw_failed(
        &self,
        step: &str,
        user: &UserId,
        error: &dyn std::fmt::Display,
        then: &str,
    ) {
        // Each step's series is exported at 0 from the start; a new step must be listed.
        debug_assert!(crate::metrics::RYW_STEPS.contains(&step), "{step}");
        self.inner
            .metrics
            .ryw_store_failures
            .with_label_values(&[step])
            .inc();
        tracing::warn!(%error, user = %user, step, "read-your-writes step failed; {then}");
    }

    /// Waits until every replica has replayed `lsn` (as this instance's monitor sees it) or
    /// can no longer be within the read-your-writes budget of any reader: a replica lacking
    /// a write acknowledged at `committed` has an `as_of` before it on every instance, so
    /// once `budget` (plus two monitor periods of margin) has passed, no router uses it for
    /// that user's data. Returns how long it waited.
    async fn wait_out_replicas_behind(&self, lsn: Lsn, committed: Instant) -> Duration {
        let budget = QueryClass::OwnData.policy().budget();
        let deadline = committed + budget + 2 * self.inner.monitor_interval;
        let period = self.inner.monitor_interval.max(Duration::from_millis(5));
        loop {
            let all_have_it = {
                let f = self.freshness_read();
                (0..self.inner.replicas.len()).all(|i| f.reached(i, lsn))
            };
            let now = Instant::now();
            if all_have_it || now >= deadline {
                return now.saturating_duration_since(committed);
            }
            tokio::time::sleep(period.min(deadline - now)).await;
        }
    }
}
