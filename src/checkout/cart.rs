//! Carts: several products, all or nothing, in one primary transaction.
//!
//! The cart locks its products' rows in `product_id` order (the lock order every
//! transaction here shares), so carts never deadlock with each other or with the
//! single-product batches, which lock one row. If every line fits, ONE guarded UPDATE takes
//! them all and the order and its lines are inserted; if any line is short nothing is
//! taken and the key is claimed by a `refused` row, so the 409 is final for the key — the
//! same rule as single-product orders. A cart holds its rows only for its own few
//! statements, so a hot product's batch waits at most that long.

use super::drops::{self, Refusal};
use super::error::CheckoutError;
use super::idempotency::{existing_under, judge_held};
use super::order::{Order, Placed, order_columns, with_lines};
use super::status::OrderStatus;
use super::stock::{self, Short};
use super::tx::commit;
use crate::domain::{IdempotencyKey, Lines, UserId};
use crate::routing::Db;

use super::stock::{Locked, Tx};

/// A cart order as the boundary parsed it.
#[derive(Debug, Clone)]
pub struct CartRequest {
    pub user: UserId,
    pub lines: Lines,
    pub key: IdempotencyKey,
}

impl CartRequest {
    /// What "the same body" means for a cart: its lines, in product order.
    pub(crate) fn fingerprint(&self) -> String {
        format!("cart:{}", self.lines.fingerprint())
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

/// Places a cart: all lines or none.
pub async fn place(db: &Db, req: &CartRequest) -> Result<Placed, CheckoutError> {
    let mut tx = db.primary().begin().await?;
    match held(&mut tx, req).await {
        Ok(None) => {}
        answer => {
            tx.rollback().await?;
            return answer?.ok_or(CheckoutError::OutcomeUnknown);
        }
    }
    let Some(locked) = stock::lock_lines(&mut tx, req.lines.get()).await? else {
        tx.rollback().await?;
        return Err(CheckoutError::ProductNotFound);
    };
    let verdict = drops::judge_lines(&mut tx, &req.user, req.lines.get(), &locked, false).await?;
    let refusal = match verdict.refusal() {
        Ok(refusal) => refusal,
        Err(not_started) => {
            // Nothing is claimed before the sale: the key may be sent again once it is on.
            tx.rollback().await?;
            return Err(not_started);
        }
    };
    let claimed = match &refusal {
        Some((r, _)) => claim(&mut tx, req, &locked, Some(r))
            .await?
            .map(|o| (o, true)),
        None => claim_and_take(&mut tx, req, &locked).await?,
    };
    let Some((order, took)) = claimed else {
        // A concurrent request with this key committed first: answer as it did.
        tx.rollback().await?;
        let mut conn = db.primary().pool()?.acquire().await?;
        return held(&mut conn, req)
            .await?
            .ok_or(CheckoutError::OutcomeUnknown);
    };
    if let Some((_, answer)) = refusal {
        commit(tx).await?;
        return Err(answer);
    }
    if !took {
        // Cannot happen while we hold the rows; if it did, nothing may commit.
        tx.rollback().await?;
        return Err(CheckoutError::OutcomeUnknown);
    }
    commit(tx).await?;
    Ok(Placed::Created(order))
}

/// Claims the request's key with a confirmed order at the locked prices, its lines and its
/// units: [`stock::claim_and_take`], one statement. `None`: another request claimed the key
/// first; the flag: every product's guard held.
async fn claim_and_take(
    tx: &mut Tx,
    req: &CartRequest,
    locked: &Locked,
) -> Result<Option<(Order, bool)>, sqlx::Error> {
    let lines: Vec<(&str, i32, i32)> = req
        .lines
        .get()
        .iter()
        .map(|(p, q)| (p.as_str(), q.get(), locked[p.as_str()].price))
        .collect();
    let claim = stock::CartClaim {
        user: req.user.as_str(),
        key: req.key.as_str(),
        fingerprint: &req.fingerprint(),
        total: total(req, locked),
        lines: &lines,
    };
    stock::claim_and_take(tx, &claim).await
}

/// Claims the request's key with the order: `confirmed` at the locked prices when every line
/// fits, else `refused` (total 0) with its reason, so the 409 is final for the key. `None`:
/// another request claimed the key first.
async fn claim(
    tx: &mut Tx,
    req: &CartRequest,
    locked: &Locked,
    refusal: Option<&Refusal>,
) -> Result<Option<Order>, sqlx::Error> {
    let (status, total) = match refusal {
        None => (OrderStatus::Confirmed, total(req, locked)),
        Some(_) => (OrderStatus::Refused, 0),
    };
    sqlx::query_as(concat!(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, refusal) \
         VALUES ($1, NULL, $2, NULL, 0, $3, $4, $5, $6, $7) \
         ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
        order_columns!()
    ))
    .bind(super::order::new_row_id())
    .bind(req.user.as_str())
    .bind(total)
    .bind(status)
    .bind(req.key.as_str())
    .bind(req.fingerprint())
    .bind(refusal.and_then(Refusal::to_stored))
    .fetch_optional(&mut **tx)
    .await
}

/// The cart's price: every line at its product's locked price.
fn total(req: &CartRequest, locked: &Locked) -> i64 {
    req.lines
        .get()
        .iter()
        .map(|(p, q)| i64::from(locked[p.as_str()].price) * i64::from(q.get()))
        .sum()
}

/// The lines a cart would need that the stock cannot give (for a 409's `lines`).
pub fn describe(short: &[Short]) -> String {
    short
        .iter()
        .map(|s| {
            format!(
                "{} (asked {}, {} left)",
                s.product_id, s.requested, s.available
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
