//! One order statement: one round trip, its own transaction, the batches of one product or of
//! several, through the one function `take_order_batches_v8` (migration
//! `20261207000004_order_sql_v8.sql`; `docs/design/orders.md` draws its calls). It locks its
//! product rows in byte order; seats each product's requests (a product with no limit whose
//! whole batch the drop rules let through is seated whole, without looking a key up; any other
//! request by request in arrival order, each judged by `drop_verdict_v1`, the one home of the
//! drop rules); claims every key in ONE `INSERT … ON CONFLICT DO NOTHING` in (user, key) byte
//! order; hands the units of a seat whose key a concurrent transaction claimed to the refused
//! requests, judged again; and takes each product's units with ONE guarded
//! `UPDATE … WHERE available_quantity >= total` (a guard that changes no row raises, and
//! nothing commits). It returns what every request's key holds now. The row locks are held
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

use crate::checkout::drops::Window;
use crate::checkout::error::CheckoutError;
use crate::checkout::idempotency::{Existing, judge};
use crate::checkout::order::{OrderRequest, Placed, at};
use crate::checkout::status::OrderStatus;
use crate::domain::ProductId;
use crate::routing::{Db, DbError};
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
    /// When the statement's answer (after its commit) arrived: the row was held from
    /// `locked_at` to here.
    pub released_at: Instant,
    /// The product's sale window.
    pub window: Window,
}

/// One row of `take_order_batches_v8`: a request (its product, and its place among that
/// product's requests), the product's row as the statement saw it, and what the request's
/// key holds now (`None`: nothing).
struct BatchRow {
    head: RowHead,
    held: Option<Existing>,
}

/// The columns of a [`BatchRow`] about its request and its product's row.
struct RowHead {
    batch_product: String,
    n: i64,
    found: i32,
    left_after: i32,
    lock_wait_us: i64,
    starts_in_ms: Option<i64>,
    sale_starts_at: Option<chrono::DateTime<chrono::Utc>>,
    sale_ends_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Where a [`BatchRow`]'s key columns start (`idempotency_key`, then the order's): after the
/// eight of its [`RowHead`].
const HELD_AT: usize = 8;

impl<'r> sqlx::FromRow<'r, PgRow> for BatchRow {
    /// By place, each column checked by name ([`at`]): the function's `RETURNS TABLE` order.
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        let held = match at::<Option<Uuid>>(row, HELD_AT + 3, "order_id")? {
            Some(_) => Some(Existing::read(row, HELD_AT)?),
            None => None,
        };
        Ok(BatchRow {
            head: RowHead {
                batch_product: at(row, 0, "batch_product")?,
                n: at(row, 1, "n")?,
                found: at(row, 2, "found")?,
                left_after: at(row, 3, "left_after")?,
                lock_wait_us: at(row, 4, "lock_wait_us")?,
                starts_in_ms: at(row, 5, "starts_in_ms")?,
                sale_starts_at: at(row, 6, "sale_starts_at")?,
                sale_ends_at: at(row, 7, "sale_ends_at")?,
            },
            held,
        })
    }
}

/// How long a combined statement may wait for one of its rows' locks before it gives up
/// (55P03, nothing written) and its batches run one by one: a few times a statement's own
/// time under load, so two instances' batches of a hot product still meet in the row's
/// queue, while a row held by a long transaction delays the other products that little.
pub(super) const COMBINED_LOCK_WAIT: Duration = Duration::from_millis(100);

/// One product's batch: it waits for its row as long as the database lets it (the coalescer
/// lets the next statement start beside one that stalls).
const ALONE: &str = "SELECT * FROM take_order_batches_v8($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// Several products' batches. The statement waits at most [`COMBINED_LOCK_WAIT`] (`$10`) for
/// any of its rows (`$10`; `set_config(…, true)` lasts for this statement's own transaction, and the
/// LATERAL reference makes it run before the function): one product's row held elsewhere
/// must not hold up the others it carries. Past it, nothing was written, and the coalescer
/// runs the batches one by one, so only the held product's batch waits.
const COMBINED: &str = "SELECT f.* FROM (SELECT set_config('lock_timeout', $10, true) AS t) s \
     CROSS JOIN LATERAL take_order_batches_v8(CASE WHEN s.t IS NOT NULL THEN $1::text[] END, \
                                              $2, $3, $4, $5, $6, $7, $8, $9) f";

/// Runs one product's batch.
pub(super) async fn run(
    db: &Db,
    product: &ProductId,
    reqs: &[&OrderRequest],
) -> Result<Committed, Failed> {
    let mut done = statement(db, &[(product, reqs.to_vec())], false).await?;
    done.pop().ok_or(Failed::Unknown)
}

/// Runs the batches of several products (each once) as one statement, one transaction, one
/// commit. Every batch's answer, in `jobs`' order, or the statement's failure for all of them
/// (an error anywhere rolls every batch back).
pub(super) async fn run_many(
    db: &Db,
    jobs: &[(&ProductId, Vec<&OrderRequest>)],
) -> Result<Vec<Committed>, Failed> {
    statement(db, jobs, true).await
}

/// The statement's arguments: the products in byte order, each one's last request (`p_ends`,
/// counted from 1), and the requests' columns in that order, with a new order id each;
/// `first[j]`: where job j's requests start.
struct Arrays<'a> {
    products: Vec<&'a str>,
    ends: Vec<i32>,
    ids: Vec<Uuid>,
    users: Vec<&'a str>,
    keys: Vec<&'a str>,
    qty: Vec<i32>,
    fps: Vec<String>,
    /// The locations each request names, end to end, and where each request's end
    /// (`p_locs`, `p_loc_ends`); both empty when no request names any.
    locs: Vec<&'a str>,
    loc_ends: Vec<i32>,
    first: Vec<usize>,
}

impl<'a> Arrays<'a> {
    fn of(jobs: &'a [(&'a ProductId, Vec<&'a OrderRequest>)]) -> Self {
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|&a, &b| jobs[a].0.as_str().cmp(jobs[b].0.as_str()));
        let total = jobs.iter().map(|(_, r)| r.len()).sum();
        let mut a = Arrays {
            products: Vec::with_capacity(jobs.len()),
            ends: Vec::with_capacity(jobs.len()),
            ids: (0..total)
                .map(|_| crate::checkout::order::new_row_id())
                .collect(),
            users: Vec::with_capacity(total),
            keys: Vec::with_capacity(total),
            qty: Vec::with_capacity(total),
            fps: Vec::with_capacity(total),
            locs: Vec::new(),
            loc_ends: Vec::new(),
            first: vec![0; jobs.len()],
        };
        for j in order {
            let (product, reqs) = &jobs[j];
            a.first[j] = a.users.len();
            a.products.push(product.as_str());
            for r in reqs {
                let (u, k) = r.key_pair();
                a.users.push(u);
                a.keys.push(k);
                a.qty.push(r.quantity.get());
                a.fps.push(r.fingerprint());
                a.locs.extend(r.locations.get().iter().map(|l| l.as_str()));
                a.loc_ends
                    .push(i32::try_from(a.locs.len()).unwrap_or(i32::MAX));
            }
            a.ends
                .push(i32::try_from(a.users.len()).unwrap_or(i32::MAX));
        }
        if a.locs.is_empty() {
            a.loc_ends.clear();
        }
        a
    }
}

/// Sends `jobs` (each product once, with its requests in arrival order) as one call of
/// `take_order_batches_v8` ([`COMBINED`] when `combined`, else [`ALONE`]) and reads each
/// job's answer.
async fn statement(
    db: &Db,
    jobs: &[(&ProductId, Vec<&OrderRequest>)],
    combined: bool,
) -> Result<Vec<Committed>, Failed> {
    let a = Arrays::of(jobs);
    let statement = sqlx::query_as::<_, BatchRow>(if combined { COMBINED } else { ALONE })
        .bind(&a.products)
        .bind(&a.ends)
        .bind(&a.ids)
        .bind(&a.users)
        .bind(&a.keys)
        .bind(&a.qty)
        .bind(&a.fps)
        .bind(&a.locs)
        .bind(&a.loc_ends);
    let statement = match combined {
        true => statement.bind(format!("{}ms", COMBINED_LOCK_WAIT.as_millis())),
        false => statement,
    };
    let (rows, sent, arrived) = send(db, statement).await?;
    // Each row moves to its request's answer: what its key holds is read once, never copied.
    let mut by_product: HashMap<String, Vec<BatchRow>> = HashMap::new();
    for mut row in rows {
        let product = std::mem::take(&mut row.head.batch_product);
        by_product.entry(product).or_default().push(row);
    }
    jobs.iter()
        .enumerate()
        .map(|(j, (product, reqs))| {
            let mine = by_product.remove(product.as_str()).unwrap_or_default();
            let ids = &a.ids[a.first[j]..a.first[j] + reqs.len()];
            read(reqs, ids, mine, sent, arrived).map_err(|e| {
                tracing::warn!(error = %e, "an order batch's answer could not be read");
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
    statement: sqlx::query::QueryAs<'q, sqlx::Postgres, BatchRow, sqlx::postgres::PgArguments>,
) -> Result<(Vec<BatchRow>, Instant, Instant), Failed> {
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

/// Reads one product's rows (none: no such product) into every request's answer.
fn read(
    reqs: &[&OrderRequest],
    ids: &[Uuid],
    rows: Vec<BatchRow>,
    sent: Instant,
    arrived: Instant,
) -> Result<Committed, sqlx::Error> {
    let Some(first) = rows.first().map(|r| &r.head) else {
        let fates = reqs
            .iter()
            .map(|_| Err(CheckoutError::ProductNotFound))
            .collect();
        return Ok(Committed { fates, row: None });
    };
    let waited = u64::try_from(first.lock_wait_us).unwrap_or(0);
    let row = RowSeen {
        found: first.found,
        left: first.left_after,
        locked_at: locked_at(sent, Duration::from_micros(waited), arrived),
        released_at: arrived,
        window: Window {
            starts: first.sale_starts_at,
            ends: first.sale_ends_at,
        },
    };
    let starts_in = first.starts_in_ms;
    let mut held: Vec<Option<Existing>> = vec![None; reqs.len()];
    for r in rows {
        let n = r.head.n;
        let slot = usize::try_from(n - 1).ok().and_then(|i| held.get_mut(i));
        let Some(slot) = slot else {
            return Err(sqlx::Error::Protocol(format!(
                "a row for request {n} of {}",
                reqs.len()
            )));
        };
        *slot = r.held;
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
            locations: Default::default(),
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
                shape: crate::checkout::Shape::Single {
                    product_id: ProductId::parse(product).expect("valid"),
                    quantity: r.quantity,
                },
                unit_price_cents: 0,
                lines: vec![],
                user_id: r.user.clone(),
                status,
                total_cents: 0,
                created_at: chrono::Utc::now(),
                cancelled_at: None,
                allocations: crate::checkout::order::Allocations::none(),
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
