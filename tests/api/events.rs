//! The event feed (`GET /v1/events`): one total order with no gaps, every committed change
//! exactly one event, live readers served prefixes of the final feed, and the feed's errors.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

/// One page of the feed: `(status, body)`.
async fn page(app: &TestApp, query: &str) -> (StatusCode, Value) {
    app.get_json(&format!("/v1/events?{query}"), Some(&app.admin))
        .await
}

/// Every event from the start, read on `app` page by page until a page comes back empty.
async fn whole_feed(app: &TestApp) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let q = match &after {
            Some(a) => format!("after={a}&limit=1000"),
            None => "limit=1000".into(),
        };
        let (status, body) = page(app, &q).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let events = body["events"].as_array().expect("events").clone();
        if events.is_empty() {
            return all;
        }
        after = Some(body["next"].as_str().expect("next").to_owned());
        all.extend(events);
    }
}

/// The whole feed once it holds an event for which `done` holds. The horizon is the
/// cluster's: a long transaction of another test's database delays the feed (never reorders
/// it), so a test waits for the last change it made rather than reading once.
async fn feed_through(app: &TestApp, done: impl Fn(&Value) -> bool) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let feed = whole_feed(app).await;
        if feed.iter().any(&done) {
            return feed;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the feed never showed the last change"
        );
        let after = feed.last().map_or("0-0".to_owned(), |e| {
            e["cursor"].as_str().unwrap().to_owned()
        });
        page(app, &format!("after={after}&wait_ms=1000")).await;
    }
}

/// The `stock.changed` of product `id`'s creation.
fn created(id: &'static str) -> impl Fn(&Value) -> bool {
    move |e| {
        e["type"] == "stock.changed"
            && e["data"]["product_id"] == id
            && e["data"]["reason"] == "create"
    }
}

/// The (product, quantity) of each of `lines`, a JSON array of lines, in its order.
fn products_and_quantities(lines: &Value) -> Vec<(String, i64)> {
    lines
        .as_array()
        .expect("lines")
        .iter()
        .map(|l| {
            (
                l["product_id"].as_str().unwrap().to_owned(),
                l["quantity"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn cursors(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["cursor"].as_str().expect("cursor").to_owned())
        .collect()
}

/// The outbox everyone writes first: events in sequence order, `n > cursor`. A change whose
/// sequence value was taken before a later one's, but that commits after it, lands behind a
/// cursor that has already passed it. The feed places it after what it served instead.
/// Mutation seen failing: the feed without `xid < pg_snapshot_xmin(...)` (it serves the
/// second transaction's event first, and its reader never sees the first's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_commits_late_is_placed_after_what_was_served_where_a_naive_outbox_skips_it()
{
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    let event = |tag: &'static str| {
        sqlx::query("INSERT INTO events (types, items, k) VALUES ('{stock.changed}', json_build_array(json_build_object('type', 'stock.changed', 'data', json_build_object('tag', $1::text))), 1)")
            .bind(tag)
    };
    // The slow change takes its place (its transaction id and sequence value) first...
    let mut slow = app.primary.begin().await.unwrap();
    event("slow").execute(&mut *slow).await.unwrap();
    // ...and a quick one commits before it.
    event("quick").execute(&app.primary).await.unwrap();

    // Every node has replayed "quick" before the feed is read: a replica that had not would
    // leave it out for its own staleness, and the feed without its horizon would pass.
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
    // The naive reader sees the quick one and moves its cursor past the slow one's place.
    let naive_after: i64 = sqlx::query_scalar("SELECT max(n) FROM events")
        .fetch_one(&app.primary)
        .await
        .unwrap();
    // The feed serves nothing yet: the slow transaction holds the horizon.
    let (status, first) = page(&app, "").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let served_first = first["events"].as_array().unwrap().clone();
    let after = first["next"].as_str().unwrap().to_owned();

    slow.commit().await.unwrap();
    let naive_rest: Vec<String> =
        sqlx::query_scalar("SELECT items->0->'data'->>'tag' FROM events WHERE n > $1 ORDER BY n")
            .bind(naive_after)
            .fetch_all(&app.primary)
            .await
            .unwrap();
    assert!(
        naive_rest.is_empty(),
        "the naive outbox was expected to skip the late commit: {naive_rest:?}"
    );

    let mut seen: Vec<Value> = served_first;
    let mut after = after;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < 2 && tokio::time::Instant::now() < deadline {
        let (status, rest) = page(&app, &format!("after={after}&wait_ms=2000")).await;
        assert_eq!(status, StatusCode::OK, "{rest}");
        seen.extend(rest["events"].as_array().unwrap().clone());
        after = rest["next"].as_str().unwrap().to_owned();
    }
    // Whatever the pages held, together they are the feed: slow then quick, each once.
    let tags: Vec<&str> = seen
        .iter()
        .map(|e| e["data"]["tag"].as_str().unwrap())
        .collect();
    assert_eq!(tags, ["slow", "quick"], "{seen:?}");
    // The whole feed read again, from a replica that may be behind: wait until it holds the
    // last change, as any reader of a replica would.
    let quick = |e: &Value| e["data"]["tag"] == "quick";
    assert_eq!(cursors(&seen), cursors(&feed_through(&app, quick).await));
}

/// Orders, cancels, holds (confirmed, released) and restocks on two instances while a reader
/// long-polls each: every committed change is exactly one event, each reader's sequence is a
/// prefix of the final feed, and the events account for every unit of stock. Mutations seen
/// failing: the orders trigger skipping single-line orders (the counts), the feed without its
/// horizon (the prefix), a restock without its `stock.changed` (the stock books).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_committed_change_is_one_event_and_every_live_reader_sees_a_prefix_of_the_feed() {
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    let products = ["ev-a", "ev-b", "ev-c"];
    for p in products {
        assert_eq!(
            a.create_product(p, 40, 100).await.status(),
            StatusCode::CREATED
        );
    }
    // Whether the changes are still being made, and each reader's pages with an order's event
    // served meanwhile: the readers must be live, not reading everything at the end.
    let loading = Arc::new(AtomicBool::new(true));
    let readers: Vec<_> = [&a, &b]
        .into_iter()
        .map(|app| {
            let (client, url, admin) =
                (app.client.clone(), app.url("/v1/events"), app.admin.clone());
            let seen = Arc::new(Mutex::new(Vec::<Value>::new()));
            let out = seen.clone();
            let live = Arc::new(AtomicUsize::new(0));
            let (loading, live_out) = (loading.clone(), live.clone());
            let task = tokio::spawn(async move {
                let mut after: Option<String> = None;
                let marker = created("ev-marker");
                while !seen.lock().await.iter().any(&marker) {
                    let mut req = client
                        .get(&url)
                        .bearer_auth(&admin)
                        .query(&[("wait_ms", "1000"), ("limit", "7")]);
                    if let Some(a) = &after {
                        req = req.query(&[("after", a)]);
                    }
                    let body: Value = req.send().await.unwrap().json().await.unwrap();
                    let events = body["events"].as_array().expect("a page").clone();
                    after = Some(body["next"].as_str().unwrap().to_owned());
                    if loading.load(Ordering::SeqCst)
                        && events.iter().any(|e| e["type"] == "order.confirmed")
                    {
                        live.fetch_add(1, Ordering::SeqCst);
                    }
                    seen.lock().await.extend(events);
                }
            });
            (task, out, live_out)
        })
        .collect();

    let mut work = Vec::new();
    for i in 0..24usize {
        let app = if i % 2 == 0 { &a } else { &b };
        let (client, base, admin) = (app.client.clone(), app.url(""), app.admin.clone());
        let user = format!("buyer-{i}");
        let token = app.user_token(&user);
        let product = products[i % products.len()];
        work.push(tokio::spawn(async move {
            let post = |path: String, body: Value, key: String| {
                client
                    .post(format!("{base}{path}"))
                    .bearer_auth(&token)
                    .header("Idempotency-Key", key)
                    .json(&body)
                    .send()
            };
            for k in 0..3 {
                let resp = post(
                    "/v1/orders".into(),
                    json!({"product_id": product, "quantity": 1 + k % 2}),
                    format!("o-{i}-{k}"),
                )
                .await
                .unwrap();
                let body: Value = resp.json().await.unwrap();
                if k == 1 && body["status"] == "confirmed" {
                    let id = body["order_id"].as_str().unwrap();
                    client
                        .post(format!("{base}/v1/orders/{id}/cancel"))
                        .bearer_auth(&token)
                        .send()
                        .await
                        .unwrap();
                }
            }
            let hold: Value = post(
                "/v1/holds".into(),
                json!({"lines": [{"product_id": product, "quantity": 1}], "ttl_s": 600}),
                format!("h-{i}"),
            )
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
            if let Some(id) = hold["hold_id"].as_str() {
                let url = format!("{base}/v1/holds/{id}");
                let end = if i % 3 == 0 {
                    client.post(format!("{url}/confirm"))
                } else {
                    client.delete(url)
                };
                end.bearer_auth(&token).send().await.unwrap();
            }
            if i % 4 == 0 {
                client
                    .post(format!("{base}/v1/products/{product}/restock"))
                    .bearer_auth(&admin)
                    .json(&json!({"quantity": 3}))
                    .send()
                    .await
                    .unwrap();
            }
        }));
    }
    for w in work {
        w.await.unwrap();
    }
    loading.store(false, Ordering::SeqCst);
    // The last change: every change above committed before it took its place in the feed.
    assert_eq!(
        b.create_product("ev-marker", 1, 1).await.status(),
        StatusCode::CREATED
    );
    let feed = feed_through(&a, created("ev-marker")).await;
    for (task, seen, live) in readers {
        task.await.unwrap();
        assert!(
            live.load(Ordering::SeqCst) > 0,
            "precondition: a reader was served orders while they were being placed"
        );
        let seen = cursors(&seen.lock().await);
        let unique: HashSet<&String> = seen.iter().collect();
        assert_eq!(
            unique.len(),
            seen.len(),
            "a reader was served an event twice"
        );
        assert_eq!(
            seen,
            cursors(&feed)[..seen.len()],
            "a reader's sequence is not a prefix of the feed"
        );
        assert_eq!(
            seen.len(),
            feed.len(),
            "a reader that read to the last change missed events"
        );
    }

    // Every committed change is one event.
    let count = |sql: &'static str| {
        let pool = a.primary.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let mut by_type: BTreeMap<&str, i64> = BTreeMap::new();
    for e in &feed {
        *by_type.entry(e["type"].as_str().unwrap()).or_default() += 1;
    }
    let expected = [
        (
            "order.confirmed",
            count("SELECT count(*) FROM orders WHERE status IN ('confirmed', 'cancelled')").await,
        ),
        (
            "order.cancelled",
            count("SELECT count(*) FROM orders WHERE status = 'cancelled'").await,
        ),
        (
            "hold.created",
            count("SELECT count(*) FROM holds WHERE status <> 'refused'").await,
        ),
        (
            "hold.confirmed",
            count("SELECT count(*) FROM holds WHERE status = 'confirmed'").await,
        ),
        (
            "hold.released",
            count("SELECT count(*) FROM holds WHERE status = 'released'").await,
        ),
        (
            "hold.expired",
            count("SELECT count(*) FROM holds WHERE status = 'expired'").await,
        ),
        (
            "stock.changed",
            count("SELECT (SELECT count(*) FROM products) + (SELECT count(*) FROM restocks)").await,
        ),
    ];
    for (kind, n) in expected {
        assert_eq!(
            by_type.get(kind).copied().unwrap_or(0),
            n,
            "{kind}: {by_type:?}"
        );
    }
    let confirmed: Vec<&str> = feed
        .iter()
        .filter(|e| e["type"] == "order.confirmed")
        .map(|e| e["data"]["order_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        confirmed.iter().collect::<HashSet<_>>().len(),
        confirmed.len(),
        "an order announced twice"
    );

    // The events account for every unit: created and restocked, less what orders took (a
    // confirmed hold's order took nothing more: its hold did), plus cancels and holds that
    // gave units back.
    let from_holds: HashSet<&str> = feed
        .iter()
        .filter(|e| e["type"] == "hold.confirmed")
        .map(|e| e["data"]["order_id"].as_str().unwrap())
        .collect();
    let mut books: HashMap<String, i64> = HashMap::new();
    let lines = |e: &Value| products_and_quantities(&e["data"]["lines"]);
    for e in &feed {
        let sign = match e["type"].as_str().unwrap() {
            "stock.changed" => {
                *books
                    .entry(e["data"]["product_id"].as_str().unwrap().to_owned())
                    .or_default() += e["data"]["delta"].as_i64().unwrap();
                continue;
            }
            "order.confirmed" if from_holds.contains(e["data"]["order_id"].as_str().unwrap()) => {
                continue;
            }
            "order.confirmed" | "hold.created" => -1,
            "order.cancelled" | "hold.released" | "hold.expired" => 1,
            _ => continue,
        };
        for (p, q) in lines(e) {
            *books.entry(p).or_default() += sign * q;
        }
    }
    for p in products {
        assert_eq!(
            books[p],
            a.stock_on_primary(p).await,
            "{p}: the events' books"
        );
    }
}

/// A long-poll answers as soon as an event is there (not at its deadline), and a page says
/// where it was read and as of when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_returns_the_event_that_arrives_while_it_waits() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    let (_, body) = page(&app, "").await;
    let after = body["next"].as_str().unwrap().to_owned();
    let (client, url, admin) = (app.client.clone(), app.url("/v1/events"), app.admin.clone());
    let waiting = tokio::spawn(async move {
        let body: Value = client
            .get(url)
            .bearer_auth(admin)
            .query(&[("after", after.as_str()), ("wait_ms", "30000")])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        body
    });
    assert_eq!(
        app.create_product("polled", 5, 100).await.status(),
        StatusCode::CREATED
    );
    let body = tokio::time::timeout(Duration::from_secs(28), waiting)
        .await
        .expect("the long-poll answered before its 30 s deadline")
        .unwrap();
    let events = body["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{body}");
    assert_eq!(events[0]["type"], "stock.changed");
    assert_eq!(events[0]["data"]["reason"], "create");
    assert_eq!(events[0]["data"]["delta"], 5);
    assert!(
        body["as_of"].is_string() && body["served_by"].is_string(),
        "{body}"
    );
    assert_eq!(body["next"], events[0]["cursor"]);
}

/// Bad cursors, limits and waits are 400; a user is 403; a cursor the retention purge has
/// passed is 410, while a read without one starts at the oldest retained event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_feed_requests_are_400_a_user_403_and_a_purged_cursor_410() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    for (query, code) in [
        ("after=nope", "INVALID_CURSOR"),
        ("after=1-2-3", "INVALID_CURSOR"),
        ("limit=0", "INVALID_LIMIT"),
        ("limit=1001", "INVALID_LIMIT"),
        ("limit=ten", "INVALID_QUERY"),
        ("wait_ms=30001", "INVALID_WAIT_MS"),
        ("wait_ms=-1", "INVALID_QUERY"),
        ("since=0", "INVALID_QUERY"),
    ] {
        assert_error_for(query, &page(&app, query).await, 400, code);
    }
    let (status, _) = app
        .get_json("/v1/events", Some(&app.user_token("mallory")))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    for p in ["old-1", "old-2"] {
        assert_eq!(
            app.create_product(p, 1, 1).await.status(),
            StatusCode::CREATED
        );
    }
    let feed = feed_through(&app, created("old-2")).await;
    let before_purge = feed[0]["cursor"].as_str().unwrap().to_owned();
    // Everything written so far is past a zero retention.
    let purged = stockgate::events::feed::purge(&app.primary, Duration::ZERO, 1)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    // A replica answers as of its own moment: wait until both have replayed the purge.
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
    let (status, body) = page(&app, &format!("after={before_purge}")).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the purged event itself was served: {body}"
    );
    assert_error(&page(&app, "after=0-0").await, 410, "CURSOR_EXPIRED");
    let (status, body) = page(&app, "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        cursors(body["events"].as_array().unwrap()),
        cursors(&feed[1..])
    );
}

/// An order's `order.confirmed` event states what its 201 stated, and states it unchanged
/// after the order is cancelled, for a single-product order and for a cart: a statement's row
/// holds its orders' ids and the events are written out from the orders when the feed is read
/// (migration 20261206000004), so only fields no later change touches may come from the row.
/// Mutation seen failing it: the event's `status` read from the row (it says "cancelled" after
/// the cancel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_confirmed_event_states_its_201_and_keeps_it_after_a_cancel() {
    let app = spawn_app(shared_cluster()).await;
    for (p, price) in [("ev-kept", 250), ("ev-kept-2", 40)] {
        assert_eq!(
            app.create_product(p, 10, price).await.status(),
            StatusCode::CREATED
        );
    }
    let single = json!({"product_id": "ev-kept", "quantity": 3});
    let cart = json!({"lines": [{"product_id": "ev-kept", "quantity": 1},
                                {"product_id": "ev-kept-2", "quantity": 2}]});
    for (key, body) in [("ev-k1", single), ("ev-k2", cart)] {
        let (status, order) = send_as(
            &app,
            reqwest::Method::POST,
            "/v1/orders",
            "ev-buyer",
            Some(key),
            body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED, "{order}");
        let id = order["order_id"].as_str().unwrap().to_owned();
        let confirmed_of = |feed: &[Value]| -> Value {
            let mine: Vec<&Value> = feed
                .iter()
                .filter(|e| e["type"] == "order.confirmed" && e["data"]["order_id"] == id.as_str())
                .collect();
            assert_eq!(mine.len(), 1, "one order.confirmed for {id}: {mine:?}");
            mine[0].clone()
        };
        let feed = feed_through(&app, |e| {
            e["type"] == "order.confirmed" && e["data"]["order_id"] == id.as_str()
        })
        .await;
        let before = confirmed_of(&feed);
        let data = &before["data"];
        for field in [
            "order_id",
            "product_id",
            "quantity",
            "user_id",
            "status",
            "total_cents",
            "allocations",
        ] {
            assert_eq!(
                data.get(field),
                order.get(field),
                "{field}: event {data}, answer {order}"
            );
        }
        assert_eq!(data["status"], "confirmed");
        let at = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap()).unwrap();
        assert_eq!(at(&data["created_at"]), at(&order["created_at"]));
        let lines = products_and_quantities(&data["lines"]);
        let asked = match body.get("lines") {
            Some(ls) => products_and_quantities(ls),
            None => vec![("ev-kept".to_owned(), 3)],
        };
        assert_eq!(lines, asked, "{data}");
        assert!(data.get("cancelled_at").is_none(), "{data}");

        let resp = app
            .client
            .post(app.url(&format!("/v1/orders/{id}/cancel")))
            .bearer_auth(app.user_token("ev-buyer"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            StatusCode::OK,
            "{}",
            resp.text().await.unwrap()
        );
        let feed = feed_through(&app, |e| {
            e["type"] == "order.cancelled" && e["data"]["order_id"] == id.as_str()
        })
        .await;
        assert_eq!(
            confirmed_of(&feed),
            before,
            "the confirmed event changed with the order"
        );
    }
}

/// A statement that writes thousands of changes (an operator's bulk insert) is never refused
/// for its events: they go in rows of at most a thousand, in order. Mutation seen failing:
/// one row per statement (a row holds at most 65,535 events; 300,000 orders were refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_of_thousands_of_changes_writes_all_their_events_in_order() {
    let cluster = shared_cluster();
    let app = spawn_app(cluster).await;
    assert_eq!(
        app.create_product("bulk", 1, 100).await.status(),
        StatusCode::CREATED
    );
    app.insert_confirmed_orders("bulk", 2500).await;
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE 'order.confirmed' = ANY(types)")
            .fetch_one(&app.primary)
            .await
            .unwrap();
    assert_eq!(rows, 3, "2,500 events in rows of at most a thousand");
    assert_eq!(
        app.create_product("bulk-end", 1, 100).await.status(),
        StatusCode::CREATED
    );
    let feed = feed_through(&app, created("bulk-end")).await;
    let orders: Vec<String> = feed
        .iter()
        .filter(|e| e["type"] == "order.confirmed")
        .map(|e| e["data"]["order_id"].as_str().unwrap().to_owned())
        .collect();
    let mut sorted = orders.clone();
    sorted.sort();
    assert_eq!(orders.len(), 2500);
    assert_eq!(
        orders, sorted,
        "a statement's events in the order it gave them"
    );
}

/// The feed is complete only up to the start of the oldest transaction still open: while one
/// is open, an order answered 201 is held back from every page (on the primary and on a fresh
/// replica alike), so no page may state an `as_of` after that 201. A paused replica (inside the
/// 5 s budget) holds it back as well, by its own staleness. Every answer, on every node, either
/// holds the order or states an `as_of` before the 201 was received; once the transaction ends,
/// the order is served with an `as_of` after it. Mutation seen failing: `Feed::bound` returning
/// `None` (pages held back by the open transaction stated `as_of` up to seconds after the 201).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_answer_never_states_an_as_of_after_an_order_it_holds_back() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    assert_eq!(
        app.create_product("held-back", 10, 100).await.status(),
        StatusCode::CREATED
    );
    feed_through(&app, created("held-back")).await;
    // Replica-1 stops replaying: it stays within the feed's 5 s budget for a while.
    blocking(|| cluster.pause_replay(1)).expect("pause replica-1");

    // Another session holds a transaction id open (a psql session, a cart batch...).
    let mut open = app.primary.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *open)
        .await
        .unwrap();

    let resp = app.order("ada", "held-back-1", "held-back", 1).await;
    let (status, order) = answer(resp).await;
    let acked = chrono::Utc::now();
    assert_eq!(status, StatusCode::CREATED, "{order}");
    let order_id = order["order_id"].as_str().unwrap().to_owned();

    let holds =
        |body: &Value| {
            body["events"].as_array().unwrap().iter().any(|e| {
                e["type"] == "order.confirmed" && e["data"]["order_id"] == order_id.as_str()
            })
        };
    let as_of = |body: &Value| -> chrono::DateTime<chrono::Utc> {
        body["as_of"].as_str().unwrap().parse().unwrap()
    };
    let mut margins: Vec<(String, chrono::Duration)> = Vec::new();
    let judge = |body: &Value, margins: &mut Vec<(String, chrono::Duration)>| {
        if !holds(body) {
            let by = body["served_by"].as_str().unwrap().to_owned();
            assert!(
                as_of(body) < acked,
                "{by} left out the order answered 201 at {acked} but stated as_of {}",
                body["as_of"]
            );
            margins.push((by, acked - as_of(body)));
        }
    };
    // While the transaction is open every page holds the order back, wherever it is read,
    // long-polls included.
    for i in 0..12 {
        let q = if i % 3 == 0 { "wait_ms=300" } else { "" };
        let (status, body) = page(&app, q).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(
            !holds(&body),
            "the open transaction held nothing back: {body}"
        );
        judge(&body, &mut margins);
    }
    let held_open: Vec<String> = margins.iter().map(|(by, _)| by.clone()).collect();
    assert!(
        held_open.iter().any(|by| by != "replica-1"),
        "no page came from a node that had replayed the order: {held_open:?}"
    );
    open.commit().await.unwrap();

    // Replica-1 still lacks the order; the others serve it once the horizon passes it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut served_after = None;
    while tokio::time::Instant::now() < deadline {
        let (status, body) = page(&app, "").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        judge(&body, &mut margins);
        if holds(&body) {
            served_after = Some(as_of(&body));
            break;
        }
    }
    let served_at = served_after.expect("the order was never served after the transaction ended");
    assert!(
        served_at > acked,
        "the page that served the order is dated {served_at}, before its 201 at {acked}"
    );
    blocking(|| cluster.resume_replay(1)).expect("resume replica-1");
    let worst = margins.iter().map(|(_, m)| *m).min().unwrap();
    eprintln!(
        "feed as_of: {} answers held the order back, the closest {} ms before its 201; served by {:?}",
        margins.len(),
        worst.num_milliseconds(),
        margins
            .iter()
            .map(|(by, _)| by.as_str())
            .collect::<HashSet<_>>()
    );
}

/// A `next` the service handed out never leads to 410, an empty first page's included: once
/// the purge has removed every event, the first page's `next` is where the purge reached.
/// Mutation seen failing: an empty first page answering `next` "0-0" (410 on the next call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_first_page_hands_out_a_cursor_that_is_never_expired() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    assert_eq!(
        app.create_product("gone-soon", 1, 1).await.status(),
        StatusCode::CREATED
    );
    feed_through(&app, created("gone-soon")).await;
    let purged = stockgate::events::feed::purge(&app.primary, Duration::ZERO, 1000)
        .await
        .unwrap();
    assert!(purged >= 1, "nothing was purged");
    blocking(|| cluster.wait_caught_up(Duration::from_secs(30))).expect("replicas caught up");
    let (status, first) = page(&app, "").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["events"], json!([]), "{first}");
    let next = first["next"].as_str().unwrap().to_owned();
    // The purge really passed the start: a cursor before it is expired.
    assert_error(&page(&app, "after=0-0").await, 410, "CURSOR_EXPIRED");
    for _ in 0..4 {
        let (status, body) = page(&app, &format!("after={next}")).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "the handed-out next {next} was refused: {body}"
        );
    }
    // And it still leads to what comes next.
    assert_eq!(
        app.create_product("after-purge", 1, 1).await.status(),
        StatusCode::CREATED
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = page(&app, &format!("after={next}&wait_ms=1000")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        if body["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["data"]["product_id"] == "after-purge")
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new event never came"
        );
    }
}
