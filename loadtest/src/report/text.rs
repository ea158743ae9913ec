//! The plain-text pieces every report's rendering shares: number formats, the
//! `  name   value` row, the latency table, error and served_by rows, the replicas line and
//! the verdict.

use super::LatencySummary;
use crate::stats::ServedBy;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

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

pub(super) fn latency_table(out: &mut String, rows: &[(&str, &LatencySummary)]) -> fmt::Result {
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

pub(super) fn error_lines(out: &mut String, errors: &BTreeMap<String, u64>) -> fmt::Result {
    for (label, n) in errors {
        writeln!(out, "    {label:<24} {n}")?;
    }
    Ok(())
}

pub(super) fn served_by_lines(out: &mut String, by: &BTreeMap<String, ServedBy>) -> fmt::Result {
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

pub(super) fn verdict(out: &mut String, problems: &[String]) -> fmt::Result {
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
pub(super) fn line(out: &mut String, name: &str, value: impl fmt::Display) -> fmt::Result {
    writeln!(out, "  {name:<26} {value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_rates_format_readably() {
        assert_eq!(fmt_ms(0.8421), "0.84 ms");
        assert_eq!(fmt_ms(12.34), "12.3 ms");
        assert_eq!(fmt_ms(1250.0), "1.25 s");
        assert_eq!(fmt_rate(1234.4), "1234/s");
        assert_eq!(fmt_rate(12.345), "12.3/s");
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
