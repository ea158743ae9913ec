//! Stock moves for several products at once (carts, holds, cancels, expiries), in the one
//! lock order every transaction here shares: product rows by `product_id` in byte order
//! (`COLLATE "C"`, Rust's `str` order, whatever the database's collation; an `en_US` one
//! sorts `B-1` before `a.2` and `a.2` after `A-3`). Single-product batches lock one row, so no
//! mix of carts, holds, imports and batches can wait in a circle. Statements that insert rows
//! referencing several products (hold lines, order lines) insert them in that order too; their
//! foreign-key checks take `FOR KEY SHARE`, which only a `FOR UPDATE` would block, and nothing
//! here takes one on a product.

use crate::domain::{ProductId, Quantity};
use std::collections::BTreeMap;

/// A write transaction on the primary.
pub(crate) type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

/// Each locked product's row, in lock order.
pub(crate) type Locked = BTreeMap<String, LockedRow>;

/// What a transaction holding a product's row lock knows of it, on the primary's clock.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub(crate) struct LockedRow {
    pub available: i32,
    pub price: i32,
    /// `max_per_customer`.
    pub limit: Option<i32>,
    /// Milliseconds until `sale_starts_at`, while it is ahead.
    pub starts_in_ms: Option<i64>,
    /// At or past `sale_ends_at`.
    pub ended: bool,
}

/// A line that cannot be served: what was asked and what there is.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Short {
    pub product_id: String,
    pub requested: i32,
    pub available: i32,
}

/// Units per product, merged and in lock order.
pub(crate) fn per_product(lines: &[(ProductId, i32)]) -> BTreeMap<&str, i32> {
    let mut merged = BTreeMap::new();
    for (p, q) in lines {
        *merged.entry(p.as_str()).or_insert(0) += q;
    }
    merged
}

/// Locks the rows in lock order and reads each (its window judged on the primary's clock once
/// the lock is held); a missing product is absent from the answer.
pub(crate) async fn lock(tx: &mut Tx, products: &[&str]) -> Result<Locked, sqlx::Error> {
    #[derive(sqlx::FromRow)]
    struct Row {
        product_id: String,
        #[sqlx(flatten)]
        row: LockedRow,
    }
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT product_id, available_quantity AS available, price_cents AS price, max_per_customer AS limit, \
                CASE WHEN sale_starts_at > clock_timestamp() \
                     THEN ceil(extract(epoch FROM sale_starts_at - clock_timestamp()) * 1000)::int8 END AS starts_in_ms, \
                coalesce(sale_ends_at <= clock_timestamp(), false) AS ended \
         FROM products WHERE product_id = ANY($1) ORDER BY product_id COLLATE \"C\" FOR NO KEY UPDATE",
    )
    .bind(products)
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows.into_iter().map(|r| (r.product_id, r.row)).collect())
}

/// Locks the lines' products ([`lock`]); `None` when one of them does not exist.
pub(crate) async fn lock_lines(
    tx: &mut Tx,
    lines: &[(ProductId, Quantity)],
) -> Result<Option<Locked>, sqlx::Error> {
    let products: Vec<&str> = lines.iter().map(|(p, _)| p.as_str()).collect();
    let locked = lock(tx, &products).await?;
    Ok((locked.len() == products.len()).then_some(locked))
}

/// The lines the locked stock cannot serve (none: all can).
pub(crate) fn shortfalls(lines: &[(ProductId, Quantity)], stock: &Locked) -> Vec<Short> {
    lines
        .iter()
        .filter_map(|(p, q)| {
            let available = stock.get(p.as_str()).map_or(0, |r| r.available);
            (available < q.get()).then(|| Short {
                product_id: p.to_string(),
                requested: q.get(),
                available,
            })
        })
        .collect()
}

/// Takes every line's units with ONE guarded UPDATE (`… AND available_quantity >= q` per
/// product). Rows must be locked already; if any guard fails the caller must roll back.
pub(crate) async fn take(tx: &mut Tx, lines: &[(ProductId, i32)]) -> Result<bool, sqlx::Error> {
    let merged = per_product(lines);
    let products: Vec<&str> = merged.keys().copied().collect();
    let qty: Vec<i32> = merged.values().copied().collect();
    let taken = sqlx::query(
        "UPDATE products p SET available_quantity = p.available_quantity - l.q, updated_at = clock_timestamp() \
         FROM UNNEST($1::text[], $2::int4[]) AS l(product_id, q) \
         WHERE p.product_id = l.product_id AND p.available_quantity >= l.q",
    )
    .bind(&products)
    .bind(&qty)
    .execute(&mut **tx)
    .await?;
    Ok(taken.rows_affected() == products.len() as u64)
}

/// Gives every line's units back (a cancel, a release, an expiry), locking in lock order.
pub(crate) async fn give_back(tx: &mut Tx, lines: &[(ProductId, i32)]) -> Result<(), sqlx::Error> {
    let merged = per_product(lines);
    let products: Vec<&str> = merged.keys().copied().collect();
    let qty: Vec<i32> = merged.values().copied().collect();
    lock(tx, &products).await?;
    sqlx::query(
        "UPDATE products p SET available_quantity = p.available_quantity + l.q, updated_at = clock_timestamp() \
         FROM UNNEST($1::text[], $2::int4[]) AS l(product_id, q) WHERE p.product_id = l.product_id",
    )
    .bind(&products)
    .bind(&qty)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A product's stock as a restock left it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Stocked {
    pub product_id: String,
    pub name: String,
    pub price_cents: i32,
    pub available_quantity: i32,
    #[sqlx(flatten)]
    pub rules: super::drops::Rules,
}
