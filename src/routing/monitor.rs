//! The freshness monitor: one task per node samples its WAL position on a short period,
//! over a dedicated connection with a client-side timeout (a frozen server completes TCP
//! handshakes and never enforces its own statement_timeout). Each node has its own task so a
//! frozen replica cannot delay the primary's samples, and with them everyone's `as_of`.
//!
//! Under Patroni the primary's task samples whichever member leads now (it reconnects when
//! the leader changes), and every sample carries its timeline (see `freshness`).

use super::Db;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Stops the monitor's tasks when dropped.
pub struct MonitorGuard(Vec<JoinHandle<()>>);

impl Drop for MonitorGuard {
    fn drop(&mut self) {
        for h in &self.0 {
            h.abort();
        }
    }
}

pub(super) fn start(db: Db, interval: Duration) -> MonitorGuard {
    let mut handles: Vec<_> = (0..db.inner.monitor_targets.len())
        .map(|node| tokio::spawn(sample_node(db.clone(), node, interval)))
        .collect();
    if db.inner.cluster.is_some() {
        handles.push(tokio::spawn(super::patroni::follow(db.clone())));
    }
    MonitorGuard(handles)
}

/// Position and timeline (0: the static mode does not track timelines).
pub(super) const PRIMARY_SQL: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, 0::int4";
const REPLICA_SQL: &str = "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8, 0::int4";
/// The primary's timeline is the one its WAL file names carry.
pub(super) const PRIMARY_SQL_TIMELINE: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, \
     ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4";
/// A replica's timeline is the one its WAL receiver streams (NULL while not streaming: not
/// judged fresh until it streams again).
const REPLICA_SQL_TIMELINE: &str = "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8, \
     (SELECT received_tli FROM pg_stat_wal_receiver)::int4";

async fn sample_node(db: Db, node: usize, interval: Duration) {
    let (name, mut options) = db.inner.monitor_targets[node].clone();
    let timelines = db.inner.cluster.is_some();
    let mut sampled_leader = db.inner.primary.leader_index();
    let timeout = db.inner.replica_timeout;
    let metrics = db.inner.metrics.clone();
    let mut conn: Option<PgConnection> = None;
    let mut last_ok = Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if node == 0 && timelines {
            // Follow the leader: a new one gets a new connection.
            let leader = db.inner.primary.leader_index();
            if leader != sampled_leader {
                sampled_leader = leader;
                conn = None;
                last_ok = Instant::now();
            }
            if let Some(target) = leader.and_then(|i| db.inner.leader_targets.get(i)) {
                options = target.clone();
            }
        }
        let sent_at = Instant::now();
        let result = tokio::time::timeout(timeout, async {
            if conn.is_none() {
                conn = Some(PgConnection::connect_with(&options).await?);
            }
            let c = conn.as_mut().ok_or_else(|| sqlx::Error::PoolClosed)?;
            let sql = match (node == 0, timelines) {
                (true, false) => PRIMARY_SQL,
                (false, false) => REPLICA_SQL,
                (true, true) => PRIMARY_SQL_TIMELINE,
                (false, true) => REPLICA_SQL_TIMELINE,
            };
            sqlx::query_as::<_, (Option<i64>, Option<i32>)>(sql)
                .fetch_one(c)
                .await
        })
        .await;
        metrics.monitor_samples.with_label_values(&[&name]).inc();
        if node == 0 {
            // The primary is "down" for writes when it refuses us outright, or when it has
            // not answered for longer than a request would wait for it: then writes fail
            // at once with 503 instead of each waiting out its own timeout.
            let ok = matches!(&result, Ok(Ok(_)));
            if ok {
                last_ok = Instant::now();
            }
            let refused = matches!(&result, Ok(Err(e)) if super::is_connection_error(e));
            db.inner
                .primary
                .set_down(!ok && (refused || last_ok.elapsed() > db.inner.primary_timeout));
        }
        let lsn = match result {
            Ok(Ok((Some(lsn), Some(tl)))) => Ok((tl as u32, lsn as u64)),
            Ok(Ok((None, _))) if timelines => Err("the leader (not in recovery)".to_string()),
            Ok(Ok((None, _))) => Err("not in recovery (promoted?): not a replica".to_string()),
            Ok(Ok((Some(_), None))) => Err("not streaming from the leader".to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        };
        match lsn {
            Ok((tl, lsn)) if node == 0 => db.freshness_write().record_primary_on(tl, sent_at, lsn),
            Ok((tl, lsn)) => {
                db.freshness_write()
                    .record_replica_on(node - 1, tl, Instant::now(), lsn)
            }
            Err(error) => {
                // Drop the connection; a fresh one (with its own timeout) next tick.
                conn = None;
                metrics.monitor_errors.with_label_values(&[&name]).inc();
                if node > 0 {
                    db.freshness_write()
                        .record_replica_error(node - 1, error.clone());
                }
                tracing::debug!(node = %name, %error, "freshness sample failed");
            }
        }
        if node > 0 {
            db.publish_replica_metrics(node - 1);
        }
    }
}
