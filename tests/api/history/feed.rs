//! The event feed against the tables it announces (issue 30): after the run, with every
//! transaction ended, the whole feed read through the service's own read must hold one
//! `order.confirmed` per order the tables hold, one `order.cancelled` per cancelled order, a
//! `stock.changed` per restock, and books that add up to every product's stock.

use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap};
use stockgate::events::{Cursor, Event, feed};
use uuid::Uuid;

/// What is wrong with the feed, as sentences (none: it tells the tables' story exactly).
pub(super) async fn feed_anomalies(pool: &PgPool) -> Vec<String> {
    let mut events: Vec<Event> = Vec::new();
    let mut after = Cursor::START;
    loop {
        let page = feed::read(pool, after, 1000, None)
            .await
            .expect("a feed page");
        let Some(last) = page.last() else { break };
        after = last.cursor;
        events.extend(page);
    }
    let mut found = Vec::new();
    if !events.windows(2).all(|w| w[0].cursor < w[1].cursor) {
        found.push("the feed is not in one strictly increasing order".to_owned());
    }
    let mut announced: HashMap<(Uuid, &str), usize> = HashMap::new();
    let mut books: BTreeMap<String, i64> = BTreeMap::new();
    let hold_orders: Vec<Uuid> = events
        .iter()
        .filter(|e| e.kind == "hold.confirmed")
        .filter_map(|e| e.data["order_id"].as_str()?.parse().ok())
        .collect();
    for e in &events {
        let lines = || {
            e.data["lines"].as_array().into_iter().flatten().map(|l| {
                (
                    l["product_id"].as_str().unwrap_or_default().to_owned(),
                    l["quantity"].as_i64().unwrap_or_default(),
                )
            })
        };
        let order = e.data["order_id"].as_str().and_then(|o| o.parse().ok());
        let sign = match e.kind.as_str() {
            "stock.changed" => {
                let p = e.data["product_id"].as_str().unwrap_or_default().to_owned();
                *books.entry(p).or_default() += e.data["delta"].as_i64().unwrap_or_default();
                0
            }
            "order.confirmed" | "order.cancelled" => {
                if let Some(o) = order {
                    *announced.entry((o, e.kind.as_str())).or_default() += 1;
                }
                match (e.kind.as_str(), order) {
                    (_, Some(o)) if e.kind == "order.confirmed" && hold_orders.contains(&o) => 0,
                    ("order.confirmed", _) => -1,
                    _ => 1,
                }
            }
            "hold.created" => -1,
            "hold.released" | "hold.expired" => 1,
            _ => 0,
        };
        for (p, q) in lines() {
            *books.entry(p).or_default() += sign * q;
        }
    }
    let orders: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT order_id, status FROM orders WHERE status <> 'refused'")
            .fetch_all(pool)
            .await
            .expect("orders");
    for (id, status) in &orders {
        let confirmed = announced.remove(&(*id, "order.confirmed")).unwrap_or(0);
        if confirmed != 1 {
            found.push(format!(
                "order {id} ({status}) announced confirmed {confirmed} times"
            ));
        }
        let cancelled = announced.remove(&(*id, "order.cancelled")).unwrap_or(0);
        if cancelled != usize::from(status == "cancelled") {
            found.push(format!(
                "order {id} ({status}) announced cancelled {cancelled} times"
            ));
        }
    }
    for ((id, kind), n) in announced {
        found.push(format!(
            "{kind} ×{n} for order {id}, which the tables do not hold"
        ));
    }
    let restocks: i64 = sqlx::query_scalar("SELECT count(*) FROM restocks")
        .fetch_one(pool)
        .await
        .expect("restocks");
    let restocked = events
        .iter()
        .filter(|e| e.kind == "stock.changed" && e.data["reason"] == "restock")
        .count();
    if restocked as i64 != restocks {
        found.push(format!("{restocks} restocks, {restocked} restock events"));
    }
    let stock: Vec<(String, i64)> =
        sqlx::query_as("SELECT product_id, available_quantity::int8 FROM products")
            .fetch_all(pool)
            .await
            .expect("products");
    for (p, available) in stock {
        let booked = books.get(&p).copied().unwrap_or(0);
        if booked != available {
            found.push(format!(
                "{p}: the events' books say {booked}, the row {available}"
            ));
        }
    }
    found
}
