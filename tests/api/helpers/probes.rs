//! What the database, the replicas, `/metrics` and the event feed say now, and polling until
//! they say something else: the state a test reads to check the service, never through it.

use super::TestApp;
use devcluster::Cluster;
use reqwest::StatusCode;
use serde_json::Value;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl TestApp {
    /// (name, state, staleness_ms) per replica, from the admin endpoint.
    pub async fn replica_states(&self) -> Vec<(String, String, Option<u64>)> {
        let (_, body) = self.get_json("/v1/admin/replicas", Some(&self.admin)).await;
        body["replicas"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .map(|r| {
                        (
                            r["name"].as_str().unwrap_or("").to_string(),
                            r["state"].as_str().unwrap_or("").to_string(),
                            r["staleness_ms"].as_u64(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    pub async fn replica_state(&self, name: &str) -> String {
        self.replica_states()
            .await
            .into_iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, s, _)| s)
            .unwrap_or_default()
    }

    /// Polls `cond` every 10 ms until it holds; panics with `what` after `timeout`.
    pub async fn wait_for<F, Fut>(&self, what: &str, timeout: Duration, cond: F)
    where
        F: Fn() -> Fut,
        Fut: Future<Output = bool>,
    {
        wait_for(what, timeout, cond).await
    }

    /// The `/metrics` page as text.
    pub async fn metrics_text(&self) -> String {
        let page = self.client.get(self.url("/metrics")).send().await.unwrap();
        page.text().await.unwrap()
    }

    /// The sum of a Prometheus metric's samples (all label sets) from `/metrics`.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub async fn stock_on_primary(&self, product: &str) -> i64 {
        stock_on(&self.primary, product).await
    }

    pub async fn confirmed_orders(&self, product: &str) -> (i64, i64) {
        sqlx::query_as::<_, (i64, i64)>("SELECT COUNT(*), COALESCE(SUM(quantity), 0)::int8 FROM orders WHERE product_id = $1 AND status = 'confirmed'")
            .bind(product)
            .fetch_one(&self.primary)
            .await
            .unwrap()
    }
}

/// A product's stock as `pool`'s database holds it.
pub async fn stock_on(pool: &sqlx::PgPool, product: &str) -> i64 {
    sqlx::query_scalar::<_, i32>("SELECT available_quantity FROM products WHERE product_id = $1")
        .bind(product)
        .fetch_one(pool)
        .await
        .unwrap()
        .into()
}

/// How many sessions of `pool`'s database (other than this query's) running a statement
/// like `query` (`ILIKE`: `%` for any) are waiting on `wait`: a wait event type (`Lock`) or a
/// wait event (`PgSleep`).
pub async fn sessions_waiting(pool: &sqlx::PgPool, wait: &str, query: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND query ILIKE $2 AND $1 IN (wait_event_type, wait_event)",
    )
    .bind(wait)
    .bind(query)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// How many order batches (calls of any `take_order_batch…` function) are waiting on `wait`
/// ([`sessions_waiting`]).
pub async fn batches_waiting_on(pool: &sqlx::PgPool, wait: &str) -> i64 {
    sessions_waiting(pool, wait, "%take_order_batch%").await
}

/// Polls `cond` every 10 ms until it holds; panics with `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, cond: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Keeps WAL moving on the primary until dropped (so lag is measurable while a replica is
/// paused).
pub struct WalTicker(tokio::task::JoinHandle<()>);

impl WalTicker {
    pub fn start(pool: sqlx::PgPool) -> Self {
        WalTicker(tokio::spawn(async move {
            loop {
                let _ = sqlx::query("SELECT txid_current()").execute(&pool).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }))
    }
}

impl Drop for WalTicker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Writes a row every few milliseconds and remembers when each commit was acknowledged, so a
/// test can check a staleness claim against the truth: a replica claimed fresh as of `t` must
/// hold every commit acknowledged before `t`.
pub struct AckLog {
    acks: Arc<std::sync::Mutex<Vec<(i64, Instant)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AckLog {
    pub async fn start(primary: sqlx::PgPool) -> AckLog {
        sqlx::query("CREATE TABLE IF NOT EXISTS acks (id bigserial PRIMARY KEY)")
            .execute(&primary)
            .await
            .unwrap();
        let acks: Arc<std::sync::Mutex<Vec<(i64, Instant)>>> = Arc::default();
        let log = acks.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Ok(id) =
                    sqlx::query_scalar::<_, i64>("INSERT INTO acks DEFAULT VALUES RETURNING id")
                        .fetch_one(&primary)
                        .await
                {
                    log.lock().unwrap().push((id, Instant::now()));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        AckLog { acks, task }
    }

    /// How stale a replica that holds rows up to `held` really was at `at`: the time since
    /// the first acknowledged commit it lacks (zero if it lacks none).
    pub fn true_staleness(&self, held: i64, at: Instant) -> Duration {
        let acks = self.acks.lock().unwrap();
        acks.iter()
            .find(|(id, _)| *id > held)
            .map(|(_, acked)| at.saturating_duration_since(*acked))
            .unwrap_or_default()
    }

    /// The largest id acknowledged before `t`.
    pub fn acked_before(&self, t: Instant) -> i64 {
        let acks = self.acks.lock().unwrap();
        acks.iter()
            .take_while(|(_, at)| *at < t)
            .map(|(id, _)| *id)
            .last()
            .unwrap_or(0)
    }
}

impl Drop for AckLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The newest `acks` row replica `i` holds.
pub async fn held_by_replica(cluster: &Cluster, i: usize, database: &str) -> i64 {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.replica_url(i, database))
        .await
        .unwrap();
    let held: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM acks")
        .fetch_one(&pool)
        .await
        .unwrap_or(None);
    pool.close().await;
    held.unwrap_or(0)
}

/// Checks the service's claim about replica `i` against the truth: every commit
/// acknowledged before the replica's `as_of` must be on it. Takes the claim first and reads
/// the replica after (it only gains rows), so a failure is always a real lie. Returns the
/// claimed staleness.
///
/// The claim is a staleness measured at the moment the service read its clock, somewhere
/// inside `replica_status()`; its `as_of` is that moment minus the staleness. The moment is
/// not visible here, so the one taken just before the call stands in: no later than the
/// service's, it gives an `as_of` no later than the claimed one, and asks of the replica only
/// what the claim promised. (Taken after the call, as this once did, it asked for more than
/// was claimed by however long the call took: a test thread descheduled for a few
/// milliseconds on a loaded machine read a commit acknowledged in that time as a lie.)
pub async fn assert_claim_is_honest(
    app: &TestApp,
    cluster: &Cluster,
    i: usize,
    log: &AckLog,
) -> Duration {
    let name = format!("replica-{i}");
    let before = Instant::now();
    let status = app
        .state
        .db
        .replica_status()
        .into_iter()
        .find(|r| r.name == name)
        .unwrap();
    let staleness = status.staleness.expect("a staleness bound");
    let as_of = before - staleness;
    let required = log.acked_before(as_of);
    let held = held_by_replica(cluster, i, &app.database).await;
    assert!(
        required <= held,
        "{name} claimed fresh as of {staleness:?} ago, which needs row {required}, but it holds only {held}"
    );
    staleness
}

/// Ends every other backend of `pool`'s database and waits until they are gone: a backend
/// keeps its counts (`pg_stat_*`: scans, deadlocks) pending and flushes them at the latest
/// when it exits, so after this the statistics views hold everything done so far. Clients
/// that reconnect afterwards are not waited for.
pub async fn flush_other_backends(pool: &sqlx::PgPool) {
    let ended: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM (SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() OFFSET 0) others WHERE pg_terminate_backend(pid)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    wait_for(
        "the database's other backends gone",
        Duration::from_secs(20),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
            )
            .bind(&ended)
            .fetch_one(pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
}

/// Deadlocks the primary detected in `database`, complete up to now (every other session of
/// it ended first: [`flush_other_backends`]).
pub async fn deadlocks(cluster: &Cluster, database: &str) -> i64 {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.primary_url(database))
        .await
        .unwrap();
    flush_other_backends(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// From a `/metrics` page, the value of the sample `name` whose labels include every one of `labels`.
pub fn metric_sample(page: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    page.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// `stockgate_routing_decisions_total` for one class, by (target, reason), read over HTTP.
pub async fn decisions(
    app: &TestApp,
    class: stockgate::routing::policy::QueryClass,
) -> std::collections::BTreeMap<(String, String), f64> {
    let text = app.metrics_text().await;
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("stockgate_routing_decisions_total{") else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").unwrap();
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        if label("class") == class.name() {
            out.insert((label("target"), label("reason")), value.parse().unwrap());
        }
    }
    out
}

/// Every event of `app`'s feed from the start (read as the admin, page by page), once one of
/// them satisfies `done`. The feed's horizon is the cluster's (another test's long
/// transaction delays it), so this waits for the change the caller made last, long-polling
/// behind what it has read, for up to 60 s.
pub async fn feed_until(app: &TestApp, what: &str, done: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut all: Vec<Value> = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let query = match &next {
                Some(after) => format!("/v1/events?limit=1000&after={after}"),
                None => "/v1/events?limit=1000".to_owned(),
            };
            let (status, body) = app.get_json(&query, Some(&app.admin)).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let events = body["events"].as_array().expect("events").clone();
            next = Some(body["next"].as_str().expect("next").to_owned());
            if events.is_empty() {
                break;
            }
            all.extend(events);
        }
        if all.iter().any(&done) {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "the feed never showed {what}: {all:?}"
        );
        let after = next.expect("a page was read");
        app.get_json(
            &format!("/v1/events?after={after}&wait_ms=1000"),
            Some(&app.admin),
        )
        .await;
    }
}
