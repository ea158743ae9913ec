//! The read-your-writes store: for each user, the primary's WAL position right after their
//! last write, kept for a TTL. A read for that user may use a replica only if the replica
//! has replayed that far. In-process for one instance; Redis when several share users.
//!
//! Positions only move forward (two devices writing at once cannot lower it), and every
//! failure is reported to the caller, which then reads from the primary: fail closed.

use crate::clock::Clock;
use crate::domain::UserId;
use crate::routing::freshness::Lsn;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
#[error("read-your-writes store unavailable: {0}")]
pub struct StoreUnavailable(String);

#[derive(Clone)]
pub enum RywStore {
    Local(Arc<Local>),
    Redis(Arc<RedisStore>),
}

/// A position and when it was written (clock ms).
#[derive(Debug, Clone, Copy)]
struct Entry {
    lsn: Lsn,
    written_ms: i64,
}

pub struct Local {
    clock: Arc<dyn Clock>,
    ttl: Duration,
    // A std Mutex: held for a map operation only, never across an await.
    map: Mutex<HashMap<UserId, Entry>>,
}

pub struct RedisStore {
    clock: Arc<dyn Clock>,
    ttl: Duration,
    /// Every write is also remembered here, so a write recorded while Redis was down
    /// still pins this instance's reads after Redis comes back without it.
    local: Local,
    conn: ConnectionManager,
    timeout: Duration,
    script: redis::Script,
    /// After a failure, calls fail at once until this moment (one probe every
    /// `BACKOFF`), so an outage costs requests microseconds, not a timeout each.
    down_until: Mutex<Option<std::time::Instant>>,
}

/// How long a failed Redis is left alone before the next call tries it again.
const BACKOFF: Duration = Duration::from_millis(500);

impl RedisStore {
    /// Runs one Redis call with the client timeout, behind the outage breaker.
    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreUnavailable> {
        let now = std::time::Instant::now();
        {
            let mut down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
            match *down {
                Some(until) if now < until => {
                    return Err(StoreUnavailable("recently failed; retrying shortly".into()));
                }
                // This call is the probe; the others keep failing fast until it answers.
                Some(_) => *down = Some(now + BACKOFF),
                None => {}
            }
        }
        let outcome = match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StoreUnavailable(e.to_string())),
            Err(_) => Err(StoreUnavailable("timed out".into())),
        };
        *self.down_until.lock().unwrap_or_else(|p| p.into_inner()) = match &outcome {
            Ok(_) => None,
            Err(_) => Some(std::time::Instant::now() + BACKOFF),
        };
        outcome
    }
}

/// Sets `lsn:written_ms` only if it moves the position forward; refreshes the expiry
/// either way. Atomic in Redis, so concurrent writers cannot lower the position.
const ADVANCE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur then
  local c = tonumber(string.match(cur, '^(%d+):'))
  if c and c > tonumber(ARGV[1]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2], 'PX', ARGV[3])
return 1
"#;

impl RywStore {
    pub fn local(clock: Arc<dyn Clock>, ttl: Duration) -> Self {
        RywStore::Local(Arc::new(Local {
            clock,
            ttl,
            map: Mutex::new(HashMap::new()),
        }))
    }

    /// Connects lazily: a Redis that is down at start only means reads go to the primary.
    pub fn redis(url: &str, clock: Arc<dyn Clock>, ttl: Duration) -> anyhow::Result<Self> {
        let client = redis::Client::open(url)?;
        let timeout = Duration::from_millis(100);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        let local = Local {
            clock: clock.clone(),
            ttl,
            map: Mutex::new(HashMap::new()),
        };
        Ok(RywStore::Redis(Arc::new(RedisStore {
            clock,
            ttl,
            local,
            conn,
            timeout,
            script: redis::Script::new(ADVANCE),
            down_until: Mutex::new(None),
        })))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            RywStore::Local(_) => "in_process",
            RywStore::Redis(_) => "redis",
        }
    }

    pub fn ttl(&self) -> Duration {
        match self {
            RywStore::Local(s) => s.ttl,
            RywStore::Redis(s) => s.ttl,
        }
    }

    /// Records that `user` wrote, and the primary was at `lsn` after the commit.
    pub async fn advance(&self, user: &UserId, lsn: Lsn) -> Result<(), StoreUnavailable> {
        match self {
            RywStore::Local(s) => {
                s.advance(user, lsn);
                Ok(())
            }
            RywStore::Redis(s) => {
                s.local.advance(user, lsn);
                let mut conn = s.conn.clone();
                let now = s.clock.now_ms();
                // Redis keeps the key a little longer than the TTL; expiry is decided by
                // our clock on read, so tests can move time.
                let px = s.ttl.as_millis() as u64 + 5_000;
                let mut invocation = s.script.key(key(user));
                invocation.arg(lsn).arg(now).arg(px);
                s.call(invocation.invoke_async::<i64>(&mut conn))
                    .await
                    .map(|_| ())
            }
        }
    }

    /// Records that each of `users` wrote, all at `lsn` (one order batch): one round trip.
    pub async fn advance_many(&self, users: &[&UserId], lsn: Lsn) -> Result<(), StoreUnavailable> {
        match self {
            RywStore::Local(s) => {
                users.iter().for_each(|u| s.advance(u, lsn));
                Ok(())
            }
            RywStore::Redis(s) => {
                users.iter().for_each(|u| s.local.advance(u, lsn));
                let mut conn = s.conn.clone();
                let now = s.clock.now_ms();
                let px = s.ttl.as_millis() as u64 + 5_000;
                let mut pipe = redis::pipe();
                pipe.load_script(&s.script).ignore();
                for u in users {
                    let mut invocation = s.script.key(key(u));
                    invocation.arg(lsn).arg(now).arg(px);
                    pipe.invoke_script(&invocation).ignore();
                }
                s.call(pipe.query_async::<()>(&mut conn)).await
            }
        }
    }

    /// The position `user` must be read at, if they wrote within the TTL.
    pub async fn get(&self, user: &UserId) -> Result<Option<Lsn>, StoreUnavailable> {
        match self {
            RywStore::Local(s) => Ok(s.get(user)),
            RywStore::Redis(s) => {
                let mut conn = s.conn.clone();
                let mut cmd = redis::cmd("GET");
                cmd.arg(key(user));
                let raw = s.call(cmd.query_async::<Option<String>>(&mut conn)).await?;
                let shared = match raw {
                    None => None,
                    Some(v) => Some(
                        parse_entry(&v)
                            .ok_or_else(|| StoreUnavailable(format!("unreadable entry {v:?}")))?,
                    ),
                };
                let shared = shared
                    .filter(|e| live(e, s.clock.now_ms(), s.ttl))
                    .map(|e| e.lsn);
                Ok(shared.max(s.local.get(user)))
            }
        }
    }

    /// The furthest position any of `users` must be read at (one round trip for all).
    pub async fn get_max(&self, users: &[&UserId]) -> Result<Option<Lsn>, StoreUnavailable> {
        match self {
            RywStore::Local(s) => Ok(users.iter().filter_map(|u| s.get(u)).max()),
            RywStore::Redis(s) => {
                if users.is_empty() {
                    return Ok(None);
                }
                let mut conn = s.conn.clone();
                let mut cmd = redis::cmd("MGET");
                for u in users {
                    cmd.arg(key(u));
                }
                let raw = s
                    .call(cmd.query_async::<Vec<Option<String>>>(&mut conn))
                    .await?;
                let now = s.clock.now_ms();
                let mut max = users.iter().filter_map(|u| s.local.get(u)).max();
                for v in raw.into_iter().flatten() {
                    let e = parse_entry(&v)
                        .ok_or_else(|| StoreUnavailable(format!("unreadable entry {v:?}")))?;
                    if live(&e, now, s.ttl) {
                        max = max.max(Some(e.lsn));
                    }
                }
                Ok(max)
            }
        }
    }

    /// Whether the store answers right now (for `/ops` and metrics).
    pub async fn healthy(&self) -> bool {
        match self {
            RywStore::Local(_) => true,
            RywStore::Redis(s) => {
                let mut conn = s.conn.clone();
                let cmd = redis::cmd("PING");
                s.call(cmd.query_async::<String>(&mut conn)).await.is_ok()
            }
        }
    }
}

impl Local {
    fn advance(&self, user: &UserId, lsn: Lsn) {
        let now = self.clock.now_ms();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let e = map.entry(user.clone()).or_insert(Entry {
            lsn,
            written_ms: now,
        });
        e.lsn = e.lsn.max(lsn);
        e.written_ms = now;
        // Keep the map bounded: drop expired entries now and then.
        if map.len() > 100_000 {
            map.retain(|_, e| live(e, now, self.ttl));
        }
    }

    fn get(&self, user: &UserId) -> Option<Lsn> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(user)
            .filter(|e| live(e, self.clock.now_ms(), self.ttl))
            .map(|e| e.lsn)
    }
}

fn live(e: &Entry, now_ms: i64, ttl: Duration) -> bool {
    now_ms - e.written_ms <= ttl.as_millis() as i64
}

fn key(user: &UserId) -> String {
    format!("stockgate:ryw:{user}")
}

fn parse_entry(v: &str) -> Option<Entry> {
    let (lsn, ms) = v.split_once(':')?;
    Some(Entry {
        lsn: lsn.parse().ok()?,
        written_ms: ms.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn user(s: &str) -> UserId {
        UserId::parse(s).expect("valid id")
    }

    #[tokio::test]
    async fn positions_only_move_forward_and_expire_after_the_ttl() {
        let clock = ManualClock::new();
        let store = RywStore::local(clock.clone(), Duration::from_secs(60));
        let ada = user("ada");
        assert_eq!(store.get(&ada).await.ok().flatten(), None);
        store
            .advance(&ada, 500)
            .await
            .expect("local store never fails");
        store
            .advance(&ada, 300)
            .await
            .expect("local store never fails");
        assert_eq!(store.get(&ada).await.ok().flatten(), Some(500));
        clock.advance(Duration::from_secs(59));
        assert_eq!(store.get(&ada).await.ok().flatten(), Some(500));
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.get(&ada).await.ok().flatten(), None);
    }
}
