//! The load modes and what they share: the run context, fresh product ids, connection
//! warm-up, progress bars and report output.

pub mod availability;
pub mod checkout;
pub mod flash_sale;
pub mod hot_sku;
pub mod sale;
pub mod sell_out;
pub mod timed;

use crate::client::Api;
use crate::locations::FIRST_RANK;
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

/// What every mode gets from the command line.
pub struct Ctx {
    pub api: Arc<Api>,
    /// The --max-seconds safety stop: no request starts after it, none outlives it.
    pub deadline: Instant,
    pub warmup: bool,
}

/// Creates `n` locations for this run (`crate::locations` says how they are named and
/// ranked) and returns their ids in rank order; none for `n` ≤ 1 (everything stays at
/// `default`).
pub async fn create_locations(api: &Api, n: u32) -> Result<Vec<String>> {
    if n <= 1 {
        return Ok(Vec::new());
    }
    let base = fresh_id("loc");
    let mut ids = Vec::with_capacity(n as usize);
    for i in 0..n {
        let id = format!("{base}-{i}");
        api.create_location(&id, FIRST_RANK + i).await?;
        ids.push(id);
    }
    Ok(ids)
}

/// `prefix-<UTC timestamp>-<6 hex>`: unique per run, within the service's id rule.
pub fn fresh_id(prefix: &str) -> String {
    let rand = uuid::Uuid::new_v4().simple().to_string();
    format!(
        "{prefix}-{}-{}",
        chrono::Utc::now().format("%Y%m%dT%H%M%S"),
        &rand[..6]
    )
}

/// A short random tag that keeps this run's Idempotency-Keys apart from every other run's.
pub fn run_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_string()
}

/// Opens up to `connections` pooled connections before the clock starts, so the run
/// measures the service rather than TCP handshakes (skipped with --no-warmup).
pub async fn warm_up(ctx: &Ctx, connections: usize) {
    if !ctx.warmup {
        return;
    }
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let api = ctx.api.clone();
        set.spawn(async move { api.touch().await });
    }
    while set.join_next().await.is_some() {}
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress(len: u64, template: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::new(len).with_style(style)
}
