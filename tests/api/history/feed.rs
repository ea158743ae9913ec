//! The event feed against the tables it announces (issue 30): after the run, with every
//! transaction ended, the whole feed read through the service's own read must hold one
//! `order.confirmed` per order the tables hold, one `order.cancelled` per cancelled order, a
//! `stock.changed` per restock, one with reason `adjust` per adjustment's movement (issue 47:
//! each with its movement's place and delta), and books that add up to every product's stock
//! (the adjustments' deltas among them).
//!
//! With locations (issue 46), two sets of books: per product from the events' `lines`, which
//! add up to the product's units at every location (an inactive one's too: its restocks and
//! transfers are announced, though they move no count that is for sale); and per (product,
//! location) from `stock.changed`'s `location_id` and the `allocations` orders and holds carry,
//! which add up to each level, the active ones to the product's count.

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
    let mut at: BTreeMap<(String, String), i64> = BTreeMap::new();
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
        let allocations = || {
            e.data["allocations"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|a| {
                    let s = |k: &str| a[k].as_str().unwrap_or_default().to_owned();
                    (
                        (s("product_id"), s("location_id")),
                        a["quantity"].as_i64().unwrap_or_default(),
                    )
                })
        };
        let order = e.data["order_id"].as_str().and_then(|o| o.parse().ok());
        let sign = match e.kind.as_str() {
            "stock.changed" => {
                let p = e.data["product_id"].as_str().unwrap_or_default().to_owned();
                let l = e.data["location_id"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned();
                let delta = e.data["delta"].as_i64().unwrap_or_default();
                *books.entry(p.clone()).or_default() += delta;
                *at.entry((p, l)).or_default() += delta;
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
        for (place, q) in allocations() {
            *at.entry(place).or_default() += sign * q;
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
    // Each adjustment's movement announced once, at its place, with its delta: as multisets
    // of (product, location, delta), so a lost, doubled or misplaced event shows.
    let mut adjusted: BTreeMap<(String, String, i64), i64> = BTreeMap::new();
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT product_id, location_id, delta::int8 FROM movements WHERE idempotency_key IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .expect("adjustments' movements");
    let movements = rows.len();
    for row in rows {
        *adjusted.entry(row).or_default() += 1;
    }
    let adjust_events: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind == "stock.changed" && e.data["reason"] == "adjust")
        .collect();
    for e in &adjust_events {
        let s = |k: &str| e.data[k].as_str().unwrap_or("default").to_owned();
        let delta = e.data["delta"].as_i64().unwrap_or_default();
        *adjusted
            .entry((s("product_id"), s("location_id"), delta))
            .or_default() -= 1;
    }
    if adjust_events.len() != movements {
        found.push(format!(
            "{movements} adjustments' movements, {} adjust events",
            adjust_events.len()
        ));
    }
    for ((p, l, delta), n) in adjusted.into_iter().filter(|(_, n)| *n != 0) {
        found.push(format!(
            "{p} at {l}, delta {delta:+}: {} adjustments' movements more than adjust events",
            n
        ));
    }
    let levels: Vec<(String, String, i64, bool)> = sqlx::query_as(
        "SELECT s.product_id, s.location_id, s.available_quantity::int8, l.active \
           FROM stock_levels s JOIN locations l USING (location_id)",
    )
    .fetch_all(pool)
    .await
    .expect("levels");
    let mut everywhere: BTreeMap<String, i64> = BTreeMap::new();
    let mut for_sale: BTreeMap<String, i64> = BTreeMap::new();
    for (p, l, level, active) in levels {
        *everywhere.entry(p.clone()).or_default() += level;
        let booked = at.remove(&(p.clone(), l.clone())).unwrap_or(0);
        if active {
            *for_sale.entry(p.clone()).or_default() += booked;
        }
        if booked != level {
            found.push(format!(
                "{p} at {l}: the events' books say {booked}, the level {level}"
            ));
        }
    }
    for ((p, l), booked) in at.into_iter().filter(|(_, n)| *n != 0) {
        found.push(format!(
            "{p} at {l}: the events' books say {booked}, and there is no level"
        ));
    }
    let stock: Vec<(String, i64)> =
        sqlx::query_as("SELECT product_id, available_quantity::int8 FROM products")
            .fetch_all(pool)
            .await
            .expect("products");
    for (p, available) in stock {
        let booked = books.get(&p).copied().unwrap_or(0);
        let held = everywhere.get(&p).copied().unwrap_or(0);
        if booked != held {
            found.push(format!(
                "{p}: the events' lines say {booked}, its levels {held}"
            ));
        }
        let active = for_sale.get(&p).copied().unwrap_or(0);
        if active != available {
            found.push(format!(
                "{p}: the events' books at its active locations say {active}, the row {available}"
            ));
        }
    }
    found
}
