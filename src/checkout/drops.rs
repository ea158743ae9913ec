//! Flash drops: a product's per-customer limit and its sale window, decided on the primary in
//! the transaction that takes the stock (the contract's "Flash drops").
//!
//! The rules are judged in ONE place, the SQL function `drop_verdict_v1` (migration
//! `20261205000002_locations.sql`): the order batch statement calls it for each request,
//! the refusal claim for the window, and carts and holds through `lines_verdicts_v3`
//! ([`lock_and_judge`]) in the statement that locks their product rows. A user's units are counted by
//! `customer_units_v2`, exact for a caller holding the product's row lock, because every take
//! and return of the product's units locks that row first. Nothing here ever reads a replica;
//! Rust only maps the verdict to its answer ([`Verdict::refusal`]).
//!
//! The order of judgement is the same everywhere, so no path turns one answer into another:
//! the window first (before the start nothing is claimed and the key may be sent again; from
//! the end the key is refused for good), then stock (what the stock gate's early "no" says),
//! then the limit.

use super::error::CheckoutError;
use super::error::Short;
use super::tx::{Locked, LockedRow, Tx};
use crate::domain::{Allocation, Locations, ProductId, Quantity, UserId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// A product's drop rules as its page states them (`null` when unset).
#[derive(Debug, Clone, Default, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Rules {
    /// The most units one user may hold of the product (its confirmed orders and live holds).
    #[schema(minimum = 1, maximum = 10000)]
    pub max_per_customer: Option<i32>,
    /// Orders, carts and holds before this moment (the primary's clock) are 409 `SALE_NOT_STARTED`.
    pub sale_starts_at: Option<DateTime<Utc>>,
    /// From this moment they are 409 `SALE_ENDED`.
    pub sale_ends_at: Option<DateTime<Utc>>,
}

/// The columns of [`Rules`], for queries that read a product.
macro_rules! rule_columns {
    () => {
        "max_per_customer, sale_starts_at, sale_ends_at"
    };
}
pub(crate) use rule_columns;

/// A product's sale window (either end open when unset).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    pub starts: Option<DateTime<Utc>>,
    pub ends: Option<DateTime<Utc>>,
}

impl Window {
    /// On sale at `now`: at or after the start, before the end.
    pub fn on_sale(&self, now: DateTime<Utc>) -> bool {
        self.starts.is_none_or(|s| s <= now) && self.ends.is_none_or(|e| now < e)
    }
}

/// Why a key was refused, as stored with its `refused` row (`orders.refusal`,
/// `holds.refusal`; NULL there is [`Refusal::OutOfStock`]), so a retry is told the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "code", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Refusal {
    OutOfStock,
    LimitExceeded {
        product_id: String,
        limit: i32,
        already: i32,
    },
    SaleEnded,
}

impl Refusal {
    /// The refusal a stored row states (`None`: a refusal for stock).
    pub(crate) fn stored(row: Option<sqlx::types::Json<Refusal>>) -> Refusal {
        row.map_or(Refusal::OutOfStock, |j| j.0)
    }

    /// The answer for a key this refusal holds.
    pub(crate) fn into_error(self) -> CheckoutError {
        match self {
            Refusal::OutOfStock => CheckoutError::OutOfStock,
            Refusal::LimitExceeded {
                product_id,
                limit,
                already,
            } => CheckoutError::LimitExceeded {
                product_id,
                limit,
                already,
            },
            Refusal::SaleEnded => CheckoutError::SaleEnded,
        }
    }

    /// As stored: `None` for stock (the column's NULL), JSON otherwise.
    pub(crate) fn to_stored(&self) -> Option<sqlx::types::Json<&Refusal>> {
        (*self != Refusal::OutOfStock).then_some(sqlx::types::Json(self))
    }
}

/// What a cart's or hold's lines get from their locked products.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Every line may be taken.
    Fits,
    /// A product is not on sale yet: nothing may be written, the key stays free.
    NotStarted { retry_after_ms: i64 },
    /// Lines short of stock: the key is refused for stock, naming them.
    Short(Vec<Short>),
    /// The key is refused for good, for this reason.
    Refused(Refusal),
}

impl Verdict {
    /// What `drop_verdict_v1` stated (`None`: the request may be taken).
    fn stated(v: Option<serde_json::Value>) -> Result<Verdict, serde_json::Error> {
        let Some(v) = v else {
            return Ok(Verdict::Fits);
        };
        Ok(match v["code"].as_str() {
            Some("SALE_NOT_STARTED") => Verdict::NotStarted {
                retry_after_ms: serde_json::from_value(v["retry_after_ms"].clone())?,
            },
            Some("OUT_OF_STOCK") => Verdict::Short(serde_json::from_value(v["lines"].clone())?),
            _ => Verdict::Refused(serde_json::from_value(v)?),
        })
    }

    /// What a cart or hold does with its verdict: `Ok(None)` take the lines;
    /// `Ok(Some((refusal, answer)))` claim the key with the refusal and give the answer;
    /// `Err(SALE_NOT_STARTED)` roll back, so nothing is claimed.
    pub(crate) fn refusal(self) -> Result<Option<(Refusal, CheckoutError)>, CheckoutError> {
        match self {
            Verdict::Fits => Ok(None),
            Verdict::NotStarted { retry_after_ms } => {
                Err(CheckoutError::SaleNotStarted { retry_after_ms })
            }
            Verdict::Short(short) => Ok(Some((Refusal::OutOfStock, CheckoutError::Short(short)))),
            Verdict::Refused(r) => Ok(Some((r.clone(), r.into_error()))),
        }
    }
}

/// A cart's (or a hold's) user, lines (each product once) and the locations it may take from.
pub(crate) type Lines<'a> = (&'a UserId, &'a [(ProductId, Quantity)], &'a Locations);

/// What locking a cart's (or several carts', or a hold's) products and judging them found.
pub(crate) struct Judged {
    /// The products' rows, locked (a product that does not exist is absent).
    pub locked: Locked,
    /// Each cart's verdict, in order. A cart naming an unknown product, or (in a batch) a
    /// limited one, is not judged: [`Verdict::Fits`] here means nothing for it.
    pub verdicts: Vec<Verdict>,
    /// Where each cart that fits takes its units from (`allocate_v1`, against what the carts
    /// before it took); empty for any other.
    pub allocations: Vec<Vec<Allocation>>,
}

/// A row of `lines_verdicts_v3`: (cart, verdict, product, price, limit, allocations).
type JudgedRow = (
    Option<i32>,
    Option<sqlx::types::Json<serde_json::Value>>,
    Option<String>,
    Option<i32>,
    Option<i32>,
    Option<sqlx::types::Json<Vec<Allocation>>>,
);

/// Locks every product `carts` name, in lock order, and judges each cart against the rows in
/// the same statement (one round trip): `lines_verdicts_v3` locks them, then judges each cart
/// with `drop_verdict_v1` (the one home of the drop rules) against the stock the carts before
/// it that fit left, and allocates each that fits (`allocate_v1`). `counted`: the user's count
/// already includes these lines (a hold's own lines, written before the lock). `batch`: a cart
/// with a limited product is left out (it is placed alone).
pub(crate) async fn lock_and_judge(
    tx: &mut Tx,
    carts: &[Lines<'_>],
    counted: bool,
    batch: bool,
) -> Result<Judged, sqlx::Error> {
    let mut users = Vec::with_capacity(carts.len());
    let mut ends = Vec::with_capacity(carts.len());
    let (mut products, mut qty) = (vec![], vec![]);
    let (mut locs, mut loc_ends) = (vec![], vec![]);
    for (user, lines, locations) in carts {
        users.push(user.as_str());
        for (p, q) in *lines {
            products.push(p.as_str());
            qty.push(q.get());
        }
        ends.push(i32::try_from(products.len()).unwrap_or(i32::MAX));
        locs.extend(locations.get().iter().map(|l| l.as_str()));
        loc_ends.push(i32::try_from(locs.len()).unwrap_or(i32::MAX));
    }
    let rows: Vec<JudgedRow> = sqlx::query_as(
        "SELECT cart, verdict, product_id, price_cents, max_per_customer, allocations \
         FROM lines_verdicts_v3($1, $2, $3, $4, $5, $6, $7, $8) ORDER BY cart NULLS FIRST",
    )
    .bind(&users)
    .bind(&ends)
    .bind(&products)
    .bind(&qty)
    .bind(counted)
    .bind(batch)
    .bind(&locs)
    .bind(&loc_ends)
    .fetch_all(&mut **tx)
    .await?;
    judged(rows, carts.len())
}

/// [`lock_and_judge`]'s rows: the locked products first (`cart` NULL), then each cart's
/// verdict and allocations, in order.
fn judged(rows: Vec<JudgedRow>, carts: usize) -> Result<Judged, sqlx::Error> {
    let mut locked = Locked::new();
    let mut stated = Vec::with_capacity(carts);
    let mut allocations = Vec::with_capacity(carts);
    for (cart, verdict, product, price, limit, allocated) in rows {
        match (cart, product, price) {
            (None, Some(product), Some(price)) => {
                locked.insert(product, LockedRow { price, limit });
            }
            (Some(_), _, _) => {
                stated.push(verdict);
                allocations.push(allocated.map(|a| a.0).unwrap_or_default());
            }
            _ => {
                return Err(sqlx::Error::Protocol(
                    "a row neither a product nor a cart".into(),
                ));
            }
        }
    }
    if stated.len() != carts {
        return Err(sqlx::Error::Protocol(format!(
            "{} verdicts for {} carts",
            stated.len(),
            carts
        )));
    }
    let verdicts = stated
        .into_iter()
        .map(|v| Verdict::stated(v.map(|j| j.0)))
        .collect::<Result<_, _>>()
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    Ok(Judged {
        locked,
        verdicts,
        allocations,
    })
}

/// [`lock_and_judge`] for one cart or hold: its locked rows and its verdict, or `None` when
/// one of its products does not exist.
pub(crate) async fn lock_and_judge_one(
    tx: &mut Tx,
    cart: Lines<'_>,
    counted: bool,
) -> Result<Option<(Locked, Verdict, Vec<Allocation>)>, sqlx::Error> {
    let Judged {
        locked,
        mut verdicts,
        mut allocations,
    } = lock_and_judge(tx, &[cart], counted, false).await?;
    if cart.1.iter().any(|(p, _)| !locked.contains_key(p.as_str())) {
        return Ok(None);
    }
    let verdict = verdicts
        .pop()
        .ok_or_else(|| sqlx::Error::Protocol("no verdict".into()))?;
    Ok(Some((
        locked,
        verdict,
        allocations.pop().unwrap_or_default(),
    )))
}

/// `Retry-After` seconds for a sale that starts in `ms` (at least 1).
pub fn retry_after_secs(ms: i64) -> u64 {
    u64::try_from(ms.max(1)).unwrap_or(1).div_ceil(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_is_open_from_its_start_and_closed_from_its_end() {
        let t = |s: i64| DateTime::from_timestamp(s, 0).expect("valid");
        let w = Window {
            starts: Some(t(100)),
            ends: Some(t(200)),
        };
        assert!(!w.on_sale(t(99)));
        assert!(w.on_sale(t(100)));
        assert!(w.on_sale(t(199)));
        assert!(!w.on_sale(t(200)));
        assert!(Window::default().on_sale(t(0)));
    }

    #[test]
    fn a_stored_refusal_round_trips_and_null_is_out_of_stock() {
        let r = Refusal::LimitExceeded {
            product_id: "p".into(),
            limit: 2,
            already: 2,
        };
        let json = serde_json::to_value(&r).expect("serializes");
        assert_eq!(json["code"], "LIMIT_EXCEEDED");
        assert_eq!(json["already"], 2);
        let back: Refusal = serde_json::from_value(json).expect("parses");
        assert_eq!(back, r);
        assert_eq!(Refusal::stored(None), Refusal::OutOfStock);
        assert!(Refusal::OutOfStock.to_stored().is_none());
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }
}
