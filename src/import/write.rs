//! One import batch on the primary: create the new products, restate the levels whose
//! stated count differs (and the products whose name or price does) by the import rule
//! ([`restate`]), each (product, location) on its own, all through
//! [`crate::checkout::stock::import`].

use super::csv::{DEFAULT_LOCATION, Row};
use crate::checkout::stock::Tx;
use crate::checkout::stock::import::{self as stock, FileLevels, LevelChanges, ProductChanges};
use crate::domain::{LocationId, ProductId};
use crate::routing::Db;
use std::collections::HashSet;
use uuid::Uuid;

/// What a stated count does to a product that exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restated {
    pub available: i32,
    /// More was sold than the lowered count leaves: the stock stopped at 0.
    pub clamped: bool,
}

/// A stated count that would take a level's stock past what the column holds.
#[derive(Debug, thiserror::Error)]
#[error(
    "product {product} at {location}: stock would exceed 2147483647 ({available} + {file} stated − {stated} stated before)"
)]
pub struct StockLimit {
    pub product: ProductId,
    pub location: LocationId,
    pub available: i32,
    pub stated: i32,
    pub file: i32,
}

/// The import rule, for one (product, location). A level holding `available` units, last
/// given `stated` (at creation or by an import; a level never given a count: `available`),
/// is now stated at `file`: it keeps what happened there since (`available − stated`: sales,
/// cancels, restocks, transfers) on top of the new count, and never goes below 0.
pub fn restate(available: i32, stated: i32, file: i32) -> Option<Restated> {
    let wanted = i64::from(available) + i64::from(file) - i64::from(stated);
    let available = i32::try_from(wanted.max(0)).ok()?;
    Some(Restated {
        available,
        clamped: wanted < 0,
    })
}

/// What one batch did, counted in (product, location) rows.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// Rows of products new to stockgate.
    pub(super) created: u64,
    /// Rows whose level's stated count, or whose product's name or price, differed.
    pub(super) changed: u64,
    pub(super) unchanged: u64,
    /// The clamped rows: `product` at `default`, `product@location` elsewhere.
    pub(super) clamped: Vec<String>,
    /// Existing products whose stock went up: the gate must hear of them.
    pub(super) raised: Vec<ProductId>,
}

/// One batch, one transaction: create the new products, lock the existing ones with a level
/// or a name or price that differs, open the missing levels, read the levels under the locks,
/// apply the rule, and write the changed levels and products in one statement. Unchanged
/// rows are neither written nor locked, so a re-run of the same file writes (and replicates)
/// nothing. `import` is the movements' `ref`.
pub(super) async fn write_batch(db: &Db, rows: &[Row], import: Uuid) -> anyhow::Result<Applied> {
    // Every writer that locks many products takes them in product_id order (byte order), so
    // two imports (or an import and a cart) cannot deadlock on each other.
    let mut rows: Vec<&Row> = rows.iter().collect();
    rows.sort_unstable_by(|a, b| level_key(a).cmp(&level_key(b)));
    let mut tx = db.primary().begin().await?;
    let products = first_of_each_product(&rows);
    let created = create_products(&mut tx, &products).await?;
    let existing = rows
        .iter()
        .copied()
        .filter(|r| !created.contains(r.product_id.as_str()));
    let locked: HashSet<String> = stock::lock_differing(&mut tx, &file_levels(existing))
        .await?
        .into_iter()
        .collect();
    let touched: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| {
            created.contains(r.product_id.as_str()) || locked.contains(r.product_id.as_str())
        })
        .collect();
    let mut applied = Applied {
        created: rows
            .iter()
            .filter(|r| created.contains(r.product_id.as_str()))
            .count() as u64,
        ..Applied::default()
    };
    let changes = restated(&mut tx, &touched, &created, &mut applied).await?;
    applied.unchanged = rows.len() as u64 - applied.created - applied.changed;
    if !changes.0.ids.is_empty() {
        let raised = stock::restate(&mut tx, &changes.0, &changes.1, &import.to_string()).await?;
        applied.raised = raised
            .into_iter()
            .filter(|p| !created.contains(p))
            .filter_map(|p| ProductId::parse(&p).ok())
            .collect();
    }
    tx.commit().await?;
    Ok(applied)
}

/// A row's place in the lock order: its product, then its location, in byte order.
fn level_key(r: &Row) -> (&str, &str) {
    (r.product_id.as_str(), r.location_id.as_str())
}

/// Each product's first row (sorted rows: its rows are together), with the file's count at
/// `default` if it states one.
fn first_of_each_product<'a>(rows: &[&'a Row]) -> Vec<(&'a Row, Option<i32>)> {
    let mut out: Vec<(&Row, Option<i32>)> = Vec::new();
    for &r in rows {
        let at_default =
            (r.location_id.as_str() == DEFAULT_LOCATION).then_some(r.available_quantity);
        match out.last_mut() {
            Some((first, d)) if first.product_id == r.product_id => *d = d.or(at_default),
            _ => out.push((r, at_default)),
        }
    }
    out
}

/// Inserts the products that do not exist yet; their ids.
async fn create_products(
    tx: &mut Tx,
    products: &[(&Row, Option<i32>)],
) -> sqlx::Result<HashSet<String>> {
    let ids: Vec<&str> = products
        .iter()
        .map(|(r, _)| r.product_id.as_str())
        .collect();
    let names: Vec<&str> = products.iter().map(|(r, _)| r.name.as_str()).collect();
    let prices: Vec<i32> = products.iter().map(|(r, _)| r.price_cents).collect();
    let defaults: Vec<Option<i32>> = products.iter().map(|(_, d)| *d).collect();
    Ok(stock::create_products(tx, &ids, &names, &prices, &defaults)
        .await?
        .into_iter()
        .collect())
}

fn file_levels<'a>(rows: impl Iterator<Item = &'a Row>) -> FileLevels<'a> {
    let mut f = FileLevels {
        ids: Vec::new(),
        locations: Vec::new(),
        names: Vec::new(),
        prices: Vec::new(),
        counts: Vec::new(),
    };
    for r in rows {
        f.ids.push(r.product_id.as_str());
        f.locations.push(r.location_id.as_str());
        f.names.push(r.name.as_str());
        f.prices.push(r.price_cents);
        f.counts.push(r.available_quantity);
    }
    f
}

/// Opens and reads the `touched` rows' levels under their products' locks, and applies the
/// rule to each row that differs: the levels and products to write, counted in `applied`.
async fn restated<'a>(
    tx: &mut Tx,
    touched: &[&'a Row],
    created: &HashSet<String>,
    applied: &mut Applied,
) -> anyhow::Result<(LevelChanges<'a>, ProductChanges<'a>)> {
    let mut levels = LevelChanges::default();
    let mut products = ProductChanges::default();
    if touched.is_empty() {
        return Ok((levels, products));
    }
    let file = file_levels(touched.iter().copied());
    stock::open_levels(tx, &file.ids, &file.locations).await?;
    let found = stock::read_levels(tx, &file).await?;
    for (&row, level) in touched.iter().zip(found) {
        let opening = created.contains(row.product_id.as_str());
        let file = row.available_quantity;
        let stated = level.stated.unwrap_or(level.available);
        if !opening && !level.product_differs && stated == file {
            continue;
        }
        let restated = restate(level.available, stated, file).ok_or_else(|| StockLimit {
            product: row.product_id.clone(),
            location: row.location_id.clone(),
            available: level.available,
            stated,
            file,
        })?;
        if !opening {
            applied.changed += 1;
        }
        if restated.clamped {
            applied.clamped.push(match row.location_id.as_str() {
                DEFAULT_LOCATION => row.product_id.to_string(),
                at => format!("{}@{at}", row.product_id),
            });
        }
        levels.ids.push(row.product_id.as_str());
        levels.locations.push(row.location_id.as_str());
        levels.deltas.push(restated.available - level.available);
        levels.stated.push(file);
        levels.opening.push(opening);
        push_product(&mut products, row);
    }
    Ok((levels, products))
}

/// Adds `row`'s product to the products to write, once (rows come in product order).
fn push_product<'a>(products: &mut ProductChanges<'a>, row: &'a Row) {
    let at_default =
        (row.location_id.as_str() == DEFAULT_LOCATION).then_some(row.available_quantity);
    if products.ids.last() == Some(&row.product_id.as_str()) {
        if let Some(last) = products.default_counts.last_mut() {
            *last = last.or(at_default);
        }
        return;
    }
    products.ids.push(row.product_id.as_str());
    products.names.push(row.name.as_str());
    products.prices.push(row.price_cents);
    products.default_counts.push(at_default);
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
