//! The sections of a sale's report, each derived from the run: the orders, the timing
//! around the sell-out moment, the latencies, the availability answers (and the lying ones),
//! and the stock read back afterwards.

use crate::report::{Failures, LatencySummary, per_second};
use crate::samples::{AvailSample, FinalRead, OrderOutcome, OrderSample, SaleRun};
use crate::stats::ServedBy;
use serde::Serialize;
use std::collections::BTreeMap;

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

pub(super) fn confirmed_units(o: &OrderSample) -> u64 {
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
    pub(super) fn of(run: &SaleRun) -> Self {
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
    pub(super) fn of(run: &SaleRun, sell_out: Option<u64>, rejected_after: u64) -> Self {
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
    pub(super) fn of(run: &SaleRun, rejected_after: &[&OrderSample]) -> Self {
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
    pub(super) fn of(run: &SaleRun, sell_out: Option<u64>) -> Self {
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
    pub(super) fn of(final_read: &Result<FinalRead, String>, expected: i64) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::sale::fixtures::{answer, confirmed, order};

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
}
