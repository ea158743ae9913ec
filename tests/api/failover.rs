//! The primary fails over under Patroni (issue 15): real Patroni, real etcd, real `kill -9`.
//!
//! All tests share ONE HA cluster (three nodes, `synchronous_mode` on) and take turns on it
//! (a lock): each starts from a healthy cluster — a leader, two streaming replicas, one of
//! them sync — and leaves one behind. Each test gets its own database.

use crate::helpers::*;
use devcluster::ha::HaCluster;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use stockgate::config::Config;
use stockgate::startup::Application;

fn ha() -> &'static HaCluster {
    static HA: OnceLock<HaCluster> = OnceLock::new();
    HA.get_or_init(|| HaCluster::temporary(true).expect("start the shared HA cluster"))
}

/// The shared cluster, healthy.
async fn healthy_cluster() -> &'static HaCluster {
    let c = blocking(ha);
    blocking(|| c.wait_healthy(Duration::from_secs(90))).expect("HA cluster healthy");
    c
}

fn leader(c: &HaCluster) -> usize {
    c.leader().ok().flatten().expect("a leader")
}

/// A new migrated database, created on the current leader.
async fn ha_database(c: &HaCluster) -> String {
    let db = format!("t_{}", uuid::Uuid::new_v4().simple());
    let l = leader(c);
    c.psql(l, &format!("CREATE DATABASE \"{db}\""))
        .expect("create database");
    stockgate::startup::migrate(&c.node_url(l, &db))
        .await
        .expect("migrate");
    db
}

/// A pool on the database on whichever node leads now.
async fn leader_pool(c: &HaCluster, db: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&c.node_url(leader(c), db))
        .await
        .expect("pool on the leader")
}

/// An instance that follows the cluster through `STOCKGATE_PATRONI_URLS`. Its
/// `DATABASE_URL` names node 1 only for the credentials and database: the member
/// addresses come from Patroni.
async fn spawn_ha_app(c: &HaCluster, db: &str, redis_url: Option<String>) -> TestApp {
    let mut env: HashMap<&str, String> = HashMap::new();
    env.insert("DATABASE_URL", c.database_url(db));
    env.insert("STOCKGATE_PATRONI_URLS", c.patroni_urls());
    env.insert("STOCKGATE_TOKEN_SECRET", SECRET.into());
    env.insert("STOCKGATE_LISTEN", "127.0.0.1:0".into());
    env.insert("STOCKGATE_PRIMARY_POOL_SIZE", "20".into());
    if let Some(r) = redis_url {
        env.insert("STOCKGATE_REDIS_URL", r);
    }
    let config = Config::from_lookup(|k| env.get(k).cloned()).expect("config");
    let app = Application::build(&config).await.expect("build app");
    let port = app.port();
    let state = app.state().clone();
    let (tx, running) = run_in_background(app);
    let tokens = stockgate::auth::Tokens::new(SECRET);
    let admin = tokens
        .issue(&stockgate::auth::Caller::Admin, Duration::from_secs(3600))
        .expect("token");
    let app = TestApp {
        address: format!("http://127.0.0.1:{port}"),
        database: db.to_string(),
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .timeout(Duration::from_secs(30))
            .build()
            .expect("client"),
        tokens,
        admin,
        primary: leader_pool(c, db).await,
        state,
        shutdown: Some(tx),
        running: Some(running),
    };
    let leader = c.name(leader(c));
    app.wait_for("both replicas healthy", Duration::from_secs(20), || async {
        let states = app.replica_states().await;
        states.len() == 3
            && states
                .iter()
                .all(|(n, s, _)| *n == leader || s == "healthy")
    })
    .await;
    app
}

/// What one buyer saw, and the statuses every attempt got.
#[derive(Debug, Default)]
struct Ledger {
    confirmed: Vec<(Instant, String)>,
    statuses: HashMap<u16, usize>,
    /// 5xx other than 503, and 503s without `Retry-After`: each a bug.
    bad: Vec<String>,
}

/// Places an order with `key` until the answer is final (201 or 409), honouring
/// `Retry-After` on 503 (capped at 1 s), for at most `patience`.
async fn buy(
    app: &TestApp,
    user: &str,
    key: &str,
    product: &str,
    patience: Duration,
    ledger: &Mutex<Ledger>,
) {
    let start = Instant::now();
    while start.elapsed() < patience {
        let resp = app
            .client
            .post(app.url("/v1/orders"))
            .bearer_auth(app.user_token(user))
            .header("Idempotency-Key", key)
            .json(&json!({"product_id": product, "quantity": 1}))
            .send()
            .await;
        let Ok(resp) = resp else {
            // The answer was lost in transit: retry with the same key.
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        {
            let mut l = ledger.lock().unwrap();
            *l.statuses.entry(status.as_u16()).or_default() += 1;
            if status.is_server_error()
                && (status != StatusCode::SERVICE_UNAVAILABLE || retry_after.is_none())
            {
                l.bad.push(format!("{status} {body}"));
            }
            if status == StatusCode::CREATED {
                l.confirmed
                    .push((Instant::now(), body["order_id"].as_str().unwrap().into()));
            }
        }
        match status {
            StatusCode::CREATED | StatusCode::CONFLICT => return,
            StatusCode::SERVICE_UNAVAILABLE => {
                let wait =
                    Duration::from_secs(retry_after.unwrap_or(1)).min(Duration::from_secs(1));
                tokio::time::sleep(wait).await;
            }
            other => {
                ledger.lock().unwrap().bad.push(format!("{other} {body}"));
                return;
            }
        }
    }
}

async fn confirmed_order_ids(pool: &sqlx::PgPool, product: &str) -> HashSet<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT order_id::text FROM orders WHERE product_id = $1 AND status = 'confirmed'",
    )
    .bind(product)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn stock(pool: &sqlx::PgPool, product: &str) -> i64 {
    sqlx::query_scalar::<_, i32>("SELECT available_quantity FROM products WHERE product_id = $1")
        .bind(product)
        .fetch_one(pool)
        .await
        .unwrap() as i64
}

/// Brings a killed node back and waits for the whole cluster to be healthy again.
async fn restore(c: &HaCluster, node: usize) {
    blocking(|| c.start_node(node)).expect("restart the old leader");
    blocking(|| c.wait_healthy(Duration::from_secs(90))).expect("cluster healthy again");
}

async fn kill_9_of_the_leader_mid_sale_loses_no_confirmed_order_and_oversells_nothing() {
    let c = healthy_cluster().await;
    let db = ha_database(c).await;
    let app = spawn_ha_app(c, &db, None).await;
    assert_eq!(
        app.create_product("flash-60", 60, 999).await.status(),
        StatusCode::CREATED
    );
    let old = leader(c);
    let changes_before = app.metric("stockgate_patroni_leader_changes_total").await;

    // 1,000 buyers arrive 10 ms apart, each retrying with their own key until the answer is
    // final; the leader dies once a third of the stock is sold.
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let app = Arc::new(app);
    let buyers: Vec<_> = (0..1000)
        .map(|i| {
            let (app, ledger) = (app.clone(), ledger.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(10 * i)).await;
                let user = format!("buyer-{i}");
                buy(
                    &app,
                    &user,
                    &format!("key-{i}"),
                    "flash-60",
                    Duration::from_secs(60),
                    &ledger,
                )
                .await;
            })
        })
        .collect();
    wait_for(
        "20 units sold before the kill",
        Duration::from_secs(20),
        || async { ledger.lock().unwrap().confirmed.len() >= 20 },
    )
    .await;
    let sold_before_kill = ledger.lock().unwrap().confirmed.len();
    assert!(
        sold_before_kill < 60,
        "the sale must still be running when the leader dies ({sold_before_kill} sold)"
    );
    let killed_at = Instant::now();
    let killed_wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    blocking(|| c.kill_node(old)).expect("kill -9 the leader");
    let new = blocking(|| c.wait_new_leader(old, Duration::from_secs(60))).expect("a new leader");
    let elected_after = killed_at.elapsed();
    for b in buyers {
        b.await.unwrap();
    }

    // Every buyer is done: the ledger is ours alone.
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let pool = leader_pool(c, &db).await;
    // Orders the new leader committed (created after the kill, by the server's clock; the
    // old leader was dead by then), and the first 201 a buyer got for one of them.
    let committed_on_new: HashSet<String> = sqlx::query_scalar(
        "SELECT order_id::text FROM orders WHERE product_id = 'flash-60' AND status = 'confirmed' AND created_at > to_timestamp($1)",
    )
    .bind(killed_wall)
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let first_on_new = ledger
        .confirmed
        .iter()
        .filter(|(_, id)| committed_on_new.contains(id))
        .map(|(t, _)| *t)
        .min()
        .expect("writes resumed on the new leader");
    println!(
        "kill -9 of {} → {} leads after {:.1}s; first 201 from the new leader {:.1}s after the kill; {} sold before, {} after; statuses {:?}",
        c.name(old),
        c.name(new),
        elected_after.as_secs_f64(),
        (first_on_new - killed_at).as_secs_f64(),
        sold_before_kill,
        committed_on_new.len(),
        ledger.statuses
    );
    assert!(
        ledger.bad.is_empty(),
        "answers that break the contract: {:?}",
        ledger.bad
    );
    assert!(
        ledger.statuses.get(&503).copied().unwrap_or(0) > 0,
        "the outage was seen (503s with Retry-After)"
    );

    let on_new_leader = confirmed_order_ids(&pool, "flash-60").await;
    let left = stock(&pool, "flash-60").await;
    assert!(
        on_new_leader.len() <= 60,
        "oversold: {}",
        on_new_leader.len()
    );
    assert_eq!(left + on_new_leader.len() as i64, 60, "stock is conserved");
    // synchronous_mode: every 201 any buyer received is a confirmed order on the new leader.
    let answered: HashSet<String> = ledger.confirmed.iter().map(|(_, id)| id.clone()).collect();
    let lost: Vec<_> = answered.difference(&on_new_leader).collect();
    assert!(lost.is_empty(), "201s lost in the failover: {lost:?}");
    // Every buyer got a final answer, so the whole stock sold, once each.
    assert_eq!(answered.len(), 60);
    assert_eq!(answered, on_new_leader);

    // The instance followed the leader and counted the change.
    let status = &app.get_json("/v1/admin/replicas", Some(&app.admin)).await.1["cluster"];
    assert_eq!(status["leader"], json!(c.name(new)), "{status}");
    assert_eq!(status["writes_to"], json!(c.name(new)), "{status}");
    assert!(app.metric("stockgate_patroni_leader_changes_total").await > changes_before);
    restore(c, old).await;
}

async fn settings_saved_on_the_old_leader_are_read_back_through_both_instances_after_the_kill() {
    let c = healthy_cluster().await;
    let db = ha_database(c).await;
    let redis = devcluster::Redis::temporary().expect("a private Redis");
    let a = spawn_ha_app(c, &db, Some(redis.url())).await;
    let b = spawn_ha_app(c, &db, Some(redis.url())).await;
    let user = "ada";
    let token = a.user_token(user);
    let put = a
        .client
        .put(a.url(&format!("/v1/users/{user}/settings")))
        .bearer_auth(&token)
        .json(&json!({"settings": {"theme": "dark", "v": 2}}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::OK);
    let old = leader(c);

    let killed_at = Instant::now();
    blocking(|| c.kill_node(old)).expect("kill -9 the leader");
    // Read through both instances, all through the failover: every answer is the new value
    // (or a 503 while no node can say); then each must answer from the new cluster.
    let mut served_by: HashSet<String> = HashSet::new();
    let mut answered_after_failover = [false, false];
    while killed_at.elapsed() < Duration::from_secs(60) && answered_after_failover != [true, true] {
        for (k, app) in [&a, &b].into_iter().enumerate() {
            let (status, body) = app
                .get_json(&format!("/v1/users/{user}/settings"), Some(&token))
                .await;
            match status {
                StatusCode::OK => {
                    assert_eq!(
                        body["settings"],
                        json!({"theme": "dark", "v": 2}),
                        "instance {k} read an old value from {}",
                        body["served_by"]
                    );
                    served_by.insert(body["served_by"].as_str().unwrap_or("").into());
                    let leads = app.state.db.cluster_status().and_then(|s| s.writes_to);
                    if leads.is_some_and(|l| l != c.name(old)) {
                        answered_after_failover[k] = true;
                    }
                }
                StatusCode::SERVICE_UNAVAILABLE => {}
                other => panic!("instance {k}: {other} {body}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "settings read back through both instances {:.1}s after the kill; served by {served_by:?}",
        killed_at.elapsed().as_secs_f64()
    );
    assert_eq!(
        answered_after_failover,
        [true, true],
        "both instances answered after the failover"
    );
    restore(c, old).await;
}

async fn a_planned_switchover_under_hot_sku_load_loses_no_confirmed_order() {
    let c = healthy_cluster().await;
    let db = ha_database(c).await;
    let app = Arc::new(spawn_ha_app(c, &db, None).await);
    assert_eq!(
        app.create_product("hot", 1_000_000, 100).await.status(),
        StatusCode::CREATED
    );
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let (app, ledger, stop) = (app.clone(), ledger.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let user = format!("hot-{w}");
                    buy(
                        &app,
                        &user,
                        &format!("k-{w}-{n}"),
                        "hot",
                        Duration::from_secs(60),
                        &ledger,
                    )
                    .await;
                    n += 1;
                }
            })
        })
        .collect();
    wait_for("orders flowing", Duration::from_secs(10), || async {
        ledger.lock().unwrap().confirmed.len() >= 200
    })
    .await;
    let old = leader(c);
    let started = Instant::now();
    let new = blocking(|| c.switchover()).expect("switchover");
    let switched = started.elapsed();
    wait_for(
        "orders on the new leader",
        Duration::from_secs(30),
        || async {
            app.state.db.cluster_status().and_then(|s| s.writes_to) == Some(c.name(new))
                && ledger
                    .lock()
                    .unwrap()
                    .confirmed
                    .iter()
                    .any(|(t, _)| t.duration_since(started) > switched)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    // Every buyer is done: the ledger is ours alone.
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let mut times: Vec<Instant> = ledger.confirmed.iter().map(|(t, _)| *t).collect();
    times.sort();
    let gap = times
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let first_after = times
        .iter()
        .find(|t| t.duration_since(started) > switched)
        .map(|t| t.duration_since(started))
        .unwrap_or_default();
    println!(
        "switchover {} → {} in {:.1}s; first 201 after it {:.1}s after the request; longest gap between 201s {:.2}s; {} confirmed; statuses {:?}",
        c.name(old),
        c.name(new),
        switched.as_secs_f64(),
        first_after.as_secs_f64(),
        gap.as_secs_f64(),
        ledger.confirmed.len(),
        ledger.statuses
    );
    assert!(
        ledger.bad.is_empty(),
        "answers that break the contract: {:?}",
        ledger.bad
    );
    let pool = leader_pool(c, &db).await;
    let on_new_leader = confirmed_order_ids(&pool, "hot").await;
    let answered: HashSet<String> = ledger.confirmed.iter().map(|(_, id)| id.clone()).collect();
    let lost: Vec<_> = answered.difference(&on_new_leader).collect();
    assert!(lost.is_empty(), "201s lost in the switchover: {lost:?}");
    assert_eq!(
        stock(&pool, "hot").await + on_new_leader.len() as i64,
        1_000_000,
        "stock is conserved"
    );
    blocking(|| c.wait_healthy(Duration::from_secs(90))).expect("healthy after the switchover");
}

async fn the_old_leader_rejoins_as_a_replica_and_serves_reads_only_once_fresh() {
    let c = healthy_cluster().await;
    let db = ha_database(c).await;
    let app = spawn_ha_app(c, &db, None).await;
    assert_eq!(
        app.create_product("mug", 500, 1299).await.status(),
        StatusCode::CREATED
    );
    let old = leader(c);
    let old_name = c.name(old);
    blocking(|| c.kill_node(old)).expect("kill -9 the leader");
    let new = blocking(|| c.wait_new_leader(old, Duration::from_secs(60))).expect("a new leader");
    wait_for(
        "the instance writes to the new leader",
        Duration::from_secs(10),
        || async { app.state.db.cluster_status().and_then(|s| s.writes_to) == Some(c.name(new)) },
    )
    .await;
    // Precondition: the dead node serves nothing.
    assert_eq!(app.replica_state(&old_name).await, "down");

    // Writes on the new timeline while the old leader is away: it must replay them (after
    // Patroni rewinds it) before it may serve a stock-gate read. Patroni can name the new
    // leader a moment before its promotion ends; a write then is refused with 503
    // DATABASE_UNAVAILABLE (nothing done) and is sent again. The stock read back below (505)
    // says each landed exactly once.
    for _ in 0..5 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let resp = app.restock("mug", 1).await;
            let status = resp.status();
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            if status == StatusCode::SERVICE_UNAVAILABLE
                && code(&body) == "DATABASE_UNAVAILABLE"
                && Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            assert_eq!(status, StatusCode::OK, "{body}");
            break;
        }
    }
    let restarted = Instant::now();
    blocking(|| c.start_node(old)).expect("restart the old leader");
    // Every read served by the old leader shows the stock as written on the new timeline,
    // and comes only after the instance judged it healthy on the leader's timeline.
    let mut served_by_old = 0;
    let mut unavailable = 0;
    while restarted.elapsed() < Duration::from_secs(60) && served_by_old < 20 {
        let resp = app.availability("mug", 1).await;
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE {
            // Allowed by the contract while the cluster changes (with Retry-After); counted.
            assert!(resp.headers().contains_key("retry-after"));
            unavailable += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        assert_eq!(resp.status(), StatusCode::OK);
        let body: Value = resp.json().await.unwrap();
        if body["served_by"] == json!(old_name) {
            assert_eq!(body["available_quantity"], json!(505), "{body}");
            assert!(body["stale_by_ms"].as_u64().unwrap() <= 250, "{body}");
            served_by_old += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "{old_name} rejoined and served {served_by_old} reads within {:.1}s of its restart \
         ({unavailable} answers were 503 with Retry-After meanwhile)",
        restarted.elapsed().as_secs_f64()
    );
    assert!(
        served_by_old > 0,
        "the old leader never served a read after rejoining"
    );
    // Patroni agrees, once its DCS has caught up (a loop): a replica on the leader's timeline.
    blocking(|| {
        devcluster::wait_until(Duration::from_secs(20), || {
            let members = c.members()?;
            let leader_tl = members
                .iter()
                .find(|m| m.role == "leader")
                .and_then(|m| m.timeline);
            Ok(members
                .iter()
                .any(|m| m.name == old_name && m.role != "leader" && m.timeline == leader_tl))
        })
    })
    .expect("Patroni lists the old leader as a replica on the leader's timeline");
    blocking(|| c.wait_healthy(Duration::from_secs(90))).expect("healthy again");
}

/// `/cluster` for the real members with `leader` named leader and the others replicas.
fn cluster_json(c: &HaCluster, leader: usize) -> String {
    let members: Vec<Value> = (1..=devcluster::ha::NODES)
        .map(|i| {
            json!({"name": c.name(i), "role": if i == leader { "leader" } else { "replica" },
                   "state": "running", "host": "127.0.0.1", "port": c.pg_port(i), "timeline": 1})
        })
        .collect();
    json!({ "members": members }).to_string()
}

/// Patroni's view can be a loop old, or plainly wrong: an instance told that a replica leads
/// must not write there. Its new primary connections check `pg_is_in_recovery()`, and the
/// order is a 503 with `Retry-After` that wrote nothing; told the truth, it writes again.
async fn an_instance_told_that_a_replica_leads_writes_nothing_there_and_answers_503() {
    let c = healthy_cluster().await;
    let db = ha_database(c).await;
    let real = leader(c);
    let replica = (1..=devcluster::ha::NODES).find(|&i| i != real).unwrap();
    // Precondition: the node we will call leader really is in recovery.
    assert_eq!(c.psql(replica, "SELECT pg_is_in_recovery()").unwrap(), "t");
    // Precondition: it has replayed the new database and its schema (after a scenario that
    // restarted it, it may still be catching up).
    wait_for(
        "the replica has the database",
        Duration::from_secs(30),
        || async {
            use sqlx::Connection;
            match sqlx::PgConnection::connect(&c.node_url(replica, &db)).await {
                Ok(mut conn) => sqlx::query_scalar::<_, bool>(
                    "SELECT to_regclass('public.products') IS NOT NULL",
                )
                .fetch_one(&mut conn)
                .await
                .unwrap_or(false),
                Err(_) => false,
            }
        },
    )
    .await;
    let fake = FakePatroni::start(cluster_json(c, replica)).await;
    let mut env: HashMap<&str, String> = HashMap::new();
    env.insert("DATABASE_URL", c.database_url(&db));
    env.insert("STOCKGATE_PATRONI_URLS", fake.url.clone());
    env.insert("STOCKGATE_TOKEN_SECRET", SECRET.into());
    env.insert("STOCKGATE_LISTEN", "127.0.0.1:0".into());
    let config = Config::from_lookup(|k| env.get(k).cloned()).expect("config");
    let app = Application::build(&config).await.expect("build app");
    let db_handle = app.state().db.clone();
    let port = app.port();
    let (_stop, _running) = run_in_background(app);
    let truth = leader_pool(c, &db).await;
    sqlx::query("INSERT INTO products (product_id, name, price_cents, available_quantity) VALUES ('p', 'P', 100, 10)")
        .execute(&truth)
        .await
        .unwrap();

    // The primary pool itself refuses the replica, whatever the freshness monitor thinks.
    let begun = db_handle.primary().begin().await;
    assert!(
        matches!(begun, Err(stockgate::routing::DbError::Unavailable(_))),
        "a primary transaction opened on a node in recovery: {:?}",
        begun.map(|_| ())
    );

    let client = reqwest::Client::new();
    let tokens = stockgate::auth::Tokens::new(SECRET);
    let token = tokens
        .issue(
            &stockgate::auth::Caller::User(stockgate::domain::UserId::parse("u").unwrap()),
            Duration::from_secs(3600),
        )
        .unwrap();
    let order = || {
        client
            .post(format!("http://127.0.0.1:{port}/v1/orders"))
            .bearer_auth(&token)
            .header("Idempotency-Key", "k1")
            .json(&json!({"product_id": "p", "quantity": 1}))
            .send()
    };
    let resp = order().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(resp.headers().contains_key("retry-after"));
    let refused: f64 = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("stockgate_writes_refused_read_only_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(refused > 0.0, "refusals are counted");
    assert_eq!(stock(&truth, "p").await, 10, "nothing was written");

    // Told the truth, it follows and the retry with the same key confirms.
    fake.say(cluster_json(c, real));
    let started = Instant::now();
    loop {
        let resp = order().await.unwrap();
        if resp.status() == StatusCode::CREATED {
            break;
        }
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never followed the real leader"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stock(&truth, "p").await, 9);
}

/// Turns Patroni's `synchronous_mode` on or off (`PATCH /config` on the leader) and waits
/// until the leader's replication says so.
fn set_synchronous(c: &HaCluster, on: bool) {
    let l = leader(c);
    let body = format!("{{\"synchronous_mode\": {on}}}");
    let (status, text) =
        devcluster::ha::http(c.rest_port(l), "PATCH", "/config", Some(&body)).expect("PATCH");
    assert_eq!(status, 200, "{text}");
    let want = if on { "1" } else { "0" };
    devcluster::wait_until(Duration::from_secs(30), || {
        Ok(c.psql(
            l,
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
        )? == want)
    })
    .expect("replication as configured");
}

/// A user's settings on node `i`, read there directly with psql ("" when none, or when the
/// node cannot say yet).
fn settings_on(c: &HaCluster, i: usize, db: &str, user: &str) -> String {
    let out = std::process::Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            db,
            "-X",
            "-A",
            "-t",
            "-q",
        ])
        .args(["-p", &c.pg_port(i).to_string()])
        .args([
            "-c",
            &format!("SELECT settings FROM user_settings WHERE user_id = '{user}'"),
        ])
        .env("PGCONNECT_TIMEOUT", "3")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Without `synchronous_mode` a write the leader acknowledged can be lost in a failover: the
/// promoted replica never received it, and its timeline forks before it. The user who wrote
/// must then be read from the primary, even once a replica of the new timeline has replayed
/// past the write's offset (its WAL there is other WAL) and serves other users' reads, and
/// what they read is what the new leader holds. Mutation: `reached` comparing offsets without
/// the timeline's history serves the user from that replica (`served_by: node2`).
async fn an_async_write_lost_past_the_fork_is_never_claimed_by_a_replica_of_the_new_timeline() {
    let c = healthy_cluster().await;
    blocking(|| set_synchronous(c, false));
    let db = ha_database(c).await;
    // One instance, its read-your-writes store in process: a new Redis would send every
    // user's reads to the primary for a TTL after its first use (its epoch's pin), which
    // would hide what this checks.
    let a = spawn_ha_app(c, &db, None).await;
    let user = "lin";
    let token = a.user_token(user);
    let put = |app: &TestApp, v: i64| {
        app.client
            .put(app.url(&format!("/v1/users/{user}/settings")))
            .bearer_auth(&token)
            .json(&json!({"settings": {"v": v}}))
            .send()
    };
    eprintln!("async failover: v1");
    assert_eq!(put(&a, 1).await.unwrap().status(), StatusCode::OK);
    let old = leader(c);
    let others: Vec<usize> = (1..=3).filter(|&i| i != old).collect();
    blocking(|| {
        devcluster::wait_until(Duration::from_secs(20), || {
            Ok(others
                .iter()
                .all(|&i| settings_on(c, i, &db, user) == r#"{"v": 1}"#))
        })
    })
    .expect("v1 on every replica");
    // The leader's WAL stops leaving it: its WAL senders are frozen.
    let senders = c
        .psql(old, "SELECT pid FROM pg_stat_replication")
        .expect("walsenders");
    eprintln!("async failover: freezing WAL senders {senders:?}");
    assert_eq!(senders.lines().count(), 2, "two WAL senders: {senders}");
    for pid in senders.lines() {
        let ok = std::process::Command::new("kill")
            .args(["-STOP", pid.trim()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
    // Acknowledged on the leader alone (asynchronous replication).
    assert_eq!(put(&a, 2).await.unwrap().status(), StatusCode::OK);
    let written_at = c.psql(old, "SELECT pg_current_wal_lsn()").expect("lsn");
    eprintln!("async failover: v2 at {written_at}");
    assert_eq!(settings_on(c, old, &db, user), r#"{"v": 2}"#);
    for &i in &others {
        assert_eq!(
            settings_on(c, i, &db, user),
            r#"{"v": 1}"#,
            "precondition: the replicas never got the write"
        );
    }
    blocking(|| c.kill_node(old)).expect("kill -9 the leader");
    // The frozen senders outlive their postmaster (orphans by then) and would hold its shared
    // memory against a restart: they go too.
    for pid in senders.lines() {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status();
    }
    let new = blocking(|| c.wait_new_leader(old, Duration::from_secs(60))).expect("a new leader");
    eprintln!("async failover: new leader {}", c.name(new));
    let replica = others.into_iter().find(|&i| i != new).unwrap();
    wait_for(
        "the instance writes to the new leader",
        Duration::from_secs(30),
        || async { a.state.db.cluster_status().and_then(|s| s.writes_to) == Some(c.name(new)) },
    )
    .await;
    // The new timeline's WAL passes the lost write's offset, and the replica follows it.
    blocking(|| {
        devcluster::wait_until(Duration::from_secs(60), || {
            let _ = c.psql(new, "SELECT pg_switch_wal()");
            Ok(c.psql(
                replica,
                &format!("SELECT pg_last_wal_replay_lsn() > '{written_at}'"),
            )
            .unwrap_or_default()
                == "t")
        })
    })
    .expect("the replica past the lost write's offset on the new timeline");
    eprintln!(
        "async failover: replica {} past {written_at}",
        c.name(replica)
    );
    // Precondition: that replica serves this class: a user who wrote nothing is read there.
    let bystander = a.user_token("bystander");
    wait_for(
        "the replica serving own data",
        Duration::from_secs(30),
        || async {
            let (_, body) = a
                .get_json("/v1/users/bystander/settings", Some(&bystander))
                .await;
            body["served_by"] == c.name(replica)
        },
    )
    .await;
    let truth = settings_on(c, new, &db, user);
    assert_eq!(
        truth, r#"{"v": 1}"#,
        "the write was lost with the old leader"
    );
    for _ in 0..20 {
        let (status, body) = a
            .get_json(&format!("/v1/users/{user}/settings"), Some(&token))
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["served_by"], "primary", "{body}");
        assert_eq!(body["settings"], json!({"v": 1}));
    }
    drop(a);
    // Synchronous again (the cluster as the other scenarios expect it), then the old leader
    // back, rewound onto the new timeline.
    blocking(|| set_synchronous(c, true));
    restore(c, old).await;
}

/// The scenarios share one Patroni cluster whose leader they kill and switch, so they run
/// in turn, inside one test: one test thread waits on the cluster, not one per scenario,
/// and the rest of the suite runs beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_scenarios_one_after_another() {
    eprintln!(
        "failover scenario: kill_9_of_the_leader_mid_sale_loses_no_confirmed_order_and_oversells_nothing"
    );
    Box::pin(kill_9_of_the_leader_mid_sale_loses_no_confirmed_order_and_oversells_nothing()).await;
    eprintln!(
        "failover scenario: settings_saved_on_the_old_leader_are_read_back_through_both_instances_after_the_kill"
    );
    Box::pin(
        settings_saved_on_the_old_leader_are_read_back_through_both_instances_after_the_kill(),
    )
    .await;
    eprintln!(
        "failover scenario: a_planned_switchover_under_hot_sku_load_loses_no_confirmed_order"
    );
    Box::pin(a_planned_switchover_under_hot_sku_load_loses_no_confirmed_order()).await;
    eprintln!(
        "failover scenario: the_old_leader_rejoins_as_a_replica_and_serves_reads_only_once_fresh"
    );
    Box::pin(the_old_leader_rejoins_as_a_replica_and_serves_reads_only_once_fresh()).await;
    eprintln!(
        "failover scenario: an_instance_told_that_a_replica_leads_writes_nothing_there_and_answers_503"
    );
    Box::pin(an_instance_told_that_a_replica_leads_writes_nothing_there_and_answers_503()).await;
    eprintln!(
        "failover scenario: an_async_write_lost_past_the_fork_is_never_claimed_by_a_replica_of_the_new_timeline"
    );
    Box::pin(an_async_write_lost_past_the_fork_is_never_claimed_by_a_replica_of_the_new_timeline())
        .await;
}
