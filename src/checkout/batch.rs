//! One order statement: one round trip, its own transaction, the batch of one product
//! (`take_order_batch_v3`) or the batches of several (`take_order_batches_v3`), both in
//! migration `20261203000006_order_batches_v3.sql`. Each locks its product rows, in byte
//! order. A product with no limit, on sale, and stock for its whole batch is seated
//! set-based: every new key claimed in one `INSERT … ON CONFLICT DO NOTHING`, the units of
//! the rows inserted taken with ONE guarded `UPDATE … WHERE available_quantity >= total` (a
//! guard that changes no row raises, and nothing commits). Any other product runs
//! `take_order_batch_v2` (migration `20261202000005_flash_drops.sql`): its sale window
//! judged, its requests seated in arrival order (first fit, stock then each user's
//! allowance), the units of a seat whose key a concurrent transaction claimed handed to its
//! refused requests. Both return what every request's key holds now. The row locks are held
//! only while the function runs and its commit is flushed: no round trip to this service
//! happens under them.
//!
//! Here, each request is answered from what its key holds ([`decide`]): the order this batch
//! wrote (201), the refusal it wrote (409), nothing before the sale starts (409
//! `SALE_NOT_STARTED`, the key stays free), or what was there before or was claimed
//! concurrently, judged by the idempotency rule (the order again, the refusal again, or 422
//! for another body). A repeat of an earlier request's key in the same batch never takes a
//! seat and is judged the same way, against what the key holds: the same body as the row
//! gets that row's answer, whatever body an earlier request of the batch carried.
//!
//! The statement is its own transaction, so an error the server reports means it rolled
//! back (nothing written), while a link that fails after the statement was sent leaves the
//! outcome unknown.

use super::drops::Window;
use super::error::CheckoutError;
use super::idempotency::{Existing, judge};
use super::order::{OrderRequest, Placed};
use super::status::OrderStatus;
use crate::domain::ProductId;
use crate::routing::{Db, DbError};
use sqlx::Row;
use sqlx::postgres::PgRow;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// A batch that did not commit.
#[derive(Debug)]
pub(super) enum Failed {
    /// Rolled back (or never sent): nothing was written.
    NothingWritten(DbError),
    /// The statement's outcome is unknown.
    Unknown,
}

/// What a committed batch decided: an answer per request, and what it saw of the product's
/// row, unless the product does not exist.
pub(super) struct Committed {
    pub fates: Vec<Result<Placed, CheckoutError>>,
    pub row: Option<RowSeen>,
}

/// The product's row as a committed batch saw it.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowSeen {
    /// The stock when the batch locked the row.
    pub found: i32,
    /// The stock it left.
    pub left: i32,
    /// No later than the moment the row lock was taken ([`locked_at`]): the stock figures
    /// are exact from then.
    pub locked_at: Instant,
    /// The product's sale window.
    pub window: Window,
}

/// Runs one product's batch: one call of `take_order_batch_v3` on the primary.
pub(super) async fn run(
    db: &Db,
    product: &ProductId,
    reqs: &[&OrderRequest],
) -> Result<Committed, Failed> {
    let ids: Vec<Uuid> = reqs.iter().map(|_| super::order::new_row_id()).collect();
    let (users, keys): (Vec<&str>, Vec<&str>) = reqs.iter().map(|r| r.key_pair()).unzip();
    let qty: Vec<i32> = reqs.iter().map(|r| r.quantity.get()).collect();
    let fps: Vec<String> = reqs.iter().map(|r| r.fingerprint()).collect();
    let statement = sqlx::query("SELECT * FROM take_order_batch_v3($1, $2, $3, $4, $5, $6)")
        .bind(product.as_str())
        .bind(&ids)
        .bind(&users)
        .bind(&keys)
        .bind(&qty)
        .bind(&fps);
    let (rows, sent, arrived) = send(db, statement).await?;
    let rows: Vec<&PgRow> = rows.iter().collect();
    read(reqs, &ids, &rows, sent, arrived).map_err(|e| {
        // Committed, but its answer cannot be read: every request must retry with its key.
        tracing::warn!(error = %e, "order batch's answer could not be read");
        Failed::Unknown
    })
}

/// How long a combined statement may wait for one of its rows' locks before it gives up
/// (55P03, nothing written) and its batches run one by one: a few times a statement's own
/// time under load, so two instances' batches of a hot product still meet in the row's
/// queue, while a row held by a long transaction delays the other products that little.
pub(super) const COMBINED_LOCK_WAIT: Duration = Duration::from_millis(100);

/// The combined statement. It waits at most [`COMBINED_LOCK_WAIT`] (`$8`) for any of its
/// rows (`set_config(…, true)` lasts for this statement's own transaction, and the LATERAL
/// reference makes it run before the function): one product's row held elsewhere must not
/// hold up the others it carries. Past it, nothing was written, and the coalescer runs the
/// batches one by one, so only the held product's batch waits.
const COMBINED: &str = "SELECT f.* FROM (SELECT set_config('lock_timeout', $8, true) AS t) s \
     CROSS JOIN LATERAL take_order_batches_v3(CASE WHEN s.t IS NOT NULL THEN $1::text[] END, \
                                              $2, $3, $4, $5, $6, $7) f";

/// Runs the batches of several products (each once) as one statement, one transaction, one
/// commit: `take_order_batches_v3`, which locks every product row in byte
/// order, seats the products whose whole batch fits (no limit or window to judge) together,
/// and runs `take_order_batch_v2` for the others. Every batch's answer, in `jobs`' order, or
/// the statement's failure for all of them (an error anywhere rolls every batch back).
pub(super) async fn run_many(
    db: &Db,
    jobs: &[(&ProductId, Vec<&OrderRequest>)],
) -> Result<Vec<Committed>, Failed> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| jobs[a].0.as_str().cmp(jobs[b].0.as_str()));
    let total = jobs.iter().map(|(_, r)| r.len()).sum();
    let (mut products, mut ends) = (
        Vec::with_capacity(jobs.len()),
        Vec::with_capacity(jobs.len()),
    );
    let mut users: Vec<&str> = Vec::with_capacity(total);
    let mut keys: Vec<&str> = Vec::with_capacity(total);
    let mut qty: Vec<i32> = Vec::with_capacity(total);
    let mut fps: Vec<String> = Vec::with_capacity(total);
    for &j in &order {
        let (product, reqs) = &jobs[j];
        products.push(product.as_str());
        for r in reqs {
            let (u, k) = r.key_pair();
            users.push(u);
            keys.push(k);
            qty.push(r.quantity.get());
            fps.push(r.fingerprint());
        }
        ends.push(i32::try_from(users.len()).unwrap_or(i32::MAX));
    }
    let ids: Vec<Uuid> = (0..total).map(|_| super::order::new_row_id()).collect();
    let statement = sqlx::query(COMBINED)
        .bind(&products)
        .bind(&ends)
        .bind(&ids)
        .bind(&users)
        .bind(&keys)
        .bind(&qty)
        .bind(&fps)
        .bind(format!("{}ms", COMBINED_LOCK_WAIT.as_millis()));
    let (rows, sent, arrived) = send(db, statement).await?;
    let mut by_product: HashMap<&str, Vec<&PgRow>> = HashMap::new();
    for row in &rows {
        let product: &str = row.try_get("batch_product").map_err(|_| Failed::Unknown)?;
        by_product.entry(product).or_default().push(row);
    }
    // Each job's slice of the ids, by the position its product took.
    let mut first_id = vec![0; jobs.len()];
    let mut at = 0;
    for &j in &order {
        first_id[j] = at;
        at += jobs[j].1.len();
    }
    jobs.iter()
        .enumerate()
        .map(|(j, (product, reqs))| {
            let mine = by_product
                .get(product.as_str())
                .map_or(&[][..], Vec::as_slice);
            let ids = &ids[first_id[j]..first_id[j] + reqs.len()];
            read(reqs, ids, mine, sent, arrived).map_err(|e| {
                tracing::warn!(error = %e, "a combined order batch's answer could not be read");
                Failed::Unknown
            })
        })
        .collect()
}

/// Sends a batch statement on a primary connection of its own: its rows, when it was sent, and
/// when its answer arrived. The statement is its own transaction: an error the server reports
/// means it rolled back (nothing written); a link that fails after it was sent leaves the
/// outcome unknown.
async fn send<'q>(
    db: &Db,
    statement: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<(Vec<PgRow>, Instant, Instant), Failed> {
    let mut conn = db
        .primary()
        .acquire()
        .await
        .map_err(Failed::NothingWritten)?;
    let sent = Instant::now();
    let rows = statement.fetch_all(&mut *conn).await.map_err(|e| match e {
        sqlx::Error::Database(_) => Failed::NothingWritten(e.into()),
        e => {
            tracing::warn!(error = %e, "an order batch lost its link; its outcome is unknown");
            Failed::Unknown
        }
    })?;
    Ok((rows, sent, Instant::now()))
}

/// Reads the function's rows (none: no such product) into every request's answer.
fn read(
    reqs: &[&OrderRequest],
    ids: &[Uuid],
    rows: &[&PgRow],
    sent: Instant,
    arrived: Instant,
) -> Result<Committed, sqlx::Error> {
    use sqlx::FromRow;
    let Some(first) = rows.first() else {
        let fates = reqs
            .iter()
            .map(|_| Err(CheckoutError::ProductNotFound))
            .collect();
        return Ok(Committed { fates, row: None });
    };
    let waited = u64::try_from(first.try_get::<i64, _>("lock_wait_us")?).unwrap_or(0);
    let row = RowSeen {
        found: first.try_get("found")?,
        left: first.try_get("left_after")?,
        locked_at: locked_at(sent, Duration::from_micros(waited), arrived),
        window: Window {
            starts: first.try_get("sale_starts_at")?,
            ends: first.try_get("sale_ends_at")?,
        },
    };
    let starts_in: Option<i64> = first.try_get("starts_in_ms")?;
    let mut held: Vec<Option<Existing>> = vec![None; reqs.len()];
    for r in rows {
        let n: i64 = r.try_get("n")?;
        let slot = usize::try_from(n - 1).ok().and_then(|i| held.get_mut(i));
        let Some(slot) = slot else {
            return Err(sqlx::Error::Protocol(format!(
                "a row for request {n} of {}",
                reqs.len()
            )));
        };
        if r.try_get::<Option<Uuid>, _>("order_id")?.is_some() {
            *slot = Some(Existing::from_row(*r)?);
        }
    }
    Ok(Committed {
        fates: decide(reqs, ids, held, starts_in),
        row: Some(row),
    })
}

/// When the batch took the row lock, on this service's clock: the send time plus the wait the
/// server measured, but never after the reply arrived. The wait comes from the server's
/// `clock_timestamp()`; a clock stepped forward under the statement would otherwise date the
/// stock after the moment it was read, and the gate cache would serve it as fresh for longer
/// than its budget.
fn locked_at(sent: Instant, waited: Duration, arrived: Instant) -> Instant {
    sent.checked_add(waited).unwrap_or(arrived).min(arrived)
}

/// Each request's answer from what its key holds now (`held[i]`, by arrival order) and the
/// order id it was offered (`ids[i]`): a confirmed row with that id is this batch's new order;
/// any other row (our own refusal, what the key held before, a concurrent claim, or, for a
/// repeat of an earlier request's key, the row that request wrote) is judged like a retry,
/// against the row's body. Never against another request of the batch: a wrong body queued
/// ahead of an honest retry must not turn the retry's answer into 422. Before the sale starts
/// (`starts_in`, ms) a key that holds nothing was left free: `SALE_NOT_STARTED`.
pub(super) fn decide(
    reqs: &[&OrderRequest],
    ids: &[Uuid],
    held: Vec<Option<Existing>>,
    starts_in: Option<i64>,
) -> Vec<Result<Placed, CheckoutError>> {
    let mut fates = Vec::with_capacity(reqs.len());
    for (i, (r, now)) in reqs.iter().zip(held).enumerate() {
        let fate = match now {
            Some(e) if e.order.order_id == ids[i] && e.order.status != OrderStatus::Refused => {
                Ok(Placed::Created(e.order.complete()))
            }
            found => judge(r, found.as_ref()).and_then(|p| {
                p.ok_or(match starts_in {
                    Some(retry_after_ms) => CheckoutError::SaleNotStarted { retry_after_ms },
                    None => CheckoutError::OutcomeUnknown,
                })
            }),
        };
        fates.push(fate);
    }
    fates
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkout::Order;
    use crate::domain::{IdempotencyKey, Quantity, UserId};

    fn req(user: &str, key: &str, product: &str, qty: i64) -> OrderRequest {
        OrderRequest {
            user: UserId::parse(user).expect("valid"),
            product: ProductId::parse(product).expect("valid"),
            quantity: Quantity::parse(&qty.into()).expect("valid"),
            key: IdempotencyKey::parse(key).expect("valid"),
        }
    }

    /// What `r`'s key holds: a row with order id `id`, placed for `product` with `r`'s
    /// quantity, in `status`.
    fn held(r: &OrderRequest, id: Uuid, product: &str, status: OrderStatus) -> Option<Existing> {
        Some(Existing {
            idempotency_key: r.key.as_str().into(),
            request_fingerprint: format!("{product}:{}", r.quantity.get()),
            refusal: None,
            order: Order {
                order_id: id,
                product_id: Some(product.into()),
                quantity: Some(r.quantity.get()),
                unit_price_cents: 0,
                lines: vec![],
                user_id: r.user.as_str().into(),
                status,
                total_cents: 0,
                created_at: chrono::Utc::now(),
                cancelled_at: None,
            },
        })
    }

    fn ids(n: usize) -> Vec<Uuid> {
        (0..n).map(|_| Uuid::new_v4()).collect()
    }

    #[test]
    fn the_rows_this_batch_wrote_answer_201_or_409() {
        let (a, b) = (req("a", "1", "p", 1), req("b", "1", "p", 1));
        let id = ids(2);
        let fates = decide(
            &[&a, &b],
            &id,
            vec![
                held(&a, id[0], "p", OrderStatus::Confirmed),
                held(&b, id[1], "p", OrderStatus::Refused),
            ],
            None,
        );
        assert!(
            matches!(&fates[0], Ok(Placed::Created(o)) if o.order_id == id[0] && o.lines.len() == 1)
        );
        assert!(matches!(fates[1], Err(CheckoutError::OutOfStock)));
    }

    #[test]
    fn a_key_that_held_something_else_is_judged_like_a_retry() {
        let (a, b, c) = (
            req("a", "1", "p", 1),
            req("b", "1", "p", 1),
            req("c", "1", "p", 1),
        );
        let id = ids(3);
        let before = Uuid::new_v4();
        let fates = decide(
            &[&a, &b, &c],
            &id,
            vec![
                // The same body placed before (here, or concurrently on another instance).
                held(&a, before, "p", OrderStatus::Confirmed),
                // The key was used on another product: 422, nothing taken.
                held(&b, Uuid::new_v4(), "other", OrderStatus::Confirmed),
                // A refusal holds the key: it stays refused.
                held(&c, Uuid::new_v4(), "p", OrderStatus::Refused),
            ],
            None,
        );
        assert!(matches!(&fates[0], Ok(Placed::Replayed(o)) if o.order_id == before));
        assert!(matches!(fates[1], Err(CheckoutError::KeyReused)));
        assert!(matches!(fates[2], Err(CheckoutError::OutOfStock)));
    }

    #[test]
    fn repeats_in_a_batch_share_the_first_fate_and_another_body_is_422() {
        let a = req("a", "1", "p", 1);
        let again = req("a", "1", "p", 1);
        let other = req("a", "1", "p", 2);
        let id = ids(3);
        // The function returns what the key holds for every request: the first's row.
        let row = held(&a, id[0], "p", OrderStatus::Confirmed);
        let fates = decide(
            &[&a, &again, &other],
            &id,
            vec![row.clone(), row.clone(), row],
            None,
        );
        assert!(matches!(fates[0], Ok(Placed::Created(_))));
        assert!(matches!(&fates[1], Ok(Placed::Replayed(o)) if o.order_id == id[0]));
        assert!(matches!(fates[2], Err(CheckoutError::KeyReused)));
    }

    #[test]
    fn the_lock_is_dated_no_later_than_the_reply_whatever_the_servers_clock_says() {
        let sent = Instant::now();
        let arrived = sent + Duration::from_millis(3);
        let wait = Duration::from_millis(2);
        assert_eq!(locked_at(sent, wait, arrived), sent + wait);
        // A server clock stepped 10 s forward during the statement.
        assert_eq!(locked_at(sent, Duration::from_secs(10), arrived), arrived);
    }

    #[test]
    fn a_wrong_body_ahead_of_an_honest_retry_does_not_change_the_retrys_answer() {
        // The key held order O (of 1 unit) before the batch; the batch carries the key with
        // another body, then with O's.
        let wrong = req("a", "k", "p", 2);
        let honest = req("a", "k", "p", 1);
        let before = Uuid::new_v4();
        let row = held(&honest, before, "p", OrderStatus::Confirmed);
        let fates = decide(&[&wrong, &honest], &ids(2), vec![row.clone(), row], None);
        assert!(matches!(fates[0], Err(CheckoutError::KeyReused)));
        assert!(
            matches!(&fates[1], Ok(Placed::Replayed(o)) if o.order_id == before),
            "{:?}",
            fates[1]
        );
    }

    #[test]
    fn a_key_that_holds_nothing_after_the_batch_is_unknown_never_a_guess() {
        let a = req("a", "1", "p", 1);
        let fates = decide(&[&a, &a], &ids(2), vec![None, None], None);
        assert!(matches!(fates[0], Err(CheckoutError::OutcomeUnknown)));
        assert!(matches!(fates[1], Err(CheckoutError::OutcomeUnknown)));
    }

    #[test]
    fn before_the_start_a_free_key_is_not_started_and_a_held_one_keeps_its_answer() {
        let (a, b) = (req("a", "1", "p", 1), req("b", "1", "p", 1));
        let before = Uuid::new_v4();
        let fates = decide(
            &[&a, &b],
            &ids(2),
            vec![None, held(&b, before, "p", OrderStatus::Confirmed)],
            Some(1500),
        );
        assert!(matches!(
            fates[0],
            Err(CheckoutError::SaleNotStarted {
                retry_after_ms: 1500
            })
        ));
        assert!(matches!(&fates[1], Ok(Placed::Replayed(o)) if o.order_id == before));
    }
}
