//! Flash drops: a product's per-customer limit and its sale window, decided on the primary in
//! the transaction that takes the stock (the contract's "Flash drops").
//!
//! Single-product orders are judged inside the order batch's statement
//! (`take_order_batch_v2`, migration `20261202000005_flash_drops.sql`); carts and holds are
//! judged here ([`judge_lines`]) once their product rows are locked. Both count a user's
//! units with the one SQL function `customer_units`, which is exact for a caller holding the
//! product's row lock, because every take and return of the product's units locks that row
//! first. Neither ever reads a replica.
//!
//! The order of judgement is the same everywhere, so no path turns one answer into another:
//! the window first (before the start nothing is claimed and the key may be sent again; from
//! the end the key is refused for good), then stock (what the stock gate's early "no" says),
//! then the limit.

use super::error::CheckoutError;
use super::stock::{Locked, Short, Tx, shortfalls};
use crate::domain::{ProductId, Quantity, UserId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

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

/// Judges `lines` (each product once) against their `locked` rows: the window, then stock,
/// then each limited product's allowance for `user`. `counted` are units of these lines that
/// `customer_units` already sees (a hold's own lines, written before the lock), subtracted
/// from the user's count.
pub(crate) async fn judge_lines(
    tx: &mut Tx,
    user: &UserId,
    lines: &[(ProductId, Quantity)],
    locked: &Locked,
    counted: bool,
) -> Result<Verdict, sqlx::Error> {
    let not_started = lines
        .iter()
        .filter_map(|(p, _)| locked.get(p.as_str())?.starts_in_ms)
        .max();
    if let Some(ms) = not_started {
        return Ok(Verdict::NotStarted { retry_after_ms: ms });
    }
    if lines
        .iter()
        .any(|(p, _)| locked.get(p.as_str()).is_some_and(|r| r.ended))
    {
        return Ok(Verdict::Refused(Refusal::SaleEnded));
    }
    let short = shortfalls(lines, locked);
    if !short.is_empty() {
        return Ok(Verdict::Short(short));
    }
    let limited: Vec<(&ProductId, i32, i32)> = lines
        .iter()
        .filter_map(|(p, q)| Some((p, q.get(), locked.get(p.as_str())?.limit?)))
        .collect();
    if limited.is_empty() {
        return Ok(Verdict::Fits);
    }
    let products: Vec<&str> = limited.iter().map(|(p, _, _)| p.as_str()).collect();
    let users: Vec<&str> = limited.iter().map(|_| user.as_str()).collect();
    let units: HashMap<String, i64> = sqlx::query_as(
        "SELECT product_id, units::int8 FROM customer_units($1::text[], $2::text[])",
    )
    .bind(&products)
    .bind(&users)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .collect();
    for (product, qty, limit) in limited {
        let seen = units.get(product.as_str()).copied().unwrap_or(0);
        let already = if counted { seen - i64::from(qty) } else { seen };
        if already + i64::from(qty) > i64::from(limit) {
            return Ok(Verdict::Refused(Refusal::LimitExceeded {
                product_id: product.to_string(),
                limit,
                already: i32::try_from(already.max(0)).unwrap_or(i32::MAX),
            }));
        }
    }
    Ok(Verdict::Fits)
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
