//! `stockgate verify`: the command-line half of the ledger check ([`crate::checkout::ledger`],
//! shared with `GET /v1/admin/ledger`): one line per disagreement on stdout, then a summary
//! that says which node answered and as of when; a progress line on a terminal.

use crate::checkout::ledger::{self, Disagreement, Observer, Verdict};
use crate::clock::SystemClock;
use crate::config::Config;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a check found, for the exit code: 0 when everything agrees, 1 when something does not.
pub enum Found {
    Agreement,
    Disagreement,
}

/// `stockgate verify`. An `Err` means the check could not be made (exit 2).
pub async fn run(config: &Config) -> anyhow::Result<Found> {
    config.require_database_url()?;
    let (db, _monitor) = crate::startup::build_db(
        config,
        Arc::new(SystemClock),
        &crate::metrics::Metrics::new(),
    )
    .await?;
    // Let the monitor sample the replicas, so a fresh one can take the scan off the primary.
    tokio::time::sleep(config.monitor_interval * 4 + Duration::from_millis(100)).await;
    let mut out = Lines {
        stdout: std::io::BufWriter::new(std::io::stdout()),
        progress: std::io::stderr().is_terminal().then(|| Progress {
            total: None,
            last: Instant::now(),
        }),
        error: None,
    };
    let verdict = ledger::check(&db, &mut out).await;
    out.clear_progress();
    let verdict = verdict.map_err(|e| match e.sqlstate().as_deref() {
        // 42P01 undefined_table: a database from before the ledger (or none at all).
        Some("42P01") => anyhow::anyhow!(
            "the database has no stock ledger (movements): run `stockgate migrate` first ({e})"
        ),
        _ => anyhow::Error::new(e).context("could not read the stock ledger"),
    })?;
    if let Some(e) = out.error {
        return Err(anyhow::Error::new(e).context("could not write the report"));
    }
    writeln!(out.stdout, "{}", summary(&verdict))?;
    out.stdout.flush()?;
    Ok(match verdict.disagreeing {
        0 => Found::Agreement,
        _ => Found::Disagreement,
    })
}

/// The last line: `SUMMARY checked=… disagreeing=… served_by=… as_of=… stale_by_ms=…`.
pub fn summary(v: &Verdict) -> String {
    format!(
        "SUMMARY checked={} disagreeing={} served_by={} as_of={} stale_by_ms={}",
        v.checked,
        v.disagreeing,
        v.route.served_by(),
        v.route.as_of_rfc3339(),
        v.route.stale_by_ms()
    )
}

/// Disagreements to stdout as they stream; progress to stderr, rewritten in place, only on a
/// terminal (a pipe or a log gets no noise).
struct Lines<W: Write> {
    stdout: W,
    progress: Option<Progress>,
    /// The first failed write to stdout (a closed pipe): the report is incomplete, so the
    /// check cannot say it was made.
    error: Option<std::io::Error>,
}

struct Progress {
    total: Option<u64>,
    last: Instant,
}

impl<W: Write> Lines<W> {
    fn clear_progress(&mut self) {
        if self.progress.is_some() {
            eprint!("\r\x1b[K");
        }
    }
}

impl<W: Write> Observer for Lines<W> {
    fn wants_total(&self) -> bool {
        self.progress.is_some()
    }

    fn total(&mut self, levels: u64) {
        if let Some(p) = &mut self.progress {
            p.total = Some(levels);
        }
    }

    fn progress(&mut self, checked: u64) {
        let Some(p) = &mut self.progress else { return };
        if p.last.elapsed() < Duration::from_millis(100) {
            return;
        }
        p.last = Instant::now();
        let total = p.total.map(|t| format!(" / ~{t}")).unwrap_or_default();
        eprint!("\rverify: checked {checked}{total} (product, location) pairs\x1b[K");
    }

    fn disagreement(&mut self, d: Disagreement) {
        if self.error.is_none()
            && let Err(e) = writeln!(self.stdout, "{d}")
        {
            self.error = Some(e);
        }
    }
}
