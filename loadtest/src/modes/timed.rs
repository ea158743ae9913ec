//! The timed-loop runner behind hot-sku and availability: C workers calling back-to-back
//! for N seconds (or until the safety stop), each keeping its own tally.

use super::{Ctx, progress};
use crate::stats::Tally;
use anyhow::{Context, Result};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How one call ended, as far as the tally cares.
pub enum Hit {
    /// An order confirmed for this many units.
    Confirmed(u32),
    OutOfStock,
    /// A 200 availability answer.
    Answer {
        served_by: String,
        stale_by_ms: u64,
    },
    Failed(String),
}

pub struct Timed {
    pub tally: Tally,
    /// Start → last call answered.
    pub elapsed_us: u64,
    /// The run was cut short by --max-seconds.
    pub stopped_by_max_seconds: bool,
}

/// Runs `call(worker, i)` back-to-back on `concurrency` workers for `seconds`.
pub async fn run<F, Fut>(
    ctx: &Ctx,
    concurrency: u32,
    seconds: u64,
    stale_limit_ms: u64,
    call: F,
) -> Result<Timed>
where
    F: Fn(u32, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Hit> + Send,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let wanted_end = start + Duration::from_secs(seconds);
    let end = wanted_end.min(ctx.deadline);
    let ok = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let last_us = Arc::new(AtomicU64::new(0));

    let pb = progress(seconds, "{spinner} [{bar:40}] {pos}/{len} s  {msg}");
    let ticker = {
        let (pb, ok, bad) = (pb.clone(), ok.clone(), bad.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(200));
            while Instant::now() < end {
                every.tick().await;
                pb.set_position(start.elapsed().as_secs());
                pb.set_message(format!(
                    "{} ok, {} not ok",
                    ok.load(Ordering::Relaxed),
                    bad.load(Ordering::Relaxed)
                ));
            }
        })
    };

    let mut workers = tokio::task::JoinSet::new();
    for w in 0..concurrency {
        let (call, ok, bad, last_us) = (call.clone(), ok.clone(), bad.clone(), last_us.clone());
        workers.spawn(async move {
            let mut t = Tally::default();
            let mut i = 0u64;
            while Instant::now() < end {
                let sent = Instant::now();
                let hit = call(w, i).await;
                let recv = Instant::now();
                i += 1;
                t.record_latency(u64::try_from((recv - sent).as_micros()).unwrap_or(u64::MAX));
                match hit {
                    Hit::Confirmed(units) => {
                        t.ok += 1;
                        t.units += u64::from(units);
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Hit::Answer {
                        served_by,
                        stale_by_ms,
                    } => {
                        t.ok += 1;
                        t.answer(&served_by, stale_by_ms, stale_limit_ms);
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Hit::OutOfStock => {
                        t.out_of_stock += 1;
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    Hit::Failed(label) => {
                        t.error(label);
                        bad.fetch_add(1, Ordering::Relaxed);
                        // Do not spin on a refusing server; the error is counted.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                let at = u64::try_from((recv - start).as_micros()).unwrap_or(u64::MAX);
                last_us.fetch_max(at, Ordering::Relaxed);
            }
            t
        });
    }
    let mut tally = Tally::default();
    while let Some(t) = workers.join_next().await {
        tally.merge(t.context("a worker task panicked")?);
    }
    ticker.abort();
    pb.finish_and_clear();
    Ok(Timed {
        tally,
        elapsed_us: last_us.load(Ordering::Relaxed),
        stopped_by_max_seconds: ctx.deadline < wanted_end,
    })
}
