//! The one owner of `products.available_quantity`. Every write of it is here: an order
//! batch's take (in the versioned server-side function `checkout/orders/statement.rs`
//! calls), a cart's or a hold's [`take`], a cancel's, a release's or an expiry's
//! [`give_back`], a [`restock`], a product's [`create`], and an import's [`create_many`] and
//! [`restate`]. The rule: **every take is a guarded UPDATE on the primary** (`… AND
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
use crate::domain::{IdempotencyKey, ProductId, Quantity};
use std::collections::BTreeMap;

/// Units per product, merged and in lock order.
pub(crate) fn per_product(lines: &[(ProductId, i32)]) -> BTreeMap<&str, i32> {
    let mut merged = BTreeMap::new();
    for (p, q) in lines {
        *merged.entry(p.as_str()).or_insert(0) += q;
    }
    merged
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
        let (mut line_ids, mut line_products, mut line_qty, mut line_prices) =
            (vec![], vec![], vec![], vec![]);
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
            line_ids,
            line_products,
            line_qty,
            line_prices,
        })
    }
}

/// Claims the carts' keys, inserts the confirmed carts' lines and takes their units with ONE
/// guarded UPDATE (each product's summed units, `… AND available_quantity >= q`): one
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
    let rows = sqlx::query(concat!(
        "WITH claim AS ( \
           INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint, refusal) \
           SELECT c.order_id, NULL, c.user_id, NULL, 0, c.total, c.status, c.k, c.fp, c.refusal \
             FROM UNNEST($1::uuid[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[]::jsonb[]) \
                  AS c(order_id, user_id, total, status, k, fp, refusal) \
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
         ) \
         SELECT claim.*, (SELECT count(*) FROM took) = (SELECT count(*) FROM need) AS guards_held, \
                l.line_products, l.line_quantities, l.line_prices \
           FROM claim LEFT JOIN ( \
                SELECT order_id, array_agg(product_id ORDER BY product_id) AS line_products, \
                       array_agg(quantity ORDER BY product_id) AS line_quantities, \
                       array_agg(unit_price_cents ORDER BY product_id) AS line_prices \
                  FROM lines GROUP BY order_id) l USING (order_id)",
    ))
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

/// Gives every line's units back (a cancel, a release, an expiry), locking in lock order.
pub(crate) async fn give_back(tx: &mut Tx, lines: &[(ProductId, i32)]) -> Result<(), sqlx::Error> {
    let merged = per_product(lines);
    let products: Vec<&str> = merged.keys().copied().collect();
    let qty: Vec<i32> = merged.values().copied().collect();
    super::tx::lock(tx, &products).await?;
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
    pub rules: Rules,
}

/// Adds `quantity` to a product's stock and records the restock under `key` (its unique
/// claim): the stock it left, and whether this restock claimed the key (`false`: a
/// concurrent one did, and the caller must roll back). `None`: no such product.
pub(crate) async fn restock(
    tx: &mut Tx,
    product: &ProductId,
    quantity: i32,
    key: Option<&IdempotencyKey>,
    fingerprint: &str,
) -> Result<Option<(Stocked, bool)>, sqlx::Error> {
    let Some(stocked) = sqlx::query_as::<_, Stocked>(concat!(
        "WITH u AS (UPDATE products SET available_quantity = available_quantity + $2, updated_at = clock_timestamp() \
                    WHERE product_id = $1 RETURNING product_id, name, price_cents, available_quantity, ",
        rule_columns!(),
        "), e AS (INSERT INTO events (types, items, k) SELECT '{stock.changed}', json_build_array(json_build_object( \
                    'type', 'stock.changed', 'data', json_build_object( \
                    'product_id', product_id, 'delta', $2::int4, 'available_quantity', available_quantity, \
                    'reason', 'restock'))), 1 FROM u) \
         SELECT * FROM u"
    ))
    .bind(product.as_str())
    .bind(quantity)
    .fetch_optional(&mut **tx)
    .await?
    else {
        return Ok(None);
    };
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

/// A new product, its stock and stated count the same. `None`: the id exists already.
pub(crate) async fn create(
    tx: &mut Tx,
    id: &ProductId,
    name: &str,
    price_cents: i32,
    stock: i32,
    rules: &Rules,
) -> Result<Option<Stocked>, sqlx::Error> {
    sqlx::query_as(concat!(
        "WITH c AS (INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity, max_per_customer, sale_starts_at, sale_ends_at) \
                    VALUES ($1, $2, $3, $4, $4, $5, $6, $7) ON CONFLICT (product_id) DO NOTHING \
                    RETURNING product_id, name, price_cents, available_quantity, ",
        rule_columns!(),
        "), e AS (INSERT INTO events (types, items, k) SELECT '{stock.changed}', json_build_array(json_build_object( \
                    'type', 'stock.changed', 'data', json_build_object( \
                    'product_id', product_id, 'delta', available_quantity, 'available_quantity', available_quantity, \
                    'reason', 'create'))), 1 FROM c) \
         SELECT * FROM c"
    ))
    .bind(id.as_str())
    .bind(name)
    .bind(price_cents)
    .bind(stock)
    .bind(rules.max_per_customer)
    .bind(rules.sale_starts_at)
    .bind(rules.sale_ends_at)
    .fetch_optional(&mut **tx)
    .await
}

/// An import's new products (stock and stated count: the file's), inserted in lock order;
/// the ids it created (an id that exists already is left to [`lock_differing`]).
pub(crate) async fn create_many(
    tx: &mut Tx,
    ids: &[&str],
    names: &[&str],
    prices: &[i32],
    stock: &[i32],
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "WITH c AS (INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) \
                    SELECT id, name, price, stock, stock \
                    FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[]) AS f(id, name, price, stock) \
                    ORDER BY id COLLATE \"C\" \
                    ON CONFLICT (product_id) DO NOTHING RETURNING product_id, available_quantity), \
              e AS (INSERT INTO events (types, items, k) \
                    SELECT '{stock.changed}', json_agg(json_build_object('type', 'stock.changed', \
                           'data', json_build_object('product_id', product_id, \
                           'delta', available_quantity, 'available_quantity', available_quantity, \
                           'reason', 'import')) ORDER BY k), count(*) \
                    FROM (SELECT c.*, row_number() OVER (ORDER BY product_id COLLATE \"C\") AS k FROM c) c \
                    GROUP BY (k - 1) / 1000 ORDER BY (k - 1) / 1000) \
         SELECT product_id FROM c",
    )
    .bind(ids)
    .bind(names)
    .bind(prices)
    .bind(stock)
    .fetch_all(&mut **tx)
    .await
}

/// Locks, in the one product order, the existing products whose stated count, name or price
/// differ from an import's file, and returns `(product_id, available_quantity,
/// stated_quantity)` as they stand under the lock (sales wait until the batch commits).
/// `FOR NO KEY UPDATE`, the lock the UPDATE that follows takes anyway: a refusal's or an
/// order line's foreign-key check (`FOR KEY SHARE`) never waits on it, so an import and the
/// buyers of sold-out products never wait on each other in a circle.
pub(crate) async fn lock_differing(
    tx: &mut Tx,
    ids: &[&str],
    names: &[&str],
    prices: &[i32],
    stated: &[i32],
) -> sqlx::Result<Vec<(String, i32, i32)>> {
    sqlx::query_as(
        "SELECT p.product_id, p.available_quantity, p.stated_quantity \
         FROM products p \
         JOIN UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[]) AS f(id, name, price, stated) \
           ON p.product_id = f.id \
         WHERE (p.name, p.price_cents, p.stated_quantity) IS DISTINCT FROM (f.name, f.price, f.stated) \
         ORDER BY p.product_id COLLATE \"C\" \
         FOR NO KEY UPDATE OF p",
    )
    .bind(ids)
    .bind(names)
    .bind(prices)
    .bind(stated)
    .fetch_all(&mut **tx)
    .await
}

/// Writes an import's restated rows (locked by [`lock_differing`]): name, price, the new
/// stock, and the file's count as the stated one; `deltas[i]` is how far row `i`'s stock moved
/// (its `stock.changed` event, when it did).
pub(crate) async fn restate(
    tx: &mut Tx,
    ids: &[&str],
    names: &[&str],
    prices: &[i32],
    (stock, deltas): (&[i32], &[i32]),
    stated: &[i32],
) -> sqlx::Result<()> {
    sqlx::query(
        "WITH r AS (UPDATE products p SET name = u.name, price_cents = u.price, available_quantity = u.stock, \
                      stated_quantity = u.stated, updated_at = clock_timestamp() \
                    FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[], $5::int4[], $6::int4[]) \
                      AS u(id, name, price, stock, stated, delta) \
                    WHERE p.product_id = u.id RETURNING p.product_id, p.available_quantity, u.delta) \
         INSERT INTO events (types, items, k) \
         SELECT '{stock.changed}', json_agg(json_build_object('type', 'stock.changed', \
                'data', json_build_object('product_id', product_id, 'delta', delta, \
                'available_quantity', available_quantity, 'reason', 'import')) ORDER BY k), count(*) \
         FROM (SELECT r.*, row_number() OVER (ORDER BY product_id COLLATE \"C\") AS k \
               FROM r WHERE delta <> 0) r \
         GROUP BY (k - 1) / 1000 ORDER BY (k - 1) / 1000",
    )
    .bind(ids)
    .bind(names)
    .bind(prices)
    .bind(stock)
    .bind(stated)
    .bind(deltas)
    .execute(&mut **tx)
    .await?;
    Ok(())
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
            if path.ends_with("checkout/stock.rs") || path.extension() != Some("rs".as_ref()) {
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
            for verb in ["update products", "insert into products"] {
                for (at, _) in code.match_indices(verb) {
                    let statement: String = code[at..].lines().take(4).collect();
                    if statement.contains("available_quantity") {
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
