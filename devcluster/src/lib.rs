//! A local PostgreSQL primary with streaming hot-standby replicas, and a Redis, for
//! development (`./dev up`) and for the integration tests. One implementation serves both,
//! so the cluster the tests prove things against is the one a developer runs.
//!
//! # Layout
//! - [`Cluster`]: create/start/stop a primary + N replicas under one directory, on TCP
//!   ports of its own (never 5432), and inject real lag into a replica: pause replay,
//!   `recovery_min_apply_delay`, stop/start, freeze/thaw with SIGSTOP/SIGCONT.
//! - [`Redis`]: the Redis on 6379 if it answers, or one of our own (tests that stop Redis
//!   always start their own).
//!
//! Everything shells out to the PostgreSQL 15 server binaries and `psql`; when run as root,
//! server commands run as the `postgres` OS user (initdb and pg_ctl refuse root).

pub mod ha;

use anyhow::{Context, Result, anyhow, bail};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// Settings every node gets. `hot_standby_feedback` stays off: with it on, a paused replica
/// pins the primary's vacuum through its slot and the hot stock row bloats.
const COMMON_CONF: &str = "
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 300
shared_buffers = 64MB
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
hot_standby = on
hot_standby_feedback = off
wal_sender_timeout = 5s
wal_receiver_timeout = 5s
wal_receiver_status_interval = 1s
synchronous_commit = on
max_standby_streaming_delay = 30s
log_min_messages = warning
log_checkpoints = off
";

/// A primary and its replicas living under one directory.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    primary_port: u16,
    replica_ports: Vec<u16>,
    /// Remove the directory when dropped (temporary test clusters).
    ephemeral: bool,
}

impl Cluster {
    /// Starts (creating it first if needed) a cluster under `dir`: the primary on
    /// `base_port`, replica *i* (1-based) on `base_port + i`. Idempotent: running nodes are
    /// left alone, stopped ones are started, missing replicas are created.
    pub fn up(dir: &Path, base_port: u16, replicas: usize) -> Result<Cluster> {
        let cluster = Cluster::up_existing(dir, base_port, replicas);
        cluster.ensure()?;
        Ok(cluster)
    }

    /// Handle on a cluster that `up` created earlier, without starting anything.
    pub fn up_existing(dir: &Path, base_port: u16, replicas: usize) -> Cluster {
        Cluster {
            dir: dir.to_path_buf(),
            primary_port: base_port,
            replica_ports: (1..=replicas as u16).map(|i| base_port + i).collect(),
            ephemeral: false,
        }
    }

    /// A fresh throwaway cluster in a new directory under /tmp on free ports below the
    /// kernel's ephemeral range; stopped and deleted on drop. Clusters left behind by test
    /// processes that have exited are reaped first.
    pub fn temporary(replicas: usize) -> Result<Cluster> {
        reap_orphans();
        let mut last_err = None;
        for _ in 0..5 {
            let base = free_port_block(replicas as u16 + 1)?;
            let dir = std::env::temp_dir().join(format!("sgc-{}-{}", std::process::id(), base));
            let _ = std::fs::remove_dir_all(&dir);
            let mut cluster = Cluster {
                dir,
                primary_port: base,
                replica_ports: (1..=replicas as u16).map(|i| base + i).collect(),
                ephemeral: true,
            };
            match cluster.ensure() {
                Ok(()) => return Ok(cluster),
                Err(e) => {
                    cluster.ephemeral = true;
                    drop(cluster);
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow!("could not start a temporary cluster")))
    }

    /// Creates what is missing and starts what is stopped: the primary, then each replica.
    fn ensure(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        chown_postgres(&self.dir)?;
        if !self.node_dir(0).join("PG_VERSION").exists() {
            self.init_primary()?;
        }
        self.start_node(0)?;
        for i in 1..=self.replica_ports.len() {
            if !self.node_dir(i).join("standby.signal").exists() {
                self.init_replica(i)?;
            }
            self.start_node(i)?;
        }
        Ok(())
    }

    /// A fresh primary data directory (anything half-made there is removed first).
    fn init_primary(&self) -> Result<()> {
        let primary = self.node_dir(0);
        let _ = std::fs::remove_dir_all(&primary);
        as_postgres(
            Command::new(format!("{PG_BIN}/initdb"))
                .args(["-A", "trust", "-U", "postgres", "-N", "-E", "UTF8"])
                .args(["--locale=C.UTF-8", "-D"])
                .arg(&primary),
        )
        .context("initdb")?;
        append(
            &primary.join("postgresql.conf"),
            &format!("{COMMON_CONF}port = {}\n", self.primary_port),
        )
    }

    /// Replica `i` from a base backup of the running primary, streaming through slot `r{i}`.
    fn init_replica(&self, i: usize) -> Result<()> {
        let dir = self.node_dir(i);
        let _ = std::fs::remove_dir_all(&dir);
        // Slot first (with WAL reserved), then the base backup; `-C` in parallel
        // loses WAL segments on this machine.
        self.psql(
            0,
            &format!(
                "SELECT pg_create_physical_replication_slot('r{i}', true) \
                 WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'r{i}')"
            ),
        )?;
        as_postgres(
            Command::new(format!("{PG_BIN}/pg_basebackup"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                    "-R",
                    "-N",
                    "-c",
                    "fast",
                ])
                .args(["-p", &self.primary_port.to_string()])
                .args(["-S", &format!("r{i}"), "-D"])
                .arg(&dir),
        )
        .with_context(|| format!("pg_basebackup for replica-{i}"))?;
        append(
            &dir.join("postgresql.conf"),
            &format!("port = {}\n", self.port(i)),
        )
    }

    fn node_dir(&self, node: usize) -> PathBuf {
        if node == 0 {
            self.dir.join("primary")
        } else {
            self.dir.join(format!("replica-{node}"))
        }
    }

    /// Port of node 0 (the primary) or replica `node` (1-based).
    pub fn port(&self, node: usize) -> u16 {
        if node == 0 {
            self.primary_port
        } else {
            self.replica_ports[node - 1]
        }
    }

    pub fn replica_count(&self) -> usize {
        self.replica_ports.len()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Connection URL for database `db` on the primary.
    pub fn primary_url(&self, db: &str) -> String {
        url(self.primary_port, db)
    }

    /// Connection URL for database `db` on replica `i` (1-based).
    pub fn replica_url(&self, i: usize, db: &str) -> String {
        url(self.port(i), db)
    }

    /// The replica URLs joined for `STOCKGATE_REPLICA_URLS`.
    pub fn replica_urls(&self, db: &str) -> String {
        (1..=self.replica_count())
            .map(|i| self.replica_url(i, db))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn is_running(&self, node: usize) -> bool {
        as_postgres(
            Command::new(format!("{PG_BIN}/pg_ctl"))
                .arg("status")
                .arg("-D")
                .arg(self.node_dir(node)),
        )
        .is_ok()
    }

    fn start_node(&self, node: usize) -> Result<()> {
        if self.is_running(node) {
            return Ok(());
        }
        let dir = self.node_dir(node);
        let _ = std::fs::remove_file(dir.join("postmaster.pid"));
        if TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], self.port(node))),
            Duration::from_millis(200),
        )
        .is_ok()
        {
            bail!(
                "port {} is taken by another process; choose another base port",
                self.port(node)
            );
        }
        as_postgres(
            Command::new(format!("{PG_BIN}/pg_ctl"))
                .args(["start", "-w", "-t", "30", "-l"])
                .arg(self.dir.join(format!("{}.log", node_name(node))))
                .arg("-D")
                .arg(&dir),
        )
        .with_context(|| {
            format!(
                "starting {} (log: {}/{}.log)",
                node_name(node),
                self.dir.display(),
                node_name(node)
            )
        })?;
        Ok(())
    }

    /// Runs one SQL statement on a node (0 = primary) in database `postgres`, returning
    /// the unaligned output.
    pub fn psql(&self, node: usize, sql: &str) -> Result<String> {
        let out = run(Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-X",
                "-A",
                "-t",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
            ])
            .args(["-p", &self.port(node).to_string(), "-c", sql])
            .env("PGCONNECT_TIMEOUT", "5"))
        .with_context(|| format!("psql on {}: {sql}", node_name(node)))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Creates database `name` on the primary (it replicates to every replica).
    pub fn create_database(&self, name: &str) -> Result<()> {
        self.psql(0, &format!("CREATE DATABASE \"{name}\""))?;
        Ok(())
    }

    /// Pauses WAL replay on replica `i` and waits until it is really paused.
    pub fn pause_replay(&self, i: usize) -> Result<()> {
        self.psql(i, "SELECT pg_wal_replay_pause()")?;
        wait_until(Duration::from_secs(10), || {
            Ok(self.psql(i, "SELECT pg_get_wal_replay_pause_state()")? == "paused")
        })
        .with_context(|| format!("replica-{i} did not pause"))
    }

    pub fn resume_replay(&self, i: usize) -> Result<()> {
        self.psql(i, "SELECT pg_wal_replay_resume()")?;
        Ok(())
    }

    /// Sets `recovery_min_apply_delay` on replica `i` (0 clears it) and reloads.
    pub fn set_apply_delay(&self, i: usize, ms: u64) -> Result<()> {
        self.psql(
            i,
            &format!("ALTER SYSTEM SET recovery_min_apply_delay = '{ms}'"),
        )?;
        self.psql(i, "SELECT pg_reload_conf()")?;
        Ok(())
    }

    /// Stops replica `i` abruptly (`-m immediate`), as a crash would.
    pub fn stop_replica(&self, i: usize) -> Result<()> {
        self.stop_node(i, "immediate")
    }

    pub fn start_replica(&self, i: usize) -> Result<()> {
        self.start_node(i)
    }

    /// Stops the primary (fast shutdown).
    pub fn stop_primary(&self) -> Result<()> {
        self.stop_node(0, "fast")
    }

    pub fn start_primary(&self) -> Result<()> {
        self.start_node(0)
    }

    fn stop_node(&self, node: usize, mode: &str) -> Result<()> {
        if !self.is_running(node) {
            return Ok(());
        }
        as_postgres(
            Command::new(format!("{PG_BIN}/pg_ctl"))
                .args(["stop", "-w", "-t", "60", "-m", mode, "-D"])
                .arg(self.node_dir(node)),
        )?;
        Ok(())
    }

    fn postmaster_pid(&self, node: usize) -> Result<u32> {
        let pidfile = std::fs::read_to_string(self.node_dir(node).join("postmaster.pid"))
            .with_context(|| format!("{} is not running", node_name(node)))?;
        pidfile
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| anyhow!("bad postmaster.pid"))
    }

    /// Freezes replica `i`: SIGSTOP to its postmaster and every child. The kernel still
    /// completes TCP handshakes, so clients need their own timeouts.
    pub fn freeze(&self, i: usize) -> Result<()> {
        self.signal_tree(i, "STOP")
    }

    /// Thaws a frozen replica (SIGCONT).
    pub fn thaw(&self, i: usize) -> Result<()> {
        self.signal_tree(i, "CONT")
    }

    fn signal_tree(&self, node: usize, sig: &str) -> Result<()> {
        let pid = self.postmaster_pid(node)?.to_string();
        run(Command::new("kill").args([&format!("-{sig}"), &pid]))?;
        // pkill exits 1 when there are no children; that is fine.
        let _ = Command::new("pkill")
            .args([&format!("-{sig}"), "-P", &pid])
            .status();
        Ok(())
    }

    /// The primary's current WAL position.
    pub fn primary_lsn(&self) -> Result<String> {
        self.psql(0, "SELECT pg_current_wal_lsn()")
    }

    /// Waits until every running, unpaused replica has replayed the primary's current WAL
    /// position.
    pub fn wait_caught_up(&self, timeout: Duration) -> Result<()> {
        let target = self.primary_lsn()?;
        for i in 1..=self.replica_count() {
            wait_until(timeout, || {
                Ok(self.psql(
                    i,
                    &format!("SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"),
                )? == "t")
            })
            .with_context(|| format!("replica-{i} did not reach {target}"))?;
        }
        Ok(())
    }

    /// Thaws, resumes and stops every node.
    pub fn down(&self) -> Result<()> {
        for i in (1..=self.replica_count()).rev() {
            let _ = self.thaw(i);
            self.stop_node(i, "immediate")?;
        }
        self.stop_node(0, "fast")
    }

    /// One line per node: name, port, running or stopped.
    pub fn status(&self) -> Vec<String> {
        (0..=self.replica_count())
            .map(|n| {
                let state = if self.is_running(n) {
                    "running"
                } else {
                    "stopped"
                };
                format!("{:<10} 127.0.0.1:{:<5} {state}", node_name(n), self.port(n))
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.ephemeral {
            for i in 1..=self.replica_count() {
                let _ = self.thaw(i);
            }
            for n in (0..=self.replica_count()).rev() {
                let _ = self.stop_node(n, "immediate");
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Stops and deletes temporary clusters (`/tmp/sgc-<pid>-<port>`) whose process has exited,
/// e.g. a test binary's shared cluster, which no destructor stops. Returns how many.
pub fn reap_orphans() -> usize {
    reap_dirs_of_exited("sgc-", |dir| {
        for node in ["replica-3", "replica-2", "replica-1", "primary"] {
            let dir = dir.join(node);
            if dir.join("postmaster.pid").exists() {
                let _ = as_postgres(
                    Command::new(format!("{PG_BIN}/pg_ctl"))
                        .args(["stop", "-w", "-t", "30", "-m", "immediate", "-D"])
                        .arg(&dir),
                );
            }
        }
    })
}

/// For each temporary directory `<prefix><pid>-<port>` whose process `pid` has exited:
/// `stop` what still runs there, then delete it. Returns how many.
pub(crate) fn reap_dirs_of_exited(prefix: &str, stop: impl Fn(&Path)) -> usize {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return 0;
    };
    let mut reaped = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some((pid, _)) = name.strip_prefix(prefix).and_then(|r| r.split_once('-')) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        stop(&entry.path());
        let _ = std::fs::remove_dir_all(entry.path());
        reaped += 1;
    }
    reaped
}

fn node_name(node: usize) -> String {
    if node == 0 {
        "primary".into()
    } else {
        format!("replica-{node}")
    }
}

fn url(port: u16, db: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/{db}")
}

/// A Redis server for the service's read-your-writes store.
#[derive(Debug)]
pub struct Redis {
    pub port: u16,
    dir: Option<PathBuf>,
}

impl Redis {
    /// The Redis on 6379 if it answers PING, else one of our own on `fallback_port`.
    pub fn ensure(fallback_port: u16) -> Result<Redis> {
        if ping_redis(6379) {
            return Ok(Redis {
                port: 6379,
                dir: None,
            });
        }
        if ping_redis(fallback_port) {
            return Ok(Redis {
                port: fallback_port,
                dir: None,
            });
        }
        let dir = std::env::temp_dir().join(format!("stockgate-redis-{fallback_port}"));
        start_redis(fallback_port, &dir)?;
        Ok(Redis {
            port: fallback_port,
            dir: None,
        })
    }

    /// A private Redis on a free port, stopped on drop; tests use it to kill Redis mid-test.
    pub fn temporary() -> Result<Redis> {
        let port = free_port_block(1)?;
        let dir = std::env::temp_dir().join(format!("sgr-{}-{port}", std::process::id()));
        start_redis(port, &dir)?;
        Ok(Redis {
            port,
            dir: Some(dir),
        })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Shuts this Redis down (only one we started ourselves).
    pub fn stop(&self) -> Result<()> {
        if self.dir.is_none() {
            bail!("refusing to stop a Redis this tool did not start");
        }
        let _ = run(Command::new("redis-cli").args([
            "-p",
            &self.port.to_string(),
            "shutdown",
            "nosave",
        ]));
        wait_until(Duration::from_secs(10), || Ok(!ping_redis(self.port)))
    }

    /// Starts it again after [`Redis::stop`].
    pub fn start(&self) -> Result<()> {
        match &self.dir {
            Some(dir) => start_redis(self.port, dir),
            None => bail!("not a Redis this tool started"),
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = Command::new("redis-cli")
                .args(["-p", &self.port.to_string(), "shutdown", "nosave"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn ping_redis(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ping"])
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        .unwrap_or(false)
}

fn start_redis(port: u16, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    run(Command::new("redis-server")
        .args([
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--port", &port.to_string()])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log")))
    .context("starting redis-server (is it installed? apt-get install redis-server)")?;
    wait_until(Duration::from_secs(10), || Ok(ping_redis(port)))
}

/// Polls `cond` every 20 ms until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    loop {
        match cond() {
            Ok(true) => return Ok(()),
            Ok(false) if start.elapsed() > timeout => bail!("condition not met within {timeout:?}"),
            Err(e) if start.elapsed() > timeout => return Err(e),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A block of `n` consecutive free TCP ports below 32768 (the kernel's ephemeral range
/// starts there: a stopped node's port could be taken as a source port).
pub fn free_port_block(n: u16) -> Result<u16> {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    // Spread processes apart so parallel test binaries rarely probe the same block.
    let seed = (std::process::id() as u64).wrapping_mul(2654435761) ^ now_nanos();
    for _ in 0..200 {
        let step = NEXT.fetch_add(n + 1, Ordering::Relaxed) as u64;
        let base = 20000 + ((seed + step * 7919) % 12000) as u16;
        if (base..base + n).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return Ok(base);
        }
    }
    bail!("no free block of {n} ports found in 20000–32767")
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0)
}

fn is_root() -> bool {
    static ROOT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // `id -u` avoids unsafe libc calls.
    *ROOT.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false)
    })
}

/// `cmd` as the `postgres` OS user when we are root, by `setpriv`, which execs (no fork), so
/// a spawned child's pid is the program's own.
fn as_postgres_cmd(cmd: &Command) -> Command {
    if is_root() {
        let mut wrapped = Command::new("setpriv");
        wrapped
            .args([
                "--reuid",
                "postgres",
                "--regid",
                "postgres",
                "--init-groups",
                "--",
            ])
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .env("HOME", "/var/lib/postgresql");
        wrapped
    } else {
        let mut same = Command::new(cmd.get_program());
        same.args(cmd.get_args());
        same
    }
}

fn as_postgres(cmd: &mut Command) -> Result<Output> {
    if is_root() {
        let mut wrapped = Command::new("runuser");
        wrapped
            .args(["-u", "postgres", "--"])
            .arg(cmd.get_program())
            .args(cmd.get_args());
        // runuser runs from the current directory, which postgres may not be able to read.
        wrapped.current_dir("/tmp");
        run(&mut wrapped)
    } else {
        run(cmd)
    }
}

fn chown_postgres(dir: &Path) -> Result<()> {
    if is_root() {
        run(Command::new("chown").args(["postgres:postgres"]).arg(dir))?;
    }
    Ok(())
}

fn append(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}{}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(out)
}
