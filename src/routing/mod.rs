//! The one place that decides where a read goes. It owns the pools, the freshness monitor
//! and the policy table; a handler names a [`QueryClass`] and gets back its answer plus a
//! [`Route`] saying where it went, why, and as of when. Nothing else knows how many
//! replicas exist.
//!
//! Write transactions can only be opened through [`Primary::begin`]; a replica-routed read
//! receives a [`ReadPool`], which exposes an executor and nothing that can begin a
//! transaction. A routing decision reads the monitor's state from memory: no extra round
//! trip on the request path.
//!
//! A replica answer states the replica's `as_of` as the monitor knew it when the query was
//! *sent*, and its staleness when the answer came back; an answer that came back older than
//! its class's budget is not served (the read is routed again). Each class has its own
//! timeout; only connect errors, point-read timeouts and failed monitor samples count
//! against a replica — a slow report or a full local pool never evicts one.

pub use crate::lsn::{format_lsn, parse_lsn};

pub mod freshness;
pub mod monitor;
pub mod patroni;
pub mod policy;
pub mod route;

use crate::clock::TimeBase;
use crate::domain::UserId;
use crate::metrics::Metrics;
use crate::ryw::{PRIMARY_ONLY, RywStore};
use freshness::{Freshness, Lsn, ReplicaState, ReplicaView};
use policy::{QueryClass, Target, WhenNoFreshReplica};
pub use route::{Reason, Route};
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// A database failure, said as what happened. Classified once, here, from the driver's
/// error; answered once, in `http::error`.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// No place can answer: the primary is unreachable or refusing connections, the cluster
    /// has no leader, or a write met a node in recovery. Nothing was done.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database answered, but not in time: every connection of our pool was in use, a
    /// lock or statement timeout fired, or it has too many connections. Nothing was done.
    /// (A pool that timed out without every connection open could not reach the server:
    /// that is `Unavailable`.)
    #[error("database busy: {0}")]
    Busy(String),
    /// A concurrent transaction won (deadlock or serialization failure): nothing was done,
    /// and running the same transaction again is safe.
    #[error("a concurrent change won: {0}")]
    Conflict(String),
    /// The class refuses to read the primary and no replica is fresh enough.
    #[error("no replica is fresh enough for {0}")]
    NoFreshReplica(QueryClass),
    /// Something that should not happen did: an invariant broke or a worker vanished.
    #[error("internal: {0}")]
    Internal(String),
    /// The database refused the statement for a reason of its own (a row-level rule, or a
    /// bug in the query): the caller may know what it means.
    #[error(transparent)]
    Query(sqlx::Error),
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        if is_conflict(&e) {
            DbError::Conflict(e.to_string())
        } else if is_busy(&e) {
            DbError::Busy(e.to_string())
        } else if is_connection_error(&e) || is_read_only_node(&e) {
            // 25006 read_only_sql_transaction: a write met a node in recovery (a leader
            // demoted under an open connection). Nothing was written; the next leader will.
            DbError::Unavailable(e.to_string())
        } else {
            DbError::Query(e)
        }
    }
}

impl DbError {
    /// The same failure, for every request of a batch that shared it (`sqlx::Error` is not
    /// `Clone`): a driver error keeps its kind, its text becomes internal.
    pub fn shared(&self) -> DbError {
        match self {
            DbError::Unavailable(s) => DbError::Unavailable(s.clone()),
            DbError::Busy(s) => DbError::Busy(s.clone()),
            DbError::Conflict(s) => DbError::Conflict(s.clone()),
            DbError::NoFreshReplica(c) => DbError::NoFreshReplica(*c),
            DbError::Internal(s) => DbError::Internal(s.clone()),
            DbError::Query(e) => DbError::Internal(e.to_string()),
        }
    }
}

/// Errors that say "too busy now", as opposed to "not there" or "this query is wrong".
fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        // 55P03 lock_not_available, 57014 query_canceled (our lock and statement timeouts),
        // 53300 too_many_connections.
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("55P03" | "57014" | "53300"))
        }
        _ => false,
    }
}

/// 40001 serialization_failure, 40P01 deadlock_detected: safe to run again.
fn is_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")))
}

/// Errors that say "this server is not answering", as opposed to "this query is wrong".
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            // 57P01 admin shutdown, 57P03 cannot connect now, 53300 too many connections,
            // 08xxx connection exceptions.
            db.code().is_some_and(|c| {
                c.starts_with("08") || c == "57P01" || c == "57P02" || c == "57P03" || c == "53300"
            })
        }
        _ => false,
    }
}

/// No member leads (Patroni mode, between a leader's loss and its successor).
/// [`Db::worst_serving_staleness`] over `statuses`, the member at `leader` left out.
fn worst_and_down(
    statuses: Vec<ReplicaStatus>,
    leader: Option<usize>,
) -> (Option<(String, Duration)>, Vec<String>) {
    let mut worst: Option<(String, Duration)> = None;
    let mut down = Vec::new();
    for (i, s) in statuses.into_iter().enumerate() {
        if Some(i) == leader {
            continue;
        }
        if s.state == ReplicaState::Down {
            down.push(s.name);
            continue;
        }
        let st = s.staleness.unwrap_or(Duration::MAX);
        if worst.as_ref().is_none_or(|(_, w)| st > *w) {
            worst = Some((s.name, st));
        }
    }
    (worst, down)
}

const NO_LEADER: usize = usize::MAX;

/// A write refused because the node is in recovery (SQLSTATE 25006).
pub fn is_read_only_node(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25006"))
}

/// The primary: the only place a transaction can be opened.
#[derive(Clone, Debug)]
pub struct Primary {
    /// One pool per member that can lead (one in the static mode); `leader` says which.
    pools: Arc<Vec<PgPool>>,
    leader: Arc<AtomicUsize>,
    /// Whether positions carry the timeline (Patroni mode).
    timelines: bool,
    /// Set by the monitor while the primary refuses connections or has not answered for
    /// longer than a request would wait: requests then fail fast instead of queueing.
    down: Arc<AtomicBool>,
}

/// A pool's error as a [`DbError`]: a pool timeout with every connection open and in use is
/// saturation (`Busy`), not an unreachable primary.
fn saturated_or(pool: &PgPool, e: sqlx::Error) -> DbError {
    match e {
        sqlx::Error::PoolTimedOut if pool.size() >= pool.options().get_max_connections() => {
            DbError::Busy("every connection to the primary is in use".into())
        }
        e => e.into(),
    }
}

impl Primary {
    fn check(&self) -> Result<(), DbError> {
        if self.leader.load(Ordering::Relaxed) == NO_LEADER {
            return Err(DbError::Unavailable("the cluster has no leader".into()));
        }
        if self.down.load(Ordering::Relaxed) {
            return Err(DbError::Unavailable("the primary is not answering".into()));
        }
        Ok(())
    }

    /// The current leader's pool (member 0's while none leads: its connections are
    /// checked for recovery, so nothing is written through it).
    fn current(&self) -> &PgPool {
        let i = self.leader.load(Ordering::Relaxed);
        self.pools.get(i).unwrap_or(&self.pools[0])
    }

    /// The member that leads, if any.
    fn leader_index(&self) -> Option<usize> {
        Some(self.leader.load(Ordering::Relaxed)).filter(|&i| i != NO_LEADER)
    }

    /// Points the primary at member `i` (or [`NO_LEADER`]); returns whether it changed.
    fn follow(&self, i: usize) -> bool {
        let old = self.leader.swap(i, Ordering::Relaxed);
        if old != i {
            self.down.store(false, Ordering::Relaxed);
        }
        old != i
    }

    fn set_down(&self, down: bool) {
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
pub struct ReadPool(PgPool);

impl ReadPool {
    pub fn exec(&self) -> impl sqlx::PgExecutor<'_> + '_ {
        &self.0
    }
}

#[derive(Debug)]
struct Replica {
    name: String,
    pool: PgPool,
    in_flight: AtomicUsize,
    /// One permit per pool connection: waiting for one is local congestion, timed apart
    /// from the query so it is never mistaken for a slow replica.
    slots: Semaphore,
}

/// Counts a read on a replica for as long as it lives: a request dropped mid-read (client
/// gone, timeout) gives its count back, so the least-busy preference cannot be skewed by
/// leaked counts.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
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
            QueryClass::Dashboard => (self.dashboard, false),
            QueryClass::RevenueReport => (self.report, false),
            QueryClass::Export => (self.export, false),
            QueryClass::StockGate
            | QueryClass::ProductPage
            | QueryClass::OwnData
            | QueryClass::OrderLookup
            | QueryClass::Primary => (self.point, true),
        }
    }

    fn longest(&self) -> Duration {
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

/// Per-request context a routing decision may need.
#[derive(Debug, Clone, Default)]
pub struct ReadCtx {
    /// The user whose own data is read (read-your-writes classes).
    pub user: Option<UserId>,
    /// A position the client carries (`X-Consistency-Token`), honoured like the store's.
    pub min_lsn: Option<Lsn>,
}

impl ReadCtx {
    pub fn none() -> Self {
        ReadCtx::default()
    }
    pub fn user(user: UserId, min_lsn: Option<Lsn>) -> Self {
        ReadCtx {
            user: Some(user),
            min_lsn,
        }
    }
}

/// A read's answer and where it came from.
#[derive(Debug)]
pub struct Routed<T> {
    pub value: T,
    pub route: Route,
}

pub struct Settings {
    pub primary_url: String,
    pub replica_urls: Vec<String>,
    pub primary_pool_size: u32,
    pub replica_pool_size: u32,
    /// Per-class replica timeouts; `point` also bounds the monitor's samples.
    pub timeouts: Timeouts,
    /// How long a request waits for a primary connection before answering 503.
    pub primary_timeout: Duration,
    pub thresholds: freshness::Thresholds,
    /// The monitor's sample period (a margin when waiting out a budget).
    pub monitor_interval: Duration,
    /// The Patroni cluster to follow (its members replace `primary_url`/`replica_urls`).
    pub patroni: Option<PatroniSetup>,
}

/// What the service learnt from Patroni at start: the client, every member's name and URL,
/// and which of them leads.
pub struct PatroniSetup {
    pub client: patroni::Patroni,
    pub members: Vec<(String, String)>,
    pub leader: Option<usize>,
}

/// The router: pools, freshness and policy.
#[derive(Clone)]
pub struct Db {
    inner: Arc<Inner>,
}

struct Inner {
    primary: Primary,
    /// Connect options for the monitor's own connections: primary first, then replicas.
    monitor_targets: Vec<(String, PgConnectOptions)>,
    /// The primary's connect options for each member that can lead (one when static).
    leader_targets: Vec<PgConnectOptions>,
    /// The followed Patroni cluster, if any.
    cluster: Option<patroni::Follower>,
    replicas: Vec<Replica>,
    freshness: Arc<RwLock<Freshness>>,
    time: TimeBase,
    metrics: Metrics,
    ryw: RywStore,
    replica_timeout: Duration,
    timeouts: Timeouts,
    primary_timeout: Duration,
    monitor_interval: Duration,
    round_robin: AtomicUsize,
}

/// The primary's connect options for this service.
pub fn primary_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(PgConnectOptions::from_str(url)?
        .application_name("stockgate")
        // A client that stops listening mid-transaction (a partition, a crash) must not hold
        // a hot row's lock for ever: the server ends such a session after 10 s idle.
        .options([
            ("statement_timeout", "30s"),
            ("lock_timeout", "10s"),
            ("idle_in_transaction_session_timeout", "10s"),
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
struct Nodes {
    leader_urls: Vec<String>,
    replica_urls: Vec<String>,
    names: Vec<String>,
    leader: usize,
}

impl Nodes {
    fn of(s: &Settings) -> Nodes {
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
fn primary_pool(
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
    fn new(s: &Settings, url: &str, name: String) -> Result<Replica, sqlx::Error> {
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

impl Db {
    /// Builds the pools (lazily: a database that is down at start is reported, not fatal).
    pub fn new(s: Settings, metrics: Metrics, ryw: RywStore) -> Result<Db, sqlx::Error> {
        let nodes = Nodes::of(&s);
        let follower = s
            .patroni
            .as_ref()
            .map(|p| patroni::Follower::new(p, &metrics));
        let leader_targets = nodes
            .leader_urls
            .iter()
            .map(|u| primary_options(u))
            .collect::<Result<Vec<_>, _>>()?;
        let pools = leader_targets
            .iter()
            .map(|o| primary_pool(&s, follower.as_ref(), o))
            .collect();
        let replicas = nodes
            .replica_urls
            .iter()
            .zip(nodes.names)
            .map(|(url, name)| Replica::new(&s, url, name))
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let mut monitor_targets = vec![("primary".to_string(), leader_targets[0].clone())];
        for (r, url) in replicas.iter().zip(&nodes.replica_urls) {
            monitor_targets.push((r.name.clone(), replica_options(url)?));
        }
        let freshness = Arc::new(RwLock::new(Freshness::new(replicas.len(), s.thresholds)));
        let db = Db {
            inner: Arc::new(Inner {
                primary: Primary {
                    pools: Arc::new(pools),
                    leader: Arc::new(AtomicUsize::new(nodes.leader)),
                    timelines: follower.is_some(),
                    down: Arc::default(),
                },
                monitor_targets,
                leader_targets,
                cluster: follower,
                replicas,
                freshness,
                time: TimeBase::now(),
                metrics,
                ryw,
                replica_timeout: s.timeouts.point,
                timeouts: s.timeouts,
                primary_timeout: s.primary_timeout,
                monitor_interval: s.monitor_interval,
                round_robin: AtomicUsize::new(0),
            }),
        };
        db.export_zeroes();
        Ok(db)
    }

    /// Exports every routing series from the start: the thresholds in force, the decisions
    /// and fallbacks each class can be counted under at 0, each node's samples and errors at
    /// 0, and each replica's staleness and state as the monitor knows them (unknown staleness
    /// is +Inf). An alert on an absent series never fires, and one that first appears at 1
    /// hides that first increase from `rate()`.
    fn export_zeroes(&self) {
        let m = &self.inner.metrics;
        m.eviction_threshold
            .set(self.thresholds().evict_after.as_secs_f64());
        for p in policy::POLICY {
            let class = p.class.name();
            if let (Target::Replica, Some(budget)) = (p.target, p.budget) {
                m.staleness_budget
                    .with_label_values(&[class])
                    .set(budget.as_secs_f64());
            }
            for (target, reason) in possible_decisions(p) {
                m.routing_decisions
                    .with_label_values(&[class, target, reason.as_str()]);
                if target == "primary" && p.target == Target::Replica {
                    m.routing_fallbacks
                        .with_label_values(&[class, reason.as_str()]);
                }
            }
        }
        for (node, _) in &self.inner.monitor_targets {
            m.monitor_samples.with_label_values(&[node]);
            m.monitor_errors.with_label_values(&[node]);
        }
        for i in 0..self.inner.replicas.len() {
            self.publish_replica_metrics(i);
        }
    }

    pub fn primary(&self) -> &Primary {
        &self.inner.primary
    }

    pub fn ryw(&self) -> &RywStore {
        &self.inner.ryw
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The followed Patroni cluster's state (None in the static mode).
    pub fn cluster_status(&self) -> Option<patroni::ClusterStatus> {
        self.inner
            .cluster
            .as_ref()
            .map(|c| c.status(self.inner.primary.leader_index()))
    }

    /// The replica state thresholds (eviction, readmission).
    pub fn thresholds(&self) -> freshness::Thresholds {
        self.freshness_read().thresholds()
    }

    /// A monotonic instant as UTC, on the router's one clock.
    pub fn wall(&self, at: Instant) -> chrono::DateTime<chrono::Utc> {
        self.inner.time.wall(at)
    }

    pub fn now_utc(&self) -> chrono::DateTime<chrono::Utc> {
        self.inner.time.wall(Instant::now())
    }

    /// Starts the background freshness monitor; it stops when the returned guard drops.
    pub fn start_monitor(&self, interval: Duration) -> monitor::MonitorGuard {
        monitor::start(self.clone(), interval)
    }

    fn freshness_read(&self) -> std::sync::RwLockReadGuard<'_, Freshness> {
        self.inner
            .freshness
            .read()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn freshness_write(&self) -> std::sync::RwLockWriteGuard<'_, Freshness> {
        self.inner
            .freshness
            .write()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Every replica's current state, for operators.
    pub fn replica_status(&self) -> Vec<ReplicaStatus> {
        let now = Instant::now();
        let f = self.freshness_read();
        let primary_lsn = f.primary_lsn();
        self.inner
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let v: ReplicaView = f.view(i, now);
                ReplicaStatus {
                    name: r.name.clone(),
                    state: v.state,
                    staleness: v.staleness,
                    lag_bytes: match (primary_lsn, v.replay_lsn) {
                        (Some(p), Some(r)) => Some(p.saturating_sub(r)),
                        _ => None,
                    },
                    replay_lsn: v.replay_lsn,
                    as_of: v.as_of.map(|t| self.inner.time.wall(t)),
                    last_error: v.last_error,
                    in_flight: r.in_flight.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    pub fn primary_lsn(&self) -> Option<Lsn> {
        self.freshness_read().primary_lsn()
    }

    /// The worst staleness among replicas that are not `down`, and the down ones' names.
    /// Under Patroni the leader's own member entry is not a replica (it reads `down`, being
    /// out of recovery), so it is neither: an import told to wait for down replicas must
    /// not wait for the leader.
    pub fn worst_serving_staleness(&self) -> (Option<(String, Duration)>, Vec<String>) {
        worst_and_down(self.replica_status(), self.leading_member())
    }

    /// Under Patroni, the member that leads now: every member is listed as a replica, the
    /// leader too, and its entry is no replica. `None` in the static mode.
    fn leading_member(&self) -> Option<usize> {
        self.inner
            .cluster
            .as_ref()
            .and(self.inner.primary.leader_index())
    }

    /// Decides where a read of `class` goes, without running it.
    pub async fn route(&self, class: QueryClass, ctx: &ReadCtx) -> Result<Route, DbError> {
        Ok(self.place(class, ctx).await?.1)
    }

    /// A read of `class` that streams (an export): where it goes, and a pool there. The
    /// stream runs outside the router's retries: a failure mid-stream ends it.
    pub async fn stream(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
    ) -> Result<(ReadPool, Route), DbError> {
        let (replica, route) = self.place(class, ctx).await?;
        Ok((self.pool_for(replica), route))
    }

    /// The replica (or `None`: the primary) a read of `class` goes to, and its route.
    async fn place(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
    ) -> Result<(Option<usize>, Route), DbError> {
        match self.min_lsn_for(class, ctx).await {
            Ok(min_lsn) => self.decide(class, min_lsn, &[]),
            Err(route) => Ok((None, route)),
        }
    }

    /// The position a read must be served at (read-your-writes and a carried token), or a
    /// primary route when the store cannot say (fail closed).
    async fn min_lsn_for(&self, class: QueryClass, ctx: &ReadCtx) -> Result<Option<Lsn>, Route> {
        let policy = class.policy();
        let mut min_lsn = ctx.min_lsn;
        if policy.target == Target::Replica
            && policy.read_your_writes
            && !self.inner.replicas.is_empty()
            && let Some(user) = &ctx.user
        {
            match self.inner.ryw.get(user).await {
                Ok(lsn) => min_lsn = min_lsn.max(lsn),
                Err(e) => {
                    self.ryw_failed("get", user, &e, "reading the primary");
                    return Err(
                        self.decided(self.primary_route(class, Reason::RywStoreUnavailable))
                    );
                }
            }
        }
        Ok(min_lsn)
    }

    /// A primary route whose `as_of` is now (before the query is sent).
    fn primary_route(&self, class: QueryClass, reason: Reason) -> Route {
        let now = Instant::now();
        Route::primary(class, reason, now, self.inner.time.wall(now))
    }

    /// Where a read of `class` at `min_lsn` goes, skipping the replicas in `excluded`.
    fn decide(
        &self,
        class: QueryClass,
        min_lsn: Option<Lsn>,
        excluded: &[usize],
    ) -> Result<(Option<usize>, Route), DbError> {
        let policy = class.policy();
        let now = Instant::now();
        let choice = {
            let f = self.freshness_read();
            let loads: Vec<usize> = self
                .inner
                .replicas
                .iter()
                .map(|r| r.in_flight.load(Ordering::Relaxed))
                .collect();
            let start = self.inner.round_robin.fetch_add(1, Ordering::Relaxed);
            choose_among(policy, &f, now, min_lsn, &loads, start, |i| {
                excluded.contains(&i)
            })
        };
        match choice {
            Choice::Replica(i, as_of) => {
                let route = Route {
                    class,
                    served_by: self.inner.replicas[i].name.clone(),
                    reason: Reason::FreshReplica,
                    as_of: self.inner.time.wall(as_of),
                    stale_by: now.saturating_duration_since(as_of),
                    as_of_instant: as_of,
                };
                Ok((Some(i), self.decided(route)))
            }
            Choice::Refuse => {
                self.inner
                    .metrics
                    .routing_decisions
                    .with_label_values(&[class.name(), "refused", Reason::NoFreshReplica.as_str()])
                    .inc();
                Err(DbError::NoFreshReplica(class))
            }
            Choice::Primary(reason) => Ok((None, self.decided(self.primary_route(class, reason)))),
        }
    }

    fn decided(&self, route: Route) -> Route {
        let target = if route.is_primary() {
            "primary"
        } else {
            "replica"
        };
        let m = &self.inner.metrics;
        m.routing_decisions
            .with_label_values(&[route.class.name(), target, route.reason.as_str()])
            .inc();
        if route.is_primary() && route.class.policy().target == Target::Replica {
            m.routing_fallbacks
                .with_label_values(&[route.class.name(), route.reason.as_str()])
                .inc();
        }
        tracing::debug!(route = %route, "routed");
        route
    }

    /// The route of what a primary transaction read while it held its row lock (the stock
    /// an order batch left behind): as of `locked_at`, when the lock was taken.
    pub fn committed_route(&self, class: QueryClass, locked_at: Instant) -> Route {
        Route::primary(
            class,
            Reason::InTransaction,
            locked_at,
            self.wall(locked_at),
        )
        .restated(Instant::now())
    }

    /// The route of a write's answer: read back on the primary in the write's own
    /// transaction or right after its commit (restock, settings, profile).
    pub fn written_route(&self) -> Route {
        self.decided(self.primary_route(QueryClass::Primary, Reason::PrimaryOnly))
    }

    /// A route for reads that run inside a primary transaction the caller already holds.
    pub fn in_transaction(&self, class: QueryClass) -> Route {
        self.decided(self.primary_route(class, Reason::InTransaction))
    }

    /// The timeout of a class's replica reads (exports use it for the whole stream).
    pub fn class_timeout(&self, class: QueryClass) -> Duration {
        self.inner.timeouts.for_class(class).0
    }

    /// Runs a read of `class` where the policy sends it. A replica that fails, misses its
    /// class's timeout, has no free connection here, or answers older than the class's
    /// budget is skipped and the read routed again (another fresh replica, else the
    /// primary). Only connect errors and point-read timeouts mark a replica `down`.
    pub async fn read<T, F, Fut>(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
        f: F,
    ) -> Result<Routed<T>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let min_lsn = match self.min_lsn_for(class, ctx).await {
            Ok(m) => m,
            Err(route) => return self.on_primary(route, &f).await,
        };
        let mut excluded: Vec<usize> = Vec::new();
        let mut failed: Option<Reason> = None;
        loop {
            let decided = match self.decide(class, min_lsn, &excluded) {
                // A class that refuses the primary still gets it after a replica failed
                // mid-read, as before: the request was already admitted to a replica.
                Err(DbError::NoFreshReplica(_)) if failed.is_some() => None,
                Err(e) => return Err(e),
                Ok(d) => Some(d),
            };
            let (replica, route) = match (decided, failed) {
                (Some((Some(i), route)), _) => (i, route),
                (Some((None, route)), None) => return self.on_primary(route, &f).await,
                // The primary after a replica attempt: say why (the attempt, not freshness).
                (Some((None, route)), Some(reason)) => {
                    return self.on_primary(Route { reason, ..route }, &f).await;
                }
                (None, reason) => {
                    let reason = reason.unwrap_or(Reason::ReplicaFailed);
                    let route = self.decided(self.primary_route(class, reason));
                    return self.on_primary(route, &f).await;
                }
            };
            excluded.push(replica);
            match self.on_replica(replica, route, &f).await {
                Ok(routed) => return Ok(routed),
                Err(reason) => failed = Some(reason),
            }
        }
    }

    async fn on_primary<T, F, Fut>(&self, route: Route, f: &F) -> Result<Routed<T>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let value = f(ReadPool(self.inner.primary.current().clone())).await?;
        Ok(Routed {
            value,
            route: route.restated(Instant::now()),
        })
    }

    /// One attempt on replica `i`; `Err` says why the read must be routed again.
    async fn on_replica<T, F, Fut>(
        &self,
        i: usize,
        route: Route,
        f: &F,
    ) -> Result<Routed<T>, Reason>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let r = &self.inner.replicas[i];
        let class = route.class;
        let (timeout, counts) = self.inner.timeouts.for_class(class);
        let budget = class.policy().budget;
        // A free connection of our own pool: waiting for one says nothing about the replica.
        let Ok(Ok(_slot)) = tokio::time::timeout(timeout, r.slots.acquire()).await else {
            tracing::debug!(replica = %r.name, %class, "no free connection to the replica here; routing again");
            return Err(Reason::ReplicaBusy);
        };
        let _counted = InFlight::enter(&r.in_flight);
        // The replica's state as the monitor knows it now, when the query is sent: the
        // answer holds at least that (the replica only moves forward while it runs).
        let Some(as_of) = self.freshness_read().as_of(i) else {
            return Err(Reason::ReplicaFailed);
        };
        let mut route = Route {
            as_of: self.inner.time.wall(as_of),
            as_of_instant: as_of,
            ..route
        };
        let outcome = tokio::time::timeout(timeout, f(ReadPool(r.pool.clone()))).await;
        let error = match outcome {
            Ok(Ok(value)) => {
                route = route.restated(Instant::now());
                if budget.is_some_and(|b| route.stale_by_ms() > b.as_millis() as u64) {
                    tracing::debug!(replica = %r.name, %class, stale_by_ms = route.stale_by_ms(), "answer came back over budget; routing again");
                    return Err(Reason::OverBudget);
                }
                return Ok(Routed { value, route });
            }
            // Our own pool had no connection in time (e.g. held by exports): local.
            Ok(Err(sqlx::Error::PoolTimedOut)) => return Err(Reason::ReplicaBusy),
            Ok(Err(e)) if is_connection_error(&e) => {
                self.mark_down(i, e.to_string());
                e.to_string()
            }
            // Any other error on a replica (e.g. a query cancelled by a recovery conflict)
            // is retried without judging the replica.
            Ok(Err(e)) => e.to_string(),
            Err(_) if counts => {
                self.mark_down(i, format!("no answer within {timeout:?}"));
                "timed out".into()
            }
            // A long class's timeout: the query was slow, not the server.
            Err(_) => format!("{class} read took over {timeout:?}"),
        };
        tracing::warn!(replica = %r.name, class = %class, %error, "replica read failed; routing again");
        Err(Reason::ReplicaFailed)
    }

    /// Like [`Db::read`], for a lookup that may find nothing: "not found" on a replica is
    /// not authoritative (the row may be newer than the replica), so it is asked again on
    /// the primary.
    pub async fn read_existing<T, F, Fut>(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
        f: F,
    ) -> Result<Routed<Option<T>>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<Option<T>, sqlx::Error>>,
    {
        let read = self.read(class, ctx, &f).await?;
        if read.value.is_some() || read.route.is_primary() {
            return Ok(read);
        }
        let route = self.decided(self.primary_route(class, Reason::NotOnReplica));
        self.on_primary(route, &f).await
    }

    /// The pool of a placed read.
    fn pool_for(&self, replica: Option<usize>) -> ReadPool {
        match replica {
            Some(i) => ReadPool(self.inner.replicas[i].pool.clone()),
            None => ReadPool(self.inner.primary.current().clone()),
        }
    }

    fn publish_replica_metrics(&self, i: usize) {
        let now = Instant::now();
        let (view, primary_lsn) = {
            let f = self.freshness_read();
            (f.view(i, now), f.primary_lsn())
        };
        let m = &self.inner.metrics;
        let name = self.inner.replicas[i].name.as_str();
        let states = [
            ReplicaState::Healthy,
            ReplicaState::Lagging,
            ReplicaState::Down,
        ];
        // Under Patroni every member is listed as a replica, the leader too; it is no
        // replica, and its entry (never fresh, `down`) must not page as a stale or down one.
        if self.leading_member() == Some(i) {
            let _ = m.replica_staleness.remove_label_values(&[name]);
            let _ = m.replica_lag_bytes.remove_label_values(&[name]);
            for state in states {
                let _ = m.replica_state.remove_label_values(&[name, state.as_str()]);
            }
            return;
        }
        m.replica_staleness.with_label_values(&[name]).set(
            view.staleness
                .map(|d| d.as_secs_f64())
                .unwrap_or(f64::INFINITY),
        );
        m.replica_lag_bytes
            .with_label_values(&[name])
            .set(match (primary_lsn, view.replay_lsn) {
                (Some(p), Some(r)) => p.saturating_sub(r) as f64,
                _ => f64::NAN,
            });
        for state in states {
            m.replica_state
                .with_label_values(&[name, state.as_str()])
                .set(i64::from(view.state == state));
        }
    }

    fn mark_down(&self, i: usize, error: String) {
        self.freshness_write().record_replica_error(i, error);
        self.inner
            .metrics
            .monitor_errors
            .with_label_values(&[&self.inner.replicas[i].name])
            .inc();
    }

    /// Records a user's write for read-your-writes: the primary's position after the
    /// commit. Never turns the committed write into an error: if the position cannot be
    /// read, the user is recorded at [`PRIMARY_ONLY`] (their reads go to the primary for one
    /// TTL); if the shared store cannot record it, this instance remembers it and the write
    /// is acknowledged only once no replica that lacks it can still serve the user's reads
    /// anywhere (each has replayed it, or is past the read-your-writes budget since the
    /// commit). Returns the position for `X-Consistency-Token`, when known.
    pub async fn note_write(&self, user: &UserId) -> Option<Lsn> {
        let committed = Instant::now();
        let lsn = match tokio::time::timeout(
            self.inner.primary_timeout,
            self.inner.primary.current_lsn(),
        )
        .await
        {
            Ok(Ok(lsn)) => Some(lsn),
            Ok(Err(e)) => {
                self.ryw_failed("position", user, &e, "pinning the user to the primary");
                None
            }
            Err(_) => {
                self.ryw_failed(
                    "position",
                    user,
                    &"timed out",
                    "pinning the user to the primary",
                );
                None
            }
        };
        self.pin(user, lsn.unwrap_or(PRIMARY_ONLY), committed).await;
        lsn
    }

    /// Records a user's write whose COMMIT was sent and never answered: it may have landed,
    /// at a position no one knows, so the user is pinned to the primary for one TTL, like a
    /// write whose position could not be read.
    pub async fn note_unknown_write(&self, user: &UserId) {
        self.pin(user, PRIMARY_ONLY, Instant::now()).await;
    }

    /// Records `pin` for `user` in the shared store; if the store cannot, returns only once
    /// no replica without the write can still serve the user's reads anywhere.
    async fn pin(&self, user: &UserId, pin: Lsn, committed: Instant) {
        if let Err(e) = self.inner.ryw.advance(user, pin).await {
            self.ryw_failed(
                "advance",
                user,
                &e,
                "waiting until no replica without the write can serve the user",
            );
            let waited = self.wait_out_replicas_behind(pin, committed).await;
            tracing::info!(user = %user, ?waited, "write acknowledged without the shared store");
        }
    }

    /// The one place a read-your-writes failure is counted and logged: `step` is what
    /// failed (`get`, `advance`, `position`), `then` what the service does instead.
    fn ryw_failed(&self, step: &str, user: &UserId, error: &dyn std::fmt::Display, then: &str) {
        // Each step's series is exported at 0 from the start; a new step must be listed.
        debug_assert!(crate::metrics::RYW_STEPS.contains(&step), "{step}");
        self.inner
            .metrics
            .ryw_store_failures
            .with_label_values(&[step])
            .inc();
        tracing::warn!(%error, user = %user, step, "read-your-writes step failed; {then}");
    }

    /// Waits until every replica has replayed `lsn` (as this instance's monitor sees it) or
    /// can no longer be within the read-your-writes budget of any reader: a replica lacking
    /// a write acknowledged at `committed` has an `as_of` before it on every instance, so
    /// once `budget` (plus two monitor periods of margin) has passed, no router uses it for
    /// that user's data. Returns how long it waited.
    async fn wait_out_replicas_behind(&self, lsn: Lsn, committed: Instant) -> Duration {
        let budget = QueryClass::OwnData.policy().budget();
        let deadline = committed + budget + 2 * self.inner.monitor_interval;
        let period = self.inner.monitor_interval.max(Duration::from_millis(5));
        loop {
            let all_have_it = {
                let f = self.freshness_read();
                (0..self.inner.replicas.len()).all(|i| f.reached(i, lsn))
            };
            let now = Instant::now();
            if all_have_it || now >= deadline {
                return now.saturating_duration_since(committed);
            }
            tokio::time::sleep(period.min(deadline - now)).await;
        }
    }
}

/// A routing decision before it is dressed as a [`Route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Replica `i`, whose answer includes every commit acknowledged before the instant.
    Replica(usize, Instant),
    Primary(Reason),
    /// No replica is fresh enough and the class refuses the primary.
    Refuse,
}

/// Where a read under `policy` goes, given what the monitor knows at `now`. Pure, so the
/// routing audit can check every class against staleness it makes up (a 5-minute budget
/// cannot be waited out in a test). Among eligible replicas the least loaded wins; ties
/// go round-robin from `start`.
pub fn choose(
    policy: &policy::Policy,
    f: &Freshness,
    now: Instant,
    min_lsn: Option<Lsn>,
    loads: &[usize],
    start: usize,
) -> Choice {
    choose_among(policy, f, now, min_lsn, loads, start, |_| false)
}

/// The (target, reason) pairs a class's reads can be counted under in
/// `routing_decisions_total`: what [`choose_among`], a retried read and a read inside a
/// transaction can decide. Reads of a replica-target class that land on the primary are
/// also its fallbacks.
pub fn possible_decisions(p: &policy::Policy) -> Vec<(&'static str, Reason)> {
    let mut out = vec![("primary", Reason::InTransaction)];
    match p.target {
        Target::Primary => out.push(("primary", Reason::PrimaryOnly)),
        Target::Replica => {
            out.push(("replica", Reason::FreshReplica));
            let mut fallbacks = vec![
                Reason::NoReplicas,
                Reason::NoFreshReplica,
                Reason::ReplicaFailed,
                Reason::ReplicaBusy,
                Reason::OverBudget,
                Reason::NotOnReplica,
            ];
            if p.read_your_writes {
                fallbacks.extend([Reason::ReadYourWrites, Reason::RywStoreUnavailable]);
            }
            out.extend(fallbacks.into_iter().map(|r| ("primary", r)));
            if p.when_no_fresh_replica == WhenNoFreshReplica::Refuse {
                out.push(("refused", Reason::NoFreshReplica));
            }
        }
    }
    out
}

/// [`choose`], never picking a replica for which `skip` holds (already tried this read).
pub fn choose_among(
    policy: &policy::Policy,
    f: &Freshness,
    now: Instant,
    min_lsn: Option<Lsn>,
    loads: &[usize],
    start: usize,
    skip: impl Fn(usize) -> bool,
) -> Choice {
    if policy.target == Target::Primary {
        return Choice::Primary(Reason::PrimaryOnly);
    }
    if loads.is_empty() {
        return Choice::Primary(Reason::NoReplicas);
    }
    let mut best: Option<(usize, usize)> = None;
    let mut behind_min_lsn = false;
    for k in 0..loads.len() {
        let i = (start + k) % loads.len();
        if skip(i) || !f.eligible(i, now, policy.budget) {
            continue;
        }
        if let Some(min) = min_lsn
            && !f.reached(i, min)
        {
            behind_min_lsn = true;
            continue;
        }
        if best.is_none_or(|(_, l)| loads[i] < l) {
            best = Some((i, loads[i]));
        }
    }
    match best.and_then(|(i, _)| f.as_of(i).map(|t| (i, t))) {
        Some((i, as_of)) => Choice::Replica(i, as_of),
        None if behind_min_lsn => Choice::Primary(Reason::ReadYourWrites),
        None if policy.when_no_fresh_replica == WhenNoFreshReplica::Refuse => Choice::Refuse,
        None => Choice::Primary(Reason::NoFreshReplica),
    }
}

#[derive(Debug, Clone)]
pub struct ReplicaStatus {
    pub name: String,
    pub state: ReplicaState,
    pub staleness: Option<Duration>,
    pub lag_bytes: Option<u64>,
    pub replay_lsn: Option<Lsn>,
    pub as_of: Option<chrono::DateTime<chrono::Utc>>,
    pub last_error: Option<String>,
    pub in_flight: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use freshness::Thresholds;

    fn status(name: &str, state: ReplicaState, staleness_ms: Option<u64>) -> ReplicaStatus {
        ReplicaStatus {
            name: name.into(),
            state,
            staleness: staleness_ms.map(Duration::from_millis),
            lag_bytes: None,
            replay_lsn: None,
            as_of: None,
            last_error: None,
            in_flight: 0,
        }
    }

    /// Under Patroni every member has a replica entry, and the leader's reads `down` (it is
    /// not in recovery): an import waiting for down replicas would wait for it forever.
    #[test]
    fn the_patroni_leaders_own_entry_is_neither_a_down_replica_nor_the_worst() {
        let members = || {
            vec![
                status("pg-1", ReplicaState::Down, None),
                status("pg-2", ReplicaState::Healthy, Some(40)),
                status("pg-3", ReplicaState::Down, None),
            ]
        };
        let (worst, down) = worst_and_down(members(), Some(0));
        assert_eq!(
            down,
            vec!["pg-3".to_string()],
            "only the real replica that is down"
        );
        assert_eq!(worst, Some(("pg-2".into(), Duration::from_millis(40))));
        // With no leader (or in the static mode) every entry counts.
        assert_eq!(worst_and_down(members(), None).1.len(), 2);
    }

    /// Two replicas, both `staleness` behind at `now` (healthy or lagging as the state
    /// machine decides), unless `down`.
    fn world(staleness: Duration, down: bool) -> (Freshness, Instant) {
        let mut f = Freshness::new(2, Thresholds::default());
        let t0 = Instant::now();
        f.record_primary(t0, 100);
        for i in 0..2 {
            f.record_replica(i, t0, 100);
        }
        let now = t0 + staleness;
        f.record_primary(now, 200);
        for i in 0..2 {
            if down {
                f.record_replica_error(i, "refused".into());
            } else {
                f.record_replica(i, now, 100);
            }
        }
        (f, now)
    }

    /// The routing audit with made-up staleness, for budgets too long to wait out in a
    /// test: every class, just inside and just outside its budget, and with replicas down.
    #[test]
    fn audit_every_class_against_its_budget() {
        use QueryClass::*;
        const MS: Duration = Duration::from_millis(1);
        // (class, staleness, replicas down, expected)
        let primary = |r| Choice::Primary(r);
        let table: &[(QueryClass, Duration, bool, Option<Reason>)] = &[
            (StockGate, 10 * MS, false, None),
            (StockGate, 251 * MS, false, Some(Reason::NoFreshReplica)),
            (StockGate, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (ProductPage, 4_900 * MS, false, None),
            (ProductPage, 5_100 * MS, false, Some(Reason::NoFreshReplica)),
            (ProductPage, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (OwnData, 4_900 * MS, false, None),
            (OwnData, 5_100 * MS, false, Some(Reason::NoFreshReplica)),
            (OwnData, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (OrderLookup, 10 * MS, false, Some(Reason::PrimaryOnly)),
            (Dashboard, 29_000 * MS, false, None),
            (Dashboard, 31_000 * MS, false, Some(Reason::NoFreshReplica)),
            (Dashboard, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (RevenueReport, 299_000 * MS, false, None),
            (
                RevenueReport,
                301_000 * MS,
                false,
                Some(Reason::NoFreshReplica),
            ),
            (RevenueReport, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Export, 3_600_000 * MS, false, None),
            (Export, 10 * MS, true, Some(Reason::NoFreshReplica)),
            (Primary, 10 * MS, false, Some(Reason::PrimaryOnly)),
        ];
        for &(class, staleness, down, expected) in table {
            let (f, now) = world(staleness, down);
            let got = choose(class.policy(), &f, now, None, &[0, 0], 0);
            // Every decision is a series exported from the start.
            let counted_as = match got {
                Choice::Replica(..) => ("replica", Reason::FreshReplica),
                Choice::Primary(r) => ("primary", r),
                Choice::Refuse => ("refused", Reason::NoFreshReplica),
            };
            assert!(
                possible_decisions(class.policy()).contains(&counted_as),
                "{class}: {counted_as:?} is not exported from the start"
            );
            match expected {
                None => assert!(
                    matches!(got, Choice::Replica(..)),
                    "{class} at {staleness:?}: {got:?}"
                ),
                Some(r) => assert_eq!(got, primary(r), "{class} at {staleness:?} down={down}"),
            }
        }
        let audited: std::collections::HashSet<_> = table.iter().map(|t| t.0).collect();
        for class in QueryClass::ALL {
            assert!(audited.contains(class), "{class} has no routing audit row");
        }
    }

    #[test]
    fn read_your_writes_needs_a_replica_past_the_users_position() {
        let (f, now) = world(Duration::from_millis(10), false);
        let policy = QueryClass::OwnData.policy();
        assert!(matches!(
            choose(policy, &f, now, Some(100), &[0, 0], 0),
            Choice::Replica(..)
        ));
        assert_eq!(
            choose(policy, &f, now, Some(101), &[0, 0], 0),
            Choice::Primary(Reason::ReadYourWrites)
        );
    }

    #[test]
    fn the_least_loaded_fresh_replica_wins() {
        let (f, now) = world(Duration::from_millis(10), false);
        let gate = QueryClass::StockGate.policy();
        assert!(matches!(
            choose(gate, &f, now, None, &[5, 1], 0),
            Choice::Replica(1, _)
        ));
        assert!(matches!(
            choose(gate, &f, now, None, &[0, 3], 1),
            Choice::Replica(0, _)
        ));
        assert_eq!(
            choose(gate, &f, now, None, &[], 0),
            Choice::Primary(Reason::NoReplicas)
        );
    }

    #[test]
    fn a_class_may_refuse_instead_of_loading_the_primary() {
        let (f, now) = world(Duration::from_secs(1), false);
        let strict = policy::Policy {
            when_no_fresh_replica: WhenNoFreshReplica::Refuse,
            ..*QueryClass::StockGate.policy()
        };
        assert_eq!(choose(&strict, &f, now, None, &[0, 0], 0), Choice::Refuse);
    }
}
