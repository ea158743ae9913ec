//! Answers that stay true when acknowledgements are lost: retries on another instance while
//! the original is still queued, reused keys, restocks retried after a lost answer, a COMMIT
//! whose outcome is unknown, batches that would deadlock, a poisoned row.

use crate::helpers::*;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const QUEUE: &str = "stockgate_order_queue_depth";

/// Waits until exactly `n` order batches are waiting on a row lock, as the primary's
/// `pg_stat_activity` shows them.
async fn batches_waiting(app: &TestApp, n: i64) {
    app.wait_for(
        &format!("{n} batches waiting on held rows"),
        Duration::from_secs(10),
        || async { batches_waiting_on(&app.primary, "Lock").await == n },
    )
    .await;
}

/// Sends an order in the background; its (status, body) arrives on the handle.
pub(crate) fn order_in_background(
    app: &TestApp,
    user: &str,
    key: &str,
    product: &str,
    qty: i64,
) -> tokio::task::JoinHandle<(StatusCode, Value)> {
    let req = app
        .client
        .post(app.url("/v1/orders"))
        .bearer_auth(app.user_token(user))
        .header("Idempotency-Key", key)
        .json(&json!({"product_id": product, "quantity": qty}));
    tokio::spawn(async move {
        let r = req.send().await.unwrap();
        let s = r.status();
        (s, r.json().await.unwrap_or(Value::Null))
    })
}

/// Waits until `app` has at least `n` orders queued (behind a held row lock).
pub(crate) async fn queued(app: &TestApp, n: f64) {
    app.wait_for(
        &format!("{n} orders queued"),
        Duration::from_secs(10),
        || async { app.metric(QUEUE).await >= n },
    )
    .await;
}

async fn key_rows(app: &TestApp, user: &str, key: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT product_id, status FROM orders WHERE user_id = $1 AND idempotency_key = $2",
    )
    .bind(user)
    .bind(key)
    .fetch_all(&app.primary)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_reused_on_another_product_takes_nothing_and_refuses_no_honest_buyer() {
    let app = spawn_app(shared_cluster()).await;
    for round in 0..5 {
        let (p1, p2) = (format!("reuse-a{round}"), format!("reuse-b{round}"));
        app.create_product(&p1, 100, 100).await;
        app.create_product(&p2, 21, 100).await;
        let key = format!("k{round}");
        assert_eq!(
            app.order("ada", &key, &p1, 1).await.status(),
            StatusCode::CREATED
        );
        // One early order occupies the worker on the held row; the rest form one batch,
        // the reuser first, asking for everything that batch can have.
        let lock = app.lock_rows(&[&p2]).await;
        let early = order_in_background(&app, "early", &key, &p2, 1);
        batches_waiting(&app, 1).await;
        let reuser = order_in_background(&app, "ada", &key, &p2, 20);
        queued(&app, 1.0).await;
        let honest: Vec<_> = (0..20)
            .map(|i| order_in_background(&app, &format!("buyer-{i}"), &key, &p2, 1))
            .collect();
        queued(&app, 21.0).await;
        lock.commit().await.unwrap();
        assert_eq!(early.await.unwrap().0, StatusCode::CREATED);
        let reused = reuser.await.unwrap();
        assert_error_for(
            &format!("round {round}"),
            &reused,
            422,
            "IDEMPOTENCY_KEY_REUSED",
        );
        for h in honest {
            let (s, body) = h.await.unwrap();
            assert_eq!(
                s,
                StatusCode::CREATED,
                "round {round}: an honest buyer got {body}"
            );
        }
        assert_eq!(app.stock_on_primary(&p2).await, 0, "round {round}");
        assert_eq!(
            key_rows(&app, "ada", &key).await,
            vec![(p1.clone(), "confirmed".into())]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_on_another_instance_while_the_original_is_queued_agrees_with_it() {
    let a = spawn_app(shared_cluster()).await;
    let b = spawn_beside(&a, shared_cluster()).await;
    let mut proven = 0;
    for round in 0..20 {
        let p = format!("retry-{round}");
        let key = format!("k{round}");
        a.create_product(&p, 1, 100).await;
        // B sells the last unit, so B's gate remembers "sold out" for up to 250 ms ...
        assert_eq!(
            b.order("seller", &key, &p, 1).await.status(),
            StatusCode::CREATED
        );
        // ... while stock comes back through A, which B does not hear of.
        assert_eq!(a.restock(&p, 1).await.status(), StatusCode::OK);
        let lock = a.lock_rows(&[&p]).await;
        let original = order_in_background(&a, "ada", &key, &p, 1);
        batches_waiting(&a, 1).await;
        // The buyer's answer was lost; they retry on B, whose gate says "sold out".
        let retry = order_in_background(&b, "ada", &key, &p, 1);
        let early = tokio::time::timeout(Duration::from_millis(500), async {
            while !retry.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok();
        lock.commit().await.unwrap();
        let (os, ob) = original.await.unwrap();
        let (rs, rb) = retry.await.unwrap();
        // Precondition: the retry was answered while the row was still held, i.e. by B's
        // gate without a batch; otherwise this round proves nothing.
        if early {
            proven += 1;
        }
        assert_eq!(os, rs, "round {round}: original {ob} vs retry {rb}");
        if os == StatusCode::CREATED {
            assert_eq!(ob["order_id"], rb["order_id"], "round {round}");
        }
        let rows = key_rows(&a, "ada", &key).await;
        let confirmed = rows.iter().filter(|(_, s)| s == "confirmed").count();
        assert_eq!(
            confirmed,
            usize::from(os == StatusCode::CREATED),
            "round {round}: {rows:?}"
        );
        assert_eq!(
            a.stock_on_primary(&p).await,
            i64::from(os != StatusCode::CREATED),
            "round {round}"
        );
        if proven >= 3 {
            break;
        }
    }
    eprintln!("retry rounds answered by B's stale gate while the original was queued: {proven}");
    assert!(
        proven >= 1,
        "no round reached B's stale 'sold out' while the original was queued"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_409_is_final_for_its_key_even_after_a_restock() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("final", 1, 100).await;
    assert_eq!(
        app.order("ada", "a", "final", 1).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(
        app.order("bob", "b", "final", 1).await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(app.restock("final", 5).await.status(), StatusCode::OK);
    let again = app.order("bob", "b", "final", 1).await;
    assert_eq!(
        again.status(),
        StatusCode::CONFLICT,
        "the same key answers as it did"
    );
    let other = app.order("bob", "b", "final", 2).await;
    assert_eq!(
        other.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "another body is refused"
    );
    assert_eq!(
        app.order("bob", "b2", "final", 1).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(app.stock_on_primary("final").await, 4);
    let (n, units) = app.confirmed_orders("final").await;
    assert_eq!((n, units), (2, 2));
}

async fn restock_with_key(
    app: &TestApp,
    product: &str,
    key: &str,
    qty: i64,
) -> (StatusCode, Value) {
    let r = app
        .client
        .post(app.url(&format!("/v1/products/{product}/restock")))
        .bearer_auth(&app.admin)
        .header("Idempotency-Key", key)
        .json(&json!({"quantity": qty}))
        .send()
        .await
        .unwrap();
    let s = r.status();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restock_retried_with_its_key_adds_once_and_answers_the_same() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("restocked", 10, 100).await;
    let answers: Vec<(StatusCode, Value)> = futures::stream::iter(0..20)
        .map(|_| restock_with_key(&app, "restocked", "delivery-1", 5))
        .buffer_unordered(20)
        .collect()
        .await;
    for (s, body) in &answers {
        assert_eq!(*s, StatusCode::OK, "{body}");
        assert_eq!(
            body["available_quantity"], 15,
            "every retry answers what the first did"
        );
    }
    assert_eq!(app.stock_on_primary("restocked").await, 15);
    let reused = restock_with_key(&app, "restocked", "delivery-1", 6).await;
    assert_error(&reused, 422, "IDEMPOTENCY_KEY_REUSED");
    // Stock sold in between does not change what the key answers, nor adds again.
    assert_eq!(
        app.order("ada", "x", "restocked", 3).await.status(),
        StatusCode::CREATED
    );
    let (s, body) = restock_with_key(&app, "restocked", "delivery-1", 5).await;
    assert_eq!(
        (s, body["available_quantity"].clone()),
        (StatusCode::OK, json!(15))
    );
    assert_eq!(app.stock_on_primary("restocked").await, 12);
    // Without a key every restock adds.
    app.restock("restocked", 1).await;
    app.restock("restocked", 1).await;
    assert_eq!(app.stock_on_primary("restocked").await, 14);
    let recorded: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(quantity), 0)::int8 FROM restocks WHERE product_id = 'restocked'",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    assert_eq!(
        recorded, 7,
        "one keyed restock of 5 and two of 1 are recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_whose_outcome_is_unknown_says_so_and_the_retry_finds_the_order() {
    let cluster = shared_cluster();
    let db = fresh_database(cluster).await;
    let proxy = ChaosProxy::start(cluster.port(0)).await;
    let app = spawn_through_proxy(cluster, &db, &proxy).await;
    app.create_product("ambiguous", 10, 100).await;
    // The commit takes a while for this buyer (a deferred trigger, run when the batch's
    // statement commits), long enough to lose the link.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.user_id = 'slowpoke' THEN PERFORM pg_sleep(1.5); END IF; RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON orders DEFERRABLE INITIALLY DEFERRED \
         FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let order = order_in_background(&app, "slowpoke", "k", "ambiguous", 1);
    app.wait_for(
        "the batch's commit under way",
        Duration::from_secs(10),
        || async { batches_waiting_on(&app.primary, "PgSleep").await == 1 },
    )
    .await;
    proxy.sever();
    assert_error(&order.await.unwrap(), 503, "OUTCOME_UNKNOWN");
    // The server finished the COMMIT nobody heard: the order exists ...
    app.wait_for("the order committed", Duration::from_secs(10), || async {
        key_rows(&app, "slowpoke", "k").await
            == vec![("ambiguous".to_string(), "confirmed".to_string())]
    })
    .await;
    // ... and the retry with the same key says so, taking nothing more.
    let retry = app.order("slowpoke", "k", "ambiguous", 1).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(app.stock_on_primary("ambiguous").await, 9);
    assert_eq!(app.confirmed_orders("ambiguous").await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_claiming_the_same_keys_in_opposite_orders_never_deadlock() {
    // Two instances, one product each: an instance runs the batches of several products that
    // are ready together as one statement, which cannot deadlock with itself; two instances'
    // statements are the case to hold.
    let app = spawn_app(shared_cluster()).await;
    let other = spawn_beside(&app, shared_cluster()).await;
    // Each of these users' rows takes a moment to insert, so two batches that claim their
    // keys are surely inside their inserts at the same time.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.user_id IN ('u1', 'u2') THEN PERFORM pg_sleep(0.2); END IF; RETURN NEW; END $$; \
         CREATE TRIGGER slow_insert BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION slow_insert();",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    for round in 0..5 {
        let (d1, d2) = (format!("dl-a{round}"), format!("dl-b{round}"));
        app.create_product(&d1, 100, 100).await;
        app.create_product(&d2, 100, 100).await;
        let lock = app.lock_rows(&[&d1, &d2]).await;
        let early: Vec<_> = [(&app, &d1), (&other, &d2)]
            .iter()
            .map(|(at, p)| order_in_background(at, "early", &format!("e-{p}"), p, 1))
            .collect();
        batches_waiting(&app, 2).await;
        let key = format!("k{round}");
        let mut answers = Vec::new();
        // (instance, product, user, orders then queued on that instance)
        for (at, p, user, n) in [
            (&app, &d1, "u1", 1.0),
            (&app, &d1, "u2", 2.0),
            (&other, &d2, "u2", 1.0),
            (&other, &d2, "u1", 2.0),
        ] {
            answers.push((user, order_in_background(at, user, &key, p, 1)));
            queued(at, n).await;
        }
        lock.commit().await.unwrap();
        // Precondition: the two batches were inside their key claims at the same moment.
        app.wait_for(
            "both batches inserting at once",
            Duration::from_secs(10),
            || async { batches_waiting_on(&app.primary, "PgSleep").await == 2 },
        )
        .await;
        for e in early {
            assert_eq!(e.await.unwrap().0, StatusCode::CREATED);
        }
        let mut by_user: std::collections::HashMap<&str, Vec<StatusCode>> = Default::default();
        for (user, h) in answers {
            let (s, body) = h.await.unwrap();
            assert!(
                s == StatusCode::CREATED
                    || (s == StatusCode::UNPROCESSABLE_ENTITY
                        && code(&body) == "IDEMPOTENCY_KEY_REUSED"),
                "round {round}: {s} {body}"
            );
            by_user.entry(user).or_default().push(s);
        }
        for (user, mut statuses) in by_user {
            statuses.sort();
            assert_eq!(
                statuses,
                vec![StatusCode::CREATED, StatusCode::UNPROCESSABLE_ENTITY],
                "round {round}: {user} holds one order and one refusal"
            );
        }
        let taken = 200 - app.stock_on_primary(&d1).await - app.stock_on_primary(&d2).await;
        assert_eq!(taken, 4, "round {round}: two early orders and one per user");
    }
    // A batch that hit a deadlock is rerun and ends the same: only the database saw it.
    assert_eq!(
        deadlocks(shared_cluster(), &app.database).await,
        0,
        "the primary detected deadlocks between the batches"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poisoned_row_fails_alone_and_the_rest_of_its_batch_commits() {
    let app = spawn_app(shared_cluster()).await;
    app.create_product("poisoned", 100, 100).await;
    // A real fault inside the batch transaction: the database refuses a statement that
    // inserts one buyer's row. Before refusing, it notes in a sequence (which no rollback
    // undoes) the most rows it saw refused in one statement.
    sqlx::raw_sql(
        "CREATE SEQUENCE poisoned_batch MINVALUE 0 START 0; \
         CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE n bigint; BEGIN \
           IF EXISTS (SELECT 1 FROM inserted WHERE user_id = 'poison') THEN \
             SELECT count(*) INTO n FROM inserted; \
             PERFORM setval('poisoned_batch', greatest(n, (SELECT last_value FROM poisoned_batch))); \
             RAISE EXCEPTION 'poisoned row'; \
           END IF; RETURN NULL; END $$; \
         CREATE TRIGGER refuse_poison AFTER INSERT ON orders REFERENCING NEW TABLE AS inserted \
         FOR EACH STATEMENT EXECUTE FUNCTION refuse_poison();",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let lock = app.lock_rows(&["poisoned"]).await;
    let early = order_in_background(&app, "early", "e", "poisoned", 1);
    batches_waiting(&app, 1).await;
    let mut buyers: Vec<String> = (0..30).map(|i| format!("mate-{i}")).collect();
    buyers.insert(13, "poison".into());
    let rest: Vec<_> = buyers
        .iter()
        .map(|u| (u.clone(), order_in_background(&app, u, "k", "poisoned", 1)))
        .collect();
    queued(&app, 31.0).await;
    lock.commit().await.unwrap();
    assert_eq!(early.await.unwrap().0, StatusCode::CREATED);
    for (user, h) in rest {
        let (s, body) = h.await.unwrap();
        if user == "poison" {
            assert_error(&(s, body), 503, "ORDER_NOT_WRITTEN");
        } else {
            assert_eq!(s, StatusCode::CREATED, "{user}: {body}");
        }
    }
    assert_eq!(app.confirmed_orders("poisoned").await, (31, 31));
    assert_eq!(app.stock_on_primary("poisoned").await, 69);
    // Precondition: the poisoned row was first tried in one statement with all 30 others.
    let widest: i64 = sqlx::query_scalar("SELECT last_value FROM poisoned_batch")
        .fetch_one(&app.primary)
        .await
        .unwrap();
    assert_eq!(
        widest, 31,
        "the widest statement refused for the poisoned row"
    );
}

/// A histogram's observations above `le` seconds, and the sum of all of them.
async fn above(app: &TestApp, histogram: &str, le: &str) -> (f64, f64) {
    let text = app.metrics_text().await;
    let value = |prefix: String| {
        text.lines()
            .find(|l| l.starts_with(&prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{prefix} is not on /metrics"))
    };
    let all = value(format!("{histogram}_count "));
    let below = value(format!("{histogram}_bucket{{le=\"{le}\"}} "));
    (all - below, value(format!("{histogram}_sum ")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_orders_wait_in_the_queue_and_its_batchs_transaction_are_measured_apart() {
    const QUEUED: &str = "stockgate_order_queue_seconds";
    const BATCH: &str = "stockgate_order_batch_seconds";
    const HELD: &str = "stockgate_order_row_held_seconds";
    let app = spawn_app(shared_cluster()).await;
    app.create_product("timed", 10, 100).await;
    let (queue_slow, queue_sum) = above(&app, QUEUED, "0.25").await;
    let (batch_slow, batch_sum) = above(&app, BATCH, "0.25").await;
    let (held_slow, _) = above(&app, HELD, "0.25").await;
    let helds = app.metric(&format!("{HELD}_count")).await;
    let lock = app.lock_rows(&["timed"]).await;
    // The first order's batch waits on the row inside its transaction; the second order
    // waits in the queue behind it.
    let first = order_in_background(&app, "ada", "t1", "timed", 1);
    batches_waiting(&app, 1).await;
    let in_transaction = Instant::now();
    let second = order_in_background(&app, "bob", "t2", "timed", 1);
    queued(&app, 1.0).await;
    let in_queue = Instant::now();
    // The wait being measured: the row stays locked this long with both orders waiting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    lock.commit().await.unwrap();
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(second.await.unwrap().0, StatusCode::CREATED);
    let (queue_slow_now, queue_sum_now) = above(&app, QUEUED, "0.25").await;
    let (batch_slow_now, batch_sum_now) = above(&app, BATCH, "0.25").await;
    // Each wait is counted once, in its own stage: the first order's in its transaction,
    // the second's in the queue (its own transaction then ran at once).
    assert_eq!(
        (queue_slow_now - queue_slow, batch_slow_now - batch_slow),
        (1.0, 1.0)
    );
    let held = |from: Instant| released.duration_since(from).as_secs_f64();
    assert!(
        queue_sum_now - queue_sum >= held(in_queue),
        "queue time {} s < the {} s the second order waited",
        queue_sum_now - queue_sum,
        held(in_queue)
    );
    assert!(
        batch_sum_now - batch_sum >= held(in_transaction),
        "batch time {} s < the {} s the first batch waited on the row",
        batch_sum_now - batch_sum,
        held(in_transaction)
    );
    // Each batch held the row from its lock to its commit: the first one's wait for the lock
    // is not the row's time in its hands.
    let (held_slow_now, _) = above(&app, HELD, "0.25").await;
    assert_eq!(
        (
            app.metric(&format!("{HELD}_count")).await - helds,
            held_slow_now - held_slow
        ),
        (2.0, 0.0),
        "two batches held the row, neither for a quarter second"
    );
}
