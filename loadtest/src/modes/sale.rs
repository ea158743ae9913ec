//! The sale engine shared by flash-sale and sell-out: a fresh product, N distinct buyers
//! with at most C orders in flight, availability pollers until the buyers are done, and
//! the product read back afterwards.

use super::{Ctx, fresh_id, progress, run_tag, warm_up};
use crate::samples::{AvailSample, Clock, OrderOutcome, OrderSample, SaleRun, SaleSpec};
use anyhow::{Context, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Availability samples kept in memory at most (all pollers together), ~100 MB.
const AVAIL_SAMPLE_CAP: usize = 2_000_000;

/// Price of the products a sale creates.
const PRICE_CENTS: u32 = 1999;

pub struct SaleArgs {
    pub mode: &'static str,
    pub id_prefix: &'static str,
    pub product_id: Option<String>,
    pub stock: u32,
    pub buyers: u64,
    pub concurrency: u32,
    pub qty: u32,
    pub pollers: u32,
}

pub async fn run(ctx: &Ctx, a: SaleArgs) -> Result<SaleRun> {
    let api = ctx.api.clone();
    let product_id = a.product_id.unwrap_or_else(|| fresh_id(a.id_prefix));
    api.create_product(&product_id, a.stock, PRICE_CENTS)
        .await?;
    let visible = api.wait_visible(&product_id, &Clock::start()).await?;
    let replicas_before = api.replicas().await.ok();
    warm_up(ctx, (a.concurrency + a.pollers) as usize).await;

    let spec = SaleSpec {
        mode: a.mode,
        base_url: api.base_url().to_string(),
        product_id: product_id.clone(),
        stock: a.stock,
        buyers: a.buyers,
        concurrency: a.concurrency,
        qty: a.qty,
        pollers: a.pollers,
    };
    let pid: Arc<str> = product_id.into();
    let tag = run_tag();
    let deadline = ctx.deadline;
    let next = Arc::new(AtomicU64::new(0));
    let units = Arc::new(AtomicU64::new(0));
    let rejected = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let buyers_done = Arc::new(AtomicBool::new(false));
    let pb = progress(
        a.buyers,
        "{spinner} {elapsed_precise} [{bar:40}] {pos}/{len} orders  {msg}",
    );
    pb.enable_steady_tick(Duration::from_millis(100));
    let clock = Clock::start();

    let mut buyers = tokio::task::JoinSet::new();
    for _ in 0..a.concurrency {
        let (api, pid, tag, pb) = (api.clone(), pid.clone(), tag.clone(), pb.clone());
        let (next, units, rejected, failed) = (
            next.clone(),
            units.clone(),
            rejected.clone(),
            failed.clone(),
        );
        let (total, qty) = (a.buyers, a.qty);
        buyers.spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < deadline {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let user = format!("buyer-{n}");
                let key = format!("lt-{tag}-{n}");
                let sent = Instant::now();
                let outcome = api.place_order(&pid, &user, qty, &key, deadline).await;
                let recv = Instant::now();
                match &outcome {
                    OrderOutcome::Confirmed { quantity } => {
                        units.fetch_add(u64::from(*quantity), Ordering::Relaxed);
                    }
                    OrderOutcome::OutOfStock => {
                        rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    OrderOutcome::Failed(_) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                out.push(OrderSample {
                    sent_us: clock.us(sent),
                    recv_us: clock.us(recv),
                    outcome,
                });
                pb.inc(1);
                pb.set_message(format!(
                    "{} units confirmed, {} out of stock, {} errors",
                    units.load(Ordering::Relaxed),
                    rejected.load(Ordering::Relaxed),
                    failed.load(Ordering::Relaxed)
                ));
            }
            out
        });
    }

    let mut pollers = tokio::task::JoinSet::new();
    let per_poller_cap = AVAIL_SAMPLE_CAP / a.pollers.max(1) as usize;
    for _ in 0..a.pollers {
        let (api, pid, done) = (api.clone(), pid.clone(), buyers_done.clone());
        let qty = a.qty;
        pollers.spawn(async move {
            let mut out = Vec::new();
            let mut capped = false;
            while !done.load(Ordering::Relaxed) && Instant::now() < deadline {
                if out.len() >= per_poller_cap {
                    capped = true;
                    break;
                }
                let sent = Instant::now();
                let outcome = api.availability(&pid, qty, &clock, deadline).await;
                let recv = Instant::now();
                let failed = outcome.is_err();
                out.push(AvailSample {
                    sent_us: clock.us(sent),
                    recv_us: clock.us(recv),
                    outcome,
                });
                if failed {
                    // Do not spin on a refusing server; errors are still counted.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            (out, capped)
        });
    }

    let mut orders = Vec::with_capacity(a.buyers.min(10_000_000) as usize);
    while let Some(r) = buyers.join_next().await {
        orders.extend(r.context("a buyer task panicked")?);
    }
    buyers_done.store(true, Ordering::Relaxed);
    let mut avail = Vec::new();
    let mut avail_capped = false;
    while let Some(r) = pollers.join_next().await {
        let (samples, capped) = r.context("a poller task panicked")?;
        avail.extend(samples);
        avail_capped |= capped;
    }
    pb.finish_and_clear();
    orders.sort_by_key(|o| o.recv_us);
    avail.sort_by_key(|s| s.recv_us);

    let last_answer = orders.iter().map(|o| o.recv_us).max().unwrap_or(0);
    let final_read = api
        .final_read(&pid, clock.wall_at(last_answer))
        .await
        .map_err(|e| format!("{e:#}"));
    let replicas_after = api.replicas().await.ok();

    Ok(SaleRun {
        spec,
        clock,
        product_visible_after_ms: visible.as_millis() as u64,
        not_sent: a.buyers - orders.len() as u64,
        orders,
        avail,
        avail_capped,
        final_read,
        replicas_before,
        replicas_after,
    })
}
