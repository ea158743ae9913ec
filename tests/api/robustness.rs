//! Real faults: a primary that goes away, a replica cut off mid-query, a deploy (SIGTERM)
//! during a sale, clients that hang up mid-order, a scalper script.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_primary_down_writes_fail_fast_with_503_and_everything_recovers_without_a_restart()
{
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 10, 100).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| cluster.stop_primary()).unwrap();
    let t = Instant::now();
    let write = app.create_product("q", 1, 1).await;
    assert_eq!(write.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(write.headers().contains_key("retry-after"));
    let order = app.order("ada", "k1", "p", 1).await;
    assert_eq!(order.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "503s took {:?}",
        t.elapsed()
    );
    assert_eq!(
        app.get_json("/readyz", None).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        app.get_json("/healthz", None).await.0,
        StatusCode::OK,
        "the process stays up"
    );
    // Reads whose budget the replicas still meet keep working from them.
    let (s, page) = app.get_json("/v1/products/p", None).await;
    assert_eq!(
        (
            s,
            page["served_by"]
                .as_str()
                .map(|b| b.starts_with("replica-"))
        ),
        (StatusCode::OK, Some(true)),
        "{page}"
    );
    blocking(|| cluster.start_primary()).unwrap();
    app.wait_for("writes work again", Duration::from_secs(20), || async {
        app.order("ada", "k2", "p", 1).await.status() == StatusCode::CREATED
    })
    .await;
    assert_eq!(app.get_json("/readyz", None).await.0, StatusCode::OK);
    app.wait_for("replicas back", Duration::from_secs(20), || async {
        app.replica_states()
            .await
            .iter()
            .all(|(_, s, _)| s == "healthy")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_cut_off_mid_query_is_failed_over_within_a_second() {
    let cluster = private_cluster();
    let db = fresh_database(&cluster).await;
    let proxy = ChaosProxy::start(cluster.port(1)).await;
    let replicas = format!(
        "postgres://postgres@127.0.0.1:{}/{db},{}",
        proxy.port,
        cluster.replica_url(2, &db)
    );
    let app = spawn_app_with(AppOptions {
        database: Some(db),
        env: vec![("STOCKGATE_REPLICA_URLS", replicas)],
        ..AppOptions::new(&cluster)
    })
    .await;
    app.create_product("p", 10, 100).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    // Long reads in flight on replica-1 when the network goes silent.
    let slow: Vec<_> = (0..4)
        .map(|_| {
            let (client, url) = (app.client.clone(), app.url("/v1/products/p"));
            tokio::spawn(async move {
                let t = Instant::now();
                let s = client.get(url).send().await.unwrap().status();
                (s, t.elapsed())
            })
        })
        .collect();
    proxy.cut();
    let mut worst = Duration::ZERO;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let t = Instant::now();
        let (s, _) = app.get_json("/v1/products/p", None).await;
        assert_eq!(s, StatusCode::OK);
        worst = worst.max(t.elapsed());
    }
    for h in slow {
        let (s, took) = h.await.unwrap();
        assert_eq!(s, StatusCode::OK);
        worst = worst.max(took);
    }
    eprintln!("worst read latency with replica-1 cut off: {worst:?}");
    assert!(worst < Duration::from_secs(1), "a read took {worst:?}");
    assert_eq!(app.replica_state("replica-1").await, "down");
    proxy.heal();
    app.wait_for(
        "replica-1 healthy after the network heals",
        Duration::from_secs(20),
        || async { app.replica_state("replica-1").await == "healthy" },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_hangs_up_mid_order_gets_all_or_nothing_and_its_retry_finds_it() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("hangup", 1000, 100).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(2))
        .build()
        .unwrap();
    let token = app.user_token("ada");
    for i in 0..40 {
        let _ = impatient
            .post(app.url("/v1/orders"))
            .bearer_auth(&token)
            .header("Idempotency-Key", format!("h-{i}"))
            .json(&json!({"product_id": "hangup", "quantity": 1}))
            .send()
            .await;
    }
    // Each retry returns the order if it happened, or places it now: never twice.
    let mut ids = std::collections::HashSet::new();
    for i in 0..40 {
        let r = app.order("ada", &format!("h-{i}"), "hangup", 1).await;
        assert_eq!(r.status(), StatusCode::CREATED);
        ids.insert(
            r.json::<Value>().await.unwrap()["order_id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(ids.len(), 40);
    assert_eq!(app.confirmed_orders("hangup").await, (40, 40));
    assert_eq!(app.stock_on_primary("hangup").await, 960);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scalper_over_the_per_user_rate_gets_429_when_the_limit_is_on() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_ORDER_RATE_PER_USER", "3".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    app.create_product("limited", 100, 100).await;
    let mut statuses = vec![];
    for i in 0..6 {
        statuses.push(
            app.order("scalper", &format!("s-{i}"), "limited", 1)
                .await
                .status(),
        );
    }
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count(),
        3,
        "{statuses:?}"
    );
    assert!(statuses.contains(&StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(
        app.order("honest", "h", "limited", 1).await.status(),
        StatusCode::CREATED
    );
}

/// A deploy during a sale: SIGTERM to the real binary under 64 connections of orders. It
/// stops accepting, finishes what is in flight and exits 0; every 201 is in the database,
/// and every order in the database was answered 201 unless its client saw the connection
/// fail — and then retrying with the same key returns it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_drains_and_loses_no_confirmed_order() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .arg("serve")
        .env("DATABASE_URL", cluster.primary_url(&db))
        .env("STOCKGATE_REPLICA_URLS", cluster.replica_urls(&db))
        .env("STOCKGATE_TOKEN_SECRET", SECRET)
        .env("STOCKGATE_LISTEN", format!("127.0.0.1:{port}"))
        .env("STOCKGATE_DRAIN_TIMEOUT_MS", "5000")
        .env("RUST_LOG", "warn")
        .current_dir(std::env::temp_dir())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let tokens = stockgate::auth::Tokens::new(SECRET);
    let admin = tokens
        .issue(&stockgate::auth::Caller::Admin, Duration::from_secs(600))
        .unwrap();
    wait_for("the binary is ready", Duration::from_secs(20), || async {
        client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == StatusCode::OK)
    })
    .await;
    let created = client.post(format!("{base}/v1/products")).bearer_auth(&admin).json(&json!({"product_id": "deploy", "name": "Deploy", "price_cents": 100, "available_quantity": 1_000_000})).send().await.unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    // 64 buyers ordering back to back until the server goes away.
    let workers: Vec<_> = (0..64)
        .map(|w| {
            let (client, base, admin) = (client.clone(), base.clone(), admin.clone());
            tokio::spawn(async move {
                let mut seen: Vec<(String, Result<String, ()>)> = vec![];
                for n in 0.. {
                    let key = format!("w{w}-{n}");
                    let resp = client
                        .post(format!("{base}/v1/orders"))
                        .bearer_auth(&admin)
                        .header("Idempotency-Key", &key)
                        .json(&json!({"product_id": "deploy", "quantity": 1, "user_id": format!("buyer-{w}")}))
                        .send()
                        .await;
                    match resp {
                        Ok(r) if r.status() == StatusCode::CREATED => seen.push((key, Ok(r.json::<Value>().await.unwrap()["order_id"].as_str().unwrap().to_string()))),
                        Ok(r) => panic!("unexpected {} during the drain", r.status()),
                        Err(_) => {
                            seen.push((key, Err(())));
                            break;
                        }
                    }
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let sent = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = blocking(|| child.wait()).unwrap();
    let drain = sent.elapsed();
    eprintln!("drained and exited in {drain:?} under 64 connections");
    assert!(status.success(), "exit status {status:?}");
    let mut answered: HashMap<String, Result<String, ()>> = HashMap::new();
    for w in workers {
        for (key, outcome) in w.await.unwrap() {
            answered.insert(key, outcome);
        }
    }
    let primary = sqlx::PgPool::connect(&cluster.primary_url(&db))
        .await
        .unwrap();
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, order_id::text FROM orders WHERE product_id = 'deploy'",
    )
    .fetch_all(&primary)
    .await
    .unwrap();
    let in_db: HashMap<String, String> = rows.into_iter().collect();
    let confirmed = answered.values().filter(|o| o.is_ok()).count();
    assert!(confirmed > 100, "the load ran: {confirmed} orders");
    for (key, outcome) in &answered {
        // A client that saw the connection fail may or may not have an order: both are allowed.
        if let Ok(id) = outcome {
            assert_eq!(
                in_db.get(key),
                Some(id),
                "a 201 for {key} must be in the database"
            );
        }
    }
    for key in in_db.keys() {
        assert!(
            answered.contains_key(key),
            "order {key} in the database was never sent"
        );
    }
    let (stock,): (i32,) =
        sqlx::query_as("SELECT available_quantity FROM products WHERE product_id = 'deploy'")
            .fetch_one(&primary)
            .await
            .unwrap();
    assert_eq!(stock as usize + in_db.len(), 1_000_000);
}
