//! Holds: units taken out of availability while a buyer pays.
//!
//! Taking a hold is a cart's guarded take with a `holds` row instead of an order: the key and
//! lines written first, then rows locked in `product_id` order and ONE guarded UPDATE for
//! every line, all or nothing; a short hold keeps its key as a `refused` row so the 409 stays
//! true. Every ending is one guarded status change `held → confirmed | released | expired`
//! under the hold's row lock, in the same transaction as the stock it moves, so each happens
//! exactly once whichever request, instance or restart races it: a confirm that comes after
//! `expires_at` expires the hold itself and answers 409. Expiry runs from the database's
//! state (every instance sweeps due holds each second with `SKIP LOCKED`), so a restart loses
//! nothing and returns nothing twice.

use super::drops::{self, Refusal};
use super::error::CheckoutError;
use super::order::{Order, order_columns, with_lines};
use super::status::HoldStatus;
use super::stock;
use super::tx::commit;
use crate::domain::{
    Allocation, HoldTtl, IdempotencyKey, Lines, Locations, ProductId, Quantity, UserId,
};
use crate::routing::Db;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::stock::Tx;

/// A hold as the boundary parsed it.
#[derive(Debug, Clone)]
pub struct HoldRequest {
    pub user: UserId,
    pub lines: Lines,
    pub ttl: HoldTtl,
    pub key: IdempotencyKey,
    /// Where it may take from (empty: every active location).
    pub locations: Locations,
}

impl HoldRequest {
    fn fingerprint(&self) -> String {
        format!(
            "hold:{}:{}{}",
            self.ttl.secs(),
            self.lines.fingerprint(),
            self.locations.fingerprint()
        )
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Hold {
    pub hold_id: Uuid,
    #[schema(value_type = String)]
    pub user_id: UserId,
    /// `held`, `confirmed` (with `order_id`), `released` or `expired`.
    #[schema(value_type = String, pattern = "^(held|confirmed|released|expired)$")]
    pub status: HoldStatus,
    pub expires_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_id: Option<Uuid>,
    #[sqlx(skip)]
    pub lines: Vec<HoldLine>,
    /// Where its units came from (and go back to, or stay as the order's).
    #[sqlx(json)]
    pub allocations: Vec<Allocation>,
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct HoldLine {
    #[schema(value_type = String)]
    pub product_id: ProductId,
    #[schema(value_type = i32, minimum = 1, maximum = 10000)]
    pub quantity: Quantity,
}

impl Hold {
    /// The products of its lines.
    pub(crate) fn products(&self) -> Vec<ProductId> {
        self.lines.iter().map(|l| l.product_id.clone()).collect()
    }

    /// The hold [`take`] just wrote.
    fn taken(
        hold_id: Uuid,
        req: &HoldRequest,
        expires_at: DateTime<Utc>,
        allocations: Vec<Allocation>,
    ) -> Hold {
        Hold {
            hold_id,
            user_id: req.user.clone(),
            status: HoldStatus::Held,
            expires_at,
            order_id: None,
            lines: req
                .lines
                .get()
                .iter()
                .map(|(product_id, quantity)| HoldLine {
                    product_id: product_id.clone(),
                    quantity: *quantity,
                })
                .collect(),
            allocations,
        }
    }
}

/// A hold with its lines; `lock` takes its row for an ending. A `held` hold past its
/// `expires_at` is stated as `expired`: it can no longer be confirmed.
async fn load(tx: &mut Tx, hold_id: Uuid, lock: bool) -> Result<Option<Hold>, sqlx::Error> {
    macro_rules! select {
        () => {
            "SELECT hold_id, user_id, \
             CASE WHEN status = 'held' AND expires_at <= clock_timestamp() THEN 'expired' ELSE status END AS status, \
             expires_at, order_id, allocations FROM holds WHERE hold_id = $1 AND status <> 'refused'"
        };
    }
    let sql = if lock {
        concat!(select!(), " FOR UPDATE")
    } else {
        select!()
    };
    let Some(mut hold) = sqlx::query_as::<_, Hold>(sql)
        .bind(hold_id)
        .fetch_optional(&mut **tx)
        .await?
    else {
        return Ok(None);
    };
    hold.lines = sqlx::query_as(
        "SELECT product_id, quantity FROM hold_lines WHERE hold_id = $1 ORDER BY product_id",
    )
    .bind(hold_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(Some(hold))
}

/// A hold by id (any status), from the primary.
pub async fn get(db: &Db, hold_id: Uuid) -> Result<Hold, CheckoutError> {
    let mut tx = db.primary().begin().await?;
    let hold = load(&mut tx, hold_id, false).await?;
    tx.rollback().await?;
    hold.ok_or(CheckoutError::HoldNotFound)
}

/// Takes a hold: all lines or none. `Ok((hold, true))` when taken now, `false` for a retry.
///
/// The key and the lines are written before any product row is locked, so a hot product's
/// rows are held only for the guarded UPDATE and the COMMIT: holds on one product queue for
/// two round trips each, not four.
pub async fn take(db: &Db, req: &HoldRequest) -> Result<(Hold, bool), CheckoutError> {
    let mut tx = db.primary().begin().await?;
    if let Some(answer) = replay(&mut tx, req).await? {
        tx.rollback().await?;
        return answer.map(|h| (h, false));
    }
    let hold_id = super::order::new_row_id();
    let lines = req.lines.units();
    let Some(expires_at) = claim(&mut tx, hold_id, req, &lines).await? else {
        // A concurrent request with this key committed first: answer as it did.
        tx.rollback().await?;
        return replay_committed(db, req).await;
    };
    // The hold's own lines are written already: the user's count includes them.
    let Some((_, verdict, allocations)) =
        drops::lock_and_judge_one(&mut tx, (&req.user, req.lines.get(), &req.locations), true)
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
    if let Some((refusal, answer)) = refusal {
        refuse(&mut tx, hold_id, &refusal).await?;
        commit(tx).await?;
        return Err(answer);
    }
    if !stock::take(&mut tx, &allocations).await? {
        tx.rollback().await?;
        return Err(CheckoutError::OutcomeUnknown);
    }
    sqlx::query("UPDATE holds SET allocations = $2 WHERE hold_id = $1")
        .bind(hold_id)
        .bind(sqlx::types::Json(&allocations))
        .execute(&mut *tx)
        .await?;
    commit(tx).await?;
    Ok((Hold::taken(hold_id, req, expires_at, allocations), true))
}

/// Claims the request's key with a `held` hold and its lines, in one statement (lines of a
/// product that does not exist are left out: the lock that follows finds it missing).
/// `None`: another request claimed the key first.
async fn claim(
    tx: &mut Tx,
    hold_id: Uuid,
    req: &HoldRequest,
    lines: &[(ProductId, i32)],
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH h AS (INSERT INTO holds (hold_id, user_id, idempotency_key, request_fingerprint, status, expires_at) \
                    VALUES ($1, $2, $3, $4, 'held', clock_timestamp() + make_interval(secs => $5)) \
                    ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING hold_id, expires_at), \
              lines AS (INSERT INTO hold_lines (hold_id, product_id, quantity) \
                    SELECT h.hold_id, l.product_id, l.quantity FROM h, UNNEST($6::text[], $7::int4[]) AS l(product_id, quantity) \
                    JOIN products p USING (product_id) ORDER BY l.product_id COLLATE \"C\") \
         SELECT expires_at FROM h",
    )
    .bind(hold_id)
    .bind(req.user.as_str())
    .bind(req.key.as_str())
    .bind(req.fingerprint())
    .bind(f64::from(req.ttl.secs()))
    .bind(lines.iter().map(|(p, _)| p.as_str()).collect::<Vec<&str>>())
    .bind(lines.iter().map(|(_, q)| *q).collect::<Vec<i32>>())
    .fetch_optional(&mut **tx)
    .await
}

/// The hold was refused (a line short, its user's limit, the sale over): the claimed hold
/// becomes a `refused` one without lines, with its reason, so the key's 409 stays true.
async fn refuse(tx: &mut Tx, hold_id: Uuid, refusal: &Refusal) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH gone AS (DELETE FROM hold_lines WHERE hold_id = $1) \
         UPDATE holds SET status = 'refused', refusal = $2 WHERE hold_id = $1",
    )
    .bind(hold_id)
    .bind(refusal.to_stored())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The answer of the request that claimed the key first, read after it committed.
async fn replay_committed(db: &Db, req: &HoldRequest) -> Result<(Hold, bool), CheckoutError> {
    let mut tx = db.primary().begin().await?;
    let answer = replay(&mut tx, req).await?;
    tx.rollback().await?;
    answer
        .ok_or(CheckoutError::OutcomeUnknown)?
        .map(|h| (h, false))
}

/// What the request's key already holds, if anything.
async fn replay(
    tx: &mut Tx,
    req: &HoldRequest,
) -> Result<Option<Result<Hold, CheckoutError>>, sqlx::Error> {
    type Found = (Uuid, String, HoldStatus, Option<sqlx::types::Json<Refusal>>);
    let found: Option<Found> = sqlx::query_as(
        "SELECT hold_id, request_fingerprint, status, refusal FROM holds WHERE user_id = $1 AND idempotency_key = $2",
    )
    .bind(req.user.as_str())
    .bind(req.key.as_str())
    .fetch_optional(&mut **tx)
    .await?;
    Ok(match found {
        None => None,
        Some((_, fp, _, _)) if fp != req.fingerprint() => Some(Err(CheckoutError::KeyReused)),
        Some((_, _, HoldStatus::Refused, why)) => Some(Err(Refusal::stored(why).into_error())),
        Some((id, _, _, _)) => Some(
            load(tx, id, false)
                .await?
                .ok_or(CheckoutError::HoldNotFound),
        ),
    })
}

/// What ending a hold did: the hold after it, and the products whose stock went up.
pub struct Ended<T> {
    pub value: T,
    pub returned: Vec<ProductId>,
}

/// Confirms a hold: its units become an order, exactly once. `Ok((order, true))` when
/// confirmed now, `false` when it already was. Too late: 409 `HOLD_EXPIRED` (the confirm
/// and the expiry both need the hold's row lock and `held`; the first wins) or
/// `HOLD_RELEASED`.
pub async fn confirm(db: &Db, hold_id: Uuid) -> Result<Ended<(Order, bool)>, CheckoutError> {
    let mut tx = db.primary().begin().await?;
    let hold = load(&mut tx, hold_id, true)
        .await?
        .ok_or(CheckoutError::HoldNotFound)?;
    match hold.status {
        HoldStatus::Confirmed => {
            let id = hold.order_id.ok_or(CheckoutError::OutcomeUnknown)?;
            let order = order_by_id(&mut tx, id).await?;
            tx.rollback().await?;
            Ok(Ended {
                value: (order, false),
                returned: vec![],
            })
        }
        HoldStatus::Released => Err(CheckoutError::HoldReleased),
        // Past its time: the sweep returns its units (within a second); it cannot become
        // an order any more, whoever asks first.
        HoldStatus::Expired => Err(CheckoutError::HoldExpired),
        HoldStatus::Held | HoldStatus::Refused => {
            let order = order_from(&mut tx, &hold).await?;
            sqlx::query(
                "UPDATE holds SET status = 'confirmed', order_id = $2, ended_at = clock_timestamp() \
                 WHERE hold_id = $1 AND status = 'held'",
            )
            .bind(hold_id)
            .bind(order.order_id)
            .execute(&mut *tx)
            .await?;
            commit(tx).await?;
            Ok(Ended {
                value: (order, true),
                returned: vec![],
            })
        }
    }
}

/// Releases a hold: its units go back, exactly once. Releasing again answers the hold as it
/// is; a confirmed hold is 409 `HOLD_CONFIRMED`.
pub async fn release(db: &Db, hold_id: Uuid) -> Result<Ended<Hold>, CheckoutError> {
    let mut tx = db.primary().begin().await?;
    let mut hold = load(&mut tx, hold_id, true)
        .await?
        .ok_or(CheckoutError::HoldNotFound)?;
    let returned = match hold.status {
        HoldStatus::Confirmed => return Err(CheckoutError::HoldConfirmed),
        HoldStatus::Held => {
            hold.status = HoldStatus::Released;
            end(&mut tx, &hold, HoldStatus::Released).await?
        }
        // Past its time: it ends as expired (if the sweep has not ended it yet).
        HoldStatus::Expired => end(&mut tx, &hold, HoldStatus::Expired).await?,
        HoldStatus::Released | HoldStatus::Refused => vec![],
    };
    commit(tx).await?;
    Ok(Ended {
        value: hold,
        returned,
    })
}

/// Ends a locked hold that is still `held` in the table (possibly past due): status, then
/// its units back. Returns the products whose stock went up (none if it had ended already).
async fn end(tx: &mut Tx, hold: &Hold, status: HoldStatus) -> Result<Vec<ProductId>, sqlx::Error> {
    let changed = sqlx::query(
        "UPDATE holds SET status = $2, ended_at = clock_timestamp() WHERE hold_id = $1 AND status = 'held'",
    )
    .bind(hold.hold_id)
    .bind(status)
    .execute(&mut **tx)
    .await?;
    if changed.rows_affected() == 0 {
        return Ok(vec![]);
    }
    stock::give_back(tx, &hold.allocations).await?;
    Ok(hold.products())
}

/// Returns the units of up to `limit` holds past their `expires_at`: how many holds ended,
/// and the products whose stock went up. Instances sweep at once without meeting: each
/// takes the due holds no one else has locked.
pub async fn expire_due(db: &Db, limit: i64) -> Result<(usize, Vec<ProductId>), CheckoutError> {
    let mut tx = db.primary().begin().await?;
    let due: Vec<(Uuid, sqlx::types::Json<Vec<Allocation>>)> = sqlx::query_as(
        "WITH due AS (SELECT hold_id FROM holds WHERE status = 'held' AND expires_at <= clock_timestamp() \
                      ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
         UPDATE holds h SET status = 'expired', ended_at = clock_timestamp() \
           FROM due WHERE h.hold_id = due.hold_id RETURNING h.hold_id, h.allocations",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let units: Vec<Allocation> = due.iter().flat_map(|(_, a)| a.0.clone()).collect();
    if !units.is_empty() {
        stock::give_back(&mut tx, &units).await?;
    }
    commit(tx).await?;
    let ended: Vec<Uuid> = due.iter().map(|(h, _)| *h).collect();
    let mut products: Vec<ProductId> = units.into_iter().map(|a| a.product_id).collect();
    products.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    products.dedup();
    Ok((ended.len(), products))
}

/// Units held right now, per product (the hottest first), for operators. From the live holds
/// (their partial index) to their lines by key: the lines of every hold ever taken stay in
/// `hold_lines`, and a join the planner may turn around (it did, without statistics) read all
/// of them every second, on every instance's sweeper. `OFFSET 0` keeps the lines' lookup a
/// per-hold subquery.
pub async fn units_held(db: &Db, top: i64) -> Result<Vec<(String, i64)>, CheckoutError> {
    Ok(sqlx::query_as(
        "SELECT l.product_id, SUM(l.quantity)::int8 FROM holds h \
         CROSS JOIN LATERAL (SELECT product_id, quantity FROM hold_lines WHERE hold_id = h.hold_id OFFSET 0) l \
         WHERE h.status = 'held' GROUP BY l.product_id ORDER BY 2 DESC, 1 LIMIT $1",
    )
    .bind(top)
    .fetch_all(db.primary().pool()?)
    .await?)
}

async fn order_by_id(tx: &mut Tx, order_id: Uuid) -> Result<Order, sqlx::Error> {
    let order: Order = sqlx::query_as(concat!(
        "SELECT ",
        order_columns!(),
        " FROM orders WHERE order_id = $1"
    ))
    .bind(order_id)
    .fetch_one(&mut **tx)
    .await?;
    with_lines(&mut **tx, order).await
}

/// The order a confirmed hold becomes: its lines at today's prices. Its units were taken
/// when the hold was, so no stock moves now. It claims no Idempotency-Key (migration
/// `20261202000001`): the hold's row makes the confirm happen once, and every key a client
/// may send stays the client's.
async fn order_from(tx: &mut Tx, hold: &Hold) -> Result<Order, sqlx::Error> {
    let products: Vec<&str> = hold.lines.iter().map(|l| l.product_id.as_str()).collect();
    let prices: Vec<(String, i32)> =
        sqlx::query_as("SELECT product_id, price_cents FROM products WHERE product_id = ANY($1)")
            .bind(&products)
            .fetch_all(&mut **tx)
            .await?;
    let price = |p: &str| prices.iter().find(|(id, _)| id == p).map_or(0, |(_, c)| *c);
    let total: i64 = hold
        .lines
        .iter()
        .map(|l| i64::from(price(l.product_id.as_str())) * i64::from(l.quantity.get()))
        .sum();
    let single = (hold.lines.len() == 1).then(|| &hold.lines[0]);
    let order_id = super::order::new_row_id();
    sqlx::query(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, allocations) \
         VALUES ($1, $2, $3, $4, $5, $6, 'confirmed', NULL, NULL, $7)",
    )
    .bind(order_id)
    .bind(single.map(|l| l.product_id.as_str()))
    .bind(hold.user_id.as_str())
    .bind(single.map(|l| l.quantity.get()))
    .bind(single.map_or(0, |l| price(l.product_id.as_str())))
    .bind(total)
    .bind(sqlx::types::Json(&hold.allocations))
    .execute(&mut **tx)
    .await?;
    if single.is_none() {
        // The lines at the prices read above by key (the total's): a join of `hold_lines` to
        // `products` here was planned as a hash of the whole catalogue on a deployment
        // without statistics.
        sqlx::query(
            "INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents) \
             SELECT $1, l.product_id, l.quantity, l.price \
             FROM UNNEST($2::text[], $3::int4[], $4::int4[]) AS l(product_id, quantity, price) \
             ORDER BY l.product_id COLLATE \"C\"",
        )
        .bind(order_id)
        .bind(&products)
        .bind(
            hold.lines
                .iter()
                .map(|l| l.quantity.get())
                .collect::<Vec<i32>>(),
        )
        .bind(
            hold.lines
                .iter()
                .map(|l| price(l.product_id.as_str()))
                .collect::<Vec<i32>>(),
        )
        .execute(&mut **tx)
        .await?;
    }
    order_by_id(tx, order_id).await
}
