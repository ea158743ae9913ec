//! One owner per contended product across instances (issue #31, part 2).
//!
//! Several instances selling one product each take its row for their own batches, and each
//! batch is smaller (an instance gathers only the orders it holds): four instances with 16
//! connections each ran batches of 15.7 orders against one instance's 34.4, and sold 0.61×
//! of one (bench/results/scale-2026-12-03.md). Here a
//! product whose row another writer keeps taking between this instance's batches ("contended",
//! [`crate::checkout::Checkout::contended`]) has its single-product orders sent to one owner,
//! the same for every instance: the live peer that ranks the product highest (rendezvous
//! hashing over `STOCKGATE_PEERS`). Orders travel in batches, each request carrying
//! everything queued for that owner when it leaves (up to [`IN_FLIGHT`] out at once), and
//! join the owner's own batches for the product: one row, one writer, larger batches.
//!
//! Nothing about correctness rests on this: the owner places each order exactly as if its
//! client had sent it there (the same guarded UPDATE, key claim and answer), and two instances
//! that disagree about the owner only contend as before. The answers come back as the owner's
//! HTTP answers (status, `Retry-After`, body), so a forwarded order is told what the owner
//! would have told it. An owner that cannot be reached (nothing sent) is skipped for
//! [`DOWN_FOR`] and the order is placed here; one that fails after the batch was sent leaves
//! its outcome unknown: 503 `OUTCOME_UNKNOWN`, and the same key tells the truth later.
//! Read-your-writes needs the shared store, so peers require `STOCKGATE_REDIS_URL`.

use crate::auth::{Caller, Tokens};
use crate::checkout::OrderRequest;
use crate::clock::Clock;
use crate::metrics::Metrics;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The peer listener's one route.
pub const PATH: &str = "/peer/v1/orders";

/// How long an owner that could not be reached is passed over (on the application's clock).
pub const DOWN_FOR: Duration = Duration::from_secs(5);

/// Forwarded requests out at once, per owner.
const IN_FLIGHT: usize = 4;

/// The most orders one forwarded request carries.
const MAX_FORWARD: usize = 1024;

/// How long a forwarded batch may take before its orders are told "unknown": the owner's own
/// batch limit (12 s) and a margin.
const FORWARD_LIMIT: Duration = Duration::from_secs(15);

/// One order on its way to its owner (the caller was authenticated here; `user` is the one
/// it acts for).
#[derive(Debug, Serialize, Deserialize)]
pub struct WireOrder {
    pub user: String,
    pub product: String,
    pub quantity: i32,
    pub key: String,
}

/// The owner's HTTP answer to one order.
#[derive(Debug, Serialize, Deserialize)]
pub struct WireAnswer {
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// The JSON body as the owner wrote it, passed on untouched.
    pub body: Box<serde_json::value::RawValue>,
}

impl WireAnswer {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut response = (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            String::from(Box::<str>::from(self.body)),
        )
            .into_response();
        if let Some(v) = self
            .retry_after
            .and_then(|v| HeaderValue::from_str(&v).ok())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }
}

struct Forward {
    order: WireOrder,
    /// `None`: the owner could not be reached and nothing was sent; place it here.
    reply: oneshot::Sender<Option<Response>>,
}

#[derive(Clone)]
pub struct Peers(Arc<Inner>);

struct Inner {
    me: String,
    all: Vec<String>,
    /// Until when each owner is passed over, on `clock`.
    down: Mutex<HashMap<String, Instant>>,
    clock: Arc<dyn Clock>,
    queues: Mutex<HashMap<String, mpsc::UnboundedSender<Forward>>>,
    client: reqwest::Client,
    tokens: Tokens,
    metrics: Metrics,
}

impl Peers {
    /// `me` is this instance's own entry of `all` (checked by the configuration); `clock`
    /// times [`DOWN_FOR`].
    pub fn new(
        me: String,
        all: Vec<String>,
        tokens: Tokens,
        metrics: Metrics,
        clock: Arc<dyn Clock>,
    ) -> Peers {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(8)
            .connect_timeout(Duration::from_secs(1))
            .timeout(FORWARD_LIMIT)
            .build()
            .expect("an HTTP client with default TLS-free settings");
        Peers(Arc::new(Inner {
            me,
            all,
            down: Mutex::default(),
            clock,
            queues: Mutex::default(),
            client,
            tokens,
            metrics,
        }))
    }

    /// The peer that owns `product`'s orders when it is contended, or `None` when it is this
    /// instance: the live peer (this one always counts as live) with the highest rank.
    pub fn owner_of(&self, product: &str) -> Option<&str> {
        let now = self.0.clock.now();
        let down = self.0.down.lock().unwrap_or_else(|p| p.into_inner());
        let owner = self
            .0
            .all
            .iter()
            .filter(|p| **p == self.0.me || down.get(*p).is_none_or(|until| *until <= now))
            .max_by_key(|p| rank(p, product))?;
        (*owner != self.0.me).then_some(owner.as_str())
    }

    /// Sends `req` to `owner` with the other orders queued for it. `None`: the owner could
    /// not be reached, nothing was sent, and the order is the caller's to place.
    pub async fn place(&self, owner: &str, req: &OrderRequest) -> Option<Response> {
        let (tx, rx) = oneshot::channel();
        let forward = Forward {
            order: WireOrder {
                user: req.user.to_string(),
                product: req.product.to_string(),
                quantity: req.quantity.get(),
                key: req.key.as_str().to_string(),
            },
            reply: tx,
        };
        {
            let mut queues = self.0.queues.lock().unwrap_or_else(|p| p.into_inner());
            let sender = queues.entry(owner.to_string()).or_insert_with(|| {
                let (sender, receiver) = mpsc::unbounded_channel();
                tokio::spawn(self.clone().sender(owner.to_string(), receiver));
                sender
            });
            if let Err(mpsc::error::SendError(forward)) = sender.send(forward) {
                // The owner's sender task is gone (a panic): place it here.
                queues.remove(owner);
                drop(forward);
                return None;
            }
        }
        // A dropped reply means the sender task died with the batch in hand: it may have
        // been sent, so the honest answer is "unknown".
        rx.await.unwrap_or_else(|_| Some(unknown()))
    }

    /// Sends `owner`'s queued orders, up to [`IN_FLIGHT`] requests at a time, each with
    /// everything queued when it left: an order waits for a free slot, never for the
    /// owner's batch that another request's orders are in.
    async fn sender(self, owner: String, mut rx: mpsc::UnboundedReceiver<Forward>) {
        let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        while let Some(first) = rx.recv().await {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_FORWARD {
                match rx.try_recv() {
                    Ok(f) => batch.push(f),
                    Err(_) => break,
                }
            }
            let (this, owner) = (self.clone(), owner.clone());
            tokio::spawn(async move {
                let _permit = permit;
                this.forward(&owner, batch).await;
            });
        }
    }

    async fn forward(&self, owner: &str, batch: Vec<Forward>) {
        let (orders, replies): (Vec<WireOrder>, Vec<_>) =
            batch.into_iter().map(|f| (f.order, f.reply)).unzip();
        let answers = self.send(owner, &orders).await;
        let outcome = match &answers {
            Sent::Answered(_) => "answered",
            Sent::Unreachable => "unreachable",
            Sent::Unknown => "unknown",
        };
        self.0
            .metrics
            .orders_forwarded
            .with_label_values(&[outcome])
            .inc_by(orders.len() as u64);
        match answers {
            Sent::Answered(answers) => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(Some(answer.into_response()));
                }
            }
            Sent::Unreachable => {
                self.0
                    .down
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(owner.to_string(), self.0.clock.now() + DOWN_FOR);
                for reply in replies {
                    let _ = reply.send(None);
                }
            }
            Sent::Unknown => {
                for reply in replies {
                    let _ = reply.send(Some(unknown()));
                }
            }
        }
    }

    async fn send(&self, owner: &str, orders: &[WireOrder]) -> Sent {
        let Ok(token) = self.0.tokens.issue(&Caller::Admin, Duration::from_secs(60)) else {
            return Sent::Unreachable;
        };
        let sent = self
            .0
            .client
            .post(format!("{owner}{PATH}"))
            .bearer_auth(token)
            .json(orders)
            .send()
            .await;
        let response = match sent {
            Ok(r) if r.status().is_success() => r,
            // The owner refused the whole request (shutting down, overloaded, bad token)
            // before placing anything: nothing of it was written.
            Ok(r) => {
                tracing::warn!(%owner, status = %r.status(), "a peer refused forwarded orders; placing them here");
                return Sent::Unreachable;
            }
            Err(e) if e.is_connect() => {
                tracing::warn!(%owner, error = %e, "a peer could not be reached; placing its orders here");
                return Sent::Unreachable;
            }
            Err(e) => {
                tracing::warn!(%owner, error = %e, "forwarded orders' link failed; their outcome is unknown");
                return Sent::Unknown;
            }
        };
        match response.json::<Vec<WireAnswer>>().await {
            Ok(answers) if answers.len() == orders.len() => Sent::Answered(answers),
            other => {
                tracing::warn!(%owner, error = ?other.err(), "a peer's answer could not be read; the outcome is unknown");
                Sent::Unknown
            }
        }
    }
}

enum Sent {
    Answered(Vec<WireAnswer>),
    Unreachable,
    Unknown,
}

/// Rendezvous rank of `peer` for `product`: every instance computes the same owner from the
/// same list, and removing a peer moves only its own products.
fn rank(peer: &str, product: &str) -> u64 {
    // SipHash with fixed keys: the same on every instance and build.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x7374_6f63_6b67_6174, 0x6f77_6e65_7273);
    peer.hash(&mut h);
    product.hash(&mut h);
    h.finish()
}

fn unknown() -> Response {
    crate::http::error::ApiError::from(crate::checkout::CheckoutError::OutcomeUnknown)
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(me: &str) -> Peers {
        let all = ["http://a:9000", "http://b:9000", "http://c:9000"]
            .map(String::from)
            .to_vec();
        Peers::new(
            me.into(),
            all,
            Tokens::new("a-secret-of-at-least-16-bytes"),
            Metrics::new(),
            Arc::new(crate::clock::SystemClock),
        )
    }

    #[test]
    fn every_instance_names_the_same_owner_and_none_names_itself() {
        let (a, b, c) = (
            peers("http://a:9000"),
            peers("http://b:9000"),
            peers("http://c:9000"),
        );
        let mut owned = HashMap::new();
        for i in 0..300 {
            let product = format!("p-{i}");
            let views = [
                a.owner_of(&product),
                b.owner_of(&product),
                c.owner_of(&product),
            ];
            // Exactly one instance owns it (sees None); the others name that one.
            let me = ["http://a:9000", "http://b:9000", "http://c:9000"];
            let owners: Vec<&str> = views
                .iter()
                .zip(me)
                .filter_map(|(v, m)| v.is_none().then_some(m))
                .collect();
            assert_eq!(owners.len(), 1, "{product}: {views:?}");
            for v in views.iter().flatten() {
                assert_eq!(*v, owners[0]);
            }
            *owned.entry(owners[0]).or_insert(0) += 1;
        }
        // Products spread over the peers.
        assert!(owned.values().all(|n| *n > 50), "{owned:?}");
    }

    #[test]
    fn an_owner_marked_down_is_passed_over_until_its_time_is_up() {
        let a = peers("http://a:9000");
        let product = (0..)
            .map(|i| format!("p-{i}"))
            .find(|p| a.owner_of(p).is_some())
            .unwrap();
        let owner = a.owner_of(&product).unwrap().to_string();
        a.0.down
            .lock()
            .unwrap()
            .insert(owner.clone(), Instant::now() + DOWN_FOR);
        assert_ne!(a.owner_of(&product), Some(owner.as_str()));
        a.0.down
            .lock()
            .unwrap()
            .insert(owner.clone(), Instant::now());
        assert_eq!(a.owner_of(&product), Some(owner.as_str()));
    }
}
