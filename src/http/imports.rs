//! Bulk imports for operators without shell access: the same engine as `stockgate import`,
//! as a job. `POST /v1/admin/imports` takes the CSV as the body and returns a job id;
//! `GET /v1/admin/imports/{id}` shows its progress; `DELETE /v1/admin/imports/{id}` stops it
//! after the batch in flight. A job lives in this instance's memory while it runs and for
//! [`KEEP_FINISHED`] after it ends (`done`, `failed` or `cancelled`), then it is dropped
//! and its id answers 404. The parsed CSV lives only as long as the job's task.

use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{Admin, ApiError, AppState, Json, Path, Query};
use crate::clock::{Clock, SystemClock};
use crate::import::{self, Announce, BadLine, Options, Row, SharedProgress};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;
use uuid::Uuid;

/// How long a finished job (and its id) stays answerable.
pub const KEEP_FINISHED: Duration = Duration::from_secs(3600);

/// Import jobs of this instance, by id. Finished jobs older than [`KEEP_FINISHED`] on the
/// clock are dropped whenever the table is used (a new job, a look-up, a stop), so the
/// table holds at most the jobs that ran within the last hour.
#[derive(Clone)]
pub struct Jobs {
    table: Arc<Mutex<HashMap<Uuid, Job>>>,
    clock: Arc<dyn Clock>,
}

#[derive(Clone)]
struct Job {
    progress: SharedProgress,
    stop: Arc<AtomicBool>,
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs::new(Arc::new(SystemClock))
    }
}

impl Jobs {
    /// Jobs whose retention is judged on `clock` (tests move a manual one instead of waiting
    /// an hour).
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Jobs {
            table: Arc::default(),
            clock,
        }
    }

    fn now(&self) -> DateTime<Utc> {
        import::clock_now(&*self.clock)
    }

    /// The table, with the expired jobs already gone.
    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Job>> {
        let now = self.now();
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        table.retain(|_, job| {
            let ended = job
                .progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .ended_at;
            ended.is_none_or(|at| now < expires(at))
        });
        table
    }

    /// Jobs held: running ones and those that ended within the last hour.
    pub fn len(&self) -> usize {
        self.live().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, id: Uuid) -> Option<Job> {
        self.live().get(&id).cloned()
    }
}

fn expires(ended: DateTime<Utc>) -> DateTime<Utc> {
    ended + chrono::Duration::from_std(KEEP_FINISHED).unwrap_or_default()
}

/// CSV bodies may be large; everything else keeps the 64 KiB limit.
const IMPORT_BODY_LIMIT: usize = 64 * 1024 * 1024;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(start).layer(DefaultBodyLimit::max(IMPORT_BODY_LIMIT)))
        .routes(routes!(show, stop))
}

/// What `start` answers.
#[derive(Serialize, ToSchema)]
struct ImportStarted {
    job_id: Uuid,
    /// `running`.
    status: import::Status,
}

/// What `show` and `stop` answer: the job's progress, its id, and when a finished job is
/// dropped.
#[derive(Serialize, ToSchema)]
struct ImportJob {
    job_id: Uuid,
    #[serde(flatten)]
    progress: import::Progress,
    /// `ended_at` + 1 h: from then on the job answers 404. Absent while it runs.
    expires_at: Option<DateTime<Utc>>,
}

impl ImportJob {
    fn of(id: Uuid, job: &Job) -> Self {
        let progress = job
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        ImportJob {
            job_id: id,
            expires_at: progress.ended_at.map(expires),
            progress,
        }
    }
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct StartQuery {
    /// Replica staleness to stay under, e.g. `5s`, `500ms` (default `5s`): a number and
    /// `ms`, `s` (the default unit), `m` or `h`, above 0 and at most ten years. The pattern
    /// admits whole numbers 1–9999 of any unit, all of which the service takes.
    #[param(example = "5s", pattern = "^[1-9][0-9]{0,3}(ms|s|m|h)?$")]
    lag_budget: Option<String>,
    /// Rows per transaction (default 1000).
    #[param(minimum = 1, maximum = 20000)]
    batch_size: Option<usize>,
    /// Import the valid lines and report the bad ones (default false: any bad line refuses all).
    skip_invalid: Option<bool>,
    /// Keep going while a replica is down (default false: wait for it).
    wait_for_down: Option<bool>,
}

/// The body's schema: the CSV as a string with the pattern below.
struct CsvFile;

impl utoipa::PartialSchema for CsvFile {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(CSV_PATTERN))
            .description(Some(CSV_BODY))
            .into()
    }
}

impl ToSchema for CsvFile {}

/// What the CSV body's documented schema says, beside its pattern.
const CSV_BODY: &str = "The header `product_id,name,price_cents,available_quantity` (any \
    order), optionally with `location_id`, then a line per product, or per (product, \
    location): its id (1–64 of `A-Z a-z 0-9 _ - .`), its name (1–200 characters, no control \
    characters; quoted if it holds a comma or a quote; the same on every line of a product), \
    two whole numbers from 0 to 2147483647, and the location whose count the line states (an \
    existing location; no column or an empty cell: `default`), each (product, location) once. \
    A location that does not exist is a bad line (422 `INVALID_CSV`, nothing written). The \
    schema's pattern admits a file of at most one line with an unquoted name and no \
    `location_id`, which the service always takes; the service takes more.";

/// A valid file of the header and at most one product (see [`CSV_BODY`]).
const CSV_PATTERN: &str = concat!(
    r"^product_id,name,price_cents,available_quantity\n",
    r#"([A-Za-z0-9_.-]{1,64},[^,"\s\x00-\x1F\x7F-\x9F][^,"\r\n\x00-\x1F\x7F-\x9F]{0,199},"#,
    r"[0-9]{1,9},[0-9]{1,9}\n)?$"
);

/// Start a bulk import (admin)
///
/// The body is the CSV (`product_id,name,price_cents,available_quantity`, optionally
/// `location_id`; up to 64 MiB), throttled against live replica staleness; poll the job for
/// progress. The job's id is the `ref` of every movement it writes.
#[utoipa::path(
    post,
    path = "/v1/admin/imports",
    tag = "admin",
    params(StartQuery),
    request_body(content = CsvFile, content_type = "text/csv",
        example = "product_id,name,price_cents,available_quantity\nmug-classic,Classic mug,1299,500\n"),
    security(("bearer" = [])),
    responses(
        (status = 202, description = "The job started", body = ImportStarted),
        (status = 400, description = "INVALID_QUERY: a bad `lag_budget` etc., or an unknown parameter", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_CSV (with `bad_lines` in the error, among them rows at a location that does not exist; nothing was written), INVALID_BATCH_SIZE", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn start(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<StartQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let opts = q.options()?;
    let parsed = tokio::task::spawn_blocking(move || import::parse_csv(&body[..]))
        .await
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("csv parser task: {e}")))?;
    let (rows, mut bad) = parsed.map_err(|e| ApiError::invalid("INVALID_CSV", e))?;
    // Before anything is written: a row at a location that does not exist is a bad line.
    let rows = import::set_aside_unknown_locations(&state.db, rows, &mut bad).await?;
    if !bad.is_empty() && !opts.skip_invalid {
        return Ok(invalid_csv(bad));
    }
    let job_id = spawn_job(&state, rows, bad, opts);
    let started = ImportStarted {
        job_id,
        status: import::Status::Running,
    };
    Ok((StatusCode::ACCEPTED, axum::Json(started)).into_response())
}

impl StartQuery {
    /// The engine's options: the defaults for what the query leaves out.
    fn options(&self) -> Result<Options, ApiError> {
        let lag_budget = match self.lag_budget.as_deref() {
            None => Duration::from_secs(5),
            Some(s) => crate::config::parse_duration(s)
                .map_err(|e| ApiError::bad_request("INVALID_QUERY", format!("lag_budget: {e}")))?,
        };
        let batch_size = self.batch_size.unwrap_or(1000);
        if !(1..=20_000).contains(&batch_size) {
            return Err(ApiError::invalid(
                "INVALID_BATCH_SIZE",
                "batch_size must be from 1 to 20000",
            ));
        }
        Ok(Options {
            lag_budget,
            batch_size,
            skip_invalid: self.skip_invalid.unwrap_or(false),
            wait_for_down: self.wait_for_down.unwrap_or(false),
        })
    }
}

/// 422 `INVALID_CSV` naming the first 100 bad lines; nothing was written.
fn invalid_csv(bad: Vec<BadLine>) -> Response {
    let message = format!(
        "{} invalid line(s); nothing was written (fix them, or pass skip_invalid=true)",
        bad.len()
    );
    let mut body = ErrorBody::new("INVALID_CSV", message);
    body.error.bad_lines = Some(bad.into_iter().take(100).collect());
    (StatusCode::UNPROCESSABLE_ENTITY, axum::Json(body)).into_response()
}

/// Registers a job for `rows` and runs the engine on it in its own task; its id.
fn spawn_job(state: &AppState, rows: Vec<Row>, bad: Vec<BadLine>, opts: Options) -> Uuid {
    let id = Uuid::new_v4();
    let job = Job {
        progress: Arc::default(),
        stop: Arc::default(),
    };
    {
        let mut p = job.progress.lock().unwrap_or_else(|e| e.into_inner());
        p.rows_total = rows.len() as u64;
        p.rows_skipped = bad.len() as u64;
        p.bad_lines = bad.into_iter().take(100).collect();
    }
    state.imports.live().insert(id, job.clone());
    let (db, metrics, checkout) = (
        state.db.clone(),
        state.metrics.clone(),
        state.checkout.clone(),
    );
    let jobs = state.imports.clone();
    tokio::spawn(async move {
        let announce = Announce::Gate(&checkout);
        let (progress, stop) = (&job.progress, &job.stop);
        let result =
            import::run_engine(&db, &metrics, announce, id, &rows, opts, progress, stop).await;
        if let Err(e) = &result {
            tracing::warn!(job = %id, error = %e, "import failed");
        }
        import::finish(&job.progress, &result, jobs.now());
    });
    id
}

/// An import job's progress (admin)
///
/// Known while it runs and for one hour after it ends (`expires_at`); then 404.
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
        (status = 404, description = "IMPORT_NOT_FOUND (also for an id that is not a UUID, or a job dropped an hour after it ended)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Json<ImportJob>, ApiError> {
    let (id, job) = find(&state, &id)?;
    Ok(Json(ImportJob::of(id, &job)))
}

/// Stop an import job (admin)
///
/// The batch in flight commits (each batch is one transaction); no further batch starts.
/// A `running` or `waiting` job answers `stopping` and becomes `cancelled` once that batch
/// is in; a job already `stopping`, `done`, `failed` or `cancelled` is answered as it is.
/// Re-importing the same file later continues where it stopped (the rows already in are
/// unchanged by it).
#[utoipa::path(
    delete,
    path = "/v1/admin/imports/{job_id}",
    tag = "admin",
    params(("job_id" = Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The job: `stopping` (then `cancelled`), or its final state if it had ended", body = ImportJob),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "IMPORT_NOT_FOUND (also for an id that is not a UUID, or a job dropped an hour after it ended)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn stop(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Json<ImportJob>, ApiError> {
    let (id, job) = find(&state, &id)?;
    import::request_stop(&job.progress, &job.stop);
    Ok(Json(ImportJob::of(id, &job)))
}

fn find(state: &AppState, id: &str) -> Result<(Uuid, Job), ApiError> {
    let not_found = || ApiError::not_found("IMPORT_NOT_FOUND", "no such import job");
    let id = Uuid::parse_str(id).map_err(|_| not_found())?;
    let job = state.imports.get(id).ok_or_else(not_found)?;
    Ok((id, job))
}
