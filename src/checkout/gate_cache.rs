//! The stock gate's bounded-staleness micro-cache. An availability answer is reused while
//! `now − as_of` is within the gate's 250 ms budget — the same bound a replica must meet —
//! and keeps the `as_of` of the read that produced it (the replica's state when the query
//! was sent, not when it came back), so a cached answer is exactly as honest as a replica
//! one and expires by that same `as_of`. Concurrent misses for one product share one database read
//! (single-flight). The coalescer stores the primary's post-commit stock here, which makes a
//! sold-out product answer from memory until its answer ages out, is restocked, or a cancel
//! reopens it.

use super::drops::Window;
use crate::domain::ProductId;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::routing::policy::QueryClass;
use crate::routing::route::ceil_ms;
use crate::routing::{Db, Route};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::OnceCell;

/// A gate answer: the product's stock (`None`: no such product), its sale window, and where
/// they came from.
#[derive(Debug, Clone)]
pub struct Answer {
    pub available: Option<i32>,
    pub window: Window,
    pub route: Route,
}

impl Answer {
    /// `route`'s `as_of` on the monotonic clock: what the answer expires by.
    fn as_of(&self) -> Instant {
        self.route.as_of_instant()
    }

    /// The answer as it should be stated now: same `as_of`, staleness measured afresh.
    pub fn restated(&self, now: Instant) -> Answer {
        Answer {
            available: self.available,
            window: self.window,
            route: self.route.clone().restated(now),
        }
    }
}

type Slot = Arc<OnceCell<Answer>>;

/// A product's slot, and what the answer it replaced said of the stock. A slot is empty while
/// its read is in flight, and `last_seen_short` must not forget a sold-out product meanwhile:
/// its orders would go to a batch each, instead of to the gate (issue #31's suite run: 5
/// batches for 500 orders after a sell-out, all while the gate's answer was refreshed).
struct Entry {
    slot: Slot,
    before: Option<i32>,
}

impl Entry {
    /// The stock this product's latest answer stated: the slot's, or while it is being
    /// read, the one it replaced.
    fn said(&self) -> Option<i32> {
        self.slot.get().map_or(self.before, |a| a.available)
    }
}

pub struct GateCache {
    budget: Duration,
    /// How long a reopening's floor is kept.
    keep_floors: Duration,
    // A std Mutex: held only to look up or swap a slot, never across an await. One lock for
    // both maps, so an answer from memory takes one lock.
    maps: Mutex<Maps>,
}

#[derive(Default)]
struct Maps {
    slots: HashMap<ProductId, Entry>,
    /// Each product whose stock went up here lately (restock, cancel, import, a cart or hold
    /// ending): the primary's position after the commit, which a read must have replayed, so
    /// a stale "sold out" never outlives a restock here; and when (no answer from before is
    /// used again). Dropped once well past the budget, when any replica the gate may use
    /// holds the change anyway.
    floors: HashMap<ProductId, (Lsn, Instant)>,
}

impl Default for GateCache {
    /// A cache for the stock gate, its answers' lifetimes from the gate's row of the policy.
    fn default() -> Self {
        let policy = QueryClass::StockGate.policy();
        GateCache {
            budget: policy.budget(),
            keep_floors: policy.marks_kept_for(),
            maps: Mutex::default(),
        }
    }
}

impl GateCache {
    fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh-enough answer for `product`, reading through `fetch` on a miss; `fetch` is
    /// given the position a read must have replayed (the product's floor, if it was reopened
    /// lately). Callers that miss together wait for one read. Every answer is stated at the
    /// moment it is handed out (same `as_of`, staleness measured then): a cached one is
    /// served only while that staleness is within the budget, and so is a shared read's
    /// answer to the callers that waited for it (a waiter that wakes late and finds it over
    /// budget reads again). The caller whose read it was gets it as the router stated it,
    /// measured afresh.
    pub async fn get_or_fetch<F, Fut, E>(&self, product: &ProductId, fetch: F) -> Result<Answer, E>
    where
        F: Fn(Option<Lsn>) -> Fut,
        Fut: std::future::Future<Output = Result<Answer, E>>,
    {
        /// How many shared reads a waiter takes, each found over budget when it woke,
        /// before it is given the last one as it is (stated honestly).
        const ROUNDS: usize = 3;
        let budget_ms = ceil_ms(self.budget);
        let within = |a: &Answer, now: Instant| {
            ceil_ms(now.saturating_duration_since(a.as_of())) <= budget_ms
        };
        let mut round = 0;
        loop {
            round += 1;
            let now = Self::now();
            let (slot, min_lsn) = {
                let mut maps = self.maps();
                let floor = maps.floors.get(product).copied();
                let usable =
                    |a: &Answer| within(a, now) && floor.is_none_or(|(_, at)| a.as_of() >= at);
                let slots = &mut maps.slots;
                if slots.len() > 50_000 {
                    // Bounded memory: forget expired answers.
                    let budget = self.budget;
                    slots.retain(|_, e| {
                        e.slot
                            .get()
                            .is_none_or(|a| now.saturating_duration_since(a.as_of()) <= budget)
                    });
                }
                let cached = slots.get(product).and_then(|e| e.slot.get());
                if let Some(answer) = cached.filter(|a| usable(a)) {
                    // Judged usable at `now`, and stated at that same `now`.
                    return Ok(answer.restated(now));
                }
                let slot = match slots.get(product) {
                    // A read in flight: wait for it.
                    Some(e) if e.slot.get().is_none() => e.slot.clone(),
                    old => {
                        let before = old.and_then(Entry::said);
                        let slot: Slot = Arc::default();
                        let entry = Entry {
                            slot: slot.clone(),
                            before,
                        };
                        slots.insert(product.clone(), entry);
                        slot
                    }
                };
                (slot, floor.map(|(lsn, _)| lsn))
            };
            let mut ours = false;
            let answer = slot
                .get_or_try_init(|| {
                    ours = true;
                    fetch(min_lsn)
                })
                .await?;
            let now = Self::now();
            if ours || within(answer, now) || round == ROUNDS {
                return Ok(answer.restated(now));
            }
        }
    }

    /// Now, on the clock answers are dated by (tokio's, so a test can pause it; the same
    /// instant as `std`'s otherwise).
    fn now() -> Instant {
        tokio::time::Instant::now().into_std()
    }

    /// Stores an authoritative answer (the primary's stock right after a commit), unless a
    /// newer one is already there.
    pub fn put(&self, product: &ProductId, answer: Answer) {
        let mut maps = self.maps();
        if maps
            .floors
            .get(product)
            .is_some_and(|(_, at)| answer.as_of() < *at)
        {
            return;
        }
        let slots = &mut maps.slots;
        let newer = slots
            .get(product)
            .and_then(|e| e.slot.get())
            .is_some_and(|a| a.as_of() > answer.as_of());
        if !newer {
            let entry = Entry {
                slot: Arc::new(OnceCell::new_with(Some(answer))),
                before: None,
            };
            slots.insert(product.clone(), entry);
        }
    }

    /// Whether this cache last saw `product` short of `quantity`, however long ago: its latest
    /// answer (kept while the next read is in flight, and until memory is bounded) said fewer
    /// units. Not for a product it never saw, saw with enough stock, or that was reopened since.
    pub fn last_seen_short(&self, product: &ProductId, quantity: i32) -> bool {
        self.maps()
            .slots
            .get(product)
            .and_then(Entry::said)
            .is_some_and(|available| available < quantity)
    }

    /// Forgets `product` and pins its floor at `lsn` (its stock went up here, up to that
    /// position: the next gate read must see that).
    pub fn reopen(&self, product: &ProductId, lsn: Lsn) {
        let now = Self::now();
        let mut maps = self.maps();
        maps.floors
            .retain(|_, (_, at)| now.saturating_duration_since(*at) <= self.keep_floors);
        let floor = maps.floors.entry(product.clone()).or_insert((lsn, now));
        *floor = (floor.0.max(lsn), now);
        maps.slots.remove(product);
    }
}

/// The one path every change of stock outside an order batch (restock, cancel, import,
/// cart, hold and its ending) takes after its commit: this instance's gate forgets its
/// cached answer and reads only where the change is. It cannot fail: if the primary's
/// position cannot be read, the product is read from the primary alone until the entry ages
/// out (fail safe), and that is counted. One read of the primary's position serves every
/// product the write changed.
pub(super) async fn reopen(db: &Db, metrics: &Metrics, cache: &GateCache, products: &[ProductId]) {
    if products.is_empty() {
        return;
    }
    let lsn = match db.primary().current_lsn().await {
        Ok(lsn) => lsn,
        Err(e) => {
            post_commit_failed(metrics, "reopen", &e);
            // No replica ever replays this far: the gate reads the primary.
            Lsn::MAX
        }
    };
    for product in products {
        cache.reopen(product, lsn);
    }
}

fn post_commit_failed(metrics: &Metrics, step: &str, e: &dyn std::fmt::Display) {
    metrics
        .post_commit_failures
        .with_label_values(&[step])
        .inc();
    tracing::warn!(step, error = %e, "a step after a committed write failed; failing safe");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn answer(available: i32, as_of: Instant) -> Answer {
        Answer {
            available: Some(available),
            window: Window::default(),
            route: Route::example(
                QueryClass::StockGate,
                "primary",
                chrono::Utc::now(),
                Instant::now().saturating_duration_since(as_of),
            ),
        }
    }

    #[tokio::test]
    async fn concurrent_misses_share_one_read_and_answers_expire_with_the_budget() {
        let cache = Arc::new(GateCache::default());
        let reads = Arc::new(AtomicUsize::new(0));
        let id = ProductId::parse("p").expect("valid");
        let fetch = |reads: Arc<AtomicUsize>| async move {
            reads.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, ()>(answer(7, Instant::now()))
        };
        let all = futures::future::join_all((0..20).map(|_| {
            let (cache, reads, id) = (cache.clone(), reads.clone(), id.clone());
            async move { cache.get_or_fetch(&id, |_| fetch(reads.clone())).await }
        }))
        .await;
        assert!(
            all.iter()
                .all(|a| a.as_ref().is_ok_and(|a| a.available == Some(7)))
        );
        assert_eq!(reads.load(Ordering::SeqCst), 1, "single flight");
        // An answer older than the budget is never served.
        let other = ProductId::parse("q").expect("valid");
        cache.put(
            &other,
            answer(3, Instant::now() - Duration::from_millis(300)),
        );
        let a = cache
            .get_or_fetch(&other, |_| fetch(reads.clone()))
            .await
            .expect("fetches");
        assert_eq!((a.available, reads.load(Ordering::SeqCst)), (Some(7), 2));
        assert!(a.route.stale_by() < Duration::from_millis(250));
    }

    /// A caller that waited for another's read, and whose task woke 200 ms after that read
    /// came back, must not be handed the answer as it was stated then: 200 ms of staleness
    /// would go unsaid, and a replica answer could pass the budget.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_wakes_late_gets_the_answer_restated_or_reads_again() {
        let cache = Arc::new(GateCache::default());
        let id = ProductId::parse("p").expect("valid");
        let reads = Arc::new(AtomicUsize::new(0));
        // A replica read that takes 100 ms and is as of when it was sent.
        let fetch = |reads: Arc<AtomicUsize>| async move {
            reads.fetch_add(1, Ordering::SeqCst);
            let sent = GateCache::now();
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, ()>(Answer {
                available: Some(7),
                window: Window::default(),
                route: Route::example_as_of(QueryClass::StockGate, "replica-1", sent),
            })
        };
        let fetcher = tokio::spawn({
            let (cache, id, reads) = (cache.clone(), id.clone(), reads.clone());
            async move { cache.get_or_fetch(&id, |_| fetch(reads.clone())).await }
        });
        tokio::task::yield_now().await;
        let mut waiter = Box::pin(cache.get_or_fetch(&id, |_| fetch(reads.clone())));
        assert!(
            futures::poll!(&mut waiter).is_pending(),
            "waits for the read in flight"
        );
        let first = fetcher.await.expect("joined").expect("read");
        assert_eq!(reads.load(Ordering::SeqCst), 1, "one read so far");
        assert_eq!(first.route.stale_by(), Duration::from_millis(100));
        // The waiter's task is woken, and runs 200 ms later: the shared answer is 300 ms old.
        tokio::time::advance(Duration::from_millis(200)).await;
        let late = waiter.await.expect("read");
        let stated = late.route.stale_by();
        let truth = GateCache::now().saturating_duration_since(late.route.as_of_instant());
        assert_eq!(stated, truth, "stated at hand-out");
        assert!(
            stated <= Duration::from_millis(250),
            "within the budget: {stated:?}"
        );
        assert_eq!(reads.load(Ordering::SeqCst), 2, "read again");
    }

    /// A sold-out product's expired answer is being refreshed: its orders must still be
    /// sent to the gate (which waits for the read), not to a batch each.
    #[tokio::test(start_paused = true)]
    async fn a_product_seen_sold_out_stays_short_while_its_answer_is_refreshed() {
        let cache = Arc::new(GateCache::default());
        let id = ProductId::parse("p").expect("valid");
        cache.put(&id, answer(0, GateCache::now()));
        assert!(cache.last_seen_short(&id, 1));
        tokio::time::advance(Duration::from_millis(300)).await;
        let (started, release) = (
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
        );
        let refresh = tokio::spawn({
            let (cache, id, started, release) =
                (cache.clone(), id.clone(), started.clone(), release.clone());
            async move {
                cache
                    .get_or_fetch(&id, |_| {
                        let (started, release) = (started.clone(), release.clone());
                        async move {
                            started.notify_one();
                            release.notified().await;
                            Ok::<_, ()>(answer(5, GateCache::now()))
                        }
                    })
                    .await
            }
        });
        started.notified().await;
        assert!(
            cache.last_seen_short(&id, 1),
            "short while the read is in flight"
        );
        release.notify_one();
        refresh.await.expect("joined").expect("read");
        assert!(!cache.last_seen_short(&id, 1), "the new answer says 5");
        assert!(cache.last_seen_short(&id, 6));
        cache.reopen(&id, Lsn::MAX);
        assert!(
            !cache.last_seen_short(&id, 6),
            "a reopened product is not short"
        );
    }

    #[tokio::test]
    async fn a_newer_put_wins_and_invalidate_forces_a_read() {
        let cache = GateCache::default();
        let id = ProductId::parse("p").expect("valid");
        let now = Instant::now();
        cache.put(&id, answer(5, now));
        cache.put(&id, answer(9, now - Duration::from_millis(10)));
        let a = cache
            .get_or_fetch(&id, |_| async { Err::<Answer, ()>(()) })
            .await
            .expect("cached");
        assert_eq!(a.available, Some(5));
        cache.reopen(&id, Lsn::MAX);
        assert!(
            cache
                .get_or_fetch(&id, |_| async { Err::<Answer, ()>(()) })
                .await
                .is_err()
        );
    }
}
