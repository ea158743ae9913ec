//! `stockgate import`: the command-line half of the bulk import — read and validate the
//! file, show progress on the terminal, stop on Ctrl-C after the current batch. The engine
//! itself ([`crate::import`]) is shared with the admin endpoint.

use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::import::{
    Announce, BadLine, Ended, Options, Progress, Row, SharedProgress, clock_now, finish, parse_csv,
    request_stop, run_engine, set_aside_unknown_locations, update,
};
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};
use uuid::Uuid;

#[derive(Args, Debug, Clone)]
#[command(
    after_help = "CSV format: a header line naming the columns product_id,name,price_cents,available_quantity \
and optionally location_id (any order), then one product per line, or one per (product, location), e.g.\n  \
product_id,name,price_cents,available_quantity,location_id\n  mug-1,Classic mug,1299,500,eu-1\n  mug-1,Classic mug,1299,20,default\n\
product_id and location_id: 1-64 of [A-Za-z0-9_.-] (no location_id, or an empty one: default; the location must exist, \
each (product, location) once, a product's lines with the same name and price); price_cents and available_quantity: \
whole numbers 0..2147483647.\n\
available_quantity states the product's count at the location: a new product starts with it there; an existing \
one's stock there moves by the change since the count that location was last given (units sold, restocked or \
transferred since are kept; it stops at 0, and the summary counts such rows as clamped), and its name and price \
are updated. Re-running the same file changes nothing, also after Ctrl-C. The import's id, printed first, is \
the ref of every movement it writes."
)]
pub struct ImportArgs {
    /// The CSV file to import.
    #[arg(long)]
    pub file: PathBuf,
    /// Keep the worst serving replica's staleness under this (e.g. 5s, 500ms).
    #[arg(long, default_value = "5s", value_parser = crate::config::parse_duration)]
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

/// `stockgate import`: validate, then write with a progress bar (or log lines without a
/// terminal); Ctrl-C stops after the current batch.
pub async fn run(config: &Config, args: ImportArgs) -> anyhow::Result<()> {
    config.require_database_url()?;
    let (rows, bad) = read_rows(&args)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let metrics = crate::metrics::Metrics::new();
    let (db, _monitor) = crate::startup::build_db(config, clock.clone(), &metrics).await?;
    let (rows, skipped) = check_locations(&db, &args, rows, bad).await?;
    // The import's id: every movement it writes names it as its `ref`.
    let id = Uuid::new_v4();
    println!(
        "import {id}: {} rows from {}",
        rows.len(),
        args.file.display()
    );
    // Let the monitor take its first samples so the first batch is judged on real data.
    tokio::time::sleep(config.monitor_interval * 4 + Duration::from_millis(100)).await;
    let progress: SharedProgress = Arc::default();
    update(&progress, |p| p.rows_skipped = skipped as u64);
    let stop = Arc::new(AtomicBool::new(false));
    stop_on_ctrl_c(progress.clone(), stop.clone());
    let reporter = tokio::spawn(report_progress(progress.clone()));
    // Another process: the servers' gates see risen stock when their cached answers expire.
    let result = run_engine(
        &db,
        &metrics,
        Announce::Nobody,
        id,
        &rows,
        args.options(),
        &progress,
        &stop,
    )
    .await;
    finish(&progress, &result, clock_now(&*clock));
    reporter.abort();
    let _ = reporter.await;
    let summary = summary(&progress.lock().unwrap_or_else(|e| e.into_inner()));
    match result? {
        Ended::Cancelled => {
            anyhow::bail!("interrupted: {summary}. Re-running the same file is safe and continues.")
        }
        Ended::Done => {
            println!("{summary}");
            Ok(())
        }
    }
}

impl ImportArgs {
    fn options(&self) -> Options {
        Options {
            lag_budget: self.lag_budget,
            batch_size: self.batch_size as usize,
            skip_invalid: self.skip_invalid,
            wait_for_down: self.wait_for_down,
        }
    }
}

/// Reads and validates the whole file: the valid rows and the bad lines. A file that cannot
/// be read as a whole is refused here, before connecting.
fn read_rows(args: &ImportArgs) -> anyhow::Result<(Vec<Row>, Vec<BadLine>)> {
    let path = args.file.display();
    let file =
        std::fs::File::open(&args.file).map_err(|e| anyhow::anyhow!("cannot open {path}: {e}"))?;
    parse_csv(std::io::BufReader::new(file)).map_err(|e| anyhow::anyhow!("{path}: {e}"))
}

/// Sets aside the rows at locations that do not exist, then reports every bad line on
/// stderr (the first 50); any refuses the file unless `--skip-invalid`. Nothing has been
/// written yet. The rows left, and how many lines were skipped.
async fn check_locations(
    db: &crate::routing::Db,
    args: &ImportArgs,
    rows: Vec<Row>,
    mut bad: Vec<BadLine>,
) -> anyhow::Result<(Vec<Row>, usize)> {
    let rows = set_aside_unknown_locations(db, rows, &mut bad).await?;
    let path = args.file.display();
    for b in bad.iter().take(50) {
        eprintln!("{path}:{}: {}", b.line, b.reason);
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
    Ok((rows, bad.len()))
}

/// On Ctrl-C, asks the engine to stop after the batch in flight.
fn stop_on_ctrl_c(progress: SharedProgress, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!(
                "\ninterrupt: stopping after the current batch (each batch is one transaction)"
            );
            request_stop(&progress, &stop);
        }
    });
}

/// The CLI's last line (`bench/import.sh` reads rows/s, "waited" and "staleness seen").
fn summary(p: &Progress) -> String {
    let clamped = match p.rows_clamped {
        0 => String::new(),
        n => format!(
            "; {n} clamped at 0 (more sold than the lowered count): {}{}",
            p.clamped_products.join(", "),
            if n as usize > p.clamped_products.len() {
                ", …"
            } else {
                ""
            }
        ),
    };
    format!(
        "{} of {} rows applied in {:.1} s ({:.0} rows/s): {} new, {} changed, {} unchanged{clamped}; {} skipped; waited {:.1} s for replicas; worst replica staleness seen {} ms (budget {} ms){}",
        p.rows_done,
        p.rows_total,
        p.elapsed_ms as f64 / 1000.0,
        p.rows_per_second,
        p.rows_created,
        p.rows_changed,
        p.rows_unchanged,
        p.rows_skipped,
        p.paused_ms as f64 / 1000.0,
        p.max_staleness_seen_ms,
        p.lag_budget_ms,
        if p.down_replicas.is_empty() {
            String::new()
        } else {
            format!("; down: {}", p.down_replicas.join(", "))
        }
    )
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
