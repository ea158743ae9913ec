//! What operators see of the replicas: their states, the worst staleness, and the routing
//! series exported from the start.

use super::Db;
use super::choose::possible_decisions;
use super::freshness::{Lsn, ReplicaState, ReplicaView};
use super::policy::{self, Target};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct ReplicaStatus {
    pub name: String,
    pub state: ReplicaState,
    pub staleness: Option<Duration>,
    pub lag_bytes: Option<u64>,
    pub replay_lsn: Option<Lsn>,
    pub as_of: Option<chrono::DateTime<chrono::Utc>>,
    pub last_error: Option<String>,
    pub in_flight: usize,
}

/// [`Db::worst_serving_staleness`] over `statuses`, the member at `leader` left out.
fn worst_and_down(
    statuses: Vec<ReplicaStatus>,
    leader: Option<usize>,
) -> (Option<(String, Duration)>, Vec<String>) {
    let mut worst: Option<(String, Duration)> = None;
    let mut down = Vec::new();
    for (i, s) in statuses.into_iter().enumerate() {
        if Some(i) == leader {
            continue;
        }
        if s.state == ReplicaState::Down {
            down.push(s.name);
            continue;
        }
        let st = s.staleness.unwrap_or(Duration::MAX);
        if worst.as_ref().is_none_or(|(_, w)| st > *w) {
            worst = Some((s.name, st));
        }
    }
    (worst, down)
}

impl Db {
    /// Exports every routing series from the start: the thresholds in force, the decisions
    /// and fallbacks each class can be counted under at 0, each node's samples and errors at
    /// 0, and each replica's staleness and state as the monitor knows them (unknown staleness
    /// is +Inf). An alert on an absent series never fires, and one that first appears at 1
    /// hides that first increase from `rate()`.
    pub(super) fn export_zeroes(&self) {
        let m = &self.inner.metrics;
        m.eviction_threshold
            .set(self.thresholds().evict_after.as_secs_f64());
        for p in policy::POLICY {
            let class = p.class.name();
            if let (Target::Replica, Some(budget)) = (p.target, p.budget) {
                m.staleness_budget
                    .with_label_values(&[class])
                    .set(budget.as_secs_f64());
            }
            for (target, reason) in possible_decisions(p) {
                m.routing_decisions
                    .with_label_values(&[class, target, reason.as_str()]);
                if target == "primary" && p.target == Target::Replica {
                    m.routing_fallbacks
                        .with_label_values(&[class, reason.as_str()]);
                }
            }
        }
        for (node, _) in &self.inner.monitor_targets {
            m.monitor_samples.with_label_values(&[node]);
            m.monitor_errors.with_label_values(&[node]);
        }
        for i in 0..self.inner.replicas.len() {
            self.publish_replica_metrics(i);
        }
    }

    /// Every replica's current state, for operators.
    pub fn replica_status(&self) -> Vec<ReplicaStatus> {
        let now = Instant::now();
        let f = self.freshness_read();
        let primary_lsn = f.primary_lsn();
        self.inner
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let v: ReplicaView = f.view(i, now);
                ReplicaStatus {
                    name: r.name.clone(),
                    state: v.state,
                    staleness: v.staleness,
                    lag_bytes: match (primary_lsn, v.replay_lsn) {
                        (Some(p), Some(r)) => Some(p.saturating_sub(r)),
                        _ => None,
                    },
                    replay_lsn: v.replay_lsn,
                    as_of: v.as_of.map(|t| self.inner.time.wall(t)),
                    last_error: v.last_error,
                    in_flight: r.in_flight.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    pub fn primary_lsn(&self) -> Option<Lsn> {
        self.freshness_read().primary_lsn()
    }

    /// The worst staleness among replicas that are not `down`, and the down ones' names.
    /// Under Patroni the leader's own member entry is not a replica (it reads `down`, being
    /// out of recovery), so it is neither: an import told to wait for down replicas must
    /// not wait for the leader.
    pub fn worst_serving_staleness(&self) -> (Option<(String, Duration)>, Vec<String>) {
        worst_and_down(self.replica_status(), self.leading_member())
    }

    /// Under Patroni, the member that leads now: every member is listed as a replica, the
    /// leader too, and its entry is no replica. `None` in the static mode.
    pub(super) fn leading_member(&self) -> Option<usize> {
        self.inner
            .cluster
            .as_ref()
            .and(self.inner.primary.leader_index())
    }

    pub(super) fn publish_replica_metrics(&self, i: usize) {
        let now = Instant::now();
        let (view, primary_lsn) = {
            let f = self.freshness_read();
            (f.view(i, now), f.primary_lsn())
        };
        let m = &self.inner.metrics;
        let name = self.inner.replicas[i].name.as_str();
        let states = [
            ReplicaState::Healthy,
            ReplicaState::Lagging,
            ReplicaState::Down,
        ];
        // Under Patroni every member is listed as a replica, the leader too; it is no
        // replica, and its entry (never fresh, `down`) must not page as a stale or down one.
        if self.leading_member() == Some(i) {
            let _ = m.replica_staleness.remove_label_values(&[name]);
            let _ = m.replica_lag_bytes.remove_label_values(&[name]);
            for state in states {
                let _ = m.replica_state.remove_label_values(&[name, state.as_str()]);
            }
            return;
        }
        m.replica_staleness.with_label_values(&[name]).set(
            view.staleness
                .map(|d| d.as_secs_f64())
                .unwrap_or(f64::INFINITY),
        );
        m.replica_lag_bytes
            .with_label_values(&[name])
            .set(match (primary_lsn, view.replay_lsn) {
                (Some(p), Some(r)) => p.saturating_sub(r) as f64,
                _ => f64::NAN,
            });
        for state in states {
            m.replica_state
                .with_label_values(&[name, state.as_str()])
                .set(i64::from(view.state == state));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(name: &str, state: ReplicaState, staleness_ms: Option<u64>) -> ReplicaStatus {
        ReplicaStatus {
            name: name.into(),
            state,
            staleness: staleness_ms.map(Duration::from_millis),
            lag_bytes: None,
            replay_lsn: None,
            as_of: None,
            last_error: None,
            in_flight: 0,
        }
    }

    /// Under Patroni every member has a replica entry, and the leader's reads `down` (it is
    /// not in recovery): an import waiting for down replicas would wait for it forever.
    #[test]
    fn the_patroni_leaders_own_entry_is_neither_a_down_replica_nor_the_worst() {
        let members = || {
            vec![
                status("pg-1", ReplicaState::Down, None),
                status("pg-2", ReplicaState::Healthy, Some(40)),
                status("pg-3", ReplicaState::Down, None),
            ]
        };
        let (worst, down) = worst_and_down(members(), Some(0));
        assert_eq!(
            down,
            vec!["pg-3".to_string()],
            "only the real replica that is down"
        );
        assert_eq!(worst, Some(("pg-2".into(), Duration::from_millis(40))));
        // With no leader (or in the static mode) every entry counts.
        assert_eq!(worst_and_down(members(), None).1.len(), 2);
    }
}
