//! Revenue and exports. The emailed report (budget 5 min), the live dashboard (30 s) and
//! the orders export (any replica that answers) each state the moment they describe, so two
//! figures that differ explain themselves.

use super::responses::{ErrorBody, Forbidden, Unauthorized, Unavailable};
use super::{Admin, ApiError, AppState, Query, Stated, stated};
use crate::routing::policy::QueryClass;
use crate::routing::{ReadCtx, ReadPool, Route, Routed};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Datelike, NaiveDate, SecondsFormat, TimeZone, Utc};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(report))
        .routes(routes!(report_text))
        .routes(routes!(dashboard))
        .routes(routes!(export_orders))
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ReportQuery {
    /// The UTC day, `YYYY-MM-DD` (default today).
    #[param(value_type = Option<chrono::NaiveDate>)]
    date: Option<String>,
    /// Run the report inside a REPEATABLE READ transaction. Transactions only exist on the
    /// primary, so this moves the report there — and the route says `in_transaction`.
    snapshot: Option<bool>,
}

#[derive(Serialize, ToSchema)]
struct Revenue {
    /// The UTC day.
    #[schema(format = Date, example = "2026-11-29")]
    date: String,
    /// Sum of confirmed orders' totals created that day.
    #[schema(minimum = 0)]
    total_cents: i64,
    #[schema(minimum = 0)]
    order_count: i64,
}

/// `YYYY-MM-DD` with a four-digit year: chrono also reads signed years (`-5000-01-01`) that
/// PostgreSQL's timestamps cannot hold, which would fail in the query as a 500.
fn parse_day(raw: &str) -> Option<NaiveDate> {
    NaiveDate::parse_from_str(raw, "%Y-%m-%d")
        .ok()
        .filter(|d| (0..=9999).contains(&d.year()))
}

fn parse_date(raw: Option<&str>) -> Result<NaiveDate, ApiError> {
    match raw {
        None => Ok(Utc::now().date_naive()),
        Some(d) => parse_day(d)
            .ok_or_else(|| ApiError::bad_request("INVALID_QUERY", "date must be YYYY-MM-DD")),
    }
}

fn day_bounds(date: NaiveDate) -> (DateTime<Utc>, DateTime<Utc>) {
    let start = Utc.from_utc_datetime(&date.and_time(chrono::NaiveTime::MIN));
    (start, start + chrono::Duration::days(1))
}

const REVENUE_SQL: &str = "SELECT COALESCE(SUM(total_cents), 0)::int8, COUNT(*) FROM orders \
                           WHERE status = 'confirmed' AND created_at >= $1 AND created_at < $2";

async fn revenue(
    state: &AppState,
    class: QueryClass,
    date: NaiveDate,
    snapshot: bool,
) -> Result<Routed<Revenue>, ApiError> {
    let (start, end) = day_bounds(date);
    let (value, route) = if snapshot {
        let mut tx = state.db.primary().begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let route = state.db.in_transaction(class);
        let value: (i64, i64) = sqlx::query_as(REVENUE_SQL)
            .bind(start)
            .bind(end)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        (value, route)
    } else {
        let read = state
            .db
            .read(class, &ReadCtx::none(), |pool| async move {
                sqlx::query_as::<_, (i64, i64)>(REVENUE_SQL)
                    .bind(start)
                    .bind(end)
                    .fetch_one(pool.exec())
                    .await
            })
            .await?;
        (read.value, read.route)
    };
    let (total_cents, order_count) = value;
    Ok(Routed {
        value: Revenue {
            date: date.to_string(),
            total_cents,
            order_count,
        },
        route,
    })
}

/// Revenue for a day (admin; routed read, 5 min budget)
///
/// With `snapshot=true` it runs in a REPEATABLE READ transaction, so on the primary.
#[utoipa::path(
    get,
    path = "/v1/reports/revenue",
    tag = "reports",
    params(ReportQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The day's revenue, and the moment it describes", body = Stated<Revenue>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 400, description = "INVALID_QUERY: a bad `date` or `snapshot`, or an unknown parameter", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn report(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<ReportQuery>,
) -> Result<Response, ApiError> {
    let r = requested_report(&state, &q).await?;
    Ok(stated(StatusCode::OK, r.value, &r.route))
}

/// The revenue report a `date`/`snapshot` query asks for.
async fn requested_report(state: &AppState, q: &ReportQuery) -> Result<Routed<Revenue>, ApiError> {
    let date = parse_date(q.date.as_deref())?;
    revenue(
        state,
        QueryClass::RevenueReport,
        date,
        q.snapshot.unwrap_or(false),
    )
    .await
}

/// Today's revenue for the live dashboard (admin; routed read, 30 s budget)
#[utoipa::path(
    get,
    path = "/v1/dashboard/revenue",
    tag = "reports",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Today's revenue, and the moment it describes", body = Stated<Revenue>,
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
async fn dashboard(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let r = revenue(
        &state,
        QueryClass::Dashboard,
        Utc::now().date_naive(),
        false,
    )
    .await?;
    Ok(stated(StatusCode::OK, r.value, &r.route))
}

/// The report as a paragraph fit for an email: the staleness explains itself.
#[utoipa::path(
    get,
    path = "/v1/reports/revenue.txt",
    tag = "reports",
    params(ReportQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "A paragraph that states the day's revenue, as of when, and by whom it was served",
            content_type = "text/plain", body = String,
            example = "Revenue for 2026-11-29 (UTC): 1234.56 from 42 confirmed orders.\nData as of 16:57:03 UTC, 3 minutes before this was produced at 17:00:03 UTC (served by replica-2).\nIt includes every order committed before 16:57:03.123 UTC; later orders may also be included.\n"),
        (status = 400, description = "INVALID_QUERY: a bad `date` or `snapshot`, or an unknown parameter", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn report_text(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<ReportQuery>,
) -> Result<Response, ApiError> {
    let r = requested_report(&state, &q).await?;
    let text = revenue_text(&r.value, &r.route, state.db.now_utc());
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

fn revenue_text(r: &Revenue, route: &Route, produced: DateTime<Utc>) -> String {
    let amount = format!("{}.{:02}", r.total_cents / 100, r.total_cents % 100);
    format!(
        "Revenue for {} (UTC): {amount} from {} confirmed orders.\n\
         Data as of {} UTC, {} before this was produced at {} UTC (served by {}).\n\
         It includes every order committed before {} UTC; later orders may also be included.\n",
        r.date,
        r.order_count,
        route.as_of().format("%H:%M:%S"),
        humanize(route.stale_by()),
        produced.format("%H:%M:%S"),
        route.served_by(),
        route.as_of().format("%H:%M:%S%.3f"),
    )
}

fn humanize(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=119_999 => format!("{:.1} seconds", d.as_secs_f64()),
        _ => format!("{} minutes", d.as_secs() / 60),
    }
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct ExportQuery {
    /// Orders created at or after: `YYYY-MM-DD` (UTC midnight) or RFC 3339 (default: all).
    #[param(example = "2026-11-29", schema_with = day_or_instant)]
    from: Option<String>,
    /// Orders created before: `YYYY-MM-DD` (UTC midnight) or RFC 3339 (default: tomorrow).
    #[param(example = "2026-11-30T00:00:00Z", schema_with = day_or_instant)]
    to: Option<String>,
}

/// What [`parse_instant`] takes: a `date` or a `date-time` (four-digit years, as both formats
/// have them).
fn day_or_instant() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{
        KnownFormat, ObjectBuilder, OneOfBuilder, Schema, SchemaFormat, Type,
    };
    let string = |format| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(format)))
    };
    Schema::OneOf(
        OneOfBuilder::new()
            .item(string(KnownFormat::Date))
            .item(string(KnownFormat::DateTime))
            .build(),
    )
}

fn parse_instant(raw: &str) -> Result<DateTime<Utc>, ApiError> {
    if let Some(d) = parse_day(raw) {
        return Ok(day_bounds(d).0);
    }
    DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            ApiError::bad_request("INVALID_QUERY", "from/to must be YYYY-MM-DD or RFC 3339")
        })
}

#[derive(sqlx::FromRow)]
struct ExportRow {
    order_id: uuid::Uuid,
    product_id: String,
    user_id: String,
    quantity: i32,
    total_cents: i64,
    status: String,
    created_at: DateTime<Utc>,
    cancelled_at: Option<DateTime<Utc>>,
}

/// Streams orders as CSV in constant memory: rows flow from the database cursor through a
/// small bounded channel to the socket; a client that goes away stops the query.
#[utoipa::path(
    get,
    path = "/v1/exports/orders",
    tag = "reports",
    summary = "Export orders as CSV (admin; any replica that is not down)",
    params(ExportQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "`order_id,product_id,user_id,quantity,total_cents,status,created_at,cancelled_at` rows, oldest first",
            content_type = "text/csv", body = String,
            headers(
                ("X-As-Of" = String, description = "RFC 3339: every commit acknowledged before it is included"),
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "Staleness when the export started"),
                ("Content-Disposition" = String, description = "`attachment; filename=\"orders.csv\"`"),
            )),
        (status = 400, description = "INVALID_QUERY: a bad `from` or `to`, or an unknown parameter", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn export_orders(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<ExportQuery>,
) -> Result<Response, ApiError> {
    let from = q
        .from
        .as_deref()
        .map(parse_instant)
        .transpose()?
        .unwrap_or(DateTime::UNIX_EPOCH);
    let to =
        q.to.as_deref()
            .map(parse_instant)
            .transpose()?
            .unwrap_or_else(|| Utc::now() + chrono::Duration::days(1));
    let (pool, route) = state
        .db
        .stream(QueryClass::Export, &ReadCtx::none())
        .await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let limit = state.db.class_timeout(QueryClass::Export);
    tokio::spawn(async move {
        let err = tx.clone();
        // One bound for the whole stream, its own class's (not a point read's).
        if tokio::time::timeout(limit, stream_csv(pool, from, to, tx))
            .await
            .is_err()
        {
            tracing::warn!(?limit, "export stopped at its timeout");
            let _ = err
                .send(Err(std::io::Error::other(
                    "export took longer than its timeout",
                )))
                .await;
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut response = (StatusCode::OK, body).into_response();
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/csv; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_DISPOSITION,
        HeaderValue::from_static("attachment; filename=\"orders.csv\""),
    );
    if let Ok(v) = HeaderValue::from_str(&route.as_of_rfc3339()) {
        h.insert("x-as-of", v);
    }
    if let Ok(v) = HeaderValue::from_str(route.served_by()) {
        h.insert("x-served-by", v);
    }
    h.insert("x-stale-by-ms", HeaderValue::from(route.stale_by_ms()));
    Ok(response)
}

/// One row per line: a single-product order as it is, a cart's lines each with their own
/// total (so the column still sums to the revenue).
const EXPORT_SQL: &str = "SELECT order_id, product_id, user_id, quantity, total_cents, status, created_at, cancelled_at \
     FROM orders WHERE status <> 'refused' AND product_id IS NOT NULL AND created_at >= $1 AND created_at < $2 \
     UNION ALL \
     SELECT o.order_id, l.product_id, o.user_id, l.quantity, l.quantity::int8 * l.unit_price_cents, o.status, o.created_at, o.cancelled_at \
     FROM orders o JOIN order_lines l USING (order_id) \
     WHERE o.status <> 'refused' AND o.created_at >= $1 AND o.created_at < $2 \
     ORDER BY created_at, order_id, product_id";

/// Sends the CSV in chunks of about 60 KiB; stops when the client has gone.
async fn stream_csv(
    pool: ReadPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    const HEADER: &[u8] =
        b"order_id,product_id,user_id,quantity,total_cents,status,created_at,cancelled_at\n";
    if tx.send(Ok(Bytes::from_static(HEADER))).await.is_err() {
        return;
    }
    let mut rows = sqlx::query_as::<_, ExportRow>(EXPORT_SQL)
        .bind(from)
        .bind(to)
        .fetch(pool.exec());
    let mut chunk = Vec::with_capacity(64 * 1024);
    loop {
        let sent = match rows.try_next().await {
            Ok(Some(r)) => {
                r.write_csv(&mut chunk);
                if chunk.len() < 60 * 1024 {
                    continue;
                }
                tx.send(Ok(Bytes::from(std::mem::take(&mut chunk)))).await
            }
            Ok(None) => {
                let _ = tx.send(Ok(Bytes::from(chunk))).await;
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "export failed mid-stream");
                let failed = std::io::Error::other("export failed mid-stream");
                let _ = tx.send(Err(failed)).await;
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
}

impl ExportRow {
    fn write_csv(&self, out: &mut Vec<u8>) {
        use std::io::Write;
        let ts = |t: DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::Micros, true);
        // Ids are restricted to [A-Za-z0-9_.-], so no field needs quoting.
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{}",
            self.order_id,
            self.product_id,
            self.user_id,
            self.quantity,
            self.total_cents,
            self.status,
            ts(self.created_at),
            self.cancelled_at.map(ts).unwrap_or_default()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_email_text_says_how_stale_it_is() {
        let produced = Utc
            .with_ymd_and_hms(2026, 11, 29, 17, 0, 3)
            .single()
            .expect("valid");
        let route = Route::example(
            QueryClass::RevenueReport,
            "replica-2",
            produced,
            Duration::from_secs(180),
        );
        let r = Revenue {
            date: "2026-11-29".into(),
            total_cents: 123_456,
            order_count: 42,
        };
        let text = revenue_text(&r, &route, produced);
        assert!(
            text.starts_with("Revenue for 2026-11-29 (UTC): 1234.56 from 42 confirmed orders."),
            "{text}"
        );
        assert!(text.contains("Data as of 16:57:03 UTC, 3 minutes before this was produced at 17:00:03 UTC (served by replica-2)"), "{text}");
        // `as_of` is a lower bound: the text must not claim later orders are missing.
        assert!(
            text.contains("It includes every order committed before 16:57:03.000 UTC; later orders may also be included."),
            "{text}"
        );
        assert!(!text.contains("not included"), "{text}");
    }

    #[test]
    fn staleness_reads_naturally() {
        assert_eq!(humanize(Duration::from_millis(40)), "40 ms");
        assert_eq!(humanize(Duration::from_millis(2500)), "2.5 seconds");
        assert_eq!(humanize(Duration::from_secs(600)), "10 minutes");
    }
}
