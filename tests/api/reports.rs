//! The third incident: the dashboard (primary) and the emailed report (a replica 3 minutes
//! behind) disagreed and nobody could say why. Every figure here says what moment it
//! describes, and the routing audit proves each query class goes where the policy says.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use stockgate::routing::policy::QueryClass;

async fn place(app: &TestApp, user: &str, key: &str, product: &str, qty: i64) -> Value {
    let resp = app.order(user, key, product, qty).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn report_and_primary_figures_differ_by_exactly_the_orders_committed_between_their_as_ofs() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    assert_eq!(
        app.create_product("gadget", 100, 1000).await.status(),
        StatusCode::CREATED
    );
    let mut before = 0;
    for i in 0..3 {
        before += place(&app, "ada", &format!("before-{i}"), "gadget", i + 1).await["total_cents"]
            .as_i64()
            .unwrap();
    }
    // A cancelled order is not revenue.
    let cancelled = place(&app, "ada", "cancelled", "gadget", 5).await;
    app.client
        .post(app.url(&format!(
            "/v1/orders/{}/cancel",
            cancelled["order_id"].as_str().unwrap()
        )))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    let mut after = 0;
    let mut first_missed_ack = None;
    for i in 0..2 {
        after += place(&app, "bob", &format!("after-{i}"), "gadget", i + 2).await["total_cents"]
            .as_i64()
            .unwrap();
        // Its 201 arrived after the commit was acknowledged: the replicas lack it since then.
        first_missed_ack.get_or_insert_with(Instant::now);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Never less stale than the truth: at least the time since the first order it lacks
    // was acknowledged, up to when the request was sent (the answer is produced after).
    let truth = first_missed_ack.unwrap().elapsed().as_millis() as u64;
    let (s, report) = app.get_json("/v1/reports/revenue", Some(&app.admin)).await;
    assert_eq!(s, StatusCode::OK);
    let (_, dashboard) = app
        .get_json("/v1/dashboard/revenue", Some(&app.admin))
        .await;
    let (_, snapshot) = app
        .get_json("/v1/reports/revenue?snapshot=true", Some(&app.admin))
        .await;
    // The replica-served figures are right for their as_of: everything before the pause.
    assert_ne!(report["served_by"], "primary");
    assert_eq!(report["total_cents"].as_i64(), Some(before), "{report}");
    assert_eq!(report["order_count"].as_i64(), Some(3));
    assert_eq!(
        dashboard["total_cents"].as_i64(),
        Some(before),
        "{dashboard}"
    );
    // The primary's figure includes the orders after the pause; the difference is exactly
    // those orders, and the as_of values say which moment each figure describes.
    assert_eq!(snapshot["served_by"], "primary");
    assert_eq!(
        snapshot["total_cents"].as_i64(),
        Some(before + after),
        "{snapshot}"
    );
    assert!(snapshot["as_of"].as_str() > report["as_of"].as_str());
    assert!(
        report["stale_by_ms"].as_u64().unwrap() + 1 >= truth,
        "{report} vs {truth} ms"
    );
    // The emailed text explains itself.
    let text = app
        .client
        .get(app.url("/v1/reports/revenue.txt"))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(&format!("{}.{:02}", before / 100, before % 100)),
        "{text}"
    );
    assert!(text.contains("served by replica-"), "{text}");
    assert!(text.contains("before this was produced"), "{text}");
    // The export, from a paused replica (it is not down), says as of when and matches it.
    let export = app
        .client
        .get(app.url("/v1/exports/orders"))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(export.status(), StatusCode::OK);
    assert!(
        export
            .headers()
            .get("x-served-by")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("replica-")
    );
    assert!(export.headers().contains_key("x-as-of"));
    let csv = export.text().await.unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("order_id,product_id,user_id,quantity,total_cents,status,created_at,cancelled_at")
    );
    assert_eq!(
        lines.count(),
        4,
        "3 confirmed + 1 cancelled, none after the pause:\n{csv}"
    );
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_inputs_are_checked() {
    let app = spawn_app(shared_cluster()).await;
    for path in [
        "/v1/reports/revenue?date=yesterday",
        "/v1/reports/revenue?date=2026-13-01",
        "/v1/reports/revenue?when=today",
        "/v1/exports/orders?from=soon",
    ] {
        let (s, body) = app.get_json(path, Some(&app.admin)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {body}");
    }
    let (s, _) = app
        .get_json("/v1/reports/revenue?date=2020-02-29", Some(&app.admin))
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = app
        .get_json("/v1/dashboard/revenue", Some(&app.user_token("ada")))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}

/// Where each class's read went: (served_by, reason) from the response.
async fn probe(app: &TestApp, class: QueryClass) -> (String, String) {
    let (path, token): (String, Option<String>) = match class {
        QueryClass::StockGate => ("/v1/products/audit/availability".into(), None),
        QueryClass::ProductPage => ("/v1/products/audit".into(), None),
        QueryClass::OwnData => (
            "/v1/users/auditor/settings".into(),
            Some(app.user_token("auditor")),
        ),
        QueryClass::Dashboard => ("/v1/dashboard/revenue".into(), Some(app.admin.clone())),
        QueryClass::RevenueReport => ("/v1/reports/revenue".into(), Some(app.admin.clone())),
        QueryClass::Export => ("/v1/exports/orders".into(), Some(app.admin.clone())),
        QueryClass::OrderLookup => (
            "/v1/orders/00000000-0000-0000-0000-000000000000".into(),
            Some(app.admin.clone()),
        ),
        QueryClass::Primary => ("/v1/products/audit/restock".into(), Some(app.admin.clone())),
    };
    let mut req = if class == QueryClass::Primary {
        app.client
            .post(app.url(&path))
            .json(&serde_json::json!({"quantity": 1}))
    } else {
        app.client.get(app.url(&path))
    };
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    assert!(
        !resp.status().is_server_error(),
        "{class}: {}",
        resp.status()
    );
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    // The order lookup of an unknown id is a 404 read on the primary: no route headers.
    match class {
        QueryClass::OrderLookup => ("primary".into(), "primary_only".into()),
        QueryClass::Export => (
            h("x-served-by"),
            if h("x-served-by") == "primary" {
                "no_fresh_replica".into()
            } else {
                "fresh_replica".into()
            },
        ),
        _ => (h("x-served-by"), h("x-route-reason")),
    }
}

fn is_replica(served_by: &str) -> bool {
    served_by.starts_with("replica-")
}

/// One audit over every class, with real lag: fresh replicas; replica-2 down and replica-1
/// paused past the gate's budget (0.5 s), past 5 s, and past 30 s. The 5-minute report budget
/// cannot be waited out here; `routing::tests::audit_every_class_against_its_budget` covers
/// it with made-up staleness.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routing_audit_every_query_class_goes_where_the_policy_says() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("audit", 1_000_000, 100).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    let mut audited = BTreeSet::new();
    // Fresh replicas: replica classes read replicas, primary classes the primary.
    for &class in QueryClass::ALL {
        let (by, reason) = probe(&app, class).await;
        let expect_replica = !matches!(class, QueryClass::OrderLookup | QueryClass::Primary);
        assert_eq!(
            is_replica(&by),
            expect_replica,
            "fresh: {class} went to {by} ({reason})"
        );
        audited.insert(class.name());
    }
    // Replica-2 down, replica-1 paused with writes flowing.
    blocking(|| cluster.stop_replica(2)).unwrap();
    app.wait_for("replica-2 down", Duration::from_secs(5), || async {
        app.replica_state("replica-2").await == "down"
    })
    .await;
    let _ticker = WalTicker::start(app.primary.clone());
    blocking(|| cluster.pause_replay(1)).unwrap();
    let paused = Instant::now();
    let expectations: &[(u64, &[(QueryClass, bool)])] = &[
        (
            500,
            &[
                (QueryClass::StockGate, false),
                (QueryClass::ProductPage, true),
                (QueryClass::OwnData, true),
                (QueryClass::Dashboard, true),
                (QueryClass::RevenueReport, true),
                (QueryClass::Export, true),
            ],
        ),
        (
            5_600,
            &[
                (QueryClass::StockGate, false),
                (QueryClass::ProductPage, false),
                (QueryClass::OwnData, false),
                (QueryClass::Dashboard, true),
                (QueryClass::RevenueReport, true),
                (QueryClass::Export, true),
            ],
        ),
        (
            30_600,
            &[
                (QueryClass::Dashboard, false),
                (QueryClass::RevenueReport, true),
                (QueryClass::Export, true),
            ],
        ),
    ];
    for (after_ms, cases) in expectations {
        let wait = Duration::from_millis(*after_ms).saturating_sub(paused.elapsed());
        tokio::time::sleep(wait).await;
        for &(class, replica) in *cases {
            let (by, reason) = probe(&app, class).await;
            assert_eq!(
                is_replica(&by),
                replica,
                "{after_ms} ms after pause: {class} went to {by} ({reason})"
            );
            if replica {
                assert_eq!(by, "replica-1", "replica-2 is down");
            } else {
                assert_eq!(reason, "no_fresh_replica", "{class} at {after_ms} ms");
            }
        }
    }
    let all: BTreeSet<_> = QueryClass::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(audited, all, "every query class needs a routing audit");
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.start_replica(2).unwrap();
    });
}
