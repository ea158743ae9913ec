//! The order batch's statement, the one the service calls — `take_order_batches_v8`, for one
//! product or several, which judges each request of a product with a limit or window to judge
//! or too little stock with `drop_verdict_v1` — called directly on a real primary: first-fit
//! seats in arrival order, keys that already hold something, repeats inside a batch, a key
//! claimed by a concurrent transaction while the batch waits for it, and the order keys are
//! claimed in.

use crate::helpers::*;
use sqlx::{PgPool, Row};
use std::time::Duration;
use uuid::Uuid;

/// One request of a batch: (user, key, quantity). Its fingerprint is the service's,
/// `product:quantity`.
type Req<'a> = (&'a str, &'a str, i32);

/// What the function returned for one request: (status, order id, product) of the row its
/// key holds, and whether this batch wrote it.
#[derive(Debug, PartialEq)]
struct Held {
    status: String,
    product: Option<String>,
    ours: bool,
}

struct Outcome {
    found: i32,
    left: i32,
    held: Vec<Held>,
}

async fn pool() -> PgPool {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    PgPool::connect(&cluster.primary_url(&db)).await.unwrap()
}

async fn product(pool: &PgPool, id: &str, stock: i32) {
    sqlx::query(
        "INSERT INTO products (product_id, name, price_cents, available_quantity) VALUES ($1, $1, 250, $2)",
    )
    .bind(id)
    .bind(stock)
    .execute(pool)
    .await
    .unwrap();
}

/// A product of `stock` units with a per-customer `limit`.
async fn limited(pool: &PgPool, id: &str, stock: i32, limit: i32) {
    product(pool, id, stock).await;
    sqlx::query("UPDATE products SET max_per_customer = $2 WHERE product_id = $1")
        .bind(id)
        .bind(limit)
        .execute(pool)
        .await
        .unwrap();
}

/// How many rows (orders and refusals) `user` has.
async fn rows_of(pool: &PgPool, user: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE user_id = $1")
        .bind(user)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Calls the function as the service does; `None`: it returned no rows (no such product).
async fn take<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    product: &str,
    reqs: &[Req<'_>],
) -> Option<Outcome> {
    let ids: Vec<Uuid> = reqs.iter().map(|_| Uuid::new_v4()).collect();
    let users: Vec<&str> = reqs.iter().map(|r| r.0).collect();
    let keys: Vec<&str> = reqs.iter().map(|r| r.1).collect();
    let qty: Vec<i32> = reqs.iter().map(|r| r.2).collect();
    let fps: Vec<String> = reqs.iter().map(|r| format!("{product}:{}", r.2)).collect();
    let rows =
        sqlx::query("SELECT * FROM take_order_batches_v8($1, $2, $3, $4, $5, $6, $7, '{}', '{}')")
            .bind([product])
            .bind([reqs.len() as i32])
            .bind(&ids)
            .bind(&users)
            .bind(&keys)
            .bind(&qty)
            .bind(&fps)
            .fetch_all(exec)
            .await
            .unwrap();
    let first = rows.first()?;
    assert_eq!(rows.len(), reqs.len(), "one row per request");
    let held = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            assert_eq!(r.get::<i64, _>("n"), i as i64 + 1, "rows in arrival order");
            Held {
                status: r.get::<Option<String>, _>("status").unwrap_or_default(),
                product: r.get("product_id"),
                ours: r.get::<Option<Uuid>, _>("order_id") == Some(ids[i]),
            }
        })
        .collect();
    Some(Outcome {
        found: first.get("found"),
        left: first.get("left_after"),
        held,
    })
}

fn ours(status: &str, product: &str) -> Held {
    Held {
        status: status.into(),
        product: Some(product.into()),
        ours: true,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn seats_go_first_fit_in_arrival_order_and_the_guarded_update_takes_their_total() {
    let pool = pool().await;
    product(&pool, "p", 4).await;
    let out = take(&pool, "p", &[("a", "1", 3), ("b", "1", 3), ("c", "1", 1)])
        .await
        .unwrap();
    assert_eq!((out.found, out.left), (4, 0));
    assert_eq!(
        out.held,
        vec![
            ours("confirmed", "p"),
            ours("refused", "p"),
            ours("confirmed", "p")
        ]
    );
    assert_eq!(
        stock_on(&pool, "p").await,
        0,
        "what it says it left is what the row holds"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_already_used_takes_nothing_and_displaces_no_honest_buyer() {
    let pool = pool().await;
    product(&pool, "p1", 5).await;
    product(&pool, "p2", 20).await;
    take(&pool, "p1", &[("ada", "k", 1)]).await.unwrap();
    // Ada reuses her key for all 20 units of p2, ahead of 20 honest buyers.
    let honest: Vec<String> = (0..20).map(|i| format!("b{i}")).collect();
    let mut reqs: Vec<Req> = vec![("ada", "k", 20)];
    reqs.extend(honest.iter().map(|u| (u.as_str(), "k", 1)));
    let out = take(&pool, "p2", &reqs).await.unwrap();
    assert_eq!(
        out.held[0],
        Held {
            status: "confirmed".into(),
            product: Some("p1".into()),
            ours: false
        },
        "her key still holds her p1 order"
    );
    assert!(
        out.held[1..].iter().all(|h| *h == ours("confirmed", "p2")),
        "{:?}",
        out.held
    );
    assert_eq!((out.found, out.left), (20, 0));
    assert_eq!(stock_on(&pool, "p2").await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_repeated_in_one_batch_takes_one_seat() {
    let pool = pool().await;
    product(&pool, "p", 10).await;
    let out = take(&pool, "p", &[("a", "1", 1), ("a", "1", 1), ("a", "1", 2)])
        .await
        .unwrap();
    assert!(out.held[0].ours && out.held[0].status == "confirmed");
    assert!(
        out.held[1..].iter().all(|h| !h.ours),
        "the repeats wrote nothing"
    );
    assert_eq!(stock_on(&pool, "p").await, 9);
    assert_eq!(rows_of(&pool, "a").await, 1);
}

/// Before a product's sale starts nothing is written, and every request is answered from what
/// its key holds: a key that holds an order (here of another product) is that order, for the
/// idempotency rule to judge (422 for this other body), never "free". Mutation seen failing
/// it (found by the history check): the answer built from the offered rows when a product was
/// not on sale (no read-back), so the held key came back empty and was told
/// `SALE_NOT_STARTED`.
#[tokio::test(flavor = "multi_thread")]
async fn before_the_sale_a_key_that_holds_an_order_is_answered_from_it() {
    let pool = pool().await;
    product(&pool, "p", 10).await;
    product(&pool, "soon", 10).await;
    sqlx::query(
        "UPDATE products SET sale_starts_at = now() + interval '1 hour' WHERE product_id = 'soon'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let earlier = take(&pool, "p", &[("a", "1", 1)]).await.unwrap();
    assert_eq!(earlier.held, vec![ours("confirmed", "p")]);
    let out = take(&pool, "soon", &[("a", "1", 2), ("b", "1", 1)])
        .await
        .unwrap();
    assert_eq!(
        out.held[0],
        Held {
            status: "confirmed".into(),
            product: Some("p".into()),
            ours: false
        }
    );
    assert_eq!(out.held[1].status, "", "b's key holds nothing");
    assert_eq!((out.found, out.left), (10, 10));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_product_writes_nothing_and_returns_no_rows() {
    let pool = pool().await;
    assert!(take(&pool, "nope", &[("a", "1", 1)]).await.is_none());
    assert_eq!(rows_of(&pool, "a").await, 0);
}

/// Claims user a's key "1" with a refusal (2 units of `product`) in a transaction left open:
/// a batch that claims the same key waits for it.
async fn claim_a1_uncommitted(
    pool: &PgPool,
    product: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut other = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
         VALUES ($1, $2, 'a', 2, 0, 0, 'refused', '1', $2 || ':2')",
    )
    .bind(Uuid::new_v4())
    .bind(product)
    .execute(&mut *other)
    .await
    .unwrap();
    other
}

/// Commits `other` once a batch waits on a lock (the key `other` claimed).
async fn commit_once_a_batch_waits(
    pool: &PgPool,
    other: sqlx::Transaction<'static, sqlx::Postgres>,
) {
    wait_for(
        "the batch to wait on the claimed key",
        Duration::from_secs(10),
        || async { batches_waiting_on(pool, "Lock").await == 1 },
    )
    .await;
    other.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn units_of_a_seat_whose_key_was_claimed_meanwhile_go_to_the_refused_in_arrival_order() {
    let pool = pool().await;
    product(&pool, "p", 2).await;
    // Another transaction claims a's key (a refusal elsewhere) and has not committed: the
    // batch's seating cannot see it, so it seats a (2 units) and refuses b and c.
    let other = claim_a1_uncommitted(&pool, "p").await;
    let batch = {
        let pool = pool.clone();
        tokio::spawn(async move {
            take(&pool, "p", &[("a", "1", 2), ("b", "1", 1), ("c", "1", 1)]).await
        })
    };
    // The batch's insert now waits for the other transaction's key.
    commit_once_a_batch_waits(&pool, other).await;
    let out = batch.await.unwrap().unwrap();
    assert_eq!(
        out.held,
        vec![
            Held {
                status: "refused".into(),
                product: Some("p".into()),
                ours: false
            },
            ours("confirmed", "p"),
            ours("confirmed", "p"),
        ]
    );
    assert_eq!((out.found, out.left), (2, 0));
    assert_eq!(stock_on(&pool, "p").await, 0);
    let paid: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(total_cents), 0)::int8 FROM orders WHERE status = 'confirmed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(paid, 2 * 250, "the reseated orders carry the price");
}

/// #44 item 7: when a seat's key is claimed concurrently, every refused request of the batch
/// is judged again, refusals for a limit included: a sibling of the same user that was
/// refused for the seat that was never taken is confirmed, and one still over the limit
/// states the count it was judged on. Mutation seen failing it: the re-seating skipping rows
/// refused for a reason (`CONTINUE WHEN v_why[i] IS NOT NULL`, as version 3 did): a2 stayed
/// refused with `already` 2, counting a seat that a's key never took.
#[tokio::test(flavor = "multi_thread")]
async fn a_limit_refusal_is_judged_again_when_a_seat_of_its_batch_is_not_taken() {
    let pool = pool().await;
    limited(&pool, "lim", 10, 2).await;
    // a's key "1" is claimed elsewhere (uncommitted): the batch seats it (2 units, a at the
    // limit), so a's keys "2" and "3" are refused for the limit, already 2.
    let other = claim_a1_uncommitted(&pool, "lim").await;
    let reqs = [("a", "1", 2), ("a", "2", 1), ("a", "3", 2)];
    let batch = {
        let pool = pool.clone();
        tokio::spawn(async move { take(&pool, "lim", &reqs).await })
    };
    commit_once_a_batch_waits(&pool, other).await;
    let out = batch.await.unwrap().unwrap();
    let statuses: Vec<(&str, bool)> = out
        .held
        .iter()
        .map(|h| (h.status.as_str(), h.ours))
        .collect();
    assert_eq!(
        statuses,
        [("refused", false), ("confirmed", true), ("refused", true)],
        "a's seat went to the other transaction; a2 fits the limit once it is judged again"
    );
    let already: Option<i32> = sqlx::query_scalar(
        "SELECT (refusal->>'already')::int4 FROM orders WHERE user_id = 'a' AND idempotency_key = '3'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(already, Some(1), "a3's refusal counts a2's unit, not a1's");
    assert_eq!((out.found, out.left), (10, 9));
    assert_eq!(stock_on(&pool, "lim").await, 9);
}

/// #44 item 8: one statement claims all of its keys in ONE (user, key) byte order, whichever
/// products they are for, so two statements never wait on each other's keys in a circle.
/// Here a's key "1" (product p, judged: it has a limit) is held by another transaction while
/// the statement also carries b's key "1" (product q, seated whole). Waiting for a's key, the
/// statement must not yet hold b's (a < b): a probe claiming b's key goes through at once.
/// Mutation seen failing it: version 3's two passes (the products seated whole first, then
/// each judged product's own insert): the statement held b's key while it waited, and the
/// probe hit its lock timeout (55P03).
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_claims_its_keys_in_one_order_across_products() {
    let pool = pool().await;
    limited(&pool, "p", 10, 5).await;
    product(&pool, "q", 10).await;
    let other = claim_a1_uncommitted(&pool, "p").await;
    let batch = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let p: &[Req] = &[("a", "1", 1)];
            let q: &[Req] = &[("b", "1", 1)];
            take_many(&pool, &[("p", p), ("q", q)]).await
        })
    };
    wait_for(
        "the statement to wait on a's claimed key",
        Duration::from_secs(10),
        || async { batches_waiting_on(&pool, "Lock").await == 1 },
    )
    .await;
    let mut probe = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '2s'")
        .execute(&mut *probe)
        .await
        .unwrap();
    let claimed = sqlx::query(
        "INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents, total_cents, status, idempotency_key, request_fingerprint) \
         VALUES ($1, 'q', 'b', 1, 0, 0, 'refused', '1', 'probe') ON CONFLICT DO NOTHING",
    )
    .bind(Uuid::new_v4())
    .execute(&mut *probe)
    .await;
    assert!(
        claimed.is_ok(),
        "b's key was held by the statement while it waited for a's: {claimed:?}"
    );
    probe.rollback().await.unwrap();
    other.commit().await.unwrap();
    let got = batch.await.unwrap().unwrap();
    let statuses: Vec<(&str, &str, bool)> = got
        .iter()
        .map(|(p, _, s, _, ours)| (p.as_str(), s.as_str(), *ours))
        .collect();
    assert_eq!(
        statuses,
        [("p", "refused", false), ("q", "confirmed", true)]
    );
    assert_eq!(
        (stock_on(&pool, "p").await, stock_on(&pool, "q").await),
        (10, 9)
    );
}

/// The refusal reasons the batch stored, in `reqs`' order (`None`: confirmed or a stock
/// refusal).
async fn reasons(pool: &PgPool, reqs: &[Req<'_>]) -> Vec<Option<String>> {
    let mut out = vec![];
    for (user, key, _) in reqs {
        out.push(
            sqlx::query_scalar(
                "SELECT refusal->>'code' FROM orders WHERE user_id = $1 AND idempotency_key = $2",
            )
            .bind(user)
            .bind(key)
            .fetch_one(pool)
            .await
            .unwrap(),
        );
    }
    out
}

/// Within one batch a user's requests are seated in arrival order against what is left of
/// their allowance, and stock is judged before the allowance (as the stock gate's early "no"
/// would): both first fit. Mutation seen failing it: the allowance not advanced by the
/// batch's own seats (buyer `a` got 4 units).
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_seats_each_users_requests_against_their_allowance_first_fit() {
    let pool = pool().await;
    limited(&pool, "lim", 10, 2).await;
    let reqs = [
        ("a", "1", 1),
        ("a", "2", 2),
        ("b", "1", 2),
        ("a", "3", 1),
        ("a", "4", 1),
    ];
    let out = take(&pool, "lim", &reqs).await.unwrap();
    let statuses: Vec<&str> = out.held.iter().map(|h| h.status.as_str()).collect();
    assert_eq!(
        statuses,
        ["confirmed", "refused", "confirmed", "confirmed", "refused"]
    );
    let limit = Some("LIMIT_EXCEEDED".to_string());
    assert_eq!(
        reasons(&pool, &reqs).await,
        [None, limit.clone(), None, None, limit.clone()]
    );
    assert_eq!((out.found, out.left), (10, 6));
    // Stock before the allowance: `a` is at the limit; with no stock its next request is
    // OUT_OF_STOCK, with some it is LIMIT_EXCEEDED.
    for (stock, key, want) in [(0, "5", None), (1, "6", limit)] {
        sqlx::query("UPDATE products SET available_quantity = $1 WHERE product_id = 'lim'")
            .bind(stock)
            .execute(&pool)
            .await
            .unwrap();
        let reqs = [("a", key, 1)];
        let out = take(&pool, "lim", &reqs).await.unwrap();
        assert_eq!(out.held[0].status, "refused");
        assert_eq!(reasons(&pool, &reqs).await, [want]);
    }
}

/// Each batch's last request, counted from 1 over all of them (the functions' `p_ends`),
/// from the batches' sizes in order.
fn ends_of(sizes: impl Iterator<Item = usize>) -> Vec<i32> {
    sizes
        .scan(0, |end, n| {
            *end += n as i32;
            Some(*end)
        })
        .collect()
}

/// Calls `take_order_batches_v8` as the service does: `batches` in the order given, each
/// `(product, requests)`. Its rows as (product, n, status, the row's product, ours).
async fn take_many<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    batches: &[(&str, &[Req<'_>])],
) -> Result<Vec<(String, i64, String, Option<String>, bool)>, sqlx::Error> {
    let all: Vec<(&str, &Req)> = batches
        .iter()
        .flat_map(|(p, reqs)| reqs.iter().map(move |r| (*p, r)))
        .collect();
    let ids: Vec<Uuid> = all.iter().map(|_| Uuid::new_v4()).collect();
    let products: Vec<&str> = batches.iter().map(|b| b.0).collect();
    let ends = ends_of(batches.iter().map(|b| b.1.len()));
    let rows =
        sqlx::query("SELECT * FROM take_order_batches_v8($1, $2, $3, $4, $5, $6, $7, '{}', '{}')")
            .bind(&products)
            .bind(&ends)
            .bind(&ids)
            .bind(all.iter().map(|(_, r)| r.0).collect::<Vec<_>>())
            .bind(all.iter().map(|(_, r)| r.1).collect::<Vec<_>>())
            .bind(all.iter().map(|(_, r)| r.2).collect::<Vec<_>>())
            .bind(
                all.iter()
                    .map(|(p, r)| format!("{p}:{}", r.2))
                    .collect::<Vec<_>>(),
            )
            .fetch_all(exec)
            .await?;
    let mut got: Vec<_> = rows
        .iter()
        .map(|r| {
            let product: String = r.get("batch_product");
            let n: i64 = r.get("n");
            let first = ends[products.iter().position(|p| *p == product).unwrap()] as usize
                - batches.iter().find(|b| b.0 == product).unwrap().1.len();
            let ours = r.get::<Option<Uuid>, _>("order_id") == Some(ids[first + n as usize - 1]);
            (product, n, r.get("status"), r.get("product_id"), ours)
        })
        .collect();
    got.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    Ok(got)
}

/// The batches of several products in one statement (`take_order_batches_v8`, the one the
/// service calls): products whose whole batch fits and that have no limit or window to judge
/// are seated whole (no verdict per request), the others by their own batch's first fit, each
/// request judged by `drop_verdict_v1`, all in one insert and one commit; a repeated key takes
/// one seat, a key that holds an order already takes nothing, a missing product returns no
/// rows; products out of byte order are refused whole (nothing written), so no two such
/// statements lock rows in opposite orders. Mutations seen failing it: every product seated
/// whole (A's second request confirmed past its stock: the guard raised); the guarded update
/// taking each product's requested units rather than the rows inserted (c left 93, not 94);
/// every product judged request by request (11 verdicts, not 9: the answers alone cannot
/// tell).
#[tokio::test(flavor = "multi_thread")]
async fn batches_of_several_products_share_one_statement_and_keep_their_own_seats() {
    let pool = pool().await;
    product(&pool, "A", 1).await;
    product(&pool, "b", 2).await;
    product(&pool, "c", 100).await;
    // An earlier order of u9's key "old" (a retry of it comes in the batch).
    let earlier = take(&pool, "c", &[("u9", "old", 1)]).await.unwrap();
    assert_eq!(earlier.held, vec![ours("confirmed", "c")]);
    let a: &[Req] = &[("u1", "k", 1), ("u2", "k", 1)];
    let b: &[Req] = &[("u3", "k", 1), ("u4", "k", 1), ("u5", "k", 1)];
    let c: &[Req] = &[
        ("u6", "k", 2),
        ("u7", "k", 3),
        ("u6", "k", 2),
        ("u9", "old", 1),
    ];
    let gone: &[Req] = &[("u8", "k", 1)];
    // "b" before "A" is not byte order ("A" < "b"): refused, nothing written.
    assert!(take_many(&pool, &[("b", b), ("A", a)]).await.is_err());
    assert_eq!(rows_of(&pool, "u1").await + rows_of(&pool, "u3").await, 0);

    // In a transaction that counts its function calls: which products were judged request by
    // request is observed, not assumed.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let got = take_many(&mut *tx, &[("A", a), ("b", b), ("c", c), ("zz", gone)])
        .await
        .unwrap();
    let verdicts: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_xact_user_functions \
         WHERE funcname = 'drop_verdict_v1'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        verdicts,
        1 + 3 + 4 + 1,
        "one for every product's whole batch (not clear: A and b are short), one per product \
         found, and one per request of A and b; c seated whole"
    );
    let row = |p: &str, n, status: &str, ours| {
        (p.to_owned(), n, status.to_owned(), Some(p.to_owned()), ours)
    };
    assert_eq!(
        got,
        vec![
            row("A", 1, "confirmed", true),
            row("A", 2, "refused", true),
            row("b", 1, "confirmed", true),
            row("b", 2, "confirmed", true),
            row("b", 3, "refused", true),
            row("c", 1, "confirmed", true),
            row("c", 2, "confirmed", true),
            // The repeat of u6's key is answered from the row its first request wrote.
            row("c", 3, "confirmed", false),
            // The retry of u9's earlier order takes nothing and finds it.
            row("c", 4, "confirmed", false),
        ],
        "no rows for the missing product zz"
    );
    assert_eq!(
        (
            stock_on(&pool, "A").await,
            stock_on(&pool, "b").await,
            stock_on(&pool, "c").await
        ),
        (0, 0, 100 - 1 - 5)
    );
}

/// A key that another transaction claims while the set-based path's insert waits for it
/// takes nothing: the guarded update takes the units of the rows the statement inserted, not
/// of the requests it was given. Mutation seen failing: the update by the requests' total
/// (c's stock 7, not 9, and two units sold that no order holds).
#[tokio::test(flavor = "multi_thread")]
async fn a_key_claimed_while_the_set_based_batch_waits_takes_no_stock() {
    let pool = pool().await;
    product(&pool, "c", 10).await;
    product(&pool, "d", 10).await;
    let other = claim_a1_uncommitted(&pool, "c").await;
    let batch = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let c: &[Req] = &[("a", "1", 2), ("b", "1", 1)];
            let d: &[Req] = &[("e", "1", 1)];
            take_many(&pool, &[("c", c), ("d", d)]).await
        })
    };
    commit_once_a_batch_waits(&pool, other).await;
    let got = batch.await.unwrap().unwrap();
    let statuses: Vec<(&str, i64, &str, bool)> = got
        .iter()
        .map(|(p, n, s, _, ours)| (p.as_str(), *n, s.as_str(), *ours))
        .collect();
    assert_eq!(
        statuses,
        [
            ("c", 1, "refused", false),
            ("c", 2, "confirmed", true),
            ("d", 1, "confirmed", true)
        ]
    );
    assert_eq!(
        (stock_on(&pool, "c").await, stock_on(&pool, "d").await),
        (9, 9)
    );
}

/// Each batch function the service calls returns `order_columns!` — every column an
/// `Order` is read from, in that order — after its own columns: a new version of a function
/// that drops or reorders one fails here, not in a customer's answer. Mutation seen failing:
/// a column added to `order_columns!` that the functions do not return.
#[tokio::test(flavor = "multi_thread")]
async fn each_batch_function_returns_the_order_columns_in_their_order() {
    let pool = pool().await;
    let want: Vec<&str> = stockgate::checkout::ORDER_COLUMNS.split(", ").collect();
    for function in ["take_order_batches_v8"] {
        let returned: Vec<String> = sqlx::query_scalar(
            "SELECT a.name FROM pg_proc p, \
                    unnest(p.proargnames, p.proargmodes) WITH ORDINALITY AS a(name, mode, i) \
             WHERE p.proname = $1 AND a.mode = 't' ORDER BY a.i",
        )
        .bind(function)
        .fetch_all(&pool)
        .await
        .unwrap();
        assert!(!returned.is_empty(), "{function} is not in the schema");
        let tail = &returned[returned.len().saturating_sub(want.len())..];
        assert_eq!(tail, want.as_slice(), "{function} returns {returned:?}");
    }
}

/// Order SQL v8 asks the drop rules once for every product's whole batch and skips each
/// product's own question when that verdict is NULL, which is right only if a verdict on
/// several lines is NULL exactly when each line's is. Held here over random line sets (windows
/// before, in and after, short and ample stock, limits met and passed), with both outcomes
/// present. Mutation that fails it: `drop_verdict_v1` judging stock on the lines' sum
/// (`sum(p_qty) > sum(p_left)`), a rule no single line shows.
#[tokio::test(flavor = "multi_thread")]
async fn a_verdict_on_several_lines_clears_them_exactly_when_each_line_would() {
    let pool = pool().await;
    let (disagree, clear, cases): (i64, i64, i64) = sqlx::query_as(
        "WITH lines AS ( \
           SELECT c, i, 1 + (random() * 3)::int AS q, (random() * 4)::int AS l, \
                  CASE WHEN random() < 0.3 THEN 1 + (random() * 3)::int END AS lim, \
                  CASE WHEN random() < 0.1 THEN now() + interval '1 hour' \
                       WHEN random() < 0.3 THEN now() - interval '1 hour' END AS st, \
                  CASE WHEN random() < 0.1 THEN now() - interval '1 minute' \
                       WHEN random() < 0.3 THEN now() + interval '1 hour' END AS en, \
                  (random() * 3)::int8 AS al \
             FROM generate_series(1, 600) c, generate_series(1, 1 + c % 4) i \
         ), cases AS ( \
           SELECT array_agg('p' || i ORDER BY i) AS ps, array_agg(q ORDER BY i) AS qs, \
                  array_agg(l ORDER BY i) AS ls, array_agg(lim ORDER BY i) AS lims, \
                  array_agg(st ORDER BY i) AS sts, array_agg(en ORDER BY i) AS ens, \
                  array_agg(al ORDER BY i) AS als \
             FROM lines GROUP BY c \
         ), judged AS ( \
           SELECT drop_verdict_v1(now(), ps, qs, ls, lims, sts, ens, als) IS NULL AS together, \
                  (SELECT bool_and(drop_verdict_v1(now(), ARRAY[ps[k]], ARRAY[qs[k]], \
                                                   ARRAY[ls[k]], ARRAY[lims[k]], ARRAY[sts[k]], \
                                                   ARRAY[ens[k]], ARRAY[als[k]]) IS NULL) \
                     FROM generate_subscripts(ps, 1) k) AS each \
             FROM cases \
         ) \
         SELECT count(*) FILTER (WHERE together <> each), count(*) FILTER (WHERE together), \
                count(*) FROM judged",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // Precondition: the cases hold both outcomes, so a disagreement could show.
    assert!(
        clear > 20 && cases - clear > 20,
        "{clear} of {cases} line sets clear"
    );
    assert_eq!(disagree, 0, "line sets whose verdict is not each line's");
}

/// Every product of a statement clear of the drop rules costs one verdict in all, not one each.
/// Mutation that fails it: version 8 asking each product on its own (3 verdicts, not 1).
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_whose_products_all_pass_asks_the_drop_rules_once() {
    let pool = pool().await;
    for p in ["x1", "x2", "x3"] {
        product(&pool, p, 10).await;
    }
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(&mut *tx)
        .await
        .unwrap();
    let (r1, r2, r3): (&[Req], &[Req], &[Req]) =
        (&[("u1", "k", 2)], &[("u2", "k", 2)], &[("u3", "k", 2)]);
    let got = take_many(&mut *tx, &[("x1", r1), ("x2", r2), ("x3", r3)])
        .await
        .unwrap();
    let verdicts: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_xact_user_functions \
         WHERE funcname = 'drop_verdict_v1'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(
        got.iter()
            .all(|(_, _, status, _, ours)| status == "confirmed" && *ours)
            && got.len() == 3,
        "{got:?}"
    );
    assert_eq!(verdicts, 1);
    let allocations: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT allocations FROM orders WHERE product_id LIKE 'x_' ORDER BY product_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        allocations,
        ["x1", "x2", "x3"]
            .map(
                |p| serde_json::json!([{"product_id": p, "location_id": "default", "quantity": 2}])
            )
            .to_vec()
    );
}

/// When every request of a batch writes its own row (no key twice, none held already),
/// `take_order_batches_v8` answers from what the INSERT returned instead of reading every key
/// back; its answers must still be the rows the table holds, column for column, `created_at`
/// included (each row's own, found by the order ids' rank), with the stock each batch found
/// and left. Mutations seen failing it: `created_at` by arrival order (`v_at[x.i]`) instead
/// of by rank; a unit price of 0 in the answers; the stock left stated as the stock found;
/// every order of a combined statement written at its first product's price. The fast path
/// taken whatever was written fails other tests: `a_key_repeated_in_one_batch_takes_one_seat`
/// (the repeat answered as a new order) and
/// `a_key_claimed_while_the_set_based_batch_waits_takes_no_stock` (the key claimed
/// concurrently). Keeping the last of a repeated key rather than the first also fails
/// `a_key_repeated_in_one_batch_takes_one_seat`.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_keys_are_all_new_answers_with_the_rows_it_wrote() {
    let pool = pool().await;
    product(&pool, "m", 1000).await;
    product(&pool, "n", 1000).await;
    sqlx::query("UPDATE products SET price_cents = 399 WHERE product_id = 'n'")
        .execute(&pool)
        .await
        .unwrap();
    let alone: Vec<(String, String, i32)> = (0..40)
        .map(|i| (format!("solo{i}"), format!("k{i}"), 1 + i % 3))
        .collect();
    let m: Vec<(String, String, i32)> = (0..25)
        .map(|i| (format!("m{i}"), format!("k{i}"), 2))
        .collect();
    let n: Vec<(String, String, i32)> = (0..15)
        .map(|i| (format!("n{i}"), "same-key".to_owned(), 1 + i % 2))
        .collect();
    macro_rules! row {
        () => {
            "row(t.order_id, t.product_id, t.quantity, t.user_id, t.status, t.total_cents, \
             t.created_at, t.cancelled_at, t.unit_price_cents, t.idempotency_key, \
             t.request_fingerprint, t.refusal)::text"
        };
    }
    for batches in [vec![("m", alone)], vec![("m", m), ("n", n)]] {
        let all: Vec<(&str, &(String, String, i32))> = batches
            .iter()
            .flat_map(|(p, rs)| rs.iter().map(move |r| (*p, r)))
            .collect();
        let ids: Vec<Uuid> = all.iter().map(|_| Uuid::new_v4()).collect();
        let users: Vec<&str> = all.iter().map(|(_, r)| r.0.as_str()).collect();
        let keys: Vec<&str> = all.iter().map(|(_, r)| r.1.as_str()).collect();
        let qty: Vec<i32> = all.iter().map(|(_, r)| r.2).collect();
        let fps: Vec<String> = all.iter().map(|(p, r)| format!("{p}:{}", r.2)).collect();
        let products: Vec<&str> = batches.iter().map(|b| b.0).collect();
        let ends = ends_of(batches.iter().map(|b| b.1.len()));
        let sql = concat!(
            "SELECT ",
            row!(),
            ", t.product_id, t.found, t.left_after \
             FROM take_order_batches_v8($1, $2, $3, $4, $5, $6, $7, '{}', '{}') t"
        );
        let mut before = std::collections::HashMap::new();
        for p in &products {
            before.insert(p.to_string(), stock_on(&pool, p).await);
        }
        let answered: Vec<(String, String, i32, i32)> = sqlx::query_as(sql)
            .bind(&products)
            .bind(&ends)
            .bind(&ids)
            .bind(&users)
            .bind(&keys)
            .bind(&qty)
            .bind(&fps)
            .fetch_all(&pool)
            .await
            .unwrap();
        let stored: Vec<String> = sqlx::query_scalar(concat!(
            "SELECT ",
            row!(),
            " FROM unnest($1::uuid[]) WITH ORDINALITY AS i(id, at) \
               JOIN orders t ON t.order_id = i.id ORDER BY i.at"
        ))
        .bind(&ids)
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(stored.len(), all.len(), "every request wrote its own row");
        let mispriced: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders o JOIN products p USING (product_id) \
              WHERE o.order_id = ANY($1) \
                AND (o.unit_price_cents, o.total_cents) <> (p.price_cents, p.price_cents::int8 * o.quantity)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(mispriced, 0, "each order at its own product's price");
        let rows: Vec<&String> = answered.iter().map(|a| &a.0).collect();
        assert_eq!(rows, stored.iter().collect::<Vec<_>>());
        // Each row states the stock its batch found and the stock it left.
        for (_, product, found, left) in &answered {
            assert_eq!(
                (i64::from(*found), i64::from(*left)),
                (before[product], stock_on(&pool, product).await),
                "{product}"
            );
        }
    }
    assert_eq!(
        (stock_on(&pool, "m").await, stock_on(&pool, "n").await),
        (1000 - 79 - 50, 1000 - 22)
    );
}

/// The text of every Rust file under `dir`.
fn rust_sources(dir: &std::path::Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// #45: the SQL installed in every database is exactly what the binary calls, plus at most
/// the immediate predecessors of those functions (marked "superseded by" one the binary
/// calls, kept while a rolling deploy may still run the binary before), plus what those and
/// the triggers call. Dead SQL fails the build. Mutations seen failing it: the v4 migration
/// without its `DROP FUNCTION take_order_batches_v2` (a version two steps back, called by
/// nothing); `take_order_batch_v3` without its "superseded by" mark.
#[tokio::test(flavor = "multi_thread")]
async fn only_live_sql_is_installed() {
    let pool = pool().await;
    let functions: Vec<(String, String, bool, Option<String>)> = sqlx::query_as(
        "SELECT p.proname::text, p.prosrc, p.prorettype = 'trigger'::regtype \
                AND EXISTS (SELECT FROM pg_trigger t WHERE t.tgfoid = p.oid), \
                obj_description(p.oid, 'pg_proc') \
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
          WHERE n.nspname = 'public'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut src = String::new();
    rust_sources(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut src,
    );
    let calls = |text: &str, name: &str| text.contains(&format!("{name}("));
    let called: Vec<&str> = functions
        .iter()
        .filter(|(name, ..)| calls(&src, name))
        .map(|(name, ..)| name.as_str())
        .collect();
    assert!(
        called.contains(&"take_order_batches_v8") && called.contains(&"drop_verdict_v1"),
        "the scan of src/ finds the calls: {called:?}"
    );
    let mut live: std::collections::BTreeSet<&str> = functions
        .iter()
        .filter(|(name, _, used_by_trigger, comment)| {
            called.contains(&name.as_str())
                || *used_by_trigger
                || comment
                    .as_deref()
                    .and_then(|c| c.strip_prefix("superseded by "))
                    .is_some_and(|next| called.contains(&next))
        })
        .map(|(name, ..)| name.as_str())
        .collect();
    // What the live functions call is live too.
    loop {
        let more: Vec<&str> = functions
            .iter()
            .filter(|(name, ..)| !live.contains(name.as_str()))
            .filter(|(name, ..)| {
                functions
                    .iter()
                    .any(|(caller, body, ..)| live.contains(caller.as_str()) && calls(body, name))
            })
            .map(|(name, ..)| name.as_str())
            .collect();
        if more.is_empty() {
            break;
        }
        live.extend(more);
    }
    let dead: Vec<&str> = functions
        .iter()
        .map(|(name, ..)| name.as_str())
        .filter(|name| !live.contains(name))
        .collect();
    assert!(
        dead.is_empty(),
        "installed but called by nothing live: {dead:?}"
    );
}

/// #45 point 4: the row types carry checked ids and quantities, read through their own
/// parsers, so a value that breaks the rule (which the tables' own checks keep out) fails the
/// read instead of being dropped or passed on as a string. Mutation seen failing it: the
/// `ProductId` decoder (`checkout/order.rs`) answering some valid id for a bad value instead
/// of an error.
#[tokio::test(flavor = "multi_thread")]
async fn a_stored_value_that_breaks_its_type_fails_the_read() {
    use stockgate::domain::{ProductId, Quantity, UserId};
    let pool = pool().await;
    let good: (ProductId, UserId, Quantity) =
        sqlx::query_as("SELECT 'p-1'::text, 'u_1'::text, 3::int4")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (good.0.as_str(), good.1.as_str(), good.2.get()),
        ("p-1", "u_1", 3)
    );
    let bad_id = sqlx::query_scalar::<_, ProductId>("SELECT 'no spaces allowed'::text")
        .fetch_one(&pool)
        .await;
    assert!(bad_id.is_err(), "{bad_id:?}");
    let bad_user = sqlx::query_scalar::<_, UserId>("SELECT ''::text")
        .fetch_one(&pool)
        .await;
    assert!(bad_user.is_err(), "{bad_user:?}");
    let bad_qty = sqlx::query_scalar::<_, Quantity>("SELECT 0::int4")
        .fetch_one(&pool)
        .await;
    assert!(bad_qty.is_err(), "{bad_qty:?}");
}

/// Where `product`'s units are, per location, and the location `products.sole_location`
/// names for it.
async fn levels_of(pool: &PgPool, product: &str) -> (Vec<(String, i32)>, Option<String>) {
    let levels = sqlx::query_as(
        "SELECT location_id, available_quantity FROM stock_levels WHERE product_id = $1 \
          ORDER BY location_id",
    )
    .bind(product)
    .fetch_all(pool)
    .await
    .unwrap();
    let sole = sqlx::query_scalar("SELECT sole_location FROM products WHERE product_id = $1")
        .bind(product)
        .fetch_one(pool)
        .await
        .unwrap();
    (levels, sole)
}

/// The allocations of the order `user` holds under `key`.
async fn allocations_of(pool: &PgPool, user: &str, key: &str) -> serde_json::Value {
    sqlx::query_scalar("SELECT allocations FROM orders WHERE user_id = $1 AND idempotency_key = $2")
        .bind(user)
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Order SQL v7 sells a product kept at one place there without reading its levels, by
/// `products.sole_location`, which the `stock_levels` triggers keep: a second level, added
/// as a transfer adds one (under the product's lock, at 0, then units moved), turns the
/// product back to the allocation rule, which here picks the better-ranked new place; its
/// removal makes the product single-placed again. Mutations seen failing it: the mark's
/// `count(*) = 1` as `>= 1` (the mark stays `default`, and the second order is allocated
/// there, against the rule); the migration without its insert trigger (no mark is set).
#[tokio::test(flavor = "multi_thread")]
async fn a_product_kept_at_one_place_is_sold_there_and_its_mark_follows_its_levels() {
    let pool = pool().await;
    product(&pool, "one", 10).await;
    assert_eq!(
        levels_of(&pool, "one").await,
        (vec![("default".into(), 10)], Some("default".into()))
    );
    let got = take(&pool, "one", &[("u1", "k1", 2)]).await.unwrap();
    assert_eq!(got.held, [ours("confirmed", "one")]);
    assert_eq!(
        allocations_of(&pool, "u1", "k1").await,
        serde_json::json!([{"product_id": "one", "location_id": "default", "quantity": 2}])
    );
    assert_eq!(levels_of(&pool, "one").await.0, [("default".into(), 8)]);

    sqlx::raw_sql(
        "INSERT INTO locations (location_id, name, rank) VALUES ('near', 'Near', 1); \
         BEGIN; \
         SET LOCAL stockgate.levels = 'on'; \
         SELECT 1 FROM products WHERE product_id = 'one' FOR NO KEY UPDATE; \
         INSERT INTO stock_levels (product_id, location_id, available_quantity) VALUES ('one', 'near', 0); \
         UPDATE stock_levels SET available_quantity = available_quantity + CASE location_id WHEN 'near' THEN 3 ELSE -3 END \
          WHERE product_id = 'one'; \
         COMMIT;",
    )
    .execute(&pool)
    .await
    .unwrap();
    take(&pool, "one", &[("u2", "k2", 2)]).await.unwrap();
    assert_eq!(
        allocations_of(&pool, "u2", "k2").await,
        serde_json::json!([{"product_id": "one", "location_id": "near", "quantity": 2}])
    );
    assert_eq!(
        levels_of(&pool, "one").await,
        (vec![("default".into(), 5), ("near".into(), 1)], None)
    );

    product(&pool, "two", 4).await;
    sqlx::raw_sql(
        "INSERT INTO stock_levels (product_id, location_id, available_quantity) VALUES ('two', 'near', 0); \
         DELETE FROM stock_levels WHERE product_id = 'two' AND location_id = 'near';",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        levels_of(&pool, "two").await,
        (vec![("default".into(), 4)], Some("default".into()))
    );
}

/// The levels' guard: a product's count that says more than its one level holds (here the
/// level lowered behind the service's back, a disagreement `stockgate verify` would report)
/// sells nothing. The batch takes the product at its one place without reading the level, so
/// only the level's guarded update stands between the order and a level below what was sold:
/// it changes no row, its count of changed rows falls short of the takes, and the batch rolls
/// back whole. Mutations seen failing it: the check of that count removed (the order confirmed,
/// the count 5 with its level still 1); the takes counted as none.
#[tokio::test(flavor = "multi_thread")]
async fn a_level_short_of_its_take_rolls_the_batch_back_whatever_the_count_says() {
    let pool = pool().await;
    product(&pool, "lean", 10).await;
    sqlx::query("UPDATE stock_levels SET available_quantity = 1 WHERE product_id = 'lean'")
        .execute(&pool)
        .await
        .unwrap();
    // The precondition: the product is kept at `default` alone, its count 10, its level 1.
    assert_eq!(
        levels_of(&pool, "lean").await,
        (vec![("default".into(), 1)], Some("default".into()))
    );
    assert_eq!(stock_on(&pool, "lean").await, 10);
    let sold = sqlx::query(
        "SELECT status FROM take_order_batches_v8('{lean}', '{1}', ARRAY[gen_random_uuid()], \
                '{u1}', '{k1}', '{5}', '{lean:5}', '{}', '{}')",
    )
    .fetch_all(&pool)
    .await;
    assert!(sold.is_err(), "the batch sold past its level: {sold:?}");
    assert_eq!(rows_of(&pool, "u1").await, 0);
    assert_eq!(stock_on(&pool, "lean").await, 10);
    assert_eq!(levels_of(&pool, "lean").await.0, [("default".into(), 1)]);
}

/// A product kept at one place is sold there only while that place is active, whatever its
/// count says: here the place is switched off behind the service's back (its count not
/// moved, a disagreement `stockgate verify` would report), and the batch sells nothing and
/// writes nothing. Mutation seen failing it: order SQL v7 taking every product's one place as
/// active (`v_sole_ok` always true), which confirms the order from the inactive place.
#[tokio::test(flavor = "multi_thread")]
async fn a_product_is_never_sold_from_its_one_place_while_that_place_is_inactive() {
    let pool = pool().await;
    product(&pool, "off", 10).await;
    // The precondition: the product is marked as kept at `default` alone, so v7's shortcut
    // is the path this batch would take.
    assert_eq!(
        levels_of(&pool, "off").await,
        (vec![("default".into(), 10)], Some("default".into()))
    );
    sqlx::query("UPDATE locations SET active = false WHERE location_id = 'default'")
        .execute(&pool)
        .await
        .unwrap();
    let sold = sqlx::query(
        "SELECT status FROM take_order_batches_v8('{off}', '{1}', ARRAY[gen_random_uuid()], \
                '{u1}', '{k1}', '{1}', '{off:1}', '{}', '{}')",
    )
    .fetch_all(&pool)
    .await;
    assert!(sold.is_err(), "the batch sold from an inactive place");
    assert_eq!(rows_of(&pool, "u1").await, 0);
    assert_eq!(levels_of(&pool, "off").await.0, [("default".into(), 10)]);
}
