//! The checker: a pure function of the history and the database. Its own tests, at the end,
//! hold that it can fail.

use super::locations::{self, Cause, Movement, Opening};
use super::model::*;
use super::nemesis::{FAULTS, Fault, Window};
use super::own_data;
use super::workload::WINDOWED;
use crate::helpers::ErrorBody;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use uuid::Uuid;

/// What an anomaly is about; it selects the operations printed with it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Subject {
    Key {
        user: String,
        key: String,
    },
    Order(Uuid),
    Restock(String),
    Product(String),
    /// One user's units of one product.
    Customer {
        user: String,
        product: String,
    },
    Database,
    /// One user's settings or profile.
    Own {
        user: String,
        record: Record,
    },
    /// A transfer, by its key.
    Transfer(String),
    /// One product's count at one location.
    Location {
        product: String,
        location: String,
    },
    /// An adjustment, by its key.
    Adjustment(String),
}

#[derive(Clone, Debug)]
pub(super) struct Anomaly {
    /// What kind of lie, for the tally.
    pub(super) class: &'static str,
    pub(super) subject: Subject,
    pub(super) what: String,
}

impl Subject {
    fn of(target: &Target) -> Subject {
        match target {
            Target::Order { user, key, .. } => Subject::Key {
                user: user.clone(),
                key: key.clone(),
            },
            Target::Cancel { order_id, .. } => Subject::Order(*order_id),
            Target::Restock { key, .. } => Subject::Restock(key.clone()),
            Target::Save { user, record, .. } | Target::Read { user, record } => Subject::Own {
                user: user.clone(),
                record: *record,
            },
            Target::Transfer { key, .. } | Target::Receive { key, .. } => {
                Subject::Transfer(key.clone())
            }
            Target::Adjust { key, .. } => Subject::Adjustment(key.clone()),
        }
    }

    fn concerns(&self, op: &Op) -> bool {
        match (self, &op.target) {
            (Subject::Order(id), Target::Cancel { order_id, .. }) => id == order_id,
            (Subject::Order(id), _) => op.answer.order_id() == Some(*id),
            (Subject::Product(p), Target::Order { product, .. })
            | (Subject::Product(p), Target::Restock { product, .. })
            | (Subject::Product(p), Target::Transfer { product, .. })
            | (Subject::Product(p), Target::Adjust { product, .. }) => p == product,
            (Subject::Location { product, location }, _) => touches(op, product, location),
            (
                Subject::Customer {
                    user: u,
                    product: p,
                },
                Target::Order { user, product, .. },
            ) => u == user && p == product,
            (Subject::Customer { user: u, .. }, Target::Cancel { user, .. }) => u == user,
            (Subject::Database, _) => false,
            (subject, target) => *subject == Subject::of(target),
        }
    }
}

/// Whether `op` moved units of `product` at `location`, by its request (a restock there, a
/// transfer from or to it) or by its answer (an order's or a cancel's allocations there, a
/// receive of a transfer to it).
fn touches(op: &Op, product: &str, location: &str) -> bool {
    match &op.target {
        Target::Restock {
            product: p,
            location: l,
            ..
        } => p == product && Target::restocked_at(l) == location,
        Target::Transfer {
            product: p,
            from,
            to,
            ..
        } => p == product && (from == location || to == location),
        Target::Receive { .. } => {
            op.answer.body()["product_id"] == product && op.answer.body()["to"] == location
        }
        Target::Order { .. } | Target::Cancel { .. } => op.answer.allocations().is_some_and(|a| {
            a.iter()
                .any(|a| a.product == product && a.location == location)
        }),
        Target::Adjust {
            product: p,
            location: l,
            ..
        } => p == product && Target::restocked_at(l) == location,
        Target::Save { .. } | Target::Read { .. } => false,
    }
}

struct Checker<'a> {
    db: &'a Snapshot,
    found: Vec<Anomaly>,
}

pub(super) fn check(initial: &Opening, history: &[Op], db: &Snapshot) -> Vec<Anomaly> {
    let mut c = Checker { db, found: vec![] };
    c.statuses(history);
    let mut keys: BTreeMap<(String, String), Vec<&Op>> = BTreeMap::new();
    let mut cancels: BTreeMap<Uuid, Vec<&Op>> = BTreeMap::new();
    let mut restocks: BTreeMap<String, Vec<&Op>> = BTreeMap::new();
    let mut adjusts: BTreeMap<String, Vec<&Op>> = BTreeMap::new();
    for op in history {
        match &op.target {
            Target::Order { user, key, .. } => keys
                .entry((user.clone(), key.clone()))
                .or_default()
                .push(op),
            Target::Cancel { order_id, .. } => cancels.entry(*order_id).or_default().push(op),
            Target::Restock { key, .. } => restocks.entry(key.clone()).or_default().push(op),
            Target::Adjust { key, .. } => adjusts.entry(key.clone()).or_default().push(op),
            // Judged on their own, below.
            Target::Save { .. }
            | Target::Read { .. }
            | Target::Transfer { .. }
            | Target::Receive { .. } => {}
        }
    }
    let rows: HashMap<(&str, &str), &Row> = db
        .orders
        .iter()
        .map(|r| ((r.user.as_str(), r.key.as_str()), r))
        .collect();
    for ((user, key), ops) in &keys {
        c.order_key(
            user,
            key,
            ops,
            rows.get(&(user.as_str(), key.as_str())).copied(),
        );
    }
    c.unasked_rows(&keys, &cancels);
    c.cancels(&cancels);
    let mut given = c.restocks(&restocks);
    given.extend(c.adjustments(&adjusts));
    c.found
        .extend(locations::check(initial, given, history, db));
    c.limits();
    c.windows(history);
    c.found.extend(own_data::read_your_writes(history));
    c.found
}

impl<'a> Checker<'a> {
    fn flag(&mut self, class: &'static str, subject: Subject, what: impl Into<String>) {
        self.found.push(Anomaly {
            class,
            subject,
            what: what.into(),
        });
    }

    /// No 500 ever; no 5xx but 503, and a 503 always says when to retry; each endpoint
    /// answers only what the contract lets it.
    fn statuses(&mut self, history: &[Op]) {
        for op in history {
            let Some(status) = op.answer.status() else {
                continue;
            };
            let code = op.answer.code();
            let wrong = match (&op.target, status) {
                (_, 503)
                    if !matches!(
                        op.answer,
                        Answer::Got {
                            retry_after: true,
                            ..
                        }
                    ) =>
                {
                    Some("503 without Retry-After")
                }
                (_, 500..) if status != 503 => Some("a 5xx other than 503"),
                (Target::Order { product, .. }, 409) => {
                    self.refusal_not_allowed(product, &op.answer)
                }
                (Target::Order { .. }, 422) if code != "IDEMPOTENCY_KEY_REUSED" => {
                    Some("422 not IDEMPOTENCY_KEY_REUSED")
                }
                (Target::Order { .. }, 201 | 422 | 503) => None,
                (Target::Cancel { .. } | Target::Restock { .. }, 200 | 503) => None,
                (Target::Transfer { .. }, 409) if code != OUT_OF_STOCK => {
                    Some("transfer 409 not OUT_OF_STOCK")
                }
                (Target::Transfer { .. }, 422) if code != "IDEMPOTENCY_KEY_REUSED" => {
                    Some("422 not IDEMPOTENCY_KEY_REUSED")
                }
                (Target::Transfer { .. }, 201 | 409 | 422 | 503) => None,
                (Target::Receive { .. }, 200 | 503) => None,
                (Target::Adjust { expected, .. }, 409) => match code {
                    "STOCK_CHANGED" if expected.is_none() => {
                        Some("STOCK_CHANGED for an adjustment that expected nothing")
                    }
                    // The count it met, which no count is below.
                    "STOCK_CHANGED"
                        if op.answer.body()["error"]["available_quantity"]
                            .as_i64()
                            .is_none_or(|n| n < 0) =>
                    {
                        Some("STOCK_CHANGED without a count of zero or more")
                    }
                    "STOCK_CHANGED" | OUT_OF_STOCK => None,
                    _ => Some("adjustment 409 not STOCK_CHANGED or OUT_OF_STOCK"),
                },
                (Target::Adjust { .. }, 422) if code != "IDEMPOTENCY_KEY_REUSED" => {
                    Some("422 not IDEMPOTENCY_KEY_REUSED")
                }
                (Target::Adjust { .. }, 200 | 422 | 503) => None,
                // A read of own data may fail closed; a write's outcome may be unknown.
                (Target::Save { .. } | Target::Read { .. }, 200 | 503) => None,
                (Target::Read { record, .. }, 404)
                    if *record == Record::Profile && code == "PROFILE_NOT_FOUND" =>
                {
                    None
                }
                _ => Some("a status this request may not get"),
            };
            if let Some(wrong) = wrong {
                self.flag(
                    wrong,
                    Subject::of(&op.target),
                    format!("#{}: {wrong}", op.seq),
                );
            }
        }
    }

    /// Whether an order's 409 is one its product may get: `OUT_OF_STOCK` always, the drop codes
    /// only where the product's rules make them possible, and `SALE_NOT_STARTED` says when
    /// to come back.
    fn refusal_not_allowed(&self, product: &str, answer: &Answer) -> Option<&'static str> {
        let rules = self.db.rules.get(product).cloned().unwrap_or_default();
        let retry_after = matches!(
            answer,
            Answer::Got {
                retry_after: true,
                ..
            }
        );
        match answer.code() {
            OUT_OF_STOCK => None,
            LIMIT_EXCEEDED if rules.limit.is_none() => Some("LIMIT_EXCEEDED without a limit"),
            SALE_NOT_STARTED if rules.starts.is_none() => Some("SALE_NOT_STARTED without a start"),
            SALE_NOT_STARTED if !retry_after => Some("SALE_NOT_STARTED without Retry-After"),
            SALE_ENDED if rules.ends.is_none() => Some("SALE_ENDED without an end"),
            LIMIT_EXCEEDED | SALE_NOT_STARTED | SALE_ENDED => None,
            _ => Some("409 with a code orders may not get"),
        }
    }

    /// Every answer for one (user, key) against the others and against its row.
    fn order_key(&mut self, user: &str, key: &str, ops: &[&Op], row: Option<&Row>) {
        let subject = Subject::Key {
            user: user.into(),
            key: key.into(),
        };
        // The first request under a key is its original: shoppers reuse only answered keys.
        let original = &ops[0].target;
        let Target::Order {
            product, quantity, ..
        } = original
        else {
            unreachable!()
        };
        let (same, reused): (Vec<&Op>, Vec<&Op>) =
            ops.iter().partition(|op| op.target == *original);
        let definite: Vec<&Op> = same
            .iter()
            .copied()
            .filter(|o| o.answer.definite())
            .collect();
        let settled: Vec<&Op> = definite
            .iter()
            .copied()
            .filter(|o| o.answer.settles())
            .collect();
        let ids: BTreeSet<Uuid> = definite
            .iter()
            .filter_map(|o| o.answer.order_id())
            .collect();
        // SALE_NOT_STARTED claims nothing: it is no refusal of the key.
        let refusal = definite.iter().find_map(|o| o.answer.refusal());
        let refused = refusal.is_some();
        if settled.is_empty() {
            self.flag(
                "unresolved",
                subject.clone(),
                "no definite answer its key keeps (only lost, 503 or SALE_NOT_STARTED), even after resolution",
            );
        }
        if ids.len() > 1 {
            self.flag(
                "two orders for one key",
                subject.clone(),
                format!("answered {} different orders: {ids:?}", ids.len()),
            );
        }
        if !ids.is_empty() && refused {
            // Which came first tells the two lies apart: a 409 that was not final, or a retry
            // told 409 about a confirmed order.
            let (class, what) = match settled[0].answer.status() {
                Some(409) => ("409 not final (a later 201)", "answered 409, then 201"),
                _ => ("201 then 409", "answered 201, then 409 to a retry"),
            };
            self.flag(class, subject.clone(), what);
        }
        if definite.iter().any(|o| o.answer.status() == Some(422)) {
            self.flag(
                "own body answered 422",
                subject.clone(),
                "its own body was answered 422",
            );
        }
        for o in definite.iter().filter(|o| o.answer.status() == Some(201)) {
            let b = o.answer.body();
            if b["order_id"].as_str().is_none()
                || b["product_id"] != json!(product)
                || b["quantity"] != json!(quantity)
                || b["user_id"] != json!(user)
            {
                self.flag(
                    "201 does not describe the request",
                    subject.clone(),
                    format!("#{}: the 201 does not describe the request", o.seq),
                );
            }
        }
        match (ids.first(), row) {
            (Some(id), None) => self.flag(
                "201 without a row",
                subject.clone(),
                format!("answered order {id}, but no row holds the key"),
            ),
            (Some(id), Some(r))
                if r.order_id != *id
                    || r.product != *product
                    || r.quantity != *quantity
                    || !is_order(r) =>
            {
                self.flag(
                    "201 names another row",
                    subject.clone(),
                    format!("answered order {id} ({product}×{quantity}), but the key holds {r:?}"),
                )
            }
            // A row with a reused body is the reuse's lie, flagged below.
            (None, Some(r))
                if refused && is_order(r) && r.product == *product && r.quantity == *quantity =>
            {
                self.flag(
                    "409 but the key holds an order",
                    subject.clone(),
                    format!(
                        "answered 409 {}, but the key holds order {} ({})",
                        refusal.unwrap_or_default(),
                        r.order_id,
                        r.status
                    ),
                )
            }
            _ => {}
        }
        self.refusal_reasons(&subject, product, *quantity, &definite, row);
        self.reused(&subject, product, *quantity, &reused, row);
    }

    /// A final 409 claimed its key with a refused row that states the same reason (so every
    /// retry is told the same), and a `LIMIT_EXCEEDED` names the product's limit and a count
    /// that the request would have passed it with.
    fn refusal_reasons(
        &mut self,
        subject: &Subject,
        product: &str,
        quantity: i64,
        definite: &[&Op],
        row: Option<&Row>,
    ) {
        let limit = self.db.rules.get(product).and_then(|r| r.limit);
        for o in definite {
            let Some(code) = o.answer.refusal() else {
                continue;
            };
            match row {
                None => self.flag(
                    "409 that claimed no key",
                    subject.clone(),
                    format!("#{}: answered 409 {code}, but no row holds the key", o.seq),
                ),
                Some(r) if r.status == "refused" && r.reason() != code => self.flag(
                    "409 not the key's refusal",
                    subject.clone(),
                    format!(
                        "#{}: answered 409 {code}, but the key's refusal says {}",
                        o.seq,
                        r.reason()
                    ),
                ),
                // An order in the row: flagged by the caller.
                Some(_) => {}
            }
            // A body that is no error body states nothing.
            let e = ErrorBody::deserialize(o.answer.body())
                .ok()
                .map(|b| b.error);
            let states = |limit: i64| {
                e.as_ref().is_some_and(|e| {
                    e.product_id.as_deref() == Some(product)
                        && e.limit == Some(limit)
                        && e.already
                            .is_some_and(|already| already >= 0 && already + quantity > limit)
                })
            };
            if code == LIMIT_EXCEEDED && !limit.is_some_and(states) {
                self.flag(
                    "LIMIT_EXCEEDED misstates the limit",
                    subject.clone(),
                    format!(
                        "#{}: {product}×{quantity} with limit {limit:?}, answered {}",
                        o.seq,
                        o.answer.body()
                    ),
                );
            }
        }
    }

    /// A reused key (another body) is answered 422 and takes nothing.
    fn reused(
        &mut self,
        subject: &Subject,
        product: &str,
        quantity: i64,
        reused: &[&Op],
        row: Option<&Row>,
    ) {
        let mut bodies: BTreeMap<String, bool> = BTreeMap::new();
        for o in reused {
            let Target::Order {
                product, quantity, ..
            } = &o.target
            else {
                unreachable!()
            };
            *bodies.entry(format!("{product}×{quantity}")).or_default() |= o.answer.definite();
            if o.answer.definite() && o.answer.status() != Some(422) {
                self.flag(
                    "reused key not answered 422",
                    subject.clone(),
                    format!(
                        "#{}: reused with another body, answered {:?}; want 422",
                        o.seq,
                        o.answer.status()
                    ),
                );
            }
        }
        for (body, done) in bodies {
            if !done {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    format!("reuse {body}: no definite answer, even after resolution"),
                );
            }
        }
        if let Some(r) =
            row.filter(|r| !reused.is_empty() && (r.product != product || r.quantity != quantity))
        {
            self.flag(
                "reused key's body took the row",
                subject.clone(),
                format!("the key's row holds a reused body: {r:?}"),
            );
        }
    }

    /// Rows nobody asked for: a key no client sent, a cancel no client asked for.
    fn unasked_rows(
        &mut self,
        keys: &BTreeMap<(String, String), Vec<&Op>>,
        cancels: &BTreeMap<Uuid, Vec<&Op>>,
    ) {
        for r in &self.db.orders {
            if !keys.contains_key(&(r.user.clone(), r.key.clone())) {
                self.flag(
                    "a row nobody asked for",
                    Subject::Order(r.order_id),
                    format!("a row under a key nobody sent: {r:?}"),
                );
            }
            if r.status == "cancelled" && !cancels.contains_key(&r.order_id) {
                self.flag(
                    "a cancel nobody asked for",
                    Subject::Order(r.order_id),
                    "cancelled, but nobody cancelled it",
                );
            }
            if !["confirmed", "cancelled", "refused"].contains(&r.status.as_str()) {
                self.flag(
                    "bad row status",
                    Subject::Order(r.order_id),
                    format!("status {}", r.status),
                );
            }
        }
    }

    /// A cancel answered 200 is cancelled in the database.
    fn cancels(&mut self, cancels: &BTreeMap<Uuid, Vec<&Op>>) {
        for (id, ops) in cancels {
            let subject = Subject::Order(*id);
            if !ops.iter().any(|o| o.answer.definite()) {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    "cancel: no definite answer, even after resolution",
                );
            }
            let said_cancelled = ops.iter().any(|o| o.answer.status() == Some(200));
            let row = self.db.orders.iter().find(|r| r.order_id == *id);
            if said_cancelled && row.map(|r| r.status.as_str()) != Some("cancelled") {
                self.flag(
                    "cancel 200 not applied",
                    subject,
                    format!("cancel answered 200, but the row is {row:?}"),
                );
            }
        }
    }

    /// Each restock key answered 200 was applied exactly once, at its location, and every
    /// retry answered the same. Returns the units each location was given, as the admins saw
    /// it.
    fn restocks(&mut self, restocks: &BTreeMap<String, Vec<&Op>>) -> Vec<Movement> {
        let mut given = vec![];
        if self.db.restocks.is_none() {
            self.flag(
                "no restocks table",
                Subject::Database,
                "no restocks table: a restock cannot be checked exactly-once",
            );
        }
        let table = self.db.restocks.clone().unwrap_or_default();
        for (key, ops) in restocks {
            let subject = Subject::Restock(key.clone());
            let Target::Restock {
                product,
                quantity,
                location,
                ..
            } = &ops[0].target
            else {
                unreachable!()
            };
            let location = Target::restocked_at(location);
            let results: BTreeSet<String> = ops
                .iter()
                .filter(|o| o.answer.status() == Some(200))
                .map(|o| {
                    format!(
                        "{}:{}",
                        o.answer.body()["product_id"],
                        o.answer.body()["available_quantity"]
                    )
                })
                .collect();
            if !ops.iter().any(|o| o.answer.definite()) {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    "no definite answer, even after resolution",
                );
            }
            if results.len() > 1 {
                self.flag(
                    "restock retries answered differently",
                    subject.clone(),
                    format!("the same key answered different results: {results:?}"),
                );
            }
            if results.is_empty() {
                continue;
            }
            given.push(Movement {
                place: place(product, location),
                cause: Cause::Restock,
                delta: *quantity,
            });
            let applied: Vec<&RestockRow> = table.iter().filter(|r| r.key == *key).collect();
            if self.db.restocks.is_some()
                && (applied.len() != 1
                    || applied[0].product != *product
                    || applied[0].quantity != *quantity
                    || applied[0].location != location)
            {
                self.flag("restock not applied exactly once", subject, format!("answered 200 for {product}+{quantity}@{location}; the restocks table holds {applied:?}"));
            }
        }
        for r in table.iter().filter(|r| !restocks.contains_key(&r.key)) {
            self.flag(
                "a restock nobody asked for",
                Subject::Restock(r.key.clone()),
                format!("a restock under a key nobody sent: {r:?}"),
            );
        }
        given
    }

    /// Each adjustment key: resolved; a reused body answered 422 and its own never; every 200
    /// the same answer, describing the request; a key answered 200 is exactly one movement,
    /// the one the answers name (`movement_id`, and the count after as `available_quantity`),
    /// holding the request (its place, its delta or the count it set, the count it expected);
    /// a key every request of which was refused made none, and no request sent after a 200
    /// was heard is refused. Returns every adjustment's movement, with the delta the primary
    /// recorded (a `set`'s depends on the count it met), for the per-location books; a row
    /// under a key nobody sent is flagged and counted too (its units moved).
    ///
    /// A 409 claims no key (the service writes nothing), so a key may be refused and still
    /// hold a movement, made by a request whose answer was lost; the service looks the key up
    /// under the product's row lock, so a request that meets a made key is answered with it.
    fn adjustments(&mut self, adjusts: &BTreeMap<String, Vec<&Op>>) -> Vec<Movement> {
        let db = self.db;
        let mut rows: BTreeMap<&str, Vec<&AdjustmentRow>> = BTreeMap::new();
        for r in &db.adjustments {
            rows.entry(r.key.as_str()).or_default().push(r);
        }
        for (key, ops) in adjusts {
            let subject = Subject::Adjustment(key.clone());
            let original = &ops[0].target;
            let Target::Adjust {
                product,
                location,
                delta,
                set,
                expected,
                ..
            } = original
            else {
                unreachable!("grouped by adjustment key")
            };
            let location = Target::restocked_at(location);
            let (same, reused): (Vec<&Op>, Vec<&Op>) =
                ops.iter().partition(|o| o.target == *original);
            if !same.iter().any(|o| o.answer.definite()) {
                self.flag(
                    "unresolved",
                    subject.clone(),
                    "adjustment: no definite answer, even after resolution",
                );
            }
            for o in &reused {
                if o.answer.definite() && o.answer.status() != Some(422) {
                    self.flag(
                        "reused key not answered 422",
                        subject.clone(),
                        format!(
                            "#{}: reused with another body, answered {:?}; want 422",
                            o.seq,
                            o.answer.status()
                        ),
                    );
                }
            }
            for o in same.iter().filter(|o| o.answer.status() == Some(422)) {
                self.flag(
                    "own body answered 422",
                    subject.clone(),
                    format!("#{}: its own body was answered 422", o.seq),
                );
            }
            let made: Vec<&Op> = same
                .iter()
                .copied()
                .filter(|o| o.answer.status() == Some(200))
                .collect();
            let answers: BTreeSet<String> = made
                .iter()
                .map(|o| {
                    let b = o.answer.body();
                    format!(
                        "{}@{} movement {} → {}",
                        b["product_id"],
                        b["location_id"],
                        b["movement_id"],
                        b["available_quantity"]
                    )
                })
                .collect();
            if answers.len() > 1 {
                self.flag(
                    "adjustment answered differently",
                    subject.clone(),
                    format!("the same key and body answered {answers:?}"),
                );
            }
            for o in &made {
                let b = o.answer.body();
                if b["product_id"] != product.as_str()
                    || b["location_id"] != location
                    || o.answer.movement_id().is_none()
                    || b["available_quantity"].as_i64().is_none_or(|n| n < 0)
                {
                    self.flag(
                        "200 does not describe the adjustment",
                        subject.clone(),
                        format!("#{}: the 200 does not describe {original:?}", o.seq),
                    );
                }
            }
            if let Some(first) = made.iter().map(|o| o.at_ms).min() {
                for o in same
                    .iter()
                    .filter(|o| o.answer.refusal().is_some() && o.sent_ms > first)
                {
                    self.flag(
                        "409 after the adjustment was made",
                        subject.clone(),
                        format!(
                            "#{}: answered 409 {}, after a 200 at +{first}ms",
                            o.seq,
                            o.answer.code()
                        ),
                    );
                }
            }
            let held = rows
                .get(key.as_str())
                .map(Vec::as_slice)
                .unwrap_or_default();
            match (made.first(), held) {
                (None, []) => {}
                (Some(o), []) => self.flag(
                    "adjustment answered 200 without its movement",
                    subject.clone(),
                    format!(
                        "#{}: answered movement {:?}, but no movement holds the key",
                        o.seq,
                        o.answer.movement_id()
                    ),
                ),
                (_, [r]) => {
                    let request_held = r.product == *product
                        && r.location == location
                        && delta.is_none_or(|d| r.delta == d)
                        && set.is_none_or(|s| r.available_after == s)
                        && expected.is_none_or(|e| r.available_after - r.delta == e);
                    if !request_held {
                        self.flag(
                            "adjustment movement not the request's",
                            subject.clone(),
                            format!("the key's movement {r:?} does not hold {original:?}"),
                        );
                    }
                    for o in &made {
                        let b = o.answer.body();
                        if o.answer.movement_id() != Some(r.movement_id.to_string().as_str())
                            || b["available_quantity"].as_i64() != Some(r.available_after)
                        {
                            self.flag(
                                "adjustment answer not its movement",
                                subject.clone(),
                                format!(
                                    "#{}: answered movement {} with {} after, but the key's movement is {} with {} after",
                                    o.seq, b["movement_id"], b["available_quantity"], r.movement_id, r.available_after
                                ),
                            );
                        }
                    }
                    // Made by a request whose answer was lost: its units count where its row
                    // says. Made although every request was told it was not: a lie.
                    if made.is_empty() && same.iter().all(|o| o.answer.definite()) {
                        self.flag(
                            "refused but the adjustment was made",
                            subject.clone(),
                            format!("every request was refused, but the key holds {r:?}"),
                        );
                    }
                }
                (_, more) => self.flag(
                    "adjustment not made exactly once",
                    subject.clone(),
                    format!("the key holds {} movements: {more:?}", more.len()),
                ),
            }
        }
        for r in db
            .adjustments
            .iter()
            .filter(|r| !adjusts.contains_key(&r.key))
        {
            self.flag(
                "an adjustment nobody asked for",
                Subject::Adjustment(r.key.clone()),
                format!("a movement under a key nobody sent: {r:?}"),
            );
        }
        db.adjustments
            .iter()
            .map(|r| Movement {
                place: place(&r.product, &r.location),
                cause: Cause::Adjust,
                delta: r.delta,
            })
            .collect()
    }

    /// No user holds more of a limited product than its limit, at the end or at any commit
    /// before it. At the end: the units of its confirmed orders plus the lines of its confirmed
    /// carts and live holds (the limits never change during the run, so the final one is the
    /// bound). At every commit: its single-product orders' confirms and cancels replayed in the
    /// primary's commit order ([`Step`] says why that order is sound), so a 201 past the limit
    /// that a cancel later undid is seen too. (The workload places no carts or holds, which the
    /// replay leaves out.)
    fn limits(&mut self) {
        let db = self.db;
        let limit = |product: &str| db.rules.get(product).and_then(|r| r.limit);
        let mut units: BTreeMap<(&str, &str), i64> = BTreeMap::new();
        let rows = db.orders.iter().filter(|r| r.status == "confirmed");
        for (user, product, quantity) in rows
            .map(|r| (&r.user, &r.product, r.quantity))
            .chain(db.lines.iter().map(|l| (&l.user, &l.product, l.quantity)))
        {
            *units.entry((user, product)).or_default() += quantity;
        }
        let peaks = self.peaks();
        let customers: BTreeSet<(&str, &str)> = units.keys().chain(peaks.keys()).copied().collect();
        for (user, product) in customers {
            let Some(limit) = limit(product) else {
                continue;
            };
            let held = units.get(&(user, product)).copied().unwrap_or(0);
            let what = match peaks.get(&(user, product)) {
                _ if held > limit => {
                    format!("{user} holds {held} of {product}, whose limit is {limit}")
                }
                Some((peak, xid)) if *peak > limit => format!(
                    "{user} held {peak} of {product} once transaction {xid} committed (now {held}), whose limit is {limit}"
                ),
                _ => continue,
            };
            let subject = Subject::Customer {
                user: user.into(),
                product: product.into(),
            };
            self.flag("a user past a limit", subject, what);
        }
    }

    /// Replays the confirms and cancels of limited products' orders, a transaction at a time in
    /// commit order, and returns each user's most units of each product after any commit (and
    /// that commit's transaction). Flags an order of a limited product that has no place in the
    /// commit order, which the replay would miss.
    fn peaks(&mut self) -> BTreeMap<(&'a str, &'a str), (i64, &'a str)> {
        let db = self.db;
        let limited = |r: &&Row| db.rules.get(&r.product).is_some_and(|p| p.limit.is_some());
        let rows: HashMap<Uuid, &Row> = db
            .orders
            .iter()
            .filter(limited)
            .map(|r| (r.order_id, r))
            .collect();
        for r in rows.values().filter(|r| is_order(r)) {
            let has = |cancel| {
                db.steps
                    .iter()
                    .any(|s| s.order_id == r.order_id && s.cancel == cancel)
            };
            if !has(false) || (r.status == "cancelled" && !has(true)) {
                self.flag(
                    "an order with no place in the commit order",
                    Subject::Order(r.order_id),
                    format!("{} with no event to replay it by: {r:?}", r.status),
                );
            }
        }
        let mut steps: Vec<&Step> = db.steps.iter().collect();
        steps.sort_by_key(|s| s.n);
        // A transaction's steps in one group, the groups in the order of their first step.
        let mut commits: Vec<(&str, Vec<&Step>)> = vec![];
        for s in steps {
            match commits.iter_mut().find(|(xid, _)| *xid == s.xid) {
                Some((_, group)) => group.push(s),
                None => commits.push((&s.xid, vec![s])),
            }
        }
        let mut held: BTreeMap<(&str, &str), i64> = BTreeMap::new();
        let mut peaks: BTreeMap<(&str, &str), (i64, &str)> = BTreeMap::new();
        for (xid, group) in commits {
            let mut touched = BTreeSet::new();
            for s in group {
                let Some(r) = rows.get(&s.order_id) else {
                    continue;
                };
                let customer = (r.user.as_str(), r.product.as_str());
                *held.entry(customer).or_default() +=
                    if s.cancel { -r.quantity } else { r.quantity };
                touched.insert(customer);
            }
            for customer in touched {
                let now = held[&customer];
                let peak = peaks.entry(customer).or_insert((now, xid));
                if now > peak.0 {
                    *peak = (now, xid);
                }
            }
        }
        peaks
    }

    /// Nothing is claimed before a product's sale starts (no order row of any status, no cart
    /// line, written before it on the primary's clock), and no request sent after a 201 for
    /// the product was heard is told `SALE_NOT_STARTED` (that 201's order was written after
    /// the start, so the start was past before the later request reached the primary).
    fn windows(&mut self, history: &[Op]) {
        let db = self.db;
        for (product, rules) in &db.rules {
            let Some(starts) = rules.starts else {
                continue;
            };
            for r in db
                .orders
                .iter()
                .filter(|r| r.product == *product && r.created_at < starts)
            {
                self.flag(
                    "claimed before the start",
                    Subject::Key {
                        user: r.user.clone(),
                        key: r.key.clone(),
                    },
                    format!(
                        "{product}'s sale starts at {starts}, but the key's {} row was written at {}",
                        r.status, r.created_at
                    ),
                );
            }
            for l in db.lines.iter().filter(|l| l.product == *product) {
                if let Some(at) = l.ordered_at.filter(|at| *at < starts) {
                    self.flag(
                        "claimed before the start",
                        Subject::Customer {
                            user: l.user.clone(),
                            product: product.clone(),
                        },
                        format!("{product}'s sale starts at {starts}, but a cart of {} with it was written at {at}", l.user),
                    );
                }
            }
            let of_product =
                |o: &&Op| matches!(&o.target, Target::Order { product: p, .. } if p == product);
            let Some(seen_on) = history
                .iter()
                .filter(of_product)
                .filter(|o| {
                    o.answer.status() == Some(201)
                        && o.answer.body()["product_id"] == json!(product)
                })
                .map(|o| o.at_ms)
                .min()
            else {
                continue;
            };
            for o in history
                .iter()
                .filter(of_product)
                .filter(|o| o.answer.not_started() && o.sent_ms > seen_on)
            {
                self.flag(
                    "SALE_NOT_STARTED once the sale was on",
                    Subject::of(&o.target),
                    format!(
                        "#{}: sent at +{}ms, but a 201 for {product} was heard at +{seen_on}ms",
                        o.seq, o.sent_ms
                    ),
                );
            }
        }
    }
}

fn is_order(r: &Row) -> bool {
    r.status == "confirmed" || r.status == "cancelled"
}

/// How many anomalies of each class: the first thing to read in a failing history.
fn tally(anomalies: &[Anomaly]) -> BTreeMap<&'static str, usize> {
    let mut by: BTreeMap<&'static str, usize> = BTreeMap::new();
    for a in anomalies {
        *by.entry(a.class).or_default() += 1;
    }
    by
}

/// A few anomalies of each class, each with every operation it concerns (capped; the
/// history file has them all).
pub(super) fn report(anomalies: &[Anomaly], history: &[Op]) -> String {
    const PER_CLASS: usize = 3;
    const OPS: usize = 60;
    let mut out = String::new();
    for (class, n) in tally(anomalies) {
        out += &format!("\n=== {class}: {n} ===\n");
        for a in anomalies
            .iter()
            .filter(|a| a.class == class)
            .take(PER_CLASS)
        {
            out += &format!("✗ {:?}: {}\n", a.subject, a.what);
            let ops: Vec<&Op> = history.iter().filter(|o| a.subject.concerns(o)).collect();
            for op in ops.iter().take(OPS) {
                out += &format!("    {op}\n");
            }
            if ops.len() > OPS {
                out += &format!("    … {} more operations\n", ops.len() - OPS);
            }
        }
    }
    out
}

/// Operations, faults injected by kind, anomalies by class, in one line.
pub(super) fn summary(
    seed: u64,
    secs: u64,
    history: &[Op],
    faults: &BTreeMap<Fault, usize>,
    anomalies: &[Anomaly],
) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for op in history {
        let what = match op.target {
            Target::Order { .. } => "order",
            Target::Cancel { .. } => "cancel",
            Target::Restock { .. } => "restock",
            Target::Save { .. } => "save",
            Target::Read { .. } => "read",
            Target::Transfer { .. } => "transfer",
            Target::Receive { .. } => "receive",
            Target::Adjust { .. } => "adjust",
        };
        let heard = match op.answer.status() {
            None => "lost".to_string(),
            // A 409's code says which refusal: stock, a limit, or the sale window.
            Some(409) => format!("409 {}", op.answer.code()),
            Some(s) => s.to_string(),
        };
        *by.entry(format!("{what} {heard}")).or_default() += 1;
    }
    let list = |items: Vec<String>| items.join(", ");
    let by = list(by.iter().map(|(k, n)| format!("{k}×{n}")).collect());
    let total: usize = faults.values().sum();
    let faults = list(faults.iter().map(|(f, n)| format!("{f:?}×{n}")).collect());
    let lies = list(
        tally(anomalies)
            .iter()
            .map(|(c, n)| format!("{c}×{n}"))
            .collect(),
    );
    format!(
        "history seed={seed} secs={secs}: {} operations ({by}); {total} faults injected ({faults}); {} anomalies ({lies})",
        history.len(),
        anomalies.len()
    )
}

/// The run straddled the windowed product's start: a 201 for it to a request sent after some
/// request for it was told `SALE_NOT_STARTED`.
fn windowed_bought_after_not_started(history: &[Op]) -> bool {
    let windowed =
        |o: &&Op| matches!(&o.target, Target::Order { product, .. } if product == WINDOWED);
    let Some(first_no) = history
        .iter()
        .filter(windowed)
        .filter(|o| o.answer.not_started())
        .map(|o| o.at_ms)
        .min()
    else {
        return false;
    };
    history
        .iter()
        .filter(windowed)
        .any(|o| o.answer.status() == Some(201) && o.sent_ms > first_no)
}

/// What a run must have exercised for the per-location checks to mean anything.
fn location_coverage(history: &[Op]) -> Vec<(&'static str, bool)> {
    let seen = |f: &dyn Fn(&Op) -> bool| history.iter().any(f);
    let away_from_default = |o: &Op| {
        o.answer
            .allocations()
            .is_some_and(|a| a.iter().any(|a| a.location != DEFAULT))
    };
    let transfer = |o: &Op, in_transit: bool| {
        matches!(o.target, Target::Transfer { in_transit: t, .. } if t == in_transit)
            && o.answer.status() == Some(201)
    };
    let receive = |o: &Op| matches!(o.target, Target::Receive { .. });
    let adjust = |o: &Op| matches!(o.target, Target::Adjust { .. });
    // The same request answered 200/201 twice: a retry or replay met what the first did.
    let again = |o: &Op, status: u16| {
        o.answer.status() == Some(status)
            && history[..o.seq]
                .iter()
                .any(|e| e.target == o.target && e.answer.status() == Some(status))
    };
    vec![
        (
            "an order that named locations answered 201",
            seen(&|o| {
                matches!(
                    o.target,
                    Target::Order {
                        locations: Some(_),
                        ..
                    }
                ) && o.answer.status() == Some(201)
            }),
        ),
        (
            "an order answered 201 with units from a location other than default",
            seen(&|o| matches!(o.target, Target::Order { .. }) && away_from_default(o)),
        ),
        (
            "an order answered 201 with its units split between two locations",
            seen(&|o| {
                matches!(o.target, Target::Order { .. })
                    && o.answer.status() == Some(201)
                    && o.answer.allocations().is_some_and(|a| {
                        a.iter().map(|a| &a.location).collect::<BTreeSet<_>>().len() > 1
                    })
            }),
        ),
        (
            "a cancel answered 200 that gave units back to a location other than default",
            seen(&|o| {
                matches!(o.target, Target::Cancel { .. })
                    && o.answer.status() == Some(200)
                    && away_from_default(o)
            }),
        ),
        (
            "a restock at a location other than default answered 200",
            seen(&|o| {
                matches!(&o.target, Target::Restock { location: Some(l), .. } if l != DEFAULT)
                    && o.answer.status() == Some(200)
            }),
        ),
        (
            "a transfer received at once answered 201",
            seen(&|o| transfer(o, false)),
        ),
        (
            "a transfer in transit answered 201",
            seen(&|o| transfer(o, true)),
        ),
        (
            "a transfer's key answered 201 again (a retry or a replay)",
            seen(&|o| matches!(o.target, Target::Transfer { .. }) && again(o, 201)),
        ),
        (
            "a transfer answered 409 OUT_OF_STOCK",
            seen(&|o| {
                matches!(o.target, Target::Transfer { .. })
                    && o.answer.refusal() == Some(OUT_OF_STOCK)
            }),
        ),
        (
            "a transfer's answer lost or 503",
            seen(&|o| matches!(o.target, Target::Transfer { .. }) && !o.answer.definite()),
        ),
        (
            "a reused transfer key answered 422",
            seen(&|o| {
                o.kind == Kind::Reuse
                    && matches!(o.target, Target::Transfer { .. })
                    && o.answer.status() == Some(422)
            }),
        ),
        (
            "a transfer in transit received (200)",
            seen(&|o| receive(o) && o.answer.status() == Some(200)),
        ),
        (
            "a receive answered 200 again",
            seen(&|o| receive(o) && again(o, 200)),
        ),
        (
            "an adjustment answered 200",
            seen(&|o| adjust(o) && o.answer.status() == Some(200)),
        ),
        (
            "an adjustment answered 409 STOCK_CHANGED",
            seen(&|o| adjust(o) && o.answer.refusal() == Some("STOCK_CHANGED")),
        ),
    ]
}

/// What a run must have exercised for its verdict to mean anything.
pub(super) fn coverage(
    history: &[Op],
    faults: &BTreeMap<Fault, usize>,
    windows: &[Window],
) -> Vec<String> {
    let seen = |f: &dyn Fn(&Op) -> bool| history.iter().any(f);
    let order = |o: &Op| matches!(o.target, Target::Order { .. });
    // Proof that the instances really reach the primary through the proxy: an order that did
    // not get through while it was cut (answered within the request timeout after the cut).
    let during_cut = |o: &Op| {
        windows
            .iter()
            .any(|w| w.fault == Fault::PrimaryCut && (w.from..w.to + 11_000).contains(&o.at_ms))
    };
    let mut missing: Vec<String> = [
        (
            "an order stalled by a primary cut (503 or lost)",
            seen(&|o| order(o) && during_cut(o) && !o.answer.definite()),
        ),
        (
            "an order answered 201",
            seen(&|o| order(o) && o.answer.status() == Some(201)),
        ),
        (
            "an order answered 409",
            seen(&|o| order(o) && o.answer.status() == Some(409)),
        ),
        (
            "a reused key answered",
            seen(&|o| o.kind == Kind::Reuse && o.answer.definite()),
        ),
        (
            "an answer lost to a hang-up",
            seen(&|o| o.kind == Kind::HangUp && o.answer.status().is_none()),
        ),
        (
            "a replay of an answered key",
            seen(&|o| o.kind == Kind::Replay),
        ),
        (
            "a cancel answered 200",
            seen(&|o| matches!(o.target, Target::Cancel { .. }) && o.answer.status() == Some(200)),
        ),
        (
            "a restock answered 200",
            seen(&|o| matches!(o.target, Target::Restock { .. }) && o.answer.status() == Some(200)),
        ),
        (
            "an order answered 409 LIMIT_EXCEEDED",
            seen(&|o| order(o) && o.answer.refusal() == Some(LIMIT_EXCEEDED)),
        ),
        (
            "an order answered 409 SALE_NOT_STARTED",
            seen(&|o| order(o) && o.answer.not_started()),
        ),
        (
            "a 201 for the windowed product, sent after a SALE_NOT_STARTED was heard",
            windowed_bought_after_not_started(history),
        ),
        (
            "a settings or profile write read back as written",
            seen(&|o| match &o.target {
                Target::Read { record, .. } => {
                    matches!(o.answer.seen(*record), Some(Seen::Value(_)))
                }
                _ => false,
            }),
        ),
        // A fault counts only if it met read-your-writes: an inert one is missing coverage.
        (
            "fault ReplicasPaused exercised: a replica served own data while a write made in the pause was read back",
            own_data::pause_exercised(history, windows),
        ),
        (
            "fault RedisRestartedEmpty exercised: a write before Redis stopped read back on the other instance after it restarted empty, replicas paused throughout",
            own_data::redis_restart_exercised(history, windows),
        ),
        (
            "a key told SALE_NOT_STARTED, then answered for good",
            seen(&|o| {
                o.answer.not_started()
                    && history[o.seq..]
                        .iter()
                        .any(|later| later.target == o.target && later.answer.settles())
            }),
        ),
    ]
    .into_iter()
    .chain(location_coverage(history))
    .filter(|(_, ok)| !ok)
    .map(|(what, _)| what.to_string())
    .collect();
    for f in FAULTS {
        if faults.get(&f).copied().unwrap_or(0) == 0 {
            missing.push(format!("fault {f:?} injected"));
        }
    }
    missing
}

// ---------------------------------------------------------------------------------------------
// The checker's own tests: it must be able to fail. Made-up histories, no cluster.
// ---------------------------------------------------------------------------------------------

fn order(seq: usize, kind: Kind, key: &str, product: &str, quantity: i64, answer: Answer) -> Op {
    Op {
        seq,
        sent_ms: seq as u64,
        at_ms: seq as u64,
        client: "ada".into(),
        kind,
        instance: seq % 2,
        target: Target::Order {
            user: "ada".into(),
            key: key.into(),
            product: product.into(),
            quantity,
            locations: None,
        },
        answer,
    }
}

fn got(status: u16, body: Value) -> Answer {
    Answer::Got {
        status,
        retry_after: status == 503,
        body,
    }
}

fn created(id: Uuid, product: &str, quantity: i64) -> Answer {
    got(
        201,
        json!({"order_id": id, "product_id": product, "quantity": quantity, "user_id": "ada", "status": "confirmed",
               "allocations": [{"product_id": product, "location_id": DEFAULT, "quantity": quantity}]}),
    )
}

fn out_of_stock() -> Answer {
    got(
        409,
        json!({"error": {"code": "OUT_OF_STOCK", "message": "…"}}),
    )
}

/// A row of `ada`'s; an order's units all from `default`.
fn row(id: Uuid, key: &str, product: &str, quantity: i64, status: &str) -> Row {
    let allocations = match status {
        "refused" => vec![],
        _ => vec![alloc(product, DEFAULT, quantity)],
    };
    Row {
        order_id: id,
        user: "ada".into(),
        key: key.into(),
        product: product.into(),
        quantity,
        status: status.into(),
        refusal: None,
        created_at: at(0),
        allocations,
    }
}

fn alloc(product: &str, location: &str, quantity: i64) -> Alloc {
    Alloc {
        product: product.into(),
        location: location.into(),
        quantity,
    }
}

/// `product`'s count, all of it at `default`.
fn set_stock(db: &mut Snapshot, product: &str, n: i64) {
    db.stock.insert(product.into(), n);
    db.levels.insert(place(product, DEFAULT), n);
}

/// Each of `products` created with `n` units at `default`, as the database and its events
/// hold them: the opening stock, and a snapshot whose `default` is active.
fn opened(products: &[(&str, i64)], db: &mut Snapshot) -> Opening {
    db.active.insert(DEFAULT.into(), true);
    let mut opening = Opening::new();
    for (p, n) in products {
        opening.insert(place(p, DEFAULT), *n);
        db.announced.insert(
            (place(p, DEFAULT), "create".into()),
            Announced {
                added: *n,
                removed: 0,
            },
        );
    }
    opening
}

/// An instant on the primary's clock, `s` seconds into a made-up day.
fn at(s: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
}

/// p: 10 initial; ada's k1 took 2 (a hang-up, then its retry found the order); k2 was refused.
fn clean() -> (Opening, Vec<Op>, Snapshot) {
    let id = Uuid::new_v4();
    let history = vec![
        order(
            0,
            Kind::HangUp,
            "k1",
            "p",
            2,
            Answer::Lost {
                lost: "hung up".into(),
            },
        ),
        order(1, Kind::Retry, "k1", "p", 2, created(id, "p", 2)),
        order(2, Kind::New, "k2", "p", 9, out_of_stock()),
        order(
            3,
            Kind::Reuse,
            "k1",
            "p",
            3,
            got(422, json!({"error": {"code": "IDEMPOTENCY_KEY_REUSED"}})),
        ),
    ];
    let mut db = Snapshot {
        orders: vec![
            row(id, "k1", "p", 2, "confirmed"),
            row(Uuid::new_v4(), "k2", "p", 9, "refused"),
        ],
        restocks: Some(vec![]),
        ..Snapshot::default()
    };
    set_stock(&mut db, "p", 8);
    (opened(&[("p", 10)], &mut db), history, db)
}

#[test]
fn history_checker_passes_a_truthful_history() {
    let (initial, history, db) = clean();
    let found = check(&initial, &history, &db);
    assert!(found.is_empty(), "{}", report(&found, &history));
}

#[test]
fn history_checker_flags_a_409_whose_original_committed_later() {
    let (initial, mut history, mut db) = clean();
    // k2's original was still queued when its retry was told 409; then it committed.
    db.orders[1].status = "confirmed".into();
    db.orders[1].quantity = 1;
    history[2] = order(2, Kind::Retry, "k2", "p", 1, out_of_stock());
    set_stock(&mut db, "p", 7);
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a
            .what
            .contains("answered 409 OUT_OF_STOCK, but the key holds order")),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_a_restock_retry_that_added_twice() {
    let (initial, mut history, mut db) = clean();
    let restock = |seq, kind, answer| Op {
        seq,
        sent_ms: 0,
        at_ms: 0,
        client: "admin".into(),
        kind,
        instance: 0,
        target: Target::Restock {
            key: "r1".into(),
            product: "p".into(),
            quantity: 5,
            location: None,
        },
        answer,
    };
    history.push(restock(
        4,
        Kind::New,
        got(503, json!({"error": {"code": "UNAVAILABLE"}})),
    ));
    history.push(restock(
        5,
        Kind::Retry,
        got(200, json!({"product_id": "p", "available_quantity": 18})),
    ));
    set_stock(&mut db, "p", 18);
    db.restocks = None;
    let found = check(&initial, &history, &db);
    assert!(
        found
            .iter()
            .any(|a| a.subject == Subject::Product("p".into())),
        "{found:?}"
    );
    assert!(
        found.iter().any(|a| a.subject == Subject::Database),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_two_orders_for_one_key() {
    let (initial, mut history, db) = clean();
    history.push(order(
        4,
        Kind::Replay,
        "k1",
        "p",
        2,
        created(Uuid::new_v4(), "p", 2),
    ));
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a.what.contains("different orders")),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_a_503_without_retry_after() {
    let (initial, mut history, db) = clean();
    history.push(order(
        4,
        Kind::Replay,
        "k1",
        "p",
        2,
        Answer::Got {
            status: 503,
            retry_after: false,
            body: Value::Null,
        },
    ));
    let found = check(&initial, &history, &db);
    assert!(
        found
            .iter()
            .any(|a| a.what.contains("503 without Retry-After")),
        "{found:?}"
    );
}

#[test]
fn history_checker_flags_a_reused_key_that_took_stock() {
    let (initial, mut history, mut db) = clean();
    // k2 was refused; its reuse with a smaller quantity then created an order.
    let id = Uuid::new_v4();
    history.push(order(4, Kind::Reuse, "k2", "p", 1, created(id, "p", 1)));
    db.orders[1] = row(id, "k2", "p", 1, "confirmed");
    set_stock(&mut db, "p", 7);
    let found = check(&initial, &history, &db);
    assert!(
        found.iter().any(|a| a.what.contains("want 422")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|a| a.what.contains("reused body")),
        "{found:?}"
    );
}

fn limit_exceeded(product: &str, limit: i64, already: i64) -> Answer {
    got(
        409,
        json!({"error": {"code": "LIMIT_EXCEEDED", "message": "…", "product_id": product, "limit": limit, "already": already}}),
    )
}

fn not_started() -> Answer {
    Answer::Got {
        status: 409,
        retry_after: true,
        body: json!({"error": {"code": "SALE_NOT_STARTED", "message": "…"}}),
    }
}

/// ada's cancel of `order_id`, `product`×`quantity` from `default`.
fn cancel(seq: usize, order_id: Uuid, product: &str, quantity: i64) -> Op {
    Op {
        seq,
        sent_ms: seq as u64,
        at_ms: seq as u64,
        client: "ada".into(),
        kind: Kind::Cancel,
        instance: seq % 2,
        target: Target::Cancel {
            user: "ada".into(),
            order_id,
        },
        answer: got(
            200,
            json!({"order_id": order_id, "status": "cancelled",
                   "allocations": [{"product_id": product, "location_id": DEFAULT, "quantity": quantity}]}),
        ),
    }
}

/// A confirm (or cancel) of `order_id`, committed by transaction `xid`, `n`th in the feed.
fn step(xid: &str, n: i64, order_id: Uuid, cancel: bool) -> Step {
    Step {
        xid: xid.into(),
        n,
        order_id,
        cancel,
    }
}

/// Two drops, 10 units each: `lim` (at most 2 per customer) and `soon` (its sale starts at
/// `at(100)`). ada's k1 took 2 of `lim`; k2 (1 more) was refused for the limit, and its replay
/// was told the same; k3 was sent before `soon` started and told SALE_NOT_STARTED, then bought
/// with the same key once it had; k4 bought too; k1 was cancelled, which freed its units for
/// k5, which took 2 of `lim` again. The commits, in order: k1, k3 and k4 (one batch), k1's
/// cancel, k5.
fn drops() -> (Opening, Vec<Op>, Snapshot) {
    let (id1, id3, id4, id5) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    let history = vec![
        order(0, Kind::New, "k1", "lim", 2, created(id1, "lim", 2)),
        order(1, Kind::New, "k2", "lim", 1, limit_exceeded("lim", 2, 2)),
        order(2, Kind::Replay, "k2", "lim", 1, limit_exceeded("lim", 2, 2)),
        order(3, Kind::New, "k3", "soon", 1, not_started()),
        order(4, Kind::Retry, "k3", "soon", 1, created(id3, "soon", 1)),
        order(5, Kind::New, "k4", "soon", 1, created(id4, "soon", 1)),
        cancel(6, id1, "lim", 2),
        order(7, Kind::New, "k5", "lim", 2, created(id5, "lim", 2)),
    ];
    let written_at = |mut r: Row, s: i64| {
        r.created_at = at(s);
        r
    };
    let mut k2 = row(Uuid::new_v4(), "k2", "lim", 1, "refused");
    k2.refusal = Some(LIMIT_EXCEEDED.into());
    let mut db = Snapshot {
        rules: BTreeMap::from([
            (
                "lim".to_string(),
                Rules {
                    limit: Some(2),
                    ..Rules::default()
                },
            ),
            (
                "soon".to_string(),
                Rules {
                    starts: Some(at(100)),
                    ..Rules::default()
                },
            ),
        ]),
        orders: vec![
            row(id1, "k1", "lim", 2, "cancelled"),
            k2,
            written_at(row(id3, "k3", "soon", 1, "confirmed"), 101),
            written_at(row(id4, "k4", "soon", 1, "confirmed"), 102),
            row(id5, "k5", "lim", 2, "confirmed"),
        ],
        lines: vec![],
        restocks: Some(vec![]),
        steps: vec![
            step("t1", 10, id1, false),
            step("t3", 30, id3, false),
            step("t3", 31, id4, false),
            step("t9", 50, id1, true),
            step("t5", 60, id5, false),
        ],
        ..Snapshot::default()
    };
    set_stock(&mut db, "lim", 8);
    set_stock(&mut db, "soon", 8);
    let initial = opened(&[("lim", 10), ("soon", 10)], &mut db);
    (initial, history, db)
}

/// Only anomalies of `class`, and at least one.
fn only(found: &[Anomaly], class: &str, history: &[Op]) {
    assert!(
        !found.is_empty() && found.iter().all(|a| a.class == class),
        "want only {class:?}:{}",
        report(found, history)
    );
}

/// Limits and a window told the truth. Mutations of the checker that make it fail: `statuses`
/// accepting only OUT_OF_STOCK for an order's 409, as before flash drops (both drop codes are
/// flagged); counting SALE_NOT_STARTED as a refusal of its key (k3 is "409 not final");
/// `limits` counting cancelled orders (ada holds 4 of `lim`); `peaks` skipping cancel steps,
/// or ordering commits by `xid` instead of `n` (k1's cancel got its transaction id after k5's
/// and committed before it: ada would hold 4 of `lim` once k5 committed).
#[test]
fn history_checker_passes_a_truthful_history_with_limits_and_a_window() {
    let (initial, history, db) = drops();
    let found = check(&initial, &history, &db);
    assert!(found.is_empty(), "{}", report(&found, &history));
}

/// k2 confirmed (ada holds 3 of `lim`, limit 2), and, separately, a live hold of 1 `lim` beside
/// ada's 2 confirmed. Mutations of the checker that make it fail: `check` without
/// `c.limits()`, or `limits` bounding by `limit + 1`, miss both; `limits` summing only order
/// rows, not `lines`, misses the hold.
#[test]
fn history_checker_flags_a_user_past_a_limit() {
    let (initial, mut history, mut db) = drops();
    let id2 = Uuid::new_v4();
    history[1] = order(1, Kind::New, "k2", "lim", 1, created(id2, "lim", 1));
    history[2] = order(2, Kind::Replay, "k2", "lim", 1, created(id2, "lim", 1));
    db.orders[1] = row(id2, "k2", "lim", 1, "confirmed");
    db.steps.insert(1, step("t2", 20, id2, false));
    set_stock(&mut db, "lim", 7);
    let found = check(&initial, &history, &db);
    only(&found, "a user past a limit", &history);
    assert!(found[0].what.contains("holds 3 of lim"), "{found:?}");

    let (initial, history, mut db) = drops();
    db.lines.push(LineUnits {
        user: "ada".into(),
        product: "lim".into(),
        quantity: 1,
        ordered_at: None,
    });
    let found = check(&initial, &history, &db);
    only(&found, "a user past a limit", &history);
    assert_eq!(
        found[0].subject,
        Subject::Customer {
            user: "ada".into(),
            product: "lim".into()
        }
    );
}

/// k4's order written a second before `soon` started, and a refusal (k6, out of stock) written
/// long before: nothing may be claimed before the start, refusals included. Mutations of the
/// checker that make it fail: `check` without `c.windows(..)`, or `windows` comparing
/// `created_at > starts`, miss both; `windows` looking only at confirmed rows misses k6.
#[test]
fn history_checker_flags_an_order_written_before_the_start() {
    let (initial, mut history, mut db) = drops();
    db.orders[3].created_at = at(99);
    history.push(order(8, Kind::New, "k6", "soon", 20, out_of_stock()));
    let mut k6 = row(Uuid::new_v4(), "k6", "soon", 20, "refused");
    k6.created_at = at(50);
    db.orders.push(k6);
    let found = check(&initial, &history, &db);
    only(&found, "claimed before the start", &history);
    let keys: BTreeSet<&Subject> = found.iter().map(|a| &a.subject).collect();
    for key in ["k4", "k6"] {
        assert!(
            keys.contains(&Subject::Key {
                user: "ada".into(),
                key: key.into()
            }),
            "{key}: {found:?}"
        );
    }
}

/// k6 sent after a 201 for `soon` was heard, yet told SALE_NOT_STARTED (then bought, so its key
/// is resolved). Mutations of the checker that make it fail: `windows` without its
/// SALE_NOT_STARTED loop, or comparing the wrong way round (`o.sent_ms < seen_on`).
#[test]
fn history_checker_flags_sale_not_started_once_the_sale_was_on() {
    let (initial, mut history, mut db) = drops();
    let id6 = Uuid::new_v4();
    history.push(order(8, Kind::New, "k6", "soon", 1, not_started()));
    history.push(order(
        9,
        Kind::Retry,
        "k6",
        "soon",
        1,
        created(id6, "soon", 1),
    ));
    let mut k6 = row(id6, "k6", "soon", 1, "confirmed");
    k6.created_at = at(103);
    db.orders.push(k6);
    set_stock(&mut db, "soon", 7);
    let found = check(&initial, &history, &db);
    only(&found, "SALE_NOT_STARTED once the sale was on", &history);
    // k3 was told SALE_NOT_STARTED before any 201 for `soon` was heard: that one was true.
    let k6 = Subject::Key {
        user: "ada".into(),
        key: "k6".into(),
    };
    assert!(found.iter().all(|a| a.subject == k6), "{found:?}");
}

/// k2's refusal stored as one for stock while its answers said LIMIT_EXCEEDED. Mutation of the
/// checker that makes it fail: `order_key` without `refusal_reasons`.
#[test]
fn history_checker_flags_a_limit_refusal_its_key_does_not_hold() {
    let (initial, history, mut db) = drops();
    db.orders[1].refusal = None;
    let found = check(&initial, &history, &db);
    only(&found, "409 not the key's refusal", &history);
}

/// A LIMIT_EXCEEDED that names another limit than the product's. Mutation of the checker that
/// makes it fail: `order_key` without `refusal_reasons`.
#[test]
fn history_checker_flags_a_limit_exceeded_that_misstates_the_limit() {
    let (initial, mut history, db) = drops();
    history[2] = order(2, Kind::Replay, "k2", "lim", 1, limit_exceeded("lim", 3, 2));
    let found = check(&initial, &history, &db);
    only(&found, "LIMIT_EXCEEDED misstates the limit", &history);
}

/// A 201 past the limit that a cancel later undid: k2 (1 of `lim`) confirmed while k1 held 2,
/// then k1 was cancelled, and k5 was refused for the limit (ada held 1 then). The final state
/// is within the limit (ada holds 1); after k2's commit ada held 3. This is what the service
/// does if its limit rule lets one order too many through (e.g. `drop_verdict_v1` judging
/// `already + qty > limit + 1`) and the user then cancels. Mutations of the checker that make
/// it fail: `limits` without `peaks` (the final state only, as before issue 48).
#[test]
fn history_checker_flags_a_limit_passed_and_then_undone_by_a_cancel() {
    let (initial, mut history, mut db) = drops();
    let id2 = Uuid::new_v4();
    history[1] = order(1, Kind::New, "k2", "lim", 1, created(id2, "lim", 1));
    history[2] = order(2, Kind::Replay, "k2", "lim", 1, created(id2, "lim", 1));
    history[7] = order(7, Kind::New, "k5", "lim", 2, limit_exceeded("lim", 2, 1));
    db.orders[1] = row(id2, "k2", "lim", 1, "confirmed");
    let mut k5 = row(db.orders[4].order_id, "k5", "lim", 2, "refused");
    k5.refusal = Some(LIMIT_EXCEEDED.into());
    db.orders[4] = k5;
    db.steps.insert(1, step("t2", 20, id2, false));
    db.steps.pop();
    set_stock(&mut db, "lim", 9);
    let found = check(&initial, &history, &db);
    only(&found, "a user past a limit", &history);
    assert!(
        found[0]
            .what
            .contains("held 3 of lim once transaction t2 committed (now 1)"),
        "{found:?}"
    );
}

/// An order of a limited product with no event to place it: the replay would be blind to it.
/// Mutation of the checker that makes it fail: `peaks` without its missing-step loop.
#[test]
fn history_checker_flags_an_order_the_commit_order_does_not_hold() {
    let (initial, history, mut db) = drops();
    db.steps.retain(|s| !s.cancel);
    let found = check(&initial, &history, &db);
    // (The replay, missing k1's cancel, then also sees ada past the limit.)
    assert!(
        found
            .iter()
            .any(|a| a.class == "an order with no place in the commit order"
                && a.what.starts_with("cancelled")),
        "{}",
        report(&found, &history)
    );
}

/// The admin's adjustment of `p` at `default` under `key`.
fn adjustment(
    seq: usize,
    kind: Kind,
    key: &str,
    change: (Option<i64>, Option<i64>),
    expected: Option<i64>,
    answer: Answer,
) -> Op {
    Op {
        seq,
        sent_ms: seq as u64,
        at_ms: seq as u64,
        client: "adjuster".into(),
        kind,
        instance: seq % 2,
        target: Target::Adjust {
            key: key.into(),
            product: "p".into(),
            location: None,
            delta: change.0,
            set: change.1,
            expected,
            reason: "count".into(),
        },
        answer,
    }
}

fn adjusted(movement_id: i64, available: i64) -> Answer {
    got(
        200,
        json!({"product_id": "p", "location_id": DEFAULT, "available_quantity": available,
               "movement_id": movement_id.to_string()}),
    )
}

/// `clean`, then adjustments of `p` at `default` (8 left): a1 (−3) hung up and its retry
/// answered with movement 7 (5 left), replayed alike; a2 (set 9 if 6) told the count is 5;
/// a3 (set 6 if 5) made movement 9 (+1, 6 left).
fn adjustments() -> (Opening, Vec<Op>, Snapshot) {
    let (initial, mut history, mut db) = clean();
    let lost = Answer::Lost {
        lost: "hung up".into(),
    };
    let changed = got(
        409,
        json!({"error": {"code": "STOCK_CHANGED", "message": "…", "available_quantity": 5}}),
    );
    history.extend([
        adjustment(4, Kind::HangUp, "a1", (Some(-3), None), None, lost),
        adjustment(5, Kind::Retry, "a1", (Some(-3), None), None, adjusted(7, 5)),
        adjustment(6, Kind::New, "a2", (None, Some(9)), Some(6), changed),
        adjustment(
            7,
            Kind::Replay,
            "a1",
            (Some(-3), None),
            None,
            adjusted(7, 5),
        ),
        adjustment(8, Kind::New, "a3", (None, Some(6)), Some(5), adjusted(9, 6)),
    ]);
    let row = |movement_id, key: &str, delta, available_after| AdjustmentRow {
        movement_id,
        key: key.into(),
        product: "p".into(),
        location: DEFAULT.into(),
        delta,
        available_after,
    };
    db.adjustments = vec![row(7, "a1", -3, 5), row(9, "a3", 1, 6)];
    set_stock(&mut db, "p", 6);
    db.announced.insert(
        (place("p", DEFAULT), "adjust".into()),
        Announced {
            added: 1,
            removed: 3,
        },
    );
    (initial, history, db)
}

/// Adjustments told the truth: the hung-up key made once and answered alike, the losing
/// compare-and-set made nothing, the movements' deltas in the books. Mutations of the checker
/// that make it fail: `Cause::Adjust` announced under another reason than `adjust`, or the
/// adjustments' movements left out of the books (`p` at `default` is 2 under its level).
#[test]
fn history_checker_passes_a_truthful_history_with_adjustments() {
    let (initial, history, db) = adjustments();
    let found = check(&initial, &history, &db);
    assert!(found.is_empty(), "{}", report(&found, &history));
}

/// a3 answered 200 (movement 9), but no movement holds its key: the service told the admin of
/// a change it did not keep (an answer sent before a commit that then failed). Its units are
/// left out of the level and the events alike, so only the key's own check sees it. Mutation
/// of the checker that makes it fail: `adjustments` without its `(Some(o), [])` arm.
#[test]
fn history_checker_flags_an_adjustment_answered_200_without_its_movement() {
    let (initial, history, mut db) = adjustments();
    db.adjustments.retain(|r| r.key != "a3");
    set_stock(&mut db, "p", 5);
    db.announced.insert(
        (place("p", DEFAULT), "adjust".into()),
        Announced {
            added: 0,
            removed: 3,
        },
    );
    let found = check(&initial, &history, &db);
    only(
        &found,
        "adjustment answered 200 without its movement",
        &history,
    );
    assert_eq!(found[0].subject, Subject::Adjustment("a3".into()));
}

/// a1's movement is 8, but its retry and replay were both answered movement 7 (consistently:
/// comparing the answers with each other sees nothing), as a replay built from a cached or
/// another key's row would be. Mutation of the checker that makes it fail: `adjustments`
/// comparing only the answers' `available_quantity` with the row's, not `movement_id`.
#[test]
fn history_checker_flags_an_adjustment_answered_with_another_movement() {
    let (initial, history, mut db) = adjustments();
    db.adjustments[0].movement_id = 8;
    let found = check(&initial, &history, &db);
    only(&found, "adjustment answer not its movement", &history);
    assert_eq!(found.len(), 2, "the retry and the replay: {found:?}");
}
