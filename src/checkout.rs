//! Order placement and cancellation: the stock gate's final word.
//!
//! An order is confirmed only by a guarded
//! `UPDATE products SET available_quantity = available_quantity - $q WHERE … AND available_quantity >= $q`
//! on the primary, in the same transaction as the order's insert, and only if that UPDATE
//! changed a row. The pre-check through the router may only say "no" early; it never
//! confirms anything. The idempotency key is claimed by the order row itself
//! (`UNIQUE (user_id, idempotency_key)`), so a concurrent duplicate waits on the first
//! and then returns its order; stock is taken once.
//!
//! Every statement of the order transaction is keyed by `product_id`.

use crate::domain::{IdempotencyKey, ProductId, Quantity, UserId};
use crate::metrics::Metrics;
use crate::routing::freshness::Lsn;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, DbError, ReadCtx, Route};
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, sqlx::FromRow, PartialEq)]
pub struct Order {
    pub order_id: Uuid,
    pub product_id: String,
    pub quantity: i32,
    pub user_id: String,
    pub status: String,
    pub total_cents: i64,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
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
    fn fingerprint(&self) -> String {
        format!("{}:{}", self.product, self.quantity.get())
    }
}

#[derive(Debug)]
pub enum Placed {
    /// A new order: stock was taken.
    Created(Order),
    /// The same key and body as an earlier order: that order, nothing taken.
    Replayed(Order),
}

#[derive(Debug, thiserror::Error)]
pub enum CheckoutError {
    #[error("not enough stock")]
    OutOfStock,
    #[error("no such product")]
    ProductNotFound,
    #[error("the idempotency key was used with a different body")]
    KeyReused,
    #[error("no such order")]
    OrderNotFound,
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<sqlx::Error> for CheckoutError {
    fn from(e: sqlx::Error) -> Self {
        CheckoutError::Db(e.into())
    }
}

#[derive(Clone)]
pub struct Checkout {
    db: Db,
    metrics: Metrics,
    /// Products whose stock went up (restock, cancel) in this instance, with the primary's
    /// position after the commit: the gate reads them only from a replica that has
    /// replayed that far, so a stale "sold out" never outlives a restock here. Entries
    /// are dropped once older than the gate's budget, after which any replica the gate may
    /// use holds the change anyway.
    reopened: Arc<Mutex<HashMap<ProductId, (Lsn, Instant)>>>,
}

impl Checkout {
    pub fn new(db: Db, metrics: Metrics) -> Self {
        Checkout {
            db,
            metrics,
            reopened: Arc::default(),
        }
    }

    /// Records that `product`'s stock went up just now (after the commit).
    pub async fn reopened(&self, product: &ProductId) -> Result<(), DbError> {
        let lsn = self.db.primary().current_lsn().await?;
        let now = Instant::now();
        let keep = QueryClass::StockGate.policy().budget.unwrap_or_default() * 4;
        let mut map = self.reopened.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, (_, at)| now.duration_since(*at) <= keep);
        let entry = map.entry(product.clone()).or_insert((lsn, now));
        *entry = (entry.0.max(lsn), now);
        Ok(())
    }

    fn reopened_at(&self, product: &ProductId) -> Option<Lsn> {
        self.reopened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(product)
            .map(|(lsn, _)| *lsn)
    }

    /// Places an order. Runs to completion in its own task, so a client that disconnects
    /// mid-request leaves either a whole order (retrievable with the same key) or nothing.
    pub async fn place(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let this = self.clone();
        let outcome = tokio::spawn(async move { this.place_inner(req).await })
            .await
            .map_err(|e| {
                CheckoutError::Db(DbError::Unavailable(format!("order task failed: {e}")))
            })?;
        let label = match &outcome {
            Ok(Placed::Created(_)) => "confirmed",
            Ok(Placed::Replayed(_)) => "replayed",
            Err(CheckoutError::OutOfStock) => "out_of_stock",
            Err(CheckoutError::KeyReused) => "key_reused",
            Err(CheckoutError::ProductNotFound | CheckoutError::OrderNotFound) => "not_found",
            Err(CheckoutError::Db(_)) => "error",
        };
        self.metrics.orders.with_label_values(&[label]).inc();
        outcome
    }

    async fn place_inner(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        if self.precheck_says_no(&req).await? {
            // "No" is only final if this is not a retry of an order that already exists.
            return match self.existing(&req).await? {
                Some(placed) => Ok(placed),
                None => Err(CheckoutError::OutOfStock),
            };
        }
        // Two rounds at most: a duplicate that we waited on may have rolled back.
        for _ in 0..2 {
            let mut tx = self.db.primary().begin().await?;
            let inserted: Option<Order> = sqlx::query_as(
                "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
                 SELECT $1, p.product_id, $3, $4, p.price_cents, p.price_cents::int8 * $4, 'confirmed', $5, $6 \
                 FROM products p WHERE p.product_id = $2 \
                 ON CONFLICT (user_id, idempotency_key) DO NOTHING \
                 RETURNING order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at",
            )
            .bind(Uuid::new_v4())
            .bind(req.product.as_str())
            .bind(req.user.as_str())
            .bind(req.quantity.get())
            .bind(req.key.as_str())
            .bind(req.fingerprint())
            .fetch_optional(&mut *tx)
            .await?;
            let Some(order) = inserted else {
                tx.rollback().await?;
                match self.existing(&req).await? {
                    Some(placed) => return Ok(placed),
                    None if self.product_exists(&req.product).await? => continue,
                    None => return Err(CheckoutError::ProductNotFound),
                }
            };
            let taken = sqlx::query(
                "UPDATE products SET available_quantity = available_quantity - $2, updated_at = clock_timestamp() \
                 WHERE product_id = $1 AND available_quantity >= $2",
            )
            .bind(req.product.as_str())
            .bind(req.quantity.get())
            .execute(&mut *tx)
            .await?;
            if taken.rows_affected() != 1 {
                // Nothing is written: the order row and the key claim roll back together.
                tx.rollback().await?;
                return Err(CheckoutError::OutOfStock);
            }
            tx.commit().await?;
            return Ok(Placed::Created(order));
        }
        Err(CheckoutError::Db(DbError::Unavailable(
            "the idempotency key is contended; retry".into(),
        )))
    }

    /// The stock gate's early "no": true only when a fresh-enough read clearly shows less
    /// stock than asked. A product the replica has not seen yet is not a "no".
    async fn precheck_says_no(&self, req: &OrderRequest) -> Result<bool, CheckoutError> {
        let (available, _) = self.available(&req.product).await?;
        Ok(available.is_some_and(|available| available < req.quantity.get()))
    }

    /// A product's stock through the stock gate (a replica within 250 ms, or the primary),
    /// with the route that says as of when. `None`: no such product there.
    pub async fn available(&self, product: &ProductId) -> Result<(Option<i32>, Route), DbError> {
        let ctx = ReadCtx {
            user: None,
            min_lsn: self.reopened_at(product),
        };
        let read = self
            .db
            .read_existing(QueryClass::StockGate, &ctx, |pool| {
                let product = product.clone();
                async move {
                    sqlx::query_scalar::<_, i32>(
                        "SELECT available_quantity FROM products WHERE product_id = $1",
                    )
                    .bind(product.as_str())
                    .fetch_optional(pool.exec())
                    .await
                }
            })
            .await?;
        Ok((read.value, read.route))
    }

    /// An order already placed with this user's key: the same order if the body matches,
    /// `KeyReused` if not.
    async fn existing(&self, req: &OrderRequest) -> Result<Option<Placed>, CheckoutError> {
        let row: Option<(String,)> = sqlx::query_as(
            "SELECT request_fingerprint FROM orders WHERE user_id = $1 AND idempotency_key = $2",
        )
        .bind(req.user.as_str())
        .bind(req.key.as_str())
        .fetch_optional(self.db.primary().pool())
        .await?;
        match row {
            None => Ok(None),
            Some((fp,)) if fp != req.fingerprint() => Err(CheckoutError::KeyReused),
            Some(_) => {
                let order: Order = sqlx::query_as(
                    "SELECT order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at \
                     FROM orders WHERE user_id = $1 AND idempotency_key = $2",
                )
                .bind(req.user.as_str())
                .bind(req.key.as_str())
                .fetch_one(self.db.primary().pool())
                .await?;
                Ok(Some(Placed::Replayed(order)))
            }
        }
    }

    async fn product_exists(&self, product: &ProductId) -> Result<bool, CheckoutError> {
        let found: Option<i32> = sqlx::query_scalar("SELECT 1 FROM products WHERE product_id = $1")
            .bind(product.as_str())
            .fetch_optional(self.db.primary().pool())
            .await?;
        Ok(found.is_some())
    }

    /// An order by id, from the primary (its owner may have placed it a moment ago).
    pub async fn get(&self, order_id: Uuid) -> Result<Order, CheckoutError> {
        sqlx::query_as::<_, Order>(
            "SELECT order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at FROM orders WHERE order_id = $1",
        )
        .bind(order_id)
        .fetch_optional(self.db.primary().pool())
        .await?
        .ok_or(CheckoutError::OrderNotFound)
    }

    /// Cancels a confirmed order and returns its quantity to stock, exactly once: the
    /// status change and the restock are one transaction, and only a `confirmed` order
    /// changes. A second cancel returns the order unchanged.
    pub async fn cancel(&self, order: &Order) -> Result<Order, CheckoutError> {
        let this = self.clone();
        let (order_id, product_id) = (order.order_id, order.product_id.clone());
        let product =
            ProductId::parse(&order.product_id).map_err(|_| CheckoutError::OrderNotFound)?;
        tokio::spawn(async move {
            let mut tx = this.db.primary().begin().await?;
            let returned: Option<i32> = sqlx::query_scalar(
                "UPDATE orders SET status = 'cancelled', cancelled_at = clock_timestamp() \
                 WHERE product_id = $1 AND order_id = $2 AND status = 'confirmed' RETURNING quantity",
            )
            .bind(&product_id)
            .bind(order_id)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(q) = returned {
                sqlx::query("UPDATE products SET available_quantity = available_quantity + $2, updated_at = clock_timestamp() WHERE product_id = $1")
                    .bind(&product_id)
                    .bind(q)
                    .execute(&mut *tx)
                    .await?;
            }
            let order: Order = sqlx::query_as(
                "SELECT order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at \
                 FROM orders WHERE product_id = $1 AND order_id = $2",
            )
            .bind(&product_id)
            .bind(order_id)
            .fetch_one(&mut *tx)
            .await?;
            tx.commit().await?;
            if returned.is_some() {
                this.reopened(&product).await?;
            }
            Ok(order)
        })
        .await
        .map_err(|e| CheckoutError::Db(DbError::Unavailable(format!("cancel task failed: {e}"))))?
    }
}
