//! Operators' view: replica freshness and the routing policy.

use super::{Admin, AppState, Json};
use crate::routing::format_lsn;
use crate::routing::policy::POLICY;
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/replicas", get(replicas))
        .route("/v1/admin/routing", get(routing))
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
    json!({ "primary": { "lsn": state.db.primary_lsn().map(format_lsn) }, "replicas": replicas })
}

async fn replicas(State(state): State<AppState>, _: Admin) -> Json<Value> {
    Json(replicas_json(&state))
}

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
    }))
}
