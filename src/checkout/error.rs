//! Every way placing, holding, cancelling or restocking can end without success.

use crate::domain::ProductId;
use crate::routing::DbError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckoutError {
    /// Not enough stock; the refusal holds the key, so this key's answer stays 409.
    #[error("not enough stock")]
    OutOfStock,
    #[error("no such product")]
    ProductNotFound,
    #[error("the idempotency key was used with a different body")]
    KeyReused,
    #[error("no such order")]
    OrderNotFound,
    /// The user placed orders faster than the configured per-user rate.
    #[error("too many orders from this user")]
    RateLimited,
    /// The database neither confirmed nor denied the commit (the connection died during
    /// COMMIT, or the batch was lost with its worker). A retry with the same key tells.
    #[error("the outcome is unknown; retry with the same key")]
    OutcomeUnknown,
    /// Not enough stock for some lines of a cart or hold; nothing was taken, and the
    /// refusal holds the key.
    #[error("not enough stock for: {}", describe(.0))]
    Short(Vec<Short>),
    /// The request would take its user past the product's `max_per_customer`; nothing was
    /// taken, and the refusal holds the key.
    #[error(
        "the limit for {product_id} is {limit} per customer, and this user already has {already}"
    )]
    LimitExceeded {
        product_id: String,
        limit: i32,
        already: i32,
    },
    /// The product's sale has not started (on the primary's clock); nothing was claimed.
    #[error("the sale has not started; it starts in {retry_after_ms} ms")]
    SaleNotStarted { retry_after_ms: i64 },
    /// The product's sale is over; the refusal holds the key.
    #[error("the sale has ended")]
    SaleEnded,
    #[error("no such hold")]
    HoldNotFound,
    /// A body or query named a location that does not exist; nothing was written.
    #[error("no location {0}")]
    UnknownLocation(String),
    /// An adjustment's `expected` is not the location's count (`available`); nothing was
    /// written.
    #[error("the location's count is {available}, not the expected one")]
    StockChanged { available: i32 },
    #[error("the hold expired; its units went back")]
    HoldExpired,
    #[error("the hold was released; its units went back")]
    HoldReleased,
    #[error("the hold was confirmed; it is an order now")]
    HoldConfirmed,
    /// The database refused this request's own row (a row-level error); nothing was written.
    #[error("the database refused this order: {0}")]
    Refused(std::sync::Arc<sqlx::Error>),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<sqlx::Error> for CheckoutError {
    fn from(e: sqlx::Error) -> Self {
        CheckoutError::Db(e.into())
    }
}

/// A line that cannot be served: what was asked and what there is.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Short {
    #[schema(value_type = String)]
    pub product_id: ProductId,
    pub requested: i32,
    pub available: i32,
}

/// The lines a cart would need that the stock cannot give (for a 409's `lines`).
fn describe(short: &[Short]) -> String {
    short
        .iter()
        .map(|s| {
            format!(
                "{} (asked {}, {} left)",
                s.product_id, s.requested, s.available
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
