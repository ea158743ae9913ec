//! Real faults: a primary that goes away, a replica cut off mid-query, a deploy (SIGTERM)
//! during a sale, clients that hang up mid-order, a scalper script.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_primary_down_writes_get_503_database_unavailable_and_everything_recovers_without_a_restart()
 {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 10, 100).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| cluster.stop_primary()).unwrap();
    // "Fast" is the service's own bound (STOCKGATE_PRIMARY_TIMEOUT_MS), not a stopwatch
    // here: the answers are 503s that say the primary is unavailable, never a client timeout.
    for write in [
        app.create_product("q", 1, 1).await,
        app.order("ada", "k1", "p", 1).await,
    ] {
        assert!(write.headers().contains_key("retry-after"));
        assert_error(&answer(write).await, 503, "DATABASE_UNAVAILABLE");
    }
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
async fn a_replica_cut_off_mid_query_is_failed_over_and_every_read_is_answered() {
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
    // Precondition: replica-1, behind the proxy, serves the product page.
    app.wait_for(
        "replica-1 serving reads",
        Duration::from_secs(10),
        || async { app.get_json("/v1/products/p", None).await.1["served_by"] == "replica-1" },
    )
    .await;
    let r1_in_flight = || {
        app.state
            .db
            .replica_status()
            .into_iter()
            .find(|r| r.name == "replica-1")
            .unwrap()
            .in_flight
    };
    // The network to replica-1 goes silent; readers keep reading meanwhile. Their client
    // gives up only after 10 s, far beyond the service's 500 ms replica timeout (the bound
    // being tested is the service's; this one only stops a hung test).
    proxy.cut();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let patient = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let (client, url, stop) = (patient.clone(), app.url("/v1/products/p"), stop.clone());
            tokio::spawn(async move {
                let mut answers = vec![];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    answers.push(client.get(&url).send().await.map(|r| r.status()));
                }
                answers
            })
        })
        .collect();
    // Precondition: reads are in flight on replica-1 while it is cut off.
    app.wait_for(
        "reads in flight on the cut replica-1",
        Duration::from_secs(10),
        || async { r1_in_flight() > 0 },
    )
    .await;
    app.wait_for(
        "replica-1 down, nothing left on it",
        Duration::from_secs(20),
        || async { app.replica_state("replica-1").await == "down" && r1_in_flight() == 0 },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        for answer in r.await.unwrap() {
            assert_eq!(answer.ok(), Some(StatusCode::OK), "a read through the cut");
        }
    }
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
    let token = app.user_token("ada");
    let body = json!({"product_id": "hangup", "quantity": 1}).to_string();
    // Keys 0–19 hang up before their request is whole: half the body sent, then closed.
    let port = app.address.rsplit(':').next().unwrap().to_string();
    for i in 0..20 {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
            .await
            .unwrap();
        let head = format!(
            "POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Idempotency-Key: h-{i}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            &body[..body.len() / 2]
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.shutdown().await.unwrap();
    }
    // Keys 20–39 hang up while their order is queued behind a held row.
    let lock = app.lock_rows(&["hangup"]).await;
    let send = |i: usize| {
        let req = app
            .client
            .post(app.url("/v1/orders"))
            .bearer_auth(&token)
            .header("Idempotency-Key", format!("h-{i}"))
            .json(&json!({"product_id": "hangup", "quantity": 1}));
        tokio::spawn(async move { req.send().await })
    };
    let first = send(20);
    wait_for(
        "the first batch waits on the row",
        Duration::from_secs(10),
        || async { batches_waiting_on(&app.primary, "Lock").await == 1 },
    )
    .await;
    let mut impatient: Vec<_> = (21..40).map(send).collect();
    impatient.push(first);
    app.wait_for("19 orders queued", Duration::from_secs(10), || async {
        app.metric("stockgate_order_queue_depth").await == 19.0
    })
    .await;
    for h in &impatient {
        h.abort();
    }
    for h in impatient {
        assert!(h.await.unwrap_err().is_cancelled());
    }
    lock.commit().await.unwrap();
    // All or nothing: the queued orders commit whole; the cut-off requests left nothing.
    app.wait_for(
        "the queued orders committed",
        Duration::from_secs(10),
        || async { app.confirmed_orders("hangup").await == (20, 20) },
    )
    .await;
    let keys: Vec<(String, String)> = sqlx::query_as(
        "SELECT idempotency_key, order_id::text FROM orders WHERE product_id = 'hangup'",
    )
    .fetch_all(&app.primary)
    .await
    .unwrap();
    let before: HashMap<String, String> = keys.into_iter().collect();
    assert!(
        (20..40).all(|i| before.contains_key(&format!("h-{i}"))),
        "the queued orders are the ones in the database: {before:?}"
    );
    // Each retry returns the order if it happened, or places it now: never twice.
    let mut ids = std::collections::HashSet::new();
    for i in 0..40 {
        let r = app.order("ada", &format!("h-{i}"), "hangup", 1).await;
        assert_eq!(r.status(), StatusCode::CREATED);
        let id = r.json::<Value>().await.unwrap()["order_id"]
            .as_str()
            .unwrap()
            .to_string();
        if let Some(committed) = before.get(&format!("h-{i}")) {
            assert_eq!(&id, committed, "the retry of h-{i} finds its order");
        }
        ids.insert(id);
    }
    assert_eq!(ids.len(), 40);
    assert_eq!(app.confirmed_orders("hangup").await, (40, 40));
    assert_eq!(app.stock_on_primary("hangup").await, 960);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scalper_over_the_per_user_rate_gets_429_when_the_limit_is_on() {
    // The limiter's clock stands still unless moved: no 1/3 s refill races the requests.
    let clock = stockgate::clock::ManualClock::new();
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_ORDER_RATE_PER_USER", "3".into())],
        clock: clock.clone(),
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
    let refused = app.order("scalper", "s-6", "limited", 1).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(
        app.order("honest", "h", "limited", 1).await.status(),
        StatusCode::CREATED
    );
    // A second later the bucket holds three orders again, and no more.
    clock.advance(Duration::from_secs(1));
    let later: Vec<StatusCode> = futures::future::join_all((7..11).map(|i| {
        let app = &app;
        async move {
            app.order("scalper", &format!("s-{i}"), "limited", 1)
                .await
                .status()
        }
    }))
    .await;
    assert_eq!(
        later.iter().filter(|s| **s == StatusCode::CREATED).count(),
        3,
        "{later:?}"
    );
    // 3 + 1 (honest) + 3 orders were confirmed, nothing for the refusals.
    assert_eq!(app.confirmed_orders("limited").await, (7, 7));
}

/// The real binary, killed (and reaped) if a test leaves it running.
struct Served {
    child: std::process::Child,
    port: u16,
}

impl Served {
    /// `stockgate serve` on a free port for `db`, once `/readyz` answers 200.
    async fn start(cluster: &devcluster::Cluster, db: &str, env: &[(&str, &str)]) -> Served {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_stockgate"));
        cmd.arg("serve")
            .env("DATABASE_URL", cluster.primary_url(db))
            .env("STOCKGATE_REPLICA_URLS", cluster.replica_urls(db))
            .env("STOCKGATE_TOKEN_SECRET", SECRET)
            .env("STOCKGATE_LISTEN", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "warn")
            .current_dir(std::env::temp_dir());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let served = Served {
            child: cmd.spawn().unwrap(),
            port,
        };
        let client = reqwest::Client::new();
        wait_for("the binary is ready", Duration::from_secs(30), || async {
            client
                .get(format!("{}/readyz", served.base()))
                .send()
                .await
                .is_ok_and(|r| r.status() == StatusCode::OK)
        })
        .await;
        served
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn signal(&self, sig: &str) {
        let sent = std::process::Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {sig}");
    }

    /// Whether the process is still running (not yet exited).
    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Whether the listen port still accepts connections.
    async fn accepting(&self) -> bool {
        tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_ok()
    }

    /// The exit status, waiting at most `timeout` (then the process is killed and the test
    /// fails).
    async fn exit_within(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the process had not exited {timeout:?} after the signal");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A gauge or counter from the process's `/metrics`.
    async fn metric(&self, client: &reqwest::Client, name: &str) -> f64 {
        let text = client
            .get(format!("{}/metrics", self.base()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.alive() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An order as the load and the held buyers send it: an admin acting for `user`.
async fn admin_order(
    client: &reqwest::Client,
    base: &str,
    admin: &str,
    user: &str,
    key: &str,
    product: &str,
) -> reqwest::Result<(StatusCode, Value)> {
    let r = client
        .post(format!("{base}/v1/orders"))
        .bearer_auth(admin)
        .header("Idempotency-Key", key)
        .json(&json!({"product_id": product, "quantity": 1, "user_id": user}))
        .send()
        .await?;
    let status = r.status();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// Orders queued behind a held row when SIGTERM arrives, under 64 connections of other
/// orders: the process stays up and stops accepting, every queued order is answered 201
/// once the row is free, and it exits 0 within the drain timeout. A load order whose answer
/// was lost to the shutdown is retried with its key on a new instance and finds the same
/// order, or gets exactly one new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_drains_and_loses_no_confirmed_order() {
    const HELD: usize = 16;
    const STOCK: i64 = 1_000_000;
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let mut served = Served::start(cluster, &db, &[("STOCKGATE_DRAIN_TIMEOUT_MS", "20000")]).await;
    let base = served.base();
    let client = reqwest::Client::new();
    let admin = stockgate::auth::Tokens::new(SECRET)
        .issue(&stockgate::auth::Caller::Admin, Duration::from_secs(600))
        .unwrap();
    for product in ["deploy", "deploy-held"] {
        let created = client.post(format!("{base}/v1/products")).bearer_auth(&admin).json(&json!({"product_id": product, "name": product, "price_cents": 100, "available_quantity": STOCK})).send().await.unwrap();
        assert_eq!(created.status(), StatusCode::CREATED);
    }
    let primary = sqlx::PgPool::connect(&cluster.primary_url(&db))
        .await
        .unwrap();
    // HELD orders provably inside the server: the first one's batch waits on the row we
    // hold, the rest wait in its queue.
    let mut lock = primary.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM products WHERE product_id = 'deploy-held' FOR NO KEY UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let send_held = |i: usize| {
        let (client, base, admin) = (client.clone(), base.clone(), admin.clone());
        tokio::spawn(async move {
            admin_order(
                &client,
                &base,
                &admin,
                "patient",
                &format!("held-{i}"),
                "deploy-held",
            )
            .await
        })
    };
    let mut held = vec![send_held(0)];
    wait_for(
        "the first held order's batch waits on the row",
        Duration::from_secs(10),
        || async { batches_waiting_on(&primary, "Lock").await == 1 },
    )
    .await;
    held.extend((1..HELD).map(send_held));
    wait_for(
        "the other held orders queued",
        Duration::from_secs(10),
        || async {
            served.metric(&client, "stockgate_order_queue_depth").await == (HELD - 1) as f64
        },
    )
    .await;
    // 64 buyers ordering back to back until the server goes away.
    let workers: Vec<_> = (0..64)
        .map(|w| {
            let (client, base, admin) = (client.clone(), base.clone(), admin.clone());
            tokio::spawn(async move {
                let mut seen: Vec<(String, Result<String, ()>)> = vec![];
                for n in 0.. {
                    let key = format!("w{w}-{n}");
                    match admin_order(
                        &client,
                        &base,
                        &admin,
                        &format!("buyer-{w}"),
                        &key,
                        "deploy",
                    )
                    .await
                    {
                        Ok((StatusCode::CREATED, body)) => {
                            seen.push((key, Ok(parse::<Order>(&body).order_id.to_string())))
                        }
                        Ok((s, body)) => panic!("unexpected {s} during the drain: {body}"),
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
    let count = |product: &'static str| {
        let primary = primary.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE product_id = $1")
                .bind(product)
                .fetch_one(&primary)
                .await
                .unwrap()
        }
    };
    wait_for("the load is running", Duration::from_secs(30), || async {
        count("deploy").await >= 100
    })
    .await;
    served.signal("-TERM");
    wait_for(
        "the listener closes on SIGTERM",
        Duration::from_secs(10),
        || async { !served.accepting().await },
    )
    .await;
    assert!(
        served.alive(),
        "the process exited with {HELD} orders still in flight"
    );
    assert!(
        held.iter().all(|h| !h.is_finished()),
        "a held order was answered before its row was free"
    );
    lock.commit().await.unwrap();
    for (i, h) in held.into_iter().enumerate() {
        match h.await.unwrap() {
            Ok((s, body)) => assert_eq!(s, StatusCode::CREATED, "held-{i}: {body}"),
            Err(e) => panic!("held-{i} in flight at SIGTERM lost its answer: {e}"),
        }
    }
    let status = served.exit_within(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status:?}");

    let mut answered: HashMap<String, Result<String, ()>> = HashMap::new();
    for w in workers {
        answered.extend(w.await.unwrap());
    }
    let in_db = |product: &'static str| {
        let primary = primary.clone();
        async move {
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT idempotency_key, order_id::text FROM orders WHERE product_id = $1",
            )
            .bind(product)
            .fetch_all(&primary)
            .await
            .unwrap();
            rows.into_iter().collect::<HashMap<String, String>>()
        }
    };
    let before_retries = in_db("deploy").await;
    for (key, outcome) in &answered {
        if let Ok(id) = outcome {
            assert_eq!(
                before_retries.get(key),
                Some(id),
                "a 201 for {key} must be in the database"
            );
        }
    }
    for key in before_retries.keys() {
        assert!(
            answered.contains_key(key),
            "order {key} in the database was never sent"
        );
    }
    // Every key whose answer was lost, retried on a new instance: the order it got, or one
    // new order now.
    let next = spawn_app_with(AppOptions {
        database: Some(db.clone()),
        ..AppOptions::new(cluster)
    })
    .await;
    let lost: Vec<&String> = answered
        .iter()
        .filter(|(_, o)| o.is_err())
        .map(|(k, _)| k)
        .collect();
    assert!(
        !lost.is_empty(),
        "SIGTERM cut no load request off; the retries prove nothing"
    );
    for key in &lost {
        let user = format!(
            "buyer-{}",
            key.trim_start_matches('w').split('-').next().unwrap()
        );
        let (s, body) = admin_order(
            &next.client,
            &next.address,
            &next.admin,
            &user,
            key,
            "deploy",
        )
        .await
        .unwrap();
        assert_eq!(s, StatusCode::CREATED, "retry of {key}: {body}");
        if let Some(id) = before_retries.get(*key) {
            assert_eq!(
                body["order_id"].as_str(),
                Some(id.as_str()),
                "retry of {key}"
            );
        }
    }
    let after_retries = in_db("deploy").await;
    let new = after_retries.len() - before_retries.len();
    let lost_without_order = lost
        .iter()
        .filter(|k| !before_retries.contains_key(**k))
        .count();
    assert_eq!(
        new, lost_without_order,
        "one new order per lost key that had none"
    );
    for (product, orders) in [
        ("deploy", after_retries.len() as i64),
        ("deploy-held", HELD as i64),
    ] {
        assert_eq!(count(product).await, orders, "{product}");
        assert_eq!(
            stock_on(&primary, product).await + orders,
            STOCK,
            "{product}"
        );
    }
}

/// Ctrl-C (SIGINT) drains like SIGTERM: the order in flight at the signal is answered 201
/// once its row is free, new connections are refused meanwhile, and the exit status is 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_stops_accepting_drains_the_order_in_flight_and_exits_0() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let mut served = Served::start(cluster, &db, &[("STOCKGATE_DRAIN_TIMEOUT_MS", "20000")]).await;
    let base = served.base();
    let client = reqwest::Client::new();
    let admin = stockgate::auth::Tokens::new(SECRET)
        .issue(&stockgate::auth::Caller::Admin, Duration::from_secs(600))
        .unwrap();
    let created = client.post(format!("{base}/v1/products")).bearer_auth(&admin).json(&json!({"product_id": "ctrl-c", "name": "C", "price_cents": 100, "available_quantity": 5})).send().await.unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    let primary = sqlx::PgPool::connect(&cluster.primary_url(&db))
        .await
        .unwrap();
    let mut lock = primary.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM products WHERE product_id = 'ctrl-c' FOR NO KEY UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let order = {
        let (client, base, admin) = (client.clone(), base.clone(), admin.clone());
        tokio::spawn(async move { admin_order(&client, &base, &admin, "ada", "k", "ctrl-c").await })
    };
    wait_for(
        "the order waits on the row",
        Duration::from_secs(10),
        || async { batches_waiting_on(&primary, "Lock").await == 1 },
    )
    .await;
    served.signal("-INT");
    wait_for(
        "the listener closes on SIGINT",
        Duration::from_secs(10),
        || async { !served.accepting().await },
    )
    .await;
    assert!(served.alive(), "the process exited with an order in flight");
    lock.commit().await.unwrap();
    let (s, body) = order
        .await
        .unwrap()
        .expect("the order in flight is answered");
    assert_eq!(s, StatusCode::CREATED, "{body}");
    let status = served.exit_within(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status:?}");
    assert_eq!(stock_on(&primary, "ctrl-c").await, 4);
}

/// A request that times out while its transaction's `BEGIN` is answered (the primary's link
/// silent meanwhile) drops a `begin()` with that answer in flight. sqlx 0.9.0 then queued no
/// ROLLBACK and the pool handed the connection on inside the transaction: the next order batch
/// ran in it, was answered 201, and committed only when some later transaction on that
/// connection did (the history check met it as a cancel answered 404 for an order answered
/// 201). Every primary and replica pool of the service is such a pool. Fails on sqlx 0.9.0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_dropped_with_its_answer_in_flight_leaves_no_transaction_for_the_next_statement() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let direct = sqlx::PgPool::connect(&cluster.primary_url(&db))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE written (n int)")
        .execute(&direct)
        .await
        .unwrap();
    // One connection, as a busy pool's next free one: the statement after the fault gets it.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!(
            "postgres://postgres@127.0.0.1:{}/{db}",
            proxy.port
        ))
        .await
        .unwrap();
    // Acquired (and pinged) before the fault, so the next bytes the database sends are the
    // answer to BEGIN: they are held.
    let mut conn = pool.acquire().await.unwrap();
    proxy.cut_after(1);
    let begun = tokio::time::timeout(
        Duration::from_millis(300),
        sqlx::Connection::begin(&mut *conn),
    )
    .await
    .is_ok();
    assert!(
        !begun,
        "BEGIN's answer was held, so begin() cannot have finished"
    );
    proxy.heal();
    drop(conn);
    sqlx::query("INSERT INTO written VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    // Its own transaction, committed when it was answered: another session sees it at once.
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM written")
        .fetch_one(&direct)
        .await
        .unwrap();
    assert_eq!(
        seen, 1,
        "the statement ran inside the dropped begin's transaction"
    );
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(&db)
    .fetch_one(&direct)
    .await
    .unwrap();
    assert_eq!(open, 0, "a session is left inside a transaction");
}
