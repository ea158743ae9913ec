//! The routing policy: every query class the service runs, where it may go and how stale
//! it may be. This table is the one place to review; `GET /v1/admin/routing` serves it and
//! the README's table is checked against it by a test.

use serde::Serialize;
use std::fmt;
use std::time::Duration;

/// Every kind of query the service runs. A handler names one; nothing else decides where a
/// query goes. Adding a variant without a row in [`POLICY`] fails to compile (`policy()` is
/// an exhaustive match), and the routing audit test fails until the class is covered there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueryClass {
    /// Availability and the pre-check of an order.
    StockGate,
    /// The product page.
    ProductPage,
    /// A user's own settings and profile: read-your-writes.
    OwnData,
    /// An order by id (its owner just placed it).
    OrderLookup,
    /// The live revenue dashboard.
    Dashboard,
    /// The emailed revenue report.
    RevenueReport,
    /// Bulk export of orders: any replica that is answering.
    Export,
    /// The event feed (`GET /v1/events`).
    Events,
    /// The stock ledger's check (`stockgate verify`, `GET /v1/admin/ledger`): one snapshot
    /// of every level, movement and allocation. A check is as true as its snapshot and says
    /// which node and as of when, so a replica a minute behind serves it and spares the
    /// primary a scan of every table stock lives in.
    Ledger,
    /// Anything that must be current: writes and the reads inside write transactions.
    Primary,
}

/// Where a class's reads may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    Primary,
    Replica,
}

/// What to do when no replica is fresh enough for a replica-targeted class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenNoFreshReplica {
    /// Read from the primary (the default).
    UsePrimary,
    /// Refuse with 503 rather than load the primary.
    Refuse,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Policy {
    pub class: QueryClass,
    pub target: Target,
    /// The most staleness a replica answer may carry; `None` means any replica that is not
    /// `down` will do.
    #[serde(rename = "staleness_budget_ms", serialize_with = "ser_budget")]
    pub budget: Option<Duration>,
    /// A replica is also required to have replayed the user's last write.
    pub read_your_writes: bool,
    pub when_no_fresh_replica: WhenNoFreshReplica,
}

impl Policy {
    /// The most staleness a replica answer of this class may carry (zero for the primary,
    /// unbounded — `Duration::MAX` — for a class without a budget).
    pub fn budget(&self) -> Duration {
        self.budget.unwrap_or(Duration::MAX)
    }

    /// How long a mark this class's reads must respect (a product reopened by a restock,
    /// an invalidated cached answer) is kept: four budgets, well past the moment after
    /// which no answer the class may serve can predate it.
    pub fn marks_kept_for(&self) -> Duration {
        self.budget().saturating_mul(4)
    }
}

fn ser_budget<S: serde::Serializer>(b: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match b {
        Some(d) => s.serialize_u64(d.as_millis() as u64),
        None => s.serialize_none(),
    }
}

const fn replica(class: QueryClass, budget_ms: u64) -> Policy {
    Policy {
        class,
        target: Target::Replica,
        budget: Some(Duration::from_millis(budget_ms)),
        read_your_writes: false,
        when_no_fresh_replica: WhenNoFreshReplica::UsePrimary,
    }
}

const fn primary(class: QueryClass) -> Policy {
    Policy {
        class,
        target: Target::Primary,
        budget: Some(Duration::ZERO),
        read_your_writes: false,
        when_no_fresh_replica: WhenNoFreshReplica::UsePrimary,
    }
}

/// The policy table, one row per class.
pub const POLICY: &[Policy] = &[
    replica(QueryClass::StockGate, 250),
    replica(QueryClass::ProductPage, 5_000),
    Policy {
        read_your_writes: true,
        ..replica(QueryClass::OwnData, 5_000)
    },
    primary(QueryClass::OrderLookup),
    replica(QueryClass::Dashboard, 30_000),
    replica(QueryClass::RevenueReport, 300_000),
    Policy {
        budget: None,
        ..replica(QueryClass::Export, 0)
    },
    replica(QueryClass::Events, 5_000),
    replica(QueryClass::Ledger, 60_000),
    primary(QueryClass::Primary),
];

impl QueryClass {
    pub const ALL: &'static [QueryClass] = &[
        QueryClass::StockGate,
        QueryClass::ProductPage,
        QueryClass::OwnData,
        QueryClass::OrderLookup,
        QueryClass::Dashboard,
        QueryClass::RevenueReport,
        QueryClass::Export,
        QueryClass::Events,
        QueryClass::Ledger,
        QueryClass::Primary,
    ];

    /// This class's row of [`POLICY`].
    pub fn policy(self) -> &'static Policy {
        // Exhaustive on purpose: a new class must be placed in the table.
        let index = match self {
            QueryClass::StockGate => 0,
            QueryClass::ProductPage => 1,
            QueryClass::OwnData => 2,
            QueryClass::OrderLookup => 3,
            QueryClass::Dashboard => 4,
            QueryClass::RevenueReport => 5,
            QueryClass::Export => 6,
            QueryClass::Events => 7,
            QueryClass::Ledger => 8,
            QueryClass::Primary => 9,
        };
        &POLICY[index]
    }

    pub fn name(self) -> &'static str {
        match self {
            QueryClass::StockGate => "stock_gate",
            QueryClass::ProductPage => "product_page",
            QueryClass::OwnData => "own_data",
            QueryClass::OrderLookup => "order_lookup",
            QueryClass::Dashboard => "dashboard",
            QueryClass::RevenueReport => "revenue_report",
            QueryClass::Export => "export",
            QueryClass::Events => "events",
            QueryClass::Ledger => "ledger",
            QueryClass::Primary => "primary",
        }
    }
}

impl fmt::Display for QueryClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_has_exactly_its_own_row() {
        assert_eq!(QueryClass::ALL.len(), POLICY.len());
        for class in QueryClass::ALL {
            assert_eq!(
                class.policy().class,
                *class,
                "row for {class} is out of place"
            );
        }
    }

    #[test]
    fn budgets_are_the_contracts() {
        let ms = |c: QueryClass| c.policy().budget.map(|d| d.as_millis());
        assert_eq!(ms(QueryClass::StockGate), Some(250));
        assert_eq!(ms(QueryClass::ProductPage), Some(5_000));
        assert_eq!(ms(QueryClass::Dashboard), Some(30_000));
        assert_eq!(ms(QueryClass::RevenueReport), Some(300_000));
        assert_eq!(ms(QueryClass::Ledger), Some(60_000));
        assert_eq!(QueryClass::Primary.policy().target, Target::Primary);
        assert!(QueryClass::OwnData.policy().read_your_writes);
    }
}
