//! An HA cluster: three PostgreSQL 15 nodes managed by Patroni 3.0 with one local etcd 3.4,
//! for `./dev up --ha` and the failover tests. Patroni, not this module, decides who leads:
//! this module only starts, stops and kills processes, asks Patroni's REST API, and waits
//! for the state a test needs before it acts.
//!
//! Timings are short (`ttl` 10 s, `loop_wait` 2 s, `retry_timeout` 4 s, measured here: a new
//! leader ~9 s after `kill -9`), `use_pg_rewind` lets a killed leader rejoin as a replica, and
//! `synchronous_mode` is on unless asked otherwise. Patroni and PostgreSQL run as `postgres`
//! (both refuse root); every process gets its own process group, so a Ctrl-C in the
//! terminal that ran `./dev up --ha` stops the service, not the cluster.

use crate::{as_postgres_cmd, chown_postgres, free_port_block, run, wait_until};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A node's `patroni.yml`, a template for `format!` (named arguments in braces).
macro_rules! patroni_yml {
    () => {
        "scope: stockgate-{base}
name: {name}
log:
  level: WARNING
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  host: 127.0.0.1:{etcd}
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    synchronous_mode: {sync}
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_level: replica
        hot_standby: 'on'
        wal_log_hints: 'on'
        max_connections: 300
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
        hot_standby_feedback: 'off'
        wal_sender_timeout: 5s
        wal_receiver_timeout: 5s
        wal_receiver_status_interval: 1s
        max_standby_streaming_delay: 30s
  initdb:
  - encoding: UTF8
  - locale: C.UTF-8
  - auth: trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {data}
  bin_dir: {pg_bin}
  pgpass: {pgpass}
  pg_hba:
  - local all all trust
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: postgres
      password: postgres
    rewind:
      username: postgres
      password: postgres
  parameters:
    unix_socket_directories: '{dir}'
    shared_buffers: 64MB
    log_min_messages: warning
    log_checkpoints: 'off'
"
    };
}

/// How many PostgreSQL nodes an HA cluster has.
pub const NODES: usize = 3;

/// Three Patroni-managed nodes and their etcd, under one directory.
///
/// Ports: etcd client `base`, etcd peer `base + 1`; node *i* (1-based) PostgreSQL on
/// `base + 2i`, its Patroni REST API on `base + 2i + 1`.
#[derive(Debug)]
pub struct HaCluster {
    dir: PathBuf,
    base: u16,
    synchronous: bool,
    /// Kill everything and delete the directory on drop (test clusters).
    ephemeral: bool,
}

/// A member as Patroni's `/cluster` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub role: String,
    pub state: String,
    pub port: u16,
    pub timeline: Option<u64>,
}

impl HaCluster {
    /// Starts (creating it if needed) an HA cluster under `dir` on ports from `base`.
    /// Idempotent: running processes are left alone. Returns once it is healthy.
    pub fn up(dir: &Path, base: u16, synchronous: bool) -> Result<HaCluster> {
        let c = HaCluster::existing(dir, base, synchronous);
        c.start_all()?;
        c.wait_healthy(Duration::from_secs(90))?;
        Ok(c)
    }

    /// Handle on a cluster `up` created, without starting anything.
    pub fn existing(dir: &Path, base: u16, synchronous: bool) -> HaCluster {
        HaCluster {
            dir: dir.to_path_buf(),
            base,
            synchronous,
            ephemeral: false,
        }
    }

    /// A fresh throwaway cluster under /tmp (`sgha-<pid>-<port>`), killed and deleted on
    /// drop; leftovers of exited test processes are reaped first.
    pub fn temporary(synchronous: bool) -> Result<HaCluster> {
        reap_orphans();
        let base = free_port_block(2 + 2 * NODES as u16)?;
        let dir = std::env::temp_dir().join(format!("sgha-{}-{base}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = HaCluster {
            dir,
            base,
            synchronous,
            ephemeral: true,
        };
        c.start_all()?;
        c.wait_healthy(Duration::from_secs(90))?;
        Ok(c)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn synchronous(&self) -> bool {
        self.synchronous
    }

    pub fn etcd_port(&self) -> u16 {
        self.base
    }

    /// PostgreSQL port of node `i` (1-based).
    pub fn pg_port(&self, i: usize) -> u16 {
        self.base + 2 * i as u16
    }

    /// Patroni REST port of node `i` (1-based).
    pub fn rest_port(&self, i: usize) -> u16 {
        self.base + 2 * i as u16 + 1
    }

    /// The member name of node `i`.
    pub fn name(&self, i: usize) -> String {
        format!("node{i}")
    }

    /// The node number of member `name`.
    pub fn node_of(&self, name: &str) -> Result<usize> {
        (1..=NODES)
            .find(|&i| self.name(i) == name)
            .ok_or_else(|| anyhow!("no member named {name}"))
    }

    /// Every node's Patroni REST URL, joined for `STOCKGATE_PATRONI_URLS`.
    pub fn patroni_urls(&self) -> String {
        (1..=NODES)
            .map(|i| format!("http://127.0.0.1:{}", self.rest_port(i)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A `DATABASE_URL` for database `db`: the credentials and database the service uses at
    /// every member (its host and port are those of node 1, where a static client would go).
    pub fn database_url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.pg_port(1))
    }

    /// URL of database `db` on node `i`.
    pub fn node_url(&self, i: usize, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.pg_port(i))
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.join(self.name(i))
    }

    fn start_all(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        chown_postgres(&self.dir)?;
        self.start_etcd()?;
        for i in 1..=NODES {
            self.start_node(i)?;
        }
        Ok(())
    }

    fn start_etcd(&self) -> Result<()> {
        if self.pid_alive("etcd") {
            return Ok(());
        }
        let data = self.dir.join("etcd");
        std::fs::create_dir_all(&data)?;
        chown_postgres(&data)?;
        let client = format!("http://127.0.0.1:{}", self.base);
        let peer = format!("http://127.0.0.1:{}", self.base + 1);
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "etcd", "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("etcd={peer}")])
            .args(["--log-level", "warn"]);
        self.spawn("etcd", cmd)?;
        wait_until(Duration::from_secs(20), || {
            Ok(http(self.base, "GET", "/health", None).is_ok_and(|(s, _)| s == 200))
        })
        .context("etcd did not become healthy")
    }

    /// Starts node `i`'s Patroni (which starts, rewinds or bootstraps its PostgreSQL).
    pub fn start_node(&self, i: usize) -> Result<()> {
        if self.pid_alive(&self.name(i)) {
            return Ok(());
        }
        let dir = self.node_dir(i);
        std::fs::create_dir_all(&dir)?;
        chown_postgres(&dir)?;
        let config = dir.join("patroni.yml");
        std::fs::write(&config, self.patroni_yaml(i))?;
        chown_postgres(&config)?;
        // A node killed with -9 leaves its pid file; Patroni would refuse to start over it.
        let _ = std::fs::remove_file(dir.join("data/postmaster.pid"));
        let mut cmd = Command::new("patroni");
        cmd.arg(&config);
        self.spawn(&self.name(i), cmd)
    }

    fn patroni_yaml(&self, i: usize) -> String {
        let dir = self.node_dir(i);
        format!(
            patroni_yml!(),
            base = self.base,
            name = self.name(i),
            rest = self.rest_port(i),
            etcd = self.base,
            sync = self.synchronous,
            pg = self.pg_port(i),
            data = dir.join("data").display(),
            pg_bin = PG_BIN,
            pgpass = dir.join("pgpass").display(),
            dir = dir.display(),
        )
    }

    /// Spawns `cmd` as `postgres` in its own process group, logging to `<name>.log`, and
    /// records its pid in `<name>.pid`. `setpriv` execs (no fork), so the pid is the
    /// program's own and a `kill -9` of it is a real crash.
    fn spawn(&self, name: &str, cmd: Command) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))?;
        let mut wrapped = as_postgres_cmd(&cmd);
        wrapped
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        let child = wrapped
            .spawn()
            .with_context(|| format!("starting {name} (is it installed?)"))?;
        std::fs::write(self.dir.join(format!("{name}.pid")), child.id().to_string())?;
        // The child is reaped by init once we exit; dropping the handle does not kill it.
        Ok(())
    }

    fn pid(&self, name: &str) -> Option<u32> {
        std::fs::read_to_string(self.dir.join(format!("{name}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn pid_alive(&self, name: &str) -> bool {
        self.pid(name).is_some_and(|p| {
            // A zombie (our own child, killed, not yet reaped) is not alive.
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| !s.contains(") Z "))
        })
    }

    fn postmaster_pid(&self, i: usize) -> Option<u32> {
        std::fs::read_to_string(self.node_dir(i).join("data/postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// `kill -9` of node `i`'s Patroni, its postmaster and every backend: a machine lost
    /// mid-flight (clients see their connections reset at once).
    pub fn kill_node(&self, i: usize) -> Result<()> {
        let patroni = self.pid(&self.name(i));
        let postmaster = self.postmaster_pid(i);
        if let Some(p) = patroni {
            let _ = signal("KILL", p);
        }
        if let Some(p) = postmaster {
            let _ = signal("KILL", p);
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &p.to_string()])
                .status();
        }
        wait_until(Duration::from_secs(10), || {
            Ok(!self.pid_alive(&self.name(i)) && !self.pg_port_open(i))
        })
        .with_context(|| format!("{} still running after kill -9", self.name(i)))
    }

    /// Stops node `i` cleanly (SIGTERM to Patroni, which stops PostgreSQL and, if it led,
    /// releases the leader key).
    pub fn stop_node(&self, i: usize) -> Result<()> {
        if let Some(p) = self.pid(&self.name(i))
            && self.pid_alive(&self.name(i))
        {
            signal("TERM", p)?;
        }
        wait_until(Duration::from_secs(60), || {
            Ok(!self.pid_alive(&self.name(i)) && !self.pg_port_open(i))
        })
    }

    fn pg_port_open(&self, i: usize) -> bool {
        TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.pg_port(i)).into(),
            Duration::from_millis(200),
        )
        .is_ok()
    }

    /// The members as Patroni's `/cluster` reports them, asked of any node that answers.
    pub fn members(&self) -> Result<Vec<Member>> {
        let mut last = anyhow!("no Patroni answered");
        for i in 1..=NODES {
            match http(self.rest_port(i), "GET", "/cluster", None) {
                Ok((200, body)) => return parse_members(&body),
                Ok((s, _)) => last = anyhow!("/cluster on {} answered {s}", self.name(i)),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The current leader's node number, if there is one.
    pub fn leader(&self) -> Result<Option<usize>> {
        let members = self.members()?;
        members
            .iter()
            .find(|m| m.role == "leader" && m.state == "running")
            .map(|m| self.node_of(&m.name))
            .transpose()
    }

    /// Runs one SQL statement on node `i` in database `postgres`.
    pub fn psql(&self, i: usize, sql: &str) -> Result<String> {
        let out = run(Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres"])
            .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
            .args(["-p", &self.pg_port(i).to_string(), "-c", sql])
            .env("PGCONNECT_TIMEOUT", "3"))
        .with_context(|| format!("psql on {}: {sql}", self.name(i)))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Healthy: a leader whose `pg_stat_replication` shows both other nodes streaming and
    /// (with `synchronous_mode`) one of them `sync`. "running" in `/cluster` is not enough:
    /// a replica streams only once the leader has created its slot.
    pub fn is_healthy(&self) -> Result<bool> {
        let Some(leader) = self.leader()? else {
            return Ok(false);
        };
        let out = self.psql(
            leader,
            "SELECT count(*) FILTER (WHERE state = 'streaming'), \
                    count(*) FILTER (WHERE sync_state = 'sync') FROM pg_stat_replication",
        )?;
        let (streaming, sync) = out.split_once('|').unwrap_or(("0", "0"));
        let want_sync = if self.synchronous { 1 } else { 0 };
        if streaming != (NODES - 1).to_string() || sync.parse::<usize>().unwrap_or(0) < want_sync {
            return Ok(false);
        }
        // Patroni records the sync standby in etcd a loop after PostgreSQL reports it; a
        // switchover before that is refused ("can not find sync_standby").
        Ok(!self.synchronous
            || (1..=NODES).any(|i| {
                http(self.rest_port(i), "GET", "/sync", None).is_ok_and(|(s, _)| s == 200)
            }))
    }

    /// Waits until [`HaCluster::is_healthy`].
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        wait_until(timeout, || self.is_healthy())
            .with_context(|| format!("HA cluster in {} not healthy", self.dir.display()))
    }

    /// Waits until a leader other than `old` runs, and returns it.
    pub fn wait_new_leader(&self, old: usize, timeout: Duration) -> Result<usize> {
        let mut found = None;
        wait_until(timeout, || {
            found = self.leader().ok().flatten().filter(|&l| l != old);
            Ok(found.is_some())
        })?;
        found.ok_or_else(|| anyhow!("no new leader"))
    }

    /// A planned switchover away from the current leader (Patroni picks the candidate:
    /// the sync standby under `synchronous_mode`). Returns the new leader.
    pub fn switchover(&self) -> Result<usize> {
        let leader = self
            .leader()?
            .ok_or_else(|| anyhow!("no leader to switch over"))?;
        let body = format!("{{\"leader\": \"{}\"}}", self.name(leader));
        let (status, text) = http(self.rest_port(leader), "POST", "/switchover", Some(&body))?;
        if status != 200 {
            bail!("switchover refused ({status}): {text}");
        }
        self.wait_new_leader(leader, Duration::from_secs(60))
    }

    /// Turns `synchronous_mode` on or off for the running cluster (`PATCH /config`), and
    /// waits until the leader's replication matches.
    pub fn set_synchronous(&mut self, on: bool) -> Result<()> {
        let leader = self.leader()?.ok_or_else(|| anyhow!("no leader"))?;
        let body = format!("{{\"synchronous_mode\": {on}}}");
        let (status, text) = http(self.rest_port(leader), "PATCH", "/config", Some(&body))?;
        if status != 200 {
            bail!("PATCH /config refused ({status}): {text}");
        }
        self.synchronous = on;
        let want = if on { "1" } else { "0" };
        wait_until(Duration::from_secs(30), || {
            Ok(self.psql(
                leader,
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            )? == want)
        })
    }

    /// Kills every process and (for a temporary cluster) deletes the directory.
    pub fn down(&self) -> Result<()> {
        for i in 1..=NODES {
            let _ = self.stop_node(i);
        }
        if let Some(p) = self.pid("etcd") {
            let _ = signal("TERM", p);
        }
        Ok(())
    }

    /// One line per node: name, ports, role and state.
    pub fn status(&self) -> Vec<String> {
        let members = self.members().unwrap_or_default();
        let mut lines: Vec<String> = (1..=NODES)
            .map(|i| {
                let m = members.iter().find(|m| m.name == self.name(i));
                format!(
                    "{:<6} pg 127.0.0.1:{:<5} rest :{:<5} {:<8} {:<10} tl {}",
                    self.name(i),
                    self.pg_port(i),
                    self.rest_port(i),
                    m.map_or("-", |m| m.role.as_str()),
                    m.map_or("stopped", |m| m.state.as_str()),
                    m.and_then(|m| m.timeline)
                        .map_or("-".into(), |t| t.to_string()),
                )
            })
            .collect();
        lines.push(format!("etcd   127.0.0.1:{}", self.base));
        lines
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        if self.ephemeral {
            kill_tree(&self.dir);
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// SIGKILLs every process recorded under `dir` (Patroni, etcd) and every postmaster.
fn kill_tree(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let pidfile = if path.extension().is_some_and(|x| x == "pid") {
            path
        } else {
            path.join("data/postmaster.pid")
        };
        if let Some(pid) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok())
        {
            let _ = signal("KILL", pid);
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &pid.to_string()])
                .status();
        }
    }
}

/// Kills and deletes temporary HA clusters (`/tmp/sgha-<pid>-<port>`) whose test process
/// has exited. Returns how many.
pub fn reap_orphans() -> usize {
    crate::reap_dirs_of_exited("sgha-", kill_tree)
}

fn signal(sig: &str, pid: u32) -> Result<()> {
    run(Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]))?;
    Ok(())
}

/// Parses Patroni's `/cluster` answer.
pub fn parse_members(body: &str) -> Result<Vec<Member>> {
    let v: Value = serde_json::from_str(body).context("/cluster is not JSON")?;
    let members = v["members"]
        .as_array()
        .ok_or_else(|| anyhow!("/cluster has no members"))?;
    Ok(members
        .iter()
        .map(|m| Member {
            name: m["name"].as_str().unwrap_or_default().to_string(),
            role: m["role"].as_str().unwrap_or_default().to_string(),
            state: m["state"].as_str().unwrap_or_default().to_string(),
            port: m["port"].as_u64().unwrap_or_default() as u16,
            timeline: m["timeline"].as_u64(),
        })
        .collect())
}

/// A minimal HTTP/1.0 request to 127.0.0.1:`port` (Patroni's and etcd's APIs), returning the
/// status and the body. Enough for local JSON APIs without an HTTP client dependency.
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(90)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad HTTP answer from :{port}"))?;
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}
