//! Prometheus metrics, one registry per application instance (tests run several in one
//! process).

use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub http_requests: IntCounterVec,
    pub http_duration: HistogramVec,
    pub replica_staleness: GaugeVec,
    pub replica_lag_bytes: IntGaugeVec,
    pub replica_state: IntGaugeVec,
    pub routing_decisions: IntCounterVec,
    pub routing_fallbacks: IntCounterVec,
    pub monitor_samples: IntCounterVec,
    pub monitor_errors: IntCounterVec,
    pub ryw_store_failures: IntCounterVec,
    pub orders: IntCounterVec,
    /// Steps after a commit that failed; the write stands and the step fails safe.
    pub post_commit_failures: IntCounterVec,
    pub load_shed: IntCounter,
    pub order_batch_size: prometheus::Histogram,
    pub order_transactions: IntCounter,
    pub order_queue_depth: prometheus::IntGauge,
    /// Holds taken, confirmed, released, expired.
    pub holds: IntCounterVec,
    /// Units held right now (all products).
    pub units_held: prometheus::IntGauge,
    /// Statements that claimed refused keys (each for many requests).
    pub refusal_statements: IntCounter,
    pub import_rows: IntCounter,
    pub import_rate: Gauge,
    pub import_paused_seconds: prometheus::Counter,
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(c.clone()))
        .expect("metric registered once");
    c
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
    r.register(Box::new(g.clone()))
        .expect("metric registered once");
    g
}

impl Metrics {
    #[allow(clippy::expect_used)]
    pub fn new() -> Self {
        let r = Registry::new_custom(Some("stockgate".into()), None).expect("valid prefix");
        let http_duration = HistogramVec::new(
            HistogramOpts::new("http_request_duration_seconds", "HTTP request latency").buckets(
                vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                ],
            ),
            &["route"],
        )
        .expect("static metric definition");
        r.register(Box::new(http_duration.clone()))
            .expect("metric registered once");
        let replica_staleness = GaugeVec::new(
            Opts::new(
                "replica_staleness_seconds",
                "Upper bound on how far each replica is behind the primary",
            ),
            &["replica"],
        )
        .expect("static metric definition");
        r.register(Box::new(replica_staleness.clone()))
            .expect("metric registered once");
        let import_rate =
            Gauge::new("import_rows_per_second", "Current bulk import rate").expect("static");
        r.register(Box::new(import_rate.clone()))
            .expect("metric registered once");
        let import_paused_seconds = prometheus::Counter::new(
            "import_paused_for_lag_seconds_total",
            "Time bulk imports waited for replicas",
        )
        .expect("static");
        r.register(Box::new(import_paused_seconds.clone()))
            .expect("metric registered once");
        let load_shed = IntCounter::new(
            "load_shed_total",
            "Requests refused with 503 because the service was at capacity",
        )
        .expect("static");
        r.register(Box::new(load_shed.clone()))
            .expect("metric registered once");
        let order_batch_size = prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "order_batch_size",
                "Orders per coalesced primary transaction",
            )
            .buckets(vec![
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
            ]),
        )
        .expect("static metric definition");
        r.register(Box::new(order_batch_size.clone()))
            .expect("metric registered once");
        let order_transactions = IntCounter::new(
            "order_transactions_total",
            "Primary transactions run to place orders",
        )
        .expect("static");
        r.register(Box::new(order_transactions.clone()))
            .expect("metric registered once");
        let order_queue_depth = prometheus::IntGauge::new(
            "order_queue_depth",
            "Orders waiting for their product's next batch",
        )
        .expect("static");
        r.register(Box::new(order_queue_depth.clone()))
            .expect("metric registered once");
        let refusal_statements = IntCounter::new(
            "order_refusal_statements_total",
            "Primary statements that made refusals final (each claims many keys)",
        )
        .expect("static");
        r.register(Box::new(refusal_statements.clone()))
            .expect("metric registered once");
        let units_held = prometheus::IntGauge::new(
            "units_held",
            "Units in holds that have not ended (out of availability until they do)",
        )
        .expect("static");
        r.register(Box::new(units_held.clone()))
            .expect("metric registered once");
        let import_rows =
            IntCounter::new("import_rows_total", "Rows written by bulk imports").expect("static");
        r.register(Box::new(import_rows.clone()))
            .expect("metric registered once");
        Metrics {
            http_requests: counter_vec(
                &r,
                "http_requests_total",
                "HTTP requests by route and status",
                &["route", "status"],
            ),
            http_duration,
            replica_staleness,
            replica_lag_bytes: gauge_vec(
                &r,
                "replica_lag_bytes",
                "WAL bytes the replica has not replayed",
                &["replica"],
            ),
            replica_state: gauge_vec(
                &r,
                "replica_state",
                "1 for the replica's current state",
                &["replica", "state"],
            ),
            routing_decisions: counter_vec(
                &r,
                "routing_decisions_total",
                "Routed reads by class, target and reason",
                &["class", "target", "reason"],
            ),
            routing_fallbacks: counter_vec(
                &r,
                "routing_fallbacks_total",
                "Replica-class reads that went to the primary",
                &["class", "reason"],
            ),
            monitor_samples: counter_vec(
                &r,
                "monitor_samples_total",
                "Freshness samples taken",
                &["node"],
            ),
            monitor_errors: counter_vec(
                &r,
                "monitor_sample_errors_total",
                "Freshness samples that failed or timed out",
                &["node"],
            ),
            ryw_store_failures: counter_vec(
                &r,
                "ryw_store_failures_total",
                "Read-your-writes store operations that failed (reads then go to the primary)",
                &["op"],
            ),
            orders: counter_vec(
                &r,
                "orders_total",
                "Order attempts by outcome",
                &["outcome"],
            ),
            post_commit_failures: counter_vec(
                &r,
                "post_commit_failures_total",
                "Steps after a committed write that failed (the write stands; the step fails safe)",
                &["step"],
            ),
            load_shed,
            order_batch_size,
            order_transactions,
            order_queue_depth,
            refusal_statements,
            holds: counter_vec(
                &r,
                "holds_total",
                "Holds by event: taken, confirmed, released, expired",
                &["event"],
            ),
            units_held,
            import_rows,
            import_rate,
            import_paused_seconds,
            registry: r,
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
