//! The test harness: real PostgreSQL clusters (primary + 2 streaming replicas) started by
//! the project's own tooling, a real Redis, and the service on port 0.
//!
//! Tests that need replicas fresh share one cluster per test binary (each test gets its own
//! database); tests that inject lag get a private cluster, so a paused replica never leaks
//! into another test. Set `TEST_LOG=1` to see the service's logs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use chrono::{DateTime, Utc};
use devcluster::Cluster;
use reqwest::{Client, Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use stockgate::auth::{Caller, Tokens};
use stockgate::clock::{Clock, SystemClock};
use stockgate::config::Config;
use stockgate::domain::UserId;
use stockgate::startup::{self, Application};
use tokio::sync::oneshot;
use uuid::Uuid;

pub const SECRET: &str = "test-secret-0123456789";

/// The cluster shared by tests that never inject lag.
pub fn shared_cluster() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(|| Cluster::temporary(2).expect("start the shared test cluster"))
}

/// A private cluster for a test that pauses, delays, stops or freezes replicas.
pub fn private_cluster() -> Cluster {
    Cluster::temporary(2).expect("start a private test cluster")
}

fn init_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if std::env::var("TEST_LOG").is_ok() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter("info,sqlx=warn")
                .with_test_writer()
                .try_init();
        }
    });
}

/// How to start an app.
pub struct AppOptions<'a> {
    pub cluster: &'a Cluster,
    /// An existing database (a second instance of the same deployment); else a new one.
    pub database: Option<String>,
    pub replicas: bool,
    pub redis_url: Option<String>,
    pub clock: Arc<dyn Clock>,
    pub env: Vec<(&'static str, String)>,
}

impl<'a> AppOptions<'a> {
    pub fn new(cluster: &'a Cluster) -> Self {
        AppOptions {
            cluster,
            database: None,
            replicas: true,
            redis_url: None,
            clock: Arc::new(SystemClock),
            env: vec![],
        }
    }
}

/// A service host whose wall clock runs `self.0` ahead of the primary's (the monotonic
/// clock as it is): a rule judged on the primary's clock must not see it.
#[derive(Debug)]
pub struct WallAhead(pub chrono::Duration);

impl Clock for WallAhead {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn wall(&self) -> DateTime<Utc> {
        Utc::now() + self.0
    }
}

pub struct TestApp {
    pub address: String,
    pub database: String,
    pub client: Client,
    pub tokens: Tokens,
    pub admin: String,
    pub primary: sqlx::PgPool,
    pub state: stockgate::http::AppState,
    pub shutdown: Option<oneshot::Sender<()>>,
    /// The application's task: over once it has stopped serving and its background work
    /// (the sweeper) has been dropped.
    pub running: Option<tokio::task::JoinHandle<()>>,
}

/// Runs `app` on a task of its own until the returned sender is used (or dropped); the task
/// ends once the application has.
pub fn run_in_background(app: Application) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        let _ = app
            .run_until(async move {
                let _ = rx.await;
            })
            .await;
    });
    (tx, running)
}

pub async fn spawn_app(cluster: &Cluster) -> TestApp {
    spawn_app_with(AppOptions::new(cluster)).await
}

pub async fn spawn_app_with(opts: AppOptions<'_>) -> TestApp {
    init_logs();
    let cluster = opts.cluster;
    let database = match opts.database {
        Some(db) => db,
        None => fresh_database(cluster).await,
    };
    let mut env: HashMap<&str, String> = HashMap::new();
    env.insert("DATABASE_URL", cluster.primary_url(&database));
    if opts.replicas {
        env.insert("STOCKGATE_REPLICA_URLS", cluster.replica_urls(&database));
    }
    if let Some(r) = opts.redis_url {
        env.insert("STOCKGATE_REDIS_URL", r);
    }
    env.insert("STOCKGATE_TOKEN_SECRET", SECRET.into());
    env.insert("STOCKGATE_LISTEN", "127.0.0.1:0".into());
    env.insert("STOCKGATE_PRIMARY_POOL_SIZE", "20".into());
    for (k, v) in opts.env {
        env.insert(k, v);
    }
    let config = Config::from_lookup(|k| env.get(k).cloned()).expect("test config");
    let app = Application::build_with_clock(&config, opts.clock)
        .await
        .expect("build app");
    let port = app.port();
    let state = app.state().clone();
    let (tx, running) = run_in_background(app);
    let primary = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&cluster.primary_url(&database))
        .await
        .expect("test pool");
    let tokens = Tokens::new(SECRET);
    let admin = tokens
        .issue(&Caller::Admin, Duration::from_secs(3600))
        .expect("token");
    let client = Client::builder()
        .pool_max_idle_per_host(256)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let app = TestApp {
        address: format!("http://127.0.0.1:{port}"),
        database,
        client,
        tokens,
        admin,
        primary,
        state,
        shutdown: Some(tx),
        running: Some(running),
    };
    // Wait until the monitor has seen every replica answer, so tests start from a known state.
    if opts.replicas {
        app.wait_for("replicas healthy", Duration::from_secs(20), || async {
            app.replica_states()
                .await
                .iter()
                .all(|(_, s, _)| s == "healthy")
        })
        .await;
    }
    app
}

/// A second instance of `app`'s deployment: the same database and cluster, its own pools,
/// monitor and (unless told otherwise) in-process read-your-writes store.
pub async fn spawn_beside(app: &TestApp, cluster: &Cluster) -> TestApp {
    spawn_app_with(AppOptions {
        database: Some(app.database.clone()),
        ..AppOptions::new(cluster)
    })
    .await
}

/// `method path` as `user` (with `Idempotency-Key: key` if given) and a JSON body: the
/// status and the JSON answer (`null` if none).
pub async fn send_as(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    user: &str,
    key: Option<&str>,
    body: Value,
) -> (StatusCode, Value) {
    let mut req = app
        .client
        .request(method, app.url(path))
        .bearer_auth(app.user_token(user))
        .json(&body);
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    answer(req.send().await.unwrap()).await
}

/// An instance of `database`'s deployment that reaches the primary through `proxy` (the
/// replicas directly), so a test can cut or sever its primary link.
pub async fn spawn_through_proxy(cluster: &Cluster, database: &str, proxy: &ChaosProxy) -> TestApp {
    spawn_app_with(AppOptions {
        database: Some(database.to_string()),
        env: vec![(
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:{}/{database}", proxy.port),
        )],
        ..AppOptions::new(cluster)
    })
    .await
}

/// A new, migrated database on `cluster`, already on its replicas.
pub async fn fresh_database(cluster: &Cluster) -> String {
    let db = format!("t_{}", uuid::Uuid::new_v4().simple());
    cluster.create_database(&db).expect("create test database");
    startup::migrate(&cluster.primary_url(&db))
        .await
        .expect("migrate");
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
    db
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    pub fn user_token(&self, user: &str) -> String {
        self.tokens
            .issue(
                &Caller::User(UserId::parse(user).unwrap()),
                Duration::from_secs(3600),
            )
            .unwrap()
    }

    pub async fn create_product(&self, id: &str, stock: i64, price: i64) -> Response {
        self.post_product(&json!({"product_id": id, "name": format!("Product {id}"), "price_cents": price, "available_quantity": stock}))
            .await
    }

    /// `POST /v1/products` with `body`, as the admin.
    pub async fn post_product(&self, body: &Value) -> Response {
        self.client
            .post(self.url("/v1/products"))
            .bearer_auth(&self.admin)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// `n` confirmed single-line orders of one unit of `product`, written in one statement
    /// straight into the primary (an operator's bulk insert; no stock is taken).
    pub async fn insert_confirmed_orders(&self, product: &str, n: i32) {
        sqlx::query(
            "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, \
             status, idempotency_key, request_fingerprint) \
             SELECT gen_random_uuid(), $1, 'u' || i, 1, 100, 100, 'confirmed', 'k' || i, 'fp' \
             FROM generate_series(1, $2) i",
        )
        .bind(product)
        .bind(n)
        .execute(&self.primary)
        .await
        .unwrap();
    }

    pub async fn restock(&self, id: &str, quantity: i64) -> Response {
        self.client
            .post(self.url(&format!("/v1/products/{id}/restock")))
            .bearer_auth(&self.admin)
            .json(&json!({"quantity": quantity}))
            .send()
            .await
            .unwrap()
    }

    pub async fn availability(&self, id: &str, qty: i64) -> Response {
        self.client
            .get(self.url(&format!("/v1/products/{id}/availability?qty={qty}")))
            .send()
            .await
            .unwrap()
    }

    pub async fn order(&self, user: &str, key: &str, product: &str, quantity: i64) -> Response {
        self.client
            .post(self.url("/v1/orders"))
            .bearer_auth(self.user_token(user))
            .header("Idempotency-Key", key)
            .json(&json!({"product_id": product, "quantity": quantity}))
            .send()
            .await
            .unwrap()
    }

    pub async fn get_json(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let mut req = self.client.get(self.url(path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        answer(req.send().await.unwrap()).await
    }

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

    /// Holds `products`' rows locked (as a long transaction would) until the guard is
    /// committed or dropped: orders for them queue up behind it.
    pub async fn lock_rows(&self, products: &[&str]) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.primary.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM products WHERE product_id = ANY($1) ORDER BY product_id FOR NO KEY UPDATE")
            .bind(products)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
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

impl TestApp {
    /// Stops the application and waits until it has ended, background work included (dropping
    /// a `TestApp` only asks it to stop).
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(running) = self.running.take() {
            let _ = running.await;
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A response's status and its JSON body (`null` if it has none): what the request helpers
/// return, and what [`assert_error`] reads.
pub async fn answer(resp: Response) -> (StatusCode, Value) {
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

// ---------------------------------------------------------------------------------------------
// Answers, typed. The service's response types only serialise (and its error body is private
// to it), so the tests read answers back into these: the contract's shapes, in one place.
// ---------------------------------------------------------------------------------------------

/// The one error body: `{"error": {"code": "SCREAMING_SNAKE_CASE", "message": "…", …}}`.
#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    /// With 409 `OUT_OF_STOCK` for a cart or hold: the short lines.
    pub lines: Option<Vec<ShortLine>>,
    /// With 409 `LIMIT_EXCEEDED`: the limited product, its limit, the units already had.
    pub product_id: Option<String>,
    pub limit: Option<i64>,
    pub already: Option<i64>,
    /// With 422 `INVALID_CSV`: the first bad lines of the file.
    pub bad_lines: Option<Vec<Value>>,
}

/// A line a cart or hold could not have. Exactly these fields: a test comparing short lines
/// compares the whole line.
#[derive(Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShortLine {
    pub product_id: String,
    pub requested: i64,
    pub available: i64,
}

/// An order (`stockgate::checkout::Order`): the fields the tests read.
#[derive(Debug, Deserialize)]
pub struct Order {
    pub order_id: Uuid,
    pub status: OrderStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    Confirmed,
    Cancelled,
}

/// A hold (`stockgate::checkout::holds::Hold`): the fields the tests read.
#[derive(Debug, Deserialize)]
pub struct Hold {
    pub hold_id: Uuid,
    pub status: HoldStatus,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldStatus {
    Held,
    Confirmed,
    Released,
    Expired,
}

/// What every routed read adds to its body (`stockgate::http::Stated`): the moment the answer
/// describes and where it came from.
#[derive(Debug, Deserialize)]
pub struct Stated {
    pub as_of: DateTime<Utc>,
    pub stale_by_ms: u64,
    /// `primary` or a replica's name (`replica-1`, …).
    pub served_by: String,
}

/// `body` read as a `T`; panics, showing the body, if it is not one.
#[track_caller]
pub fn parse<T: DeserializeOwned>(body: &Value) -> T {
    T::deserialize(body)
        .unwrap_or_else(|e| panic!("not a {}: {e}: {body}", std::any::type_name::<T>()))
}

/// An error body's code; `""` for any other body. For filters and retry loops, and where the
/// status is already known; an assertion on an answer wants [`assert_error`].
pub fn code(body: &Value) -> &str {
    body.pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Asserts that `answer` is the error `status` `code` in the contract's shape, and returns
/// its details (a limit, the short lines) for the checks that follow.
#[track_caller]
pub fn assert_error(answer: &(StatusCode, Value), status: u16, code: &str) -> ErrorDetail {
    assert_error_for("", answer, status, code)
}

/// [`assert_error`], naming `what` was asked (a round, a product) when it fails.
#[track_caller]
pub fn assert_error_for(
    what: &str,
    answer: &(StatusCode, Value),
    status: u16,
    code: &str,
) -> ErrorDetail {
    let (got, body) = answer;
    match ErrorBody::deserialize(body) {
        Ok(b) if got.as_u16() == status && b.error.code == code => b.error,
        _ if what.is_empty() => panic!("want {status} {code}, got {got} {body}"),
        _ => panic!("{what}: want {status} {code}, got {got} {body}"),
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

/// Runs a blocking cluster operation from async code.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// A TCP proxy the test controls, between the service and one database: when cut, it
/// stops forwarding on every connection (open ones go silent mid-query, new ones are
/// accepted and not answered) until healed, as a network partition would; `sever` closes
/// every open connection at once. `sever_after` / `cut_after` do either once the database
/// has sent that many more bytes through it: mid-stream by construction, whatever the
/// machine's socket buffers hold (on loopback they grow to 32 MB each, so "after the client's
/// first chunk" could come after the whole answer had left the database).
pub struct ChaosProxy {
    pub port: u16,
    cut: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
    /// The open connections' pumps, so `sever` can close them.
    links: Links,
    /// An armed fault: the bytes the database may still send, and the fault.
    trip: Arc<std::sync::Mutex<Option<(usize, Fault)>>>,
}

type Links = Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>;

/// What an armed [`ChaosProxy`] does once its bytes have passed.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Sever,
    Cut,
}

impl ChaosProxy {
    pub async fn start(upstream_port: u16) -> ChaosProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = cut.clone();
        let links: Links = Arc::default();
        let trip: Arc<std::sync::Mutex<Option<(usize, Fault)>>> = Arc::default();
        let (open, armed) = (links.clone(), trip.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let flag = flag.clone();
                let flag_after = flag.clone();
                let (all, armed) = (open.clone(), armed.clone());
                // After `n` more bytes from the database: the armed fault, if any.
                let passed = move |n: usize| {
                    let mut trip = armed.lock().unwrap();
                    let Some((left, fault)) = trip.as_mut() else {
                        return;
                    };
                    if n < *left {
                        *left -= n;
                        return;
                    }
                    match *fault {
                        Fault::Cut => flag_after.store(true, Ordering::SeqCst),
                        Fault::Sever => {
                            for link in all.lock().unwrap().drain(..) {
                                link.abort();
                            }
                        }
                    }
                    *trip = None;
                };
                let link = tokio::spawn(async move {
                    let Ok(server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream_port)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let pump =
                        |mut from: tokio::net::tcp::OwnedReadHalf,
                         mut to: tokio::net::tcp::OwnedWriteHalf,
                         flag: Arc<std::sync::atomic::AtomicBool>,
                         passed: Option<Arc<dyn Fn(usize) + Send + Sync>>| async move {
                            let mut buf = vec![0u8; 16 * 1024];
                            loop {
                                let n = match from.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                if let Some(passed) = &passed {
                                    passed(n);
                                }
                                // While cut, hold the bytes (and so stop reading: TCP
                                // pushes back) until healed, as a partition does: nothing
                                // is lost, the peer just hears nothing meanwhile.
                                while flag.load(Ordering::SeqCst) {
                                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                                }
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        };
                    // Both directions in this task, so aborting it closes both sockets.
                    tokio::join!(
                        pump(cr, sw, flag.clone(), None),
                        pump(sr, cw, flag, Some(Arc::new(passed)))
                    );
                });
                open.lock().unwrap().push(link.abort_handle());
            }
        });
        ChaosProxy {
            port,
            cut,
            task,
            links,
            trip,
        }
    }

    /// Severs every open connection once the database has sent `bytes` more through the proxy.
    pub fn sever_after(&self, bytes: usize) {
        *self.trip.lock().unwrap() = Some((bytes, Fault::Sever));
    }

    /// Cuts (see [`ChaosProxy::cut`]) once the database has sent `bytes` more through the
    /// proxy.
    pub fn cut_after(&self, bytes: usize) {
        *self.trip.lock().unwrap() = Some((bytes, Fault::Cut));
    }

    /// Closes every open connection at once (the peer sees the socket close, as when a
    /// server or a link dies); new connections are served as before.
    pub fn sever(&self) {
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.task.abort();
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

/// A stand-in for Patroni's REST API that says whatever the test wants: `/cluster` and
/// `/history` answer the current `body`, `/history` with no switches.
pub struct FakePatroni {
    pub url: String,
    cluster: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakePatroni {
    pub async fn start(cluster: String) -> FakePatroni {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let body = Arc::new(Mutex::new(cluster));
        let shared = body.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = sock.read(&mut buf).await.unwrap_or(0);
                    let request = String::from_utf8_lossy(&buf[..n]);
                    let body = if request.starts_with("GET /history") {
                        "[]".to_string()
                    } else {
                        shared.lock().unwrap().clone()
                    };
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(answer.as_bytes()).await;
                });
            }
        });
        FakePatroni {
            url,
            cluster: body,
            task,
        }
    }

    pub fn say(&self, cluster: String) {
        *self.cluster.lock().unwrap() = cluster;
    }
}

impl Drop for FakePatroni {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether this run is CI (`CI` set and not empty). There, a test whose tools are missing
/// fails; elsewhere it is skipped, and says so.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty())
}

/// A test that cannot run here: fails under CI with `reason`; elsewhere prints
/// `SKIPPED (reason)` on stderr past the test harness's capture, so it shows in a plain
/// `cargo test` run too, and the caller returns.
pub fn skip_outside_ci(test: &str, reason: &str) {
    use std::io::Write;
    assert!(
        !in_ci(),
        "{test}: {reason} (CI is set, so this fails instead of skipping)"
    );
    let _ = writeln!(std::io::stderr(), "{test}: SKIPPED ({reason})");
}

/// The error assertion must be able to fail: on another status, another code, or a body that
/// is not the contract's error body.
#[test]
fn assert_error_fails_on_another_status_another_code_or_a_body_not_in_the_contracts_shape() {
    let refused = |body: Value| (StatusCode::CONFLICT, body);
    let out_of_stock = json!({"error": {"code": "OUT_OF_STOCK", "message": "not enough"}});
    let e = assert_error(&refused(out_of_stock.clone()), 409, "OUT_OF_STOCK");
    assert_eq!(e.message, "not enough");
    let fails = |answer: (StatusCode, Value), status: u16, code: &'static str| {
        std::panic::catch_unwind(move || assert_error(&answer, status, code)).is_err()
    };
    assert!(fails(refused(out_of_stock.clone()), 422, "OUT_OF_STOCK"));
    assert!(fails(refused(out_of_stock), 409, "LIMIT_EXCEEDED"));
    assert!(fails(
        refused(json!({"error": {"code": "OUT_OF_STOCK"}})),
        409,
        "OUT_OF_STOCK"
    ));
    assert!(fails(
        refused(json!({"code": "OUT_OF_STOCK", "message": "flat"})),
        409,
        "OUT_OF_STOCK"
    ));
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
