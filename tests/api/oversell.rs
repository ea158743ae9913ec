//! The incident this project exists for: 60 units, 340 confirmed orders, because the check
//! that gated each order read a replica 41 s behind. Real cluster, real concurrency, HTTP.

use crate::helpers::*;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;
use std::collections::BTreeSet;
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
    /// The buyers answered 201.
    confirmed_users: BTreeSet<String>,
    /// What each buyer answered 409 had asked for.
    refused_quantities: Vec<i64>,
}

/// An availability answer seen while the sale ran.
#[derive(Debug)]
struct Poll {
    sent: Duration,
    served_by: String,
    available: bool,
    stale_by_ms: u64,
}

/// Four clients asking a product's availability over and over, from when they start until
/// they are stopped, so a test can keep them watching across several waves of buyers.
struct Pollers {
    done: Arc<AtomicBool>,
    polls: Arc<Mutex<Vec<Poll>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pollers {
    /// `start` is the instant every [`Poll::sent`] is measured from.
    fn start(app: &TestApp, product: &str, start: Instant) -> Pollers {
        let done = Arc::new(AtomicBool::new(false));
        let polls = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..4)
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
                        let stated = parse::<Stated>(&a);
                        polls.lock().await.push(Poll {
                            sent,
                            served_by: stated.served_by,
                            available: a["available"].as_bool().unwrap(),
                            stale_by_ms: stated.stale_by_ms,
                        });
                    }
                })
            })
            .collect();
        Pollers { done, polls, tasks }
    }

    /// Whether an answer to a request sent after `t` has come back.
    async fn answered_after(&self, t: Duration) -> bool {
        self.polls.lock().await.iter().any(|p| p.sent > t)
    }

    async fn stop(self) -> Vec<Poll> {
        self.done.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        std::mem::take(&mut *self.polls.lock().await)
    }
}

/// Runs `buyers` distinct buyers (named `{tag}buyer-{i}`, quantity `qty(i)`) at
/// `concurrency`; times are measured from `start`.
async fn buy_wave(
    app: &TestApp,
    product: &str,
    tag: &str,
    buyers: usize,
    concurrency: usize,
    qty: impl Fn(usize) -> i64,
    start: Instant,
) -> Outcome {
    // Tokens are made up front so the sale itself is only HTTP.
    let orders: Vec<(String, String, i64)> = (0..buyers)
        .map(|i| {
            let user = format!("{tag}buyer-{i}");
            (app.user_token(&user), user, qty(i))
        })
        .collect();
    let results: Vec<(String, StatusCode, i64, Duration)> =
        futures::stream::iter(orders.into_iter().enumerate())
            .map(|(i, (token, user, q))| {
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
                    (user, resp.status(), q, start.elapsed())
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
    let mut outcome = Outcome::default();
    for (user, status, q, at) in results {
        match status {
            StatusCode::CREATED => {
                outcome.confirmed += 1;
                outcome.confirmed_units += q;
                outcome.last_confirmation = outcome.last_confirmation.max(Some(at));
                outcome.confirmed_users.insert(user);
            }
            StatusCode::CONFLICT => {
                outcome.out_of_stock += 1;
                outcome.refused_quantities.push(q);
            }
            s => outcome.other.push(s.as_u16()),
        }
    }
    outcome
}

/// One wave of buyers while four pollers watch availability. Returns the outcome, what the
/// pollers saw, and the instant times are measured from.
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
    let pollers = Pollers::start(app, product, start);
    let outcome = buy_wave(app, product, tag, buyers, concurrency, qty, start).await;
    (outcome, pollers.stop().await, start)
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

/// Whatever order the buyers arrived in, a sale with no restocks or cancels ends the same
/// way: every refused buyer asked for more than is left (stock only fell, so each refusal
/// saw at least what is left now), the confirmed units are exactly what is gone, and the
/// database's confirmed buyers are exactly those answered 201. Returns the stock left.
async fn sold_as_far_as_it_goes(app: &TestApp, product: &str, given: i64, o: &Outcome) -> i64 {
    assert!(o.other.is_empty(), "{o:?}");
    let left = app.stock_on_primary(product).await;
    assert!(left >= 0);
    if let Some(smallest) = o.refused_quantities.iter().min() {
        assert!(
            left < *smallest,
            "a buyer of {smallest} was refused while {left} remain"
        );
    }
    assert_eq!(o.confirmed_units, given - left, "{o:?}");
    assert_eq!(
        app.confirmed_orders(product).await,
        (o.confirmed as i64, given - left)
    );
    let in_db: BTreeSet<String> = sqlx::query_scalar(
        "SELECT user_id FROM orders WHERE product_id = $1 AND status = 'confirmed'",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(in_db, o.confirmed_users, "orders in the database vs 201s");
    left
}

/// The product's stock as replica `i` has it (`None`: it has no such row yet), read on the
/// replica itself, not through the service.
async fn stock_on_replica(
    cluster: &devcluster::Cluster,
    i: usize,
    db: &str,
    id: &str,
) -> Option<i64> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.replica_url(i, db))
        .await
        .unwrap();
    let stock: Option<i32> =
        sqlx::query_scalar("SELECT available_quantity FROM products WHERE product_id = $1")
            .bind(id)
            .fetch_optional(&pool)
            .await
            .unwrap();
    pool.close().await;
    stock.map(i64::from)
}

/// Waits until each of `replicas` is more than `by` behind, both by the service's own
/// measure (`/v1/admin/replicas`) and by the cluster's truth: the replica lacks a commit
/// that `acks` saw acknowledged more than `by` ago. Writes must be flowing (`acks`), or
/// staleness is not real. (The service's figure is an upper bound, up to a sample period
/// above the truth, so the two cross `by` at slightly different moments.)
async fn replicas_behind(
    app: &TestApp,
    cluster: &devcluster::Cluster,
    acks: &AckLog,
    replicas: &[usize],
    by: Duration,
) {
    let by_ms = by.as_millis() as u64;
    let behind = |i: usize| async move {
        let name = format!("replica-{i}");
        let says = app
            .replica_states()
            .await
            .into_iter()
            .any(|(n, _, ms)| n == name && ms.is_some_and(|ms| ms > by_ms));
        says && {
            let held = held_by_replica(cluster, i, &app.database).await;
            acks.true_staleness(held, Instant::now()) > by
        }
    };
    for &i in replicas {
        app.wait_for(
            &format!("replica-{i} more than {by:?} behind, as the service says and in truth"),
            by + Duration::from_secs(15),
            || behind(i),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flash_sale_with_both_replicas_paused_confirms_exactly_the_stock() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    sale_product(&app, "flash-60", 60).await;
    // Writes keep flowing (each acknowledgement logged), so a paused replica really falls
    // behind, and by how much can be told from the rows it lacks.
    let acks = AckLog::start(app.primary.clone()).await;
    // The replicas have seen "60 in stock" — and then stop, as in the incident.
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    assert_eq!(
        stock_on_replica(&cluster, 1, &app.database, "flash-60").await,
        Some(60)
    );
    assert_eq!(
        stock_on_replica(&cluster, 2, &app.database, "flash-60").await,
        Some(60)
    );
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    // Nobody buys until both are well past the gate's 250 ms budget: a gate that ignored
    // its budget would then read "60 in stock" from them.
    replicas_behind(&app, &cluster, &acks, &[1, 2], Duration::from_secs(1)).await;

    let start = Instant::now();
    let pollers = Pollers::start(&app, "flash-60", start);
    let first = buy_wave(&app, "flash-60", "", 1000, 200, |_| 1, start).await;
    assert_eq!(
        (first.confirmed, first.out_of_stock, first.other.as_slice()),
        (60, 940, &[][..]),
        "{first:?}"
    );
    let sold_out = first.last_confirmation.unwrap();
    // A second wave after the sell-out, with the pollers still watching: when the gate's
    // own "sold out" ages out, a gate that trusted the replicas would reopen the sale.
    let second = buy_wave(&app, "flash-60", "late-", 300, 100, |_| 1, start).await;
    assert_eq!(
        (
            second.confirmed,
            second.out_of_stock,
            second.other.as_slice()
        ),
        (0, 300, &[][..]),
        "{second:?}"
    );
    let watched_until = sold_out + Duration::from_secs(1);
    wait_for(
        "the pollers watching a second past the sell-out",
        Duration::from_secs(10),
        || pollers.answered_after(watched_until),
    )
    .await;
    let polls = pollers.stop().await;
    // The pause held to the end: the replicas are further behind than the whole sale.
    replicas_behind(
        &app,
        &cluster,
        &acks,
        &[1, 2],
        start.elapsed() + Duration::from_secs(1),
    )
    .await;

    assert_eq!(app.stock_on_primary("flash-60").await, 0);
    assert_eq!(app.confirmed_orders("flash-60").await, (60, 60));
    let over_budget: Vec<&Poll> = polls
        .iter()
        .filter(|p| p.served_by != "primary" && p.stale_by_ms > 250)
        .collect();
    assert!(
        over_budget.is_empty(),
        "replica answers over the gate's budget: {over_budget:?}"
    );
    // Both replicas were over a second behind before the first poll, so no answer could
    // honestly come from them.
    let from_replicas = polls.iter().filter(|p| p.served_by != "primary").count();
    assert_eq!(from_replicas, 0, "answers from paused replicas");
    // Nothing says "available" after the last unit was sold (plus the gate's budget and a
    // request's flight time).
    let settled = sold_out + Duration::from_millis(350);
    let after: Vec<&Poll> = polls.iter().filter(|p| p.sent > settled).collect();
    let lies: Vec<&&Poll> = after.iter().filter(|p| p.available).collect();
    assert!(lies.is_empty(), "available after the sell-out: {lies:?}");
    assert!(
        after.len() >= 10,
        "only {} answers after the sell-out: the watch proved nothing",
        after.len()
    );
    eprintln!(
        "paused sale: sold out at {sold_out:?}, watched until {:?}: {} polls, {} after the sell-out",
        start.elapsed(),
        polls.len(),
        after.len(),
    );
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
    sale_product(&app, "flash-delay", 60).await;
    let acks = AckLog::start(app.primary.clone()).await;
    // replica-1 holds the product before it falls behind: otherwise a read there finds no
    // row and goes to the primary whatever the router decides.
    wait_for(
        "replica-1 holding flash-delay",
        Duration::from_secs(10),
        || async { stock_on_replica(&cluster, 1, &app.database, "flash-delay").await == Some(60) },
    )
    .await;
    blocking(|| cluster.set_apply_delay(1, 2000)).unwrap();
    // The delay is in force: replica-1 lacks commits acknowledged over a second ago (and
    // the service measures it so), while it still says 60 for everything bought from now.
    replicas_behind(&app, &cluster, &acks, &[1], Duration::from_secs(1)).await;

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
    // Still delayed after the sale, so every poll ran while replica-1 was out of budget.
    replicas_behind(&app, &cluster, &acks, &[1], Duration::from_secs(1)).await;
    let from_delayed: Vec<&Poll> = polls
        .iter()
        .filter(|p| p.served_by == "replica-1")
        .collect();
    assert!(
        from_delayed.is_empty(),
        "replica-1 is 2 s behind and must not serve the stock gate: {from_delayed:?}"
    );
    let over_budget: Vec<&Poll> = polls
        .iter()
        .filter(|p| p.served_by != "primary" && p.stale_by_ms > 250)
        .collect();
    assert!(
        over_budget.is_empty(),
        "replica answers over the gate's budget: {over_budget:?}"
    );
    let settled = outcome.last_confirmation.unwrap() + Duration::from_millis(350);
    let lies: Vec<&Poll> = polls
        .iter()
        .filter(|p| p.sent > settled && p.available)
        .collect();
    assert!(lies.is_empty(), "available after the sell-out: {lies:?}");
    assert!(!polls.is_empty());
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
    assert_eq!(outcome.out_of_stock, 392, "{outcome:?}");
    assert_eq!(
        sold_as_far_as_it_goes(&app, "sevens", 60, &outcome).await,
        4
    );

    // 100 buyers each of 1, 2, 3, 4 and 5 units want 1,500 of 100. Whatever the order, none
    // is left: were a unit left, every refused buyer wanted more than that, so all 100
    // one-unit buyers were served — which takes every unit.
    sale_product(&app, "mixed", 100).await;
    let (outcome, _, _) = flash_sale(&app, "mixed", 500, 200, |i| (i % 5) as i64 + 1).await;
    assert_eq!(outcome.confirmed + outcome.out_of_stock, 500, "{outcome:?}");
    assert_eq!(
        sold_as_far_as_it_goes(&app, "mixed", 100, &outcome).await,
        0
    );
    assert_eq!(outcome.confirmed_units, 100);
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
    let ids: std::collections::HashSet<uuid::Uuid> = results
        .iter()
        .map(|(s, b)| {
            assert_eq!(*s, StatusCode::CREATED, "{b}");
            parse::<Order>(b).order_id
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
    assert!(ids.contains(&parse::<Order>(&again).order_id));
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
    let order: Order = app
        .order("ada", "c1", "cancel-me", 3)
        .await
        .json()
        .await
        .unwrap();
    let id = order.order_id;
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
        let first: Order = app
            .order(&format!("a{round}"), "k", "last-unit", 1)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            first.status,
            OrderStatus::Confirmed,
            "round {round}: {first:?}"
        );
        let id = first.order_id;
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
            let taken: Order = r.json().await.unwrap();
            app.client
                .post(app.url(&format!("/v1/orders/{}/cancel", taken.order_id)))
                .bearer_auth(&app.admin)
                .send()
                .await
                .unwrap();
        }
        assert_eq!(app.stock_on_primary("last-unit").await, 1, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_sell_out_rejections_take_no_order_batch_and_are_made_final_in_bulk() {
    let app = spawn_app(shared_cluster()).await;
    sale_product(&app, "gone", 20).await;
    let (outcome, _, _) = flash_sale(&app, "gone", 100, 50, |_| 1).await;
    assert_eq!(outcome.confirmed, 20);
    let before = app.metric("stockgate_order_transactions_total").await;
    let claims_before = app.metric("stockgate_order_refusal_statements_total").await;
    let (late, _, _) = flash_sale_tagged(&app, "gone", "late-", 500, 64, |_| 1).await;
    assert_eq!((late.confirmed, late.out_of_stock), (0, 500));
    let after = app.metric("stockgate_order_transactions_total").await;
    let claims = app.metric("stockgate_order_refusal_statements_total").await - claims_before;
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
    let b = spawn_beside(&a, shared_cluster()).await;
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
    let acknowledged = chrono::Utc::now();
    // Every answer of B's gate whose as_of is after the restock's acknowledgement must
    // include it; B says "available" once its cached "sold out" is past the gate's budget.
    b.wait_for("B sees the restock", Duration::from_secs(10), || async {
        let answer: Value = b.availability("shared", 1).await.json().await.unwrap();
        let as_of = chrono::DateTime::parse_from_rfc3339(answer["as_of"].as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert!(
            as_of < acknowledged || answer["available"] == true,
            "B's answer as of {as_of} misses a restock acknowledged at {acknowledged}: {answer}"
        );
        answer["available"] == true
    })
    .await;
}
