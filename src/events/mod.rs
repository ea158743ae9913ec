//! The event feed: every committed order, hold and stock change, in one total order with no
//! gaps (contract, "Events").
//!
//! Events are written by the database in the transaction of the change (triggers on
//! `orders`, `order_lines` and `holds`; `stock.changed` by `checkout::stock`'s
//! statements), so every writer, the batch functions included, writes them without an extra
//! round trip, and a rolled-back change has none (migration `20261202000007_events.sql`).
//!
//! **Why no event can appear behind a reader.** An event's place is `(xid, n)`: the id of the
//! transaction that wrote it, then its position within it (rows in sequence, one per writing
//! statement, and the event's place in its row). A read serves only events whose
//! `xid` is below its snapshot's `xmin` — every transaction with a smaller id has ended — so
//! an event that commits later always has an `xid` at or above that `xmin`, after everything
//! already served. The naive outbox (`WHERE id > $cursor` on a sequence) loses events: a
//! sequence value is taken before commit, so a change that commits a moment late gets a
//! smaller id than one already served. A long transaction holds `xmin` back: it delays the
//! feed, never reorders it. The same read on a hot standby uses the standby's snapshot,
//! whose `xmin` is the primary's as replayed, so a replica serves a prefix of the same feed.

pub mod feed;
pub mod horizon;
pub mod webhooks;

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A place in the feed: the event at position `n` of transaction `xid`, or [`Cursor::START`]
/// before every event. A position is `row * 65536 + i`: the event's row (one per writing
/// statement, in sequence) and its place in that row. Opaque to clients: `<xid>-<n>` in
/// lower-case hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor {
    pub xid: u64,
    pub n: i64,
}

impl Cursor {
    /// Before the first event.
    pub const START: Cursor = Cursor { xid: 0, n: 0 };
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}-{:x}", self.xid, self.n)
    }
}

/// A cursor that is not one this service wrote.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a cursor is the `next` (or an event's `cursor`) of an earlier answer")]
pub struct BadCursor;

impl FromStr for Cursor {
    type Err = BadCursor;
    fn from_str(s: &str) -> Result<Self, BadCursor> {
        let (xid, n) = s.split_once('-').ok_or(BadCursor)?;
        let hex = |t: &str| {
            (!t.is_empty() && t.len() <= 16 && t.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| u64::from_str_radix(t, 16).ok())
                .flatten()
        };
        let xid = hex(xid).ok_or(BadCursor)?;
        let n = hex(n)
            .and_then(|n| i64::try_from(n).ok())
            .ok_or(BadCursor)?;
        Ok(Cursor { xid, n })
    }
}

impl Serialize for Cursor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The kinds of event (the contract's `type`).
pub const TYPES: &[&str] = &[
    "order.confirmed",
    "order.cancelled",
    "hold.created",
    "hold.confirmed",
    "hold.released",
    "hold.expired",
    "stock.changed",
];

/// One event as the feed and the webhooks state it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Event {
    /// This event's place; a read `after` it continues behind it.
    #[schema(value_type = String, example = "2f8-1a")]
    pub cursor: Cursor,
    #[serde(rename = "type")]
    #[schema(example = "order.confirmed")]
    pub kind: String,
    pub at: chrono::DateTime<chrono::Utc>,
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_written_and_nothing_else_parses() {
        for c in [
            Cursor::START,
            Cursor { xid: 0x2f8, n: 26 },
            Cursor {
                xid: u64::MAX,
                n: i64::MAX,
            },
        ] {
            assert_eq!(c.to_string().parse::<Cursor>(), Ok(c));
        }
        for bad in [
            "",
            "-",
            "1",
            "1-",
            "-1",
            "x-1",
            "1-x",
            "1-1-1",
            " 1-1",
            "1-8000000000000000",
            "00000000000000001-1",
            "+1-1",
        ] {
            assert_eq!(bad.parse::<Cursor>(), Err(BadCursor), "{bad:?}");
        }
    }

    #[test]
    fn cursors_order_by_transaction_then_sequence() {
        let a = Cursor { xid: 5, n: 90 };
        let b = Cursor { xid: 6, n: 1 };
        assert!(Cursor::START < a && a < b);
    }
}
