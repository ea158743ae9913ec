//! Operators' view: replica freshness, the routing policy, and the stock ledger's check.

use super::responses::{Forbidden, Unauthorized, Unavailable};
use super::{Admin, ApiError, AppState, Json, Stated, stated};
use crate::checkout::ledger::{self, Disagreement, FirstDisagreements};
use crate::lsn::format_lsn;
use crate::routing::freshness::ReplicaState;
use crate::routing::patroni::ClusterStatus;
use crate::routing::policy::{POLICY, Policy, Target, WhenNoFreshReplica};
use crate::routing::{Db, ReplicaStatus};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(replicas))
        .routes(routes!(routing))
        .routes(routes!(ledger_check))
}

#[derive(Serialize, ToSchema)]
struct ReplicasView {
    primary: PrimaryView,
    replicas: Vec<ReplicaView>,
    /// With `STOCKGATE_PATRONI_URLS`: the members, the leader and the timeline; else null.
    cluster: Option<ClusterStatus>,
}

#[derive(Serialize, ToSchema)]
struct PrimaryView {
    /// The primary's last sampled WAL position (`16/B374D848`); null before the first sample.
    lsn: Option<String>,
}

#[derive(Serialize, ToSchema)]
struct ReplicaView {
    /// `replica-1`, `replica-2`, … in `STOCKGATE_REPLICA_URLS` order; under Patroni, the
    /// member names (the leader's entry is `down`: it is not a replica).
    name: String,
    /// `healthy`, `lagging` (over the eviction threshold) or `down`.
    #[schema(value_type = String, pattern = "^(healthy|lagging|down)$")]
    state: ReplicaState,
    /// `now - as_of`; null before the first sample.
    staleness_ms: Option<u64>,
    /// Primary position minus replay position.
    lag_bytes: Option<u64>,
    replay_lsn: Option<String>,
    /// The newest primary moment this replica has replayed.
    as_of: Option<chrono::DateTime<chrono::Utc>>,
    /// Reads running on it now.
    in_flight: u64,
    last_error: Option<String>,
}

impl From<ReplicaStatus> for ReplicaView {
    fn from(r: ReplicaStatus) -> Self {
        ReplicaView {
            name: r.name,
            state: r.state,
            staleness_ms: r.staleness.map(|d| d.as_millis() as u64),
            lag_bytes: r.lag_bytes,
            replay_lsn: r.replay_lsn.map(format_lsn),
            as_of: r.as_of,
            in_flight: r.in_flight as u64,
            last_error: r.last_error,
        }
    }
}

impl ReplicasView {
    fn of(db: &Db) -> Self {
        ReplicasView {
            primary: PrimaryView {
                lsn: db.primary_lsn().map(format_lsn),
            },
            replicas: db.replica_status().into_iter().map(Into::into).collect(),
            cluster: db.cluster_status(),
        }
    }
}

#[derive(Serialize, ToSchema)]
struct RoutingView {
    classes: Vec<ClassPolicyView>,
    /// `in_process` or `redis`.
    #[schema(pattern = "^(in_process|redis)$")]
    read_your_writes_store: &'static str,
    read_your_writes_store_healthy: bool,
    read_your_writes_ttl_ms: u64,
    /// Staleness at which a healthy replica becomes `lagging`.
    eviction_threshold_ms: u64,
}

#[derive(Serialize, ToSchema)]
struct ClassPolicyView {
    /// The query class, e.g. `stock_gate`.
    name: &'static str,
    /// `primary` or `replica`.
    #[schema(value_type = String, pattern = "^(primary|replica)$")]
    target: Target,
    /// The most staleness a replica answer may carry; null: any replica that is not down.
    staleness_budget_ms: Option<u64>,
    read_your_writes: bool,
    /// `use_primary` or `refuse` (503).
    #[schema(value_type = String, pattern = "^(use_primary|refuse)$")]
    when_no_fresh_replica: WhenNoFreshReplica,
}

impl From<&Policy> for ClassPolicyView {
    fn from(p: &Policy) -> Self {
        ClassPolicyView {
            name: p.class.name(),
            target: p.target,
            staleness_budget_ms: p.budget.map(|d| d.as_millis() as u64),
            read_your_writes: p.read_your_writes,
            when_no_fresh_replica: p.when_no_fresh_replica,
        }
    }
}

/// Replica freshness (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/replicas",
    tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The primary's position and each replica's state", body = ReplicasView),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn replicas(State(state): State<AppState>, _: Admin) -> Json<ReplicasView> {
    Json(ReplicasView::of(&state.db))
}

/// The routing policy of every query class (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/routing",
    tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The policy table and the read-your-writes store", body = RoutingView),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn routing(State(state): State<AppState>, _: Admin) -> Json<RoutingView> {
    let ryw = state.db.ryw();
    Json(RoutingView {
        classes: POLICY.iter().map(Into::into).collect(),
        read_your_writes_store: ryw.kind(),
        read_your_writes_store_healthy: ryw.healthy().await,
        read_your_writes_ttl_ms: ryw.ttl().as_millis() as u64,
        eviction_threshold_ms: state.db.thresholds().evict_after.as_millis() as u64,
    })
}

/// The most disagreements one answer lists (`disagreeing` counts them all).
const LISTED: usize = 1000;

#[derive(Serialize, ToSchema)]
struct LedgerView {
    /// (product, location) pairs checked.
    checked: u64,
    /// Pairs whose count held is not what the ledger gives.
    disagreeing: u64,
    /// The first 1000 of them, in (product, location) order.
    disagreements: Vec<Disagreement>,
}

/// Check every product's stock at every location against its ledger (admin; routed read, 60 s budget)
///
/// What `stockgate verify` does, for an operator without a shell: one snapshot of every
/// level, movement and allocation (`docs/operations.md`, "Checking the stock ledger").
#[utoipa::path(
    get,
    path = "/v1/admin/ledger",
    tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "How many pairs were checked, those that disagree (the first 1000), and the snapshot's node and moment", body = Stated<LedgerView>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn ledger_check(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let mut first = FirstDisagreements {
        keep: LISTED,
        found: Vec::new(),
    };
    let verdict = ledger::check(&state.db, &mut first).await?;
    let view = LedgerView {
        checked: verdict.checked,
        disagreeing: verdict.disagreeing,
        disagreements: first.found,
    };
    Ok(stated(StatusCode::OK, view, &verdict.route))
}
