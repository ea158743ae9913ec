//! Revenue: the emailed report (budget 5 min) and the live dashboard (budget 30 s). Each
//! figure states the moment it describes, so two figures that differ explain themselves.

use super::{Admin, ApiError, AppState, Query, stated};
use crate::routing::ReadCtx;
use crate::routing::policy::QueryClass;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use chrono::{NaiveDate, TimeZone, Utc};
use serde::{Deserialize, Serialize};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/reports/revenue", get(report))
        .route("/v1/dashboard/revenue", get(dashboard))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportQuery {
    date: Option<String>,
}

#[derive(Serialize)]
struct Revenue {
    date: String,
    total_cents: i64,
    order_count: i64,
}

async fn report(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<ReportQuery>,
) -> Result<Response, ApiError> {
    let date = match q.date.as_deref() {
        None => Utc::now().date_naive(),
        Some(d) => NaiveDate::parse_from_str(d, "%Y-%m-%d")
            .map_err(|_| ApiError::bad_request("INVALID_QUERY", "date must be YYYY-MM-DD"))?,
    };
    revenue(&state, QueryClass::RevenueReport, date).await
}

async fn dashboard(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    revenue(&state, QueryClass::Dashboard, Utc::now().date_naive()).await
}

async fn revenue(
    state: &AppState,
    class: QueryClass,
    date: NaiveDate,
) -> Result<Response, ApiError> {
    let start = Utc.from_utc_datetime(&date.and_hms_opt(0, 0, 0).unwrap_or_default());
    let end = start + chrono::Duration::days(1);
    let read = state
        .db
        .read(class, &ReadCtx::none(), |pool| async move {
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT COALESCE(SUM(total_cents), 0)::int8, COUNT(*) FROM orders \
                 WHERE status = 'confirmed' AND created_at >= $1 AND created_at < $2",
            )
            .bind(start)
            .bind(end)
            .fetch_one(pool.exec())
            .await
        })
        .await?;
    let (total_cents, order_count) = read.value;
    Ok(stated(
        StatusCode::OK,
        Revenue {
            date: date.to_string(),
            total_cents,
            order_count,
        },
        &read.route,
    ))
}
