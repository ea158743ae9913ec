//! Clusters, databases and instances of the service, the typed requests a test sends one,
//! and whether this run is CI.

use super::{ChaosProxy, answer};
use chrono::{DateTime, Utc};
use devcluster::Cluster;
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use stockgate::auth::{Caller, Tokens};
use stockgate::clock::{Clock, SystemClock};
use stockgate::config::Config;
use stockgate::domain::UserId;
use stockgate::startup::{self, Application};
use tokio::sync::oneshot;

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

/// `m path` as the admin (with `Idempotency-Key: key` if given; `body` `null` sends none):
/// the status and the JSON answer.
pub async fn send_admin(
    app: &TestApp,
    m: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Value,
) -> (StatusCode, Value) {
    let mut req = app.client.request(m, app.url(path)).bearer_auth(&app.admin);
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    if !body.is_null() {
        req = req.json(&body);
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

/// A new database on `cluster` with the schema as it was before migration `version` (every
/// migration below it applied): its name, URL and a pool, for a test that writes the rows an
/// older binary would have and then migrates.
pub async fn database_before(cluster: &Cluster, version: i64) -> (String, String, sqlx::PgPool) {
    let db = format!("t_{}", uuid::Uuid::new_v4().simple());
    cluster.create_database(&db).expect("create test database");
    let url = cluster.primary_url(&db);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut before = sqlx::migrate!("./migrations");
    before.migrations = before
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect::<Vec<_>>()
        .into();
    before
        .run(&pool)
        .await
        .expect("the schema before the migration");
    (db, url, pool)
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

/// Runs a blocking cluster operation from async code.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
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
