//! Stock in several locations: where every unit of an order, a cart or a hold is taken from
//! (the contract's allocation rule), transfers, and give-backs to the location a unit came
//! from. Real cluster, real concurrency, HTTP only: counts are read from the product page.

use crate::carts::lines;
use crate::helpers::*;
use chrono::Utc;
use futures::StreamExt;
use futures::future::join_all;
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

type Answer = (StatusCode, Value);
type Items<'a> = &'a [(&'a str, i64)];
type Locs<'a> = Option<&'a [&'a str]>;
/// Units per (product, location): an answer's `allocations`, or what a test expects.
type Allocs = BTreeMap<(String, String), i64>;
/// Units per location.
type PerLocation = BTreeMap<String, i64>;

const TRANSFERS: &str = "/v1/transfers";

/// An entry of `allocations`, of a product page's `stock` (with `active`), of an
/// availability answer's `by_location`, or of `GET /v1/locations`.
#[derive(Debug, Deserialize)]
struct Entry {
    product_id: Option<String>,
    location_id: String,
    #[serde(alias = "available_quantity")]
    quantity: Option<i64>,
    active: Option<bool>,
}

/// `name` made unique to one test run (`name-1a2b3c4d`), leaked so tables can hold it: ids
/// of one run never meet another's.
fn unique(name: &str, run: &str) -> &'static str {
    format!("{name}-{run}").leak()
}

fn run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

async fn get(app: &TestApp, path: &str) -> Answer {
    send_admin(app, Method::GET, path, None, Value::Null).await
}

async fn post(app: &TestApp, path: &str, body: Value) -> Answer {
    send_admin(app, Method::POST, path, None, body).await
}

/// Asserts `got` is `status` with `field` = `value`.
#[track_caller]
fn expect(got: &Answer, status: u16, field: &str, value: impl Into<Value>) {
    let ok = got.0.as_u16() == status && got.1[field] == value.into();
    assert!(ok, "want {status} with {field}: {} {}", got.0, got.1);
}

/// Creates each (location, rank).
async fn locations(app: &TestApp, ranked: &[(&str, i64)]) {
    for &(id, rank) in ranked {
        let body = json!({"location_id": id, "name": format!("Site {id}"), "rank": rank});
        let got = post(app, "/v1/locations", body).await;
        expect(&got, 201, "location_id", id);
        expect(&got, 201, "rank", rank);
        expect(&got, 201, "active", true);
    }
}

async fn set_active(app: &TestApp, id: &str, active: bool) {
    let (path, body) = (format!("/v1/locations/{id}"), json!({"active": active}));
    let got = send_admin(app, Method::PATCH, &path, None, body).await;
    expect(&got, 200, "active", active);
}

/// Creates `id` kept at `stock`'s locations.
async fn stocked(app: &TestApp, id: &str, stock: Items<'_>) {
    let entry = |(l, q): &(&str, i64)| json!({"location_id": l, "quantity": q});
    let stock: Vec<Value> = stock.iter().map(entry).collect();
    let body = json!({"product_id": id, "name": id, "price_cents": 100, "stock": stock});
    let (s, got) = answer(app.post_product(&body).await).await;
    assert_eq!(s, StatusCode::CREATED, "{got}");
}

/// `POST /v1/orders` as `user`: one line as a single order, more as a cart.
async fn buy(app: &TestApp, user: &str, key: &str, items: Items<'_>, at: Locs<'_>) -> Answer {
    let mut body = match items {
        [(p, q)] => json!({"product_id": p, "quantity": q}),
        _ => json!({"lines": lines(items)}),
    };
    if let Some(l) = at {
        body["locations"] = json!(l);
    }
    send_as(app, Method::POST, "/v1/orders", user, Some(key), body).await
}

/// A hold of `items` from `at` only, for the user `holder`.
async fn hold(app: &TestApp, key: &str, items: Items<'_>, at: &str, ttl_s: i64) -> Answer {
    let body = json!({"lines": lines(items), "ttl_s": ttl_s, "locations": [at]});
    send_as(app, Method::POST, "/v1/holds", "holder", Some(key), body).await
}

async fn as_holder(app: &TestApp, method: Method, path: &str) -> Answer {
    send_as(app, method, path, "holder", None, json!({})).await
}

fn moving(p: &str, from: &str, to: &str, quantity: i64, in_transit: bool) -> Value {
    json!({"product_id": p, "from": from, "to": to, "quantity": quantity, "in_transit": in_transit})
}

async fn transfer(app: &TestApp, key: &str, body: Value) -> Answer {
    send_admin(app, Method::POST, TRANSFERS, Some(key), body).await
}

/// A transfer's (from, to, quantity, status).
fn shape(t: &Value) -> (&str, &str, i64, &str) {
    let s = |k: &str| t[k].as_str().unwrap_or("");
    let n = t["quantity"].as_i64().unwrap_or(0);
    (s("from"), s("to"), n, s("status"))
}

/// An answer's `allocations`, summed per (product, location); each entry must be positive.
fn allocs(body: &Value) -> Allocs {
    let mut out = Allocs::new();
    for a in parse::<Vec<Entry>>(&body["allocations"]) {
        let (p, q) = (a.product_id.unwrap(), a.quantity.unwrap());
        assert!(q > 0, "an allocation of {q}: {body}");
        *out.entry((p, a.location_id)).or_default() += q;
    }
    out
}

/// A 201's allocations.
#[track_caller]
fn taken(got: &Answer) -> Allocs {
    assert_eq!(got.0, StatusCode::CREATED, "{}", got.1);
    allocs(&got.1)
}

fn want(items: &[(&str, &str, i64)]) -> Allocs {
    let entry = |(p, l, q): &(&str, &str, i64)| ((p.to_string(), l.to_string()), *q);
    items.iter().map(entry).collect()
}

/// `items` without their zeros.
fn per_location(items: Items<'_>) -> PerLocation {
    let entry = |(l, q): &(&str, i64)| (*q != 0).then(|| (l.to_string(), *q));
    items.iter().filter_map(entry).collect()
}

fn at(units: &PerLocation, loc: &str) -> i64 {
    units.get(loc).copied().unwrap_or(0)
}

/// How many of `answers` are 201, and their units per location; the others must be 409
/// `OUT_OF_STOCK`.
fn tally<'a>(answers: impl IntoIterator<Item = &'a Answer>) -> (usize, PerLocation) {
    let (mut served, mut units) = (0, PerLocation::new());
    for got in answers {
        if got.0 != StatusCode::CREATED {
            assert_error(got, 409, "OUT_OF_STOCK");
            continue;
        }
        served += 1;
        for ((_, l), q) in allocs(&got.1) {
            *units.entry(l).or_default() += q;
        }
    }
    (served, units)
}

/// A routed read of `path` once its answer includes every commit acknowledged before this
/// call (`as_of` at or after now): polled, since a replica may lag.
async fn fresh(app: &TestApp, path: &str) -> Value {
    let since = Utc::now();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, body) = app.get_json(path, None).await;
        assert_eq!(s, StatusCode::OK, "{path}: {body}");
        if parse::<Stated>(&body).as_of >= since {
            return body;
        }
        let late = Instant::now() > deadline;
        assert!(!late, "{path} never read as of {since}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The product page's count and `active` per location, read fresh. Checks that no count is
/// negative, none listed twice, and that `available_quantity` is the active locations' sum.
async fn levels(app: &TestApp, product: &str) -> BTreeMap<String, (i64, bool)> {
    let page = fresh(app, &format!("/v1/products/{product}")).await;
    let mut out = BTreeMap::new();
    for e in parse::<Vec<Entry>>(&page["stock"]) {
        let (q, on) = (e.quantity.unwrap(), e.active.unwrap());
        let twice = out.insert(e.location_id, (q, on)).is_some();
        assert!(q >= 0 && !twice, "{page}");
    }
    let active: i64 = out.values().filter(|(_, on)| *on).map(|(q, _)| q).sum();
    assert_eq!(page["available_quantity"], active, "{page}");
    out
}

/// The product page's counts per location, zeros left out.
async fn counts(app: &TestApp, product: &str) -> PerLocation {
    let nonzero = |(l, (q, _)): (String, (i64, bool))| (q != 0).then_some((l, q));
    let all = levels(app, product).await;
    all.into_iter().filter_map(nonzero).collect()
}

/// Asserts `product`'s counts: `want`'s locations as given, every other location 0.
async fn assert_levels(app: &TestApp, product: &str, want: Items<'_>) {
    let got = counts(app, product).await;
    assert_eq!(got, per_location(want), "{product}'s counts per location");
}

/// An availability answer's `available`, `available_quantity` and `by_location`.
fn availability(v: &Value) -> (bool, i64, PerLocation) {
    let by = parse::<Vec<Entry>>(&v["by_location"]).into_iter();
    let by = by.map(|e| (e.location_id, e.quantity.unwrap())).collect();
    let quantity = v["available_quantity"].as_i64().unwrap();
    (v["available"] == true, quantity, by)
}

/// One request of [`allocation_follows_the_rule`]'s table, on products and locations named
/// by tags (`p`, `q`; `a`, `b`, `c`, and `nowhere`, never created): the products' stock
/// (product, location, count), the request, and its allocations or its error.
/// (product, location, units) rows.
type Table = &'static [(&'static str, &'static str, i64)];

struct Case {
    name: &'static str,
    stock: Table,
    lines: &'static [(&'static str, i64)],
    locations: Option<&'static [&'static str]>,
    want: Result<Table, (u16, &'static str)>,
}

// Mutation: allocate without step (1) (always split from the first location in order): case `rank` answers {b: 1, c: 2}, not {c: 3}.
// Mutation: lines_verdicts_v3's one-place carts taking every line at the first line's place: case `cart-apart` fails (seen: 503, the level guard finds no level of q at a).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allocation_follows_the_rule() {
    let app = spawn_app(shared_cluster()).await;
    let run = run_id();
    let id = |tag: &str| unique(tag, &run);
    let availability_at = |p: &str, qty: i64, locations: &str| {
        format!("/v1/products/{p}/availability?qty={qty}&locations={locations}")
    };
    // Rank order: b, c (tied at 10, broken by id), a (30), then `default` (100). Created in
    // neither that order nor id order, so only rank-then-id gives it.
    let (a, b, c) = (id("a"), id("b"), id("c"));
    locations(&app, &[(a, 30), (c, 10), (b, 10)]).await;
    let again = json!({"location_id": a, "name": "again", "rank": 1});
    let again = post(&app, "/v1/locations", again).await;
    assert_error(&again, 409, "ALREADY_EXISTS");
    let (_, list) = get(&app, "/v1/locations").await;
    let mut listed = parse::<Vec<Entry>>(&list["locations"]);
    let ours = |l: &Entry| l.location_id.ends_with(&run) || l.location_id == "default";
    listed.retain(ours);
    let ids: Vec<&str> = listed.iter().map(|l| l.location_id.as_str()).collect();
    assert_eq!(ids, [b, c, a, "default"], "rank, then location_id: {list}");
    let rename = json!({"name": "x"});
    let rename = send_admin(&app, Method::PATCH, "/v1/locations/none", None, rename);
    assert_eq!(rename.await.0, StatusCode::NOT_FOUND);

    #[rustfmt::skip]
    let cases = [
        // b comes first but cannot serve 3; c can; a holds the most but ranks last.
        Case { name: "rank", stock: &[("p", "a", 9), ("p", "b", 1), ("p", "c", 5)],
               lines: &[("p", 3)], locations: None, want: Ok(&[("p", "c", 3)]) },
        Case { name: "tie", stock: &[("p", "a", 4), ("p", "b", 4), ("p", "c", 4)],
               lines: &[("p", 2)], locations: None, want: Ok(&[("p", "b", 2)]) },
        // The client's order beats rank; b, which could serve, is not considered.
        Case { name: "client", stock: &[("p", "a", 5), ("p", "b", 5), ("p", "c", 5)],
               lines: &[("p", 2)], locations: Some(&["a", "c"]), want: Ok(&[("p", "a", 2)]) },
        // A split follows the client's order too (rank order would take c's 2 first).
        Case { name: "client-split", stock: &[("p", "a", 2), ("p", "b", 9), ("p", "c", 2)],
               lines: &[("p", 3)], locations: Some(&["a", "c"]),
               want: Ok(&[("p", "a", 2), ("p", "c", 1)]) },
        Case { name: "considered-short", stock: &[("p", "a", 1), ("p", "b", 9), ("p", "c", 1)],
               lines: &[("p", 3)], locations: Some(&["a", "c"]), want: Err((409, "OUT_OF_STOCK")) },
        // c is the first location that serves EVERY line (b serves q alone, a p alone): judged
        // per line, q would come from b.
        Case { name: "cart-one",
               stock: &[("p", "a", 5), ("p", "b", 1), ("p", "c", 2), ("q", "b", 2), ("q", "c", 2)],
               lines: &[("p", 2), ("q", 2)], locations: None,
               want: Ok(&[("p", "c", 2), ("q", "c", 2)]) },
        // No location serves both: each line takes from b, c, a in turn.
        Case { name: "cart-split", stock: &[("p", "a", 1), ("p", "b", 2), ("q", "a", 1), ("q", "c", 2)],
               lines: &[("p", 3), ("q", 3)], locations: None,
               want: Ok(&[("p", "b", 2), ("p", "a", 1), ("q", "c", 2), ("q", "a", 1)]) },
        // Each product has units at one place only, not the same one: each line takes its
        // own (no location serves both, and each line's only source is its own).
        Case { name: "cart-apart", stock: &[("p", "a", 5), ("q", "c", 5)],
               lines: &[("p", 2), ("q", 3)], locations: None,
               want: Ok(&[("p", "a", 2), ("q", "c", 3)]) },
        Case { name: "unknown", stock: &[("p", "a", 5)], lines: &[("p", 1)],
               locations: Some(&["a", "nowhere"]), want: Err((422, "UNKNOWN_LOCATION")) },
    ];
    for case in &cases {
        let product = |tag: &str| unique(&format!("{}-{tag}", case.name), &run);
        let mut left: BTreeMap<&str, Vec<(&str, i64)>> = BTreeMap::new();
        for (p, l, q) in case.stock {
            left.entry(product(p)).or_default().push((id(l), *q));
        }
        for (p, stock) in &left {
            stocked(&app, p, stock).await;
        }
        let items: Vec<(&str, i64)> = case.lines.iter().map(|(p, q)| (product(p), *q)).collect();
        let locs: Option<Vec<&str>> = case.locations.map(|ls| ls.iter().map(|l| id(l)).collect());
        let got = buy(&app, "ada", case.name, &items, locs.as_deref()).await;
        match case.want {
            Ok(w) => {
                let w: Vec<_> = w.iter().map(|(p, l, q)| (product(p), id(l), *q)).collect();
                assert_eq!(taken(&got), want(&w), "{}", case.name);
                for (p, l, q) in &w {
                    let level = left.get_mut(p).unwrap().iter_mut().find(|(x, _)| x == l);
                    level.unwrap().1 -= q;
                }
                // A retry of the key is the same order, the same allocations, nothing taken.
                let again = buy(&app, "ada", case.name, &items, locs.as_deref()).await;
                assert_eq!(taken(&again), want(&w), "{}", case.name);
                assert_eq!(again.1["order_id"], got.1["order_id"], "{}", case.name);
            }
            Err((status, code)) => {
                assert_error_for(case.name, &got, status, code);
            }
        }
        for (p, stock) in &left {
            assert_levels(&app, p, stock).await;
        }
    }

    // A retry after the stock moved answers the allocations it was given, though the rule
    // would now choose b; the same key naming other locations is another body.
    let p = unique("rank-p", &run);
    let body = json!({"quantity": 10, "location_id": b});
    let restocked = post(&app, &format!("/v1/products/{p}/restock"), body).await;
    expect(&restocked, 200, "available_quantity", 22);
    let again = buy(&app, "ada", "rank", &[(p, 3)], None).await;
    assert_eq!(taken(&again), want(&[(p, c, 3)]));
    let reused = buy(&app, "ada", "rank", &[(p, 3)], Some(&[b])).await;
    assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_levels(&app, p, &[(a, 9), (b, 11), (c, 2)]).await;

    // Unknown locations in a body or a query are 422.
    let (nowhere, bad) = (id("nowhere"), id("bad"));
    let stock = [json!({"location_id": nowhere, "quantity": 1})];
    let bad = json!({"product_id": bad, "name": "bad", "price_cents": 1, "stock": stock});
    let bad = answer(app.post_product(&bad).await).await;
    assert_error(&bad, 422, "UNKNOWN_LOCATION");
    let path = availability_at(p, 1, &format!("{a},{nowhere}"));
    assert_error(&app.get_json(&path, None).await, 422, "UNKNOWN_LOCATION");

    // The split: 3 × 21 units, 32 buyers of 2. Whatever their order, b, c and a each sell 10
    // whole, the 31st takes b's last unit and c's, the 32nd is refused, a's last unit stays.
    let p = id("split");
    stocked(&app, p, &[(a, 21), (b, 21), (c, 21)]).await;
    let answers: Vec<Answer> = futures::stream::iter(0..32)
        .map(|i| {
            let (app, user) = (&app, format!("split-{i}"));
            async move { buy(app, &user, "k", &[(p, 2)], None).await }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let sold = per_location(&[(a, 20), (b, 21), (c, 21)]);
    assert_eq!(tally(&answers), (31, sold), "{answers:?}");
    let served = answers.iter().filter(|(s, _)| s.is_success());
    let mut split: Vec<Allocs> = served.map(|(_, o)| allocs(o)).collect();
    split.retain(|t| t.len() > 1);
    assert_eq!(split, [want(&[(p, b, 1), (p, c, 1)])]);
    assert_levels(&app, p, &[(a, 1)]).await;

    // An inactive location is shown, but neither counted, sold nor offered; reactivated, it is.
    let p = id("inactive");
    stocked(&app, p, &[(a, 5), (b, 5), (c, 5)]).await;
    set_active(&app, b, false).await;
    assert_eq!(levels(&app, p).await.get(b), Some(&(5, false)));
    let got = buy(&app, "ina", "1", &[(p, 3)], None).await;
    assert_eq!(taken(&got), want(&[(p, c, 3)]));
    let only_b = buy(&app, "ina", "2", &[(p, 1)], Some(&[b])).await;
    assert_error(&only_b, 409, "OUT_OF_STOCK");
    let at_b = availability(&fresh(&app, &availability_at(p, 1, b)).await);
    assert_eq!(at_b, (false, 0, BTreeMap::from([(b.to_owned(), 0)])));
    let at_ac = availability_at(p, 8, &format!("{a},{c}"));
    let at_ac = availability(&fresh(&app, &at_ac).await);
    assert_eq!(at_ac, (false, 7, per_location(&[(a, 5), (c, 2)])));
    let got = buy(&app, "ina", "3", &[(p, 7)], None).await;
    assert_eq!(taken(&got), want(&[(p, c, 2), (p, a, 5)]));
    let none = buy(&app, "ina", "4", &[(p, 1)], None).await;
    assert_error(&none, 409, "OUT_OF_STOCK");
    assert_levels(&app, p, &[(b, 5)]).await;
    set_active(&app, b, true).await;
    let got = buy(&app, "ina", "5", &[(p, 1)], None).await;
    assert_eq!(taken(&got), want(&[(p, b, 1)]));
    assert_levels(&app, p, &[(b, 4)]).await;
}

// Mutation: drop the guard of a location's take (`AND available_quantity >= n`) and choose locations from levels read before the product's row lock: a location sells more than it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_buyers_over_three_locations_with_replicas_paused() {
    let cluster = private_cluster();
    let one = spawn_app(&cluster).await;
    let two = spawn_beside(&one, &cluster).await;
    let run = run_id();
    let (x, y, z) = (unique("x", &run), unique("y", &run), unique("z", &run));
    let given = [(x, 40), (y, 35), (z, 25)];
    locations(&one, &[(x, 10), (y, 20), (z, 30)]).await;
    let p = unique("many", &run);
    stocked(&one, p, &given).await;
    // The replicas hold the whole stock, and keep offering it while it sells out.
    blocking(|| cluster.wait_caught_up(Duration::from_secs(10))).unwrap();
    for i in 1..=2 {
        blocking(|| cluster.pause_replay(i)).unwrap();
    }
    let wal = WalTicker::start(one.primary.clone());
    let behind = || async {
        let states = one.replica_states().await;
        states.iter().all(|(_, _, ms)| *ms > Some(1000))
    };
    wait_for("replicas 1 s behind", Duration::from_secs(20), behind).await;
    drop(wal);

    // 300 buyers of 1, 2 or 3 units (600 wanted of 100), on both instances.
    let answers: Vec<(i64, Answer)> = futures::stream::iter(0..300usize)
        .map(|i| {
            let app = if i % 2 == 0 { &one } else { &two };
            let (user, items) = (format!("many-{i}"), [(p, 1 + (i % 3) as i64)]);
            async move { (items[0].1, buy(app, &user, "k", &items, None).await) }
        })
        .buffer_unordered(100)
        .collect()
        .await;
    for i in 1..=2 {
        let replica = sqlx::PgPool::connect(&cluster.replica_url(i, &one.database)).await;
        let offered = stock_on(&replica.unwrap(), p).await;
        assert_eq!(offered, 100, "replica-{i} kept the whole stock");
        blocking(|| cluster.resume_replay(i)).unwrap();
    }

    let (_, sold) = tally(answers.iter().map(|(_, got)| got));
    for (q, (_, body)) in answers.iter().filter(|(_, (s, _))| s.is_success()) {
        assert_eq!(allocs(body).values().sum::<i64>(), *q, "{body}");
    }
    let left = counts(&one, p).await;
    for (l, g) in given {
        assert_eq!(at(&sold, l) + at(&left, l), g, "{l}: {sold:?} {left:?}");
    }
    // Counts only fell, so a refusal saw at least what is left now; and with 100 buyers of one
    // unit, a unit left would mean every one of them was served, which takes every unit.
    assert!(left.is_empty(), "sold out exactly, yet {left:?} left");
    assert_eq!(sold, per_location(&given), "nothing sold anywhere else");
    // Last: it ends the instances' database sessions, so that they report their statistics.
    let deadlocked = deadlocks(&cluster, &one.database).await;
    assert_eq!(deadlocked, 0, "the database saw no deadlock");
}

// Mutation: take each cart line as it is judged, without undoing earlier lines when a later one is short: p's units leave a on the refused cart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn carts_over_two_products_in_several_locations_are_all_or_nothing() {
    let app = spawn_app(shared_cluster()).await;
    let run = run_id();
    let (a, b) = (unique("a", &run), unique("b", &run));
    locations(&app, &[(a, 10), (b, 20)]).await;
    let (p, q) = (unique("p", &run), unique("q", &run));
    stocked(&app, p, &[(a, 3), (b, 3)]).await;
    stocked(&app, q, &[(a, 1), (b, 1)]).await;
    let unchanged = || async {
        assert_levels(&app, p, &[(a, 3), (b, 3)]).await;
        assert_levels(&app, q, &[(a, 1), (b, 1)]).await;
    };
    // q's line cannot be served by any combination: nothing moves anywhere.
    let short = buy(&app, "ada", "c1", &[(p, 2), (q, 3)], None).await;
    assert_error(&short, 409, "OUT_OF_STOCK");
    unchanged().await;
    // a and b together could serve it, but only a is considered.
    let only_a = buy(&app, "ada", "c2", &[(p, 4), (q, 1)], Some(&[a])).await;
    assert_error(&only_a, 409, "OUT_OF_STOCK");
    unchanged().await;
    // No location serves both lines: each takes from a, then b, up to its quantity.
    let got = taken(&buy(&app, "ada", "c3", &[(p, 5), (q, 2)], None).await);
    let mut lines = BTreeMap::new();
    for ((product, _), n) in &got {
        *lines.entry(product.as_str()).or_insert(0) += n;
    }
    assert_eq!(lines, BTreeMap::from([(p, 5), (q, 2)]));
    assert_eq!(got, want(&[(p, a, 3), (p, b, 2), (q, a, 1), (q, b, 1)]));
    assert_levels(&app, p, &[(b, 1)]).await;
    assert_levels(&app, q, &[]).await;
}

// Mutation: choose locations from levels read before the product's row lock and take without the guard: both racers take b's one unit (two 201s, or a CHECK violation as a 5xx).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_buyers_race_for_the_last_unit_of_the_second_location() {
    let one = spawn_app(shared_cluster()).await;
    let two = spawn_beside(&one, shared_cluster()).await;
    let run = run_id();
    let (a, b) = (unique("a", &run), unique("b", &run));
    locations(&one, &[(a, 10), (b, 20)]).await;
    for round in 0..10 {
        let p = unique(&format!("last{round}"), &run);
        stocked(&one, p, &[(a, 1), (b, 1)]).await;
        let drained = buy(&one, "drainer", p, &[(p, 1)], None).await;
        assert_eq!(taken(&drained), want(&[(p, a, 1)]));
        let (ux, uy, item) = (format!("x{round}"), format!("y{round}"), [(p, 1)]);
        let (x, y) = tokio::join!(
            buy(&one, &ux, "k", &item, None),
            buy(&two, &uy, "k", &item, None),
        );
        let (won, lost): (Vec<_>, Vec<_>) = [x, y].into_iter().partition(|(s, _)| s.is_success());
        assert_eq!(won.len(), 1, "round {round}: {won:?} {lost:?}");
        assert_eq!(taken(&won[0]), want(&[(p, b, 1)]), "round {round}");
        assert_error_for(&format!("round {round}"), &lost[0], 409, "OUT_OF_STOCK");
        assert_levels(&one, p, &[]).await;
    }
}

// Mutation: a transfer that reads `from`'s count and writes back that count less the quantity (no guard, no row lock) undoes the sales in between: a's sold + moved + left exceeds 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transfer_racing_a_sale_never_oversells() {
    let one = spawn_app(shared_cluster()).await;
    let two = spawn_beside(&one, shared_cluster()).await;
    let run = run_id();
    let (a, b) = (unique("a", &run), unique("b", &run));
    locations(&one, &[(a, 10), (b, 20)]).await;
    let mut made = 0;
    for round in 0..8 {
        let p = unique(&format!("t{round}"), &run);
        stocked(&one, p, &[(a, 10)]).await;
        // 12 buyers of one unit and a transfer of 5 from a to b, all at once. A transfer moves
        // units and never loses them, so exactly 10 buyers are served, wherever the units are.
        let orders = join_all((0..12).map(|i| {
            let (app, user) = (if i % 2 == 0 { &one } else { &two }, format!("r{i}"));
            async move { buy(app, &user, p, &[(p, 1)], None).await }
        }));
        let (orders, moved) = tokio::join!(orders, transfer(&one, p, moving(p, a, b, 5, false)));
        let moved = if moved.0 == StatusCode::CREATED {
            assert_eq!(shape(&moved.1), (a, b, 5, "received"), "{}", moved.1);
            made += 1;
            5
        } else {
            assert_error(&moved, 409, "OUT_OF_STOCK");
            0
        };
        let (served, sold) = tally(&orders);
        assert_eq!(served, 10, "round {round}: {orders:?}");
        let left = counts(&one, p).await;
        let what = format!("round {round}: sold {sold:?}, moved {moved}, left {left:?}");
        assert_eq!(at(&sold, a) + moved + at(&left, a), 10, "{what}");
        assert_eq!(at(&sold, b) + at(&left, b), moved, "{what}");
        assert!(left.is_empty(), "{what}");
    }
    eprintln!("transfers made in the race: {made} of 8 (the others found a short)");
    // a is empty now: a transfer from it is refused and moves nothing.
    let p = unique("t7", &run);
    let short = transfer(&one, "short", moving(p, a, b, 1, false)).await;
    assert_error(&short, 409, "OUT_OF_STOCK");
    assert_levels(&one, p, &[]).await;
}

// Mutation: a cancel that gives units back to the product's first location by rank (or to `default`) instead of each allocation's own: dst would read 5 and src 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_after_a_transfer_returns_units_where_they_were_taken() {
    let app = spawn_app(shared_cluster()).await;
    let run = run_id();
    let (dst, src) = (unique("dst", &run), unique("src", &run));
    locations(&app, &[(dst, 10), (src, 20)]).await;
    let p = unique("p", &run);
    stocked(&app, p, &[(src, 5)]).await;
    let order = buy(&app, "ada", "o1", &[(p, 2)], None).await;
    assert_eq!(taken(&order), want(&[(p, src, 2)]));
    let t = transfer(&app, "t1", moving(p, src, dst, 3, false)).await;
    assert_eq!(shape(&t.1), (src, dst, 3, "received"), "{t:?}");
    assert_levels(&app, p, &[(dst, 3)]).await;
    let path = format!("/v1/orders/{}/cancel", parse::<Order>(&order.1).order_id);
    let cancel = || send_as(&app, Method::POST, &path, "ada", None, json!({}));
    for got in join_all((0..4).map(|_| cancel())).await {
        expect(&got, 200, "status", "cancelled");
    }
    // The 2 units go back to src, where they were taken, exactly once, though the transfer
    // emptied src in between: src's count may then exceed what its shelf holds. That is the
    // contract's stated rule ("give-backs go where the units came from"), not a miscount.
    assert_levels(&app, p, &[(src, 2), (dst, 3)]).await;
}

// Mutation: receive without claiming the transfer (`UPDATE transfers SET status = 'received'` without `AND status = 'in_transit'`, `to` raised whatever it found): concurrent receives add the units more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transfers_in_transit_and_receive_exactly_once() {
    let one = spawn_app(shared_cluster()).await;
    let two = spawn_beside(&one, shared_cluster()).await;
    let run = run_id();
    let (from, to) = (unique("from", &run), unique("to", &run));
    locations(&one, &[(from, 10), (to, 20)]).await;
    let p = unique("p", &run);
    stocked(&one, p, &[(from, 10)]).await;
    let body = moving(p, from, to, 4, true);
    let missing = post(&one, TRANSFERS, body.clone()).await;
    assert_error(&missing, 400, "IDEMPOTENCY_KEY_MISSING");
    let as_user = send_as(&one, Method::POST, TRANSFERS, "u", Some("k"), body.clone());
    assert_eq!(as_user.await.0, StatusCode::FORBIDDEN);
    let nowhere = moving(p, from, unique("nowhere", &run), 1, true);
    assert_error(&transfer(&one, "n", nowhere).await, 422, "UNKNOWN_LOCATION");
    let same = transfer(&one, "s", moving(p, from, from, 1, true)).await;
    assert_eq!(same.0.as_u16(), 422, "from = to: {}", same.1);
    assert_levels(&one, p, &[(from, 10)]).await;

    let t = transfer(&one, "t1", body.clone()).await;
    assert_eq!(t.0, StatusCode::CREATED, "{}", t.1);
    assert_eq!(shape(&t.1), (from, to, 4, "in_transit"), "{}", t.1);
    let id = t.1["transfer_id"].as_str().expect("a transfer_id");
    // In transit, the units are in no location.
    assert_levels(&one, p, &[(from, 6)]).await;
    let read = get(&one, &format!("{TRANSFERS}/{id}")).await;
    expect(&read, 200, "transfer_id", id);
    assert_eq!(shape(&read.1), (from, to, 4, "in_transit"));
    // The same key and body: the same transfer, nothing taken again; another body: 422.
    let retry = transfer(&two, "t1", body.clone()).await;
    let same = retry.0.is_success() && retry.1["transfer_id"] == id;
    assert!(same, "{retry:?}");
    let reused = transfer(&one, "t1", moving(p, from, to, 3, true)).await;
    assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    assert_levels(&one, p, &[(from, 6)]).await;

    // Ten receives at once on two instances: every one 200 `received`, the units join once.
    let receive = format!("{TRANSFERS}/{id}/receive");
    let receives = join_all((0..10).map(|i| {
        let app = if i % 2 == 0 { &one } else { &two };
        post(app, &receive, Value::Null)
    }));
    for got in receives.await {
        expect(&got, 200, "transfer_id", id);
        assert_eq!(shape(&got.1), (from, to, 4, "received"));
    }
    assert_levels(&one, p, &[(from, 6), (to, 4)]).await;
    let again = post(&two, &receive, Value::Null).await;
    expect(&again, 200, "status", "received");
    let read = get(&two, &format!("{TRANSFERS}/{id}")).await;
    expect(&read, 200, "status", "received");
    assert_levels(&one, p, &[(from, 6), (to, 4)]).await;

    let path = format!("{TRANSFERS}/{}", uuid::Uuid::new_v4());
    assert_eq!(get(&one, &path).await.0, StatusCode::NOT_FOUND);
    let unknown = post(&one, &format!("{path}/receive"), Value::Null).await;
    assert_eq!(unknown.0, StatusCode::NOT_FOUND, "{}", unknown.1);
}

// Found by schemathesis: units in transit, then `to` restocked to the column's limit; the
// receive cannot add them. Mutation that fails it: `levels::receive` swallowing the add's
// error and committing its status change (the transfer says `received`, its units are in no
// location). The 422 left out of the OpenAPI document fails `schemathesis::` (as it did).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_receive_past_the_column_limit_is_refused_and_the_transfer_stays_in_transit() {
    let app = spawn_app(shared_cluster()).await;
    let run = run_id();
    let (from, to) = (unique("from", &run), unique("to", &run));
    locations(&app, &[(from, 10), (to, 20)]).await;
    let p = unique("p", &run);
    let max = i64::from(i32::MAX);
    stocked(&app, p, &[(from, 5), (to, max - 5)]).await;
    let t = transfer(&app, "t", moving(p, from, to, 4, true)).await;
    assert_eq!(t.0, StatusCode::CREATED, "{}", t.1);
    let id = t.1["transfer_id"].as_str().expect("a transfer_id");
    let restock = json!({"quantity": 4, "location_id": to});
    let path = format!("/v1/products/{p}/restock");
    let restocked = send_admin(&app, Method::POST, &path, None, restock).await;
    assert_eq!(restocked.0, StatusCode::OK, "{}", restocked.1);
    assert_levels(&app, p, &[(from, 1), (to, max - 1)]).await;
    let refused = post(&app, &format!("{TRANSFERS}/{id}/receive"), Value::Null).await;
    assert_error(&refused, 422, "VALUE_OUT_OF_RANGE");
    let read = get(&app, &format!("{TRANSFERS}/{id}")).await;
    expect(&read, 200, "status", "in_transit");
    assert_levels(&app, p, &[(from, 1), (to, max - 1)]).await;
}

// Mutation: a hold's confirm that takes its units again by the rule instead of keeping the hold's allocations: a (first by rank) loses 2 more and the order says a.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holds_keep_their_allocations() {
    let app = spawn_app(shared_cluster()).await;
    let run = run_id();
    let (a, b) = (unique("a", &run), unique("b", &run));
    locations(&app, &[(a, 10), (b, 20)]).await;
    let p = unique("p", &run);
    stocked(&app, p, &[(a, 5), (b, 5)]).await;

    let h1 = hold(&app, "h1", &[(p, 2)], b, 600).await;
    assert_eq!(taken(&h1), want(&[(p, b, 2)]));
    assert_levels(&app, p, &[(a, 5), (b, 3)]).await;
    let again = hold(&app, "h1", &[(p, 2)], b, 600).await;
    assert_eq!(again.1["hold_id"], h1.1["hold_id"]);
    assert_eq!(taken(&again), taken(&h1));
    // The order keeps the hold's allocations; nothing is taken again.
    let confirm = format!("/v1/holds/{}/confirm", parse::<Hold>(&h1.1).hold_id);
    let order = as_holder(&app, Method::POST, &confirm).await;
    assert_eq!(taken(&order), taken(&h1));
    assert_levels(&app, p, &[(a, 5), (b, 3)]).await;

    // A released hold gives back to b, once (given back by rank, b's 3 would land at a).
    let h2 = hold(&app, "h2", &[(p, 3)], b, 600).await;
    assert_eq!(taken(&h2), want(&[(p, b, 3)]));
    assert_levels(&app, p, &[(a, 5)]).await;
    let release = format!("/v1/holds/{}", parse::<Hold>(&h2.1).hold_id);
    for _ in 0..2 {
        let released = as_holder(&app, Method::DELETE, &release).await;
        expect(&released, 200, "status", "released");
    }
    assert_levels(&app, p, &[(a, 5), (b, 3)]).await;

    // An expired hold gives back to b too (within 5 s of its expires_at).
    let h3 = hold(&app, "h3", &[(p, 1)], b, 1).await;
    assert_eq!(taken(&h3), want(&[(p, b, 1)]));
    let back = || async { at(&counts(&app, p).await, b) == 3 };
    wait_for("b's unit back", Duration::from_secs(20), back).await;
    assert_levels(&app, p, &[(a, 5), (b, 3)]).await;
}
