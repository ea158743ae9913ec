//! Bulk imports for operators without shell access: the same engine as `stockgate import`,
//! as a job. `POST /v1/admin/imports` takes the CSV as the body and returns a job id;
//! `GET /v1/admin/imports/{id}` shows its progress.

use super::openapi::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{Admin, ApiError, AppState, Json, Path, Query};
use crate::import::{self, Options, SharedProgress, Status};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// Import jobs of this instance, by id.
pub type Jobs = Arc<Mutex<HashMap<Uuid, SharedProgress>>>;

/// CSV bodies may be large; everything else keeps the 64 KiB limit.
const IMPORT_BODY_LIMIT: usize = 64 * 1024 * 1024;

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/admin/imports",
            post(start).layer(DefaultBodyLimit::max(IMPORT_BODY_LIMIT)),
        )
        .route("/v1/admin/imports/{job_id}", get(show))
}

#[derive(utoipa::OpenApi)]
#[openapi(paths(start, show))]
pub(super) struct Api;

/// What `start` answers (built with `json!`).
#[allow(dead_code)]
#[derive(ToSchema)]
struct ImportStarted {
    job_id: Uuid,
    /// `running`.
    status: String,
}

/// What `show` answers: the job's progress plus its id.
#[allow(dead_code)]
#[derive(serde::Serialize, ToSchema)]
struct ImportJob {
    job_id: Uuid,
    #[serde(flatten)]
    progress: import::Progress,
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct StartQuery {
    /// Replica staleness to stay under, e.g. `5s`, `500ms` (default `5s`).
    #[param(example = "5s")]
    lag_budget: Option<String>,
    /// Rows per transaction (default 1000).
    #[param(minimum = 1, maximum = 20000)]
    batch_size: Option<usize>,
    /// Import the valid lines and report the bad ones (default false: any bad line refuses all).
    skip_invalid: Option<bool>,
    /// Keep going while a replica is down (default false: wait for it).
    wait_for_down: Option<bool>,
}

/// Start a bulk import (admin)
///
/// The body is the CSV (`product_id,name,price_cents,available_quantity`, up to 64 MiB),
/// throttled against live replica staleness; poll the job for progress.
#[utoipa::path(
    post,
    path = "/v1/admin/imports",
    tag = "admin",
    params(StartQuery),
    request_body(content = String, content_type = "text/csv",
        example = "product_id,name,price_cents,available_quantity\nmug-classic,Classic mug,1299,500\n"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "The job started", body = ImportStarted),
        (status = 400, description = "INVALID_QUERY: a bad `lag_budget` etc., or an unknown parameter", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_CSV (with `bad_lines` in the error; nothing was written), INVALID_BATCH_SIZE", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn start(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<StartQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let lag_budget = match q.lag_budget.as_deref() {
        None => std::time::Duration::from_secs(5),
        Some(s) => crate::cli::parse_duration(s)
            .map_err(|e| ApiError::bad_request("INVALID_QUERY", format!("lag_budget: {e}")))?,
    };
    let batch_size = q.batch_size.unwrap_or(1000);
    if !(1..=20_000).contains(&batch_size) {
        return Err(ApiError::invalid(
            "INVALID_BATCH_SIZE",
            "batch_size must be from 1 to 20000",
        ));
    }
    let opts = Options {
        lag_budget,
        batch_size,
        skip_invalid: q.skip_invalid.unwrap_or(false),
        wait_for_down: q.wait_for_down.unwrap_or(false),
    };
    let parsed = tokio::task::spawn_blocking(move || import::parse_csv(&body[..]))
        .await
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("csv parser task: {e}")))?;
    let (rows, bad) = parsed.map_err(|e| ApiError::invalid("INVALID_CSV", e))?;
    if !bad.is_empty() && !opts.skip_invalid {
        let body = json!({ "error": {
            "code": "INVALID_CSV",
            "message": format!("{} invalid line(s); nothing was written (fix them, or pass skip_invalid=true)", bad.len()),
            "bad_lines": bad.iter().take(100).collect::<Vec<_>>(),
        }});
        return Ok((StatusCode::UNPROCESSABLE_ENTITY, axum::Json(body)).into_response());
    }
    let id = Uuid::new_v4();
    let progress: SharedProgress = Arc::default();
    {
        let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
        p.rows_total = rows.len() as u64;
        p.rows_skipped = bad.len() as u64;
        p.bad_lines = bad.into_iter().take(100).collect();
    }
    state
        .imports
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, progress.clone());
    let (db, metrics) = (state.db.clone(), state.metrics.clone());
    tokio::spawn(async move {
        let stop = AtomicBool::new(false);
        if let Err(e) = import::run_engine(&db, &metrics, &rows, opts, &progress, &stop).await {
            tracing::warn!(job = %id, error = %e, "import failed");
            let mut p = progress.lock().unwrap_or_else(|e| e.into_inner());
            p.status = Status::Failed;
            p.error = Some("a batch failed and was rolled back; earlier batches are in; re-running the same file is safe".into());
        }
    });
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(json!({ "job_id": id, "status": "running" })),
    )
        .into_response())
}

/// An import job's progress (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/imports/{job_id}",
    tag = "admin",
    params(("job_id" = Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The job's progress", body = ImportJob),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "IMPORT_NOT_FOUND (also for an id that is not a UUID)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let not_found = || ApiError::not_found("IMPORT_NOT_FOUND", "no such import job");
    let id = Uuid::parse_str(&id).map_err(|_| not_found())?;
    let progress = state
        .imports
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .cloned()
        .ok_or_else(not_found)?;
    let p = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut body = serde_json::to_value(p).map_err(|e| ApiError::Internal(e.into()))?;
    body["job_id"] = json!(id);
    Ok(Json(body))
}
