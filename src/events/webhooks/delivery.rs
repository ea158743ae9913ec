//! The delivery worker, one per instance: it leases webhooks on the primary and sends each
//! leased webhook's events in feed order, one `POST` at a time, retrying the same event with
//! a capped backoff until a 2xx.
//!
//! **One deliverer per webhook.** The lease is a session advisory lock
//! (`LOCK_SPACE`, `lock_key`) taken on one primary connection that the worker keeps for
//! itself (detached from the pool). Every statement about a leased webhook — reading its
//! events, recording an outcome — runs on that same session, so a statement that succeeds
//! proves the lease was still held; if the connection fails, the worker drops it (and with
//! it every lease and every attempt in flight) and starts over, and the server releases the
//! locks when the session ends, so another instance takes over. No transaction is ever open:
//! a delivery may take 10 s, and the primary ends a session idle in a transaction after 10 s.
//!
//! **A frozen holder loses its lease.** A process that stops (SIGSTOP, a VM paused, a runtime
//! starved) keeps its TCP connection: the server would see an idle session for ever and keep
//! its locks. So the lease session carries `idle_session_timeout` ([`LEASE_IDLE_TIMEOUT`]):
//! the server ends it after that long without a word, which releases the locks, and another
//! instance takes the webhooks at its next tick. A live worker speaks on the session at every
//! tick ([`TICK`], `take_one_free`'s query), far more often; an attempt in flight runs beside
//! the ticks, never instead of them, so a 10 s delivery does not leave the session idle. A
//! holder that wakes up finds its session gone at its next statement and drops everything; so
//! that it does not first start a `POST` the new holder may be sending too, an attempt goes
//! out only within half the timeout of the start of the round whose statement proved the
//! lease (the server cannot have ended the session before a full timeout after it).
//!
//! **At least once, never ahead.** The cursor is persisted after each 2xx, before the next
//! event is sent; a new holder reads it only after taking the lock, so it resumes at the
//! first event not yet recorded as delivered. An event delivered whose record was lost (a
//! crash between the 2xx and the `UPDATE`) is sent again: the receiver sees that cursor twice.

use super::snapshot::CreationSnapshot;
use super::{lost, signature};
use crate::events::{Cursor, Event, feed};
use crate::metrics::Metrics;
use crate::routing::{Db, DbError};
use futures::FutureExt;
use futures::future::{AbortHandle, Abortable, Aborted, BoxFuture};
use futures::stream::{FuturesUnordered, StreamExt};
use sqlx::{PgConnection, Row};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use uuid::Uuid;

/// The first key of every webhook lease (`pg_try_advisory_lock(LOCK_SPACE, lock_key)`), so
/// webhook leases cannot collide with any other advisory lock.
const LOCK_SPACE: i32 = 0x5748_4B53; // "WHKS"
/// How often the worker looks for new events, new and deleted webhooks, and due retries.
const TICK: Duration = Duration::from_millis(200);
/// A delivery without an answer in this long has failed (contract, "Webhooks").
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a round of the worker's statements may take before the connection is given up.
const DB_TIMEOUT: Duration = Duration::from_secs(5);
/// The lease session's `idle_session_timeout`: a holder silent this long (frozen) loses its
/// leases. Fifteen ticks: a live worker never comes near it.
pub const LEASE_IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// Events read ahead per webhook (the feed below the horizon never changes, so they keep).
const PAGE: i64 = 100;
/// How often the backlog gauge is sampled, and the most it counts.
const BACKLOG_EVERY: Duration = Duration::from_secs(1);
const BACKLOG_CAP: i64 = 10_000;
/// The backoff after the first failure, and the most it grows to.
const FIRST_RETRY: Duration = Duration::from_millis(500);
const MAX_RETRY: Duration = Duration::from_secs(60);

/// How long to wait before retrying an event that has failed `failures` times in a row:
/// 0.5 s, doubling, at most 60 s.
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST_RETRY.saturating_mul(1 << doublings).min(MAX_RETRY)
}

/// Stops the worker when dropped (with the application): its connection closes, so its
/// leases go to another instance.
pub struct DeliveryGuard(JoinHandle<()>);

impl Drop for DeliveryGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts this instance's delivery worker.
pub fn start(db: Db, metrics: Metrics) -> DeliveryGuard {
    let client = reqwest::Client::builder()
        .timeout(DELIVERY_TIMEOUT)
        // A redirect is not a delivery: the 3xx is the answer, and it is retried.
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("stockgate-webhooks/", env!("CARGO_PKG_VERSION")))
        .build()
        .unwrap_or_default();
    let worker = Worker {
        db,
        metrics,
        client,
        lease: None,
        sending: FuturesUnordered::new(),
        round_started: Instant::now(),
    };
    DeliveryGuard(tokio::spawn(worker.run()))
}

/// A leased webhook, as this worker knows it.
struct Hook {
    key: i32,
    label: String,
    url: String,
    secret: String,
    types: Vec<String>,
    /// What its creation saw: events of transactions it saw end are not sent (`None`: a
    /// webhook from before this was recorded).
    created: Option<CreationSnapshot>,
    /// The last event recorded as delivered.
    delivered: Cursor,
    /// Where the next page is read after: the last event read, sent or skipped.
    read_to: Cursor,
    /// Failed attempts at the next event since the last delivery (the backoff grows with it).
    failures: u32,
    /// No attempt before this.
    due: Instant,
    /// The next events after `delivered`, read ahead; the front one is the next to send.
    ahead: VecDeque<Event>,
    /// The attempt in flight, if any (at most one per webhook).
    sending: Option<AbortHandle>,
}

/// The worker's primary session and the webhooks it holds the lock of.
struct Lease {
    conn: PgConnection,
    hooks: HashMap<Uuid, Hook>,
    backlog_sampled: Option<Instant>,
}

/// An attempt's outcome.
struct Sent {
    id: Uuid,
    cursor: Cursor,
    outcome: Outcome,
}

enum Outcome {
    /// A 2xx.
    Delivered,
    /// Anything else, and why.
    Failed(String),
    /// Not sent: the lease was last proven too long ago (the worker was frozen or starved
    /// in between). The next tick proves it again, or finds it gone.
    NotSent,
}

struct Worker {
    db: Db,
    metrics: Metrics,
    client: reqwest::Client,
    lease: Option<Lease>,
    sending: FuturesUnordered<Abortable<BoxFuture<'static, Sent>>>,
    /// When the current round began: its statements were sent after it, so the server
    /// cannot end the session before [`LEASE_IDLE_TIMEOUT`] after it.
    round_started: Instant,
}

/// What woke the worker.
enum Wake {
    Tick,
    Sent(Result<Sent, Aborted>),
}

impl Worker {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let wake = tokio::select! {
                _ = tick.tick() => Wake::Tick,
                Some(done) = self.sending.next(), if !self.sending.is_empty() => Wake::Sent(done),
            };
            self.round_started = Instant::now();
            let round = match wake {
                Wake::Tick => tokio::time::timeout(DB_TIMEOUT, self.tick()).await,
                // An attempt abandoned (its webhook deleted) has nothing to record.
                Wake::Sent(Err(Aborted)) => continue,
                Wake::Sent(Ok(sent)) => tokio::time::timeout(DB_TIMEOUT, self.record(sent))
                    .await
                    .map(|r| r.map_err(DbError::from)),
            };
            let failed = match round {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer from the primary in {DB_TIMEOUT:?}"),
            };
            if self.lease.is_some() {
                tracing::warn!(error = %failed, "webhook lease connection lost; leases dropped, retaking them");
            } else {
                tracing::debug!(error = %failed, "no primary connection for webhook delivery yet");
            }
            self.drop_lease();
        }
    }

    /// Lets every lease go: the attempts in flight are abandoned (the session that proved the
    /// lease is gone), and closing the connection releases the locks on the server.
    fn drop_lease(&mut self) {
        if let Some(lease) = self.lease.take() {
            for hook in lease.hooks.values() {
                self.forget_gauge(hook);
            }
        }
        self.sending = FuturesUnordered::new();
    }

    fn forget_gauge(&self, hook: &Hook) {
        let _ = self
            .metrics
            .webhook_backlog
            .remove_label_values(&[&hook.label]);
    }

    /// One round: (re)connect, let deleted webhooks go, take a free one, sample the backlog,
    /// and start the due attempts.
    async fn tick(&mut self) -> Result<(), DbError> {
        if self.lease.is_none() {
            let mut conn = self.db.primary().acquire().await?.detach();
            // `false`: for the session, not this (implicit) transaction.
            sqlx::query("SELECT set_config('idle_session_timeout', $1, false)")
                .bind(format!("{}ms", LEASE_IDLE_TIMEOUT.as_millis()))
                .execute(&mut conn)
                .await?;
            self.lease = Some(Lease {
                conn,
                hooks: HashMap::new(),
                backlog_sampled: None,
            });
        }
        for hook in self.let_go_of_deleted().await? {
            self.forget_gauge(&hook);
        }
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        lease.take_one_free().await?;
        lease.sample_backlog(&self.metrics).await?;
        let ids: Vec<Uuid> = lease.hooks.keys().copied().collect();
        for id in ids {
            self.send_next(id).await?;
        }
        Ok(())
    }

    /// Releases the leased webhooks that were deleted; returns them.
    async fn let_go_of_deleted(&mut self) -> Result<Vec<Hook>, sqlx::Error> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(vec![]);
        };
        if lease.hooks.is_empty() {
            return Ok(vec![]);
        }
        let held: Vec<Uuid> = lease.hooks.keys().copied().collect();
        let live: Vec<Uuid> = sqlx::query_scalar(
            "SELECT webhook_id FROM webhooks WHERE webhook_id = ANY($1) AND deleted_at IS NULL",
        )
        .bind(&held)
        .fetch_all(&mut lease.conn)
        .await?;
        let mut gone = Vec::new();
        for id in held.into_iter().filter(|id| !live.contains(id)) {
            if let Some(hook) = lease.release(id).await? {
                tracing::info!(webhook = %id, "webhook deleted; delivery stopped");
                gone.push(hook);
            }
        }
        Ok(gone)
    }

    /// Starts the attempt at `id`'s next event, if it is due and none is in flight.
    async fn send_next(&mut self, id: Uuid) -> Result<(), sqlx::Error> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let Some(hook) = lease.hooks.get_mut(&id) else {
            return Ok(());
        };
        if hook.sending.is_some() || hook.due > Instant::now() {
            return Ok(());
        }
        while hook.ahead.is_empty() {
            let page = feed::read(&mut lease.conn, hook.read_to, PAGE, Some(&hook.types)).await?;
            // Everything read before was sent: what the purge took beyond it is lost.
            lost::reconcile(&mut lease.conn, id, hook.read_to, &page).await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            hook.read_to = last.cursor;
            let created = hook.created.as_ref();
            hook.ahead = page
                .into_iter()
                .filter(|e| !created.is_some_and(|c| c.saw(e.cursor.xid)))
                .collect();
        }
        let Some(event) = hook.ahead.front().cloned() else {
            return Ok(());
        };
        let attempt = attempt(
            self.client.clone(),
            hook.url.clone(),
            hook.secret.clone(),
            event,
            self.round_started + LEASE_IDLE_TIMEOUT / 2,
        )
        .map(move |(cursor, outcome)| Sent {
            id,
            cursor,
            outcome,
        })
        .boxed();
        let (handle, registration) = AbortHandle::new_pair();
        self.sending.push(Abortable::new(attempt, registration));
        hook.sending = Some(handle);
        Ok(())
    }

    /// Records an attempt's outcome on the lease's session, then goes on with the next event
    /// at once after a success, or after the backoff after a failure.
    async fn record(&mut self, sent: Sent) -> Result<(), sqlx::Error> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let Some(hook) = lease.hooks.get_mut(&sent.id) else {
            return Ok(());
        };
        hook.sending = None;
        let label = hook.label.clone();
        match sent.outcome {
            Outcome::NotSent => Ok(()),
            Outcome::Delivered => {
                debug_assert_eq!(hook.ahead.front().map(|e| e.cursor), Some(sent.cursor));
                hook.ahead.pop_front();
                hook.delivered = sent.cursor;
                hook.failures = 0;
                hook.due = Instant::now();
                let recorded = lease.record_delivered(sent.id, sent.cursor).await?;
                self.metrics
                    .webhook_delivered
                    .with_label_values(&[&label])
                    .inc();
                if !recorded {
                    if let Some(hook) = lease.release(sent.id).await? {
                        self.forget_gauge(&hook);
                    }
                    return Ok(());
                }
                self.send_next(sent.id).await
            }
            Outcome::Failed(why) => {
                hook.failures = hook.failures.saturating_add(1);
                let (failures, wait) = (hook.failures, backoff(hook.failures));
                hook.due = Instant::now() + wait;
                lease.record_failure(sent.id, failures, &why, wait).await?;
                self.metrics
                    .webhook_failures
                    .with_label_values(&[&label])
                    .inc();
                tracing::info!(webhook = %sent.id, cursor = %sent.cursor, failures, retry_in_ms = wait.as_millis() as u64, error = %why, "webhook delivery failed; the same event will be retried");
                Ok(())
            }
        }
    }
}

impl Lease {
    /// Takes the lock of one webhook no instance holds (a random one, so instances share
    /// them out), then reads where its delivery stands: only now, under the lock, so the
    /// previous holder's last record is in what is read.
    async fn take_one_free(&mut self) -> Result<(), sqlx::Error> {
        let held: Vec<Uuid> = self.hooks.keys().copied().collect();
        let free: Option<(Uuid, i32)> = sqlx::query_as(
            "SELECT w.webhook_id, w.lock_key FROM webhooks w \
             WHERE w.deleted_at IS NULL AND NOT (w.webhook_id = ANY($1)) \
               AND NOT EXISTS (SELECT 1 FROM pg_locks l \
                               WHERE l.locktype = 'advisory' AND l.objsubid = 2 \
                                 AND l.database = (SELECT oid FROM pg_database \
                                                   WHERE datname = current_database()) \
                                 AND l.classid = $2::oid AND l.objid = w.lock_key::oid) \
             ORDER BY random() LIMIT 1",
        )
        .bind(&held)
        .bind(LOCK_SPACE)
        .fetch_optional(&mut self.conn)
        .await?;
        let Some((id, key)) = free else {
            return Ok(());
        };
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(LOCK_SPACE)
            .bind(key)
            .fetch_one(&mut self.conn)
            .await?;
        if !locked {
            return Ok(());
        }
        let row = sqlx::query(
            "SELECT webhook_id, url, secret, types, delivered_xid::text::int8 AS xid, delivered_n, failures, \
                    created_snapshot::text AS created_snapshot, \
                    greatest(extract(epoch FROM next_attempt_at - now()), 0)::float8 AS wait_s \
             FROM webhooks WHERE webhook_id = $1 AND deleted_at IS NULL",
        )
        .bind(id)
        .fetch_optional(&mut self.conn)
        .await?;
        let Some(row) = row else {
            unlock(&mut self.conn, key).await?;
            return Ok(());
        };
        let hook = hook_of(&row, key)?;
        tracing::info!(webhook = %id, delivered = %hook.delivered, "webhook leased; delivering");
        self.hooks.insert(id, hook);
        Ok(())
    }

    /// Records `cursor` as `id`'s last delivery; `false` if the webhook was deleted.
    async fn record_delivered(&mut self, id: Uuid, cursor: Cursor) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE webhooks SET delivered_xid = $2::text::xid8, delivered_n = $3, \
                    failures = 0, next_attempt_at = now() \
             WHERE webhook_id = $1 AND deleted_at IS NULL",
        )
        .bind(id)
        .bind(cursor.xid.to_string())
        .bind(cursor.n)
        .execute(&mut self.conn)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records a failed attempt: the count since the last delivery, why, and when to retry.
    async fn record_failure(
        &mut self,
        id: Uuid,
        failures: u32,
        why: &str,
        wait: Duration,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE webhooks SET failures = $2, last_error = $3, \
                    next_attempt_at = now() + make_interval(secs => $4) \
             WHERE webhook_id = $1 AND deleted_at IS NULL",
        )
        .bind(id)
        .bind(i32::try_from(failures).unwrap_or(i32::MAX))
        .bind(why)
        .bind(wait.as_secs_f64())
        .execute(&mut self.conn)
        .await?;
        Ok(())
    }

    /// Gives up `id`'s lease, abandoning its attempt in flight.
    async fn release(&mut self, id: Uuid) -> Result<Option<Hook>, sqlx::Error> {
        let Some(hook) = self.hooks.remove(&id) else {
            return Ok(None);
        };
        if let Some(attempt) = &hook.sending {
            attempt.abort();
        }
        unlock(&mut self.conn, hook.key).await?;
        Ok(Some(hook))
    }

    /// Sets each leased webhook's backlog gauge: the events of its types after its delivered
    /// cursor, counted up to [`BACKLOG_CAP`], once every [`BACKLOG_EVERY`]. A row of order
    /// ids (one type, `k` events) is counted by its positions, not written out as JSON.
    async fn sample_backlog(&mut self, metrics: &Metrics) -> Result<(), sqlx::Error> {
        if self.hooks.is_empty()
            || self
                .backlog_sampled
                .is_some_and(|t| t.elapsed() < BACKLOG_EVERY)
        {
            return Ok(());
        }
        self.backlog_sampled = Some(Instant::now());
        let held: Vec<Uuid> = self.hooks.keys().copied().collect();
        let rows: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT w.webhook_id, \
                    (SELECT count(*) FROM (SELECT 1 FROM event_rows e \
                                           CROSS JOIN LATERAL ( \
                                               SELECT x.i, x.item->>'type' AS type \
                                                 FROM json_array_elements(e.items) WITH ORDINALITY x(item, i) \
                                               UNION ALL \
                                               SELECT g.i, e.types[1] FROM generate_series(1, e.k) g(i) \
                                                WHERE e.orders IS NOT NULL) x \
                                           WHERE (e.xid, e.n) >= (w.delivered_xid, w.delivered_n / 65536) \
                                             AND (e.xid, e.n * 65536 + x.i) > (w.delivered_xid, w.delivered_n) \
                                             AND e.types && w.types \
                                             AND x.type = ANY(w.types) LIMIT $2) b) \
             FROM webhooks w WHERE w.webhook_id = ANY($1)",
        )
        .bind(&held)
        .bind(BACKLOG_CAP)
        .fetch_all(&mut self.conn)
        .await?;
        for (id, backlog) in rows {
            if let Some(hook) = self.hooks.get(&id) {
                metrics
                    .webhook_backlog
                    .with_label_values(&[&hook.label])
                    .set(backlog);
            }
        }
        Ok(())
    }
}

/// A webhook just leased, from its row.
fn hook_of(row: &sqlx::postgres::PgRow, key: i32) -> Result<Hook, sqlx::Error> {
    let id: Uuid = row.try_get("webhook_id")?;
    let wait = Duration::try_from_secs_f64(row.try_get("wait_s")?).unwrap_or_default();
    let created = row
        .try_get::<Option<String>, _>("created_snapshot")?
        .map(|s| CreationSnapshot::parse(&s))
        .transpose()
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let delivered = Cursor {
        xid: u64::try_from(row.try_get::<i64, _>("xid")?).unwrap_or(0),
        n: row.try_get("delivered_n")?,
    };
    Ok(Hook {
        key,
        label: id.to_string(),
        url: row.try_get("url")?,
        secret: row.try_get("secret")?,
        types: row.try_get("types")?,
        created,
        delivered,
        read_to: delivered,
        failures: u32::try_from(row.try_get::<i32, _>("failures")?).unwrap_or(0),
        due: Instant::now() + wait.min(MAX_RETRY),
        ahead: VecDeque::new(),
        sending: None,
    })
}

async fn unlock(conn: &mut PgConnection, key: i32) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_unlock($1, $2)")
        .bind(LOCK_SPACE)
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

/// One `POST` of `event` to `url`, signed with `secret`, if it can start before `send_by`
/// (see the module: a lease proven too long ago may have passed to another instance): the
/// event's cursor and how it went, a 2xx within [`DELIVERY_TIMEOUT`] being a delivery.
async fn attempt(
    client: reqwest::Client,
    url: String,
    secret: String,
    event: Event,
    send_by: Instant,
) -> (Cursor, Outcome) {
    if Instant::now() >= send_by {
        return (event.cursor, Outcome::NotSent);
    }
    let outcome = match post(&client, &url, secret.as_bytes(), &event).await {
        Ok(()) => Outcome::Delivered,
        Err(why) => Outcome::Failed(why),
    };
    (event.cursor, outcome)
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    secret: &[u8],
    event: &Event,
) -> Result<(), String> {
    let body = serde_json::to_vec(event).map_err(|e| format!("event not serialisable: {e}"))?;
    let t = chrono::Utc::now().timestamp();
    let answer = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("Stockgate-Event-Cursor", event.cursor.to_string())
        .header("Stockgate-Signature", signature(secret, t, &body))
        .body(body)
        .send()
        .await
        .map_err(describe)?;
    let status = answer.status();
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("answered {status}"))
    }
}

/// Why a request got no answer, in a sentence (without the URL, which the caller knows).
fn describe(e: reqwest::Error) -> String {
    let what = if e.is_timeout() {
        format!("no answer within {} s", DELIVERY_TIMEOUT.as_secs())
    } else if e.is_connect() {
        "could not connect".to_string()
    } else {
        "the request failed".to_string()
    };
    let mut why = what;
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        why.push_str(": ");
        why.push_str(&s.to_string());
        source = s.source();
    }
    why.chars().take(500).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_half_a_second_to_a_minute() {
        let ms = |f| backoff(f).as_millis();
        assert_eq!(
            (1..=9).map(ms).collect::<Vec<_>>(),
            [
                500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000
            ]
        );
        assert_eq!(ms(0), 500);
        assert_eq!(ms(u32::MAX), 60_000);
    }
}
