//! The skeleton: migrations, products, the error contract, tokens, configuration.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::process::Command;
use std::time::Duration;
use stockgate::auth::{Caller, Tokens};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_twice_is_harmless() {
    let app = spawn_app(shared_cluster()).await;
    let url = shared_cluster().primary_url(&app.database);
    stockgate::startup::migrate(&url).await.expect("second run");
    let out = Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .output()
        .expect("run binary");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let versions: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations")
        .fetch_one(&app.primary)
        .await
        .unwrap();
    assert_eq!(
        versions as usize,
        std::fs::read_dir("migrations").unwrap().count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_product_is_created_read_and_restocked() {
    let app = spawn_app(shared_cluster()).await;
    let created = app.create_product("mug-1", 10, 1299).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let body: Value = created.json().await.unwrap();
    assert_eq!(body["product_id"], "mug-1");
    assert_eq!(body["available_quantity"], 10);
    assert_eq!(body["served_by"], "primary");

    let again = app.create_product("mug-1", 5, 100).await;
    assert_error(&answer(again).await, 409, "ALREADY_EXISTS");

    let restocked: Value = app.restock("mug-1", 40).await.json().await.unwrap();
    assert_eq!(restocked["available_quantity"], 50);

    // The product page may come from a replica within 5 s; it must say so, and be right
    // once the replica has the restock.
    app.wait_for(
        "product page shows the restock",
        Duration::from_secs(10),
        || async {
            let (s, b) = app.get_json("/v1/products/mug-1", None).await;
            s == StatusCode::OK && b["available_quantity"] == 50
        },
    )
    .await;
    let (_, page) = app.get_json("/v1/products/mug-1", None).await;
    for field in ["as_of", "stale_by_ms", "served_by", "name", "price_cents"] {
        assert!(page.get(field).is_some(), "missing {field}: {page}");
    }
}

/// The error `resp` is in the contract's shape: its status and code, and a message.
async fn error_of(resp: reqwest::Response) -> (StatusCode, String) {
    let (status, body) = answer(resp).await;
    let e = parse::<ErrorBody>(&body).error;
    assert!(!e.message.is_empty(), "error.message: {body}");
    (status, e.code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_status_comes_with_the_contracts_json_shape() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("p-err", 1, 100).await;
    let c = &app.client;
    let admin = &app.admin;
    let user = app.user_token("ada");
    let post = |path: &str| c.post(app.url(path));

    // 400: malformed JSON, wrong types, unknown query values, a missing key header.
    let cases: Vec<(reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (post("/v1/products").bearer_auth(admin).header("content-type", "application/json").body("{not json"), StatusCode::BAD_REQUEST, "MALFORMED_JSON"),
        (post("/v1/products").bearer_auth(admin).json(&json!({"product_id": 5, "name": "x", "price_cents": 1, "available_quantity": 1})), StatusCode::BAD_REQUEST, "INVALID_BODY"),
        (post("/v1/products").bearer_auth(admin).body("{}"), StatusCode::BAD_REQUEST, "UNSUPPORTED_CONTENT_TYPE"),
        (c.get(app.url("/v1/products/p-err/availability?qty=lots")), StatusCode::BAD_REQUEST, "INVALID_QUERY"),
        (c.get(app.url("/v1/products/p-err/availability?colour=red")), StatusCode::BAD_REQUEST, "INVALID_QUERY"),
        (post("/v1/orders").bearer_auth(&user).json(&json!({"product_id": "p-err", "quantity": 1})), StatusCode::BAD_REQUEST, "IDEMPOTENCY_KEY_MISSING"),
        // 401: no token, a garbage token.
        (post("/v1/products").json(&json!({})), StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
        (post("/v1/products").bearer_auth("garbage").json(&json!({})), StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
        // 403: a user on an admin route, a user acting for another.
        (post("/v1/products").bearer_auth(&user).json(&json!({})), StatusCode::FORBIDDEN, "FORBIDDEN"),
        (c.get(app.url("/v1/users/bob/settings")).bearer_auth(&user), StatusCode::FORBIDDEN, "FORBIDDEN"),
        // 404: unknown product, order, route.
        (c.get(app.url("/v1/products/nope")), StatusCode::NOT_FOUND, "PRODUCT_NOT_FOUND"),
        (c.get(app.url("/v1/orders/00000000-0000-0000-0000-000000000000")).bearer_auth(admin), StatusCode::NOT_FOUND, "ORDER_NOT_FOUND"),
        (c.get(app.url("/v1/nowhere")), StatusCode::NOT_FOUND, "NOT_FOUND"),
        (c.delete(app.url("/v1/products")), StatusCode::METHOD_NOT_ALLOWED, "METHOD_NOT_ALLOWED"),
        // 409: out of stock.
        (post("/v1/orders").bearer_auth(&user).header("Idempotency-Key", "too-many").json(&json!({"product_id": "p-err", "quantity": 2})), StatusCode::CONFLICT, "OUT_OF_STOCK"),
        // 413: a body over 64 KiB.
        (post("/v1/products").bearer_auth(admin).header("content-type", "application/json").body(format!("{{\"name\": \"{}\"}}", "x".repeat(70_000))), StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE"),
        // 422: rules broken by valid JSON.
        (post("/v1/orders").bearer_auth(&user).header("Idempotency-Key", "q0").json(&json!({"product_id": "p-err", "quantity": 0})), StatusCode::UNPROCESSABLE_ENTITY, "INVALID_QUANTITY"),
        (post("/v1/orders").bearer_auth(&user).header("Idempotency-Key", "q1").json(&json!({"product_id": "p-err", "quantity": 1e12})), StatusCode::UNPROCESSABLE_ENTITY, "INVALID_QUANTITY"),
        (post("/v1/products").bearer_auth(admin).json(&json!({"product_id": "ok", "name": "x", "price_cents": -1, "available_quantity": 1})), StatusCode::UNPROCESSABLE_ENTITY, "INVALID_PRICE"),
        (post("/v1/products").bearer_auth(admin).json(&json!({"product_id": "bad id!", "name": "x", "price_cents": 1, "available_quantity": 1})), StatusCode::UNPROCESSABLE_ENTITY, "INVALID_PRODUCT_ID"),
        (c.get(app.url("/v1/products/p-err/availability?qty=0")), StatusCode::UNPROCESSABLE_ENTITY, "INVALID_QUANTITY"),
    ];
    for (req, status, code) in cases {
        let resp = req.send().await.unwrap();
        assert_eq!(error_of(resp).await, (status, code.to_string()));
    }
    // The same key with a different body: 422.
    assert_eq!(
        app.order("ada", "k-reuse", "p-err", 1).await.status(),
        StatusCode::CREATED
    );
    let reused = app.order("ada", "k-reuse", "p-err", 2).await;
    assert_eq!(
        error_of(reused).await,
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "IDEMPOTENCY_KEY_REUSED".into()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_tampered_and_expired_tokens_get_401() {
    let app = spawn_app(shared_cluster()).await;
    let foreign = Tokens::new("some-other-secret-entirely")
        .issue(&Caller::Admin, Duration::from_secs(600))
        .unwrap();
    let expired = app
        .tokens
        .issue_expired(&Caller::Admin, Duration::from_secs(120))
        .unwrap();
    let mut tampered = app.admin.clone();
    tampered.pop();
    tampered.push(if app.admin.ends_with('A') { 'B' } else { 'A' });
    for token in [foreign, expired, tampered] {
        let resp = app
            .client
            .get(app.url("/v1/admin/routing"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    }
    let ok = app
        .client
        .get(app.url("/v1/admin/routing"))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

#[test]
fn a_configuration_error_is_one_line_and_exit_2() {
    let bin = env!("CARGO_BIN_EXE_stockgate");
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: &[Case] = &[
        (&["serve"], &[("DATABASE_URL", "postgres://h/db")]),
        (
            &["serve"],
            &[
                ("DATABASE_URL", "not a url"),
                ("STOCKGATE_TOKEN_SECRET", "0123456789abcdef"),
            ],
        ),
        (&["migrate"], &[]),
        (&["token", "--admin"], &[]),
        (
            &["serve"],
            &[
                ("DATABASE_URL", "postgres://h/db"),
                ("STOCKGATE_TOKEN_SECRET", "0123456789abcdef"),
                ("STOCKGATE_LISTEN", "nope"),
            ],
        ),
    ];
    for (args, env) in cases {
        let mut cmd = Command::new(bin);
        cmd.args(*args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .current_dir(std::env::temp_dir());
        for (k, v) in *env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run stockgate");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn tokens_from_the_command_line_are_accepted_by_the_service_rules() {
    let out = Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .args(["token", "--user", "ada", "--ttl", "1h"])
        .env("STOCKGATE_TOKEN_SECRET", SECRET)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap();
    let caller = Tokens::new(SECRET)
        .verify(token.trim())
        .expect("valid token");
    assert_eq!(
        caller,
        Caller::User(stockgate::domain::UserId::parse("ada").unwrap())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_metrics_and_routing_are_served() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(app.get_json("/healthz", None).await.0, StatusCode::OK);
    assert_eq!(app.get_json("/readyz", None).await.0, StatusCode::OK);
    let metrics = app.metrics_text().await;
    assert!(
        metrics.contains("stockgate_replica_staleness_seconds"),
        "{metrics}"
    );
    let (_, routing) = app.get_json("/v1/admin/routing", Some(&app.admin)).await;
    let gate = routing["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "stock_gate")
        .unwrap()
        .clone();
    assert_eq!(gate["target"], "replica");
    assert_eq!(gate["staleness_budget_ms"], 250);
}

fn sqlstate(e: &sqlx::Error) -> String {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
        .unwrap_or_else(|| format!("not a database error: {e}"))
}

/// Orders and order lines name products that exist, and such a product is never deleted or
/// re-keyed: the foreign keys' guarantee, checked once per statement and product (migration
/// 20261203000005). Mutations seen failing it: without `FOR KEY SHARE` in the insert
/// trigger, the delete does not wait for the uncommitted order; without the products' delete
/// trigger, the product with an order is deleted; without the orders' update trigger, an
/// order's product becomes one that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_names_a_product_that_exists_and_keeps_it() {
    let app = spawn_app(shared_cluster()).await;
    let db = &app.primary;
    for id in ["kept", "raced"] {
        assert_eq!(app.create_product(id, 10, 100).await.status(), 201);
    }
    let insert = "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, \
                  total_cents, status, idempotency_key, request_fingerprint) \
                  SELECT gen_random_uuid(), p, 'u', 1, 100, 100, 'confirmed', 'key-' || p, 'f' \
                  FROM unnest($1::text[]) p";
    let orders = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
            .fetch_one(db)
            .await
            .unwrap()
    };

    // One row of the statement names no product: nothing of it is written.
    let err = sqlx::query(insert)
        .bind(vec!["kept", "missing"])
        .execute(db)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "23503", "{err}");
    assert_eq!(orders().await, 0);
    // A cart's line likewise.
    let err = sqlx::query(
        "WITH o AS (INSERT INTO orders (order_id, user_id, unit_price_cents, total_cents, status, \
                    idempotency_key, request_fingerprint) \
                    VALUES (gen_random_uuid(), 'u', 0, 100, 'confirmed', 'cart', 'f') RETURNING order_id) \
         INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents) \
         SELECT order_id, 'missing', 1, 100 FROM o",
    )
    .execute(db)
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&err), "23503", "{err}");
    assert_eq!(orders().await, 0);

    // A product with an order is neither deleted nor re-keyed, and an order's product
    // changes only to one that exists.
    sqlx::query(insert)
        .bind(vec!["kept"])
        .execute(db)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE orders SET product_id = 'missing' WHERE product_id = 'kept'")
        .execute(db)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "23503", "{err}");
    for statement in [
        "DELETE FROM products WHERE product_id = 'kept'",
        "UPDATE products SET product_id = 'rekeyed' WHERE product_id = 'kept'",
    ] {
        let err = sqlx::query(statement).execute(db).await.unwrap_err();
        assert_eq!(sqlstate(&err), "23503", "{statement}: {err}");
    }

    // An order not yet committed holds its product: the delete waits for it, then finds it.
    let mut tx = db.begin().await.unwrap();
    sqlx::query(insert)
        .bind(vec!["raced"])
        .execute(&mut *tx)
        .await
        .unwrap();
    let deleting = {
        let db = db.clone();
        tokio::spawn(async move {
            sqlx::query("DELETE FROM products WHERE product_id = 'raced'")
                .execute(&db)
                .await
        })
    };
    wait_for(
        "the delete waits on the uncommitted order's lock",
        Duration::from_secs(10),
        || async { sessions_waiting(db, "Lock", "DELETE FROM products%").await == 1 },
    )
    .await;
    tx.commit().await.unwrap();
    let err = deleting.await.unwrap().unwrap_err();
    assert_eq!(sqlstate(&err), "23503", "{err}");
    assert_eq!(
        stock_on(db, "raced").await,
        10,
        "the product is still there"
    );
    assert_eq!(orders().await, 2);
}

/// `stockgate token` in a directory with a `.env`: `.env` supplies what the environment
/// lacks (the token it prints verifies with `.env`'s secret), and the real environment wins
/// over it. Mutation seen failing it: `Config::from_env` without `dotenvy::dotenv()` (no
/// secret: exit 2).
#[test]
fn a_dot_env_file_is_read_and_the_real_environment_wins_over_it() {
    let dir = std::env::temp_dir().join(format!("sg-dotenv-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let from_file = "secret-from-the-dot-env-file";
    std::fs::write(
        dir.join(".env"),
        format!("# as .env.example\nSTOCKGATE_TOKEN_SECRET={from_file}\n"),
    )
    .unwrap();
    let token = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_stockgate"));
        cmd.args(["token", "--user", "ada"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .current_dir(&dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run stockgate");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let ada = Caller::User(stockgate::domain::UserId::parse("ada").unwrap());
    let read = token(&[]);
    assert_eq!(
        Tokens::new(from_file).verify(&read).ok(),
        Some(ada.clone()),
        "signed with the .env file's secret"
    );
    let overridden = token(&[("STOCKGATE_TOKEN_SECRET", SECRET)]);
    assert_eq!(Tokens::new(SECRET).verify(&overridden).ok(), Some(ada));
    assert!(Tokens::new(from_file).verify(&overridden).is_err());
    let _ = std::fs::remove_dir_all(dir);
}
