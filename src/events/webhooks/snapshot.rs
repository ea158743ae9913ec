//! What a webhook's creation saw: the snapshot of the transaction that created it
//! (`pg_current_snapshot()`, stored with the webhook), so delivery can skip the events that
//! were committed before the webhook existed.
//!
//! **Why the starting cursor alone is not enough.** A new webhook starts after the newest
//! event below its creation snapshot's `xmin`, the feed's horizon. An event whose transaction
//! committed before the creation but has an id at or above that `xmin` (an older transaction
//! was still open: a psql session, a cart batch, another database of the cluster) sorts
//! after the starting cursor, yet the webhook did not exist when it happened. Such an event
//! is exactly one whose transaction the creation snapshot sees as finished: an id in
//! `[xmin, xmax)` not listed as running. Events below `xmin` are at or before the starting
//! cursor already; events of transactions running at the creation, or begun after it, are
//! delivered, whatever their id.

use std::fmt;

/// A `pg_snapshot` as PostgreSQL prints it: `xmin:xmax:xip,…` (the ids in progress).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreationSnapshot {
    xmin: u64,
    xmax: u64,
    xip: Vec<u64>,
}

/// A text that is not a `pg_snapshot`'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a pg_snapshot: {0:?}")]
pub struct BadSnapshot(pub String);

impl CreationSnapshot {
    pub fn parse(s: &str) -> Result<Self, BadSnapshot> {
        let bad = || BadSnapshot(s.chars().take(100).collect());
        let mut parts = s.split(':');
        let (Some(xmin), Some(xmax), Some(xip), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let id = |t: &str| t.parse::<u64>().map_err(|_| bad());
        let (xmin, xmax) = (id(xmin)?, id(xmax)?);
        let xip = xip
            .split(',')
            .filter(|t| !t.is_empty())
            .map(id)
            .collect::<Result<Vec<_>, _>>()?;
        if xmin > xmax || xip.iter().any(|&x| x < xmin || x >= xmax) {
            return Err(bad());
        }
        Ok(CreationSnapshot { xmin, xmax, xip })
    }

    /// Whether transaction `xid` had ended when the snapshot was taken: PostgreSQL's
    /// `pg_visible_in_snapshot(xid, snapshot)`. For the id of a transaction that wrote events
    /// (so committed), that is "committed before the webhook was created".
    pub fn saw(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && !self.xip.contains(&xid))
    }
}

impl fmt::Display for CreationSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_reads_back_as_postgres_prints_it() {
        for text in ["10:10:", "10:20:10,14,15", "748:752:749"] {
            assert_eq!(CreationSnapshot::parse(text).unwrap().to_string(), text);
        }
        for bad in [
            "",
            "10",
            "10:20",
            "10:20:x",
            "20:10:",
            "10:20:9",
            "10:20:20",
            "10:20:1:2",
            "-1:2:",
        ] {
            assert!(CreationSnapshot::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn it_saw_the_ended_transactions_below_xmax_and_not_the_running_ones() {
        let s = CreationSnapshot::parse("10:20:10,14,15").unwrap();
        // Below xmin: ended before (and before the starting cursor).
        assert!(s.saw(3) && s.saw(9));
        // In [xmin, xmax): ended unless listed as running.
        assert!(s.saw(11) && s.saw(13) && s.saw(19));
        assert!(!s.saw(10) && !s.saw(14) && !s.saw(15));
        // From xmax on: not begun when the snapshot was taken.
        assert!(!s.saw(20) && !s.saw(1000));
    }
}
