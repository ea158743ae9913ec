//! Configuration, read once from the environment (and `.env` if present).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `DATABASE_URL` | the primary | required for every subcommand but `token` |
//! | `STOCKGATE_REPLICA_URLS` | comma-separated replica URLs, named `replica-1`, `replica-2`, … | empty: every read goes to the primary |
//! | `STOCKGATE_PATRONI_URLS` | comma-separated Patroni REST API URLs; members, roles and timelines come from Patroni, each member is reached with `DATABASE_URL`'s credentials at its own host:port, and `STOCKGATE_REPLICA_URLS` is ignored | empty: the static primary and replicas |
//! | `STOCKGATE_REDIS_URL` | shared read-your-writes store | empty: in-process store (one instance) |
//! | `STOCKGATE_LISTEN` | listen address | `127.0.0.1:8080` |
//! | `STOCKGATE_TOKEN_SECRET` | signs bearer tokens (at least 16 bytes) | required for `serve` and `token` |
//! | `STOCKGATE_MONITOR_INTERVAL_MS` | freshness sample period | `25` |
//! | `STOCKGATE_EVICT_AFTER_MS` | staleness at which a replica becomes `lagging` | `5000` |
//! | `STOCKGATE_REPLICA_TIMEOUT_MS` | client-side timeout of a point read on a replica (gate, product page, own data) and of a freshness sample; missing it marks the replica down | `500` |
//! | `STOCKGATE_DASHBOARD_TIMEOUT_MS` | timeout of a dashboard read on a replica (missing it routes the read again; never marks the replica down) | `5000` |
//! | `STOCKGATE_REPORT_TIMEOUT_MS` | timeout of a revenue-report read on a replica (likewise) | `60000` |
//! | `STOCKGATE_EXPORT_TIMEOUT_MS` | how long one export may stream | `600000` |
//! | `STOCKGATE_PRIMARY_POOL_SIZE` | connections to the primary | `16` |
//! | `STOCKGATE_REPLICA_POOL_SIZE` | connections to each replica | `16` |
//! | `STOCKGATE_RYW_TTL_MS` | how long a user's write pins their reads (must exceed every read-your-writes budget) | `60000` |
//! | `STOCKGATE_HTTP_THREADS` | threads that serve HTTP, each with its own single-threaded runtime; one accepting task hands them connections in turn | the number of CPUs |
//! | `STOCKGATE_MAX_IN_FLIGHT` | concurrent requests before shedding load with 503 | `1024` |
//! | `STOCKGATE_REQUEST_TIMEOUT_MS` | per-request timeout | `10000` |
//! | `STOCKGATE_DRAIN_TIMEOUT_MS` | how long shutdown waits for in-flight requests | `10000` |
//! | `STOCKGATE_PRIMARY_TIMEOUT_MS` | how long a request waits for a primary connection before 503 | `2000` |
//! | `STOCKGATE_ORDER_RATE_PER_USER` | orders per second one user may place (429 beyond; 0 = no limit) | `0` |
//! | `STOCKGATE_ORDER_BATCH_MAX` | most orders one coalesced transaction takes | `256` |
//! | `STOCKGATE_ORDER_BATCH_WINDOW_US` | how long a batch waits for more orders once the queue is empty | `0` |
//! | `STOCKGATE_IDEMPOTENCY_WINDOW` | how long a key's answer is remembered at least (`30s`, `15m`, `24h`); refusals older than this are purged, so their keys may be used anew; confirmed orders never are | `24h` |
//! | `STOCKGATE_EVENT_RETENTION` | how long events are kept at least (`12h`, `7d`); a cursor before the events purged since is 410 `CURSOR_EXPIRED` | `7d` |
//! | `STOCKGATE_PEERS` | comma-separated peer URLs (`http://host:port`) of every instance of the deployment, the same list on each: a contended product's single-product orders go to one owner among them (docs/design/peers.md). Requires `STOCKGATE_REDIS_URL` and `STOCKGATE_PEER_URL` | empty: every instance places its own orders |
//! | `STOCKGATE_PEER_URL` | this instance's own entry of `STOCKGATE_PEERS`; its peer listener binds that port (on that address if it is an IP, else on every interface) | empty: no peer listener |
//! | `RUST_LOG` | log filter, read by [`crate::telemetry`] from the real environment only (logging starts before `.env` is read) | `info,sqlx=warn,tower_http=info` for serve, `warn,sqlx::query=error` for the other commands |

use std::net::SocketAddr;
use std::time::Duration;
use url::Url;

/// A configuration problem, reported as one line on stderr with exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

#[derive(Clone, Debug)]
pub struct Config {
    pub database_url: Option<String>,
    pub replica_urls: Vec<String>,
    pub patroni_urls: Vec<String>,
    pub redis_url: Option<String>,
    pub listen: SocketAddr,
    pub token_secret: Option<String>,
    pub monitor_interval: Duration,
    pub evict_after: Duration,
    pub replica_timeout: Duration,
    pub dashboard_timeout: Duration,
    pub report_timeout: Duration,
    pub export_timeout: Duration,
    pub primary_pool_size: u32,
    pub replica_pool_size: u32,
    pub ryw_ttl: Duration,
    pub max_in_flight: usize,
    pub http_threads: usize,
    pub request_timeout: Duration,
    pub drain_timeout: Duration,
    pub order_batch_max: usize,
    pub order_rate_per_user: u32,
    pub primary_timeout: Duration,
    pub order_batch_window: Duration,
    pub idempotency_window: Duration,
    pub event_retention: Duration,
    pub peers: Vec<String>,
    pub peer_url: Option<String>,
}

impl Config {
    /// Reads `.env` (if present, without overriding the real environment) and then the
    /// environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        let _ = dotenvy::dotenv();
        Self::from_lookup(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
    }

    /// Builds a configuration from any key lookup (tests pass a map). Values are checked in
    /// the order below; the first bad one is the error.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let ms = |key: &str, default: u64, min: u64| -> Result<Duration, ConfigError> {
            Ok(Duration::from_millis(number(
                &get, key, default, min, 86_400_000,
            )?))
        };
        let count =
            |key: &str, default: u64, min: u64, max: u64| number(&get, key, default, min, max);
        Config {
            database_url: one(&get, "DATABASE_URL", postgres_url)?,
            patroni_urls: list(&get, "STOCKGATE_PATRONI_URLS", patroni_url)?,
            replica_urls: list(&get, "STOCKGATE_REPLICA_URLS", postgres_url)?,
            redis_url: one(&get, "STOCKGATE_REDIS_URL", redis_url)?,
            listen: one(&get, "STOCKGATE_LISTEN", listen_addr)?
                .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080))),
            token_secret: one(&get, "STOCKGATE_TOKEN_SECRET", token_secret)?,
            monitor_interval: ms("STOCKGATE_MONITOR_INTERVAL_MS", 25, 5)?,
            evict_after: ms("STOCKGATE_EVICT_AFTER_MS", 5_000, 100)?,
            replica_timeout: ms("STOCKGATE_REPLICA_TIMEOUT_MS", 500, 10)?,
            dashboard_timeout: ms("STOCKGATE_DASHBOARD_TIMEOUT_MS", 5_000, 10)?,
            report_timeout: ms("STOCKGATE_REPORT_TIMEOUT_MS", 60_000, 10)?,
            export_timeout: ms("STOCKGATE_EXPORT_TIMEOUT_MS", 600_000, 10)?,
            primary_pool_size: count("STOCKGATE_PRIMARY_POOL_SIZE", 16, 1, 1000)? as u32,
            replica_pool_size: count("STOCKGATE_REPLICA_POOL_SIZE", 16, 1, 1000)? as u32,
            ryw_ttl: ms("STOCKGATE_RYW_TTL_MS", 60_000, 1)?,
            max_in_flight: count("STOCKGATE_MAX_IN_FLIGHT", 1024, 1, 1_000_000)? as usize,
            http_threads: count("STOCKGATE_HTTP_THREADS", cpus().min(256), 1, 256)? as usize,
            request_timeout: ms("STOCKGATE_REQUEST_TIMEOUT_MS", 10_000, 100)?,
            drain_timeout: ms("STOCKGATE_DRAIN_TIMEOUT_MS", 10_000, 0)?,
            order_rate_per_user: count("STOCKGATE_ORDER_RATE_PER_USER", 0, 0, 1_000_000)? as u32,
            primary_timeout: ms("STOCKGATE_PRIMARY_TIMEOUT_MS", 2_000, 10)?,
            order_batch_max: count("STOCKGATE_ORDER_BATCH_MAX", 256, 1, 10_000)? as usize,
            order_batch_window: Duration::from_micros(count(
                "STOCKGATE_ORDER_BATCH_WINDOW_US",
                0,
                0,
                100_000,
            )?),
            idempotency_window: one(&get, "STOCKGATE_IDEMPOTENCY_WINDOW", window)?
                .unwrap_or(Duration::from_secs(24 * 3600)),
            event_retention: one(&get, "STOCKGATE_EVENT_RETENTION", window)?
                .unwrap_or(Duration::from_secs(7 * 24 * 3600)),
            peers: list(&get, "STOCKGATE_PEERS", peer_url)?,
            peer_url: one(&get, "STOCKGATE_PEER_URL", peer_url)?,
        }
        .checked()
    }

    /// The rules between variables.
    fn checked(self) -> Result<Config, ConfigError> {
        match (&self.peer_url, self.peers.is_empty()) {
            (None, true) => {}
            (None, false) => {
                return Err(ConfigError(
                    "STOCKGATE_PEERS needs STOCKGATE_PEER_URL (this instance's own entry)".into(),
                ));
            }
            (Some(_), true) => {
                return Err(ConfigError(
                    "STOCKGATE_PEER_URL needs STOCKGATE_PEERS (every instance's entry)".into(),
                ));
            }
            (Some(me), false) => {
                if !self.peers.contains(me) {
                    return Err(ConfigError(format!(
                        "STOCKGATE_PEER_URL ({me}) must be one of STOCKGATE_PEERS"
                    )));
                }
                if self.redis_url.is_none() {
                    return Err(ConfigError(
                        "STOCKGATE_PEERS needs STOCKGATE_REDIS_URL: read-your-writes must hold across the instances".into(),
                    ));
                }
            }
        }
        Ok(self)
    }

    /// Where the peer listener binds: `STOCKGATE_PEER_URL`'s port, on its address if that
    /// is an IP, else on every interface.
    pub fn peer_listen(&self) -> Option<SocketAddr> {
        let url = Url::parse(self.peer_url.as_deref()?).ok()?;
        let port = url.port_or_known_default()?;
        let ip = match url.host()? {
            url::Host::Ipv4(ip) => ip.into(),
            url::Host::Ipv6(ip) => ip.into(),
            url::Host::Domain(_) => std::net::IpAddr::from([0, 0, 0, 0]),
        };
        Some(SocketAddr::new(ip, port))
    }

    pub fn require_database_url(&self) -> Result<&str, ConfigError> {
        self.database_url.as_deref().ok_or_else(|| {
            ConfigError(
                "DATABASE_URL is required (the primary, e.g. postgres://user@host:5432/stockgate)"
                    .into(),
            )
        })
    }

    pub fn require_token_secret(&self) -> Result<&str, ConfigError> {
        self.token_secret.as_deref().ok_or_else(|| {
            ConfigError("STOCKGATE_TOKEN_SECRET is required (at least 16 random bytes)".into())
        })
    }
}

/// The CPUs this process may run on (1 if unknown).
fn cpus() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

fn bad(key: &str, value: &str, why: &str) -> ConfigError {
    ConfigError(format!("{key} is invalid ({why}): {}", redact(value)))
}

/// Hides a password in a URL before it is printed.
fn redact(value: &str) -> String {
    match Url::parse(value) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => value.to_string(),
    }
}

/// An optional variable, checked by `parse` when set.
fn one<T>(
    get: &impl Fn(&str) -> Option<String>,
    key: &str,
    parse: impl Fn(&str, &str) -> Result<T, ConfigError>,
) -> Result<Option<T>, ConfigError> {
    get(key).map(|v| parse(key, &v)).transpose()
}

/// A comma-separated list (empty items skipped), each item checked by `parse`; unset: empty.
fn list(
    get: &impl Fn(&str) -> Option<String>,
    key: &str,
    parse: impl Fn(&str, &str) -> Result<String, ConfigError>,
) -> Result<Vec<String>, ConfigError> {
    let Some(list) = get(key) else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| parse(key, item))
        .collect()
}

fn postgres_url(key: &str, value: &str) -> Result<String, ConfigError> {
    let parsed = Url::parse(value).map_err(|e| bad(key, value, &e.to_string()))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(bad(key, value, "the scheme must be postgres://"));
    }
    if parsed.host_str().unwrap_or("").is_empty() {
        return Err(bad(key, value, "no host"));
    }
    Ok(value.to_string())
}

fn peer_url(key: &str, value: &str) -> Result<String, ConfigError> {
    match Url::parse(value) {
        Ok(p)
            if p.scheme() == "http"
                && p.host().is_some()
                && p.port().is_some()
                && matches!(p.path(), "" | "/") =>
        {
            Ok(value.trim_end_matches('/').to_string())
        }
        _ => Err(bad(key, value, "expected http://host:port")),
    }
}

fn patroni_url(key: &str, value: &str) -> Result<String, ConfigError> {
    match Url::parse(value) {
        Ok(p) if matches!(p.scheme(), "http" | "https") => Ok(value.to_string()),
        _ => Err(bad(key, value, "expected http://host:8008")),
    }
}

fn redis_url(key: &str, value: &str) -> Result<String, ConfigError> {
    let parsed = Url::parse(value).map_err(|e| bad(key, value, &e.to_string()))?;
    if !matches!(parsed.scheme(), "redis" | "rediss") {
        return Err(bad(key, value, "the scheme must be redis://"));
    }
    Ok(value.to_string())
}

fn listen_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| bad(key, value, "expected host:port such as 127.0.0.1:8080"))
}

fn token_secret(key: &str, value: &str) -> Result<String, ConfigError> {
    if value.len() < 16 {
        return Err(ConfigError(format!("{key} must be at least 16 bytes long")));
    }
    Ok(value.to_string())
}

fn number(
    get: &impl Fn(&str) -> Option<String>,
    key: &str,
    default: u64,
    min: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    match get(key) {
        None => Ok(default),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            _ => Err(ConfigError(format!(
                "{key} must be a whole number from {min} to {max}, got {v:?}"
            ))),
        },
    }
}

/// A window like `24h` (see [`parse_duration`]).
fn window(key: &str, value: &str) -> Result<Duration, ConfigError> {
    parse_duration(value).map_err(|why| bad(key, value, &why))
}

/// Parses `5s`, `500ms`, `30m`, `24h`, `7d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 5s or 500ms"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => return Err(format!("{s:?}: unit must be ms, s, m, h or d")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 10.0 * 365.0 * 86400.0 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn peers_need_their_own_entry_and_the_shared_store() {
        let all = "http://10.0.0.1:9000, http://10.0.0.2:9000/";
        let redis = ("STOCKGATE_REDIS_URL", "redis://127.0.0.1:6379");
        let c = config(&[
            ("STOCKGATE_PEERS", all),
            ("STOCKGATE_PEER_URL", "http://10.0.0.2:9000"),
            redis,
        ])
        .expect("a complete peer configuration");
        assert_eq!(c.peers, ["http://10.0.0.1:9000", "http://10.0.0.2:9000"]);
        assert_eq!(c.peer_listen(), Some("10.0.0.2:9000".parse().unwrap()));
        let named = config(&[
            ("STOCKGATE_PEERS", "http://sg-1:9000"),
            ("STOCKGATE_PEER_URL", "http://sg-1:9000"),
            redis,
        ])
        .unwrap();
        assert_eq!(named.peer_listen(), Some("0.0.0.0:9000".parse().unwrap()));
        for (pairs, says) in [
            (
                vec![("STOCKGATE_PEERS", all), redis],
                "needs STOCKGATE_PEER_URL",
            ),
            (
                vec![("STOCKGATE_PEER_URL", "http://10.0.0.2:9000"), redis],
                "needs STOCKGATE_PEERS",
            ),
            (
                vec![
                    ("STOCKGATE_PEERS", all),
                    ("STOCKGATE_PEER_URL", "http://10.0.0.3:9000"),
                    redis,
                ],
                "must be one of",
            ),
            (
                vec![
                    ("STOCKGATE_PEERS", all),
                    ("STOCKGATE_PEER_URL", "http://10.0.0.2:9000"),
                ],
                "needs STOCKGATE_REDIS_URL",
            ),
            (
                vec![("STOCKGATE_PEERS", "http://10.0.0.1"), redis],
                "expected http://host:port",
            ),
        ] {
            let e = config(&pairs).expect_err(says).to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn defaults_apply_when_nothing_is_set() {
        let c = config(&[]).expect("empty config is valid until a subcommand needs more");
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert!(c.replica_urls.is_empty());
        assert!(c.require_database_url().is_err());
    }

    #[test]
    fn each_long_class_has_its_own_replica_timeout() {
        let c = config(&[]).expect("valid");
        assert_eq!(
            (
                c.replica_timeout,
                c.dashboard_timeout,
                c.report_timeout,
                c.export_timeout
            ),
            (
                Duration::from_millis(500),
                Duration::from_secs(5),
                Duration::from_secs(60),
                Duration::from_secs(600)
            )
        );
        let c = config(&[("STOCKGATE_REPORT_TIMEOUT_MS", "120000")]).expect("valid");
        assert_eq!(c.report_timeout, Duration::from_secs(120));
        assert!(config(&[("STOCKGATE_DASHBOARD_TIMEOUT_MS", "soon")]).is_err());
    }

    #[test]
    fn patroni_urls_are_http_and_split() {
        let c = config(&[(
            "STOCKGATE_PATRONI_URLS",
            "http://10.0.0.1:8008, http://10.0.0.2:8008,",
        )])
        .expect("valid");
        assert_eq!(
            c.patroni_urls,
            vec!["http://10.0.0.1:8008", "http://10.0.0.2:8008"]
        );
        assert!(config(&[("STOCKGATE_PATRONI_URLS", "postgres://a:1/x")]).is_err());
        assert!(config(&[]).expect("valid").patroni_urls.is_empty());
    }

    #[test]
    fn replica_urls_are_split_and_trimmed() {
        let c = config(&[(
            "STOCKGATE_REPLICA_URLS",
            "postgres://a:1/x, postgres://b:2/x,",
        )])
        .expect("valid");
        assert_eq!(c.replica_urls, vec!["postgres://a:1/x", "postgres://b:2/x"]);
    }

    #[test]
    fn a_bad_url_is_one_clear_line_and_hides_the_password() {
        let e = config(&[("DATABASE_URL", "mysql://u:secret@h/db")]).expect_err("wrong scheme");
        assert!(e.0.contains("DATABASE_URL"), "{e}");
        assert!(!e.0.contains("secret"), "{e}");
        assert!(!e.0.contains('\n'));
    }

    #[test]
    fn short_secrets_and_bad_numbers_are_refused() {
        assert!(config(&[("STOCKGATE_TOKEN_SECRET", "short")]).is_err());
        assert!(config(&[("STOCKGATE_MONITOR_INTERVAL_MS", "fast")]).is_err());
        assert!(config(&[("STOCKGATE_LISTEN", "nowhere")]).is_err());
    }
}
