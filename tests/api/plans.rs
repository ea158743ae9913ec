//! Plans that do not depend on the planner's statistics (issue #31): on a new deployment,
//! whose tables were never analyzed, the order paths probe indexes and never scan the
//! tables they write, however the plans were cached while the tables looked empty.

use crate::helpers::*;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Every table the order paths read or write: the orders, carts, holds and restocks and
/// their keys, the products they lock and judge (stock, limits, sale windows), the lines a
/// limit counts (`customer_units` reads `hold_lines` on every limited order) and the events
/// their triggers write.
const TABLES: [&str; 10] = [
    "orders",
    "holds",
    "order_lines",
    "restocks",
    "hold_lines",
    "products",
    "stock_levels",
    "locations",
    "transfers",
    "event_rows",
];

/// Tables measured and reported but not judged: the order paths only append to `event_rows`
/// (their triggers), but the feed's watcher and purge, which run in the same service, read it,
/// and on a deployment without statistics they read all of it: `feed::newest` orders by its
/// output column `xid` (`xid::text::int8`, which no index serves), so every tick (4 a second
/// per instance) reads and sorts every event below the horizon; the purge's first plan scans
/// the table and sorts it. Judged here once `src/events/feed.rs` no longer does (issue #48,
/// item 7).
const READ_BY_THE_FEED: [&str; 1] = ["event_rows"];

/// Per table: (sequential scans, index entries read, index blocks touched), every backend of
/// the database but this one ended first so their pending statistics are flushed.
async fn scans(pool: &sqlx::PgPool) -> BTreeMap<String, (i64, i64, i64)> {
    flush_other_backends(pool).await;
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .unwrap();
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT t.relname::text, coalesce(t.seq_scan, 0), \
                coalesce((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i WHERE i.relid = t.relid), 0)::int8, \
                coalesce((SELECT sum(i.idx_blks_hit + i.idx_blks_read) FROM pg_statio_user_indexes i WHERE i.relid = t.relid), 0)::int8 \
         FROM pg_stat_user_tables t WHERE t.relname = ANY($1)",
    )
    .bind(&TABLES[..])
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(t, s, i, b)| (t, (s, i, b)))
        .collect()
}

/// A fresh database on the shared cluster, with autovacuum off on the order paths' tables so
/// that nothing analyzes them, and a pool on it; then a service on it with [`app_on`].
async fn unanalyzed_database() -> (String, sqlx::PgPool) {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let pool = sqlx::PgPool::connect(&cluster.primary_url(&db))
        .await
        .unwrap();
    sqlx::raw_sql(
        "ALTER TABLE orders SET (autovacuum_enabled = off); \
         ALTER TABLE holds SET (autovacuum_enabled = off); \
         ALTER TABLE order_lines SET (autovacuum_enabled = off); \
         ALTER TABLE restocks SET (autovacuum_enabled = off); \
         ALTER TABLE hold_lines SET (autovacuum_enabled = off); \
         ALTER TABLE products SET (autovacuum_enabled = off); \
         ALTER TABLE event_rows SET (autovacuum_enabled = off); \
         ALTER TABLE stock_levels SET (autovacuum_enabled = off); \
         ALTER TABLE locations SET (autovacuum_enabled = off); \
         ALTER TABLE transfers SET (autovacuum_enabled = off);",
    )
    .execute(&pool)
    .await
    .unwrap();
    // A catalogue and a history, never analyzed: on a few pages a sequential scan is the
    // cheapest plan and says nothing, on many it reads them all. 20,000 products, 10,000
    // released holds of two lines each, 20,000 rows of events.
    sqlx::raw_sql(
        "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) \
           SELECT 'filler-' || i, 'Filler ' || i, 100, 10, 10 FROM generate_series(1, 20000) i; \
         INSERT INTO holds (hold_id, user_id, idempotency_key, request_fingerprint, status, expires_at, ended_at) \
           SELECT ('00000000-0000-4000-8000-' || lpad(i::text, 12, '0'))::uuid, 'filler-' || i, 'k', 'fp', \
                  'released', now(), now() FROM generate_series(1, 10000) i; \
         INSERT INTO hold_lines (hold_id, product_id, quantity) \
           SELECT ('00000000-0000-4000-8000-' || lpad(i::text, 12, '0'))::uuid, 'filler-' || (i + j), 1 \
           FROM generate_series(1, 10000) i, generate_series(0, 1) j; \
         INSERT INTO event_rows (types, items, k) \
           SELECT '{stock.changed}', json_build_array(json_build_object('type', 'stock.changed', \
                  'data', json_build_object('product_id', 'filler-' || i, 'delta', 10, \
                  'available_quantity', 10, 'reason', 'create'))), 1 \
           FROM generate_series(1, 20000) i;",
    )
    .execute(&pool)
    .await
    .unwrap();
    (db, pool)
}

async fn app_on(db: &str) -> TestApp {
    let cluster = shared_cluster();
    spawn_app_with(AppOptions {
        database: Some(db.to_string()),
        ..AppOptions::new(cluster)
    })
    .await
}

async fn send(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    user: &str,
    key: Option<String>,
    body: Value,
) -> (StatusCode, Value) {
    send_as(app, method, path, user, key.as_deref(), body).await
}

/// A fresh database (tables never analyzed, autovacuum off for them so nothing analyzes
/// them meanwhile), and a few thousand orders, refusals, carts, holds with their endings,
/// cancels and keyed restocks through the service, on products with and without a
/// per-customer limit, starting with batched carts while `orders` is empty: not one sequential
/// scan of the tables the order paths write, and a bounded number of index entries read per
/// request (a full scan of a key index under a hash join would read the whole table per
/// batch). Mutations seen failing it: without migration 20261202000002 (the batch function's
/// planner settings) the batches' cached key lookups scan `orders`; without migration
/// 20261203000001 the cart batches' key lookup and the `order.confirmed` trigger on
/// `order_lines` do. With 20,000 products and 20,000 hold lines already there, a hold's
/// confirm that joins `hold_lines` to `products` for its lines' prices hashes the whole of
/// `products` (100 scans), and the sweeper's `units_held` and `expire_due` (every second) scan
/// `hold_lines`: each seen failing it before `holds::order_from` took its prices by key and
/// the two sweeper statements went from the holds to their lines by key (mutations: either
/// statement back to its join).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_order_paths_never_scan_their_tables_on_a_deployment_without_statistics() {
    let (db, pool) = unanalyzed_database().await;
    let before = scans(&pool).await;
    let app = app_on(&db).await;
    app.create_product("plan-hot", 100_000, 100).await;
    app.create_product("plan-gone", 0, 100).await;
    for i in 0..20 {
        app.create_product(&format!("plan-{i}"), 100_000, 100).await;
    }
    // Limited products: every batch, cart and hold on them counts its users' units
    // (`customer_units`), which must probe indexes too.
    let limited = json!({"product_id": "plan-lim", "name": "limited", "price_cents": 100, "available_quantity": 100_000, "max_per_customer": 2});
    let r = app.post_product(&limited).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    for i in 0..20 {
        let r = app
            .client
            .patch(app.url(&format!("/v1/products/plan-{i}")))
            .bearer_auth(&app.admin)
            .json(&json!({"max_per_customer": 10_000}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }

    let mut requests = 0usize;
    // First, while `orders` is still empty (as on a new deployment's first sale), three-line
    // carts 32 at a time on products without a limit: they are placed in batches (many keys
    // looked up at once, many orders and lines inserted by one statement).
    for i in 0..20 {
        app.create_product(&format!("plan-f{i}"), 100_000, 100)
            .await;
    }
    let carts: Vec<(StatusCode, Value)> = futures::stream::iter(0..400)
        .map(|i| {
            let lines: Vec<Value> = (0..3)
                .map(
                    |k| json!({"product_id": format!("plan-f{}", (i + k * 7) % 20), "quantity": 1}),
                )
                .collect();
            let app = &app;
            async move {
                send(
                    app,
                    reqwest::Method::POST,
                    "/v1/orders",
                    &format!("f{i}"),
                    Some(format!("cart{i}")),
                    json!({"lines": lines}),
                )
                .await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    requests += carts.len();
    assert!(
        carts.iter().all(|(s, _)| *s == StatusCode::CREATED),
        "{:?}",
        carts.iter().find(|(s, _)| *s != StatusCode::CREATED)
    );
    // Orders on the hot product, 32 at a time (they batch), and refusals of a sold-out one.
    let orders: Vec<(StatusCode, Value)> = futures::stream::iter(0..3000)
        .map(|i| {
            let (product, user) = if i % 4 == 3 {
                ("plan-gone", format!("r{i}"))
            } else if i % 4 == 2 {
                ("plan-lim", format!("l{i}"))
            } else {
                ("plan-hot", format!("b{}", i % 50))
            };
            let app = &app;
            async move {
                send(
                    app,
                    reqwest::Method::POST,
                    "/v1/orders",
                    &user,
                    Some(format!("k{i}")),
                    json!({"product_id": product, "quantity": 1}),
                )
                .await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    requests += orders.len();
    let created = orders
        .iter()
        .filter(|(s, _)| *s == StatusCode::CREATED)
        .count();
    let refused = orders
        .iter()
        .filter(|(s, _)| *s == StatusCode::CONFLICT)
        .count();
    assert_eq!(
        (created, refused),
        (2250, 750),
        "{:?}",
        orders
            .iter()
            .find(|(s, _)| !s.is_success() && *s != StatusCode::CONFLICT)
    );
    // Replays of some of them: the key lookups.
    for i in 0..100 {
        let (s, _) = send(
            &app,
            reqwest::Method::POST,
            "/v1/orders",
            &format!("b{}", i % 50),
            Some(format!("k{i}")),
            json!({"product_id": "plan-hot", "quantity": 1}),
        )
        .await;
        assert!(s.is_success() || s == StatusCode::CONFLICT, "{s}");
        requests += 1;
    }
    // Carts, holds (half confirmed, a quarter released), cancels, keyed restocks.
    let mut order_ids = Vec::new();
    for i in 0..200 {
        let lines = json!([{"product_id": format!("plan-{}", i % 20), "quantity": 1}, {"product_id": format!("plan-{}", (i + 7) % 20), "quantity": 2}]);
        let (s, cart) = send(
            &app,
            reqwest::Method::POST,
            "/v1/orders",
            &format!("c{i}"),
            Some(format!("cart{i}")),
            json!({"lines": lines}),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{cart}");
        order_ids.push((format!("c{i}"), parse::<Order>(&cart).order_id));
        let (s, hold) = send(
            &app,
            reqwest::Method::POST,
            "/v1/holds",
            &format!("h{i}"),
            Some(format!("hold{i}")),
            json!({"lines": lines}),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{hold}");
        let id = parse::<Hold>(&hold).hold_id;
        requests += 2;
        if i % 2 == 0 {
            let (s, _) = send(
                &app,
                reqwest::Method::POST,
                &format!("/v1/holds/{id}/confirm"),
                &format!("h{i}"),
                None,
                json!({}),
            )
            .await;
            assert_eq!(s, StatusCode::CREATED);
            requests += 1;
        } else if i % 4 == 1 {
            let (s, _) = send(
                &app,
                reqwest::Method::DELETE,
                &format!("/v1/holds/{id}"),
                &format!("h{i}"),
                None,
                json!({}),
            )
            .await;
            assert_eq!(s, StatusCode::OK);
            requests += 1;
        }
    }
    for (user, id) in order_ids.iter().take(50) {
        let (s, _) = send(
            &app,
            reqwest::Method::POST,
            &format!("/v1/orders/{id}/cancel"),
            user,
            None,
            json!({}),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        requests += 1;
    }
    for i in 0..50 {
        let resp = app
            .client
            .post(app.url(&format!("/v1/products/plan-{}/restock", i % 20)))
            .bearer_auth(&app.admin)
            .header("Idempotency-Key", format!("rs{i}"))
            .json(&json!({"quantity": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        requests += 1;
    }
    drop(app);
    let after = scans(&pool).await;
    // Precondition: the first carts really were placed in batches (many carts' rows per
    // transaction), which is what the plans had to hold for. (Read after the scans are
    // counted: this count is itself a scan.)
    let (rows, transactions): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT xmin::text) FROM orders WHERE user_id LIKE 'f%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        transactions * 2 < rows,
        "{rows} carts written by {transactions} transactions"
    );

    let analyzed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname = ANY($1) \
         AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)",
    )
    .bind(&TABLES[..])
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(analyzed, 0, "the tables were never analyzed");
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(total >= 3000, "{total} rows in orders");
    let mut report = Vec::new();
    for t in TABLES {
        let (s0, i0, b0) = before.get(t).copied().unwrap_or_default();
        let (s1, i1, b1) = after.get(t).copied().unwrap_or_default();
        report.push(format!(
            "{t}: {} seq scans, {} index entries read, {} index blocks touched",
            s1 - s0,
            i1 - i0,
            b1 - b0
        ));
    }
    println!("{} requests; {}", requests, report.join("; "));
    for t in TABLES.into_iter().filter(|t| !READ_BY_THE_FEED.contains(t)) {
        let (s0, i0, _) = before.get(t).copied().unwrap_or_default();
        let (s1, i1, _) = after.get(t).copied().unwrap_or_default();
        assert_eq!(s1 - s0, 0, "sequential scans of {t}: {report:?}");
        let per_request = (i1 - i0) as f64 / requests as f64;
        assert!(
            per_request <= 20.0,
            "{t}: {per_request:.1} index entries read per request: {report:?}"
        );
    }
}

/// The idempotency window's purge finds old refusals through `orders_refused_by_age` without
/// walking it: with 20,000 refusals younger than the window, each purge (every instance's
/// sweeper runs one a second) reads next to nothing of the index. Mutation seen failing it:
/// the cutoff computed from `clock_timestamp()` (volatile, so not an index condition), which
/// read every refusal each second (1.7 s a statement at 1.2 M refusals in `bench/soak.sh`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_reads_only_refusals_past_the_window() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("purge-p", 0, 100).await;
    sqlx::query(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
         SELECT gen_random_uuid(), 'purge-p', 'purge-u', 1, 0, 0, 'refused', 'k' || g, 'purge-p:1' FROM generate_series(1, 20000) g",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let index = |pool: sqlx::PgPool| async move {
        flush_other_backends(&pool).await;
        let mut conn = pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT idx_scan, idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'orders_refused_by_age'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap()
    };
    let before = index(app.primary.clone()).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let after = loop {
        let now = index(app.primary.clone()).await;
        if now.0 >= before.0 + 3 {
            break now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no three purges within 20 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let per_scan = (after.1 - before.1) / (after.0 - before.0);
    assert!(
        per_scan < 100,
        "each purge read {per_scan} entries of the refusals' index (20,000 younger than the window)"
    );
}

/// A per-customer allowance (`customer_units`) reads the buyer's own confirmed orders, and
/// nothing else, on a table that has grown: 100,000 refusals of other buyers, and 2,000 of
/// each buyer here, all in the idempotency window (never analyzed). Limited orders then touch
/// a few of `orders`' index blocks each (a normal run: 11 entries and 21 blocks per order).
/// Precondition, asserted: the allowance really counted each buyer's 20 orders (the 21st is
/// refused at the limit) and none of its refusals (all 20 were sold).
/// Mutations seen failing it: the allowance's read without `status = 'confirmed'` inside its
/// fence (no index leads with `user_id` for it then; it walked the whole key-first index:
/// 2,011 entries and 895 blocks per order); the schema before migrations 20261203000002–4
/// (the user-first index, each buyer's refusals read too: 2,011 entries per order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowance_reads_the_buyers_confirmed_orders_only_on_a_grown_table() {
    let (db, pool) = unanalyzed_database().await;
    sqlx::raw_sql(
        "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity, max_per_customer) \
           VALUES ('allow-old', 'sold out', 100, 0, 0, NULL), ('allow-lim', 'limited', 100, 100000, 100000, 20); \
         INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
           SELECT gen_random_uuid(), 'allow-old', 'other' || g, 1, 100, 0, 'refused', 'old' || g, 'allow-old:1' \
             FROM generate_series(1, 100000) g \
           UNION ALL \
           SELECT gen_random_uuid(), 'allow-old', 'buyer' || (g % 10), 1, 100, 0, 'refused', 'old' || g, 'allow-old:1' \
             FROM generate_series(1, 20000) g;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let before = scans(&pool).await;
    let app = app_on(&db).await;
    let buyers = 10;
    let answers: Vec<(StatusCode, Value)> = futures::stream::iter(0..buyers * 21)
        .map(|i| {
            let app = &app;
            async move {
                send(
                    app,
                    reqwest::Method::POST,
                    "/v1/orders",
                    &format!("buyer{}", i % buyers),
                    Some(format!("new{i}")),
                    json!({"product_id": "allow-lim", "quantity": 1}),
                )
                .await
            }
        })
        .buffered(8)
        .collect()
        .await;
    let (sold, over) = answers.split_at(buyers * 20);
    assert!(
        sold.iter().all(|(s, _)| *s == StatusCode::CREATED),
        "{:?}",
        sold.iter().find(|(s, _)| *s != StatusCode::CREATED)
    );
    assert!(
        over.iter().all(|(s, b)| *s == StatusCode::CONFLICT
            && b["error"]["code"] == "LIMIT_EXCEEDED"
            && b["error"]["already"] == 20),
        "{over:?}"
    );
    let requests = answers.len() as i64;
    drop(app);
    let after = scans(&pool).await;
    let (s0, i0, b0) = before["orders"];
    let (s1, i1, b1) = after["orders"];
    let report = format!(
        "{requests} limited orders: {} seq scans, {} index entries read, {} index blocks touched",
        s1 - s0,
        i1 - i0,
        b1 - b0
    );
    println!("{report}");
    assert_eq!(s1 - s0, 0, "{report}");
    assert!((i1 - i0) / requests <= 50, "{report}");
    assert!((b1 - b0) / requests <= 60, "{report}");
}
