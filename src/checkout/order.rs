//! What an order is: its row, its lines, its status, and the request that places one.

use super::status::OrderStatus;
use crate::domain::{IdempotencyKey, ProductId, Quantity, UserId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// The columns of an [`Order`], in its field order: the one list every query uses (a
/// macro, so queries stay string literals).
macro_rules! order_columns {
    () => {
        "order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at, unit_price_cents"
    };
}
pub(crate) use order_columns;

/// [`order_columns!`] as a value, for the tests that hold SQL to it.
pub const ORDER_COLUMNS: &str = order_columns!();

/// The id of a new row in `orders`, `holds` or `restocks`: time-ordered (UUID v7), so each
/// insert lands on the right-hand page of its primary-key index, which stays in memory,
/// instead of on a random page of an index that outgrows it (measured against random v4 ids
/// on a large `orders` table: `bench/results/`).
pub(crate) fn new_row_id() -> Uuid {
    Uuid::now_v7()
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, PartialEq, utoipa::ToSchema)]
pub struct Order {
    pub order_id: Uuid,
    /// A single-line order's product; absent for a cart (see `lines`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product_id: Option<String>,
    /// A single-line order's quantity; absent for a cart.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 10000)]
    pub quantity: Option<i32>,
    pub user_id: String,
    /// `confirmed` or `cancelled`.
    #[schema(value_type = String, pattern = "^(confirmed|cancelled)$", example = "confirmed")]
    pub status: OrderStatus,
    pub total_cents: i64,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    /// A single-line order's unit price (its one line's); 0 on a cart's row.
    #[serde(skip)]
    pub(crate) unit_price_cents: i32,
    /// Every line of the order (a single-line order has one).
    #[sqlx(skip)]
    pub lines: Vec<OrderLine>,
}

/// One product of an order.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, PartialEq, utoipa::ToSchema)]
pub struct OrderLine {
    pub product_id: String,
    #[schema(minimum = 1, maximum = 10000)]
    pub quantity: i32,
    pub unit_price_cents: i32,
}

impl Order {
    /// The products of its lines.
    pub(crate) fn products(&self) -> Vec<ProductId> {
        self.lines
            .iter()
            .filter_map(|l| ProductId::parse(&l.product_id).ok())
            .collect()
    }

    /// A single-line order with its one line stated; a cart is completed by [`with_lines`].
    pub(crate) fn complete(mut self) -> Order {
        if let (Some(p), Some(q)) = (&self.product_id, self.quantity)
            && self.lines.is_empty()
        {
            self.lines = vec![OrderLine {
                product_id: p.clone(),
                quantity: q,
                unit_price_cents: self.unit_price_cents,
            }];
        }
        self
    }
}

/// An order with every line stated, reading a cart's lines with `exec`.
pub(crate) async fn with_lines<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    order: Order,
) -> Result<Order, sqlx::Error> {
    if order.product_id.is_some() {
        return Ok(order.complete());
    }
    let lines = sqlx::query_as(
        "SELECT product_id, quantity, unit_price_cents FROM order_lines WHERE order_id = $1 ORDER BY product_id",
    )
    .bind(order.order_id)
    .fetch_all(exec)
    .await?;
    Ok(Order { lines, ..order })
}

#[derive(Debug, Clone)]
pub struct OrderRequest {
    pub user: UserId,
    pub product: ProductId,
    pub quantity: Quantity,
    pub key: IdempotencyKey,
}

impl OrderRequest {
    /// What "the same body" means for idempotency.
    pub(crate) fn fingerprint(&self) -> String {
        format!("{}:{}", self.product, self.quantity.get())
    }

    /// The (user, key) this request is idempotent under.
    pub(crate) fn key_pair(&self) -> (&str, &str) {
        (self.user.as_str(), self.key.as_str())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Placed {
    /// A new order: stock was taken.
    Created(Order),
    /// The same key and body as an earlier order: that order, nothing taken.
    Replayed(Order),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_row_ids_are_time_ordered_so_inserts_append_to_the_key_index() {
        let ids: Vec<Uuid> = (0..10_000).map(|_| new_row_id()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        assert_eq!(ids[0].get_version_num(), 7);
    }
}
