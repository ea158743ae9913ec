//! An import job's state: its progress as the endpoint and the CLI report it, its status,
//! stop requests and how it ended.

use super::csv::BadLine;
use super::throttle::Replicas;
use super::write::{Applied, StockLimit};
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many clamped rows a job lists (it counts them all).
const CLAMPED_LISTED: usize = 100;

/// Live progress, shared with whoever reports it (a progress bar, log lines, the endpoint).
#[derive(Debug, Clone, Serialize, Default, utoipa::ToSchema)]
pub struct Progress {
    pub status: Status,
    pub rows_total: u64,
    /// Rows applied so far (created, changed or found unchanged).
    pub rows_done: u64,
    /// Rows (a product at a location) of products new to stockgate: each level starts
    /// with the file's count.
    pub rows_created: u64,
    /// Rows whose level's stated count, or whose product's name or price, differed: the
    /// level moved by the change in its stated count.
    pub rows_changed: u64,
    /// Rows already as the file states them: nothing written.
    pub rows_unchanged: u64,
    /// Changed rows whose lowered count was below what had been sold there since: the level
    /// stopped at 0 instead of going negative.
    pub rows_clamped: u64,
    /// The first 100 clamped rows: the product, and `@location` unless it is `default`.
    pub clamped_products: Vec<String>,
    pub rows_skipped: u64,
    pub bad_lines: Vec<BadLine>,
    pub batch_size: usize,
    pub rows_per_second: f64,
    pub lag_budget_ms: u64,
    pub worst_staleness_ms: Option<u64>,
    pub max_staleness_seen_ms: u64,
    pub waiting: Option<String>,
    pub paused_ms: u64,
    pub down_replicas: Vec<String>,
    pub error: Option<String>,
    pub elapsed_ms: u64,
    /// When the job reached `done`, `failed` or `cancelled`.
    pub ended_at: Option<DateTime<Utc>>,
}

/// `running` ⇄ `waiting` → `done` | `failed`; a stop request → `stopping` → `cancelled`.
#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Writing batches.
    #[default]
    Running,
    /// Between batches, for replicas to catch up (see `waiting`).
    Waiting,
    /// Asked to stop: the batch in flight commits, no further batch starts.
    Stopping,
    /// Every row applied.
    Done,
    /// Stopped on request after a whole batch; re-running the same file continues.
    Cancelled,
    /// A batch failed and was rolled back; the batches before it are in.
    Failed,
}

impl Status {
    /// `done`, `failed` and `cancelled` never change again.
    pub fn is_final(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Cancelled)
    }
}

pub type SharedProgress = Arc<Mutex<Progress>>;

pub(crate) fn update(p: &SharedProgress, f: impl FnOnce(&mut Progress)) {
    f(&mut p.lock().unwrap_or_else(|e| e.into_inner()));
}

/// Asks a job to stop after its current batch; `stopping` until then. A job already
/// finished is left as it is.
pub fn request_stop(progress: &SharedProgress, stop: &AtomicBool) {
    // The flag first, then the status under the lock: the engine reads the flag under the
    // same lock when it sets `running`/`waiting`, so it can never write over `stopping`.
    stop.store(true, Ordering::SeqCst);
    update(progress, |p| {
        if !p.status.is_final() {
            p.status = Status::Stopping;
        }
    });
}

/// How the engine ended, when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Done,
    Cancelled,
}

/// Records the final state and when it was reached, in one step (whoever sees a final
/// status also sees `ended_at`).
pub fn finish(progress: &SharedProgress, result: &anyhow::Result<Ended>, at: DateTime<Utc>) {
    update(progress, |p| {
        p.status = match result {
            Ok(Ended::Done) => Status::Done,
            Ok(Ended::Cancelled) => Status::Cancelled,
            Err(_) => Status::Failed,
        };
        if let Err(e) = result {
            p.error = Some(match e.downcast_ref::<StockLimit>() {
                Some(limit) => format!("{limit}; the batch was rolled back, earlier batches are in"),
                None => "a batch failed and was rolled back; earlier batches are in; re-running the same file is safe".into(),
            });
        }
        p.waiting = None;
        p.ended_at = Some(at);
    });
}

impl Progress {
    /// Before a batch: what the replicas allow, and whether the job runs, waits or stops.
    pub(super) fn saw_replicas(
        &mut self,
        replicas: &Replicas,
        stop: &AtomicBool,
        paused: Duration,
        elapsed: Duration,
    ) {
        self.worst_staleness_ms = replicas.worst_ms;
        self.max_staleness_seen_ms = self
            .max_staleness_seen_ms
            .max(replicas.worst_ms.unwrap_or(0));
        self.down_replicas = replicas.down.clone();
        self.status = if stop.load(Ordering::SeqCst) {
            Status::Stopping
        } else if replicas.waiting.is_some() {
            Status::Waiting
        } else {
            Status::Running
        };
        self.waiting = replicas.waiting.clone();
        self.paused_ms = paused.as_millis() as u64;
        self.elapsed_ms = elapsed.as_millis() as u64;
    }

    /// After a committed batch: its counts, and the import's pace so far.
    pub(super) fn add_batch(
        &mut self,
        applied: Applied,
        done: usize,
        worst_ms: u64,
        batch: usize,
        elapsed: Duration,
    ) {
        self.rows_done = done as u64;
        self.rows_created += applied.created;
        self.rows_changed += applied.changed;
        self.rows_unchanged += applied.unchanged;
        self.rows_clamped += applied.clamped.len() as u64;
        let room = CLAMPED_LISTED.saturating_sub(self.clamped_products.len());
        self.clamped_products
            .extend(applied.clamped.into_iter().take(room));
        self.max_staleness_seen_ms = self.max_staleness_seen_ms.max(worst_ms);
        self.batch_size = batch;
        self.rows_per_second = done as f64 / elapsed.as_secs_f64().max(1e-6);
        self.elapsed_ms = elapsed.as_millis() as u64;
    }
}
