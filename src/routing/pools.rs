//! The pools: the primary (the only place a transaction opens), the replicas' read pools,
//! their connect options, in-flight counts and per-class timeouts.

use super::error::{DbError, Unavailable, saturated_or};
use super::policy::QueryClass;
use super::{Settings, monitor, patroni};
use crate::lsn::Lsn;
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Semaphore;

pub(super) const NO_LEADER: usize = usize::MAX;

#[derive(Clone, Debug)]
pub struct Primary {
    /// One pool per member that can lead (one in the static mode); `leader` says which.
    pub(super) pools: Arc<Vec<PgPool>>,
    pub(super) leader: Arc<AtomicUsize>,
    /// Whether positions carry the timeline (Patroni mode).
    pub(super) timelines: bool,
    /// Set by the monitor while the primary refuses connections or has not answered for
    /// longer than a request would wait: requests then fail fast instead of queueing.
    pub(super) down: Arc<AtomicBool>,
}

impl Primary {
    fn check(&self) -> Result<(), DbError> {
        if self.leader.load(Ordering::Relaxed) == NO_LEADER {
            return Err(DbError::Unavailable(Unavailable::NoLeader));
        }
        if self.down.load(Ordering::Relaxed) {
            return Err(DbError::Unavailable(Unavailable::PrimaryDown));
        }
        Ok(())
    }

    /// The current leader's pool (member 0's while none leads: its connections are
    /// checked for recovery, so nothing is written through it).
    pub(super) fn current(&self) -> &PgPool {
        let i = self.leader.load(Ordering::Relaxed);
        self.pools.get(i).unwrap_or(&self.pools[0])
    }

    /// The member that leads, if any.
    pub(super) fn leader_index(&self) -> Option<usize> {
        Some(self.leader.load(Ordering::Relaxed)).filter(|&i| i != NO_LEADER)
    }

    /// Points the primary at member `i` (or [`NO_LEADER`]); returns whether it changed.
    pub(super) fn follow(&self, i: usize) -> bool {
        let old = self.leader.swap(i, Ordering::Relaxed);
        if old != i {
            self.down.store(false, Ordering::Relaxed);
        }
        old != i
    }

    pub(super) fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }

    /// Opens a write transaction on the primary.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, DbError> {
        self.check()?;
        let pool = self.current();
        pool.begin().await.map_err(|e| saturated_or(pool, e))
    }

    /// A connection to the primary, for a write that is one statement (its own transaction).
    pub async fn acquire(&self) -> Result<PoolConnection<sqlx::Postgres>, DbError> {
        self.check()?;
        let pool = self.current();
        pool.acquire().await.map_err(|e| saturated_or(pool, e))
    }

    /// The primary pool, for single statements outside a transaction (also primary-only).
    pub fn pool(&self) -> Result<&PgPool, DbError> {
        self.check()?;
        Ok(self.current())
    }

    /// The primary's WAL position now (after a commit: a position that includes it), on
    /// its timeline in the Patroni mode ([`patroni::position`]).
    pub async fn current_lsn(&self) -> Result<Lsn, DbError> {
        self.check()?;
        let sql = if self.timelines {
            monitor::PRIMARY_SQL_TIMELINE
        } else {
            monitor::PRIMARY_SQL
        };
        let (lsn, timeline): (Option<i64>, Option<i32>) =
            sqlx::query_as(sql).fetch_one(self.current()).await?;
        Ok(patroni::position(
            timeline.unwrap_or(0) as u32,
            lsn.unwrap_or(0) as Lsn,
        ))
    }
}

/// What a routed read may use: an executor, and no way to begin a transaction.
#[derive(Clone, Debug)]
pub struct ReadPool(pub(super) PgPool);

impl ReadPool {
    pub fn exec(&self) -> impl sqlx::PgExecutor<'_> + '_ {
        &self.0
    }

    /// A `REPEATABLE READ, READ ONLY` transaction: several statements (or one long one) that
    /// see one snapshot. It cannot write on any node, the primary included, so a write
    /// transaction still opens only through [`Primary::begin`]; and it runs on a hot standby.
    pub async fn snapshot(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, DbError> {
        Ok(self
            .0
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await?)
    }
}

#[derive(Debug)]
pub(super) struct Replica {
    pub(super) name: String,
    pub(super) pool: PgPool,
    pub(super) in_flight: AtomicUsize,
    /// One permit per pool connection: waiting for one is local congestion, timed apart
    /// from the query so it is never mistaken for a slow replica.
    pub(super) slots: Semaphore,
}

/// Counts a read on a replica for as long as it lives: a request dropped mid-read (client
/// gone, timeout) gives its count back, so the least-busy preference cannot be skewed by
/// leaked counts.
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    pub(super) fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a replica read of each kind may take (`STOCKGATE_*_TIMEOUT_MS`).
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Point reads (gate, product page, own data) and the monitor's samples.
    pub point: Duration,
    pub dashboard: Duration,
    pub report: Duration,
    pub export: Duration,
}

impl Timeouts {
    /// The class's timeout, and whether missing it is held against the replica: only a
    /// point read is small enough that slowness says something about the server.
    pub fn for_class(&self, class: QueryClass) -> (Duration, bool) {
        match class {
            // A page of up to a thousand events: a dashboard's timeout, never held against it.
            QueryClass::Dashboard | QueryClass::Events => (self.dashboard, false),
            QueryClass::RevenueReport => (self.report, false),
            // Every level, movement and allocation in one streamed statement: an export's.
            QueryClass::Export | QueryClass::Ledger => (self.export, false),
            QueryClass::StockGate
            | QueryClass::ProductPage
            | QueryClass::OwnData
            | QueryClass::OrderLookup
            | QueryClass::Primary => (self.point, true),
        }
    }

    pub(super) fn longest(&self) -> Duration {
        self.point
            .max(self.dashboard)
            .max(self.report)
            .max(self.export)
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            point: Duration::from_millis(500),
            dashboard: Duration::from_secs(5),
            report: Duration::from_secs(60),
            export: Duration::from_secs(600),
        }
    }
}

pub fn primary_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(PgConnectOptions::from_str(url)?
        .application_name("stockgate")
        // A client that stops listening mid-transaction (a partition, a crash) must not hold
        // a hot row's lock for ever: the server ends such a session after 10 s idle.
        .options([
            ("statement_timeout", "30s"),
            ("lock_timeout", "10s"),
            ("idle_in_transaction_session_timeout", "10s"),
            // This binary writes stock levels itself: the triggers that keep them for
            // writers that know no location (migration 20261205000002) stay out of its way.
            ("stockgate.levels", "on"),
        ]))
}

/// Replica connect options: every session read-only, so even a bug cannot write there.
pub fn replica_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    replica_options_with(url, Duration::from_secs(30))
}

/// Replica options whose server-side statement timeout is `statement_timeout` (the longest
/// class timeout, so the server never cuts a report its class still allows).
pub fn replica_options_with(
    url: &str,
    statement_timeout: Duration,
) -> Result<PgConnectOptions, sqlx::Error> {
    let ms = format!("{}ms", statement_timeout.as_millis());
    Ok(PgConnectOptions::from_str(url)?
        .application_name("stockgate")
        .options([
            ("default_transaction_read_only", "on"),
            ("statement_timeout", ms.as_str()),
        ]))
}

/// The nodes the settings name: who can lead, who serves reads, and who leads now. Under
/// Patroni every member is both (the leader's replica pool is judged fresh only while it
/// is a replica); otherwise the primary leads and the replicas read.
pub(super) struct Nodes {
    pub(super) leader_urls: Vec<String>,
    pub(super) replica_urls: Vec<String>,
    pub(super) names: Vec<String>,
    pub(super) leader: usize,
}

impl Nodes {
    pub(super) fn of(s: &Settings) -> Nodes {
        match &s.patroni {
            Some(p) => {
                let urls: Vec<String> = p.members.iter().map(|(_, u)| u.clone()).collect();
                Nodes {
                    leader_urls: urls.clone(),
                    replica_urls: urls,
                    names: p.members.iter().map(|(n, _)| n.clone()).collect(),
                    leader: p.leader.unwrap_or(NO_LEADER),
                }
            }
            None => Nodes {
                leader_urls: vec![s.primary_url.clone()],
                replica_urls: s.replica_urls.clone(),
                names: (1..=s.replica_urls.len())
                    .map(|i| format!("replica-{i}"))
                    .collect(),
                leader: 0,
            },
        }
    }
}

/// A pool to one member that may lead; under Patroni its connections refuse a node in
/// recovery.
pub(super) fn primary_pool(
    s: &Settings,
    follower: Option<&patroni::Follower>,
    options: &PgConnectOptions,
) -> PgPool {
    let opts = PgPoolOptions::new()
        .max_connections(s.primary_pool_size)
        .min_connections(0)
        .acquire_timeout(s.primary_timeout);
    let opts = match follower {
        Some(f) => f.refuse_recovery(opts),
        None => opts,
    };
    opts.connect_lazy_with(options.clone())
}

impl Replica {
    pub(super) fn new(s: &Settings, url: &str, name: String) -> Result<Replica, sqlx::Error> {
        Ok(Replica {
            name,
            pool: PgPoolOptions::new()
                .max_connections(s.replica_pool_size)
                .min_connections(0)
                // Shorter than a point read's timeout, so a pool that is merely full
                // (exports hold connections outside the slots) is seen as such before the
                // read's own timeout would blame the replica.
                .acquire_timeout(s.timeouts.point / 2)
                .connect_lazy_with(replica_options_with(
                    url,
                    s.timeouts.longest() + Duration::from_secs(1),
                )?),
            in_flight: AtomicUsize::new(0),
            slots: Semaphore::new(s.replica_pool_size as usize),
        })
    }
}
