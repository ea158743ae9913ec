//! Webhooks (admin): register, look at, list and delete. The delivery itself is
//! [`crate::events::webhooks`]'.

use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{Admin, ApiError, AppState, Json, Path};
use crate::events::TYPES;
use crate::events::webhooks::{
    self, EventTypes, NewWebhook, Secret, Webhook, WebhookStatus, WebhookUrl,
};
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(create, list))
        .routes(routes!(show, delete))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewWebhookBody {
    /// An absolute `http://` or `https://` URL with a host, at most 2048 bytes, without
    /// control characters (422 `INVALID_URL`): each event is `POST`ed to it. The pattern
    /// admits a plain subset of such URLs (an ASCII host name or address, an optional port,
    /// printable ASCII after it); others the rule allows are accepted too.
    #[schema(
        example = "https://fulfilment.example/hooks/stockgate",
        max_length = 2048,
        pattern = "^https?://[A-Za-z0-9.-]+(:[1-9][0-9]{0,3})?(/[!-~]*)?$"
    )]
    url: String,
    /// 16–256 bytes of UTF-8 without NUL (422 `INVALID_SECRET`); the key of
    /// `Stockgate-Signature`. The lengths below count characters, so a secret of many
    /// multi-byte characters can pass them and still be over 256 bytes.
    #[schema(
        min_length = 16,
        max_length = 256,
        pattern = "^[^\\u0000]*$",
        example = "whsec-0123456789abcdef"
    )]
    secret: String,
    /// The event types to receive: one or more of the feed's types, each known (an empty
    /// list or an unknown type is 422 `INVALID_TYPES`).
    #[schema(schema_with = event_types, example = json!(["order.confirmed", "order.cancelled"]))]
    types: Vec<String>,
}

/// `types`' schema: a non-empty array of the feed's event types, from [`TYPES`] itself.
fn event_types() -> utoipa::openapi::Array {
    use utoipa::openapi::{ArrayBuilder, ObjectBuilder, Type};
    ArrayBuilder::new()
        .items(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(TYPES.iter().copied())),
        )
        .min_items(Some(1))
        .build()
}

/// A webhook id from the path; anything but a UUID is 400.
fn webhook_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw)
        .map_err(|_| ApiError::bad_request("INVALID_WEBHOOK_ID", "webhook_id must be a UUID"))
}

fn not_found() -> ApiError {
    ApiError::not_found("WEBHOOK_NOT_FOUND", "no such webhook")
}

/// Register a webhook (admin)
///
/// It receives every event of its `types` after the newest event at its creation (its
/// `delivered_cursor`), in feed order, one `POST` per event, with `Stockgate-Event-Cursor` and
/// `Stockgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`; anything but
/// a 2xx within 10 s is retried with backoff, never skipping ahead.
#[utoipa::path(
    post,
    path = "/v1/admin/webhooks",
    tag = "admin",
    request_body = NewWebhookBody,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Registered; delivery starts after `delivered_cursor`", body = Webhook),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_URL, INVALID_SECRET, INVALID_TYPES", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn create(
    State(state): State<AppState>,
    _: Admin,
    Json(body): Json<NewWebhookBody>,
) -> Result<(StatusCode, Json<Webhook>), ApiError> {
    let new = NewWebhook {
        url: WebhookUrl::parse(&body.url)?,
        secret: Secret::parse(&body.secret)?,
        types: EventTypes::parse(&body.types)?,
    };
    let registered = webhooks::create(&state.db, &new).await?;
    Ok((StatusCode::CREATED, Json(registered)))
}

/// Every webhook (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/webhooks",
    tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The webhooks not deleted, oldest first", body = Vec<WebhookStatus>),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn list(
    State(state): State<AppState>,
    _: Admin,
) -> Result<Json<Vec<WebhookStatus>>, ApiError> {
    Ok(Json(webhooks::list(&state.db).await?))
}

/// A webhook and its delivery (admin)
///
/// `delivered_cursor` is the last event delivered; `failures` counts the failed attempts at
/// the next one since then, `last_error` says why the latest failed.
#[utoipa::path(
    get,
    path = "/v1/admin/webhooks/{webhook_id}",
    tag = "admin",
    params(("webhook_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The webhook, as its deliverer last recorded it", body = WebhookStatus),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "WEBHOOK_NOT_FOUND", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Json<WebhookStatus>, ApiError> {
    let id = webhook_id(&id)?;
    Ok(Json(
        webhooks::get(&state.db, id).await?.ok_or_else(not_found)?,
    ))
}

/// Delete a webhook (admin)
///
/// Delivery stops within a fraction of a second; an attempt in flight is abandoned.
#[utoipa::path(
    delete,
    path = "/v1/admin/webhooks/{webhook_id}",
    tag = "admin",
    params(("webhook_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Deleted: the webhook as it stood", body = WebhookStatus),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "WEBHOOK_NOT_FOUND (also once deleted)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn delete(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Json<WebhookStatus>, ApiError> {
    let id = webhook_id(&id)?;
    Ok(Json(
        webhooks::delete(&state.db, id)
            .await?
            .ok_or_else(not_found)?,
    ))
}
