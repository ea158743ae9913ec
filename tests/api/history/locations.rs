//! Stock per location (issue 46), judged like the rest of the history: a pure function of
//! what the clients were told and what the primary holds.
//!
//! Each (product, location) is given units by **movements** — its creation stock, restocks
//! there, transfers in, less transfers out (in transit too: those units are in no location) —
//! and loses them to the allocations of confirmed orders and of holds not returned. What is
//! left is its level, at the end and never below zero. A movement is a [`Movement`] with its
//! [`Cause`]; the ledger's adjustments (issue 47) are one more, each the delta the primary
//! recorded for it, judged by the same books ([`conserved`]) and held to what announced them
//! ([`announced`]). (Imports re-state the counts they were created with and move nothing.)
//!
//! Every answer's `allocations` are its order's row's, and a row's allocations add up to its
//! order, from active locations the request named. Every transfer an admin was told of exists
//! once, in the state it was answered in, and its units moved once.

use super::checker::{Anomaly, Subject};
use super::model::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use uuid::Uuid;

/// What each (product, location) was created with.
pub(super) type Opening = BTreeMap<Place, i64>;

/// Why a location's count moved other than by an order, a cart or a hold (the contract's
/// movements).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Cause {
    Create,
    Restock,
    TransferOut,
    TransferIn,
    Adjust,
}

impl Cause {
    /// The `stock.changed` reason that announces it.
    fn reason(self) -> &'static str {
        match self {
            Cause::Create => "create",
            Cause::Restock => "restock",
            Cause::TransferOut | Cause::TransferIn => "transfer",
            Cause::Adjust => "adjust",
        }
    }

    /// How the books say it (with its sign, as a column of a sum).
    fn label(self) -> &'static str {
        match self {
            Cause::Create => "created",
            Cause::Restock => "restocked",
            Cause::TransferOut => "transferred out",
            Cause::TransferIn => "transferred in",
            Cause::Adjust => "adjusted",
        }
    }
}

/// Units given to (positive) or taken from (negative) one place, for one cause.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Movement {
    pub(super) place: Place,
    pub(super) cause: Cause,
    pub(super) delta: i64,
}

/// The per-location checks. `given`: the restocks the admins were told of, each at its
/// location, and the movements adjustments wrote (both judged exactly-once by the caller).
pub(super) fn check(
    opening: &Opening,
    given: Vec<Movement>,
    history: &[Op],
    db: &Snapshot,
) -> Vec<Anomaly> {
    let mut f = Found(vec![]);
    let mut moves: Vec<Movement> = opening
        .iter()
        .map(|(place, n)| Movement {
            place: place.clone(),
            cause: Cause::Create,
            delta: *n,
        })
        .collect();
    moves.extend(given);
    moves.extend(transfers(&mut f, history, db));
    allocations(&mut f, history, db);
    conserved(&mut f, &moves, db);
    announced(&mut f, &moves, db);
    f.0
}

struct Found(Vec<Anomaly>);

impl Found {
    fn flag(&mut self, class: &'static str, subject: Subject, what: impl Into<String>) {
        self.0.push(Anomaly {
            class,
            subject,
            what: what.into(),
        });
    }
}

fn location_subject(place: &Place) -> Subject {
    Subject::Location {
        product: place.0.clone(),
        location: place.1.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// Conservation.
// ---------------------------------------------------------------------------------------------

/// One place's books.
#[derive(Default)]
struct Books {
    given: BTreeMap<Cause, i64>,
    confirmed: i64,
    held: i64,
}

impl Books {
    fn want(&self) -> i64 {
        self.given.values().sum::<i64>() - self.confirmed - self.held
    }

    fn explain(&self) -> String {
        let mut out: Vec<String> = self
            .given
            .iter()
            .map(|(c, n)| format!("{n:+} {}", c.label()))
            .collect();
        out.push(format!("-{} in confirmed orders", self.confirmed));
        out.push(format!("-{} held", self.held));
        format!("{} = {}", out.join(" "), self.want())
    }
}

/// For each (product, location): its movements − confirmed orders' allocations there − the
/// allocations there of holds not returned = `stock_levels.available_quantity`, never below
/// zero; and each product's count is what its active locations hold.
///
/// Mutations of the service this fails on: a cancel giving its units back to `default`
/// instead of the allocation's location (`stock::give_back` binding `'default'` for the
/// location: `default` over, the other under); a receive without its `status = 'in_transit'`
/// guard (`levels::receive`: a retried receive adds the units again at `to`); a transfer in
/// transit adding its units to `to` at once (`levels::transfer` ignoring `in_transit`); a take
/// from one location with the level of another lowered (`take_order_batches_v8`'s level
/// update keyed on the product only). Of the checker: `Books::want` leaving out transfers out
/// (every source of a made transfer is short).
fn conserved(f: &mut Found, moves: &[Movement], db: &Snapshot) {
    let mut books: BTreeMap<Place, Books> = BTreeMap::new();
    for m in moves {
        *books
            .entry(m.place.clone())
            .or_default()
            .given
            .entry(m.cause)
            .or_default() += m.delta;
    }
    for r in db.orders.iter().filter(|r| r.status == "confirmed") {
        for a in &r.allocations {
            books.entry(a.place()).or_default().confirmed += a.quantity;
        }
    }
    for a in &db.held {
        books.entry(a.place()).or_default().held += a.quantity;
    }
    for place in db.levels.keys() {
        books.entry(place.clone()).or_default();
    }
    let mut products: BTreeMap<&str, (i64, Vec<String>)> = BTreeMap::new();
    for (place, b) in &books {
        let level = db.levels.get(place).copied().unwrap_or(0);
        let want = b.want();
        if level != want || level < 0 {
            f.flag(
                "stock not conserved at a location",
                location_subject(place),
                format!(
                    "{} at {}: level {level}; want {}",
                    place.0,
                    place.1,
                    b.explain()
                ),
            );
        }
        if db.active.get(&place.1).copied().unwrap_or(false) {
            let p = products.entry(&place.0).or_default();
            p.0 += want;
            p.1.push(format!("{} {want}", place.1));
        }
    }
    let names: BTreeSet<&str> = products
        .keys()
        .copied()
        .chain(db.stock.keys().map(String::as_str))
        .collect();
    for product in names {
        let (want, parts) = products.remove(product).unwrap_or_default();
        let stock = db.stock.get(product).copied().unwrap_or(i64::MIN);
        if stock != want || stock < 0 {
            f.flag(
                "stock not conserved",
                Subject::Product(product.to_owned()),
                format!(
                    "stock {stock}; want the active locations' {} = {want}",
                    parts.join(" + ")
                ),
            );
        }
    }
}

/// What the `stock.changed` events announce at each place for each reason is what the
/// movements gave and took there: each restock once, each transfer's units out once and (once
/// received) in once. Events are written in the change's own transaction, so they count how
/// many times it was applied; the movement ledger will be a second witness.
///
/// Mutations of the service this fails on: a receive without its `status = 'in_transit'` guard
/// (`levels::receive`: a retried receive announces, and adds, the units again); a transfer
/// retried under its key moving the units again (`levels::transfer` not looking the key up
/// first). Of the checker: `Cause::reason` giving transfers in a reason of their own.
fn announced(f: &mut Found, moves: &[Movement], db: &Snapshot) {
    let mut want: BTreeMap<(Place, String), Announced> = BTreeMap::new();
    for m in moves {
        let a = want
            .entry((m.place.clone(), m.cause.reason().to_owned()))
            .or_default();
        if m.delta >= 0 {
            a.added += m.delta;
        } else {
            a.removed -= m.delta;
        }
    }
    let keys: BTreeSet<&(Place, String)> = want.keys().chain(db.announced.keys()).collect();
    for key in keys {
        let (w, got) = (
            want.get(key).copied().unwrap_or_default(),
            db.announced.get(key).copied().unwrap_or_default(),
        );
        if w != got {
            let ((product, location), reason) = key;
            f.flag(
                "movements not announced once",
                location_subject(&key.0),
                format!(
                    "{product} at {location}, {reason}: stock.changed events add {} and remove {}; the movements the admins were told of add {} and remove {}",
                    got.added, got.removed, w.added, w.removed
                ),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Allocations.
// ---------------------------------------------------------------------------------------------

/// Every 201 for an order key, and every cancel's 200, states the allocations of the key's
/// row; a row's allocations add up, per product, to its order (`[]` for a refusal), each
/// from an active location and, if the request named `locations`, from one of them. A
/// location's active flag is judged by the end state: the run's locations never change it.
///
/// Mutations of the service this fails on: `active_levels_v2` without `AND l.active` (`back`,
/// ranked before `default`, serves requests that name no location); `request_locations_v1`
/// ignoring a request's `locations` (its allocations come from elsewhere); an answer built
/// from the request, not the row (a retry told another split than the one written). Of the
/// checker: comparing answers only to each other (one wrong row, answered consistently).
fn allocations(f: &mut Found, history: &[Op], db: &Snapshot) {
    let by_key: HashMap<(&str, &str), &Row> = db
        .orders
        .iter()
        .map(|r| ((r.user.as_str(), r.key.as_str()), r))
        .collect();
    let by_id: HashMap<Uuid, &Row> = db.orders.iter().map(|r| (r.order_id, r)).collect();
    // The `locations` each key was first sent with (shoppers reuse only answered keys).
    let mut named: HashMap<(&str, &str), Option<&Vec<String>>> = HashMap::new();
    for op in history {
        let (row, subject) = match &op.target {
            Target::Order {
                user,
                key,
                locations,
                ..
            } => {
                named
                    .entry((user.as_str(), key.as_str()))
                    .or_insert(locations.as_ref());
                if op.answer.status() != Some(201) {
                    continue;
                }
                let row = by_key.get(&(user.as_str(), key.as_str())).copied();
                let subject = Subject::Key {
                    user: user.clone(),
                    key: key.clone(),
                };
                (row, subject)
            }
            Target::Cancel { order_id, .. } if op.answer.status() == Some(200) => {
                (by_id.get(order_id).copied(), Subject::Order(*order_id))
            }
            _ => continue,
        };
        // A 201 that names another order than the key's row is flagged by the checker.
        let Some(row) = row.filter(|r| op.answer.order_id() == Some(r.order_id)) else {
            continue;
        };
        let told = op.answer.allocations();
        if told.as_ref() != Some(&row.allocations) {
            f.flag(
                "allocations not the row's",
                subject,
                format!(
                    "#{}: answered allocations {told:?}, but the row holds {:?}",
                    op.seq, row.allocations
                ),
            );
        }
    }
    for r in &db.orders {
        let subject = Subject::Key {
            user: r.user.clone(),
            key: r.key.clone(),
        };
        let of_product: i64 = r
            .allocations
            .iter()
            .filter(|a| a.product == r.product && a.quantity > 0)
            .map(|a| a.quantity)
            .sum();
        let want = if r.status == "refused" { 0 } else { r.quantity };
        if of_product != want
            || r.allocations
                .iter()
                .any(|a| a.product != r.product || a.quantity <= 0)
        {
            f.flag(
                "allocations do not add up to the order",
                subject.clone(),
                format!(
                    "a {} order of {}×{} allocated {:?}",
                    r.status, r.product, r.quantity, r.allocations
                ),
            );
        }
        let asked = named
            .get(&(r.user.as_str(), r.key.as_str()))
            .copied()
            .flatten();
        for a in &r.allocations {
            if !db.active.get(&a.location).copied().unwrap_or(false) {
                f.flag(
                    "an allocation from an inactive location",
                    subject.clone(),
                    format!(
                        "took {} of {} from {}, which is not active",
                        a.quantity, a.product, a.location
                    ),
                );
            }
            if let Some(asked) = asked.filter(|l| !l.contains(&a.location)) {
                f.flag(
                    "an allocation from a location not named",
                    subject.clone(),
                    format!(
                        "took {} of {} from {}; the request named {asked:?}",
                        a.quantity, a.product, a.location
                    ),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transfers.
// ---------------------------------------------------------------------------------------------

/// The ops of one transfer: its key's requests (the first is its original body; the mover
/// reuses only made keys) and the receives of the id it was answered with.
struct TransferOps<'h> {
    same: Vec<&'h Op>,
    reused: Vec<&'h Op>,
}

/// Every transfer key the mover sent against `transfers`, and the receives against the rows
/// they name; returns the movements of the rows (what the primary did: a row that
/// contradicts an answer is flagged here, and its units are still where the row says).
///
/// Mutations of the service this fails on: a retried receive answered from the request
/// rather than the row; `levels::transfer` storing `in_transit` for a transfer asked to be
/// received at once, or a receive that answers 200 without changing the status (the
/// transfer stays `in_transit` though answered received); a transfer answered 201 whose
/// transaction then rolls back (an acknowledged transfer with no row). Of the checker:
/// `expected_status` ignoring receives (every received transfer is flagged).
fn transfers(f: &mut Found, history: &[Op], db: &Snapshot) -> Vec<Movement> {
    let mut keys: BTreeMap<&str, TransferOps> = BTreeMap::new();
    let mut receives: BTreeMap<Uuid, Vec<&Op>> = BTreeMap::new();
    for op in history {
        match &op.target {
            Target::Transfer { key, .. } => {
                let ops = keys.entry(key).or_insert(TransferOps {
                    same: vec![],
                    reused: vec![],
                });
                match ops.same.first() {
                    Some(first) if first.target != op.target => ops.reused.push(op),
                    _ => ops.same.push(op),
                }
            }
            Target::Receive { transfer_id, .. } => {
                receives.entry(*transfer_id).or_default().push(op)
            }
            _ => {}
        }
    }
    let mut rows: HashMap<&str, Vec<&TransferRow>> = HashMap::new();
    for r in &db.transfers {
        rows.entry(r.key.as_str()).or_default().push(r);
    }
    for (key, ops) in &keys {
        let rows = rows.get(key).map(Vec::as_slice).unwrap_or_default();
        transfer_key(f, key, ops, rows, &receives);
    }
    for r in db
        .transfers
        .iter()
        .filter(|r| !keys.contains_key(r.key.as_str()))
    {
        f.flag(
            "a transfer nobody asked for",
            Subject::Transfer(r.key.clone()),
            format!("a transfer under a key nobody sent: {r:?}"),
        );
    }
    for (id, ops) in &receives {
        received(
            f,
            *id,
            ops,
            db.transfers.iter().find(|r| r.transfer_id == *id),
        );
    }
    let mut moves = vec![];
    for r in &db.transfers {
        moves.push(Movement {
            place: place(&r.product, &r.from),
            cause: Cause::TransferOut,
            delta: -r.quantity,
        });
        if r.status == TransferStatus::Received {
            moves.push(Movement {
                place: place(&r.product, &r.to),
                cause: Cause::TransferIn,
                delta: r.quantity,
            });
        }
    }
    moves
}

/// Whether a transfer's answer (a 201, or a receive's 200) describes `target`'s body.
fn describes(answer: &Answer, target: &Target) -> bool {
    let Target::Transfer {
        product,
        from,
        to,
        quantity,
        ..
    } = target
    else {
        return false;
    };
    let b = answer.body();
    b["product_id"] == product.as_str()
        && b["from"] == from.as_str()
        && b["to"] == to.as_str()
        && b["quantity"].as_i64() == Some(*quantity)
        && answer.transfer_id().is_some()
        && answer.transfer_status().is_some()
}

/// One transfer key: resolved, one transfer whatever the retries, answers that describe the
/// request, a reused body refused, and exactly one row when one was answered, holding the
/// answered body and id in the state the answers and receives put it in.
fn transfer_key(
    f: &mut Found,
    key: &str,
    ops: &TransferOps,
    rows: &[&TransferRow],
    receives: &BTreeMap<Uuid, Vec<&Op>>,
) {
    let subject = Subject::Transfer(key.to_owned());
    let original = &ops.same[0].target;
    let Target::Transfer {
        product,
        from,
        to,
        quantity,
        in_transit,
        ..
    } = original
    else {
        unreachable!("grouped by transfer key")
    };
    if !ops.same.iter().any(|o| o.answer.definite()) {
        f.flag(
            "unresolved",
            subject.clone(),
            "transfer: no definite answer, even after resolution",
        );
    }
    for o in &ops.reused {
        if o.answer.definite() && o.answer.status() != Some(422) {
            f.flag(
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
    let made: Vec<&Op> = ops
        .same
        .iter()
        .copied()
        .filter(|o| o.answer.status() == Some(201))
        .collect();
    for o in ops.same.iter().filter(|o| o.answer.status() == Some(422)) {
        f.flag(
            "own body answered 422",
            subject.clone(),
            format!("#{}: its own body was answered 422", o.seq),
        );
    }
    let ids: BTreeSet<Uuid> = made.iter().filter_map(|o| o.answer.transfer_id()).collect();
    if ids.len() > 1 {
        f.flag(
            "two transfers for one key",
            subject.clone(),
            format!("answered {} different transfers: {ids:?}", ids.len()),
        );
    }
    for o in &made {
        let at_once = !in_transit && o.answer.transfer_status() != Some(TransferStatus::Received);
        if !describes(&o.answer, original) || at_once {
            f.flag(
                "201 does not describe the transfer",
                subject.clone(),
                format!("#{}: the 201 does not describe {original:?}", o.seq),
            );
        }
    }
    // Once a 201 was heard, the transfer exists: a later request is told so, not 409.
    if let Some(first) = made.iter().map(|o| o.at_ms).min() {
        for o in ops
            .same
            .iter()
            .filter(|o| o.answer.status() == Some(409) && o.sent_ms > first)
        {
            f.flag(
                "409 after the transfer was made",
                subject.clone(),
                format!(
                    "#{}: answered 409 {}, after a 201 at +{first}ms",
                    o.seq,
                    o.answer.code()
                ),
            );
        }
    }
    let row = match (ids.first(), rows) {
        (None, []) => return,
        // Made although every request was told it was not (none went unanswered).
        (None, [r]) if ops.same.iter().all(|o| o.answer.definite()) => {
            f.flag(
                "refused but the transfer was made",
                subject.clone(),
                format!("every request was refused, but the key holds {r:?}"),
            );
            return;
        }
        // Made by a request whose answer was lost: its units count where its row says.
        (None, [_]) => return,
        (Some(id), [r])
            if r.transfer_id == *id
                && r.product == *product
                && r.from == *from
                && r.to == *to
                && r.quantity == *quantity =>
        {
            *r
        }
        (Some(id), _) => {
            f.flag(
                "transfer not made exactly once",
                subject.clone(),
                format!("answered transfer {id} ({product}×{quantity} {from}→{to}), but the key holds {rows:?}"),
            );
            return;
        }
        (None, _) => {
            f.flag(
                "transfer not made exactly once",
                subject.clone(),
                format!("the key holds {rows:?}"),
            );
            return;
        }
    };
    let receipts = receives
        .get(&row.transfer_id)
        .map(Vec::as_slice)
        .unwrap_or_default();
    transfer_status(f, &subject, *in_transit, &made, receipts, row);
}

/// A transfer asked to be received at once is `received`; one in transit is `received` once a
/// receive was answered 200 and `in_transit` if none was ever sent. An answer says `received`
/// only after some receive was sent, and `in_transit` only before any was answered.
fn transfer_status(
    f: &mut Found,
    subject: &Subject,
    in_transit: bool,
    made: &[&Op],
    receipts: &[&Op],
    row: &TransferRow,
) {
    let answered = receipts.iter().filter(|o| o.answer.status() == Some(200));
    let first_received = answered.map(|o| o.at_ms).min();
    let first_sent = receipts.iter().map(|o| o.sent_ms).min();
    let want = match (in_transit, first_received, first_sent) {
        (false, _, _) | (true, Some(_), _) => Some(TransferStatus::Received),
        (true, None, None) => Some(TransferStatus::InTransit),
        // Sent, never answered: flagged as unresolved by `received`.
        (true, None, Some(_)) => None,
    };
    if let Some(want) = want
        && want != row.status
    {
        let n = receipts
            .iter()
            .filter(|o| o.answer.status() == Some(200))
            .count();
        f.flag(
            "transfer not in its answered state",
            subject.clone(),
            format!("want {want:?} after {n} receive(s) answered 200, but the row is {row:?}"),
        );
    }
    for o in made {
        let said = o.answer.transfer_status();
        let lie = match said {
            Some(TransferStatus::Received) if in_transit => {
                first_sent.is_none_or(|sent| sent > o.at_ms)
            }
            Some(TransferStatus::InTransit) => first_received.is_some_and(|r| r < o.sent_ms),
            _ => false,
        };
        if lie {
            f.flag(
                "transfer not in its answered state",
                subject.clone(),
                format!("#{}: answered {said:?} (receives sent from {first_sent:?}, first answered {first_received:?})", o.seq),
            );
        }
    }
}

/// Every receive of a transfer is answered, in the end, with the transfer `received`: the
/// row's body and id.
fn received(f: &mut Found, id: Uuid, ops: &[&Op], row: Option<&TransferRow>) {
    let Some(Target::Receive { key, .. }) = ops.first().map(|o| &o.target) else {
        return;
    };
    let subject = Subject::Transfer(key.clone());
    if !ops.iter().any(|o| o.answer.definite()) {
        f.flag(
            "unresolved",
            subject.clone(),
            format!("receive of {id}: no definite answer, even after resolution"),
        );
    }
    for o in ops.iter().filter(|o| o.answer.status() == Some(200)) {
        let b = o.answer.body();
        let right = row.is_some_and(|r| {
            o.answer.transfer_id() == Some(id)
                && o.answer.transfer_status() == Some(TransferStatus::Received)
                && b["product_id"] == r.product.as_str()
                && b["from"] == r.from.as_str()
                && b["to"] == r.to.as_str()
                && b["quantity"].as_i64() == Some(r.quantity)
        });
        if !right {
            f.flag(
                "receive does not describe the transfer",
                subject.clone(),
                format!(
                    "#{}: a receive of {id} answered {b}; the row is {row:?}",
                    o.seq
                ),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The per-location checks' own tests: made-up histories, no cluster.
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::super::checker::{check, report};
    use super::*;
    use serde_json::{Value, json};

    const P: &str = "p";

    fn got(status: u16, body: Value) -> Answer {
        Answer::Got {
            status,
            retry_after: status == 503,
            body,
        }
    }

    fn op(seq: usize, kind: Kind, target: Target, answer: Answer) -> Op {
        Op {
            seq,
            sent_ms: 10 * seq as u64,
            at_ms: 10 * seq as u64 + 5,
            client: "ada".into(),
            kind,
            instance: seq % 2,
            target,
            answer,
        }
    }

    fn allocs(items: &[(&str, i64)]) -> Vec<Alloc> {
        let mut out: Vec<Alloc> = items
            .iter()
            .map(|(l, q)| Alloc {
                product: P.into(),
                location: l.to_string(),
                quantity: *q,
            })
            .collect();
        out.sort();
        out
    }

    fn ordered(key: &str, quantity: i64, locations: Option<&[&str]>) -> Target {
        Target::Order {
            user: "ada".into(),
            key: key.into(),
            product: P.into(),
            quantity,
            locations: locations.map(|l| l.iter().map(|l| l.to_string()).collect()),
        }
    }

    fn order_answer(
        status: u16,
        id: Uuid,
        quantity: i64,
        state: &str,
        at: &[(&str, i64)],
    ) -> Answer {
        got(
            status,
            json!({"order_id": id, "product_id": P, "quantity": quantity, "user_id": "ada",
                   "status": state, "allocations": allocs(at)}),
        )
    }

    fn moving(key: &str, from: &str, to: &str, quantity: i64, in_transit: bool) -> Target {
        Target::Transfer {
            key: key.into(),
            product: P.into(),
            from: from.into(),
            to: to.into(),
            quantity,
            in_transit,
        }
    }

    fn transfer_answer(status: u16, id: Uuid, t: &Target, state: &str) -> Answer {
        let Target::Transfer {
            from, to, quantity, ..
        } = t
        else {
            unreachable!()
        };
        got(
            status,
            json!({"transfer_id": id, "product_id": P, "from": from, "to": to,
                   "quantity": quantity, "status": state}),
        )
    }

    fn order_row(id: Uuid, key: &str, quantity: i64, status: &str, at: &[(&str, i64)]) -> Row {
        Row {
            order_id: id,
            user: "ada".into(),
            key: key.into(),
            product: P.into(),
            quantity,
            status: status.into(),
            refusal: None,
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
            allocations: allocs(at),
        }
    }

    fn announce(db: &mut Snapshot, location: &str, reason: &str, added: i64, removed: i64) {
        let a = db
            .announced
            .entry((place(P, location), reason.into()))
            .or_default();
        a.added += added;
        a.removed += removed;
    }

    /// `p` created with 6 at `default`, 4 at `eu-1`, 5 at `back` (inactive). ada's k1 (3, from
    /// `eu-1` only) took 3 there and was cancelled; k2 (2, no locations) took 2 at `default`;
    /// r1 restocked 2 at `eu-1`; t1 moved 2 from `back` to `default` in transit, received by a
    /// retry after a lost receive, and received again; t2 moved 1 from `default` to `eu-1` at
    /// once, and was replayed; t3 (5 from `eu-1`) was refused. Levels: `default` 6 − 2 + 2 − 1
    /// = 5, `eu-1` 4 + 2 + 1 = 7, `back` 5 − 2 = 3; the count 12.
    fn spread() -> (Opening, Vec<Op>, Snapshot, [Uuid; 4]) {
        let ids @ [k1, k2, t1, t2] = [(); 4].map(|_| Uuid::new_v4());
        let (m1, m2) = (
            moving("t1", "back", DEFAULT, 2, true),
            moving("t2", DEFAULT, "eu-1", 1, false),
        );
        let receive = Target::Receive {
            key: "t1".into(),
            transfer_id: t1,
        };
        let history = vec![
            op(
                0,
                Kind::New,
                ordered("k1", 3, Some(&["eu-1"])),
                order_answer(201, k1, 3, "confirmed", &[("eu-1", 3)]),
            ),
            op(
                1,
                Kind::New,
                ordered("k2", 2, None),
                order_answer(201, k2, 2, "confirmed", &[(DEFAULT, 2)]),
            ),
            op(
                2,
                Kind::Cancel,
                Target::Cancel {
                    user: "ada".into(),
                    order_id: k1,
                },
                order_answer(200, k1, 3, "cancelled", &[("eu-1", 3)]),
            ),
            op(
                3,
                Kind::New,
                Target::Restock {
                    key: "r1".into(),
                    product: P.into(),
                    quantity: 2,
                    location: Some("eu-1".into()),
                },
                got(200, json!({"product_id": P, "available_quantity": 13})),
            ),
            op(
                4,
                Kind::New,
                m1.clone(),
                transfer_answer(201, t1, &m1, "in_transit"),
            ),
            op(
                5,
                Kind::HangUp,
                receive.clone(),
                Answer::Lost {
                    lost: "hung up".into(),
                },
            ),
            op(
                6,
                Kind::Retry,
                receive.clone(),
                transfer_answer(200, t1, &m1, "received"),
            ),
            op(
                7,
                Kind::Replay,
                receive,
                transfer_answer(200, t1, &m1, "received"),
            ),
            op(
                8,
                Kind::New,
                m2.clone(),
                transfer_answer(201, t2, &m2, "received"),
            ),
            op(
                9,
                Kind::Replay,
                m2.clone(),
                transfer_answer(201, t2, &m2, "received"),
            ),
            op(
                10,
                Kind::New,
                moving("t3", "eu-1", DEFAULT, 5, false),
                got(
                    409,
                    json!({"error": {"code": "OUT_OF_STOCK", "message": "…"}}),
                ),
            ),
        ];
        let row = |id, key: &str, t: &Target, status| {
            let Target::Transfer {
                from, to, quantity, ..
            } = t
            else {
                unreachable!()
            };
            TransferRow {
                transfer_id: id,
                key: key.into(),
                product: P.into(),
                from: from.clone(),
                to: to.clone(),
                quantity: *quantity,
                status,
            }
        };
        let mut db = Snapshot {
            stock: BTreeMap::from([(P.to_string(), 12)]),
            orders: vec![
                order_row(k1, "k1", 3, "cancelled", &[("eu-1", 3)]),
                order_row(k2, "k2", 2, "confirmed", &[(DEFAULT, 2)]),
            ],
            restocks: Some(vec![RestockRow {
                key: "r1".into(),
                product: P.into(),
                quantity: 2,
                location: "eu-1".into(),
            }]),
            levels: BTreeMap::from([
                (place(P, DEFAULT), 5),
                (place(P, "eu-1"), 7),
                (place(P, "back"), 3),
            ]),
            active: BTreeMap::from([
                (DEFAULT.to_string(), true),
                ("eu-1".to_string(), true),
                ("back".to_string(), false),
            ]),
            transfers: vec![
                row(t1, "t1", &m1, TransferStatus::Received),
                row(t2, "t2", &m2, TransferStatus::Received),
            ],
            ..Snapshot::default()
        };
        let mut opening = Opening::new();
        for (l, n) in [(DEFAULT, 6), ("eu-1", 4), ("back", 5)] {
            opening.insert(place(P, l), n);
            announce(&mut db, l, "create", n, 0);
        }
        announce(&mut db, "eu-1", "restock", 2, 0);
        announce(&mut db, "back", "transfer", 0, 2);
        announce(&mut db, DEFAULT, "transfer", 2, 1);
        announce(&mut db, "eu-1", "transfer", 1, 0);
        (opening, history, db, ids)
    }

    /// Only anomalies of `class`, at least one, each about one of `subjects`.
    fn only(found: &[Anomaly], class: &str, subjects: &[Subject], history: &[Op]) {
        assert!(
            !found.is_empty()
                && found
                    .iter()
                    .all(|a| a.class == class && subjects.contains(&a.subject)),
            "want only {class:?} about {subjects:?}:{}",
            report(found, history)
        );
    }

    fn at(location: &str) -> Subject {
        Subject::Location {
            product: P.into(),
            location: location.into(),
        }
    }

    fn key(key: &str) -> Subject {
        Subject::Key {
            user: "ada".into(),
            key: key.into(),
        }
    }

    /// Mutations of the checker that make it fail: `conserved` leaving out transfers in or
    /// out, or restocks (three places off), or counting cancelled orders' allocations
    /// (`eu-1` short by 3); `announced` keyed by product only.
    #[test]
    fn history_checker_passes_a_truthful_history_across_locations() {
        let (opening, history, db, _) = spread();
        let found = check(&opening, &history, &db);
        assert!(found.is_empty(), "{}", report(&found, &history));
    }

    /// k1's cancel gave its 3 units back to `default`, not to `eu-1` they came from: the
    /// product's count is right, two locations are not. This is what the service does with
    /// `stock::give_back` binding `'default'` for every allocation's location. Mutations of
    /// the checker that make it fail: `check` without `conserved`, or `conserved` judging
    /// products only (as before locations).
    #[test]
    fn history_checker_flags_a_cancel_given_back_to_another_location() {
        let (opening, history, mut db, _) = spread();
        db.levels.insert(place(P, DEFAULT), 8);
        db.levels.insert(place(P, "eu-1"), 4);
        let found = check(&opening, &history, &db);
        only(
            &found,
            "stock not conserved at a location",
            &[at(DEFAULT), at("eu-1")],
            &history,
        );
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found.iter().any(|a| a
                .what
                .contains("level 8; want +6 created -1 transferred out +2 transferred in -2 in confirmed orders -0 held = 5")),
            "{found:?}"
        );
    }

    /// t1's retried receive added its 2 units to `default` again (and announced them again).
    /// This is what the service does with `levels::receive`'s UPDATE without `AND status =
    /// 'in_transit'`. Mutations of the checker that make it fail: `check` without `conserved`
    /// and `announced` (the row says received once, and every answer agrees).
    #[test]
    fn history_checker_flags_a_receive_that_added_twice() {
        let (opening, history, mut db, _) = spread();
        db.levels.insert(place(P, DEFAULT), 7);
        db.stock.insert(P.into(), 14);
        announce(&mut db, DEFAULT, "transfer", 2, 0);
        let found = check(&opening, &history, &db);
        let classes: BTreeSet<&str> = found.iter().map(|a| a.class).collect();
        assert_eq!(
            classes,
            BTreeSet::from([
                "movements not announced once",
                "stock not conserved",
                "stock not conserved at a location"
            ]),
            "{}",
            report(&found, &history)
        );
        assert!(
            found
                .iter()
                .any(|a| a.subject == at(DEFAULT) && a.what.contains("events add 4")),
            "{found:?}"
        );
    }

    /// k2's replay was told 2 from `eu-1` while its row (and the units) say `default`. What a
    /// service answering a replay from the request rather than the row does. Mutation of the
    /// checker that makes it fail: `allocations` comparing answers with each other only.
    #[test]
    fn history_checker_flags_allocations_that_are_not_the_rows() {
        let (opening, mut history, db, [_, k2, ..]) = spread();
        let n = history.len();
        history.push(op(
            n,
            Kind::Replay,
            ordered("k2", 2, None),
            order_answer(201, k2, 2, "confirmed", &[("eu-1", 2)]),
        ));
        let found = check(&opening, &history, &db);
        only(&found, "allocations not the row's", &[key("k2")], &history);
    }

    /// k2 (no locations named) took its 2 units from `back`, which is inactive, and k1 (which
    /// named `eu-1` only) took from `default`; every answer says so, and the books add up.
    /// What `active_levels_v2` without `AND l.active`, and `request_locations_v1` ignoring a
    /// request's `locations`, do. Mutations of the checker that make it fail: `allocations`
    /// without its location loop, or reading `named` from the last request under a key.
    #[test]
    fn history_checker_flags_allocations_from_inactive_or_unnamed_locations() {
        let (opening, mut history, mut db, _) = spread();
        let moved = |a: &mut Answer, from: &str, to: &str| {
            if let Answer::Got { body, .. } = a {
                for x in body["allocations"].as_array_mut().unwrap() {
                    if x["location_id"] == from {
                        x["location_id"] = json!(to);
                    }
                }
            }
        };
        moved(&mut history[1].answer, DEFAULT, "back");
        moved(&mut history[0].answer, "eu-1", DEFAULT);
        moved(&mut history[2].answer, "eu-1", DEFAULT);
        db.orders[1].allocations = allocs(&[("back", 2)]);
        db.orders[0].allocations = allocs(&[(DEFAULT, 3)]);
        db.levels.insert(place(P, DEFAULT), 7);
        db.levels.insert(place(P, "back"), 1);
        db.stock.insert(P.into(), 14);
        let found = check(&opening, &history, &db);
        let classes: BTreeSet<&str> = found.iter().map(|a| a.class).collect();
        assert_eq!(
            classes,
            BTreeSet::from([
                "an allocation from a location not named",
                "an allocation from an inactive location"
            ]),
            "{}",
            report(&found, &history)
        );
    }

    /// A row whose allocations do not add up to its order: 3 ordered, 2 allocated. Mutation of
    /// the checker that makes it fail: `allocations` without its sum.
    #[test]
    fn history_checker_flags_allocations_short_of_the_order() {
        let (opening, history, mut db, _) = spread();
        db.orders[0].quantity = 4;
        let found = check(&opening, &history, &db);
        assert!(
            found
                .iter()
                .any(|a| a.class == "allocations do not add up to the order"
                    && a.subject == key("k1")),
            "{}",
            report(&found, &history)
        );
    }

    /// t1 still `in_transit` although its receives were answered 200, and its units not at
    /// `default` (the books add up to the row). What a receive answered without its UPDATE
    /// does. Mutation of the checker that makes it fail: `transfer_status` ignoring receives.
    #[test]
    fn history_checker_flags_a_transfer_received_in_answers_only() {
        let (opening, history, mut db, _) = spread();
        db.transfers[0].status = TransferStatus::InTransit;
        db.levels.insert(place(P, DEFAULT), 3);
        db.stock.insert(P.into(), 10);
        db.announced.insert(
            (place(P, DEFAULT), "transfer".into()),
            Announced {
                added: 0,
                removed: 1,
            },
        );
        let found = check(&opening, &history, &db);
        only(
            &found,
            "transfer not in its answered state",
            &[Subject::Transfer("t1".into())],
            &history,
        );
    }

    /// t2 answered 201 (twice) but no row holds it, and its unit never moved. What a transfer
    /// answered before a commit that then failed does. Mutation of the checker that makes it
    /// fail: `transfer_key` returning early when its key holds no row.
    #[test]
    fn history_checker_flags_an_acknowledged_transfer_with_no_row() {
        let (opening, history, mut db, _) = spread();
        db.transfers.retain(|t| t.key == "t1");
        db.levels.insert(place(P, DEFAULT), 6);
        db.levels.insert(place(P, "eu-1"), 6);
        db.announced.remove(&(place(P, "eu-1"), "transfer".into()));
        db.announced.insert(
            (place(P, DEFAULT), "transfer".into()),
            Announced {
                added: 2,
                removed: 0,
            },
        );
        let found = check(&opening, &history, &db);
        only(
            &found,
            "transfer not made exactly once",
            &[Subject::Transfer("t2".into())],
            &history,
        );
    }
}
