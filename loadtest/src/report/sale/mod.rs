//! The report of a sale (flash-sale, sell-out): built from the run's samples, it passes
//! only if nothing was oversold (in all, or to one buyer past its limit), no request failed,
//! no availability answer lied, and the stock read back adds up.

#[cfg(test)]
pub(super) mod fixtures;
mod per_buyer;
mod render;
mod sections;

use self::per_buyer::PerBuyer;
use self::sections::{
    AfterSale, AvailabilitySeen, OrderCounts, SaleLatency, SaleTiming, sell_out_moment,
};
use crate::report::{PerLocation, oversold};
use crate::samples::{OrderOutcome, OrderSample, SaleRun};
use serde::Serialize;
use serde_json::Value;

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
    /// The books at each location, when the stock was spread over several (`--locations`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_location: Option<PerLocation>,
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
            per_location: per_location(run),
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
        if let Some(books) = &self.per_location {
            problems.extend(books.problems(None));
        }
        problems
    }
}

/// The books per location of a run that spread its stock over several; `None` when it
/// kept it all at `default`.
fn per_location(run: &SaleRun) -> Option<PerLocation> {
    if run.spec.locations.is_empty() {
        return None;
    }
    let levels = run.final_read.as_ref().ok().map(|r| r.levels.as_slice());
    Some(PerLocation::of(&run.spec.locations, &run.allocated, levels))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Report;
    use crate::report::sale::fixtures::*;

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
        // All at `default` (--locations 1): the report of before locations.
        assert!(!text.contains("per location"), "{text}");
        let json = serde_json::to_value(&r).expect("serializes");
        assert!(json.get("per_location").is_none(), "{json}");
    }

    // Mutation that fails this test: `find_problems` without the per-location books'
    // problems (the verdict judged on the product's total alone).
    #[test]
    fn a_location_allocated_beyond_its_stock_fails_the_sale_though_the_total_adds_up() {
        use crate::locations::StockAt;
        use crate::samples::Level;
        let at = |id: &str, quantity| StockAt {
            location_id: id.into(),
            quantity,
        };
        let left = |id: &str| Level {
            location_id: id.into(),
            available_quantity: 0,
            active: true,
        };
        // 3 units (a 2, b 1), 3 confirmed, 0 left: the total adds up; but the answers say
        // b gave 2 of its 1, and a's 2 are gone with only 1 allocated there.
        let orders = vec![confirmed(1_000), confirmed(2_000), confirmed(3_000)];
        let mut sale = run(orders, Vec::new(), 0);
        sale.spec.stock = 3;
        sale.spec.locations = vec![at("a", 2), at("b", 1)];
        sale.allocated = [("a".to_string(), 1), ("b".to_string(), 2)]
            .into_iter()
            .collect();
        if let Ok(read) = sale.final_read.as_mut() {
            read.levels = vec![left("a"), left("b")];
        }
        let r = SaleReport::build(&sale);
        assert_eq!((r.oversold, r.after.matches), (0, true));
        assert!(!r.ok);
        let text = r.render();
        assert!(text.contains("stock 3 over 2 locations (2/1)"), "{text}");
        assert!(text.contains("OVERSOLD AT LOCATION b:"), "{text}");
        assert!(text.contains("verdict: FAIL"), "{text}");
        let json = serde_json::to_value(&r).expect("serializes");
        assert_eq!(json["per_location"]["oversold"], 1, "{json}");
        assert_eq!(json["per_location"]["locations"][1]["location_id"], "b");
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
}
