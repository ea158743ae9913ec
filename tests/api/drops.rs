//! Flash drops: per-customer limits and sale windows, decided on the primary in the
//! transaction that takes the stock, whatever the replicas, instances and keys.

use crate::carts::lines;
use crate::helpers::*;
use futures::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::time::Duration;

async fn order(
    app: &TestApp,
    user: &str,
    key: &str,
    product: &str,
    qty: i64,
) -> (StatusCode, Value) {
    let body = json!({"product_id": product, "quantity": qty});
    send_as(app, Method::POST, "/v1/orders", user, Some(key), body).await
}

async fn cart(app: &TestApp, user: &str, key: &str, items: &[(&str, i64)]) -> (StatusCode, Value) {
    let body = json!({"lines": lines(items)});
    send_as(app, Method::POST, "/v1/orders", user, Some(key), body).await
}

async fn hold(app: &TestApp, user: &str, key: &str, items: &[(&str, i64)]) -> (StatusCode, Value) {
    let body = json!({"lines": lines(items), "ttl_s": 600});
    send_as(app, Method::POST, "/v1/holds", user, Some(key), body).await
}

/// Creates a product with drop rules (`extra` is merged into the body).
async fn create(app: &TestApp, id: &str, stock: i64, extra: Value) -> (StatusCode, Value) {
    let mut body =
        json!({"product_id": id, "name": id, "price_cents": 100, "available_quantity": stock});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let r = app.post_product(&body).await;
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

async fn patch(app: &TestApp, id: &str, token: &str, body: Value) -> (StatusCode, Value) {
    let r = app
        .client
        .patch(app.url(&format!("/v1/products/{id}")))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

/// Units `user` holds of `product` on the primary: confirmed orders (single and cart lines)
/// and live holds, counted from the tables, not by the service.
async fn units_of(app: &TestApp, user: &str, product: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE(SUM(q), 0)::int8 FROM ( \
           SELECT quantity AS q FROM orders WHERE status = 'confirmed' AND user_id = $1 AND product_id = $2 \
           UNION ALL SELECT l.quantity FROM order_lines l JOIN orders o USING (order_id) \
             WHERE o.status = 'confirmed' AND o.user_id = $1 AND o.product_id IS NULL AND l.product_id = $2 \
           UNION ALL SELECT l.quantity FROM hold_lines l JOIN holds h USING (hold_id) \
             WHERE h.status = 'held' AND h.user_id = $1 AND l.product_id = $2) s",
    )
    .bind(user)
    .bind(product)
    .fetch_one(&app.primary)
    .await
    .unwrap()
}

/// Rows of any kind (orders, refusals, holds) that name `product` or claim one of `user`'s keys.
async fn rows_written(app: &TestApp, product: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM orders WHERE product_id = $1) \
              + (SELECT count(*) FROM order_lines WHERE product_id = $1) \
              + (SELECT count(*) FROM hold_lines WHERE product_id = $1)",
    )
    .bind(product)
    .fetch_one(&app.primary)
    .await
    .unwrap()
}

/// The first scenario. 30 users × 5 one-unit attempts (orders, and for every third user
/// a hold first), spread over two instances, with both replicas paused and proven a second
/// behind: every user ends with exactly 2 units, every excess is `LIMIT_EXCEEDED` with its
/// limit and what the user already had, and a retry of a limited key on the other instance
/// stays 409. Mutations seen failing it: the batch's limit check removed (buyers got 5), the
/// count without hold lines, or holds without `judge_lines`' limit step (hold users got 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_users_five_attempts_on_two_instances_get_exactly_their_limit() {
    let cluster = private_cluster();
    let a = spawn_app(&cluster).await;
    let b = spawn_beside(&a, &cluster).await;
    let (s, body) = create(&a, "drop-2", 1000, json!({"max_per_customer": 2})).await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    assert_eq!(body["max_per_customer"], 2);
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    for i in 1..=2 {
        blocking(|| cluster.pause_replay(i)).unwrap();
    }
    let wal = WalTicker::start(a.primary.clone());
    a.wait_for(
        "both replicas over 1 s behind",
        Duration::from_secs(20),
        || async {
            a.replica_states()
                .await
                .iter()
                .all(|(_, _, ms)| ms.is_some_and(|ms| ms > 1000))
        },
    )
    .await;
    drop(wal);

    let answers: Vec<(usize, usize, StatusCode, Value)> = futures::stream::iter(0..150usize)
        .map(|n| {
            let (user, attempt) = (n % 30, n / 30);
            let app = if n % 2 == 0 { &a } else { &b };
            async move {
                let name = format!("buyer-{user}");
                let key = format!("k{attempt}");
                let (s, body) = if user % 3 == 0 && attempt == 0 {
                    hold(app, &name, &key, &[("drop-2", 1)]).await
                } else {
                    order(app, &name, &key, "drop-2", 1).await
                };
                (user, attempt, s, body)
            }
        })
        .buffer_unordered(150)
        .collect()
        .await;
    let mut limited = vec![];
    for (user, attempt, s, body) in &answers {
        match *s {
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => {
                let e = parse::<ErrorBody>(body).error;
                assert_eq!(
                    (e.code.as_str(), e.limit, e.already),
                    ("LIMIT_EXCEEDED", Some(2), Some(2)),
                    "buyer-{user} k{attempt}: {body}"
                );
                limited.push((*user, *attempt));
            }
            other => panic!("buyer-{user} k{attempt}: {other} {body}"),
        }
    }
    for user in 0..30 {
        let won = answers
            .iter()
            .filter(|(u, _, s, _)| *u == user && *s == StatusCode::CREATED)
            .count();
        assert_eq!(won, 2, "buyer-{user} was told 201 twice");
        assert_eq!(
            units_of(&a, &format!("buyer-{user}"), "drop-2").await,
            2,
            "buyer-{user} holds exactly the limit"
        );
    }
    assert_eq!(limited.len(), 90, "every excess was refused for the limit");
    // A limited key is final, on the other instance too.
    for (user, attempt) in limited
        .iter()
        .filter(|(u, k)| u % 3 != 0 || *k != 0)
        .take(10)
    {
        let again = order(
            &b,
            &format!("buyer-{user}"),
            &format!("k{attempt}"),
            "drop-2",
            1,
        )
        .await;
        assert_error(&again, 409, "LIMIT_EXCEEDED");
    }
    assert_eq!(a.stock_on_primary("drop-2").await, 1000 - 60);
    for i in 1..=2 {
        blocking(|| cluster.resume_replay(i)).unwrap();
    }
}

/// A cart that would pass a limit takes nothing from any line, says the limit, and its key
/// stays refused; a cart within it buys. Mutation seen failing it: `judge_lines` without its
/// limit step (the cart took 2 of `lim`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cart_over_the_limit_takes_nothing() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        create(&app, "lim", 10, json!({"max_per_customer": 2}))
            .await
            .0,
        StatusCode::CREATED
    );
    assert_eq!(
        create(&app, "free", 10, json!({})).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        order(&app, "carter", "one", "lim", 1).await.0,
        StatusCode::CREATED
    );
    let big = cart(&app, "carter", "big", &[("lim", 2), ("free", 1)]).await;
    let e = assert_error(&big, 409, "LIMIT_EXCEEDED");
    assert_eq!(
        (e.product_id.as_deref(), e.limit, e.already),
        (Some("lim"), Some(2), Some(1))
    );
    assert_eq!(app.stock_on_primary("lim").await, 9, "nothing taken");
    assert_eq!(app.stock_on_primary("free").await, 10, "nothing taken");
    let again = cart(&app, "carter", "big", &[("lim", 2), ("free", 1)]).await;
    assert_error_for("the key is final", &again, 409, "LIMIT_EXCEEDED");
    // A hold over the limit is refused the same way.
    let held = hold(&app, "carter", "h", &[("lim", 2)]).await;
    assert_error(&held, 409, "LIMIT_EXCEEDED");
    assert_eq!(app.stock_on_primary("lim").await, 9);
    let (s, body) = cart(&app, "carter", "fits", &[("lim", 1), ("free", 1)]).await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    assert_eq!(units_of(&app, "carter", "lim").await, 2);
}

/// A cancel and a release free units for new keys; the keys refused before stay refused.
/// Mutation seen failing it: `customer_units` counting cancelled orders.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_and_a_release_free_units_for_new_keys() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        create(&app, "lim-c", 10, json!({"max_per_customer": 2}))
            .await
            .0,
        StatusCode::CREATED
    );
    let (s, first) = order(&app, "canceller", "1", "lim-c", 1).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, held) = hold(&app, "canceller", "2", &[("lim-c", 1)]).await;
    assert_eq!(s, StatusCode::CREATED, "{held}");
    let third = order(&app, "canceller", "3", "lim-c", 1).await;
    assert_error(&third, 409, "LIMIT_EXCEEDED");
    let id = parse::<Order>(&first).order_id;
    let (s, _) = send_as(
        &app,
        Method::POST,
        &format!("/v1/orders/{id}/cancel"),
        "canceller",
        None,
        json!({}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        order(&app, "canceller", "4", "lim-c", 1).await.0,
        StatusCode::CREATED,
        "the cancel freed a unit"
    );
    let third = order(&app, "canceller", "3", "lim-c", 1).await;
    assert_error_for("a refused key stays refused", &third, 409, "LIMIT_EXCEEDED");
    let hold_id = parse::<Hold>(&held).hold_id;
    let (s, _) = send_as(
        &app,
        Method::DELETE,
        &format!("/v1/holds/{hold_id}"),
        "canceller",
        None,
        json!({}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        order(&app, "canceller", "5", "lim-c", 1).await.0,
        StatusCode::CREATED,
        "the release freed a unit"
    );
    assert_eq!(units_of(&app, "canceller", "lim-c").await, 2);
}

/// An expiry frees a limited user's units for new keys, like a cancel or a release; the key
/// refused while the hold lived stays refused. Mutation seen failing it: `customer_units`
/// counting expired holds (`y.status IN ('held', 'expired')` in migration 20261203000004).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_frees_units_for_new_keys() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        create(&app, "lim-e", 10, json!({"max_per_customer": 2}))
            .await
            .0,
        StatusCode::CREATED
    );
    let body = json!({"lines": lines(&[("lim-e", 2)]), "ttl_s": 1});
    let (s, held) = send_as(&app, Method::POST, "/v1/holds", "expirer", Some("h"), body).await;
    assert_eq!(s, StatusCode::CREATED, "{held}");
    let hold_id = parse::<Hold>(&held).hold_id;
    // Precondition: the live hold counts against the limit.
    let refused = order(&app, "expirer", "1", "lim-e", 1).await;
    let e = assert_error(&refused, 409, "LIMIT_EXCEEDED");
    assert_eq!((e.limit, e.already), (Some(2), Some(2)));
    // The expiry is the sweeper's ending (the units back in stock). A `GET` says `expired` as
    // soon as `expires_at` passes, but until the sweep the limit still counts the hold.
    app.wait_for("the hold's units back", Duration::from_secs(15), || async {
        app.stock_on_primary("lim-e").await == 10
    })
    .await;
    let token = app.user_token("expirer");
    let (_, got) = app
        .get_json(&format!("/v1/holds/{hold_id}"), Some(&token))
        .await;
    assert_eq!(parse::<Hold>(&got).status, HoldStatus::Expired);
    let (s, bought) = order(&app, "expirer", "2", "lim-e", 2).await;
    assert_eq!(
        s,
        StatusCode::CREATED,
        "the expiry freed both units: {bought}"
    );
    let refused = order(&app, "expirer", "1", "lim-e", 1).await;
    assert_error_for(
        "a refused key stays refused",
        &refused,
        409,
        "LIMIT_EXCEEDED",
    );
    assert_eq!(units_of(&app, "expirer", "lim-e").await, 2);
}

/// Sale windows are judged on the primary's clock, not the service's: a service whose wall
/// clock runs two hours ahead (`WallAhead`) still refuses a sale that starts in an hour on
/// the primary, with the primary's `Retry-After`, and still sells a product whose sale ends
/// in an hour there, though by its own clock the first started and the second ended an hour
/// ago. Mutation seen failing it (standing in for "judged on the service's clock", which runs
/// two hours ahead): `clock_timestamp() + interval '2 hours'` in `stock::lock` and the refusal
/// claim's window (`refusals::CLAIM`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sale_window_follows_the_primarys_clock_not_the_services() {
    let app = spawn_app_with(AppOptions {
        clock: std::sync::Arc::new(WallAhead(chrono::Duration::hours(2))),
        ..AppOptions::new(shared_cluster())
    })
    .await;
    // An hour ahead on the primary's clock: the service's (two hours ahead) says otherwise.
    let in_an_hour: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT date_trunc('milliseconds', now() + interval '1 hour')")
            .fetch_one(&app.primary)
            .await
            .unwrap();
    let at = in_an_hour.to_rfc3339();
    for (id, stock, window) in [
        ("skew-soon", 10, json!({"sale_starts_at": at})),
        ("skew-soon-gone", 0, json!({"sale_starts_at": at})),
        ("skew-ending", 10, json!({"sale_ends_at": at})),
    ] {
        assert_eq!(
            create(&app, id, stock, window).await.0,
            StatusCode::CREATED,
            "{id}"
        );
    }
    for product in ["skew-soon", "skew-soon-gone"] {
        let r = app.order("skewed", product, product, 1).await;
        let retry: u64 = r
            .headers()
            .get("retry-after")
            .expect("Retry-After")
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((3590..=3601).contains(&retry), "Retry-After {retry}");
        assert_error_for(product, &answer(r).await, 409, "SALE_NOT_STARTED");
    }
    let carted = cart(&app, "skewed", "cart", &[("skew-soon", 1)]).await;
    assert_error(&carted, 409, "SALE_NOT_STARTED");
    let held = hold(&app, "skewed", "hold", &[("skew-soon", 1)]).await;
    assert_error(&held, 409, "SALE_NOT_STARTED");
    assert_eq!(
        order(&app, "skewed", "ending", "skew-ending", 1).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        cart(&app, "skewed", "cart-ending", &[("skew-ending", 1)])
            .await
            .0,
        StatusCode::CREATED
    );
    assert_eq!(
        hold(&app, "skewed", "hold-ending", &[("skew-ending", 1)])
            .await
            .0,
        StatusCode::CREATED
    );
    assert_eq!(app.stock_on_primary("skew-ending").await, 7);
    assert_eq!(app.stock_on_primary("skew-soon").await, 10);
}

/// Before the start: orders (on both instances, in stock and sold out), carts and holds are
/// `SALE_NOT_STARTED` with `Retry-After`, nothing is written, availability says `on_sale`
/// false; once the primary's clock passes the start, the same keys buy. The sold-out product
/// goes through the stock gate's early "no", which must not make it `OUT_OF_STOCK`.
/// Mutations seen failing it: the refusal claim without its window (the sold-out product
/// said OUT_OF_STOCK), the batch without its not-started branch (an order bought early),
/// `stock::lock` without its `starts_in_ms` (a hold taken early; seen failing after the change
/// below). The start is an hour away while the requests are refused, however long they take, and is
/// then moved to a moment just ahead, which the primary's clock passes (a start 3 s ahead of
/// ten requests failed on a loaded machine without a bug).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn before_the_start_nothing_is_claimed_and_the_same_keys_buy_once_it_starts() {
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    let starts: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT date_trunc('milliseconds', now() + interval '1 hour')")
            .fetch_one(&a.primary)
            .await
            .unwrap();
    let window = json!({"sale_starts_at": starts.to_rfc3339()});
    assert_eq!(
        create(&a, "soon", 10, window.clone()).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        create(&a, "soon-gone", 0, window).await.0,
        StatusCode::CREATED
    );
    let (_, page) = b.get_json("/v1/products/soon", None).await;
    let shown: chrono::DateTime<chrono::Utc> =
        page["sale_starts_at"].as_str().unwrap().parse().unwrap();
    assert_eq!(shown, starts, "{page}");
    assert!(
        page["max_per_customer"].is_null() && page["sale_ends_at"].is_null(),
        "{page}"
    );
    let (_, avail) = b.get_json("/v1/products/soon/availability", None).await;
    assert_eq!(avail["on_sale"], false, "{avail}");
    for (app, user) in [(&a, "early-a"), (&b, "early-b")] {
        for product in ["soon", "soon-gone"] {
            let r = app.order(user, product, product, 1).await;
            assert_eq!(r.status(), StatusCode::CONFLICT);
            let retry: u64 = r.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!((3590..=3601).contains(&retry), "Retry-After {retry}");
            assert_error_for(product, &answer(r).await, 409, "SALE_NOT_STARTED");
        }
        let carted = cart(app, user, "cart", &[("soon", 1)]).await;
        assert_error(&carted, 409, "SALE_NOT_STARTED");
        let held = hold(app, user, "hold", &[("soon", 1)]).await;
        assert_error(&held, 409, "SALE_NOT_STARTED");
    }
    assert_eq!(
        rows_written(&a, "soon").await + rows_written(&a, "soon-gone").await,
        0
    );
    let keys: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM orders WHERE user_id LIKE 'early-%') + (SELECT count(*) FROM holds WHERE user_id LIKE 'early-%')",
    )
    .fetch_one(&a.primary)
    .await
    .unwrap();
    assert_eq!(keys, 0, "no key was claimed before the start");
    assert_eq!(a.stock_on_primary("soon").await, 10);
    // The start, moved to just ahead, passes on the primary's clock.
    let starts: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT date_trunc('milliseconds', now() + interval '500 milliseconds')",
    )
    .fetch_one(&a.primary)
    .await
    .unwrap();
    for product in ["soon", "soon-gone"] {
        let (s, body) = patch(
            &a,
            product,
            &a.admin,
            json!({"sale_starts_at": starts.to_rfc3339()}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{body}");
    }
    wait_for("the sale to start", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>("SELECT now() >= $1")
            .bind(starts)
            .fetch_one(&a.primary)
            .await
            .unwrap()
    })
    .await;
    for (app, user) in [(&a, "early-a"), (&b, "early-b")] {
        assert_eq!(
            app.order(user, "soon", "soon", 1).await.status(),
            StatusCode::CREATED
        );
        let gone = answer(app.order(user, "soon-gone", "soon-gone", 1).await).await;
        assert_error(&gone, 409, "OUT_OF_STOCK");
        assert_eq!(
            cart(app, user, "cart", &[("soon", 1)]).await.0,
            StatusCode::CREATED
        );
        assert_eq!(
            hold(app, user, "hold", &[("soon", 1)]).await.0,
            StatusCode::CREATED
        );
    }
    assert_eq!(a.stock_on_primary("soon").await, 4);
}

/// From the end: orders, carts and holds are `SALE_ENDED`, for good (the key stays refused
/// after the end is cleared), while a new key then buys. Mutation seen failing it: the batch's
/// end check removed (the order bought).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn from_the_end_every_request_is_sale_ended_for_good() {
    let app = spawn_app(shared_cluster()).await;
    let ended: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now() - interval '1 second'")
            .fetch_one(&app.primary)
            .await
            .unwrap();
    let window = json!({"sale_starts_at": (ended - chrono::Duration::hours(1)).to_rfc3339(), "sale_ends_at": ended.to_rfc3339()});
    assert_eq!(
        create(&app, "over", 10, window.clone()).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        create(&app, "over-gone", 0, window).await.0,
        StatusCode::CREATED
    );
    let (_, avail) = app.get_json("/v1/products/over/availability", None).await;
    assert_eq!(avail["on_sale"], false, "{avail}");
    for product in ["over", "over-gone"] {
        let late = order(&app, "late", product, product, 1).await;
        assert_error_for(product, &late, 409, "SALE_ENDED");
    }
    let carted = cart(&app, "late", "cart", &[("over", 1)]).await;
    assert_error(&carted, 409, "SALE_ENDED");
    let held = hold(&app, "late", "hold", &[("over", 1)]).await;
    assert_error(&held, 409, "SALE_ENDED");
    assert_eq!(app.stock_on_primary("over").await, 10);
    let (s, body) = patch(&app, "over", &app.admin, json!({"sale_ends_at": null})).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert!(body["sale_ends_at"].is_null(), "{body}");
    let final_for_its_key = "final for its key";
    let ordered = order(&app, "late", "over", "over", 1).await;
    assert_error_for(final_for_its_key, &ordered, 409, "SALE_ENDED");
    let carted = cart(&app, "late", "cart", &[("over", 1)]).await;
    assert_error_for(final_for_its_key, &carted, 409, "SALE_ENDED");
    let held = hold(&app, "late", "hold", &[("over", 1)]).await;
    assert_error_for(final_for_its_key, &held, 409, "SALE_ENDED");
    assert_eq!(
        order(&app, "late", "new", "over", 1).await.0,
        StatusCode::CREATED
    );
}

/// PATCH validates like the contract says (and create the same rules): a limit, a date, a
/// window that would end before it starts, also against the start the row already holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn patch_and_create_validate_drop_rules_like_the_contract_says() {
    let app = spawn_app(shared_cluster()).await;
    let (s, body) = create(&app, "pat", 10, json!({})).await;
    assert_eq!(s, StatusCode::CREATED);
    for field in ["max_per_customer", "sale_starts_at", "sale_ends_at"] {
        assert!(body[field].is_null(), "{field} is null when unset: {body}");
    }
    let admin = app.admin.clone();
    for (bad, status, want) in [
        (
            json!({"max_per_customer": 0}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_LIMIT",
        ),
        (
            json!({"max_per_customer": 10001}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_LIMIT",
        ),
        (
            json!({"max_per_customer": 1.5}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_LIMIT",
        ),
        (
            json!({"max_per_customer": "2"}),
            StatusCode::BAD_REQUEST,
            "INVALID_BODY",
        ),
        (
            json!({"sale_starts_at": "tomorrow"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_DATE",
        ),
        (
            json!({"sale_starts_at": "2026-12-24 18:00:00"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_DATE",
        ),
        (
            json!({"sale_starts_at": "2026-12-24T18:00:00Z", "sale_ends_at": "2026-12-24T17:00:00Z"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "INVALID_SALE_WINDOW",
        ),
        (
            json!({"available_quantity": 5}),
            StatusCode::BAD_REQUEST,
            "INVALID_BODY",
        ),
    ] {
        let refused = patch(&app, "pat", &admin, bad.clone()).await;
        assert_error_for(&bad.to_string(), &refused, status.as_u16(), want);
    }
    // An end before the start the row already holds.
    let (s, _) = patch(
        &app,
        "pat",
        &admin,
        json!({"sale_starts_at": "2020-01-02T00:00:00Z"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let ends_first = patch(
        &app,
        "pat",
        &admin,
        json!({"sale_ends_at": "2020-01-01T00:00:00+00:00"}),
    )
    .await;
    assert_error(&ends_first, 422, "INVALID_SALE_WINDOW");
    let unknown = patch(&app, "nope", &admin, json!({"max_per_customer": 2})).await;
    assert_error(&unknown, 404, "PRODUCT_NOT_FOUND");
    let user = app.user_token("patcher");
    assert_eq!(
        patch(&app, "pat", &user, json!({"max_per_customer": 2}))
            .await
            .0,
        StatusCode::FORBIDDEN
    );
    let empty_window = create(
        &app,
        "bad-window",
        1,
        json!({"sale_starts_at": "2026-12-24T18:00:00Z", "sale_ends_at": "2026-12-24T18:00:00Z"}),
    )
    .await;
    assert_error(&empty_window, 422, "INVALID_SALE_WINDOW");
    let no_limit = create(&app, "bad-limit", 1, json!({"max_per_customer": 0})).await;
    assert_error(&no_limit, 422, "INVALID_LIMIT");
}

/// PATCH changes the rules between batches: a limit raised mid-sale lets a buyer take more
/// with new keys, while a key refused under the old limit stays refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_raised_mid_sale_lets_buyers_take_more() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        create(&app, "pat", 10, json!({})).await.0,
        StatusCode::CREATED
    );
    let admin = app.admin.clone();
    let (s, _) = patch(
        &app,
        "pat",
        &admin,
        json!({"sale_starts_at": "2020-01-02T00:00:00Z"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    // Mid-sale: a limit of 1, then 3.
    let (s, body) = patch(&app, "pat", &admin, json!({"max_per_customer": 1})).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(body["max_per_customer"], 1);
    assert_eq!(
        body["sale_starts_at"], "2020-01-02T00:00:00Z",
        "a field left out stays: {body}"
    );
    assert_eq!(
        order(&app, "patcher", "1", "pat", 1).await.0,
        StatusCode::CREATED
    );
    let second = order(&app, "patcher", "2", "pat", 1).await;
    assert_eq!(
        assert_error(&second, 409, "LIMIT_EXCEEDED").already,
        Some(1)
    );
    let (s, body) = patch(&app, "pat", &admin, json!({"max_per_customer": 3})).await;
    assert_eq!(
        (s, body["max_per_customer"].clone()),
        (StatusCode::OK, json!(3))
    );
    assert_eq!(
        order(&app, "patcher", "3", "pat", 2).await.0,
        StatusCode::CREATED
    );
    let second = order(&app, "patcher", "2", "pat", 1).await;
    assert_error_for(
        "refused under the old limit",
        &second,
        409,
        "LIMIT_EXCEEDED",
    );
    let (s, body) = patch(&app, "pat", &admin, json!({"max_per_customer": null})).await;
    assert!(
        s == StatusCode::OK && body["max_per_customer"].is_null(),
        "{body}"
    );
    assert_eq!(
        order(&app, "patcher", "4", "pat", 5).await.0,
        StatusCode::CREATED,
        "no limit now"
    );
}
