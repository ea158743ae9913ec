//! checkout: buyers hold a cart, "pay" (a random delay), then confirm, release or walk
//! away; checks afterwards that no unit was oversold and that every hold ended, leaving
//! nothing held.
//!
//! The accounting rests on one identity per product, read back through the API once every
//! hold has ended: `available_quantity + units we saw confirmed == stock given` — and, with
//! `--locations N`, the same at each location of each product, from the confirmed orders'
//! `allocations` and the product page's `stock`. Units
//! still held would make the left side short, so the check waits (polling
//! `GET /v1/admin/holds`) until the service says nothing of ours is held, and gives up at
//! the latest `expires_at` + 5 s (the contract's bound) plus a little grace.
//!
//! # Layout
//! - `mod.rs`: the run: set up the products, drive the buyers, then check the books;
//! - `workload.rs`: each buyer's cart, payment delay and ending, drawn from the seed;
//! - `buyer.rs`: one buyer's steps, retried until their outcome is known;
//! - `tally.rs`: what the buyers saw, merged across workers;
//! - `books.rs`: waiting for every hold to end, and reading the stock back.
//!
//! The report, its books and its verdict are `report::checkout`'s.

mod books;
mod buyer;
mod tally;
mod workload;

use self::books::{read_books, wait_holds_ended};
use self::buyer::{ATTEMPTS, buyer};
use self::tally::Tally;
use super::{Ctx, create_locations, fresh_id, progress, run_tag, warm_up};
use crate::cli::CheckoutArgs;
use crate::client::Api;
use crate::locations::Stock;
use crate::report::checkout::{CheckoutReport, ProductCheck, Steps, problems};
use crate::report::{LatencySummary, per_second};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub async fn run(ctx: &Ctx, a: CheckoutArgs) -> Result<CheckoutReport> {
    if a.lines > a.products {
        bail!(
            "--lines {} needs at least that many --products (got {})",
            a.lines,
            a.products
        );
    }
    if a.delay_min_ms > a.delay_max_ms {
        bail!("--delay-min-ms must not exceed --delay-max-ms");
    }
    let api = ctx.api.clone();
    let base = fresh_id("co");
    let products: Arc<[String]> = (0..a.products).map(|i| format!("{base}-{i}")).collect();
    // Every product is spread over the same locations, the same way.
    let stock = Stock::spread(a.stock, &create_locations(&api, a.locations).await?);
    for id in products.iter() {
        api.create_product(id, &stock, 100).await?;
    }
    let index = products
        .iter()
        .enumerate()
        .map(|(i, id)| (id.clone(), i))
        .collect();
    warm_up(ctx, a.concurrency as usize).await;
    let seed = a.seed.unwrap_or_else(|| fastrand::u64(..));
    let plan = Arc::new(Plan {
        api,
        products,
        index,
        stock,
        tag: run_tag(),
        seed,
        a,
        deadline: ctx.deadline,
    });

    let (t, elapsed) = drive(&plan).await?;
    let held = wait_holds_ended(&plan.api, &plan.index, t.last_end).await?;
    let per_product = read_books(&plan, &t.units, &t.allocated).await?;
    Ok(report(&plan, t, elapsed, held, per_product))
}

/// Runs every buyer, `concurrency` at a time; returns what they saw and how long it took
/// from the start to the last answer.
async fn drive(plan: &Arc<Plan>) -> Result<(Tally, Duration)> {
    let pb = progress(plan.a.buyers, "{spinner} [{bar:40}] {pos}/{len} buyers");
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..plan.a.concurrency {
        let (plan, next, pb) = (plan.clone(), next.clone(), pb.clone());
        workers.spawn(async move {
            let mut t = Tally::new(plan.products.len());
            loop {
                let b = next.fetch_add(1, Ordering::Relaxed);
                if b >= plan.a.buyers || Instant::now() >= plan.deadline {
                    break;
                }
                buyer(&plan, &mut t, b).await;
                pb.inc(1);
            }
            t
        });
    }
    let mut t = Tally::new(plan.products.len());
    while let Some(w) = workers.join_next().await {
        t.merge(w.context("a buyer task panicked")?);
    }
    pb.finish_and_clear();
    let elapsed = t.last_answer.map(|l| l - start).unwrap_or_default();
    Ok((t, elapsed))
}

/// What the workers share.
struct Plan {
    api: Arc<Api>,
    products: Arc<[String]>,
    index: HashMap<String, usize>,
    /// Where each product's stock was put.
    stock: Stock,
    tag: String,
    seed: u64,
    a: CheckoutArgs,
    deadline: Instant,
}

/// The report of a finished run; `held` is what waiting for the holds to end found.
fn report(
    plan: &Plan,
    t: Tally,
    elapsed: Duration,
    (units_left_held, waited): (u64, Duration),
    per_product: Vec<ProductCheck>,
) -> CheckoutReport {
    let a = &plan.a;
    let mut r = CheckoutReport {
        mode: "checkout",
        base_url: plan.api.base_url().to_string(),
        seed: plan.seed,
        products: a.products,
        stock_per_product: a.stock,
        buyers: a.buyers,
        concurrency: a.concurrency,
        lines_per_cart: a.lines,
        qty_per_line: a.qty,
        ttl_s: a.ttl_s,
        delay_ms: [a.delay_min_ms, a.delay_max_ms],
        abandon: a.abandon,
        release_share: a.release_share,
        buyers_not_started: a.buyers - t.started,
        elapsed_s: elapsed.as_secs_f64(),
        orders_per_s: per_second(t.counts.confirmed, elapsed.as_micros() as u64),
        units_confirmed: t.units.iter().sum(),
        latency: Steps {
            hold: LatencySummary::of(&t.hold),
            confirm: LatencySummary::of(&t.confirm),
            release: LatencySummary::of(&t.release),
        },
        counts: t.counts,
        retried: t.retried,
        unexpected: t.unexpected,
        holds_ended_after_ms: waited.as_millis() as u64,
        units_left_held,
        oversold_units: per_product.iter().map(|p| p.oversold).sum(),
        per_product,
        problems: Vec::new(),
        ok: false,
    };
    r.problems = problems(&r, ATTEMPTS);
    r.ok = r.problems.is_empty();
    r
}
