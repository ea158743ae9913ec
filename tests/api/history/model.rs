//! The history's records: what the primary holds once the run is over, and every request any
//! client sent with what it heard back. The checker reads the one against the other.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::fmt;
use uuid::Uuid;

// ---------------------------------------------------------------------------------------------
// The database's side of the story. All of this file's SQL is here: issue 13's branch changes
// these tables (a `refused` order status, a `restocks` table), so this is the one place to
// adjust.
// ---------------------------------------------------------------------------------------------

/// One row of `orders`.
#[derive(Clone, Debug)]
pub(super) struct Row {
    pub(super) order_id: Uuid,
    pub(super) user: String,
    pub(super) key: String,
    pub(super) product: String,
    pub(super) quantity: i64,
    /// `confirmed`, `cancelled`, or `refused` (a 409 that claimed its key; not an order).
    pub(super) status: String,
    /// A `refused` row's stored reason (`refusal->>'code'`); NULL is a refusal for stock.
    pub(super) refusal: Option<String>,
    /// When the primary inserted the row, on its clock (the column's `clock_timestamp()`).
    pub(super) created_at: DateTime<Utc>,
    /// Where its units came from (`[]` for a refusal); a cancelled order keeps them, they say
    /// where its units went back to.
    pub(super) allocations: Vec<Alloc>,
}

impl Row {
    /// The 409 code a refused row stands for.
    pub(super) fn reason(&self) -> &str {
        self.refusal.as_deref().unwrap_or(OUT_OF_STOCK)
    }
}

/// A product's flash-drop rules as the primary holds them once the run is over. Nothing changes
/// them during the run, so they are the rules every request was judged by.
#[derive(Clone, Debug, Default)]
pub(super) struct Rules {
    pub(super) limit: Option<i64>,
    pub(super) starts: Option<DateTime<Utc>>,
    pub(super) ends: Option<DateTime<Utc>>,
}

/// Units a user holds of a product outside single-product orders: a line of a confirmed cart,
/// or of a live hold. The workload places neither, but a user's count under a limit includes
/// them, so the limit check reads them too.
#[derive(Clone, Debug)]
pub(super) struct LineUnits {
    pub(super) user: String,
    pub(super) product: String,
    pub(super) quantity: i64,
    /// The cart order's `created_at`; `None` for a hold, whose row is written before its
    /// products are locked and judged, so its time says nothing about the sale window.
    pub(super) ordered_at: Option<DateTime<Utc>>,
}

/// One row of `restocks` that was made under an `Idempotency-Key`.
#[derive(Clone, Debug)]
pub(super) struct RestockRow {
    pub(super) key: String,
    pub(super) product: String,
    pub(super) quantity: i64,
    pub(super) location: String,
}

/// One row of `movements` written by an adjustment (one with an `Idempotency-Key`).
#[derive(Clone, Debug)]
pub(super) struct AdjustmentRow {
    pub(super) movement_id: i64,
    pub(super) key: String,
    pub(super) product: String,
    pub(super) location: String,
    /// As the primary recorded it: a `set`'s delta depends on the count it met.
    pub(super) delta: i64,
    pub(super) available_after: i64,
}

/// A (product, location): where a count is kept.
pub(super) type Place = (String, String);

pub(super) fn place(product: &str, location: &str) -> Place {
    (product.to_owned(), location.to_owned())
}

/// One entry of an order's, a cart's or a hold's `allocations`, in a row or in an answer.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
pub(super) struct Alloc {
    #[serde(rename = "product_id")]
    pub(super) product: String,
    #[serde(rename = "location_id")]
    pub(super) location: String,
    pub(super) quantity: i64,
}

impl Alloc {
    pub(super) fn place(&self) -> Place {
        place(&self.product, &self.location)
    }
}

/// `allocations` as a list to compare: sorted, since the order of its entries says nothing.
/// `None` if `v` is no list of allocations.
pub(super) fn allocations(v: &Value) -> Option<Vec<Alloc>> {
    let mut out: Vec<Alloc> = serde_json::from_value(v.clone()).ok()?;
    out.sort();
    Some(out)
}

/// A transfer's state: its units in no location, or joined to `to` (once).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum TransferStatus {
    InTransit,
    Received,
}

/// One row of `transfers`.
#[derive(Clone, Debug)]
pub(super) struct TransferRow {
    pub(super) transfer_id: Uuid,
    pub(super) key: String,
    pub(super) product: String,
    pub(super) from: String,
    pub(super) to: String,
    pub(super) quantity: i64,
    pub(super) status: TransferStatus,
}

/// What `stock.changed` events say moved at one (product, location) for one reason: the
/// units added and the units removed. A witness of how many times a change was applied,
/// written in the change's own transaction; the movement ledger will be another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Announced {
    pub(super) added: i64,
    pub(super) removed: i64,
}

/// One order's confirm or cancel, at its place in the primary's commit order.
///
/// The order comes from the event rows the same transaction wrote (the `events` triggers):
/// `n`, an identity drawn when the row is inserted, and `xid`, the transaction. It is sound
/// for one product's orders and cancels, which is all a limit needs: every transaction that
/// confirms or cancels an order locks the order's product rows first (the batch functions with
/// `FOR NO KEY UPDATE`, a cancel with `stock::lock`) and holds the lock until it commits, and
/// its event row is inserted under that lock. So of two such transactions on one product, the
/// one that committed first drew every one of its `n` before the other drew any. A sequence is
/// used rather than `created_at`/`cancelled_at`: those are wall-clock readings (a clock may step
/// back), and equal microseconds would leave two commits unordered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Step {
    /// The writing transaction: its steps commit together, and are judged together.
    pub(super) xid: String,
    pub(super) n: i64,
    pub(super) order_id: Uuid,
    pub(super) cancel: bool,
}

/// What the primary holds once the history is over.
#[derive(Clone, Debug, Default)]
pub(super) struct Snapshot {
    pub(super) stock: BTreeMap<String, i64>,
    pub(super) rules: BTreeMap<String, Rules>,
    pub(super) orders: Vec<Row>,
    pub(super) lines: Vec<LineUnits>,
    /// `None` when there is no `restocks` table (main before issue 13).
    pub(super) restocks: Option<Vec<RestockRow>>,
    /// Every order's confirm and cancel, in commit order per product (by `n`).
    pub(super) steps: Vec<Step>,
    /// `stock_levels`: each (product, location) that ever held the product.
    pub(super) levels: BTreeMap<Place, i64>,
    /// Every location, and whether it is active.
    pub(super) active: BTreeMap<String, bool>,
    pub(super) transfers: Vec<TransferRow>,
    /// The allocations of holds whose units have not been returned (`held`; a confirmed
    /// hold's units are its order's).
    pub(super) held: Vec<Alloc>,
    /// `stock.changed` events by (product, location) and reason.
    pub(super) announced: BTreeMap<(Place, String), Announced>,
    /// The movements adjustments wrote (rows of `movements` with an `idempotency_key`).
    pub(super) adjustments: Vec<AdjustmentRow>,
}

pub(super) async fn snapshot(pool: &PgPool) -> Snapshot {
    type ProductRow = (
        String,
        i64,
        Option<i64>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
    );
    let products = sqlx::query_as::<_, ProductRow>(
        "SELECT product_id, available_quantity::int8, max_per_customer::int8, sale_starts_at, sale_ends_at \
         FROM products",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    type OrderRow = (
        Uuid,
        String,
        String,
        String,
        i64,
        String,
        Option<String>,
        DateTime<Utc>,
        String,
    );
    let orders = sqlx::query_as::<_, OrderRow>(
        "SELECT order_id, user_id, idempotency_key, product_id, quantity::int8, status, \
                refusal->>'code', created_at, allocations::text FROM orders",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // The same two sources as the service's `customer_units`: cart lines of confirmed orders
    // (a single-product order's units are its row's), and the lines of live holds.
    let lines = sqlx::query_as::<_, (String, String, i64, Option<DateTime<Utc>>)>(
        "SELECT o.user_id, l.product_id, l.quantity::int8, o.created_at \
           FROM order_lines l JOIN orders o USING (order_id) \
          WHERE o.status = 'confirmed' AND o.product_id IS NULL \
         UNION ALL \
         SELECT h.user_id, l.product_id, l.quantity::int8, NULL \
           FROM hold_lines l JOIN holds h USING (hold_id) WHERE h.status = 'held'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    // `restocks` has no location column: its request fingerprint names a location other than
    // `default` after an `@` (`product:quantity@location`, `checkout::Checkout::restock`).
    let restocks = sqlx::query_as::<_, (String, String, i64, String)>(
        "SELECT idempotency_key, product_id, quantity::int8, \
                CASE WHEN strpos(request_fingerprint, '@') > 0 \
                     THEN split_part(request_fingerprint, '@', 2) ELSE 'default' END \
           FROM restocks WHERE idempotency_key IS NOT NULL",
    )
    .fetch_all(pool)
    .await;
    let steps = sqlx::query_as::<_, (String, i64, Uuid, bool)>(
        "SELECT e.xid::text, e.n, (item->'data'->>'order_id')::uuid, item->>'type' = 'order.cancelled' \
           FROM events e, json_array_elements(e.items) item \
          WHERE e.types && ARRAY['order.confirmed', 'order.cancelled'] \
            AND item->>'type' IN ('order.confirmed', 'order.cancelled') \
          ORDER BY e.n",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(xid, n, order_id, cancel)| Step {
        xid,
        n,
        order_id,
        cancel,
    })
    .collect();
    let (levels, active, transfers, held, announced) = by_location(pool).await;
    let adjustments = sqlx::query_as::<_, (i64, String, String, String, i64, i64)>(
        "SELECT movement_id, idempotency_key, product_id, location_id, delta::int8, available_after::int8 \
           FROM movements WHERE idempotency_key IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(
        |(movement_id, key, product, location, delta, available_after)| AdjustmentRow {
            movement_id,
            key,
            product,
            location,
            delta,
            available_after,
        },
    )
    .collect();
    let restocks = match restocks {
        Ok(rows) => Some(rows),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => None,
        Err(e) => panic!("reading restocks: {e}"),
    };
    Snapshot {
        stock: products.iter().map(|p| (p.0.clone(), p.1)).collect(),
        rules: products
            .into_iter()
            .map(|(product, _, limit, starts, ends)| {
                (
                    product,
                    Rules {
                        limit,
                        starts,
                        ends,
                    },
                )
            })
            .collect(),
        orders: orders
            .into_iter()
            .map(
                |(order_id, user, key, product, quantity, status, refusal, created_at, allocs)| {
                    Row {
                        order_id,
                        user,
                        key,
                        product,
                        quantity,
                        status,
                        refusal,
                        created_at,
                        allocations: serde_json::from_str::<Value>(&allocs)
                            .ok()
                            .and_then(|v| allocations(&v))
                            .unwrap_or_else(|| panic!("an order's allocations: {allocs}")),
                    }
                },
            )
            .collect(),
        lines: lines
            .into_iter()
            .map(|(user, product, quantity, ordered_at)| LineUnits {
                user,
                product,
                quantity,
                ordered_at,
            })
            .collect(),
        restocks: restocks.map(|rows| {
            rows.into_iter()
                .map(|(key, product, quantity, location)| RestockRow {
                    key,
                    product,
                    quantity,
                    location,
                })
                .collect()
        }),
        steps,
        levels,
        active,
        transfers,
        held,
        announced,
        adjustments,
    }
}

type ByLocation = (
    BTreeMap<Place, i64>,
    BTreeMap<String, bool>,
    Vec<TransferRow>,
    Vec<Alloc>,
    BTreeMap<(Place, String), Announced>,
);

/// The per-location tables (migration `20261205000002_locations.sql`): levels, locations,
/// transfers, live holds' allocations, and what `stock.changed` events announced.
async fn by_location(pool: &PgPool) -> ByLocation {
    let levels = sqlx::query_as::<_, (String, String, i64)>(
        "SELECT product_id, location_id, available_quantity::int8 FROM stock_levels",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(p, l, n)| ((p, l), n))
    .collect();
    let active = sqlx::query_as::<_, (String, bool)>("SELECT location_id, active FROM locations")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    type TransferTuple = (Uuid, String, String, String, String, i64, String);
    let transfers = sqlx::query_as::<_, TransferTuple>(
        "SELECT transfer_id, idempotency_key, product_id, from_location, to_location, \
                quantity::int8, status FROM transfers",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(
        |(transfer_id, key, product, from, to, quantity, status)| TransferRow {
            transfer_id,
            key,
            product,
            from,
            to,
            quantity,
            status: serde_json::from_value(Value::String(status.clone()))
                .unwrap_or_else(|_| panic!("a transfer's status: {status}")),
        },
    )
    .collect();
    let held = sqlx::query_scalar::<_, String>(
        "SELECT allocations::text FROM holds WHERE status = 'held'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .flat_map(|a| {
        serde_json::from_str::<Value>(&a)
            .ok()
            .and_then(|v| allocations(&v))
            .unwrap_or_else(|| panic!("a hold's allocations: {a}"))
    })
    .collect();
    let announced = sqlx::query_as::<_, (String, String, String, i64, i64)>(
        "SELECT d->>'product_id', coalesce(d->>'location_id', 'default'), d->>'reason', \
                coalesce(sum((d->>'delta')::int8) FILTER (WHERE (d->>'delta')::int8 > 0), 0)::int8, \
                coalesce(-sum((d->>'delta')::int8) FILTER (WHERE (d->>'delta')::int8 < 0), 0)::int8 \
           FROM events e, json_array_elements(e.items) item, LATERAL (SELECT item->'data' AS d) x \
          WHERE e.types && ARRAY['stock.changed'] AND item->>'type' = 'stock.changed' \
          GROUP BY 1, 2, 3",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(p, l, reason, added, removed)| (((p, l), reason), Announced { added, removed }))
    .collect();
    (levels, active, transfers, held, announced)
}

/// A digest of every order's status, every product's stock, every level and every
/// transfer's status: it stops changing once no request is still working on the primary.
pub(super) async fn fingerprint(pool: &PgPool) -> String {
    sqlx::query_scalar(
        "SELECT md5(coalesce((SELECT string_agg(order_id::text || status, ',' ORDER BY order_id) FROM orders), '') \
         || coalesce((SELECT string_agg(product_id || ':' || available_quantity, ',' ORDER BY product_id) FROM products), '') \
         || coalesce((SELECT string_agg(product_id || '@' || location_id || ':' || available_quantity, ',' \
                                        ORDER BY product_id, location_id) FROM stock_levels), '') \
         || coalesce((SELECT string_agg(transfer_id::text || status, ',' ORDER BY transfer_id) FROM transfers), ''))",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The primary's sessions on this database that are inside a transaction: what a request
/// that never resolves is stuck on.
pub(super) async fn open_transactions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT format('pid %s %s wait=%s:%s xact_age=%ss query=%s', pid, state, wait_event_type, wait_event, \
                round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1), left(query, 100)) \
         FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The history: every request any client sent, and what it heard back.
// ---------------------------------------------------------------------------------------------

/// What a request asked for. Two requests with equal targets are retries of each other.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Target {
    Order {
        user: String,
        key: String,
        product: String,
        quantity: i64,
        /// The request's `locations`, in its order of preference (`None`: every active one).
        #[serde(skip_serializing_if = "Option::is_none")]
        locations: Option<Vec<String>>,
    },
    Cancel {
        user: String,
        order_id: Uuid,
    },
    Restock {
        key: String,
        product: String,
        quantity: i64,
        /// `location_id` (`None`: the body names none, which means `default`).
        #[serde(skip_serializing_if = "Option::is_none")]
        location: Option<String>,
    },
    /// `POST /v1/transfers` under `key`.
    Transfer {
        key: String,
        product: String,
        from: String,
        to: String,
        quantity: i64,
        in_transit: bool,
    },
    /// `POST /v1/transfers/{transfer_id}/receive`. `key` is the transfer's, the mover's note
    /// of which transfer it is (not sent).
    Receive {
        key: String,
        transfer_id: Uuid,
    },
    /// `PUT` of one of a user's own records (read-your-writes): `value` is unique to this
    /// write, so a read names the write it saw.
    Save {
        user: String,
        record: Record,
        value: String,
    },
    /// `GET` of one of a user's own records.
    Read {
        user: String,
        record: Record,
    },
    /// `POST /v1/products/{product}/adjustments` under `key`: exactly one of `delta` and
    /// `set`, `expected` a compare-and-set.
    Adjust {
        key: String,
        product: String,
        /// `location_id` (`None`: the body names none, which means `default`).
        #[serde(skip_serializing_if = "Option::is_none")]
        location: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        delta: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        set: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        expected: Option<i64>,
        reason: String,
    },
}

/// A user's own records, the two the read-your-writes promise covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Record {
    Settings,
    Profile,
}

impl Record {
    pub(super) fn path(self) -> &'static str {
        match self {
            Record::Settings => "settings",
            Record::Profile => "profile",
        }
    }

    /// The body of a `PUT` that writes `value`: the settings `{"v": value}`, or a profile whose
    /// name is `value` and whose email is made from it (a read holding one write's name and
    /// another's email is torn).
    pub(super) fn body(self, value: &str) -> Value {
        match self {
            Record::Settings => serde_json::json!({"settings": {"v": value}}),
            Record::Profile => {
                serde_json::json!({"display_name": value, "email": email_of(value)})
            }
        }
    }
}

/// The email a profile written with `value` holds.
pub(super) fn email_of(value: &str) -> String {
    format!("{}@example.com", value.replace(['/', '#'], "."))
}

/// What a read of an own record returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    /// The value no write gave: settings `{}`, or 404 `PROFILE_NOT_FOUND`.
    Initial,
    Value(String),
    /// A 200 that is neither: a profile whose email is not its name's, settings without `v`.
    Garbled(String),
}

impl Target {
    /// Where a restock's units go.
    pub(super) fn restocked_at(location: &Option<String>) -> &str {
        location.as_deref().unwrap_or(DEFAULT)
    }

    /// Whether the resolver sends it again until it settles: orders, cancels, restocks,
    /// transfers, receives and adjustments. An
    /// own record's read needs no answer, and its write is `PUT`, whose outcome the checker
    /// leaves open when it was not heard.
    pub(super) fn resolvable(&self) -> bool {
        !matches!(self, Target::Save { .. } | Target::Read { .. })
    }
}

/// Why the client sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Kind {
    /// A fresh key.
    New,
    /// A fresh key whose client drops the request after a short random delay.
    HangUp,
    /// The same key and body after a lost answer or a 503.
    Retry,
    /// The same key and body after a definite answer: it must agree.
    Replay,
    /// The same key with another body: it must be 422 and take nothing.
    Reuse,
    Cancel,
    /// After the run, with every fault healed: until a definite answer.
    Resolve,
    /// A `PUT` of an own record.
    Save,
    /// A `GET` of an own record.
    Read,
}

/// The location every database has, and where a write that names none goes.
pub(super) const DEFAULT: &str = "default";

/// The 409 codes an order may be answered (flash drops added the last three).
pub(super) const OUT_OF_STOCK: &str = "OUT_OF_STOCK";
pub(super) const LIMIT_EXCEEDED: &str = "LIMIT_EXCEEDED";
pub(super) const SALE_NOT_STARTED: &str = "SALE_NOT_STARTED";
pub(super) const SALE_ENDED: &str = "SALE_ENDED";

#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub(super) enum Answer {
    /// No answer: the client hung up, or the connection failed.
    Lost { lost: String },
    Got {
        status: u16,
        retry_after: bool,
        body: Value,
    },
}

impl Answer {
    pub(super) fn status(&self) -> Option<u16> {
        match self {
            Answer::Got { status, .. } => Some(*status),
            Answer::Lost { .. } => None,
        }
    }

    /// Anything but a lost answer or a 503 settles the request (the contract: a 503 is
    /// "unknown", retry the same key).
    pub(super) fn definite(&self) -> bool {
        matches!(self.status(), Some(s) if s != 503)
    }

    /// 409 `SALE_NOT_STARTED`: definite about this request (it took nothing and claimed no
    /// key), but not about its key, which may buy once the sale is on.
    pub(super) fn not_started(&self) -> bool {
        self.status() == Some(409) && self.code() == SALE_NOT_STARTED
    }

    /// A definite answer its key keeps: anything but a lost answer, a 503 or a
    /// `SALE_NOT_STARTED`.
    pub(super) fn settles(&self) -> bool {
        self.definite() && !self.not_started()
    }

    /// The code of a 409 that is final for its key (every 409 but `SALE_NOT_STARTED`).
    pub(super) fn refusal(&self) -> Option<&str> {
        (self.status() == Some(409) && !self.not_started()).then(|| self.code())
    }

    pub(super) fn body(&self) -> &Value {
        match self {
            Answer::Got { body, .. } => body,
            Answer::Lost { .. } => &Value::Null,
        }
    }

    pub(super) fn code(&self) -> &str {
        crate::helpers::code(self.body())
    }

    pub(super) fn order_id(&self) -> Option<Uuid> {
        self.body()["order_id"].as_str()?.parse().ok()
    }

    /// An order's (or a cancel's) `allocations`, sorted; `None` if the body holds none.
    pub(super) fn allocations(&self) -> Option<Vec<Alloc>> {
        allocations(&self.body()["allocations"])
    }

    pub(super) fn transfer_id(&self) -> Option<Uuid> {
        self.body()["transfer_id"].as_str()?.parse().ok()
    }

    /// An adjustment's `movement_id` (opaque: a string).
    pub(super) fn movement_id(&self) -> Option<&str> {
        self.body()["movement_id"].as_str()
    }

    pub(super) fn transfer_status(&self) -> Option<TransferStatus> {
        serde_json::from_value(self.body()["status"].clone()).ok()
    }

    /// What a read of `record` returned, if it returned one (a 200, or a profile's 404).
    pub(super) fn seen(&self, record: Record) -> Option<Seen> {
        let b = self.body();
        match (record, self.status()?) {
            (Record::Settings, 200) => Some(match b["settings"].as_object() {
                Some(o) if o.is_empty() => Seen::Initial,
                _ => match b["settings"]["v"].as_str() {
                    Some(v) => Seen::Value(v.to_owned()),
                    None => Seen::Garbled(b.to_string()),
                },
            }),
            (Record::Profile, 200) => Some(match b["display_name"].as_str() {
                Some(v) if b["email"].as_str() == Some(email_of(v).as_str()) => {
                    Seen::Value(v.to_owned())
                }
                _ => Seen::Garbled(b.to_string()),
            }),
            (Record::Profile, 404) if self.code() == "PROFILE_NOT_FOUND" => Some(Seen::Initial),
            _ => None,
        }
    }

    /// `served_by` of a routed answer (`primary` or a replica's name).
    pub(super) fn served_by(&self) -> Option<&str> {
        self.body()["served_by"].as_str()
    }
}

#[derive(Clone, Debug, Serialize)]
pub(super) struct Op {
    pub(super) seq: usize,
    /// When the client sent it and when it heard the answer (or gave up), in ms since the
    /// history began: one clock for every client, so answers can be put in real-time order.
    pub(super) sent_ms: u64,
    pub(super) at_ms: u64,
    pub(super) client: String,
    pub(super) kind: Kind,
    pub(super) instance: usize,
    pub(super) target: Target,
    pub(super) answer: Answer,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match &self.target {
            Target::Order {
                user,
                key,
                product,
                quantity,
                locations,
            } => match locations {
                Some(l) => format!("order {user}/{key} {product}×{quantity} from {l:?}"),
                None => format!("order {user}/{key} {product}×{quantity}"),
            },
            Target::Cancel { user, order_id } => format!("cancel {user} {order_id}"),
            Target::Restock {
                key,
                product,
                quantity,
                location,
            } => format!(
                "restock {key} {product}+{quantity}@{}",
                Target::restocked_at(location)
            ),
            Target::Transfer {
                key,
                product,
                from,
                to,
                quantity,
                in_transit,
            } => {
                let how = if *in_transit { " in transit" } else { "" };
                format!("transfer {key} {product}×{quantity} {from}→{to}{how}")
            }
            Target::Receive { key, transfer_id } => format!("receive {key} ({transfer_id})"),
            Target::Save {
                user,
                record,
                value,
            } => format!("save {user}'s {} = {value}", record.path()),
            Target::Read { user, record } => format!("read {user}'s {}", record.path()),
            Target::Adjust {
                key,
                product,
                location,
                delta,
                set,
                expected,
                reason,
            } => {
                let change = match (delta, set) {
                    (Some(d), _) => format!("{d:+}"),
                    (_, Some(s)) => format!("={s}"),
                    _ => "?".into(),
                };
                let cas = expected.map_or(String::new(), |e| format!(" if {e}"));
                format!(
                    "adjust {key} {product}{change}@{}{cas} ({reason})",
                    Target::restocked_at(location)
                )
            }
        };
        let heard = match &self.answer {
            Answer::Lost { lost } => format!("lost ({lost})"),
            Answer::Got {
                status,
                retry_after,
                body,
            } => {
                let ra = if *retry_after { " Retry-After" } else { "" };
                format!("{status}{ra} {body}")
            }
        };
        write!(
            f,
            "#{} +{}..{}ms {} {:?} @{} {what} → {heard}",
            self.seq, self.sent_ms, self.at_ms, self.client, self.kind, self.instance
        )
    }
}
