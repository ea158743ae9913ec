//! The ledger's routes (admin, primary): adjustments, a product's count changed at one
//! location with a reason and an optional compare-and-set, and the movements that record
//! every change of a count that is not an order's, a cart's or a hold's.

use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{Admin, ApiError, AppState, Json, Path, Query};
use crate::checkout::{Adjust, AdjustReason, Adjusted, AdjustmentRequest, CheckoutError, Movement};
use crate::domain::{LocationId, ProductId};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Number;
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{IntoParams, PartialSchema, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(adjust))
        .routes(routes!(movements))
}

/// The longest note, in characters.
const MAX_NOTE: usize = 500;

/// An adjustment's body as the handler reads it; the document states it as
/// [`NewAdjustmentBody`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewAdjustment {
    location_id: Option<String>,
    delta: Option<Number>,
    set: Option<Number>,
    expected: Option<Number>,
    reason: String,
    note: Option<String>,
}

/// The fields every adjustment may carry, besides its change.
#[derive(ToSchema)]
#[allow(dead_code)]
struct AdjustmentFields {
    /// Where (default `default`).
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "eu-1")]
    location_id: Option<String>,
    /// Made only if the location's count is exactly this at that moment, else 409
    /// `STOCK_CHANGED`.
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 2147483647, example = 20)]
    expected: Option<i64>,
    reason: AdjustReason,
    /// At most 500 characters.
    #[schema(max_length = 500, pattern = "^[^\\x00]*$")]
    note: Option<String>,
}

/// An adjustment's body: [`AdjustmentFields`] and exactly one of `delta` (not 0) and `set`.
struct NewAdjustmentBody;

impl utoipa::PartialSchema for NewAdjustmentBody {
    fn schema() -> RefOr<Schema> {
        let null = || ObjectBuilder::new().schema_type(Type::Null);
        let int = |min: i64, max: i64| {
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(min))
                .maximum(Some(max))
        };
        let max = i64::from(i32::MAX);
        let delta = OneOfBuilder::new()
            .item(int(1, max))
            .item(int(-max, -1))
            .description(Some("Units to add (> 0) or remove (< 0)."));
        let by_delta = ObjectBuilder::new()
            .title(Some("By delta"))
            .property("delta", delta)
            .required("delta")
            .property("set", null());
        let to_set = ObjectBuilder::new()
            .title(Some("To a count"))
            .property("set", int(0, max).description(Some("The count to state.")))
            .required("set")
            .property("delta", null());
        AllOfBuilder::new()
            .item(Ref::from_schema_name(AdjustmentFields::name()))
            .item(OneOfBuilder::new().item(by_delta).item(to_set))
            .into()
    }
}

impl ToSchema for NewAdjustmentBody {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((AdjustmentFields::name().into(), AdjustmentFields::schema()));
        schemas.push((AdjustReason::name().into(), AdjustReason::schema()));
    }
}

/// A whole number in `range`, else 422 `code`.
fn whole(
    n: &Number,
    range: std::ops::RangeInclusive<i64>,
    code: &'static str,
    what: &str,
) -> Result<i32, ApiError> {
    match n.as_i64() {
        Some(v) if range.contains(&v) => Ok(v as i32),
        _ => Err(ApiError::invalid(
            code,
            format!(
                "{what} must be a whole number from {} to {}",
                range.start(),
                range.end()
            ),
        )),
    }
}

impl NewAdjustment {
    fn change(&self) -> Result<Adjust, ApiError> {
        let max = i64::from(i32::MAX);
        match (&self.delta, &self.set) {
            (Some(d), None) => match whole(d, -max..=max, "INVALID_DELTA", "delta")? {
                0 => Err(ApiError::invalid("INVALID_DELTA", "delta must not be 0")),
                d => Ok(Adjust::Delta(d)),
            },
            (None, Some(s)) => Ok(Adjust::Set(whole(s, 0..=max, "INVALID_SET", "set")?)),
            _ => Err(ApiError::invalid(
                "INVALID_ADJUSTMENT",
                "give exactly one of delta and set",
            )),
        }
    }

    fn reason(&self) -> Result<AdjustReason, ApiError> {
        serde_json::from_value(serde_json::Value::String(self.reason.clone())).map_err(|_| {
            ApiError::invalid(
                "INVALID_REASON",
                "reason must be one of received, damaged, lost, found, count, returned, correction",
            )
        })
    }

    fn note(&self) -> Result<Option<String>, ApiError> {
        match &self.note {
            Some(n) if n.chars().count() > MAX_NOTE || n.contains('\0') => Err(ApiError::invalid(
                "INVALID_NOTE",
                "note must be at most 500 characters, without NUL",
            )),
            other => Ok(other.clone()),
        }
    }
}

/// Change one location's count with a reason (admin, idempotent by key)
#[utoipa::path(
    post,
    path = "/v1/products/{product_id}/adjustments",
    tag = "ledger",
    params(
        ("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("Idempotency-Key" = String, Header, description = "Required; the same key and body answers the same adjustment (the same `movement_id`)",
            min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body = NewAdjustmentBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Made (or the same adjustment again, for a repeated key and body): the location's count after it, and its movement", body = Adjusted),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "STOCK_CHANGED: the count is not `expected` (the error's `available_quantity` says what it is); OUT_OF_STOCK: the count would go below zero. Nothing was written", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "UNKNOWN_LOCATION, INVALID_ADJUSTMENT, INVALID_DELTA, INVALID_SET, INVALID_EXPECTED, INVALID_REASON, INVALID_NOTE, IDEMPOTENCY_KEY_REUSED, VALUE_OUT_OF_RANGE (the count would pass 2^31 − 1; nothing written)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn adjust(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<NewAdjustment>,
) -> Result<Response, ApiError> {
    let product = ProductId::parse(&id)?;
    let key = super::required_key(&headers)?;
    let max = i64::from(i32::MAX);
    let req = AdjustmentRequest {
        key,
        location: LocationId::parse(body.location_id.as_deref().unwrap_or("default"))?,
        change: body.change()?,
        expected: body
            .expected
            .as_ref()
            .map(|e| whole(e, 0..=max, "INVALID_EXPECTED", "expected"))
            .transpose()?,
        reason: body.reason()?,
        note: body.note()?,
        product: product.clone(),
    };
    match state.checkout.adjust(req).await {
        Ok((adjusted, _)) => Ok((StatusCode::OK, Json(adjusted)).into_response()),
        Err(CheckoutError::ProductNotFound) => Err(ApiError::not_found(
            "PRODUCT_NOT_FOUND",
            format!("no product {product}"),
        )),
        Err(CheckoutError::OutOfStock) => Err(ApiError::conflict(
            "OUT_OF_STOCK",
            "the location's count would go below zero; nothing was written",
        )),
        Err(e) => Err(e.into()),
    }
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct MovementsQuery {
    /// Only this location's movements.
    #[param(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    location_id: Option<String>,
    /// The `next` of an earlier page; omitted: from the first movement.
    #[param(pattern = "^[0-9]{1,18}$")]
    after: Option<String>,
    /// 1–1000; default 100.
    #[param(value_type = Option<i64>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

#[derive(Serialize, ToSchema)]
struct MovementsPage {
    movements: Vec<Movement>,
    /// The `after` of the following call (opaque).
    #[schema(example = "42")]
    next: String,
}

/// A product's movements, oldest first (admin, primary)
#[utoipa::path(
    get,
    path = "/v1/products/{product_id}/movements",
    tag = "ledger",
    params(("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"), MovementsQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The movements after `after`, and the cursor to continue from", body = MovementsPage),
        (status = 400, description = "INVALID_CURSOR, INVALID_LIMIT, INVALID_QUERY", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 422, description = "UNKNOWN_LOCATION, INVALID_LOCATION_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn movements(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    Query(q): Query<MovementsQuery>,
) -> Result<Response, ApiError> {
    let product = ProductId::parse(&id)?;
    let after = match q.after.as_deref() {
        None => 0,
        Some(a) => a
            .parse::<i64>()
            .ok()
            .filter(|a| *a >= 0)
            .ok_or_else(|| ApiError::bad_request("INVALID_CURSOR", format!("after={a:?}")))?,
    };
    let limit = match q.limit.as_deref() {
        None => 100,
        Some(l) => l
            .parse::<i64>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| ApiError::bad_request("INVALID_LIMIT", "limit must be 1 to 1000"))?,
    };
    let location = q
        .location_id
        .as_deref()
        .map(LocationId::parse)
        .transpose()?;
    let Some(movements) = state
        .checkout
        .movements(&product, location.as_ref(), after, limit)
        .await?
    else {
        return Err(ApiError::not_found(
            "PRODUCT_NOT_FOUND",
            format!("no product {product}"),
        ));
    };
    let next = movements
        .last()
        .map_or_else(|| after.to_string(), |m| m.movement_id.clone());
    Ok((StatusCode::OK, Json(MovementsPage { movements, next })).into_response())
}
