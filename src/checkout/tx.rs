//! How a change's transaction ends: wholly or not at all, and never with a guessed outcome.

use super::error::CheckoutError;
use std::future::Future;

/// Runs `work` in a task of its own and awaits it: a client that hangs up (dropping the
/// request's future) cannot cut a change short between its commit and what must follow it
/// (the gate's reopen, the counters), so the whole change happens or none. A task that died
/// may have committed: that is [`CheckoutError::OutcomeUnknown`], and the same request
/// again tells.
pub(crate) async fn whole_or_none<T: Send + 'static>(
    work: impl Future<Output = Result<T, CheckoutError>> + Send + 'static,
) -> Result<T, CheckoutError> {
    tokio::spawn(work)
        .await
        .map_err(|_| CheckoutError::OutcomeUnknown)?
}

/// Commits, telling "nothing was written" apart from "the outcome is unknown": an error
/// on COMMIT itself may come after the server made the transaction durable.
pub(crate) async fn commit(
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
) -> Result<(), CheckoutError> {
    tx.commit().await.map_err(|e| {
        tracing::warn!(error = %e, "COMMIT failed; its outcome is unknown");
        CheckoutError::OutcomeUnknown
    })
}
