//! Order placement and cancellation: the stock gate's final word.
//!
//! An order is confirmed only by a guarded
//! `UPDATE products SET available_quantity = available_quantity - $total WHERE … AND available_quantity >= $total`
//! on the primary, in the same transaction as the orders' insert, and only if that UPDATE
//! changed a row ([`coalescer`] batches concurrent orders for one product into one such
//! transaction). The pre-check through the stock gate ([`gate_cache`], a replica ≤ 250 ms
//! stale, or the primary) may only say "no" early; it never confirms anything. A "no" is
//! final only after checking that the request is not a retry of an order that exists: that
//! lookup reads the user's own data with read-your-writes, so it never loads the primary for
//! buyers who placed nothing. Idempotency keys are unique per user (`UNIQUE (user_id,
//! idempotency_key)`), and every statement of the order transaction is keyed by `product_id`.

pub mod coalescer;
pub mod gate_cache;
pub mod lookups;

use crate::domain::{IdempotencyKey, ProductId, Quantity, UserId};
use crate::metrics::Metrics;
use crate::routing::freshness::Lsn;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, DbError, ReadCtx, Route};
use chrono::{DateTime, Utc};
use coalescer::Coalescer;
use gate_cache::{Answer, GateCache};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, sqlx::FromRow, PartialEq, utoipa::ToSchema)]
pub struct Order {
    pub order_id: Uuid,
    pub product_id: String,
    #[schema(minimum = 1, maximum = 10000)]
    pub quantity: i32,
    pub user_id: String,
    /// `confirmed` or `cancelled`.
    #[schema(pattern = "^(confirmed|cancelled)$", example = "confirmed")]
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
    pub(crate) fn fingerprint(&self) -> String {
        format!("{}:{}", self.product, self.quantity.get())
    }
}

#[derive(Debug, Clone)]
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
    /// The user placed orders faster than the configured per-user rate.
    #[error("too many orders from this user")]
    RateLimited,
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
    cache: Arc<GateCache>,
    coalescer: Arc<Coalescer>,
    /// Products whose stock went up (restock, cancel) in this instance, with the primary's
    /// position after the commit: the gate reads them only from a replica that has
    /// replayed that far, so a stale "sold out" never outlives a restock here. Entries
    /// are dropped once well past the gate's budget, after which any replica the gate may
    /// use holds the change anyway.
    reopened: Arc<Mutex<HashMap<ProductId, (Lsn, Instant)>>>,
    /// Per-user token buckets (orders per second), when a limit is configured.
    limiter: Option<Arc<RateLimiter>>,
    lookups: lookups::Lookups,
}

/// How orders are batched (`STOCKGATE_ORDER_BATCH_MAX`, `STOCKGATE_ORDER_BATCH_WINDOW_US`).
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub max: usize,
    pub window: Duration,
}

impl Checkout {
    pub fn new(db: Db, metrics: Metrics, batching: Batching, rate_per_user: u32) -> Self {
        let budget = QueryClass::StockGate.policy().budget.unwrap_or_default();
        let cache = Arc::new(GateCache::new(budget));
        let coalescer = Coalescer::new(
            db.clone(),
            metrics.clone(),
            cache.clone(),
            batching.max,
            batching.window,
        );
        let limiter = (rate_per_user > 0).then(|| Arc::new(RateLimiter::new(rate_per_user)));
        let lookups = lookups::Lookups::start(db.clone(), metrics.clone());
        Checkout {
            db,
            metrics,
            cache,
            coalescer,
            reopened: Arc::default(),
            limiter,
            lookups,
        }
    }

    /// Records that `product`'s stock went up just now (after the commit): this instance's
    /// gate forgets its cached answer and reads only where the change is.
    pub async fn reopened(&self, product: &ProductId) -> Result<(), DbError> {
        let lsn = self.db.primary().current_lsn().await?;
        let now = Instant::now();
        let keep = QueryClass::StockGate.policy().budget.unwrap_or_default() * 4;
        let mut map = self.reopened.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, (_, at)| now.duration_since(*at) <= keep);
        let entry = map.entry(product.clone()).or_insert((lsn, now));
        *entry = (entry.0.max(lsn), now);
        drop(map);
        // Pinned first, then forgotten: the next gate read must reach the pinned position.
        self.cache.invalidate(product);
        Ok(())
    }

    fn reopened_at(&self, product: &ProductId) -> Option<Lsn> {
        self.reopened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(product)
            .map(|(lsn, _)| *lsn)
    }

    /// Places an order: the gate's early "no", or a seat in the product's next batch.
    pub async fn place(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let outcome = match &self.limiter {
            Some(l) if !l.allow(&req.user) => Err(CheckoutError::RateLimited),
            _ => self.place_inner(req).await,
        };
        let label = match &outcome {
            Ok(Placed::Created(_)) => "confirmed",
            Ok(Placed::Replayed(_)) => "replayed",
            Err(CheckoutError::OutOfStock) => "out_of_stock",
            Err(CheckoutError::KeyReused) => "key_reused",
            Err(CheckoutError::ProductNotFound | CheckoutError::OrderNotFound) => "not_found",
            Err(CheckoutError::RateLimited) => "rate_limited",
            Err(CheckoutError::Db(_)) => "error",
        };
        self.metrics.orders.with_label_values(&[label]).inc();
        outcome
    }

    async fn place_inner(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let (available, _) = self.available(&req.product).await?;
        let says_no = available.is_some_and(|a| a < req.quantity.get());
        // A duplicate of an order in flight here joins it in the batch instead.
        if says_no && !self.coalescer.is_in_flight(&req.user, &req.key) {
            return match self.lookups.existing(req).await? {
                Some(placed) => Ok(placed),
                None => Err(CheckoutError::OutOfStock),
            };
        }
        self.coalescer.submit(req).await
    }

    /// A product's stock through the stock gate (the micro-cache, a replica within 250 ms,
    /// or the primary), with the route that says as of when. `None`: no such product.
    pub async fn available(&self, product: &ProductId) -> Result<(Option<i32>, Route), DbError> {
        let answer = self
            .cache
            .get_or_fetch(product, || async {
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
                // The replica's state when the query was sent (the router's stamp), not
                // "now minus the staleness at routing", which loses the query's latency.
                let as_of = read.route.as_of_instant.unwrap_or_else(|| {
                    Instant::now()
                        .checked_sub(read.route.stale_by)
                        .unwrap_or_else(Instant::now)
                });
                Ok::<_, DbError>(Answer {
                    available: read.value,
                    route: read.route,
                    as_of,
                })
            })
            .await?;
        Ok((answer.available, answer.route))
    }

    /// An order by id, from the primary (its owner may have placed it a moment ago).
    pub async fn get(&self, order_id: Uuid) -> Result<Order, CheckoutError> {
        let read = self
            .db
            .read(QueryClass::OrderLookup, &ReadCtx::none(), |pool| async move {
                sqlx::query_as::<_, Order>(
                    "SELECT order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at \
                     FROM orders WHERE order_id = $1",
                )
                .bind(order_id)
                .fetch_optional(pool.exec())
                .await
            })
            .await?;
        read.value.ok_or(CheckoutError::OrderNotFound)
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

/// An order found under a user's idempotency key, with the body it was placed with.
#[derive(sqlx::FromRow)]
pub(crate) struct Existing {
    idempotency_key: String,
    request_fingerprint: String,
    #[sqlx(flatten)]
    order: Order,
}

/// The (user, key) an order request is idempotent under.
pub(crate) fn key_of(req: &OrderRequest) -> (String, String) {
    (req.user.as_str().to_string(), req.key.as_str().to_string())
}

/// Orders already placed under any of `reqs`' (user, key) pairs — only for `product` when
/// given — by (user, key). One indexed query however many requests; the single lookup, the
/// coalescer's batch and the batched "no"-path lookups all use it.
pub(crate) async fn existing_for<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    reqs: &[&OrderRequest],
    product: Option<&ProductId>,
) -> Result<HashMap<(String, String), Existing>, sqlx::Error> {
    let users: Vec<&str> = reqs.iter().map(|r| r.user.as_str()).collect();
    let keys: Vec<&str> = reqs.iter().map(|r| r.key.as_str()).collect();
    let found: Vec<Existing> = sqlx::query_as(
        "SELECT o.idempotency_key, o.request_fingerprint, o.order_id, o.product_id, o.quantity, o.user_id, o.status, \
                o.total_cents, o.created_at, o.cancelled_at \
         FROM orders o JOIN UNNEST($1::text[], $2::text[]) AS k(user_id, idempotency_key) \
           ON o.user_id = k.user_id AND o.idempotency_key = k.idempotency_key \
         WHERE $3::text IS NULL OR o.product_id = $3",
    )
    .bind(&users)
    .bind(&keys)
    .bind(product.map(ProductId::as_str))
    .fetch_all(exec)
    .await?;
    Ok(found
        .into_iter()
        .map(|e| ((e.order.user_id.clone(), e.idempotency_key.clone()), e))
        .collect())
}

pub(crate) fn judge(
    req: &OrderRequest,
    found: Option<Existing>,
) -> Result<Option<Placed>, CheckoutError> {
    match found {
        None => Ok(None),
        Some(e) if e.request_fingerprint != req.fingerprint() => Err(CheckoutError::KeyReused),
        Some(e) => Ok(Some(Placed::Replayed(e.order))),
    }
}

/// The same lookup on the primary (after a concurrent claim of the key).
pub(crate) async fn existing_on_primary(
    db: &Db,
    req: &OrderRequest,
) -> Result<Option<Placed>, CheckoutError> {
    let mut found = existing_for(db.primary().pool()?, &[req], None).await?;
    judge(req, found.remove(&key_of(req)))
}

/// A token bucket per user: `rate` orders per second, bursts of up to `rate`.
pub struct RateLimiter {
    rate: f64,
    buckets: Mutex<HashMap<UserId, (f64, Instant)>>,
}

impl RateLimiter {
    pub fn new(rate: u32) -> Self {
        RateLimiter {
            rate: f64::from(rate),
            buckets: Mutex::default(),
        }
    }

    pub fn allow(&self, user: &UserId) -> bool {
        let now = Instant::now();
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

    #[test]
    fn the_rate_limiter_allows_a_burst_then_refuses_per_user() {
        let l = RateLimiter::new(3);
        let ada = UserId::parse("ada").expect("valid");
        let bob = UserId::parse("bob").expect("valid");
        assert_eq!((0..5).filter(|_| l.allow(&ada)).count(), 3);
        assert!(l.allow(&bob), "another user has their own bucket");
    }
}
