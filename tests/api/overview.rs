//! `GET /v1/admin/overview` (issue 29): the ops page's numbers, worked out by the service —
//! the thresholds of the running configuration, and rates of what it did over the last
//! minute.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::time::Duration;

fn class<'a>(overview: &'a Value, name: &str) -> &'a Value {
    overview["routing"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["class"] == name))
        .unwrap_or_else(|| panic!("no {name} in {overview}"))
}

fn label_rate(list: &Value, label: &str) -> Option<f64> {
    list.as_array()?
        .iter()
        .find(|e| e["label"] == label)?
        .get("per_s")?
        .as_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_is_for_admins_and_no_query_string_breaks_it() {
    let app = spawn_app(shared_cluster()).await;
    let anonymous = app.get_json("/v1/admin/overview", None).await;
    assert_error(&anonymous, 401, "UNAUTHORIZED");
    let (status, _) = app
        .get_json("/v1/admin/overview", Some("not-a-token"))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let user = app.user_token("ops-peeker");
    let (status, body) = app.get_json("/v1/admin/overview", Some(&user)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    for junk in ["?window=-1", "?%ff=%00", "?rates_over_s=abc&&&"] {
        let (status, body) = app
            .get_json(&format!("/v1/admin/overview{junk}"), Some(&app.admin))
            .await;
        assert_eq!(status, StatusCode::OK, "{junk}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_states_the_thresholds_in_force_and_rates_of_what_the_instance_did() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_EVICT_AFTER_MS", "3000".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    // The first look has nothing earlier to compare with: no rates, but every state.
    let (status, first) = app.get_json("/v1/admin/overview", Some(&app.admin)).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["rates_over_s"], Value::Null, "{first}");
    assert_eq!(class(&first, "stock_gate")["replica_per_s"], Value::Null);
    assert_eq!(
        first["thresholds"]["eviction_threshold_ms"], 3000,
        "{first}"
    );
    assert_eq!(first["thresholds"]["stock_gate_budget_ms"], 250, "{first}");
    assert_eq!(first["read_your_writes"]["store"], "in_process", "{first}");
    assert_eq!(first["read_your_writes"]["healthy"], true, "{first}");
    assert_eq!(first["units_held"], 0, "{first}");
    let classes: Vec<&str> = first["routing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["class"].as_str().unwrap())
        .collect();
    assert_eq!(classes.len(), stockgate::routing::policy::POLICY.len());

    // Gate reads and an order: they show as rates over the time since the first look.
    assert_eq!(
        app.create_product("overview-1", 50, 100).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(
        app.order("ov-buyer", "ov-1", "overview-1", 2)
            .await
            .status(),
        StatusCode::CREATED
    );
    app.wait_for(
        "stock-gate reads from a replica in the overview",
        Duration::from_secs(20),
        || async {
            app.availability("overview-1", 1).await;
            let (_, o) = app.get_json("/v1/admin/overview", Some(&app.admin)).await;
            class(&o, "stock_gate")["replica_per_s"]
                .as_f64()
                .is_some_and(|r| r > 0.0)
        },
    )
    .await;
    let (_, o) = app.get_json("/v1/admin/overview", Some(&app.admin)).await;
    let span = o["rates_over_s"].as_f64().expect("rates by now");
    assert!(span > 0.0 && span <= 61.0, "{o}");
    let confirmed = label_rate(&o["orders_per_s"], "confirmed").expect("confirmed");
    assert!(confirmed > 0.0, "{o}");
    assert_eq!(
        label_rate(&o["orders_per_s"], "key_reused"),
        Some(0.0),
        "{o}"
    );
    assert_eq!(label_rate(&o["holds_per_s"], "taken"), Some(0.0), "{o}");
    assert_eq!(o["read_your_writes"]["failures_per_s"], 0.0, "{o}");
    // Order lookups always read the primary, and that is no fallback.
    assert_eq!(class(&o, "order_lookup")["fallbacks_per_s"], 0.0, "{o}");
}
