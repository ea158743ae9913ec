//! Per-second rates of the service's own counters over the last minute, for the ops page's
//! overview (`GET /v1/admin/overview`): the page draws numbers; it neither scrapes
//! `/metrics` nor differences counters itself.
//!
//! Samples are taken when an overview is asked for, at most one per [`SPACING`], and kept for
//! [`WINDOW`], plus the newest one older than that, which starts the window. A rate is a
//! series' increase from the window's first sample to now, over the time between them (the
//! `span`, at most a minute and a spacing; shorter while the instance is young or
//! unwatched). A series absent from the first sample started at 0; one that went down
//! (impossible within one process, but cheap to survive) counts from 0 too. The first
//! overview has no earlier sample and so no rates. Time is a parameter: the tests use
//! made-up instants.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// How far back the rates look.
pub const WINDOW: Duration = Duration::from_secs(60);
/// The closest two kept samples may be (pages poll every second).
pub const SPACING: Duration = Duration::from_secs(1);

/// A series: its family's name (`stockgate_orders_total`) and its label pairs, sorted.
pub type Series = (String, Vec<(String, String)>);

/// Counter values at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot(pub BTreeMap<Series, f64>);

impl Snapshot {
    /// The counters of `families` in `registry`, by full name.
    pub fn of(registry: &prometheus::Registry, families: &[&str]) -> Snapshot {
        let mut values = BTreeMap::new();
        for family in registry.gather() {
            if !families.contains(&family.name()) {
                continue;
            }
            for m in family.get_metric() {
                let mut labels: Vec<(String, String)> = m
                    .get_label()
                    .iter()
                    .map(|l| (l.name().to_string(), l.value().to_string()))
                    .collect();
                labels.sort();
                values.insert(
                    (family.name().to_string(), labels),
                    m.get_counter().get_value(),
                );
            }
        }
        Snapshot(values)
    }

    /// The values of label `key` among `family`'s series, each once, in order.
    pub fn label_values(&self, family: &str, key: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .0
            .keys()
            .filter(|(f, _)| f == family)
            .filter_map(|(_, ls)| ls.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Kept samples; see the module doc.
#[derive(Debug, Default)]
pub struct RateWindow {
    samples: VecDeque<(Instant, Snapshot)>,
}

/// What [`RateWindow::observe`] gives: the values now and their rates over `span`.
#[derive(Debug, Clone)]
pub struct Rates {
    pub span: Duration,
    now: Snapshot,
    per_second: BTreeMap<Series, f64>,
}

impl RateWindow {
    /// Records `now`'s values and returns the rates since the window's first sample, or
    /// `None` with no earlier sample to compare with.
    pub fn observe(&mut self, at: Instant, now: Snapshot) -> Option<Rates> {
        // Keep one sample at or before the window's start, and drop those before it.
        while self.samples.len() >= 2 && self.samples[1].0 + WINDOW <= at {
            self.samples.pop_front();
        }
        let rates = self
            .samples
            .front()
            .filter(|(t, _)| *t < at)
            .map(|(t, first)| Rates::between(first, now.clone(), at - *t));
        if self.samples.back().is_none_or(|(t, _)| *t + SPACING <= at) {
            self.samples.push_back((at, now));
        }
        rates
    }
}

impl Rates {
    fn between(first: &Snapshot, now: Snapshot, span: Duration) -> Rates {
        let secs = span.as_secs_f64();
        let per_second = now
            .0
            .iter()
            .map(|(series, v)| {
                let before = first.0.get(series).copied().unwrap_or(0.0);
                let increase = if *v >= before { v - before } else { *v };
                (series.clone(), increase / secs)
            })
            .collect();
        Rates {
            span,
            now,
            per_second,
        }
    }

    /// The summed rate of `family`'s series whose labels include every one of `labels`.
    pub fn rate(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        sum_matching(&self.per_second, family, labels)
    }

    /// The summed value now of the same series.
    pub fn total(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        sum_matching(&self.now.0, family, labels)
    }
}

fn sum_matching(values: &BTreeMap<Series, f64>, family: &str, labels: &[(&str, &str)]) -> f64 {
    values
        .iter()
        .filter(|((f, ls), _)| {
            f == family
                && labels
                    .iter()
                    .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, v)| v)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(values: &[(&str, &str, f64)]) -> Snapshot {
        Snapshot(
            values
                .iter()
                .map(|(class, target, v)| {
                    (
                        (
                            "decisions".to_string(),
                            vec![
                                ("class".to_string(), class.to_string()),
                                ("target".to_string(), target.to_string()),
                            ],
                        ),
                        *v,
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn the_first_look_has_no_rates_and_the_second_has_them_over_the_time_between() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        assert!(w.observe(t0, snap(&[("gate", "replica", 10.0)])).is_none());
        let r = w
            .observe(
                t0 + Duration::from_secs(2),
                snap(&[("gate", "replica", 30.0), ("gate", "primary", 4.0)]),
            )
            .expect("rates");
        assert_eq!(r.span, Duration::from_secs(2));
        assert_eq!(r.rate("decisions", &[("target", "replica")]), 10.0);
        // A series that appeared since started at 0.
        assert_eq!(r.rate("decisions", &[("target", "primary")]), 2.0);
        assert_eq!(r.rate("decisions", &[("class", "gate")]), 12.0);
        assert_eq!(r.total("decisions", &[]), 34.0);
        assert_eq!(r.rate("decisions", &[("class", "other")]), 0.0);
        assert_eq!(
            r.now.label_values("decisions", "target"),
            ["primary", "replica"]
        );
    }

    #[test]
    fn rates_cover_the_last_minute_once_there_is_one() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        // A counter rising 5 a second, looked at every 500 ms for 3 minutes, then a burst.
        let mut last = None;
        for i in 0..=360u32 {
            let at = t0 + Duration::from_millis(500) * i;
            last = w.observe(at, snap(&[("gate", "replica", 2.5 * f64::from(i))]));
        }
        let r = last.expect("rates");
        assert!(
            r.span >= WINDOW && r.span <= WINDOW + SPACING,
            "{:?}",
            r.span
        );
        assert!((r.rate("decisions", &[]) - 5.0).abs() < 1e-9);
        // Samples are at least a second apart, so the kept ones stay a minute's worth.
        assert!(w.samples.len() <= 62, "{}", w.samples.len());
        // A burst of 600 in the last half second shows as 10 more a second over the minute.
        let at = t0 + Duration::from_millis(500) * 361;
        let r = w
            .observe(at, snap(&[("gate", "replica", 2.5 * 361.0 + 600.0)]))
            .expect("rates");
        let expected = (2.5 * 361.0 + 600.0 - 2.5 * 240.0) / r.span.as_secs_f64();
        assert!((r.rate("decisions", &[]) - expected).abs() < 1e-9);
    }

    #[test]
    fn a_counter_that_went_down_counts_from_zero() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        w.observe(t0, snap(&[("gate", "replica", 100.0)]));
        let r = w
            .observe(
                t0 + Duration::from_secs(4),
                snap(&[("gate", "replica", 8.0)]),
            )
            .expect("rates");
        assert_eq!(r.rate("decisions", &[]), 2.0);
    }

    #[test]
    fn two_looks_within_a_spacing_share_the_same_start() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        w.observe(t0, snap(&[("gate", "replica", 0.0)]));
        let a = t0 + Duration::from_millis(1500);
        w.observe(a, snap(&[("gate", "replica", 3.0)]));
        // 100 ms later: not kept, and measured from t0 still.
        let r = w
            .observe(
                a + Duration::from_millis(100),
                snap(&[("gate", "replica", 4.0)]),
            )
            .expect("rates");
        assert_eq!(r.span, Duration::from_millis(1600));
        assert_eq!(w.samples.len(), 2);
    }
}
