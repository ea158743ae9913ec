//! Adjustments (a location's count changed with a reason, optionally compare-and-set) and
//! the movements that record them: the contract's semantics through the API, the ledger's
//! rows read back through `GET /v1/products/{id}/movements`, and the rule (count = the sum of
//! a level's movements, for a product nobody bought) checked on the primary.

use crate::helpers::*;
use futures::future::join_all;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::time::Duration;

type Answer = (StatusCode, Value);

async fn adjust(app: &TestApp, product: &str, key: &str, body: Value) -> Answer {
    let path = format!("/v1/products/{product}/adjustments");
    send_admin(app, Method::POST, &path, Some(key), body).await
}

/// Every movement of `product` (at `location`, if given), page by page, `limit` a page.
async fn movements(app: &TestApp, product: &str, location: Option<&str>, limit: u32) -> Vec<Value> {
    let mut all = vec![];
    let mut after = None::<String>;
    loop {
        let mut path = format!("/v1/products/{product}/movements?limit={limit}");
        if let Some(l) = location {
            path += &format!("&location_id={l}");
        }
        if let Some(a) = &after {
            path += &format!("&after={a}");
        }
        let (s, page) = send_admin(app, Method::GET, &path, None, Value::Null).await;
        assert_eq!(s, StatusCode::OK, "{page}");
        let got = page["movements"].as_array().unwrap().clone();
        let next = page["next"].as_str().unwrap().to_owned();
        if got.is_empty() {
            assert_eq!(Some(&next), after.as_ref().or(Some(&"0".to_owned())));
            return all;
        }
        assert_eq!(
            next,
            got.last().unwrap()["movement_id"],
            "next is the last id"
        );
        all.extend(got);
        after = Some(next);
    }
}

/// A level's count, and the sum of its movements, on the primary.
async fn level_and_ledger(app: &TestApp, product: &str, location: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT available_quantity::int8 FROM stock_levels WHERE product_id = $1 AND location_id = $2), \
                (SELECT coalesce(sum(delta), 0)::int8 FROM movements WHERE product_id = $1 AND location_id = $2)",
    )
    .bind(product)
    .bind(location)
    .fetch_one(&app.primary)
    .await
    .unwrap()
}

/// The product's count on the primary: the routed product page may be served by a replica
/// up to its staleness budget behind (it once read the count before the `set`, under CI's
/// load), and what is asserted here is what the database holds.
async fn product_count(app: &TestApp, product: &str) -> i64 {
    let count: i32 =
        sqlx::query_scalar("SELECT available_quantity FROM products WHERE product_id = $1")
            .bind(product)
            .fetch_one(&app.primary)
            .await
            .unwrap();
    i64::from(count)
}

// Mutation: `set` applied as a delta (count + set): the set answers 15, not 10.
// Mutation: the compare-and-set ignored (`expected` unchecked): the mismatch answers 200.
// Mutation: a below-zero delta clamped at zero instead of refused: 200 with 0.
// Mutation: the key's fingerprint without `note`: the reused key with another note is 200.
// Mutation: `levels::add` without its movement: the ledger misses the adjustments.
// Mutation: the event's reason left as the movement's (`damaged`): no `adjust` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adjustments_follow_the_contract_and_each_is_one_movement() {
    let app = spawn_app(shared_cluster()).await;
    let (s, b) = send_admin(
        &app,
        Method::POST,
        "/v1/locations",
        None,
        json!({"location_id": "adj-eu", "name": "EU", "rank": 10}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let body = json!({"product_id": "adj-1", "name": "Adjusted", "price_cents": 100,
                      "stock": [{"location_id": "default", "quantity": 20},
                                {"location_id": "adj-eu", "quantity": 5}]});
    let (s, b) = answer(app.post_product(&body).await).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");

    // delta, at `default` when no location is named.
    let got = adjust(
        &app,
        "adj-1",
        "a1",
        json!({"delta": -3, "reason": "damaged", "note": "dropped"}),
    )
    .await;
    assert_eq!(got.0, StatusCode::OK, "{}", got.1);
    assert_eq!(got.1["location_id"], "default");
    assert_eq!(got.1["available_quantity"], 17);
    let first_id = got.1["movement_id"]
        .as_str()
        .expect("an opaque string")
        .to_owned();
    assert_eq!(product_count(&app, "adj-1").await, 22);

    // set.
    let got = adjust(
        &app,
        "adj-1",
        "a2",
        json!({"location_id": "adj-eu", "set": 10, "reason": "count"}),
    )
    .await;
    assert_eq!(
        (got.0, &got.1["available_quantity"]),
        (StatusCode::OK, &json!(10)),
        "{}",
        got.1
    );
    assert_eq!(product_count(&app, "adj-1").await, 27);

    // expected matching, then not matching: 409 saying the count, nothing written.
    let got = adjust(
        &app,
        "adj-1",
        "a3",
        json!({"location_id": "adj-eu", "set": 12, "expected": 10, "reason": "found"}),
    )
    .await;
    assert_eq!(
        (got.0, &got.1["available_quantity"]),
        (StatusCode::OK, &json!(12)),
        "{}",
        got.1
    );
    let got = adjust(
        &app,
        "adj-1",
        "a4",
        json!({"location_id": "adj-eu", "delta": 1, "expected": 10, "reason": "found"}),
    )
    .await;
    let e = assert_error(&got, 409, "STOCK_CHANGED");
    assert_eq!(got.1["error"]["available_quantity"], 12, "{e:?}");

    // Below zero: 409 OUT_OF_STOCK, nothing written.
    let got = adjust(
        &app,
        "adj-1",
        "a5",
        json!({"location_id": "adj-eu", "delta": -13, "reason": "lost"}),
    )
    .await;
    assert_error(&got, 409, "OUT_OF_STOCK");
    assert_eq!(level_and_ledger(&app, "adj-1", "adj-eu").await, (12, 12));

    // A replay: the same answer, the same movement, nothing more; another body: 422.
    let again = adjust(
        &app,
        "adj-1",
        "a1",
        json!({"delta": -3, "reason": "damaged", "note": "dropped"}),
    )
    .await;
    assert_eq!(again.0, StatusCode::OK, "{}", again.1);
    assert_eq!(
        (
            again.1["movement_id"].as_str(),
            &again.1["available_quantity"]
        ),
        (Some(first_id.as_str()), &json!(17))
    );
    assert_eq!(level_and_ledger(&app, "adj-1", "default").await, (17, 17));
    let reused = adjust(
        &app,
        "adj-1",
        "a1",
        json!({"delta": -3, "reason": "damaged", "note": "another"}),
    )
    .await;
    assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    let reused = adjust(
        &app,
        "adj-1",
        "a1",
        json!({"delta": -3, "reason": "lost", "note": "dropped"}),
    )
    .await;
    assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");

    // Unknown reason or location, and the other malformed bodies: 422 (400 without a key).
    for (body, code) in [
        (json!({"delta": 1, "reason": "stolen"}), "INVALID_REASON"),
        (
            json!({"location_id": "nowhere", "delta": 1, "reason": "found"}),
            "UNKNOWN_LOCATION",
        ),
        (
            json!({"delta": 1, "set": 2, "reason": "found"}),
            "INVALID_ADJUSTMENT",
        ),
        (json!({"reason": "found"}), "INVALID_ADJUSTMENT"),
        (json!({"delta": 0, "reason": "found"}), "INVALID_DELTA"),
        (json!({"set": -1, "reason": "count"}), "INVALID_SET"),
        (
            json!({"delta": 1, "reason": "found", "note": "x".repeat(501)}),
            "INVALID_NOTE",
        ),
        (
            json!({"delta": 2147483647, "reason": "found"}),
            "VALUE_OUT_OF_RANGE",
        ),
    ] {
        let key = uuid::Uuid::new_v4().to_string();
        assert_error_for(
            &body.to_string(),
            &adjust(&app, "adj-1", &key, body.clone()).await,
            422,
            code,
        );
    }
    let no_key = send_admin(
        &app,
        Method::POST,
        "/v1/products/adj-1/adjustments",
        None,
        json!({"delta": 1, "reason": "found"}),
    )
    .await;
    assert_error(&no_key, 400, "IDEMPOTENCY_KEY_MISSING");
    assert_error(
        &adjust(
            &app,
            "adj-none",
            "a6",
            json!({"delta": 1, "reason": "found"}),
        )
        .await,
        404,
        "PRODUCT_NOT_FOUND",
    );
    let user = send_as(
        &app,
        Method::POST,
        "/v1/products/adj-1/adjustments",
        "u1",
        Some("a7"),
        json!({"delta": 1, "reason": "found"}),
    )
    .await;
    assert_error(&user, 403, "FORBIDDEN");

    // The ledger: oldest first, page by page, every change once with its reason and note.
    let all = movements(&app, "adj-1", None, 2).await;
    let seen: Vec<(String, String, i64, Value)> = all
        .iter()
        .map(|m| {
            (
                m["location_id"].as_str().unwrap().to_owned(),
                m["reason"].as_str().unwrap().to_owned(),
                m["delta"].as_i64().unwrap(),
                m["note"].clone(),
            )
        })
        .collect();
    let want = [
        ("adj-eu", "create", 5, Value::Null),
        ("default", "create", 20, Value::Null),
        ("default", "damaged", -3, json!("dropped")),
        ("adj-eu", "count", 5, Value::Null),
        ("adj-eu", "found", 2, Value::Null),
    ];
    let want: Vec<(String, String, i64, Value)> = want
        .into_iter()
        .map(|(l, r, d, n)| (l.to_owned(), r.to_owned(), d, n))
        .collect();
    assert_eq!(seen, want);
    assert!(
        all.iter()
            .all(|m| m["ref"].is_null() && m["at"].is_string())
    );
    let at_eu = movements(&app, "adj-1", Some("adj-eu"), 100).await;
    assert_eq!(at_eu.len(), 3);
    assert_eq!(level_and_ledger(&app, "adj-1", "default").await, (17, 17));
    for (path, status, code) in [
        ("/v1/products/adj-1/movements?limit=0", 400, "INVALID_LIMIT"),
        (
            "/v1/products/adj-1/movements?after=x",
            400,
            "INVALID_CURSOR",
        ),
        (
            "/v1/products/adj-1/movements?location_id=nowhere",
            422,
            "UNKNOWN_LOCATION",
        ),
        ("/v1/products/adj-none/movements", 404, "PRODUCT_NOT_FOUND"),
    ] {
        assert_error_for(
            path,
            &send_admin(&app, Method::GET, path, None, Value::Null).await,
            status,
            code,
        );
    }

    // Each adjustment is a `stock.changed` with reason `adjust` and its location.
    let events = feed_until(&app, "the found adjustment", |e| {
        e["type"] == "stock.changed"
            && e["data"]["reason"] == "adjust"
            && e["data"]["available_quantity"] == 12
    })
    .await;
    let adjusts: Vec<&Value> = events
        .iter()
        .filter(|e| {
            e["type"] == "stock.changed"
                && e["data"]["product_id"] == "adj-1"
                && e["data"]["reason"] == "adjust"
        })
        .collect();
    assert_eq!(adjusts.len(), 3, "{adjusts:?}");
    assert_eq!(adjusts[0]["data"]["location_id"], "default");
    assert_eq!(adjusts[0]["data"]["delta"], -3);
}

// Mutation: the count compared before the product's row lock (read, then lock, then add):
// several of the twenty find 20 and win.
// Mutation: `expected` unchecked: all twenty answer 200.
// The race really races: the test holds the product's row while the twenty arrive, and lets
// go only once several of them wait on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn twenty_concurrent_set_if_expected_have_one_winner() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        app.create_product("cas-1", 20, 100).await.status(),
        StatusCode::CREATED
    );
    let tries = (0..20).map(|i| {
        let app = &app;
        async move {
            let body = json!({"set": 100 + i, "expected": 20, "reason": "count"});
            (i, adjust(app, "cas-1", &format!("cas-{i}"), body).await)
        }
    });
    let held = app.lock_rows(&["cas-1"]).await;
    let release = async {
        wait_for(
            "adjustments waiting on the product's row",
            Duration::from_secs(30),
            || async { sessions_waiting(&app.primary, "Lock", "%").await >= 2 },
        )
        .await;
        held.rollback().await.unwrap();
    };
    let (got, ()) = tokio::join!(join_all(tries), release);
    let winners: Vec<i64> = got
        .iter()
        .filter(|(_, a)| a.0 == StatusCode::OK)
        .map(|(i, _)| 100 + i)
        .collect();
    assert_eq!(winners.len(), 1, "{got:?}");
    let won = winners[0];
    for (_, a) in got.iter().filter(|(_, a)| a.0 != StatusCode::OK) {
        assert_error(a, 409, "STOCK_CHANGED");
        assert_eq!(
            a.1["error"]["available_quantity"], won,
            "a loser is told the winner's count"
        );
    }
    assert_eq!(product_count(&app, "cas-1").await, won);
    assert_eq!(level_and_ledger(&app, "cas-1", "default").await, (won, won));
    assert_eq!(
        movements(&app, "cas-1", None, 100).await.len(),
        2,
        "the create and one count"
    );
}
