//! Reports: the numbers each mode derives from its samples (oversold, units per buyer
//! against the per-customer limit, sell-out moment, lying availability answers, rates,
//! percentiles), the structs written as JSON, and their plain-text rendering.

use crate::samples::{AvailSample, FinalRead, OrderOutcome, OrderSample, SaleRun};
use crate::stats::{ServedBy, Tally, histogram};
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};

// ---------------------------------------------------------------------------------------
// Derived numbers
// ---------------------------------------------------------------------------------------

/// Units confirmed beyond the stock there was. Anything above 0 is a broken promise.
pub fn oversold(confirmed_units: u64, stock: u64) -> u64 {
    confirmed_units.saturating_sub(stock)
}

/// Units one buyer got beyond the product's `max_per_customer` (none without a limit).
/// Anything above 0 is a broken promise, like overselling the stock.
pub fn over_limit(buyer_units: u64, max_per_customer: Option<u32>) -> u64 {
    max_per_customer.map_or(0, |limit| buyer_units.saturating_sub(u64::from(limit)))
}

/// What one buyer's orders came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuyerUnits {
    /// Units of its confirmed orders (confirmed orders × their quantity).
    pub units: u64,
    /// Some order of its ended without a known outcome (timeout, 503, ...): it may hold
    /// more units than we saw confirmed.
    pub unknown: bool,
}

/// Per buyer (by number), the units its confirmed orders took; every buyer with an order
/// is there, also one that got nothing.
pub fn units_per_buyer(orders: &[OrderSample]) -> HashMap<u64, BuyerUnits> {
    let mut by: HashMap<u64, BuyerUnits> = HashMap::new();
    for o in orders {
        let b = by.entry(o.buyer).or_default();
        b.units += confirmed_units(o);
        b.unknown |= matches!(o.outcome, OrderOutcome::Failed(_));
    }
    by
}

/// Whether a 409 LIMIT_EXCEEDED saying `limit` and `already` to a buyer who ended with
/// `buyer` cannot be true for a product limited to `max_per_customer` and orders of `qty`:
/// the product has no limit or another one; the request would have fit (`already + qty`
/// within the limit); or the buyer is said to have had more units than all its confirmed
/// orders (with every outcome known — units only grow, nothing is cancelled).
pub fn false_limit_refusal(
    limit: u32,
    already: u32,
    qty: u32,
    buyer: BuyerUnits,
    max_per_customer: Option<u32>,
) -> bool {
    max_per_customer != Some(limit)
        || u64::from(already) + u64::from(qty) <= u64::from(limit)
        || (!buyer.unknown && u64::from(already) > buyer.units)
}

/// The moment (µs from t0) the last unit was confirmed: the latest 201 answer, once the
/// stock is gone — either our confirmations leave less than one order's worth, or the
/// service's final stock does (it may have confirmed orders whose answers we lost).
/// `None` when the sale never sold out.
pub fn sell_out_moment(
    orders: &[OrderSample],
    stock: u64,
    qty: u64,
    final_stock: Option<i64>,
) -> Option<u64> {
    let units: u64 = orders.iter().map(confirmed_units).sum();
    let ours = units + qty > stock;
    let theirs = final_stock.is_some_and(|s| s < qty as i64);
    if !(ours || theirs) {
        return None;
    }
    orders
        .iter()
        .filter(|o| is_confirmed(o))
        .map(|o| o.recv_us)
        .max()
}

fn confirmed_units(o: &OrderSample) -> u64 {
    match o.outcome {
        OrderOutcome::Confirmed { quantity } => u64::from(quantity),
        _ => 0,
    }
}

/// Availability answers that lie: `available: true`, received after the sell-out moment,
/// and claiming (`as_of`) to reflect a moment after it — when no stock was left.
pub fn lying_answers(avail: &[AvailSample], sell_out_us: u64) -> u64 {
    avail
        .iter()
        .filter(|s| s.recv_us > sell_out_us)
        .filter_map(|s| s.outcome.as_ref().ok())
        .filter(|a| a.available && a.as_of_us > sell_out_us as i64)
        .count() as u64
}

/// Events per second over `window_us`; 0 for an empty window.
pub fn per_second(count: u64, window_us: u64) -> f64 {
    if window_us == 0 {
        0.0
    } else {
        count as f64 * 1e6 / window_us as f64
    }
}

// ---------------------------------------------------------------------------------------
// Latency percentiles
// ---------------------------------------------------------------------------------------

/// Percentiles of one endpoint's latencies, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    /// From a histogram of microseconds.
    pub fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            count: h.len(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p95_ms: ms(h.value_at_quantile(0.95)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }

    pub fn of_us(values: impl IntoIterator<Item = u64>) -> Self {
        let mut h = histogram();
        for v in values {
            h.saturating_record(v.max(1));
        }
        Self::of(&h)
    }
}

/// "0.84 ms", "12.3 ms", "1.25 s".
pub fn fmt_ms(ms: f64) -> String {
    if ms < 10.0 {
        format!("{ms:.2} ms")
    } else if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// "1234/s", "12.5/s".
pub fn fmt_rate(per_s: f64) -> String {
    if per_s >= 100.0 {
        format!("{per_s:.0}/s")
    } else {
        format!("{per_s:.1}/s")
    }
}

fn latency_table(out: &mut String, rows: &[(&str, &LatencySummary)]) -> fmt::Result {
    writeln!(
        out,
        "  {:<26} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "", "count", "p50", "p95", "p99", "max"
    )?;
    for (name, l) in rows {
        if l.count == 0 {
            writeln!(out, "  {name:<26} {:>8} {:>10}", 0, "-")?;
        } else {
            writeln!(
                out,
                "  {name:<26} {:>8} {:>10} {:>10} {:>10} {:>10}",
                l.count,
                fmt_ms(l.p50_ms),
                fmt_ms(l.p95_ms),
                fmt_ms(l.p99_ms),
                fmt_ms(l.max_ms)
            )?;
        }
    }
    Ok(())
}

fn error_lines(out: &mut String, errors: &BTreeMap<String, u64>) -> fmt::Result {
    for (label, n) in errors {
        writeln!(out, "    {label:<24} {n}")?;
    }
    Ok(())
}

fn served_by_lines(out: &mut String, by: &BTreeMap<String, ServedBy>) -> fmt::Result {
    for (name, s) in by {
        writeln!(
            out,
            "  {name:<26} {:>8} answers, max stale_by_ms {}{}",
            s.answers,
            s.max_stale_by_ms,
            if s.over_limit > 0 {
                format!(", {} over the limit", s.over_limit)
            } else {
                String::new()
            }
        )?;
    }
    Ok(())
}

/// One line per replica from a `/v1/admin/replicas` answer.
pub fn replica_summary(v: &Value) -> String {
    let Some(replicas) = v.get("replicas").and_then(Value::as_array) else {
        return "unknown".into();
    };
    replicas
        .iter()
        .map(|r| {
            let field = |k: &str| {
                r.get(k).map_or("?".into(), |x| match x {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
            };
            format!(
                "{} {} ({} ms stale, {} bytes behind)",
                field("name"),
                field("state"),
                field("staleness_ms"),
                field("lag_bytes")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn verdict(out: &mut String, problems: &[String]) -> fmt::Result {
    if problems.is_empty() {
        writeln!(out, "verdict: OK")
    } else {
        writeln!(out, "verdict: FAIL")?;
        for p in problems {
            writeln!(out, "  - {p}")?;
        }
        Ok(())
    }
}

/// One `  name   value` row of a report section.
fn line(out: &mut String, name: &str, value: impl fmt::Display) -> fmt::Result {
    writeln!(out, "  {name:<26} {value}")
}

/// Requests that failed, counted by label (status and error code, or a transport label).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Failures {
    pub errors_total: u64,
    pub errors: BTreeMap<String, u64>,
}

impl Failures {
    fn add(&mut self, label: &str) {
        self.errors_total += 1;
        *self.errors.entry(label.to_string()).or_default() += 1;
    }

    fn of(errors: &BTreeMap<String, u64>) -> Self {
        Self {
            errors_total: errors.values().sum(),
            errors: errors.clone(),
        }
    }

    /// The `errors` row, then one row per label.
    fn render_into(&self, out: &mut String) -> fmt::Result {
        line(out, "errors", self.errors_total)?;
        error_lines(out, &self.errors)
    }
}

/// Earliest sent and latest received of samples given as `(sent_us, recv_us)`; 0 when none.
fn span(samples: impl Iterator<Item = (u64, u64)>) -> (u64, u64) {
    let (first, last) = samples.fold((None, None), |(f, l): (Option<u64>, _), (s, r)| {
        (Some(f.map_or(s, |f| f.min(s))), l.max(Some(r)))
    });
    (first.unwrap_or(0), last.unwrap_or(0))
}

fn is_confirmed(o: &OrderSample) -> bool {
    matches!(o.outcome, OrderOutcome::Confirmed { .. })
}

// ---------------------------------------------------------------------------------------
// flash-sale and sell-out
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize)]
pub struct OrderCounts {
    pub sent: u64,
    pub confirmed_orders: u64,
    pub confirmed_units: u64,
    pub out_of_stock: u64,
    /// 409 LIMIT_EXCEEDED: the order would have taken its buyer past `max_per_customer`.
    pub limit_exceeded: u64,
    /// Anything but 201 and 409 OUT_OF_STOCK / LIMIT_EXCEEDED, by status and error code.
    #[serde(flatten)]
    pub failed: Failures,
    /// Orders never sent because the --max-seconds safety stop came first.
    pub not_sent: u64,
}

impl OrderCounts {
    fn of(run: &SaleRun) -> Self {
        let mut c = Self {
            sent: run.orders.len() as u64,
            confirmed_orders: 0,
            confirmed_units: 0,
            out_of_stock: 0,
            limit_exceeded: 0,
            failed: Failures::default(),
            not_sent: run.not_sent,
        };
        for o in &run.orders {
            match &o.outcome {
                OrderOutcome::Confirmed { quantity } => {
                    c.confirmed_orders += 1;
                    c.confirmed_units += u64::from(*quantity);
                }
                OrderOutcome::OutOfStock => c.out_of_stock += 1,
                OrderOutcome::LimitExceeded { .. } => c.limit_exceeded += 1,
                OrderOutcome::Failed(label) => c.failed.add(label),
            }
        }
        c
    }
}

/// What the buyers got one by one, against the product's `max_per_customer`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PerBuyer {
    pub attempts_per_buyer: u32,
    /// The product's limit; `None`: the run gave it none.
    pub max_per_customer: Option<u32>,
    /// The most units any single buyer got (its confirmed orders × qty).
    pub max_units_one_buyer: u64,
    /// A buyer that got that many (the lowest-numbered), when any got a unit.
    pub top_buyer: Option<String>,
    /// Buyers that got at least one unit.
    pub buyers_with_units: u64,
    /// Buyers given more than the limit, and the units beyond it in all. Must be 0.
    pub buyers_over_limit: u64,
    pub units_over_limit: u64,
    /// 409 LIMIT_EXCEEDED answers that cannot be true (see [`false_limit_refusal`]). Must be 0.
    pub false_limit_refusals: u64,
}

impl PerBuyer {
    pub fn of(orders: &[OrderSample], spec: &crate::samples::SaleSpec) -> Self {
        let limit = spec.max_per_customer;
        let by = units_per_buyer(orders);
        let mut p = Self {
            attempts_per_buyer: spec.attempts_per_buyer,
            max_per_customer: limit,
            ..Self::default()
        };
        for b in by.values() {
            p.buyers_with_units += u64::from(b.units > 0);
            let over = over_limit(b.units, limit);
            if over > 0 {
                p.buyers_over_limit += 1;
                p.units_over_limit += over;
            }
        }
        let top = by
            .iter()
            .filter(|(_, b)| b.units > 0)
            .max_by_key(|&(&n, b)| (b.units, std::cmp::Reverse(n)));
        if let Some((n, b)) = top {
            p.max_units_one_buyer = b.units;
            p.top_buyer = Some(format!("buyer-{n}"));
        }
        p.false_limit_refusals = orders
            .iter()
            .filter(|o| match o.outcome {
                OrderOutcome::LimitExceeded { limit: l, already } => {
                    let b = by.get(&o.buyer).copied().unwrap_or_default();
                    false_limit_refusal(l, already, spec.qty, b, limit)
                }
                _ => false,
            })
            .count() as u64;
        p
    }

    /// Whether the report shows a per-buyer section: a limit, or buyers trying again.
    pub fn shown(&self) -> bool {
        self.max_per_customer.is_some() || self.attempts_per_buyer > 1
    }

    /// "2 (limit 2)", "3 (no limit)".
    pub fn most_to_one_buyer(&self) -> String {
        match self.max_per_customer {
            Some(l) => format!("{} (limit {l})", self.max_units_one_buyer),
            None => format!("{} (no limit)", self.max_units_one_buyer),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SaleTiming {
    pub sold_out: bool,
    /// First order sent → the last unit's confirmation received.
    pub time_to_sell_out_ms: Option<f64>,
    /// First order sent → last order answered.
    pub total_ms: f64,
    pub order_requests_per_s: f64,
    pub availability_requests_per_s: f64,
    pub requests_per_s: f64,
    /// 409 OUT_OF_STOCK answers received after the sell-out moment.
    pub rejections_after_sell_out: u64,
    /// Sell-out moment → last order answered.
    pub after_sell_out_ms: Option<f64>,
    pub rejections_per_s_after_sell_out: Option<f64>,
}

impl SaleTiming {
    fn of(run: &SaleRun, sell_out: Option<u64>, rejected_after: u64) -> Self {
        let (first_sent, last_recv) = span(run.orders.iter().map(|o| (o.sent_us, o.recv_us)));
        let (avail_first, avail_last) = span(run.avail.iter().map(|s| (s.sent_us, s.recv_us)));
        let total_us = last_recv.saturating_sub(first_sent);
        let all_window = last_recv
            .max(avail_last)
            .saturating_sub(first_sent.min(avail_first));
        let (orders, avail) = (run.orders.len() as u64, run.avail.len() as u64);
        let after_us = sell_out.map(|t| last_recv.saturating_sub(t));
        Self {
            sold_out: sell_out.is_some(),
            time_to_sell_out_ms: sell_out.map(|t| t.saturating_sub(first_sent) as f64 / 1000.0),
            total_ms: total_us as f64 / 1000.0,
            order_requests_per_s: per_second(orders, total_us),
            availability_requests_per_s: per_second(avail, avail_last.saturating_sub(avail_first)),
            requests_per_s: per_second(orders + avail, all_window),
            rejections_after_sell_out: rejected_after,
            after_sell_out_ms: after_us.map(|us| us as f64 / 1000.0),
            rejections_per_s_after_sell_out: after_us.map(|us| per_second(rejected_after, us)),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SaleLatency {
    pub orders: LatencySummary,
    pub orders_confirmed: LatencySummary,
    pub orders_rejected_after_sell_out: LatencySummary,
    pub availability: LatencySummary,
}

impl SaleLatency {
    fn of(run: &SaleRun, rejected_after: &[&OrderSample]) -> Self {
        let orders = |keep: fn(&OrderSample) -> bool| {
            LatencySummary::of_us(
                run.orders
                    .iter()
                    .filter(|o| keep(o))
                    .map(|o| o.latency_us()),
            )
        };
        Self {
            orders: orders(|_| true),
            orders_confirmed: orders(is_confirmed),
            orders_rejected_after_sell_out: LatencySummary::of_us(
                rejected_after.iter().map(|o| o.latency_us()),
            ),
            availability: LatencySummary::of_us(run.avail.iter().map(AvailSample::latency_us)),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AvailabilitySeen {
    pub requests: u64,
    pub answers: u64,
    #[serde(flatten)]
    pub failed: Failures,
    pub by_served_by: BTreeMap<String, ServedBy>,
    pub max_stale_by_ms: u64,
    /// `available: true` answers received after the sell-out moment (any `as_of`).
    pub available_true_after_sell_out: u64,
    /// ... of those, the ones whose `as_of` is after the sell-out moment: lies. Must be 0.
    pub lying_after_sell_out: u64,
    /// Pollers stopped early because the in-memory sample cap was reached.
    pub capped: bool,
}

impl AvailabilitySeen {
    fn of(run: &SaleRun, sell_out: Option<u64>) -> Self {
        let mut seen = Self {
            requests: run.avail.len() as u64,
            answers: 0,
            failed: Failures::default(),
            by_served_by: BTreeMap::new(),
            max_stale_by_ms: 0,
            available_true_after_sell_out: 0,
            lying_after_sell_out: sell_out.map_or(0, |t| lying_answers(&run.avail, t)),
            capped: run.avail_capped,
        };
        for s in &run.avail {
            match &s.outcome {
                Ok(a) => {
                    seen.answers += 1;
                    let e = seen.by_served_by.entry(a.served_by.clone()).or_default();
                    e.answers += 1;
                    e.max_stale_by_ms = e.max_stale_by_ms.max(a.stale_by_ms);
                    seen.max_stale_by_ms = seen.max_stale_by_ms.max(a.stale_by_ms);
                    if a.available && sell_out.is_some_and(|t| s.recv_us > t) {
                        seen.available_true_after_sell_out += 1;
                    }
                }
                Err(label) => seen.failed.add(label),
            }
        }
        seen
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct AfterSale {
    pub expected_available_quantity: i64,
    pub reported: Option<FinalRead>,
    pub read_error: Option<String>,
    pub matches: bool,
}

impl AfterSale {
    fn of(final_read: &Result<FinalRead, String>, expected: i64) -> Self {
        Self {
            expected_available_quantity: expected,
            reported: final_read.as_ref().ok().cloned(),
            read_error: final_read.as_ref().err().cloned(),
            matches: final_read
                .as_ref()
                .is_ok_and(|r| r.available_quantity == expected),
        }
    }
}

/// What every mode's report gives: its text, and whether the run passed. The JSON is the
/// report itself (`Serialize`).
pub trait Report: Serialize {
    fn render_into(&self, out: &mut String) -> fmt::Result;

    fn passed(&self) -> bool;

    fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.render_into(&mut out);
        out
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SaleReport {
    pub mode: String,
    pub base_url: String,
    pub product_id: String,
    pub started_at: String,
    /// From creating the product to availability answering 200 for it (before the clock).
    pub product_visible_after_ms: u64,
    pub stock: u32,
    pub buyers: u64,
    pub concurrency: u32,
    pub qty: u32,
    pub pollers: u32,
    pub orders: OrderCounts,
    pub oversold: u64,
    /// Units per buyer against `max_per_customer` (with the run's attempts per buyer).
    pub per_buyer: PerBuyer,
    pub timing: SaleTiming,
    pub latency: SaleLatency,
    pub availability: AvailabilitySeen,
    pub after: AfterSale,
    pub replicas_before: Option<Value>,
    pub replicas_after: Option<Value>,
    pub ok: bool,
    pub problems: Vec<String>,
}

impl SaleReport {
    pub fn build(run: &SaleRun) -> Self {
        let spec = &run.spec;
        let (stock, qty) = (u64::from(spec.stock), u64::from(spec.qty));
        let orders = OrderCounts::of(run);
        let final_stock = run.final_read.as_ref().ok().map(|r| r.available_quantity);
        let sell_out = sell_out_moment(&run.orders, stock, qty, final_stock);
        let rejected_after: Vec<&OrderSample> = run
            .orders
            .iter()
            .filter(|o| sell_out.is_some_and(|t| o.recv_us > t))
            .filter(|o| o.outcome == OrderOutcome::OutOfStock)
            .collect();
        let expected = i64::from(spec.stock) - orders.confirmed_units as i64;
        let mut r = Self {
            mode: spec.mode.to_string(),
            base_url: spec.base_url.clone(),
            product_id: spec.product_id.clone(),
            started_at: run.clock.started_at().to_rfc3339(),
            product_visible_after_ms: run.product_visible_after_ms,
            stock: spec.stock,
            buyers: spec.buyers,
            concurrency: spec.concurrency,
            qty: spec.qty,
            pollers: spec.pollers,
            oversold: oversold(orders.confirmed_units, stock),
            per_buyer: PerBuyer::of(&run.orders, spec),
            orders,
            timing: SaleTiming::of(run, sell_out, rejected_after.len() as u64),
            latency: SaleLatency::of(run, &rejected_after),
            availability: AvailabilitySeen::of(run, sell_out),
            after: AfterSale::of(&run.final_read, expected),
            replicas_before: run.replicas_before.clone(),
            replicas_after: run.replicas_after.clone(),
            ok: false,
            problems: Vec::new(),
        };
        r.problems = r.find_problems();
        r.ok = r.problems.is_empty();
        r
    }

    /// What went wrong, one sentence each; empty means the sale passed.
    fn find_problems(&self) -> Vec<String> {
        let (o, seen, after) = (&self.orders, &self.availability, &self.after);
        let mut problems = Vec::new();
        if self.oversold > 0 {
            problems.push(format!("OVERSOLD by {} units", self.oversold));
        }
        let b = &self.per_buyer;
        if let (true, Some(limit), Some(top)) =
            (b.buyers_over_limit > 0, b.max_per_customer, &b.top_buyer)
        {
            problems.push(format!(
                "OVERSOLD TO ONE BUYER: {top} got {} units with max_per_customer {limit} \
                 ({} buyers over the limit, {} units beyond it)",
                b.max_units_one_buyer, b.buyers_over_limit, b.units_over_limit
            ));
        }
        if b.false_limit_refusals > 0 {
            problems.push(format!(
                "{} LIMIT_EXCEEDED answers cannot be true (no such limit, or the buyer had \
                 fewer units than they say)",
                b.false_limit_refusals
            ));
        }
        if o.failed.errors_total > 0 {
            problems.push(format!(
                "{} order requests failed unexpectedly (not 201/409)",
                o.failed.errors_total
            ));
        }
        if seen.failed.errors_total > 0 {
            problems.push(format!(
                "{} availability requests failed",
                seen.failed.errors_total
            ));
        }
        if seen.lying_after_sell_out > 0 {
            problems.push(format!(
                "{} availability answers said available after the sell-out, as of after it",
                seen.lying_after_sell_out
            ));
        }
        match &after.reported {
            Some(r) if !after.matches => problems.push(format!(
                "service reports available_quantity {} but stock − confirmed units = {}",
                r.available_quantity, after.expected_available_quantity
            )),
            None => problems.push("could not read the product back after the sale".into()),
            _ => {}
        }
        if o.not_sent > 0 {
            problems.push(format!(
                "stopped by --max-seconds: {} buyers never sent",
                o.not_sent
            ));
        }
        problems
    }

    fn render_header(&self, out: &mut String) -> fmt::Result {
        let b = &self.per_buyer;
        let attempts = match b.attempts_per_buyer {
            0 | 1 => String::new(),
            m => format!(" x {m} attempts"),
        };
        let limit = b
            .max_per_customer
            .map_or(String::new(), |l| format!(", limit {l} per customer"));
        writeln!(out, "== {} against {} ==", self.mode, self.base_url)?;
        writeln!(
            out,
            "product {}: stock {}{limit}, {} buyers{attempts} x qty {}, concurrency {}, {} pollers (started {})",
            self.product_id,
            self.stock,
            self.buyers,
            self.qty,
            self.concurrency,
            self.pollers,
            self.started_at
        )?;
        if let Some(r) = &self.replicas_before {
            writeln!(out, "replicas at start: {}", replica_summary(r))?;
        }
        writeln!(
            out,
            "product visible to availability {} ms after creation (before the clock started)",
            self.product_visible_after_ms
        )
    }

    fn render_orders(&self, out: &mut String) -> fmt::Result {
        let o = &self.orders;
        writeln!(out, "\norders")?;
        line(out, "sent", o.sent)?;
        line(
            out,
            "confirmed (201)",
            format_args!(
                "{} orders ({} units)",
                o.confirmed_orders, o.confirmed_units
            ),
        )?;
        line(out, "out of stock (409)", o.out_of_stock)?;
        if self.per_buyer.max_per_customer.is_some() || o.limit_exceeded > 0 {
            line(out, "limit exceeded (409)", o.limit_exceeded)?;
        }
        o.failed.render_into(out)?;
        if o.not_sent > 0 {
            line(out, "not sent (safety stop)", o.not_sent)?;
        }
        line(
            out,
            "OVERSOLD",
            format_args!("{}   (max(0, confirmed units - stock))", self.oversold),
        )
    }

    fn render_per_buyer(&self, out: &mut String) -> fmt::Result {
        let b = &self.per_buyer;
        if !b.shown() {
            return Ok(());
        }
        writeln!(out, "\nper buyer")?;
        line(out, "attempts per buyer", b.attempts_per_buyer)?;
        line(
            out,
            "max per customer",
            b.max_per_customer.map_or("none".into(), |l| l.to_string()),
        )?;
        let top = b
            .top_buyer
            .as_ref()
            .map_or(String::new(), |t| format!("   ({t})"));
        line(
            out,
            "most units to one buyer",
            format_args!("{}{top}", b.most_to_one_buyer()),
        )?;
        line(out, "buyers with units", b.buyers_with_units)?;
        if b.max_per_customer.is_some() {
            line(
                out,
                "OVER LIMIT",
                format_args!(
                    "{}   (buyers given more than max_per_customer, {} units beyond it; must be 0)",
                    b.buyers_over_limit, b.units_over_limit
                ),
            )?;
        }
        if b.max_per_customer.is_some() || b.false_limit_refusals > 0 {
            line(
                out,
                "false limit refusals",
                format_args!(
                    "{}   (LIMIT_EXCEEDED that cannot be true; must be 0)",
                    b.false_limit_refusals
                ),
            )?;
        }
        Ok(())
    }

    fn render_timing(&self, out: &mut String) -> fmt::Result {
        let t = &self.timing;
        let sell_out = t
            .time_to_sell_out_ms
            .map_or("never (did not sell out)".into(), fmt_ms);
        writeln!(out, "\ntiming")?;
        line(out, "time to sell out", sell_out)?;
        line(out, "total time", fmt_ms(t.total_ms))?;
        line(out, "order requests", fmt_rate(t.order_requests_per_s))?;
        if self.pollers > 0 {
            let avail = fmt_rate(t.availability_requests_per_s);
            line(out, "availability requests", avail)?;
            line(out, "all requests", fmt_rate(t.requests_per_s))?;
        }
        if let (Some(after), Some(rate)) = (t.after_sell_out_ms, t.rejections_per_s_after_sell_out)
        {
            line(
                out,
                "rejections after sell-out",
                format_args!(
                    "{} in {} after sell-out = {}",
                    t.rejections_after_sell_out,
                    fmt_ms(after),
                    fmt_rate(rate)
                ),
            )?;
        }
        Ok(())
    }

    fn render_latency(&self, out: &mut String) -> fmt::Result {
        let l = &self.latency;
        writeln!(out, "\nlatency")?;
        let mut rows = vec![
            ("orders (all)", &l.orders),
            ("orders confirmed", &l.orders_confirmed),
            (
                "orders rejected after s/o",
                &l.orders_rejected_after_sell_out,
            ),
        ];
        if self.pollers > 0 {
            rows.push(("availability", &l.availability));
        }
        latency_table(out, &rows)
    }

    fn render_availability(&self, out: &mut String) -> fmt::Result {
        let a = &self.availability;
        writeln!(out, "\navailability answers")?;
        served_by_lines(out, &a.by_served_by)?;
        if a.failed.errors_total > 0 {
            a.failed.render_into(out)?;
        }
        line(out, "max stale_by_ms", a.max_stale_by_ms)?;
        line(
            out,
            "available:true after s/o",
            a.available_true_after_sell_out,
        )?;
        line(
            out,
            "LYING answers",
            format_args!(
                "{}   (available:true, received and as_of after sell-out; must be 0)",
                a.lying_after_sell_out
            ),
        )?;
        if a.capped {
            writeln!(out, "  (pollers stopped early: sample cap reached)")?;
        }
        Ok(())
    }

    fn render_after(&self, out: &mut String) -> fmt::Result {
        writeln!(out, "\nafter the sale")?;
        match (&self.after.reported, &self.after.read_error) {
            (Some(r), _) => line(
                out,
                "available_quantity",
                format_args!(
                    "{} (expected {}; {}; served_by {}, as_of {}, after {} ms{})",
                    r.available_quantity,
                    self.after.expected_available_quantity,
                    if self.after.matches {
                        "matches"
                    } else {
                        "MISMATCH"
                    },
                    r.served_by,
                    r.as_of,
                    r.waited_ms,
                    if r.covers_all_orders {
                        ""
                    } else {
                        ", NOT covering the last order"
                    }
                ),
            )?,
            (None, Some(e)) => writeln!(out, "  could not read the product: {e}")?,
            (None, None) => writeln!(out, "  not read")?,
        }
        if let Some(r) = &self.replicas_after {
            writeln!(out, "  replicas: {}", replica_summary(r))?;
        }
        writeln!(out)?;
        verdict(out, &self.problems)
    }
}

// ---------------------------------------------------------------------------------------
// hot-sku and availability
// ---------------------------------------------------------------------------------------

/// What a timed run was asked and how it went, apart from the tally.
pub struct TimedMeta {
    pub base_url: String,
    pub product_id: String,
    pub seconds: u64,
    pub concurrency: u32,
    pub qty: u32,
    pub elapsed_us: u64,
    pub stopped_by_max_seconds: bool,
}

/// The report of a timed mode (hot-sku, availability): C workers calling back-to-back.
#[derive(Debug, Clone, Serialize)]
pub struct TimedReport {
    pub mode: String,
    pub base_url: String,
    pub product_id: String,
    pub seconds: u64,
    pub concurrency: u32,
    pub qty: u32,
    pub elapsed_s: f64,
    pub requests: u64,
    /// What the successful calls were: confirmed orders or availability answers.
    #[serde(flatten)]
    pub seen: Seen,
    #[serde(flatten)]
    pub failed: Failures,
    pub requests_per_s: f64,
    pub latency: LatencySummary,
    pub stopped_by_max_seconds: bool,
    pub ok: bool,
    pub problems: Vec<String>,
}

/// The mode's own numbers.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Seen {
    /// hot-sku: orders placed back-to-back on one product.
    Orders {
        confirmed_orders: u64,
        confirmed_units: u64,
        out_of_stock: u64,
        confirmed_per_s: f64,
    },
    /// availability: GET availability back-to-back on one product.
    Answers {
        answers: u64,
        by_served_by: BTreeMap<String, ServedBy>,
        max_stale_by_ms: u64,
        stale_limit_ms: u64,
        /// Replica answers with `stale_by_ms` over the limit (should be 0).
        replica_answers_over_limit: u64,
    },
}

impl Seen {
    fn orders(t: &Tally, elapsed_us: u64) -> Self {
        Self::Orders {
            confirmed_orders: t.ok,
            confirmed_units: t.units,
            out_of_stock: t.out_of_stock,
            confirmed_per_s: per_second(t.ok, elapsed_us),
        }
    }

    fn answers(t: &Tally, stale_limit_ms: u64) -> Self {
        let replicas = t.served_by.iter().filter(|(name, _)| *name != "primary");
        Self::Answers {
            answers: t.ok,
            by_served_by: t.served_by.clone(),
            max_stale_by_ms: t
                .served_by
                .values()
                .map(|s| s.max_stale_by_ms)
                .max()
                .unwrap_or(0),
            stale_limit_ms,
            replica_answers_over_limit: replicas.map(|(_, s)| s.over_limit).sum(),
        }
    }

    /// The mode's name and what its requests were called (as in "N order requests failed").
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            Self::Orders { .. } => ("hot-sku", "order"),
            Self::Answers { .. } => ("availability", "availability"),
        }
    }

    /// The mode's own failure, if any, then what it says when no call succeeded.
    fn problems(&self) -> (Option<String>, &'static str) {
        match self {
            Self::Orders { out_of_stock, .. } => (
                (*out_of_stock > 0).then(|| {
                    format!("{out_of_stock} orders out of stock (the hot product ran out)")
                }),
                "no order was confirmed",
            ),
            Self::Answers {
                stale_limit_ms,
                replica_answers_over_limit: over,
                ..
            } => (
                (*over > 0).then(|| {
                    format!("{over} replica answers were more than {stale_limit_ms} ms stale")
                }),
                "no availability answer",
            ),
        }
    }
}

impl TimedReport {
    pub fn hot_sku(m: TimedMeta, t: &Tally) -> Self {
        let seen = Seen::orders(t, m.elapsed_us);
        Self::build(m, t, seen)
    }

    pub fn availability(m: TimedMeta, t: &Tally, stale_limit_ms: u64) -> Self {
        Self::build(m, t, Seen::answers(t, stale_limit_ms))
    }

    fn build(m: TimedMeta, t: &Tally, seen: Seen) -> Self {
        let (mode, noun) = seen.names();
        let (own, none_ok) = seen.problems();
        let mut problems = Vec::new();
        if t.errors_total() > 0 {
            problems.push(format!("{} {noun} requests failed", t.errors_total()));
        }
        problems.extend(own);
        if t.ok == 0 {
            problems.push(none_ok.into());
        }
        if m.stopped_by_max_seconds {
            problems.push("stopped early by --max-seconds".into());
        }
        Self {
            mode: mode.into(),
            base_url: m.base_url,
            product_id: m.product_id,
            seconds: m.seconds,
            concurrency: m.concurrency,
            qty: m.qty,
            elapsed_s: m.elapsed_us as f64 / 1e6,
            requests: t.requests(),
            seen,
            failed: Failures::of(&t.errors),
            requests_per_s: per_second(t.requests(), m.elapsed_us),
            latency: LatencySummary::of(&t.latency),
            stopped_by_max_seconds: m.stopped_by_max_seconds,
            ok: problems.is_empty(),
            problems,
        }
    }
}

impl Seen {
    /// The rows that count successful calls.
    fn counts_into(&self, out: &mut String) -> fmt::Result {
        match self {
            Self::Orders {
                confirmed_orders,
                confirmed_units,
                out_of_stock,
                ..
            } => {
                let orders = format!("{confirmed_orders} orders ({confirmed_units} units)");
                line(out, "confirmed (201)", orders)?;
                line(out, "out of stock (409)", out_of_stock)
            }
            Self::Answers { answers, .. } => line(out, "answers (200)", answers),
        }
    }

    /// The rate rows above the `requests` rate.
    fn rates_into(&self, out: &mut String) -> fmt::Result {
        match self {
            Self::Orders {
                confirmed_per_s, ..
            } => line(out, "confirmed orders", fmt_rate(*confirmed_per_s)),
            Self::Answers { .. } => Ok(()),
        }
    }

    /// The availability answers by `served_by` and their staleness.
    fn answers_into(&self, out: &mut String) -> fmt::Result {
        let Self::Answers {
            by_served_by,
            max_stale_by_ms,
            stale_limit_ms,
            replica_answers_over_limit: over,
            ..
        } = self
        else {
            return Ok(());
        };
        writeln!(out, "\nanswers by served_by")?;
        served_by_lines(out, by_served_by)?;
        line(out, "max stale_by_ms", max_stale_by_ms)?;
        line(
            out,
            "too stale",
            format_args!(
                "{over}   (replica answers with stale_by_ms > {stale_limit_ms}; should be 0)"
            ),
        )
    }
}

impl Report for SaleReport {
    fn render_into(&self, out: &mut String) -> fmt::Result {
        self.render_header(out)?;
        self.render_orders(out)?;
        self.render_per_buyer(out)?;
        self.render_timing(out)?;
        self.render_latency(out)?;
        if self.pollers == 0 {
            writeln!(out, "\navailability answers: none (no pollers)")?;
        } else {
            self.render_availability(out)?;
        }
        self.render_after(out)
    }

    fn passed(&self) -> bool {
        self.ok
    }
}

impl Report for TimedReport {
    fn render_into(&self, out: &mut String) -> fmt::Result {
        let (asking, latency_row) = match self.seen {
            Seen::Orders { .. } => (format!("ordering qty {}", self.qty), "orders"),
            Seen::Answers { .. } => (format!("asking qty={}", self.qty), "availability"),
        };
        writeln!(out, "== {} against {} ==", self.mode, self.base_url)?;
        writeln!(
            out,
            "product {}: {} workers {asking} back-to-back for {} s (ran {:.2} s)",
            self.product_id, self.concurrency, self.seconds, self.elapsed_s
        )?;
        writeln!(out)?;
        line(out, "requests", self.requests)?;
        self.seen.counts_into(out)?;
        self.failed.render_into(out)?;
        self.seen.rates_into(out)?;
        line(out, "requests", fmt_rate(self.requests_per_s))?;
        writeln!(out, "\nlatency")?;
        latency_table(out, &[(latency_row, &self.latency)])?;
        self.seen.answers_into(out)?;
        writeln!(out)?;
        verdict(out, &self.problems)
    }

    fn passed(&self) -> bool {
        self.ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::samples::{AvailAnswer, Clock, SaleSpec};

    /// An order of its own buyer (one order per buyer, as without attempts).
    fn order(recv_us: u64, outcome: OrderOutcome) -> OrderSample {
        buyer_order(recv_us, recv_us, outcome)
    }

    fn buyer_order(buyer: u64, recv_us: u64, outcome: OrderOutcome) -> OrderSample {
        OrderSample {
            buyer,
            sent_us: recv_us.saturating_sub(1_000),
            recv_us,
            outcome,
        }
    }

    fn confirmed(recv_us: u64) -> OrderSample {
        order(recv_us, OrderOutcome::Confirmed { quantity: 1 })
    }

    fn answer(recv_us: u64, available: bool, as_of_us: i64) -> AvailSample {
        AvailSample {
            sent_us: recv_us.saturating_sub(500),
            recv_us,
            outcome: Ok(AvailAnswer {
                available,
                available_quantity: i64::from(available),
                as_of_us,
                stale_by_ms: 0,
                served_by: "replica-1".into(),
            }),
        }
    }

    #[test]
    fn oversold_is_units_beyond_stock_never_negative() {
        assert_eq!(oversold(60, 60), 0);
        assert_eq!(oversold(12, 60), 0);
        assert_eq!(oversold(61, 60), 1);
        assert_eq!(oversold(0, 0), 0);
    }

    #[test]
    fn sell_out_is_the_last_confirmation_once_stock_is_gone() {
        let orders = vec![
            confirmed(5_000),
            order(6_000, OrderOutcome::OutOfStock),
            confirmed(9_000),
            order(12_000, OrderOutcome::OutOfStock),
        ];
        assert_eq!(sell_out_moment(&orders, 2, 1, None), Some(9_000));
        // Stock left over: no sell-out...
        assert_eq!(sell_out_moment(&orders, 3, 1, Some(1)), None);
        // ...unless the service says it is gone (an answer we lost was a confirmation).
        assert_eq!(sell_out_moment(&orders, 3, 1, Some(0)), Some(9_000));
        // With qty 2, one unit left can not be sold: that is a sell-out.
        let twos = vec![order(4_000, OrderOutcome::Confirmed { quantity: 2 })];
        assert_eq!(sell_out_moment(&twos, 3, 2, None), Some(4_000));
        assert_eq!(sell_out_moment(&[], 3, 1, None), None);
    }

    #[test]
    fn lying_answers_need_available_true_and_as_of_after_sell_out() {
        let sell_out = 10_000;
        let samples = vec![
            answer(8_000, true, 7_000),    // before sell-out: honest
            answer(11_000, true, 9_000),   // after, but as of before: stale, not a lie
            answer(12_000, true, 10_500),  // after, as of after, says available: LIE
            answer(13_000, false, 12_000), // after, says sold out: honest
            answer(14_000, true, 10_000),  // as_of exactly at sell-out: not after
            AvailSample {
                sent_us: 14_000,
                recv_us: 15_000,
                outcome: Err("503 OVERLOADED".into()),
            },
        ];
        assert_eq!(lying_answers(&samples, sell_out), 1);
        assert_eq!(lying_answers(&samples, 20_000), 0);
    }

    #[test]
    fn percentiles_are_reported_in_ms() {
        let l = LatencySummary::of_us((1..=100).map(|i| i * 1000));
        assert_eq!(l.count, 100);
        assert!((l.p50_ms - 50.0).abs() < 0.1, "{l:?}");
        assert!((l.p95_ms - 95.0).abs() < 0.1, "{l:?}");
        assert!((l.p99_ms - 99.0).abs() < 0.1, "{l:?}");
        assert!((l.max_ms - 100.0).abs() < 0.1, "{l:?}");
        assert_eq!(LatencySummary::of_us([]), LatencySummary::default());
    }

    #[test]
    fn durations_and_rates_format_readably() {
        assert_eq!(fmt_ms(0.8421), "0.84 ms");
        assert_eq!(fmt_ms(12.34), "12.3 ms");
        assert_eq!(fmt_ms(1250.0), "1.25 s");
        assert_eq!(fmt_rate(1234.4), "1234/s");
        assert_eq!(fmt_rate(12.345), "12.3/s");
        assert_eq!(per_second(500, 250_000), 2000.0);
        assert_eq!(per_second(5, 0), 0.0);
    }

    fn run(orders: Vec<OrderSample>, avail: Vec<AvailSample>, final_qty: i64) -> SaleRun {
        SaleRun {
            spec: SaleSpec {
                mode: "flash-sale",
                base_url: "http://127.0.0.1:1".into(),
                product_id: "p".into(),
                stock: 2,
                buyers: orders.len() as u64,
                attempts_per_buyer: 1,
                max_per_customer: None,
                concurrency: 2,
                qty: 1,
                pollers: 1,
            },
            clock: Clock::start(),
            product_visible_after_ms: 0,
            orders,
            avail,
            not_sent: 0,
            avail_capped: false,
            final_read: Ok(FinalRead {
                available_quantity: final_qty,
                served_by: "primary".into(),
                as_of: "2026-01-01T00:00:00.000Z".into(),
                covers_all_orders: true,
                waited_ms: 0,
            }),
            replicas_before: None,
            replicas_after: None,
        }
    }

    #[test]
    fn a_clean_sale_passes() {
        let orders = vec![
            confirmed(2_000),
            confirmed(3_000),
            order(4_000, OrderOutcome::OutOfStock),
            order(6_000, OrderOutcome::OutOfStock),
        ];
        let avail = vec![answer(1_000, true, 500), answer(5_000, false, 4_000)];
        let r = SaleReport::build(&run(orders, avail, 0));
        assert!(r.ok, "{:?}", r.problems);
        assert_eq!(r.oversold, 0);
        assert_eq!(r.orders.confirmed_units, 2);
        assert_eq!(r.orders.out_of_stock, 2);
        assert_eq!(r.timing.time_to_sell_out_ms, Some(2.0));
        assert_eq!(r.timing.rejections_after_sell_out, 2);
        assert_eq!(r.timing.after_sell_out_ms, Some(3.0));
        assert_eq!(r.availability.by_served_by["replica-1"].answers, 2);
        let text = r.render();
        assert!(text.contains("verdict: OK"), "{text}");
        assert!(text.contains("OVERSOLD"), "{text}");
    }

    #[test]
    fn oversell_errors_lies_and_stock_mismatch_fail() {
        let orders = vec![
            confirmed(2_000),
            confirmed(3_000),
            confirmed(3_500),
            order(4_000, OrderOutcome::Failed("503 OVERLOADED".into())),
        ];
        let avail = vec![answer(5_000, true, 4_000)];
        let r = SaleReport::build(&run(orders, avail, 1));
        assert!(!r.ok);
        assert_eq!(r.oversold, 1);
        assert_eq!(r.orders.failed.errors["503 OVERLOADED"], 1);
        assert_eq!(r.availability.lying_after_sell_out, 1);
        assert!(!r.after.matches);
        assert_eq!(r.problems.len(), 4, "{:?}", r.problems);
        assert!(r.render().contains("verdict: FAIL"));
    }

    #[test]
    fn over_limit_is_units_beyond_the_limit_and_nothing_without_one() {
        assert_eq!(over_limit(2, Some(2)), 0);
        assert_eq!(over_limit(1, Some(2)), 0);
        assert_eq!(over_limit(3, Some(2)), 1);
        assert_eq!(over_limit(0, Some(1)), 0);
        assert_eq!(over_limit(1_000, None), 0);
    }

    fn limited(limit: u32, already: u32) -> OrderOutcome {
        OrderOutcome::LimitExceeded { limit, already }
    }

    #[test]
    fn units_are_tallied_per_buyer_with_unknown_outcomes_marked() {
        let two = OrderOutcome::Confirmed { quantity: 2 };
        let orders = vec![
            buyer_order(1, 1_000, two.clone()),
            buyer_order(1, 2_000, two),
            buyer_order(1, 3_000, limited(4, 4)),
            buyer_order(2, 1_500, OrderOutcome::OutOfStock),
            buyer_order(3, 1_600, OrderOutcome::Confirmed { quantity: 1 }),
            buyer_order(3, 1_700, OrderOutcome::Failed("timeout".into())),
        ];
        let by = units_per_buyer(&orders);
        assert_eq!(by.len(), 3);
        let (units, unknown) = (by[&1].units, by[&1].unknown);
        assert_eq!((units, unknown), (4, false));
        assert_eq!(by[&2], BuyerUnits::default());
        let (units, unknown) = (by[&3].units, by[&3].unknown);
        assert_eq!((units, unknown), (1, true));
    }

    #[test]
    fn a_limit_refusal_must_fit_the_limit_and_what_the_buyer_got() {
        let got = |units| BuyerUnits {
            units,
            unknown: false,
        };
        // Limit 2, two units already, one more would pass it: true.
        assert!(!false_limit_refusal(2, 2, 1, got(2), Some(2)));
        // qty 2 on top of one unit passes a limit of 2 too.
        assert!(!false_limit_refusal(2, 1, 2, got(1), Some(2)));
        // The request would have fit.
        assert!(false_limit_refusal(2, 1, 1, got(1), Some(2)));
        // Not the product's limit, or no limit at all.
        assert!(false_limit_refusal(3, 3, 1, got(3), Some(2)));
        assert!(false_limit_refusal(2, 2, 1, got(2), None));
        // Said to have 2 units, but every order of the buyer is known and only 1 confirmed...
        assert!(false_limit_refusal(2, 2, 1, got(1), Some(2)));
        // ...unless an order's outcome is unknown: it may have been confirmed.
        let unsure = BuyerUnits {
            units: 1,
            unknown: true,
        };
        assert!(!false_limit_refusal(2, 2, 1, unsure, Some(2)));
    }

    fn limited_run(orders: Vec<OrderSample>, stock: u32, limit: u32, final_qty: i64) -> SaleRun {
        let mut r = run(orders, Vec::new(), final_qty);
        r.spec.stock = stock;
        r.spec.buyers = 2;
        r.spec.attempts_per_buyer = 3;
        r.spec.max_per_customer = Some(limit);
        r.spec.pollers = 0;
        r
    }

    #[test]
    fn limit_refusals_are_expected_and_the_most_one_buyer_got_is_shown() {
        let one = || OrderOutcome::Confirmed { quantity: 1 };
        let orders = vec![
            buyer_order(0, 1_000, one()),
            buyer_order(0, 1_100, one()),
            buyer_order(0, 1_200, limited(2, 2)),
            buyer_order(1, 1_300, one()),
            // Answered before buyer-1's second confirmation, which it already counts.
            buyer_order(1, 1_400, limited(2, 2)),
            buyer_order(1, 1_500, one()),
        ];
        let r = SaleReport::build(&limited_run(orders, 10, 2, 6));
        assert!(r.ok, "{:?}", r.problems);
        assert_eq!(r.orders.limit_exceeded, 2);
        assert_eq!(r.orders.failed.errors_total, 0);
        let b = &r.per_buyer;
        assert_eq!(
            (b.max_units_one_buyer, b.top_buyer.as_deref()),
            (2, Some("buyer-0"))
        );
        assert_eq!((b.buyers_over_limit, b.false_limit_refusals), (0, 0));
        assert_eq!(b.buyers_with_units, 2);
        let text = r.render();
        assert!(
            text.contains("limit 2 per customer, 2 buyers x 3 attempts"),
            "{text}"
        );
        assert!(text.contains("limit exceeded (409)"), "{text}");
        assert!(
            text.contains("most units to one buyer    2 (limit 2)   (buyer-0)"),
            "{text}"
        );
        assert!(text.contains("OVER LIMIT"), "{text}");
        assert!(text.contains("verdict: OK"), "{text}");
        let json = serde_json::to_value(&r).expect("serializes");
        assert_eq!(json["per_buyer"]["max_units_one_buyer"], 2);
        assert_eq!(json["per_buyer"]["max_per_customer"], 2);
        assert_eq!(json["orders"]["limit_exceeded"], 2);
    }

    #[test]
    fn a_buyer_over_the_limit_fails_like_an_oversell() {
        let one = || OrderOutcome::Confirmed { quantity: 1 };
        let orders = vec![
            buyer_order(0, 1_000, one()),
            buyer_order(0, 1_100, one()),
            buyer_order(0, 1_200, one()),
            buyer_order(1, 1_300, one()),
            buyer_order(1, 1_400, limited(2, 0)),
        ];
        let r = SaleReport::build(&limited_run(orders, 10, 2, 6));
        assert!(!r.ok);
        assert_eq!(r.oversold, 0);
        let b = &r.per_buyer;
        assert_eq!(
            (b.max_units_one_buyer, b.top_buyer.as_deref()),
            (3, Some("buyer-0"))
        );
        assert_eq!((b.buyers_over_limit, b.units_over_limit), (1, 1));
        assert_eq!(b.false_limit_refusals, 1);
        assert_eq!(r.problems.len(), 2, "{:?}", r.problems);
        assert!(
            r.problems[0].starts_with("OVERSOLD TO ONE BUYER: buyer-0 got 3 units"),
            "{:?}",
            r.problems
        );
        assert!(r.render().contains("verdict: FAIL"));
    }

    #[test]
    fn a_sale_without_limit_or_attempts_reads_as_before() {
        let r = SaleReport::build(&run(vec![confirmed(2_000)], Vec::new(), 1));
        let text = r.render();
        assert!(!text.contains("per buyer"), "{text}");
        assert!(!text.contains("limit exceeded"), "{text}");
        assert!(text.contains(": stock 2, 1 buyers x qty 1,"), "{text}");
        // A LIMIT_EXCEEDED for a product without a limit is not believed.
        let r = SaleReport::build(&run(vec![order(2_000, limited(1, 1))], Vec::new(), 2));
        assert_eq!(r.per_buyer.false_limit_refusals, 1);
        assert!(!r.ok);
    }

    #[test]
    fn replica_summary_reads_the_admin_answer() {
        let v: Value = serde_json::from_str(
            r#"{"primary":{"lsn":"0/1"},"replicas":[{"name":"replica-1","state":"healthy","staleness_ms":48,"lag_bytes":0}]}"#,
        )
        .expect("valid json");
        assert_eq!(
            replica_summary(&v),
            "replica-1 healthy (48 ms stale, 0 bytes behind)"
        );
    }
}
