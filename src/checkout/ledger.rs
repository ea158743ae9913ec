//! The stock ledger's check: for every (product, location), is the count held what the
//! ledger gives? The rule (migration `20261206000001_movements.sql`, the contract's "The
//! ledger"):
//!
//! ```text
//! stock_levels.available_quantity = sum(movements.delta)
//!                                 - units allocated there by orders with status 'confirmed'
//!                                 - units allocated there by holds with status 'held'
//! ```
//!
//! A (product, location) with movements or allocations but no level row disagrees too (its
//! count held is missing). `stockgate verify` and `GET /v1/admin/ledger` both run [`check`],
//! so there is one way to do it; it only reads (`checkout::stock` stays the one writer).
//!
//! **One snapshot.** Levels, movements, orders and holds are read by one statement in a
//! `REPEATABLE READ, READ ONLY` transaction ([`ReadPool::snapshot`]), routed as
//! [`QueryClass::Ledger`]: a replica within a minute, else the primary. Every writer moves a
//! level and writes its movement or allocation in one transaction, so any snapshot on any
//! node sees both or neither: a disagreement is never a race with a sale in flight.
//!
//! **Bounded memory.** The statement groups by (product, location) on the server and
//! streams the groups in that order; each is compared here ([`compare`], pure) and handed
//! to an [`Observer`] as it comes, so the client holds one row at a time however many
//! there are. Every group is streamed, not only the disagreeing ones, so the count checked
//! and a progress line come from the same pass.

use crate::routing::Db;
use crate::routing::policy::QueryClass;
use crate::routing::{DbError, ReadCtx, ReadPool, Route};
use futures::TryStreamExt;
use serde::Serialize;
use std::time::Instant;

/// One (product, location) whose count held is not what the ledger gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Disagreement {
    pub product_id: String,
    pub location_id: String,
    /// `stock_levels.available_quantity`; null when there is no level row for movements or
    /// allocations that name this (product, location).
    pub held: Option<i64>,
    /// Its movements' sum minus the units its confirmed orders and live holds took.
    pub ledger: i64,
}

impl std::fmt::Display for Disagreement {
    /// `DISAGREE product=p1 location=default held=7 ledger=9` (`held=missing` without a level
    /// row): one line, `key=value`, for grep and awk.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DISAGREE product={} location={} held=",
            self.product_id, self.location_id
        )?;
        match self.held {
            Some(n) => write!(f, "{n}")?,
            None => f.write_str("missing")?,
        }
        write!(f, " ledger={}", self.ledger)
    }
}

/// One group of the check's statement: a (product, location) with its count held (`None`:
/// no level row) and the count its ledger gives.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Group {
    pub product_id: String,
    pub location_id: String,
    pub held: Option<i64>,
    pub ledger: i64,
}

/// The group as a disagreement, or `None` when the count held is the ledger's.
pub fn compare(g: Group) -> Option<Disagreement> {
    (g.held != Some(g.ledger)).then_some(Disagreement {
        product_id: g.product_id,
        location_id: g.location_id,
        held: g.held,
        ledger: g.ledger,
    })
}

/// What a check found, and the snapshot it looked at.
#[derive(Debug)]
pub struct Verdict {
    /// (product, location) pairs checked.
    pub checked: u64,
    pub disagreeing: u64,
    /// Where the snapshot was read and as of when (restated when the check ended).
    pub route: Route,
}

/// Told about a check as it runs.
pub trait Observer {
    /// Whether to count the level rows first, for [`Observer::total`] (one more, cheaper,
    /// scan in the same snapshot); only a progress line needs it.
    fn wants_total(&self) -> bool {
        false
    }
    /// The level rows in the snapshot: about the pairs to check (a pair without a level row
    /// adds one).
    fn total(&mut self, _levels: u64) {}
    /// `checked` pairs so far; called every [`PROGRESS_EVERY`] pairs.
    fn progress(&mut self, _checked: u64) {}
    /// A disagreement, in (product, location) order.
    fn disagreement(&mut self, d: Disagreement);
}

/// How many pairs between two [`Observer::progress`] calls.
pub const PROGRESS_EVERY: u64 = 10_000;

/// Every (product, location) with its count held and its ledger's, in order. The four
/// branches are each an indexed or sequential read; the server groups them (spilling to disk
/// past `work_mem`, never the client).
const CHECK_SQL: &str = "\
SELECT product_id, location_id, sum(held)::int8 AS held, sum(ledger)::int8 AS ledger
  FROM (SELECT product_id, location_id, available_quantity::int8 AS held, 0::int8 AS ledger
          FROM stock_levels
        UNION ALL
        SELECT product_id, location_id, NULL, delta::int8 FROM movements
        UNION ALL
        SELECT a.product_id, a.location_id, NULL, -a.quantity::int8
          FROM orders o,
               jsonb_to_recordset(o.allocations) AS a(product_id text, location_id text, quantity integer)
         WHERE o.status = 'confirmed'
        UNION ALL
        SELECT a.product_id, a.location_id, NULL, -a.quantity::int8
          FROM holds h,
               jsonb_to_recordset(h.allocations) AS a(product_id text, location_id text, quantity integer)
         WHERE h.status = 'held') AS x
 GROUP BY product_id, location_id
 ORDER BY product_id, location_id";

/// Checks every (product, location) against its ledger in one snapshot, routed as
/// [`QueryClass::Ledger`]; tells `observer` what it finds as it streams. A failure midway is
/// an error: nothing is concluded from part of the rows.
pub async fn check(db: &Db, observer: &mut impl Observer) -> Result<Verdict, DbError> {
    let (pool, route) = db.stream(QueryClass::Ledger, &ReadCtx::none()).await?;
    let timeout = db.class_timeout(QueryClass::Ledger);
    let (checked, disagreeing) = run(&pool, timeout, observer).await?;
    Ok(Verdict {
        checked,
        disagreeing,
        route: route.restated(Instant::now()),
    })
}

/// The check on `pool`: (pairs checked, pairs disagreeing).
async fn run(
    pool: &ReadPool,
    timeout: std::time::Duration,
    observer: &mut impl Observer,
) -> Result<(u64, u64), DbError> {
    let mut tx = pool.snapshot().await?;
    // The primary's sessions stop a statement at 30 s; this one reads every stock table, and
    // may take the class's (an export's) time.
    sqlx::query("SELECT set_config('statement_timeout', $1, true)")
        .bind(format!("{}ms", timeout.as_millis()))
        .execute(&mut *tx)
        .await?;
    if observer.wants_total() {
        let levels: i64 = sqlx::query_scalar("SELECT count(*) FROM stock_levels")
            .fetch_one(&mut *tx)
            .await?;
        observer.total(levels.max(0) as u64);
    }
    let (mut checked, mut disagreeing) = (0u64, 0u64);
    {
        let mut groups = sqlx::query_as::<_, Group>(CHECK_SQL).fetch(&mut *tx);
        while let Some(g) = groups.try_next().await? {
            checked += 1;
            if let Some(d) = compare(g) {
                disagreeing += 1;
                observer.disagreement(d);
            }
            if checked % PROGRESS_EVERY == 0 {
                observer.progress(checked);
            }
        }
    }
    observer.progress(checked);
    tx.commit().await?;
    Ok((checked, disagreeing))
}

/// An [`Observer`] that keeps the first `keep` disagreements (the admin route's answer).
#[derive(Debug, Default)]
pub struct FirstDisagreements {
    pub keep: usize,
    pub found: Vec<Disagreement>,
}

impl Observer for FirstDisagreements {
    fn disagreement(&mut self, d: Disagreement) {
        if self.found.len() < self.keep {
            self.found.push(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(held: Option<i64>, ledger: i64) -> Group {
        Group {
            product_id: "p1".into(),
            location_id: "default".into(),
            held,
            ledger,
        }
    }

    #[test]
    fn a_pair_agrees_only_when_its_count_is_the_ledgers() {
        assert_eq!(compare(group(Some(7), 7)), None);
        assert_eq!(compare(group(Some(0), 0)), None);
        let d = compare(group(Some(7), 9)).expect("7 held, 9 by the ledger");
        assert_eq!((d.held, d.ledger), (Some(7), 9));
        // Movements or allocations with no level row: missing, whatever the ledger says.
        assert!(compare(group(None, 0)).is_some());
        assert!(compare(group(None, 3)).is_some());
    }

    #[test]
    fn a_disagreement_is_one_greppable_line() {
        let line = |held, ledger| compare(group(held, ledger)).unwrap().to_string();
        assert_eq!(
            line(Some(7), 9),
            "DISAGREE product=p1 location=default held=7 ledger=9"
        );
        assert_eq!(
            line(None, -2),
            "DISAGREE product=p1 location=default held=missing ledger=-2"
        );
    }

    #[test]
    fn the_route_keeps_only_the_first_disagreements() {
        let mut first = FirstDisagreements {
            keep: 2,
            ..Default::default()
        };
        for ledger in 1..=5 {
            first.disagreement(compare(group(Some(0), ledger)).unwrap());
        }
        let ledgers: Vec<i64> = first.found.iter().map(|d| d.ledger).collect();
        assert_eq!(ledgers, [1, 2]);
    }
}
