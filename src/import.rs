//! Bulk import of products from CSV, throttled against live replica staleness.
//!
//! The CSV has a header `product_id,name,price_cents,available_quantity` (any column order)
//! and one product per line. The whole file is validated first: every bad line is reported
//! with its line number, and unless `--skip-invalid` is given nothing is written. Rows are
//! then written in batches, one transaction each (a crash or Ctrl-C never leaves half a batch).
//!
//! **Imports keep what was sold.** A line *states* a product's count; it does not overwrite
//! the stock. A product new to stockgate starts with the file's count. For one that exists,
//! the stock moves by the change in the stated count — `file − stated_quantity`, the count
//! it was last given (at creation or by an import) — and `stated_quantity` becomes the
//! file's. Sales, cancels and restocks since then never touch `stated_quantity`, so they are
//! kept; re-running the same file changes nothing; a recount of +5 adds 5; and re-running
//! after Ctrl-C just continues, because the batches already in are no-ops the second time.
//! If more was sold than a lowered count leaves, the stock stops at 0 (the CHECK forbids
//! less) and the row is counted as clamped ([`restate`] is the whole rule).
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

use crate::checkout::Checkout;
use crate::checkout::stock::{self, Tx};
use crate::clock::Clock;
use crate::domain::{ProductId, ProductName};
use crate::metrics::Metrics;
use crate::routing::Db;
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Import options shared by the CLI and the admin endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub lag_budget: Duration,
    pub batch_size: usize,
    pub skip_invalid: bool,
    pub wait_for_down: bool,
}

/// One valid CSV row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub product_id: ProductId,
    pub name: String,
    pub price_cents: i32,
    /// The count the file states for the product (the CSV's `available_quantity`).
    pub available_quantity: i32,
}

/// A line that could not be imported.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct BadLine {
    pub line: u64,
    pub reason: String,
}

/// The most a single line may be (a 10 MB line is refused, not buffered into a batch).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Parses and validates a whole CSV. Returns the valid rows and every bad line; an error
/// that makes the file unreadable as a whole (no header, missing columns) is `Err`.
pub fn parse_csv(input: impl std::io::Read) -> Result<(Vec<Row>, Vec<BadLine>), String> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_reader(input);
    let headers = reader
        .byte_headers()
        .map_err(|e| format!("cannot read the header line: {e}"))?
        .clone();
    let column = |name: &str| {
        headers
            .iter()
            .position(|h| h.trim_ascii() == name.as_bytes())
    };
    let cols = ["product_id", "name", "price_cents", "available_quantity"].map(|c| (c, column(c)));
    let missing: Vec<&str> = cols
        .iter()
        .filter(|(_, i)| i.is_none())
        .map(|(c, _)| *c)
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "line 1: the header is missing {} (expected product_id,name,price_cents,available_quantity)",
            missing.join(", ")
        ));
    }
    let idx: Vec<usize> = cols.iter().filter_map(|(_, i)| *i).collect();
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    let mut seen: HashSet<ProductId> = HashSet::new();
    let mut record = csv::ByteRecord::new();
    loop {
        let line = reader.position().line();
        match reader.read_byte_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                // A broken record (e.g. an unterminated quote) ends the readable part of the file.
                bad.push(BadLine {
                    line: e.position().map(|p| p.line()).unwrap_or(line),
                    reason: format!("unreadable CSV: {e}"),
                });
                break;
            }
        }
        let line = record.position().map(|p| p.line()).unwrap_or(line);
        match parse_row(&record, &idx) {
            Ok(row) if !seen.insert(row.product_id.clone()) => bad.push(BadLine {
                line,
                reason: format!(
                    "duplicate product_id {} (already on an earlier line)",
                    row.product_id
                ),
            }),
            Ok(row) => rows.push(row),
            Err(reason) => bad.push(BadLine { line, reason }),
        }
    }
    Ok((rows, bad))
}

fn parse_row(record: &csv::ByteRecord, idx: &[usize]) -> Result<Row, String> {
    if record.as_slice().len() > MAX_LINE_BYTES {
        return Err(format!(
            "line is {} bytes, over the {MAX_LINE_BYTES}-byte limit",
            record.as_slice().len()
        ));
    }
    let field = |k: usize, name: &str| -> Result<&str, String> {
        let raw = record
            .get(idx[k])
            .ok_or_else(|| format!("missing {name}"))?;
        std::str::from_utf8(raw)
            .map(str::trim)
            .map_err(|_| format!("{name} is not valid UTF-8"))
    };
    let number = |k: usize, name: &str| -> Result<i32, String> {
        let v = field(k, name)?;
        match v.parse::<i64>() {
            Ok(n) if (0..=i32::MAX as i64).contains(&n) => Ok(n as i32),
            Ok(n) => Err(format!("{name} {n} is out of range (0..2147483647)")),
            Err(_) => Err(format!("{name} {v:?} is not a whole number")),
        }
    };
    let id = ProductId::parse(field(0, "product_id")?).map_err(|e| e.message)?;
    let name = ProductName::parse(field(1, "name")?).map_err(|e| e.message)?;
    Ok(Row {
        product_id: id,
        name: name.as_str().to_string(),
        price_cents: number(2, "price_cents")?,
        available_quantity: number(3, "available_quantity")?,
    })
}

/// Live progress, shared with whoever reports it (a progress bar, log lines, the endpoint).
#[derive(Debug, Clone, Serialize, Default, utoipa::ToSchema)]
pub struct Progress {
    pub status: Status,
    pub rows_total: u64,
    /// Rows applied so far (created, changed or found unchanged).
    pub rows_done: u64,
    /// Products new to stockgate: they start with the file's count.
    pub rows_created: u64,
    /// Existing products whose stated count, name or price differed: stock moved by the
    /// change in the stated count.
    pub rows_changed: u64,
    /// Existing products already as the file states them: nothing written.
    pub rows_unchanged: u64,
    /// Changed rows whose lowered count was below what had been sold since: stock stopped
    /// at 0 instead of going negative.
    pub rows_clamped: u64,
    /// The first 100 clamped products.
    #[schema(value_type = Vec<String>)]
    pub clamped_products: Vec<ProductId>,
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

/// What a stated count does to a product that exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restated {
    pub available: i32,
    /// More was sold than the lowered count leaves: the stock stopped at 0.
    pub clamped: bool,
}

/// A stated count that would take a product's stock past what the column holds.
#[derive(Debug, thiserror::Error)]
#[error(
    "product {product}: stock would exceed 2147483647 ({available} + {file} stated − {stated} stated before)"
)]
pub struct StockLimit {
    pub product: ProductId,
    pub available: i32,
    pub stated: i32,
    pub file: i32,
}

/// The import rule. A product holding `available` units, last given `stated`, is now stated
/// at `file`: it keeps what happened since (`available − stated`: sales, cancels, restocks)
/// on top of the new count, and never goes below 0.
pub fn restate(available: i32, stated: i32, file: i32) -> Option<Restated> {
    let wanted = i64::from(available) + i64::from(file) - i64::from(stated);
    let available = i32::try_from(wanted.max(0)).ok()?;
    Some(Restated {
        available,
        clamped: wanted < 0,
    })
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

const MIN_BATCH: usize = 50;
const MAX_BATCH: usize = 20_000;
const CLAMPED_LISTED: usize = 100;
/// How long one wait for the replicas lasts before they are read again.
const WAIT_TICK: Duration = Duration::from_millis(50);

/// Writes `rows` in throttled batches. Stops between batches when `stop` is set. The final
/// state is the caller's to record ([`finish`]), with its own clock.
pub async fn run_engine(
    db: &Db,
    metrics: &Metrics,
    announce: Announce<'_>,
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
        let applied = apply_batch(db, metrics, announce, &rows[done..end]).await?;
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
    rows: &[Row],
) -> anyhow::Result<Applied> {
    let t = Instant::now();
    let applied = write_batch(db, rows).await?;
    announce_raised(announce, &applied.raised).await;
    metrics.import_rows.inc_by(rows.len() as u64);
    let rate = rows.len() as f64 / t.elapsed().as_secs_f64().max(1e-6);
    metrics.import_rate.set(rate);
    Ok(applied)
}

/// The batch size, under AIMD: it grows additively while replicas keep well inside the
/// budget and halves when they near it or the import has to wait for them.
struct Throttle {
    batch: usize,
    floor: usize,
    budget: Duration,
}

impl Throttle {
    fn new(opts: &Options) -> Throttle {
        let floor = MIN_BATCH.min(opts.batch_size.max(1));
        Throttle {
            batch: opts.batch_size.clamp(floor, MAX_BATCH),
            floor,
            budget: opts.lag_budget,
        }
    }

    fn halve(&mut self) {
        self.batch = (self.batch / 2).max(self.floor);
    }

    fn grow(&mut self) {
        self.batch = (self.batch + 250).min(MAX_BATCH);
    }

    /// After a batch, from the worst serving staleness (`None`: no replica serving).
    fn adapt(&mut self, worst: Option<Duration>) {
        match worst {
            Some(d) if d > self.budget / 2 => self.halve(),
            Some(d) if d < self.budget / 4 => self.grow(),
            None => self.grow(),
            _ => {}
        }
    }
}

/// The replicas as the import sees them before a batch.
struct Replicas {
    worst_ms: Option<u64>,
    down: Vec<String>,
    /// Why the batch must wait: the worst serving replica is over budget, or (with
    /// `--wait-for-down`) one is down. `None`: go.
    waiting: Option<String>,
}

impl Replicas {
    fn read(db: &Db, opts: &Options) -> Replicas {
        let (worst, down) = db.worst_serving_staleness();
        let waiting = match (&worst, down.first()) {
            (Some((name, d)), _) if *d > opts.lag_budget => Some(format!(
                "{name} at {:.1} s > {} budget",
                d.as_secs_f64(),
                fmt_budget(opts.lag_budget)
            )),
            (_, Some(name)) if opts.wait_for_down => Some(format!("{name} is down")),
            _ => None,
        };
        Replicas {
            worst_ms: worst.map(|(_, d)| millis(d)),
            down,
            waiting,
        }
    }
}

impl Progress {
    /// Before a batch: what the replicas allow, and whether the job runs, waits or stops.
    fn saw_replicas(
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
    fn add_batch(
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

fn millis(d: Duration) -> u64 {
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

fn fmt_budget(d: Duration) -> String {
    if d.as_millis().is_multiple_of(1000) {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// What one batch did.
#[derive(Debug, Default)]
struct Applied {
    created: u64,
    changed: u64,
    unchanged: u64,
    clamped: Vec<ProductId>,
    /// Existing products whose stock went up: the gate must hear of them.
    raised: Vec<ProductId>,
}

/// One batch, one transaction: create the new products, then restate the existing ones
/// whose stated count, name or price differ. Unchanged rows are neither written nor
/// locked, so a re-run of the same file writes (and replicates) nothing.
async fn write_batch(db: &Db, rows: &[Row]) -> anyhow::Result<Applied> {
    // Every writer that locks many products takes them in product_id order, so two imports
    // (or an import and a cart) cannot deadlock on each other.
    let mut rows: Vec<&Row> = rows.iter().collect();
    rows.sort_unstable_by(|a, b| a.product_id.as_str().cmp(b.product_id.as_str()));
    let mut tx = db.primary().begin().await?;
    let created = insert_new(&mut tx, &rows).await?;
    let existing: Vec<&Row> = rows
        .into_iter()
        .filter(|r| !created.contains(r.product_id.as_str()))
        .collect();
    let differing = lock_differing(&mut tx, &existing).await?;
    let by_id: HashMap<&str, &Row> = existing
        .iter()
        .map(|r| (r.product_id.as_str(), *r))
        .collect();
    let mut applied = Applied {
        created: created.len() as u64,
        changed: differing.len() as u64,
        unchanged: (existing.len() - differing.len()) as u64,
        ..Applied::default()
    };
    let mut updates = Vec::with_capacity(differing.len());
    for (id, available, stated) in differing {
        let Some(&row) = by_id.get(id.as_str()) else {
            continue;
        };
        let file = row.available_quantity;
        let restated = restate(available, stated, file).ok_or_else(|| StockLimit {
            product: row.product_id.clone(),
            available,
            stated,
            file,
        })?;
        if restated.clamped {
            applied.clamped.push(row.product_id.clone());
        }
        if restated.available > available {
            applied.raised.push(row.product_id.clone());
        }
        updates.push((row, restated.available));
    }
    update_restated(&mut tx, &updates).await?;
    tx.commit().await?;
    Ok(applied)
}

/// Inserts the rows whose product does not exist yet (stock and stated count: the file's)
/// and returns their ids. Existing products are left to [`lock_differing`].
async fn insert_new(tx: &mut Tx, rows: &[&Row]) -> sqlx::Result<HashSet<String>> {
    let (ids, names, prices, counts) = columns(rows.iter().map(|r| (*r, r.available_quantity)));
    Ok(stock::create_many(tx, &ids, &names, &prices, &counts)
        .await?
        .into_iter()
        .collect())
}

/// Locks the existing products whose stated count, name or price differ from the file
/// ([`stock::lock_differing`]): `(product_id, available_quantity, stated_quantity)` under
/// the lock.
async fn lock_differing(tx: &mut Tx, rows: &[&Row]) -> sqlx::Result<Vec<(String, i32, i32)>> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, names, prices, stated) = columns(rows.iter().map(|r| (*r, r.available_quantity)));
    stock::lock_differing(tx, &ids, &names, &prices, &stated).await
}

/// Writes the restated rows: name, price, the new stock, and the file's count as the
/// stated one.
async fn update_restated(tx: &mut Tx, updates: &[(&Row, i32)]) -> sqlx::Result<()> {
    if updates.is_empty() {
        return Ok(());
    }
    let (ids, names, prices, stock) = columns(updates.iter().copied());
    let stated: Vec<i32> = updates.iter().map(|(r, _)| r.available_quantity).collect();
    stock::restate(tx, &ids, &names, &prices, &stock, &stated).await
}

/// The id, name and price columns of `rows`, and a count for each.
fn columns<'a>(
    rows: impl Iterator<Item = (&'a Row, i32)>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<i32>, Vec<i32>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (r, n) in rows {
        out.0.push(r.product_id.as_str());
        out.1.push(r.name.as_str());
        out.2.push(r.price_cents);
        out.3.push(n);
    }
    out
}

/// The clock's now as a UTC instant (through the time base, so a test clock moves it).
pub fn clock_now(clock: &dyn Clock) -> DateTime<Utc> {
    static BASE: std::sync::OnceLock<crate::clock::TimeBase> = std::sync::OnceLock::new();
    BASE.get_or_init(crate::clock::TimeBase::now)
        .wall(clock.now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &[u8]) -> (Vec<Row>, Vec<BadLine>) {
        parse_csv(text).expect("readable file")
    }

    #[test]
    fn a_good_file_parses_in_any_column_order() {
        let (rows, bad) = parse(b"name,product_id,available_quantity,price_cents\nMug,mug-1,5,1299\n\"Tee, black\",tee,0,2499\n");
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            rows[1],
            Row {
                product_id: ProductId::parse("tee").expect("valid id"),
                name: "Tee, black".into(),
                price_cents: 2499,
                available_quantity: 0
            }
        );
    }

    #[test]
    fn bad_lines_are_reported_with_their_line_numbers() {
        let mut text = b"product_id,name,price_cents,available_quantity\nok,Fine,1,1\nneg,Negative,1,-5\nnum,Bad number,abc,1\nok,Again,1,1\nbad id!,Name,1,1\n".to_vec();
        text.extend_from_slice(b"latin,\xe9t\xe9,1,1\n");
        text.extend_from_slice(format!("huge,{},1,1\n", "x".repeat(10 * 1024 * 1024)).as_bytes());
        let (rows, bad) = parse(&text);
        assert_eq!(rows.len(), 1);
        let lines: Vec<u64> = bad.iter().map(|b| b.line).collect();
        assert_eq!(lines, vec![3, 4, 5, 6, 7, 8], "{bad:?}");
        assert!(bad[0].reason.contains("out of range"), "{}", bad[0].reason);
        assert!(bad[1].reason.contains("not a whole number"));
        assert!(bad[2].reason.contains("duplicate"));
        assert!(bad[4].reason.contains("UTF-8"));
        assert!(bad[5].reason.contains("limit"));
    }

    #[test]
    fn a_re_run_of_the_same_count_keeps_every_sale() {
        // Imported 10, sold 3: the same file states 10 again.
        assert_eq!(
            restate(7, 10, 10),
            Some(Restated {
                available: 7,
                clamped: false
            })
        );
    }

    #[test]
    fn a_recount_moves_stock_by_the_difference_and_keeps_restocks() {
        // Stated 10, sold 3, restocked 4 (11 on hand); the recount says 15: +5 on top.
        assert_eq!(restate(11, 10, 15).map(|r| r.available), Some(16));
        // Lowered from 10 to 8 with 3 sold: 5 left.
        assert_eq!(restate(7, 10, 8).map(|r| r.available), Some(5));
    }

    #[test]
    fn a_count_lowered_below_what_was_sold_stops_at_zero_and_says_so() {
        // Stated 10, sold 8 (2 left); the file now says 5: 2 - 5 would be -3.
        assert_eq!(
            restate(2, 10, 5),
            Some(Restated {
                available: 0,
                clamped: true
            })
        );
        // Exactly zero is not a clamp.
        assert_eq!(restate(2, 10, 8).map(|r| r.clamped), Some(false));
    }

    #[test]
    fn a_count_past_the_column_is_refused_not_wrapped() {
        assert_eq!(restate(i32::MAX - 1, 0, 2), None);
        assert_eq!(
            restate(i32::MAX, i32::MAX, i32::MAX).map(|r| r.available),
            Some(i32::MAX)
        );
    }

    #[test]
    fn batches_halve_near_the_budget_and_grow_well_inside_it() {
        let mut throttle = Throttle::new(&Options {
            lag_budget: Duration::from_secs(4),
            batch_size: 1000,
            skip_invalid: false,
            wait_for_down: false,
        });
        throttle.adapt(Some(Duration::from_secs(3)));
        assert_eq!(throttle.batch, 500, "over half the budget");
        throttle.adapt(Some(Duration::from_millis(1500)));
        assert_eq!(throttle.batch, 500, "between a quarter and a half: kept");
        throttle.adapt(Some(Duration::from_millis(500)));
        assert_eq!(throttle.batch, 750, "under a quarter");
        throttle.adapt(None);
        assert_eq!(throttle.batch, 1000, "no replica serving");
        for _ in 0..10 {
            throttle.halve();
        }
        assert_eq!(throttle.batch, MIN_BATCH, "never below the floor");
    }

    #[test]
    fn a_missing_column_refuses_the_whole_file() {
        let err =
            parse_csv(&b"product_id,name,price_cents\nx,y,1\n"[..]).expect_err("missing column");
        assert!(
            err.contains("line 1") && err.contains("available_quantity"),
            "{err}"
        );
    }
}
