//! The nemesis: pauses both replicas, restarts Redis empty, cuts the primary off and restarts
//! an instance, one fault at a time, each healed before the next.

use super::workload::{Choices, World};
use crate::helpers::*;
use devcluster::{Cluster, Redis};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Fault {
    ReplicasPaused,
    RedisRestartedEmpty,
    PrimaryCut,
    InstanceRestarted,
}

pub(super) const FAULTS: [Fault; 4] = [
    Fault::ReplicasPaused,
    Fault::RedisRestartedEmpty,
    Fault::PrimaryCut,
    Fault::InstanceRestarted,
];

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
    /// When each fault was in force, in ms since the history began, to line operations up.
    pub(super) windows: Vec<(Fault, u64, u64)>,
}

impl Nemesis<'_> {
    /// An instance of the deployment: the shared database, reached through the chaos proxy,
    /// the private Redis, both replicas.
    async fn spawn_instance(&self) -> TestApp {
        spawn_instance(self.cluster, &self.database, &self.redis, &self.proxy).await
    }

    pub(super) async fn run(&mut self, deadline: Instant) {
        for fault in FAULTS.iter().cycle() {
            if Instant::now() >= deadline {
                return;
            }
            let hold = self.rng.ms(800, 2500);
            let from = self.world.start.elapsed().as_millis() as u64;
            match fault {
                Fault::ReplicasPaused => {
                    blocking(|| {
                        self.cluster.pause_replay(1).unwrap();
                        self.cluster.pause_replay(2).unwrap();
                    });
                    tokio::time::sleep(hold).await;
                    blocking(|| {
                        self.cluster.resume_replay(1).unwrap();
                        self.cluster.resume_replay(2).unwrap();
                    });
                }
                Fault::RedisRestartedEmpty => {
                    blocking(|| self.redis.stop()).unwrap();
                    tokio::time::sleep(hold).await;
                    blocking(|| self.redis.start()).unwrap();
                }
                Fault::PrimaryCut => {
                    self.proxy.cut();
                    tokio::time::sleep(hold).await;
                    self.proxy.heal();
                }
                Fault::InstanceRestarted => {
                    let slot = self.rng.instance();
                    // Dropping it shuts it down: it drains what it has in flight.
                    self.apps[slot] = None;
                    let app = self.spawn_instance().await;
                    *self.world.addresses[slot].write().unwrap() = app.address.clone();
                    self.apps[slot] = Some(app);
                }
            }
            *self.injected.entry(*fault).or_default() += 1;
            let to = self.world.start.elapsed().as_millis() as u64;
            self.windows.push((*fault, from, to));
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
        env: vec![(
            "DATABASE_URL",
            format!("postgres://postgres@127.0.0.1:{}/{db}", proxy.port),
        )],
        ..AppOptions::new(cluster)
    })
    .await
}
