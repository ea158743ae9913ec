//! The report of a timed mode (hot-sku, availability): C workers calling back-to-back for
//! N seconds, each keeping a tally, merged at the end; for a hot product spread over
//! several locations, its books at each.

use super::text::{latency_table, line, served_by_lines, verdict};
use super::{Failures, LatencySummary, PerLocation, Report, fmt_rate, per_second};
use crate::stats::{ServedBy, Tally};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

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
    /// hot-sku with `--locations N`: the books at each location.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_location: Option<PerLocation>,
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
    pub fn hot_sku(m: TimedMeta, t: &Tally, per_location: Option<PerLocation>) -> Self {
        let seen = Seen::orders(t, m.elapsed_us);
        Self::build(m, t, seen, per_location)
    }

    pub fn availability(m: TimedMeta, t: &Tally, stale_limit_ms: u64) -> Self {
        Self::build(m, t, Seen::answers(t, stale_limit_ms), None)
    }

    fn build(m: TimedMeta, t: &Tally, seen: Seen, per_location: Option<PerLocation>) -> Self {
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
        if let Some(books) = &per_location {
            problems.extend(books.problems(None));
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
            per_location,
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
        if let Some(books) = &self.per_location {
            books.render_into(out)?;
        }
        writeln!(out)?;
        verdict(out, &self.problems)
    }

    fn passed(&self) -> bool {
        self.ok
    }
}
