//! The one owner of `products.available_quantity`. Every write of it is here: an order
//! batch's take (in the versioned server-side function `checkout/orders/statement.rs`
//! calls), a cart's or a hold's [`take`], a cancel's, a release's or an expiry's
//! [`give_back`], a [`restock`], a product's [`create`], and an import's batch
//! ([`import`]). The rule: **every take is a guarded UPDATE on the primary** (`… AND
//! available_quantity >= q`), in the transaction that records why (the order, the hold,
//! the restock, the import's batch), so stock never moves without its reason and never goes
//! below zero. A test (`only_this_module_writes_stock`) holds every other file in `src/` to it.
//!
//! Lock order: every transaction here locks product rows by `product_id` in byte order
//! (`COLLATE "C"`, Rust's `str` order, whatever the database's collation; an `en_US` one
//! sorts `B-1` before `a.2` and `a.2` after `A-3`). Single-product batches lock one row, so no
//! mix of carts, holds, imports and batches can wait in a circle. Statements that insert rows
//! referencing several products (hold lines, order lines) insert them in that order too; their
//! foreign-key checks take `FOR KEY SHARE`, which only a `FOR UPDATE` would block, and nothing
//! here takes one on a product.

use super::drops::{Refusal, Rules, rule_columns};
use super::order::{Order, OrderLine, new_row_id, order_columns};
use super::status::OrderStatus;
pub(crate) use super::tx::Tx;
use crate::domain::{Allocation, IdempotencyKey, LocationId, ProductId, Quantity};

pub(crate) mod import;
pub(crate) mod levels;
use std::collections::BTreeMap;

/// Units per (product, location), merged and in lock order.
fn per_level(allocations: &[Allocation]) -> BTreeMap<(&str, &str), i32> {
    let mut merged = BTreeMap::new();
    for a in allocations {
        *merged
            .entry((a.product_id.as_str(), a.location_id.as_str()))
            .or_insert(0) += a.quantity;
    }
    merged
}

/// Takes every allocation's units: ONE guarded UPDATE of the levels (`… AND
/// available_quantity >= q` per (product, location)) and one of the products' counts, in one
/// statement. Rows must be locked already; if any guard fails (`false`) the caller must roll
/// back.
pub(crate) async fn take(tx: &mut Tx, allocations: &[Allocation]) -> Result<bool, sqlx::Error> {
    let merged = per_level(allocations);
    let products: Vec<&str> = merged.keys().map(|(p, _)| *p).collect();
    let locations: Vec<&str> = merged.keys().map(|(_, l)| *l).collect();
    let qty: Vec<i32> = merged.values().copied().collect();
    sqlx::query_scalar(
        "WITH l AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[]) AS l(product_id, location_id, q)), \
              lv AS (UPDATE stock_levels s SET available_quantity = s.available_quantity - l.q, \
                            updated_at = clock_timestamp() \
                       FROM l WHERE s.product_id = l.product_id AND s.location_id = l.location_id \
                        AND s.available_quantity >= l.q RETURNING 1), \
              need AS (SELECT product_id, sum(q)::int4 AS q FROM l GROUP BY product_id), \
              p AS (UPDATE products p SET available_quantity = p.available_quantity - need.q, \
                           updated_at = clock_timestamp() \
                      FROM need WHERE p.product_id = need.product_id AND p.available_quantity >= need.q \
                    RETURNING 1) \
         SELECT (SELECT count(*) FROM lv) = (SELECT count(*) FROM l) \
            AND (SELECT count(*) FROM p) = (SELECT count(*) FROM need)",
    )
    .bind(&products)
    .bind(&locations)
    .bind(&qty)
    .fetch_one(&mut **tx)
    .await
}

/// A cart's claim on its key, as [`claim_carts`] writes it: a confirmed order at the locked
/// prices with its lines, or a refusal (no lines, total 0).
pub(crate) struct CartClaim<'a> {
    pub order_id: uuid::Uuid,
    pub user: &'a str,
    pub key: &'a str,
    pub fingerprint: String,
    /// `None`: confirmed. `Some`: refused, for this reason.
    pub refusal: Option<&'a Refusal>,
    pub total: i64,
    /// (product, quantity, locked price), each product once; empty for a refusal.
    pub lines: Vec<(&'a str, i32, i32)>,
    /// Where the lines' units come from; empty for a refusal.
    pub allocations: Vec<Allocation>,
}

/// What [`claim_carts`] wrote: the orders and refusals whose keys it claimed (a key another
/// request claimed first is absent, and nothing of its cart was written), and whether every
/// product's guard held (when it is false, nothing may commit).
pub(crate) struct CartsClaimed {
    pub orders: Vec<Order>,
    pub guards_held: bool,
}

/// [`claim_carts`]'s parameters: the claims in (user, key) byte order, a column each, and
/// their lines.
struct ClaimArrays<'a> {
    ids: Vec<uuid::Uuid>,
    users: Vec<&'a str>,
    totals: Vec<i64>,
    statuses: Vec<&'static str>,
    keys: Vec<&'a str>,
    fps: Vec<&'a str>,
    refusals: Vec<Option<String>>,
    allocations: Vec<String>,
    /// Every claim's allocations, a column each (order id, product, location, units).
    take_ids: Vec<uuid::Uuid>,
    take_products: Vec<&'a str>,
    take_locations: Vec<&'a str>,
    take_qty: Vec<i32>,
    line_ids: Vec<uuid::Uuid>,
    line_products: Vec<&'a str>,
    line_qty: Vec<i32>,
    line_prices: Vec<i32>,
}

impl<'a> ClaimArrays<'a> {
    fn of(claims: &'a [CartClaim<'a>]) -> Result<Self, sqlx::Error> {
        let mut sorted: Vec<&CartClaim<'_>> = claims.iter().collect();
        sorted.sort_by(|a, b| (a.user, a.key).cmp(&(b.user, b.key)));
        let ids: Vec<uuid::Uuid> = sorted.iter().map(|c| c.order_id).collect();
        let users: Vec<&str> = sorted.iter().map(|c| c.user).collect();
        let totals: Vec<i64> = sorted.iter().map(|c| c.total).collect();
        let statuses: Vec<&str> = sorted
            .iter()
            .map(|c| match c.refusal {
                None => OrderStatus::Confirmed.as_str(),
                Some(_) => OrderStatus::Refused.as_str(),
            })
            .collect();
        let keys: Vec<&str> = sorted.iter().map(|c| c.key).collect();
        let fps: Vec<&str> = sorted.iter().map(|c| c.fingerprint.as_str()).collect();
        let refusals = sorted
            .iter()
            .map(|c| {
                c.refusal
                    .and_then(Refusal::to_stored)
                    .map(|j| serde_json::to_string(&j.0))
                    .transpose()
            })
            .collect::<Result<Vec<Option<String>>, _>>()
            .map_err(|e| sqlx::Error::Encode(e.into()))?;
        let allocations = sorted
            .iter()
            .map(|c| serde_json::to_string(&c.allocations))
            .collect::<Result<Vec<String>, _>>()
            .map_err(|e| sqlx::Error::Encode(e.into()))?;

        let (mut line_ids, mut line_products, mut line_qty, mut line_prices) =
            (vec![], vec![], vec![], vec![]);
        let (take_ids, take_products, take_locations, take_qty) = takes(&sorted);
        for c in &sorted {
            for &(p, q, price) in &c.lines {
                line_ids.push(c.order_id);
                line_products.push(p);
                line_qty.push(q);
                line_prices.push(price);
            }
        }
        Ok(ClaimArrays {
            ids,
            users,
            totals,
            statuses,
            keys,
            fps,
            refusals,
            allocations,
            take_ids,
            take_products,
            take_locations,
            take_qty,
            line_ids,
            line_products,
            line_qty,
            line_prices,
        })
    }
}

/// Every claim's allocations as columns: (order, product, location, units).
type Takes<'a> = (Vec<uuid::Uuid>, Vec<&'a str>, Vec<&'a str>, Vec<i32>);

fn takes<'a>(claims: &[&'a CartClaim<'a>]) -> Takes<'a> {
    let mut t: Takes<'a> = (vec![], vec![], vec![], vec![]);
    for c in claims {
        for a in &c.allocations {
            t.0.push(c.order_id);
            t.1.push(a.product_id.as_str());
            t.2.push(a.location_id.as_str());
            t.3.push(a.quantity);
        }
    }
    t
}

/// [`claim_carts`]'s statement: the claims ($1–$7, $12: their allocations as JSON), the
/// lines ($8–$11), and every allocation as columns ($13–$16: order, product, location,
/// units; arrays, so a plan without statistics probes the levels by key).
const CLAIM_CARTS: &str = concat!(
    "WITH claim AS ( \
           INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, refusal, allocations) \
           SELECT c.order_id, NULL, c.user_id, NULL, 0, c.total, c.status, c.k, c.fp, c.refusal, c.allocations \
             FROM UNNEST($1::uuid[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[]::jsonb[], $12::text[]::jsonb[]) \
                  AS c(order_id, user_id, total, status, k, fp, refusal, allocations) \
           ON CONFLICT (user_id, idempotency_key) DO NOTHING RETURNING ",
    order_columns!(),
    "), want AS ( \
           SELECT l.* FROM UNNEST($8::uuid[], $9::text[], $10::int4[], $11::int4[]) AS l(order_id, product_id, quantity, price) \
             JOIN claim USING (order_id) \
         ), lines AS ( \
           INSERT INTO order_lines (order_id, product_id, quantity, unit_price_cents) \
           SELECT order_id, product_id, quantity, price FROM want ORDER BY product_id COLLATE \"C\", order_id \
           RETURNING order_id, product_id, quantity, unit_price_cents \
         ), need AS ( \
           SELECT product_id, sum(quantity)::int4 AS q FROM want GROUP BY product_id \
         ), took AS ( \
           UPDATE products p SET available_quantity = p.available_quantity - need.q, updated_at = clock_timestamp() \
             FROM need WHERE p.product_id = need.product_id AND p.available_quantity >= need.q \
           RETURNING 1 \
         ), lv AS ( \
           SELECT a.product_id, a.location_id, sum(a.q)::int4 AS q \
             FROM UNNEST($13::uuid[], $14::text[], $15::text[], $16::int4[]) AS a(order_id, product_id, location_id, q) \
             JOIN claim USING (order_id) \
            GROUP BY a.product_id, a.location_id \
         ), took_lv AS ( \
           UPDATE stock_levels s SET available_quantity = s.available_quantity - lv.q, updated_at = clock_timestamp() \
             FROM lv WHERE s.product_id = lv.product_id AND s.location_id = lv.location_id AND s.available_quantity >= lv.q \
           RETURNING 1 \
         ) \
         SELECT claim.*, (SELECT count(*) FROM took) = (SELECT count(*) FROM need) \
                     AND (SELECT count(*) FROM took_lv) = (SELECT count(*) FROM lv) \
                     AND (SELECT sum(q) FROM lv) IS NOT DISTINCT FROM (SELECT sum(q) FROM need) AS guards_held, \
                l.line_products, l.line_quantities, l.line_prices \
           FROM claim LEFT JOIN ( \
                SELECT order_id, array_agg(product_id ORDER BY product_id) AS line_products, \
                       array_agg(quantity ORDER BY product_id) AS line_quantities, \
                       array_agg(unit_price_cents ORDER BY product_id) AS line_prices \
                  FROM lines GROUP BY order_id) l USING (order_id)",
);

/// Claims the carts' keys, inserts the confirmed carts' lines and takes their units with ONE
/// guarded UPDATE per table (each product's and each level's summed units, `… AND
/// available_quantity >= q`): one
/// statement for any number of carts, so the rows the caller locked are held for one round
/// trip and the commit. Keys are claimed in (user, key) byte order, the order every batch and
/// refusal claims keys in, so two claimers never wait on each other's keys in a circle; lines
/// go in in lock order. Orders come back with their lines as stored, in the order
/// `with_lines` reads them.
pub(crate) async fn claim_carts(
    tx: &mut Tx,
    claims: &[CartClaim<'_>],
) -> Result<CartsClaimed, sqlx::Error> {
    let a = ClaimArrays::of(claims)?;
    let rows = sqlx::query(CLAIM_CARTS)
        .bind(&a.ids)
        .bind(&a.users)
        .bind(&a.totals)
        .bind(&a.statuses)
        .bind(&a.keys)
        .bind(&a.fps)
        .bind(&a.refusals)
        .bind(&a.line_ids)
        .bind(&a.line_products)
        .bind(&a.line_qty)
        .bind(&a.line_prices)
        .bind(&a.allocations)
        .bind(&a.take_ids)
        .bind(&a.take_products)
        .bind(&a.take_locations)
        .bind(&a.take_qty)
        .fetch_all(&mut **tx)
        .await?;
    let mut claimed = CartsClaimed {
        orders: Vec::with_capacity(rows.len()),
        guards_held: true,
    };
    for row in &rows {
        let (order, held) = cart_order(row)?;
        claimed.guards_held &= held;
        claimed.orders.push(order);
    }
    Ok(claimed)
}

/// [`claim_carts`]'s row: the order with its lines (none for a refusal), and whether every
/// product's guard held.
fn cart_order(row: &sqlx::postgres::PgRow) -> Result<(Order, bool), sqlx::Error> {
    use super::order::column;
    use sqlx::{FromRow, Row};
    let products: Option<Vec<String>> = row.try_get("line_products")?;
    let quantities: Option<Vec<i32>> = row.try_get("line_quantities")?;
    let prices: Option<Vec<i32>> = row.try_get("line_prices")?;
    let lines = products
        .unwrap_or_default()
        .into_iter()
        .zip(quantities.unwrap_or_default())
        .zip(prices.unwrap_or_default())
        .map(|((product_id, quantity), unit_price_cents)| {
            Ok(OrderLine {
                product_id: column(ProductId::parse(&product_id), "line_products")?,
                quantity: column(Quantity::from_i64(quantity.into()), "line_quantities")?,
                unit_price_cents,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    let order = Order {
        lines,
        ..Order::from_row(row)?
    };
    Ok((order, row.try_get("guards_held")?))
}

/// Gives every allocation's units back to its own location (a cancel, a release, an
/// expiry), locking the products in lock order first: each level gains its units, and each
/// product's count those of its active locations (read after the lock). A location's count
/// may then exceed what it held before the take, when units were transferred out since:
/// the units are back where they were taken, as the contract says.
pub(crate) async fn give_back(tx: &mut Tx, allocations: &[Allocation]) -> Result<(), sqlx::Error> {
    let merged = per_level(allocations);
    let products: Vec<&str> = merged.keys().map(|(p, _)| *p).collect();
    let locations: Vec<&str> = merged.keys().map(|(_, l)| *l).collect();
    let qty: Vec<i32> = merged.values().copied().collect();
    let mut distinct = products.clone();
    distinct.dedup();
    super::tx::lock(tx, &distinct).await?;
    sqlx::query(
        "WITH l AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[]) AS l(product_id, location_id, q)), \
              lv AS (UPDATE stock_levels s SET available_quantity = s.available_quantity + l.q, \
                            updated_at = clock_timestamp() \
                       FROM l WHERE s.product_id = l.product_id AND s.location_id = l.location_id \
                     RETURNING s.product_id, s.location_id, l.q), \
              back AS (SELECT lv.product_id, sum(lv.q)::int4 AS q FROM lv \
                         JOIN locations loc ON loc.location_id = lv.location_id AND loc.active \
                        GROUP BY lv.product_id) \
         UPDATE products p SET available_quantity = p.available_quantity + back.q, updated_at = clock_timestamp() \
           FROM back WHERE p.product_id = back.product_id",
    )
    .bind(&products)
    .bind(&locations)
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
    pub rules: Rules,
}

/// Adds `quantity` to a product's level at `location` (and to its count when the location is
/// active) and records the restock under `key` (its unique claim): the stock it left, and
/// whether this restock claimed the key (`false`: a concurrent one did, and the caller must
/// roll back). `None`: no such product.
pub(crate) async fn restock(
    tx: &mut Tx,
    product: &ProductId,
    location: &LocationId,
    quantity: i32,
    key: Option<&IdempotencyKey>,
    fingerprint: &str,
) -> Result<Option<(Stocked, bool)>, sqlx::Error> {
    if super::tx::lock(tx, &[product.as_str()]).await?.is_empty() {
        return Ok(None);
    }
    levels::ensure(tx, product.as_str(), &[location.as_str()]).await?;
    levels::add(
        tx,
        product.as_str(),
        location.as_str(),
        quantity,
        levels::Change::because("restock"),
    )
    .await?;
    let stocked: Stocked = sqlx::query_as(concat!(
        "SELECT product_id, name, price_cents, available_quantity, ",
        rule_columns!(),
        " FROM products WHERE product_id = $1"
    ))
    .bind(product.as_str())
    .fetch_one(&mut **tx)
    .await?;
    let claimed = sqlx::query(
        "INSERT INTO restocks (restock_id, product_id, quantity, idempotency_key, request_fingerprint, available_after) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(new_row_id())
    .bind(product.as_str())
    .bind(quantity)
    .bind(key.map(IdempotencyKey::as_str))
    .bind(fingerprint)
    .bind(stocked.available_quantity)
    .execute(&mut **tx)
    .await?;
    Ok(Some((stocked, claimed.rows_affected() == 1)))
}

/// A new product with its stock at each of `stock`'s locations (each once; its count: the
/// active ones'), each level's stated count its own (what an import restates it from), the
/// product's their sum. `None`: the id exists already.
pub(crate) async fn create(
    tx: &mut Tx,
    id: &ProductId,
    name: &str,
    price_cents: i32,
    stock: &[(LocationId, i32)],
    rules: &Rules,
) -> Result<Option<Stocked>, sqlx::Error> {
    let stated: i64 = stock.iter().map(|(_, q)| i64::from(*q)).sum();
    let stated = i32::try_from(stated).map_err(|e| sqlx::Error::Encode(e.into()))?;
    let made = sqlx::query(
        "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity, max_per_customer, sale_starts_at, sale_ends_at) \
         VALUES ($1, $2, $3, 0, $4, $5, $6, $7) ON CONFLICT (product_id) DO NOTHING",
    )
    .bind(id.as_str())
    .bind(name)
    .bind(price_cents)
    .bind(stated)
    .bind(rules.max_per_customer)
    .bind(rules.sale_starts_at)
    .bind(rules.sale_ends_at)
    .execute(&mut **tx)
    .await?;
    if made.rows_affected() == 0 {
        return Ok(None);
    }
    let mut sorted: Vec<&(LocationId, i32)> = stock.iter().collect();
    sorted.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    let names: Vec<&str> = sorted.iter().map(|(l, _)| l.as_str()).collect();
    let counts: Vec<i32> = sorted.iter().map(|(_, q)| *q).collect();
    levels::open_stated(tx, id.as_str(), &names, &counts).await?;
    for (location, quantity) in sorted {
        levels::add(
            tx,
            id.as_str(),
            location.as_str(),
            *quantity,
            levels::Change::because("create"),
        )
        .await?;
    }
    sqlx::query_as(concat!(
        "SELECT product_id, name, price_cents, available_quantity, ",
        rule_columns!(),
        " FROM products WHERE product_id = $1"
    ))
    .bind(id.as_str())
    .fetch_optional(&mut **tx)
    .await
}

#[cfg(test)]
mod tests {
    /// Every statement that writes `products.available_quantity` lives in this file (or in
    /// a versioned server-side function, which orders/statement.rs calls by name). A write anywhere else
    /// in `src/` fails here: move it into this module.
    #[test]
    fn only_this_module_writes_stock() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = vec![root];
        let mut offenders = Vec::new();
        while let Some(path) = files.pop() {
            if path.is_dir() {
                for entry in std::fs::read_dir(&path).expect("readable src/") {
                    files.push(entry.expect("a directory entry").path());
                }
                continue;
            }
            if path.to_string_lossy().contains("checkout/stock/")
                || path.extension() != Some("rs".as_ref())
            {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable source");
            // The code, without comment lines, in lower case.
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| l.to_ascii_lowercase() + "\n")
                .collect();
            // A statement that names products and then the stock column within its next
            // few lines (an UPDATE's SET list, an INSERT's column list).
            for verb in [
                "update products",
                "insert into products",
                "update stock_levels",
                "insert into stock_levels",
            ] {
                for (at, _) in code.match_indices(verb) {
                    let statement: String = code[at..].lines().take(4).collect();
                    if statement.contains("available_quantity") || verb.contains("stock_levels") {
                        let line = code[..at].lines().count();
                        offenders.push(format!("{}:{line}: {verb} …", path.display()));
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "stock written outside checkout/stock.rs:\n{}",
            offenders.join("\n")
        );
    }
}
