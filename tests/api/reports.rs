//! The third incident: the dashboard (primary) and the emailed report (a replica 3 minutes
//! behind) disagreed and nobody could say why. Every figure here says what moment it
//! describes, and the routing audit proves each query class goes where the policy says.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use stockgate::routing::policy::{QueryClass, Target, WhenNoFreshReplica};

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
            parse::<Order>(&cancelled).order_id
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

/// A routed read as the service reports it over HTTP.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    /// `primary`, a replica's name, or `replica` when only the metrics saw it.
    served_by: String,
    reason: String,
    /// Where the observation came from: the response, the routing metrics, or both.
    source: &'static str,
}

/// The one HTTP request that reads through `class`. The mapping from class to endpoint is the
/// only thing written down here; where each read goes is observed, not assumed.
fn request_for(app: &TestApp, class: QueryClass, order_id: &str) -> reqwest::RequestBuilder {
    let get = |path: &str| app.client.get(app.url(path));
    let admin = app.admin.clone();
    match class {
        QueryClass::StockGate => get("/v1/products/audit/availability"),
        QueryClass::ProductPage => get("/v1/products/audit"),
        // A user who never wrote: no read-your-writes position narrows the choice.
        QueryClass::OwnData => {
            get("/v1/users/auditor/settings").bearer_auth(app.user_token("auditor"))
        }
        QueryClass::OrderLookup => get(&format!("/v1/orders/{order_id}")).bearer_auth(admin),
        QueryClass::Dashboard => get("/v1/dashboard/revenue").bearer_auth(admin),
        QueryClass::RevenueReport => get("/v1/reports/revenue").bearer_auth(admin),
        QueryClass::Export => get("/v1/exports/orders").bearer_auth(admin),
        QueryClass::Events => get("/v1/events").bearer_auth(admin),
        QueryClass::Ledger => get("/v1/admin/ledger").bearer_auth(admin),
        // Its own product, so the restock's reopening never touches the gate's probe.
        QueryClass::Primary => app
            .client
            .post(app.url("/v1/products/audit-restock/restock"))
            .json(&serde_json::json!({"quantity": 1}))
            .bearer_auth(admin),
    }
}

/// Sends `class`'s request and reports where its read went: from the route the response
/// states (`X-Served-By`, `X-Route-Reason`) and from the routing decision the metrics
/// recorded meanwhile, which must agree. A response answered from memory (the gate's cache
/// keeps an answer up to its 250 ms budget) records no decision: it is asked again.
async fn observe(app: &TestApp, class: QueryClass, order_id: &str) -> Observed {
    let started = Instant::now();
    loop {
        let before = decisions(app, class).await;
        let resp = request_for(app, class, order_id).send().await.unwrap();
        assert!(resp.status().is_success(), "{class}: {}", resp.status());
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (served_by, reason) = (header("x-served-by"), header("x-route-reason"));
        drop(resp);
        let after = decisions(app, class).await;
        let recorded: Vec<(String, String)> = after
            .iter()
            .filter(|(k, v)| **v > before.get(*k).copied().unwrap_or(0.0))
            .map(|(k, _)| k.clone())
            .collect();
        // The last word: a replica read that found no row is asked again on the primary.
        let decided = recorded
            .iter()
            .find(|(target, _)| target == "primary")
            .or(recorded.first())
            .cloned();
        match (served_by, reason, decided) {
            (Some(by), reason, Some((target, recorded_reason))) => {
                let stated_target = if is_replica(&by) {
                    "replica"
                } else {
                    "primary"
                };
                assert_eq!(
                    stated_target, target,
                    "{class}: stated {by}, recorded {recorded:?}"
                );
                if let Some(r) = &reason {
                    assert_eq!(*r, recorded_reason, "{class}: stated reason vs recorded");
                }
                return Observed {
                    served_by: by,
                    reason: recorded_reason,
                    source: if reason.is_some() {
                        "response + metrics"
                    } else {
                        "served_by + metrics"
                    },
                };
            }
            (None, None, Some((target, reason))) => {
                let served_by = if target == "primary" {
                    "primary".into()
                } else {
                    target
                };
                return Observed {
                    served_by,
                    reason,
                    source: "metrics only",
                };
            }
            // A route that needs no decision: the class only ever reads the primary.
            (Some(by), Some(reason), None) if reason == "primary_only" => {
                return Observed {
                    served_by: by,
                    reason,
                    source: "response only (not recorded in the routing metrics)",
                };
            }
            (by, reason, None) => {
                assert!(
                    started.elapsed() < Duration::from_secs(2),
                    "{class}: no routing decision recorded within 2 s (stated {by:?}, {reason:?})"
                );
                tokio::time::sleep(Duration::from_millis(10)).await; // the poll interval
            }
            (by, reason, decided) => {
                panic!("{class}: stated {by:?} ({reason:?}) but recorded {decided:?}")
            }
        }
    }
}

fn is_replica(served_by: &str) -> bool {
    served_by.starts_with("replica")
}

/// What the service says of its replicas: (name, state, staleness in ms).
type ReplicaStates = Vec<(String, String, Option<u64>)>;

/// Where the policy sends `class`, given what the service measures of its replicas: the
/// replicas that may serve it, or the primary and why.
#[derive(Debug, Clone, PartialEq)]
enum Expected {
    Replica(BTreeSet<String>),
    Primary(&'static str),
    Refused,
}

fn expected(class: QueryClass, replicas: &ReplicaStates, eviction_ms: u64) -> Expected {
    let p = class.policy();
    if p.target == Target::Primary {
        return Expected::Primary("primary_only");
    }
    let budget_ms = p.budget.map(|b| b.as_millis() as u64);
    let fit: BTreeSet<String> = replicas
        .iter()
        .filter(|(_, state, staleness)| {
            state != "down"
                && budget_ms.is_none_or(|b| {
                    // A lagging replica serves only budgets above the eviction threshold.
                    staleness.is_some_and(|s| s <= b) && (state == "healthy" || b > eviction_ms)
                })
        })
        .map(|(name, _, _)| name.clone())
        .collect();
    match (fit.is_empty(), p.when_no_fresh_replica) {
        (false, _) => Expected::Replica(fit),
        (true, WhenNoFreshReplica::UsePrimary) => Expected::Primary("no_fresh_replica"),
        (true, WhenNoFreshReplica::Refuse) => Expected::Refused,
    }
}

/// Audits every class: derives where it must go from the replicas' measured state before
/// and after the request (both must give the same answer, or the request straddled a budget
/// and is asked again), observes where it went, and records the outcome per class. Each
/// class is asked once more than there are replicas in a row, so the router's rotation
/// offers it every replica at least once.
async fn audit_round(
    app: &TestApp,
    label: &str,
    eviction_ms: u64,
    order_id: &str,
    seen: &mut BTreeMap<&'static str, BTreeSet<String>>,
) {
    let asks = app.replica_states().await.len() + 1;
    for &class in QueryClass::ALL {
        let mut went = BTreeSet::new();
        for _ in 0..asks {
            let started = Instant::now();
            let (want, got, states) = loop {
                let before = app.replica_states().await;
                let got = observe(app, class, order_id).await;
                let after = app.replica_states().await;
                let want = expected(class, &before, eviction_ms);
                if want == expected(class, &after, eviction_ms) {
                    break (want, got, after);
                }
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "{label}: {class} keeps straddling a budget"
                );
            };
            match &want {
                Expected::Replica(names) => assert!(
                    names.contains(&got.served_by) && got.reason == "fresh_replica",
                    "{label}: {class} should read one of {names:?}, went to {got:?}; replicas {states:?}"
                ),
                Expected::Primary(reason) => assert!(
                    got.served_by == "primary" && got.reason == *reason,
                    "{label}: {class} should read the primary ({reason}), went to {got:?}; replicas {states:?}"
                ),
                Expected::Refused => panic!("{label}: {class}: no class refuses today; audit it"),
            }
            let side = if is_replica(&got.served_by) {
                "replica"
            } else {
                "primary"
            };
            seen.entry(class.name())
                .or_default()
                .insert(side.to_string());
            went.insert(format!(
                "{} ({}; {})",
                got.served_by, got.reason, got.source
            ));
        }
        eprintln!("audit {label}: {class:<14} -> {went:?}");
    }
}

/// The routing audit: every class in `QueryClass::ALL`, each observed over HTTP, against
/// expectations derived from its policy row and the staleness the service measures — with
/// both replicas fresh, then with replica-2 down and replica-1 paused (writes flowing) past
/// each staleness budget the test can wait out. The revenue report's 5-minute budget cannot
/// be waited out here: it is seen only on the replica side, and
/// `routing::tests::audit_every_class_against_its_budget` covers its other side.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routing_audit_every_query_class_goes_where_the_policy_says() {
    const LONGEST_WAIT_MS: u64 = 40_000;
    /// How far past a budget a round runs, so the round's own requests never straddle it.
    const PAST_BY_MS: u64 = 600;
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    // The policy the service serves is the one the expectations are derived from.
    let (_, routing) = app.get_json("/v1/admin/routing", Some(&app.admin)).await;
    for &class in QueryClass::ALL {
        let served = routing["classes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == class.name())
            .unwrap_or_else(|| panic!("{class} missing from /v1/admin/routing"));
        let p = class.policy();
        assert_eq!(
            served["staleness_budget_ms"].as_u64(),
            p.budget.map(|b| b.as_millis() as u64)
        );
        assert_eq!(served["target"], serde_json::to_value(p.target).unwrap());
    }
    let eviction_ms = routing["eviction_threshold_ms"].as_u64().unwrap();
    for id in ["audit", "audit-restock"] {
        assert_eq!(
            app.create_product(id, 1_000_000, 100).await.status(),
            StatusCode::CREATED
        );
    }
    // The order the lookup reads is on the restock product: a sale puts its post-commit
    // stock in the gate's cache, which would answer the gate's probe from memory.
    let order = place(&app, "audit-buyer", "audit-order", "audit-restock", 1).await;
    let order_id = parse::<Order>(&order).order_id.to_string();
    let acks = AckLog::start(app.primary.clone()).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    let mut seen: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();

    audit_round(&app, "fresh", eviction_ms, &order_id, &mut seen).await;

    // Replica-2 down, replica-1 paused while writes flow: from here replica-1's staleness
    // only grows, and every boundary the policy draws gets crossed in turn.
    blocking(|| cluster.stop_replica(2)).unwrap();
    app.wait_for("replica-2 down", Duration::from_secs(5), || async {
        app.replica_state("replica-2").await == "down"
    })
    .await;
    blocking(|| cluster.pause_replay(1)).unwrap();
    let mut boundaries: Vec<u64> = QueryClass::ALL
        .iter()
        .filter(|c| c.policy().target == Target::Replica)
        .filter_map(|c| c.policy().budget.map(|b| b.as_millis() as u64))
        .chain([eviction_ms])
        .filter(|b| b + PAST_BY_MS <= LONGEST_WAIT_MS)
        .collect();
    boundaries.sort_unstable();
    boundaries.dedup();
    for boundary in boundaries {
        let past = boundary + PAST_BY_MS;
        app.wait_for(
            &format!("replica-1 over {past} ms behind"),
            Duration::from_millis(past + 15_000),
            || async {
                app.replica_states()
                    .await
                    .iter()
                    .any(|(n, _, s)| n == "replica-1" && s.is_some_and(|s| s > past))
            },
        )
        .await;
        // The lag is real: replica-1 lacks a commit acknowledged more than the boundary
        // ago, and the service's claim about it is no fresher than the truth.
        let held = held_by_replica(&cluster, 1, &app.database).await;
        let truth = acks.true_staleness(held, Instant::now());
        assert!(
            truth > Duration::from_millis(boundary),
            "replica-1 only {truth:?} behind"
        );
        assert_claim_is_honest(&app, &cluster, 1, &acks).await;
        audit_round(
            &app,
            &format!("past {boundary} ms"),
            eviction_ms,
            &order_id,
            &mut seen,
        )
        .await;
    }

    // Every class was audited, and every class with a budget the test could wait out was
    // seen on both sides of it.
    let all: BTreeSet<&str> = QueryClass::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(seen.keys().copied().collect::<BTreeSet<_>>(), all);
    for &class in QueryClass::ALL {
        let p = class.policy();
        let sides: Vec<&str> = match (p.target, p.budget) {
            (Target::Primary, _) => vec!["primary"],
            (Target::Replica, None) => vec!["replica"],
            (Target::Replica, Some(b)) if b.as_millis() as u64 + PAST_BY_MS <= LONGEST_WAIT_MS => {
                vec!["primary", "replica"]
            }
            (Target::Replica, Some(_)) => vec!["replica"],
        };
        let want: BTreeSet<String> = sides.into_iter().map(String::from).collect();
        assert_eq!(seen[class.name()], want, "{class}");
    }
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.start_replica(2).unwrap();
    });
}
