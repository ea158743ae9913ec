//! A sale report as plain text: header, orders, per buyer, timing, latency, availability
//! answers, the stock read back (in all, and per location when it was spread over several),
//! and the verdict.

use super::SaleReport;
use crate::report::text::{latency_table, line, replica_summary, served_by_lines, verdict};
use crate::report::{Report, fmt_ms, fmt_rate};
use std::fmt::{self, Write as _};

impl SaleReport {
    fn render_header(&self, out: &mut String) -> fmt::Result {
        let b = &self.per_buyer;
        let attempts = match b.attempts_per_buyer {
            0 | 1 => String::new(),
            m => format!(" x {m} attempts"),
        };
        let limit = b
            .max_per_customer
            .map_or(String::new(), |l| format!(", limit {l} per customer"));
        let spread = self.per_location.as_ref().map_or(String::new(), |p| {
            let given = p
                .locations
                .iter()
                .take(p.spread_over)
                .map(|l| l.given.to_string());
            let given: Vec<String> = given.collect();
            format!(" over {} locations ({})", p.spread_over, given.join("/"))
        });
        writeln!(out, "== {} against {} ==", self.mode, self.base_url)?;
        writeln!(
            out,
            "product {}: stock {}{spread}{limit}, {} buyers{attempts} x qty {}, concurrency {}, {} pollers (started {})",
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
        if let Some(books) = &self.per_location {
            books.render_into(out)?;
        }
        writeln!(out)?;
        verdict(out, &self.problems)
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
