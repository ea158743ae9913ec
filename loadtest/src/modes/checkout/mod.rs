//! checkout: buyers hold a cart, "pay" (a random delay), then confirm, release or walk
//! away; checks afterwards that no unit was oversold and that every hold ended, leaving
//! nothing held.
//!
//! The accounting rests on one identity per product, read back through the API once every
//! hold has ended: `available_quantity + units we saw confirmed == stock given`. Units
//! still held would make the left side short, so the check waits (polling
//! `GET /v1/admin/holds`) until the service says nothing of ours is held, and gives up at
//! the latest `expires_at` + 5 s (the contract's bound) plus a little grace.

use super::{Ctx, fresh_id, progress, run_tag, warm_up};
use crate::cli::CheckoutArgs;
use crate::client::{Answer, Api, error_code, error_label};
use crate::report::checkout::{CheckoutReport, Counts, ProductCheck, Steps, problems};
use crate::report::{LatencySummary, per_second};
use crate::stats::histogram;
use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Attempts per step: a 503 with Retry-After or a lost answer is retried (holds by their
/// Idempotency-Key, confirm and release by the hold id), so each outcome becomes known.
const ATTEMPTS: u32 = 5;
/// The contract lets an expired hold's units come back up to 5 s after `expires_at`; the
/// grace covers our clock against the service's and one poll interval.
const EXPIRY_BOUND: Duration = Duration::from_secs(5);
const EXPIRY_GRACE: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------------------
// Pure pieces: randomness, carts, endings
// ---------------------------------------------------------------------------------------

/// Buyer `b`'s own random stream (cart, payment delay, ending), so workers need not share
/// one and a run replays from --seed (with the same `fastrand` as in Cargo.lock).
fn buyer_rng(seed: u64, b: u64) -> fastrand::Rng {
    fastrand::Rng::with_seed(seed ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// `lines` distinct product indexes below `products` (the service refuses a cart naming a
/// product twice). Needs `lines <= products`.
fn pick_cart(rng: &mut fastrand::Rng, products: usize, lines: usize) -> Vec<usize> {
    let mut cart = Vec::with_capacity(lines);
    while cart.len() < lines {
        let p = rng.usize(..products);
        if !cart.contains(&p) {
            cart.push(p);
        }
    }
    cart
}

/// How a buyer ends its hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Confirm,
    Release,
    WalkAway,
}

/// `abandon_roll` below `abandon` abandons; of those, `release_roll` below `release_share`
/// releases and the rest walk away.
fn ending(abandon_roll: f64, release_roll: f64, abandon: f64, release_share: f64) -> Ending {
    if abandon_roll >= abandon {
        Ending::Confirm
    } else if release_roll < release_share {
        Ending::Release
    } else {
        Ending::WalkAway
    }
}

// ---------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------

/// What the workers share.
struct Plan {
    api: Arc<Api>,
    products: Arc<[String]>,
    index: HashMap<String, usize>,
    tag: String,
    seed: u64,
    a: CheckoutArgs,
    deadline: Instant,
}

/// Everything one worker saw.
struct Tally {
    hold: Histogram<u64>,
    confirm: Histogram<u64>,
    release: Histogram<u64>,
    counts: Counts,
    units: Vec<u64>,
    retried: BTreeMap<String, u64>,
    unexpected: BTreeMap<String, u64>,
    /// The latest moment a hold of ours could still be holding units.
    last_end: Option<DateTime<Utc>>,
    last_answer: Option<Instant>,
    started: u64,
}

impl Tally {
    fn new(products: usize) -> Self {
        Self {
            hold: histogram(),
            confirm: histogram(),
            release: histogram(),
            counts: Counts::default(),
            units: vec![0; products],
            retried: BTreeMap::new(),
            unexpected: BTreeMap::new(),
            last_end: None,
            last_answer: None,
            started: 0,
        }
    }

    fn unexpected(&mut self, step: Step, label: String) {
        *self
            .unexpected
            .entry(format!("{}: {label}", step.name()))
            .or_default() += 1;
    }

    fn ended(&mut self, at: DateTime<Utc>) {
        self.last_end = self.last_end.max(Some(at));
    }

    fn merge(&mut self, o: Tally) {
        for (mine, theirs) in [
            (&mut self.hold, &o.hold),
            (&mut self.confirm, &o.confirm),
            (&mut self.release, &o.release),
        ] {
            // Same bounds on both sides: adding cannot fail.
            let _ = mine.add(theirs);
        }
        let (c, d) = (&mut self.counts, &o.counts);
        c.holds_taken += d.holds_taken;
        c.holds_refused += d.holds_refused;
        c.confirmed += d.confirmed;
        c.confirm_too_late += d.confirm_too_late;
        c.released += d.released;
        c.release_after_expiry += d.release_after_expiry;
        c.abandoned += d.abandoned;
        c.unresolved += d.unresolved;
        for (u, v) in self.units.iter_mut().zip(&o.units) {
            *u += v;
        }
        for (k, v) in o.retried {
            *self.retried.entry(k).or_default() += v;
        }
        for (k, v) in o.unexpected {
            *self.unexpected.entry(k).or_default() += v;
        }
        self.last_end = self.last_end.max(o.last_end);
        self.last_answer = self.last_answer.max(o.last_answer);
        self.started += o.started;
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Hold,
    Confirm,
    Release,
}

impl Step {
    fn name(self) -> &'static str {
        match self {
            Step::Hold => "hold",
            Step::Confirm => "confirm",
            Step::Release => "release",
        }
    }
}

#[derive(Deserialize)]
struct HoldBody {
    hold_id: String,
    status: String,
    expires_at: DateTime<Utc>,
}

#[derive(Deserialize)]
struct OrderBody {
    status: String,
    lines: Vec<LineBody>,
}

#[derive(Deserialize)]
struct LineBody {
    product_id: String,
    quantity: u64,
}

#[derive(Deserialize)]
struct HeldBody {
    units_held: Vec<HeldLine>,
}

#[derive(Deserialize)]
struct HeldLine {
    product_id: String,
    units: i64,
}

/// Sends one step, retrying 503-with-Retry-After and lost answers (every step here is
/// safe to repeat); `None` when no answer came after [`ATTEMPTS`] (counted unresolved).
/// A 503 without Retry-After is outside the contract and returned for the caller to flag.
async fn send(
    plan: &Plan,
    t: &mut Tally,
    step: Step,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> Option<Answer> {
    for attempt in 1..=ATTEMPTS {
        let sent = Instant::now();
        let answer = plan
            .api
            .admin_call(method.clone(), path, key, body, plan.deadline)
            .await;
        let us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
        let h = match step {
            Step::Hold => &mut t.hold,
            Step::Confirm => &mut t.confirm,
            Step::Release => &mut t.release,
        };
        h.saturating_record(us.max(1));
        t.last_answer = t.last_answer.max(Some(Instant::now()));
        let wait = match answer {
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE && a.retry_after.is_some() => {
                let label = format!("{}: {}", step.name(), error_label(a.status, &a.body));
                *t.retried.entry(label).or_default() += 1;
                // Honour the service's hint, but a load run should not stall for long.
                a.retry_after
                    .unwrap_or_default()
                    .min(Duration::from_secs(1))
            }
            Ok(a) => return Some(a),
            Err(label) => {
                *t.retried
                    .entry(format!("{}: {label}", step.name()))
                    .or_default() += 1;
                Duration::from_millis(50)
            }
        };
        if attempt == ATTEMPTS || Instant::now() + wait >= plan.deadline {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    t.counts.unresolved += 1;
    None
}

/// One buyer: hold a cart, pay, then confirm, release or walk away.
async fn buyer(plan: &Plan, t: &mut Tally, b: u64) {
    let a = &plan.a;
    t.started += 1;
    let mut rng = buyer_rng(plan.seed, b);
    let cart = pick_cart(&mut rng, plan.products.len(), a.lines as usize);
    let Some(hold) = take_hold(plan, t, b, &cart).await else {
        return;
    };
    t.counts.holds_taken += 1;
    let delay = rng.u64(a.delay_min_ms..=a.delay_max_ms);
    let plan_end = ending(rng.f64(), rng.f64(), a.abandon, a.release_share);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    end_hold(plan, t, &hold, plan_end, &cart).await;
}

/// Asks to hold buyer `b`'s cart; `Some` when the units are held, otherwise the answer is
/// counted (refused, unexpected or unresolved).
async fn take_hold(plan: &Plan, t: &mut Tally, b: u64, cart: &[usize]) -> Option<HoldBody> {
    let qty = plan.a.qty;
    let lines: Vec<Value> = cart
        .iter()
        .map(|&p| json!({"product_id": plan.products[p], "quantity": qty}))
        .collect();
    let body =
        json!({"user_id": format!("lt-{}-{b}", plan.tag), "lines": lines, "ttl_s": plan.a.ttl_s});
    let key = format!("lt-{}-hold-{b}", plan.tag);
    let path = "/v1/holds";
    let ans = send(
        plan,
        t,
        Step::Hold,
        Method::POST,
        path,
        Some(&key),
        Some(&body),
    )
    .await?;
    let unexpected = match ans.status {
        StatusCode::CREATED => match serde_json::from_slice::<HoldBody>(&ans.body) {
            Ok(h) if h.status == "held" => return Some(h),
            Ok(h) => format!("201 status {}", h.status),
            Err(_) => "201 unreadable body".into(),
        },
        StatusCode::CONFLICT if error_code(&ans.body).as_deref() == Some("OUT_OF_STOCK") => {
            t.counts.holds_refused += 1;
            return None;
        }
        s => error_label(s, &ans.body),
    };
    t.unexpected(Step::Hold, unexpected);
    None
}

/// Ends a hold the way the buyer planned; whatever comes back, the hold is over by its
/// expiry at the latest.
async fn end_hold(plan: &Plan, t: &mut Tally, hold: &HoldBody, end: Ending, cart: &[usize]) {
    let path = format!("/v1/holds/{}", hold.hold_id);
    match end {
        Ending::WalkAway => {
            t.counts.abandoned += 1;
            t.ended(hold.expires_at);
        }
        Ending::Confirm => {
            let path = format!("{path}/confirm");
            let ans = send(plan, t, Step::Confirm, Method::POST, &path, None, None).await;
            t.ended(hold.expires_at);
            if let Some(ans) = ans {
                let held = cart.iter().map(|&p| (p, u64::from(plan.a.qty))).collect();
                confirmed(plan, t, &ans, held);
            }
        }
        Ending::Release => {
            let ans = send(plan, t, Step::Release, Method::DELETE, &path, None, None).await;
            t.ended(hold.expires_at);
            if let Some(ans) = ans {
                released(t, &ans);
            }
        }
    }
}

/// Classifies a confirm answer. The units counted are the order's own lines (the service's
/// word), and they must be the held ones: an order that differs from its hold is flagged.
fn confirmed(plan: &Plan, t: &mut Tally, ans: &Answer, mut held: Vec<(usize, u64)>) {
    match ans.status {
        StatusCode::CREATED | StatusCode::OK => {
            match serde_json::from_slice::<OrderBody>(&ans.body) {
                Ok(o) if o.status == "confirmed" => {
                    t.counts.confirmed += 1;
                    let mut got = Vec::with_capacity(o.lines.len());
                    for l in o.lines {
                        match plan.index.get(&l.product_id) {
                            Some(&i) => {
                                t.units[i] += l.quantity;
                                got.push((i, l.quantity));
                            }
                            None => got.push((usize::MAX, l.quantity)),
                        }
                    }
                    got.sort_unstable();
                    held.sort_unstable();
                    if got != held {
                        t.unexpected(Step::Confirm, "order lines differ from the hold's".into());
                    }
                }
                Ok(o) => t.unexpected(
                    Step::Confirm,
                    format!("{} status {}", ans.status.as_u16(), o.status),
                ),
                Err(_) => t.unexpected(
                    Step::Confirm,
                    format!("{} unreadable body", ans.status.as_u16()),
                ),
            }
        }
        StatusCode::CONFLICT if error_code(&ans.body).as_deref() == Some("HOLD_EXPIRED") => {
            t.counts.confirm_too_late += 1;
        }
        s => t.unexpected(Step::Confirm, error_label(s, &ans.body)),
    }
}

fn released(t: &mut Tally, ans: &Answer) {
    if ans.status != StatusCode::OK {
        return t.unexpected(Step::Release, error_label(ans.status, &ans.body));
    }
    match serde_json::from_slice::<HoldBody>(&ans.body) {
        Ok(h) if h.status == "released" => t.counts.released += 1,
        Ok(h) if h.status == "expired" => t.counts.release_after_expiry += 1,
        Ok(h) => t.unexpected(Step::Release, format!("200 status {}", h.status)),
        Err(_) => t.unexpected(Step::Release, "200 unreadable body".into()),
    }
}

/// Units of our products the service still lists as held.
async fn units_held(api: &Api, ours: &HashMap<String, usize>, deadline: Instant) -> Result<u64> {
    let a = api
        .admin_call(Method::GET, "/v1/admin/holds", None, None, deadline)
        .await
        .map_err(|label| anyhow::anyhow!("GET /v1/admin/holds: {label}"))?;
    if a.status != StatusCode::OK {
        bail!(
            "GET /v1/admin/holds: HTTP {}",
            error_label(a.status, &a.body)
        );
    }
    let held: HeldBody =
        serde_json::from_slice(&a.body).context("GET /v1/admin/holds: unexpected body")?;
    Ok(held
        .units_held
        .iter()
        .filter(|h| ours.contains_key(&h.product_id))
        .map(|h| h.units.max(0) as u64)
        .sum())
}

/// Polls until nothing of ours is held, giving up at `last_end` + the contract's 5 s +
/// grace. Returns the units still held (0 on success) and how long it took.
async fn wait_holds_ended(
    api: &Api,
    ours: &HashMap<String, usize>,
    last_end: Option<DateTime<Utc>>,
) -> Result<(u64, Duration)> {
    let start = Instant::now();
    let left = last_end
        .map(|e| (e - Utc::now()).to_std().unwrap_or_default())
        .unwrap_or_default();
    let give_up = start + left + EXPIRY_BOUND + EXPIRY_GRACE;
    loop {
        let held = units_held(api, ours, give_up + POLL).await?;
        if held == 0 || Instant::now() >= give_up {
            return Ok((held, start.elapsed()));
        }
        tokio::time::sleep(POLL).await;
    }
}

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
    for id in products.iter() {
        api.create_product(id, a.stock, 100).await?;
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
        tag: run_tag(),
        seed,
        a,
        deadline: ctx.deadline,
    });

    let (t, elapsed) = drive(&plan).await?;
    let held = wait_holds_ended(&plan.api, &plan.index, t.last_end).await?;
    let per_product = read_books(&plan, &t.units).await?;
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

/// Reads every product back once the holds have ended and checks its books against the
/// units we saw confirmed.
async fn read_books(plan: &Plan, units: &[u64]) -> Result<Vec<ProductCheck>> {
    let end = Utc::now();
    let mut per_product = Vec::with_capacity(plan.products.len());
    for (i, id) in plan.products.iter().enumerate() {
        let read = plan.api.final_read(id, end).await?;
        let given = u64::from(plan.a.stock);
        let mut p = ProductCheck::new(id.clone(), given, units[i], read.available_quantity);
        p.served_by = read.served_by;
        p.covers_end = read.covers_all_orders;
        per_product.push(p);
    }
    Ok(per_product)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endings_split_by_the_abandon_and_release_shares() {
        assert_eq!(ending(0.5, 0.0, 0.2, 0.5), Ending::Confirm);
        assert_eq!(ending(0.19, 0.49, 0.2, 0.5), Ending::Release);
        assert_eq!(ending(0.19, 0.5, 0.2, 0.5), Ending::WalkAway);
        // No abandon at all: everyone confirms, whatever the rolls.
        assert_eq!(ending(0.0, 0.0, 0.0, 1.0), Ending::Confirm);
        // Over many buyers the shares come out near what was asked.
        let mut rng = buyer_rng(7, 0);
        let mut seen = [0u32; 3];
        for _ in 0..10_000 {
            match ending(rng.f64(), rng.f64(), 0.2, 0.5) {
                Ending::Confirm => seen[0] += 1,
                Ending::Release => seen[1] += 1,
                Ending::WalkAway => seen[2] += 1,
            }
        }
        assert!((7_700..=8_300).contains(&seen[0]), "{seen:?}");
        assert!((800..=1_200).contains(&seen[1]), "{seen:?}");
        assert!((800..=1_200).contains(&seen[2]), "{seen:?}");
    }

    #[test]
    fn carts_name_distinct_products_and_delays_stay_in_range() {
        for b in 0..1_000 {
            let mut rng = buyer_rng(42, b);
            let mut cart = pick_cart(&mut rng, 3, 3);
            cart.sort_unstable();
            assert_eq!(cart, vec![0, 1, 2], "buyer {b}");
            let d = rng.u64(5..=9);
            assert!((5..=9).contains(&d), "buyer {b}: {d}");
        }
    }

    #[test]
    fn a_seed_replays_every_buyers_cart_delay_and_ending() {
        let draw = |seed, b| {
            let mut rng = buyer_rng(seed, b);
            let cart = pick_cart(&mut rng, 20, 3);
            (
                cart,
                rng.u64(0..=200),
                ending(rng.f64(), rng.f64(), 0.2, 0.5),
            )
        };
        for b in 0..100 {
            assert_eq!(draw(42, b), draw(42, b), "buyer {b}");
        }
        // Buyers draw apart from each other, and another seed draws another run.
        assert_ne!(
            (0..20).map(|b| draw(42, b)).collect::<Vec<_>>(),
            (20..40).map(|b| draw(42, b)).collect::<Vec<_>>()
        );
        assert_ne!(
            (0..20).map(|b| draw(42, b)).collect::<Vec<_>>(),
            (0..20).map(|b| draw(43, b)).collect::<Vec<_>>()
        );
    }
}
