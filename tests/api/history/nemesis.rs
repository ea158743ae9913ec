//! The nemesis: pauses both replicas, restarts Redis empty, cuts the primary off and restarts
//! an instance, one fault at a time, each healed before the next.
//!
//! The two faults that read-your-writes must survive are only faults if a replica would
//! otherwise serve a user's own data: so each waits until both instances serve a never-writing
//! user's settings from a replica (a Redis restart pins every user to the primary for one TTL,
//! and so does a brand-new deployment's first minute), and Redis is restarted while both
//! replicas lack the latest writes (their replay paused since before those writes).

use super::model::{Kind, Record, Target};
use super::workload::{Choices, PROBE_USER, World};
use crate::helpers::*;
use devcluster::{Cluster, Redis};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Fault {
    ReplicasPaused,
    RedisRestartedEmpty,
    PrimaryCut,
    InstanceRestarted,
}

/// In this order: the two that need replicas serving own data come last in a cycle, so the
/// first one's wait for the end of a brand-new deployment's pin costs the run little.
pub(super) const FAULTS: [Fault; 4] = [
    Fault::PrimaryCut,
    Fault::InstanceRestarted,
    Fault::ReplicasPaused,
    Fault::RedisRestartedEmpty,
];

/// How long a user's write pins their reads on the instances under test: just over the
/// own-data budget (5 s), so the pin-all window a Redis restart opens is over soon enough for
/// the next pause to meet replicas that serve own data.
pub(super) const RYW_TTL_MS: u64 = 6000;

/// When a fault was in force, in ms since the history began, to line operations up with it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Window {
    pub(super) fault: Fault,
    /// From when it was in force (replay paused, Redis stopped, the proxy cut, the instance
    /// dropped) …
    pub(super) from: u64,
    /// … until its healing began.
    pub(super) to: u64,
    /// `RedisRestartedEmpty`: when Redis was stopped and when it answered again; the replicas'
    /// replay is paused over the whole window.
    pub(super) redis_down: Option<(u64, u64)>,
}

/// Everything the faults act on. Each fault heals itself before the next one starts.
pub(super) struct Nemesis<'a> {
    pub(super) cluster: &'a Cluster,
    pub(super) database: String,
    pub(super) redis: Redis,
    pub(super) proxy: ChaosProxy,
    pub(super) apps: [Option<TestApp>; 2],
    pub(super) world: Arc<World>,
    pub(super) rng: fastrand::Rng,
    pub(super) injected: BTreeMap<Fault, usize>,
    pub(super) windows: Vec<Window>,
}

impl Nemesis<'_> {
    /// An instance of the deployment: the shared database, reached through the chaos proxy,
    /// the private Redis, both replicas.
    async fn spawn_instance(&self) -> TestApp {
        spawn_instance(self.cluster, &self.database, &self.redis, &self.proxy).await
    }

    fn now(&self) -> u64 {
        self.world.start.elapsed().as_millis() as u64
    }

    /// Polls until both instances serve own data from a replica; false if the run ended
    /// first (the fault is then not injected).
    async fn replicas_serve_own_data(&self, deadline: Instant) -> bool {
        while Instant::now() < deadline {
            let mut both = true;
            for i in 0..2 {
                let served = self.world.probe_own_read(i).await;
                both &= served.is_some_and(|s| s != "primary");
            }
            if both {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Reads the never-writing user's settings through both instances, into the history: where
    /// they are served shows whether replicas serve own data inside a fault's window.
    async fn probe(&self) {
        for i in 0..2 {
            let target = Target::Read {
                user: PROBE_USER.into(),
                record: Record::Settings,
            };
            self.world
                .call("nemesis", Kind::Read, i, target, None)
                .await;
        }
    }

    fn pause_replicas(&self) {
        blocking(|| {
            self.cluster.pause_replay(1).unwrap();
            self.cluster.pause_replay(2).unwrap();
        });
    }

    fn resume_replicas(&self) {
        blocking(|| {
            self.cluster.resume_replay(1).unwrap();
            self.cluster.resume_replay(2).unwrap();
        });
    }

    pub(super) async fn run(&mut self, deadline: Instant) {
        for fault in FAULTS.iter().cycle() {
            if Instant::now() >= deadline {
                return;
            }
            let needs_replicas =
                matches!(fault, Fault::ReplicasPaused | Fault::RedisRestartedEmpty);
            if needs_replicas && !self.replicas_serve_own_data(deadline).await {
                return;
            }
            let hold = self.rng.ms(800, 2500);
            let mut redis_down = None;
            let (from, to) = match fault {
                Fault::ReplicasPaused => {
                    self.pause_replicas();
                    let from = self.now();
                    tokio::time::sleep(hold / 2).await;
                    self.probe().await;
                    tokio::time::sleep(hold / 2).await;
                    let to = self.now();
                    self.resume_replicas();
                    (from, to)
                }
                // Writes land while the replicas lack them (their positions reach Redis), Redis
                // comes back without them, and reads follow while the replicas still lack them:
                // only the store's epoch then keeps a read off a replica. The whole pause stays
                // well inside the own-data budget, so the replicas are not evicted for it.
                Fault::RedisRestartedEmpty => {
                    self.pause_replicas();
                    let from = self.now();
                    tokio::time::sleep(self.rng.ms(600, 1200)).await;
                    self.probe().await;
                    blocking(|| self.redis.stop()).unwrap();
                    let stopped = self.now();
                    tokio::time::sleep(self.rng.ms(300, 800)).await;
                    blocking(|| self.redis.start()).unwrap();
                    redis_down = Some((stopped, self.now()));
                    tokio::time::sleep(self.rng.ms(800, 1200)).await;
                    // With the store's epoch, these go to the primary (every user is pinned).
                    self.probe().await;
                    let to = self.now();
                    self.resume_replicas();
                    (from, to)
                }
                Fault::PrimaryCut => {
                    self.proxy.cut();
                    let from = self.now();
                    tokio::time::sleep(hold).await;
                    let to = self.now();
                    self.proxy.heal();
                    (from, to)
                }
                Fault::InstanceRestarted => {
                    let slot = self.rng.instance();
                    let from = self.now();
                    // Dropping it shuts it down: it drains what it has in flight.
                    self.apps[slot] = None;
                    let app = self.spawn_instance().await;
                    *self.world.addresses[slot].write().unwrap() = app.address.clone();
                    self.apps[slot] = Some(app);
                    (from, self.now())
                }
            };
            *self.injected.entry(*fault).or_default() += 1;
            self.windows.push(Window {
                fault: *fault,
                from,
                to,
                redis_down,
            });
            tokio::time::sleep(self.rng.ms(500, 1500)).await;
        }
    }
}

pub(super) async fn spawn_instance(
    cluster: &Cluster,
    db: &str,
    redis: &Redis,
    proxy: &ChaosProxy,
) -> TestApp {
    spawn_app_with(AppOptions {
        database: Some(db.to_string()),
        redis_url: Some(redis.url()),
        env: vec![
            (
                "DATABASE_URL",
                format!("postgres://postgres@127.0.0.1:{}/{db}", proxy.port),
            ),
            ("STOCKGATE_RYW_TTL_MS", RYW_TTL_MS.to_string()),
        ],
        ..AppOptions::new(cluster)
    })
    .await
}
