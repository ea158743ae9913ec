//! The report of a checkout run: what the buyers' holds came to (per step and ending), each
//! step's latency, the retried and unexpected answers, and each product's books read back
//! once every hold has ended (given = confirmed + available, and at each location when the
//! stock was spread over several); its verdict and its text.

use crate::report::{LatencySummary, PerLocation, Report, fmt_ms, fmt_rate, oversold};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

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
    /// With `--locations N`: the books at each location.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_location: Option<PerLocation>,
}

impl ProductCheck {
    pub fn new(product_id: String, given: u64, confirmed: u64, available: i64) -> Self {
        Self {
            product_id,
            stock_given: given,
            confirmed_units: confirmed,
            available_quantity: available,
            served_by: String::new(),
            covers_end: true,
            oversold: oversold(confirmed, given),
            unaccounted: given as i64 - confirmed as i64 - available,
            per_location: None,
        }
    }
}

/// What went wrong, one sentence each; empty means the run passed. `attempts` is how often
/// the run sends a step before it counts the buyer unresolved.
pub fn problems(r: &CheckoutReport, attempts: u32) -> Vec<String> {
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
            "{} buyers whose outcome stayed unknown after {attempts} attempts",
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
        if let Some(books) = &p.per_location {
            out.extend(books.problems(Some(&p.product_id)));
        }
    }
    out
}

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
        )?;
        let spread = self
            .per_product
            .iter()
            .filter_map(|p| p.per_location.as_ref());
        let Some(total) = PerLocation::total(spread) else {
            return Ok(());
        };
        total.render_into(out)?;
        writeln!(
            out,
            "  (summed over the products; each product's own books, in the JSON, are judged)"
        )
    }
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
        assert!(problems(&report(vec![p]), 5).is_empty());
    }

    #[test]
    fn units_confirmed_beyond_the_stock_are_oversold_and_fail_the_run() {
        // The incident: 12 units confirmed out of 10, and the service says 0 are left.
        let p = ProductCheck::new("a".into(), 10, 12, 0);
        assert_eq!((p.oversold, p.unaccounted), (2, -2));
        let found = problems(&report(vec![p]), 5);
        assert!(found.iter().any(|m| m == "2 units oversold"), "{found:?}");
    }

    #[test]
    fn units_neither_sold_nor_on_sale_fail_the_run() {
        // An expired hold whose units never came back: 10 given, 6 sold, 2 on sale.
        let p = ProductCheck::new("a".into(), 10, 6, 2);
        assert_eq!((p.oversold, p.unaccounted), (0, 2));
        let found = problems(&report(vec![p]), 5);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("off by 2"), "{found:?}");
    }

    // Mutation that fails this test: `problems` without each product's per-location problems.
    #[test]
    fn a_location_of_one_product_allocated_beyond_its_stock_fails_the_run_and_is_named() {
        use crate::locations::StockAt;
        use crate::samples::Level;
        // 4 given (a 2, b 2), 4 confirmed, 0 left: the product balances; but b gave 3.
        let mut p = ProductCheck::new("p".into(), 4, 4, 0);
        let given = ["a", "b"].map(|id| StockAt {
            location_id: id.into(),
            quantity: 2,
        });
        let levels = ["a", "b"].map(|id| Level {
            location_id: id.into(),
            available_quantity: 0,
            active: true,
        });
        let allocated = [("a".to_string(), 1), ("b".to_string(), 3)]
            .into_iter()
            .collect();
        p.per_location = Some(PerLocation::of(&given, &allocated, Some(&levels)));
        let r = report(vec![p]);
        let found = problems(&r, 5);
        assert!(
            found
                .iter()
                .any(|m| m.starts_with("OVERSOLD AT LOCATION b of p:")),
            "{found:?}"
        );
        assert!(r.render().contains("per location"));
    }

    #[test]
    fn held_units_unexpected_answers_and_unknown_outcomes_each_fail_the_run() {
        let ok = || report(vec![ProductCheck::new("a".into(), 10, 10, 0)]);
        assert!(problems(&ok(), 5).is_empty());
        let mut r = ok();
        r.units_left_held = 3;
        assert_eq!(problems(&r, 5).len(), 1);
        let mut r = ok();
        r.unexpected.insert("confirm: 500".into(), 1);
        assert_eq!(problems(&r, 5).len(), 1);
        let mut r = ok();
        r.counts.unresolved = 1;
        assert_eq!(problems(&r, 5).len(), 1);
        let mut r = ok();
        r.per_product[0].covers_end = false;
        assert_eq!(problems(&r, 5).len(), 1);
    }
}
