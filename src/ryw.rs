//! The read-your-writes store: for each user, the primary's WAL position right after their
//! last write, kept for a TTL. A read for that user may use a replica only if the replica
//! has replayed that far. In-process for one instance; Redis when several share users.
//!
//! Positions only move forward (two devices writing at once cannot lower it), and every
//! failure is reported to the caller, which then reads from the primary: fail closed.
//!
//! Expiry runs on one clock per store: Redis's own `PX` for the shared store (no writer's
//! wall clock is compared with a reader's), the injected monotonic [`Clock`] in process.
//!
//! A Redis that restarts — empty, or from a dump older than the latest positions — forgets
//! positions that still matter. So the store carries an *epoch* naming the server run that
//! issued it (`run_id:random`), read in the same round trip (one script) as the positions.
//! The first read that finds it missing or issued by another run replaces it and sets a
//! `pin-all` key that lives one TTL (Redis's `PX`): while it exists every user's reads go to
//! the primary, on every instance, including ones started after the restart. An instance
//! that sees the epoch change under it pins everyone locally for one TTL as well (belt and
//! braces, should the `pin-all` key be evicted).

use crate::clock::Clock;
use crate::domain::UserId;
use crate::lsn::Lsn;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A position no replica can reach: a user recorded at it reads only the primary.
pub const PRIMARY_ONLY: Lsn = i64::MAX as Lsn;

#[derive(Debug, thiserror::Error)]
#[error("read-your-writes store unavailable: {0}")]
pub struct StoreUnavailable(String);

#[derive(Clone)]
pub enum RywStore {
    Local(Arc<Local>),
    Redis(Arc<RedisStore>),
}

/// A position and when it was written (on the store's monotonic clock).
#[derive(Debug, Clone, Copy)]
struct Entry {
    lsn: Lsn,
    written: Instant,
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
    advance: redis::Script,
    read: redis::Script,
    /// The epoch this instance last saw, and until when it pins everyone after a change.
    epoch: Mutex<EpochState>,
    /// After a failure, calls fail at once until this moment (one probe every
    /// `BACKOFF`), so an outage costs requests microseconds, not a timeout each.
    down_until: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct EpochState {
    known: Option<String>,
    pin_all_until: Option<Instant>,
}

/// How long a failed Redis is left alone before the next call tries it again.
const BACKOFF: Duration = Duration::from_millis(500);

const EPOCH_KEY: &str = "stockgate:ryw:epoch";
const PIN_ALL_KEY: &str = "stockgate:ryw:pin-all";

impl RedisStore {
    /// Runs one Redis call with the client timeout, behind the outage breaker.
    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreUnavailable> {
        let now = Instant::now();
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
            Err(_) => Some(Instant::now() + BACKOFF),
        };
        outcome
    }

    /// Reads the epoch, the pin-all flag and `users`' positions in one round trip (one
    /// script, which also replaces an epoch the running server did not issue), and returns
    /// the furthest position they must be read at ([`PRIMARY_ONLY`] while pinned).
    async fn positions(&self, users: &[&UserId]) -> Result<Option<Lsn>, StoreUnavailable> {
        let mut conn = self.conn.clone();
        let mut invocation = self.read.key(EPOCH_KEY);
        invocation.key(PIN_ALL_KEY);
        for u in users {
            invocation.key(key(u));
        }
        invocation
            .arg(uuid::Uuid::new_v4().simple().to_string())
            .arg(self.ttl.as_millis() as u64);
        let raw = self
            .call(invocation.invoke_async::<Vec<Option<String>>>(&mut conn))
            .await?;
        let mut raw = raw.into_iter();
        let epoch = raw
            .next()
            .flatten()
            .ok_or_else(|| StoreUnavailable("no epoch in the answer".into()))?;
        let pin_all = raw.next().flatten().as_deref() == Some("1");
        let locally_pinned = self.observe_epoch(epoch);
        if pin_all || locally_pinned {
            return Ok(Some(PRIMARY_ONLY));
        }
        let mut max = users.iter().filter_map(|u| self.local.get(u)).max();
        for v in raw.flatten() {
            let lsn: Lsn = v
                .parse()
                .map_err(|_| StoreUnavailable(format!("unreadable entry {v:?}")))?;
            max = max.max(Some(lsn));
        }
        Ok(max)
    }

    /// Remembers `epoch`; a change from the one seen before pins everyone here for one
    /// TTL (belt and braces: the store's own `pin-all` key says the same for everyone).
    /// Returns whether this instance is pinning everyone now.
    fn observe_epoch(&self, epoch: String) -> bool {
        let now = self.clock.now();
        let mut st = self.epoch.lock().unwrap_or_else(|p| p.into_inner());
        if st.known.as_ref().is_some_and(|k| *k != epoch) {
            tracing::warn!(%epoch, "read-your-writes store restarted or lost its data: every user reads the primary for one TTL");
            st.pin_all_until = Some(now + self.ttl);
        }
        st.known = Some(epoch);
        st.pin_all_until.is_some_and(|until| now < until)
    }
}

/// Sets the position only if it moves it forward; refreshes the expiry either way. Atomic in
/// Redis, so concurrent writers cannot lower the position. `PX` is the only expiry.
const ADVANCE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur then
  local c = tonumber(cur)
  if c and c > tonumber(ARGV[1]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"#;

/// Reads the epoch, the pin-all flag and each user's position. The epoch names the server
/// run that issued it (`run_id:random`): a missing epoch (an empty store) or one issued by
/// another run (a restart, even from a dump that lacks the latest positions) is replaced,
/// and the pin-all window opened for one TTL on Redis's clock, atomically.
const READ: &str = r#"
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local epoch = redis.call('GET', KEYS[1])
local pinned = redis.call('EXISTS', KEYS[2]) == 1
if (not epoch) or string.sub(epoch, 1, #run + 1) ~= (run .. ':') then
  epoch = run .. ':' .. ARGV[1]
  redis.call('SET', KEYS[1], epoch)
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
  pinned = true
end
local out = {epoch, pinned and '1' or '0'}
for i = 3, #KEYS do
  out[#out + 1] = redis.call('GET', KEYS[i])
end
return out
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
            advance: redis::Script::new(ADVANCE),
            read: redis::Script::new(READ),
            epoch: Mutex::default(),
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

    /// Records that `user` wrote, and the primary was at `lsn` after the commit. This
    /// instance remembers it even when the shared store fails.
    pub async fn advance(&self, user: &UserId, lsn: Lsn) -> Result<(), StoreUnavailable> {
        match self {
            RywStore::Local(s) => {
                s.advance(user, lsn);
                Ok(())
            }
            RywStore::Redis(s) => {
                s.local.advance(user, lsn);
                let mut conn = s.conn.clone();
                let px = s.ttl.as_millis() as u64;
                let mut invocation = s.advance.key(key(user));
                invocation.arg(lsn).arg(px);
                s.call(invocation.invoke_async::<()>(&mut conn)).await
            }
        }
    }

    /// The position `user` must be read at, if they wrote within the TTL
    /// ([`PRIMARY_ONLY`] while the store cannot vouch for the window).
    pub async fn get(&self, user: &UserId) -> Result<Option<Lsn>, StoreUnavailable> {
        match self {
            RywStore::Local(s) => Ok(s.get(user)),
            RywStore::Redis(s) => s.positions(&[user]).await,
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
        let now = self.clock.now();
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let e = map
            .entry(user.clone())
            .or_insert(Entry { lsn, written: now });
        e.lsn = e.lsn.max(lsn);
        e.written = now;
        // Keep the map bounded: drop expired entries now and then.
        if map.len() > 100_000 {
            let ttl = self.ttl;
            map.retain(|_, e| live(e, now, ttl));
        }
    }

    fn get(&self, user: &UserId) -> Option<Lsn> {
        let now = self.clock.now();
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(user)
            .filter(|e| live(e, now, self.ttl))
            .map(|e| e.lsn)
    }
}

fn live(e: &Entry, now: Instant, ttl: Duration) -> bool {
    now.saturating_duration_since(e.written) <= ttl
}

fn key(user: &UserId) -> String {
    format!("stockgate:ryw:{user}")
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
