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
