//! Stock per location: the writes of `stock_levels` that are not an order's, a cart's or a
//! hold's take (those are `super::take` and the batch statement) or a give-back
//! (`super::give_back`): a location's (de)activation, a restock or a product's creation at
//! named locations, and transfers.
//!
//! The protocol (migration `20261205000002_locations.sql`): a level's writer holds its
//! product's row lock first; it reads a location's `active` flag only in a statement after
//! that lock; a level row is created (with 0) in a statement of its own before its count
//! changes. `products.available_quantity` is then always the sum of the active levels.

use super::Tx;
use crate::checkout::error::CheckoutError;
use crate::checkout::order::new_row_id;
use crate::domain::{IdempotencyKey, LocationId, ProductId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// Turns a location on or off: its levels join or leave their products' counts (no level
/// changes, no movement). The location's row is locked `FOR UPDATE` first (which waits for
/// the foreign-key checks of level rows being created there, and holds off new ones), then
/// every product with a level there, in the one lock order; the sums move in a statement
/// after those locks. Returns the location, and the products whose counts moved (`None`: no
/// such location).
pub(crate) async fn set_active(
    tx: &mut Tx,
    id: &LocationId,
    active: bool,
) -> Result<Option<(bool, Vec<ProductId>)>, sqlx::Error> {
    let Some(was): Option<bool> =
        sqlx::query_scalar("SELECT active FROM locations WHERE location_id = $1 FOR UPDATE")
            .bind(id.as_str())
            .fetch_optional(&mut **tx)
            .await?
    else {
        return Ok(None);
    };
    if was == active {
        return Ok(Some((active, vec![])));
    }
    let products: Vec<ProductId> = sqlx::query_scalar(
        "SELECT p.product_id FROM products p \
          WHERE p.product_id IN (SELECT s.product_id FROM stock_levels s WHERE s.location_id = $1) \
          ORDER BY p.product_id COLLATE \"C\" FOR NO KEY UPDATE OF p",
    )
    .bind(id.as_str())
    .fetch_all(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE products p \
            SET available_quantity = p.available_quantity \
                                     + CASE WHEN $2 THEN s.available_quantity ELSE -s.available_quantity END, \
                updated_at = clock_timestamp() \
           FROM stock_levels s \
          WHERE s.location_id = $1 AND s.product_id = p.product_id AND s.available_quantity > 0",
    )
    .bind(id.as_str())
    .bind(active)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE locations SET active = $2, updated_at = clock_timestamp() WHERE location_id = $1",
    )
    .bind(id.as_str())
    .bind(active)
    .execute(&mut **tx)
    .await?;
    Ok(Some((active, products)))
}

/// Makes sure `product` has a level at each of `locations` (0 where it had none), in a
/// statement of its own (see the module's protocol). The product's row must be locked.
pub(crate) async fn ensure(
    tx: &mut Tx,
    product: &str,
    locations: &[&str],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO stock_levels (product_id, location_id, available_quantity) \
         SELECT $1, l, 0 FROM unnest($2::text[]) AS l ORDER BY l COLLATE \"C\" \
         ON CONFLICT DO NOTHING",
    )
    .bind(product)
    .bind(locations)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// [`ensure`] for a new product: each level opens at 0 (its count then moves by its own
/// movement) with `stated[i]` as the count it was last given, which an import restates it
/// from (`stock_levels.stated_quantity`).
pub(crate) async fn open_stated(
    tx: &mut Tx,
    product: &str,
    locations: &[&str],
    stated: &[i32],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO stock_levels (product_id, location_id, available_quantity, stated_quantity) \
         SELECT $1, l, 0, n FROM unnest($2::text[], $3::int4[]) AS u(l, n) ORDER BY l COLLATE \"C\" \
         ON CONFLICT DO NOTHING",
    )
    .bind(product)
    .bind(locations)
    .bind(stated)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Why a level moves, as its movement (the ledger's row) states it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change<'a> {
    /// The movement's reason: `create`, `restock`, `import`, `transfer_out`, `transfer_in`
    /// or an adjustment's own.
    pub reason: &'a str,
    /// The transfer or import it belongs to.
    pub reference: Option<&'a str>,
    pub note: Option<&'a str>,
    /// An adjustment's key and request fingerprint (its answer is the movement).
    pub key: Option<(&'a str, &'a str)>,
}

impl<'a> Change<'a> {
    pub(crate) fn because(reason: &'a str) -> Self {
        Change {
            reason,
            reference: None,
            note: None,
            key: None,
        }
    }

    /// The `stock.changed` event's reason for this movement's.
    fn event_reason(&self) -> &'a str {
        match self.reason {
            r @ ("create" | "restock" | "import") => r,
            "transfer_out" | "transfer_in" => "transfer",
            _ => "adjust",
        }
    }
}

/// A level after a change: its count, and the movement that records it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Moved {
    pub available_quantity: i32,
    pub movement_id: i64,
}

/// Adds `delta` (any sign) to `product`'s level at `location`, guarded (`… >= -delta`), and
/// to the product's count when the location is active, in ONE statement that also writes
/// the movement (the ledger's row, `change`) and a `stock.changed` event stating the level
/// after. The product's row must be locked and the level must exist ([`ensure`]). `None`:
/// the level would go below zero (nothing changed).
pub(crate) async fn add(
    tx: &mut Tx,
    product: &str,
    location: &str,
    delta: i32,
    change: Change<'_>,
) -> Result<Option<Moved>, sqlx::Error> {
    let row: Option<(i32, i64)> = sqlx::query_as(
        "WITH l AS (UPDATE stock_levels s SET available_quantity = s.available_quantity + $3, \
                           updated_at = clock_timestamp() \
                     WHERE s.product_id = $1 AND s.location_id = $2 AND s.available_quantity + $3 >= 0 \
                    RETURNING s.available_quantity), \
              p AS (UPDATE products p SET available_quantity = p.available_quantity + $3, \
                           updated_at = clock_timestamp() \
                     WHERE p.product_id = $1 AND EXISTS (SELECT FROM l) \
                       AND (SELECT active FROM locations WHERE location_id = $2) \
                    RETURNING 1), \
              m AS (INSERT INTO movements (product_id, location_id, delta, reason, ref, note, \
                                           idempotency_key, request_fingerprint, available_after) \
                    SELECT $1, $2, $3, $5, $6, $7, $8, $9, l.available_quantity FROM l \
                    RETURNING movement_id), \
              e AS (INSERT INTO event_rows (types, items, k) \
                    SELECT '{stock.changed}', json_build_array(json_build_object( \
                           'type', 'stock.changed', 'data', json_build_object( \
                           'product_id', $1::text, 'location_id', $2::text, 'delta', $3::int4, \
                           'available_quantity', l.available_quantity, 'reason', $4::text))), 1 \
                      FROM l WHERE $3 <> 0 OR $4 IN ('create', 'adjust')) \
         SELECT l.available_quantity, m.movement_id FROM l, m",
    )
    .bind(product)
    .bind(location)
    .bind(delta)
    .bind(change.event_reason())
    .bind(change.reason)
    .bind(change.reference)
    .bind(change.note)
    .bind(change.key.map(|k| k.0))
    .bind(change.key.map(|k| k.1))
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(|(available_quantity, movement_id)| Moved {
        available_quantity,
        movement_id,
    }))
}

/// A product's levels, as its page states them: one per location that ever held it.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Level {
    #[schema(example = "default")]
    pub location_id: String,
    pub available_quantity: i32,
    pub active: bool,
}

/// A transfer as the API states it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Transfer {
    pub transfer_id: Uuid,
    #[schema(value_type = String)]
    pub product_id: String,
    #[schema(value_type = String)]
    #[sqlx(rename = "from_location")]
    pub from: String,
    #[schema(value_type = String)]
    #[sqlx(rename = "to_location")]
    pub to: String,
    pub quantity: i32,
    /// `in_transit` or `received`.
    #[schema(pattern = "^(in_transit|received)$")]
    pub status: String,
    pub created_at: DateTime<Utc>,
    pub received_at: Option<DateTime<Utc>>,
    #[serde(skip)]
    pub request_fingerprint: String,
}

const TRANSFER_COLUMNS: &str = "transfer_id, product_id, from_location, to_location, quantity, \
                                status, created_at, received_at, request_fingerprint";

/// What a transfer asks.
pub struct TransferRequest {
    pub key: IdempotencyKey,
    pub product: ProductId,
    pub from: LocationId,
    pub to: LocationId,
    pub quantity: i32,
    pub in_transit: bool,
}

impl TransferRequest {
    fn fingerprint(&self) -> String {
        format!(
            "{}:{}>{}:{}:{}",
            self.product, self.from, self.to, self.quantity, self.in_transit
        )
    }
}

/// Creates a transfer under its key: its units leave `from` (guarded) and, unless in
/// transit, join `to`, in this transaction. `Ok((transfer, true))`: made now; `false`: the
/// key's earlier transfer, the same body. Errors: no such product, `from` short
/// (`OutOfStock`, nothing written), the key used with another body.
pub(crate) async fn transfer(
    tx: &mut Tx,
    req: &TransferRequest,
) -> Result<(Transfer, bool), CheckoutError> {
    let fp = req.fingerprint();
    if let Some(t) = by_key(tx, &req.key).await? {
        return match t.request_fingerprint == fp {
            true => Ok((t, false)),
            false => Err(CheckoutError::KeyReused),
        };
    }
    let product = req.product.as_str();
    if crate::checkout::tx::lock(tx, &[product]).await?.is_empty() {
        return Err(CheckoutError::ProductNotFound);
    }
    let status = if req.in_transit {
        "in_transit"
    } else {
        "received"
    };
    let inserted: Option<Transfer> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO transfers (transfer_id, product_id, from_location, to_location, quantity, status, \
                                idempotency_key, request_fingerprint, received_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, CASE WHEN $6 = 'received' THEN clock_timestamp() END) \
         ON CONFLICT (idempotency_key) DO NOTHING RETURNING {TRANSFER_COLUMNS}"
    )))
    .bind(new_row_id())
    .bind(product)
    .bind(req.from.as_str())
    .bind(req.to.as_str())
    .bind(req.quantity)
    .bind(status)
    .bind(req.key.as_str())
    .bind(&fp)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(made) = inserted else {
        // Claimed concurrently: that transfer is the key's, once it commits.
        return match by_key(tx, &req.key).await? {
            Some(t) if t.request_fingerprint == fp => Ok((t, false)),
            Some(_) => Err(CheckoutError::KeyReused),
            None => Err(CheckoutError::OutcomeUnknown),
        };
    };
    ensure(tx, product, &[req.from.as_str(), req.to.as_str()]).await?;
    move_units(tx, &made, req.in_transit).await?;
    Ok((made, true))
}

/// A new transfer's units leave `from` (guarded: `OutOfStock`) and, unless in transit, join
/// `to`, each a movement naming the transfer.
async fn move_units(tx: &mut Tx, t: &Transfer, in_transit: bool) -> Result<(), CheckoutError> {
    let reference = t.transfer_id.to_string();
    let moved = |reason| Change {
        reference: Some(&reference),
        ..Change::because(reason)
    };
    let (product, q) = (t.product_id.as_str(), t.quantity);
    if add(tx, product, &t.from, -q, moved("transfer_out"))
        .await?
        .is_none()
    {
        return Err(CheckoutError::OutOfStock);
    }
    if !in_transit {
        add(tx, product, &t.to, q, moved("transfer_in")).await?;
    }
    Ok(())
}

async fn by_key(tx: &mut Tx, key: &IdempotencyKey) -> Result<Option<Transfer>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE idempotency_key = $1"
    )))
    .bind(key.as_str())
    .fetch_optional(&mut **tx)
    .await
}

/// A transfer by id.
pub(crate) async fn get(
    exec: impl sqlx::PgExecutor<'_>,
    id: Uuid,
) -> Result<Option<Transfer>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE transfer_id = $1"
    )))
    .bind(id)
    .fetch_optional(exec)
    .await
}

/// Receives an in-transit transfer: its units join `to`, exactly once (one guarded status
/// change from `in_transit`, under the product's row lock). `Ok((transfer, true))` when
/// received now; a transfer received already answers as it is. `None`: no such transfer.
pub(crate) async fn receive(
    tx: &mut Tx,
    id: Uuid,
) -> Result<Option<(Transfer, bool)>, sqlx::Error> {
    let Some(t) = get(&mut **tx, id).await? else {
        return Ok(None);
    };
    crate::checkout::tx::lock(tx, &[t.product_id.as_str()]).await?;
    let received: Option<Transfer> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE transfers SET status = 'received', received_at = clock_timestamp() \
          WHERE transfer_id = $1 AND status = 'in_transit' RETURNING {TRANSFER_COLUMNS}"
    )))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(t) = received else {
        return Ok(get(&mut **tx, id).await?.map(|t| (t, false)));
    };
    ensure(tx, &t.product_id, &[t.to.as_str()]).await?;
    let reference = t.transfer_id.to_string();
    let change = Change {
        reference: Some(&reference),
        ..Change::because("transfer_in")
    };
    add(tx, &t.product_id, &t.to, t.quantity, change).await?;
    Ok(Some((t, true)))
}

/// What an adjustment asks: a change of one location's count, with its reason.
#[derive(Debug, Clone)]
pub struct AdjustmentRequest {
    pub key: IdempotencyKey,
    pub product: ProductId,
    pub location: LocationId,
    pub change: Adjust,
    /// Compare-and-set: made only if the count is exactly this at that moment.
    pub expected: Option<i32>,
    pub reason: AdjustReason,
    pub note: Option<String>,
}

/// `delta` adds or removes; `set` states the count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Adjust {
    Delta(i32),
    Set(i32),
}

/// An adjustment's reason: the contract's fixed list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdjustReason {
    Received,
    Damaged,
    Lost,
    Found,
    Count,
    Returned,
    Correction,
}

impl AdjustReason {
    pub fn as_str(self) -> &'static str {
        match self {
            AdjustReason::Received => "received",
            AdjustReason::Damaged => "damaged",
            AdjustReason::Lost => "lost",
            AdjustReason::Found => "found",
            AdjustReason::Count => "count",
            AdjustReason::Returned => "returned",
            AdjustReason::Correction => "correction",
        }
    }
}

impl AdjustmentRequest {
    /// The body, as its key remembers it (the product too: a key names one adjustment).
    fn fingerprint(&self) -> String {
        let change = match self.change {
            Adjust::Delta(d) => format!("delta={d}"),
            Adjust::Set(s) => format!("set={s}"),
        };
        serde_json::json!([
            self.product.as_str(),
            self.location.as_str(),
            change,
            self.expected,
            self.reason.as_str(),
            self.note,
        ])
        .to_string()
    }
}

/// An adjustment's answer: the location's count after it, and its movement.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Adjusted {
    #[schema(value_type = String)]
    pub product_id: String,
    #[schema(value_type = String)]
    pub location_id: String,
    /// That location's count after the adjustment.
    pub available_quantity: i32,
    /// Opaque.
    pub movement_id: String,
}

/// Makes an adjustment under its key, under the product's row lock: the count it finds is
/// the count it changes, so `expected` is a true compare-and-set. `Ok((answer, true))`: made
/// now; `false`: the key's earlier adjustment, the same body. Errors: no such product,
/// `StockChanged` (the count is not `expected`), `OutOfStock` (below zero), the key used with
/// another body; nothing is written by any of them.
pub(crate) async fn adjust(
    tx: &mut Tx,
    req: &AdjustmentRequest,
) -> Result<(Adjusted, bool), CheckoutError> {
    let fp = req.fingerprint();
    if let Some(done) = adjusted_by_key(tx, &req.key, &fp).await? {
        return Ok((done, false));
    }
    let product = req.product.as_str();
    let location = req.location.as_str();
    if crate::checkout::tx::lock(tx, &[product]).await?.is_empty() {
        return Err(CheckoutError::ProductNotFound);
    }
    // A concurrent request with this key held the lock before us: its answer is ours.
    if let Some(done) = adjusted_by_key(tx, &req.key, &fp).await? {
        return Ok((done, false));
    }
    ensure(tx, product, &[location]).await?;
    let count: i32 = sqlx::query_scalar(
        "SELECT available_quantity FROM stock_levels WHERE product_id = $1 AND location_id = $2",
    )
    .bind(product)
    .bind(location)
    .fetch_one(&mut **tx)
    .await?;
    if req.expected.is_some_and(|e| e != count) {
        return Err(CheckoutError::StockChanged { available: count });
    }
    let delta = match req.change {
        Adjust::Delta(d) => d,
        Adjust::Set(s) => s - count,
    };
    let change = Change {
        reason: req.reason.as_str(),
        reference: None,
        note: req.note.as_deref(),
        key: Some((req.key.as_str(), &fp)),
    };
    let Some(moved) = add(tx, product, location, delta, change).await? else {
        return Err(CheckoutError::OutOfStock);
    };
    Ok((
        Adjusted {
            product_id: product.to_owned(),
            location_id: location.to_owned(),
            available_quantity: moved.available_quantity,
            movement_id: moved.movement_id.to_string(),
        },
        true,
    ))
}

/// The key's adjustment, when it made one: its answer for the same body, else `KeyReused`.
async fn adjusted_by_key(
    tx: &mut Tx,
    key: &IdempotencyKey,
    fingerprint: &str,
) -> Result<Option<Adjusted>, CheckoutError> {
    let row: Option<(Adjusted, String)> = sqlx::query_as(
        "SELECT product_id, location_id, available_after, movement_id::text, request_fingerprint \
           FROM movements WHERE idempotency_key = $1",
    )
    .bind(key.as_str())
    .fetch_optional(&mut **tx)
    .await?
    .map(
        |(product_id, location_id, available_quantity, movement_id, fp)| {
            (
                Adjusted {
                    product_id,
                    location_id,
                    available_quantity,
                    movement_id,
                },
                fp,
            )
        },
    );
    match row {
        None => Ok(None),
        Some((done, fp)) if fp == fingerprint => Ok(Some(done)),
        Some(_) => Err(CheckoutError::KeyReused),
    }
}

/// A movement as the API states it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Movement {
    /// Opaque; ascending in the order the movements committed.
    pub movement_id: String,
    pub at: DateTime<Utc>,
    #[schema(value_type = String)]
    pub location_id: String,
    pub delta: i32,
    /// `create`, `restock`, `import`, `transfer_out`, `transfer_in` or an adjustment's reason.
    pub reason: String,
    /// The transfer or import it belongs to.
    #[serde(rename = "ref")]
    #[sqlx(rename = "ref")]
    pub reference: Option<String>,
    pub note: Option<String>,
}

/// A product's movements after `after` (a movement id), oldest first, at most `limit`, at
/// `location` or everywhere. Every writer of a product's levels holds its row lock when it
/// takes an id, so ids grow in commit order per product and a cursor skips nothing.
pub(crate) async fn movements(
    exec: impl sqlx::PgExecutor<'_>,
    product: &ProductId,
    location: Option<&LocationId>,
    after: i64,
    limit: i64,
) -> Result<Vec<Movement>, sqlx::Error> {
    sqlx::query_as(
        "SELECT movement_id::text, at, location_id, delta, reason, ref, note FROM movements \
          WHERE product_id = $1 AND ($2::text IS NULL OR location_id = $2) AND movement_id > $3 \
          ORDER BY movement_id LIMIT $4",
    )
    .bind(product.as_str())
    .bind(location.map(LocationId::as_str))
    .bind(after)
    .bind(limit)
    .fetch_all(exec)
    .await
}
