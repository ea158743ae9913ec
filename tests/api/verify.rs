//! `stockgate verify` and `GET /v1/admin/ledger` (issue 47, point 3): every product's count
//! at every location is what its ledger gives — after the service's own writes, and after a
//! database was migrated to the ledger — and a count changed behind the service's back, or a
//! lost movement, is named with both numbers. Exit 0 / 1 / 2: agree / disagree / could not
//! check.

use crate::helpers::*;
use reqwest::{Method, StatusCode};
use serde_json::json;
use std::process::{Command, Output};
use std::time::Duration;

/// `stockgate verify` against `database` on `cluster` (its replicas too).
fn verify(cluster: &devcluster::Cluster, database: &str) -> Output {
    verify_at(
        &cluster.primary_url(database),
        &cluster.replica_urls(database),
    )
}

fn verify_at(primary: &str, replicas: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .arg("verify")
        .env("DATABASE_URL", primary)
        .env("STOCKGATE_REPLICA_URLS", replicas)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

/// (exit code, stdout, stderr).
fn outcome(out: &Output) -> (Option<i32>, String, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The summary line's `key=value` fields.
fn summary(stdout: &str) -> std::collections::HashMap<String, String> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("SUMMARY "))
        .unwrap_or_else(|| panic!("no SUMMARY line in {stdout:?}"));
    line.split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The replicas have replayed everything committed so far: whichever node the check is
/// routed to sees it.
fn caught_up(cluster: &devcluster::Cluster) {
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
}

/// A little of everything that moves stock, made by the service: a product created at two
/// locations and one at `default`, a restock, orders, a cancel, a transfer and a live hold.
async fn activity(app: &TestApp) {
    let loc = json!({"location_id": "eu-1", "name": "Leeds", "rank": 10});
    let (s, b) = send_admin(app, Method::POST, "/v1/locations", None, loc).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let two = json!({"product_id": "v1", "name": "v1", "price_cents": 100,
                     "stock": [{"location_id": "default", "quantity": 10}, {"location_id": "eu-1", "quantity": 5}]});
    let (s, b) = answer(app.post_product(&two).await).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let (s, b) = answer(app.create_product("v2", 8, 250).await).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let restock = json!({"quantity": 4, "location_id": "default"});
    let (s, b) = send_admin(app, Method::POST, "/v1/products/v1/restock", None, restock).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let order = |key: &'static str, qty: i64| {
        let body = json!({"lines": [{"product_id": "v1", "quantity": qty}, {"product_id": "v2", "quantity": 1}]});
        async move { send_as(app, Method::POST, "/v1/orders", "buyer", Some(key), body).await }
    };
    let (s, kept) = order("o1", 3).await;
    assert_eq!(s, StatusCode::CREATED, "{kept}");
    let (s, cancelled) = order("o2", 6).await;
    assert_eq!(s, StatusCode::CREATED, "{cancelled}");
    let id = cancelled["order_id"].as_str().unwrap();
    let path = format!("/v1/orders/{id}/cancel");
    let (s, b) = send_as(app, Method::POST, &path, "buyer", None, json!({})).await;
    assert_eq!(
        (s, b["status"].as_str()),
        (StatusCode::OK, Some("cancelled")),
        "{b}"
    );
    let moving = json!({"product_id": "v1", "from": "default", "to": "eu-1", "quantity": 2, "in_transit": false});
    let (s, b) = send_admin(app, Method::POST, "/v1/transfers", Some("t1"), moving).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let hold = json!({"lines": [{"product_id": "v1", "quantity": 2}], "ttl_s": 600, "locations": ["default"]});
    let (s, b) = send_as(app, Method::POST, "/v1/holds", "holder", Some("h1"), hold).await;
    assert_eq!(
        (s, b["status"].as_str()),
        (StatusCode::CREATED, Some("held")),
        "{b}"
    );
}

// Mutation: the check subtracts the allocations of every order that is not refused (the
// cancelled one too): v1 disagrees at once, exit 1.
// Mutation: the check ignores holds: the live hold's 2 units at v1/default disagree, exit 1.
// Mutation: `compare` says every pair agrees: the UPDATE goes unnamed, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_changed_behind_the_services_back_is_named_with_both_counts() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    activity(&app).await;
    caught_up(cluster);
    let (code, stdout, stderr) = outcome(&verify(cluster, &app.database));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(!stdout.contains("DISAGREE"), "{stdout}");
    let s = summary(&stdout);
    assert_eq!(
        s["checked"], "3",
        "v1 at two locations, v2 at one: {stdout}"
    );
    assert_eq!(s["disagreeing"], "0");

    let held: i32 = sqlx::query_scalar(
        "UPDATE stock_levels SET available_quantity = available_quantity + 1 \
          WHERE product_id = 'v1' AND location_id = 'eu-1' RETURNING available_quantity",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    caught_up(cluster);
    let (code, stdout, stderr) = outcome(&verify(cluster, &app.database));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let want = format!(
        "DISAGREE product=v1 location=eu-1 held={held} ledger={}",
        held - 1
    );
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("DISAGREE"))
        .collect();
    assert_eq!(lines, [want.as_str()], "{stdout}");
    let s = summary(&stdout);
    assert_eq!(
        (s["checked"].as_str(), s["disagreeing"].as_str()),
        ("3", "1")
    );
    assert!(
        ["primary", "replica-1", "replica-2"].contains(&s["served_by"].as_str()),
        "{stdout}"
    );
    chrono::DateTime::parse_from_rfc3339(&s["as_of"]).expect("as_of is RFC 3339");
    app.stop().await;
}

// Mutation: `compare` flags only counts above their ledger (stock no record explains, what
// the first test's UPDATE makes): a lost transfer-out leaves the count 2 below its ledger,
// unnamed, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_movement_is_named() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    activity(&app).await;
    let deleted = sqlx::query(
        "DELETE FROM movements WHERE movement_id = (SELECT movement_id FROM movements \
          WHERE product_id = 'v1' AND location_id = 'default' AND reason = 'transfer_out')",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    assert_eq!(
        deleted.rows_affected(),
        1,
        "the transfer's movement out of default"
    );
    caught_up(cluster);
    let (code, stdout, stderr) = outcome(&verify(cluster, &app.database));
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("DISAGREE"))
        .collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert!(
        lines[0].starts_with("DISAGREE product=v1 location=default held="),
        "{stdout}"
    );
    // The transfer took 2 out: without its movement the ledger gives 2 more than is held.
    let n = |key: &str| -> i64 {
        let field = lines[0]
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key));
        field.unwrap().parse().unwrap()
    };
    assert_eq!(n("held=") - n("ledger="), -2, "{stdout}");
    app.stop().await;
}

/// The migration that starts the ledger: the version below which the schema has none.
const MOVEMENTS: i64 = 20261206000001;

// Mutation: the check reads allocations of holds in any status but `refused` (the released
// hold's unit is subtracted again): m2/default disagrees, exit 1 and a disagreement listed.
// Mutation: the check reads cancelled orders' allocations: m1/eu-1 disagrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_migrated_to_the_ledger_agrees_with_it() {
    let cluster = shared_cluster();
    let (db, url, pool) = database_before(cluster, MOVEMENTS).await;
    // As the binary with locations but no ledger wrote it (its sessions set
    // `stockgate.levels`, so it writes the levels itself): m1 at two locations (7 = 5 + 2),
    // m2 at default; a confirmed order, a cancelled one, a refusal, a confirmed cart across
    // both locations, a live hold and a released one.
    sqlx::raw_sql(
        "SELECT set_config('stockgate.levels', 'on', false); \
         INSERT INTO locations (location_id, name, rank) VALUES ('eu-1', 'Leeds', 10); \
         INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) VALUES \
           ('m1', 'one', 100, 7, 10), ('m2', 'two', 200, 3, 6); \
         INSERT INTO stock_levels (product_id, location_id, available_quantity) VALUES \
           ('m1', 'default', 5), ('m1', 'eu-1', 2), ('m2', 'default', 3); \
         INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, \
                             idempotency_key, request_fingerprint, allocations) VALUES \
           ('00000000-0000-7000-8000-000000000001', 'm1', 'u1', 2, 100, 200, 'confirmed', 'k1', 'm1:2', \
            '[{\"product_id\": \"m1\", \"location_id\": \"default\", \"quantity\": 2}]'), \
           ('00000000-0000-7000-8000-000000000002', 'm1', 'u2', 1, 100, 100, 'cancelled', 'k2', 'm1:1', \
            '[{\"product_id\": \"m1\", \"location_id\": \"eu-1\", \"quantity\": 1}]'), \
           ('00000000-0000-7000-8000-000000000003', 'm2', 'u3', 9, 0, 0, 'refused', 'k3', 'm2:9', '[]'), \
           ('00000000-0000-7000-8000-000000000004', NULL, 'u4', NULL, 0, 500, 'confirmed', 'k4', 'cart:m1:1,m2:2', \
            '[{\"product_id\": \"m1\", \"location_id\": \"eu-1\", \"quantity\": 1}, \
              {\"product_id\": \"m2\", \"location_id\": \"default\", \"quantity\": 2}]'); \
         INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents) VALUES \
           ('00000000-0000-7000-8000-000000000004', 'm1', 1, 100), \
           ('00000000-0000-7000-8000-000000000004', 'm2', 2, 200); \
         INSERT INTO holds (hold_id, user_id, idempotency_key, request_fingerprint, status, expires_at, ended_at, allocations) VALUES \
           ('00000000-0000-7000-8000-000000000011', 'u5', 'h1', 'fp', 'held', now() + interval '1 hour', NULL, \
            '[{\"product_id\": \"m1\", \"location_id\": \"default\", \"quantity\": 1}]'), \
           ('00000000-0000-7000-8000-000000000012', 'u6', 'h2', 'fp', 'released', now(), now(), \
            '[{\"product_id\": \"m2\", \"location_id\": \"default\", \"quantity\": 1}]'); \
         INSERT INTO hold_lines (hold_id, product_id, quantity) VALUES \
           ('00000000-0000-7000-8000-000000000011', 'm1', 1), ('00000000-0000-7000-8000-000000000012', 'm2', 1);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    stockgate::startup::migrate(&url)
        .await
        .expect("migrate to the ledger");
    caught_up(cluster);

    let (code, stdout, stderr) = outcome(&verify(cluster, &db));
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(!stdout.contains("DISAGREE"), "{stdout}");
    assert_eq!(summary(&stdout)["checked"], "3", "{stdout}");

    let app = spawn_app_with(AppOptions {
        database: Some(db.clone()),
        ..AppOptions::new(cluster)
    })
    .await;
    let (s, body) = app.get_json("/v1/admin/ledger", Some(&app.admin)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(
        (
            &body["checked"],
            &body["disagreeing"],
            &body["disagreements"]
        ),
        (&json!(3), &json!(0), &json!([])),
        "{body}"
    );
    app.stop().await;
}

// Mutation: a failed check reported as a run-time failure (exit 1, as other subcommands):
// it would read as "stock disagrees".
// Mutation: an undefined table taken as "nothing to check" (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_that_cannot_be_made_exits_2() {
    // Nothing listens on port 1.
    let (code, stdout, stderr) = outcome(&verify_at("postgres://postgres@127.0.0.1:1/none", ""));
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("could not check"), "{stderr}");
    assert!(!stdout.contains("SUMMARY"), "{stdout}");

    // A database that was never migrated.
    let cluster = shared_cluster();
    let db = format!("t_{}", uuid::Uuid::new_v4().simple());
    cluster.create_database(&db).expect("create test database");
    let (code, stdout, stderr) = outcome(&verify(cluster, &db));
    assert_eq!(code, Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("stockgate migrate"), "{stderr}");
}

// Mutation: the route without its `Admin` extractor: the user gets 200.
// Mutation: the route answering from a `FirstDisagreements` with `keep: 0`: the
// disagreement is counted but not listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_see_the_disagreement_through_the_admin_route() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    activity(&app).await;
    let user = app.user_token("buyer");
    let (s, _) = app.get_json("/v1/admin/ledger", Some(&user)).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    sqlx::query(
        "UPDATE stock_levels SET available_quantity = available_quantity + 1 \
          WHERE product_id = 'v2' AND location_id = 'default'",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let changed = chrono::Utc::now();
    caught_up(cluster);
    let (s, body) = app.get_json("/v1/admin/ledger", Some(&app.admin)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(
        (&body["checked"], &body["disagreeing"]),
        (&json!(3), &json!(1)),
        "{body}"
    );
    // v2: 8 created, one unit in each of the two carts, one of them cancelled.
    assert_eq!(
        body["disagreements"],
        json!([{"product_id": "v2", "location_id": "default", "held": 8, "ledger": 7}]),
        "{body}"
    );
    let served_by = body["served_by"].as_str().unwrap_or_default();
    assert!(
        ["primary", "replica-1", "replica-2"].contains(&served_by),
        "{body}"
    );
    let as_of = chrono::DateTime::parse_from_rfc3339(body["as_of"].as_str().unwrap()).unwrap();
    let stale = body["stale_by_ms"].as_u64().unwrap();
    assert!(stale <= 60_000, "within the ledger class's budget: {body}");
    assert!(
        as_of <= chrono::Utc::now(),
        "as_of {as_of} is in the future ({changed} was the change)"
    );
    app.stop().await;
}
