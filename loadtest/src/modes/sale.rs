//! The sale engine shared by flash-sale and sell-out: a fresh product (optionally with a
//! `max_per_customer`, optionally with its stock spread over locations of its own), N
//! distinct buyers sending M orders each with at most C orders in flight, availability
//! pollers until the buyers are done, and the product read back afterwards.

use super::{Ctx, create_locations, fresh_id, progress, run_tag, warm_up};
use crate::client::Api;
use crate::locations::Stock;
use crate::samples::{Allocated, AvailSample, Clock, OrderOutcome, OrderSample, SaleRun, SaleSpec};
use anyhow::{Context, Result};
use indicatif::ProgressBar;
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
    /// Orders per buyer, each with its own Idempotency-Key (1 for one order each).
    pub attempts_per_buyer: u32,
    /// The fresh product's `max_per_customer`, if any.
    pub max_per_customer: Option<u32>,
    pub concurrency: u32,
    pub qty: u32,
    pub pollers: u32,
    /// Locations to spread the stock over (1: all at `default`).
    pub locations: u32,
}

impl SaleArgs {
    /// Orders the run sends in all: every buyer's every attempt.
    pub fn orders(&self) -> u64 {
        self.buyers
            .saturating_mul(u64::from(self.attempts_per_buyer.max(1)))
    }
}

/// Which buyer, and which of its attempts, the `n`th order of the run is: a buyer's
/// attempts come one after another, so with several orders in flight they race each other
/// (the case a per-customer limit has to hold in).
pub fn slot(n: u64, attempts_per_buyer: u32) -> (u64, u32) {
    let m = u64::from(attempts_per_buyer.max(1));
    (n / m, (n % m) as u32)
}

/// What the buyers and pollers of one sale share.
struct Sale {
    api: Arc<Api>,
    pid: Arc<str>,
    tag: String,
    qty: u32,
    /// Orders to send in all, and how many of them each buyer sends.
    orders: u64,
    attempts_per_buyer: u32,
    deadline: Instant,
    clock: Clock,
    /// The next order to send (see [`slot`]).
    next: AtomicU64,
    /// For the progress bar: units confirmed, out-of-stock answers, limit refusals, failed
    /// orders.
    units: AtomicU64,
    rejected: AtomicU64,
    limited: AtomicU64,
    failed: AtomicU64,
    /// Set once every buyer is done; the pollers stop then.
    buyers_done: AtomicBool,
    pb: ProgressBar,
}

/// Creates the run's locations (if any) and its fresh product, and waits until
/// availability sees it; returns the product, where its stock is, and how long it took to
/// become visible.
async fn set_up(api: &Api, a: &mut SaleArgs) -> Result<(String, Stock, Duration)> {
    let product_id = a.product_id.take().unwrap_or_else(|| fresh_id(a.id_prefix));
    let stock = Stock::spread(a.stock, &create_locations(api, a.locations).await?);
    api.create_limited_product(&product_id, &stock, PRICE_CENTS, a.max_per_customer)
        .await?;
    let visible = api.wait_visible(&product_id, &Clock::start()).await?;
    Ok((product_id, stock, visible))
}

pub async fn run(ctx: &Ctx, mut a: SaleArgs) -> Result<SaleRun> {
    let api = ctx.api.clone();
    let (product_id, stock, visible) = set_up(&api, &mut a).await?;
    let replicas_before = api.replicas().await.ok();
    warm_up(ctx, (a.concurrency + a.pollers) as usize).await;

    let spec = SaleSpec {
        mode: a.mode,
        base_url: api.base_url().to_string(),
        product_id: product_id.clone(),
        stock: a.stock,
        buyers: a.buyers,
        attempts_per_buyer: a.attempts_per_buyer,
        max_per_customer: a.max_per_customer,
        concurrency: a.concurrency,
        qty: a.qty,
        pollers: a.pollers,
        locations: stock.at().map(<[_]>::to_vec).unwrap_or_default(),
    };
    let sale = Arc::new(Sale::start(api, product_id.into(), &a, ctx.deadline));
    let (orders, allocated, avail, avail_capped) =
        sale.clone().drive(a.concurrency, a.pollers).await?;

    let last_answer = orders.iter().map(|o| o.recv_us).max().unwrap_or(0);
    let final_read = sale
        .api
        .final_read(&sale.pid, sale.clock.wall_at(last_answer))
        .await
        .map_err(|e| format!("{e:#}"));
    let replicas_after = sale.api.replicas().await.ok();

    Ok(SaleRun {
        spec,
        clock: sale.clock,
        product_visible_after_ms: visible.as_millis() as u64,
        not_sent: a.orders().saturating_sub(orders.len() as u64),
        orders,
        allocated,
        avail,
        avail_capped,
        final_read,
        replicas_before,
        replicas_after,
    })
}

impl Sale {
    /// Shows the progress bar and starts the run's clock.
    fn start(api: Arc<Api>, pid: Arc<str>, a: &SaleArgs, deadline: Instant) -> Self {
        let pb = progress(
            a.orders(),
            "{spinner} {elapsed_precise} [{bar:40}] {pos}/{len} orders  {msg}",
        );
        pb.enable_steady_tick(Duration::from_millis(100));
        Self {
            api,
            pid,
            tag: run_tag(),
            qty: a.qty,
            orders: a.orders(),
            attempts_per_buyer: a.attempts_per_buyer,
            deadline,
            clock: Clock::start(),
            next: AtomicU64::new(0),
            units: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            buyers_done: AtomicBool::new(false),
            pb,
        }
    }

    /// Runs `concurrency` buyer tasks and `pollers` poller tasks until every buyer is done
    /// (or the safety stop); returns the orders, the units allocated per location, and the
    /// availability samples, each sorted by answer time, and whether a poller hit the
    /// sample cap.
    async fn drive(
        self: Arc<Self>,
        concurrency: u32,
        pollers: u32,
    ) -> Result<(Vec<OrderSample>, Allocated, Vec<AvailSample>, bool)> {
        let mut buyers = tokio::task::JoinSet::new();
        for _ in 0..concurrency {
            buyers.spawn(self.clone().buy());
        }
        let mut polls = tokio::task::JoinSet::new();
        let per_poller_cap = AVAIL_SAMPLE_CAP / pollers.max(1) as usize;
        for _ in 0..pollers {
            polls.spawn(self.clone().poll(per_poller_cap));
        }

        let mut orders = Vec::with_capacity(self.orders.min(10_000_000) as usize);
        let mut allocated = Allocated::default();
        while let Some(r) = buyers.join_next().await {
            let (mine, at) = r.context("a buyer task panicked")?;
            orders.extend(mine);
            allocated.merge(at);
        }
        self.buyers_done.store(true, Ordering::Relaxed);
        let mut avail = Vec::new();
        let mut avail_capped = false;
        while let Some(r) = polls.join_next().await {
            let (samples, capped) = r.context("a poller task panicked")?;
            avail.extend(samples);
            avail_capped |= capped;
        }
        self.pb.finish_and_clear();
        orders.sort_by_key(|o| o.recv_us);
        avail.sort_by_key(|s| s.recv_us);
        Ok((orders, allocated, avail, avail_capped))
    }

    /// One buyer task: takes the next order (a buyer and one of its attempts) and places
    /// it with a fresh Idempotency-Key, until every order is sent or the safety stop;
    /// returns its orders and the units their answers allocated per location.
    async fn buy(self: Arc<Self>) -> (Vec<OrderSample>, Allocated) {
        let mut out = Vec::new();
        let mut allocated = Allocated::default();
        while Instant::now() < self.deadline {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            if n >= self.orders {
                break;
            }
            let (buyer, attempt) = slot(n, self.attempts_per_buyer);
            let user = format!("buyer-{buyer}");
            let key = format!("lt-{}-{buyer}-{attempt}", self.tag);
            let sent = Instant::now();
            let (outcome, at) = (self.api)
                .place_order(&self.pid, &user, self.qty, &key, self.deadline)
                .await;
            let recv = Instant::now();
            allocated.add(&self.pid, &at);
            match &outcome {
                OrderOutcome::Confirmed { quantity } => self
                    .units
                    .fetch_add(u64::from(*quantity), Ordering::Relaxed),
                OrderOutcome::OutOfStock => self.rejected.fetch_add(1, Ordering::Relaxed),
                OrderOutcome::LimitExceeded { .. } => self.limited.fetch_add(1, Ordering::Relaxed),
                OrderOutcome::Failed(_) => self.failed.fetch_add(1, Ordering::Relaxed),
            };
            out.push(OrderSample {
                buyer,
                sent_us: self.clock.us(sent),
                recv_us: self.clock.us(recv),
                outcome,
            });
            self.pb.inc(1);
            self.pb.set_message(format!(
                "{} units confirmed, {} out of stock, {} over the limit, {} errors",
                self.units.load(Ordering::Relaxed),
                self.rejected.load(Ordering::Relaxed),
                self.limited.load(Ordering::Relaxed),
                self.failed.load(Ordering::Relaxed)
            ));
        }
        (out, allocated)
    }

    /// One poller task: asks availability back-to-back until the buyers are done, keeping
    /// at most `cap` samples; `true` when it stopped at the cap.
    async fn poll(self: Arc<Self>, cap: usize) -> (Vec<AvailSample>, bool) {
        let mut out = Vec::new();
        while !self.buyers_done.load(Ordering::Relaxed) && Instant::now() < self.deadline {
            if out.len() >= cap {
                return (out, true);
            }
            let sent = Instant::now();
            let outcome = (self.api)
                .availability(&self.pid, self.qty, &self.clock, self.deadline)
                .await;
            let recv = Instant::now();
            let failed = outcome.is_err();
            out.push(AvailSample {
                sent_us: self.clock.us(sent),
                recv_us: self.clock.us(recv),
                outcome,
            });
            if failed {
                // Do not spin on a refusing server; errors are still counted.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        (out, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buyers_attempts_come_one_after_another() {
        let slots: Vec<_> = (0..6).map(|n| slot(n, 3)).collect();
        assert_eq!(slots, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
        // One attempt each: order n is buyer n, as before attempts existed.
        assert_eq!(slot(41, 1), (41, 0));
        assert_eq!(slot(7, 0), (7, 0));
    }
}
