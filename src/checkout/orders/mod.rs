//! Per-product order coalescing: application-level group commit on the hot row.
//!
//! Concurrent orders for one product queue up for that product's worker, which takes them
//! in batches: everything queued when it is free, up to `max_batch` (optionally waiting a
//! short window for more), and runs each as one primary transaction ([`statement`]).
//! The guarded UPDATE and the CHECK constraint stay, so correctness never depends on this
//! module: with several instances, their batches simply take turns on the row lock.
//!
//! A queued order belongs to its worker, not to the request that sent it: a client that
//! hangs up or times out leaves its order in the queue, and the order's key — claimed by the
//! batch on the primary — tells any retry, on any instance, what became of it.
//!
//! Instances that sell the same product take turns on its row, and each turn costs a lock
//! hand-off, a batch's statement and a commit, however few orders the batch holds. When a
//! batch finds that another writer took stock since our last commit, the row is contended,
//! and the next batch gathers orders for as long as this one waited for the lock (at most
//! [`MAX_WINDOW`]) before it queues: the row is busy with the other writer meanwhile, so the
//! wait costs no throughput, and the batch that reaches the lock is larger. Uncontended,
//! the configured window applies (none by default).
//!
//! Failures are contained. A batch that hits a row-level error is split in halves and
//! retried, so one poisoned row fails alone; a deadlock or serialization failure reruns the
//! batch; a COMMIT whose outcome is unknown answers every request it held "unknown, retry
//! with the same key". A worker that dies is replaced on the next order for its product,
//! and the orders it held are answered "unknown" (its batch may have committed).
//!
//! Sends happen under the queue map's lock, and a worker retires itself under the same lock
//! only when its queue is empty, so no order is ever sent to a worker that has gone.

mod combiner;
mod statement;

use crate::batching::{BATCH_LIMIT, answer, gather};
use crate::checkout::error::CheckoutError;
use crate::checkout::gate_cache::{Answer, GateCache};
use crate::checkout::order::{OrderRequest, Placed};
use crate::domain::ProductId;
use crate::metrics::Metrics;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, DbError, Internal};
use combiner::{Job, Lanes};
use statement::{Committed, Failed, RowSeen};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

type Reply = oneshot::Sender<Result<Placed, CheckoutError>>;

struct Pending {
    req: OrderRequest,
    reply: Reply,
    queued: Instant,
}

/// How long an idle product's worker lingers before retiring.
const IDLE: Duration = Duration::from_secs(5);

/// The longest a contended product's batch gathers orders before it queues for the row.
const MAX_WINDOW: Duration = Duration::from_millis(4);

/// How long a product stays contended after a batch saw another writer's take. An instance
/// that sends the product's orders to its owner runs no batches of its own, so it looks
/// again (one local batch) once this has passed.
const CONTENDED_FOR: Duration = Duration::from_secs(5);

/// How many times a batch is rerun after a deadlock or serialization failure.
const RERUNS: usize = 3;

/// What a committed batch saw of its product's row, and how long it waited for it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    row: RowSeen,
    /// From the batch's start to holding the row lock.
    waited: Duration,
}

/// How long the next batch gathers orders: as long as this one waited for the row when
/// another writer took stock since our last commit (bounded), else the configured window.
fn next_window(configured: Duration, last_left: Option<i32>, seen: Option<Seen>) -> Duration {
    match seen {
        Some(seen) if last_left.is_some_and(|left| left != seen.row.found) => {
            seen.waited.clamp(configured, MAX_WINDOW.max(configured))
        }
        _ => configured,
    }
}

pub struct Coalescer {
    db: Db,
    metrics: Metrics,
    cache: Arc<GateCache>,
    max_batch: usize,
    window: Duration,
    queues: Mutex<HashMap<ProductId, mpsc::UnboundedSender<Pending>>>,
    /// Products whose row another writer took between two of our batches, until when.
    contended: Mutex<HashMap<ProductId, Instant>>,
    /// The products' batches, on their way to a shared statement ([`combiner`]).
    jobs: Lanes,
}

/// Sends `item` to `key`'s worker, starting one if there is none or if the one there has
/// died (its receiver is gone). A dead worker's queued items were dropped with it, so
/// their senders learn at once.
fn send_or_respawn<K: Eq + Hash + Clone, T>(
    queues: &mut HashMap<K, mpsc::UnboundedSender<T>>,
    key: &K,
    item: T,
    mut spawn: impl FnMut() -> mpsc::UnboundedSender<T>,
) -> Result<(), T> {
    let sender = queues.entry(key.clone()).or_insert_with(&mut spawn);
    match sender.send(item) {
        Ok(()) => Ok(()),
        Err(mpsc::error::SendError(item)) => {
            let fresh = spawn();
            let sent = fresh.send(item).map_err(|e| e.0);
            queues.insert(key.clone(), fresh);
            sent
        }
    }
}

/// An error that one request's row can cause (bad data, a constraint, a trigger's
/// refusal): worth splitting the batch around. Lock and statement timeouts, resource and
/// connection errors are the database's state, not a row's: nothing was written, retry.
fn is_row_level(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c.starts_with("P0")),
        _ => false,
    }
}

impl Coalescer {
    pub fn new(
        db: Db,
        metrics: Metrics,
        cache: Arc<GateCache>,
        max_batch: usize,
        window: Duration,
    ) -> Arc<Self> {
        let jobs = Lanes::start(&db, &metrics);
        Arc::new(Coalescer {
            db,
            metrics,
            cache,
            max_batch: max_batch.max(1),
            window,
            queues: Mutex::default(),
            contended: Mutex::default(),
            jobs,
        })
    }

    /// Whether another writer took `product`'s row between two of this instance's batches
    /// within the last [`CONTENDED_FOR`].
    pub fn contended(&self, product: &ProductId) -> bool {
        let mut contended = self.contended.lock().unwrap_or_else(|p| p.into_inner());
        match contended.get(product) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                contended.remove(product);
                false
            }
            None => false,
        }
    }

    /// Queues an order for its product's next batch and waits for the answer. The batch
    /// runs in the worker's task, so a caller that goes away leaves a whole order or none.
    pub async fn submit(self: &Arc<Self>, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let (tx, rx) = oneshot::channel();
        {
            let product = req.product.clone();
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            send_or_respawn(
                &mut queues,
                &product,
                Pending {
                    req,
                    reply: tx,
                    queued: Instant::now(),
                },
                || {
                    let (sender, receiver) = mpsc::unbounded_channel();
                    tokio::spawn(self.clone().worker(product.clone(), receiver));
                    sender
                },
            )
            .map_err(|_| DbError::Internal(Internal::WorkerGone("order worker")))?;
            self.metrics.order_queue_depth.inc();
        }
        // The reply is dropped only if the worker died holding this order: it may have
        // committed, so the honest answer is "unknown".
        answer(rx, Err(CheckoutError::OutcomeUnknown)).await
    }

    async fn worker(self: Arc<Self>, product: ProductId, mut rx: mpsc::UnboundedReceiver<Pending>) {
        let mut window = self.window;
        // The stock our last committed batch left, to notice other writers.
        let mut last_left: Option<i32> = None;
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
            // Let requests that arrived together join, then take all that is queued.
            tokio::task::yield_now().await;
            let batch = gather(first, &mut rx, self.max_batch, window, |_| 1).await;
            self.metrics.order_queue_depth.sub(batch.len() as i64);
            self.metrics.order_batch_size.observe(batch.len() as f64);
            let taken = Instant::now();
            for p in &batch {
                self.metrics
                    .order_queue_seconds
                    .observe(taken.saturating_duration_since(p.queued).as_secs_f64());
            }
            let seen = self.process(&product, batch).await;
            if let (Some(left), Some(seen)) = (last_left, seen)
                && left != seen.row.found
            {
                self.contended
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(product.clone(), Instant::now() + CONTENDED_FOR);
            }
            window = next_window(self.window, last_left, seen);
            last_left = seen.map(|s| s.row.left).or(last_left);
        }
    }

    /// Runs a batch, splitting it around row-level errors, and sends every reply. Returns
    /// what its first committed part saw of the row.
    async fn process(self: &Arc<Self>, product: &ProductId, batch: Vec<Pending>) -> Option<Seen> {
        let mut parts = vec![batch];
        let mut seen = None;
        while let Some(part) = parts.pop() {
            let reqs: Vec<&OrderRequest> = part.iter().map(|p| &p.req).collect();
            let started = Instant::now();
            let result = self.run(product, &reqs).await;
            self.metrics
                .order_batch_seconds
                .observe(started.elapsed().as_secs_f64());
            if let Ok(Committed { row: Some(row), .. }) = &result {
                self.metrics.order_row_held_seconds.observe(
                    row.released_at
                        .saturating_duration_since(row.locked_at)
                        .as_secs_f64(),
                );
                seen.get_or_insert(Seen {
                    row: *row,
                    waited: row.locked_at.saturating_duration_since(started),
                });
            }
            match result {
                Err(Failed::NothingWritten(DbError::Query(e)))
                    if part.len() > 1 && is_row_level(&e) =>
                {
                    // A row-level error: split so the healthy orders commit without it.
                    tracing::warn!(%product, error = %e, size = part.len(), "order batch hit a row-level error; splitting it");
                    let mut part = part;
                    let back = part.split_off(part.len() / 2);
                    parts.push(back);
                    parts.push(part);
                }
                result => self.reply(part, result),
            }
        }
        seen
    }

    /// One batch transaction, rerun after a deadlock or serialization failure.
    async fn run(&self, product: &ProductId, reqs: &[&OrderRequest]) -> Result<Committed, Failed> {
        let mut attempt = 0;
        loop {
            let (reply, rx) = oneshot::channel();
            let job = Job {
                product: product.clone(),
                reqs: reqs.iter().map(|r| (*r).clone()).collect(),
                reply,
            };
            // A job the combiner never took wrote nothing; one it dropped (it died holding
            // it) may have committed: unknown.
            let sent = self.jobs.send(job).map_err(|_| {
                Failed::NothingWritten(DbError::Internal(Internal::WorkerGone("order combiner")))
            });
            let result = tokio::time::timeout(BATCH_LIMIT, async {
                sent?;
                answer(rx, Err(Failed::Unknown)).await
            })
            .await
            .unwrap_or_else(|_| {
                    tracing::warn!(%product, "order batch got no answer in time; its outcome is unknown");
                    Err(Failed::Unknown)
                });
            attempt += 1;
            match &result {
                Err(Failed::NothingWritten(DbError::Conflict(e))) if attempt < RERUNS => {
                    let code = e
                        .as_database_error()
                        .and_then(|d| d.code())
                        .unwrap_or_default();
                    self.metrics
                        .order_batch_reruns
                        .with_label_values(&[code.as_ref()])
                        .inc();
                    tracing::warn!(%product, error = %e, "order batch lost a lock race; rerunning it");
                }
                _ => return result,
            }
        }
    }

    /// Records what the batch left in the gate's cache and answers every request.
    fn reply(&self, batch: Vec<Pending>, result: Result<Committed, Failed>) {
        let fates: Vec<Result<Placed, CheckoutError>> = match result {
            Ok(Committed { fates, row }) => {
                if let (Some(p), Some(row)) = (batch.first(), row) {
                    self.remember(&p.req.product, row);
                }
                fates
            }
            Err(failed) => {
                let product = batch.first().map(|p| &p.req.product);
                tracing::warn!(
                    ?product,
                    ?failed,
                    size = batch.len(),
                    "order batch did not commit"
                );
                batch
                    .iter()
                    .map(|_| {
                        Err(match &failed {
                            Failed::Unknown => CheckoutError::OutcomeUnknown,
                            Failed::NothingWritten(DbError::Query(e)) if is_row_level(e) => {
                                CheckoutError::Refused(e.clone())
                            }
                            Failed::NothingWritten(e) => CheckoutError::Db(e.clone()),
                        })
                    })
                    .collect()
            }
        };
        for (p, fate) in batch.into_iter().zip(fates) {
            let _ = p.reply.send(fate);
        }
    }

    /// The stock right after our commit, exact from the moment we held the row lock.
    fn remember(&self, product: &ProductId, row: RowSeen) {
        let route = self
            .db
            .committed_route(QueryClass::StockGate, row.locked_at);
        self.cache.put(
            product,
            Answer {
                available: Some(row.left),
                window: row.window,
                route,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_gathers_longer_only_after_another_writer_took_stock() {
        let ms = Duration::from_millis;
        let seen = |found, waited| {
            Some(Seen {
                row: RowSeen {
                    found,
                    left: found - 10,
                    locked_at: std::time::Instant::now(),
                    released_at: std::time::Instant::now(),
                    window: super::super::drops::Window::default(),
                },
                waited,
            })
        };
        // Alone on the row: our last batch left 90 and this one found 90.
        assert_eq!(next_window(ms(0), Some(90), seen(90, ms(3))), ms(0));
        // Another instance sold 5 in between: gather as long as we waited for the lock.
        assert_eq!(next_window(ms(0), Some(90), seen(85, ms(3))), ms(3));
        // Bounded above, and never below the configured window.
        assert_eq!(next_window(ms(0), Some(90), seen(85, ms(50))), MAX_WINDOW);
        assert_eq!(next_window(ms(1), Some(90), seen(85, ms(0))), ms(1));
        // No previous batch, or nothing committed: the configured window.
        assert_eq!(next_window(ms(0), None, seen(85, ms(3))), ms(0));
        assert_eq!(next_window(ms(0), Some(90), None), ms(0));
    }

    #[tokio::test]
    async fn a_dead_worker_is_replaced_and_what_it_held_is_answered() {
        type Queue = mpsc::UnboundedReceiver<oneshot::Sender<u32>>;
        let mut queues = HashMap::new();
        let workers: std::cell::RefCell<Vec<Queue>> = Default::default();
        let spawn = || {
            let (tx, rx) = mpsc::unbounded_channel();
            workers.borrow_mut().push(rx);
            tx
        };
        let (held, held_rx) = oneshot::channel();
        assert!(send_or_respawn(&mut queues, &"p", held, spawn).is_ok());
        // The worker dies holding the order: its receiver (and the queued reply) drop.
        drop(workers.borrow_mut().remove(0));
        assert!(
            held_rx.await.is_err(),
            "the order the dead worker held learns at once"
        );
        let (next, _next_rx) = oneshot::channel();
        assert!(send_or_respawn(&mut queues, &"p", next, spawn).is_ok());
        let mut workers = workers.borrow_mut();
        assert_eq!(workers.len(), 1, "a new worker was started");
        assert!(
            workers[0].try_recv().is_ok(),
            "and the next order reached it"
        );
    }
}
