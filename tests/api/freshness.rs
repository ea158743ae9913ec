//! Replica freshness that cannot lie, and a router that reads only from fresh enough
//! replicas. Every lag here is real: replay paused, apply delay, a stopped or frozen server.
//! Every answer's `as_of` and `stale_by_ms` are judged against acknowledged commits; slow
//! reports, a full local pool and cancelled reads must not skew where reads go.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stockgate::routing::policy::QueryClass;
use stockgate::routing::{ReadCtx, Reason};

async fn gate(app: &TestApp, product: &str) -> Value {
    let resp = app.availability(product, 1).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

/// The test's own map between instants and UTC, taken once: the service's claims are judged
/// on it, never on the service's own conversion.
#[derive(Clone, Copy)]
struct TestClock {
    instant: Instant,
    wall: chrono::DateTime<chrono::Utc>,
}

impl TestClock {
    fn now() -> Self {
        TestClock {
            instant: Instant::now(),
            wall: chrono::Utc::now(),
        }
    }

    fn wall(&self, at: Instant) -> chrono::DateTime<chrono::Utc> {
        let since = chrono::Duration::from_std(at.saturating_duration_since(self.instant));
        let before = chrono::Duration::from_std(self.instant.saturating_duration_since(at));
        self.wall + since.unwrap() - before.unwrap()
    }

    /// The instant of an answer's `as_of`.
    fn instant_of(&self, answer: &Value) -> Instant {
        let as_of = chrono::DateTime::parse_from_rfc3339(answer["as_of"].as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc);
        let d = (as_of - self.wall).to_std();
        match d {
            Ok(after) => self.instant + after,
            Err(_) => self.instant - (self.wall - as_of).to_std().unwrap(),
        }
    }
}

/// A gate answer with the moment its request was sent.
async fn timed_gate(app: &TestApp, product: &str) -> (Instant, Value) {
    let sent = Instant::now();
    (sent, gate(app, product).await)
}

/// Judges every gate answer that replica `i` gave: within the 250 ms budget by its own
/// statement and by the test's clock (the request was sent before the answer was made, so
/// `sent − as_of` is a lower bound of its age), and holding every commit acknowledged before
/// its `as_of`. Replica `i` must be paused, so what it holds now is what it held then.
/// Returns how many answers it gave.
async fn assert_paused_replicas_gate_answers_are_honest(
    app: &TestApp,
    cluster: &devcluster::Cluster,
    i: usize,
    log: &AckLog,
    clock: &TestClock,
    answers: &[(Instant, Value)],
) -> usize {
    let name = format!("replica-{i}");
    let held = held_by_replica(cluster, i, &app.database).await;
    let mine: Vec<_> = answers
        .iter()
        .filter(|(_, a)| a["served_by"] == name.as_str())
        .collect();
    for (sent, answer) in &mine {
        let as_of = clock.instant_of(answer);
        let age = sent.saturating_duration_since(as_of);
        let stated = answer["stale_by_ms"].as_u64().unwrap();
        // (as_of is printed to the millisecond: 2 ms of rounding.)
        assert!(
            stated <= 250 && age <= Duration::from_millis(252),
            "{name} served the gate {age:?} after its as_of (stated {stated} ms): {answer}"
        );
        let required = log.acked_before(as_of);
        assert!(
            required <= held,
            "{name}'s gate answer needs row {required}, but it holds only {held}: {answer}"
        );
    }
    mine.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_primary_keeps_replicas_fresh_and_serving_the_stock_gate() {
    // A private cluster: the shared one's WAL moves with every other test's writes.
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("idle", 5, 100).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    // Nothing is written for 10 s. A `now() - pg_last_xact_replay_timestamp()` lag would
    // climb to 10 s here; ours must stay near zero.
    let start = Instant::now();
    let (mut served_by_replica, mut reads) = (0, 0);
    let mut seen = vec![];
    while start.elapsed() < Duration::from_secs(10) {
        for (name, state, staleness) in app.replica_states().await {
            assert_eq!(state, "healthy", "{name} while idle");
            seen.push(staleness.unwrap_or(u64::MAX));
        }
        let answer = gate(&app, "idle").await;
        reads += 1;
        if answer["served_by"] != "primary" {
            served_by_replica += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The bound is the sample period plus scheduling delay; other tests load these two
    // cores, so judge the 95th percentile rather than one unlucky sample.
    seen.sort_unstable();
    let p95 = seen[seen.len() * 95 / 100];
    assert!(p95 < 250, "idle staleness p95 {p95} ms (all: {seen:?})");
    // A share, not a count: how many reads fit in 10 s depends on the machine's load.
    assert!(reads >= 10, "only {reads} gate reads in 10 s");
    assert!(
        served_by_replica * 10 >= reads * 8,
        "only {served_by_replica} of {reads} gate reads used a replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_replica_leaves_the_stock_gate_within_its_budget_but_serves_the_dashboard_until_its_own()
 {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 5, 100).await;
    let log = AckLog::start(app.primary.clone()).await;
    // Precondition: replica-1 serves the gate before the pause.
    app.wait_for(
        "replica-1 serving the gate",
        Duration::from_secs(10),
        || async { gate(&app, "p").await["served_by"] == "replica-1" },
    )
    .await;
    let clock = TestClock::now();
    blocking(|| cluster.pause_replay(1)).unwrap();
    // Gate answers until replica-1 says it is 1.5 s behind: any from replica-1 must be
    // within the gate's budget of its as_of, and hold what that as_of promises.
    let mut answers = vec![];
    loop {
        answers.push(timed_gate(&app, "p").await);
        let states = app.replica_states().await;
        if states
            .iter()
            .any(|(n, _, st)| n == "replica-1" && st.unwrap_or(0) >= 1_500)
        {
            break;
        }
    }
    let from_r1 =
        assert_paused_replicas_gate_answers_are_honest(&app, &cluster, 1, &log, &clock, &answers)
            .await;
    eprintln!(
        "gate answers from the paused replica: {from_r1} of {}",
        answers.len()
    );
    // Its reported staleness is honest: it holds every commit acknowledged before its as_of.
    assert_claim_is_honest(&app, &cluster, 1, &log).await;
    // The dashboard (30 s) still reads from replicas, including replica-1 while it is under 30 s.
    let mut dashboard_from_r1 = false;
    for _ in 0..40 {
        let (s, body) = app
            .get_json("/v1/dashboard/revenue", Some(&app.admin))
            .await;
        assert_eq!(s, StatusCode::OK);
        dashboard_from_r1 |= body["served_by"] == "replica-1";
    }
    assert!(
        dashboard_from_r1,
        "the dashboard's 30 s budget still admits a replica 2 s behind"
    );
    // After 5 s it is `lagging`; after resume it is readmitted only after a calm period.
    app.wait_for("replica-1 lagging", Duration::from_secs(10), || async {
        app.replica_state("replica-1").await == "lagging"
    })
    .await;
    blocking(|| cluster.resume_replay(1)).unwrap();
    let resumed = Instant::now();
    app.wait_for(
        "replica-1 healthy again",
        Duration::from_secs(10),
        || async { app.replica_state("replica-1").await == "healthy" },
    )
    .await;
    assert!(
        resumed.elapsed() >= Duration::from_millis(900),
        "readmitted after {:?}: no hysteresis",
        resumed.elapsed()
    );
    app.wait_for(
        "gate served by replica-1 again",
        Duration::from_secs(10),
        || async { gate(&app, "p").await["served_by"] == "replica-1" },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_both_replicas_paused_the_gate_reads_the_primary_and_stale_by_is_honest() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 5, 100).await;
    let log = AckLog::start(app.primary.clone()).await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.pause_replay(1).unwrap();
        cluster.pause_replay(2).unwrap();
    });
    let clock = TestClock::now();
    let answers = Mutex::new(vec![]);
    app.wait_for(
        "the gate leaves the paused replicas",
        Duration::from_secs(10),
        || async {
            let answer = timed_gate(&app, "p").await;
            let left = answer.1["served_by"] == "primary";
            answers.lock().unwrap().push(answer);
            left
        },
    )
    .await;
    // Until it left them, each replica answer was within budget of an honest as_of.
    let answers = answers.into_inner().unwrap();
    for i in 1..=2 {
        assert_paused_replicas_gate_answers_are_honest(&app, &cluster, i, &log, &clock, &answers)
            .await;
    }
    for _ in 0..20 {
        let a = gate(&app, "p").await;
        assert_eq!(a["served_by"], "primary", "{a}");
        // A primary answer, possibly reused from the gate's cache: never over the budget.
        assert!(a["stale_by_ms"].as_u64().unwrap() <= 250, "{a}");
    }
    // Two seconds behind: the dashboard (30 s) still reads a replica, and says how stale.
    app.wait_for("replicas 2 s behind", Duration::from_secs(10), || async {
        app.replica_states()
            .await
            .iter()
            .all(|(_, _, st)| st.unwrap_or(0) >= 2_000)
    })
    .await;
    let sent = Instant::now();
    let (_, dash) = app
        .get_json("/v1/dashboard/revenue", Some(&app.admin))
        .await;
    let Stated {
        served_by,
        stale_by_ms: reported,
        ..
    } = parse(&dash);
    assert!(
        served_by.starts_with("replica-"),
        "the dashboard may use a replica 2 s behind: {dash}"
    );
    let i: usize = served_by.trim_start_matches("replica-").parse().unwrap();
    let truth = log.true_staleness(held_by_replica(&cluster, i, &app.database).await, sent);
    // Never less stale than the truth: the time since the first acknowledged commit the
    // replica lacks, up to when the request was sent (the answer was produced after).
    assert!(
        reported + 1 >= truth.as_millis() as u64,
        "stale_by_ms {reported} < true staleness {truth:?}"
    );
    for i in 1..=2 {
        assert_claim_is_honest(&app, &cluster, i, &log).await;
    }
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_second_apply_delay_reads_as_at_least_the_true_staleness() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    let log = AckLog::start(app.primary.clone()).await;
    blocking(|| cluster.set_apply_delay(1, 2000)).unwrap();
    app.wait_for("the delay to show", Duration::from_secs(10), || async {
        app.replica_states()
            .await
            .iter()
            .any(|(n, _, st)| n == "replica-1" && st.unwrap_or(0) >= 1_500)
    })
    .await;
    // Sample the claim for two seconds; each claim must hold against the acknowledged commits.
    let mut samples = vec![];
    for _ in 0..20 {
        samples.push(
            assert_claim_is_honest(&app, &cluster, 1, &log)
                .await
                .as_millis() as u64,
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let avg = samples.iter().sum::<u64>() / samples.len() as u64;
    eprintln!("reported staleness under a 2 s apply delay: average {avg} ms ({samples:?})");
    // Each claim above was at least the truth; no claim fell below the delay's effect
    // (load only adds to it, so this bound cannot be missed by a slow machine).
    assert!(
        samples.iter().all(|ms| *ms >= 1_500),
        "a claim under a 2 s delay: {samples:?}"
    );
    // The undelayed replica is judged by the same truth, and is fresher than the delayed one.
    let other = assert_claim_is_honest(&app, &cluster, 2, &log).await;
    let delayed = assert_claim_is_honest(&app, &cluster, 1, &log).await;
    assert!(
        other < delayed,
        "replica-2 is not delayed: {other:?}, replica-1 {delayed:?}"
    );
    blocking(|| cluster.set_apply_delay(1, 0)).unwrap();
}

/// Product reads for `seconds`, each answered 200 (a read stuck on a dead replica would
/// meet the client's 30 s timeout instead: the service's own 500 ms replica timeout is what
/// keeps them answering, not a stopwatch here).
async fn keeps_answering_through(app: &TestApp, product: &str, seconds: u64) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(seconds) {
        let resp = app
            .client
            .get(app.url(&format!("/v1/products/{product}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_is_down_requests_keep_succeeding_and_it_comes_back() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 5, 100).await;
    blocking(|| cluster.stop_replica(1)).unwrap();
    app.wait_for("replica-1 down", Duration::from_secs(5), || async {
        app.replica_state("replica-1").await == "down"
    })
    .await;
    keeps_answering_through(&app, "p", 2).await;
    blocking(|| cluster.start_replica(1)).unwrap();
    app.wait_for(
        "replica-1 healthy after restart",
        Duration::from_secs(15),
        || async { app.replica_state("replica-1").await == "healthy" },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_replica_is_down_requests_keep_succeeding_and_it_comes_back_after_thaw() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    app.create_product("p", 5, 100).await;
    blocking(|| cluster.freeze(1)).unwrap();
    // Reads keep coming within a second each, from replica-2 or the primary, while the
    // frozen server accepts connections and never answers.
    keeps_answering_through(&app, "p", 3).await;
    app.wait_for(
        "replica-1 down while frozen",
        Duration::from_secs(5),
        || async { app.replica_state("replica-1").await == "down" },
    )
    .await;
    blocking(|| cluster.thaw(1)).unwrap();
    app.wait_for(
        "replica-1 healthy after thaw",
        Duration::from_secs(15),
        || async { app.replica_state("replica-1").await == "healthy" },
    )
    .await;
}

/// The gate's 250 ms promise checked from outside against its own words. Replicas apply
/// WAL 120 ms late, orders flow through instance B, availability is polled through A. Every
/// answer is judged against the orders acknowledged to the test: it must include every
/// order acknowledged before its `as_of`, state a `stale_by_ms` no smaller than
/// `now − as_of` when it was asked, and (from a replica) be no older than 250 ms by its
/// own `as_of`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_gate_answer_holds_what_its_as_of_promises_and_states_its_age_honestly() {
    const STOCK: i64 = 1_000_000;
    const BUDGET_MS: i64 = 250;
    let cluster = private_cluster();
    let a = spawn_app(&cluster).await;
    let b = spawn_beside(&a, &cluster).await;
    assert_eq!(
        a.create_product("flow", STOCK, 100).await.status(),
        StatusCode::CREATED
    );
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    blocking(|| {
        cluster.set_apply_delay(1, 120).unwrap();
        cluster.set_apply_delay(2, 120).unwrap();
    });
    let stop = Arc::new(AtomicBool::new(false));
    // Receipt instants of confirmed orders: each was acknowledged no later than that.
    let acks: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let b = Arc::new(b);
    let buyers: Vec<_> = (0..2)
        .map(|w| {
            let (b, acks, stop) = (b.clone(), acks.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let key = uuid::Uuid::new_v4().to_string();
                    let resp = b.order(&format!("buyer{w}"), &key, "flow", 1).await;
                    assert_eq!(resp.status(), StatusCode::CREATED);
                    acks.lock().unwrap().push(Instant::now());
                }
            })
        })
        .collect();
    // Precondition: the delay shows as staleness (WAL is moving and replicas are behind).
    a.wait_for(
        "replicas ~120 ms behind",
        Duration::from_secs(10),
        || async {
            a.replica_states()
                .await
                .iter()
                .any(|(_, _, st)| st.unwrap_or(0) >= 100)
        },
    )
    .await;
    let clock = TestClock::now();
    let a = Arc::new(a);
    let replica_answers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let pollers: Vec<_> = (0..3)
        .map(|_| {
            let (a, stop, replica_answers) = (a.clone(), stop.clone(), replica_answers.clone());
            tokio::spawn(async move {
                let mut seen = vec![];
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let resp = a.availability("flow", 1).await;
                    assert_eq!(resp.status(), StatusCode::OK);
                    let body = resp.json::<Value>().await.unwrap();
                    if body["served_by"] != "primary" {
                        replica_answers.fetch_add(1, Ordering::Relaxed);
                    }
                    seen.push((sent, body));
                }
                seen
            })
        })
        .collect();
    // Enough traffic to judge: 300 replica answers and 300 acknowledged orders.
    a.wait_for("traffic to judge", Duration::from_secs(60), || async {
        replica_answers.load(Ordering::Relaxed) >= 300 && acks.lock().unwrap().len() >= 300
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = vec![];
    for p in pollers {
        answers.extend(p.await.unwrap());
    }
    for w in buyers {
        w.await.unwrap();
    }
    let acks: Vec<_> = acks
        .lock()
        .unwrap()
        .iter()
        .map(|t| clock.wall(*t))
        .collect();
    let (mut from_replica, mut over_budget, mut overstated_stock) = (0, 0, 0);
    let mut largest_understatement = 0i64;
    let mut oldest_replica_ms = 0i64;
    for (sent, body) in &answers {
        let as_of = chrono::DateTime::parse_from_rfc3339(body["as_of"].as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc);
        // On the test's clock: the moment the request was sent, before the answer was
        // produced, so `age` is a lower bound of `now − as_of` when it was.
        let age = (clock.wall(*sent) - as_of).num_milliseconds();
        let stated = body["stale_by_ms"].as_i64().unwrap();
        largest_understatement = largest_understatement.max(age - stated);
        if body["served_by"] != "primary" {
            from_replica += 1;
            oldest_replica_ms = oldest_replica_ms.max(age.max(stated));
            if age > BUDGET_MS || stated > BUDGET_MS {
                over_budget += 1;
            }
        }
        let acked_before = acks.iter().filter(|t| **t < as_of).count() as i64;
        if body["available_quantity"].as_i64().unwrap() > STOCK - acked_before {
            overstated_stock += 1;
        }
    }
    eprintln!(
        "gate answers checked: {} ({from_replica} from replicas) against {} acknowledged orders; \
         over budget: {over_budget}; largest stale_by_ms understatement: {largest_understatement} ms; \
         oldest replica answer: {oldest_replica_ms} ms; stock overstated: {overstated_stock}",
        answers.len(),
        acks.len()
    );
    blocking(|| {
        cluster.set_apply_delay(1, 0).unwrap();
        cluster.set_apply_delay(2, 0).unwrap();
    });
    // Preconditions: replicas answered a real share while behind, and orders kept flowing.
    assert!(
        from_replica >= 100 && acks.len() >= 100,
        "too little traffic to judge"
    );
    assert_eq!(over_budget, 0, "replica answers older than 250 ms");
    assert_eq!(largest_understatement, 0, "stale_by_ms below now − as_of");
    assert_eq!(
        overstated_stock, 0,
        "answers missing orders acknowledged before their as_of"
    );
}

async fn sleep_on_replica(
    app: &TestApp,
    class: QueryClass,
    seconds: f64,
) -> Result<stockgate::routing::Route, stockgate::routing::DbError> {
    app.state
        .db
        .read(class, &ReadCtx::none(), |pool| async move {
            sqlx::query_scalar::<_, i32>("SELECT 1 FROM pg_sleep($1)")
                .bind(seconds)
                .fetch_one(pool.exec())
                .await
        })
        .await
        .map(|r| r.route)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_report_neither_evicts_its_replica_nor_falls_back_to_the_primary() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_REPLICA_TIMEOUT_MS", "300".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    // A big day: the report takes a second, far over a point read's 300 ms.
    let route = sleep_on_replica(&app, QueryClass::RevenueReport, 1.0)
        .await
        .unwrap();
    assert!(route.served_by().starts_with("replica-"), "{route}");
    assert_eq!(route.reason(), Reason::FreshReplica, "{route}");
    for (name, state, _) in app.replica_states().await {
        assert_eq!(state, "healthy", "{name} after a slow report");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_pool_is_congestion_not_a_replica_failure() {
    let app = spawn_app_with(AppOptions {
        env: vec![
            ("STOCKGATE_REPLICA_POOL_SIZE", "1".into()),
            ("STOCKGATE_REPLICA_TIMEOUT_MS", "300".into()),
        ],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    let app = Arc::new(app);
    let busy = |n: usize| {
        let app = app.clone();
        async move {
            app.state
                .db
                .replica_status()
                .iter()
                .filter(|r| r.in_flight == 1)
                .count()
                == n
        }
    };
    // Each replica's one connection held by a two-second report (the second report goes
    // to the less busy replica).
    let mut holders = vec![];
    for n in 1..=2 {
        let held = app.clone();
        holders.push(tokio::spawn(async move {
            sleep_on_replica(&held, QueryClass::RevenueReport, 2.0).await
        }));
        wait_for("report running", Duration::from_secs(5), || busy(n)).await;
    }
    // A point read finds no free connection to either replica here.
    let route = sleep_on_replica(&app, QueryClass::StockGate, 0.0)
        .await
        .unwrap();
    assert_eq!(
        (route.served_by(), route.reason()),
        ("primary", Reason::ReplicaBusy),
        "{route}"
    );
    for (name, state, _) in app.replica_states().await {
        assert_eq!(state, "healthy", "{name} with its local pool full");
    }
    for h in holders {
        let route = h.await.unwrap().unwrap();
        assert!(route.served_by().starts_with("replica-"), "{route}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_cancelled_mid_flight_give_their_in_flight_counts_back() {
    let app = Arc::new(spawn_app(shared_cluster()).await);
    let in_flight = |app: Arc<TestApp>| async move {
        let (_, body) = app.get_json("/v1/admin/replicas", Some(&app.admin)).await;
        body["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["in_flight"].as_u64().unwrap())
            .sum::<u64>()
    };
    let reads: Vec<_> = (0..6)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(
                async move { sleep_on_replica(&app, QueryClass::RevenueReport, 5.0).await },
            )
        })
        .collect();
    wait_for("six reads in flight", Duration::from_secs(5), || async {
        in_flight(app.clone()).await == 6
    })
    .await;
    // The clients give up mid-read (a hang-up, a request timeout): the futures are dropped.
    for r in &reads {
        r.abort();
    }
    wait_for(
        "in-flight counts back to 0",
        Duration::from_secs(2),
        || async { in_flight(app.clone()).await == 0 },
    )
    .await;
}

/// A replica that is up but refuses the monitor (here: the database it names does not exist
/// yet) is tried again after a pause that doubles up to a second, not every 25 ms period: each
/// try costs it a backend and a FATAL line in its log. Once the database exists (created on
/// the primary, replicated), the replicas are judged healthy again. The primary's own
/// samples, one a period, are the test's clock. Mutation seen failing: `pause_after`
/// returning zero (each replica's tries kept pace with the primary's samples: 80 against 80).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_refuses_the_monitor_is_tried_less_and_less_often_until_it_answers() {
    let cluster = shared_cluster();
    let late = format!("t_late_{}", uuid::Uuid::new_v4().simple());
    let mut opts = AppOptions::new(cluster);
    opts.replicas = false;
    opts.env
        .push(("STOCKGATE_REPLICA_URLS", cluster.replica_urls(&late)));
    let app = spawn_app_with(opts).await;
    let samples = |page: &str, node: &str| {
        metric_sample(page, "stockgate_monitor_samples_total", &[("node", node)])
    };
    app.wait_for(
        "80 samples of the primary",
        Duration::from_secs(60),
        || async { samples(&app.metrics_text().await, "primary").unwrap_or(0.0) >= 80.0 },
    )
    .await;
    let page = app.metrics_text().await;
    let periods = samples(&page, "primary").unwrap();
    for node in ["replica-1", "replica-2"] {
        let tries = samples(&page, node).unwrap_or_else(|| panic!("{node}'s samples: {page}"));
        assert!(
            (3.0..=periods / 4.0).contains(&tries),
            "{node}: {tries} tries over the primary's {periods} periods"
        );
    }
    // The precondition: each replica is down because the server refused the database.
    let (_, replicas) = app.get_json("/v1/admin/replicas", Some(&app.admin)).await;
    let listed = replicas["replicas"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{replicas}");
    for r in listed {
        assert_eq!(r["state"], "down", "{replicas}");
        assert!(
            r["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("does not exist")),
            "refused for its database: {replicas}"
        );
    }
    // The database arrives: the pause is at most a second, so the replicas answer soon.
    blocking(|| cluster.create_database(&late)).expect("create the late database");
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
    app.wait_for("replicas healthy", Duration::from_secs(20), || async {
        let states = app.replica_states().await;
        states.len() == 2 && states.iter().all(|(_, s, _)| s == "healthy")
    })
    .await;
}

/// A node that answers the monitor keeps its connection even when the answer rules it out:
/// pointed at the primary as if it were a replica ("not in recovery"), the monitor samples it
/// on one backend throughout instead of opening a new one every 25 ms. Mutation seen failing:
/// dropping the connection on every failed sample, as before (a new backend each period).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_answers_keeps_its_monitor_connection_whatever_it_says() {
    let cluster = shared_cluster();
    let database = fresh_database(cluster).await;
    let mut opts = AppOptions::new(cluster);
    opts.database = Some(database.clone());
    opts.replicas = false;
    opts.env
        .push(("STOCKGATE_REPLICA_URLS", cluster.primary_url(&database)));
    let app = spawn_app_with(opts).await;
    let samples = || async { app.metric("stockgate_monitor_samples_total").await };
    // The backends running the monitor's replica sample, on the primary.
    let backends = || async {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 \
             AND query LIKE '%pg_last_wal_replay_lsn%' AND pid <> pg_backend_pid() ORDER BY pid",
        )
        .bind(&database)
        .fetch_all(&app.primary)
        .await
        .unwrap();
        pids
    };
    app.wait_for("the node ruled out", Duration::from_secs(20), || async {
        app.metric("stockgate_monitor_sample_errors_total").await >= 5.0
    })
    .await;
    let before = backends().await;
    let at = samples().await;
    app.wait_for("40 more samples", Duration::from_secs(60), || async {
        samples().await >= at + 40.0
    })
    .await;
    let after = backends().await;
    assert_eq!(before.len(), 1, "one monitor backend: {before:?}");
    assert_eq!(before, after, "the same backend 40 samples later");
    let states = app.replica_states().await;
    assert!(
        states.iter().all(|(_, s, _)| s != "healthy"),
        "a node that is not in recovery is never a healthy replica: {states:?}"
    );
}
