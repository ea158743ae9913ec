//! The second incident: a replica fell 9 minutes behind and users who saved a setting and
//! reloaded — often on another device — saw the old value. After a write, every later read
//! of that user's data, from any client and any instance, sees it.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use stockgate::clock::ManualClock;
use stockgate::domain::UserId;
use stockgate::ryw::RywStore;

/// A private Redis that has been in service: it holds an epoch issued by its running
/// server, as any Redis that has served stockgate for a while does. (A Redis found without
/// one makes every instance read the primary for one TTL, which would hide what these tests
/// look at.)
fn redis_in_service() -> devcluster::Redis {
    let redis = devcluster::Redis::temporary().unwrap();
    let info = redis_cli(&redis, &["INFO", "server"]);
    let run_id = info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .unwrap()
        .trim()
        .to_string();
    let epoch = format!("{run_id}:in-service");
    assert_eq!(
        redis_cli(&redis, &["SET", "stockgate:ryw:epoch", &epoch]),
        "OK"
    );
    redis
}

async fn put_profile(app: &TestApp, user: &str, name: &str) -> reqwest::Response {
    app.client
        .put(app.url(&format!("/v1/users/{user}/profile")))
        .bearer_auth(app.user_token(user))
        .json(&json!({"display_name": name, "email": format!("{user}@example.com")}))
        .send()
        .await
        .unwrap()
}

/// (settings, display name, served_by of both reads) read by `user` on a fresh device.
async fn read_back(app: &TestApp, user: &str) -> (Value, Value, String) {
    let (_, settings, _) = get_settings(app, user).await;
    let device = reqwest::Client::new();
    let profile: Value = device
        .get(app.url(&format!("/v1/users/{user}/profile")))
        .bearer_auth(app.user_token(user))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let served = format!("{} {}", settings["served_by"], profile["served_by"]);
    (
        settings["settings"].clone(),
        profile["display_name"].clone(),
        served,
    )
}

/// What replica `i` itself holds for `user` (its settings), read directly.
async fn replica_holds(cluster: &devcluster::Cluster, i: usize, db: &str, user: &str) -> Value {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.replica_url(i, db))
        .await
        .unwrap();
    let v: Option<Value> =
        sqlx::query_scalar("SELECT settings FROM user_settings WHERE user_id = $1")
            .bind(user)
            .fetch_optional(&pool)
            .await
            .unwrap();
    pool.close().await;
    v.unwrap_or(Value::Null)
}

/// `redis-cli` against this Redis; its answer, trimmed.
fn redis_cli(redis: &devcluster::Redis, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Where this Redis keeps its dump (`SAVE` writes it; a start loads it).
fn redis_dump(redis: &devcluster::Redis) -> std::path::PathBuf {
    let answer = redis_cli(redis, &["CONFIG", "GET", "dir"]);
    let dir = answer.lines().nth(1).unwrap().trim().to_string();
    std::path::Path::new(&dir).join("dump.rdb")
}

async fn store_healthy(app: &TestApp) -> bool {
    let (_, body) = app.get_json("/v1/admin/routing", Some(&app.admin)).await;
    body["read_your_writes_store_healthy"] == true
}

async fn put_settings(app: &TestApp, user: &str, settings: Value) -> reqwest::Response {
    app.client
        .put(app.url(&format!("/v1/users/{user}/settings")))
        .bearer_auth(app.user_token(user))
        .json(&json!({ "settings": settings }))
        .send()
        .await
        .unwrap()
}

/// The precondition of a read that must skip the replicas: both still hold `user`'s old
/// settings, and one is healthy and within the own-data budget (5 s), so only what the service
/// knows of the user's write can keep the read off it.
async fn replicas_lack_the_write_within_budget(
    cluster: &devcluster::Cluster,
    app: &TestApp,
    user: &str,
) {
    for i in 1..=2 {
        assert_eq!(
            replica_holds(cluster, i, &app.database, user).await["v"],
            "old"
        );
    }
    assert!(
        app.replica_states()
            .await
            .iter()
            .any(|(_, state, st)| state == "healthy" && st.is_some_and(|ms| ms < 5_000)),
        "the replicas were already past the budget"
    );
}

/// (status, body, route reason) of a settings read by `user` with a brand-new client (a
/// second device: no cookies, no consistency token).
async fn get_settings(app: &TestApp, user: &str) -> (StatusCode, Value, String) {
    let device = reqwest::Client::new();
    let resp = device
        .get(app.url(&format!("/v1/users/{user}/settings")))
        .bearer_auth(app.user_token(user))
        .send()
        .await
        .unwrap();
    let reason = resp
        .headers()
        .get("x-route-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let status = resp.status();
    (status, resp.json().await.unwrap(), reason)
}

/// Two instances of one deployment (one database) sharing `redis`, with `env` on both.
async fn two_instances(
    cluster: &devcluster::Cluster,
    redis: &devcluster::Redis,
    env: Vec<(&'static str, String)>,
) -> (TestApp, TestApp) {
    let a = spawn_app_with(AppOptions {
        redis_url: Some(redis.url()),
        env: env.clone(),
        ..AppOptions::new(cluster)
    })
    .await;
    let b = spawn_app_with(AppOptions {
        redis_url: Some(redis.url()),
        database: Some(a.database.clone()),
        env,
        ..AppOptions::new(cluster)
    })
    .await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn settings_saved_on_one_device_are_seen_on_another_and_on_another_instance() {
    let cluster = private_cluster();
    let redis = redis_in_service();
    let (a, b) = two_instances(&cluster, &redis, vec![]).await;
    let user = format!("u{}", uuid::Uuid::new_v4().simple());
    assert_eq!(
        put_settings(&a, &user, json!({"theme": "light"}))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        put_settings(&a, "bystander", json!({"theme": "light"}))
            .await
            .status(),
        StatusCode::OK
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    // Both replicas stop replaying, well within the 5 s budget of this read class.
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    assert_eq!(
        put_settings(&a, &user, json!({"theme": "dark"}))
            .await
            .status(),
        StatusCode::OK
    );
    for app in [&a, &b] {
        let (status, body, reason) = get_settings(app, &user).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["settings"]["theme"], "dark", "{body}");
        assert_eq!(body["served_by"], "primary");
        assert_eq!(reason, "read_your_writes");
    }
    // The replicas were fresh enough for everyone else: only the writer is pinned.
    let (_, other, _) = get_settings(&b, "bystander").await;
    assert_ne!(
        other["served_by"], "primary",
        "a user with no recent write reads a replica: {other}"
    );
    // Once the replicas have replayed the write, the user is back on them.
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
        cluster.wait_caught_up(Duration::from_secs(10)).unwrap();
    });
    b.wait_for(
        "reads back on a replica",
        Duration::from_secs(5),
        || async {
            let (_, body, _) = get_settings(&b, &user).await;
            body["served_by"] != "primary" && body["settings"]["theme"] == "dark"
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sticky_window_ends_after_the_ttl_on_the_injected_clock() {
    let cluster = private_cluster();
    let clock = ManualClock::new();
    let app = spawn_app_with(AppOptions {
        clock: clock.clone(),
        ..AppOptions::new(&cluster)
    })
    .await;
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    assert_eq!(
        put_settings(&app, "ada", json!({"lang": "en"}))
            .await
            .status(),
        StatusCode::OK
    );
    // Just after the write, replicas behind it: the primary.
    let (_, body, reason) = get_settings(&app, "ada").await;
    assert_eq!(
        (body["served_by"].as_str(), reason.as_str()),
        (Some("primary"), "read_your_writes")
    );
    // The replicas catch up with the write; the user's position is still remembered.
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
        cluster.wait_caught_up(Duration::from_secs(10)).unwrap();
    });
    let user = UserId::parse("ada").unwrap();
    let ryw = app.state.db.ryw();
    assert!(
        ryw.get(&user).await.unwrap().is_some(),
        "within the TTL the position is kept"
    );
    // Move the clock past the 60 s TTL: the position is forgotten, and the user reads a
    // replica that holds the write (never one that lacks it).
    clock.advance(Duration::from_secs(61));
    assert_eq!(
        ryw.get(&user).await.unwrap(),
        None,
        "after the TTL the position is gone"
    );
    let (_, body, reason) = get_settings(&app, "ada").await;
    assert_ne!(
        body["served_by"], "primary",
        "after the TTL: {body} ({reason})"
    );
    assert_eq!(body["settings"]["lang"], "en", "{body} ({reason})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_saves_succeed_and_reads_fail_closed_to_the_primary() {
    let cluster = private_cluster();
    let redis = redis_in_service();
    // A short window: Redis comes back empty below, which pins everyone for one TTL.
    let app = spawn_app_with(AppOptions {
        redis_url: Some(redis.url()),
        env: vec![("STOCKGATE_RYW_TTL_MS", "6000".into())],
        ..AppOptions::new(&cluster)
    })
    .await;
    assert_eq!(
        put_settings(&app, "ada", json!({"v": 1})).await.status(),
        StatusCode::OK
    );
    blocking(|| redis.stop()).unwrap();
    let saved = put_settings(&app, "ada", json!({"v": 2})).await;
    assert_eq!(saved.status(), StatusCode::OK);
    for _ in 0..10 {
        let (status, body, reason) = get_settings(&app, "ada").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["settings"]["v"], 2);
        assert_eq!(
            (body["served_by"].as_str(), reason.as_str()),
            (Some("primary"), "ryw_store_unavailable")
        );
    }
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("stockgate_ryw_store_failures_total{op=\"get\"}")),
        "{metrics}"
    );
    // Redis returns (empty): no restart; after the one-TTL pin an empty store imposes,
    // replicas are used again once they hold the write.
    blocking(|| redis.start()).unwrap();
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    app.wait_for(
        "replica reads after Redis returns",
        Duration::from_secs(20),
        || async {
            let (_, body, _) = get_settings(&app, "ada").await;
            body["served_by"] != "primary" && body["settings"]["v"] == 2
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_devices_writing_at_once_never_move_the_position_backwards() {
    let redis = redis_in_service();
    let store = RywStore::redis(
        &redis.url(),
        Arc::new(stockgate::clock::SystemClock),
        Duration::from_secs(60),
    )
    .unwrap();
    let user = UserId::parse(&format!("dev-{}", uuid::Uuid::new_v4().simple())).unwrap();
    // Positions arrive out of order from many writers; a reader must never see one drop.
    let writers: Vec<_> = (0..8u64)
        .map(|w| {
            let (store, user) = (store.clone(), user.clone());
            tokio::spawn(async move {
                for k in 0..100u64 {
                    let lsn = 1_000 + ((k * 8 + w) * 7919) % 800;
                    store.advance(&user, lsn).await.unwrap();
                }
            })
        })
        .collect();
    let reader = {
        let (store, user) = (store.clone(), user.clone());
        tokio::spawn(async move {
            let mut last = 0;
            for _ in 0..300 {
                let now = store.get(&user).await.unwrap().unwrap_or(0);
                assert!(now >= last, "position went back from {last} to {now}");
                last = now;
            }
        })
    };
    for w in writers {
        w.await.unwrap();
    }
    reader.await.unwrap();
    let max = (0..8u64)
        .flat_map(|w| (0..100u64).map(move |k| 1_000 + ((k * 8 + w) * 7919) % 800))
        .max();
    assert_eq!(store.get(&user).await.unwrap(), max);
    // A second instance (its own process memory) sees the same position through Redis.
    let other = RywStore::redis(
        &redis.url(),
        Arc::new(stockgate::clock::SystemClock),
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(other.get(&user).await.unwrap(), max);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_cannot_touch_each_others_settings_or_profile_but_admins_can() {
    let app = spawn_app(shared_cluster()).await;
    let ada = app.user_token("ada");
    for (method, path) in [
        ("GET", "/v1/users/bob/settings"),
        ("PUT", "/v1/users/bob/settings"),
        ("GET", "/v1/users/bob/profile"),
        ("PUT", "/v1/users/bob/profile"),
    ] {
        let req = app
            .client
            .request(method.parse().unwrap(), app.url(path))
            .bearer_auth(&ada);
        let req = if method == "PUT" {
            req.json(&json!({"settings": {}, "display_name": "x", "email": "x@example.com"}))
        } else {
            req
        };
        assert_eq!(
            req.send().await.unwrap().status(),
            StatusCode::FORBIDDEN,
            "{method} {path}"
        );
    }
    let put = app
        .client
        .put(app.url("/v1/users/bob/profile"))
        .bearer_auth(&app.admin)
        .json(&json!({"display_name": "Bob", "email": "bob@example.com"}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::OK);
    assert!(put.headers().contains_key("x-consistency-token"));
    let (status, profile) = app
        .get_json("/v1/users/bob/profile", Some(&app.user_token("bob")))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (profile["display_name"].as_str(), profile["email"].as_str()),
        (Some("Bob"), Some("bob@example.com"))
    );
    for field in ["as_of", "stale_by_ms", "served_by"] {
        assert!(profile.get(field).is_some(), "{field} missing: {profile}");
    }
    let bad = app
        .client
        .put(app.url("/v1/users/bob/profile"))
        .bearer_auth(&app.admin)
        .json(&json!({"display_name": "Bob", "email": "not-an-email"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let not_object = put_settings(&app, "ada", json!([1, 2, 3])).await;
    assert_eq!(not_object.status(), StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_carrying_its_consistency_token_is_served_only_by_replicas_that_hold_its_write() {
    let cluster = private_cluster();
    // No shared store in common: two instances, each with its own in-process store.
    let a = spawn_app(&cluster).await;
    let b = spawn_beside(&a, &cluster).await;
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    let saved = put_settings(&a, "eve", json!({"n": 7})).await;
    // Without the token, instance B (no shared store) would read a replica that lacks it…
    let (_, blind, _) = get_settings(&b, "eve").await;
    assert_ne!(blind["served_by"], "primary", "{blind}");
    assert_ne!(blind["settings"]["n"], 7, "{blind}");
    // …with it, B reads only where the write is.
    let token = saved
        .headers()
        .get("x-consistency-token")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let resp = b
        .client
        .get(b.url("/v1/users/eve/settings"))
        .bearer_auth(b.user_token("eve"))
        .header("X-Consistency-Token", &token)
        .send()
        .await
        .unwrap();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        (body["served_by"].as_str(), body["settings"]["n"].as_i64()),
        (Some("primary"), Some(7))
    );
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

/// Incident 003 through a Redis outage: the user saves on instance A while Redis is down,
/// then reads on instance B (another device) after Redis is back — once restarted from a
/// dump taken before the outage (its data, but not the write), once restarted empty.
/// Replicas are paused, so they hold the old values; every read must show the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_saved_while_redis_was_down_is_seen_on_another_instance_after_it_returns_with_or_without_its_data()
 {
    let cluster = private_cluster();
    let redis = redis_in_service();
    let dump = redis_dump(&redis);
    // A short window: each restart below pins everyone for one TTL, and part 2 needs
    // replicas serving again first.
    let ttl = ("STOCKGATE_RYW_TTL_MS", "6000".to_string());
    let (a, b) = two_instances(&cluster, &redis, vec![ttl]).await;
    let (ann, bea) = (
        format!("ann{}", uuid::Uuid::new_v4().simple()),
        format!("bea{}", uuid::Uuid::new_v4().simple()),
    );
    for user in [&ann, &bea] {
        assert_eq!(
            put_settings(&a, user, json!({"v": "old"})).await.status(),
            StatusCode::OK
        );
        assert_eq!(
            put_profile(&a, user, "Old Name").await.status(),
            StatusCode::OK
        );
    }
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    // Precondition: caught-up replicas serve these users on B (nothing pins them).
    b.wait_for(
        "B reads ann from a replica",
        Duration::from_secs(10),
        || async {
            let (v, _, served) = read_back(&b, &ann).await;
            v["v"] == "old" && !served.contains("primary")
        },
    )
    .await;

    // 1. A dump of Redis, Redis killed, the save, Redis restarted from the dump.
    let epoch_before = redis_cli(&redis, &["GET", "stockgate:ryw:epoch"]);
    let dumped = redis_cli(&redis, &["SAVE"]);
    assert_eq!(dumped, "OK");
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    blocking(|| redis.stop()).unwrap();
    let saved = std::time::Instant::now();
    let (s, p) = tokio::join!(
        put_settings(&a, &ann, json!({"v": "new"})),
        put_profile(&a, &ann, "New Name")
    );
    assert_eq!((s.status(), p.status()), (StatusCode::OK, StatusCode::OK));
    eprintln!(
        "saves acknowledged without the store after {:?}",
        saved.elapsed()
    );
    blocking(|| redis.start()).unwrap();
    for app in [&a, &b] {
        app.wait_for("store healthy", Duration::from_secs(5), || {
            store_healthy(app)
        })
        .await;
    }
    // Preconditions: Redis came back with its data (the epoch from before the dump), and
    // the replicas lack the write.
    assert_eq!(
        redis_cli(&redis, &["GET", "stockgate:ryw:epoch"]),
        epoch_before
    );
    for i in 1..=2 {
        assert_eq!(
            replica_holds(&cluster, i, &a.database, &ann).await["v"],
            "old",
            "precondition: replica-{i} lacks the write"
        );
    }
    let (settings, name, served) = read_back(&b, &ann).await;
    assert_eq!(
        (settings["v"].as_str(), name.as_str()),
        (Some("new"), Some("New Name")),
        "B after Redis returned with its data (served by {served})"
    );

    // 2. Redis killed, the save, Redis restarted empty (its dump removed).
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
        cluster.wait_caught_up(Duration::from_secs(10)).unwrap();
    });
    b.wait_for(
        "B reads bea from a replica",
        Duration::from_secs(15),
        || async {
            let (v, _, served) = read_back(&b, &bea).await;
            v["v"] == "old" && !served.contains("primary")
        },
    )
    .await;
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    blocking(|| redis.stop()).unwrap();
    std::fs::remove_file(&dump).unwrap();
    let (s, p) = tokio::join!(
        put_settings(&a, &bea, json!({"v": "new"})),
        put_profile(&a, &bea, "New Name")
    );
    assert_eq!((s.status(), p.status()), (StatusCode::OK, StatusCode::OK));
    blocking(|| redis.start()).unwrap();
    for app in [&a, &b] {
        app.wait_for("store healthy", Duration::from_secs(5), || {
            store_healthy(app)
        })
        .await;
    }
    assert_eq!(redis_cli(&redis, &["DBSIZE"]), "0", "restarted empty");
    for i in 1..=2 {
        assert_eq!(
            replica_holds(&cluster, i, &a.database, &bea).await["v"],
            "old"
        );
    }
    for app in [&b, &a] {
        let (settings, name, served) = read_back(app, &bea).await;
        assert_eq!(
            (settings["v"].as_str(), name.as_str()),
            (Some("new"), Some("New Name")),
            "after Redis restarted empty (served by {served})"
        );
    }
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

/// The store epoch on its own: a write the store DID record is lost when Redis restarts
/// empty. With the replicas only a moment behind (well inside the 5 s budget), the other
/// instance must still not serve that user from a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_position_lost_in_a_redis_restart_still_keeps_the_user_off_stale_replicas() {
    position_lost_in_a_restart(false).await;
}

/// The same when Redis restarts from a dump taken before the write: its data is back (the
/// epoch included), the position is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_position_newer_than_redis_dump_still_keeps_the_user_off_stale_replicas() {
    position_lost_in_a_restart(true).await;
}

async fn position_lost_in_a_restart(from_dump: bool) {
    let cluster = private_cluster();
    let redis = redis_in_service();
    let (a, b) = two_instances(&cluster, &redis, vec![]).await;
    let user = format!("cy{}", uuid::Uuid::new_v4().simple());
    assert_eq!(
        put_settings(&a, &user, json!({"v": "old"})).await.status(),
        StatusCode::OK
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    b.wait_for(
        "B reads the user from a replica",
        Duration::from_secs(10),
        || async {
            let (_, body, _) = get_settings(&b, &user).await;
            body["settings"]["v"] == "old" && body["served_by"] != "primary"
        },
    )
    .await;
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    let paused = std::time::Instant::now();
    if from_dump {
        assert_eq!(redis_cli(&redis, &["SAVE"]), "OK");
    }
    assert_eq!(
        put_settings(&a, &user, json!({"v": "new"})).await.status(),
        StatusCode::OK
    );
    blocking(|| {
        redis.stop().unwrap();
        redis.start().unwrap();
    });
    b.wait_for("store healthy", Duration::from_secs(5), || {
        store_healthy(&b)
    })
    .await;
    // Precondition: Redis came back as intended — with the dump's data (the epoch and the
    // user's older position), or empty.
    let keys = redis_cli(&redis, &["DBSIZE"]);
    if from_dump {
        assert_ne!(keys, "0", "restored from the dump");
    } else {
        assert_eq!(keys, "0", "restarted empty");
    }
    let (status, body, reason) = get_settings(&b, &user).await;
    // Precondition: a replica was still within the read's 5 s budget, so only the lost
    // position's replacement keeps this read off it.
    let fresh_enough = b
        .replica_states()
        .await
        .iter()
        .any(|(_, state, st)| state == "healthy" && st.is_some_and(|ms| ms < 5_000));
    // (Staleness only grows while replay is paused: fresh enough now, fresh enough then.)
    assert!(
        fresh_enough,
        "the replicas were already past the budget ({:?} after the pause)",
        paused.elapsed()
    );
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["settings"]["v"], "new", "{body} ({reason})");
    assert_eq!(body["served_by"], "primary", "{body}");
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

/// One clock for expiry: a reader whose clock runs a minute ahead of the writer's (skew,
/// an NTP step) must not see a position expire early; Redis's own TTL decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_clock_runs_ahead_does_not_expire_a_position_early() {
    let redis = redis_in_service();
    let ttl = Duration::from_secs(60);
    let writer = RywStore::redis(&redis.url(), ManualClock::new(), ttl).unwrap();
    let ahead = ManualClock::new();
    ahead.advance(Duration::from_secs(61));
    let reader = RywStore::redis(&redis.url(), ahead, ttl).unwrap();
    let user = UserId::parse("skewed").unwrap();
    writer.advance(&user, 4242).await.unwrap();
    assert_eq!(writer.get(&user).await.unwrap(), Some(4242));
    assert_eq!(
        reader.get(&user).await.unwrap(),
        Some(4242),
        "the position was written a moment ago, whatever the reader's clock says"
    );
}

/// A committed write is never turned into an error: when the primary's position cannot be
/// read after the commit (primary gone a moment later, pool saturated), the user is pinned
/// to the primary for one TTL instead, and the failure is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_position_cannot_be_read_pins_the_user_to_the_primary_instead_of_failing() {
    use stockgate::routing::{Db, Settings, Timeouts};
    let metrics = stockgate::metrics::Metrics::new();
    let store = RywStore::local(ManualClock::new(), Duration::from_secs(60));
    // A primary nobody listens on: the post-commit position read fails.
    let port = devcluster::free_port_block(1).unwrap();
    let db = Db::new(
        Settings {
            primary_url: format!("postgres://postgres@127.0.0.1:{port}/gone"),
            replica_urls: vec![],
            primary_pool_size: 1,
            replica_pool_size: 1,
            timeouts: Timeouts::default(),
            primary_timeout: Duration::from_millis(200),
            thresholds: Default::default(),
            monitor_interval: Duration::from_millis(25),
            patroni: None,
            time: stockgate::clock::TimeBase::now(),
        },
        metrics.clone(),
        store.clone(),
    )
    .unwrap();
    let user = UserId::parse("pinned").unwrap();
    assert_eq!(store.get(&user).await.unwrap(), None, "precondition");
    assert_eq!(
        db.note_write(&user).await,
        None,
        "no position, and no error"
    );
    assert_eq!(
        store.get(&user).await.unwrap(),
        Some(stockgate::ryw::PRIMARY_ONLY),
        "the user's reads go to the primary"
    );
    assert_eq!(
        metrics
            .ryw_store_failures
            .with_label_values(&["position"])
            .get(),
        1
    );
}

/// Redis down and the replicas paused behind a write, read on the other instance: with no
/// store to ask, that instance must read the primary, although a replica is well within the
/// read's budget and would answer from before the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_and_replicas_paused_another_instance_still_reads_the_write() {
    let cluster = private_cluster();
    let redis = redis_in_service();
    let (a, b) = two_instances(&cluster, &redis, vec![]).await;
    let user = format!("rd{}", uuid::Uuid::new_v4().simple());
    assert_eq!(
        put_settings(&a, &user, json!({"v": "old"})).await.status(),
        StatusCode::OK
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    assert_eq!(
        put_settings(&a, &user, json!({"v": "new"})).await.status(),
        StatusCode::OK
    );
    blocking(|| redis.stop()).unwrap();
    let (status, body, reason) = get_settings(&b, &user).await;
    replicas_lack_the_write_within_budget(&cluster, &b, &user).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["settings"]["v"], "new", "{body} ({reason})");
    assert_eq!(
        (body["served_by"].as_str(), reason.as_str()),
        (Some("primary"), "ryw_store_unavailable"),
        "{body}"
    );
    blocking(|| {
        redis.start().unwrap();
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

/// A save whose COMMIT outlasts the request's timeout is answered 503 `TIMEOUT`, and the
/// server finishes the write all the same: the user's position must still be noted, or their
/// next read is served by a replica from before the write (and flips to the new value once it
/// replays). Fails when the write runs in the request's own future, which the timeout drops
/// between the COMMIT and the note (no position is ever noted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_save_that_outlasts_its_request_timeout_still_keeps_the_users_reads_off_stale_replicas() {
    let cluster = private_cluster();
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_REQUEST_TIMEOUT_MS", "500".into())],
        ..AppOptions::new(&cluster)
    })
    .await;
    let user = "slowsave";
    assert_eq!(
        put_settings(&app, user, json!({"v": "old"})).await.status(),
        StatusCode::OK
    );
    let id = stockgate::domain::UserId::parse(user).unwrap();
    let noted = || async { app.state.db.ryw().get(&id).await.unwrap() };
    let old_position = noted().await;
    assert!(
        old_position.is_some(),
        "precondition: the first save was noted"
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    // The COMMIT of the next write takes 1.5 s (a deferred trigger), three timeouts long.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT OR UPDATE ON user_settings \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let resp = put_settings(&app, user, json!({"v": "new"})).await;
    let answer = (resp.status(), resp.json::<Value>().await.unwrap());
    assert_error(&answer, 503, "TIMEOUT");
    app.wait_for("the write committed", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, Value>("SELECT settings FROM user_settings WHERE user_id = $1")
            .bind(user)
            .fetch_one(&app.primary)
            .await
            .unwrap()["v"]
            == "new"
    })
    .await;
    // The note follows the COMMIT's answer: a read between the two is concurrent with the
    // write. Once a position past the first save's is noted, every read must see the write.
    app.wait_for(
        "the write's position noted",
        Duration::from_secs(10),
        || async { noted().await > old_position },
    )
    .await;
    let (status, body, reason) = get_settings(&app, user).await;
    replicas_lack_the_write_within_budget(&cluster, &app, user).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["settings"]["v"], "new", "{body} ({reason})");
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}
