//! Reading the feed: a page of events behind a cursor, below the reading snapshot's horizon;
//! the retention purge; and the one per-instance watcher that wakes long-polls.

use super::horizon::XidClock;
use super::{Cursor, Event};
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::routing::{Db, DbError};
use sqlx::Row;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

/// A page of the feed and the snapshot it was read in: `xmin` and `xmax` say which
/// transactions the page could not include yet (see [`super::horizon`]).
pub struct Page {
    pub events: Vec<Event>,
    pub xmin: u64,
    pub xmax: u64,
}

/// Up to `limit` events after `after`, in feed order, of the `types` given (every type when
/// `None`), that no later commit can precede: those of rows whose transaction id is below the
/// reading snapshot's `xmin` (see the module above). `exec` may be the primary or a replica.
/// The rows are found first by their event counts (`k`), then opened, so a page opens only
/// the rows it returns events from: a row holds a whole batch's events.
pub async fn read<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    after: Cursor,
    limit: i64,
    types: Option<&[String]>,
) -> Result<Vec<Event>, sqlx::Error> {
    Ok(read_page(exec, after, limit, types).await?.events)
}

/// [`read`], with the snapshot's `xmin` and `xmax`, taken in the same statement: one
/// snapshot decides both what the page holds and what it held back.
pub async fn read_page<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    after: Cursor,
    limit: i64,
    types: Option<&[String]>,
) -> Result<Page, sqlx::Error> {
    let rows = sqlx::query(
        "WITH s AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin, \
                           pg_snapshot_xmax(pg_current_snapshot()) AS xmax), \
              r AS (SELECT e.xid, e.n, e.at, e AS ev, \
                           sum(e.k) OVER (ORDER BY e.xid, e.n ROWS UNBOUNDED PRECEDING) - e.k AS before \
                    FROM event_rows e \
                    WHERE (e.xid, e.n) >= ($1::text::xid8, $2 / 65536) \
                      AND (e.xid, e.n * 65536 + e.k) > ($1::text::xid8, $2) \
                      AND e.xid < (SELECT xmin FROM s) \
                      AND ($4::text[] IS NULL OR e.types && $4) \
                    ORDER BY e.xid, e.n LIMIT greatest($3, 2)), \
              page AS (SELECT r.xid::text::int8 AS xid, r.n * 65536 + x.i AS pos, \
                              x.item->>'type' AS type, r.at, x.item->'data' AS data \
                       FROM r CROSS JOIN LATERAL json_array_elements(event_items(r.ev)) WITH ORDINALITY AS x(item, i) \
                       WHERE ($4::text[] IS NOT NULL OR r.before < $3) \
                         AND (r.xid, r.n * 65536 + x.i) > ($1::text::xid8, $2) \
                         AND ($4::text[] IS NULL OR x.item->>'type' = ANY($4)) \
                       ORDER BY r.xid, r.n, x.i LIMIT $3) \
         SELECT s.xmin::text::int8 AS snap_xmin, s.xmax::text::int8 AS snap_xmax, page.* \
         FROM s LEFT JOIN page ON true ORDER BY page.xid, page.pos",
    )
    .bind(after.xid.to_string())
    .bind(after.n)
    .bind(limit)
    .bind(types)
    .fetch_all(exec)
    .await?;
    let xid = |r: &sqlx::postgres::PgRow, col: &str| -> Result<u64, sqlx::Error> {
        Ok(u64::try_from(r.try_get::<i64, _>(col)?).unwrap_or(0))
    };
    let (xmin, xmax) = match rows.first() {
        Some(r) => (xid(r, "snap_xmin")?, xid(r, "snap_xmax")?),
        None => return Err(sqlx::Error::RowNotFound),
    };
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        // The one row of an empty page carries only the snapshot.
        if r.try_get::<Option<i64>, _>("xid")?.is_none() {
            continue;
        }
        events.push(Event {
            cursor: Cursor {
                xid: xid(r, "xid")?,
                n: r.try_get("pos")?,
            },
            kind: r.try_get("type")?,
            at: r.try_get("at")?,
            data: r.try_get("data")?,
        });
    }
    Ok(Page { events, xmin, xmax })
}

/// The newest event a read could serve now ([`Cursor::START`]: none): where a reader that
/// wants only what comes next starts.
pub async fn newest<'e>(exec: impl sqlx::PgExecutor<'e>) -> Result<Cursor, sqlx::Error> {
    let row: Option<(i64, i64)> = sqlx::query_as(
        "SELECT xid::text::int8, n * 65536 + k FROM event_rows \
         WHERE xid < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY event_rows.xid DESC, event_rows.n DESC LIMIT 1",
    )
    .fetch_optional(exec)
    .await?;
    Ok(row.map_or(Cursor::START, |(xid, pos)| Cursor {
        xid: u64::try_from(xid).unwrap_or(0),
        n: pos,
    }))
}

/// The newest position the retention purge removed ([`Cursor::START`]: none). A cursor
/// before it may have missed events: 410 `CURSOR_EXPIRED`.
pub async fn purged_through<'e>(exec: impl sqlx::PgExecutor<'e>) -> Result<Cursor, sqlx::Error> {
    let row: Option<(i64, i64)> = sqlx::query_as("SELECT xid::text::int8, pos FROM events_purged")
        .fetch_optional(exec)
        .await?;
    Ok(row.map_or(Cursor::START, |(xid, n)| Cursor {
        xid: u64::try_from(xid).unwrap_or(0),
        n,
    }))
}

/// Removes up to `batch` of the oldest rows of events written before `retention` ago, in
/// feed order, and records the newest position removed (on the primary). Returns how many
/// events went.
pub async fn purge<'e>(
    primary: impl sqlx::PgExecutor<'e>,
    retention: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let gone: Option<(i64,)> = sqlx::query_as(
        "WITH old AS (SELECT xid, n FROM event_rows WHERE at < now() - make_interval(secs => $1) \
                      ORDER BY xid, n LIMIT $2), \
              gone AS (DELETE FROM event_rows e USING old WHERE (e.xid, e.n) = (old.xid, old.n) \
                       RETURNING e.xid, e.n, e.k), \
              newest AS (SELECT xid, n * 65536 + k AS pos FROM gone ORDER BY xid DESC, n DESC LIMIT 1), \
              noted AS (INSERT INTO events_purged (xid, pos) SELECT xid, pos FROM newest \
                        ON CONFLICT (one) DO UPDATE SET xid = EXCLUDED.xid, pos = EXCLUDED.pos \
                        WHERE (events_purged.xid, events_purged.pos) < (EXCLUDED.xid, EXCLUDED.pos)) \
         SELECT coalesce(sum(k), 0)::int8 FROM gone",
    )
    .bind(retention.as_secs_f64())
    .bind(batch)
    .fetch_optional(primary)
    .await?;
    Ok(gone.map_or(0, |(count,)| u64::try_from(count).unwrap_or(0)))
}

/// What the watcher sees on the primary at one look.
struct Look {
    /// The newest event a read can serve now.
    newest: Cursor,
    /// How many events entered the feed since the previous look's `newest`.
    entered: i64,
    /// The newest servable event's age behind the newest written (the feed's lag: how long a
    /// long transaction has held the horizon back).
    lag: f64,
    /// The next transaction id the primary will assign (read after the look was sent).
    next_xid: u64,
}

async fn horizon(db: &Db, before: Cursor) -> Result<Look, DbError> {
    let pool = db.primary().pool()?;
    let newest = newest(pool).await?;
    let (entered, lag, next_xid): (Option<i64>, Option<f64>, i64) = sqlx::query_as(
        "SELECT (SELECT sum(k)::int8 FROM event_rows \
                  WHERE (xid, n) > ($1::text::xid8, $2 / 65536) AND (xid, n) <= ($3::text::xid8, $4 / 65536)), \
                extract(epoch FROM (SELECT at FROM event_rows ORDER BY xid DESC, n DESC LIMIT 1) \
                       - (SELECT at FROM event_rows WHERE (xid, n) = ($3::text::xid8, $4 / 65536)))::float8, \
                pg_snapshot_xmax(pg_current_snapshot())::text::int8",
    )
    .bind(before.xid.to_string())
    .bind(before.n)
    .bind(newest.xid.to_string())
    .bind(newest.n)
    .fetch_one(pool)
    .await?;
    Ok(Look {
        newest,
        entered: entered.unwrap_or(0),
        lag: lag.unwrap_or(0.0).max(0.0),
        next_xid: u64::try_from(next_xid).unwrap_or(0),
    })
}

/// One round of the retention purge on the primary, logged.
async fn purge_past(db: &Db, retention: Duration) {
    let purged = match db.primary().pool() {
        Ok(pool) => purge(pool, retention, PURGE_BATCH)
            .await
            .map_err(DbError::from),
        Err(e) => Err(e),
    };
    match purged {
        Ok(0) => {}
        Ok(n) => tracing::info!(events = n, "purged events past retention"),
        Err(e) => tracing::warn!(error = %e, "event purge failed; retrying later"),
    }
}

/// This instance's feed: the watcher that long-polls wait on, and the retention purge.
#[derive(Clone)]
pub struct Feed {
    /// The newest servable event the watcher saw, and the primary's position just after
    /// (a replica that has replayed it can serve that event).
    newest: Arc<watch::Sender<(Cursor, Option<Lsn>)>>,
    /// The primary's next transaction id, sampled at every look: dates what a read's
    /// snapshot held back ([`super::horizon`]).
    xids: Arc<Mutex<XidClock>>,
    retention: Duration,
}

/// Stops the feed's background task when dropped (with the application).
pub struct FeedGuard(tokio::task::JoinHandle<()>);

impl Drop for FeedGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How often the watcher looks at the horizon (and samples the metrics) while a long-poll
/// waits; how often otherwise.
const WATCH_TICK: Duration = Duration::from_millis(50);
const IDLE_TICK: Duration = Duration::from_millis(250);
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// How often the purge runs for `retention`: once a minute, or four times per retention when
/// that is shorter, so no event outlives a short retention by more than a quarter of it.
fn purge_period(retention: Duration) -> Duration {
    PURGE_EVERY
        .min(retention / 4)
        .max(Duration::from_millis(100))
}
const PURGE_BATCH: i64 = 10_000;

impl Feed {
    /// Starts the one watcher of this instance: one query of the primary's horizon per tick
    /// (every 50 ms while a long-poll waits, every second otherwise), whatever the number of
    /// waiting clients; and the purge of events past `retention`, once a minute (or four times
    /// per retention, if shorter).
    pub fn start(db: Db, metrics: Metrics, retention: Duration) -> (Feed, FeedGuard) {
        let tx = Arc::new(watch::Sender::new((Cursor::START, None)));
        let newest = tx.clone();
        let xids = Arc::new(Mutex::new(XidClock::new(distant_past())));
        let sampled = xids.clone();
        let task = tokio::spawn(async move {
            let mut last_purge: Option<tokio::time::Instant> = None;
            let mut seen: Option<Cursor> = None;
            loop {
                let sent_at = Instant::now();
                match horizon(&db, seen.unwrap_or(Cursor::START)).await {
                    Ok(Look {
                        newest: cursor,
                        entered,
                        lag,
                        next_xid,
                    }) => {
                        lock(&sampled).observe(sent_at, next_xid);
                        if tx.borrow().0 != cursor {
                            let at = db.primary().current_lsn().await.ok();
                            tx.send_replace((cursor, at));
                        }
                        // The first look only finds where the feed stands.
                        if seen.is_some() {
                            metrics
                                .events_written
                                .inc_by(u64::try_from(entered).unwrap_or(0));
                        }
                        seen = Some(cursor);
                        metrics.event_feed_lag.set(lag);
                    }
                    Err(e) => tracing::debug!(error = %e, "event horizon unavailable"),
                }
                if last_purge.is_none_or(|t| t.elapsed() >= purge_period(retention)) {
                    last_purge = Some(tokio::time::Instant::now());
                    purge_past(&db, retention).await;
                }
                let tick = if tx.receiver_count() > 0 {
                    WATCH_TICK
                } else {
                    IDLE_TICK
                };
                tokio::time::sleep(tick).await;
            }
        });
        (
            Feed {
                newest,
                xids,
                retention,
            },
            FeedGuard(task),
        )
    }

    /// How late the `as_of` of a page read in a snapshot with `xmin` and `xmax` may be
    /// (`None`: the snapshot held nothing back).
    pub fn bound(&self, xmin: u64, xmax: u64) -> Option<Instant> {
        lock(&self.xids).bound(xmin, xmax)
    }

    /// How long events are kept at least.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// A waiter on the newest servable event: `changed()` wakes when it moves.
    pub fn subscribe(&self) -> watch::Receiver<(Cursor, Option<Lsn>)> {
        self.newest.subscribe()
    }
}

fn lock(xids: &Mutex<XidClock>) -> MutexGuard<'_, XidClock> {
    // The samples stay consistent whatever a panicking holder did: each update is one push.
    xids.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The Unix epoch on the monotonic clock: what a transaction open since before this instance
/// started is dated by, since nothing later can be vouched for.
fn distant_past() -> Instant {
    let since_epoch = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    Instant::now()
        .checked_sub(since_epoch)
        .or_else(|| Instant::now().checked_sub(Duration::from_secs(365 * 86_400)))
        .expect("the monotonic clock reaches a year back")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_runs_once_a_minute_or_four_times_per_short_retention() {
        assert_eq!(purge_period(Duration::from_secs(7 * 86_400)), PURGE_EVERY);
        assert_eq!(purge_period(Duration::from_secs(240)), PURGE_EVERY);
        assert_eq!(
            purge_period(Duration::from_secs(10)),
            Duration::from_millis(2500)
        );
        assert_eq!(purge_period(Duration::ZERO), Duration::from_millis(100));
    }
}
