//! Per-request costs of routing and of read-your-writes, measured in-process against the
//! local cluster (`./dev up`; the URLs come from `./dev cluster env`).
//!
//! ```sh
//! eval "$(./dev cluster env | sed 's/^/export /')" && cargo bench --bench router
//! ```
//! Prints a table and writes it to `bench/results/router-<date>.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};
use stockgate::clock::SystemClock;
use stockgate::config::Config;
use stockgate::domain::UserId;
use stockgate::routing::policy::QueryClass;
use stockgate::routing::{Db, ReadCtx};
use stockgate::ryw::RywStore;

fn per_op(total: Duration, n: u32) -> String {
    let ns = total.as_nanos() as f64 / n as f64;
    if ns < 10_000.0 {
        format!("{ns:.0} ns")
    } else {
        format!("{:.1} µs", ns / 1000.0)
    }
}

/// One row of the table: what was measured, its cost per operation, a note.
type Row = (&'static str, String, String);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut config = Config::from_env().map_err(|e| anyhow::anyhow!(e.0))?;
    config.token_secret = Some("bench-secret-0123456789".into());
    anyhow::ensure!(
        config.database_url.is_some(),
        "set DATABASE_URL etc.: eval \"$(./dev cluster env | sed 's/^/export /')\""
    );
    let metrics = stockgate::metrics::Metrics::new();
    let (db, _monitor) =
        stockgate::startup::build_db(&config, Arc::new(SystemClock), &metrics).await?;
    wait_for_healthy_replicas(&db).await?;
    let mut rows = vec![routing_decision(&db).await?];
    rows.extend(ryw_lookups(&config).await?);
    rows.push(monitor_queries(&db, &config).await);
    write_table(rows)
}

async fn wait_for_healthy_replicas(db: &Db) -> anyhow::Result<()> {
    let start = Instant::now();
    while !db
        .replica_status()
        .iter()
        .all(|r| r.state.as_str() == "healthy")
    {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(10),
            "replicas not healthy: is ./dev up running?"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A routing decision: freshness from memory, policy lookup, metrics, the Route value.
async fn routing_decision(db: &Db) -> anyhow::Result<Row> {
    let n = 200_000;
    let t = Instant::now();
    let mut to_replica = 0;
    for _ in 0..n {
        let route = db.route(QueryClass::StockGate, &ReadCtx::none()).await?;
        to_replica += usize::from(!route.is_primary());
    }
    Ok((
        "route a stock-gate read (Db::route)",
        per_op(t.elapsed(), n),
        format!("{to_replica} of {n} to a replica"),
    ))
}

/// Read-your-writes lookups: in-process, Redis, and Redis down (fail closed).
async fn ryw_lookups(config: &Config) -> anyhow::Result<Vec<Row>> {
    let user = UserId::parse("bench-user").map_err(|e| anyhow::anyhow!(e.message))?;
    let local = RywStore::local(Arc::new(SystemClock), Duration::from_secs(60));
    local.advance(&user, 1).await?;
    let n = 200_000;
    let t = Instant::now();
    for _ in 0..n {
        let _ = local.get(&user).await;
    }
    let mut rows = vec![(
        "read-your-writes lookup, in-process",
        per_op(t.elapsed(), n),
        String::new(),
    )];
    let redis_url = config
        .redis_url
        .clone()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/".into());
    let redis = RywStore::redis(&redis_url, Arc::new(SystemClock), Duration::from_secs(60))?;
    redis.advance(&user, 1).await?;
    let m = 20_000;
    let t = Instant::now();
    for _ in 0..m {
        redis.get(&user).await?;
    }
    rows.push((
        "read-your-writes lookup, Redis (one round trip)",
        per_op(t.elapsed(), m),
        redis_url,
    ));
    rows.push(ryw_lookup_with_redis_down(&user).await?);
    Ok(rows)
}

async fn ryw_lookup_with_redis_down(user: &UserId) -> anyhow::Result<Row> {
    let down = RywStore::redis(
        "redis://127.0.0.1:1/",
        Arc::new(SystemClock),
        Duration::from_secs(60),
    )?;
    let k = 2_000;
    let mut failed = 0;
    let mut each = Vec::with_capacity(k as usize);
    for _ in 0..k {
        let t = Instant::now();
        failed += usize::from(down.get(user).await.is_err());
        each.push(t.elapsed());
    }
    each.sort_unstable();
    let total: Duration = each.iter().sum();
    Ok((
        "read-your-writes lookup, Redis down (fails closed)",
        per_op(total, k),
        format!(
            "{failed} of {k} failed closed; median {:?}, worst {:?} (one probe per 500 ms)",
            each[each.len() / 2],
            each[each.len() - 1]
        ),
    ))
}

/// What the monitor costs each node.
async fn monitor_queries(db: &Db, config: &Config) -> Row {
    let samples = || {
        db.metrics()
            .monitor_samples
            .with_label_values(&["primary"])
            .get()
    };
    let before = samples();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let per_s = (samples() - before) as f64 / 5.0;
    (
        "monitor queries per node",
        format!("{per_s:.0}/s"),
        format!(
            "one single-row SELECT each, every {:?}",
            config.monitor_interval
        ),
    )
}

fn write_table(rows: Vec<Row>) -> anyhow::Result<()> {
    let mut out = format!(
        "## routing costs, {}\n\n| measurement | per operation | note |\n|---|---|---|\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
    for (what, cost, note) in rows {
        out.push_str(&format!("| {what} | {cost} | {note} |\n"));
    }
    print!("{out}");
    std::fs::create_dir_all("bench/results")?;
    let file = format!(
        "bench/results/router-{}.md",
        chrono::Utc::now().format("%Y-%m-%d")
    );
    std::fs::write(&file, &out)?;
    eprintln!("written to {file}");
    Ok(())
}
