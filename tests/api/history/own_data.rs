//! Read-your-writes against the history (issue 48): once a write of a user's settings or
//! profile is acknowledged, no read of that record by that user begun afterwards — from either
//! device, through either instance — returns an older value. A read may fail closed (503 with
//! `Retry-After`); a stale value is the lie.
//!
//! Every write's value is unique, so a read names the write it saw. Writes of one record can
//! overlap (two devices), so "older" is only what real time proves: write X is older than
//! write W when X was acknowledged before W was sent (X committed before W began), and the
//! value no write gave is older than every write. A write never heard back (lost, 503) may
//! commit at any time, so it is older than nothing.
//!
//! Also here: whether a run exercised the two faults read-your-writes must survive. A fault
//! counts only if, while it was in force, a replica served own data (so a read that lacked its
//! pin would have met a replica without the write) and a user's write was read back across it.

use super::checker::{Anomaly, Subject};
use super::model::{Answer, Op, Record, Seen, Target};
use super::nemesis::{Fault, Window};
use std::collections::BTreeMap;

/// The user and record of an own-data operation, and the value if it is a write.
fn own(op: &Op) -> Option<(&str, Record, Option<&str>)> {
    match &op.target {
        Target::Save {
            user,
            record,
            value,
        } => Some((user, *record, Some(value))),
        Target::Read { user, record } => Some((user, *record, None)),
        _ => None,
    }
}

fn acked(op: &Op) -> bool {
    op.answer.status() == Some(200)
}

/// Every stale read, read of a value nobody wrote, and read of a write not yet sent.
pub(super) fn read_your_writes(history: &[Op]) -> Vec<Anomaly> {
    type Ops<'a> = (Vec<(&'a Op, &'a str)>, Vec<&'a Op>);
    let mut by: BTreeMap<(&str, Record), Ops> = BTreeMap::new();
    for op in history {
        match own(op) {
            Some((user, record, Some(value))) => {
                by.entry((user, record)).or_default().0.push((op, value))
            }
            Some((user, record, None)) => by.entry((user, record)).or_default().1.push(op),
            None => {}
        }
    }
    let mut found = vec![];
    for ((user, record), (writes, reads)) in by {
        let subject = Subject::Own {
            user: user.to_owned(),
            record,
        };
        let mut flag = |class, what: String| {
            found.push(Anomaly {
                class,
                subject: subject.clone(),
                what,
            })
        };
        for r in reads {
            let seen = match r.answer.seen(record) {
                None => continue,
                Some(Seen::Garbled(body)) => {
                    flag("an own record no write gave", format!("#{}: {body}", r.seq));
                    continue;
                }
                Some(Seen::Initial) => None,
                Some(Seen::Value(v)) => match writes.iter().find(|(_, value)| *value == v) {
                    Some(&(x, _)) => Some(x),
                    None => {
                        flag(
                            "an own record no write gave",
                            format!("#{}: read {v}, which no request wrote", r.seq),
                        );
                        continue;
                    }
                },
            };
            if let Some(x) = seen.filter(|x| x.sent_ms > r.at_ms) {
                flag(
                    "an own read that saw a later write",
                    format!(
                        "#{}: answered at +{}ms with #{}'s value, sent at +{}ms",
                        r.seq, r.at_ms, x.seq, x.sent_ms
                    ),
                );
            }
            // The newest acknowledged write before the read that replaced what it saw.
            let older = |w: &Op| seen.is_none_or(|x| acked(x) && x.at_ms < w.sent_ms);
            let replaced = writes
                .iter()
                .map(|(w, _)| *w)
                .filter(|w| acked(w) && w.at_ms < r.sent_ms && older(w))
                .max_by_key(|w| w.at_ms);
            if let Some(w) = replaced {
                let saw = seen.map_or("the value no write gave".to_owned(), |x| {
                    format!("#{}'s value (acknowledged at +{}ms)", x.seq, x.at_ms)
                });
                flag(
                    "stale own read (read-your-writes)",
                    format!(
                        "#{} by {} @{} sent at +{}ms, served by {}: saw {saw}, but #{} by {} @{} was acknowledged at +{}ms after it",
                        r.seq,
                        r.client,
                        r.instance,
                        r.sent_ms,
                        r.answer.served_by().unwrap_or("?"),
                        w.seq,
                        w.client,
                        w.instance,
                        w.at_ms
                    ),
                );
            }
        }
    }
    found
}

fn within(op: &Op, from: u64, to: u64) -> bool {
    from <= op.sent_ms && op.at_ms <= to
}

fn from_replica(answer: &Answer) -> bool {
    answer.status() == Some(200) && answer.served_by().is_some_and(|s| s != "primary")
}

/// A read in `from..=to` served by a replica: one that lacked a pin would have been too.
fn replica_served(history: &[Op], from: u64, to: u64) -> bool {
    history
        .iter()
        .any(|o| own(o).is_some() && within(o, from, to) && from_replica(&o.answer))
}

/// A write acknowledged in `written` (sent at or after its start, heard before its end), read
/// back by the same user in `read` (sent after the write was heard). If `elsewhere`, through an
/// instance the user sent no write to from the start of `written` until the read was answered:
/// that instance held none of the user's positions itself.
fn read_back(history: &[Op], written: (u64, u64), read: (u64, u64), elsewhere: bool) -> bool {
    let wrote_through = |user: &str, instance: usize, until: u64| {
        history.iter().any(|w| {
            matches!(own(w), Some((u, _, Some(_))) if u == user)
                && w.instance == instance
                && (written.0..until).contains(&w.sent_ms)
        })
    };
    history.iter().filter(|x| acked(x)).any(|x| {
        let Some((user, record, Some(_))) = own(x) else {
            return false;
        };
        within(x, written.0, written.1)
            && history.iter().any(|r| {
                matches!(own(r), Some((u, rec, None)) if u == user && rec == record)
                    && r.sent_ms > x.at_ms
                    && within(r, read.0, read.1)
                    && (!elsewhere || !wrote_through(user, r.instance, r.at_ms))
                    && r.answer.seen(record).is_some()
            })
    })
}

/// A pause of both replicas during which a replica served own data and a user's write made in
/// the pause was read back in it: without the user's pin, that read could meet a replica
/// that lacks the write.
pub(super) fn pause_exercised(history: &[Op], windows: &[Window]) -> bool {
    windows
        .iter()
        .filter(|w| w.fault == Fault::ReplicasPaused)
        .any(|w| {
            replica_served(history, w.from, w.to)
                && read_back(history, (w.from, w.to), (w.from, w.to), false)
        })
}

/// A Redis restart (empty) straddled by a user's write and its read through an instance the
/// user wrote nothing to since the pause (so it held no position of theirs), with both
/// replicas lacking the write
/// throughout and serving own data before the restart: without the store's epoch, that read
/// could meet a replica that lacks the write.
pub(super) fn redis_restart_exercised(history: &[Op], windows: &[Window]) -> bool {
    windows
        .iter()
        .filter(|w| w.fault == Fault::RedisRestartedEmpty)
        .any(|w| {
            let Some((stopped, started)) = w.redis_down else {
                return false;
            };
            replica_served(history, w.from, stopped)
                && read_back(history, (w.from, stopped), (started, w.to), true)
        })
}

// ---------------------------------------------------------------------------------------------
// Its tests: made-up histories, no cluster.
// ---------------------------------------------------------------------------------------------

fn op(
    seq: usize,
    sent: u64,
    at: u64,
    client: &str,
    instance: usize,
    target: Target,
    answer: Answer,
) -> Op {
    Op {
        seq,
        sent_ms: sent,
        at_ms: at,
        client: client.into(),
        kind: match target {
            Target::Save { .. } => super::model::Kind::Save,
            _ => super::model::Kind::Read,
        },
        instance,
        target,
        answer,
    }
}

fn save(seq: usize, sent: u64, at: u64, device: &str, value: &str, status: u16) -> Op {
    let target = Target::Save {
        user: "ada".into(),
        record: Record::Settings,
        value: value.into(),
    };
    let answer = Answer::Got {
        status,
        retry_after: status == 503,
        body: serde_json::json!({}),
    };
    op(seq, sent, at, device, seq % 2, target, answer)
}

/// A read of ada's settings that saw `value` (`None`: `{}`) from `served_by`.
fn read(
    seq: usize,
    sent: u64,
    at: u64,
    instance: usize,
    value: Option<&str>,
    served_by: &str,
) -> Op {
    let settings = match value {
        Some(v) => serde_json::json!({"v": v}),
        None => serde_json::json!({}),
    };
    let target = Target::Read {
        user: "ada".into(),
        record: Record::Settings,
    };
    let body = serde_json::json!({"user_id": "ada", "settings": settings, "served_by": served_by});
    op(
        seq,
        sent,
        at,
        "ada/laptop",
        instance,
        target,
        Answer::Got {
            status: 200,
            retry_after: false,
            body,
        },
    )
}

/// ada's phone saves a, then b; her laptop reads b through the other instance; a write c is
/// lost and, being unheard, may land any time; a later read of a while c is unresolved is
/// stale all the same (b was acknowledged after a, before the read).
fn two_devices() -> Vec<Op> {
    vec![
        save(0, 0, 10, "ada/phone", "a", 200),
        save(1, 20, 30, "ada/phone", "b", 200),
        read(2, 40, 50, 0, Some("b"), "replica-1"),
        save(3, 60, 70, "ada/phone", "c", 503),
        read(4, 80, 90, 1, Some("c"), "primary"),
        read(5, 100, 110, 0, Some("b"), "primary"),
    ]
}

/// Mutation of the checker that makes it fail: `older` always true (every read of the newest
/// write would be stale against that write itself).
#[test]
fn read_your_writes_passes_reads_of_the_newest_or_an_unheard_write() {
    let found = read_your_writes(&two_devices());
    assert!(found.is_empty(), "{found:?}");
}

/// A read sent after b was acknowledged returns a (a replica that lacked b, as `src/ryw.rs`
/// without its pin would send it to), and another returns `{}`. Mutations of the checker that
/// make it fail: `older` comparing `x.at_ms > w.sent_ms`; `older` true only for `{}` (`seen`
/// must be `None`).
#[test]
fn read_your_writes_flags_a_read_older_than_an_acknowledged_write() {
    let mut history = two_devices();
    history.push(read(6, 120, 130, 1, Some("a"), "replica-2"));
    history.push(read(7, 140, 150, 0, None, "replica-1"));
    let found = read_your_writes(&history);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found
            .iter()
            .all(|a| a.class == "stale own read (read-your-writes)"),
        "{found:?}"
    );
    assert!(
        found[0].what.contains("#6") && found[0].what.contains("#1 by ada/phone"),
        "{found:?}"
    );
}

/// Overlapping writes from two devices: a read may see either until one is known older.
#[test]
fn read_your_writes_lets_a_read_see_either_of_two_overlapping_writes() {
    let history = vec![
        save(0, 0, 50, "ada/phone", "a", 200),
        save(1, 10, 60, "ada/laptop", "b", 200),
        read(2, 70, 80, 0, Some("a"), "primary"),
        read(3, 90, 100, 1, Some("b"), "primary"),
    ];
    assert!(read_your_writes(&history).is_empty());
}

/// Mutation of the checker that makes it fail: `replica_served` ignoring the served-by (the
/// window where everything came from the primary would count), or `read_back` ignoring
/// `elsewhere` (a read through an instance the user wrote to would count).
#[test]
fn a_redis_restart_counts_only_if_a_write_and_its_read_on_the_other_instance_straddle_it() {
    let window = Window {
        fault: Fault::RedisRestartedEmpty,
        from: 0,
        to: 1000,
        redis_down: Some((400, 600)),
    };
    let mut history = vec![
        read(0, 100, 110, 1, None, "replica-1"),
        save(1, 200, 210, "ada/phone", "a", 200),
        read(2, 700, 710, 1, Some("a"), "primary"),
    ];
    history[1].instance = 0;
    assert!(redis_restart_exercised(&history, &[window]));
    // Read back through the instance that wrote it: its own memory pins the read.
    history[2].instance = 0;
    assert!(!redis_restart_exercised(&history, &[window]));
    history[2].instance = 1;
    // … or through one the user also wrote to (unheard) while Redis was down.
    let mut lost = save(3, 450, 850, "ada/laptop", "b", 503);
    lost.instance = 1;
    history.insert(2, lost);
    assert!(!redis_restart_exercised(&history, &[window]));
    history.remove(2);
    // No replica served own data before the restart: the fault proved nothing.
    history[0] = read(0, 100, 110, 1, None, "primary");
    assert!(!redis_restart_exercised(&history, &[window]));
    history[0] = read(0, 100, 110, 1, None, "replica-1");
    // The read was sent while Redis was still down: it straddles no restart.
    history[2].sent_ms = 500;
    assert!(!redis_restart_exercised(&history, &[window]));
}
