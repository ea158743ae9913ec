//! The ops page and the shop page: served with the right types and headers, and working in
//! a real headless Chromium. The browser side is a node script in `tests/browser/`
//! (playwright-core driving Debian's `/usr/bin/chromium`); this side owns the cluster and
//! tells the script what it did over stdin, and the script says what it saw over stdout.

use crate::helpers::*;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::Instant;

const CHROMIUM: &str = "/usr/bin/chromium";
/// The longest any one step may take (the first includes starting the browser).
const STEP: Duration = Duration::from_secs(30);

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// `<target>/browser-screenshots`, beside the scratch dir cargo gives integration tests.
fn screenshot_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp.parent().unwrap_or(tmp).join("browser-screenshots");
    std::fs::create_dir_all(&dir).expect("create the screenshot directory");
    dir
}

/// Whether the browser tests can run here. Missing prerequisites skip the test on a
/// developer's machine, and fail it under CI (`./dev test` installs them).
fn browser_available() -> bool {
    let mut missing = vec![];
    if !Path::new(CHROMIUM).exists() {
        missing.push(format!("{CHROMIUM} (apt-get install chromium)"));
    }
    if !browser_dir().join("node_modules/playwright-core").is_dir() {
        missing.push("tests/browser/node_modules (npm ci in tests/browser)".to_string());
    }
    let node = std::process::Command::new("node")
        .arg("--version")
        .stdout(Stdio::null())
        .status();
    if !node.map(|s| s.success()).unwrap_or(false) {
        missing.push("node".to_string());
    }
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "browser test prerequisites missing: {}; `./dev test` installs them",
        missing.join(", ")
    );
    crate::helpers::skip_outside_ci("browser tests", &why);
    false
}

/// A browser script in a child process, killed if the test ends early.
struct Browser {
    script: &'static str,
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Browser {
    fn spawn(script: &'static str, env: &[(&str, &str)]) -> Browser {
        let mut child = Command::new("node")
            .arg(browser_dir().join(script))
            .current_dir(browser_dir())
            .env("SCREENSHOT_DIR", screenshot_dir())
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start node {script}: {e}"));
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        Browser {
            script,
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// Reads the script's lines until one starts with `prefix` (returning the rest of it),
    /// echoing the others; fails on `FAIL …`, an early exit, or after `STEP`.
    async fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + STEP;
        loop {
            let next = tokio::time::timeout_at(deadline, self.lines.next_line()).await;
            let line = match next {
                Err(_) => panic!("{}: no `{prefix}` within {STEP:?}", self.script),
                Ok(Err(e)) => panic!("{}: reading its output: {e}", self.script),
                Ok(Ok(None)) => {
                    let status = self.child.wait().await;
                    panic!(
                        "{} exited ({status:?}) before saying `{prefix}`",
                        self.script
                    )
                }
                Ok(Ok(Some(line))) => line,
            };
            if let Some(path) = line.strip_prefix("SCREENSHOT ") {
                println!("screenshot: {path}");
            } else if let Some(why) = line.strip_prefix("FAIL ") {
                panic!("{}: {why}", self.script);
            } else {
                println!("[{}] {line}", self.script);
            }
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    async fn send(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("write to the browser script");
        self.stdin
            .flush()
            .await
            .expect("flush to the browser script");
    }

    /// Waits for `DONE` and a clean exit.
    async fn finish(mut self) {
        self.expect("DONE").await;
        let status = tokio::time::timeout(STEP, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{} did not exit after DONE", self.script))
            .expect("wait for the browser script");
        assert!(status.success(), "{} exited with {status}", self.script);
    }
}

/// Reads a URL every 50 ms until dropped, so routing decisions flow.
struct Reader(tokio::task::JoinHandle<()>);

impl Reader {
    fn start(client: reqwest::Client, url: String) -> Self {
        Reader(tokio::spawn(async move {
            loop {
                let _ = client.get(&url).send().await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }))
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `method path` as the admin, with `Idempotency-Key: key` if given and a JSON body: asserts
/// the answer's status is `want` and returns its body.
async fn as_admin(
    app: &TestApp,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Value,
    want: StatusCode,
) -> Value {
    let mut req = app
        .client
        .request(method, app.url(path))
        .bearer_auth(&app.admin)
        .json(&body);
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    let got = answer(req.send().await.unwrap()).await;
    assert_eq!(got.0, want, "{path}: {}", got.1);
    got.1
}

/// Makes each (location, name, rank) and `product` kept at `stock`'s locations (price £1),
/// then deactivates `inactive`: its units stay, but are not sold.
async fn keep_at_locations(
    app: &TestApp,
    locations: &[(&str, &str, i64)],
    product: &str,
    stock: &[(&str, i64)],
    inactive: &str,
) {
    let created = StatusCode::CREATED;
    for &(id, name, rank) in locations {
        let body = json!({"location_id": id, "name": name, "rank": rank});
        as_admin(app, Method::POST, "/v1/locations", None, body, created).await;
    }
    let stock: Vec<Value> = (stock.iter())
        .map(|(l, q)| json!({"location_id": l, "quantity": q}))
        .collect();
    let body = json!({"product_id": product, "name": product, "price_cents": 100, "stock": stock});
    as_admin(app, Method::POST, "/v1/products", None, body, created).await;
    let path = format!("/v1/locations/{inactive}");
    let body = json!({"active": false});
    let got = as_admin(app, Method::PATCH, &path, None, body, StatusCode::OK).await;
    assert_eq!(got["active"], false, "{got}");
}

/// What the shop page must say of an order's `allocations`: "ships from eu-1 (2), default (1)".
fn ships_from(order: &Value) -> String {
    let places: Vec<String> = (order["allocations"].as_array().expect("allocations"))
        .iter()
        .map(|a| format!("{} ({})", a["location_id"].as_str().unwrap(), a["quantity"]))
        .collect();
    format!("ships from {}", places.join(", "))
}

/// The ops page's stock-by-location rows for `product` as the primary holds them, in rank then
/// `location_id` order: "location name rank state units · … · total N", where the total is the
/// product's own count (its units at active locations).
async fn stock_rows(app: &TestApp, product: &str) -> String {
    let rows: Vec<(String, String, i32, bool, i32)> = sqlx::query_as(
        "SELECT l.location_id, l.name, l.rank, l.active, s.available_quantity \
           FROM stock_levels s JOIN locations l USING (location_id) WHERE s.product_id = $1 \
          ORDER BY l.rank, l.location_id COLLATE \"C\"",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap();
    let state = |active| if active { "active" } else { "inactive" };
    let rows = rows
        .into_iter()
        .map(|(l, name, rank, active, n)| format!("{l} {name} {rank} {} {n}", state(active)));
    let total = format!("total {}", app.stock_on_primary(product).await);
    rows.chain([total]).collect::<Vec<_>>().join(" · ")
}

async fn fetch(
    app: &TestApp,
    path: &str,
) -> (StatusCode, String, String, reqwest::header::HeaderMap) {
    let resp = app.client.get(app.url(path)).send().await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    (status, content_type, resp.text().await.unwrap(), headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_and_their_assets_are_served_from_the_binary_with_their_types() {
    let app = spawn_app(shared_cluster()).await;
    for (path, kind) in [
        ("/ops", "text/html"),
        ("/shop/flash-60", "text/html"),
        ("/shop/no-such-product", "text/html"),
        ("/static/ops.js", "text/javascript"),
        ("/static/shop.js", "text/javascript"),
        ("/static/common.js", "text/javascript"),
        ("/static/pages.css", "text/css"),
    ] {
        let (status, content_type, body, headers) = fetch(&app, path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        assert!(!body.is_empty(), "{path}");
        assert_eq!(headers["x-content-type-options"], "nosniff", "{path}");
        if kind == "text/html" {
            let csp = headers["content-security-policy"].to_str().unwrap();
            assert!(csp.contains("script-src 'self'"), "{path}: {csp}");
            // Everything the page loads comes from this service.
            for attr in ["src=\"", "href=\""] {
                for (i, _) in body.match_indices(attr) {
                    let url = &body[i + attr.len()..];
                    assert!(
                        url.starts_with("/static/") || url.starts_with("data:,\""),
                        "{path} loads {}",
                        url.chars().take(40).collect::<String>()
                    );
                }
            }
        }
    }
    // A malformed product id is the contract's error, not a page and not a 500.
    let (status, content_type, body, _) = fetch(&app, "/shop/has%20space").await;
    assert!(
        content_type.starts_with("application/json"),
        "{status} {content_type}: {body}"
    );
    let body = serde_json::from_str(&body).unwrap_or_default();
    assert_error(&(status, body), 422, "INVALID_PRODUCT_ID");
    let (status, _, _, _) = fetch(&app, "/shop/").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// The ops page (tests/browser/ops.mjs): both replicas healthy, the policy, holds, rates and
/// thresholds in force; one product's stock at each location, as the primary holds it before
/// and after a transfer, a sale and a new rank; then replica-1 followed as its replay pauses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ops_page_shows_stock_by_location_and_follows_replica_1_when_it_is_paused() {
    if !browser_available() {
        return;
    }
    let cluster = private_cluster();
    // Not the default 5 s: the page must draw the threshold in force, not a copy of its own.
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_EVICT_AFTER_MS", "4000".into())],
        ..AppOptions::new(&cluster)
    })
    .await;
    assert_eq!(
        app.create_product("ops-demo", 1000, 1299).await.status(),
        StatusCode::CREATED
    );
    // A buyer holds 7 units: the page lists them under "Units held".
    let hold = app
        .client
        .post(app.url("/v1/holds"))
        .bearer_auth(app.user_token("ops-buyer"))
        .header("Idempotency-Key", "ops-hold")
        .json(&serde_json::json!({"lines": [{"product_id": "ops-demo", "quantity": 7}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(hold.status(), StatusCode::CREATED);
    let stocked = "ops-stock";
    keep_at_locations(
        &app,
        &[("closed", "Old depot", 5), ("eu-1", "Leeds", 10)],
        stocked,
        &[("closed", 4), ("eu-1", 5), ("default", 3)],
        "closed",
    )
    .await;
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    let _reads = Reader::start(
        app.client.clone(),
        app.url("/v1/products/ops-demo/availability?qty=1"),
    );
    let mut browser = Browser::spawn(
        "ops.mjs",
        &[
            ("STOCKGATE_URL", &app.address),
            ("STOCKGATE_ADMIN_TOKEN", &app.admin),
            ("STOCKGATE_EVICT_MS", "4000"),
        ],
    );
    // The panel's rows are the primary's, before and after stock moves.
    assert_eq!(
        browser.expect("STOCK").await,
        stock_rows(&app, stocked).await
    );
    let body = json!({"product_id": stocked, "from": "eu-1", "to": "default", "quantity": 2});
    let (key, created) = (Some("ops-move"), StatusCode::CREATED);
    let got = as_admin(&app, Method::POST, "/v1/transfers", key, body, created).await;
    assert_eq!(got["status"], "received", "{got}");
    // One unit sold: `closed` is first by rank but inactive, so eu-1 serves it.
    let sale = app.order("ops-buyer", "ops-sale", stocked, 1).await;
    let (status, sale) = answer(sale).await;
    assert_eq!(status, StatusCode::CREATED, "{sale}");
    assert_eq!(ships_from(&sale), "ships from eu-1 (1)");
    let (rank, path) = (json!({"rank": 1}), "/v1/locations/default");
    as_admin(&app, Method::PATCH, path, None, rank, StatusCode::OK).await;
    browser.send("MOVED").await;
    assert_eq!(
        browser.expect("STOCK").await,
        stock_rows(&app, stocked).await
    );
    // The movements card: the primary's ledger rows, oldest first (no row for the sale).
    let moves: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT location_id, reason, delta FROM movements WHERE product_id = $1 ORDER BY movement_id",
    )
    .bind(stocked)
    .fetch_all(&app.primary)
    .await
    .unwrap();
    let moves: Vec<String> = moves
        .iter()
        .map(|(l, r, d)| format!("{l} {r} {d}"))
        .collect();
    assert_eq!(browser.expect("MOVES").await, moves.join(" · "));
    browser.expect("READY").await;

    let _ticker = WalTicker::start(app.primary.clone());
    blocking(|| cluster.pause_replay(1)).unwrap();
    browser.send("PAUSED").await;
    browser.expect("STALE").await;

    blocking(|| cluster.pause_replay(2)).unwrap();
    browser.send("PAUSED_BOTH").await;
    browser.finish().await;
    blocking(|| {
        cluster.resume_replay(1).unwrap();
        cluster.resume_replay(2).unwrap();
    });
}

/// The shop page (tests/browser/shop.mjs) on a product kept at `default` only: fresh
/// availability, the last unit sold once (shipping from `default`), then 409. And on a product
/// kept at three locations and a fourth, inactive one that alone could serve the order: the
/// active places are listed, three units ship from the two the order's allocations name
/// (no one active location has three), and the list follows the sale. Where each order ships
/// from is held to the order as the service stored it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shop_page_sells_the_last_unit_once_and_says_where_each_order_ships_from() {
    if !browser_available() {
        return;
    }
    let app = spawn_app(shared_cluster()).await;
    let product = "last-sneaker";
    assert_eq!(
        app.create_product(product, 1, 8999).await.status(),
        StatusCode::CREATED
    );
    let split = "split-sneaker";
    keep_at_locations(
        &app,
        &[
            ("closed", "Closed", 5),
            ("eu-1", "Leeds", 10),
            ("eu-2", "Lyon", 20),
        ],
        split,
        &[("closed", 9), ("eu-1", 2), ("eu-2", 2), ("default", 1)],
        "closed",
    )
    .await;
    let token = app.user_token("shopper-1");
    let mut browser = Browser::spawn(
        "shop.mjs",
        &[
            ("STOCKGATE_URL", &app.address),
            ("STOCKGATE_PRODUCT", product),
            ("STOCKGATE_PRICE", "£89.99"),
            ("STOCKGATE_USER_TOKEN", &token),
            ("STOCKGATE_SPLIT_PRODUCT", split),
            ("STOCKGATE_SPLIT_QTY", "3"),
            (
                "STOCKGATE_SPLIT_AT",
                "in stock at eu-1 (2), eu-2 (2), default (1)",
            ),
            ("STOCKGATE_SPLIT_LEFT", "in stock at eu-2 (1), default (1)"),
        ],
    );
    let freshness = browser.expect("FRESHNESS").await;
    assert!(freshness.starts_with("In stock — as of "), "{freshness}");
    let order_id = browser.expect("BOUGHT").await;
    let ships = browser.expect("SHIPS").await;
    browser.expect("SOLD_OUT").await;
    let split_id = browser.expect("SPLIT_BOUGHT").await;
    let split_ships = browser.expect("SPLIT_SHIPS").await;
    browser.finish().await;

    // What the page showed is what happened: one confirmed order, no stock left.
    let (status, order) = app
        .get_json(&format!("/v1/orders/{order_id}"), Some(&app.admin))
        .await;
    assert_eq!(status, StatusCode::OK, "{order}");
    assert_eq!(order["status"], "confirmed", "{order}");
    assert_eq!(order["user_id"], "shopper-1", "{order}");
    assert_eq!(app.confirmed_orders(product).await, (1, 1));
    assert_eq!(app.stock_on_primary(product).await, 0);
    assert_eq!(ships, ships_from(&order), "{order}");
    assert_eq!(ships, "ships from default (1)");

    // The split order: the page named what the order took, and it did split.
    let (status, order) = app
        .get_json(&format!("/v1/orders/{split_id}"), Some(&app.admin))
        .await;
    assert_eq!(status, StatusCode::OK, "{order}");
    assert_eq!(order["quantity"], 3, "{order}");
    assert_eq!(split_ships, ships_from(&order), "{order}");
    assert_eq!(split_ships, "ships from eu-1 (2), eu-2 (1)");
    assert_eq!(app.stock_on_primary(split).await, 2);
}

/// The shop page on a drop (tests/browser/drop.mjs): "limit 1 per customer" and a countdown
/// that moves while buy is disabled; a buy forced early is told `SALE_NOT_STARTED`; when the
/// test then opens the sale (PATCH) the page enables buy and sells one unit, and the second
/// is `LIMIT_EXCEEDED`; when the test ends the sale the page says "sale ended" and a forced
/// buy is `SALE_ENDED`. The page's claims are then checked against the database: one order,
/// one unit gone. The rules move on the script's word, not on a clock, so a slow browser
/// start cannot miss a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shop_page_counts_down_to_a_drop_states_its_limit_and_its_end() {
    if !browser_available() {
        return;
    }
    let app = spawn_app(shared_cluster()).await;
    let product = "drop-page";
    let (starts, ends): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT now() + interval '10 minutes', now() + interval '2 hours'")
            .fetch_one(&app.primary)
            .await
            .unwrap();
    let r = app
        .post_product(
            &serde_json::json!({"product_id": product, "name": "Drop", "price_cents": 100,
            "available_quantity": 10, "max_per_customer": 1,
            "sale_starts_at": starts.to_rfc3339(), "sale_ends_at": ends.to_rfc3339()}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let patch = |rules: serde_json::Value| {
        let app = &app;
        async move {
            let r = app
                .client
                .patch(app.url(&format!("/v1/products/{product}")))
                .bearer_auth(&app.admin)
                .json(&rules)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
    };
    let token = app.user_token("dropper");
    let mut browser = Browser::spawn(
        "drop.mjs",
        &[
            ("STOCKGATE_URL", &app.address),
            ("STOCKGATE_PRODUCT", product),
            ("STOCKGATE_USER_TOKEN", &token),
        ],
    );
    browser.expect("BEFORE").await;
    browser.expect("SALE_NOT_STARTED").await;
    patch(serde_json::json!({"sale_starts_at": null})).await;
    browser.expect("BOUGHT").await;
    browser.expect("LIMIT_EXCEEDED").await;
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&app.primary)
        .await
        .unwrap();
    patch(serde_json::json!({"sale_ends_at": now.to_rfc3339()})).await;
    browser.expect("SALE_ENDED").await;
    browser.finish().await;
    assert_eq!(app.confirmed_orders(product).await, (1, 1));
    assert_eq!(app.stock_on_primary(product).await, 9);
}
