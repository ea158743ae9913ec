//! Bulk import of products from CSV, throttled against live replica staleness.
//!
//! The CSV has a header `product_id,name,price_cents,available_quantity` (any column order)
//! and one product per line; each line upserts that product (a re-run of the same file
//! rewrites nothing). The whole file is validated first: every bad line is reported with its
//! line number, and unless `--skip-invalid` is given nothing is written. Rows are then
//! written in batches, one transaction each (a crash or Ctrl-C never leaves half a batch).
//!
//! Before every batch the engine reads the worst staleness of the replicas that are serving
//! (not `down`) from the same freshness monitor the router uses. Over the budget it waits;
//! batch sizes grow additively while replicas keep up and halve when they fall behind
//! (AIMD). A `down` replica does not hold the import hostage unless `--wait-for-down`.

use crate::clock::SystemClock;
use crate::config::Config;
use crate::domain::{ProductId, ProductName};
use crate::metrics::Metrics;
use crate::routing::Db;
use clap::Args;
use serde::Serialize;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
#[command(
    after_help = "CSV format: a header line naming the columns product_id,name,price_cents,available_quantity \
(any order), then one product per line, e.g.\n  product_id,name,price_cents,available_quantity\n  mug-1,Classic mug,1299,500\n\
product_id: 1-64 of [A-Za-z0-9_.-]; price_cents and available_quantity: whole numbers 0..2147483647.\n\
Existing products are updated (name, price, stock); re-running the same file is harmless."
)]
pub struct ImportArgs {
    /// The CSV file to import.
    #[arg(long)]
    pub file: PathBuf,
    /// Keep the worst serving replica's staleness under this (e.g. 5s, 500ms).
    #[arg(long, default_value = "5s", value_parser = crate::cli::parse_duration)]
    pub lag_budget: Duration,
    /// Rows per transaction to start with (adapted as the import runs).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub batch_size: u32,
    /// Skip invalid lines (they are reported) instead of refusing the whole file.
    #[arg(long)]
    pub skip_invalid: bool,
    /// Also wait while a replica is down (default: report it and carry on).
    #[arg(long)]
    pub wait_for_down: bool,
}

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
    pub product_id: String,
    pub name: String,
    pub price_cents: i32,
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
    let mut seen = HashSet::new();
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
        product_id: id.to_string(),
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
    pub rows_done: u64,
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
}

#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Running,
    Waiting,
    Done,
    Interrupted,
    Failed,
}

pub type SharedProgress = Arc<Mutex<Progress>>;

fn update(p: &SharedProgress, f: impl FnOnce(&mut Progress)) {
    f(&mut p.lock().unwrap_or_else(|e| e.into_inner()));
}

const MIN_BATCH: usize = 50;
const MAX_BATCH: usize = 20_000;

/// Writes `rows` in throttled batches. Stops between batches when `stop` is set.
pub async fn run_engine(
    db: &Db,
    metrics: &Metrics,
    rows: &[Row],
    opts: Options,
    progress: &SharedProgress,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let budget = opts.lag_budget;
    let floor = MIN_BATCH.min(opts.batch_size.max(1));
    let mut batch = opts.batch_size.clamp(floor, MAX_BATCH);
    let mut done = 0usize;
    let mut paused = Duration::ZERO;
    update(progress, |p| {
        p.rows_total = rows.len() as u64;
        p.lag_budget_ms = budget.as_millis() as u64;
    });
    while done < rows.len() {
        if stop.load(Ordering::Relaxed) {
            update(progress, |p| p.status = Status::Interrupted);
            return Ok(());
        }
        // Wait while the worst serving replica is over budget (or, if asked, one is down).
        let (worst, down) = db.worst_serving_staleness();
        let worst_ms = worst
            .as_ref()
            .map(|(_, d)| d.as_millis().min(u64::MAX as u128) as u64);
        let waiting = match (&worst, down.first()) {
            (Some((name, d)), _) if *d > budget => Some(format!(
                "{name} at {:.1} s > {} budget",
                d.as_secs_f64(),
                fmt_budget(budget)
            )),
            (_, Some(name)) if opts.wait_for_down => Some(format!("{name} is down")),
            _ => None,
        };
        update(progress, |p| {
            p.worst_staleness_ms = worst_ms;
            p.max_staleness_seen_ms = p.max_staleness_seen_ms.max(worst_ms.unwrap_or(0));
            p.down_replicas = down.clone();
            p.status = if waiting.is_some() {
                Status::Waiting
            } else {
                Status::Running
            };
            p.waiting = waiting.clone();
            p.paused_ms = paused.as_millis() as u64;
            p.elapsed_ms = start.elapsed().as_millis() as u64;
        });
        if waiting.is_some() {
            let tick = Duration::from_millis(50);
            tokio::time::sleep(tick).await;
            paused += tick;
            metrics.import_paused_seconds.inc_by(tick.as_secs_f64());
            // Falling behind: the next batches start smaller.
            batch = (batch / 2).max(floor);
            continue;
        }
        let end = (done + batch).min(rows.len());
        let t = Instant::now();
        write_batch(db, &rows[done..end]).await?;
        let written = end - done;
        done = end;
        metrics.import_rows.inc_by(written as u64);
        let rate = written as f64 / t.elapsed().as_secs_f64().max(1e-6);
        metrics.import_rate.set(rate);
        // AIMD: grow while replicas keep well inside the budget, halve when they near it.
        let (worst, _) = db.worst_serving_staleness();
        let worst = worst.map(|(_, d)| d);
        let worst_ms = worst
            .map(|d| d.as_millis().min(u64::MAX as u128) as u64)
            .unwrap_or(0);
        match worst {
            Some(d) if d > budget / 2 => batch = (batch / 2).max(floor),
            Some(d) if d < budget / 4 => batch = (batch + 250).min(MAX_BATCH),
            None => batch = (batch + 250).min(MAX_BATCH),
            _ => {}
        }
        let elapsed = start.elapsed();
        update(progress, |p| {
            p.rows_done = done as u64;
            p.max_staleness_seen_ms = p.max_staleness_seen_ms.max(worst_ms);
            p.batch_size = batch;
            p.rows_per_second = done as f64 / elapsed.as_secs_f64().max(1e-6);
            p.elapsed_ms = elapsed.as_millis() as u64;
        });
    }
    update(progress, |p| {
        p.status = Status::Done;
        p.waiting = None;
        p.paused_ms = paused.as_millis() as u64;
    });
    metrics.import_rate.set(0.0);
    Ok(())
}

fn fmt_budget(d: Duration) -> String {
    if d.as_millis().is_multiple_of(1000) {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// One batch, one transaction. Unchanged rows are not rewritten, so a re-run of the same
/// file writes (and replicates) nothing.
async fn write_batch(db: &Db, rows: &[Row]) -> anyhow::Result<()> {
    let ids: Vec<&str> = rows.iter().map(|r| r.product_id.as_str()).collect();
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    let prices: Vec<i32> = rows.iter().map(|r| r.price_cents).collect();
    let stock: Vec<i32> = rows.iter().map(|r| r.available_quantity).collect();
    let mut tx = db.primary().begin().await?;
    sqlx::query(
        "INSERT INTO products (product_id, name, price_cents, available_quantity) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[]) \
         ON CONFLICT (product_id) DO UPDATE SET name = EXCLUDED.name, price_cents = EXCLUDED.price_cents, \
           available_quantity = EXCLUDED.available_quantity, updated_at = clock_timestamp() \
         WHERE (products.name, products.price_cents, products.available_quantity) \
           IS DISTINCT FROM (EXCLUDED.name, EXCLUDED.price_cents, EXCLUDED.available_quantity)",
    )
    .bind(&ids)
    .bind(&names)
    .bind(&prices)
    .bind(&stock)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// `stockgate import`: validate, then write with a progress bar (or log lines without a
/// terminal); Ctrl-C stops after the current batch.
pub async fn run(config: &Config, args: ImportArgs) -> anyhow::Result<()> {
    config.require_database_url()?;
    let file = std::fs::File::open(&args.file)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", args.file.display()))?;
    let (rows, bad) = parse_csv(std::io::BufReader::new(file))
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.file.display()))?;
    for b in bad.iter().take(50) {
        eprintln!("{}:{}: {}", args.file.display(), b.line, b.reason);
    }
    if bad.len() > 50 {
        eprintln!("… and {} more bad lines", bad.len() - 50);
    }
    if !bad.is_empty() && !args.skip_invalid {
        anyhow::bail!(
            "{} invalid line(s); nothing was written (fix them, or pass --skip-invalid to import the rest)",
            bad.len()
        );
    }
    let (state, _monitor) = crate::startup::build_state(config, Arc::new(SystemClock))?;
    // Let the monitor take its first samples so the first batch is judged on real data.
    tokio::time::sleep(config.monitor_interval * 4 + Duration::from_millis(100)).await;
    let opts = Options {
        lag_budget: args.lag_budget,
        batch_size: args.batch_size as usize,
        skip_invalid: args.skip_invalid,
        wait_for_down: args.wait_for_down,
    };
    let progress: SharedProgress = Arc::default();
    update(&progress, |p| p.rows_skipped = bad.len() as u64);
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!(
                    "\ninterrupt: stopping after the current batch (each batch is one transaction)"
                );
                stop.store(true, Ordering::Relaxed);
            }
        });
    }
    let reporter = tokio::spawn(report_progress(progress.clone()));
    let result = run_engine(&state.db, &state.metrics, &rows, opts, &progress, &stop).await;
    reporter.abort();
    let _ = reporter.await;
    let p = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let summary = format!(
        "{} of {} rows written in {:.1} s ({:.0} rows/s); {} skipped; waited {:.1} s for replicas; worst replica staleness seen {} ms (budget {} ms){}",
        p.rows_done,
        p.rows_total,
        p.elapsed_ms as f64 / 1000.0,
        p.rows_per_second,
        p.rows_skipped,
        p.paused_ms as f64 / 1000.0,
        p.max_staleness_seen_ms,
        p.lag_budget_ms,
        if p.down_replicas.is_empty() {
            String::new()
        } else {
            format!("; down: {}", p.down_replicas.join(", "))
        }
    );
    result?;
    match p.status {
        Status::Interrupted => {
            anyhow::bail!("interrupted: {summary}. Re-running the same file is safe and continues.")
        }
        _ => {
            println!("{summary}");
            Ok(())
        }
    }
}

async fn report_progress(progress: SharedProgress) {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let bar = if terminal {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} rows  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    let mut last_log = Instant::now();
    loop {
        let p = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let msg = format!(
            "{:.0} rows/s  staleness {} / {} ms{}{}",
            p.rows_per_second,
            p.worst_staleness_ms
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            p.lag_budget_ms,
            p.waiting
                .as_ref()
                .map(|w| format!("  waiting: {w}"))
                .unwrap_or_default(),
            if p.down_replicas.is_empty() {
                String::new()
            } else {
                format!("  down: {}", p.down_replicas.join(", "))
            }
        );
        match &bar {
            Some(bar) => {
                bar.set_length(p.rows_total);
                bar.set_position(p.rows_done);
                bar.set_message(msg);
            }
            None if last_log.elapsed() >= Duration::from_secs(2) => {
                eprintln!("import: {}/{} rows  {msg}", p.rows_done, p.rows_total);
                last_log = Instant::now();
            }
            None => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
                product_id: "tee".into(),
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
    fn a_missing_column_refuses_the_whole_file() {
        let err =
            parse_csv(&b"product_id,name,price_cents\nx,y,1\n"[..]).expect_err("missing column");
        assert!(
            err.contains("line 1") && err.contains("available_quantity"),
            "{err}"
        );
    }
}
