//! `devcluster`: the command-line face of the local cluster tooling, used by `./dev`.
//!
//! ```text
//! devcluster up|down|status|env|wait|reap
//! devcluster pause|resume|stop|start|freeze|thaw N
//! devcluster delay N MS
//! devcluster ha up [--async]|down|status|env|wait|switchover|sync on|off|kill N|stop N|start N
//! ```
//! The HA cluster (three Patroni-managed nodes and an etcd) lives in `STOCKGATE_DEV_DIR`-ha on
//! ports from `STOCKGATE_DEV_HA_PORT` (default 16400: etcd; node *i* PostgreSQL on
//! 16400 + 2i, its Patroni REST API on the next port).
//! The directory and base port come from `STOCKGATE_DEV_DIR` (default /tmp/stockgate-dev)
//! and `STOCKGATE_DEV_PORT` (default 15432: primary; replicas take the next ports); the
//! Redis is the one on 6379 if it answers, else our own on `STOCKGATE_DEV_REDIS_PORT` (16379).

use anyhow::{Context, Result, bail};
use devcluster::ha::{self, HaCluster};
use devcluster::{Cluster, Redis};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: devcluster up|down|status|env|wait|reap|stop-primary|start-primary | pause|resume|stop|start|freeze|thaw N | delay N MS";

fn main() {
    if let Err(e) = run() {
        eprintln!("devcluster: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(
        std::env::var("STOCKGATE_DEV_DIR").unwrap_or_else(|_| "/tmp/stockgate-dev".into()),
    );
    let port = env_port("STOCKGATE_DEV_PORT", "15432")?;
    let redis_port = env_port("STOCKGATE_DEV_REDIS_PORT", "16379")?;
    match args.first().map(String::as_str).unwrap_or("") {
        "ha" => ha(&args[1..], &dir, redis_port),
        "reap" => {
            println!(
                "reaped {} leftover test cluster(s)",
                devcluster::reap_orphans() + devcluster::ha::reap_orphans()
            );
            Ok(())
        }
        "up" => up(&dir, port, redis_port),
        cmd => on_existing(cmd, &args, &dir, port, redis_port),
    }
}

/// A port number from the environment, or `default`.
fn env_port(key: &str, default: &str) -> Result<u16> {
    std::env::var(key)
        .unwrap_or_else(|_| default.into())
        .parse()
        .with_context(|| format!("{key} must be a port number"))
}

/// The 1-based replica or node number in `args[i]`, at most `max`.
fn number(args: &[String], i: usize, usage: &'static str, max: usize, must: &str) -> Result<usize> {
    let n: usize = args
        .get(i)
        .context(usage)?
        .parse()
        .context(must.to_string())?;
    if !(1..=max).contains(&n) {
        bail!("{must}");
    }
    Ok(n)
}

/// `devcluster up`: creates or starts the cluster and the Redis, and says what runs where.
fn up(dir: &Path, port: u16, redis_port: u16) -> Result<()> {
    let t = Instant::now();
    let cluster = Cluster::up(dir, port, 2)?;
    let redis = Redis::ensure(redis_port)?;
    for line in cluster.status() {
        println!("{line}");
    }
    println!("redis      127.0.0.1:{:<5} running", redis.port);
    println!(
        "cluster ready in {:.1}s (data in {})",
        t.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(())
}

/// Every other command works on an existing cluster without creating one.
fn on_existing(cmd: &str, args: &[String], dir: &Path, port: u16, redis_port: u16) -> Result<()> {
    if !dir.join("primary/PG_VERSION").exists() {
        bail!("no cluster in {}; run `devcluster up` first", dir.display());
    }
    let cluster = Cluster::up_existing(dir, port, 2);
    let replica = || number(args, 1, USAGE, 2, "replica number must be 1 or 2");
    match cmd {
        "down" => cluster.down()?,
        "status" => cluster.status().iter().for_each(|l| println!("{l}")),
        "env" => {
            let redis = Redis::ensure(redis_port)?;
            println!("DATABASE_URL={}", cluster.primary_url("stockgate"));
            println!(
                "STOCKGATE_REPLICA_URLS={}",
                cluster.replica_urls("stockgate")
            );
            println!("STOCKGATE_REDIS_URL={}", redis.url());
        }
        "wait" => cluster.wait_caught_up(Duration::from_secs(30))?,
        "stop-primary" => cluster.stop_primary()?,
        "start-primary" => cluster.start_primary()?,
        "pause" => cluster.pause_replay(replica()?)?,
        "resume" => cluster.resume_replay(replica()?)?,
        "stop" => cluster.stop_replica(replica()?)?,
        "start" => cluster.start_replica(replica()?)?,
        "freeze" => cluster.freeze(replica()?)?,
        "thaw" => cluster.thaw(replica()?)?,
        "delay" => {
            let ms: u64 = args
                .get(2)
                .context(USAGE)?
                .parse()
                .context("delay is in milliseconds")?;
            cluster.set_apply_delay(replica()?, ms)?
        }
        _ => bail!("{USAGE}"),
    }
    Ok(())
}

const HA_USAGE: &str = "usage: devcluster ha up [--async]|down|status|env|wait|switchover|sync on|off|kill N|stop N|start N";

/// `devcluster ha …`: the Patroni cluster for `./dev up --ha`.
fn ha(args: &[String], dir: &Path, redis_port: u16) -> Result<()> {
    let dir = PathBuf::from(format!("{}-ha", dir.display()));
    let port = env_port("STOCKGATE_DEV_HA_PORT", "16400")?;
    let synchronous = !args.iter().any(|a| a == "--async");
    let cmd = args.first().map(String::as_str).unwrap_or("");
    if cmd == "up" {
        return ha_up(&dir, port, synchronous, redis_port);
    }
    if !dir.join("node1/patroni.yml").exists() {
        bail!(
            "no HA cluster in {}; run `devcluster ha up` first",
            dir.display()
        );
    }
    let mut cluster = HaCluster::existing(&dir, port, synchronous);
    let node = || {
        number(
            args,
            1,
            HA_USAGE,
            ha::NODES,
            "node number must be 1, 2 or 3",
        )
    };
    match cmd {
        "down" => cluster.down()?,
        "status" => cluster.status().iter().for_each(|l| println!("{l}")),
        "env" => {
            let redis = Redis::ensure(redis_port)?;
            println!("DATABASE_URL={}", cluster.database_url("stockgate"));
            println!("STOCKGATE_PATRONI_URLS={}", cluster.patroni_urls());
            println!("STOCKGATE_REDIS_URL={}", redis.url());
        }
        "wait" => cluster.wait_healthy(Duration::from_secs(90))?,
        "switchover" => {
            let t = Instant::now();
            let to = cluster.switchover()?;
            let (leader, took) = (cluster.name(to), t.elapsed().as_secs_f64());
            println!("{leader} leads after {took:.1}s");
        }
        "sync" => match args.get(1).map(String::as_str) {
            Some("on") => cluster.set_synchronous(true)?,
            Some("off") => cluster.set_synchronous(false)?,
            _ => bail!("usage: devcluster ha sync on|off"),
        },
        "kill" => cluster.kill_node(node()?)?,
        "stop" => cluster.stop_node(node()?)?,
        "start" => cluster.start_node(node()?)?,
        _ => bail!("{HA_USAGE}"),
    }
    Ok(())
}

/// `devcluster ha up`: creates or starts the HA cluster and the Redis.
fn ha_up(dir: &Path, port: u16, synchronous: bool, redis_port: u16) -> Result<()> {
    let t = Instant::now();
    let cluster = HaCluster::up(dir, port, synchronous)?;
    let redis = Redis::ensure(redis_port)?;
    cluster.status().iter().for_each(|l| println!("{l}"));
    println!("redis  127.0.0.1:{}", redis.port);
    println!(
        "HA cluster healthy in {:.1}s (synchronous_mode {synchronous}; data in {})",
        t.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(())
}
