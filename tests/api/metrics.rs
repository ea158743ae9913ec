//! Every metric that the alert rules and the Grafana dashboard name is on `/metrics` of a
//! fresh instance, before any traffic (issue 29): an alert on `rate()` of an absent series
//! never fires, and a panel on one stays empty. The names are read out of
//! `deploy/prometheus/alerts.yml` and `deploy/grafana/stockgate.json`, so this cannot drift.

use crate::helpers::*;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::Path;

fn deploy_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The `stockgate_…` metric names in a text (a rule, a query).
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("stockgate_") {
        let word: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if word.len() > "stockgate_".len() {
            names.insert(word.clone());
        }
        rest = &rest[i + word.len().max(1)..];
    }
    names
}

/// Every `expr` of every panel (and of panels inside collapsed rows).
fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// The metric names the alert rules and the dashboard's queries use.
fn named() -> BTreeSet<String> {
    let mut names = names_in(&deploy_file("deploy/prometheus/alerts.yml"));
    let dashboard: Value = serde_json::from_str(&deploy_file("deploy/grafana/stockgate.json"))
        .expect("the dashboard is JSON");
    let mut queries = vec![];
    exprs(&dashboard, &mut queries);
    assert!(queries.len() >= 20, "the dashboard's queries: {queries:?}");
    for q in &queries {
        let found = names_in(q);
        assert!(!found.is_empty(), "a dashboard query names no metric: {q}");
        names.extend(found);
    }
    // The parsing found what it must: one name from each file at least.
    assert!(names.contains("stockgate_replica_staleness_seconds"));
    assert!(names.contains("stockgate_order_queue_seconds_bucket"));
    names
}

/// The names of the samples on a `/metrics` page.
fn exported(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

fn missing(named: &BTreeSet<String>, exported: &BTreeSet<String>, patroni: bool) -> Vec<String> {
    named
        .iter()
        .filter(|n| patroni || !n.starts_with("stockgate_patroni_"))
        .filter(|n| !exported.contains(*n))
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_instance_exports_every_metric_the_alerts_and_the_dashboard_name() {
    let app = spawn_app(shared_cluster()).await;
    let page = app.metrics_text().await;
    let exported = exported(&page);
    let missing = missing(&named(), &exported, false);
    assert!(missing.is_empty(), "not on a fresh /metrics: {missing:?}");

    // The series the rules select exist at 0 before their first event, so the first one is
    // an increase that rate() sees.
    for (name, labels) in [
        (
            "stockgate_routing_decisions_total",
            &[("class", "stock_gate"), ("target", "replica")][..],
        ),
        (
            "stockgate_routing_fallbacks_total",
            &[("class", "stock_gate"), ("reason", "no_fresh_replica")],
        ),
        ("stockgate_ryw_store_failures_total", &[("op", "get")]),
        (
            "stockgate_writes_refused_read_only_total",
            &[("at", "connect")],
        ),
        (
            "stockgate_http_requests_total",
            &[("route", "/v1/orders"), ("status", "503")],
        ),
        ("stockgate_holds_total", &[("event", "expired")]),
        ("stockgate_orders_total", &[("outcome", "out_of_stock")]),
        (
            "stockgate_monitor_sample_errors_total",
            &[("node", "replica-2")],
        ),
    ] {
        assert_eq!(
            metric_sample(&page, name, labels),
            Some(0.0),
            "{name} {labels:?} at 0 on a fresh instance"
        );
    }
    // Each replica's state is there from the start, and the thresholds in force.
    for replica in ["replica-1", "replica-2"] {
        assert!(
            metric_sample(
                &page,
                "stockgate_replica_state",
                &[("replica", replica), ("state", "down")]
            )
            .is_some(),
            "{replica}'s state"
        );
    }
    assert_eq!(
        metric_sample(
            &page,
            "stockgate_routing_staleness_budget_seconds",
            &[("class", "stock_gate")]
        ),
        Some(0.25)
    );
    assert_eq!(
        metric_sample(&page, "stockgate_replica_eviction_threshold_seconds", &[]),
        Some(5.0)
    );
    // Patroni's series belong to instances that follow Patroni: here PatroniNoLeader must
    // have nothing to fire on.
    let patroni: Vec<_> = exported
        .iter()
        .filter(|n| n.starts_with("stockgate_patroni_"))
        .collect();
    assert!(patroni.is_empty(), "{patroni:?} without Patroni");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_follows_patroni_exports_the_patroni_metrics_from_the_start() {
    let cluster = shared_cluster();
    let database = fresh_database(cluster).await;
    // The shared cluster as Patroni would describe it: its primary leads.
    let members: Vec<Value> = (0..=cluster.replica_count())
        .map(|i| {
            json!({"name": format!("node-{i}"), "role": if i == 0 { "leader" } else { "replica" },
                   "state": "running", "host": "127.0.0.1", "port": cluster.port(i), "timeline": 1})
        })
        .collect();
    let patroni = FakePatroni::start(json!({ "members": members }).to_string()).await;
    let app = spawn_app_with(AppOptions {
        database: Some(database),
        replicas: false,
        env: vec![("STOCKGATE_PATRONI_URLS", patroni.url.clone())],
        ..AppOptions::new(cluster)
    })
    .await;
    let page = app.metrics_text().await;
    let missing = missing(&named(), &exported(&page), true);
    assert!(missing.is_empty(), "not on a fresh /metrics: {missing:?}");
    assert_eq!(
        metric_sample(&page, "stockgate_patroni_has_leader", &[]),
        Some(1.0),
        "a leader from the start: PatroniNoLeader stays quiet"
    );
    assert_eq!(
        metric_sample(&page, "stockgate_patroni_leader_changes_total", &[]),
        Some(0.0)
    );
    // Every member is listed among the replicas, the leader too; its entry is no replica,
    // so it has no staleness or state for ReplicaStale and ReplicaDown to page on.
    for name in [
        "stockgate_replica_state",
        "stockgate_replica_staleness_seconds",
        "stockgate_replica_lag_bytes",
    ] {
        assert_eq!(
            metric_sample(&page, name, &[("replica", "node-0")]),
            None,
            "{name}"
        );
        assert!(
            metric_sample(&page, name, &[("replica", "node-1")]).is_some(),
            "{name}"
        );
    }
}
