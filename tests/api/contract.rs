//! Contract promises no other test exercised: a write that meets a read-only node, hold
//! expiry, load shedding, the request timeout, a hold whose answer was lost, the CHECK
//! constraint, `GET /v1/admin/replicas` and `stockgate replicas` against the truth.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn send(req: reqwest::RequestBuilder) -> (StatusCode, Option<String>, Value) {
    let r = req.send().await.unwrap();
    let retry_after = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let s = r.status();
    (s, retry_after, r.json().await.unwrap_or(Value::Null))
}

fn hold_request(
    app: &TestApp,
    user: &str,
    key: &str,
    lines: Value,
    ttl: i64,
) -> reqwest::RequestBuilder {
    app.client
        .post(app.url("/v1/holds"))
        .bearer_auth(app.user_token(user))
        .header("Idempotency-Key", key)
        .json(&json!({"lines": lines, "ttl_s": ttl}))
}

/// `DATABASE_URL` pointed at a streaming replica (a static configuration gone stale, a
/// leader demoted under the service): every write meets SQLSTATE 25006 there. Each is a 503
/// with `Retry-After`, and nothing is written anywhere; the same key then works on the
/// real primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_that_meets_a_read_only_node_is_a_503_with_retry_after_and_writes_nothing() {
    let cluster = shared_cluster();
    let real = spawn_app(cluster).await;
    assert_eq!(
        real.create_product("ro", 10, 100).await.status(),
        StatusCode::CREATED
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    let misled = spawn_app_with(AppOptions {
        database: Some(real.database.clone()),
        env: vec![("DATABASE_URL", cluster.replica_url(1, &real.database))],
        // (Its monitor cannot sample a "primary" in recovery; no replicas to judge by it.)
        replicas: false,
        ..AppOptions::new(cluster)
    })
    .await;
    let product =
        json!({"product_id": "ro-new", "name": "New", "price_cents": 1, "available_quantity": 1});
    let order = json!({"product_id": "ro", "quantity": 1});
    let writes = [
        misled
            .client
            .post(misled.url("/v1/products"))
            .bearer_auth(&misled.admin)
            .json(&product),
        misled
            .client
            .post(misled.url("/v1/products/ro/restock"))
            .bearer_auth(&misled.admin)
            .json(&json!({"quantity": 5})),
        misled
            .client
            .post(misled.url("/v1/orders"))
            .bearer_auth(misled.user_token("ada"))
            .header("Idempotency-Key", "k")
            .json(&order),
        misled
            .client
            .put(misled.url("/v1/users/ada/settings"))
            .bearer_auth(misled.user_token("ada"))
            .json(&json!({"settings": {"v": 1}})),
    ];
    for write in writes {
        let (s, retry_after, body) = send(write).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(retry_after.is_some(), "a 503 says when to retry: {body}");
    }
    // Nothing was written on the real primary ...
    let (products, orders): (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM products), (SELECT count(*) FROM orders)")
            .fetch_one(&real.primary)
            .await
            .unwrap();
    assert_eq!((products, orders), (1, 0));
    assert_eq!(real.stock_on_primary("ro").await, 10);
    // ... and the key was never claimed: it places the order on the real primary.
    let placed = real.order("ada", "k", "ro", 1).await;
    assert_eq!(placed.status(), StatusCode::CREATED);
    assert_eq!(real.confirmed_orders("ro").await, (1, 1));
}

/// A hold past its `expires_at`: its units are back within 5 s of it (never before), judged
/// from what this test saw, not from what the service wrote about itself: the first read of
/// the stock that found the units back ended less than 5 s after `expires_at` (an upper
/// bound of the moment they came back) and after it (a read that ended before `expires_at`
/// and found them back would prove them early). The database and this test read the same
/// host clock. `GET` then says `expired`, a confirm is 409 `HOLD_EXPIRED` and makes no order,
/// and the sweeper's ending is one `hold.expired` event in the feed with the hold's lines.
/// Mutations seen failing: a sweeper 6 s late that dates its ending at `expires_at`
/// (`expires_at <= clock_timestamp() - interval '6 s'` and `ended_at = h.expires_at` in
/// `holds::expire_due`: the service's own `ended_at` said 0 ms late, the stock came back
/// 6 s late); the sweeper ending a hold as `released` (`SET status = 'released'` in
/// `expire_due`); the ending trigger without `'expired'` (`events_holds_updated` in migration
/// `20261202000007`: no `hold.expired` before the marker).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_hold_gives_its_units_back_within_5_s_and_says_hold_expired() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("exp", 10, 100).await;
    app.create_product("exp-b", 10, 100).await;
    let (s, _, hold) = send(hold_request(
        &app,
        "ada",
        "h1",
        json!([{"product_id": "exp", "quantity": 3}, {"product_id": "exp-b", "quantity": 2}]),
        1,
    ))
    .await;
    assert_eq!(s, StatusCode::CREATED, "{hold}");
    let hold = parse::<Hold>(&hold);
    assert_eq!(hold.status, HoldStatus::Held);
    let id = hold.hold_id;
    // Both counts in one statement (one snapshot): two reads could straddle the expiry's
    // commit and see half of it, which no transaction ever wrote.
    let stock = || async {
        sqlx::query_as::<_, (i32, i32)>(
            "SELECT (SELECT available_quantity FROM products WHERE product_id = 'exp'), \
                    (SELECT available_quantity FROM products WHERE product_id = 'exp-b')",
        )
        .fetch_one(&app.primary)
        .await
        .unwrap()
    };
    // Precondition: the units were held when the hold came back.
    assert_eq!(stock().await, (7, 8));
    let back_seen_at = loop {
        let read = stock().await;
        let ended = chrono::Utc::now();
        match read {
            (10, 10) => break ended,
            (7, 8) => {}
            other => panic!("the hold's units came back in part: {other:?}"),
        }
        assert!(
            ended - hold.expires_at < chrono::Duration::seconds(15),
            "the units never came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let late = back_seen_at - hold.expires_at;
    assert!(
        late >= chrono::Duration::zero(),
        "the units were back {} ms before expires_at",
        -late.num_milliseconds()
    );
    assert!(
        late < chrono::Duration::seconds(5),
        "the units were seen back only {} ms after expires_at",
        late.num_milliseconds()
    );
    let token = app.user_token("ada");
    let (s, got) = app.get_json(&format!("/v1/holds/{id}"), Some(&token)).await;
    assert_eq!(s, StatusCode::OK, "{got}");
    assert_eq!(parse::<Hold>(&got).status, HoldStatus::Expired);
    let (s, _, body) = send(
        app.client
            .post(app.url(&format!("/v1/holds/{id}/confirm")))
            .bearer_auth(&token),
    )
    .await;
    assert_error(&(s, body), 409, "HOLD_EXPIRED");
    assert_eq!(app.confirmed_orders("exp").await, (0, 0));
    assert_eq!(app.stock_on_primary("exp").await, 10);

    // The sweeper's ending, in the feed: one `hold.expired` naming the lines that went back,
    // and no other ending of this hold. A product created now is the marker: the feed up to
    // its creation holds every change that committed before it.
    assert_eq!(
        app.create_product("exp-marker", 1, 100).await.status(),
        StatusCode::CREATED
    );
    let feed = feed_until(&app, "the marker's creation", |e| {
        e["type"] == "stock.changed" && e["data"]["product_id"] == "exp-marker"
    })
    .await;
    let hold_id = id.to_string();
    let endings: Vec<&Value> = feed
        .iter()
        .filter(|e| {
            e["data"]["hold_id"] == hold_id.as_str()
                && ["hold.expired", "hold.released", "hold.confirmed"]
                    .contains(&e["type"].as_str().unwrap_or(""))
        })
        .collect();
    assert_eq!(endings.len(), 1, "one ending: {endings:?}");
    assert_eq!(
        endings[0]["data"]["lines"],
        json!([{"product_id": "exp", "quantity": 3}, {"product_id": "exp-b", "quantity": 2}]),
        "{}",
        endings[0]
    );
}

/// A hold whose client hung up while it waited on the row: the retry with its key tells the
/// truth, whichever way the first attempt ended — one hold for the key, its units taken once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_retried_after_a_lost_answer_is_the_same_hold_and_takes_units_once() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("lost-hold", 10, 100).await;
    let lines = json!([{"product_id": "lost-hold", "quantity": 2}]);
    let lock = app.lock_rows(&["lost-hold"]).await;
    let first = tokio::spawn(hold_request(&app, "ada", "h", lines.clone(), 600).send());
    app.wait_for(
        "the hold waits on the row",
        Duration::from_secs(10),
        || async { sessions_waiting(&app.primary, "Lock", "%").await == 1 },
    )
    .await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    lock.commit().await.unwrap();
    let (s, _, again) = send(hold_request(&app, "ada", "h", lines.clone(), 600)).await;
    assert_eq!(s, StatusCode::CREATED, "{again}");
    let (s, _, third) = send(hold_request(&app, "ada", "h", lines, 600)).await;
    assert!(s.is_success(), "{third}");
    assert_eq!(again["hold_id"], third["hold_id"], "one hold for the key");
    let holds: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM holds h JOIN hold_lines l USING (hold_id) WHERE l.product_id = 'lost-hold'",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    assert_eq!(holds, 1);
    assert_eq!(app.stock_on_primary("lost-hold").await, 8);
}

/// `STOCKGATE_MAX_IN_FLIGHT`: with that many requests in flight, the next one is shed at
/// once with 503 `OVERLOADED` and `Retry-After`, and once they finish it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_max_in_flight_a_request_is_shed_with_503_overloaded() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_MAX_IN_FLIGHT", "1".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    app.create_product("shed", 10, 100).await;
    let lock = app.lock_rows(&["shed"]).await;
    let order = {
        let req = app
            .client
            .post(app.url("/v1/orders"))
            .bearer_auth(app.user_token("ada"))
            .header("Idempotency-Key", "k")
            .json(&json!({"product_id": "shed", "quantity": 1}));
        tokio::spawn(req.send())
    };
    app.wait_for("the order in flight", Duration::from_secs(10), || async {
        batches_waiting_on(&app.primary, "Lock").await == 1
    })
    .await;
    let (s, retry_after, body) = send(app.client.get(app.url("/v1/products/shed"))).await;
    assert_error(&(s, body), 503, "OVERLOADED");
    assert!(retry_after.is_some());
    lock.commit().await.unwrap();
    assert_eq!(order.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let (s, _) = app.get_json("/v1/products/shed", None).await;
    assert_eq!(s, StatusCode::OK);
}

/// `STOCKGATE_REQUEST_TIMEOUT_MS`: an order stuck behind a held row past it is answered 503
/// `TIMEOUT` with `Retry-After`; its outcome may still come (the queued order is not
/// withdrawn), and the retry with the same key tells it: one order, stock taken once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_over_the_timeout_is_a_503_and_its_retry_tells_the_outcome() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_REQUEST_TIMEOUT_MS", "300".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    app.create_product("slow", 10, 100).await;
    let lock = app.lock_rows(&["slow"]).await;
    let order = app.order("ada", "k", "slow", 1).await;
    assert!(
        order.headers().contains_key("retry-after"),
        "{} {:?}",
        order.status(),
        order.headers()
    );
    assert_error(&answer(order).await, 503, "TIMEOUT");
    // Precondition: the answer came while the row was still held.
    assert_eq!(batches_waiting_on(&app.primary, "Lock").await, 1);
    lock.commit().await.unwrap();
    // The order outlived its request: it commits with no retry at all ...
    app.wait_for(
        "the timed-out order committed",
        Duration::from_secs(10),
        || async { app.confirmed_orders("slow").await == (1, 1) },
    )
    .await;
    // ... and the retry with its key finds it rather than placing another.
    let retry = app.order("ada", "k", "slow", 1).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(app.confirmed_orders("slow").await, (1, 1));
    assert_eq!(app.stock_on_primary("slow").await, 9);
}

/// The database forbids negative stock itself, whatever the application does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_refuses_negative_stock_with_a_check_violation() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("checked", 1, 100).await;
    let e = sqlx::query("UPDATE products SET available_quantity = available_quantity - 2 WHERE product_id = 'checked'")
        .execute(&app.primary)
        .await
        .unwrap_err();
    let code = e
        .as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("23514"), "{e}");
    assert_eq!(app.stock_on_primary("checked").await, 1);
}

/// An LSN `X/Y` as a number.
fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').unwrap();
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// `GET /v1/admin/replicas` against the replicas themselves: a paused replica's
/// `replay_lsn` is the position it really replayed, `lag_bytes` is the primary's position
/// minus it, and its staleness and state say it is behind; the other one is healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_replicas_page_states_each_replicas_real_position_lag_and_state() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    blocking(|| cluster.pause_replay(1)).unwrap();
    let wal = WalTicker::start(app.primary.clone());
    app.wait_for(
        "replica-1 over 1 s behind",
        Duration::from_secs(20),
        || async {
            app.replica_states()
                .await
                .iter()
                .any(|(n, _, st)| n == "replica-1" && st.is_some_and(|ms| ms >= 1_000))
        },
    )
    .await;
    // WAL stops moving; once the monitor has sampled the primary's final position, the
    // page is judged against what the primary and the replica themselves say.
    drop(wal);
    let replica = sqlx::PgPool::connect(&cluster.replica_url(1, &app.database))
        .await
        .unwrap();
    let replayed: String = sqlx::query_scalar("SELECT pg_last_wal_replay_lsn()::text")
        .fetch_one(&replica)
        .await
        .unwrap();
    let last = std::sync::Mutex::new(Value::Null);
    app.wait_for(
        "the page at the primary's position",
        Duration::from_secs(10),
        || async {
            let current: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
                .fetch_one(&app.primary)
                .await
                .unwrap();
            let (_, page) = app.get_json("/v1/admin/replicas", Some(&app.admin)).await;
            let at = page["primary"]["lsn"].as_str().map(lsn) == Some(lsn(&current))
                && page["replicas"][1]["replay_lsn"].as_str().map(lsn) == Some(lsn(&current));
            *last.lock().unwrap() = page;
            at
        },
    )
    .await;
    let page = last.into_inner().unwrap();
    let primary_lsn = lsn(page["primary"]["lsn"].as_str().unwrap());
    let replicas = page["replicas"].as_array().unwrap();
    assert_eq!(replicas.len(), 2, "{page}");
    for r in replicas {
        for field in ["name", "state", "staleness_ms", "lag_bytes", "replay_lsn"] {
            assert!(r.get(field).is_some(), "{field} missing: {r}");
        }
        let replay = lsn(r["replay_lsn"].as_str().unwrap());
        assert!(replay <= primary_lsn, "{r}");
        assert_eq!(r["lag_bytes"].as_u64(), Some(primary_lsn - replay), "{r}");
    }
    let r1 = &replicas[0];
    assert_eq!(r1["name"], "replica-1");
    assert_eq!(
        lsn(r1["replay_lsn"].as_str().unwrap()),
        lsn(&replayed),
        "{r1}"
    );
    assert!(r1["lag_bytes"].as_u64().unwrap() > 0, "{r1}");
    assert!(r1["staleness_ms"].as_u64().unwrap() >= 1_000, "{r1}");
    assert_eq!(replicas[1]["name"], "replica-2");
    assert_eq!(replicas[1]["state"], "healthy", "{page}");
    blocking(|| cluster.resume_replay(1)).unwrap();
}

/// `stockgate replicas`: one line per replica — name, state, staleness, lag in bytes — as
/// the freshness monitor measures them; one that cannot be reached is `down`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stockgate_replicas_prints_each_replica_with_its_state_staleness_and_lag() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    // A port held by a listener that never answers: nothing else in the suite can take it
    // (a port freed for the test could be handed to another test's proxy to a replica), and
    // a node that completes the handshake but never speaks is what a frozen host looks like.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = silent.local_addr().unwrap().port();
    let run = || {
        blocking(|| {
            std::process::Command::new(env!("CARGO_BIN_EXE_stockgate"))
                .arg("replicas")
                .env("DATABASE_URL", cluster.primary_url(&db))
                .env(
                    "STOCKGATE_REPLICA_URLS",
                    format!(
                        "{},postgres://postgres@127.0.0.1:{closed}/{db}?connect_timeout=1",
                        cluster.replica_url(1, &db)
                    ),
                )
                .env("RUST_LOG", "error")
                .current_dir(std::env::temp_dir())
                .output()
                .unwrap()
        })
    };
    // replica-1 is the shared cluster's: other tests' bulk writes can put it megabytes behind
    // for a moment, and then it is rightly `lagging`. Asked again until it has caught up.
    let deadline = Instant::now() + Duration::from_secs(60);
    let stdout = loop {
        let out = run();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        if stdout
            .lines()
            .next()
            .is_some_and(|l| l.contains(" healthy "))
            || Instant::now() > deadline
        {
            break stdout;
        }
    };
    let lines: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    // replica-1  healthy  3 ms  0 B
    assert_eq!(lines[0][..2], ["replica-1", "healthy"], "{stdout}");
    assert!(
        lines[0][2].parse::<u64>().is_ok() && lines[0][3] == "ms",
        "{stdout}"
    );
    assert!(
        lines[0][4].parse::<u64>().is_ok() && lines[0][5] == "B",
        "{stdout}"
    );
    assert_eq!(lines[1][..3], ["replica-2", "down", "-"], "{stdout}");
    drop(silent);
}

/// `OUTCOME_UNKNOWN` on one instance, and the retry sent to another while the commit is
/// still in doubt (the server has not finished it): the retry waits for the truth rather
/// than deciding afresh — the same order, stock taken once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outcome_unknown_retried_on_another_instance_while_in_doubt_finds_the_same_order() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let a = spawn_through_proxy(cluster, &db, &proxy).await;
    let b = spawn_beside(&a, cluster).await;
    a.create_product("doubt", 10, 100).await;
    // This buyer's commit takes a while (a deferred trigger, run at COMMIT).
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.user_id = 'slowpoke' THEN PERFORM pg_sleep(3); END IF; RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON orders DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .execute(&a.primary)
    .await
    .unwrap();
    let original = {
        let req = a
            .client
            .post(a.url("/v1/orders"))
            .bearer_auth(a.user_token("slowpoke"))
            .header("Idempotency-Key", "k")
            .json(&json!({"product_id": "doubt", "quantity": 1}));
        tokio::spawn(send(req))
    };
    a.wait_for("A's commit under way", Duration::from_secs(10), || async {
        batches_waiting_on(&a.primary, "PgSleep").await == 1
    })
    .await;
    proxy.sever();
    let (s, _, body) = original.await.unwrap();
    assert_error(&(s, body), 503, "OUTCOME_UNKNOWN");
    let retry = {
        let req = b
            .client
            .post(b.url("/v1/orders"))
            .bearer_auth(b.user_token("slowpoke"))
            .header("Idempotency-Key", "k")
            .json(&json!({"product_id": "doubt", "quantity": 1}));
        tokio::spawn(send(req))
    };
    // Precondition: B's batch meets the key while A's commit is still running.
    b.wait_for(
        "B's retry waits on A's commit",
        Duration::from_secs(10),
        || async {
            batches_waiting_on(&b.primary, "PgSleep").await == 1
                && batches_waiting_on(&b.primary, "Lock").await == 1
        },
    )
    .await;
    let (s, _, body) = retry.await.unwrap();
    assert_eq!(s, StatusCode::CREATED, "{body}");
    let committed: String = sqlx::query_scalar(
        "SELECT order_id::text FROM orders WHERE user_id = 'slowpoke' AND idempotency_key = 'k'",
    )
    .fetch_one(&b.primary)
    .await
    .unwrap();
    assert_eq!(body["order_id"].as_str(), Some(committed.as_str()));
    assert_eq!(b.confirmed_orders("doubt").await, (1, 1));
    assert_eq!(b.stock_on_primary("doubt").await, 9);
}

/// How an export ended for its client: the bytes it got, and whether the body ended cleanly.
async fn read_export(mut resp: reqwest::Response) -> (usize, bool) {
    let mut got = 0;
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => got += bytes.len(),
            Ok(None) => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

/// An export streamed from a replica that is cut off mid-stream (its connections closed, or
/// the network silent until the export's timeout): the client sees the body fail, never a
/// clean 200 that ends early.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_export_whose_replica_is_cut_mid_stream_fails_instead_of_ending_short() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let proxy = ChaosProxy::start(cluster.port(1)).await;
    // replica-1, behind the proxy, is the only replica: the exports stream from it. One
    // instance with the default export timeout (a whole export on a loaded machine takes
    // what it takes), one whose timeout ends a frozen stream in 3 s.
    let instance = |timeout_ms: Option<&str>| {
        let mut env = vec![(
            "STOCKGATE_REPLICA_URLS",
            format!("postgres://postgres@127.0.0.1:{}/{db}", proxy.port),
        )];
        if let Some(ms) = timeout_ms {
            env.push(("STOCKGATE_EXPORT_TIMEOUT_MS", ms.to_string()));
        }
        spawn_app_with(AppOptions {
            database: Some(db.clone()),
            env,
            ..AppOptions::new(cluster)
        })
    };
    let app = instance(None).await;
    let short = instance(Some("3000")).await;
    app.create_product("csv", 1, 100).await;
    // An export of ~14 MB; the proxy cuts it after its first megabyte left the replica (a
    // cut "after the client's first chunk" once came after the whole export had left it:
    // loopback socket buffers grow to 32 MB each).
    app.insert_confirmed_orders("csv", 150_000).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).unwrap();
    /// An export that streams from replica-1: sent again (the answer dropped unread) until
    /// the router sends it there, as it does once its monitor has seen replica-1 healthy.
    async fn export(app: &TestApp) -> reqwest::Response {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let resp = app
                .client
                .get(app.url("/v1/exports/orders"))
                .bearer_auth(&app.admin)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            if resp.headers()["x-served-by"] == "replica-1" {
                return resp;
            }
            assert!(
                Instant::now() < deadline,
                "no export from replica-1 within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Precondition: whole, the export ends cleanly.
    let (whole, clean) = read_export(export(&app).await).await;
    assert!(clean, "an export with nothing cut failed");
    assert!(
        whole > 4 << 20,
        "the export is {whole} bytes, not several megabytes"
    );
    // Connections closed mid-stream.
    proxy.sever_after(1 << 20);
    let (got, clean) = read_export(export(&app).await).await;
    assert!(
        got < whole,
        "the cut came after the whole export ({got} bytes)"
    );
    assert!(
        !clean,
        "a severed export ended as a clean 200 after {got} of {whole} bytes"
    );
    // The network silent mid-stream: the export's timeout ends it, as a failure.
    proxy.cut_after(1 << 20);
    let (got, clean) = read_export(export(&short).await).await;
    proxy.heal();
    assert!(
        got < whole,
        "the cut came after the whole export ({got} bytes)"
    );
    assert!(
        !clean,
        "a frozen export ended as a clean 200 after {got} of {whole} bytes"
    );
}

/// `ttl_s` is 1–3600 and a cart or hold has 1–50 lines: both ends are accepted, one past
/// either is 422 and writes nothing, takes nothing and claims no key (the same key then
/// works with a valid body). Mutations seen failing it: `HoldTtl::parse` accepting
/// `1..=3601`; `Lines::MAX = 51`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_outside_1_to_3600_and_51_lines_are_422_and_take_nothing() {
    let app = spawn_app(shared_cluster()).await;
    let ids: Vec<String> = (0..51).map(|i| format!("many-{i:02}")).collect();
    for id in &ids {
        assert_eq!(
            app.create_product(id, 10, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let one = json!([{"product_id": "many-00", "quantity": 1}]);
    for ttl in [json!(0), json!(3601), json!(-1), json!(1.5)] {
        let (s, _, body) = send(
            app.client
                .post(app.url("/v1/holds"))
                .bearer_auth(app.user_token("ada"))
                .header("Idempotency-Key", format!("ttl-{ttl}"))
                .json(&json!({"lines": one, "ttl_s": ttl})),
        )
        .await;
        assert_error_for(&format!("ttl_s {ttl}"), &(s, body), 422, "INVALID_TTL");
    }
    let all: Vec<Value> = ids
        .iter()
        .map(|p| json!({"product_id": p, "quantity": 1}))
        .collect();
    let fifty = Value::from(all[..50].to_vec());
    let fifty_one = Value::from(all.clone());
    let cart = |key: &str, lines: &Value| {
        app.client
            .post(app.url("/v1/orders"))
            .bearer_auth(app.user_token("ada"))
            .header("Idempotency-Key", key)
            .json(&json!({"lines": lines}))
    };
    let (s, _, body) = send(cart("cart-51", &fifty_one)).await;
    assert_error_for("a cart of 51", &(s, body), 422, "INVALID_LINES");
    let (s, _, body) = send(hold_request(&app, "ada", "hold-51", fifty_one.clone(), 60)).await;
    assert_error_for("a hold of 51", &(s, body), 422, "INVALID_LINES");
    let rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM orders) + (SELECT count(*) FROM holds) \
              + (SELECT count(*) FROM products WHERE available_quantity <> 10)",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    assert_eq!(rows, 0, "a refused body writes and takes nothing");

    // The ends themselves, under the keys the refused bodies did not claim.
    for ttl in [1, 3600] {
        let (s, _, body) = send(hold_request(
            &app,
            "ada",
            &format!("ttl-{ttl}"),
            one.clone(),
            ttl,
        ))
        .await;
        assert_eq!(s, StatusCode::CREATED, "ttl_s {ttl}: {body}");
    }
    let (s, _, body) = send(cart("cart-51", &fifty)).await;
    assert_eq!(s, StatusCode::CREATED, "a cart of 50: {body}");
    assert_eq!(body["lines"].as_array().map(Vec::len), Some(50));
    let (s, _, body) = send(hold_request(&app, "ada", "hold-51", fifty, 60)).await;
    assert_eq!(s, StatusCode::CREATED, "a hold of 50: {body}");
}
