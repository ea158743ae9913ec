//! Carts: several products, all or nothing, placed in batches.
//!
//! The carts that arrive while a batch runs form the next one (`CartQueue`): one primary
//! transaction and one commit for all of them (`seat`). It locks the carts' products' rows
//! in `product_id` order (the lock order every transaction here shares), so carts never
//! deadlock with each other or with the single-product batches. Each product's units are
//! taken by ONE guarded UPDATE for the carts that fit; a cart with a short line takes nothing
//! and its key is claimed by a `refused` row, so the 409 is final for the key — the same rule
//! as single-product orders. The rows are held only for the batch's claim statement and its
//! commit, so a hot product's batch waits at most that long. Some carts are placed alone
//! ([`place`]), in a transaction of their own, with the same statement.

use super::drops::{self, Refusal};
use super::error::CheckoutError;
use super::gate_cache::GateCache;
use super::idempotency::{existing_under, judge_held};
use super::order::{Placed, with_lines};
use super::stock;
use super::tx::Locked;
use super::tx::commit;
use crate::batching::{BATCH_LIMIT, answer, gather};
use crate::domain::{Allocation, IdempotencyKey, Lines, Locations, ProductId, UserId};
use crate::metrics::Metrics;
use crate::routing::Db;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

use super::stock::CartClaim;
use std::collections::{HashMap, HashSet};

/// A cart order as the boundary parsed it.
#[derive(Debug, Clone)]
pub struct CartRequest {
    pub user: UserId,
    pub lines: Lines,
    pub key: IdempotencyKey,
    /// Where it may take from (empty: every active location).
    pub locations: Locations,
}

impl CartRequest {
    /// What "the same body" means for a cart: its lines, in product order, and the locations
    /// it names (none: as before locations).
    pub(crate) fn fingerprint(&self) -> String {
        format!(
            "cart:{}{}",
            self.lines.fingerprint(),
            self.locations.fingerprint()
        )
    }
}

/// What the request's key already holds, judged (`None`: the key is free), with a cart
/// order's lines.
async fn held(
    conn: &mut sqlx::PgConnection,
    req: &CartRequest,
) -> Result<Option<Placed>, CheckoutError> {
    let key = (req.user.as_str().to_string(), req.key.as_str().to_string());
    let found = existing_under(&mut *conn, &[&key.0], &[&key.1]).await?;
    match judge_held(&req.fingerprint(), found.get(&key))? {
        None => Ok(None),
        Some(order) => Ok(Some(Placed::Replayed(with_lines(conn, order).await?))),
    }
}

/// Places a cart alone: all lines or none, in a transaction of its own.
pub async fn place(db: &Db, req: &CartRequest) -> Result<Placed, CheckoutError> {
    let mut tx = db.primary().begin().await?;
    match held(&mut tx, req).await {
        Ok(None) => {}
        answer => {
            tx.rollback().await?;
            return answer?.ok_or(CheckoutError::OutcomeUnknown);
        }
    }
    let Some((locked, verdict, allocations)) =
        drops::lock_and_judge_one(&mut tx, (&req.user, req.lines.get(), &req.locations), false)
            .await?
    else {
        tx.rollback().await?;
        return Err(CheckoutError::ProductNotFound);
    };
    let refusal = match verdict.refusal() {
        Ok(refusal) => refusal,
        Err(not_started) => {
            // Nothing is claimed before the sale: the key may be sent again once it is on.
            tx.rollback().await?;
            return Err(not_started);
        }
    };
    let claim = claim_of(req, &locked, refusal.as_ref().map(|(r, _)| r), allocations);
    let claimed = stock::claim_carts(&mut tx, &[claim]).await?;
    let Some(order) = claimed.orders.into_iter().next() else {
        // A concurrent request with this key committed first: answer as it did.
        tx.rollback().await?;
        let mut conn = db.primary().pool()?.acquire().await?;
        return held(&mut conn, req)
            .await?
            .ok_or(CheckoutError::OutcomeUnknown);
    };
    if !claimed.guards_held {
        // Cannot happen while we hold the rows; if it did, nothing may commit.
        tx.rollback().await?;
        return Err(CheckoutError::OutcomeUnknown);
    }
    commit(tx).await?;
    match refusal {
        Some((_, answer)) => Err(answer),
        None => Ok(Placed::Created(order)),
    }
}

/// A cart's claim on its key: confirmed at the locked prices, or refused (no lines).
fn claim_of<'a>(
    req: &'a CartRequest,
    locked: &Locked,
    refusal: Option<&'a Refusal>,
    allocations: Vec<Allocation>,
) -> CartClaim<'a> {
    let lines = match refusal {
        Some(_) => vec![],
        None => req
            .lines
            .get()
            .iter()
            .map(|(p, q)| (p.as_str(), q.get(), locked[p.as_str()].price))
            .collect(),
    };
    CartClaim {
        order_id: super::order::new_row_id(),
        user: req.user.as_str(),
        key: req.key.as_str(),
        fingerprint: req.fingerprint(),
        refusal,
        total: if refusal.is_some() {
            0
        } else {
            total(req, locked)
        },
        lines,
        allocations: match refusal {
            Some(_) => vec![],
            None => allocations,
        },
    }
}

/// A cart's answer from a batch; `None`: it is placed alone after the batch ([`place`]).
type Fate = Option<Result<Placed, CheckoutError>>;

/// Places several carts (in arrival order) as one transaction with one commit ([`seat`]); the
/// carts the batch leaves to themselves, and all of them if the batch fails before its commit
/// (then nothing of it was written), are placed alone.
pub async fn place_many(db: &Db, reqs: &[CartRequest]) -> Vec<Result<Placed, CheckoutError>> {
    if let [req] = reqs {
        return vec![place(db, req).await];
    }
    let fates = seat(db, reqs).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, carts = reqs.len(), "a batch of carts failed before its commit (nothing written); placing them one by one");
        reqs.iter().map(|_| None).collect()
    });
    futures::future::join_all(reqs.iter().zip(fates).map(|(req, fate)| async move {
        match fate {
            Some(fate) => fate,
            None => place(db, req).await,
        }
    }))
    .await
}

/// One transaction for a batch of carts. It reads what their keys hold (one statement),
/// locks every product they name in lock order (one statement), judges the carts in arrival
/// order against what the earlier ones left (the drop rules: [`drops::lock_and_judge`]), and
/// claims every key with its order or refusal, its lines and its units in one statement
/// ([`stock::claim_carts`]), then commits once. Left to be placed alone (`None`): a repeat of
/// an earlier cart's key in the batch (it is judged against what that cart wrote), a cart
/// with a per-customer limit (its allowance counts the user's other orders, which this batch
/// may be writing), and a cart whose key another request claimed first.
async fn seat(db: &Db, reqs: &[CartRequest]) -> Result<Vec<Fate>, CheckoutError> {
    let mut fates: Vec<Fate> = reqs.iter().map(|_| None).collect();
    let mut tx = db.primary().begin().await?;
    let open = free_keys(&mut tx, reqs, &mut fates).await?;
    let (locked, judged) = judge(&mut tx, reqs, &open, &mut fates).await?;
    if judged.is_empty() {
        tx.rollback().await?;
        return Ok(fates);
    }
    let claims: Vec<CartClaim<'_>> = judged
        .iter()
        .map(|(i, refusal, allocations)| {
            claim_of(
                &reqs[*i],
                &locked,
                refusal.as_ref().map(|(r, _)| r),
                allocations.clone(),
            )
        })
        .collect();
    let claimed = stock::claim_carts(&mut tx, &claims).await?;
    if !claimed.guards_held {
        // Cannot happen while we hold the rows; if it did, nothing may commit.
        tx.rollback().await?;
        return Err(CheckoutError::OutcomeUnknown);
    }
    if claimed.orders.len() < claims.len() {
        // A cart's key was claimed concurrently: it takes nothing, yet the carts after it were
        // judged against its units. Nothing of the batch may stand on that; each is placed
        // alone, against the stock as it is.
        tx.rollback().await?;
        return Ok(fates);
    }
    let mut orders: HashMap<_, _> = claimed
        .orders
        .into_iter()
        .map(|o| (o.order_id, o))
        .collect();
    let committed = commit(tx).await;
    for ((i, refusal, _), claim) in judged.iter().zip(&claims) {
        let Some(order) = orders.remove(&claim.order_id) else {
            continue;
        };
        fates[*i] = Some(match (&committed, refusal) {
            (Err(unknown), _) => Err(unknown.clone()),
            (Ok(()), Some((_, answer))) => Err(answer.clone()),
            (Ok(()), None) => Ok(Placed::Created(order)),
        });
    }
    Ok(fates)
}

/// The batch's carts whose keys are free (each key's first cart only), in arrival order; a
/// key that holds something is answered from it (`fates`).
async fn free_keys(
    tx: &mut stock::Tx,
    reqs: &[CartRequest],
    fates: &mut [Fate],
) -> Result<Vec<usize>, CheckoutError> {
    let (users, keys): (Vec<&str>, Vec<&str>) = reqs
        .iter()
        .map(|r| (r.user.as_str(), r.key.as_str()))
        .unzip();
    let found = existing_under(&mut **tx, &users, &keys).await?;
    let mut first = HashSet::new();
    let mut open = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        if !first.insert((users[i], keys[i])) {
            continue;
        }
        let key = (users[i].to_string(), keys[i].to_string());
        fates[i] = match judge_held(&r.fingerprint(), found.get(&key)) {
            Ok(None) => {
                open.push(i);
                continue;
            }
            Ok(Some(order)) => Some(Ok(Placed::Replayed(with_lines(&mut **tx, order).await?))),
            Err(answer) => Some(Err(answer)),
        };
    }
    Ok(open)
}

/// A cart's verdict in its batch: take its lines (`None`) from where its allocations say, or
/// claim its key with this refusal and give this answer.
type Judged = (usize, Option<(Refusal, CheckoutError)>, Vec<Allocation>);

/// Locks every product the `open` carts name, in lock order, and judges each cart in arrival
/// order against what the earlier ones that fit left, in one statement
/// ([`drops::lock_and_judge`]). A cart with an unknown product is answered (`fates`); one not
/// yet on sale too (nothing claimed); one with a limited product is left to be placed alone
/// (its allowance counts the user's other orders, which this batch may be writing).
async fn judge(
    tx: &mut stock::Tx,
    reqs: &[CartRequest],
    open: &[usize],
    fates: &mut [Fate],
) -> Result<(Locked, Vec<Judged>), CheckoutError> {
    if open.is_empty() {
        return Ok((Locked::new(), vec![]));
    }
    let carts: Vec<drops::Lines<'_>> = open
        .iter()
        .map(|&i| (&reqs[i].user, reqs[i].lines.get(), &reqs[i].locations))
        .collect();
    let drops::Judged {
        locked,
        verdicts,
        allocations,
    } = drops::lock_and_judge(tx, &carts, false, true).await?;
    let mut judged = Vec::with_capacity(open.len());
    for ((&i, verdict), allocations) in open.iter().zip(verdicts).zip(allocations) {
        let lines = reqs[i].lines.get();
        if lines.iter().any(|(p, _)| !locked.contains_key(p.as_str())) {
            fates[i] = Some(Err(CheckoutError::ProductNotFound));
            continue;
        }
        if lines
            .iter()
            .any(|(p, _)| locked[p.as_str()].limit.is_some())
        {
            continue;
        }
        match verdict.refusal() {
            Err(not_started) => fates[i] = Some(Err(not_started)),
            Ok(refusal) => judged.push((i, refusal, allocations)),
        }
    }
    Ok((locked, judged))
}

type Queued = (CartRequest, oneshot::Sender<Result<Placed, CheckoutError>>);

/// The most carts one transaction carries.
const MAX_CARTS: usize = 256;

/// The carts waiting for the next batch. A queued cart belongs to its batch, not to the
/// request that sent it: a client that hangs up leaves the whole cart or none.
pub(crate) struct CartQueue {
    tx: mpsc::UnboundedSender<Queued>,
    metrics: Metrics,
}

impl CartQueue {
    pub(crate) fn start(db: Db, metrics: Metrics, cache: Arc<GateCache>) -> CartQueue {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(dispatch(db, metrics.clone(), cache, rx));
        CartQueue { tx, metrics }
    }

    /// The cart's answer from the batch it joins. A batch whose task died may have committed:
    /// that is [`CheckoutError::OutcomeUnknown`], and the same key tells.
    pub(crate) async fn place(&self, req: CartRequest) -> Result<Placed, CheckoutError> {
        let (reply, slot) = oneshot::channel();
        // Counted before it can be taken, so the gauge never reads below zero.
        self.metrics.cart_queue_depth.inc();
        if self.tx.send((req, reply)).is_err() {
            self.metrics.cart_queue_depth.dec();
            return Err(CheckoutError::OutcomeUnknown);
        }
        answer(slot, Err(CheckoutError::OutcomeUnknown)).await
    }
}

/// Takes every cart queued when the last batch is done (up to [`MAX_CARTS`]) as the next batch
/// ([`place_many`]), one batch at a time: a batch locks most of the products it names, so a
/// second one in flight only waited for the first's locks, and two or three in flight sold
/// fewer carts than one, side by side (bench/results/carts-2026-12-03.md). Each batch runs in
/// a task of its own, so a panic ends only that batch (its carts are told "unknown") and not
/// the queue. A batch that waits on a row lock (an import's, another instance's) holds up the
/// carts behind it, for at most the database's lock timeout.
async fn dispatch(
    db: Db,
    metrics: Metrics,
    cache: Arc<GateCache>,
    mut rx: mpsc::UnboundedReceiver<Queued>,
) {
    while let Some(first) = rx.recv().await {
        let batch = gather(first, &mut rx, MAX_CARTS, Duration::ZERO, |_| 1).await;
        metrics.cart_queue_depth.sub(batch.len() as i64);
        let (db, metrics, cache) = (db.clone(), metrics.clone(), cache.clone());
        let (placed, done) = oneshot::channel::<()>();
        tokio::spawn(async move {
            metrics.order_transactions.inc();
            let (reqs, replies): (Vec<CartRequest>, Vec<_>) = batch.into_iter().unzip();
            // A batch stuck on a silent link would hold up every cart behind it.
            let fates = tokio::time::timeout(BATCH_LIMIT, place_many(&db, &reqs))
                .await
                .unwrap_or_else(|_| {
                    tracing::warn!(
                        carts = reqs.len(),
                        "a batch of carts got no answer in time; its outcome is unknown"
                    );
                    reqs.iter()
                        .map(|_| Err(CheckoutError::OutcomeUnknown))
                        .collect()
                });
            let _ = placed.send(());
            // The gate forgets what it knew of the products the batch took: one read of the
            // primary's position for the whole batch, before any cart is answered.
            let took: HashSet<ProductId> = fates
                .iter()
                .filter_map(|f| match f {
                    Ok(Placed::Created(order)) => Some(order.products()),
                    _ => None,
                })
                .flatten()
                .collect();
            super::gate_cache::reopen(&db, &metrics, &cache, &took.into_iter().collect::<Vec<_>>())
                .await;
            for (reply, fate) in replies.into_iter().zip(fates) {
                let _ = reply.send(fate);
            }
        });
        // The next batch may start once this one's transactions are over (or its task died);
        // the gate's reopen and the answers follow on their own.
        let _ = done.await;
    }
}

/// The cart's price: every line at its product's locked price.
fn total(req: &CartRequest, locked: &Locked) -> i64 {
    req.lines
        .get()
        .iter()
        .map(|(p, q)| i64::from(locked[p.as_str()].price) * i64::from(q.get()))
        .sum()
}
