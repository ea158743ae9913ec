//! Migrating a database that already has sales, holds and refusals to locations
//! (`20261205000002_locations.sql`) keeps every number, and the service then gives back to
//! where the migration says units came from.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};

const LOCATIONS: i64 = 20261205000002;

// Mutation: the migration's backfill without the cart rows (`orders.allocations` left `[]`
// for carts): the cart's allocations are not its lines, and its cancel gives nothing back.
// Mutation: `stock_levels` seeded with 0 instead of each product's count: the levels disagree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrating_a_database_with_sales_holds_and_refusals_keeps_every_number() {
    let cluster = shared_cluster();
    let (db, url, pool) = database_before(cluster, LOCATIONS).await;
    // The history, as the binary before locations would have written it: one count each.
    sqlx::raw_sql(
        "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) VALUES \
           ('m1', 'one', 100, 7, 10), ('m2', 'two', 200, 3, 6), ('m3', 'three', 300, 8, 10); \
         INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, \
                             idempotency_key, request_fingerprint) VALUES \
           ('00000000-0000-7000-8000-000000000001', 'm1', 'u1', 2, 100, 200, 'confirmed', 'k1', 'm1:2'), \
           ('00000000-0000-7000-8000-000000000002', 'm1', 'u2', 1, 100, 100, 'cancelled', 'k2', 'm1:1'), \
           ('00000000-0000-7000-8000-000000000003', 'm2', 'u3', 9, 0, 0, 'refused', 'k3', 'm2:9'), \
           ('00000000-0000-7000-8000-000000000004', NULL, 'u4', NULL, 0, 500, 'confirmed', 'k4', 'cart:m1:1,m2:2'); \
         INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents) VALUES \
           ('00000000-0000-7000-8000-000000000004', 'm1', 1, 100), \
           ('00000000-0000-7000-8000-000000000004', 'm2', 2, 200); \
         INSERT INTO holds (hold_id, user_id, idempotency_key, request_fingerprint, status, expires_at, ended_at) VALUES \
           ('00000000-0000-7000-8000-000000000011', 'u5', 'h1', 'fp', 'held', now() + interval '1 hour', NULL), \
           ('00000000-0000-7000-8000-000000000012', 'u6', 'h2', 'fp', 'released', now(), now()); \
         INSERT INTO hold_lines (hold_id, product_id, quantity) VALUES \
           ('00000000-0000-7000-8000-000000000011', 'm1', 1), ('00000000-0000-7000-8000-000000000011', 'm3', 2), \
           ('00000000-0000-7000-8000-000000000012', 'm2', 1);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let counts = "SELECT product_id, available_quantity FROM products ORDER BY 1";
    let was: Vec<(String, i32)> = sqlx::query_as(counts).fetch_all(&pool).await.unwrap();

    stockgate::startup::migrate(&url)
        .await
        .expect("migrate to locations");

    let now: Vec<(String, i32)> = sqlx::query_as(counts).fetch_all(&pool).await.unwrap();
    assert_eq!(now, was, "no product's count moved");
    let levels: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT product_id, location_id, available_quantity FROM stock_levels ORDER BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let want: Vec<(String, String, i32)> = was
        .iter()
        .map(|(p, q)| (p.clone(), "default".to_string(), *q))
        .collect();
    assert_eq!(levels, want, "every unit is at default");
    let alloc = |table: &str, id: &str| {
        let sql = format!(
            "SELECT allocations FROM {table} WHERE {table}.{}_id = $1::uuid",
            &table[..table.len() - 1]
        );
        let pool = pool.clone();
        let id = id.to_string();
        async move {
            sqlx::query_scalar::<_, Value>(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let at = |p: &str, q: i64| json!({"product_id": p, "location_id": "default", "quantity": q});
    assert_eq!(
        alloc("orders", "00000000-0000-7000-8000-000000000001").await,
        json!([at("m1", 2)])
    );
    assert_eq!(
        alloc("orders", "00000000-0000-7000-8000-000000000002").await,
        json!([at("m1", 1)])
    );
    assert_eq!(
        alloc("orders", "00000000-0000-7000-8000-000000000003").await,
        json!([])
    );
    assert_eq!(
        alloc("orders", "00000000-0000-7000-8000-000000000004").await,
        json!([at("m1", 1), at("m2", 2)])
    );
    assert_eq!(
        alloc("holds", "00000000-0000-7000-8000-000000000011").await,
        json!([at("m1", 1), at("m3", 2)])
    );

    // The service gives back where the migration says: the cart's cancel and the hold's release.
    let app = spawn_app_with(AppOptions {
        database: Some(db.clone()),
        ..AppOptions::new(cluster)
    })
    .await;
    let cancel = app
        .client
        .post(app.url("/v1/orders/00000000-0000-7000-8000-000000000004/cancel"))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), StatusCode::OK);
    let release = app
        .client
        .delete(app.url("/v1/holds/00000000-0000-7000-8000-000000000011"))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(release.status(), StatusCode::OK);
    let after: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT p.product_id, p.available_quantity, s.available_quantity \
           FROM products p JOIN stock_levels s ON s.product_id = p.product_id ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        after,
        vec![
            ("m1".to_string(), 9, 9),
            ("m2".to_string(), 5, 5),
            ("m3".to_string(), 10, 10)
        ]
    );
    app.stop().await;
}
