//! A change's transaction: the product rows it locks (in the one lock order every writer
//! shares), and how it ends: wholly or not at all, and never with a guessed outcome.

use super::error::CheckoutError;
use std::collections::BTreeMap;
use std::future::Future;

/// A write transaction on the primary.
pub(crate) type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

/// Each locked product's row, in lock order.
pub(crate) type Locked = BTreeMap<String, LockedRow>;

/// What a transaction holding a product's row lock takes from it (the drop rules read the
/// rest themselves: `drops::lock_and_judge`).
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub(crate) struct LockedRow {
    pub price: i32,
    /// `max_per_customer`.
    pub limit: Option<i32>,
}

/// Locks the rows in lock order and reads each; a missing product is absent from the answer.
pub(crate) async fn lock(tx: &mut Tx, products: &[&str]) -> Result<Locked, sqlx::Error> {
    #[derive(sqlx::FromRow)]
    struct Row {
        product_id: String,
        #[sqlx(flatten)]
        row: LockedRow,
    }
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT product_id, price_cents AS price, max_per_customer AS limit \
         FROM products WHERE product_id = ANY($1) ORDER BY product_id COLLATE \"C\" FOR NO KEY UPDATE",
    )
    .bind(products)
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows.into_iter().map(|r| (r.product_id, r.row)).collect())
}

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
pub(crate) async fn commit(tx: Tx) -> Result<(), CheckoutError> {
    tx.commit().await.map_err(|e| {
        tracing::warn!(error = %e, "COMMIT failed; its outcome is unknown");
        CheckoutError::OutcomeUnknown
    })
}
