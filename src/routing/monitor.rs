//! The freshness monitor: one task per node samples its WAL position on a short period,
//! over a dedicated connection with a client-side timeout (a frozen server completes TCP
//! handshakes and never enforces its own statement_timeout). Each node has its own task so a
//! frozen replica cannot delay the primary's samples, and with them everyone's `as_of`.

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
    let handles = (0..db.inner.monitor_targets.len())
        .map(|node| tokio::spawn(sample_node(db.clone(), node, interval)))
        .collect();
    MonitorGuard(handles)
}

const PRIMARY_SQL: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8";
const REPLICA_SQL: &str = "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8";

async fn sample_node(db: Db, node: usize, interval: Duration) {
    let (name, options) = db.inner.monitor_targets[node].clone();
    let timeout = db.inner.replica_timeout;
    let metrics = db.inner.metrics.clone();
    let mut conn: Option<PgConnection> = None;
    let mut last_ok = Instant::now();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let sent_at = Instant::now();
        let result = tokio::time::timeout(timeout, async {
            if conn.is_none() {
                conn = Some(PgConnection::connect_with(&options).await?);
            }
            let c = conn.as_mut().ok_or_else(|| sqlx::Error::PoolClosed)?;
            let sql = if node == 0 { PRIMARY_SQL } else { REPLICA_SQL };
            sqlx::query_scalar::<_, Option<i64>>(sql).fetch_one(c).await
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
            Ok(Ok(Some(lsn))) => Ok(lsn as u64),
            Ok(Ok(None)) => Err("not in recovery (promoted?): not a replica".to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        };
        match lsn {
            Ok(lsn) if node == 0 => db.freshness_write().record_primary(sent_at, lsn),
            Ok(lsn) => db
                .freshness_write()
                .record_replica(node - 1, Instant::now(), lsn),
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
