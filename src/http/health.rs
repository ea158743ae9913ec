//! Liveness, readiness and metrics.

use super::responses::{ErrorBody, Unavailable};
use super::{ApiError, AppState, Json};
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Serialize;
use std::time::Duration;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
}

/// What `healthz` and `readyz` answer.
#[derive(Serialize, ToSchema)]
struct HealthStatus {
    /// `ok` (alive) or `ready`.
    #[schema(pattern = "^(ok|ready)$")]
    status: &'static str,
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
async fn healthz() -> Json<HealthStatus> {
    Json(HealthStatus { status: "ok" })
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
async fn readyz(State(state): State<AppState>) -> Result<Json<HealthStatus>, ApiError> {
    let pool = state.db.primary().pool()?;
    let ping = sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(pool);
    match tokio::time::timeout(Duration::from_secs(1), ping).await {
        Ok(Ok(_)) => Ok(Json(HealthStatus { status: "ready" })),
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
