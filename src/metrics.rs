//! Prometheus metrics, one registry per application instance (tests run several in one
//! process).

use prometheus::core::Collector;
use prometheus::{
    Counter, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Request latency buckets, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Orders per coalesced transaction.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// Finer than HTTP's: an order's time splits into these two, a few milliseconds each.
const ORDER_STAGE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0,
];

/// One metric of the table: its kind's constructor from name, help, and then labels (the
/// `…Vec` kinds) and/or buckets (histograms).
macro_rules! define {
    ($kind:ident, $name:literal, $help:literal) => {
        $kind::with_opts(Opts::new($name, $help))
    };
    ($kind:ident, $name:literal, $help:literal, [$($label:literal),+]) => {
        $kind::new(Opts::new($name, $help), &[$($label),+])
    };
    ($kind:ident, $name:literal, $help:literal, buckets $buckets:expr) => {
        $kind::with_opts(HistogramOpts::new($name, $help).buckets($buckets.to_vec()))
    };
    ($kind:ident, $name:literal, $help:literal, [$($label:literal),+], buckets $buckets:expr) => {
        $kind::new(HistogramOpts::new($name, $help).buckets($buckets.to_vec()), &[$($label),+])
    };
}

/// Declares [`Metrics`] and registers each field under its name, from one table:
/// `field: Kind("name", "help", [labels], buckets B);` (labels and buckets as the kind takes).
macro_rules! metrics {
    ($($(#[$doc:meta])* $field:ident: $kind:ident($($def:tt)*);)*) => {
        #[derive(Clone)]
        pub struct Metrics {
            pub registry: Registry,
            $($(#[$doc])* pub $field: $kind,)*
        }

        impl Metrics {
            #[allow(clippy::expect_used)]
            pub fn new() -> Self {
                let registry = Registry::new_custom(Some("stockgate".into()), None)
                    .expect("valid prefix");
                let metrics = Metrics {
                    $($field: register(&registry, define!($kind, $($def)*)),)*
                    registry,
                };
                metrics.export_zeroes();
                metrics
            }
        }
    };
}

/// Registers a statically defined metric: a bad definition or a name used twice is a
/// programming error that every test run would hit at start-up.
#[allow(clippy::expect_used)]
fn register<M: Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<M>,
) -> M {
    let metric = metric.expect("static metric definition");
    registry
        .register(Box::new(metric.clone()))
        .expect("metric registered once");
    metric
}

metrics! {
    http_requests: IntCounterVec("http_requests_total", "HTTP requests by route and status", ["route", "status"]);
    http_duration: HistogramVec("http_request_duration_seconds", "HTTP request latency", ["route"], buckets LATENCY_BUCKETS);
    replica_staleness: GaugeVec("replica_staleness_seconds", "Upper bound on how far each replica is behind the primary", ["replica"]);
    /// NaN until both positions are known (0 would claim a fresh replica).
    replica_lag_bytes: GaugeVec("replica_lag_bytes", "WAL bytes the replica has not replayed (NaN: not known yet)", ["replica"]);
    replica_state: IntGaugeVec("replica_state", "1 for the replica's current state", ["replica", "state"]);
    /// The running configuration's thresholds, so a dashboard draws them instead of copies.
    staleness_budget: GaugeVec("routing_staleness_budget_seconds", "The staleness a replica answer may carry, per query class that reads replicas", ["class"]);
    eviction_threshold: Gauge("replica_eviction_threshold_seconds", "Staleness at which a healthy replica becomes lagging (STOCKGATE_EVICT_AFTER_MS)");
    routing_decisions: IntCounterVec("routing_decisions_total", "Routed reads by class, target and reason", ["class", "target", "reason"]);
    routing_fallbacks: IntCounterVec("routing_fallbacks_total", "Replica-class reads that went to the primary", ["class", "reason"]);
    monitor_samples: IntCounterVec("monitor_samples_total", "Freshness samples taken", ["node"]);
    monitor_errors: IntCounterVec("monitor_sample_errors_total", "Freshness samples that failed or timed out", ["node"]);
    ryw_store_failures: IntCounterVec("ryw_store_failures_total", "Read-your-writes store operations that failed (reads then go to the primary)", ["op"]);
    orders: IntCounterVec("orders_total", "Order attempts by outcome", ["outcome"]);
    /// Steps after a commit that failed; the write stands and the step fails safe.
    post_commit_failures: IntCounterVec("post_commit_failures_total", "Steps after a committed write that failed (the write stands; the step fails safe)", ["step"]);
    load_shed: IntCounter("load_shed_total", "Requests refused with 503 because the service was at capacity");
    order_batch_size: Histogram("order_batch_size", "Orders per product batch (the batches of several products may share one primary transaction)", buckets BATCH_BUCKETS);
    /// An order's time in its product's queue, from arrival until a batch took it.
    order_queue_seconds: Histogram("order_queue_seconds", "Time an order waited for its product's batch to take it", buckets ORDER_STAGE_BUCKETS);
    /// One batch's transaction on the primary, from sending it to its commit's answer.
    order_batch_seconds: Histogram("order_batch_seconds", "Time of one order batch's transaction on the primary (statement and commit)", buckets ORDER_STAGE_BUCKETS);
    /// How long a committed batch held its product's row: from taking the row lock (the send
    /// plus the wait the server measured) to its commit's answer. What the row's other writers
    /// wait behind, without the batch's hand-off to the combiner or its connection's checkout.
    order_row_held_seconds: Histogram("order_row_held_seconds", "Time a committed order batch held its product's row (row lock to the commit's answer)", buckets ORDER_STAGE_BUCKETS);
    order_transactions: IntCounter("order_transactions_total", "Primary transactions run to place orders");
    /// Order statements that ran past the stall limit (a row lock, most likely) and let the
    /// next statement start beside them (src/checkout/orders/).
    order_statements_stalled: IntCounter("order_statements_stalled_total", "Order statements that waited past the stall limit (a held row lock, most likely) and let the next statement start beside them");
    /// Batches rerun after losing a lock race (a deadlock or a serialization failure): rare by
    /// design, and never hidden.
    order_batch_reruns: IntCounterVec("order_batch_reruns_total", "Order batches rerun after a deadlock or serialization failure (nothing of the first run was written)", ["sqlstate"]);
    /// Single-product orders sent to their product's owner instance (src/http/peer/).
    orders_forwarded: IntCounterVec("orders_forwarded_total", "Orders sent to the owner instance of their contended product, by outcome: answered, unreachable (placed here instead), no_answer (the owner went silent: placed here under the same keys), unknown (the link failed after sending)", ["outcome"]);
    order_queue_depth: IntGauge("order_queue_depth", "Orders waiting for their product's next batch");
    cart_queue_depth: IntGauge("cart_queue_depth", "Carts waiting for the next batch of carts");
    /// Holds taken, confirmed, released, expired.
    holds: IntCounterVec("holds_total", "Holds by event: taken, confirmed, released, expired", ["event"]);
    /// Units held right now (all products).
    units_held: IntGauge("units_held", "Units in holds that have not ended (out of availability until they do)");
    /// Statements that claimed refused keys (each for many requests).
    refusal_statements: IntCounter("order_refusal_statements_total", "Primary statements that made refusals final (each claims many keys)");
    /// Refusals (orders' and holds') older than the idempotency window, deleted.
    refusals_purged: IntCounter("refusals_purged_total", "Refusals older than STOCKGATE_IDEMPOTENCY_WINDOW deleted (their keys may be used anew)");
    import_rows: IntCounter("import_rows_total", "Rows written by bulk imports");
    import_rate: Gauge("import_rows_per_second", "Current bulk import rate");
    import_paused_seconds: Counter("import_paused_for_lag_seconds_total", "Time bulk imports waited for replicas");
    /// Primary connections refused because the node was in recovery: only a Patroni-followed
    /// cluster can name a demoted node leader, but the series is 0 everywhere else too.
    /// Sampled from the database (every instance's events, every writer's), once a second.
    events_written: IntCounter("events_written_total", "Events written to the feed (database-wide, sampled)");
    /// How far the newest servable event is behind the newest written (a long transaction
    /// holding the horizon back), in seconds.
    event_feed_lag: Gauge("event_feed_lag_seconds", "Age of the newest servable event behind the newest written");
    webhook_backlog: IntGaugeVec("webhook_backlog_events", "Events of a webhook's types not yet delivered", ["webhook"]);
    webhook_failures: IntCounterVec("webhook_delivery_failures_total", "Webhook deliveries that failed (non-2xx, error or timeout)", ["webhook"]);
    webhook_delivered: IntCounterVec("webhook_deliveries_total", "Events delivered to webhooks", ["webhook"]);
    writes_refused_read_only: IntCounterVec("writes_refused_read_only_total", "Primary connections refused because the node was in recovery (a write would have met a read-only node)", ["at"]);
}

/// The `outcome` labels of `orders_total` (`checkout::Checkout::count`).
pub const ORDER_OUTCOMES: &[&str] = &[
    "confirmed",
    "replayed",
    "out_of_stock",
    "key_reused",
    "limit_exceeded",
    "sale_not_started",
    "sale_ended",
    "not_found",
    "rate_limited",
    "outcome_unknown",
    "hold_state",
    "error",
];
/// The `event` labels of `holds_total`.
pub const HOLD_EVENTS: &[&str] = &["taken", "confirmed", "released", "expired"];
/// The `op` labels of `ryw_store_failures_total` (`routing::Db::ryw_failed`).
pub const RYW_STEPS: &[&str] = &["get", "advance", "position"];
/// The `step` labels of `post_commit_failures_total`.
pub const POST_COMMIT_STEPS: &[&str] = &["reopen"];

/// `stockgate_orders_forwarded_total`'s outcomes (src/http/peer/).
pub const FORWARD_OUTCOMES: &[&str] = &["answered", "unreachable", "no_answer", "unknown"];
/// The order route's statuses that the 5xx alert divides (`deploy/prometheus/alerts.yml`):
/// the confirmations and the failures, so neither side of the ratio starts absent.
const ORDER_ROUTE_STATUSES: &[&str] = &["201", "500", "503"];

impl Metrics {
    /// Exports the labelled counters at 0 for every label value known before any traffic:
    /// a series that first appears at 1 hides that first increase from `rate()`, and an
    /// alert on an absent series never fires. (Routing's classes, targets, reasons and
    /// replicas are registered by `routing::Db::new`, which knows them.)
    fn export_zeroes(&self) {
        for outcome in ORDER_OUTCOMES {
            self.orders.with_label_values(&[outcome]);
        }
        for event in HOLD_EVENTS {
            self.holds.with_label_values(&[event]);
        }
        for step in RYW_STEPS {
            self.ryw_store_failures.with_label_values(&[step]);
        }
        for step in POST_COMMIT_STEPS {
            self.post_commit_failures.with_label_values(&[step]);
        }
        for status in ORDER_ROUTE_STATUSES {
            self.http_requests
                .with_label_values(&["/v1/orders", status]);
        }
        self.writes_refused_read_only
            .with_label_values(&["connect"]);
        for outcome in FORWARD_OUTCOMES {
            self.orders_forwarded.with_label_values(&[outcome]);
        }
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_registers_each_metric_under_the_stockgate_prefix() {
        let metrics = Metrics::new();
        // A second instance in the same process has a registry of its own.
        let _other = Metrics::new();
        metrics
            .http_requests
            .with_label_values(&["/v1/orders", "201"])
            .inc();
        metrics
            .http_duration
            .with_label_values(&["/v1/orders"])
            .observe(0.003);
        metrics.order_batch_size.observe(3.0);
        let text = metrics.render();
        for expected in [
            "stockgate_http_requests_total{route=\"/v1/orders\",status=\"201\"} 1",
            "stockgate_http_request_duration_seconds_bucket{route=\"/v1/orders\",le=\"0.005\"} 1",
            "stockgate_order_batch_size_bucket{le=\"4\"} 1",
            "stockgate_load_shed_total 0",
            "stockgate_units_held 0",
            "stockgate_import_rows_per_second 0",
            "stockgate_import_paused_for_lag_seconds_total 0",
            "stockgate_ryw_store_failures_total{op=\"get\"} 0",
            "stockgate_writes_refused_read_only_total{at=\"connect\"} 0",
            "stockgate_holds_total{event=\"expired\"} 0",
            "stockgate_orders_total{outcome=\"confirmed\"} 0",
            "stockgate_http_requests_total{route=\"/v1/orders\",status=\"503\"} 0",
        ] {
            assert!(text.contains(expected), "{expected} missing from:\n{text}");
        }
    }
}
