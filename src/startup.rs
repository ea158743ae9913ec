//! Building and running the application: pools, monitor, store, router, listener.
//! The application binds its own listener, so tests start it on port 0.

use crate::auth::Tokens;
use crate::checkout::Checkout;
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::routing::freshness::Thresholds;
use crate::routing::monitor::MonitorGuard;
use crate::routing::{self, Db};
use crate::ryw::RywStore;
use anyhow::Context;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    state: AppState,
    drain_timeout: Duration,
    _monitor: MonitorGuard,
    _sweeper: crate::checkout::SweeperGuard,
}

/// The router alone (pools, read-your-writes store, freshness monitor): for `stockgate
/// replicas`, `import` and the router benchmark, which need the service's freshness signal
/// and nothing of its HTTP side.
pub async fn build_db(
    config: &Config,
    clock: Arc<dyn Clock>,
    metrics: &Metrics,
) -> anyhow::Result<(Db, MonitorGuard)> {
    let ryw = ryw_store(config, clock)?;
    let db = Db::new(routing_settings(config).await?, metrics.clone(), ryw)?;
    let monitor = db.start_monitor(config.monitor_interval);
    Ok((db, monitor))
}

/// The application's state: the router, tokens, checkout and import jobs.
async fn build_state(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<(AppState, MonitorGuard)> {
    let metrics = Metrics::new();
    let imports = http::Jobs::new(clock.clone());
    let (db, monitor) = build_db(config, clock, &metrics).await?;
    let tokens = Tokens::new(config.require_token_secret()?);
    let checkout = Checkout::new(
        db.clone(),
        metrics.clone(),
        crate::checkout::Batching {
            max: config.order_batch_max,
            window: config.order_batch_window,
        },
        config.order_rate_per_user,
    );
    let shared = http::Shared {
        db,
        tokens,
        metrics,
        checkout,
        imports,
    };
    Ok((AppState::from(shared), monitor))
}

/// The read-your-writes store (Redis when configured, else in-process), whose pins must
/// outlast the read-your-writes budget.
fn ryw_store(config: &Config, clock: Arc<dyn Clock>) -> anyhow::Result<RywStore> {
    let ryw = match &config.redis_url {
        Some(url) => RywStore::redis(url, clock, config.ryw_ttl).context("STOCKGATE_REDIS_URL")?,
        None => RywStore::local(clock, config.ryw_ttl),
    };
    let own_data_budget = routing::policy::QueryClass::OwnData.policy().budget();
    if config.ryw_ttl <= own_data_budget {
        anyhow::bail!(
            "STOCKGATE_RYW_TTL_MS ({} ms) must exceed the read-your-writes budget ({} ms), or a replica could serve a read that misses the write",
            config.ryw_ttl.as_millis(),
            own_data_budget.as_millis()
        );
    }
    Ok(ryw)
}

/// What the router needs from the configuration: nodes, pools, timeouts, thresholds.
async fn routing_settings(config: &Config) -> anyhow::Result<routing::Settings> {
    Ok(routing::Settings {
        primary_url: config.require_database_url()?.to_string(),
        replica_urls: config.replica_urls.clone(),
        primary_pool_size: config.primary_pool_size,
        replica_pool_size: config.replica_pool_size,
        timeouts: routing::Timeouts {
            point: config.replica_timeout,
            dashboard: config.dashboard_timeout,
            report: config.report_timeout,
            export: config.export_timeout,
        },
        primary_timeout: config.primary_timeout,
        thresholds: Thresholds {
            evict_after: config.evict_after,
            ..Thresholds::default()
        },
        monitor_interval: config.monitor_interval,
        patroni: patroni_setup(config).await?,
    })
}

/// With `STOCKGATE_PATRONI_URLS`, the members and leader as Patroni names them now (asked
/// for up to 30 s: a cluster still bootstrapping has no members yet).
async fn patroni_setup(config: &Config) -> anyhow::Result<Option<routing::PatroniSetup>> {
    use routing::patroni::{Patroni, member_url};
    if config.patroni_urls.is_empty() {
        return Ok(None);
    }
    let client = Patroni::new(config.patroni_urls.clone());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let topology = loop {
        match client.topology().await {
            Ok(t) if !t.members.is_empty() => break t,
            Ok(_) if std::time::Instant::now() < deadline => {}
            Err(_) if std::time::Instant::now() < deadline => {}
            Ok(_) => anyhow::bail!("STOCKGATE_PATRONI_URLS: the cluster has no members"),
            Err(e) => anyhow::bail!("STOCKGATE_PATRONI_URLS: {e}"),
        }
        tokio::time::sleep(routing::patroni::POLL).await;
    };
    let database_url = config.require_database_url()?;
    let members = topology
        .members
        .iter()
        .map(|m| {
            member_url(database_url, &m.host, m.port)
                .map(|u| (m.name.clone(), u))
                .map_err(|e| anyhow::anyhow!("DATABASE_URL for member {}: {e}", m.name))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let leader = topology
        .leader()
        .and_then(|l| members.iter().position(|(n, _)| *n == l.name));
    tracing::info!(members = members.len(), leader = ?topology.leader().map(|m| &m.name), timeline = ?topology.timeline(), "following Patroni");
    Ok(Some(routing::PatroniSetup {
        client,
        members,
        leader,
    }))
}

impl Application {
    pub async fn build(config: &Config) -> anyhow::Result<Application> {
        Self::build_with_clock(config, Arc::new(SystemClock)).await
    }

    pub async fn build_with_clock(
        config: &Config,
        clock: Arc<dyn Clock>,
    ) -> anyhow::Result<Application> {
        config.require_token_secret()?;
        let (state, monitor) = build_state(config, clock).await?;
        let router = http::router(state.clone(), config.max_in_flight, config.request_timeout);
        // Holds past their time give their units back within a second or so (the contract
        // allows 5 s), from the database's state, on every instance.
        let sweeper = state.checkout.start_hold_sweeper(Duration::from_secs(1));
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        Ok(Application {
            listener,
            router,
            state,
            drain_timeout: config.drain_timeout,
            _monitor: monitor,
            _sweeper: sweeper,
        })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` completes, then stops accepting, lets in-flight requests
    /// finish for at most the drain timeout, and returns.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let (tx, mut rx) = tokio::sync::watch::channel(false);
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight requests");
            let _ = tx.send(true);
        };
        let serve = axum::serve(self.listener, self.router).with_graceful_shutdown(signal);
        let drain = self.drain_timeout;
        tokio::select! {
            r = serve => r,
            _ = async move {
                let _ = rx.wait_for(|stop| *stop).await;
                tokio::time::sleep(drain).await;
            } => {
                tracing::warn!(?drain, "drain timeout reached; exiting with requests still in flight");
                Ok(())
            }
        }
    }
}

/// Applies the migrations in `migrations/` to the primary; safe to run twice.
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(routing::primary_options(database_url)?)
        .await
        .context("connecting to the primary")?;
    sqlx::migrate!("./migrations")
        .run(&pool)
        .await
        .context("applying migrations")?;
    pool.close().await;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
