//! Idempotency: what a user's key already holds, and what a request with that key is
//! answered. One key type (a user's key, as stored), one lookup for any number of keys, and
//! one rule (`judge_held`): the same body gets the same answer (the order again, or the
//! refusal again), another body 422, and a free key nothing. Orders, carts, holds and
//! refusals all ask here.

use super::drops::Refusal;
use super::error::CheckoutError;
use super::order::{Order, OrderRequest, Placed, at, order_columns};
use super::status::OrderStatus;
use crate::routing::Db;
use sqlx::postgres::PgRow;
use std::collections::HashMap;

/// A user's idempotency key as stored: `(user_id, idempotency_key)`.
pub(crate) type Key = (String, String);

/// What each key already holds.
pub(crate) type Held = HashMap<Key, Existing>;

/// `req`'s key, owned.
pub(crate) fn key_of(req: &OrderRequest) -> Key {
    (req.user.as_str().to_string(), req.key.as_str().to_string())
}

/// An order or refusal found under a user's idempotency key, with the body it was placed with.
#[derive(Debug, Clone)]
pub(crate) struct Existing {
    pub(super) idempotency_key: String,
    pub(super) request_fingerprint: String,
    /// A refusal's reason (`None` for stock, and for orders).
    pub(super) refusal: Option<sqlx::types::Json<Refusal>>,
    pub(super) order: Order,
}

impl<'r> sqlx::FromRow<'r, PgRow> for Existing {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        use sqlx::{Column, Row};
        Existing::read(row, row.try_column("idempotency_key")?.ordinal())
    }
}

impl Existing {
    /// What a key holds, from `row`'s columns `idempotency_key, request_fingerprint, refusal`
    /// and then [`order_columns!`], the first at column `first`, read by place ([`at`]).
    pub(crate) fn read(row: &PgRow, first: usize) -> Result<Self, sqlx::Error> {
        Ok(Existing {
            idempotency_key: at(row, first, "idempotency_key")?,
            request_fingerprint: at(row, first + 1, "request_fingerprint")?,
            refusal: at(row, first + 2, "refusal")?,
            order: Order::read(row, first + 3)?,
        })
    }

    /// The key it is held under.
    pub(crate) fn key(&self) -> Key {
        (self.order.user_id.to_string(), self.idempotency_key.clone())
    }
}

/// Orders and refusals already recorded under any of `reqs`' (user, key) pairs, whatever
/// their product, by (user, key). One indexed query however many requests.
pub(crate) async fn existing_for<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    reqs: &[&OrderRequest],
) -> Result<Held, sqlx::Error> {
    let (users, keys): (Vec<&str>, Vec<&str>) = reqs.iter().map(|r| r.key_pair()).unzip();
    existing_under(exec, &users, &keys).await
}

/// What each (user, key) pair already holds, whatever the request's shape (order, cart): the
/// `keys_held` function (migration `20261203000001`), whose plan probes the key index whether
/// or not `orders` has statistics.
pub(crate) async fn existing_under<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    users: &[&str],
    keys: &[&str],
) -> Result<Held, sqlx::Error> {
    let found: Vec<Existing> = sqlx::query_as(concat!(
        "SELECT idempotency_key, request_fingerprint, refusal, ",
        order_columns!(),
        " FROM keys_held($1, $2)"
    ))
    .bind(users)
    .bind(keys)
    .fetch_all(exec)
    .await?;
    Ok(found.into_iter().map(|e| (e.key(), e)).collect())
}

/// The answer a body gets from what its key already holds: the order again for the same
/// body, the refusal again for a refused key, 422 for another body. `None`: the key is free.
pub(crate) fn judge_held(
    fingerprint: &str,
    found: Option<&Existing>,
) -> Result<Option<Order>, CheckoutError> {
    match found {
        None => Ok(None),
        Some(e) if e.request_fingerprint != fingerprint => Err(CheckoutError::KeyReused),
        Some(e) if e.order.status == OrderStatus::Refused => {
            Err(Refusal::stored(e.refusal.clone()).into_error())
        }
        Some(e) => Ok(Some(e.order.clone().complete())),
    }
}

/// [`judge_held`] for a single-product order.
pub(crate) fn judge(
    req: &OrderRequest,
    found: Option<&Existing>,
) -> Result<Option<Placed>, CheckoutError> {
    Ok(judge_held(&req.fingerprint(), found)?.map(Placed::Replayed))
}

/// The key's answer read from the primary, for a key that must hold something (it made
/// our insert conflict). Finding nothing there cannot happen — rows are never deleted —
/// but if it did, the honest answer is "unknown, retry".
pub(crate) async fn decided_on_primary(
    db: &Db,
    req: &OrderRequest,
) -> Result<Placed, CheckoutError> {
    let found = existing_for(db.primary().pool()?, &[req]).await?;
    judge(req, found.get(&key_of(req)))?.ok_or(CheckoutError::OutcomeUnknown)
}
