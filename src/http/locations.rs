//! Locations and transfers (admin, primary), and the per-location reads of a product's page
//! and availability (routed, like the rest of them).

use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{Admin, ApiError, AppState, Json, Path};
use crate::checkout::{CheckoutError, Location, Transfer, TransferRequest};
use crate::domain::{LocationId, ProductId, Stock};
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
        .routes(routes!(create, list))
        .routes(routes!(patch))
        .routes(routes!(transfer))
        .routes(routes!(show_transfer))
        .routes(routes!(receive))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewLocation {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "eu-1")]
    location_id: String,
    /// 1–200 characters (trimmed), no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        example = "Leeds",
        pattern = r"^[^\x00-\x1F\x7F-\x9F]*[^\s\x00-\x1F\x7F-\x9F][^\x00-\x1F\x7F-\x9F]*$"
    )]
    name: String,
    /// 0–10,000 (default 100); lower first when a request names no locations.
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 10000, example = 10)]
    rank: Option<Number>,
}

fn parse_rank(n: &Number) -> Result<i32, ApiError> {
    match n.as_i64() {
        Some(r) if (0..=10_000).contains(&r) => Ok(r as i32),
        _ => Err(ApiError::invalid(
            "INVALID_RANK",
            "rank must be a whole number from 0 to 10000",
        )),
    }
}

fn parse_name(name: &str) -> Result<String, ApiError> {
    Ok(crate::domain::ProductName::parse(name)
        .map_err(|_| {
            ApiError::invalid(
                "INVALID_NAME",
                "name must be 1 to 200 characters, no control characters",
            )
        })?
        .as_str()
        .to_string())
}

/// Create a location (admin)
#[utoipa::path(
    post,
    path = "/v1/locations",
    tag = "locations",
    request_body = NewLocation,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Created, active", body = Location),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 409, description = "ALREADY_EXISTS", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_LOCATION_ID, INVALID_NAME, INVALID_RANK", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn create(
    State(state): State<AppState>,
    _: Admin,
    Json(body): Json<NewLocation>,
) -> Result<Response, ApiError> {
    let id = LocationId::parse(&body.location_id)?;
    let name = parse_name(&body.name)?;
    let rank = body
        .rank
        .as_ref()
        .map(parse_rank)
        .transpose()?
        .unwrap_or(100);
    match state.checkout.create_location(&id, &name, rank).await? {
        Some(l) => Ok((StatusCode::CREATED, Json(l)).into_response()),
        None => Err(ApiError::conflict(
            "ALREADY_EXISTS",
            format!("location {id} already exists"),
        )),
    }
}

#[derive(Serialize, ToSchema)]
struct Locations {
    locations: Vec<Location>,
}

/// Every location, in rank order, then `location_id` (admin)
#[utoipa::path(
    get,
    path = "/v1/locations",
    tag = "locations",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "From the primary", body = Locations),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn list(State(state): State<AppState>, _: Admin) -> Result<Response, ApiError> {
    let locations = state.checkout.locations().await?;
    Ok(Json(Locations { locations }).into_response())
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct LocationPatch {
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\x00-\x1F\x7F-\x9F]*[^\s\x00-\x1F\x7F-\x9F][^\x00-\x1F\x7F-\x9F]*$"
    )]
    name: Option<String>,
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 10000)]
    rank: Option<Number>,
    /// An inactive location's stock is not sold, held or counted as available; it is still
    /// restocked, transferred and shown.
    active: Option<bool>,
}

/// Rename, re-rank, activate or deactivate a location (admin)
#[utoipa::path(
    patch,
    path = "/v1/locations/{location_id}",
    tag = "locations",
    params(("location_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body = LocationPatch,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The location after the change", body = Location),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "LOCATION_NOT_FOUND", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_LOCATION_ID, INVALID_NAME, INVALID_RANK", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn patch(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    Json(body): Json<LocationPatch>,
) -> Result<Response, ApiError> {
    let id = LocationId::parse(&id)?;
    let name = body.name.as_deref().map(parse_name).transpose()?;
    let rank = body.rank.as_ref().map(parse_rank).transpose()?;
    match state
        .checkout
        .patch_location(&id, name, rank, body.active)
        .await?
    {
        Some(l) => Ok(Json(l).into_response()),
        None => Err(location_not_found(&id)),
    }
}

fn location_not_found(id: &LocationId) -> ApiError {
    ApiError::not_found("LOCATION_NOT_FOUND", format!("no location {id}"))
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NewTransfer {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    product_id: String,
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    from: String,
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$")]
    to: String,
    #[schema(value_type = i64, minimum = 1, maximum = 1000000000)]
    quantity: Number,
    /// `true`: the units leave `from` now and join `to` when received.
    #[serde(default)]
    in_transit: bool,
}

/// Move units between locations (admin, idempotent by key)
#[utoipa::path(
    post,
    path = "/v1/transfers",
    tag = "locations",
    params(("Idempotency-Key" = String, Header, description = "Required; the same key and body answers the same transfer",
        min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$")),
    request_body = NewTransfer,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Made (or the same transfer again, for a repeated key and body): `received`, or `in_transit`", body = Transfer),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "OUT_OF_STOCK: `from` holds fewer units; nothing was written", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "UNKNOWN_LOCATION, SAME_LOCATION (`from` = `to`), INVALID_QUANTITY, IDEMPOTENCY_KEY_REUSED, VALUE_OUT_OF_RANGE (`to`'s count would pass 2^31 − 1; nothing written)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn transfer(
    State(state): State<AppState>,
    _: Admin,
    headers: HeaderMap,
    Json(body): Json<NewTransfer>,
) -> Result<Response, ApiError> {
    let key = super::required_key(&headers)?;
    let req = TransferRequest {
        key,
        product: ProductId::parse(&body.product_id)?,
        from: LocationId::parse(&body.from)?,
        to: LocationId::parse(&body.to)?,
        quantity: match body.quantity.as_i64() {
            Some(q) if (1..=1_000_000_000).contains(&q) => q as i32,
            _ => {
                return Err(ApiError::invalid(
                    "INVALID_QUANTITY",
                    "quantity must be a whole number from 1 to 1000000000",
                ));
            }
        },
        in_transit: body.in_transit,
    };
    if req.from == req.to {
        return Err(ApiError::invalid(
            "SAME_LOCATION",
            "from and to must be two locations",
        ));
    }
    let product = req.product.clone();
    match state.checkout.transfer(req).await {
        Ok((t, _)) => Ok((StatusCode::CREATED, Json(t)).into_response()),
        Err(CheckoutError::ProductNotFound) => Err(ApiError::not_found(
            "PRODUCT_NOT_FOUND",
            format!("no product {product}"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// A transfer (admin)
#[utoipa::path(
    get,
    path = "/v1/transfers/{transfer_id}",
    tag = "locations",
    params(("transfer_id" = Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "From the primary", body = Transfer),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "TRANSFER_NOT_FOUND", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show_transfer(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = transfer_id(&id)?;
    match state.checkout.transfer_by_id(id).await? {
        Some(t) => Ok(Json(t).into_response()),
        None => Err(transfer_not_found()),
    }
}

/// Receive an in-transit transfer: its units join `to`, exactly once (admin)
#[utoipa::path(
    post,
    path = "/v1/transfers/{transfer_id}/receive",
    tag = "locations",
    params(("transfer_id" = Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The transfer, received (again: the same)", body = Transfer),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "TRANSFER_NOT_FOUND", body = ErrorBody),
        (status = 422, description = "VALUE_OUT_OF_RANGE: `to`'s count (or the product's) would pass 2^31 − 1; the transfer stays `in_transit`", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn receive(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = transfer_id(&id)?;
    match state.checkout.receive_transfer(id).await? {
        Some((t, _)) => Ok(Json(t).into_response()),
        None => Err(transfer_not_found()),
    }
}

/// A path's transfer id; one that is no UUID names no transfer (404).
fn transfer_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| transfer_not_found())
}

fn transfer_not_found() -> ApiError {
    ApiError::not_found("TRANSFER_NOT_FOUND", "no such transfer")
}

/// One location's share of a product's stock (an availability answer's `by_location`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow, ToSchema)]
pub(super) struct AtLocation {
    pub location_id: String,
    /// 0 for an inactive location.
    pub available_quantity: i32,
}

/// A product's levels, for its page (every location that ever held it), as a JSON column
/// of the statement that reads the product (`$1`), so both are of one snapshot.
macro_rules! levels_of {
    () => {
        "(SELECT coalesce(json_agg(json_build_object('location_id', s.location_id, \
                 'available_quantity', s.available_quantity, 'active', l.active) \
                 ORDER BY l.rank, s.location_id COLLATE \"C\"), '[]') \
            FROM stock_levels s JOIN locations l ON l.location_id = s.location_id \
           WHERE s.product_id = $1)"
    };
}
pub(super) use levels_of;

/// What `product` has at each of `at` (in that order; an inactive one or one without a level
/// counts 0) and its sale window, in one statement (one snapshot), or `None` when there is
/// no such product.
pub(super) async fn at_locations(
    exec: impl sqlx::PgExecutor<'_>,
    product: &ProductId,
    at: &[LocationId],
) -> Result<Option<(Vec<AtLocation>, crate::checkout::Window)>, sqlx::Error> {
    type Time = Option<chrono::DateTime<chrono::Utc>>;
    let names: Vec<&str> = at.iter().map(LocationId::as_str).collect();
    let rows: Vec<(Option<bool>, Time, Time, String, i32)> = sqlx::query_as(
        "SELECT p.found, p.sale_starts_at, p.sale_ends_at, x.l, \
                coalesce((SELECT CASE WHEN loc.active THEN s.available_quantity ELSE 0 END \
                            FROM stock_levels s JOIN locations loc ON loc.location_id = s.location_id \
                           WHERE s.product_id = $1 AND s.location_id = x.l), 0) \
           FROM unnest($2::text[]) WITH ORDINALITY AS x(l, n) \
           LEFT JOIN (SELECT true AS found, sale_starts_at, sale_ends_at FROM products \
                       WHERE product_id = $1) p ON true \
          ORDER BY x.n",
    )
    .bind(product.as_str())
    .bind(&names)
    .fetch_all(exec)
    .await?;
    let Some(&(Some(true), starts, ends, ..)) = rows.first() else {
        return Ok(None);
    };
    let levels = rows
        .into_iter()
        .map(|(.., location_id, available_quantity)| AtLocation {
            location_id,
            available_quantity,
        })
        .collect();
    Ok(Some((levels, crate::checkout::Window { starts, ends })))
}

/// A product's stock at several locations, as `stock: [...]` on create says it (each
/// location once).
#[derive(Deserialize, ToSchema)]
pub(super) struct StockAt {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "eu-1")]
    pub location_id: String,
    #[schema(value_type = i64, minimum = 0, maximum = 2147483647)]
    pub quantity: Number,
}

/// Parses `stock: [...]`: each location once, each count a stock.
pub(super) fn parse_stock(stock: &[StockAt]) -> Result<Vec<(LocationId, i32)>, ApiError> {
    if stock.is_empty() || stock.len() > crate::domain::Locations::MAX {
        return Err(ApiError::invalid(
            "INVALID_STOCK",
            "stock must name 1 to 50 locations",
        ));
    }
    let mut parsed: Vec<(LocationId, i32)> = Vec::with_capacity(stock.len());
    for s in stock {
        let id = LocationId::parse(&s.location_id)?;
        if parsed.iter().any(|(l, _)| *l == id) {
            return Err(ApiError::invalid(
                "DUPLICATE_LOCATION",
                format!("location {id} appears twice; name each location once"),
            ));
        }
        parsed.push((id, Stock::parse(&s.quantity)?.get()));
    }
    let total: i64 = parsed.iter().map(|(_, q)| i64::from(*q)).sum();
    if total > i64::from(i32::MAX) {
        return Err(ApiError::invalid(
            "STOCK_LIMIT",
            "stock would exceed 2147483647",
        ));
    }
    Ok(parsed)
}

/// An availability answer over named locations (`?locations=`).
#[derive(Serialize, ToSchema)]
pub(super) struct AvailabilityAt {
    #[schema(value_type = String)]
    product_id: ProductId,
    qty: i32,
    /// `available_quantity >= qty`.
    available: bool,
    /// The sum over the considered locations (an inactive one counts 0).
    available_quantity: i32,
    on_sale: bool,
    /// One entry per considered location, in the order asked.
    by_location: Vec<AtLocation>,
}

/// Availability at the named locations: one routed read of the stock gate's class (a replica
/// within its budget, or the primary), stated like every routed read.
pub(super) async fn by_location(
    state: &AppState,
    id: ProductId,
    qty: crate::domain::Quantity,
    at: crate::domain::Locations,
) -> Result<Response, ApiError> {
    let read = state
        .db
        .read_existing(
            crate::routing::policy::QueryClass::StockGate,
            &crate::routing::ReadCtx::none(),
            |pool| {
                let (id, at) = (id.clone(), at.clone());
                async move { at_locations(pool.exec(), &id, at.get()).await }
            },
        )
        .await?;
    let Some((levels, window)) = read.value else {
        return Err(ApiError::not_found(
            "PRODUCT_NOT_FOUND",
            format!("no product {id}"),
        ));
    };
    let total: i64 = levels.iter().map(|l| i64::from(l.available_quantity)).sum();
    let total = i32::try_from(total).unwrap_or(i32::MAX);
    let body = AvailabilityAt {
        product_id: id,
        qty: qty.get(),
        available: total >= qty.get(),
        available_quantity: total,
        on_sale: window.on_sale(state.db.primary_now()),
        by_location: levels,
    };
    Ok(super::with_route_headers(
        super::stated(StatusCode::OK, body, &read.route),
        &read.route,
    ))
}
