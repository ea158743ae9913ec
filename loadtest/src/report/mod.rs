//! Reports: what each mode makes of its run — the numbers it derives (oversold, units per
//! buyer against the per-customer limit, sell-out moment, lying availability answers, rates,
//! percentiles), the struct written as JSON, its plain-text rendering and its verdict, and
//! the files they are written to.
//!
//! # Layout
//! - `mod.rs`: the [`Report`] trait every mode's report implements, what they all share
//!   (`oversold`, `per_second`, [`Failures`]), and writing their outputs;
//! - `latency.rs`: [`LatencySummary`], one endpoint's latency percentiles;
//! - `per_location.rs`: [`PerLocation`], a product's books at each location its stock was
//!   spread over (`--locations N`), and the oversell verdict per location;
//! - `text.rs`: the plain-text pieces every rendering uses (formats, rows, tables, verdict);
//! - `sale/`: flash-sale and sell-out's [`SaleReport`]: its sections, the per-buyer limit
//!   arithmetic, and its text;
//! - `timed.rs`: hot-sku and availability's [`TimedReport`];
//! - `checkout.rs`: checkout's [`CheckoutReport`](checkout::CheckoutReport), with each
//!   product's books;
//! - `html/`: a sale's self-contained HTML page: the text report and SVG charts.

pub mod checkout;
pub mod html;
mod latency;
mod per_location;
mod sale;
mod text;
mod timed;

pub use self::latency::LatencySummary;
pub use self::per_location::PerLocation;
pub use self::sale::SaleReport;
use self::text::{error_lines, line};
pub use self::text::{fmt_ms, fmt_rate};
pub use self::timed::{TimedMeta, TimedReport};
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// Units confirmed beyond the stock there was. Anything above 0 is a broken promise.
pub fn oversold(confirmed_units: u64, stock: u64) -> u64 {
    confirmed_units.saturating_sub(stock)
}

/// Events per second over `window_us`; 0 for an empty window.
pub fn per_second(count: u64, window_us: u64) -> f64 {
    if window_us == 0 {
        0.0
    } else {
        count as f64 * 1e6 / window_us as f64
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

/// A report's text, its JSON, and whether the run passed.
pub fn outputs(r: &impl Report) -> Result<(String, String, bool)> {
    Ok((r.render(), serde_json::to_string_pretty(r)?, r.passed()))
}

/// Writes one output file (--json, --html), naming it when that fails.
pub fn write_file(path: &Path, contents: String) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversold_is_units_beyond_stock_never_negative() {
        assert_eq!(oversold(60, 60), 0);
        assert_eq!(oversold(12, 60), 0);
        assert_eq!(oversold(61, 60), 1);
        assert_eq!(oversold(0, 0), 0);
    }

    #[test]
    fn rates_are_per_second_of_the_window_and_0_for_none() {
        assert_eq!(per_second(500, 250_000), 2000.0);
        assert_eq!(per_second(5, 0), 0.0);
    }
}
