//! The incident this project exists for: 60 units, 340 confirmed orders, because the check
//! that gated each order read a replica 41 s behind. Real cluster, real concurrency, HTTP.

use crate::helpers::*;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

#[derive(Debug, Default)]
struct Outcome {
    confirmed: usize,
    confirmed_units: i64,
    out_of_stock: usize,
    other: Vec<u16>,
    /// When the last confirmation arrived, relative to the start.
    last_confirmation: Option<Duration>,
}

/// An availability answer seen while the sale ran.
struct Poll {
    sent: Duration,
    served_by: String,
    available: bool,
    stale_by_ms: u64,
}

/// Runs `buyers` distinct buyers (quantity from `qty(i)`) at `concurrency`, while four
/// pollers watch availability. Returns the outcome and what the pollers saw.
async fn flash_sale(
    app: &TestApp,
    product: &str,
    buyers: usize,
    concurrency: usize,
    qty: impl Fn(usize) -> i64,
) -> (Outcome, Vec<Poll>, Instant) {
    flash_sale_tagged(app, product, "", buyers, concurrency, qty).await
}

/// As [`flash_sale`], with `tag` making buyers and keys distinct from an earlier sale's.
async fn flash_sale_tagged(
    app: &TestApp,
    product: &str,
    tag: &str,
    buyers: usize,
    concurrency: usize,
    qty: impl Fn(usize) -> i64,
) -> (Outcome, Vec<Poll>, Instant) {
    let start = Instant::now();
    let done = Arc::new(AtomicBool::new(false));
    let polls = Arc::new(Mutex::new(Vec::new()));
    let pollers: Vec<_> = (0..4)
        .map(|_| {
            let (client, url, done, polls) = (
                app.client.clone(),
                app.url(&format!("/v1/products/{product}/availability?qty=1")),
                done.clone(),
                polls.clone(),
            );
            tokio::spawn(async move {
                while !done.load(Ordering::Relaxed) {
                    let sent = start.elapsed();
                    let Ok(resp) = client.get(&url).send().await else {
                        continue;
                    };
                    assert_eq!(resp.status(), StatusCode::OK);
                    let a: Value = resp.json().await.unwrap();
                    polls.lock().await.push(Poll {
                        sent,
                        served_by: a["served_by"].as_str().unwrap().to_string(),
                        available: a["available"].as_bool().unwrap(),
                        stale_by_ms: a["stale_by_ms"].as_u64().unwrap(),
                    });
                }
            })
        })
        .collect();
    // Tokens are made up front so the sale itself is only HTTP.
    let orders: Vec<(String, i64)> = (0..buyers)
        .map(|i| (app.user_token(&format!("{tag}buyer-{i}")), qty(i)))
        .collect();
    let results: Vec<(StatusCode, i64, Duration)> =
        futures::stream::iter(orders.into_iter().enumerate())
            .map(|(i, (token, q))| {
                let (client, url) = (app.client.clone(), app.url("/v1/orders"));
                async move {
                    let resp = client
                        .post(url)
                        .bearer_auth(token)
                        .header("Idempotency-Key", format!("{product}-{tag}{i}"))
                        .json(&serde_json::json!({"product_id": product, "quantity": q}))
                        .send()
                        .await
                        .unwrap();
                    (resp.status(), q, start.elapsed())
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
    done.store(true, Ordering::Relaxed);
    for p in pollers {
        p.await.unwrap();
    }
    let mut outcome = Outcome::default();
    for (status, q, at) in results {
        match status {
            StatusCode::CREATED => {
                outcome.confirmed += 1;
                outcome.confirmed_units += q;
                outcome.last_confirmation = outcome.last_confirmation.max(Some(at));
            }
            StatusCode::CONFLICT => outcome.out_of_stock += 1,
            s => outcome.other.push(s.as_u16()),
        }
    }
    let polls = std::mem::take(&mut *polls.lock().await);
    (outcome, polls, start)
}

async fn sale_product(app: &TestApp, id: &str, stock: i64) {
    assert_eq!(
        app.create_product(id, stock, 999).await.status(),
        StatusCode::CREATED
    );
}

/// The database agrees: stock + confirmed units = what was given, and stock ≥ 0.
async fn ledger_balances(app: &TestApp, product: &str, given: i64) {
    let stock = app.stock_on_primary(product).await;
    let (_, units) = app.confirmed_orders(product).await;
    assert!(stock >= 0);
    assert_eq!(
        stock + units,
        given,
        "stock {stock} + confirmed {units} != given {given}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flash_sale_with_both_replicas_paused_confirms_exactly_the_stock() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    sale_product(&app, "flash-60", 60).await;
    // The replicas have seen "60 in stock" — and then stop, as in the incident.
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    let paused = Instant::now();
    // Writes keep flowing, so the paused replicas really fall behind from this moment.
    let _ticker = WalTicker::start(app.primary.clone());
    let (outcome, polls, start) = flash_sale(&app, "flash-60", 1000, 200, |_| 1).await;
    assert_eq!(
        (
            outcome.confirmed,
            outcome.out_of_stock,
            outcome.other.as_slice()
        ),
        (60, 940, &[][..]),
        "{outcome:?}"
    );
    assert_eq!(app.stock_on_primary("flash-60").await, 0);
    assert_eq!(app.confirmed_orders("flash-60").await, (60, 60));
    // No availability answer from a replica once they were past the gate's budget
    // (250 ms + one 50 ms sample period + scheduling slack after the pause)…
    let pause_to_start = start.duration_since(paused);
    let cutoff = Duration::from_millis(250 + 50 + 50).saturating_sub(pause_to_start);
    let bad: Vec<_> = polls
        .iter()
        .filter(|p| p.sent > cutoff && p.served_by != "primary")
        .map(|p| (p.sent, p.served_by.clone()))
        .collect();
    assert!(
        bad.is_empty(),
        "replica answers after the gate budget: {bad:?}"
    );
    assert!(
        polls
            .iter()
            .all(|p| p.served_by == "primary" || p.stale_by_ms <= 250),
        "a replica answer over budget"
    );
    // …and no "available" after the last unit was sold (plus the budget).
    let sold_out = outcome.last_confirmation.unwrap() + Duration::from_millis(350);
    let lies = polls
        .iter()
        .filter(|p| p.sent > sold_out && p.available)
        .count();
    assert_eq!(lies, 0, "availability said true after the sell-out");
    assert!(!polls.is_empty());
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flash_sale_with_healthy_replicas_confirms_exactly_the_stock() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "flash-healthy", 60).await;
    let (outcome, polls, _) = flash_sale(&app, "flash-healthy", 1000, 200, |_| 1).await;
    assert_eq!(
        (
            outcome.confirmed,
            outcome.out_of_stock,
            outcome.other.as_slice()
        ),
        (60, 940, &[][..]),
        "{outcome:?}"
    );
    ledger_balances(&app, "flash-healthy", 60).await;
    assert_eq!(app.stock_on_primary("flash-healthy").await, 0);
    let sold_out = outcome.last_confirmation.unwrap() + Duration::from_millis(350);
    assert_eq!(
        polls
            .iter()
            .filter(|p| p.sent > sold_out && p.available)
            .count(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flash_sale_with_a_delayed_replica_confirms_exactly_the_stock() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    blocking(|| cluster.set_apply_delay(1, 2000)).unwrap();
    sale_product(&app, "flash-delay", 60).await;
    let (outcome, polls, _) = flash_sale(&app, "flash-delay", 1000, 200, |_| 1).await;
    assert_eq!(
        (
            outcome.confirmed,
            outcome.out_of_stock,
            outcome.other.as_slice()
        ),
        (60, 940, &[][..]),
        "{outcome:?}"
    );
    ledger_balances(&app, "flash-delay", 60).await;
    // The delayed replica (2 s behind) never answers the gate.
    let from_delayed = polls
        .iter()
        .filter(|p| p.sent > Duration::from_millis(500) && p.served_by == "replica-1")
        .count();
    assert_eq!(
        from_delayed, 0,
        "replica-1 is 2 s behind and must not serve the stock gate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quantities_that_do_not_divide_the_stock_never_oversell() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "sevens", 60).await;
    let (outcome, _, _) = flash_sale(&app, "sevens", 400, 200, |_| 7).await;
    // 8 × 7 = 56 fit; the last 4 units cannot make a 7.
    assert_eq!(
        (
            outcome.confirmed,
            outcome.confirmed_units,
            outcome.other.len()
        ),
        (8, 56, 0),
        "{outcome:?}"
    );
    assert_eq!(app.stock_on_primary("sevens").await, 4);

    sale_product(&app, "mixed", 100).await;
    let (outcome, _, _) = flash_sale(&app, "mixed", 500, 200, |i| (i % 5) as i64 + 1).await;
    assert!(
        outcome.confirmed_units <= 100 && outcome.other.is_empty(),
        "{outcome:?}"
    );
    ledger_balances(&app, "mixed", 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_of_one_key_make_one_order_and_take_stock_once() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "dupes", 10).await;
    let token = app.user_token("ada");
    let send = |q: i64| {
        let (client, url, token) = (app.client.clone(), app.url("/v1/orders"), token.clone());
        async move {
            let resp = client
                .post(url)
                .bearer_auth(token)
                .header("Idempotency-Key", "one-key")
                .json(&serde_json::json!({"product_id": "dupes", "quantity": q}))
                .send()
                .await
                .unwrap();
            let status = resp.status();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let results = futures::future::join_all((0..50).map(|_| send(2))).await;
    let ids: std::collections::HashSet<String> = results
        .iter()
        .map(|(s, b)| {
            assert_eq!(*s, StatusCode::CREATED, "{b}");
            b["order_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one order for one key");
    assert_eq!(app.stock_on_primary("dupes").await, 8);
    // The same key with another body, even concurrently: refused, nothing taken.
    let reused = futures::future::join_all((0..10).map(|_| send(3))).await;
    assert!(
        reused
            .iter()
            .all(|(s, _)| *s == StatusCode::UNPROCESSABLE_ENTITY)
    );
    assert_eq!(app.stock_on_primary("dupes").await, 8);
    // A retry after sell-out still returns the original order, not OUT_OF_STOCK.
    assert_eq!(
        app.order("bob", "bob-1", "dupes", 8).await.status(),
        StatusCode::CREATED
    );
    let (s, again) = send(2).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(ids.contains(again["order_id"].as_str().unwrap()));
    // The same key for another product is a different body: refused, nothing taken there.
    sale_product(&app, "dupes-other", 10).await;
    let other = app.order("ada", "one-key", "dupes-other", 1).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.stock_on_primary("dupes-other").await, 10);
    assert_eq!(app.confirmed_orders("dupes-other").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_twice_returns_stock_once() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "cancel-me", 5).await;
    let order: Value = app
        .order("ada", "c1", "cancel-me", 3)
        .await
        .json()
        .await
        .unwrap();
    let id = order["order_id"].as_str().unwrap().to_string();
    let token = app.user_token("ada");
    let cancel = || {
        app.client
            .post(app.url(&format!("/v1/orders/{id}/cancel")))
            .bearer_auth(&token)
            .send()
    };
    let results = futures::future::join_all((0..10).map(|_| cancel())).await;
    for r in results {
        let r = r.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.json::<Value>().await.unwrap()["status"], "cancelled");
    }
    assert_eq!(app.stock_on_primary("cancel-me").await, 5);
    // Someone else cannot cancel it; admin can read it.
    let other = app
        .client
        .post(app.url(&format!("/v1/orders/{id}/cancel")))
        .bearer_auth(app.user_token("mallory"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        app.get_json(&format!("/v1/orders/{id}"), Some(&app.admin))
            .await
            .1["status"],
        "cancelled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_racing_an_order_for_the_last_unit_never_breaks_the_ledger() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "last-unit", 1).await;
    for round in 0..20 {
        let first: Value = app
            .order(&format!("a{round}"), "k", "last-unit", 1)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(first["status"], "confirmed", "round {round}: {first}");
        let id = first["order_id"].as_str().unwrap().to_string();
        let cancel = app
            .client
            .post(app.url(&format!("/v1/orders/{id}/cancel")))
            .bearer_auth(&app.admin)
            .send();
        let racer_name = format!("b{round}");
        let racer = app.order(&racer_name, "k", "last-unit", 1);
        let (c, r) = tokio::join!(cancel, racer);
        assert_eq!(c.unwrap().status(), StatusCode::OK);
        assert!(
            matches!(r.status(), StatusCode::CREATED | StatusCode::CONFLICT),
            "{}",
            r.status()
        );
        ledger_balances(&app, "last-unit", 1).await;
        // Reset for the next round: cancel whatever holds the unit.
        if r.status() == StatusCode::CREATED {
            let id: Value = r.json().await.unwrap();
            app.client
                .post(app.url(&format!(
                    "/v1/orders/{}/cancel",
                    id["order_id"].as_str().unwrap()
                )))
                .bearer_auth(&app.admin)
                .send()
                .await
                .unwrap();
        }
        assert_eq!(app.stock_on_primary("last-unit").await, 1, "round {round}");
    }
}

async fn metric(app: &TestApp, name: &str) -> f64 {
    let text = app
        .client
        .get(app.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_sell_out_rejections_take_no_order_batch_and_are_made_final_in_bulk() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "gone", 20).await;
    let (outcome, _, _) = flash_sale(&app, "gone", 100, 50, |_| 1).await;
    assert_eq!(outcome.confirmed, 20);
    let before = metric(&app, "stockgate_order_transactions_total").await;
    let claims_before = metric(&app, "stockgate_order_refusal_statements_total").await;
    let (late, _, _) = flash_sale_tagged(&app, "gone", "late-", 500, 64, |_| 1).await;
    assert_eq!((late.confirmed, late.out_of_stock), (0, 500));
    let after = metric(&app, "stockgate_order_transactions_total").await;
    let claims = metric(&app, "stockgate_order_refusal_statements_total").await - claims_before;
    // Fewer than 1 % of the late requests reached an order batch ...
    assert!(
        after - before < 5.0,
        "{} order batches for 500 rejections",
        after - before
    );
    // ... and their refusals were claimed on the primary together, not one statement each.
    eprintln!("500 rejections made final in {claims} statements");
    assert!(
        (1.0..250.0).contains(&claims),
        "{claims} refusal statements for 500 rejections"
    );
    // Every rejected key now holds its refusal: a retry of it answers 409 again.
    let refused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders WHERE product_id = 'gone' AND status = 'refused' AND user_id LIKE 'late-%'",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    assert_eq!(refused, 500);
    // A buyer who did get one, retrying with the same key after the sell-out, gets their order.
    let winner: String = sqlx::query_scalar(
        "SELECT user_id FROM orders WHERE product_id = 'gone' AND status = 'confirmed' LIMIT 1",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    let i = winner.trim_start_matches("buyer-");
    let retry = app.order(&winner, &format!("gone-{i}"), "gone", 1).await;
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "a retry of a confirmed order is not OUT_OF_STOCK"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_selling_one_product_take_turns_on_the_row_and_never_oversell() {
    let a = spawn_app(shared_cluster()).await;
    let b = spawn_app_with(AppOptions {
        database: Some(a.database.clone()),
        ..AppOptions::new(shared_cluster())
    })
    .await;
    sale_product(&a, "shared", 100).await;
    let statuses: Vec<StatusCode> = futures::stream::iter(0..600)
        .map(|i| {
            let app = if i % 2 == 0 { &a } else { &b };
            let (client, url, token) = (
                app.client.clone(),
                app.url("/v1/orders"),
                app.user_token(&format!("two-{i}")),
            );
            async move {
                client
                    .post(url)
                    .bearer_auth(token)
                    .header("Idempotency-Key", "k")
                    .json(&serde_json::json!({"product_id": "shared", "quantity": 1}))
                    .send()
                    .await
                    .unwrap()
                    .status()
            }
        })
        .buffer_unordered(200)
        .collect()
        .await;
    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    let refused = statuses
        .iter()
        .filter(|s| **s == StatusCode::CONFLICT)
        .count();
    assert_eq!((created, refused), (100, 500), "{statuses:?}");
    ledger_balances(&a, "shared", 100).await;
    // Sold out in both; a restock through A reaches B's gate within its budget (B's cached
    // "sold out" ages out, then a replica or the primary has the restock).
    assert_eq!(
        b.availability("shared", 1)
            .await
            .json::<Value>()
            .await
            .unwrap()["available"],
        false
    );
    assert_eq!(a.restock("shared", 5).await.status(), StatusCode::OK);
    let restocked = Instant::now();
    b.wait_for("B sees the restock", Duration::from_secs(2), || async {
        b.availability("shared", 1)
            .await
            .json::<Value>()
            .await
            .unwrap()["available"]
            == true
    })
    .await;
    eprintln!("instance B saw A's restock after {:?}", restocked.elapsed());
    assert!(
        restocked.elapsed() < Duration::from_secs(1),
        "B took {:?}",
        restocked.elapsed()
    );
}
