//! Where a run's fresh product keeps its stock: all at `default`, as before locations
//! existed (`--locations 1`), or spread over N locations the run creates for itself.
//!
//! A run's locations are `loc-<UTC timestamp>-<6 hex>-<i>`, so runs never share one. They
//! are ranked 10, 11, 12, … in the order they are created: all before `default` (100), and
//! the first — which gets the remainder of the spread — is tried first by a request that
//! names no locations. Locations are never deleted, so each such run leaves N behind.
//! (The values only: `modes::create_locations` creates a run's locations through the API.)

use serde::Serialize;

/// The rank of a run's first location; the i-th is `FIRST_RANK + i`.
pub const FIRST_RANK: u32 = 10;

/// The most locations one request may name (the contract's 1–50), and so the most a run
/// spreads its stock over.
pub const MAX_LOCATIONS: u32 = 50;

/// Units a run gives one location of a fresh product.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StockAt {
    pub location_id: String,
    pub quantity: u32,
}

/// A fresh product's stock, as the run gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stock {
    /// All of it at `default`, sent as `available_quantity` (the body of before locations).
    Default(u32),
    /// One entry per location, sent as `stock`.
    At(Vec<StockAt>),
}

impl Stock {
    /// `total` spread over `locations` as evenly as possible, the remainder to the first;
    /// no locations: all at `default`.
    pub fn spread(total: u32, locations: &[String]) -> Self {
        if locations.is_empty() {
            return Self::Default(total);
        }
        let n = locations.len() as u32;
        let at = locations
            .iter()
            .enumerate()
            .map(|(i, id)| StockAt {
                location_id: id.clone(),
                quantity: total / n + if i == 0 { total % n } else { 0 },
            })
            .collect();
        Self::At(at)
    }

    /// What each of the run's own locations was given; `None` at `default` alone, where the
    /// product's total books are its only books.
    pub fn at(&self) -> Option<&[StockAt]> {
        match self {
            Self::Default(_) => None,
            Self::At(at) => Some(at),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantities(total: u32, n: usize) -> Vec<u32> {
        let ids: Vec<String> = (0..n).map(|i| format!("l{i}")).collect();
        match Stock::spread(total, &ids) {
            Stock::At(at) => at.iter().map(|s| s.quantity).collect(),
            Stock::Default(_) => Vec::new(),
        }
    }

    #[test]
    fn stock_is_spread_evenly_with_the_remainder_to_the_first() {
        assert_eq!(quantities(61, 3), [21, 20, 20]);
        assert_eq!(quantities(60, 3), [20, 20, 20]);
        // Less stock than locations: some are given nothing.
        assert_eq!(quantities(2, 3), [2, 0, 0]);
        assert_eq!(Stock::spread(7, &[]), Stock::Default(7));
        assert_eq!(Stock::spread(7, &[]).at(), None);
    }
}
