//! The timed-loop runner behind hot-sku and availability: C workers calling back-to-back
//! for N seconds (or until the safety stop), each keeping its own tally.

use super::{Ctx, progress};
use crate::report::TimedMeta;
use crate::samples::Allocation;
use crate::stats::Tally;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How one call ended, as far as the tally cares.
pub enum Hit {
    /// An order of `product_id` confirmed for this many units, taken from these locations.
    Confirmed {
        product_id: Arc<str>,
        units: u32,
        allocations: Vec<Allocation>,
    },
    OutOfStock,
    /// A 200 availability answer.
    Answer {
        served_by: String,
        stale_by_ms: u64,
    },
    Failed(String),
}

/// What a timed run is asked to do.
pub struct TimedSpec {
    pub product_id: String,
    pub seconds: u64,
    pub concurrency: u32,
    /// The `qty` every call names (for the report).
    pub qty: u32,
    /// Answers staler than this count as over the limit.
    pub stale_limit_ms: u64,
}

/// Counters the workers share with the progress bar.
#[derive(Default)]
struct Live {
    ok: AtomicU64,
    bad: AtomicU64,
    /// Start → the latest answer so far, µs.
    last_us: AtomicU64,
}

/// Runs `call(worker, i)` back-to-back on `spec.concurrency` workers for `spec.seconds`.
pub async fn run<F, Fut>(ctx: &Ctx, spec: TimedSpec, call: F) -> Result<(TimedMeta, Tally)>
where
    F: Fn(u32, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Hit> + Send,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let wanted_end = start + Duration::from_secs(spec.seconds);
    let end = wanted_end.min(ctx.deadline);
    let live = Arc::new(Live::default());
    let pb = progress(spec.seconds, "{spinner} [{bar:40}] {pos}/{len} s  {msg}");
    let ticker = tick(pb.clone(), live.clone(), start, end);

    let mut workers = tokio::task::JoinSet::new();
    for w in 0..spec.concurrency {
        let (call, live, limit) = (call.clone(), live.clone(), spec.stale_limit_ms);
        workers.spawn(async move { worker(w, &*call, &live, start, end, limit).await });
    }
    let mut tally = Tally::default();
    while let Some(t) = workers.join_next().await {
        tally.merge(t.context("a worker task panicked")?);
    }
    ticker.abort();
    pb.finish_and_clear();
    let meta = TimedMeta {
        base_url: ctx.api.base_url().to_string(),
        product_id: spec.product_id,
        seconds: spec.seconds,
        concurrency: spec.concurrency,
        qty: spec.qty,
        elapsed_us: live.last_us.load(Ordering::Relaxed),
        stopped_by_max_seconds: ctx.deadline < wanted_end,
    };
    Ok((meta, tally))
}

/// Redraws the progress bar every 200 ms until `end`.
fn tick(pb: ProgressBar, live: Arc<Live>, start: Instant, end: Instant) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(200));
        while Instant::now() < end {
            every.tick().await;
            pb.set_position(start.elapsed().as_secs());
            pb.set_message(format!(
                "{} ok, {} not ok",
                live.ok.load(Ordering::Relaxed),
                live.bad.load(Ordering::Relaxed)
            ));
        }
    })
}

/// One worker: calls back-to-back until `end`, tallying every answer.
async fn worker<F, Fut>(
    w: u32,
    call: &F,
    live: &Live,
    start: Instant,
    end: Instant,
    stale_limit_ms: u64,
) -> Tally
where
    F: Fn(u32, u64) -> Fut,
    Fut: Future<Output = Hit>,
{
    let mut t = Tally::default();
    let mut i = 0u64;
    while Instant::now() < end {
        let sent = Instant::now();
        let hit = call(w, i).await;
        let recv = Instant::now();
        i += 1;
        t.record_latency(micros(recv - sent));
        let failed = matches!(hit, Hit::Failed(_));
        let counter = if record(&mut t, hit, stale_limit_ms) {
            &live.ok
        } else {
            &live.bad
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if failed {
            // Do not spin on a refusing server; the error is counted.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        live.last_us
            .fetch_max(micros(recv - start), Ordering::Relaxed);
    }
    t
}

/// Counts one call in the tally; `true` when it succeeded.
fn record(t: &mut Tally, hit: Hit, stale_limit_ms: u64) -> bool {
    match hit {
        Hit::Confirmed {
            product_id,
            units,
            allocations,
        } => {
            t.ok += 1;
            t.units += u64::from(units);
            t.allocated.add(&product_id, &allocations);
            true
        }
        Hit::Answer {
            served_by,
            stale_by_ms,
        } => {
            t.ok += 1;
            t.answer(&served_by, stale_by_ms, stale_limit_ms);
            true
        }
        Hit::OutOfStock => {
            t.out_of_stock += 1;
            false
        }
        Hit::Failed(label) => {
            t.error(label);
            false
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
