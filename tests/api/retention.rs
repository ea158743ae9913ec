//! Event retention (`STOCKGATE_EVENT_RETENTION`): the service's own background purge keeps
//! every event younger than the retention and removes the older ones, and a cursor is 410
//! only once events that follow it are gone.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::time::Duration;

/// The `cursor` of product `id`'s creation event in `feed`.
fn creation(feed: &[Value], id: &str) -> Option<String> {
    feed.iter()
        .find(|e| e["type"] == "stock.changed" && e["data"]["product_id"] == id)
        .map(|e| e["cursor"].as_str().expect("cursor").to_owned())
}

/// Events on both sides of a one-hour retention, purged by the purge a service runs when it
/// starts (no direct call): those aged 2 h and 61 min go, those aged 59 min and new stay; the
/// feed from the start begins after the purged ones; the cursor of a purged event that other
/// purged events follow is 410, the cursor of the last purged one is not. Mutations seen
/// failing it: `purge(pool, retention / 1000, …)` in `Feed::start` (the 59 min event went);
/// `retention * 2` (the 61 min event stayed; the wait times out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_purge_keeps_events_younger_than_the_retention_and_removes_older() {
    let cluster = shared_cluster();
    let writer = spawn_app(cluster).await;
    let ids = ["old-1", "old-2", "edge-out", "edge-in", "young"];
    for id in ids {
        assert_eq!(
            writer.create_product(id, 1, 100).await.status(),
            StatusCode::CREATED
        );
    }
    let feed = feed_until(&writer, "the last creation", |e| {
        e["data"]["product_id"] == "young"
    })
    .await;
    let cursor = |id| creation(&feed, id).unwrap_or_else(|| panic!("{id} in {feed:?}"));
    let (old_1, edge_out) = (cursor("old-1"), cursor("edge-out"));
    let database = writer.database.clone();
    let primary = writer.primary.clone();
    writer.stop().await;
    // Their ages, on the primary's clock (each creation is a row of its own).
    for (id, age_of) in [
        ("old-1", "2 hours"),
        ("old-2", "2 hours"),
        ("edge-out", "61 minutes"),
        ("edge-in", "59 minutes"),
    ] {
        age(&primary, id, age_of).await;
    }
    let rows = |ids: &'static [&'static str]| {
        let primary = primary.clone();
        async move {
            let mut n = 0;
            for id in ids {
                n += event_rows(&primary, id).await;
            }
            n
        }
    };
    assert_eq!(
        rows(&["old-1", "old-2", "edge-out", "edge-in", "young"]).await,
        5
    );

    let app = spawn_app_with(AppOptions {
        database: Some(database),
        env: vec![("STOCKGATE_EVENT_RETENTION", "1h".into())],
        ..AppOptions::new(cluster)
    })
    .await;
    app.wait_for(
        "the events past the retention purged",
        Duration::from_secs(20),
        || async { rows(&["old-1", "old-2", "edge-out"]).await == 0 },
    )
    .await;
    assert_eq!(
        rows(&["edge-in", "young"]).await,
        2,
        "events younger than the retention stay"
    );
    let (status, page) = app
        .get_json("/v1/events?limit=1000", Some(&app.admin))
        .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let events = page["events"].as_array().expect("events").clone();
    let kept: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "stock.changed")
        .map(|e| e["data"]["product_id"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(kept, ["edge-in", "young"], "the feed from the oldest kept");
    let (status, body) = app
        .get_json(&format!("/v1/events?after={old_1}"), Some(&app.admin))
        .await;
    assert_error(&(status, body), 410, "CURSOR_EXPIRED");
    let (status, body) = app
        .get_json(&format!("/v1/events?after={edge_out}"), Some(&app.admin))
        .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "nothing after it was purged: {body}"
    );
}

/// The rows of `events` holding `id`'s creation.
async fn event_rows(primary: &sqlx::PgPool, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM events \
         WHERE items::text LIKE '%\"product_id\" : \"' || $1 || '\"%' \
            OR items::text LIKE '%\"product_id\":\"' || $1 || '\"%'",
    )
    .bind(id)
    .fetch_one(primary)
    .await
    .unwrap()
}

/// Ages `id`'s creation event to `age` on the primary's clock.
async fn age(primary: &sqlx::PgPool, id: &str, age: &str) {
    let aged = sqlx::query(
        "UPDATE events SET at = clock_timestamp() - $2::interval \
         WHERE items::text LIKE '%\"product_id\" : \"' || $1 || '\"%' \
            OR items::text LIKE '%\"product_id\":\"' || $1 || '\"%'",
    )
    .bind(id)
    .bind(age)
    .execute(primary)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(aged, 1, "{id}'s event row");
}

/// The purge runs again while the service runs, not only at its start: with a 10 s retention
/// (purged every 2.5 s), an event aged past it after the start goes, while one aged 4 s stays.
/// Mutations seen failing it: the purge only at start (`PURGE_EVERY` for every retention: the
/// old event stays past the wait), `purge(pool, retention / 1000, …)` (the 4 s event goes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_runs_again_while_the_service_runs() {
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_EVENT_RETENTION", "10s".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    for id in ["later-old", "later-young"] {
        assert_eq!(
            app.create_product(id, 1, 100).await.status(),
            StatusCode::CREATED
        );
    }
    feed_until(&app, "both creations", |e| {
        e["data"]["product_id"] == "later-young"
    })
    .await;
    // After the start's purge: one past the retention, one well inside it.
    age(&app.primary, "later-old", "11 seconds").await;
    age(&app.primary, "later-young", "4 seconds").await;
    app.wait_for(
        "the event past the retention purged",
        Duration::from_secs(30),
        || async { event_rows(&app.primary, "later-old").await == 0 },
    )
    .await;
    assert_eq!(
        event_rows(&app.primary, "later-young").await,
        1,
        "the 4 s event stays"
    );
}
