//! A user's own settings and profile: writes on the primary, reads with read-your-writes.
//!
//! After a write commits, the primary's WAL position is recorded for the user (in the
//! shared store and in an `X-Consistency-Token` response header). Later reads, from any
//! device and any instance, use a replica only if it has replayed that far. A committed
//! write is always answered 200: what could not be recorded is made safe by
//! [`crate::routing::Db::note_write`] instead (a pin to the primary, or a wait). A write whose
//! COMMIT lost its link may have landed: it is answered 503 `OUTCOME_UNKNOWN` and pins the
//! user to the primary all the same ([`crate::routing::Db::note_unknown_write`]). The write
//! and its note run in a task of their own, so a request that times out (503 `TIMEOUT`) while
//! its COMMIT is under way still leaves the position noted once the write lands.

use super::responses::{BadRequest, ErrorBody, PayloadTooLarge, Unauthorized, Unavailable};
use super::{ApiError, AppState, Json, Path, Stated, stated};
use crate::auth::Caller;
use crate::domain::{DisplayName, Email, Settings, UserId};
use crate::lsn::{format_lsn, parse_lsn};
use crate::routing::policy::QueryClass;
use crate::routing::{ReadCtx, Routed};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{FromRow, Postgres};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(get_settings, put_settings))
        .routes(routes!(get_profile, put_profile))
}

const CONSISTENCY_TOKEN: &str = "x-consistency-token";

/// The user in the path, if the caller may act for them.
fn authorize(caller: &Caller, raw: &str) -> Result<UserId, ApiError> {
    let user = UserId::parse(raw)?;
    if !caller.may_act_for(user.as_str()) {
        return Err(ApiError::Forbidden(
            "a user may read and write only their own data",
        ));
    }
    Ok(user)
}

/// The position a client carries from an earlier write (ignored if unreadable).
fn carried_lsn(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONSISTENCY_TOKEN)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_lsn)
}

/// Adds the write's position as `X-Consistency-Token`, when it could be read (when it could
/// not, the user is pinned to the primary instead and there is no token to carry).
fn with_token(mut response: Response, lsn: Option<u64>) -> Response {
    if let Some(lsn) = lsn
        && let Ok(v) = HeaderValue::from_str(&format_lsn(lsn))
    {
        response
            .headers_mut()
            .insert(HeaderName::from_static(CONSISTENCY_TOKEN), v);
    }
    response
}

/// The shared path of a read: the user's one row, on the `own_data` class with the position
/// the client carries (read-your-writes).
async fn read_own<T>(
    state: &AppState,
    user: &UserId,
    headers: &HeaderMap,
    sql: &'static str,
) -> Result<Routed<Option<T>>, ApiError>
where
    T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
{
    let ctx = ReadCtx::user(user.clone(), carried_lsn(headers));
    let read = state.db.read(QueryClass::OwnData, &ctx, |pool| async move {
        sqlx::query_as::<_, T>(sql)
            .bind(user.as_str())
            .fetch_optional(pool.exec())
            .await
    });
    Ok(read.await?)
}

/// The shared path of a write: one statement in a primary transaction, then the position
/// noted for the user and `saved` answered as a GET would, with `X-Consistency-Token`. The
/// transaction and the note run in a task of their own: a request that times out or hangs up
/// (dropping this future) cannot fall between the COMMIT and the note, which the user's next
/// reads need to skip replicas from before the write.
async fn write_own<T: Serialize>(
    state: &AppState,
    user: &UserId,
    statement: sqlx::query::Query<'static, Postgres, PgArguments>,
    saved: T,
) -> Result<Response, ApiError> {
    let (db, who) = (state.db.clone(), user.clone());
    let lsn = match tokio::spawn(async move { commit_own(&db, &who, statement).await }).await {
        Ok(done) => done?,
        // The task died (a panic): its write may have landed.
        Err(e) => {
            tracing::error!(error = %e, user = %user, "a user's write task died; its outcome is unknown");
            state.db.note_unknown_write(user).await;
            return Err(outcome_unknown());
        }
    };
    let route = state.db.written_route();
    Ok(with_token(stated(StatusCode::OK, saved, &route), lsn))
}

/// Runs a user's write and notes its position: `None` when it could not be read (the user is
/// then pinned to the primary instead, [`crate::routing::Db::note_write`]).
async fn commit_own(
    db: &crate::routing::Db,
    user: &UserId,
    statement: sqlx::query::Query<'static, Postgres, PgArguments>,
) -> Result<Option<crate::lsn::Lsn>, ApiError> {
    let mut tx = db.primary().begin().await?;
    statement.execute(&mut *tx).await?;
    match tx.commit().await {
        Ok(()) => {}
        // The server refused the COMMIT: it rolled back, nothing was written.
        Err(e @ sqlx::Error::Database(_)) => return Err(e.into()),
        // The link failed with the COMMIT sent: the write may have landed, at a position no
        // one knows. The user's reads go to the primary for one TTL, everywhere, so they
        // never flip between the old value and the new.
        Err(e) => {
            tracing::warn!(error = %e, user = %user, "COMMIT of a user's write lost its link; its outcome is unknown");
            db.note_unknown_write(user).await;
            return Err(outcome_unknown());
        }
    }
    // Committed: from here on nothing may turn this into an error.
    Ok(db.note_write(user).await)
}

fn outcome_unknown() -> ApiError {
    ApiError::unavailable(
        "OUTCOME_UNKNOWN",
        "the database did not confirm or deny the write, so it may have been saved; send it again",
    )
}

#[derive(Serialize, FromRow, ToSchema)]
struct SettingsBody {
    user_id: String,
    /// Any JSON object (`{}` for a user who never saved settings).
    #[schema(value_type = Object)]
    settings: Value,
}

/// A user's settings (that user, or admin; read-your-writes)
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}/settings",
    tag = "users",
    params(
        ("user_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("X-Consistency-Token" = Option<String>, Header, description = "From an earlier write's response: the read then sees that write, on any instance (ignored if unreadable)"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The settings, and the moment they describe", body = Stated<SettingsBody>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "A user acting for another user", body = ErrorBody),
        (status = 404, description = "No such route (an id of `.` or `..` is resolved away)", body = ErrorBody),
        (status = 422, description = "INVALID_USER_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn get_settings(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let user = authorize(&caller, &user)?;
    const SQL: &str = "SELECT user_id, settings FROM user_settings WHERE user_id = $1";
    let read = read_own(&state, &user, &headers, SQL).await?;
    // A user who never saved settings has the empty object.
    let body = read.value.unwrap_or_else(|| SettingsBody {
        user_id: user.to_string(),
        settings: Value::Object(Default::default()),
    });
    Ok(stated(StatusCode::OK, body, &read.route))
}

#[derive(Deserialize, ToSchema)]
struct PutSettings {
    /// Replaces the whole object: at most 16 KiB serialised, 8 levels deep, no NUL.
    #[schema(value_type = Object)]
    settings: Value,
}

/// Replace a user's settings (that user, or admin)
#[utoipa::path(
    put,
    path = "/v1/users/{user_id}/settings",
    tag = "users",
    params(("user_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body = PutSettings,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The saved settings, as GET", body = Stated<SettingsBody>,
            headers(("X-Consistency-Token" = String, description = "Send it back on later reads from any instance"))),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "A user acting for another user", body = ErrorBody),
        (status = 404, description = "No such route (an id of `.` or `..` is resolved away)", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_SETTINGS, INVALID_USER_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn put_settings(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
    Json(body): Json<PutSettings>,
) -> Result<Response, ApiError> {
    let user = authorize(&caller, &user)?;
    let saved = SettingsBody {
        user_id: user.to_string(),
        settings: Settings::parse(body.settings)?.into_value(),
    };
    let upsert = sqlx::query(
        "INSERT INTO user_settings (user_id, settings) VALUES ($1, $2) \
         ON CONFLICT (user_id) DO UPDATE SET settings = EXCLUDED.settings, updated_at = clock_timestamp()",
    )
    .bind(user.to_string())
    .bind(saved.settings.clone());
    write_own(&state, &user, upsert, &saved).await
}

#[derive(Serialize, FromRow, ToSchema)]
struct Profile {
    user_id: String,
    display_name: String,
    email: String,
}

/// A user's profile (that user, or admin; read-your-writes)
#[utoipa::path(
    get,
    path = "/v1/users/{user_id}/profile",
    tag = "users",
    params(
        ("user_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("X-Consistency-Token" = Option<String>, Header, description = "From an earlier write's response: the read then sees that write, on any instance (ignored if unreadable)"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The profile, and the moment it describes", body = Stated<Profile>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "A user acting for another user", body = ErrorBody),
        (status = 404, description = "PROFILE_NOT_FOUND", body = ErrorBody),
        (status = 422, description = "INVALID_USER_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn get_profile(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let user = authorize(&caller, &user)?;
    const SQL: &str = "SELECT user_id, display_name, email FROM user_profiles WHERE user_id = $1";
    let read = read_own::<Profile>(&state, &user, &headers, SQL).await?;
    let profile = read.value.ok_or_else(|| {
        ApiError::not_found(
            "PROFILE_NOT_FOUND",
            format!("user {user} has no profile yet"),
        )
    })?;
    Ok(stated(StatusCode::OK, profile, &read.route))
}

#[derive(Deserialize, ToSchema)]
struct PutProfile {
    /// 1–100 characters (trimmed), no control characters.
    #[schema(
        min_length = 1,
        max_length = 100,
        example = "Ada Lovelace",
        pattern = r"^[^\x00-\x1F\x7F-\x9F]*[^\s\x00-\x1F\x7F-\x9F][^\x00-\x1F\x7F-\x9F]*$"
    )]
    display_name: String,
    /// `name@example.com`, at most 254 bytes, the part before the `@` at most 64, no
    /// whitespace or control characters. (The pattern admits the ASCII addresses, whose
    /// characters are bytes; the service also takes other characters within those limits.)
    #[schema(
        max_length = 254,
        example = "ada@example.com",
        pattern = r"^[!-?A-~]{1,64}@[!-\-/-?A-~]+(\.[!-\-/-?A-~]+)+$"
    )]
    email: String,
}

/// Create or replace a user's profile (that user, or admin)
#[utoipa::path(
    put,
    path = "/v1/users/{user_id}/profile",
    tag = "users",
    params(("user_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body = PutProfile,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The saved profile, as GET", body = Stated<Profile>,
            headers(("X-Consistency-Token" = String, description = "Send it back on later reads from any instance"))),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "A user acting for another user", body = ErrorBody),
        (status = 404, description = "No such route (an id of `.` or `..` is resolved away)", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_DISPLAY_NAME, INVALID_EMAIL, INVALID_USER_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn put_profile(
    State(state): State<AppState>,
    caller: Caller,
    Path(user): Path<String>,
    Json(body): Json<PutProfile>,
) -> Result<Response, ApiError> {
    let user = authorize(&caller, &user)?;
    let name = DisplayName::parse(&body.display_name)?;
    let email = Email::parse(&body.email)?;
    let upsert = sqlx::query(
        "INSERT INTO user_profiles (user_id, display_name, email) VALUES ($1, $2, $3) \
         ON CONFLICT (user_id) DO UPDATE SET display_name = EXCLUDED.display_name, email = EXCLUDED.email, updated_at = clock_timestamp()",
    )
    .bind(user.to_string())
    .bind(name.as_str().to_string())
    .bind(email.as_str().to_string());
    let saved = Profile {
        user_id: user.to_string(),
        display_name: name.as_str().to_string(),
        email: email.as_str().to_string(),
    };
    write_own(&state, &user, upsert, saved).await
}
