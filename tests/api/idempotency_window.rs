//! The idempotency window (`STOCKGATE_IDEMPOTENCY_WINDOW`): refusals older than it are
//! purged, so the table does not grow with every rejected buyer; confirmed orders never are.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::json;
use std::time::Duration;

async fn count(app: &TestApp, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&app.primary)
        .await
        .unwrap()
}

/// With a one-hour window: refusals (orders' and holds') aged two hours go, the young ones
/// stay, confirmed and cancelled orders of any age stay, and a purged key may buy anew while
/// a young refused key is still final. Mutations: no purge (the wait times out); a purge
/// without its `status = 'refused'` filter (the old orders go too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_older_than_the_window_are_purged_and_their_keys_may_buy_anew() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_IDEMPOTENCY_WINDOW", "1h".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    app.create_product("window", 2, 100).await;
    assert_eq!(
        app.order("keep", "a", "window", 1).await.status(),
        StatusCode::CREATED
    );
    let gone = app.order("keep", "b", "window", 1).await;
    assert_eq!(gone.status(), StatusCode::CREATED);
    let gone: Order = gone.json().await.unwrap();
    let cancel = app
        .client
        .post(app.url(&format!("/v1/orders/{}/cancel", gone.order_id)))
        .bearer_auth(app.user_token("keep"))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), StatusCode::OK);
    // One unit back: buy it, then every later buyer is refused.
    assert_eq!(
        app.order("keep", "c", "window", 1).await.status(),
        StatusCode::CREATED
    );
    for i in 0..20 {
        let r = app.order(&format!("r{i:02}"), "k", "window", 1).await;
        assert_eq!(r.status(), StatusCode::CONFLICT);
    }
    let hold = app
        .client
        .post(app.url("/v1/holds"))
        .bearer_auth(app.user_token("holder"))
        .header("Idempotency-Key", "h")
        .json(&json!({"lines": [{"product_id": "window", "quantity": 5}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(hold.status(), StatusCode::CONFLICT);

    // Two hours pass for the first ten refusals, the hold's, and every order.
    sqlx::raw_sql(
        "UPDATE orders SET created_at = created_at - interval '2 hours' \
           WHERE user_id IN ('keep', 'r00', 'r01', 'r02', 'r03', 'r04', 'r05', 'r06', 'r07', 'r08', 'r09'); \
         UPDATE holds SET created_at = created_at - interval '2 hours' WHERE user_id = 'holder';",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    app.wait_for("the aged refusals purged", Duration::from_secs(20), || async {
        count(&app, "SELECT count(*) FROM orders WHERE status = 'refused' AND created_at < now() - interval '1 hour'").await == 0
            && count(&app, "SELECT count(*) FROM holds WHERE status = 'refused'").await == 0
    })
    .await;
    assert_eq!(
        count(&app, "SELECT count(*) FROM orders WHERE status = 'refused'").await,
        10,
        "the young refusals stay"
    );
    assert_eq!(
        count(&app, "SELECT count(*) FROM orders WHERE user_id = 'keep' AND status IN ('confirmed', 'cancelled')").await,
        3,
        "orders are never purged, however old"
    );
    assert!(app.metric("stockgate_refusals_purged_total").await >= 11.0);

    // With stock again: a young refused key stays refused; a purged one buys.
    app.restock("window", 1).await;
    assert_eq!(
        app.order("r15", "k", "window", 1).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        app.order("r03", "k", "window", 1).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(app.stock_on_primary("window").await, 0);
}

/// Ages every refusal of `user` to `age` before now (the primary's clock).
async fn age_refusals(app: &TestApp, user: &str, age: &str) {
    sqlx::query(
        "WITH o AS (UPDATE orders SET created_at = clock_timestamp() - $2::interval \
                    WHERE user_id = $1 AND status = 'refused' RETURNING 1), \
              h AS (UPDATE holds SET created_at = clock_timestamp() - $2::interval \
                    WHERE user_id = $1 AND status = 'refused' RETURNING 1) \
         SELECT (SELECT count(*) FROM o) + (SELECT count(*) FROM h)",
    )
    .bind(user)
    .bind(age)
    .fetch_one(&app.primary)
    .await
    .unwrap();
}

async fn refusals_of(app: &TestApp, user: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM orders WHERE user_id = $1 AND status = 'refused') \
              + (SELECT count(*) FROM holds WHERE user_id = $1 AND status = 'refused')",
    )
    .bind(user)
    .fetch_one(&app.primary)
    .await
    .unwrap()
}

/// The boundary, under the default window (24 h, the one deployments run): an order's and a
/// hold's refusal aged 23 h 59 min stay, the same aged 24 h 1 min go, in the same sweep. The
/// margin (a minute) is far wider than the sweeps between the aging and the check, so no
/// schedule can move a refusal across it. Mutations: the window read in minutes instead of
/// seconds (`make_interval(mins => $1)` in `refusals::purge`: 24 h becomes 60 d, the outside
/// refusals stay and the wait times out), or the window cut to minutes (`window.as_secs_f64()
/// / 60.0`: 24 h becomes 24 min, the inside refusals go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_just_inside_the_window_stays_and_one_just_outside_goes() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("edge", 0, 100).await;
    for user in ["inside", "outside"] {
        let (s, body) = send_as(
            &app,
            reqwest::Method::POST,
            "/v1/orders",
            user,
            Some("o"),
            json!({"product_id": "edge", "quantity": 1}),
        )
        .await;
        assert_error(&(s, body), 409, "OUT_OF_STOCK");
        let (s, body) = send_as(
            &app,
            reqwest::Method::POST,
            "/v1/holds",
            user,
            Some("h"),
            json!({"lines": [{"product_id": "edge", "quantity": 1}]}),
        )
        .await;
        assert_error(&(s, body), 409, "OUT_OF_STOCK");
        assert_eq!(
            refusals_of(&app, user).await,
            2,
            "{user}: both refusals kept"
        );
    }
    age_refusals(&app, "inside", "23 hours 59 minutes").await;
    age_refusals(&app, "outside", "24 hours 1 minute").await;
    // Young refusals that were never aged: they must outlive everything here.
    let (s, body) = send_as(
        &app,
        reqwest::Method::POST,
        "/v1/orders",
        "young",
        Some("o"),
        json!({"product_id": "edge", "quantity": 1}),
    )
    .await;
    assert_error(&(s, body), 409, "OUT_OF_STOCK");

    app.wait_for(
        "the refusals past the window purged",
        Duration::from_secs(20),
        || async { refusals_of(&app, "outside").await == 0 },
    )
    .await;
    // The purge that took the outside ones ran with the inside ones already aged: they were
    // judged in the same statement, and stayed.
    assert_eq!(
        refusals_of(&app, "inside").await,
        2,
        "a refusal a minute inside the window stays"
    );
    assert_eq!(refusals_of(&app, "young").await, 1);

    // Their keys, with stock again: the inside key is still final, the outside one buys.
    app.restock("edge", 1).await;
    assert_eq!(
        app.order("inside", "o", "edge", 1).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        app.order("outside", "o", "edge", 1).await.status(),
        StatusCode::CREATED
    );
}
