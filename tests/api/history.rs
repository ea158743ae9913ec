//! A Jepsen-style history check (issue 13): ~40 clients place, hang up on, retry, replay,
//! cancel and reuse orders and restock with keys through two instances, while a nemesis pauses
//! both replicas, restarts Redis empty, cuts the primary off and restarts an instance. Every
//! answer any client saw is then checked against the primary's tables.
//!
//! Flash drops (issue 27) are part of the workload: some products have a small
//! `max_per_customer` that collectors come back for with fresh keys, and one product's sale
//! starts a few seconds into the run. The checker holds every user to each limit in the final
//! state, finds nothing claimed before the start, and holds every refusal's reason to the row
//! its key claimed.
//!
//! `STOCKGATE_HISTORY_SEED` replays a workload's choices (the interleavings still differ);
//! `STOCKGATE_HISTORY_SECS` sets how long the workload runs (default 30; `bench/history.sh`
//! soaks for 600). The full history is written as JSON lines under the target directory.

use crate::helpers::*;
use chrono::{DateTime, Utc};
use devcluster::{Cluster, Redis};
use futures::StreamExt;
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use stockgate::auth::{Caller, Tokens};
use stockgate::domain::UserId;
use uuid::Uuid;

// ---------------------------------------------------------------------------------------------
// The database's side of the story. All of this file's SQL is here: issue 13's branch changes
// these tables (a `refused` order status, a `restocks` table), so this is the one place to
// adjust.
// ---------------------------------------------------------------------------------------------

/// One row of `orders`.
#[derive(Clone, Debug)]
struct Row {
    order_id: Uuid,
    user: String,
    key: String,
    product: String,
    quantity: i64,
    /// `confirmed`, `cancelled`, or `refused` (a 409 that claimed its key; not an order).
    status: String,
    /// A `refused` row's stored reason (`refusal->>'code'`); NULL is a refusal for stock.
    refusal: Option<String>,
    /// When the primary inserted the row, on its clock (the column's `clock_timestamp()`).
    created_at: DateTime<Utc>,
}

impl Row {
    /// The 409 code a refused row stands for.
    fn reason(&self) -> &str {
        self.refusal.as_deref().unwrap_or(OUT_OF_STOCK)
    }
}

/// A product's flash-drop rules as the primary holds them once the run is over. Nothing changes
/// them during the run, so they are the rules every request was judged by.
#[derive(Clone, Debug, Default)]
struct Rules {
    limit: Option<i64>,
    starts: Option<DateTime<Utc>>,
    ends: Option<DateTime<Utc>>,
}

/// Units a user holds of a product outside single-product orders: a line of a confirmed cart,
/// or of a live hold. The workload places neither, but a user's count under a limit includes
/// them, so the limit check reads them too.
#[derive(Clone, Debug)]
struct LineUnits {
    user: String,
    product: String,
    quantity: i64,
    /// The cart order's `created_at`; `None` for a hold, whose row is written before its
    /// products are locked and judged, so its time says nothing about the sale window.
    ordered_at: Option<DateTime<Utc>>,
}

/// One row of `restocks` that was made under an `Idempotency-Key`.
#[derive(Clone, Debug)]
struct RestockRow {
    key: String,
    product: String,
    quantity: i64,
}

/// What the primary holds once the history is over.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    stock: BTreeMap<String, i64>,
    rules: BTreeMap<String, Rules>,
    orders: Vec<Row>,
    lines: Vec<LineUnits>,
    /// `None` when there is no `restocks` table (main before issue 13).
    restocks: Option<Vec<RestockRow>>,
}

async fn snapshot(pool: &PgPool) -> Snapshot {
    type ProductRow = (
        String,
        i64,
        Option<i64>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
    );
    let products = sqlx::query_as::<_, ProductRow>(
        "SELECT product_id, available_quantity::int8, max_per_customer::int8, sale_starts_at, sale_ends_at \
         FROM products",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    type OrderRow = (
        Uuid,
        String,
        String,
        String,
        i64,
        String,
        Option<String>,
        DateTime<Utc>,
    );
    let orders = sqlx::query_as::<_, OrderRow>(
        "SELECT order_id, user_id, idempotency_key, product_id, quantity::int8, status, \
                refusal->>'code', created_at FROM orders",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // The same two sources as the service's `customer_units`: cart lines of confirmed orders
    // (a single-product order's units are its row's), and the lines of live holds.
    let lines = sqlx::query_as::<_, (String, String, i64, Option<DateTime<Utc>>)>(
        "SELECT o.user_id, l.product_id, l.quantity::int8, o.created_at \
           FROM order_lines l JOIN orders o USING (order_id) \
          WHERE o.status = 'confirmed' AND o.product_id IS NULL \
         UNION ALL \
         SELECT h.user_id, l.product_id, l.quantity::int8, NULL \
           FROM hold_lines l JOIN holds h USING (hold_id) WHERE h.status = 'held'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let restocks = sqlx::query_as::<_, (String, String, i64)>(
        "SELECT idempotency_key, product_id, quantity::int8 FROM restocks \
         WHERE idempotency_key IS NOT NULL",
    )
    .fetch_all(pool)
    .await;
    let restocks = match restocks {
        Ok(rows) => Some(rows),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => None,
        Err(e) => panic!("reading restocks: {e}"),
    };
    Snapshot {
        stock: products.iter().map(|p| (p.0.clone(), p.1)).collect(),
        rules: products
            .into_iter()
            .map(|(product, _, limit, starts, ends)| {
                (
                    product,
                    Rules {
                        limit,
                        starts,
                        ends,
                    },
                )
            })
            .collect(),
        orders: orders
            .into_iter()
            .map(
                |(order_id, user, key, product, quantity, status, refusal, created_at)| Row {
                    order_id,
                    user,
                    key,
                    product,
                    quantity,
                    status,
                    refusal,
                    created_at,
                },
            )
            .collect(),
        lines: lines
            .into_iter()
            .map(|(user, product, quantity, ordered_at)| LineUnits {
                user,
                product,
                quantity,
                ordered_at,
            })
            .collect(),
        restocks: restocks.map(|rows| {
            rows.into_iter()
                .map(|(key, product, quantity)| RestockRow {
                    key,
                    product,
                    quantity,
                })
                .collect()
        }),
    }
}

/// A digest of every order's status and every product's stock: it stops changing once no
/// request is still working on the primary.
async fn fingerprint(pool: &PgPool) -> String {
    sqlx::query_scalar(
        "SELECT md5(coalesce((SELECT string_agg(order_id::text || status, ',' ORDER BY order_id) FROM orders), '') \
         || coalesce((SELECT string_agg(product_id || ':' || available_quantity, ',' ORDER BY product_id) FROM products), ''))",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The primary's sessions on this database that are inside a transaction: what a request
/// that never resolves is stuck on.
async fn open_transactions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('pid %s %s wait=%s:%s xact_age=%ss query=%s', pid, state, wait_event_type, wait_event, \
                round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1), left(query, 100)) \
         FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The history: every request any client sent, and what it heard back.
// ---------------------------------------------------------------------------------------------

/// What a request asked for. Two requests with equal targets are retries of each other.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Target {
    Order {
        user: String,
        key: String,
        product: String,
        quantity: i64,
    },
    Cancel {
        user: String,
        order_id: Uuid,
    },
    Restock {
        key: String,
        product: String,
        quantity: i64,
    },
}

/// Why the client sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    /// A fresh key.
    New,
    /// A fresh key whose client drops the request after a short random delay.
    HangUp,
    /// The same key and body after a lost answer or a 503.
    Retry,
    /// The same key and body after a definite answer: it must agree.
    Replay,
    /// The same key with another body: it must be 422 and take nothing.
    Reuse,
    Cancel,
    /// After the run, with every fault healed: until a definite answer.
    Resolve,
}

/// The 409 codes an order may be answered (flash drops added the last three).
const OUT_OF_STOCK: &str = "OUT_OF_STOCK";
const LIMIT_EXCEEDED: &str = "LIMIT_EXCEEDED";
const SALE_NOT_STARTED: &str = "SALE_NOT_STARTED";
const SALE_ENDED: &str = "SALE_ENDED";

#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
enum Answer {
    /// No answer: the client hung up, or the connection failed.
    Lost { lost: String },
    Got {
        status: u16,
        retry_after: bool,
        body: Value,
    },
}

impl Answer {
    fn status(&self) -> Option<u16> {
        match self {
            Answer::Got { status, .. } => Some(*status),
            Answer::Lost { .. } => None,
        }
    }

    /// Anything but a lost answer or a 503 settles the request (the contract: a 503 is
    /// "unknown", retry the same key).
    fn definite(&self) -> bool {
        matches!(self.status(), Some(s) if s != 503)
    }

    /// 409 `SALE_NOT_STARTED`: definite about this request (it took nothing and claimed no
    /// key), but not about its key, which may buy once the sale is on.
    fn not_started(&self) -> bool {
        self.status() == Some(409) && self.code() == SALE_NOT_STARTED
    }

    /// A definite answer its key keeps: anything but a lost answer, a 503 or a
    /// `SALE_NOT_STARTED`.
    fn settles(&self) -> bool {
        self.definite() && !self.not_started()
    }

    /// The code of a 409 that is final for its key (every 409 but `SALE_NOT_STARTED`).
    fn refusal(&self) -> Option<&str> {
        (self.status() == Some(409) && !self.not_started()).then(|| self.code())
    }

    fn body(&self) -> &Value {
        match self {
            Answer::Got { body, .. } => body,
            Answer::Lost { .. } => &Value::Null,
        }
    }

    fn code(&self) -> &str {
        self.body()["error"]["code"].as_str().unwrap_or("")
    }

    fn order_id(&self) -> Option<Uuid> {
        self.body()["order_id"].as_str()?.parse().ok()
    }
}

#[derive(Clone, Debug, Serialize)]
struct Op {
    seq: usize,
    /// When the client sent it and when it heard the answer (or gave up), in ms since the
    /// history began: one clock for every client, so answers can be put in real-time order.
    sent_ms: u64,
    at_ms: u64,
    client: String,
    kind: Kind,
    instance: usize,
    target: Target,
    answer: Answer,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match &self.target {
            Target::Order {
                user,
                key,
                product,
                quantity,
            } => format!("order {user}/{key} {product}×{quantity}"),
            Target::Cancel { user, order_id } => format!("cancel {user} {order_id}"),
            Target::Restock {
                key,
                product,
                quantity,
            } => format!("restock {key} {product}+{quantity}"),
        };
        let heard = match &self.answer {
            Answer::Lost { lost } => format!("lost ({lost})"),
            Answer::Got {
                status,
                retry_after,
                body,
            } => {
                let ra = if *retry_after { " Retry-After" } else { "" };
                format!("{status}{ra} {body}")
            }
        };
        write!(
            f,
            "#{} +{}..{}ms {} {:?} @{} {what} → {heard}",
            self.seq, self.sent_ms, self.at_ms, self.client, self.kind, self.instance
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The world the clients share: where the two instances are, tokens, and the log.
// ---------------------------------------------------------------------------------------------

struct World {
    /// Base URL of instance 0 and 1; the nemesis swaps one when it restarts an instance.
    addresses: [RwLock<String>; 2],
    http: reqwest::Client,
    tokens: Tokens,
    admin: String,
    start: Instant,
    log: Mutex<Vec<Op>>,
}

impl World {
    fn new(addresses: [String; 2]) -> World {
        let tokens = Tokens::new(SECRET);
        let admin = tokens
            .issue(&Caller::Admin, Duration::from_secs(3 * 3600))
            .unwrap();
        World {
            addresses: addresses.map(RwLock::new),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
            tokens,
            admin,
            start: Instant::now(),
            log: Mutex::new(Vec::new()),
        }
    }

    fn user_token(&self, user: &str) -> String {
        self.tokens
            .issue(
                &Caller::User(UserId::parse(user).unwrap()),
                Duration::from_secs(3 * 3600),
            )
            .unwrap()
    }

    fn request(&self, instance: usize, target: &Target) -> reqwest::RequestBuilder {
        let base = self.addresses[instance].read().unwrap().clone();
        match target {
            Target::Order {
                user,
                key,
                product,
                quantity,
            } => self
                .http
                .post(format!("{base}/v1/orders"))
                .bearer_auth(self.user_token(user))
                .header("Idempotency-Key", key)
                .json(&json!({"product_id": product, "quantity": quantity})),
            Target::Cancel { user, order_id } => self
                .http
                .post(format!("{base}/v1/orders/{order_id}/cancel"))
                .bearer_auth(self.user_token(user)),
            Target::Restock {
                key,
                product,
                quantity,
            } => self
                .http
                .post(format!("{base}/v1/products/{product}/restock"))
                .bearer_auth(&self.admin)
                .header("Idempotency-Key", key)
                .json(&json!({"quantity": quantity})),
        }
    }

    /// Sends one request and records it. With `hang_up`, the client drops the request once
    /// that much time has passed without an answer, as a closed browser tab would.
    async fn call(
        &self,
        client: &str,
        kind: Kind,
        instance: usize,
        target: Target,
        hang_up: Option<Duration>,
    ) -> Answer {
        let request = self.request(instance, &target);
        let sent_ms = self.start.elapsed().as_millis() as u64;
        let exchange = async move {
            let resp = request.send().await?;
            let status = resp.status().as_u16();
            let retry_after = resp.headers().contains_key(reqwest::header::RETRY_AFTER);
            let text = resp.text().await?;
            let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
            Ok::<_, reqwest::Error>(Answer::Got {
                status,
                retry_after,
                body,
            })
        };
        let outcome = match hang_up {
            Some(after) => tokio::time::timeout(after, exchange)
                .await
                .map_err(|_| format!("hung up after {} ms", after.as_millis())),
            None => Ok(exchange.await),
        };
        let answer = match outcome {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Answer::Lost {
                lost: format!("transport: {e}"),
            },
            Err(hung_up) => Answer::Lost { lost: hung_up },
        };
        let mut log = self.log.lock().unwrap();
        let op = Op {
            seq: log.len(),
            sent_ms,
            at_ms: self.start.elapsed().as_millis() as u64,
            client: client.to_string(),
            kind,
            instance,
            target,
            answer: answer.clone(),
        };
        log.push(op);
        answer
    }

    fn history(&self) -> Vec<Op> {
        self.log.lock().unwrap().clone()
    }
}

// ---------------------------------------------------------------------------------------------
// The workload.
// ---------------------------------------------------------------------------------------------

/// The workload's choices, on `fastrand`'s seeded generator: the test seeds one from
/// `STOCKGATE_HISTORY_SEED` and forks every client's from it, so a printed seed replays them.
trait Choices {
    /// True `percent` times in a hundred.
    fn chance(&mut self, percent: u64) -> bool;
    /// A pause of `lo..=hi` milliseconds.
    fn ms(&mut self, lo: u64, hi: u64) -> Duration;
    /// Instance 0 or 1.
    fn instance(&mut self) -> usize;
}

impl Choices for fastrand::Rng {
    fn chance(&mut self, percent: u64) -> bool {
        self.u64(..100) < percent
    }
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.u64(lo..=hi))
    }
    fn instance(&mut self) -> usize {
        self.usize(..2)
    }
}

const PRODUCTS: [&str; 5] = ["scarce-a", "scarce-b", "scarce-c", "drop-2", "drop-soon"];
const INITIAL_STOCK: i64 = 40;
/// Per-customer limits, small enough that collectors (who come back for more with fresh keys)
/// and an order of 3 meet them while stock is left.
const LIMITS: [(&str, i64); 3] = [("scarce-c", 3), ("drop-2", 2), ("drop-soon", 3)];
/// The product whose sale starts a few seconds into the run: orders land on both sides.
const WINDOWED: &str = "drop-soon";
/// Every third shopper is a collector: most of its new orders go to one limited product.
const COLLECTOR_EVERY: usize = 3;
const SHOPPERS: usize = 38;
const RESTOCKERS: usize = 2;

/// What a client believes about one of its keys.
#[derive(Clone, Copy, PartialEq)]
enum Belief {
    Unsure,
    Created(Uuid),
    Refused,
}

struct Held {
    target: Target,
    belief: Belief,
}

/// A buyer: one user, its own keys.
struct Shopper {
    name: String,
    /// A collector's limited product, which it orders again and again under fresh keys.
    favourite: Option<&'static str>,
    rng: fastrand::Rng,
    world: Arc<World>,
    keys: Vec<Held>,
    cancelled: BTreeSet<Uuid>,
    unsure_cancels: Vec<Uuid>,
}

impl Shopper {
    async fn run(mut self, deadline: Instant) {
        while Instant::now() < deadline {
            // Think time keeps ~40 clients to a few hundred requests/s on a shared machine.
            tokio::time::sleep(self.rng.ms(20, 200)).await;
            match self.rng.u64(..100) {
                0..45 => self.new_order().await,
                45..60 => self.retry_unsure().await,
                60..70 => self.cancel().await,
                70..76 => self.reuse().await,
                76..80 => self.reuse_beside_replay().await,
                80..90 => self.replay().await,
                _ => self.retry_cancel().await,
            }
        }
    }

    async fn send(&mut self, kind: Kind, i: usize, hang_up: Option<Duration>) -> Answer {
        let instance = self.rng.instance();
        let target = self.keys[i].target.clone();
        let answer = self
            .world
            .call(&self.name, kind, instance, target, hang_up)
            .await;
        let belief = &mut self.keys[i].belief;
        match answer.status() {
            Some(201) if *belief == Belief::Unsure => {
                *belief = answer.order_id().map_or(Belief::Unsure, Belief::Created)
            }
            // SALE_NOT_STARTED leaves the key free: it stays unsure and is sent again later.
            Some(409) if *belief == Belief::Unsure && !answer.not_started() => {
                *belief = Belief::Refused
            }
            _ => {}
        }
        answer
    }

    async fn new_order(&mut self) {
        // Some keys look like the ones hold confirms once took (`hold:<id>`): any key a client
        // sends is the client's.
        let prefix = if self.rng.chance(10) { "hold:" } else { "" };
        let target = Target::Order {
            user: self.name.clone(),
            key: format!("{prefix}k{}", self.keys.len()),
            product: self.product().to_string(),
            quantity: self.rng.i64(1..=3),
        };
        self.keys.push(Held {
            target,
            belief: Belief::Unsure,
        });
        let i = self.keys.len() - 1;
        if self.rng.chance(30) {
            let after = self.rng.ms(1, 40);
            if let Answer::Lost { .. } = self.send(Kind::HangUp, i, Some(after)).await {
                tokio::time::sleep(self.rng.ms(0, 50)).await;
                self.send(Kind::Retry, i, None).await;
            }
        } else {
            self.send(Kind::New, i, None).await;
        }
    }

    /// A new order's product: a collector's favourite most of the time, else any.
    fn product(&mut self) -> &'static str {
        match self.favourite {
            Some(p) if self.rng.chance(60) => p,
            _ => PRODUCTS[self.rng.usize(..PRODUCTS.len())],
        }
    }

    fn pick(&mut self, want: impl Fn(&Held) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.keys.len())
            .filter(|&i| want(&self.keys[i]))
            .collect();
        self.rng.choice(candidates)
    }

    async fn retry_unsure(&mut self) {
        match self.pick(|h| h.belief == Belief::Unsure) {
            Some(i) => {
                self.send(Kind::Retry, i, None).await;
            }
            None => self.new_order().await,
        }
    }

    async fn replay(&mut self) {
        if let Some(i) = self.pick(|h| h.belief != Belief::Unsure) {
            self.send(Kind::Replay, i, None).await;
        }
    }

    /// The same key with another product or quantity than it was first sent with.
    async fn reuse(&mut self) {
        let Some(i) = self.pick(|h| h.belief != Belief::Unsure) else {
            return;
        };
        let product_too = self.rng.chance(50);
        let target = self.reused(i, product_too);
        let instance = self.rng.instance();
        self.world
            .call(&self.name, Kind::Reuse, instance, target, None)
            .await;
    }

    /// A settled key sent with another quantity and, at the same moment on the same
    /// instance, with its own body: both queue for the product's next batch, the wrong body
    /// first. The replay must still agree with what the key holds.
    async fn reuse_beside_replay(&mut self) {
        let Some(i) = self.pick(|h| h.belief != Belief::Unsure) else {
            return;
        };
        let wrong = self.reused(i, false);
        let instance = self.rng.instance();
        let world = self.world.clone();
        let reuse = world.call(&self.name, Kind::Reuse, instance, wrong, None);
        let target = self.keys[i].target.clone();
        let replay = async {
            tokio::task::yield_now().await;
            world
                .call(&self.name, Kind::Replay, instance, target, None)
                .await
        };
        tokio::join!(reuse, replay);
    }

    /// Key `i`'s target with another quantity (and, if `product_too`, another product).
    fn reused(&self, i: usize, product_too: bool) -> Target {
        let Target::Order {
            user,
            key,
            product,
            quantity,
        } = self.keys[i].target.clone()
        else {
            unreachable!("shoppers hold order keys")
        };
        let (product, quantity) = if product_too {
            let next = (PRODUCTS.iter().position(|p| *p == product).unwrap() + 1) % PRODUCTS.len();
            (PRODUCTS[next].to_string(), quantity)
        } else {
            (product, quantity % 3 + 1)
        };
        Target::Order {
            user,
            key,
            product,
            quantity,
        }
    }

    async fn cancel(&mut self) {
        let cancelled = self.cancelled.clone();
        let Some(i) =
            self.pick(|h| matches!(h.belief, Belief::Created(id) if !cancelled.contains(&id)))
        else {
            return;
        };
        let Belief::Created(order_id) = self.keys[i].belief else {
            unreachable!()
        };
        self.cancelled.insert(order_id);
        self.send_cancel(order_id).await;
    }

    async fn retry_cancel(&mut self) {
        if let Some(order_id) = self.unsure_cancels.pop() {
            self.send_cancel(order_id).await;
        }
    }

    async fn send_cancel(&mut self, order_id: Uuid) {
        let target = Target::Cancel {
            user: self.name.clone(),
            order_id,
        };
        let instance = self.rng.instance();
        let answer = self
            .world
            .call(&self.name, Kind::Cancel, instance, target, None)
            .await;
        if !answer.definite() {
            self.unsure_cancels.push(order_id);
        }
    }
}

/// An admin adding a few units now and then, under keys, retrying what it did not hear.
struct Restocker {
    name: String,
    rng: fastrand::Rng,
    world: Arc<World>,
    sent: usize,
    unsure: Vec<Target>,
}

impl Restocker {
    async fn run(mut self, deadline: Instant) {
        while Instant::now() < deadline {
            tokio::time::sleep(self.rng.ms(150, 400)).await;
            if !self.unsure.is_empty() && self.rng.chance(40) {
                let target = self.unsure.remove(0);
                self.send(Kind::Retry, target, None).await;
                continue;
            }
            let target = Target::Restock {
                key: format!("{}-{}", self.name, self.sent),
                product: PRODUCTS[self.rng.usize(..PRODUCTS.len())].to_string(),
                quantity: self.rng.i64(1..=5),
            };
            self.sent += 1;
            if self.rng.chance(25) {
                let after = self.rng.ms(1, 40);
                let heard = self.send(Kind::HangUp, target.clone(), Some(after)).await;
                if !heard {
                    self.unsure.retain(|t| *t != target);
                    self.send(Kind::Retry, target, None).await;
                }
            } else {
                self.send(Kind::New, target, None).await;
            }
        }
    }

    /// Returns whether the answer was definite; remembers the target if it was not.
    async fn send(&mut self, kind: Kind, target: Target, hang_up: Option<Duration>) -> bool {
        let instance = self.rng.instance();
        let answer = self
            .world
            .call(&self.name, kind, instance, target.clone(), hang_up)
            .await;
        if !answer.definite() {
            self.unsure.push(target);
        }
        answer.definite()
    }
}

/// An operator re-stating the products' counts from a file again and again (the counts they
/// were created with, so no stock moves; only the price alternates), through the import job
/// of either instance: its row locks meet every buyer's and refusal's. Returns how many
/// imports applied a change; one that failed under a fault (a primary cut) is not an anomaly,
/// a deadlock is, and the test counts those in the database.
async fn importer(world: Arc<World>, mut rng: fastrand::Rng, deadline: Instant) -> usize {
    let mut applied = 0;
    let mut round = 0;
    while Instant::now() < deadline {
        tokio::time::sleep(rng.ms(100, 400)).await;
        round += 1;
        let mut file = String::from("product_id,name,price_cents,available_quantity\n");
        for p in PRODUCTS {
            file.push_str(&format!("{p},{p},{},{INITIAL_STOCK}\n", 500 + round % 2));
        }
        let base = world.addresses[rng.instance()].read().unwrap().clone();
        let Ok(resp) = world
            .http
            .post(format!("{base}/v1/admin/imports?lag_budget=5s"))
            .bearer_auth(&world.admin)
            .body(file)
            .send()
            .await
        else {
            continue;
        };
        let Ok(job) = resp.json::<Value>().await else {
            continue;
        };
        let Some(id) = job["job_id"].as_str() else {
            continue;
        };
        let until = Instant::now() + Duration::from_secs(20);
        while Instant::now() < until {
            let job = match world
                .http
                .get(format!("{base}/v1/admin/imports/{id}"))
                .bearer_auth(&world.admin)
                .send()
                .await
            {
                Ok(r) => r.json::<Value>().await.unwrap_or(Value::Null),
                Err(_) => break,
            };
            match job["status"].as_str() {
                Some("done") => {
                    applied += usize::from(job["rows_changed"].as_u64() > Some(0));
                    break;
                }
                Some("failed" | "cancelled") | None => break,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
    applied
}

/// After the run: every request without a definite answer its key keeps is retried,
/// alternating instances and honouring `Retry-After`, until it gets one (or `within` passes;
/// the checker then names it). A key told only `SALE_NOT_STARTED` is sent again too: the sale
/// is on by now, and the same key must then buy or be refused for good.
async fn resolve(world: &Arc<World>, within: Duration) {
    let history = world.history();
    let mut settled: HashMap<&Target, bool> = HashMap::new();
    for op in &history {
        *settled.entry(&op.target).or_default() |= op.answer.settles();
    }
    let open: Vec<Target> = settled
        .into_iter()
        .filter(|(_, done)| !done)
        .map(|(t, _)| t.clone())
        .collect();
    let until = Instant::now() + within;
    futures::stream::iter(open)
        .map(|target| async move {
            for attempt in 0usize.. {
                let answer = world
                    .call("resolver", Kind::Resolve, attempt % 2, target.clone(), None)
                    .await;
                if answer.settles() || Instant::now() > until {
                    return;
                }
                tokio::time::sleep(retry_pause(&answer)).await;
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<()>>()
        .await;
}

/// What `Retry-After` asks for, capped at a second so resolution stays brisk.
fn retry_pause(answer: &Answer) -> Duration {
    match answer {
        Answer::Got {
            retry_after: true, ..
        } => Duration::from_secs(1),
        _ => Duration::from_millis(100),
    }
}

// ---------------------------------------------------------------------------------------------
// The nemesis.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    ReplicasPaused,
    RedisRestartedEmpty,
    PrimaryCut,
    InstanceRestarted,
}

const FAULTS: [Fault; 4] = [
    Fault::ReplicasPaused,
    Fault::RedisRestartedEmpty,
    Fault::PrimaryCut,
    Fault::InstanceRestarted,
];

/// Everything the faults act on. Each fault heals itself before the next one starts.
struct Nemesis<'a> {
    cluster: &'a Cluster,
    database: String,
    redis: Redis,
    proxy: ChaosProxy,
    apps: [Option<TestApp>; 2],
    world: Arc<World>,
    rng: fastrand::Rng,
    injected: BTreeMap<Fault, usize>,
    /// When each fault was in force, in ms since the history began, to line operations up.
    windows: Vec<(Fault, u64, u64)>,
}

impl Nemesis<'_> {
    /// An instance of the deployment: the shared database, reached through the chaos proxy,
    /// the private Redis, both replicas.
    async fn spawn_instance(&self) -> TestApp {
        spawn_instance(self.cluster, &self.database, &self.redis, &self.proxy).await
    }

    async fn run(&mut self, deadline: Instant) {
        for fault in FAULTS.iter().cycle() {
            if Instant::now() >= deadline {
                return;
            }
            let hold = self.rng.ms(800, 2500);
            let from = self.world.start.elapsed().as_millis() as u64;
            match fault {
                Fault::ReplicasPaused => {
                    blocking(|| {
                        self.cluster.pause_replay(1).unwrap();
                        self.cluster.pause_replay(2).unwrap();
                    });
                    tokio::time::sleep(hold).await;
                    blocking(|| {
                        self.cluster.resume_replay(1).unwrap();
                        self.cluster.resume_replay(2).unwrap();
                    });
                }
                Fault::RedisRestartedEmpty => {
                    blocking(|| self.redis.stop()).unwrap();
                    tokio::time::sleep(hold).await;
                    blocking(|| self.redis.start()).unwrap();
                }
                Fault::PrimaryCut => {
                    self.proxy.cut();
                    tokio::time::sleep(hold).await;
                    self.proxy.heal();
                }
                Fault::InstanceRestarted => {
                    let slot = self.rng.instance();
                    // Dropping it shuts it down: it drains what it has in flight.
                    self.apps[slot] = None;
                    let app = self.spawn_instance().await;
                    *self.world.addresses[slot].write().unwrap() = app.address.clone();
                    self.apps[slot] = Some(app);
                }
            }
            *self.injected.entry(*fault).or_default() += 1;
            let to = self.world.start.elapsed().as_millis() as u64;
            self.windows.push((*fault, from, to));
            tokio::time::sleep(self.rng.ms(500, 1500)).await;
        }
    }
}

async fn spawn_instance(cluster: &Cluster, db: &str, redis: &Redis, proxy: &ChaosProxy) -> TestApp {
    spawn_app_with(AppOptions {
        database: Some(db.to_string()),
        redis_url: Some(redis.url()),
        env: vec![(
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:{}/{db}", proxy.port),
        )],
        ..AppOptions::new(cluster)
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// The checker: a pure function of the history and the database.
// ---------------------------------------------------------------------------------------------

/// What an anomaly is about; it selects the operations printed with it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Subject {
    Key {
        user: String,
        key: String,
    },
    Order(Uuid),
    Restock(String),
    Product(String),
    /// One user's units of one product.
    Customer {
        user: String,
        product: String,
    },
    Database,
}

#[derive(Clone, Debug)]
struct Anomaly {
    /// What kind of lie, for the tally.
    class: &'static str,
    subject: Subject,
    what: String,
}

impl Subject {
    fn of(target: &Target) -> Subject {
        match target {
            Target::Order { user, key, .. } => Subject::Key {
                user: user.clone(),
                key: key.clone(),
            },
            Target::Cancel { order_id, .. } => Subject::Order(*order_id),
            Target::Restock { key, .. } => Subject::Restock(key.clone()),
        }
    }

    fn concerns(&self, op: &Op) -> bool {
        match (self, &op.target) {
            (Subject::Order(id), Target::Cancel { order_id, .. }) => id == order_id,
            (Subject::Order(id), _) => op.answer.order_id() == Some(*id),
            (Subject::Product(p), Target::Order { product, .. })
            | (Subject::Product(p), Target::Restock { product, .. }) => p == product,
            (
                Subject::Customer {
                    user: u,
                    product: p,
                },
                Target::Order { user, product, .. },
            ) => u == user && p == product,
            (Subject::Customer { user: u, .. }, Target::Cancel { user, .. }) => u == user,
            (Subject::Database, _) => false,
            (subject, target) => *subject == Subject::of(target),
        }
    }
}

struct Checker<'a> {
    initial: &'a BTreeMap<String, i64>,
    db: &'a Snapshot,
    found: Vec<Anomaly>,
}

fn check(initial: &BTreeMap<String, i64>, history: &[Op], db: &Snapshot) -> Vec<Anomaly> {
    let mut c = Checker {
        initial,
        db,
        found: vec![],
    };
    c.statuses(history);
    let mut keys: BTreeMap<(String, String), Vec<&Op>> = BTreeMap::new();
    let mut cancels: BTreeMap<Uuid, Vec<&Op>> = BTreeMap::new();
    let mut restocks: BTreeMap<String, Vec<&Op>> = BTreeMap::new();
    for op in history {
        match &op.target {
            Target::Order { user, key, .. } => keys
                .entry((user.clone(), key.clone()))
                .or_default()
                .push(op),
            Target::Cancel { order_id, .. } => cancels.entry(*order_id).or_default().push(op),
            Target::Restock { key, .. } => restocks.entry(key.clone()).or_default().push(op),
        }
    }
    let rows: HashMap<(&str, &str), &Row> = db
        .orders
        .iter()
        .map(|r| ((r.user.as_str(), r.key.as_str()), r))
        .collect();
    for ((user, key), ops) in &keys {
        c.order_key(
            user,
            key,
            ops,
            rows.get(&(user.as_str(), key.as_str())).copied(),
        );
    }
    c.unasked_rows(&keys, &cancels);
    c.cancels(&cancels);
    let restocked = c.restocks(&restocks);
    c.conservation(&restocked);
    c.limits();
    c.windows(history);
    c.found
}

impl Checker<'_> {
    fn flag(&mut self, class: &'static str, subject: Subject, what: impl Into<String>) {
        self.found.push(Anomaly {
            class,
            subject,
            what: what.into(),
        });
    }

    /// No 500 ever; no 5xx but 503, and a 503 always says when to retry; each endpoint
    /// answers only what the contract lets it.
    fn statuses(&mut self, history: &[Op]) {
        for op in history {
            let Some(status) = op.answer.status() else {
                continue;
            };
            let code = op.answer.code();
            let wrong = match (&op.target, status) {
                (_, 503)
                    if !matches!(
                        op.answer,
                        Answer::Got {
                            retry_after: true,
                            ..
                        }
                    ) =>
                {
                    Some("503 without Retry-After")
                }
                (_, 500..) if status != 503 => Some("a 5xx other than 503"),
                (Target::Order { product, .. }, 409) => {
                    self.refusal_not_allowed(product, &op.answer)
                }
                (Target::Order { .. }, 422) if code != "IDEMPOTENCY_KEY_REUSED" => {
                    Some("422 not IDEMPOTENCY_KEY_REUSED")
                }
                (Target::Order { .. }, 201 | 422 | 503) => None,
                (Target::Cancel { .. } | Target::Restock { .. }, 200 | 503) => None,
                _ => Some("a status this request may not get"),
            };
            if let Some(wrong) = wrong {
                self.flag(
                    wrong,
                    Subject::of(&op.target),
                    format!("#{}: {wrong}", op.seq),
                );
            }
        }
    }

    /// Whether an order's 409 is one its product may get: `OUT_OF_STOCK` always, the drop codes
    /// only where the product's rules make them possible, and `SALE_NOT_STARTED` says when
    /// to come back.
    fn refusal_not_allowed(&self, product: &str, answer: &Answer) -> Option<&'static str> {
        let rules = self.db.rules.get(product).cloned().unwrap_or_default();
        let retry_after = matches!(
            answer,
            Answer::Got {
                retry_after: true,
                ..
            }
        );
        match answer.code() {
            OUT_OF_STOCK => None,
            LIMIT_EXCEEDED if rules.limit.is_none() => Some("LIMIT_EXCEEDED without a limit"),
            SALE_NOT_STARTED if rules.starts.is_none() => Some("SALE_NOT_STARTED without a start"),
            SALE_NOT_STARTED if !retry_after => Some("SALE_NOT_STARTED without Retry-After"),
            SALE_ENDED if rules.ends.is_none() => Some("SALE_ENDED without an end"),
            LIMIT_EXCEEDED | SALE_NOT_STARTED | SALE_ENDED => None,
            _ => Some("409 with a code orders may not get"),
        }
    }

    /// Every answer for one (user, key) against the others and against its row.
    fn order_key(&mut self, user: &str, key: &str, ops: &[&Op], row: Option<&Row>) {
        let subject = Subject::Key {
            user: user.into(),
            key: key.into(),
        };
        // The first request under a key is its original: shoppers reuse only answered keys.
        let original = &ops[0].target;
        let Target::Order {
            product, quantity, ..
        } = original
        else {
            unreachable!()
        };
        let (same, reused): (Vec<&Op>, Vec<&Op>) =
            ops.iter().partition(|op| op.target == *original);
        let definite: Vec<&Op> = same
            .iter()
            .copied()
            .filter(|o| o.answer.definite())
            .collect();
        let settled: Vec<&Op> = definite
            .iter()
            .copied()
            .filter(|o| o.answer.settles())
            .collect();
        let ids: BTreeSet<Uuid> = definite
            .iter()
            .filter_map(|o| o.answer.order_id())
            .collect();
        // SALE_NOT_STARTED claims nothing: it is no refusal of the key.
        let refusal = definite.iter().find_map(|o| o.answer.refusal());
        let refused = refusal.is_some();
        if settled.is_empty() {
            self.flag(
                "unresolved",
                subject.clone(),
                "no definite answer its key keeps (only lost, 503 or SALE_NOT_STARTED), even after resolution",
            );
        }
        if ids.len() > 1 {
            self.flag(
                "two orders for one key",
                subject.clone(),
                format!("answered {} different orders: {ids:?}", ids.len()),
            );
        }
        if !ids.is_empty() && refused {
            // Which came first tells the two lies apart: a 409 that was not final, or a retry
            // told 409 about a confirmed order.
            let (class, what) = match settled[0].answer.status() {
                Some(409) => ("409 not final (a later 201)", "answered 409, then 201"),
                _ => ("201 then 409", "answered 201, then 409 to a retry"),
            };
            self.flag(class, subject.clone(), what);
        }
        if definite.iter().any(|o| o.answer.status() == Some(422)) {
            self.flag(
                "own body answered 422",
                subject.clone(),
                "its own body was answered 422",
            );
        }
        for o in definite.iter().filter(|o| o.answer.status() == Some(201)) {
            let b = o.answer.body();
            if b["order_id"].as_str().is_none()
                || b["product_id"] != json!(product)
                || b["quantity"] != json!(quantity)
                || b["user_id"] != json!(user)
            {
                self.flag(
                    "201 does not describe the request",
                    subject.clone(),
                    format!("#{}: the 201 does not describe the request", o.seq),
                );
            }
        }
        match (ids.first(), row) {
            (Some(id), None) => self.flag(
                "201 without a row",
                subject.clone(),
                format!("answered order {id}, but no row holds the key"),
            ),
            (Some(id), Some(r))
                if r.order_id != *id
                    || r.product != *product
                    || r.quantity != *quantity
                    || !is_order(r) =>
            {
                self.flag(
                    "201 names another row",
                    subject.clone(),
                    format!("answered order {id} ({product}×{quantity}), but the key holds {r:?}"),
                )
            }
            // A row with a reused body is the reuse's lie, flagged below.
            (None, Some(r))
                if refused && is_order(r) && r.product == *product && r.quantity == *quantity =>
            {
                self.flag(
                    "409 but the key holds an order",
                    subject.clone(),
                    format!(
                        "answered 409 {}, but the key holds order {} ({})",
                        refusal.unwrap_or_default(),
                        r.order_id,
                        r.status
                    ),
                )
            }
            _ => {}
        }
        self.refusal_reasons(&subject, product, *quantity, &definite, row);
        self.reused(&subject, product, *quantity, &reused, row);
    }

    /// A final 409 claimed its key with a refused row that states the same reason (so every
    /// retry is told the same), and a `LIMIT_EXCEEDED` names the product's limit and a count
    /// that the request would have passed it with.
    fn refusal_reasons(
        &mut self,
        subject: &Subject,
        product: &str,
        quantity: i64,
        definite: &[&Op],
        row: Option<&Row>,
    ) {
        let limit = self.db.rules.get(product).and_then(|r| r.limit);
        for o in definite {
            let Some(code) = o.answer.refusal() else {
                continue;
            };
            match row {
                None => self.flag(
                    "409 that claimed no key",
                    subject.clone(),
                    format!("#{}: answered 409 {code}, but no row holds the key", o.seq),
                ),
                Some(r) if r.status == "refused" && r.reason() != code => self.flag(
                    "409 not the key's refusal",
                    subject.clone(),
                    format!(
                        "#{}: answered 409 {code}, but the key's refusal says {}",
                        o.seq,
                        r.reason()
                    ),
                ),
                // An order in the row: flagged by the caller.
                Some(_) => {}
            }
            let e = &o.answer.body()["error"];
            let states = |limit: i64| {
                e["product_id"] == json!(product)
                    && e["limit"] == json!(limit)
                    && e["already"]
                        .as_i64()
                        .is_some_and(|already| already >= 0 && already + quantity > limit)
            };
            if code == LIMIT_EXCEEDED && !limit.is_some_and(states) {
                self.flag(
                    "LIMIT_EXCEEDED misstates the limit",
                    subject.clone(),
                    format!(
                        "#{}: {product}×{quantity} with limit {limit:?}, answered {e}",
                        o.seq
                    ),
                );
            }
        }
    }

    /// A reused key (another body) is answered 422 and takes nothing.
    fn reused(
        &mut self,
        subject: &Subject,
        product: &str,
        quantity: i64,
        reused: &[&Op],
        row: Option<&Row>,
    ) {
        let mut bodies: BTreeMap<String, bool> = BTreeMap::new();
        for o in reused {
            let Target::Order {
                product, quantity, ..
            } = &o.target
            else {
                unreachable!()
            };
            *bodies.entry(format!("{product}×{quantity}")).or_default() |= o.answer.definite();
            if o.answer.definite() && o.answer.status() != Some(422) {
                self.flag(
                    "reused key not answered 422",
                    subject.clone(),
                    format!(
                        "#{}: reused with another body, answered {:?}; want 422",
                        o.seq,
                        o.answer.status()
                    ),
                );
            }
        }
        for (body, done) in bodies {
            if !done {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    format!("reuse {body}: no definite answer, even after resolution"),
                );
            }
        }
        if let Some(r) =
            row.filter(|r| !reused.is_empty() && (r.product != product || r.quantity != quantity))
        {
            self.flag(
                "reused key's body took the row",
                subject.clone(),
                format!("the key's row holds a reused body: {r:?}"),
            );
        }
    }

    /// Rows nobody asked for: a key no client sent, a cancel no client asked for.
    fn unasked_rows(
        &mut self,
        keys: &BTreeMap<(String, String), Vec<&Op>>,
        cancels: &BTreeMap<Uuid, Vec<&Op>>,
    ) {
        for r in &self.db.orders {
            if !keys.contains_key(&(r.user.clone(), r.key.clone())) {
                self.flag(
                    "a row nobody asked for",
                    Subject::Order(r.order_id),
                    format!("a row under a key nobody sent: {r:?}"),
                );
            }
            if r.status == "cancelled" && !cancels.contains_key(&r.order_id) {
                self.flag(
                    "a cancel nobody asked for",
                    Subject::Order(r.order_id),
                    "cancelled, but nobody cancelled it",
                );
            }
            if !["confirmed", "cancelled", "refused"].contains(&r.status.as_str()) {
                self.flag(
                    "bad row status",
                    Subject::Order(r.order_id),
                    format!("status {}", r.status),
                );
            }
        }
    }

    /// A cancel answered 200 is cancelled in the database.
    fn cancels(&mut self, cancels: &BTreeMap<Uuid, Vec<&Op>>) {
        for (id, ops) in cancels {
            let subject = Subject::Order(*id);
            if !ops.iter().any(|o| o.answer.definite()) {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    "cancel: no definite answer, even after resolution",
                );
            }
            let said_cancelled = ops.iter().any(|o| o.answer.status() == Some(200));
            let row = self.db.orders.iter().find(|r| r.order_id == *id);
            if said_cancelled && row.map(|r| r.status.as_str()) != Some("cancelled") {
                self.flag(
                    "cancel 200 not applied",
                    subject,
                    format!("cancel answered 200, but the row is {row:?}"),
                );
            }
        }
    }

    /// Each restock key answered 200 was applied exactly once, and every retry answered the
    /// same. Returns the units each product was given, as the admins saw it.
    fn restocks(&mut self, restocks: &BTreeMap<String, Vec<&Op>>) -> BTreeMap<String, i64> {
        let mut given: BTreeMap<String, i64> = BTreeMap::new();
        if self.db.restocks.is_none() {
            self.flag(
                "no restocks table",
                Subject::Database,
                "no restocks table: a restock cannot be checked exactly-once",
            );
        }
        let table = self.db.restocks.clone().unwrap_or_default();
        for (key, ops) in restocks {
            let subject = Subject::Restock(key.clone());
            let Target::Restock {
                product, quantity, ..
            } = &ops[0].target
            else {
                unreachable!()
            };
            let results: BTreeSet<String> = ops
                .iter()
                .filter(|o| o.answer.status() == Some(200))
                .map(|o| {
                    format!(
                        "{}:{}",
                        o.answer.body()["product_id"],
                        o.answer.body()["available_quantity"]
                    )
                })
                .collect();
            if !ops.iter().any(|o| o.answer.definite()) {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    "no definite answer, even after resolution",
                );
            }
            if results.len() > 1 {
                self.flag(
                    "restock retries answered differently",
                    subject.clone(),
                    format!("the same key answered different results: {results:?}"),
                );
            }
            if results.is_empty() {
                continue;
            }
            *given.entry(product.clone()).or_default() += quantity;
            let applied: Vec<&RestockRow> = table.iter().filter(|r| r.key == *key).collect();
            if self.db.restocks.is_some()
                && (applied.len() != 1
                    || applied[0].product != *product
                    || applied[0].quantity != *quantity)
            {
                self.flag("restock not applied exactly once", subject, format!("answered 200 for {product}+{quantity}; the restocks table holds {applied:?}"));
            }
        }
        for r in table.iter().filter(|r| !restocks.contains_key(&r.key)) {
            self.flag(
                "a restock nobody asked for",
                Subject::Restock(r.key.clone()),
                format!("a restock under a key nobody sent: {r:?}"),
            );
        }
        given
    }

    /// initial + restocks − confirmed = final, per product, and never negative (cancelled
    /// orders gave their units back; refused rows never took any).
    fn conservation(&mut self, restocked: &BTreeMap<String, i64>) {
        for (product, initial) in self.initial {
            let confirmed: i64 = self
                .db
                .orders
                .iter()
                .filter(|r| r.product == *product && r.status == "confirmed")
                .map(|r| r.quantity)
                .sum();
            let added = restocked.get(product).copied().unwrap_or(0);
            let want = initial + added - confirmed;
            let stock = self.db.stock.get(product).copied().unwrap_or(i64::MIN);
            if stock != want || stock < 0 {
                self.flag("stock not conserved", 
                    Subject::Product(product.clone()),
                    format!("stock {stock}; want {initial} initial + {added} restocked − {confirmed} confirmed = {want}"),
                );
            }
        }
    }

    /// No user holds more of a limited product than its limit: the units of its confirmed
    /// orders plus the lines of its confirmed carts and live holds, in the final state (the
    /// limits never change during the run, so the final one is the bound).
    fn limits(&mut self) {
        let db = self.db;
        let mut units: BTreeMap<(&str, &str), i64> = BTreeMap::new();
        let rows = db.orders.iter().filter(|r| r.status == "confirmed");
        for (user, product, quantity) in rows
            .map(|r| (&r.user, &r.product, r.quantity))
            .chain(db.lines.iter().map(|l| (&l.user, &l.product, l.quantity)))
        {
            *units.entry((user, product)).or_default() += quantity;
        }
        for ((user, product), held) in units {
            let Some(limit) = db.rules.get(product).and_then(|r| r.limit) else {
                continue;
            };
            if held > limit {
                self.flag(
                    "a user past a limit",
                    Subject::Customer {
                        user: user.into(),
                        product: product.into(),
                    },
                    format!("{user} holds {held} of {product}, whose limit is {limit}"),
                );
            }
        }
    }

    /// Nothing is claimed before a product's sale starts (no order row of any status, no cart
    /// line, written before it on the primary's clock), and no request sent after a 201 for
    /// the product was heard is told `SALE_NOT_STARTED` (that 201's order was written after
    /// the start, so the start was past before the later request reached the primary).
    fn windows(&mut self, history: &[Op]) {
        let db = self.db;
        for (product, rules) in &db.rules {
            let Some(starts) = rules.starts else {
                continue;
            };
            for r in db
                .orders
                .iter()
                .filter(|r| r.product == *product && r.created_at < starts)
            {
                self.flag(
                    "claimed before the start",
                    Subject::Key {
                        user: r.user.clone(),
                        key: r.key.clone(),
                    },
                    format!(
                        "{product}'s sale starts at {starts}, but the key's {} row was written at {}",
                        r.status, r.created_at
                    ),
                );
            }
            for l in db.lines.iter().filter(|l| l.product == *product) {
                if let Some(at) = l.ordered_at.filter(|at| *at < starts) {
                    self.flag(
                        "claimed before the start",
                        Subject::Customer {
                            user: l.user.clone(),
                            product: product.clone(),
                        },
                        format!("{product}'s sale starts at {starts}, but a cart of {} with it was written at {at}", l.user),
                    );
                }
            }
            let of_product =
                |o: &&Op| matches!(&o.target, Target::Order { product: p, .. } if p == product);
            let Some(seen_on) = history
                .iter()
                .filter(of_product)
                .filter(|o| {
                    o.answer.status() == Some(201)
                        && o.answer.body()["product_id"] == json!(product)
                })
                .map(|o| o.at_ms)
                .min()
            else {
                continue;
            };
            for o in history
                .iter()
                .filter(of_product)
                .filter(|o| o.answer.not_started() && o.sent_ms > seen_on)
            {
                self.flag(
                    "SALE_NOT_STARTED once the sale was on",
                    Subject::of(&o.target),
                    format!(
                        "#{}: sent at +{}ms, but a 201 for {product} was heard at +{seen_on}ms",
                        o.seq, o.sent_ms
                    ),
                );
            }
        }
    }
}

fn is_order(r: &Row) -> bool {
    r.status == "confirmed" || r.status == "cancelled"
}

/// How many anomalies of each class: the first thing to read in a failing history.
fn tally(anomalies: &[Anomaly]) -> BTreeMap<&'static str, usize> {
    let mut by: BTreeMap<&'static str, usize> = BTreeMap::new();
    for a in anomalies {
        *by.entry(a.class).or_default() += 1;
    }
    by
}

/// A few anomalies of each class, each with every operation it concerns (capped; the
/// history file has them all).
fn report(anomalies: &[Anomaly], history: &[Op]) -> String {
    const PER_CLASS: usize = 3;
    const OPS: usize = 60;
    let mut out = String::new();
    for (class, n) in tally(anomalies) {
        out += &format!("\n=== {class}: {n} ===\n");
        for a in anomalies
            .iter()
            .filter(|a| a.class == class)
            .take(PER_CLASS)
        {
            out += &format!("✗ {:?}: {}\n", a.subject, a.what);
            let ops: Vec<&Op> = history.iter().filter(|o| a.subject.concerns(o)).collect();
            for op in ops.iter().take(OPS) {
                out += &format!("    {op}\n");
            }
            if ops.len() > OPS {
                out += &format!("    … {} more operations\n", ops.len() - OPS);
            }
        }
    }
    out
}

/// Operations, faults injected by kind, anomalies by class, in one line.
fn summary(
    seed: u64,
    secs: u64,
    history: &[Op],
    faults: &BTreeMap<Fault, usize>,
    anomalies: &[Anomaly],
) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for op in history {
        let what = match op.target {
            Target::Order { .. } => "order",
            Target::Cancel { .. } => "cancel",
            Target::Restock { .. } => "restock",
        };
        let heard = match op.answer.status() {
            None => "lost".to_string(),
            // A 409's code says which refusal: stock, a limit, or the sale window.
            Some(409) => format!("409 {}", op.answer.code()),
            Some(s) => s.to_string(),
        };
        *by.entry(format!("{what} {heard}")).or_default() += 1;
    }
    let list = |items: Vec<String>| items.join(", ");
    let by = list(by.iter().map(|(k, n)| format!("{k}×{n}")).collect());
    let total: usize = faults.values().sum();
    let faults = list(faults.iter().map(|(f, n)| format!("{f:?}×{n}")).collect());
    let lies = list(
        tally(anomalies)
            .iter()
            .map(|(c, n)| format!("{c}×{n}"))
            .collect(),
    );
    format!(
        "history seed={seed} secs={secs}: {} operations ({by}); {total} faults injected ({faults}); {} anomalies ({lies})",
        history.len(),
        anomalies.len()
    )
}

// ---------------------------------------------------------------------------------------------
// The test.
// ---------------------------------------------------------------------------------------------

fn settings() -> (u64, u64) {
    let seed = std::env::var("STOCKGATE_HISTORY_SEED")
        .ok()
        .map(|s| s.parse().expect("STOCKGATE_HISTORY_SEED is a u64"))
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ u64::from(std::process::id())
        });
    let secs = std::env::var("STOCKGATE_HISTORY_SECS")
        .ok()
        .map(|s| s.parse().expect("STOCKGATE_HISTORY_SECS is whole seconds"))
        .unwrap_or(30);
    (seed, secs)
}

/// Polls until no request is still changing the primary: the digest holds for a second.
async fn settle(pool: &PgPool) {
    let start = Instant::now();
    let (mut last, mut since) = (fingerprint(pool).await, Instant::now());
    while since.elapsed() < Duration::from_secs(1) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the database never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = fingerprint(pool).await;
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
}

/// The run straddled the windowed product's start: a 201 for it to a request sent after some
/// request for it was told `SALE_NOT_STARTED`.
fn windowed_bought_after_not_started(history: &[Op]) -> bool {
    let windowed =
        |o: &&Op| matches!(&o.target, Target::Order { product, .. } if product == WINDOWED);
    let Some(first_no) = history
        .iter()
        .filter(windowed)
        .filter(|o| o.answer.not_started())
        .map(|o| o.at_ms)
        .min()
    else {
        return false;
    };
    history
        .iter()
        .filter(windowed)
        .any(|o| o.answer.status() == Some(201) && o.sent_ms > first_no)
}

/// Creates the workload's products, each with `INITIAL_STOCK` and its limit; the windowed
/// one's sale starts `lead` after the primary's clock now. Returns the initial stock.
async fn create_products(app: &TestApp, lead: Duration) -> BTreeMap<String, i64> {
    let starts: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('milliseconds', now() + make_interval(secs => $1))")
            .bind(lead.as_secs_f64())
            .fetch_one(&app.primary)
            .await
            .unwrap();
    let mut initial = BTreeMap::new();
    for p in PRODUCTS {
        let limit = LIMITS.iter().find(|(l, _)| *l == p).map(|(_, n)| *n);
        let mut body = json!({"product_id": p, "name": p, "price_cents": 500, "available_quantity": INITIAL_STOCK});
        if let Some(limit) = limit {
            body["max_per_customer"] = json!(limit);
        }
        if p == WINDOWED {
            body["sale_starts_at"] = json!(starts.to_rfc3339());
        }
        let r = app
            .client
            .post(app.url("/v1/products"))
            .bearer_auth(&app.admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "creating {p}");
        let made: Value = r.json().await.unwrap();
        assert_eq!(made["max_per_customer"], json!(limit), "{made}");
        initial.insert(p.to_string(), INITIAL_STOCK);
    }
    initial
}

/// What a run must have exercised for its verdict to mean anything.
fn coverage(
    history: &[Op],
    faults: &BTreeMap<Fault, usize>,
    windows: &[(Fault, u64, u64)],
) -> Vec<String> {
    let seen = |f: &dyn Fn(&Op) -> bool| history.iter().any(f);
    let order = |o: &Op| matches!(o.target, Target::Order { .. });
    // Proof that the instances really reach the primary through the proxy: an order that did
    // not get through while it was cut (answered within the request timeout after the cut).
    let during_cut = |o: &Op| {
        windows
            .iter()
            .any(|&(f, from, to)| f == Fault::PrimaryCut && (from..to + 11_000).contains(&o.at_ms))
    };
    let mut missing: Vec<String> = [
        (
            "an order stalled by a primary cut (503 or lost)",
            seen(&|o| order(o) && during_cut(o) && !o.answer.definite()),
        ),
        (
            "an order answered 201",
            seen(&|o| order(o) && o.answer.status() == Some(201)),
        ),
        (
            "an order answered 409",
            seen(&|o| order(o) && o.answer.status() == Some(409)),
        ),
        (
            "a reused key answered",
            seen(&|o| o.kind == Kind::Reuse && o.answer.definite()),
        ),
        (
            "an answer lost to a hang-up",
            seen(&|o| o.kind == Kind::HangUp && o.answer.status().is_none()),
        ),
        (
            "a replay of an answered key",
            seen(&|o| o.kind == Kind::Replay),
        ),
        (
            "a cancel answered 200",
            seen(&|o| matches!(o.target, Target::Cancel { .. }) && o.answer.status() == Some(200)),
        ),
        (
            "a restock answered 200",
            seen(&|o| matches!(o.target, Target::Restock { .. }) && o.answer.status() == Some(200)),
        ),
        (
            "an order answered 409 LIMIT_EXCEEDED",
            seen(&|o| order(o) && o.answer.refusal() == Some(LIMIT_EXCEEDED)),
        ),
        (
            "an order answered 409 SALE_NOT_STARTED",
            seen(&|o| order(o) && o.answer.not_started()),
        ),
        (
            "a 201 for the windowed product, sent after a SALE_NOT_STARTED was heard",
            windowed_bought_after_not_started(history),
        ),
        (
            "a key told SALE_NOT_STARTED, then answered for good",
            seen(&|o| {
                o.answer.not_started()
                    && history[o.seq..]
                        .iter()
                        .any(|later| later.target == o.target && later.answer.settles())
            }),
        ),
    ]
    .into_iter()
    .filter(|(_, ok)| !ok)
    .map(|(what, _)| what.to_string())
    .collect();
    for f in FAULTS {
        if faults.get(&f).copied().unwrap_or(0) == 0 {
            missing.push(format!("fault {f:?} injected"));
        }
    }
    missing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_answer_under_paused_replicas_redis_restarts_primary_cuts_and_instance_restarts_is_the_truth()
 {
    let (seed, secs) = settings();
    eprintln!(
        "history: seed={seed} secs={secs} (STOCKGATE_HISTORY_SEED={seed} replays the choices)"
    );
    let cluster = private_cluster();
    let redis = Redis::temporary().expect("a private Redis");
    let database = fresh_database(&cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let a = spawn_instance(&cluster, &database, &redis, &proxy).await;
    let b = spawn_instance(&cluster, &database, &redis, &proxy).await;
    // The windowed product's sale starts a few seconds in: orders land on both sides of it.
    let initial = create_products(&a, Duration::from_secs((secs / 6).clamp(2, 5))).await;
    let checker_pool = a.primary.clone();
    let world = Arc::new(World::new([a.address.clone(), b.address.clone()]));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut master = fastrand::Rng::with_seed(seed);
    let mut clients = vec![];
    for c in 0..SHOPPERS {
        let shopper = Shopper {
            name: format!("shopper-{c:02}"),
            favourite: (c % COLLECTOR_EVERY == 0)
                .then(|| LIMITS[(c / COLLECTOR_EVERY) % LIMITS.len()].0),
            rng: master.fork(),
            world: world.clone(),
            keys: vec![],
            cancelled: BTreeSet::new(),
            unsure_cancels: vec![],
        };
        clients.push(tokio::spawn(shopper.run(deadline)));
    }
    for c in 0..RESTOCKERS {
        let restocker = Restocker {
            name: format!("restocker-{c}"),
            rng: master.fork(),
            world: world.clone(),
            sent: 0,
            unsure: vec![],
        };
        clients.push(tokio::spawn(restocker.run(deadline)));
    }
    let imports = tokio::spawn(importer(world.clone(), master.fork(), deadline));
    let mut nemesis = Nemesis {
        cluster: &cluster,
        database: database.clone(),
        redis,
        proxy,
        apps: [Some(a), Some(b)],
        world: world.clone(),
        rng: master.fork(),
        injected: BTreeMap::new(),
        windows: vec![],
    };
    nemesis.run(deadline).await;
    for c in clients {
        c.await.unwrap();
    }
    let imports = imports.await.unwrap();
    // Every fault has healed itself; now every open request gets a definite answer.
    resolve(&world, Duration::from_secs(60)).await;
    settle(&checker_pool).await;
    let db = snapshot(&checker_pool).await;
    let open = open_transactions(&checker_pool).await;
    let history = world.history();
    let anomalies = check(&initial, &history, &db);
    // The checker judges by the rules the primary holds at the end; they are the ones every
    // request met only if nothing (an import, say) changed them during the run.
    let drifted: Vec<String> = PRODUCTS
        .iter()
        .filter_map(|p| {
            let want = LIMITS.iter().find(|(l, _)| l == p).map(|(_, n)| *n);
            let rules = db.rules.get(*p).cloned().unwrap_or_default();
            (rules.limit != want || rules.starts.is_some() != (*p == WINDOWED))
                .then(|| format!("{p}: {rules:?}"))
        })
        .collect();
    let file =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("history-{seed}.jsonl"));
    let lines: Vec<String> = history
        .iter()
        .map(|o| serde_json::to_string(o).unwrap())
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let line = summary(seed, secs, &history, &nemesis.injected, &anomalies);
    eprintln!("{line}\nfull history: {}", file.display());
    let mut missing = coverage(&history, &nemesis.injected, &nemesis.windows);
    if imports == 0 {
        missing.push("an import that re-stated the products".into());
    }
    // The importer's row locks, the buyers', the refusals' and the cancels' never wait in a
    // circle (a batch would rerun after a deadlock and hide it; the database counts it).
    let windows = nemesis.windows.clone();
    drop(nemesis);
    flush_other_backends(&checker_pool).await;
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&checker_pool)
    .await
    .unwrap();
    eprintln!("{imports} imports applied; {deadlocks} deadlocks");
    assert!(
        anomalies.is_empty() && missing.is_empty() && deadlocks == 0 && drifted.is_empty(),
        "{deadlocks} deadlocks\ndrop rules changed during the run: {drifted:?}\n{}\nnot exercised: {missing:?}\nfaults (kind, from ms, to ms): {:?}\nprimary transactions still open: {open:#?}\n{line}\nseed {seed}; full history in {}",
        report(&anomalies, &history),
        windows,
        file.display()
    );
}

// ---------------------------------------------------------------------------------------------
// The checker's own tests: it must be able to fail. Made-up histories, no cluster.
// ---------------------------------------------------------------------------------------------

fn order(seq: usize, kind: Kind, key: &str, product: &str, quantity: i64, answer: Answer) -> Op {
    Op {
        seq,
        sent_ms: seq as u64,
        at_ms: seq as u64,
        client: "ada".into(),
        kind,
        instance: seq % 2,
        target: Target::Order {
            user: "ada".into(),
            key: key.into(),
            product: product.into(),
            quantity,
        },
        answer,
    }
}

fn got(status: u16, body: Value) -> Answer {
    Answer::Got {
        status,
        retry_after: status == 503,
        body,
    }
}

fn created(id: Uuid, product: &str, quantity: i64) -> Answer {
    got(
        201,
        json!({"order_id": id, "product_id": product, "quantity": quantity, "user_id": "ada", "status": "confirmed"}),
    )
}

fn out_of_stock() -> Answer {
    got(
        409,
        json!({"error": {"code": "OUT_OF_STOCK", "message": "…"}}),
    )
}

fn row(id: Uuid, key: &str, product: &str, quantity: i64, status: &str) -> Row {
    Row {
        order_id: id,
        user: "ada".into(),
        key: key.into(),
        product: product.into(),
        quantity,
        status: status.into(),
        refusal: None,
        created_at: at(0),
    }
}

/// An instant on the primary's clock, `s` seconds into a made-up day.
fn at(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

/// p: 10 initial; ada's k1 took 2 (a hang-up, then its retry found the order); k2 was refused.
fn clean() -> (BTreeMap<String, i64>, Vec<Op>, Snapshot) {
    let id = Uuid::new_v4();
    let history = vec![
        order(
            0,
            Kind::HangUp,
            "k1",
            "p",
            2,
            Answer::Lost {
                lost: "hung up".into(),
            },
        ),
        order(1, Kind::Retry, "k1", "p", 2, created(id, "p", 2)),
        order(2, Kind::New, "k2", "p", 9, out_of_stock()),
        order(
            3,
            Kind::Reuse,
            "k1",
            "p",
            3,
            got(422, json!({"error": {"code": "IDEMPOTENCY_KEY_REUSED"}})),
        ),
    ];
    let db = Snapshot {
        stock: BTreeMap::from([("p".to_string(), 8)]),
        orders: vec![
            row(id, "k1", "p", 2, "confirmed"),
            row(Uuid::new_v4(), "k2", "p", 9, "refused"),
        ],
        restocks: Some(vec![]),
        ..Snapshot::default()
    };
    (BTreeMap::from([("p".to_string(), 10)]), history, db)
}

#[test]
fn history_checker_passes_a_truthful_history() {
    let (initial, history, db) = clean();
    let found = check(&initial, &history, &db);
    assert!(found.is_empty(), "{}", report(&found, &history));
}

#[test]
fn history_checker_flags_a_409_whose_original_committed_later() {
    let (initial, mut history, mut db) = clean();
    // k2's original was still queued when its retry was told 409; then it committed.
    db.orders[1].status = "confirmed".into();
    db.orders[1].quantity = 1;
    history[2] = order(2, Kind::Retry, "k2", "p", 1, out_of_stock());
    db.stock.insert("p".into(), 7);
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a
            .what
            .contains("answered 409 OUT_OF_STOCK, but the key holds order")),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_a_restock_retry_that_added_twice() {
    let (initial, mut history, mut db) = clean();
    let restock = |seq, kind, answer| Op {
        seq,
        sent_ms: 0,
        at_ms: 0,
        client: "admin".into(),
        kind,
        instance: 0,
        target: Target::Restock {
            key: "r1".into(),
            product: "p".into(),
            quantity: 5,
        },
        answer,
    };
    history.push(restock(
        4,
        Kind::New,
        got(503, json!({"error": {"code": "UNAVAILABLE"}})),
    ));
    history.push(restock(
        5,
        Kind::Retry,
        got(200, json!({"product_id": "p", "available_quantity": 18})),
    ));
    db.stock.insert("p".into(), 18);
    db.restocks = None;
    let found = check(&initial, &history, &db);
    assert!(
        found
            .iter()
            .any(|a| a.subject == Subject::Product("p".into())),
        "{found:?}"
    );
    assert!(
        found.iter().any(|a| a.subject == Subject::Database),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_two_orders_for_one_key_and_a_bare_503() {
    let (initial, mut history, db) = clean();
    history.push(order(
        4,
        Kind::Replay,
        "k1",
        "p",
        2,
        created(Uuid::new_v4(), "p", 2),
    ));
    history.push(order(
        5,
        Kind::Replay,
        "k1",
        "p",
        2,
        Answer::Got {
            status: 503,
            retry_after: false,
            body: Value::Null,
        },
    ));
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a.what.contains("different orders")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|a| a.what.contains("503 without Retry-After")),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_a_reused_key_that_took_stock() {
    let (initial, mut history, mut db) = clean();
    // k2 was refused; its reuse with a smaller quantity then created an order.
    let id = Uuid::new_v4();
    history.push(order(4, Kind::Reuse, "k2", "p", 1, created(id, "p", 1)));
    db.orders[1] = row(id, "k2", "p", 1, "confirmed");
    db.stock.insert("p".into(), 7);
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a.what.contains("want 422")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|a| a.what.contains("reused body")),
        "{found:?}"
    );
}

fn limit_exceeded(product: &str, limit: i64, already: i64) -> Answer {
    got(
        409,
        json!({"error": {"code": "LIMIT_EXCEEDED", "message": "…", "product_id": product, "limit": limit, "already": already}}),
    )
}

fn not_started() -> Answer {
    Answer::Got {
        status: 409,
        retry_after: true,
        body: json!({"error": {"code": "SALE_NOT_STARTED", "message": "…"}}),
    }
}

fn cancel(seq: usize, order_id: Uuid) -> Op {
    Op {
        seq,
        sent_ms: seq as u64,
        at_ms: seq as u64,
        client: "ada".into(),
        kind: Kind::Cancel,
        instance: seq % 2,
        target: Target::Cancel {
            user: "ada".into(),
            order_id,
        },
        answer: got(200, json!({"order_id": order_id, "status": "cancelled"})),
    }
}

/// Two drops, 10 units each: `lim` (at most 2 per customer) and `soon` (its sale starts at
/// `at(100)`). ada's k1 took 2 of `lim`; k2 (1 more) was refused for the limit, and its replay
/// was told the same; k3 was sent before `soon` started and told SALE_NOT_STARTED, then bought
/// with the same key once it had; k4 bought too; k1 was cancelled, which freed its units for
/// k5, which took 2 of `lim` again.
fn drops() -> (BTreeMap<String, i64>, Vec<Op>, Snapshot) {
    let (id1, id3, id4, id5) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let history = vec![
        order(0, Kind::New, "k1", "lim", 2, created(id1, "lim", 2)),
        order(1, Kind::New, "k2", "lim", 1, limit_exceeded("lim", 2, 2)),
        order(2, Kind::Replay, "k2", "lim", 1, limit_exceeded("lim", 2, 2)),
        order(3, Kind::New, "k3", "soon", 1, not_started()),
        order(4, Kind::Retry, "k3", "soon", 1, created(id3, "soon", 1)),
        order(5, Kind::New, "k4", "soon", 1, created(id4, "soon", 1)),
        cancel(6, id1),
        order(7, Kind::New, "k5", "lim", 2, created(id5, "lim", 2)),
    ];
    let written_at = |mut r: Row, s: i64| {
        r.created_at = at(s);
        r
    };
    let mut k2 = row(Uuid::new_v4(), "k2", "lim", 1, "refused");
    k2.refusal = Some(LIMIT_EXCEEDED.into());
    let db = Snapshot {
        stock: BTreeMap::from([("lim".to_string(), 8), ("soon".to_string(), 8)]),
        rules: BTreeMap::from([
            (
                "lim".to_string(),
                Rules {
                    limit: Some(2),
                    ..Rules::default()
                },
            ),
            (
                "soon".to_string(),
                Rules {
                    starts: Some(at(100)),
                    ..Rules::default()
                },
            ),
        ]),
        orders: vec![
            row(id1, "k1", "lim", 2, "cancelled"),
            k2,
            written_at(row(id3, "k3", "soon", 1, "confirmed"), 101),
            written_at(row(id4, "k4", "soon", 1, "confirmed"), 102),
            row(id5, "k5", "lim", 2, "confirmed"),
        ],
        lines: vec![],
        restocks: Some(vec![]),
    };
    let initial = BTreeMap::from([("lim".to_string(), 10), ("soon".to_string(), 10)]);
    (initial, history, db)
}

/// Only anomalies of `class`, and at least one.
fn only(found: &[Anomaly], class: &str, history: &[Op]) {
    assert!(
        !found.is_empty() && found.iter().all(|a| a.class == class),
        "want only {class:?}:{}",
        report(found, history)
    );
}

/// Limits and a window told the truth. Mutations of the checker that make it fail: `statuses`
/// accepting only OUT_OF_STOCK for an order's 409, as before flash drops (both drop codes are
/// flagged); counting SALE_NOT_STARTED as a refusal of its key (k3 is "409 not final");
/// `limits` counting cancelled orders (ada holds 4 of `lim`).
#[test]
fn history_checker_passes_a_truthful_history_with_limits_and_a_window() {
    let (initial, history, db) = drops();
    let found = check(&initial, &history, &db);
    assert!(found.is_empty(), "{}", report(&found, &history));
}

/// k2 confirmed (ada holds 3 of `lim`, limit 2), and, separately, a live hold of 1 `lim` beside
/// ada's 2 confirmed. Mutations of the checker that make it fail: `check` without
/// `c.limits()`, or `limits` bounding by `limit + 1`, miss both; `limits` summing only order
/// rows, not `lines`, misses the hold.
#[test]
fn history_checker_flags_a_user_past_a_limit() {
    let (initial, mut history, mut db) = drops();
    let id2 = Uuid::new_v4();
    history[1] = order(1, Kind::New, "k2", "lim", 1, created(id2, "lim", 1));
    history[2] = order(2, Kind::Replay, "k2", "lim", 1, created(id2, "lim", 1));
    db.orders[1] = row(id2, "k2", "lim", 1, "confirmed");
    db.stock.insert("lim".into(), 7);
    let found = check(&initial, &history, &db);
    only(&found, "a user past a limit", &history);
    assert!(found[0].what.contains("holds 3 of lim"), "{found:?}");

    let (initial, history, mut db) = drops();
    db.lines.push(LineUnits {
        user: "ada".into(),
        product: "lim".into(),
        quantity: 1,
        ordered_at: None,
    });
    let found = check(&initial, &history, &db);
    only(&found, "a user past a limit", &history);
    assert_eq!(
        found[0].subject,
        Subject::Customer {
            user: "ada".into(),
            product: "lim".into()
        }
    );
}

/// k4's order written a second before `soon` started, and a refusal (k6, out of stock) written
/// long before: nothing may be claimed before the start, refusals included. Mutations of the
/// checker that make it fail: `check` without `c.windows(..)`, or `windows` comparing
/// `created_at > starts`, miss both; `windows` looking only at confirmed rows misses k6.
#[test]
fn history_checker_flags_an_order_written_before_the_start() {
    let (initial, mut history, mut db) = drops();
    db.orders[3].created_at = at(99);
    history.push(order(8, Kind::New, "k6", "soon", 20, out_of_stock()));
    let mut k6 = row(Uuid::new_v4(), "k6", "soon", 20, "refused");
    k6.created_at = at(50);
    db.orders.push(k6);
    let found = check(&initial, &history, &db);
    only(&found, "claimed before the start", &history);
    let keys: BTreeSet<&Subject> = found.iter().map(|a| &a.subject).collect();
    for key in ["k4", "k6"] {
        assert!(
            keys.contains(&Subject::Key {
                user: "ada".into(),
                key: key.into()
            }),
            "{key}: {found:?}"
        );
    }
}

/// k6 sent after a 201 for `soon` was heard, yet told SALE_NOT_STARTED (then bought, so its key
/// is resolved). Mutations of the checker that make it fail: `windows` without its
/// SALE_NOT_STARTED loop, or comparing the wrong way round (`o.sent_ms < seen_on`).
#[test]
fn history_checker_flags_sale_not_started_once_the_sale_was_on() {
    let (initial, mut history, mut db) = drops();
    let id6 = Uuid::new_v4();
    history.push(order(8, Kind::New, "k6", "soon", 1, not_started()));
    history.push(order(
        9,
        Kind::Retry,
        "k6",
        "soon",
        1,
        created(id6, "soon", 1),
    ));
    let mut k6 = row(id6, "k6", "soon", 1, "confirmed");
    k6.created_at = at(103);
    db.orders.push(k6);
    db.stock.insert("soon".into(), 7);
    let found = check(&initial, &history, &db);
    only(&found, "SALE_NOT_STARTED once the sale was on", &history);
    // k3 was told SALE_NOT_STARTED before any 201 for `soon` was heard: that one was true.
    let k6 = Subject::Key {
        user: "ada".into(),
        key: "k6".into(),
    };
    assert!(found.iter().all(|a| a.subject == k6), "{found:?}");
}

/// k2's refusal stored as one for stock while its answers said LIMIT_EXCEEDED, and,
/// separately, a LIMIT_EXCEEDED that names another limit than the product's. Mutation of the
/// checker that makes it fail: `order_key` without `refusal_reasons`.
#[test]
fn history_checker_flags_a_limit_refusal_its_key_does_not_hold() {
    let (initial, history, mut db) = drops();
    db.orders[1].refusal = None;
    let found = check(&initial, &history, &db);
    only(&found, "409 not the key's refusal", &history);

    let (initial, mut history, db) = drops();
    history[2] = order(2, Kind::Replay, "k2", "lim", 1, limit_exceeded("lim", 3, 2));
    let found = check(&initial, &history, &db);
    only(&found, "LIMIT_EXCEEDED misstates the limit", &history);
}
