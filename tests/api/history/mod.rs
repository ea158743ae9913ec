//! A Jepsen-style history check (issue 13): ~40 clients place, hang up on, retry, replay,
//! cancel and reuse orders and restock with keys through two instances, while a nemesis pauses
//! both replicas, restarts Redis empty, cuts the primary off and restarts an instance. Every
//! answer any client saw is then checked against the primary's tables.
//!
//! Flash drops (issue 27) are part of the workload: some products have a small
//! `max_per_customer` that collectors come back for with fresh keys, and one product's sale
//! starts a few seconds into the run. The checker holds every user to each limit in the final
//! state and after every commit (replayed in the primary's commit order), finds nothing
//! claimed before the start, and holds every refusal's reason to the row its key claimed.
//!
//! Read-your-writes (issue 48) is part of it too: users write their settings and profile from
//! two devices through either instance and read them back, and no read begun after a write
//! was acknowledged may return an older value (`own_data`). The replica pause and the Redis
//! restart count as exercised only if such a write and read met them.
//!
//! The event feed (issue 30) is checked against the same tables: every order the primary
//! holds announced once, every cancel once, every restock, and books that add up to the stock.
//!
//! Locations (issue 46): three products are kept at several locations (one of them inactive
//! throughout), some buyers name the locations they will take from, restocks name locations,
//! and a mover transfers units between them, in transit or at once, retrying and receiving
//! again under the nemesis. Stock is then conserved per (product, location), every answer's
//! allocations are the row's, and every transfer an admin was told of exists once, in the
//! state it was answered in (`locations`).
//!
//! The ledger (issue 47): at the end, `stockgate verify` must find every (product, location)
//! count equal to its movements less its confirmed orders' and live holds' allocations. An
//! adjuster changes counts at the products' locations under keys, by a delta or to a count it
//! read (some as a compare-and-set that loses to a count changed since), hanging up,
//! retrying, replaying and reusing keys under the nemesis. Every key answered 200 is exactly
//! one movement, the one its every answer names (`movement_id`, the count after), a refused
//! key made none, and the movements' deltas, as the primary recorded them, are more causes in
//! the per-location books and in the event feed's (`stock.changed` with reason `adjust`).
//!
//! `STOCKGATE_HISTORY_SEED` replays a workload's choices (the interleavings still differ);
//! `STOCKGATE_HISTORY_SECS` sets how long the workload runs (default 30; `bench/history.sh`
//! soaks for 600). The full history is written as JSON lines under the target directory.

mod checker;
mod feed;
mod locations;
mod model;
mod nemesis;
mod own_data;
mod workload;

use crate::helpers::*;
use checker::{check, coverage, report, summary};
use chrono::{DateTime, Utc};
use devcluster::Redis;
use locations::Opening;
use model::{DEFAULT, fingerprint, open_transactions, place, snapshot};
use nemesis::{Nemesis, spawn_instance};
use serde_json::{Value, json};
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use workload::{
    Adjuster, DEVICES, Device, INITIAL_STOCK, LIMITS, LOCATIONS, Mover, PRODUCTS, RESTOCKERS,
    RYW_USERS, Restocker, SHOPPERS, SPREAD, Shopper, WINDOWED, World, importer, resolve,
};

// ---------------------------------------------------------------------------------------------
// The test.
// ---------------------------------------------------------------------------------------------

fn settings() -> (u64, u64) {
    let seed = std::env::var("STOCKGATE_HISTORY_SEED")
        .ok()
        .map(|s| s.parse().expect("STOCKGATE_HISTORY_SEED is a u64"))
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ u64::from(std::process::id())
        });
    let secs = std::env::var("STOCKGATE_HISTORY_SECS")
        .ok()
        .map(|s| s.parse().expect("STOCKGATE_HISTORY_SECS is whole seconds"))
        .unwrap_or(30);
    (seed, secs)
}

/// Polls until no request is still changing the primary: the digest holds for a second.
async fn settle(pool: &PgPool) {
    let start = Instant::now();
    let (mut last, mut since) = (fingerprint(pool).await, Instant::now());
    while since.elapsed() < Duration::from_secs(1) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the database never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = fingerprint(pool).await;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
}

/// Creates the run's locations besides `default`, each with its rank; an inactive one is made
/// inactive before any product is kept there, so its active flag never changes during the run.
async fn create_locations(app: &TestApp) {
    for (id, rank, active) in LOCATIONS {
        let body = json!({"location_id": id, "name": id, "rank": rank});
        let r = app
            .client
            .post(app.url("/v1/locations"))
            .bearer_auth(&app.admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "creating location {id}");
        if !active {
            let r = app
                .client
                .patch(app.url(&format!("/v1/locations/{id}")))
                .bearer_auth(&app.admin)
                .json(&json!({"active": false}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "deactivating location {id}");
        }
    }
}

/// Creates the workload's products, each with `INITIAL_STOCK` (at `default`, or spread over
/// several locations by `SPREAD`) and its limit; the windowed one's sale starts `lead` after
/// the primary's clock now. Returns the stock each (product, location) was created with.
async fn create_products(app: &TestApp, lead: Duration) -> Opening {
    let starts: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('milliseconds', now() + make_interval(secs => $1))")
            .bind(lead.as_secs_f64())
            .fetch_one(&app.primary)
            .await
            .unwrap();
    let mut initial = Opening::new();
    for p in PRODUCTS {
        let limit = LIMITS.iter().find(|(l, _)| *l == p).map(|(_, n)| *n);
        let mut body = json!({"product_id": p, "name": p, "price_cents": 500, "available_quantity": INITIAL_STOCK});
        let stock: &[(&str, i64)] = match SPREAD.iter().find(|(s, _)| *s == p) {
            Some((_, stock)) => stock,
            None => &[(DEFAULT, INITIAL_STOCK)],
        };
        if stock.len() > 1 {
            let total: i64 = stock.iter().map(|(_, n)| n).sum();
            assert_eq!(
                total, INITIAL_STOCK,
                "{p}: the importer re-states {INITIAL_STOCK}"
            );
            let entries: Vec<Value> = stock
                .iter()
                .map(|(l, n)| json!({"location_id": l, "quantity": n}))
                .collect();
            body.as_object_mut().unwrap().remove("available_quantity");
            body["stock"] = json!(entries);
        }
        if let Some(limit) = limit {
            body["max_per_customer"] = json!(limit);
        }
        if p == WINDOWED {
            body["sale_starts_at"] = json!(starts.to_rfc3339());
        }
        let r = app.post_product(&body).await;
        assert_eq!(r.status(), 201, "creating {p}");
        let made: Value = r.json().await.unwrap();
        assert_eq!(made["max_per_customer"], json!(limit), "{made}");
        for (l, n) in stock {
            initial.insert(place(p, l), *n);
        }
    }
    initial
}

/// Mutations of the service this fails on (issue 48): `RywStore::advance` returning at once (a
/// write pins nothing: stale reads during a replica pause); `RedisStore::positions` ignoring
/// `pin_all || locally_pinned` (stale reads after the Redis restart, through the instance that
/// never saw the write); `drop_verdict_v1` judging `p_already + p_qty > p_limit + 1` (users past a
/// limit, some only between a 201 and a later cancel, which the final state hides).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answer_under_paused_replicas_redis_restarts_primary_cuts_and_instance_restarts_is_the_truth()
 {
    let (seed, secs) = settings();
    eprintln!(
        "history: seed={seed} secs={secs} (STOCKGATE_HISTORY_SEED={seed} replays the choices)"
    );
    let cluster = private_cluster();
    let redis = Redis::temporary().expect("a private Redis");
    let database = fresh_database(&cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let a = spawn_instance(&cluster, &database, &redis, &proxy).await;
    let b = spawn_instance(&cluster, &database, &redis, &proxy).await;
    create_locations(&a).await;
    // The windowed product's sale starts a few seconds in: orders land on both sides of it.
    let initial = create_products(&a, Duration::from_secs((secs / 6).clamp(2, 5))).await;
    let checker_pool = a.primary.clone();
    let world = Arc::new(World::new([a.address.clone(), b.address.clone()]));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut master = fastrand::Rng::with_seed(seed);
    let mut clients = vec![];
    for c in 0..SHOPPERS {
        let shopper = Shopper::new(c, master.fork(), world.clone());
        clients.push(tokio::spawn(shopper.run(deadline)));
    }
    for c in 0..RESTOCKERS {
        let restocker = Restocker::new(c, master.fork(), world.clone());
        clients.push(tokio::spawn(restocker.run(deadline)));
    }
    clients.push(tokio::spawn(
        Mover::new(master.fork(), world.clone()).run(deadline),
    ));
    clients.push(tokio::spawn(
        Adjuster::new(master.fork(), world.clone()).run(deadline),
    ));
    for u in 0..RYW_USERS {
        for d in 0..DEVICES.len() {
            let device = Device::new(u, d, master.fork(), world.clone());
            clients.push(tokio::spawn(device.run(deadline)));
        }
    }
    let imports = tokio::spawn(importer(world.clone(), master.fork(), deadline));
    let mut nemesis = Nemesis {
        cluster: &cluster,
        database: database.clone(),
        redis,
        proxy,
        apps: [Some(a), Some(b)],
        world: world.clone(),
        rng: master.fork(),
        injected: BTreeMap::new(),
        windows: vec![],
    };
    nemesis.run(deadline).await;
    for c in clients {
        c.await.unwrap();
    }
    let imports = imports.await.unwrap();
    // Every fault has healed itself; now every open request gets a definite answer.
    resolve(&world, Duration::from_secs(60)).await;
    settle(&checker_pool).await;
    let db = snapshot(&checker_pool).await;
    let open = open_transactions(&checker_pool).await;
    let history = world.history();
    let anomalies = check(&initial, &history, &db);
    let feed = feed::feed_anomalies(&checker_pool).await;
    // The ledger's rule, checked by the operator's own tool: every (product, location) count
    // is its movements (creates, restocks, transfers, imports) less its confirmed orders' and
    // live holds' allocations, after everything the nemesis did.
    let (verified, verify_out) = blocking(|| crate::ledger::verify(&cluster, &database));
    // The checker judges by the rules the primary holds at the end; they are the ones every
    // request met only if nothing (an import, say) changed them during the run.
    let drifted: Vec<String> = PRODUCTS
        .iter()
        .filter_map(|p| {
            let want = LIMITS.iter().find(|(l, _)| l == p).map(|(_, n)| *n);
            let rules = db.rules.get(*p).cloned().unwrap_or_default();
            (rules.limit != want || rules.starts.is_some() != (*p == WINDOWED))
                .then(|| format!("{p}: {rules:?}"))
        })
        .collect();
    let file =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("history-{seed}.jsonl"));
    let lines: Vec<String> = history
        .iter()
        .map(|o| serde_json::to_string(o).unwrap())
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let line = summary(seed, secs, &history, &nemesis.injected, &anomalies);
    eprintln!(
        "{line}\nfaults: {:?}\nfull history: {}",
        nemesis.windows,
        file.display()
    );
    let mut missing = coverage(&history, &nemesis.injected, &nemesis.windows);
    if imports == 0 {
        missing.push("an import that re-stated the products".into());
    }
    // The importer's row locks, the buyers', the refusals' and the cancels' never wait in a
    // circle (a batch would rerun after a deadlock and hide it; the database counts it).
    let windows = nemesis.windows.clone();
    drop(nemesis);
    flush_other_backends(&checker_pool).await;
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&checker_pool)
    .await
    .unwrap();
    eprintln!("{imports} imports applied; {deadlocks} deadlocks");
    assert!(
        anomalies.is_empty()
            && missing.is_empty()
            && deadlocks == 0
            && drifted.is_empty()
            && feed.is_empty()
            && verified == Some(0),
        "{deadlocks} deadlocks\nstockgate verify exited {verified:?}: {verify_out}\ndrop rules changed during the run: {drifted:?}\nthe event feed against the tables: {feed:#?}\n{}\nnot exercised: {missing:?}\nfaults: {:?}\nprimary transactions still open: {open:#?}\n{line}\nseed {seed}; full history in {}",
        report(&anomalies, &history),
        windows,
        file.display()
    );
}
