//! Orders spread over many products (issue #31's normal day): the batches of products that
//! are ready at the same moment share one primary statement and one commit, and nothing is
//! oversold or split by it.

use crate::helpers::*;
use futures::StreamExt;
use reqwest::StatusCode;
use stockgate::routing::policy::QueryClass;

/// 900 orders over 60 products of 5 units each, 64 at a time, on two instances: every product
/// sells exactly its 5 units, stock and orders add up, every answer is 201 or 409, and
/// batches of several products committed together: judged from the database, not from the
/// service's counters, the confirmed orders were written by fewer transactions (distinct
/// `xmin`) than (transaction, product) pairs, as `carts.rs` judges carts. Mutations seen
/// failing it: the combiner running every batch alone (`MAX_COMBINED = 1`); the same with
/// `order_transactions` counted only for combined statements (the counters then still said
/// "shared", the rows did not).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_over_many_products_commit_together_and_sell_exactly_the_stock() {
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    let products: Vec<String> = (0..60).map(|i| format!("spread-{i:02}")).collect();
    for p in &products {
        assert_eq!(
            a.create_product(p, 5, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let answers: Vec<(usize, StatusCode)> = futures::stream::iter(0..900usize)
        .map(|i| {
            let app = if i % 2 == 0 { &a } else { &b };
            let product = &products[(i * 7) % products.len()];
            async move {
                let r = app
                    .order(&format!("spread-buyer-{i}"), "k", product, 1)
                    .await;
                (i, r.status())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let created = answers
        .iter()
        .filter(|(_, s)| *s == StatusCode::CREATED)
        .count();
    for (i, s) in &answers {
        assert!(
            *s == StatusCode::CREATED || *s == StatusCode::CONFLICT,
            "order {i}: {s}"
        );
    }
    assert_eq!(created, 300, "every unit sold once");
    for p in &products {
        assert_eq!(a.stock_on_primary(p).await, 0, "{p}");
        assert_eq!(a.confirmed_orders(p).await, (5, 5), "{p}");
    }
    // The orders' own rows: the transaction that wrote each (no order was updated since).
    let (pairs, transactions, widest): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT tx), coalesce(max(n), 0) FROM ( \
           SELECT xmin::text AS tx, count(DISTINCT product_id) AS n FROM orders \
           WHERE status = 'confirmed' AND product_id LIKE 'spread-%' GROUP BY xmin::text) t, \
         LATERAL generate_series(1, t.n::int)",
    )
    .fetch_one(&a.primary)
    .await
    .unwrap();
    eprintln!(
        "{pairs} (transaction, product) pairs in {transactions} transactions, up to {widest} products in one"
    );
    assert!(
        transactions < pairs && widest >= 2,
        "{pairs} product batches committed in {transactions} transactions: none shared one"
    );
}

/// The stock gate is read only where it could say "no": 60 orders for a product with stock,
/// 16 at a time, make no stock-gate read at all (each goes straight to its batch, which
/// decides on the primary), while they all sell. Mutation seen failing it: `place_inner`
/// reading the gate for every order (1 read, not 0: the first order missed the cache, and
/// every batch's answer refilled it for the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_for_a_product_with_stock_make_no_stock_gate_read() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        app.create_product("gateless", 1000, 100).await.status(),
        StatusCode::CREATED
    );
    let gate_reads = || async {
        decisions(&app, QueryClass::StockGate)
            .await
            .values()
            .sum::<f64>()
    };
    let before = gate_reads().await;
    let answers: Vec<StatusCode> = futures::stream::iter(0..60usize)
        .map(|i| {
            let app = &app;
            async move {
                app.order(&format!("gateless-{i}"), "k", "gateless", 1)
                    .await
                    .status()
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(
        answers.iter().all(|s| *s == StatusCode::CREATED),
        "{answers:?}"
    );
    assert_eq!(app.stock_on_primary("gateless").await, 940);
    assert_eq!(
        gate_reads().await - before,
        0.0,
        "stock-gate reads for orders"
    );
    // The counter does count gate reads: an availability check of a product this instance
    // never saw reads the gate once.
    app.create_product("gate-probe", 1, 100).await;
    assert_eq!(
        app.availability("gate-probe", 1).await.status(),
        StatusCode::OK
    );
    assert!(
        gate_reads().await - before >= 1.0,
        "the gate read was not counted"
    );
}

/// One order statement runs at a time, but one stuck on a held row lock does not hold up the
/// other products: while a long transaction holds `stall-a`'s row and a batch for it waits
/// on the lock, orders for three other products are answered 201, one after another, and that
/// batch is still waiting, its buyer still unanswered, when they are. Then the lock goes and
/// that buyer gets the unit too. Mutation seen failing it: the stalled statement keeping its
/// place (the next statement waits behind it, and `stall-b` is answered 503 `TIMEOUT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_waiting_on_a_held_row_does_not_hold_up_other_products() {
    let app = spawn_app(shared_cluster()).await;
    for p in ["stall-a", "stall-b", "stall-c", "stall-d"] {
        app.create_product(p, 5, 100).await;
    }
    let lock = app.lock_rows(&["stall-a"]).await;
    let waiting = crate::retries::order_in_background(&app, "ann", "a1", "stall-a", 1);
    wait_for(
        "the batch for stall-a waiting on its row",
        std::time::Duration::from_secs(10),
        || async { batches_waiting_on(&app.primary, "Lock").await == 1 },
    )
    .await;
    for (i, p) in ["stall-b", "stall-c", "stall-d"].iter().enumerate() {
        let r = app.order("bob", &format!("b{i}"), p, 1).await;
        assert_eq!(r.status(), StatusCode::CREATED, "{p}: {:?}", r.text().await);
    }
    assert_eq!(
        batches_waiting_on(&app.primary, "Lock").await,
        1,
        "stall-a's batch still waits on its row"
    );
    assert!(!waiting.is_finished(), "and its buyer is still unanswered");
    assert!(app.metric("stockgate_order_statements_stalled_total").await >= 1.0);
    lock.commit().await.unwrap();
    assert_eq!(waiting.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(app.stock_on_primary("stall-a").await, 4);
}

/// A hot product's large batches (eight orders or more) run in a lane of their own, so they
/// never wait for a statement of quiet products' batches to finish before theirs can start:
/// sold beside orders spread over quiet products, no transaction that wrote eight or more of
/// the hot product's orders wrote a quiet product's order too, while the quiet products'
/// batches still share statements among themselves. Judged from the rows' `xmin`. Mutation
/// seen failing it: every batch sent to the small lane (`LARGE = usize::MAX`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_products_large_batches_commit_apart_from_the_quiet_products_batches() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    assert_eq!(
        app.create_product("lane-hot", 100_000, 100).await.status(),
        StatusCode::CREATED
    );
    let quiet: Vec<String> = (0..40).map(|i| format!("lane-q-{i:02}")).collect();
    for p in &quiet {
        assert_eq!(
            app.create_product(p, 100, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let answers: Vec<StatusCode> = futures::stream::iter(0..1200usize)
        .map(|i| {
            let product = match i % 2 {
                0 => "lane-hot",
                _ => quiet[(i * 7) % quiet.len()].as_str(),
            };
            let app = &app;
            async move {
                app.order(&format!("lane-buyer-{i}"), "k", product, 1)
                    .await
                    .status()
            }
        })
        .buffer_unordered(96)
        .collect()
        .await;
    assert!(
        answers.iter().all(|s| *s == StatusCode::CREATED),
        "{answers:?}"
    );
    // Per transaction (no order was updated since): the hot orders it wrote, the quiet ones,
    // and the quiet products.
    let per_tx: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE product_id = 'lane-hot'), \
                count(*) FILTER (WHERE product_id <> 'lane-hot'), \
                count(DISTINCT product_id) FILTER (WHERE product_id <> 'lane-hot') \
         FROM orders WHERE status = 'confirmed' GROUP BY xmin::text",
    )
    .fetch_all(&app.primary)
    .await
    .unwrap();
    let large = per_tx.iter().filter(|(hot, _, _)| *hot >= 8).count();
    let mixed: Vec<_> = per_tx
        .iter()
        .filter(|(hot, quiet, _)| *hot >= 8 && *quiet > 0)
        .collect();
    eprintln!(
        "{} transactions, {large} with a large hot batch, {} of them with quiet orders",
        per_tx.len(),
        mixed.len()
    );
    assert!(large > 0, "no large batch formed: {per_tx:?}");
    assert!(
        per_tx.iter().any(|(_, _, products)| *products >= 2),
        "no two quiet products' batches shared a statement: {per_tx:?}"
    );
    assert!(
        mixed.is_empty(),
        "large hot batches committed with quiet orders (hot, quiet, quiet products): {mixed:?}"
    );
}
