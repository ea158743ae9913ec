//! Units per buyer against the product's `max_per_customer`: who got how many, who got more
//! than the limit, and which LIMIT_EXCEEDED answers cannot be true.

use super::sections::confirmed_units;
use crate::samples::{OrderOutcome, OrderSample};
use serde::Serialize;
use std::collections::HashMap;

/// Units one buyer got beyond the product's `max_per_customer` (none without a limit).
/// Anything above 0 is a broken promise, like overselling the stock.
pub fn over_limit(buyer_units: u64, max_per_customer: Option<u32>) -> u64 {
    max_per_customer.map_or(0, |limit| buyer_units.saturating_sub(u64::from(limit)))
}

/// What one buyer's orders came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuyerUnits {
    /// Units of its confirmed orders (confirmed orders × their quantity).
    pub units: u64,
    /// Some order of its ended without a known outcome (timeout, 503, ...): it may hold
    /// more units than we saw confirmed.
    pub unknown: bool,
}

/// Per buyer (by number), the units its confirmed orders took; every buyer with an order
/// is there, also one that got nothing.
pub fn units_per_buyer(orders: &[OrderSample]) -> HashMap<u64, BuyerUnits> {
    let mut by: HashMap<u64, BuyerUnits> = HashMap::new();
    for o in orders {
        let b = by.entry(o.buyer).or_default();
        b.units += confirmed_units(o);
        b.unknown |= matches!(o.outcome, OrderOutcome::Failed(_));
    }
    by
}

/// Whether a 409 LIMIT_EXCEEDED saying `limit` and `already` to a buyer who ended with
/// `buyer` cannot be true for a product limited to `max_per_customer` and orders of `qty`:
/// the product has no limit or another one; the request would have fit (`already + qty`
/// within the limit); or the buyer is said to have had more units than all its confirmed
/// orders (with every outcome known — units only grow, nothing is cancelled).
pub fn false_limit_refusal(
    limit: u32,
    already: u32,
    qty: u32,
    buyer: BuyerUnits,
    max_per_customer: Option<u32>,
) -> bool {
    max_per_customer != Some(limit)
        || u64::from(already) + u64::from(qty) <= u64::from(limit)
        || (!buyer.unknown && u64::from(already) > buyer.units)
}

/// What the buyers got one by one, against the product's `max_per_customer`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PerBuyer {
    pub attempts_per_buyer: u32,
    /// The product's limit; `None`: the run gave it none.
    pub max_per_customer: Option<u32>,
    /// The most units any single buyer got (its confirmed orders × qty).
    pub max_units_one_buyer: u64,
    /// A buyer that got that many (the lowest-numbered), when any got a unit.
    pub top_buyer: Option<String>,
    /// Buyers that got at least one unit.
    pub buyers_with_units: u64,
    /// Buyers given more than the limit, and the units beyond it in all. Must be 0.
    pub buyers_over_limit: u64,
    pub units_over_limit: u64,
    /// 409 LIMIT_EXCEEDED answers that cannot be true (see [`false_limit_refusal`]). Must be 0.
    pub false_limit_refusals: u64,
}

impl PerBuyer {
    pub fn of(orders: &[OrderSample], spec: &crate::samples::SaleSpec) -> Self {
        let limit = spec.max_per_customer;
        let by = units_per_buyer(orders);
        let mut p = Self {
            attempts_per_buyer: spec.attempts_per_buyer,
            max_per_customer: limit,
            ..Self::default()
        };
        for b in by.values() {
            p.buyers_with_units += u64::from(b.units > 0);
            let over = over_limit(b.units, limit);
            if over > 0 {
                p.buyers_over_limit += 1;
                p.units_over_limit += over;
            }
        }
        let top = by
            .iter()
            .filter(|(_, b)| b.units > 0)
            .max_by_key(|&(&n, b)| (b.units, std::cmp::Reverse(n)));
        if let Some((n, b)) = top {
            p.max_units_one_buyer = b.units;
            p.top_buyer = Some(format!("buyer-{n}"));
        }
        p.false_limit_refusals = orders
            .iter()
            .filter(|o| match o.outcome {
                OrderOutcome::LimitExceeded { limit: l, already } => {
                    let b = by.get(&o.buyer).copied().unwrap_or_default();
                    false_limit_refusal(l, already, spec.qty, b, limit)
                }
                _ => false,
            })
            .count() as u64;
        p
    }

    /// Whether the report shows a per-buyer section: a limit, or buyers trying again.
    pub fn shown(&self) -> bool {
        self.max_per_customer.is_some() || self.attempts_per_buyer > 1
    }

    /// "2 (limit 2)", "3 (no limit)".
    pub fn most_to_one_buyer(&self) -> String {
        match self.max_per_customer {
            Some(l) => format!("{} (limit {l})", self.max_units_one_buyer),
            None => format!("{} (no limit)", self.max_units_one_buyer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::sale::fixtures::{buyer_order, limited};

    #[test]
    fn over_limit_is_units_beyond_the_limit_and_nothing_without_one() {
        assert_eq!(over_limit(2, Some(2)), 0);
        assert_eq!(over_limit(1, Some(2)), 0);
        assert_eq!(over_limit(3, Some(2)), 1);
        assert_eq!(over_limit(0, Some(1)), 0);
        assert_eq!(over_limit(1_000, None), 0);
    }

    #[test]
    fn units_are_tallied_per_buyer_with_unknown_outcomes_marked() {
        let two = OrderOutcome::Confirmed { quantity: 2 };
        let orders = vec![
            buyer_order(1, 1_000, two.clone()),
            buyer_order(1, 2_000, two),
            buyer_order(1, 3_000, limited(4, 4)),
            buyer_order(2, 1_500, OrderOutcome::OutOfStock),
            buyer_order(3, 1_600, OrderOutcome::Confirmed { quantity: 1 }),
            buyer_order(3, 1_700, OrderOutcome::Failed("timeout".into())),
        ];
        let by = units_per_buyer(&orders);
        assert_eq!(by.len(), 3);
        let (units, unknown) = (by[&1].units, by[&1].unknown);
        assert_eq!((units, unknown), (4, false));
        assert_eq!(by[&2], BuyerUnits::default());
        let (units, unknown) = (by[&3].units, by[&3].unknown);
        assert_eq!((units, unknown), (1, true));
    }

    #[test]
    fn a_limit_refusal_must_fit_the_limit_and_what_the_buyer_got() {
        let got = |units| BuyerUnits {
            units,
            unknown: false,
        };
        // Limit 2, two units already, one more would pass it: true.
        assert!(!false_limit_refusal(2, 2, 1, got(2), Some(2)));
        // qty 2 on top of one unit passes a limit of 2 too.
        assert!(!false_limit_refusal(2, 1, 2, got(1), Some(2)));
        // The request would have fit.
        assert!(false_limit_refusal(2, 1, 1, got(1), Some(2)));
        // Not the product's limit, or no limit at all.
        assert!(false_limit_refusal(3, 3, 1, got(3), Some(2)));
        assert!(false_limit_refusal(2, 2, 1, got(2), None));
        // Said to have 2 units, but every order of the buyer is known and only 1 confirmed...
        assert!(false_limit_refusal(2, 2, 1, got(1), Some(2)));
        // ...unless an order's outcome is unknown: it may have been confirmed.
        let unsure = BuyerUnits {
            units: 1,
            unknown: true,
        };
        assert!(!false_limit_refusal(2, 2, 1, unsure, Some(2)));
    }
}
