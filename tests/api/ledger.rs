//! The ledger's rule after a mixed workload on two instances: orders, carts, holds (expired,
//! released, confirmed), cancels, transfers (received at once and in transit), an import and
//! adjustments, all at once over products kept at three locations. `stockgate verify` then
//! finds every (product, location) agreeing with its movements and allocations; the primary's
//! own sums are held to the same rule, so the check cannot pass by checking nothing.

use crate::carts::lines;
use crate::helpers::*;
use devcluster::Cluster;
use futures::future::join_all;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::process::Command;
use std::time::Duration;

/// `stockgate verify` against `app`'s database (its primary and replicas): the exit code and
/// what it printed.
pub(crate) fn verify(cluster: &Cluster, database: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .arg("verify")
        .env("DATABASE_URL", cluster.primary_url(database))
        .env("STOCKGATE_REPLICA_URLS", cluster.replica_urls(database))
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The levels that break the rule, by the primary's own sums.
async fn breaking(app: &TestApp) -> Vec<(String, String, i64, i64)> {
    sqlx::query_as(
        "WITH t AS (SELECT product_id, location_id, available_quantity::int8 AS held, 0::int8 AS ledger FROM stock_levels \
                    UNION ALL SELECT product_id, location_id, 0, delta FROM movements \
                    UNION ALL SELECT a.product_id, a.location_id, 0, -a.quantity \
                      FROM (SELECT allocations FROM orders WHERE status = 'confirmed' \
                            UNION ALL SELECT allocations FROM holds WHERE status = 'held') x, \
                           jsonb_to_recordset(x.allocations) AS a(product_id text, location_id text, quantity int8)) \
         SELECT product_id, location_id, sum(held)::int8, sum(ledger)::int8 FROM t \
          GROUP BY 1, 2 HAVING sum(held) <> sum(ledger) ORDER BY 1, 2",
    )
    .fetch_all(&app.primary)
    .await
    .unwrap()
}

const PRODUCTS: [&str; 2] = ["lw-1", "lw-2"];
const PLACES: [&str; 3] = ["default", "lw-a", "lw-b"];

/// One client's share of the workload, `i` choosing what it does; every request goes to `a`
/// or `b` by turn.
async fn client(a: &TestApp, b: &TestApp, i: usize) {
    let app = if i.is_multiple_of(2) { a } else { b };
    let user = format!("lw-u{i}");
    let p = PRODUCTS[i % 2];
    let at = PLACES[i % 3];
    match i % 8 {
        0 => {
            let body = json!({"product_id": p, "quantity": 1 + i % 3});
            let (s, o) = send_as(
                app,
                Method::POST,
                "/v1/orders",
                &user,
                Some(&format!("o{i}")),
                body,
            )
            .await;
            // Every other confirmed order is cancelled, through the other instance.
            if s == StatusCode::CREATED && i.is_multiple_of(16) {
                let other = if i.is_multiple_of(2) { b } else { a };
                let path = format!("/v1/orders/{}/cancel", o["order_id"].as_str().unwrap());
                send_as(other, Method::POST, &path, &user, None, json!({})).await;
            }
        }
        1 => {
            let body = json!({"lines": lines(&[("lw-1", 2), ("lw-2", 1)]), "locations": [PLACES[(i + 1) % 3], at]});
            send_as(
                app,
                Method::POST,
                "/v1/orders",
                &user,
                Some(&format!("c{i}")),
                body,
            )
            .await;
        }
        2 | 3 => {
            // A hold that is confirmed (2) or released (3).
            let body = json!({"lines": lines(&[(p, 2)]), "ttl_s": 600});
            let (s, h) = send_as(
                app,
                Method::POST,
                "/v1/holds",
                &user,
                Some(&format!("h{i}")),
                body,
            )
            .await;
            if s == StatusCode::CREATED {
                let id = h["hold_id"].as_str().unwrap();
                let (m, path) = match i % 8 {
                    2 => (Method::POST, format!("/v1/holds/{id}/confirm")),
                    _ => (Method::DELETE, format!("/v1/holds/{id}")),
                };
                send_as(app, m, &path, &user, None, json!({})).await;
            }
        }
        4 => {
            // A hold left to expire.
            let body = json!({"lines": lines(&[(p, 1)]), "ttl_s": 1});
            send_as(
                app,
                Method::POST,
                "/v1/holds",
                &user,
                Some(&format!("x{i}")),
                body,
            )
            .await;
        }
        5 => {
            let body = json!({"product_id": p, "from": at, "to": PLACES[(i + 1) % 3],
                              "quantity": 1 + i % 2, "in_transit": i.is_multiple_of(3)});
            let (s, t) = send_admin(
                app,
                Method::POST,
                "/v1/transfers",
                Some(&format!("t{i}")),
                body,
            )
            .await;
            if s == StatusCode::CREATED && t["status"] == "in_transit" && i % 6 == 5 {
                let path = format!(
                    "/v1/transfers/{}/receive",
                    t["transfer_id"].as_str().unwrap()
                );
                send_admin(app, Method::POST, &path, None, Value::Null).await;
            }
        }
        6 => {
            let body = json!({"location_id": at, "delta": if i.is_multiple_of(3) { 3 } else { -1 }, "reason": "correction"});
            let path = format!("/v1/products/{p}/adjustments");
            send_admin(app, Method::POST, &path, Some(&format!("d{i}")), body).await;
        }
        _ => {
            let body = json!({"location_id": at, "set": 4 + i % 5, "reason": "count"});
            let path = format!("/v1/products/{p}/adjustments");
            send_admin(app, Method::POST, &path, Some(&format!("s{i}")), body).await;
        }
    }
}

// Mutation: a restock, a transfer or an import that writes no movement (drop the movement
// CTE of `levels::add` or of the import's statements): verify exits 1 naming the level.
// Mutation: the migration's opening movement left out: every level disagrees.
// Mutation: the rule counting released holds' allocations: verify exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn verify_agrees_after_a_mixed_workload_on_two_instances() {
    let cluster = shared_cluster();
    let a = spawn_app(cluster).await;
    let b = spawn_beside(&a, cluster).await;
    for (id, rank) in [("lw-a", 10), ("lw-b", 20)] {
        let body = json!({"location_id": id, "name": id, "rank": rank});
        let (s, got) = send_admin(&a, Method::POST, "/v1/locations", None, body).await;
        assert_eq!(s, StatusCode::CREATED, "{got}");
    }
    for p in PRODUCTS {
        let stock: Vec<Value> = PLACES
            .iter()
            .map(|l| json!({"location_id": l, "quantity": 12}))
            .collect();
        let body = json!({"product_id": p, "name": p, "price_cents": 100, "stock": stock});
        let (s, got) = answer(a.post_product(&body).await).await;
        assert_eq!(s, StatusCode::CREATED, "{got}");
    }
    // Stock restated by import while the clients run: a new product and lw-2's `default`.
    let dir = std::env::temp_dir().join(format!("sg-ledger-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("stock.csv");
    std::fs::write(
        &file,
        "product_id,name,price_cents,available_quantity\nlw-2,lw-2,100,20\nlw-3,Imported,250,9\n",
    )
    .unwrap();
    let import = {
        let (url, replicas) = (
            cluster.primary_url(&a.database),
            cluster.replica_urls(&a.database),
        );
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_stockgate"))
                .args(["import", "--file"])
                .arg(&file)
                .env("DATABASE_URL", url)
                .env("STOCKGATE_REPLICA_URLS", replicas)
                .current_dir(std::env::temp_dir())
                .output()
                .unwrap()
        })
    };
    join_all((0..96).map(|i| client(&a, &b, i))).await;
    let imported = import.await.unwrap();
    assert!(
        imported.status.success(),
        "{}",
        String::from_utf8_lossy(&imported.stderr)
    );
    // Every short hold expired by the sweeper (of either instance).
    let expired = "SELECT count(*) FROM holds WHERE status = 'held' AND expires_at < now() + interval '1 minute'";
    wait_for(
        "the short holds expired",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(expired)
                .fetch_one(&a.primary)
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    let statuses: Vec<String> = sqlx::query_scalar("SELECT DISTINCT status FROM holds ORDER BY 1")
        .fetch_all(&a.primary)
        .await
        .unwrap();
    for s in ["confirmed", "expired", "released"] {
        assert!(statuses.iter().any(|x| x == s), "a hold {s}: {statuses:?}");
    }
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT reason FROM movements ORDER BY 1")
            .fetch_all(&a.primary)
            .await
            .unwrap();
    for r in [
        "correction",
        "count",
        "create",
        "import",
        "transfer_in",
        "transfer_out",
    ] {
        assert!(
            reasons.iter().any(|x| x == r),
            "a movement {r}: {reasons:?}"
        );
    }

    assert_eq!(breaking(&a).await, vec![], "the primary's own sums");
    let (code, out) = blocking(|| verify(cluster, &a.database));
    assert_eq!(code, Some(0), "{out}");
    let levels: i64 = sqlx::query_scalar("SELECT count(*) FROM stock_levels")
        .fetch_one(&a.primary)
        .await
        .unwrap();
    assert!(
        out.contains(&levels.to_string()),
        "verify says how many it checked ({levels}): {out}"
    );
}
