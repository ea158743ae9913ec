//! Liveness, readiness and metrics.

use super::responses::{ErrorBody, Unavailable};
use super::{ApiError, AppState, Json};
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::{Value, json};
use std::time::Duration;
use utoipa::ToSchema;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(healthz, readyz, metrics))]
pub(super) struct Api;

/// What `healthz` and `readyz` build with `json!`.
#[allow(dead_code)]
#[derive(ToSchema)]
struct HealthStatus {
    /// `ok` (alive) or `ready`.
    #[schema(pattern = "^(ok|ready)$")]
    status: String,
}

/// Alive
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "health",
    responses(
        (status = 200, description = "`{\"status\": \"ok\"}`", body = HealthStatus),
        (status = 503, response = Unavailable),
    )
)]
async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the primary answers within a second.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "health",
    responses(
        (status = 200, description = "`{\"status\": \"ready\"}`", body = HealthStatus),
        (status = 503, description = "PRIMARY_UNAVAILABLE (or shedding load)", body = ErrorBody,
            headers(("Retry-After" = String, description = "Seconds to wait"))),
    )
)]
async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let pool = state.db.primary().pool()?;
    let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool);
    match tokio::time::timeout(Duration::from_secs(1), ping).await {
        Ok(Ok(_)) => Ok(Json(json!({ "status": "ready" }))),
        _ => Err(ApiError::unavailable(
            "PRIMARY_UNAVAILABLE",
            "the primary is not answering",
        )),
    }
}

/// Prometheus metrics
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "health",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4", content_type = "text/plain", body = String),
        (status = 503, response = Unavailable),
    )
)]
async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
