//! One order batch: one primary transaction for a product's queued orders, in four stages
//! and four round trips (BEGIN, lock + lookup, insert + take, COMMIT), since the row lock
//! is held, and the next batch waits, from the second to the last.
//!
//! 1. **allocate** (pure, after one statement): lock the product row (`FOR NO KEY UPDATE`:
//!    batches take turns, while inserts that merely reference the product — refusals — are
//!    not held up) and, in the same statement, read what the batch's keys already hold (on
//!    any product); then seat the rest in arrival order: a seat for each request that fits,
//!    a refusal for each that does not. A key already used answers as it did (the order,
//!    the refusal, or 422 for another body) and takes nothing, so it never displaces an
//!    honest buyer.
//! 2. **insert**: one `INSERT … ON CONFLICT DO NOTHING` claims every new key — seats as
//!    `confirmed` orders, refusals as `refused` rows — in (user, key) order, the one lock
//!    order every batch and refusal shares, so two batches never deadlock on keys.
//! 3. **settle**: a key that a concurrent transaction claimed (including one the lookup
//!    could not see: its snapshot predates the wait for the lock) makes our insert conflict
//!    and is decided later from the primary; the units its seat held go to refused requests
//!    of this batch, in arrival order (their rows are ours, uncommitted, so flipping them
//!    takes no new lock; a fifth round trip, only then).
//! 4. **take**: ONE guarded `UPDATE … WHERE available_quantity >= $total` for the total of
//!    the confirmed rows that actually went in, in the same statement as the insert (a
//!    data-modifying CTE, [`take_cte`]); a guard that changes no row rolls the whole batch
//!    back. Then COMMIT: an error on COMMIT means "outcome unknown", never "nothing written".

use super::idempotency::{Existing, Held, held_under, judge, key_of};
use super::{CheckoutError, Order, OrderRequest, Placed, REFUSED, commit, order_columns};
use crate::domain::ProductId;
use crate::routing::{Db, DbError};
use std::collections::HashMap;
use std::time::Instant;
use uuid::Uuid;

/// What the allocation decided for one request.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Plan {
    /// Decided by what its key already holds, or by a rule; writes nothing.
    Known(Result<Placed, PlanError>),
    /// A seat: inserted as a `confirmed` order.
    Seat,
    /// Not enough stock: inserted as a `refused` claim on its key.
    Refuse,
    /// The same key and body as the earlier request at this index: shares its fate.
    SameAs(usize),
}

/// The errors a plan can hold (`CheckoutError` is not `Clone`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum PlanError {
    OutOfStock,
    KeyReused,
}

impl From<PlanError> for CheckoutError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::OutOfStock => CheckoutError::OutOfStock,
            PlanError::KeyReused => CheckoutError::KeyReused,
        }
    }
}

/// One request's fate once the batch committed.
#[derive(Debug)]
pub(super) enum Fate {
    Decided(Result<Placed, CheckoutError>),
    /// Its key was claimed by a concurrent transaction: read its answer from the primary.
    Contended,
}

/// A batch that did not commit.
#[derive(Debug)]
pub(super) enum Failed {
    /// Rolled back (or never began): nothing was written.
    NothingWritten(DbError),
    /// COMMIT's outcome is unknown.
    Unknown,
}

/// What a committed batch decided: a fate per request, and what it saw of the product's
/// row, unless the product does not exist.
pub(super) struct Committed {
    pub fates: Vec<Fate>,
    pub row: Option<RowSeen>,
}

/// The product's row as a committed batch saw it.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowSeen {
    /// The stock when the batch locked the row.
    pub found: i32,
    /// The stock it left.
    pub left: i32,
    /// When the row lock was taken: the stock figures are exact from then.
    pub locked_at: Instant,
}

/// Stage 1, pure: seats in arrival order, given what the keys already hold and the stock.
pub(super) fn allocate(reqs: &[&OrderRequest], existing: &Held, stock: i32) -> Vec<Plan> {
    let mut left = stock;
    let mut first: HashMap<(&str, &str), usize> = HashMap::new();
    let mut plans = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        if let Some(&f) = first.get(&r.key_pair()) {
            plans.push(if reqs[f].fingerprint() == r.fingerprint() {
                Plan::SameAs(f)
            } else {
                Plan::Known(Err(PlanError::KeyReused))
            });
            continue;
        }
        first.insert(r.key_pair(), i);
        let held = existing.get(&key_of(r));
        plans.push(match judge(r, held) {
            Ok(Some(placed)) => Plan::Known(Ok(placed)),
            Err(CheckoutError::KeyReused) => Plan::Known(Err(PlanError::KeyReused)),
            Err(_) => Plan::Known(Err(PlanError::OutOfStock)),
            Ok(None) if r.quantity.get() <= left => {
                left -= r.quantity.get();
                Plan::Seat
            }
            Ok(None) => Plan::Refuse,
        });
    }
    plans
}

/// Stage 3, pure: which refused requests take the units that contended seats left, in
/// arrival order. `inserted[i]` says whether request i's row went in.
pub(super) fn reseat(
    reqs: &[&OrderRequest],
    plans: &[Plan],
    inserted: &[bool],
    stock: i32,
) -> Vec<usize> {
    let seated: i32 = (0..reqs.len())
        .filter(|&i| plans[i] == Plan::Seat && inserted[i])
        .map(|i| reqs[i].quantity.get())
        .sum();
    let mut left = stock - seated;
    let mut flipped = Vec::new();
    for i in 0..reqs.len() {
        if plans[i] == Plan::Refuse && inserted[i] && reqs[i].quantity.get() <= left {
            left -= reqs[i].quantity.get();
            flipped.push(i);
        }
    }
    flipped
}

/// The guarded UPDATE, as the `take` CTE of the statement whose rows (`$rows`, a CTE
/// returning order columns) it pays for: it takes the confirmed rows' total from product `$1`
/// only `WHERE available_quantity >= total`, and returns the stock it left. It is the only
/// thing that confirms: a batch whose confirmed rows it did not pay for rolls back. (A macro,
/// so both statements that use it stay string literals.)
macro_rules! take_cte {
    ($rows:literal) => {
        concat!(
            "take AS (UPDATE products SET available_quantity = available_quantity - t.total, \
             updated_at = clock_timestamp() \
             FROM (SELECT sum(quantity) AS total FROM ",
            $rows,
            " WHERE status = 'confirmed') t \
             WHERE product_id = $1 AND t.total > 0 AND available_quantity >= t.total \
             RETURNING available_quantity)"
        )
    };
}

/// The product row as the batch locked it, and what the batch's keys already hold.
struct Locked {
    stock: i32,
    price: i32,
    existing: Held,
    at: Instant,
}

/// An order row a statement wrote, with the stock its guarded UPDATE left (`None`: it
/// took nothing).
#[derive(sqlx::FromRow)]
struct Written {
    #[sqlx(flatten)]
    order: Order,
    left_after: Option<i32>,
}

/// The rows one writing statement returned, by request index, and the stock its guarded
/// UPDATE left (`None`: it took nothing).
struct Took {
    rows: HashMap<usize, Order>,
    left: Option<i32>,
}

/// Runs the batch's transaction: BEGIN, lock + key lookup, insert + guarded UPDATE, COMMIT
/// (a fifth statement only when a concurrently claimed key freed units to reseat).
pub(super) async fn run(
    db: &Db,
    product: &ProductId,
    reqs: &[&OrderRequest],
) -> Result<Committed, Failed> {
    let nothing = |e: sqlx::Error| Failed::NothingWritten(e.into());
    let mut tx = db.primary().begin().await.map_err(Failed::NothingWritten)?;
    let Some(locked) = lock(&mut tx, product, reqs).await.map_err(nothing)? else {
        let _ = tx.rollback().await;
        let fates = reqs
            .iter()
            .map(|_| Fate::Decided(Err(CheckoutError::ProductNotFound)))
            .collect();
        return Ok(Committed { fates, row: None });
    };
    let plans = allocate(reqs, &locked.existing, locked.stock);
    let written = insert(&mut tx, product, locked.price, reqs, &plans)
        .await
        .map_err(nothing);
    let (mut rows, mut left) = match written.and_then(paid) {
        Ok(took) => (took.rows, took.left),
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e);
        }
    };
    let inserted: Vec<bool> = (0..reqs.len()).map(|i| rows.contains_key(&i)).collect();
    let flipped = reseat(reqs, &plans, &inserted, locked.stock);
    if !flipped.is_empty() {
        let confirmed = confirm(&mut tx, product, locked.price, &flipped, &rows)
            .await
            .map_err(nothing);
        match confirmed.and_then(paid) {
            Ok(took) => {
                left = took.left.or(left);
                rows.extend(took.rows);
            }
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(e);
            }
        }
    }
    commit(tx).await.map_err(|_| Failed::Unknown)?;
    Ok(Committed {
        fates: settle(&plans, rows),
        row: Some(RowSeen {
            found: locked.stock,
            left: left.unwrap_or(locked.stock),
            locked_at: locked.at,
        }),
    })
}

/// Stage 1's statement: locks the product row (`FOR NO KEY UPDATE`) and reads what the
/// batch's keys already hold, in one round trip. `None`: no such product.
///
/// Under READ COMMITTED the statement's snapshot is taken before it waits for the row lock,
/// so a key committed by the batch it waited for may be missing here (the stock is not: a
/// locked row is re-read at its newest version). Such a key cannot be claimed twice: stage
/// 2's insert conflicts on it, and its request is decided later from the primary.
async fn lock(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    product: &ProductId,
    reqs: &[&OrderRequest],
) -> Result<Option<Locked>, sqlx::Error> {
    use sqlx::{FromRow, Row};
    let (users, keys): (Vec<&str>, Vec<&str>) = reqs.iter().map(|r| r.key_pair()).unzip();
    let found = sqlx::query(concat!(
        "SELECT p.available_quantity AS stock, p.price_cents AS price, e.* \
         FROM (SELECT available_quantity, price_cents FROM products \
               WHERE product_id = $1 FOR NO KEY UPDATE) p \
         LEFT JOIN LATERAL (",
        held_under!("$2", "$3"),
        ") e ON true"
    ))
    .bind(product.as_str())
    .bind(&users)
    .bind(&keys)
    .fetch_all(&mut **tx)
    .await?;
    let at = Instant::now();
    let Some(first) = found.first() else {
        return Ok(None);
    };
    let mut existing = HashMap::new();
    for row in &found {
        if row.try_get::<Option<Uuid>, _>("order_id")?.is_some() {
            let e = Existing::from_row(row)?;
            existing.insert(e.key(), e);
        }
    }
    Ok(Some(Locked {
        stock: first.try_get("stock")?,
        price: first.try_get("price")?,
        existing,
        at,
    }))
}

/// Checks a writing statement's guard — every confirmed row it wrote was paid for by its
/// guarded UPDATE, or nothing may commit — and files its rows by request index (`index`:
/// the request each written order id belongs to).
fn paid((index, written): (HashMap<Uuid, usize>, Vec<Written>)) -> Result<Took, Failed> {
    let total: i64 = written
        .iter()
        .filter(|w| w.order.status == "confirmed")
        .filter_map(|w| w.order.quantity.map(i64::from))
        .sum();
    let left = written.first().and_then(|w| w.left_after);
    if total > 0 && left.is_none() {
        // Cannot happen while we hold the row lock; if it did, nothing may commit.
        return Err(Failed::NothingWritten(DbError::Internal(
            "the guarded stock update changed no row; the batch was rolled back".into(),
        )));
    }
    let rows = written
        .into_iter()
        .filter_map(|w| index.get(&w.order.order_id).map(|&i| (i, w.order)))
        .collect();
    Ok(Took { rows, left })
}

/// Stage 2 and 4 in one statement: one INSERT claiming every new key, seats and refusals,
/// in (user, key) order, and the guarded UPDATE for the seats that went in. Returns the
/// rows that went in, and which request each order id is.
async fn insert(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    product: &ProductId,
    price: i32,
    reqs: &[&OrderRequest],
    plans: &[Plan],
) -> Result<(HashMap<Uuid, usize>, Vec<Written>), sqlx::Error> {
    let mut new: Vec<usize> = (0..reqs.len())
        .filter(|&i| matches!(plans[i], Plan::Seat | Plan::Refuse))
        .collect();
    if new.is_empty() {
        return Ok((HashMap::new(), Vec::new()));
    }
    new.sort_by(|&a, &b| reqs[a].key_pair().cmp(&reqs[b].key_pair()));
    let ids: Vec<Uuid> = new.iter().map(|_| Uuid::new_v4()).collect();
    let users: Vec<&str> = new.iter().map(|&i| reqs[i].user.as_str()).collect();
    let keys: Vec<&str> = new.iter().map(|&i| reqs[i].key.as_str()).collect();
    let qty: Vec<i32> = new.iter().map(|&i| reqs[i].quantity.get()).collect();
    let fps: Vec<String> = new.iter().map(|&i| reqs[i].fingerprint()).collect();
    let status: Vec<&str> = new
        .iter()
        .map(|&i| match plans[i] {
            Plan::Seat => "confirmed",
            _ => REFUSED,
        })
        .collect();
    let written: Vec<Written> = sqlx::query_as(concat!(
        "WITH ins AS (INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
         SELECT o.order_id, $1, o.user_id, o.quantity, \
                CASE WHEN o.status = 'confirmed' THEN $2 ELSE 0 END, \
                CASE WHEN o.status = 'confirmed' THEN $2::int8 * o.quantity ELSE 0 END, \
                o.status, o.idempotency_key, o.fingerprint \
         FROM UNNEST($3::uuid[], $4::text[], $5::int4[], $6::text[], $7::text[], $8::text[]) \
              WITH ORDINALITY AS o(order_id, user_id, quantity, idempotency_key, fingerprint, status, n) \
         ORDER BY o.n \
         ON CONFLICT (user_id, idempotency_key) DO NOTHING \
         RETURNING ",
        order_columns!(),
        "), ",
        take_cte!("ins"),
        " SELECT ins.*, take.available_quantity AS left_after FROM ins LEFT JOIN take ON true"
    ))
    .bind(product.as_str())
    .bind(price)
    .bind(&ids)
    .bind(&users)
    .bind(&qty)
    .bind(&keys)
    .bind(&fps)
    .bind(&status)
    .fetch_all(&mut **tx)
    .await?;
    Ok((ids.into_iter().zip(new).collect(), written))
}

/// Stage 3's reseating: turns this batch's own refused rows into confirmed orders, and
/// takes their units with the guarded UPDATE, in one statement.
async fn confirm(
    tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    product: &ProductId,
    price: i32,
    flipped: &[usize],
    rows: &HashMap<usize, Order>,
) -> Result<(HashMap<Uuid, usize>, Vec<Written>), sqlx::Error> {
    let ids: Vec<Uuid> = flipped.iter().map(|i| rows[i].order_id).collect();
    let written = sqlx::query_as(concat!(
        "WITH c AS (UPDATE orders SET status = 'confirmed', unit_price_cents = $2, total_cents = $2::int8 * quantity \
         WHERE order_id = ANY($3) AND status = 'refused' RETURNING ",
        order_columns!(),
        "), ",
        take_cte!("c"),
        " SELECT c.*, take.available_quantity AS left_after FROM c LEFT JOIN take ON true"
    ))
    .bind(product.as_str())
    .bind(price)
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    Ok((
        ids.into_iter().zip(flipped.iter().copied()).collect(),
        written,
    ))
}

/// Each request's fate from its plan and the row it inserted (if any).
fn settle(plans: &[Plan], mut rows: HashMap<usize, Order>) -> Vec<Fate> {
    let mut fates: Vec<Fate> = Vec::with_capacity(plans.len());
    for (i, plan) in plans.iter().enumerate() {
        let fate = match plan {
            Plan::Known(r) => Fate::Decided(r.clone().map_err(Into::into)),
            Plan::Seat | Plan::Refuse => match rows.remove(&i) {
                Some(o) if o.status == "confirmed" => {
                    Fate::Decided(Ok(Placed::Created(o.complete())))
                }
                Some(_) => Fate::Decided(Err(CheckoutError::OutOfStock)),
                None => Fate::Contended,
            },
            Plan::SameAs(f) => match &fates[*f] {
                Fate::Decided(Ok(Placed::Created(o) | Placed::Replayed(o))) => {
                    Fate::Decided(Ok(Placed::Replayed(o.clone())))
                }
                Fate::Decided(Err(CheckoutError::KeyReused)) => {
                    Fate::Decided(Err(CheckoutError::KeyReused))
                }
                Fate::Decided(Err(_)) => Fate::Decided(Err(CheckoutError::OutOfStock)),
                Fate::Contended => Fate::Contended,
            },
        };
        fates.push(fate);
    }
    fates
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkout::idempotency::Key;
    use crate::domain::{IdempotencyKey, Quantity, UserId};

    fn req(user: &str, key: &str, product: &str, qty: i64) -> OrderRequest {
        OrderRequest {
            user: UserId::parse(user).expect("valid"),
            product: ProductId::parse(product).expect("valid"),
            quantity: Quantity::parse(&qty.into()).expect("valid"),
            key: IdempotencyKey::parse(key).expect("valid"),
        }
    }

    fn held(r: &OrderRequest, product: &str, status: &str) -> (Key, Existing) {
        let order = Order {
            order_id: Uuid::new_v4(),
            product_id: Some(product.into()),
            quantity: Some(r.quantity.get()),
            unit_price_cents: 0,
            lines: vec![],
            user_id: r.user.as_str().into(),
            status: status.into(),
            total_cents: 0,
            created_at: chrono::Utc::now(),
            cancelled_at: None,
        };
        (
            (r.user.as_str().into(), r.key.as_str().into()),
            Existing {
                idempotency_key: r.key.as_str().into(),
                request_fingerprint: format!("{product}:{}", r.quantity.get()),
                order,
            },
        )
    }

    #[test]
    fn a_key_reused_from_another_product_takes_nothing_and_displaces_no_one() {
        // The reuser asks for all 20 units with a key already used on another product.
        let reuser = req("ada", "k", "p2", 20);
        let honest: Vec<OrderRequest> = (0..20)
            .map(|i| req(&format!("b{i}"), "k", "p2", 1))
            .collect();
        let mut reqs: Vec<&OrderRequest> = vec![&reuser];
        reqs.extend(honest.iter());
        let existing: HashMap<_, _> = [held(&req("ada", "k", "p1", 1), "p1", "confirmed")].into();
        let plans = allocate(&reqs, &existing, 20);
        assert_eq!(plans[0], Plan::Known(Err(PlanError::KeyReused)));
        assert!(plans[1..].iter().all(|p| *p == Plan::Seat), "{plans:?}");
    }

    #[test]
    fn seats_go_in_arrival_order_and_the_rest_are_refused() {
        let rs = [
            req("a", "1", "p", 3),
            req("b", "1", "p", 3),
            req("c", "1", "p", 1),
        ];
        let reqs: Vec<&OrderRequest> = rs.iter().collect();
        let plans = allocate(&reqs, &HashMap::new(), 4);
        assert_eq!(plans, vec![Plan::Seat, Plan::Refuse, Plan::Seat]);
    }

    #[test]
    fn a_refused_key_stays_refused_and_a_placed_key_replays() {
        let refused = req("a", "1", "p", 1);
        let placed = req("b", "1", "p", 1);
        let existing: HashMap<_, _> = [
            held(&refused, "p", REFUSED),
            held(&placed, "p", "confirmed"),
        ]
        .into();
        let plans = allocate(&[&refused, &placed], &existing, 100);
        assert_eq!(plans[0], Plan::Known(Err(PlanError::OutOfStock)));
        assert!(matches!(plans[1], Plan::Known(Ok(Placed::Replayed(_)))));
    }

    #[test]
    fn duplicates_in_a_batch_share_a_fate_and_another_body_is_refused_422() {
        let a = req("a", "1", "p", 1);
        let again = req("a", "1", "p", 1);
        let other = req("a", "1", "p", 2);
        let plans = allocate(&[&a, &again, &other], &HashMap::new(), 10);
        assert_eq!(
            plans,
            vec![
                Plan::Seat,
                Plan::SameAs(0),
                Plan::Known(Err(PlanError::KeyReused))
            ]
        );
    }

    #[test]
    fn units_of_a_contended_seat_go_to_the_refused_in_arrival_order() {
        let rs = [
            req("a", "1", "p", 2),
            req("b", "1", "p", 1),
            req("c", "1", "p", 1),
        ];
        let reqs: Vec<&OrderRequest> = rs.iter().collect();
        let plans = allocate(&reqs, &HashMap::new(), 2);
        assert_eq!(plans, vec![Plan::Seat, Plan::Refuse, Plan::Refuse]);
        // a's key was claimed concurrently: its 2 units go to b then c.
        assert_eq!(reseat(&reqs, &plans, &[false, true, true], 2), vec![1, 2]);
        // Nothing contended: nobody moves.
        assert!(reseat(&reqs, &plans, &[true, true, true], 2).is_empty());
    }
}
