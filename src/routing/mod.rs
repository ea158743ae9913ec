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

mod choose;
mod error;
pub mod freshness;
pub mod monitor;
pub mod patroni;
pub mod policy;
mod pools;
mod read;
pub mod route;
mod status;
mod sticky;

pub use choose::{Choice, choose, choose_among, possible_decisions};
pub use error::{Busy, DbError, Internal, Unavailable, is_connection_error};
pub use pools::{
    Primary, ReadPool, Timeouts, primary_options, replica_options, replica_options_with,
};
pub use status::ReplicaStatus;

use crate::clock::TimeBase;
use crate::domain::UserId;
use crate::metrics::Metrics;
use crate::ryw::RywStore;
use freshness::{Freshness, Lsn};
use pools::{NO_LEADER, Nodes, Replica, primary_pool};
pub use route::{Reason, Route};
use sqlx::postgres::PgConnectOptions;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

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
    /// The service's clock: monotonic instants to UTC.
    pub time: TimeBase,
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
    /// The primary's clock minus the service's, in µs, from the monitor's last sample of the
    /// primary (0 until one is taken).
    primary_clock_offset_us: AtomicI64,
    metrics: Metrics,
    ryw: RywStore,
    replica_timeout: Duration,
    timeouts: Timeouts,
    primary_timeout: Duration,
    monitor_interval: Duration,
    round_robin: AtomicUsize,
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
                time: s.time,
                primary_clock_offset_us: AtomicI64::new(0),
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

    /// The primary's clock now, as the monitor last read it (within half that sample's round
    /// trip): where the contract judges a rule "on the primary's clock" outside a primary
    /// transaction (a sale window shown by availability).
    pub fn primary_now(&self) -> chrono::DateTime<chrono::Utc> {
        let offset = self.inner.primary_clock_offset_us.load(Ordering::Relaxed);
        self.now_utc() + chrono::Duration::microseconds(offset)
    }

    /// The primary read `primary_us` on its clock between `sent` and `received`.
    fn note_primary_clock(&self, sent: Instant, received: Instant, primary_us: i64) {
        let mid = sent + received.saturating_duration_since(sent) / 2;
        let ours = self.inner.time.wall(mid).timestamp_micros();
        self.inner
            .primary_clock_offset_us
            .store(primary_us - ours, Ordering::Relaxed);
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

    fn mark_down(&self, i: usize, error: String) {
        self.freshness_write().record_replica_error(i, error);
        self.inner
            .metrics
            .monitor_errors
            .with_label_values(&[&self.inner.replicas[i].name])
            .inc();
    }
}
