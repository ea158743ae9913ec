//! Holds: take units out of availability while a buyer pays, then confirm or release.

use super::orders::{NewLine, parse_lines};
use super::responses::{BadRequest, ErrorBody, PayloadTooLarge, Unauthorized, Unavailable};
use super::{Admin, ApiError, AppState, Json, Path};
use crate::auth::Caller;
use crate::checkout::OrderBody;
use crate::checkout::{Hold, HoldRequest};
use crate::domain::HoldTtl;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Number;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(take))
        .routes(routes!(show, release))
        .routes(routes!(confirm))
        .routes(routes!(held))
}

#[derive(Deserialize, ToSchema)]
struct NewHold {
    #[schema(schema_with = hold_lines)]
    lines: Vec<NewLine>,
    /// Seconds the units stay held (1–3600, default 600).
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 3600, example = 600)]
    ttl_s: Option<Number>,
    /// Admin tokens name the user they hold for; user tokens may omit it.
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    user_id: Option<String>,
    /// Where the hold may take from, in order of preference (1–50, each once); absent: every
    /// active location, in rank order. Part of the body for idempotency.
    #[schema(schema_with = super::orders::locations_schema)]
    locations: Option<Vec<String>>,
}

fn hold_lines() -> utoipa::openapi::schema::ArrayBuilder {
    super::orders::lines_schema("The units to hold.")
}

/// Hold units (all lines or none)
///
/// The units leave availability at once (a guarded UPDATE per product, like an order) until
/// the hold is confirmed, released, or expires (they return within 5 s of `expires_at`).
/// Idempotent by key like orders; a 409 is final for its key.
#[utoipa::path(
    post,
    path = "/v1/holds",
    tag = "holds",
    params(
        ("Idempotency-Key" = String, Header, description = "1–255 printable ASCII characters, no spaces",
            min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body = NewHold,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Held (or the same hold again for a repeated key and body)", body = Hold),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "A user holding for another user", body = ErrorBody),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "OUT_OF_STOCK, with the short `lines`; nothing was held", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_LINES, DUPLICATE_PRODUCT, INVALID_TTL, INVALID_QUANTITY, INVALID_PRODUCT_ID, IDEMPOTENCY_KEY_REUSED, USER_ID_REQUIRED", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn take(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<NewHold>,
) -> Result<Response, ApiError> {
    let key = super::required_key(&headers)?;
    let user = super::acting_user(&caller, body.user_id.as_deref(), "take holds")?;
    let lines = parse_lines(&body.lines)?;
    let locations = crate::domain::Locations::parse(body.locations.as_deref())?;
    state.checkout.known_locations(locations.get()).await?;
    let ttl = match &body.ttl_s {
        Some(n) => HoldTtl::parse(n)?,
        None => HoldTtl::DEFAULT,
    };
    let (hold, _) = state
        .checkout
        .hold(HoldRequest {
            user,
            lines,
            ttl,
            key,
            locations,
        })
        .await?;
    Ok((StatusCode::CREATED, Json(hold)).into_response())
}

/// Loads a hold the caller may see; someone else's is a 403.
async fn load(state: &AppState, caller: &Caller, id: &str) -> Result<Hold, ApiError> {
    let id =
        Uuid::parse_str(id).map_err(|_| ApiError::not_found("HOLD_NOT_FOUND", "no such hold"))?;
    let hold = state.checkout.hold_by_id(id).await?;
    if !caller.may_act_for(hold.user_id.as_str()) {
        return Err(ApiError::Forbidden("this hold belongs to another user"));
    }
    Ok(hold)
}

/// A hold (its user, or admin)
#[utoipa::path(
    get,
    path = "/v1/holds/{hold_id}",
    tag = "holds",
    params(("hold_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The hold: `held`, `confirmed` (with `order_id`), `released` or `expired`", body = Hold),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "The hold belongs to another user", body = ErrorBody),
        (status = 404, description = "HOLD_NOT_FOUND (also for an id that is not a UUID)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Hold>, ApiError> {
    Ok(Json(load(&state, &caller, &id).await?))
}

/// Confirm a hold: its units become the order
///
/// Exactly once: 201 with the order the first time, 200 with the same order after.
#[utoipa::path(
    post,
    path = "/v1/holds/{hold_id}/confirm",
    tag = "holds",
    params(("hold_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Confirmed now: the order, its lines the held ones", body = OrderBody),
        (status = 200, description = "Confirmed before: the same order", body = OrderBody),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "The hold belongs to another user", body = ErrorBody),
        (status = 404, description = "HOLD_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "HOLD_EXPIRED or HOLD_RELEASED: too late", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn confirm(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let hold = load(&state, &caller, &id).await?;
    let (order, now) = state.checkout.confirm_hold(hold.hold_id).await?;
    let status = if now {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(order)).into_response())
}

/// Release a hold: its units go back
///
/// Exactly once; releasing again answers the hold as it is.
#[utoipa::path(
    delete,
    path = "/v1/holds/{hold_id}",
    tag = "holds",
    params(("hold_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The hold, `released` (or `expired` if its time had passed)", body = Hold),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "The hold belongs to another user", body = ErrorBody),
        (status = 404, description = "HOLD_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "HOLD_CONFIRMED: it is an order now", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn release(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Hold>, ApiError> {
    let hold = load(&state, &caller, &id).await?;
    Ok(Json(state.checkout.release_hold(hold.hold_id).await?))
}

#[derive(Serialize, ToSchema)]
struct Held {
    product_id: String,
    units: i64,
}

#[derive(Serialize, ToSchema)]
struct HeldNow {
    /// The products with the most units held (up to 20), most first.
    units_held: Vec<Held>,
}

/// Units held per product (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/holds",
    tag = "holds",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Units held now, the hottest products first", body = HeldNow),
        (status = 401, response = Unauthorized),
        (status = 403, description = "Not an admin", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn held(State(state): State<AppState>, _: Admin) -> Result<Json<HeldNow>, ApiError> {
    let units_held = state
        .checkout
        .units_held(20)
        .await?
        .into_iter()
        .map(|(product_id, units)| Held { product_id, units })
        .collect();
    Ok(Json(HeldNow { units_held }))
}
