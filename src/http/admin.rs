//! Operators' view: replica freshness and the routing policy.

use super::responses::{Forbidden, Unauthorized, Unavailable};
use super::{Admin, AppState, Json};
use crate::routing::format_lsn;
use crate::routing::policy::POLICY;
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};
use utoipa::ToSchema;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/replicas", get(replicas))
        .route("/v1/admin/routing", get(routing))
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(replicas, routing))]
pub(super) struct Api;

// The shapes below document what `replicas_json` and `routing` build with `json!`.

#[allow(dead_code)]
#[derive(ToSchema)]
struct ReplicasView {
    primary: PrimaryView,
    replicas: Vec<ReplicaView>,
    /// With `STOCKGATE_PATRONI_URLS`: the members, the leader and the timeline; else null.
    cluster: Option<crate::routing::patroni::ClusterStatus>,
}

#[allow(dead_code)]
#[derive(ToSchema)]
struct PrimaryView {
    /// The primary's last sampled WAL position (`16/B374D848`); null before the first sample.
    lsn: Option<String>,
}

#[allow(dead_code)]
#[derive(ToSchema)]
struct ReplicaView {
    /// `replica-1`, `replica-2`, … in `STOCKGATE_REPLICA_URLS` order; under Patroni, the
    /// member names (the leader's entry is `down`: it is not a replica).
    name: String,
    /// `healthy`, `lagging` (over the eviction threshold) or `down`.
    #[schema(pattern = "^(healthy|lagging|down)$")]
    state: String,
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

#[allow(dead_code)]
#[derive(ToSchema)]
struct RoutingView {
    classes: Vec<ClassPolicyView>,
    /// `in_process` or `redis`.
    #[schema(pattern = "^(in_process|redis)$")]
    read_your_writes_store: String,
    read_your_writes_store_healthy: bool,
    read_your_writes_ttl_ms: u64,
    /// Staleness at which a healthy replica becomes `lagging`.
    eviction_threshold_ms: u64,
}

#[allow(dead_code)]
#[derive(ToSchema)]
struct ClassPolicyView {
    /// The query class, e.g. `stock_gate`.
    name: String,
    /// `primary` or `replica`.
    #[schema(pattern = "^(primary|replica)$")]
    target: String,
    /// The most staleness a replica answer may carry; null: any replica that is not down.
    staleness_budget_ms: Option<u64>,
    read_your_writes: bool,
    /// `use_primary` or `refuse` (503).
    #[schema(pattern = "^(use_primary|refuse)$")]
    when_no_fresh_replica: String,
}

/// The replicas' state as JSON (shared with `stockgate replicas`).
pub fn replicas_json(state: &AppState) -> Value {
    let replicas: Vec<Value> = state
        .db
        .replica_status()
        .into_iter()
        .map(|r| {
            json!({
                "name": r.name,
                "state": r.state,
                "staleness_ms": r.staleness.map(|d| d.as_millis() as u64),
                "lag_bytes": r.lag_bytes,
                "replay_lsn": r.replay_lsn.map(format_lsn),
                "as_of": r.as_of,
                "in_flight": r.in_flight,
                "last_error": r.last_error,
            })
        })
        .collect();
    json!({
        "primary": { "lsn": state.db.primary_lsn().map(format_lsn) },
        "replicas": replicas,
        "cluster": state.db.cluster_status(),
    })
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
async fn replicas(State(state): State<AppState>, _: Admin) -> Json<Value> {
    Json(replicas_json(&state))
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
async fn routing(State(state): State<AppState>, _: Admin) -> Json<Value> {
    let classes: Vec<Value> = POLICY
        .iter()
        .map(|p| {
            json!({
                "name": p.class.name(),
                "target": p.target,
                "staleness_budget_ms": p.budget.map(|d| d.as_millis() as u64),
                "read_your_writes": p.read_your_writes,
                "when_no_fresh_replica": p.when_no_fresh_replica,
            })
        })
        .collect();
    Json(json!({
        "classes": classes,
        "read_your_writes_store": state.db.ryw().kind(),
        "read_your_writes_store_healthy": state.db.ryw().healthy().await,
        "read_your_writes_ttl_ms": state.db.ryw().ttl().as_millis() as u64,
        "eviction_threshold_ms": state.db.thresholds().evict_after.as_millis() as u64,
    }))
}
