//! Bulk import of products from CSV, throttled against live replica staleness.
//!
//! The CSV has a header `product_id,name,price_cents,available_quantity` (any column order),
//! optionally with `location_id`, and one (product, location) per line: a line without a
//! location (no column, or an empty cell) states the count at `default`. The whole file is
//! validated first: every bad line is reported with its number (a duplicate (product,
//! location), a product whose lines disagree on name or price, a location that does not
//! exist, which is read from the primary before anything is written), and unless
//! `--skip-invalid` is given nothing is written. Rows are then written in batches, one
//! transaction each (a crash or Ctrl-C never leaves half a batch).
//!
//! **Imports keep what was sold**, at each location on its own. A line *states* a product's
//! count at a location; it does not overwrite the stock. A product new to stockgate starts
//! with the file's counts (at the locations its lines name, and only there). For one that
//! exists, each level moves by the change in its stated count — `file − stated_quantity`,
//! the count the level was last given (at creation or by an import; a level never given one:
//! its count) — and its `stated_quantity` becomes the file's. Sales, cancels, restocks and
//! transfers since then never touch `stated_quantity`, so they are kept where they happened;
//! re-running the same file changes nothing; a recount of +5 adds 5; and re-running after
//! Ctrl-C just continues, because the batches already in are no-ops the second time. If
//! more was sold than a lowered count leaves, the level stops at 0 (the CHECK forbids less)
//! and the row is counted as clamped ([`restate`] is the whole rule). The product's count
//! moves by its levels' actual changes at active locations; an inactive location's level is
//! restated all the same. Every change is a movement (reason `import`, `ref` the import's
//! id: the job's id, or the one the CLI prints when it starts).
//!
//! Stock that goes up must reopen the stock gate, which may be answering "sold out" from
//! memory. In the service the job hands each batch's risen products to
//! [`Checkout::reopened`]. The CLI runs in another process and cannot reach the servers'
//! gates; they see the increase within the gate's 250 ms budget, when their cached answers
//! expire (see [`Announce`]).
//!
//! Before every batch the engine reads the worst staleness of the replicas that are serving
//! (not `down`) from the same freshness monitor the router uses. Over the budget it waits;
//! batch sizes grow additively while replicas keep up and halve when they fall behind
//! (AIMD). A `down` replica does not hold the import hostage unless `--wait-for-down`.
//!
//! A job's states: `running` ⇄ `waiting` (for replicas) → `done` or `failed`; a stop request
//! (Ctrl-C, `DELETE /v1/admin/imports/{id}`) makes it `stopping` until the batch in flight
//! commits, then `cancelled`. `done`, `failed` and `cancelled` are final and carry `ended_at`.

mod csv;
mod job;
mod locations;
mod throttle;
mod write;

pub use csv::{BadLine, DEFAULT_LOCATION, MAX_LINE_BYTES, Row, parse_csv};
pub(crate) use job::update;
pub use job::{Ended, Progress, SharedProgress, Status, finish, request_stop};
pub use locations::set_aside_unknown_locations;
pub use write::{Restated, StockLimit, restate};

use crate::checkout::Checkout;
use crate::clock::Clock;
use crate::domain::ProductId;
use crate::metrics::Metrics;
use crate::routing::Db;
use chrono::{DateTime, Utc};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use throttle::{Replicas, Throttle};
use uuid::Uuid;
use write::{Applied, write_batch};

/// Import options shared by the CLI and the admin endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub lag_budget: Duration,
    pub batch_size: usize,
    pub skip_invalid: bool,
    pub wait_for_down: bool,
}

/// Who must hear that stock went up.
#[derive(Clone, Copy)]
pub enum Announce<'a> {
    /// This process serves the stock gate: each product whose stock rose reopens it
    /// ([`Checkout::reopened`]), so a "sold out" cached here does not outlive the import.
    Gate(&'a Checkout),
    /// Another process (`stockgate import`): no gate here. The servers' gates cache an
    /// answer only while it is within the 250 ms budget, so they see the rise within that.
    Nobody,
}

/// How long one wait for the replicas lasts before they are read again.
const WAIT_TICK: Duration = Duration::from_millis(50);

/// Writes `rows` in throttled batches, as the import `id` (its movements' `ref`). Stops
/// between batches when `stop` is set. The final state is the caller's to record
/// ([`finish`]), with its own clock.
#[allow(clippy::too_many_arguments)]
pub async fn run_engine(
    db: &Db,
    metrics: &Metrics,
    announce: Announce<'_>,
    id: Uuid,
    rows: &[Row],
    opts: Options,
    progress: &SharedProgress,
    stop: &AtomicBool,
) -> anyhow::Result<Ended> {
    let start = Instant::now();
    let mut throttle = Throttle::new(&opts);
    let mut done = 0usize;
    let mut paused = Duration::ZERO;
    update(progress, |p| {
        p.rows_total = rows.len() as u64;
        p.lag_budget_ms = opts.lag_budget.as_millis() as u64;
    });
    while done < rows.len() {
        if stop.load(Ordering::SeqCst) {
            return Ok(Ended::Cancelled);
        }
        let replicas = Replicas::read(db, &opts);
        update(progress, |p| {
            p.saw_replicas(&replicas, stop, paused, start.elapsed());
        });
        if replicas.waiting.is_some() {
            tokio::time::sleep(WAIT_TICK).await;
            paused += WAIT_TICK;
            metrics
                .import_paused_seconds
                .inc_by(WAIT_TICK.as_secs_f64());
            // Falling behind: the next batches start smaller.
            throttle.halve();
            continue;
        }
        let end = (done + throttle.batch).min(rows.len());
        let applied = apply_batch(db, metrics, announce, id, &rows[done..end]).await?;
        done = end;
        let worst = db.worst_serving_staleness().0.map(|(_, d)| d);
        throttle.adapt(worst);
        let elapsed = start.elapsed();
        update(progress, |p| {
            p.add_batch(
                applied,
                done,
                worst.map_or(0, millis),
                throttle.batch,
                elapsed,
            );
        });
    }
    update(progress, |p| p.paused_ms = paused.as_millis() as u64);
    metrics.import_rate.set(0.0);
    Ok(Ended::Done)
}

/// Writes one batch, tells the gate of the stock it raised, and counts its rows and rate.
async fn apply_batch(
    db: &Db,
    metrics: &Metrics,
    announce: Announce<'_>,
    id: Uuid,
    rows: &[Row],
) -> anyhow::Result<Applied> {
    let t = Instant::now();
    let applied = write_batch(db, rows, id).await?;
    announce_raised(announce, &applied.raised).await;
    metrics.import_rows.inc_by(rows.len() as u64);
    let rate = rows.len() as f64 / t.elapsed().as_secs_f64().max(1e-6);
    metrics.import_rate.set(rate);
    Ok(applied)
}

pub(super) fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// Reopens the gate for products whose stock rose in a committed batch, through the one
/// path every increase of stock takes (which fails safe on its own).
async fn announce_raised(announce: Announce<'_>, raised: &[ProductId]) {
    let Announce::Gate(checkout) = announce else {
        return;
    };
    checkout.reopened(raised).await;
}

pub(super) fn fmt_budget(d: Duration) -> String {
    if d.as_millis().is_multiple_of(1000) {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// The clock's now as a UTC instant (through the time base, so a test clock moves it).
pub fn clock_now(clock: &dyn Clock) -> DateTime<Utc> {
    static BASE: std::sync::OnceLock<crate::clock::TimeBase> = std::sync::OnceLock::new();
    BASE.get_or_init(crate::clock::TimeBase::now)
        .wall(clock.now())
}
