//! Per-product order coalescing: application-level group commit on the hot row.
//!
//! Concurrent orders for one product queue up for that product's worker, which takes them
//! in batches: everything queued when it is free, up to `max_batch` (optionally waiting a
//! short window for more). One primary transaction per batch locks the product row, looks
//! up the batch's idempotency keys, allocates stock in arrival order, inserts the winners'
//! orders in one statement and takes their total with ONE guarded
//! `UPDATE … WHERE available_quantity >= $total`, then commits. Losers get OUT_OF_STOCK as
//! before. The guarded UPDATE and the CHECK constraint stay, so correctness never depends
//! on this module: with several instances, their batches simply take turns on the row lock.
//!
//! Sends happen under the queue map's lock, and a worker retires itself under the same lock
//! only when its queue is empty, so no order is ever sent to a worker that has gone.

use super::gate_cache::{Answer, GateCache};
use super::{CheckoutError, Order, OrderRequest, Placed};
use crate::domain::{IdempotencyKey, ProductId, UserId};
use crate::metrics::Metrics;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, DbError, Reason, Route};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

type Reply = oneshot::Sender<Result<Placed, CheckoutError>>;

struct Pending {
    req: OrderRequest,
    reply: Reply,
}

/// How long an idle product's worker lingers before retiring.
const IDLE: Duration = Duration::from_secs(5);

pub struct Coalescer {
    db: Db,
    metrics: Metrics,
    cache: Arc<GateCache>,
    max_batch: usize,
    window: Duration,
    queues: Mutex<HashMap<ProductId, mpsc::UnboundedSender<Pending>>>,
    /// (user, key) of orders queued or in a batch in this instance.
    in_flight: Mutex<HashMap<(UserId, IdempotencyKey), usize>>,
}

/// Clears an order's in-flight mark however its request ends.
struct InFlight<'a>(&'a Coalescer, (UserId, IdempotencyKey));

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut marks = self.0.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = marks.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                marks.remove(&self.1);
            }
        }
    }
}

/// What the batch decided for one request.
enum Outcome {
    Done(Result<Placed, CheckoutError>),
    /// Its key was taken by a concurrent transaction between our lookup and our insert:
    /// look it up again after the commit.
    LookUpAgain,
}

impl Coalescer {
    pub fn new(
        db: Db,
        metrics: Metrics,
        cache: Arc<GateCache>,
        max_batch: usize,
        window: Duration,
    ) -> Arc<Self> {
        Arc::new(Coalescer {
            db,
            metrics,
            cache,
            max_batch: max_batch.max(1),
            window,
            queues: Mutex::default(),
            in_flight: Mutex::default(),
        })
    }

    /// Whether an order with this user's key is queued or being placed here right now.
    pub fn is_in_flight(&self, user: &UserId, key: &IdempotencyKey) -> bool {
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&(user.clone(), key.clone()))
    }

    /// Queues an order for its product's next batch and waits for the answer. The batch
    /// runs in the worker's task, so a caller that goes away leaves a whole order or none.
    pub async fn submit(self: &Arc<Self>, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let mark = (req.user.clone(), req.key.clone());
        *self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(mark.clone())
            .or_default() += 1;
        let _guard = InFlight(self, mark);
        let (tx, rx) = oneshot::channel();
        {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            let sender = queues.entry(req.product.clone()).or_insert_with(|| {
                let (sender, receiver) = mpsc::unbounded_channel();
                tokio::spawn(self.clone().worker(req.product.clone(), receiver));
                sender
            });
            sender.send(Pending { req, reply: tx }).map_err(|_| {
                CheckoutError::Db(DbError::Unavailable("order queue closed".into()))
            })?;
            self.metrics.order_queue_depth.inc();
        }
        rx.await.map_err(|_| {
            CheckoutError::Db(DbError::Unavailable("the order batch was abandoned".into()))
        })?
    }

    async fn worker(self: Arc<Self>, product: ProductId, mut rx: mpsc::UnboundedReceiver<Pending>) {
        loop {
            let first = match tokio::time::timeout(IDLE, rx.recv()).await {
                Ok(Some(p)) => p,
                Ok(None) => return,
                Err(_) => {
                    let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
                    if rx.is_empty() {
                        queues.remove(&product);
                        return;
                    }
                    continue;
                }
            };
            let mut batch = vec![first];
            // Let requests that arrived together join, then take all that is queued.
            tokio::task::yield_now().await;
            let deadline = tokio::time::Instant::now() + self.window;
            while batch.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) if self.window.is_zero() => break,
                    Err(_) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(p)) => batch.push(p),
                        _ => break,
                    },
                }
            }
            self.metrics.order_queue_depth.sub(batch.len() as i64);
            self.process(&product, batch).await;
        }
    }

    async fn process(self: &Arc<Self>, product: &ProductId, batch: Vec<Pending>) {
        self.metrics.order_batch_size.observe(batch.len() as f64);
        let reqs: Vec<&OrderRequest> = batch.iter().map(|p| &p.req).collect();
        let result = self.run_batch(product, &reqs).await;
        let this = self.clone();
        // Replies (and the bookkeeping before them) run beside the next batch.
        tokio::spawn(async move {
            match result {
                Ok((outcomes, winners)) => {
                    if !winners.is_empty() {
                        this.note_writes(&winners).await;
                    }
                    for (p, outcome) in batch.into_iter().zip(outcomes) {
                        let answer = match outcome {
                            Outcome::Done(r) => r,
                            Outcome::LookUpAgain => {
                                match super::existing_on_primary(&this.db, &p.req).await {
                                    Ok(Some(placed)) => Ok(placed),
                                    Ok(None) => Err(CheckoutError::Db(DbError::Unavailable(
                                        "the idempotency key is contended; retry".into(),
                                    ))),
                                    Err(e) => Err(e),
                                }
                            }
                        };
                        let _ = p.reply.send(answer);
                    }
                }
                Err(e) => {
                    // Nothing of the batch was written; every request in it gets the error.
                    tracing::warn!(product = %p_id(&batch), error = %e, size = batch.len(), "order batch failed and rolled back");
                    let msg = e.to_string();
                    for p in batch {
                        let _ = p
                            .reply
                            .send(Err(CheckoutError::Db(DbError::Unavailable(msg.clone()))));
                    }
                }
            }
        });
    }

    /// Records each winner's write for read-your-writes, so a retry of their order finds it
    /// wherever it is read.
    async fn note_writes(&self, winners: &[UserId]) {
        let lsn = match self.db.primary().current_lsn().await {
            Ok(lsn) => lsn,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the primary's position after an order batch");
                return;
            }
        };
        let unique: Vec<&UserId> = winners.iter().collect::<HashSet<_>>().into_iter().collect();
        if self.db.ryw().advance_many(&unique, lsn).await.is_err() {
            self.metrics
                .ryw_store_failures
                .with_label_values(&["advance"])
                .inc();
        }
    }

    /// One transaction for the batch. Returns an outcome per request and the users whose
    /// orders were created.
    async fn run_batch(
        &self,
        product: &ProductId,
        reqs: &[&OrderRequest],
    ) -> Result<(Vec<Outcome>, Vec<UserId>), DbError> {
        self.metrics.order_transactions.inc();
        let mut tx = self.db.primary().begin().await?;
        let row: Option<(i32, i32)> = sqlx::query_as(
            "SELECT available_quantity, price_cents FROM products WHERE product_id = $1 FOR UPDATE",
        )
        .bind(product.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let locked_at = Instant::now();
        let Some((stock, price)) = row else {
            tx.rollback().await?;
            return Ok((
                reqs.iter()
                    .map(|_| Outcome::Done(Err(CheckoutError::ProductNotFound)))
                    .collect(),
                vec![],
            ));
        };
        // Orders already placed for this product under these keys (by earlier batches or
        // instances). Like every statement here it is keyed by product_id; a key already
        // used for another product surfaces as a conflict on insert and is looked up after.
        let existing = super::existing_for(&mut *tx, reqs, Some(product)).await?;
        // Allocate in arrival order.
        let mut remaining = stock;
        let mut outcomes: Vec<Outcome> = Vec::with_capacity(reqs.len());
        let mut first_of: HashMap<(&str, &str), usize> = HashMap::new();
        let mut duplicates: Vec<(usize, usize)> = Vec::new();
        let mut winners: Vec<(usize, Uuid)> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if let Some(&first) = first_of.get(&(r.user.as_str(), r.key.as_str())) {
                duplicates.push((i, first));
                outcomes.push(Outcome::LookUpAgain); // decided below, from the first's fate
                continue;
            }
            first_of.insert((r.user.as_str(), r.key.as_str()), i);
            let outcome = match existing.get(&super::key_of(r)) {
                Some(e) if e.request_fingerprint == r.fingerprint() => {
                    Outcome::Done(Ok(Placed::Replayed(e.order.clone())))
                }
                Some(_) => Outcome::Done(Err(CheckoutError::KeyReused)),
                None if r.quantity.get() <= remaining => {
                    remaining -= r.quantity.get();
                    winners.push((i, Uuid::new_v4()));
                    Outcome::LookUpAgain // becomes Created once inserted
                }
                None => Outcome::Done(Err(CheckoutError::OutOfStock)),
            };
            outcomes.push(outcome);
        }
        let mut created_users = Vec::new();
        if !winners.is_empty() {
            let ids: Vec<Uuid> = winners.iter().map(|(_, id)| *id).collect();
            let w_users: Vec<&str> = winners
                .iter()
                .map(|(i, _)| reqs[*i].user.as_str())
                .collect();
            let w_qty: Vec<i32> = winners
                .iter()
                .map(|(i, _)| reqs[*i].quantity.get())
                .collect();
            let w_keys: Vec<&str> = winners.iter().map(|(i, _)| reqs[*i].key.as_str()).collect();
            let w_fps: Vec<String> = winners
                .iter()
                .map(|(i, _)| reqs[*i].fingerprint())
                .collect();
            let inserted: Vec<Order> = sqlx::query_as(
                "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
                 SELECT o.order_id, $1, o.user_id, o.quantity, $2, $2::int8 * o.quantity, 'confirmed', o.idempotency_key, o.fingerprint \
                 FROM UNNEST($3::uuid[], $4::text[], $5::int4[], $6::text[], $7::text[]) AS o(order_id, user_id, quantity, idempotency_key, fingerprint) \
                 ON CONFLICT (user_id, idempotency_key) DO NOTHING \
                 RETURNING order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at",
            )
            .bind(product.as_str())
            .bind(price)
            .bind(&ids)
            .bind(&w_users)
            .bind(&w_qty)
            .bind(&w_keys)
            .bind(&w_fps)
            .fetch_all(&mut *tx)
            .await?;
            let mut by_id: HashMap<Uuid, Order> =
                inserted.into_iter().map(|o| (o.order_id, o)).collect();
            let mut total = 0i32;
            for (i, id) in &winners {
                // A winner whose key a concurrent transaction claimed stays LookUpAgain.
                if let Some(order) = by_id.remove(id) {
                    total += order.quantity;
                    created_users.push(reqs[*i].user.clone());
                    outcomes[*i] = Outcome::Done(Ok(Placed::Created(order)));
                }
            }
            remaining = stock - total;
            if total > 0 {
                let taken = sqlx::query(
                    "UPDATE products SET available_quantity = available_quantity - $2, updated_at = clock_timestamp() \
                     WHERE product_id = $1 AND available_quantity >= $2",
                )
                .bind(product.as_str())
                .bind(total)
                .execute(&mut *tx)
                .await?;
                if taken.rows_affected() != 1 {
                    tx.rollback().await?;
                    return Err(DbError::Unavailable(
                        "the guarded stock update changed no row; the batch was rolled back".into(),
                    ));
                }
            }
        }
        tx.commit().await?;
        // A duplicate inside the batch shares its first request's fate.
        for (d, first) in duplicates {
            let same_body = reqs[d].fingerprint() == reqs[first].fingerprint();
            outcomes[d] = match &outcomes[first] {
                _ if !same_body => Outcome::Done(Err(CheckoutError::KeyReused)),
                Outcome::Done(Ok(Placed::Created(o) | Placed::Replayed(o))) => {
                    Outcome::Done(Ok(Placed::Replayed(o.clone())))
                }
                Outcome::Done(Err(CheckoutError::OutOfStock)) => {
                    Outcome::Done(Err(CheckoutError::OutOfStock))
                }
                Outcome::Done(Err(CheckoutError::ProductNotFound)) => {
                    Outcome::Done(Err(CheckoutError::ProductNotFound))
                }
                Outcome::Done(Err(CheckoutError::KeyReused)) => {
                    Outcome::Done(Err(CheckoutError::KeyReused))
                }
                _ => Outcome::LookUpAgain,
            };
        }
        // The stock right after our commit, exact from the moment we held the row lock.
        let route = Route {
            as_of: self.db.wall(locked_at),
            ..Route::primary(
                QueryClass::StockGate,
                Reason::PrimaryOnly,
                self.db.now_utc(),
            )
        };
        self.cache.put(
            product,
            Answer {
                available: Some(remaining),
                route,
                as_of: locked_at,
            },
        );
        Ok((outcomes, created_users))
    }
}

fn p_id(batch: &[Pending]) -> String {
    batch
        .first()
        .map(|p| p.req.product.to_string())
        .unwrap_or_default()
}
