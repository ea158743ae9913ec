//! The stock gate's "no", made final: before a request is told 409, its (user, key) is
//! claimed on the primary with a `refused` row. If the key already holds something — an
//! order committed by a batch here or on another instance, an earlier refusal, a different
//! body — the claim conflicts and the request gets what the key holds instead. Once the
//! refusal commits, no order for that key can commit anywhere (its insert would conflict),
//! so the 409 stays true whatever happens to an original still queued, and the retry needs
//! neither Redis nor a replica to learn the truth.
//!
//! After a sell-out every buyer passes through here, so the claims that queue up while one
//! statement runs go together: one `INSERT … ON CONFLICT DO NOTHING` for all of them, in
//! (user, key) order like the order batches, and one indexed read for the keys that were
//! taken.

use super::drops::Refusal;
use super::error::CheckoutError;
use super::idempotency::{decided_on_primary, existing_for, judge, key_of};
use super::order::{OrderRequest, Placed};
use crate::batching::{answer, gather};
use crate::metrics::Metrics;
use crate::routing::{Db, DbError, Internal, is_connection_error};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tokio::sync::{Semaphore, mpsc, oneshot};
use uuid::Uuid;

type Reply = oneshot::Sender<Result<Placed, CheckoutError>>;

/// The most claims one statement takes.
const MAX_BATCH: usize = 512;

/// Statements in flight at once; while they run, new claims queue up for the next one.
const IN_FLIGHT: usize = 4;

/// The longest a claim statement may take before its requests are told "unknown".
const STATEMENT_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Clone)]
pub struct Refusals {
    tx: mpsc::UnboundedSender<(OrderRequest, Reply)>,
}

impl Refusals {
    pub fn start(db: Db, metrics: Metrics) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(worker(db, metrics, rx));
        Refusals { tx }
    }

    /// Refuses `req` for want of stock (or as the sale window says), unless its key already
    /// holds an answer: that answer.
    pub async fn refuse(&self, req: OrderRequest) -> Result<Placed, CheckoutError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send((req, reply))
            .map_err(|_| DbError::Internal(Internal::WorkerGone("refusal worker")))?;
        // Dropped only if the claim's task died mid-statement: it may have committed.
        answer(rx, Err(CheckoutError::OutcomeUnknown)).await
    }
}

async fn worker(db: Db, metrics: Metrics, mut rx: mpsc::UnboundedReceiver<(OrderRequest, Reply)>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let batch = gather(first, &mut rx, MAX_BATCH, std::time::Duration::ZERO, |_| 1).await;
        let db = db.clone();
        metrics.refusal_statements.inc();
        tokio::spawn(async move {
            let _permit = permit;
            let reqs: Vec<&OrderRequest> = batch.iter().map(|(r, _)| r).collect();
            let answers = claim(&db, &reqs).await;
            for ((_, reply), answer) in batch.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        });
    }
}

/// Claims every free key among `reqs` with a refusal; an answer per request.
async fn claim(db: &Db, reqs: &[&OrderRequest]) -> Vec<Result<Placed, CheckoutError>> {
    let Claims {
        claimed,
        not_started,
    } = match insert(db, reqs).await {
        Ok(claims) => claims,
        Err(e) => return reqs.iter().map(|_| Err(e.clone())).collect(),
    };
    // The first request of each claimed key is refused; every other one reads its key.
    let mut first_seen: HashSet<(&str, &str)> = HashSet::new();
    let refused: Vec<Option<&Refusal>> = reqs
        .iter()
        .map(|r| {
            claimed
                .get(&r.key_pair())
                .filter(|_| first_seen.insert(r.key_pair()))
        })
        .collect();
    let rest: Vec<&OrderRequest> = reqs
        .iter()
        .zip(&refused)
        .filter(|(_, refused)| refused.is_none())
        .map(|(r, _)| *r)
        .collect();
    let held = match db.primary().pool() {
        Ok(pool) if !rest.is_empty() => {
            existing_for(pool, &rest).await.map_err(CheckoutError::from)
        }
        Ok(_) => Ok(HashMap::new()),
        Err(e) => Err(e.into()),
    };
    let mut answers = Vec::with_capacity(reqs.len());
    for (r, refused) in reqs.iter().zip(refused) {
        answers.push(match (&held, refused) {
            (_, Some(why)) => Err(why.clone().into_error()),
            (Ok(held), None) => {
                let key = key_of(r);
                match judge(r, held.get(&key)) {
                    Ok(Some(placed)) => Ok(placed),
                    // Before the start nothing was claimed: the key stays free.
                    Ok(None) => match not_started.get(r.product.as_str()) {
                        Some(&retry_after_ms) => {
                            Err(CheckoutError::SaleNotStarted { retry_after_ms })
                        }
                        None => decided_on_primary(db, r).await,
                    },
                    Err(e) => Err(e),
                }
            }
            (Err(e), None) => Err(e.clone()),
        });
    }
    answers
}

/// What one claim statement did: the keys it refused (and why), and the products that were
/// not on sale yet (ms to their start), whose keys it left free.
struct Claims<'r> {
    claimed: HashMap<(&'r str, &'r str), Refusal>,
    not_started: HashMap<String, i64>,
}

/// A claimed key `(user, Some(key), refusal, None)`, or a product not on sale yet
/// `(product, None, None, Some(ms to its start))`.
type ClaimRow = (
    String,
    Option<String>,
    Option<sqlx::types::Json<Refusal>>,
    Option<i64>,
);

/// The claim statement of [`insert`]: each request judged by `drop_verdict_v1` (the one home
/// of the drop rules) on the primary's clock, with nothing left for it (the stock gate found
/// too little), then a refusal for every key of a product on sale: `SALE_ENDED` past its end,
/// else for stock. Before a product's start nothing is claimed and its rows say when.
const CLAIM: &str = "WITH w AS (SELECT p.product_id, p.sale_starts_at, p.sale_ends_at \
                      FROM products p WHERE p.product_id = ANY($2::text[])), \
              v AS (SELECT o.*, drop_verdict_v1(clock_timestamp(), ARRAY[o.product_id], ARRAY[o.quantity], ARRAY[0], \
                                                ARRAY[NULL::int4], ARRAY[w.sale_starts_at], ARRAY[w.sale_ends_at], \
                                                ARRAY[NULL::int8]) AS verdict \
                      FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int4[], $5::text[], $6::text[]) \
                           WITH ORDINALITY AS o(order_id, product_id, user_id, quantity, idempotency_key, fingerprint, n) \
                      LEFT JOIN w ON w.product_id = o.product_id), \
              ins AS (INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, refusal) \
                      SELECT v.order_id, v.product_id, v.user_id, v.quantity, 0, 0, 'refused', v.idempotency_key, v.fingerprint, \
                             CASE WHEN v.verdict->>'code' <> 'OUT_OF_STOCK' THEN v.verdict END \
                      FROM v WHERE v.verdict->>'code' <> 'SALE_NOT_STARTED' \
                      ORDER BY v.n \
                      ON CONFLICT (user_id, idempotency_key) DO NOTHING \
                      RETURNING user_id, idempotency_key, refusal) \
         SELECT user_id, idempotency_key, refusal, NULL::int8 FROM ins \
         UNION ALL SELECT DISTINCT ON (product_id) product_id, NULL, NULL, (verdict->>'retry_after_ms')::int8 \
                   FROM v WHERE v.verdict->>'code' = 'SALE_NOT_STARTED'";

fn claim_failed(e: sqlx::Error) -> CheckoutError {
    if matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) {
        // Never sent: nothing was written.
        CheckoutError::from(e)
    } else if is_connection_error(&e) {
        // The statement may have committed before the connection went.
        CheckoutError::OutcomeUnknown
    } else {
        CheckoutError::from(e)
    }
}

/// One statement inserting a `refused` row for each distinct key, in (user, key) order, on
/// the primary's clock: before a product's sale starts its keys are left free (the answer is
/// `SALE_NOT_STARTED`), from its end they are refused as `SALE_ENDED`, else for stock (the
/// order of judgement of [`super::drops`]). It commits on its own, so a connection lost
/// during it leaves its outcome unknown.
async fn insert<'r>(db: &Db, reqs: &[&'r OrderRequest]) -> Result<Claims<'r>, CheckoutError> {
    let mut distinct: Vec<&OrderRequest> = Vec::with_capacity(reqs.len());
    let mut seen = HashSet::new();
    for r in reqs {
        if seen.insert(r.key_pair()) {
            distinct.push(r);
        }
    }
    distinct.sort_by(|a, b| a.key_pair().cmp(&b.key_pair()));
    let ids: Vec<Uuid> = distinct
        .iter()
        .map(|_| super::order::new_row_id())
        .collect();
    let products: Vec<&str> = distinct.iter().map(|r| r.product.as_str()).collect();
    let users: Vec<&str> = distinct.iter().map(|r| r.user.as_str()).collect();
    let keys: Vec<&str> = distinct.iter().map(|r| r.key.as_str()).collect();
    let qty: Vec<i32> = distinct.iter().map(|r| r.quantity.get()).collect();
    let fps: Vec<String> = distinct.iter().map(|r| r.fingerprint()).collect();
    let pool = db.primary().pool()?;
    let statement = sqlx::query_as::<_, ClaimRow>(CLAIM)
        .bind(&ids)
        .bind(&products)
        .bind(&users)
        .bind(&qty)
        .bind(&keys)
        .bind(&fps)
        .fetch_all(pool);
    // A silent link must not hold every buyer of a sold-out product: past the limit the
    // statement's outcome is unknown.
    let rows: Vec<ClaimRow> = tokio::time::timeout(STATEMENT_LIMIT, statement)
        .await
        .map_err(|_| CheckoutError::OutcomeUnknown)?
        .map_err(claim_failed)?;
    let mut refused: HashMap<(String, String), Refusal> = HashMap::new();
    let mut not_started = HashMap::new();
    for (who, key, why, starts_in) in rows {
        match (key, starts_in) {
            (Some(key), _) => {
                refused.insert((who, key), Refusal::stored(why));
            }
            (None, Some(ms)) => {
                not_started.insert(who, ms);
            }
            (None, None) => {}
        }
    }
    let claimed = distinct
        .iter()
        .filter_map(|r| {
            let (u, k) = r.key_pair();
            let why = refused.remove(&(u.to_string(), k.to_string()))?;
            Some(((u, k), why))
        })
        .collect();
    Ok(Claims {
        claimed,
        not_started,
    })
}

/// Deletes up to `limit` order refusals and up to `limit` hold refusals (keys claimed by a
/// 409; a refused hold has no lines) older than `window`, the oldest first, skipping rows
/// another instance's purge has locked: their keys may be used anew (the contract's
/// idempotency window). Confirmed and cancelled orders and live or ended holds are never
/// touched, and no product row is locked (deleting a row that references a product takes no
/// lock on it). One statement, committed on its own: a crash loses nothing but the rest of
/// the purge. Returns how many of each went.
///
/// The cutoff is `now()` (the statement's start), not `clock_timestamp()`: a volatile bound
/// cannot be an index condition, and the purge then walked the whole `orders_refused_by_age`
/// index every second, filtering every refusal younger than the window (1.7 s a statement at
/// 1.2 M refusals, found by `bench/soak.sh`); with a stable bound the index scan starts and
/// ends at the cutoff.
pub(crate) async fn purge(
    db: &Db,
    window: std::time::Duration,
    limit: i64,
) -> Result<(i64, i64), DbError> {
    Ok(sqlx::query_as(
        "WITH o AS (DELETE FROM orders WHERE order_id IN ( \
                      SELECT order_id FROM orders \
                      WHERE status = 'refused' AND created_at < now() - make_interval(secs => $1) \
                      ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING 1), \
              h AS (DELETE FROM holds WHERE hold_id IN ( \
                      SELECT hold_id FROM holds \
                      WHERE status = 'refused' AND created_at < now() - make_interval(secs => $1) \
                      ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING 1) \
         SELECT (SELECT count(*) FROM o), (SELECT count(*) FROM h)",
    )
    .bind(window.as_secs_f64())
    .bind(limit)
    .fetch_one(db.primary().pool()?)
    .await?)
}
