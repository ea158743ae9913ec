//! Liveness, readiness and metrics.

use super::{ApiError, AppState, Json};
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::{Value, json};
use std::time::Duration;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the primary answers within a second.
async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(state.db.primary().pool());
    match tokio::time::timeout(Duration::from_secs(1), ping).await {
        Ok(Ok(_)) => Ok(Json(json!({ "status": "ready" }))),
        _ => Err(ApiError::unavailable(
            "PRIMARY_UNAVAILABLE",
            "the primary is not answering",
        )),
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
