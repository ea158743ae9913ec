//! One import batch on the primary: create the new products, restate the changed ones by
//! the import rule ([`restate`]), all through [`crate::checkout::stock`].

use super::csv::Row;
use crate::checkout::stock::{self, Tx};
use crate::domain::ProductId;
use crate::routing::Db;
use std::collections::{HashMap, HashSet};

/// What a stated count does to a product that exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restated {
    pub available: i32,
    /// More was sold than the lowered count leaves: the stock stopped at 0.
    pub clamped: bool,
}

/// A stated count that would take a product's stock past what the column holds.
#[derive(Debug, thiserror::Error)]
#[error(
    "product {product}: stock would exceed 2147483647 ({available} + {file} stated − {stated} stated before)"
)]
pub struct StockLimit {
    pub product: ProductId,
    pub available: i32,
    pub stated: i32,
    pub file: i32,
}

/// The import rule. A product holding `available` units, last given `stated`, is now stated
/// at `file`: it keeps what happened since (`available − stated`: sales, cancels, restocks)
/// on top of the new count, and never goes below 0.
pub fn restate(available: i32, stated: i32, file: i32) -> Option<Restated> {
    let wanted = i64::from(available) + i64::from(file) - i64::from(stated);
    let available = i32::try_from(wanted.max(0)).ok()?;
    Some(Restated {
        available,
        clamped: wanted < 0,
    })
}

/// What one batch did.
#[derive(Debug, Default)]
pub(super) struct Applied {
    pub(super) created: u64,
    pub(super) changed: u64,
    pub(super) unchanged: u64,
    pub(super) clamped: Vec<ProductId>,
    /// Existing products whose stock went up: the gate must hear of them.
    pub(super) raised: Vec<ProductId>,
}

/// One batch, one transaction: create the new products, then restate the existing ones
/// whose stated count, name or price differ. Unchanged rows are neither written nor
/// locked, so a re-run of the same file writes (and replicates) nothing.
pub(super) async fn write_batch(db: &Db, rows: &[Row]) -> anyhow::Result<Applied> {
    // Every writer that locks many products takes them in product_id order, so two imports
    // (or an import and a cart) cannot deadlock on each other.
    let mut rows: Vec<&Row> = rows.iter().collect();
    rows.sort_unstable_by(|a, b| a.product_id.as_str().cmp(b.product_id.as_str()));
    let mut tx = db.primary().begin().await?;
    let created = insert_new(&mut tx, &rows).await?;
    let existing: Vec<&Row> = rows
        .into_iter()
        .filter(|r| !created.contains(r.product_id.as_str()))
        .collect();
    let differing = lock_differing(&mut tx, &existing).await?;
    let by_id: HashMap<&str, &Row> = existing
        .iter()
        .map(|r| (r.product_id.as_str(), *r))
        .collect();
    let mut applied = Applied {
        created: created.len() as u64,
        changed: differing.len() as u64,
        unchanged: (existing.len() - differing.len()) as u64,
        ..Applied::default()
    };
    let mut updates = Vec::with_capacity(differing.len());
    for (id, available, stated) in differing {
        let Some(&row) = by_id.get(id.as_str()) else {
            continue;
        };
        let file = row.available_quantity;
        let restated = restate(available, stated, file).ok_or_else(|| StockLimit {
            product: row.product_id.clone(),
            available,
            stated,
            file,
        })?;
        if restated.clamped {
            applied.clamped.push(row.product_id.clone());
        }
        if restated.available > available {
            applied.raised.push(row.product_id.clone());
        }
        updates.push((row, restated.available, restated.available - available));
    }
    update_restated(&mut tx, &updates).await?;
    tx.commit().await?;
    Ok(applied)
}

/// Inserts the rows whose product does not exist yet (stock and stated count: the file's)
/// and returns their ids. Existing products are left to [`lock_differing`].
async fn insert_new(tx: &mut Tx, rows: &[&Row]) -> sqlx::Result<HashSet<String>> {
    let (ids, names, prices, counts) = columns(rows.iter().map(|r| (*r, r.available_quantity)));
    Ok(stock::create_many(tx, &ids, &names, &prices, &counts, None)
        .await?
        .into_iter()
        .collect())
}

/// Locks the existing products whose stated count, name or price differ from the file
/// ([`stock::lock_differing`]): `(product_id, available_quantity, stated_quantity)` under
/// the lock.
async fn lock_differing(tx: &mut Tx, rows: &[&Row]) -> sqlx::Result<Vec<(String, i32, i32)>> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, names, prices, stated) = columns(rows.iter().map(|r| (*r, r.available_quantity)));
    stock::lock_differing(tx, &ids, &names, &prices, &stated).await
}

/// Writes the restated rows: name, price, the new stock (and how far it moved), and the
/// file's count as the stated one.
async fn update_restated(tx: &mut Tx, updates: &[(&Row, i32, i32)]) -> sqlx::Result<()> {
    if updates.is_empty() {
        return Ok(());
    }
    let (ids, names, prices, _) = columns(updates.iter().map(|&(r, s, _)| (r, s)));
    let deltas: Vec<i32> = updates.iter().map(|&(_, _, d)| d).collect();
    let stated: Vec<i32> = updates
        .iter()
        .map(|(r, _, _)| r.available_quantity)
        .collect();
    stock::restate(tx, &ids, &names, &prices, &deltas, &stated, None).await
}

/// The id, name and price columns of `rows`, and a count for each.
fn columns<'a>(
    rows: impl Iterator<Item = (&'a Row, i32)>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<i32>, Vec<i32>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (r, n) in rows {
        out.0.push(r.product_id.as_str());
        out.1.push(r.name.as_str());
        out.2.push(r.price_cents);
        out.3.push(n);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_re_run_of_the_same_count_keeps_every_sale() {
        // Imported 10, sold 3: the same file states 10 again.
        assert_eq!(
            restate(7, 10, 10),
            Some(Restated {
                available: 7,
                clamped: false
            })
        );
    }

    #[test]
    fn a_recount_moves_stock_by_the_difference_and_keeps_restocks() {
        // Stated 10, sold 3, restocked 4 (11 on hand); the recount says 15: +5 on top.
        assert_eq!(restate(11, 10, 15).map(|r| r.available), Some(16));
        // Lowered from 10 to 8 with 3 sold: 5 left.
        assert_eq!(restate(7, 10, 8).map(|r| r.available), Some(5));
    }

    #[test]
    fn a_count_lowered_below_what_was_sold_stops_at_zero_and_says_so() {
        // Stated 10, sold 8 (2 left); the file now says 5: 2 - 5 would be -3.
        assert_eq!(
            restate(2, 10, 5),
            Some(Restated {
                available: 0,
                clamped: true
            })
        );
        // Exactly zero is not a clamp.
        assert_eq!(restate(2, 10, 8).map(|r| r.clamped), Some(false));
    }

    #[test]
    fn a_count_past_the_column_is_refused_not_wrapped() {
        assert_eq!(restate(i32::MAX - 1, 0, 2), None);
        assert_eq!(
            restate(i32::MAX, i32::MAX, i32::MAX).map(|r| r.available),
            Some(i32::MAX)
        );
    }
}
