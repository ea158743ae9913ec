//! Webhooks (contract, "Webhooks"): every subscribed event, in feed order, signed, at least
//! once, by one instance at a time, through a failing receiver and an instance restart.

use crate::helpers::{
    AppOptions, ChaosProxy, TestApp, fresh_database, shared_cluster, spawn_app, spawn_app_with,
    spawn_beside, spawn_through_proxy, wait_for,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode as AxumStatus};
use hmac::{Hmac, Mac};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::Sha256;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const SECRET: &str = "whsec-test-0123456789abcdef";
const TYPES: [&str; 4] = [
    "order.confirmed",
    "order.cancelled",
    "hold.created",
    "hold.released",
];

/// One request the receiver got, and what it answered.
#[derive(Debug, Clone)]
struct Arrival {
    cursor: String,
    signature: String,
    body: Bytes,
    accepted: bool,
    /// When it arrived (the receiver's own clock).
    at: Instant,
}

/// The receiver's state: what arrived, how many answers are still to fail, and a gate that,
/// while shut, keeps requests waiting for their answer (a delivery in flight).
struct Inbox {
    arrivals: Mutex<Vec<Arrival>>,
    fail_next: AtomicUsize,
    waiting: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    open: watch::Sender<bool>,
    /// How long each accepted request waits before its answer, in ms (a slow receiver).
    answer_after_ms: AtomicU64,
}

/// Counts a request in flight for as long as its handler lives.
struct InFlight<'a>(&'a Inbox);

impl<'a> InFlight<'a> {
    fn enter(inbox: &'a Inbox) -> Self {
        let now = inbox.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        inbox.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(inbox)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A webhook receiver on port 0 that answers 500 to its first `fail_first` requests.
struct Receiver {
    url: String,
    inbox: Arc<Inbox>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(State(inbox): State<Arc<Inbox>>, headers: HeaderMap, body: Bytes) -> AxumStatus {
    let _counted = InFlight::enter(&inbox);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let fail = inbox
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    inbox.arrivals.lock().unwrap().push(Arrival {
        cursor: header("stockgate-event-cursor"),
        signature: header("stockgate-signature"),
        body,
        accepted: !fail,
        at: Instant::now(),
    });
    if fail {
        return AxumStatus::INTERNAL_SERVER_ERROR;
    }
    let mut open = inbox.open.subscribe();
    inbox.waiting.fetch_add(1, Ordering::SeqCst);
    let _ = open.wait_for(|open| *open).await;
    inbox.waiting.fetch_sub(1, Ordering::SeqCst);
    let slow = inbox.answer_after_ms.load(Ordering::SeqCst);
    if slow > 0 {
        tokio::time::sleep(Duration::from_millis(slow)).await;
    }
    AxumStatus::NO_CONTENT
}

impl Receiver {
    async fn start(fail_first: usize) -> Receiver {
        let inbox = Arc::new(Inbox {
            arrivals: Mutex::new(Vec::new()),
            fail_next: AtomicUsize::new(fail_first),
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            open: watch::Sender::new(true),
            answer_after_ms: AtomicU64::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(receive))
            .with_state(inbox.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { url, inbox, task }
    }

    fn arrivals(&self) -> Vec<Arrival> {
        self.inbox.arrivals.lock().unwrap().clone()
    }

    /// The cursors answered 2xx, each once, in the order they first were.
    fn delivered(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        self.arrivals()
            .into_iter()
            .filter(|a| a.accepted && seen.insert(a.cursor.clone()))
            .map(|a| a.cursor)
            .collect()
    }

    fn shut_gate(&self) {
        self.inbox.open.send_replace(false);
    }

    fn open_gate(&self) {
        self.inbox.open.send_replace(true);
    }
}

/// Whether `signature` is `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>">` with `secret`, for a
/// `t` within five minutes of now.
fn signed(secret: &str, signature: &str, body: &[u8]) -> bool {
    let Some((t, v1)) = signature
        .strip_prefix("t=")
        .and_then(|s| s.split_once(",v1="))
    else {
        return false;
    };
    let (Ok(t_secs), Ok(mac_bytes)) = (t.parse::<i64>(), hex::decode(v1)) else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    (chrono::Utc::now().timestamp() - t_secs).abs() < 300 && mac.verify_slice(&mac_bytes).is_ok()
}

async fn admin(
    app: &TestApp,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = app
        .client
        .request(method, app.url(path))
        .bearer_auth(&app.admin);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let resp = req.send().await.unwrap();
    (resp.status(), resp.json().await.unwrap_or(Value::Null))
}

async fn register(app: &TestApp, url: &str, types: &[&str]) -> Value {
    let (status, body) = admin(
        app,
        Method::POST,
        "/v1/admin/webhooks",
        Some(json!({"url": url, "secret": SECRET, "types": types})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body
}

fn parse_cursor(c: &str) -> (u64, i64) {
    let (xid, n) = c.split_once('-').unwrap();
    (
        u64::from_str_radix(xid, 16).unwrap(),
        i64::from_str_radix(n, 16).unwrap(),
    )
}

/// The events of `types` after `after`, in feed order, as `(cursor, type)`, straight from
/// the table.
async fn feed_after(pool: &sqlx::PgPool, after: &str, types: &[&str]) -> Vec<(String, String)> {
    let (xid, n) = parse_cursor(after);
    let rows: Vec<(i64, i64, String)> = sqlx::query_as(
        "SELECT e.xid::text::int8, e.n * 65536 + x.i, x.item->>'type' \
         FROM events e, json_array_elements(e.items) WITH ORDINALITY x(item, i) \
         WHERE (e.xid, e.n * 65536 + x.i) > ($1::text::xid8, $2) AND x.item->>'type' = ANY($3) \
         ORDER BY e.xid, e.n, x.i",
    )
    .bind(xid.to_string())
    .bind(n)
    .bind(types)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(x, n, t)| (format!("{x:x}-{n:x}"), t))
        .collect()
}

/// Orders (a third of them cancelled) and holds (half of them released) on `app`.
async fn churn(app: &TestApp, tag: &str, rounds: usize) {
    for i in 0..rounds {
        let user = format!("wh-{tag}-{i}");
        let order = app.order(&user, &format!("o-{tag}-{i}"), "wh-sku", 1).await;
        assert_eq!(order.status(), StatusCode::CREATED);
        let order: Value = order.json().await.unwrap();
        if i % 3 == 0 {
            let id = order["order_id"].as_str().unwrap();
            let path = format!("/v1/orders/{id}/cancel");
            let (s, _) =
                crate::helpers::send_as(app, Method::POST, &path, &user, None, json!({})).await;
            assert_eq!(s, StatusCode::OK);
        }
        let body = json!({"lines": [{"product_id": "wh-sku", "quantity": 1}], "ttl_s": 600});
        let key = format!("h-{tag}-{i}");
        let (s, hold) = crate::helpers::send_as(
            app,
            Method::POST,
            "/v1/holds",
            &user,
            Some(key.as_str()),
            body,
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{hold}");
        if i % 2 == 0 {
            let path = format!("/v1/holds/{}", hold["hold_id"].as_str().unwrap());
            let (s, _) =
                crate::helpers::send_as(app, Method::DELETE, &path, &user, None, json!({})).await;
            assert_eq!(s, StatusCode::OK);
        }
    }
}

/// How many events `app` has delivered to webhooks (its own counter).
async fn delivered_by(app: &TestApp) -> f64 {
    app.metric("stockgate_webhook_deliveries_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_gets_every_subscribed_event_in_feed_order_signed_through_failures_and_a_restart()
{
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    assert_eq!(
        a.create_product("wh-sku", 100_000, 250).await.status(),
        StatusCode::CREATED
    );
    let receiver = Receiver::start(3).await;
    let hook = register(&b, &receiver.url, &TYPES).await;
    let id = hook["webhook_id"].as_str().unwrap().to_string();
    let start = hook["delivered_cursor"].as_str().unwrap().to_string();

    // Orders, cancels and holds on both instances while the receiver fails its first three
    // answers: the first event is retried until it is taken.
    tokio::join!(churn(&a, "a", 12), churn(&b, "b", 12), async {
        wait_for("five events delivered", Duration::from_secs(30), || async {
            receiver.delivered().len() >= 5
        })
        .await;
    });
    // Shut the gate and make one more event: its delivery waits, unanswered, in flight.
    receiver.shut_gate();
    a.order("wh-late", "o-late", "wh-sku", 1).await;
    wait_for("a delivery in flight", Duration::from_secs(30), || async {
        receiver.inbox.waiting.load(Ordering::SeqCst) >= 1
    })
    .await;
    let in_flight = receiver.arrivals().last().unwrap().cursor.clone();
    assert_eq!(
        receiver.inbox.max_in_flight.load(Ordering::SeqCst),
        1,
        "one delivery in flight at a time, across both instances"
    );

    // The instance delivering goes away mid-delivery; the other one is restarted beside.
    let (by_a, by_b) = (delivered_by(&a).await, delivered_by(&b).await);
    assert!(
        by_a == 0.0 || by_b == 0.0,
        "one deliverer: a {by_a}, b {by_b}"
    );
    let (gone, stays) = if by_a > 0.0 { (a, b) } else { (b, a) };
    let port = gone.address.rsplit(':').next().unwrap().to_string();
    drop(gone);
    wait_for("the deliverer stopped", Duration::from_secs(15), || async {
        tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
            .await
            .is_err()
    })
    .await;
    let restarted = spawn_beside(&stays, cluster).await;
    // The event in flight was never recorded as delivered: it is sent again, by the instance
    // that took the lease over.
    wait_for(
        "the event in flight sent again",
        Duration::from_secs(30),
        || async {
            receiver
                .arrivals()
                .iter()
                .filter(|a| a.cursor == in_flight)
                .count()
                >= 2
        },
    )
    .await;
    receiver.open_gate();
    tokio::join!(churn(&stays, "c", 6), churn(&restarted, "d", 6));

    let want = feed_after(&stays.primary, &start, &TYPES).await;
    let last = want.last().unwrap().0.clone();
    wait_for("every event delivered", Duration::from_secs(60), || async {
        let (_, now) = admin(
            &stays,
            Method::GET,
            &format!("/v1/admin/webhooks/{id}"),
            None,
        )
        .await;
        now["delivered_cursor"] == last.as_str()
    })
    .await;

    let want_cursors: Vec<String> = want.iter().map(|(c, _)| c.clone()).collect();
    // The setup reached its claim: many events, and many of them after the restart.
    let restart_at = want_cursors.iter().position(|c| *c == in_flight).unwrap();
    assert!(
        want.len() >= 80 && restart_at >= 5 && want.len() - restart_at >= 30,
        "{restart_at} of {}",
        want.len()
    );
    assert_eq!(
        receiver.delivered(),
        want_cursors,
        "every event once, in feed order"
    );
    let types: HashMap<&str, &str> = want.iter().map(|(c, t)| (c.as_str(), t.as_str())).collect();
    let arrivals = receiver.arrivals();
    for a in &arrivals {
        assert!(
            signed(SECRET, &a.signature, &a.body),
            "signature of {}",
            a.cursor
        );
        let body: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(
            body["cursor"],
            a.cursor.as_str(),
            "header and body name one event"
        );
        assert_eq!(body["type"], types[a.cursor.as_str()]);
        assert!(body["at"].is_string() && body["data"].is_object(), "{body}");
    }
    // The three failures were the first event, retried; the only other repeat is the event
    // that was in flight when its deliverer went away.
    let first: Vec<&str> = arrivals[..4].iter().map(|a| a.cursor.as_str()).collect();
    assert_eq!(
        first,
        [want_cursors[0].as_str(); 4],
        "the failed event is retried, not skipped"
    );
    let mut sent = HashMap::<&str, usize>::new();
    arrivals
        .iter()
        .for_each(|a| *sent.entry(a.cursor.as_str()).or_default() += 1);
    let repeated: BTreeSet<&str> = sent
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(c, _)| *c)
        .collect();
    let allowed = BTreeSet::from([want_cursors[0].as_str(), in_flight.as_str()]);
    assert!(
        repeated.is_subset(&allowed),
        "repeats {repeated:?} beyond {allowed:?}"
    );

    let (_, status) = admin(
        &stays,
        Method::GET,
        &format!("/v1/admin/webhooks/{id}"),
        None,
    )
    .await;
    assert_eq!(status["failures"], 0, "{status}");
    assert!(
        status["last_error"].as_str().unwrap_or("").contains("500"),
        "{status}"
    );
}

/// A deleted webhook gets nothing more: after the DELETE (and the holder's letting it go),
/// orders are confirmed until a live control webhook of the same types has every one of them,
/// and the deleted webhook's receiver has none.
///
/// Mutation seen failing it: the worker never lets deleted webhooks go (`let_go_of_deleted`
/// returns nothing at once): the deleted webhook's lock is never released, and the wait for it
/// fails (the old version, which concluded as soon as a control created after the delete had one
/// order, could pass it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_webhook_starts_after_the_newest_event_and_a_deleted_one_gets_nothing_more() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("wh-new", 100, 100).await;
    let before = app.order("wh-u1", "k1", "wh-new", 1).await;
    assert_eq!(before.status(), StatusCode::CREATED);
    // The order's event is below the feed's horizon (no transaction that could precede it is
    // still open), so "the newest event" at creation is at or after it.
    wait_for(
        "the order's event is servable",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM events WHERE 'order.confirmed' = ANY(types) \
                            AND xid < pg_snapshot_xmin(pg_current_snapshot()))",
            )
            .fetch_one(&app.primary)
            .await
            .unwrap()
        },
    )
    .await;
    let newest = feed_after(&app.primary, "0-0", &["order.confirmed"]).await;
    let receiver = Receiver::start(0).await;
    let hook = register(&app, &receiver.url, &["order.confirmed"]).await;
    let start = hook["delivered_cursor"].as_str().unwrap().to_string();
    assert!(
        parse_cursor(&start) >= parse_cursor(&newest[0].0),
        "{start} names the newest event"
    );

    // A control webhook of the same types, leased and delivering before the delete: what it
    // gets after the delete is what the deleted one would have been sent.
    let control = Receiver::start(0).await;
    register(&app, &control.url, &["order.confirmed"]).await;
    app.order("wh-u2", "k2", "wh-new", 1).await;
    let want = feed_after(&app.primary, &start, &["order.confirmed"]).await;
    assert_eq!(want.len(), 1, "only the order after the webhook: {want:?}");
    wait_for(
        "the new order delivered to both webhooks",
        Duration::from_secs(30),
        || async {
            receiver.delivered() == [want[0].0.clone()]
                && control.delivered() == [want[0].0.clone()]
        },
    )
    .await;

    // Deleted: the orders after it go to the control, and none to this one. The test concludes
    // only once the control has every one of them (a condition, not a sleep): by then a
    // deleted webhook still held by the worker would have been sent them too.
    let id = hook["webhook_id"].as_str().unwrap();
    let (s, _) = admin(
        &app,
        Method::DELETE,
        &format!("/v1/admin/webhooks/{id}"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    // The holder lets a deleted webhook go at its next tick; until then, an event committed
    // just after the DELETE can still be sent (within one tick, `let_go_of_deleted` runs before
    // the feed is read). So the orders come once no session holds the deleted webhook's lock.
    wait_for(
        "the deleted webhook's lease let go",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks l JOIN webhooks w ON l.objid = w.lock_key::oid \
                 WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted \
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND w.webhook_id = $1::uuid",
            )
            .bind(id)
            .fetch_one(&app.primary)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    for i in 3..8 {
        let resp = app
            .order(&format!("wh-u{i}"), &format!("k{i}"), "wh-new", 1)
            .await;
        assert_eq!(resp.status(), StatusCode::CREATED);
    }
    let after: Vec<String> = feed_after(&app.primary, &want[0].0, &["order.confirmed"])
        .await
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    assert_eq!(after.len(), 5, "{after:?}");
    wait_for(
        "the control webhook got every order after the delete",
        Duration::from_secs(30),
        || async {
            let got = control.delivered();
            after.iter().all(|c| got.contains(c))
        },
    )
    .await;
    let sent: Vec<String> = receiver.arrivals().into_iter().map(|a| a.cursor).collect();
    assert_eq!(sent, [want[0].0.clone()], "nothing after the delete");
    let (s, body) = admin(&app, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
    assert_eq!(
        (s, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("WEBHOOK_NOT_FOUND"))
    );
}

/// Mutations that fail it: drop `WebhookUrl::parse`'s control-character check (a NUL in the
/// path or query reached the table: 500), or `Secret::parse`'s NUL check (500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_webhook_input_is_refused_with_its_code_and_a_user_token_is_forbidden() {
    let app = spawn_app(shared_cluster()).await;
    let good =
        json!({"url": "http://127.0.0.1:9/hook", "secret": SECRET, "types": ["hold.created"]});
    let with = |field: &str, value: Value| {
        let mut body = good.clone();
        body[field] = value;
        body
    };
    let refused = [
        (
            with("url", json!("ftp://example.com/hook")),
            422,
            "INVALID_URL",
        ),
        (with("url", json!("not a url")), 422, "INVALID_URL"),
        (with("secret", json!("s".repeat(15))), 422, "INVALID_SECRET"),
        (
            with("secret", json!("s".repeat(257))),
            422,
            "INVALID_SECRET",
        ),
        // A NUL anywhere was a 500 (PostgreSQL's text cannot hold one); every control
        // character in a URL is refused.
        (
            with("url", json!("http://127.0.0.1:9/ho\u{0}ok")),
            422,
            "INVALID_URL",
        ),
        (
            with("url", json!("http://127.0.0.1:9/hook?x=\u{0}")),
            422,
            "INVALID_URL",
        ),
        (
            with("url", json!("http://127.0.0.1:9/hook\n")),
            422,
            "INVALID_URL",
        ),
        (
            with("secret", json!(format!("\u{0}{SECRET}"))),
            422,
            "INVALID_SECRET",
        ),
        (
            with("secret", json!(format!("whsec-\u{0}-{SECRET}"))),
            422,
            "INVALID_SECRET",
        ),
        (with("types", json!([])), 422, "INVALID_TYPES"),
        (
            with("types", json!(["order.confirmed", "order.\u{0}"])),
            422,
            "INVALID_TYPES",
        ),
        (
            with("types", json!(["order.shipped"])),
            422,
            "INVALID_TYPES",
        ),
        (with("types", json!("order.confirmed")), 400, "INVALID_BODY"),
        (with("extra", json!(1)), 400, "INVALID_BODY"),
        (
            json!({"url": "http://127.0.0.1:9/hook", "secret": SECRET}),
            400,
            "INVALID_BODY",
        ),
    ];
    for (body, status, code) in refused {
        let (s, answer) = admin(&app, Method::POST, "/v1/admin/webhooks", Some(body.clone())).await;
        assert_eq!(
            (s.as_u16(), answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}"
        );
    }
    let malformed = app
        .client
        .post(app.url("/v1/admin/webhooks"))
        .bearer_auth(&app.admin)
        .header("content-type", "application/json")
        .body("{\"url\":")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), StatusCode::BAD_REQUEST);

    let unknown = uuid::Uuid::new_v4();
    for method in [Method::GET, Method::DELETE] {
        let (s, body) = admin(&app, method.clone(), "/v1/admin/webhooks/not-a-uuid", None).await;
        assert_eq!(
            (s, body["error"]["code"].as_str()),
            (StatusCode::BAD_REQUEST, Some("INVALID_WEBHOOK_ID"))
        );
        let (s, body) = admin(&app, method, &format!("/v1/admin/webhooks/{unknown}"), None).await;
        assert_eq!(
            (s, body["error"]["code"].as_str()),
            (StatusCode::NOT_FOUND, Some("WEBHOOK_NOT_FOUND"))
        );
    }

    // A user token may do none of it; an admin's webhook is then there, once.
    let user = app.user_token("wh-user");
    let created = register(&app, "http://127.0.0.1:9/hook", &["hold.created"]).await;
    let id = created["webhook_id"].as_str().unwrap();
    for (method, path) in [
        (Method::POST, "/v1/admin/webhooks".to_string()),
        (Method::GET, "/v1/admin/webhooks".to_string()),
        (Method::GET, format!("/v1/admin/webhooks/{id}")),
        (Method::DELETE, format!("/v1/admin/webhooks/{id}")),
    ] {
        let resp = app
            .client
            .request(method.clone(), app.url(&path))
            .bearer_auth(&user)
            .json(&good)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{method} {path}");
        let anonymous = app
            .client
            .request(method.clone(), app.url(&path))
            .json(&good)
            .send()
            .await
            .unwrap();
        assert_eq!(
            anonymous.status(),
            StatusCode::UNAUTHORIZED,
            "{method} {path}"
        );
    }
    let (s, listed) = admin(&app, Method::GET, "/v1/admin/webhooks", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["types"], json!(["hold.created"]));
    assert!(
        listed[0].get("secret").is_none(),
        "the secret is never shown"
    );
    let (s, shown) = admin(&app, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(shown["failures"], 0);
    assert_eq!(shown["delivered_cursor"], created["delivered_cursor"]);
    let (s, _) = admin(
        &app,
        Method::DELETE,
        &format!("/v1/admin/webhooks/{id}"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = admin(
        &app,
        Method::DELETE,
        &format!("/v1/admin/webhooks/{id}"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "deleted once");
}

/// The cursor of the event that announced order `order_id`, straight from the table (`None`
/// while there is none).
async fn event_of_order(pool: &sqlx::PgPool, order_id: &str) -> Option<String> {
    let row: Option<(i64, i64)> = sqlx::query_as(
        "SELECT e.xid::text::int8, e.n * 65536 + x.i \
         FROM events e, json_array_elements(e.items) WITH ORDINALITY x(item, i) \
         WHERE x.item->>'type' = 'order.confirmed' AND x.item->'data'->>'order_id' = $1",
    )
    .bind(order_id)
    .fetch_optional(pool)
    .await
    .unwrap();
    row.map(|(x, n)| format!("{x:x}-{n:x}"))
}

/// An order of one unit, answered 201; its id.
async fn placed(app: &TestApp, user: &str, key: &str, product: &str) -> String {
    let resp = app.order(user, key, product, 1).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let order: Value = resp.json().await.unwrap();
    order["order_id"].as_str().unwrap().to_string()
}

/// An order confirmed (201) before the webhook was created, while an older transaction held
/// the feed's horizon back, sorts after the webhook's starting cursor; it must still never be
/// sent, and an order confirmed after the creation must be.
///
/// Mutation seen failing it: deliver every event after the starting cursor (drop the
/// creation-snapshot filter in `send_next`): the earlier order arrives first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_confirmed_before_the_webhook_existed_is_never_sent_to_it_though_it_sorts_after_its_start()
 {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        app.create_product("wh-snap", 100, 100).await.status(),
        StatusCode::CREATED
    );
    // An older transaction holding an xid (a psql session, a cart batch) stays open.
    let mut held = app.primary.begin().await.unwrap();
    let held_xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8")
        .fetch_one(&mut *held)
        .await
        .unwrap();
    let before = placed(&app, "wh-s1", "s1", "wh-snap").await;
    let receiver = Receiver::start(0).await;
    let hook = register(&app, &receiver.url, &["order.confirmed"]).await;
    let after = placed(&app, "wh-s2", "s2", "wh-snap").await;
    held.rollback().await.unwrap();

    // Precondition: the earlier order's event is above the creation snapshot's xmin (so after
    // the starting cursor), and that snapshot saw its transaction committed.
    let id = uuid::Uuid::parse_str(hook["webhook_id"].as_str().unwrap()).unwrap();
    let before_cursor = event_of_order(&app.primary, &before).await.unwrap();
    let (xmin, saw): (i64, bool) = sqlx::query_as(
        "SELECT pg_snapshot_xmin(created_snapshot)::text::int8, \
                pg_visible_in_snapshot($2::text::xid8, created_snapshot) \
         FROM webhooks WHERE webhook_id = $1",
    )
    .bind(id)
    .bind(parse_cursor(&before_cursor).0.to_string())
    .fetch_one(&app.primary)
    .await
    .unwrap();
    let start = hook["delivered_cursor"].as_str().unwrap();
    assert!(
        xmin <= held_xid && parse_cursor(&before_cursor).0 >= xmin as u64,
        "xmin {xmin}, held {held_xid}, earlier order {before_cursor}"
    );
    assert!(
        parse_cursor(&before_cursor) > parse_cursor(start),
        "{before_cursor} sorts after the start {start}"
    );
    assert!(saw, "the creation saw the earlier order committed");

    let after_cursor = event_of_order(&app.primary, &after).await.unwrap();
    assert!(parse_cursor(&after_cursor) > parse_cursor(&before_cursor));
    wait_for(
        "the order after the creation delivered",
        Duration::from_secs(30),
        || async { !receiver.delivered().is_empty() },
    )
    .await;
    // Delivery is in feed order, so the earlier order would have come first.
    let sent: Vec<String> = receiver.arrivals().into_iter().map(|a| a.cursor).collect();
    assert_eq!(sent, [after_cursor], "only the order after the creation");
}

/// A deliverer whose process freezes keeps its TCP connection to the primary open and silent
/// (as under SIGSTOP: the kernel still answers for it). Here its primary link goes through a
/// proxy that is cut: nothing passes either way, nothing is closed. Another instance must take
/// its webhook over within seconds and deliver what is confirmed meanwhile.
///
/// Mutation seen failing it: no `idle_session_timeout` on the lease session (the frozen
/// session, and its advisory lock, stay for ever; the order is never delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_deliverer_loses_its_webhooks_to_another_instance_within_seconds() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let frozen = spawn_through_proxy(cluster, &db, &proxy).await;
    assert_eq!(
        frozen.create_product("wh-frz", 1000, 100).await.status(),
        StatusCode::CREATED
    );
    let receiver = Receiver::start(0).await;
    register(&frozen, &receiver.url, &["order.confirmed"]).await;
    placed(&frozen, "wh-f1", "f1", "wh-frz").await;
    wait_for(
        "the first instance delivers",
        Duration::from_secs(30),
        || async { delivered_by(&frozen).await >= 1.0 },
    )
    .await;
    let other = spawn_beside(&frozen, cluster).await;
    // Precondition: the first instance holds the lease (the other one is idle beside it).
    let holders: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN webhooks w ON l.objid = w.lock_key::oid \
         WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&other.primary)
    .await
    .unwrap();
    assert_eq!(holders, 1);
    assert_eq!(delivered_by(&other).await, 0.0);

    proxy.cut();
    let frozen_at = Instant::now();
    let order = placed(&other, "wh-f2", "f2", "wh-frz").await;
    let cursor = event_of_order(&other.primary, &order).await.unwrap();
    wait_for(
        "the order placed after the freeze delivered",
        Duration::from_secs(60),
        || async { receiver.delivered().contains(&cursor) },
    )
    .await;
    let took = frozen_at.elapsed();
    eprintln!(
        "webhook take-over from a frozen deliverer: {:.2} s (lease idle_session_timeout {:?})",
        took.as_secs_f64(),
        stockgate::events::webhooks::LEASE_IDLE_TIMEOUT
    );
    // The receiver records a delivery when the POST arrives; the deliverer counts it once the
    // answer is back, a moment later: polled, not read once.
    wait_for(
        "the other instance took over",
        Duration::from_secs(10),
        || async { delivered_by(&other).await >= 1.0 },
    )
    .await;
    proxy.heal();
}

/// Events purged past retention while the receiver refused them: what the deliverer had read
/// ahead before the purge is still sent; the rest is gone, and the webhook says how many
/// (`lost_events`) and why (`last_error`), rather than skipping them in silence.
///
/// Mutation seen failing it: skip `lost::reconcile` in `send_next` (nothing is said).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_purged_before_a_webhook_was_sent_them_are_counted_and_said_on_it() {
    // The service's purge is run here with a 1 s retention; the instance's own keeps a minute,
    // so the order placed after the purge cannot itself be purged while the deliverer sits out
    // the backoff its refused attempts earned (with a 1 s retention everywhere it sometimes
    // was, and was never delivered).
    let retention = Duration::from_secs(1);
    let app = spawn_app_with(AppOptions {
        env: vec![("STOCKGATE_EVENT_RETENTION", "60s".into())],
        ..AppOptions::new(shared_cluster())
    })
    .await;
    assert_eq!(
        app.create_product("wh-purge", 10, 100).await.status(),
        StatusCode::CREATED
    );
    let receiver = Receiver::start(usize::MAX).await;
    let hook = register(&app, &receiver.url, &["order.confirmed"]).await;
    let id = hook["webhook_id"].as_str().unwrap().to_string();
    let start = hook["delivered_cursor"].as_str().unwrap().to_string();
    // One statement, one row of 150 events: more than the deliverer reads ahead.
    app.insert_confirmed_orders("wh-purge", 150).await;
    let written: Vec<String> = feed_after(&app.primary, &start, &["order.confirmed"])
        .await
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    assert_eq!(written.len(), 150);
    wait_for(
        "the first event refused",
        Duration::from_secs(30),
        || async { !receiver.arrivals().is_empty() },
    )
    .await;
    // The service's own purge, while the receiver refuses.
    wait_for("the events purged", Duration::from_secs(30), || async {
        stockgate::events::feed::purge(&app.primary, retention, 10_000)
            .await
            .unwrap();
        feed_after(&app.primary, &start, &["order.confirmed"])
            .await
            .is_empty()
    })
    .await;
    receiver.inbox.fail_next.store(0, Ordering::SeqCst);
    let order = placed(&app, "wh-p1", "p1", "wh-purge").await;
    let last = event_of_order(&app.primary, &order).await.unwrap();
    wait_for(
        "the order after the purge delivered",
        Duration::from_secs(60),
        || async { receiver.delivered().contains(&last) },
    )
    .await;

    let delivered = receiver.delivered();
    let sent_before = delivered.len() - 1;
    // Precondition: some were read ahead and some were not.
    assert!((1..150).contains(&sent_before), "{sent_before} sent");
    assert_eq!(
        delivered[..sent_before],
        written[..sent_before],
        "what was read ahead, in order"
    );
    let (_, status) = admin(&app, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
    assert_eq!(
        status["lost_events"],
        json!(150 - sent_before),
        "every event is either sent or counted lost: {status}"
    );
    let why = status["last_error"].as_str().unwrap_or("");
    assert!(why.contains("purged"), "{status}");
}

/// The contract's "no answer in 10 s" (`DELIVERY_TIMEOUT` in the worker).
const NO_ANSWER_AFTER: Duration = Duration::from_secs(10);

/// A receiver that answers 500 three times, then accepts a POST and never answers: the attempt
/// must time out (the webhook is not stalled for ever), `failures`/`last_error` say so, and the
/// same event is retried after the backoff and delivered once the receiver answers. The gaps
/// between the receiver's own arrival instants are at least `backoff()` of the failures so far
/// (the timed-out attempt's gap also holds the 10 s), grow, and stay within a generous bound of
/// it: a correctness bound on the schedule, not a speed claim.
///
/// Mutations seen failing it: the client built without `.timeout(DELIVERY_TIMEOUT)` (the
/// attempt hangs; `last_error` never says "no answer"); `backoff` returning a constant
/// `FIRST_RETRY` (the second retry comes 0.5 s after the first, not 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_is_timed_out_and_the_event_retried_with_a_growing_backoff() {
    use stockgate::events::webhooks::backoff;
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        app.create_product("wh-slow", 100, 100).await.status(),
        StatusCode::CREATED
    );
    // Three quick 500s, then the gate: the fourth request is accepted and never answered.
    let receiver = Receiver::start(3).await;
    receiver.shut_gate();
    let hook = register(&app, &receiver.url, &["order.confirmed"]).await;
    let id = hook["webhook_id"].as_str().unwrap().to_string();
    let order = placed(&app, "wh-t1", "t1", "wh-slow").await;
    let cursor = event_of_order(&app.primary, &order).await.unwrap();

    wait_for(
        "the fourth attempt waiting for its answer",
        Duration::from_secs(30),
        || async { receiver.inbox.waiting.load(Ordering::SeqCst) >= 1 },
    )
    .await;
    // The unanswered attempt is given up and said on the webhook (the next attempt waits for
    // backoff(4) = 4 s, then for the shut gate: a window of seconds for this poll).
    let status = Arc::new(Mutex::new(Value::Null));
    wait_for(
        "the unanswered attempt recorded as timed out",
        Duration::from_secs(30),
        || async {
            let (_, now) =
                admin(&app, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
            let timed_out = now["failures"] == 4
                && now["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("no answer"));
            *status.lock().unwrap() = now;
            timed_out
        },
    )
    .await;
    let recorded = status.lock().unwrap().clone();
    assert_eq!(
        recorded["delivered_cursor"], hook["delivered_cursor"],
        "{recorded}"
    );
    receiver.open_gate();
    wait_for(
        "the same event delivered after the backoff",
        Duration::from_secs(60),
        || async { receiver.delivered() == [cursor.clone()] },
    )
    .await;
    wait_for("the delivery recorded", Duration::from_secs(30), || async {
        let (_, now) = admin(&app, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
        now["delivered_cursor"] == cursor.as_str() && now["failures"] == 0
    })
    .await;

    let arrivals = receiver.arrivals();
    assert_eq!(arrivals.len(), 5, "three 500s, one timeout, one delivery");
    assert!(
        arrivals.iter().all(|a| a.cursor == cursor),
        "the same event each time, never skipped"
    );
    let gaps: Vec<Duration> = arrivals.windows(2).map(|w| w[1].at - w[0].at).collect();
    // The wait after the n-th failure; after the fourth, the attempt itself took the timeout.
    let least: Vec<Duration> = (1..=4u32)
        .map(|f| {
            backoff(f)
                + if f == 4 {
                    NO_ANSWER_AFTER
                } else {
                    Duration::ZERO
                }
        })
        .collect();
    eprintln!("webhook retry gaps {gaps:?}, at least {least:?}");
    for (i, (gap, least)) in gaps.iter().zip(&least).enumerate() {
        assert!(
            gap >= least,
            "retry {} came {gap:?} after the previous attempt, before the backoff {least:?}",
            i + 1
        );
        // Generous: twice the wait plus 3 s (ticks of 200 ms, statements, a loaded machine).
        assert!(
            *gap <= *least * 2 + Duration::from_secs(3),
            "retry {} came {gap:?} after the previous attempt, far beyond {least:?}",
            i + 1
        );
    }
    assert!(
        gaps[0] < gaps[1] && gaps[1] < gaps[2],
        "the quick failures' retries back off: {gaps:?}"
    );
}

/// Two instances, one webhook, a receiver that takes 200 ms over each answer and many events
/// confirmed on both instances: over the whole run, never more than one `POST` of the webhook
/// is in flight at once (the receiver counts them itself).
///
/// Mutation seen failing it: skip the lease check in `take_one_free` (no `pg_locks` filter, the
/// `pg_try_advisory_lock` result ignored): each instance delivers, two at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_never_have_two_posts_of_one_webhook_in_flight() {
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    assert_eq!(
        a.create_product("wh-one", 100_000, 100).await.status(),
        StatusCode::CREATED
    );
    let receiver = Receiver::start(0).await;
    receiver.inbox.answer_after_ms.store(200, Ordering::SeqCst);
    let hook = register(&a, &receiver.url, &["order.confirmed"]).await;
    let id = hook["webhook_id"].as_str().unwrap().to_string();
    let start = hook["delivered_cursor"].as_str().unwrap().to_string();
    for i in 0..15 {
        let (ua, ka, ub, kb) = (
            format!("wh-a{i}"),
            format!("a{i}"),
            format!("wh-b{i}"),
            format!("b{i}"),
        );
        tokio::join!(
            placed(&a, &ua, &ka, "wh-one"),
            placed(&b, &ub, &kb, "wh-one"),
        );
    }
    let want: Vec<String> = feed_after(&a.primary, &start, &["order.confirmed"])
        .await
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    assert_eq!(want.len(), 30);
    let last = want.last().unwrap().clone();
    wait_for("every event delivered", Duration::from_secs(60), || async {
        let (_, now) = admin(&a, Method::GET, &format!("/v1/admin/webhooks/{id}"), None).await;
        now["delivered_cursor"] == last.as_str()
    })
    .await;
    // Precondition: both instances were running and could deliver (each ticks every 200 ms);
    // the whole run took many slow answers.
    assert!(receiver.arrivals().len() >= 30);
    assert_eq!(
        receiver.inbox.max_in_flight.load(Ordering::SeqCst),
        1,
        "one POST of the webhook in flight at a time, over the whole run: by a {}, by b {}",
        delivered_by(&a).await,
        delivered_by(&b).await
    );
    assert_eq!(receiver.delivered(), want, "every event, in feed order");
}
