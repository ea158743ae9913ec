//! The peer client: forwards a contended product's orders to its owner in lanes, one per
//! owner and product, and passes over an owner that cannot be reached or goes silent (the
//! why is in [`super`]).

use super::placement::{self, Placement};
use super::{ALIVE_PATH, MAX_FORWARD, PATH, WireAnswer, WireOrder};
use crate::auth::{Caller, Tokens};
use crate::checkout::OrderRequest;
use crate::clock::Clock;
use crate::metrics::Metrics;
use axum::response::{IntoResponse, Response};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long an owner that could not be reached, or that went silent, is passed over.
pub const DOWN_FOR: Duration = Duration::from_secs(5);

/// Forwarded requests out at once, per owner and product: a product whose batch waits at the
/// owner (its row held locked) fills only its own slots, never another product's.
const IN_FLIGHT: usize = 4;

/// The outer bound on a forwarded request whose owner keeps showing signs of life: the
/// owner's own batch limit (12 s) and a margin. Past it the orders are told "unknown".
const FORWARD_LIMIT: Duration = Duration::from_secs(15);

/// How long a sign of life may take: the route does no work, so a live process answers in
/// far less even on a saturated host; a frozen one never does.
const PROBE_LIMIT: Duration = Duration::from_secs(1);

/// How many answered forwards, per owner, [`suspect_after`] looks back on.
const RECENT: usize = 32;

/// How long a forwarded request may go unanswered before its owner is asked for a sign of
/// life, from how long the owner's recent answers took (`recent`, the newest last): four
/// times the slowest, so an owner that is merely busy is rarely asked; at least
/// [`SUSPECT_FLOOR`], well above any batch's time on a healthy owner (a batch is a few
/// milliseconds, and a product waits on another's stalled statement for 25 ms at most);
/// and at most [`SUSPECT_CAP`], so that a frozen owner is passed over with most of the
/// client's 10 s still left for the order to be placed here. Being asked costs the owner
/// one tiny request, so suspecting early is cheap; only silence counts against it.
pub fn suspect_after(recent: &VecDeque<Duration>) -> Duration {
    let slowest = recent.iter().max().copied().unwrap_or_default();
    (slowest * 4).clamp(SUSPECT_FLOOR, SUSPECT_CAP)
}

/// See [`suspect_after`].
const SUSPECT_FLOOR: Duration = Duration::from_millis(250);
/// See [`suspect_after`].
const SUSPECT_CAP: Duration = Duration::from_secs(2);

struct Forward {
    order: WireOrder,
    /// `None`: the order is the caller's to place here (nothing was sent, or the owner went
    /// silent with it: the key claim decides, see [`Sent::Silent`]).
    reply: oneshot::Sender<Option<Response>>,
}

/// Orders on their way to one owner for one product: those waiting for a slot, and how many
/// requests are out.
#[derive(Default)]
struct Lane {
    waiting: Vec<Forward>,
    in_flight: usize,
}

impl Lane {
    /// The next request's orders: everything waiting, up to [`MAX_FORWARD`].
    fn take(&mut self) -> Vec<Forward> {
        let n = self.waiting.len().min(MAX_FORWARD);
        self.waiting.drain(..n).collect()
    }
}

/// (owner, product).
type LaneKey = (String, String);

#[derive(Clone)]
pub struct Peers(Arc<Inner>);

struct Inner {
    me: String,
    all: Vec<String>,
    /// Until when each owner is passed over, on `clock`.
    down: Mutex<HashMap<String, Instant>>,
    clock: Arc<dyn Clock>,
    lanes: Mutex<HashMap<LaneKey, Lane>>,
    /// How long each owner's recent answered forwards took, the newest last.
    recent: Mutex<HashMap<String, VecDeque<Duration>>>,
    client: reqwest::Client,
    tokens: Tokens,
    metrics: Metrics,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
            lanes: Mutex::default(),
            recent: Mutex::default(),
            client,
            tokens,
            metrics,
        }))
    }

    /// Where an order for `product` is placed, `contended` saying whether it is contended
    /// here. The down list is read only for a contended product, so an order that stays here
    /// takes no lock.
    pub fn placement(&self, product: &str, contended: bool) -> Placement<'_> {
        placement::decide(product, contended, &self.0.me, &self.0.all, |p| {
            self.is_down(p)
        })
    }

    /// Forwarded requests to `owner` that have not been answered yet, over all products.
    pub fn in_flight(&self, owner: &str) -> usize {
        locked(&self.0.lanes)
            .iter()
            .filter(|((o, _), _)| o == owner)
            .map(|(_, lane)| lane.in_flight)
            .sum()
    }

    fn is_down(&self, owner: &str) -> bool {
        let now = self.0.clock.now();
        locked(&self.0.down)
            .get(owner)
            .is_some_and(|until| now < *until)
    }

    fn mark_down(&self, owner: &str) {
        let until = self.0.clock.now() + DOWN_FOR;
        locked(&self.0.down).insert(owner.to_string(), until);
    }

    /// Sends `req` to `owner` with the other orders for its product queued for that owner.
    /// `None`: the order is the caller's to place here, under the same key (nothing was
    /// sent, or the owner went silent; either way the key's claim in the database decides).
    pub async fn place(&self, owner: &str, req: &OrderRequest) -> Option<Response> {
        let (tx, rx) = oneshot::channel();
        let forward = Forward {
            order: WireOrder {
                user: req.user.to_string(),
                product: req.product.to_string(),
                quantity: req.quantity.get(),
                key: req.key.as_str().to_string(),
                locations: req.locations.get().iter().map(|l| l.to_string()).collect(),
            },
            reply: tx,
        };
        let key = (owner.to_string(), req.product.to_string());
        if let Some(batch) = self.enqueue(&key, forward) {
            tokio::spawn(self.clone().drive(key, batch));
        }
        // A dropped reply means the sending task died with the batch in hand: it may have
        // been sent, so the honest answer is "unknown".
        crate::batching::answer(rx, Some(unknown())).await
    }

    /// Queues `forward` in its lane; the orders to send now when the lane has a free slot
    /// (which is then the caller's).
    fn enqueue(&self, key: &LaneKey, forward: Forward) -> Option<Vec<Forward>> {
        let mut lanes = locked(&self.0.lanes);
        let lane = lanes.entry(key.clone()).or_default();
        lane.waiting.push(forward);
        (lane.in_flight < IN_FLIGHT).then(|| {
            lane.in_flight += 1;
            lane.take()
        })
    }

    /// Sends `batch`, then whatever its lane gathered meanwhile, until the lane is empty:
    /// each request carries everything waiting when it leaves, and an order waits for a
    /// free slot of its own product, never for another request's answer.
    async fn drive(self, key: LaneKey, mut batch: Vec<Forward>) {
        let mut slot = Slot {
            peers: &self,
            key: &key,
            held: true,
        };
        loop {
            self.forward(&key.0, batch).await;
            match slot.next() {
                Some(next) => batch = next,
                None => return,
            }
        }
    }

    async fn forward(&self, owner: &str, batch: Vec<Forward>) {
        let (orders, replies): (Vec<WireOrder>, Vec<_>) =
            batch.into_iter().map(|f| (f.order, f.reply)).unzip();
        if self.is_down(owner) {
            // Passed over since these orders were queued: nothing sent, placed here.
            for reply in replies {
                let _ = reply.send(None);
            }
            return;
        }
        let answers = self.exchange(owner, &orders).await;
        let outcome = match &answers {
            Sent::Answered(_) => "answered",
            Sent::Unreachable => "unreachable",
            Sent::Silent => "no_answer",
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
            Sent::Unreachable | Sent::Silent => {
                self.mark_down(owner);
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

    /// Sends `orders` and waits for the answer for as long as `owner` shows signs of life:
    /// an answer slower than [`suspect_after`] has the owner asked whether it is alive, and
    /// one that is not is given up ([`Sent::Silent`]). An owner that answers is only slow
    /// for this product (its row held, say), and the orders would wait as long here.
    async fn exchange(&self, owner: &str, orders: &[WireOrder]) -> Sent {
        let started = Instant::now();
        let send = self.send(owner, orders);
        tokio::pin!(send);
        let sent = loop {
            let suspect = suspect_after(locked(&self.0.recent).entry(owner.into()).or_default());
            if let Ok(sent) = tokio::time::timeout(suspect, &mut send).await {
                break sent;
            }
            if self.is_down(owner) {
                // Another request to it went unanswered already.
                break Sent::Silent;
            }
            let alive = tokio::select! {
                sent = &mut send => break sent,
                alive = self.alive(owner) => alive,
            };
            if !alive {
                tracing::warn!(%owner, waited_ms = started.elapsed().as_millis() as u64, "a peer does not answer; placing its orders here under their keys");
                break Sent::Silent;
            }
        };
        if let Sent::Answered(_) = &sent {
            let mut recent = locked(&self.0.recent);
            let recent = recent.entry(owner.into()).or_default();
            if recent.len() == RECENT {
                recent.pop_front();
            }
            recent.push_back(started.elapsed());
        }
        sent
    }

    /// Whether `owner`'s process answers at all (any HTTP answer) within [`PROBE_LIMIT`].
    async fn alive(&self, owner: &str) -> bool {
        self.0
            .client
            .get(format!("{owner}{ALIVE_PATH}"))
            .timeout(PROBE_LIMIT)
            .send()
            .await
            .is_ok()
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
            // The owner refused the whole request (shutting down, overloaded, bad token),
            // which it does before placing anything; and placing here is safe in any case,
            // since the same keys are claimed in the same database.
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

/// A lane's slot, held by the task sending its requests: given back once the lane has
/// nothing waiting, and also when the task dies (a panic), so a lane never stays full.
struct Slot<'a> {
    peers: &'a Peers,
    key: &'a LaneKey,
    held: bool,
}

impl Slot<'_> {
    /// The lane's next orders, or `None` with the slot given back (in one step under the
    /// lanes' lock, so an order queued meanwhile is never left without a sender).
    fn next(&mut self) -> Option<Vec<Forward>> {
        let mut lanes = locked(&self.peers.0.lanes);
        let lane = lanes.get_mut(self.key)?;
        if !lane.waiting.is_empty() {
            return Some(lane.take());
        }
        self.held = false;
        lane.in_flight -= 1;
        if lane.in_flight == 0 {
            lanes.remove(self.key);
        }
        None
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let mut lanes = locked(&self.peers.0.lanes);
        let Some(lane) = lanes.get_mut(self.key) else {
            return;
        };
        lane.in_flight -= 1;
        if lane.in_flight == 0 {
            // No sender left: the orders waiting were never sent, so they are placed here.
            for f in lane.waiting.drain(..) {
                let _ = f.reply.send(None);
            }
            lanes.remove(self.key);
        }
    }
}

enum Sent {
    Answered(Vec<WireAnswer>),
    /// Nothing was sent (or the owner refused the request whole): placed here.
    Unreachable,
    /// Sent, and the owner gave no answer and no sign of life: it is passed over like an
    /// unreachable one, and the orders are placed here under their own keys. The owner may
    /// still place them (a frozen process thaws and carries on), but each key is claimed
    /// once in the database, so whichever placement comes second answers what the first
    /// wrote: never two orders, never a refusal beside an order.
    Silent,
    /// The link failed after sending: the owner may have committed; 503 `OUTCOME_UNKNOWN`.
    Unknown,
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

    /// The owner `p` names for `product` when it is contended; `None` when that is `p`.
    fn owner<'a>(p: &'a Peers, product: &str) -> Option<&'a str> {
        match p.placement(product, true) {
            Placement::Here => None,
            Placement::Owner(owner) => Some(owner),
        }
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
                owner(&a, &product),
                owner(&b, &product),
                owner(&c, &product),
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
            .find(|p| owner(&a, p).is_some())
            .unwrap();
        let named = owner(&a, &product).unwrap().to_string();
        a.0.down
            .lock()
            .unwrap()
            .insert(named.clone(), Instant::now() + DOWN_FOR);
        assert_ne!(owner(&a, &product), Some(named.as_str()));
        a.0.down
            .lock()
            .unwrap()
            .insert(named.clone(), Instant::now());
        assert_eq!(owner(&a, &product), Some(named.as_str()));
    }

    #[test]
    fn an_unanswered_forward_is_suspected_after_four_times_the_slowest_recent_answer_within_bounds()
    {
        let ms = Duration::from_millis;
        let recent = |d: &[u64]| d.iter().map(|d| ms(*d)).collect::<VecDeque<_>>();
        assert_eq!(
            suspect_after(&recent(&[])),
            SUSPECT_FLOOR,
            "nothing seen yet"
        );
        assert_eq!(suspect_after(&recent(&[3, 9, 4])), SUSPECT_FLOOR);
        assert_eq!(
            suspect_after(&recent(&[3, 100, 4])),
            ms(400),
            "the slowest counts"
        );
        assert_eq!(suspect_after(&recent(&[3, 9_000])), SUSPECT_CAP);
        assert!(
            SUSPECT_CAP + PROBE_LIMIT < Duration::from_secs(5),
            "well inside the client's 10 s"
        );
    }

    fn forward() -> (Forward, oneshot::Receiver<Option<Response>>) {
        let (reply, rx) = oneshot::channel();
        let order = WireOrder {
            user: "u".into(),
            product: "p".into(),
            quantity: 1,
            key: "k".into(),
            locations: vec![],
        };
        (Forward { order, reply }, rx)
    }

    #[test]
    fn a_product_whose_lane_is_full_leaves_the_owners_other_products_free() {
        let a = peers("http://a:9000");
        let lane = |p: &str| ("http://b:9000".to_string(), p.to_string());
        let mut waiting = Vec::new();
        for _ in 0..IN_FLIGHT {
            let (f, rx) = forward();
            assert!(a.enqueue(&lane("held"), f).is_some(), "a free slot sends");
            waiting.push(rx);
        }
        let (f, _rx) = forward();
        assert!(
            a.enqueue(&lane("held"), f).is_none(),
            "the lane is full: it waits"
        );
        assert_eq!(a.in_flight("http://b:9000"), IN_FLIGHT);
        let (f, _rx) = forward();
        assert_eq!(
            a.enqueue(&lane("other"), f).map(|b| b.len()),
            Some(1),
            "another product of the same owner goes at once"
        );
    }

    #[test]
    fn a_lane_whose_senders_die_hands_its_waiting_orders_back_to_be_placed_here() {
        let a = peers("http://a:9000");
        let key = ("http://b:9000".to_string(), "p".to_string());
        let (f, _sent) = forward();
        let _batch = a.enqueue(&key, f).expect("a slot");
        let (f, mut waiting) = forward();
        for _ in 1..IN_FLIGHT {
            let (g, _) = forward();
            let _ = a.enqueue(&key, g);
        }
        let _ = a.enqueue(&key, f);
        // Every sender dies (its slot dropped while held, as in a panic).
        for _ in 0..IN_FLIGHT {
            drop(Slot {
                peers: &a,
                key: &key,
                held: true,
            });
        }
        assert!(
            matches!(waiting.try_recv(), Ok(None)),
            "placed here: never sent"
        );
        assert_eq!(a.in_flight("http://b:9000"), 0);
    }
}
