//! The review's edges, round two (issue #44), each reproduced from outside: availability's
//! `on_sale` judged on the primary's clock, one product's held row and the other products'
//! orders, and what a 422 key reuse may change.

use crate::helpers::*;
use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `on_sale` in availability is judged on the primary's clock, as orders are: with the
/// service's clock an hour ahead, a sale that starts in half an hour is not on yet and one
/// that ends in half an hour has not ended. Mutation seen failing: `on_sale` judged at
/// `state.db.now_utc()` (the service's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn availability_judges_the_sale_window_on_the_primarys_clock() {
    let cluster = shared_cluster();
    let mut opts = AppOptions::new(cluster);
    opts.clock = Arc::new(WallAhead(chrono::Duration::hours(1)));
    let app = spawn_app_with(opts).await;
    let primary_now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&app.primary)
        .await
        .unwrap();
    let half_hour = chrono::Duration::minutes(30);
    for (id, window) in [
        (
            "starts-soon",
            json!({"sale_starts_at": (primary_now + half_hour).to_rfc3339()}),
        ),
        (
            "ends-soon",
            json!({"sale_ends_at": (primary_now + half_hour).to_rfc3339()}),
        ),
    ] {
        let mut body =
            json!({"product_id": id, "name": id, "price_cents": 1, "available_quantity": 5});
        body.as_object_mut()
            .unwrap()
            .extend(window.as_object().unwrap().clone());
        let (status, created) = answer(app.post_product(&body).await).await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
    }
    // The monitor has read the primary's clock (it samples every 25 ms from the start).
    app.wait_for(
        "a sample of the primary",
        Duration::from_secs(10),
        || async { app.metric("stockgate_monitor_samples_total").await >= 2.0 },
    )
    .await;
    let on_sale = |body: &Value| body["on_sale"].as_bool().unwrap();
    let (status, soon) = answer(app.availability("starts-soon", 1).await).await;
    assert_eq!(status, StatusCode::OK, "{soon}");
    assert!(
        !on_sale(&soon),
        "a sale that starts in 30 min is on: {soon}"
    );
    let (status, ending) = answer(app.availability("ends-soon", 1).await).await;
    assert_eq!(status, StatusCode::OK, "{ending}");
    assert!(
        on_sale(&ending),
        "a sale that ends in 30 min has ended: {ending}"
    );
}

/// Four products' rows held by a long transaction while their orders arrive together with
/// orders for twenty others: the others are all answered 201 while the four still wait (a
/// combined statement that carries a held product gives up within a moment and its batches
/// run one by one), and the four are answered once their rows are free. Mutation seen
/// failing: `run_many` without its `lock_timeout` (the combined statement waited on the held
/// rows with every product it carried: their buyers got 503 `TIMEOUT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn products_whose_rows_are_held_never_hold_up_the_other_products() {
    let app = spawn_app(shared_cluster()).await;
    let held: Vec<String> = (0..4).map(|i| format!("held-{i}")).collect();
    let free: Vec<String> = (0..20).map(|i| format!("free-{i}")).collect();
    for p in held.iter().chain(&free) {
        assert_eq!(
            app.create_product(p, 100, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let held_refs: Vec<&str> = held.iter().map(String::as_str).collect();
    let lock = app.lock_rows(&held_refs).await;
    let mut worst = Duration::ZERO;
    let mut waiting = Vec::new();
    for round in 0..5 {
        // Each round sends the held products' orders in the same burst as the free ones', so
        // they share statements.
        if round == 0 {
            for (i, p) in held.iter().enumerate() {
                waiting.push(crate::retries::order_in_background(
                    &app,
                    "hanna",
                    &format!("h{i}"),
                    p,
                    1,
                ));
            }
        }
        let burst = free.iter().enumerate().map(|(i, p)| {
            let app = &app;
            async move {
                let started = Instant::now();
                let r = app.order("frank", &format!("f{round}-{i}"), p, 1).await;
                (p.clone(), r.status(), started.elapsed())
            }
        });
        for (p, status, took) in futures::future::join_all(burst).await {
            assert_eq!(status, StatusCode::CREATED, "{p} in round {round}");
            worst = worst.max(took);
        }
        // The held products' batches really wait on their rows, their buyers unanswered.
        wait_for(
            "the held products' batches waiting on their rows",
            Duration::from_secs(10),
            || async { batches_waiting_on(&app.primary, "Lock").await >= 1 },
        )
        .await;
        assert!(waiting.iter().all(|w| !w.is_finished()), "round {round}");
    }
    lock.commit().await.unwrap();
    for w in waiting {
        assert_eq!(w.await.unwrap().0, StatusCode::CREATED);
    }
    for p in &held {
        assert_eq!(app.stock_on_primary(p).await, 99, "{p}");
    }
    for p in &free {
        assert_eq!(app.stock_on_primary(p).await, 95, "{p}");
    }
    eprintln!(
        "held rows: 100 orders for 20 other products answered 201 while 4 products' rows were held; the slowest took {} ms",
        worst.as_millis()
    );
}

/// A cancel racing a retry of the same order's key, on the same product: the retry's batch
/// holds the product's row while it claims the key, and the cancel takes the product's row
/// before the order's, so neither waits on the other. Staged: the product's row is held while
/// the retry's batch (with a new order beside it) queues for it first and the cancel second;
/// then it goes. Both answer
/// (the retry the order, the cancel 200) and PostgreSQL found no deadlock. Mutation seen
/// failing: the cancel updating the order row before locking its products (a deadlock, and
/// the retry or the cancel answered 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_racing_a_retry_of_its_key_never_deadlocks() {
    let cluster = shared_cluster();
    // A batch waits 100 ms for more orders, so the retry and a new order share one.
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_ORDER_BATCH_WINDOW_US", "100000".into())],
        ..AppOptions::new(cluster)
    })
    .await;
    assert_eq!(
        app.create_product("raced", 5, 100).await.status(),
        StatusCode::CREATED
    );
    let (status, order) = answer(app.order("rita", "k1", "raced", 1).await).await;
    assert_eq!(status, StatusCode::CREATED, "{order}");
    let order_id = order["order_id"].as_str().unwrap().to_owned();
    let deadlocks_before = deadlocks(cluster, &app.database).await;

    let lock = app.lock_rows(&["raced"]).await;
    // A batch of only known keys answers without the row; a new order beside the retry
    // makes its batch take the row, then claim both keys.
    let retry = crate::retries::order_in_background(&app, "rita", "k1", "raced", 1);
    let fresh = crate::retries::order_in_background(&app, "rosa", "k2", "raced", 1);
    wait_for(
        "the retry's batch waiting on the row",
        Duration::from_secs(10),
        || async { batches_waiting_on(&app.primary, "Lock").await == 1 },
    )
    .await;
    let cancel = {
        let req = app
            .client
            .post(app.url(&format!("/v1/orders/{order_id}/cancel")))
            .bearer_auth(app.user_token("rita"));
        tokio::spawn(async move {
            let r = req.send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap_or(Value::Null))
        })
    };
    wait_for(
        "the cancel waiting on a lock",
        Duration::from_secs(10),
        || async { sessions_waiting(&app.primary, "Lock", "%products%").await == 1 },
    )
    .await;
    lock.commit().await.unwrap();

    assert_eq!(fresh.await.unwrap().0, StatusCode::CREATED);
    let (status, retried) = retry.await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{retried}");
    assert_eq!(retried["order_id"], order_id.as_str());
    let (status, cancelled) = cancel.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(
        deadlocks(cluster, &app.database).await,
        deadlocks_before,
        "PostgreSQL broke a deadlock"
    );
    assert_eq!(app.stock_on_primary("raced").await, 4);
}

/// Sends a cart of `lines` for `user` under `key`, in the background.
fn cart_in_background(
    app: &TestApp,
    user: &str,
    key: &str,
    lines: &[&str],
) -> tokio::task::JoinHandle<(StatusCode, Value)> {
    let lines: Vec<Value> = lines
        .iter()
        .map(|p| json!({"product_id": p, "quantity": 1}))
        .collect();
    let req = app
        .client
        .post(app.url("/v1/orders"))
        .bearer_auth(app.user_token(user))
        .header("Idempotency-Key", key)
        .json(&json!({ "lines": lines }));
    tokio::spawn(async move { answer(req.send().await.unwrap()).await })
}

/// Item 7: a 422 key reuse changes no other request's answer. Two carts share a batch: A, whose
/// key another transaction holds with another body (not yet committed, so the batch cannot see
/// it), and B, for the same last unit. The batch judges A first (it fits) and B short; then
/// A's claim meets the other transaction's key and takes nothing. B must not keep the 409 it
/// was judged on while the unit is still there. Staging: a cart on a held row occupies the cart
/// queue's one batch at a time, so A and B queue behind it and leave as one batch; the gauge
/// `stockgate_cart_queue_depth` shows both queued. Mutation seen failing it: `seat` without
/// its roll-back when fewer carts were claimed than judged (B answered 409 `OUT_OF_STOCK`,
/// the unit left unsold).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cart_whose_key_is_reused_concurrently_changes_no_other_carts_answer() {
    let app = spawn_app(shared_cluster()).await;
    for (p, stock) in [("cq-r", 5), ("cq-s", 5), ("cq-p", 1), ("cq-q", 5)] {
        assert_eq!(
            app.create_product(p, stock, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let held = app.lock_rows(&["cq-r"]).await;
    let first = cart_in_background(&app, "cq-c", "k", &["cq-r", "cq-s"]);
    wait_for(
        "the first cart's batch waiting on the held row",
        Duration::from_secs(10),
        || async { sessions_waiting(&app.primary, "Lock", "%lines_verdicts_v3%").await == 1 },
    )
    .await;
    // A's key, claimed with another body by a transaction that has not committed.
    let mut other = app.primary.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
         VALUES (gen_random_uuid(), 'cq-p', 'cq-a', 1, 100, 100, 'confirmed', 'k', 'cq-p:1')",
    )
    .execute(&mut *other)
    .await
    .unwrap();
    let a = cart_in_background(&app, "cq-a", "k", &["cq-p", "cq-q"]);
    let b = cart_in_background(&app, "cq-b", "k", &["cq-p", "cq-q"]);
    app.wait_for(
        "A and B queued together",
        Duration::from_secs(10),
        || async { app.metric("stockgate_cart_queue_depth").await == 2.0 },
    )
    .await;
    held.commit().await.unwrap();
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    wait_for(
        "the batch of A and B waiting on A's key",
        Duration::from_secs(10),
        || async { sessions_waiting(&app.primary, "Lock", "%WITH claim AS%").await == 1 },
    )
    .await;
    // The other transaction's order takes no stock of its own: it stands for a body that
    // would have, so the unit is B's to buy.
    other.commit().await.unwrap();
    let (status, body) = a.await.unwrap();
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (status, body) = b.await.unwrap();
    assert_eq!(
        status,
        StatusCode::CREATED,
        "B was refused a unit that was there: {body}"
    );
    assert_eq!(app.stock_on_primary("cq-p").await, 0);
}
