//! The freshness monitor: one task per node samples its WAL position on a short period,
//! over a dedicated connection with a client-side timeout (a frozen server completes TCP
//! handshakes and never enforces its own statement_timeout). Each node has its own task so a
//! frozen replica cannot delay the primary's samples, and with them everyone's `as_of`.
//!
//! Under Patroni the primary's task samples whichever member leads now (it reconnects when
//! the leader changes), and every sample carries its timeline (see `freshness`).
//!
//! A node that cannot be reached is tried again every period, so its return is seen within
//! one. A node that is up and refuses us (a database that does not exist, a login it rejects)
//! is tried again after a pause that doubles up to [`MAX_PAUSE`]: each try would cost it a
//! backend started and a FATAL line in its log, 40 times a second, for as long as it refuses.

use super::Db;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
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

/// The longest pause before trying again a node that is up and refuses us.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// The pause before the next try after `refusals` in a row by a node that is up: none after
/// none, then the period, doubling, at most [`MAX_PAUSE`].
fn pause_after(refusals: u32, interval: Duration) -> Duration {
    match refusals {
        0 => Duration::ZERO,
        n => interval
            .saturating_mul(1 << (n - 1).min(16))
            .min(MAX_PAUSE.max(interval)),
    }
}

/// Whether a new connection failed because the server answered and refused it (its own error:
/// a database that does not exist, a login it rejects), not because the server is down,
/// starting or shutting down, which are tried every period. A query that fails on a
/// connection the server accepted (a leader just demoted, say) is tried every period too.
fn refused_by_a_live_server(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(_)) && !super::is_connection_error(e)
}

/// Position and timeline (0: the static mode does not track timelines).
pub(super) const PRIMARY_SQL: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, 0::int4";
/// The primary's timeline is the one its WAL file names carry.
pub(super) const PRIMARY_SQL_TIMELINE: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, \
     ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4";
/// The monitor's own samples: as above, and the primary's also read its clock (µs since the
/// epoch), so the service can tell the primary's time where a rule is judged on it.
const PRIMARY_SAMPLE: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, 0::int4, \
     (extract(epoch FROM clock_timestamp()) * 1e6)::int8";
const REPLICA_SAMPLE: &str =
    "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8, 0::int4, NULL::int8";
const PRIMARY_SAMPLE_TIMELINE: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, \
     ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4, \
     (extract(epoch FROM clock_timestamp()) * 1e6)::int8";
/// A replica's timeline is the one its WAL receiver streams (NULL while not streaming: not
/// judged fresh until it streams again).
const REPLICA_SAMPLE_TIMELINE: &str = "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::int8, \
     (SELECT received_tli FROM pg_stat_wal_receiver)::int4, NULL::int8";

/// One sample's outcome: the position, timeline and the primary's clock, or why there is none.
type Sample = Result<
    Result<(Option<i64>, Option<i32>, Option<i64>), sqlx::Error>,
    tokio::time::error::Elapsed,
>;

async fn sample_node(db: Db, node: usize, interval: Duration) {
    let (name, options) = db.inner.monitor_targets[node].clone();
    let mut sampler = Sampler {
        sampled_leader: db.inner.primary.leader_index(),
        db,
        node,
        name,
        options,
        conn: None,
        last_ok: Instant::now(),
        refusals: 0,
    };
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        sampler.follow_leader();
        let sent_at = Instant::now();
        let result = sampler.sample().await;
        sampler.record(result, sent_at);
        let pause = pause_after(sampler.refusals, interval);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

/// The monitor's view of one node: node 0 is the primary (the leader, under Patroni), node
/// `i > 0` is replica `i - 1`.
struct Sampler {
    db: Db,
    node: usize,
    name: String,
    options: PgConnectOptions,
    conn: Option<PgConnection>,
    /// The leader the primary's connection was opened to (Patroni mode).
    sampled_leader: Option<usize>,
    /// The primary's last good sample.
    last_ok: Instant,
    /// New connections in a row that the node, up, refused ([`pause_after`]).
    refusals: u32,
}

impl Sampler {
    fn timelines(&self) -> bool {
        self.db.inner.cluster.is_some()
    }

    /// The primary's sampler follows the leader: a new one gets a new connection.
    fn follow_leader(&mut self) {
        if self.node != 0 || !self.timelines() {
            return;
        }
        let leader = self.db.inner.primary.leader_index();
        if leader != self.sampled_leader {
            self.sampled_leader = leader;
            self.conn = None;
            self.last_ok = Instant::now();
        }
        if let Some(target) = leader.and_then(|i| self.db.inner.leader_targets.get(i)) {
            self.options = target.clone();
        }
    }

    /// One position query, on the kept connection (or a new one), within the point timeout.
    async fn sample(&mut self) -> Sample {
        let sql = match (self.node == 0, self.timelines()) {
            (true, false) => PRIMARY_SAMPLE,
            (false, false) => REPLICA_SAMPLE,
            (true, true) => PRIMARY_SAMPLE_TIMELINE,
            (false, true) => REPLICA_SAMPLE_TIMELINE,
        };
        let (conn, options) = (&mut self.conn, &self.options);
        let mut refused = false;
        let sample = tokio::time::timeout(self.db.inner.replica_timeout, async {
            if conn.is_none() {
                match PgConnection::connect_with(options).await {
                    Ok(c) => *conn = Some(c),
                    Err(e) => {
                        refused = refused_by_a_live_server(&e);
                        return Err(e);
                    }
                }
            }
            let c = conn.as_mut().ok_or(sqlx::Error::PoolClosed)?;
            sqlx::query_as(sql).fetch_one(c).await
        })
        .await;
        self.refusals = match refused {
            true => self.refusals.saturating_add(1),
            false => 0,
        };
        sample
    }

    /// Records a sample: the node's position, or its error; the primary's up/down state.
    fn record(&mut self, result: Sample, sent_at: Instant) {
        let db = self.db.clone();
        let metrics = &db.inner.metrics;
        metrics
            .monitor_samples
            .with_label_values(&[&self.name])
            .inc();
        if self.node == 0 {
            self.judge_primary(&result);
            if let Ok(Ok((_, _, Some(primary_us)))) = result {
                self.db
                    .note_primary_clock(sent_at, Instant::now(), primary_us);
            }
        }
        // A node that answered keeps its connection, whatever the answer said.
        let answered = matches!(result, Ok(Ok(_)));
        match self.position(result) {
            Ok((tl, lsn)) if self.node == 0 => self
                .db
                .freshness_write()
                .record_primary_on(tl, sent_at, lsn),
            Ok((tl, lsn)) => {
                self.db
                    .freshness_write()
                    .record_replica_on(self.node - 1, tl, Instant::now(), lsn)
            }
            Err(error) => {
                // A failed query or connection: a fresh one (with its own timeout) next try.
                if !answered {
                    self.conn = None;
                }
                metrics
                    .monitor_errors
                    .with_label_values(&[&self.name])
                    .inc();
                if self.node > 0 {
                    self.db
                        .freshness_write()
                        .record_replica_error(self.node - 1, error.clone());
                }
                tracing::debug!(node = %self.name, %error, "freshness sample failed");
            }
        }
        if self.node > 0 {
            self.db.publish_replica_metrics(self.node - 1);
        }
    }

    /// The primary is "down" for writes when it refuses us outright, or when it has not
    /// answered for longer than a request would wait for it: then writes fail at once with
    /// 503 instead of each waiting out its own timeout.
    fn judge_primary(&mut self, result: &Sample) {
        let ok = matches!(result, Ok(Ok(_)));
        if ok {
            self.last_ok = Instant::now();
        }
        let refused = matches!(result, Ok(Err(e)) if super::is_connection_error(e));
        let waited_too_long = self.last_ok.elapsed() > self.db.inner.primary_timeout;
        self.db
            .inner
            .primary
            .set_down(!ok && (refused || waited_too_long));
    }

    /// The (timeline, position) a sample gives, or why it gives none.
    fn position(&self, result: Sample) -> Result<(u32, u64), String> {
        match result {
            Ok(Ok((Some(lsn), Some(tl), _))) => Ok((tl as u32, lsn as u64)),
            Ok(Ok((None, _, _))) if self.timelines() => Err("the leader (not in recovery)".into()),
            Ok(Ok((None, _, _))) => Err("not in recovery (promoted?): not a replica".into()),
            Ok(Ok((Some(_), None, _))) => Err("not streaming from the leader".into()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {:?}",
                self.db.inner.replica_timeout
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusing_node_is_tried_again_after_a_pause_that_doubles_to_a_second() {
        let ms = Duration::from_millis;
        let pauses: Vec<Duration> = (0..9).map(|n| pause_after(n, ms(25))).collect();
        assert_eq!(
            pauses,
            [0, 25, 50, 100, 200, 400, 800, 1000, 1000].map(ms),
            "none until refused, then the period doubling to MAX_PAUSE"
        );
        assert_eq!(pause_after(u32::MAX, ms(25)), MAX_PAUSE, "no overflow");
        assert_eq!(
            pause_after(3, ms(2000)),
            ms(2000),
            "never sooner than the period itself"
        );
    }
}
