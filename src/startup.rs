//! Building and running the application: pools, monitor, store, router, listener.
//! The application binds its own listener, so tests start it on port 0.
//!
//! HTTP is served by `STOCKGATE_HTTP_THREADS` threads (one per CPU by default), each running
//! its own single-threaded runtime, the way nginx runs a worker per core. One task on the
//! main runtime accepts connections and hands them out in turn; a connection then lives on
//! its thread, where its requests are parsed, answered and written with no hand-off between
//! threads. Side by side with tokio's work-stealing runtime serving everything, this took CPU
//! off an availability answer (`bench/results/2026-12-01.md`).
//! Handing out in turn, rather than letting every thread accept, keeps a burst of new
//! connections (a load test's 64 at once) spread evenly. The freshness monitor, the
//! read-your-writes store's connection and the hold sweeper run on the main runtime; a task a
//! request spawns (an order's batch, a cancel) runs on that request's thread. Any thread may
//! use any pooled connection: tokio delivers a socket's readiness from the runtime that
//! registered it to whichever task waits on it, and every serving runtime runs until the
//! application has stopped.

use crate::auth::Tokens;
use crate::checkout::Checkout;
use crate::clock::{Clock, SystemClock, TimeBase};
use crate::config::Config;
use crate::events::feed::{Feed, FeedGuard};
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
    /// Where peers send the orders of products this instance owns (`STOCKGATE_PEERS`), and
    /// what serves it.
    peer_listener: Option<(TcpListener, axum::Router)>,
    http_threads: usize,
    router: axum::Router,
    state: AppState,
    drain_timeout: Duration,
    _monitor: MonitorGuard,
    _sweeper: crate::checkout::SweeperGuard,
    _feed: FeedGuard,
    _webhooks: crate::events::webhooks::DeliveryGuard,
}

/// The router alone (pools, read-your-writes store, freshness monitor): for `stockgate
/// replicas`, `import` and the router benchmark, which need the service's freshness signal
/// and nothing of its HTTP side.
pub async fn build_db(
    config: &Config,
    clock: Arc<dyn Clock>,
    metrics: &Metrics,
) -> anyhow::Result<(Db, MonitorGuard)> {
    let time = TimeBase::with_wall({
        let clock = clock.clone();
        move || clock.wall()
    });
    let ryw = ryw_store(config, clock)?;
    let db = Db::new(routing_settings(config, time).await?, metrics.clone(), ryw)?;
    let monitor = db.start_monitor(config.monitor_interval);
    Ok((db, monitor))
}

/// The application's state: the router, tokens, checkout and import jobs.
async fn build_state(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> anyhow::Result<(AppState, MonitorGuard, FeedGuard)> {
    let metrics = Metrics::new();
    let imports = http::Jobs::new(clock.clone());
    let (db, monitor) = build_db(config, clock.clone(), &metrics).await?;
    let tokens = Tokens::new(config.require_token_secret()?);
    let checkout = Checkout::new(
        db.clone(),
        metrics.clone(),
        crate::checkout::Batching {
            max: config.order_batch_max,
            window: config.order_batch_window,
        },
        config.order_rate_per_user,
        clock.clone(),
    );
    let (feed, feed_guard) = Feed::start(db.clone(), metrics.clone(), config.event_retention);
    let peers = config.peer_url.as_ref().map(|me| {
        http::peer::Peers::new(
            me.clone(),
            config.peers.clone(),
            tokens.clone(),
            metrics.clone(),
            clock.clone(),
        )
    });
    let shared = http::Shared {
        db,
        tokens,
        metrics,
        checkout,
        imports,
        feed,
        peers,
        rates: Default::default(),
    };
    Ok((AppState::from(shared), monitor, feed_guard))
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
async fn routing_settings(config: &Config, time: TimeBase) -> anyhow::Result<routing::Settings> {
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
        time,
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
        let (state, monitor, feed) = build_state(config, clock).await?;
        let router = http::router(state.clone(), config.max_in_flight, config.request_timeout);
        let peer_router = || {
            http::peer_router(
                state.clone(),
                http::Limits {
                    max_in_flight: config.max_in_flight,
                    request_timeout: config.request_timeout,
                    body: http::BODY_LIMIT,
                },
            )
        };
        // Holds past their time give their units back within a second or so (the contract
        // allows 5 s), from the database's state, on every instance; refusals older than the
        // idempotency window go too.
        let sweeper = state
            .checkout
            .start_sweeper(Duration::from_secs(1), config.idempotency_window);
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let peer_listener = match config.peer_listen() {
            Some(addr) => Some((
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the peer listener {addr}"))?,
                peer_router(),
            )),
            None => None,
        };
        Ok(Application {
            listener,
            peer_listener,
            http_threads: config.http_threads,
            router,
            _webhooks: crate::events::webhooks::start(state.db.clone(), state.metrics.clone()),
            state,
            drain_timeout: config.drain_timeout,
            _monitor: monitor,
            _sweeper: sweeper,
            _feed: feed,
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
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let local = self.listener.local_addr()?;
        let mut threads = (0..self.http_threads)
            .map(|i| ServingThread::start(i, local, self.router.clone(), stopped.clone()))
            .collect::<std::io::Result<Vec<_>>>()?;
        drop(self.router);
        // The peer listener stops and drains with the public one: orders a peer sent are
        // answered before this instance exits.
        let peers = self.peer_listener.map(|(listener, router)| {
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                axum::serve(listener, router)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
            })
        });
        let handing_out = tokio::spawn(hand_out(
            self.listener,
            threads.iter().map(|t| t.connections.clone()).collect(),
            stopped,
        ));
        shutdown.await;
        tracing::info!("shutting down: draining in-flight requests");
        let _ = stop.send(true);
        let _ = handing_out.await;
        let drained = async {
            let served = futures::future::join_all(threads.iter_mut().map(|t| &mut t.served)).await;
            if let Some(peers) = peers {
                let _ = peers.await;
            }
            served
        };
        match tokio::time::timeout(self.drain_timeout, drained).await {
            Ok(results) => results.into_iter().try_for_each(|r| {
                r.unwrap_or_else(|_| Err(std::io::Error::other("a serving thread died")))
            }),
            Err(_) => {
                let drain = self.drain_timeout;
                tracing::warn!(
                    ?drain,
                    "drain timeout reached; exiting with requests still in flight"
                );
                Ok(())
            }
        }
    }
}

/// A connection accepted on the main runtime, on its way to a serving thread.
type Handed = (std::net::TcpStream, std::net::SocketAddr);

/// Accepts connections until `stopped`, giving each to the next serving thread in turn.
async fn hand_out(
    mut listener: TcpListener,
    threads: Vec<tokio::sync::mpsc::UnboundedSender<Handed>>,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) {
    for next in (0..threads.len()).cycle() {
        let (stream, addr) = tokio::select! {
            c = axum::serve::Listener::accept(&mut listener) => c,
            _ = stopped.wait_for(|stop| *stop) => return,
        };
        // Out of this runtime's reactor, into the serving thread's.
        match stream.into_std() {
            Ok(stream) => {
                if threads[next].send((stream, addr)).is_err() {
                    tracing::error!(
                        thread = next,
                        "a serving thread has stopped; its connection is dropped"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "dropping an accepted connection"),
        }
    }
}

/// The connections handed to one serving thread, as `axum::serve` takes them.
struct HandedOut {
    connections: tokio::sync::mpsc::UnboundedReceiver<Handed>,
    local: std::net::SocketAddr,
}

impl axum::serve::Listener for HandedOut {
    type Io = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Some((stream, addr)) = self.connections.recv().await else {
                // Accepting has stopped: the graceful shutdown ends this serve.
                return std::future::pending().await;
            };
            match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => return (stream, addr),
                Err(e) => tracing::warn!(error = %e, "dropping an accepted connection"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// One thread serving HTTP on its own single-threaded runtime. The runtime (with the tasks
/// its requests spawned and the sockets they opened) runs until this value is dropped, after
/// the application has stopped serving.
struct ServingThread {
    connections: tokio::sync::mpsc::UnboundedSender<Handed>,
    /// How `axum::serve` ended on this thread: after the stop signal, once its connections
    /// have drained.
    served: tokio::sync::oneshot::Receiver<std::io::Result<()>>,
    /// Dropped to let the runtime end.
    _release: tokio::sync::oneshot::Sender<()>,
}

impl ServingThread {
    fn start(
        i: usize,
        local: std::net::SocketAddr,
        router: axum::Router,
        mut stopped: tokio::sync::watch::Receiver<bool>,
    ) -> std::io::Result<ServingThread> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (connections, handed) = tokio::sync::mpsc::unbounded_channel();
        let (served_tx, served) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let listener = HandedOut {
            connections: handed,
            local,
        };
        std::thread::Builder::new()
            .name(format!("stockgate-http-{i}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let result = axum::serve(listener, router)
                        .with_graceful_shutdown(async move {
                            let _ = stopped.wait_for(|stop| *stop).await;
                        })
                        .await;
                    let _ = served_tx.send(result);
                    let _ = released.await;
                });
            })?;
        Ok(ServingThread {
            connections,
            served,
            _release: release,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connections_are_handed_to_the_serving_threads_in_turn_until_stopped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (senders, mut receivers): (Vec<_>, Vec<_>) = (0..3)
            .map(|_| tokio::sync::mpsc::unbounded_channel::<Handed>())
            .unzip();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let accepting = tokio::spawn(hand_out(listener, senders, stopped));
        let mut clients = Vec::new();
        for _ in 0..7 {
            clients.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        let mut counts = [0; 3];
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while counts.iter().sum::<usize>() < clients.len() {
            assert!(std::time::Instant::now() < deadline, "handed {counts:?}");
            for (n, rx) in counts.iter_mut().zip(&mut receivers) {
                while rx.try_recv().is_ok() {
                    *n += 1;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(counts, [3, 2, 2], "7 connections, 3 threads, in turn");
        let _ = stop.send(true);
        accepting.await.expect("hand_out ends when stopped");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener is closed once accepting stops"
        );
    }
}
