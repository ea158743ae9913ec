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
use crate::report::{LatencySummary, Report, fmt_ms, fmt_rate, oversold, per_second};
use crate::stats::histogram;
use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
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
// Pure pieces: randomness, carts, endings, accounting, verdict
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

/// One product's books after the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProductCheck {
    pub product_id: String,
    pub stock_given: u64,
    /// Units in orders we saw confirmed (201 or 200 from confirm).
    pub confirmed_units: u64,
    /// `available_quantity` read back through the API.
    pub available_quantity: i64,
    pub served_by: String,
    /// The read's `as_of` covered the moment every hold had ended.
    pub covers_end: bool,
    /// Confirmed beyond the stock given.
    pub oversold: u64,
    /// Given − confirmed − available: units neither sold nor on sale (still held, or lost);
    /// negative when units appeared from nowhere. Must be 0 once every hold has ended.
    pub unaccounted: i64,
}

impl ProductCheck {
    fn new(product_id: String, given: u64, confirmed: u64, available: i64) -> Self {
        Self {
            product_id,
            stock_given: given,
            confirmed_units: confirmed,
            available_quantity: available,
            served_by: String::new(),
            covers_end: true,
            oversold: oversold(confirmed, given),
            unaccounted: given as i64 - confirmed as i64 - available,
        }
    }
}

/// What went wrong, one sentence each; empty means the run passed.
fn problems(r: &CheckoutReport) -> Vec<String> {
    let mut out = Vec::new();
    if r.oversold_units > 0 {
        out.push(format!("{} units oversold", r.oversold_units));
    }
    if r.units_left_held > 0 {
        out.push(format!(
            "{} units still held after every hold should have ended",
            r.units_left_held
        ));
    }
    let unexpected: u64 = r.unexpected.values().sum();
    if unexpected > 0 {
        out.push(format!("{unexpected} unexpected answers"));
    }
    if r.counts.unresolved > 0 {
        out.push(format!(
            "{} buyers whose outcome stayed unknown after {ATTEMPTS} attempts",
            r.counts.unresolved
        ));
    }
    for p in &r.per_product {
        if p.unaccounted != 0 {
            out.push(format!(
                "{}: given {} but confirmed {} + available {} (off by {})",
                p.product_id, p.stock_given, p.confirmed_units, p.available_quantity, p.unaccounted
            ));
        }
        if !p.covers_end {
            out.push(format!(
                "{}: no stock read covering the end of the run (served by {})",
                p.product_id, p.served_by
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counts {
    pub holds_taken: u64,
    /// 409 OUT_OF_STOCK: nothing was held.
    pub holds_refused: u64,
    pub confirmed: u64,
    /// Confirm answered 409 HOLD_EXPIRED: the payment took longer than the hold.
    pub confirm_too_late: u64,
    pub released: u64,
    /// Release found the hold already expired (200 with `status: expired`).
    pub release_after_expiry: u64,
    /// Walked away: the hold had to expire by itself.
    pub abandoned: u64,
    /// Steps that still had no answer after every attempt.
    pub unresolved: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Steps {
    pub hold: LatencySummary,
    pub confirm: LatencySummary,
    pub release: LatencySummary,
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckoutReport {
    pub mode: &'static str,
    pub base_url: String,
    pub seed: u64,
    pub products: u32,
    pub stock_per_product: u32,
    pub buyers: u64,
    pub concurrency: u32,
    pub lines_per_cart: u32,
    pub qty_per_line: u32,
    pub ttl_s: u32,
    pub delay_ms: [u64; 2],
    pub abandon: f64,
    pub release_share: f64,
    /// Buyers who never started: the --max-seconds safety stop came first.
    pub buyers_not_started: u64,
    /// First hold sent → last step answered.
    pub elapsed_s: f64,
    pub counts: Counts,
    pub units_confirmed: u64,
    pub orders_per_s: f64,
    /// Per step, every attempt's latency (retries included).
    pub latency: Steps,
    /// Answers retried (503 with Retry-After, lost answers), by label.
    pub retried: BTreeMap<String, u64>,
    /// Answers outside the contract for their step, by step and label.
    pub unexpected: BTreeMap<String, u64>,
    /// The last buyer done → the service lists nothing of ours as held.
    pub holds_ended_after_ms: u64,
    pub units_left_held: u64,
    pub oversold_units: u64,
    pub per_product: Vec<ProductCheck>,
    pub problems: Vec<String>,
    pub ok: bool,
}

impl Report for CheckoutReport {
    fn render_into(&self, out: &mut String) -> fmt::Result {
        self.render_header(out)?;
        self.render_counts(out)?;
        self.render_steps(out)?;
        self.render_books(out)?;
        writeln!(out)?;
        if self.ok {
            writeln!(out, "OK")
        } else {
            writeln!(out, "FAILED: {}", self.problems.join("; "))
        }
    }

    fn passed(&self) -> bool {
        self.ok
    }
}

impl CheckoutReport {
    fn render_header(&self, out: &mut String) -> fmt::Result {
        writeln!(out, "== checkout against {} ==", self.base_url)?;
        writeln!(
            out,
            "{} buyers ({} at once), carts of {} x {} unit(s) over {} products of {} units; \
             hold ttl {} s, payment {}-{} ms, abandon {:.0} % (of them {:.0} % release); seed {}",
            self.buyers,
            self.concurrency,
            self.lines_per_cart,
            self.qty_per_line,
            self.products,
            self.stock_per_product,
            self.ttl_s,
            self.delay_ms[0],
            self.delay_ms[1],
            self.abandon * 100.0,
            self.release_share * 100.0,
            self.seed
        )?;
        if self.buyers_not_started > 0 {
            writeln!(
                out,
                "stopped by --max-seconds: {} buyers never started",
                self.buyers_not_started
            )?;
        }
        writeln!(out)
    }

    fn render_counts(&self, out: &mut String) -> fmt::Result {
        let c = &self.counts;
        let rows: [(&str, u64); 8] = [
            ("holds taken (201)", c.holds_taken),
            ("holds refused (409)", c.holds_refused),
            ("confirmed", c.confirmed),
            ("confirm too late (409)", c.confirm_too_late),
            ("released", c.released),
            ("release after expiry", c.release_after_expiry),
            ("abandoned (left to expire)", c.abandoned),
            ("unresolved", c.unresolved),
        ];
        for (name, n) in rows {
            writeln!(out, "  {name:<28} {n}")?;
        }
        writeln!(
            out,
            "  {:<28} {} ({} units) in {:.2} s",
            "orders confirmed/s",
            fmt_rate(self.orders_per_s),
            self.units_confirmed,
            self.elapsed_s
        )?;
        writeln!(out)
    }

    /// Latency per step, then the retried and unexpected answers.
    fn render_steps(&self, out: &mut String) -> fmt::Result {
        writeln!(
            out,
            "  {:<10} {:>8} {:>10} {:>10} {:>10}",
            "step", "calls", "p50", "p99", "max"
        )?;
        for (name, l) in [
            ("hold", &self.latency.hold),
            ("confirm", &self.latency.confirm),
            ("release", &self.latency.release),
        ] {
            writeln!(
                out,
                "  {:<10} {:>8} {:>10} {:>10} {:>10}",
                name,
                l.count,
                fmt_ms(l.p50_ms),
                fmt_ms(l.p99_ms),
                fmt_ms(l.max_ms)
            )?;
        }
        for (label, n) in &self.retried {
            writeln!(out, "  retried: {label} x{n}")?;
        }
        for (label, n) in &self.unexpected {
            writeln!(out, "  UNEXPECTED: {label} x{n}")?;
        }
        writeln!(out)
    }

    /// Units left held and the per-product books.
    fn render_books(&self, out: &mut String) -> fmt::Result {
        writeln!(
            out,
            "  {:<28} {} (polled /v1/admin/holds for {} ms after the last buyer)",
            "units left held", self.units_left_held, self.holds_ended_after_ms
        )?;
        let off = self
            .per_product
            .iter()
            .filter(|p| p.unaccounted != 0)
            .count();
        writeln!(
            out,
            "  {:<28} {} (stock read back: {} of {} products balance: available + confirmed = given)",
            "oversold units",
            self.oversold_units,
            self.per_product.len() - off,
            self.per_product.len()
        )
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
    r.problems = problems(&r);
    r.ok = r.problems.is_empty();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(per_product: Vec<ProductCheck>) -> CheckoutReport {
        CheckoutReport {
            mode: "checkout",
            base_url: "http://127.0.0.1:1".into(),
            seed: 1,
            products: per_product.len() as u32,
            stock_per_product: 10,
            buyers: 10,
            concurrency: 1,
            lines_per_cart: 3,
            qty_per_line: 1,
            ttl_s: 2,
            delay_ms: [0, 200],
            abandon: 0.2,
            release_share: 0.5,
            buyers_not_started: 0,
            elapsed_s: 1.0,
            counts: Counts::default(),
            units_confirmed: 0,
            orders_per_s: 0.0,
            latency: Steps::default(),
            retried: BTreeMap::new(),
            unexpected: BTreeMap::new(),
            holds_ended_after_ms: 0,
            units_left_held: 0,
            oversold_units: per_product.iter().map(|p| p.oversold).sum(),
            per_product,
            problems: Vec::new(),
            ok: false,
        }
    }

    #[test]
    fn a_product_whose_books_balance_passes() {
        // 10 given, 7 confirmed, 3 back on sale: nothing held, nothing lost.
        let p = ProductCheck::new("a".into(), 10, 7, 3);
        assert_eq!((p.oversold, p.unaccounted), (0, 0));
        assert!(problems(&report(vec![p])).is_empty());
    }

    #[test]
    fn units_confirmed_beyond_the_stock_are_oversold_and_fail_the_run() {
        // The incident: 12 units confirmed out of 10, and the service says 0 are left.
        let p = ProductCheck::new("a".into(), 10, 12, 0);
        assert_eq!((p.oversold, p.unaccounted), (2, -2));
        let found = problems(&report(vec![p]));
        assert!(found.iter().any(|m| m == "2 units oversold"), "{found:?}");
    }

    #[test]
    fn units_neither_sold_nor_on_sale_fail_the_run() {
        // An expired hold whose units never came back: 10 given, 6 sold, 2 on sale.
        let p = ProductCheck::new("a".into(), 10, 6, 2);
        assert_eq!((p.oversold, p.unaccounted), (0, 2));
        let found = problems(&report(vec![p]));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("off by 2"), "{found:?}");
    }

    #[test]
    fn held_units_unexpected_answers_and_unknown_outcomes_each_fail_the_run() {
        let ok = || report(vec![ProductCheck::new("a".into(), 10, 10, 0)]);
        assert!(problems(&ok()).is_empty());
        let mut r = ok();
        r.units_left_held = 3;
        assert_eq!(problems(&r).len(), 1);
        let mut r = ok();
        r.unexpected.insert("confirm: 500".into(), 1);
        assert_eq!(problems(&r).len(), 1);
        let mut r = ok();
        r.counts.unresolved = 1;
        assert_eq!(problems(&r).len(), 1);
        let mut r = ok();
        r.per_product[0].covers_end = false;
        assert_eq!(problems(&r).len(), 1);
    }

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
