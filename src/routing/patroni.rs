//! Following a Patroni cluster's leader (`STOCKGATE_PATRONI_URLS`), and positions that know
//! their timeline.
//!
//! **Members.** At start the service asks `/cluster` for the members; each is reached with
//! `DATABASE_URL`'s user, password, database and options at the member's own host and port,
//! and is a read replica named by its member name (the leader's replica entry is `down`:
//! it is not in recovery). A follower task asks `/cluster` and `/history` every
//! [`POLL`] and, when the leader changes, points the primary at it. A member that joins
//! later is logged and not used until a restart (the set is fixed at start).
//!
//! **Never a write to a node in recovery.** Every new primary connection checks
//! `pg_is_in_recovery()` and is refused if it is (503, counted); a write that still meets a
//! read-only node (SQLSTATE 25006, a demotion under an open connection) is a 503 with
//! `Retry-After`. While `/cluster` names no leader, writes answer 503 at once.
//!
//! **Positions know their timeline.** A read-your-writes or reopen position is
//! `timeline << 48 | lsn` ([`position`]); in the static mode the timeline is 0 and a position
//! is the bare LSN, as before. Larger is later for the store's "only forward" rule (a newer
//! timeline is later). A position is [`reached`] by a replica on the same timeline that
//! replayed past it, or by a replica on a later timeline only if the position lies at or
//! before the point where its timeline ended (Patroni's `/history`), i.e. in the history both
//! share. A position past that point was lost in the failover (possible only without
//! `synchronous_mode`); no replica ever reaches it and the user reads the primary until the
//! position expires. Until the follower has the history, an old-timeline position is
//! judged unreachable: a pinned user reads the primary.

use crate::lsn::Lsn;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How often the follower asks Patroni.
pub const POLL: Duration = Duration::from_millis(500);

const LSN_BITS: u32 = 48;
const LSN_MASK: Lsn = (1 << LSN_BITS) - 1;

/// A position on `timeline`: the timeline in the top 16 bits, the LSN in the low 48
/// (256 TiB of WAL per timeline).
pub fn position(timeline: u32, lsn: Lsn) -> Lsn {
    (Lsn::from(timeline) << LSN_BITS) | (lsn & LSN_MASK)
}

/// The timeline and LSN of a [`position`].
pub fn split(position: Lsn) -> (u32, Lsn) {
    ((position >> LSN_BITS) as u32, position & LSN_MASK)
}

/// Where each ended timeline switched to the next: `(timeline, lsn)` pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct History(Vec<(u32, Lsn)>);

impl History {
    pub fn new(mut switches: Vec<(u32, Lsn)>) -> Self {
        switches.sort_unstable();
        History(switches)
    }

    /// The LSN at which `timeline` ended, if it has.
    pub fn end_of(&self, timeline: u32) -> Option<Lsn> {
        self.0.iter().find(|(t, _)| *t == timeline).map(|(_, l)| *l)
    }
}

/// Whether a replica streaming `replica_timeline`, replayed to `replay_lsn`, holds
/// `position`.
pub fn reached(position: Lsn, replica_timeline: u32, replay_lsn: Lsn, history: &History) -> bool {
    let (timeline, lsn) = split(position);
    if timeline == replica_timeline {
        return replay_lsn >= lsn;
    }
    if timeline > replica_timeline {
        return false;
    }
    // An older timeline: only what it shares with every later one, i.e. up to where it ended
    // (each later timeline forked at or after that point, so the bound holds along the chain).
    history.end_of(timeline).is_some_and(|end| lsn <= end) && replay_lsn >= lsn
}

/// One member as `/cluster` lists it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub role: String,
    pub state: String,
    pub host: String,
    pub port: u16,
    #[serde(default)]
    pub timeline: Option<u32>,
    /// Bytes behind the leader as Patroni last wrote it to the DCS (up to a loop old).
    #[serde(default, deserialize_with = "lag_bytes")]
    pub lag: Option<u64>,
}

/// Patroni writes `lag` as a number, or `"unknown"` for a member it cannot place.
fn lag_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(serde_json::Value::deserialize(d)?.as_u64())
}

impl Member {
    pub fn is_leader(&self) -> bool {
        matches!(self.role.as_str(), "leader" | "master" | "primary") && self.state == "running"
    }
}

/// The cluster as Patroni last described it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Topology {
    pub members: Vec<Member>,
    #[serde(skip)]
    pub history: History,
}

impl Topology {
    pub fn leader(&self) -> Option<&Member> {
        self.members.iter().find(|m| m.is_leader())
    }

    /// The leader's timeline (the cluster's).
    pub fn timeline(&self) -> Option<u32> {
        self.leader().and_then(|m| m.timeline)
    }
}

#[derive(Deserialize)]
struct ClusterBody {
    members: Vec<Member>,
}

/// Parses `/cluster`.
pub fn parse_cluster(body: &str) -> Result<Vec<Member>, serde_json::Error> {
    Ok(serde_json::from_str::<ClusterBody>(body)?.members)
}

/// Parses `/history`: `[[timeline, lsn, reason, timestamp, new_leader], …]`.
pub fn parse_history(body: &str) -> Result<History, serde_json::Error> {
    let rows: Vec<Vec<serde_json::Value>> = serde_json::from_str(body)?;
    Ok(History::new(
        rows.iter()
            .filter_map(|r| Some((r.first()?.as_u64()? as u32, r.get(1)?.as_u64()?)))
            .collect(),
    ))
}

/// A client of the Patroni REST APIs: the first URL that answers is asked.
#[derive(Debug, Clone)]
pub struct Patroni {
    urls: Vec<String>,
    http: reqwest::Client,
}

impl Patroni {
    pub fn new(urls: Vec<String>) -> Self {
        Patroni {
            urls,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap_or_default(),
        }
    }

    /// The members and the timeline history, from the first API that answers both.
    pub async fn topology(&self) -> Result<Topology, String> {
        let mut last = "no Patroni URL configured".to_string();
        for url in &self.urls {
            match self.ask(url).await {
                Ok(t) => return Ok(t),
                Err(e) => last = format!("{url}: {e}"),
            }
        }
        Err(last)
    }

    async fn ask(&self, base: &str) -> Result<Topology, String> {
        let get = |path: &'static str| async move {
            let r = self
                .http
                .get(format!("{}{path}", base.trim_end_matches('/')))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !r.status().is_success() {
                return Err(format!("{path} answered {}", r.status()));
            }
            r.text().await.map_err(|e| e.to_string())
        };
        let members = parse_cluster(&get("/cluster").await?).map_err(|e| e.to_string())?;
        let history = parse_history(&get("/history").await?).map_err(|e| e.to_string())?;
        Ok(Topology { members, history })
    }
}

/// `database_url` pointed at `host:port`: the same user, password, database and options.
pub fn member_url(database_url: &str, host: &str, port: u16) -> Result<String, String> {
    let mut url = url::Url::parse(database_url).map_err(|e| e.to_string())?;
    url.set_host(Some(host)).map_err(|e| e.to_string())?;
    url.set_port(Some(port))
        .map_err(|()| "DATABASE_URL cannot take a port".to_string())?;
    Ok(url.to_string())
}

/// The service's side of the followed cluster: its client, members, last topology and
/// metrics. The loop that drives it is [`follow`].
pub struct Follower {
    client: Patroni,
    names: Vec<String>,
    topology: std::sync::RwLock<Option<(Topology, std::time::Instant)>>,
    last_error: std::sync::Mutex<Option<String>>,
    leader_changes: prometheus::IntCounter,
    has_leader: prometheus::IntGauge,
    timeline: prometheus::IntGauge,
    refused_read_only: prometheus::IntCounterVec,
}

impl Follower {
    pub fn new(setup: &super::PatroniSetup, metrics: &crate::metrics::Metrics) -> Follower {
        let r = &metrics.registry;
        let counter = |name: &str, help: &str| {
            let c = prometheus::IntCounter::new(name, help).expect("static metric");
            let _ = r.register(Box::new(c.clone()));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = prometheus::IntGauge::new(name, help).expect("static metric");
            let _ = r.register(Box::new(g.clone()));
            g
        };
        let f = Follower {
            client: setup.client.clone(),
            names: setup.members.iter().map(|(n, _)| n.clone()).collect(),
            topology: Default::default(),
            last_error: Default::default(),
            leader_changes: counter(
                "patroni_leader_changes_total",
                "Times this instance saw Patroni's leader change",
            ),
            has_leader: gauge(
                "patroni_has_leader",
                "1 while Patroni names a running leader, else 0",
            ),
            timeline: gauge("patroni_timeline", "The leader's timeline"),
            refused_read_only: metrics.writes_refused_read_only.clone(),
        };
        f.has_leader.set(i64::from(setup.leader.is_some()));
        f
    }

    /// Pool options that refuse a primary connection to a node in recovery: a demoted or
    /// not-yet-promoted node can never receive a write through the primary pool.
    pub fn refuse_recovery(
        &self,
        opts: sqlx::postgres::PgPoolOptions,
    ) -> sqlx::postgres::PgPoolOptions {
        let refused = self.refused_read_only.with_label_values(&["connect"]);
        opts.after_connect(move |conn, _meta| {
            let refused = refused.clone();
            Box::pin(async move {
                let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                    .fetch_one(&mut *conn)
                    .await?;
                if in_recovery {
                    refused.inc();
                    return Err(sqlx::Error::Io(std::io::Error::other(
                        "refusing a primary connection to a node in recovery",
                    )));
                }
                Ok(())
            })
        })
    }

    /// The last topology and how old it is, and the last error asking for it.
    pub fn snapshot(&self) -> (Option<(Topology, Duration)>, Option<String>) {
        let t = self
            .topology
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(t, at)| (t.clone(), at.elapsed()));
        let e = self
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        (t, e)
    }

    pub fn leader_changes(&self) -> u64 {
        self.leader_changes.get()
    }
}

/// The followed cluster for operators (`/v1/admin/replicas` → `cluster`, `/ops`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ClusterStatus {
    /// The member Patroni names leader; null while none leads.
    pub leader: Option<String>,
    /// The member this instance sends writes to (null: none; writes answer 503).
    pub writes_to: Option<String>,
    /// The leader's timeline.
    pub timeline: Option<u32>,
    /// Leader changes this instance has seen since it started.
    pub leader_changes: u64,
    /// How old the last answer from Patroni is; null before the first.
    pub patroni_age_ms: Option<u64>,
    /// Why the last question to Patroni failed, if it did.
    pub patroni_error: Option<String>,
    pub members: Vec<MemberStatus>,
}

/// One member as Patroni describes it (its freshness as measured here is under `replicas`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MemberStatus {
    pub name: String,
    /// `leader`, `sync_standby` or `replica`, as Patroni says.
    pub role: String,
    /// `running`, `starting`, `stopped`, … as Patroni says.
    pub state: String,
    pub host: String,
    pub port: u16,
    pub timeline: Option<u32>,
    /// Bytes behind the leader as Patroni last recorded it (up to a loop old).
    pub patroni_lag_bytes: Option<u64>,
}

impl Follower {
    pub fn status(&self, writes_to: Option<usize>) -> ClusterStatus {
        let (topology, error) = self.snapshot();
        let (t, age) = topology.unzip();
        let t = t.unwrap_or_default();
        ClusterStatus {
            leader: t.leader().map(|m| m.name.clone()),
            writes_to: writes_to.and_then(|i| self.names.get(i).cloned()),
            timeline: t.timeline(),
            leader_changes: self.leader_changes(),
            patroni_age_ms: age.map(|a| a.as_millis() as u64),
            patroni_error: error,
            members: t
                .members
                .iter()
                .map(|m| MemberStatus {
                    name: m.name.clone(),
                    role: m.role.clone(),
                    state: m.state.clone(),
                    host: m.host.clone(),
                    port: m.port,
                    timeline: m.timeline,
                    patroni_lag_bytes: m.lag,
                })
                .collect(),
        }
    }
}

/// Asks Patroni every [`POLL`] and follows its leader until the handle is aborted.
pub(super) async fn follow(db: super::Db) {
    let Some(f) = db.inner.cluster.as_ref() else {
        return;
    };
    let mut ticker = tokio::time::interval(POLL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let topology = match f.client.topology().await {
            Ok(t) => t,
            Err(e) => {
                // Keep following the last known leader: its connections are still checked
                // for recovery, so a stale belief cannot send a write to a replica.
                tracing::warn!(error = %e, "Patroni did not answer; keeping the last leader");
                *f.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                continue;
            }
        };
        *f.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        for m in &topology.members {
            if !f.names.contains(&m.name) {
                tracing::warn!(member = %m.name, "a member joined after start; it is used after a restart");
            }
        }
        let leader = topology.leader().map(|m| m.name.clone());
        let index = leader
            .as_ref()
            .and_then(|n| f.names.iter().position(|x| x == n));
        f.has_leader.set(i64::from(index.is_some()));
        if let Some(tl) = topology.timeline() {
            f.timeline.set(i64::from(tl));
        }
        db.freshness_write().set_history(topology.history.clone());
        // Counted on arrival of a leader: loss-then-successor is one change.
        if db.inner.primary.follow(index.unwrap_or(super::NO_LEADER)) && index.is_some() {
            f.leader_changes.inc();
            tracing::warn!(leader = ?leader, timeline = ?topology.timeline(), "Patroni's leader changed; following it");
        }
        *f.topology.write().unwrap_or_else(|p| p.into_inner()) =
            Some((topology, std::time::Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_static_mode_keeps_bare_lsns() {
        assert_eq!(position(0, 0x16_B374_D848), 0x16_B374_D848);
        assert_eq!(split(0x16_B374_D848), (0, 0x16_B374_D848));
        assert_eq!(split(position(3, 42)), (3, 42));
        // The store keeps the larger position: a newer timeline is later.
        assert!(position(2, 1) > position(1, LSN_MASK));
    }

    /// The incident the timeline guards against: a write acknowledged on timeline 1 at
    /// 0/5000 that the old leader never shipped (async). Timeline 2 forked at 0/4000, and
    /// its WAL passes 0/5000 soon after; a replica there at 0/6000 lacks the write.
    #[test]
    fn a_lost_old_timeline_write_is_never_reached_by_new_wal() {
        let history = History::new(vec![(1, 0x4000)]);
        let write = position(1, 0x5000);
        assert!(!reached(write, 2, 0x6000, &history));
        assert!(!reached(write, 2, 0x6000, &History::default()));
        // On its own timeline it is judged by the offset.
        assert!(reached(write, 1, 0x5000, &history));
        assert!(!reached(write, 1, 0x4fff, &history));
    }

    #[test]
    fn an_old_timeline_write_before_the_fork_is_reached_on_the_new_one() {
        let history = History::new(vec![(1, 0x4000), (2, 0x9000)]);
        let write = position(1, 0x3000);
        assert!(reached(write, 2, 0x3000, &history));
        assert!(reached(write, 3, 0x3000, &history));
        assert!(!reached(write, 2, 0x2fff, &history));
        // Unknown history: unjudgeable, so not reached (the user reads the primary).
        assert!(!reached(write, 2, 0x6000, &History::default()));
        // A replica still on an older timeline never holds a newer position.
        assert!(!reached(position(2, 0x10), 1, 0x9999, &history));
    }

    #[test]
    fn cluster_and_history_parse_as_patroni_3_writes_them() {
        let body = r#"{"members": [{"name": "node1", "role": "leader", "state": "running", "api_url": "http://127.0.0.1:17403/patroni", "host": "127.0.0.1", "port": 17402, "timeline": 2}, {"name": "node2", "role": "sync_standby", "state": "running", "host": "127.0.0.1", "port": 17404, "timeline": 2, "lag": 0}, {"name": "node3", "role": "replica", "state": "stopped", "host": "127.0.0.1", "port": 17406, "lag": "unknown"}]}"#;
        let members = parse_cluster(body).unwrap_or_default();
        let t = Topology {
            members,
            history: History::default(),
        };
        assert_eq!(t.leader().map(|m| m.name.as_str()), Some("node1"));
        assert_eq!(t.timeline(), Some(2));
        assert_eq!(t.members[1].lag, Some(0));
        assert_eq!(t.members[2].lag, None);
        let h = parse_history(r#"[[1, 67109280, "no recovery target specified", "2026-12-01T03:56:39+00:00", "node3"]]"#)
            .unwrap_or_default();
        assert_eq!(h.end_of(1), Some(67109280));
        assert_eq!(h.end_of(2), None);
    }

    #[test]
    fn members_are_reached_with_the_database_urls_credentials() {
        assert_eq!(
            member_url(
                "postgres://app:s3cret@db.example:5432/shop?sslmode=disable",
                "10.0.0.7",
                6432
            )
            .as_deref(),
            Ok("postgres://app:s3cret@10.0.0.7:6432/shop?sslmode=disable")
        );
    }
}
