//! Order placement, cancellation and restocks: the stock gate's final word.
//!
//! An order is confirmed only by a guarded
//! `UPDATE products SET available_quantity = available_quantity - $total WHERE … AND available_quantity >= $total`
//! on the primary, in the same transaction as the orders' insert, and only if that UPDATE
//! changed a row (`orders` batches concurrent orders for one product into one such
//! transaction). The pre-check through the stock gate
//! (`gate_cache`, a replica ≤ 250 ms stale, or the primary) may only say "no" early; it
//! never confirms anything.
//!
//! **Every answer is final for its key.** Idempotency keys are unique per user
//! (`orders_user_idempotency_key` on `orders`), and both outcomes claim the key on the
//! primary: a confirmed order by its row, a refusal by a `refused` row (`refusals` for the
//! gate's early "no", the batch for its own losers). Whichever commits first owns the key, so
//! a retry — on this instance or another, while its original is still queued or after — gets
//! the original's outcome, and a 409 is only said once no order for that key can still commit.
//! None of this depends on Redis. When a COMMIT's outcome is unknown the answer says so
//! ([`CheckoutError::OutcomeUnknown`], 503); the same key resolves it.

mod cart;
mod drops;
mod error;
mod gate_cache;
mod holds;
mod idempotency;
pub mod ledger;
mod locations;
mod order;
mod orders;
mod rate_limit;
mod refusals;
mod status;
pub(crate) mod stock;
mod sweeper;
mod tx;

pub use cart::CartRequest;
pub(crate) use drops::rule_columns;
pub use drops::{Rules, Window, retry_after_secs};
pub use error::{CheckoutError, Short};
pub use holds::{Hold, HoldRequest};
pub use locations::Location;
pub use order::{ORDER_COLUMNS, Order, OrderBody, OrderLine, OrderRequest, Placed, Shape};
pub(crate) use order::{order_columns, with_lines};
pub use rate_limit::RateLimiter;
pub use status::{HoldStatus, OrderStatus};
pub use stock::Stocked;
pub use stock::levels::{
    Adjust, AdjustReason, Adjusted, AdjustmentRequest, Level, Movement, Transfer, TransferRequest,
};
pub use sweeper::SweeperGuard;
pub(crate) use tx::commit;
use tx::whole_or_none;

use crate::clock::Clock;
use crate::domain::{IdempotencyKey, LocationId, ProductId};
use crate::metrics::Metrics;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, DbError, ReadCtx};
use chrono::{DateTime, Utc};
use gate_cache::{Answer, GateCache};
use orders::Coalescer;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

#[derive(Clone)]
pub struct Checkout {
    db: Db,
    metrics: Metrics,
    cache: Arc<GateCache>,
    coalescer: Arc<Coalescer>,
    carts: Arc<cart::CartQueue>,
    /// Per-user token buckets (orders per second), when a limit is configured.
    limiter: Option<Arc<RateLimiter>>,
    refusals: refusals::Refusals,
    known: locations::Known,
}

/// How orders are batched (`STOCKGATE_ORDER_BATCH_MAX`, `STOCKGATE_ORDER_BATCH_WINDOW_US`).
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub max: usize,
    pub window: Duration,
}

impl Checkout {
    /// `clock` judges the per-user order rate (the application's clock for windows).
    pub fn new(
        db: Db,
        metrics: Metrics,
        batching: Batching,
        rate_per_user: u32,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let cache = Arc::new(GateCache::default());
        let coalescer = Coalescer::new(
            db.clone(),
            metrics.clone(),
            cache.clone(),
            batching.max,
            batching.window,
        );
        let limiter =
            (rate_per_user > 0).then(|| Arc::new(RateLimiter::with_clock(rate_per_user, clock)));
        let refusals = refusals::Refusals::start(db.clone(), metrics.clone());
        let carts = Arc::new(cart::CartQueue::start(
            db.clone(),
            metrics.clone(),
            cache.clone(),
        ));
        Checkout {
            db,
            metrics,
            cache,
            coalescer,
            carts,
            limiter,
            refusals,
            known: locations::Known::default(),
        }
    }

    /// After a committed change of these products' stock: `gate_cache::reopen`.
    pub async fn reopened(&self, products: &[ProductId]) {
        gate_cache::reopen(&self.db, &self.metrics, &self.cache, products).await;
    }

    /// Places an order: the gate's early "no", or a seat in the product's next batch.
    pub async fn place(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let outcome = match &self.limiter {
            Some(l) if !l.allow(&req.user) => Err(CheckoutError::RateLimited),
            _ => self.place_inner(req).await,
        };
        self.count(&outcome);
        outcome
    }

    /// Whether another writer keeps taking `product`'s row between this instance's batches
    /// (its orders then go to the product's owner, when there are peers: src/http/peer/).
    pub fn contended(&self, product: &ProductId) -> bool {
        self.coalescer.contended(product)
    }

    /// Places a cart: all lines or none, in the next batch of carts (a client that hangs up
    /// leaves the whole cart or none).
    pub async fn place_cart(&self, req: cart::CartRequest) -> Result<Placed, CheckoutError> {
        let outcome = match &self.limiter {
            Some(l) if !l.allow(&req.user) => Err(CheckoutError::RateLimited),
            _ => self.carts.place(req).await,
        };
        self.count(&outcome);
        outcome
    }

    /// Takes a hold (all lines or none); `true` when taken now, `false` for a retry.
    pub async fn hold(
        &self,
        req: holds::HoldRequest,
    ) -> Result<(holds::Hold, bool), CheckoutError> {
        let this = self.clone();
        whole_or_none(async move {
            let taken = holds::take(&this.db, &req).await?;
            if taken.1 {
                // The units left availability at once: this instance's gate must not answer
                // from before the hold. Counted once the gate is reopened.
                this.reopened(&taken.0.products()).await;
                this.metrics.holds.with_label_values(&["taken"]).inc();
            }
            Ok(taken)
        })
        .await
    }

    pub async fn hold_by_id(&self, hold_id: Uuid) -> Result<holds::Hold, CheckoutError> {
        holds::get(&self.db, hold_id).await
    }

    /// Turns a hold into its order, exactly once; `true` when confirmed now.
    pub async fn confirm_hold(&self, hold_id: Uuid) -> Result<(Order, bool), CheckoutError> {
        let db = self.db.clone();
        let ended = whole_or_none(async move { holds::confirm(&db, hold_id).await }).await?;
        if ended.value.1 {
            self.metrics.holds.with_label_values(&["confirmed"]).inc();
        }
        Ok(ended.value)
    }

    /// Releases a hold; its units go back exactly once and reopen the gate.
    pub async fn release_hold(&self, hold_id: Uuid) -> Result<holds::Hold, CheckoutError> {
        let this = self.clone();
        whole_or_none(async move {
            let ended = holds::release(&this.db, hold_id).await?;
            this.reopened(&ended.returned).await;
            if !ended.returned.is_empty() {
                let event = if ended.value.status == HoldStatus::Released {
                    "released"
                } else {
                    "expired"
                };
                this.metrics.holds.with_label_values(&[event]).inc();
            }
            Ok(ended.value)
        })
        .await
    }

    /// Units held now per product, the most first (up to `top`).
    pub async fn units_held(&self, top: i64) -> Result<Vec<(String, i64)>, CheckoutError> {
        holds::units_held(&self.db, top).await
    }

    fn count(&self, outcome: &Result<Placed, CheckoutError>) {
        let label = match outcome {
            Ok(Placed::Created(_)) => "confirmed",
            Ok(Placed::Replayed(_)) => "replayed",
            Err(CheckoutError::OutOfStock | CheckoutError::Short(_)) => "out_of_stock",
            Err(CheckoutError::KeyReused) => "key_reused",
            Err(CheckoutError::LimitExceeded { .. }) => "limit_exceeded",
            Err(CheckoutError::SaleNotStarted { .. }) => "sale_not_started",
            Err(CheckoutError::SaleEnded) => "sale_ended",
            Err(
                CheckoutError::ProductNotFound
                | CheckoutError::OrderNotFound
                | CheckoutError::UnknownLocation(_),
            ) => "not_found",
            Err(CheckoutError::RateLimited) => "rate_limited",
            Err(CheckoutError::OutcomeUnknown) => "outcome_unknown",
            Err(
                CheckoutError::HoldNotFound
                | CheckoutError::HoldExpired
                | CheckoutError::HoldReleased
                | CheckoutError::HoldConfirmed,
            ) => "hold_state",
            // Not an order's outcome (an adjustment's).
            Err(CheckoutError::StockChanged { .. }) => "error",
            Err(CheckoutError::Refused(_) | CheckoutError::Db(_)) => "error",
        };
        self.metrics.orders.with_label_values(&[label]).inc();
    }

    /// The gate is read only where it may say "no": for a product this instance last saw
    /// short of the request. An order for a product it never saw, or last saw with enough
    /// stock, goes straight to its batch, whose guarded UPDATE on the primary decides either
    /// way, and whose outcome refills the cache (a sold-out product is then answered early
    /// from memory and by the gate's reads). A gate read per order of a product that has
    /// stock bought a round trip and nothing else: with orders spread over many products,
    /// almost every order missed the cache (issue #31).
    async fn place_inner(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        if self.cache.last_seen_short(&req.product, req.quantity.get()) {
            let gate = self.available(&req.product).await?;
            if gate.available.is_some_and(|a| a < req.quantity.get()) {
                // The gate's "no" becomes final only once it holds the key on the primary,
                // which judges the sale window first.
                return self.refusals.refuse(req).await;
            }
        }
        self.coalescer.submit(req).await
    }

    /// A product's stock and sale window through the stock gate (the micro-cache, a replica
    /// within 250 ms, or the primary), with the route that says as of when. `available` is
    /// `None` for no such product.
    pub async fn available(&self, product: &ProductId) -> Result<Answer, DbError> {
        self.cache
            .get_or_fetch(product, |min_lsn| async move {
                let ctx = ReadCtx {
                    user: None,
                    min_lsn,
                };
                type Row = (i32, Option<DateTime<Utc>>, Option<DateTime<Utc>>);
                let read = self
                    .db
                    .read_existing(QueryClass::StockGate, &ctx, |pool| {
                        let product = product.clone();
                        async move {
                            sqlx::query_as::<_, Row>(
                                "SELECT available_quantity, sale_starts_at, sale_ends_at FROM products WHERE product_id = $1",
                            )
                            .bind(product.as_str())
                            .fetch_optional(pool.exec())
                            .await
                        }
                    })
                    .await?;
                Ok::<_, DbError>(Answer {
                    available: read.value.map(|r| r.0),
                    window: read.value.map_or_else(drops::Window::default, |(_, starts, ends)| {
                        drops::Window { starts, ends }
                    }),
                    route: read.route,
                })
            })
            .await
    }

    /// An order by id, with its lines, from the primary (its owner may have placed it a
    /// moment ago).
    pub async fn get(&self, order_id: Uuid) -> Result<Order, CheckoutError> {
        let read = self
            .db
            .read(
                QueryClass::OrderLookup,
                &ReadCtx::none(),
                |pool| async move {
                    let order = sqlx::query_as::<_, Order>(concat!(
                        "SELECT ",
                        order_columns!(),
                        " FROM orders WHERE order_id = $1 AND status <> 'refused'"
                    ))
                    .bind(order_id)
                    .fetch_optional(pool.exec())
                    .await?;
                    match order {
                        Some(o) => Ok(Some(with_lines(pool.exec(), o).await?)),
                        None => Ok(None),
                    }
                },
            )
            .await?;
        read.value.ok_or(CheckoutError::OrderNotFound)
    }

    /// Cancels a confirmed order and returns every line's units to stock, exactly once: the
    /// status change and the restock are one transaction, and only a `confirmed` order
    /// changes. A second cancel returns the order unchanged. It runs in its own task, so a
    /// client that hangs up leaves the whole cancel or none.
    pub async fn cancel(&self, order: &Order) -> Result<Order, CheckoutError> {
        let this = self.clone();
        let order_id = order.order_id;
        let products = order.products();
        whole_or_none(async move {
            let mut tx = this.db.primary().begin().await?;
            // The products' rows first, in the lock order every writer shares, and only then
            // the order's: a batch retrying this order's key holds the product row while it
            // claims the key, so an order row locked first would make the two wait on each
            // other (a deadlock, found after a second).
            let names: Vec<&str> = products.iter().map(ProductId::as_str).collect();
            tx::lock(&mut tx, &names).await?;
            let cancelled: Option<Order> = sqlx::query_as(concat!(
                "UPDATE orders SET status = 'cancelled', cancelled_at = clock_timestamp() \
                 WHERE order_id = $1 AND status = 'confirmed' RETURNING ",
                order_columns!()
            ))
            .bind(order_id)
            .fetch_optional(&mut *tx)
            .await?;
            let now_cancelled = cancelled.is_some();
            let order = match cancelled {
                Some(order) => order,
                // Cancelled before (or never confirmed): answered as it is.
                None => {
                    sqlx::query_as(concat!(
                        "SELECT ",
                        order_columns!(),
                        " FROM orders WHERE order_id = $1"
                    ))
                    .bind(order_id)
                    .fetch_one(&mut *tx)
                    .await?
                }
            };
            let order = with_lines(&mut *tx, order).await?;
            if now_cancelled {
                stock::give_back(&mut tx, &order.allocations.parse()?).await?;
            }
            commit(tx).await?;
            if now_cancelled {
                this.reopened(&order.products()).await;
            }
            Ok(order)
        })
        .await
    }

    /// Adds `quantity` to a product's stock at `location`, exactly once per `key`: the same
    /// key with the same body answers what the first restock did and adds nothing; with
    /// another body it is refused. Every restock is recorded in `restocks`, whose unique key
    /// is the claim.
    pub async fn restock(
        &self,
        product: &ProductId,
        location: &LocationId,
        quantity: i32,
        key: Option<&IdempotencyKey>,
    ) -> Result<Stocked, CheckoutError> {
        self.known
            .check(&self.db, std::slice::from_ref(location))
            .await?;
        // A restock at `default` fingerprints as it did before locations.
        let fingerprint = match location.as_str() {
            "default" => format!("{product}:{quantity}"),
            at => format!("{product}:{quantity}@{at}"),
        };
        let this = self.clone();
        let (product, location, key) = (product.clone(), location.clone(), key.cloned());
        whole_or_none(async move {
            // A second round only when a concurrent restock with this key won the claim.
            for _ in 0..2 {
                if let Some(key) = &key
                    && let Some(done) = this.restocked(key, &fingerprint).await?
                {
                    return Ok(done);
                }
                let mut tx = this.db.primary().begin().await?;
                let Some((stocked, claimed)) = stock::restock(
                    &mut tx,
                    &product,
                    &location,
                    quantity,
                    key.as_ref(),
                    &fingerprint,
                )
                .await?
                else {
                    return Err(CheckoutError::ProductNotFound);
                };
                if !claimed {
                    // A concurrent restock with this key committed first: answer as it did.
                    tx.rollback().await?;
                    continue;
                }
                commit(tx).await?;
                this.reopened(std::slice::from_ref(&product)).await;
                return Ok(stocked);
            }
            Err(CheckoutError::OutcomeUnknown)
        })
        .await
    }

    /// What the restock under `key` did, if there was one.
    async fn restocked(
        &self,
        key: &IdempotencyKey,
        fingerprint: &str,
    ) -> Result<Option<Stocked>, CheckoutError> {
        #[derive(sqlx::FromRow)]
        struct Found {
            request_fingerprint: String,
            #[sqlx(flatten)]
            stocked: Stocked,
        }
        let found: Option<(String, Stocked)> = sqlx::query_as::<_, Found>(concat!(
            "SELECT r.request_fingerprint, p.product_id, p.name, p.price_cents, r.available_after AS available_quantity, ",
            drops::rule_columns!(),
            " FROM restocks r JOIN products p USING (product_id) WHERE r.idempotency_key = $1"
        ))
        .bind(key.as_str())
        .fetch_optional(self.db.primary().pool()?)
        .await?
        .map(|f| (f.request_fingerprint, f.stocked));
        match found {
            None => Ok(None),
            Some((fp, _)) if fp != fingerprint => Err(CheckoutError::KeyReused),
            Some((_, done)) => Ok(Some(done)),
        }
    }
}
