//! The combiner: every product's batch that is ready at one moment goes into one statement
//! ([`statement::run_many`]), one transaction and one commit, so orders spread over many
//! products do not each pay a commit. Large batches (a hot product's) have a lane of their
//! own ([`Lanes`]).

use super::statement::{self, Committed, Failed};
use crate::batching::gather;
use crate::checkout::order::OrderRequest;
use crate::domain::ProductId;
use crate::metrics::Metrics;
use crate::routing::Db;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// One product's batch, for the [`combiner`].
pub(super) struct Job {
    pub product: ProductId,
    pub reqs: Vec<OrderRequest>,
    pub reply: oneshot::Sender<Result<Committed, Failed>>,
}

/// Order statements in flight at once in a lane ([`Lanes`]), normally: one. While it runs, the
/// batches that become ready queue for the next, so a spread of orders over many products
/// commits many products at a time, and a hot product alone sends one batch at a time, which
/// runs alone.
/// One statement at a time makes the largest statements, and an order statement's fixed
/// cost (its executor start-ups, triggers and commit, many times an order's own share) is
/// paid fewest times. Over 1,000 products, side by side on a new database each, two in
/// flight made smaller statements and sold less with a higher p99; letting a second
/// statement start once the first had run a while (an overlap) lost to one at a time in
/// every round, on throughput, p99 and PostgreSQL's CPU per order. The runs:
/// bench/results/spread-2026-12-04.md; the fixed cost: bench/results/README.md.
const STATEMENTS: usize = 1;

/// A statement that has run this long without an answer is taken to be waiting on a row
/// lock (an import's, another instance's, a long transaction's): it gives its place to the
/// next statement, so the other products' orders go on beside it. A statement under full
/// load with no row held answers well within it (bench/results/spread-2026-12-04.md).
const STALL: Duration = Duration::from_millis(25);

/// How many stalled statements may wait beside the ones running normally, both lanes together;
/// beyond this, the next statement waits for one of them. A product waiting on a held row ends
/// up in a statement of its own (a combined one gives up after
/// [`statement::COMBINED_LOCK_WAIT`]), so this many held products leave the running places
/// free; each holds one primary connection, so the two lanes hold no more than one did.
const STALLED: usize = 8;

/// The most requests one combined statement carries.
const MAX_COMBINED: usize = 1024;

/// A batch of at least this many orders goes to the large lane. A product that sells in such
/// batches is hot: its orders already share one statement and its commit among themselves, so
/// gathering quiet products' batches into that statement saves them little and makes the hot
/// product's orders wait for the quiet ones' statement before theirs can start. With a hot
/// product and 1,000 quiet ones at once, side by side, the hot one sold 0.40–0.42 of what it
/// sold alone (p99 28–34 ms) in one lane and 0.55–0.69 (p99 22–27 ms) with its own
/// (bench/results/mix-2026-12-07.md, from 12:26). Spread orders come in batches of one or two
/// and stay in the small lane, so they keep the largest statements.
const LARGE: usize = 8;

/// Two combiners: one for small batches, one for large ones ([`LARGE`]). Each runs its own
/// statements one at a time ([`STATEMENTS`]); a product's worker sends one batch at a time, so
/// no two statements in flight ever hold a batch of the same product, and all of them lock
/// their rows in the one shared order.
pub(super) struct Lanes {
    small: mpsc::UnboundedSender<Job>,
    large: mpsc::UnboundedSender<Job>,
}

impl Lanes {
    pub(super) fn start(db: &Db, metrics: &Metrics) -> Lanes {
        let stalled = Arc::new(tokio::sync::Semaphore::new(STALLED));
        let lane = || {
            let (jobs, rx) = mpsc::unbounded_channel();
            tokio::spawn(combiner(db.clone(), metrics.clone(), stalled.clone(), rx));
            jobs
        };
        Lanes {
            small: lane(),
            large: lane(),
        }
    }

    /// Sends a batch to its lane; back if that lane's combiner is gone.
    pub(super) fn send(&self, job: Job) -> Result<(), mpsc::error::SendError<Job>> {
        match job.reqs.len() >= LARGE {
            true => self.large.send(job),
            false => self.small.send(job),
        }
    }
}

/// Runs the products' batches: each alone when nothing else is ready, else every batch ready
/// at that moment in one statement ([`statement::run_many`]: one transaction, rows locked in the
/// shared product order, one commit). If a combined statement fails, nothing of it was
/// written, and its batches run again one by one, so each product's worker sees its own
/// outcome (a row-level error it splits around, a lock race it reruns) exactly as if it had
/// run alone. No two statements in flight hold a batch of the same product (a product's
/// worker waits for its batch's answer), so a stalled statement never blocks the next one.
async fn combiner(
    db: Db,
    metrics: Metrics,
    stalled: Arc<tokio::sync::Semaphore>,
    mut rx: mpsc::UnboundedReceiver<Job>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(STATEMENTS));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let jobs = gather(first, &mut rx, MAX_COMBINED, Duration::ZERO, |j: &Job| {
            j.reqs.len()
        })
        .await;
        let (db, metrics, stalled) = (db.clone(), metrics.clone(), stalled.clone());
        tokio::spawn(async move {
            let run = run_jobs(&db, &metrics, jobs);
            tokio::pin!(run);
            if tokio::time::timeout(STALL, &mut run).await.is_ok() {
                return;
            }
            // Stalled: trade the running place for a stalled one, if one is free.
            let _place = match stalled.try_acquire_owned() {
                Ok(aside) => {
                    drop(permit);
                    metrics.order_statements_stalled.inc();
                    aside
                }
                Err(_) => permit,
            };
            run.await;
        });
    }
}

async fn run_jobs(db: &Db, metrics: &Metrics, jobs: Vec<Job>) {
    if jobs.len() > 1 {
        metrics.order_transactions.inc();
        let views: Vec<(&ProductId, Vec<&OrderRequest>)> = jobs
            .iter()
            .map(|j| (&j.product, j.reqs.iter().collect()))
            .collect();
        // Boxed: a statement's future is large (its query, its connection's, its timeouts),
        // and a future is copied whole each time it moves; held inline, it made the spawned
        // task of every statement large, and tokio copies a task's future as it spawns and
        // finishes it: about 7 % of the service's instructions an order over 1,000 products
        // (callgrind; bench/results/README.md, "The 1,000-product gap").
        match Box::pin(statement::run_many(db, &views)).await {
            Ok(committed) => {
                for (job, c) in jobs.into_iter().zip(committed) {
                    let _ = job.reply.send(Ok(c));
                }
                return;
            }
            Err(Failed::Unknown) => {
                for job in jobs {
                    let _ = job.reply.send(Err(Failed::Unknown));
                }
                return;
            }
            Err(Failed::NothingWritten(e)) => {
                tracing::warn!(error = %e, batches = jobs.len(), "a combined order statement failed; running its batches one by one");
            }
        }
    }
    futures::future::join_all(jobs.into_iter().map(|job| async move {
        metrics.order_transactions.inc();
        let reqs: Vec<&OrderRequest> = job.reqs.iter().collect();
        let result = Box::pin(statement::run(db, &job.product, &reqs)).await;
        let _ = job.reply.send(result);
    }))
    .await;
}
