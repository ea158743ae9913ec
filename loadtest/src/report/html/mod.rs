//! The self-contained HTML report of a sale run: the text report plus inline SVG charts
//! (orders confirmed vs stock, latency percentiles over time, availability answers and
//! staleness by served_by). No scripts, no network.

mod svg;

use self::svg::{Series, chart, esc, series};
use crate::report::{Report, SaleReport, fmt_ms, write_file};
use crate::samples::{OrderOutcome, SaleRun};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// Writes the page of a sale run to `path`, when --html asked for one.
pub fn write(path: Option<&Path>, report: &SaleReport, run: &SaleRun) -> Result<()> {
    if let Some(path) = path {
        write_file(path, render(report, run))?;
    }
    Ok(())
}

pub fn render(report: &SaleReport, run: &SaleRun) -> String {
    let span_us = run
        .orders
        .iter()
        .map(|o| o.recv_us)
        .chain(run.avail.iter().map(|s| s.recv_us))
        .max()
        .unwrap_or(0);
    let axis = TimeAxis {
        bucket_us: bucket_size_us(span_us),
        x_max: (span_us as f64 / 1e6).max(0.001),
        sell_out_s: report
            .timing
            .time_to_sell_out_ms
            .map(|ms| ms / 1000.0 + first_sent_s(run)),
    };
    let charts = [
        confirmed_chart(report, run, &axis),
        order_latency_chart(run, &axis),
        avail_latency_chart(run, &axis),
        served_by_chart(run, &axis),
        staleness_chart(run, &axis),
        reported_stock_chart(report, run, &axis),
    ]
    .concat();
    page(report, &charts, axis.bucket_us)
}

/// The page around the charts: a summary line, the charts, then the text report.
fn page(report: &SaleReport, charts: &str, bucket_us: u64) -> String {
    let status = if report.ok {
        "<span class=ok>OK</span>"
    } else {
        "<span class=bad>FAIL</span>"
    };
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>stockgate {mode} {pid}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 900px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
pre {{ background: #f6f6f6; padding: 12px; overflow-x: auto; font-size: 12px; }}
.ok {{ color: #1a7f37; font-weight: bold; }} .bad {{ color: #c00; font-weight: bold; }}
svg {{ display: block; margin: 8px 0 20px; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #333; }}
svg .title {{ font-size: 13px; font-weight: bold; }}
.note {{ color: #666; font-size: 12px; }}
</style></head><body>
<h1>stockgate {mode}: {pid} — {status}</h1>
<p>{confirmed} units confirmed of {stock} stock, oversold {oversold}, {oos} out of stock, {errors} errors;{per_buyer}
time to sell out {tts}; total {total}. Buckets of {bucket} ms; the dashed vertical line is the sell-out moment.</p>
{charts}
<h2>Report</h2>
<pre>{text}</pre>
</body></html>
"#,
        mode = esc(&report.mode),
        pid = esc(&report.product_id),
        confirmed = report.orders.confirmed_units,
        stock = report.stock,
        oversold = report.oversold,
        oos = report.orders.out_of_stock,
        errors = report.orders.failed.errors_total,
        per_buyer = per_buyer_summary(report),
        tts = report
            .timing
            .time_to_sell_out_ms
            .map_or("never".into(), fmt_ms),
        total = fmt_ms(report.timing.total_ms),
        bucket = bucket_us / 1000,
        text = esc(&report.render()),
    )
}

/// For a run with a limit or several attempts per buyer: " most units to one buyer 2
/// (limit 2), 0 buyers over the limit, 140 refused by the limit;" (escaped); else nothing.
fn per_buyer_summary(report: &SaleReport) -> String {
    let b = &report.per_buyer;
    if !b.shown() {
        return String::new();
    }
    let over = match b.max_per_customer {
        Some(_) if b.buyers_over_limit > 0 => format!(
            ", <span class=bad>{} buyers over the limit</span>",
            b.buyers_over_limit
        ),
        Some(_) => ", 0 buyers over the limit".into(),
        None => String::new(),
    };
    format!(
        "\nmost units to one buyer {}{over}, {} refused by the limit;",
        esc(&b.most_to_one_buyer()),
        report.orders.limit_exceeded
    )
}

/// The time axis every chart of a run shares: seconds from 0 to `x_max`, samples counted
/// in buckets of `bucket_us`, and the sell-out moment marked.
struct TimeAxis {
    bucket_us: u64,
    x_max: f64,
    sell_out_s: Option<f64>,
}

impl TimeAxis {
    fn chart(&self, title: &str, y_label: &str, series: &[Series]) -> String {
        chart(title, y_label, series, self.x_max, self.sell_out_s)
    }
}

/// 100 ms buckets up to 30 s, then whole seconds, keeping at most ~300 buckets.
pub fn bucket_size_us(span_us: u64) -> u64 {
    if span_us <= 30_000_000 {
        100_000
    } else {
        span_us.div_ceil(300).div_ceil(1_000_000).max(1) * 1_000_000
    }
}

fn first_sent_s(run: &SaleRun) -> f64 {
    run.orders.iter().map(|o| o.sent_us).min().unwrap_or(0) as f64 / 1e6
}

fn bucket_mid_s(b: u64, bucket_us: u64) -> f64 {
    (b * bucket_us + bucket_us / 2) as f64 / 1e6
}

/// Nearest-rank percentile of a sorted slice.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn color_for(name: &str, i: usize) -> String {
    match name {
        "primary" => "#1f77b4".into(),
        "replica-1" => "#2ca02c".into(),
        "replica-2" => "#ff7f0e".into(),
        _ => ["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"][i % 5].into(),
    }
}

/// A step line over the run's confirmations: `at(units confirmed so far)` at 0 s, at each
/// confirmation and at the end.
fn confirmed_steps(run: &SaleRun, x_max: f64, at: impl Fn(u64) -> f64) -> Vec<(f64, f64)> {
    let mut units = 0u64;
    let mut points = vec![(0.0, at(0))];
    for o in &run.orders {
        if let OrderOutcome::Confirmed { quantity } = o.outcome {
            units += u64::from(quantity);
            points.push((o.recv_us as f64 / 1e6, at(units)));
        }
    }
    points.push((x_max, at(units)));
    points
}

fn confirmed_chart(report: &SaleReport, run: &SaleRun, axis: &TimeAxis) -> String {
    let x_max = axis.x_max;
    let mut confirmed = series(
        "units confirmed",
        "#1f77b4",
        confirmed_steps(run, x_max, |units| units as f64),
    );
    confirmed.step = true;
    let mut stock = series(
        "stock",
        "#c00",
        vec![
            (0.0, f64::from(report.stock)),
            (x_max, f64::from(report.stock)),
        ],
    );
    stock.dashed = true;
    axis.chart(
        "Orders confirmed over time vs stock",
        "units",
        &[confirmed, stock],
    )
}

/// Per-bucket latency percentiles (ms) of samples given as (recv_us, latency_us).
fn latency_series(
    samples: impl Iterator<Item = (u64, u64)>,
    bucket_us: u64,
    quantiles: &[(&str, f64, &str)],
) -> Vec<Series> {
    let mut buckets: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (recv, lat) in samples {
        buckets.entry(recv / bucket_us).or_default().push(lat);
    }
    for v in buckets.values_mut() {
        v.sort_unstable();
    }
    quantiles
        .iter()
        .map(|(name, q, color)| {
            let pts = buckets
                .iter()
                .map(|(b, v)| {
                    (
                        bucket_mid_s(*b, bucket_us),
                        percentile(v, *q) as f64 / 1000.0,
                    )
                })
                .collect();
            series(name, color, pts)
        })
        .collect()
}

const QUANTILES: [(&str, f64, &str); 4] = [
    ("p50", 0.50, "#2ca02c"),
    ("p95", 0.95, "#ff7f0e"),
    ("p99", 0.99, "#d62728"),
    ("max", 1.0, "#7f7f7f"),
];

fn order_latency_chart(run: &SaleRun, axis: &TimeAxis) -> String {
    let s = latency_series(
        run.orders.iter().map(|o| (o.recv_us, o.latency_us())),
        axis.bucket_us,
        &QUANTILES,
    );
    axis.chart("Order latency by answer time", "ms", &s)
}

fn avail_latency_chart(run: &SaleRun, axis: &TimeAxis) -> String {
    if run.avail.is_empty() {
        return "<p class=note>No availability pollers in this run.</p>".into();
    }
    let s = latency_series(
        run.avail.iter().map(|a| (a.recv_us, a.latency_us())),
        axis.bucket_us,
        &QUANTILES,
    );
    axis.chart("Availability latency by answer time", "ms", &s)
}

/// Per served_by, one value per bucket folded from the answers in it.
fn per_served_by(
    run: &SaleRun,
    bucket_us: u64,
    fold: impl Fn(Option<f64>, f64) -> f64,
    value: impl Fn(&crate::samples::AvailAnswer) -> f64,
) -> BTreeMap<String, BTreeMap<u64, f64>> {
    let mut by: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
    for s in &run.avail {
        let (key, v) = match &s.outcome {
            Ok(a) => (a.served_by.clone(), value(a)),
            Err(_) => ("errors".to_string(), 1.0),
        };
        let slot = by.entry(key).or_default();
        let b = s.recv_us / bucket_us;
        let next = fold(slot.get(&b).copied(), v);
        slot.insert(b, next);
    }
    by
}

/// Per served_by, the highest `value` answered in each bucket (failed requests left out).
fn max_per_served_by(
    run: &SaleRun,
    bucket_us: u64,
    value: impl Fn(&crate::samples::AvailAnswer) -> f64,
) -> BTreeMap<String, BTreeMap<u64, f64>> {
    let mut by = per_served_by(run, bucket_us, |cur, v| cur.map_or(v, |c| c.max(v)), value);
    by.remove("errors");
    by
}

fn to_series(
    by: BTreeMap<String, BTreeMap<u64, f64>>,
    bucket_us: u64,
    totals: bool,
) -> Vec<Series> {
    by.into_iter()
        .enumerate()
        .map(|(i, (name, buckets))| {
            let total: f64 = buckets.values().sum();
            let label = if totals {
                format!("{name} ({total:.0})")
            } else {
                name.clone()
            };
            let color = if name == "errors" {
                "#c00".to_string()
            } else {
                color_for(&name, i)
            };
            let pts = buckets
                .into_iter()
                .map(|(b, v)| (bucket_mid_s(b, bucket_us), v))
                .collect();
            series(&label, &color, pts)
        })
        .collect()
}

fn served_by_chart(run: &SaleRun, axis: &TimeAxis) -> String {
    if run.avail.is_empty() {
        return String::new();
    }
    let bucket_us = axis.bucket_us;
    let by = per_served_by(run, bucket_us, |cur, v| cur.unwrap_or(0.0) + v, |_| 1.0);
    axis.chart(
        &format!(
            "Availability answers per {} ms by served_by (total)",
            bucket_us / 1000
        ),
        "answers",
        &to_series(by, bucket_us, true),
    )
}

fn staleness_chart(run: &SaleRun, axis: &TimeAxis) -> String {
    if run.avail.is_empty() {
        return String::new();
    }
    let by = max_per_served_by(run, axis.bucket_us, |a| a.stale_by_ms as f64);
    axis.chart(
        "Max stale_by_ms per bucket by served_by",
        "ms",
        &to_series(by, axis.bucket_us, false),
    )
}

fn reported_stock_chart(report: &SaleReport, run: &SaleRun, axis: &TimeAxis) -> String {
    if run.avail.is_empty() {
        return String::new();
    }
    let by = max_per_served_by(run, axis.bucket_us, |a| a.available_quantity as f64);
    let mut s = to_series(by, axis.bucket_us, false);
    let stock = i64::from(report.stock);
    let truth = confirmed_steps(run, axis.x_max, |units| (stock - units as i64) as f64);
    let mut t = series("stock − confirmed", "#000", truth);
    t.step = true;
    t.dashed = true;
    s.push(t);
    axis.chart(
        "Highest available_quantity answered per bucket vs stock left",
        "units",
        &s,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_stay_few() {
        assert_eq!(bucket_size_us(2_000_000), 100_000);
        assert_eq!(bucket_size_us(30_000_000), 100_000);
        assert_eq!(bucket_size_us(31_000_000), 1_000_000);
        assert_eq!(bucket_size_us(900_000_000), 3_000_000);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(percentile(&v, 0.5), 5);
        assert_eq!(percentile(&v, 0.99), 10);
        assert_eq!(percentile(&v, 1.0), 10);
        assert_eq!(percentile(&[], 0.5), 0);
    }

    #[test]
    fn the_page_names_the_most_one_buyer_got_and_the_limit() {
        use crate::report::sale::fixtures::{buyer_order, limited_run};
        let one = || OrderOutcome::Confirmed { quantity: 1 };
        let orders = vec![
            buyer_order(0, 1_000, one()),
            buyer_order(0, 2_000, one()),
            buyer_order(0, 3_000, one()),
            buyer_order(1, 4_000, OrderOutcome::OutOfStock),
        ];
        let mut run = limited_run(orders, 3, 2, 0);
        run.spec.product_id = "p<1>".into();
        let page = render(&SaleReport::build(&run), &run);
        let summary =
            "most units to one buyer 3 (limit 2), <span class=bad>1 buyers over the limit</span>";
        assert!(page.contains(summary), "{page}");
        assert!(
            page.contains("OVERSOLD TO ONE BUYER: buyer-0 got 3 units"),
            "{page}"
        );
        assert!(page.contains("p&lt;1&gt;"), "{page}");
        // Without a limit or attempts, the summary reads as before.
        run.spec.attempts_per_buyer = 1;
        run.spec.max_per_customer = None;
        let page = render(&SaleReport::build(&run), &run);
        assert!(!page.contains("most units to one buyer"), "{page}");
    }
}
