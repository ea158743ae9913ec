//! Orders: place (idempotent), look up, cancel.

use super::peer::Placement;
use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable,
};
use super::{ApiError, AppState, Json, Path};
use crate::auth::Caller;
use crate::checkout::CartRequest;
use crate::checkout::{Order, OrderBody, OrderRequest, Placed};
use crate::domain::{Lines, Locations, ProductId, Quantity};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Number;
use utoipa::openapi::schema::{
    ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type,
};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(place))
        .routes(routes!(show))
        .routes(routes!(cancel))
}

/// A single-product order (`product_id` + `quantity`) or a cart (`lines`); its schema is
/// written out below, since it is one of two shapes.
#[derive(Deserialize)]
struct NewOrder {
    product_id: Option<String>,
    quantity: Option<Number>,
    lines: Option<Vec<NewLine>>,
    user_id: Option<String>,
    locations: Option<Vec<String>>,
}

/// Exactly one of the two shapes `place` takes, the other's fields absent or null.
impl PartialSchema for NewOrder {
    fn schema() -> RefOr<Schema> {
        let null = || ObjectBuilder::new().schema_type(Type::Null);
        let user_id = || {
            ObjectBuilder::new()
                .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
                .pattern(Some(ID_PATTERN))
                .description(Some(
                    "Admin tokens name the user they order for; user tokens may omit it.",
                ))
        };
        let quantity = ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1))
            .maximum(Some(Quantity::MAX))
            .examples([1]);
        let single = ObjectBuilder::new()
            .title(Some("One product"))
            .property("product_id", id_schema().examples(["flash-60"]))
            .property("quantity", quantity)
            .required("product_id")
            .required("quantity")
            .property("lines", null())
            .property("user_id", user_id())
            .property("locations", locations_schema());
        let cart = ObjectBuilder::new()
            .title(Some("A cart"))
            .property(
                "lines",
                lines_schema("A cart (instead of `product_id` + `quantity`)."),
            )
            .required("lines")
            .property("product_id", null())
            .property("quantity", null())
            .property("user_id", user_id())
            .property("locations", locations_schema());
        OneOfBuilder::new()
            .description(Some("A single-product order or a cart."))
            .item(single)
            .item(cart)
            .into()
    }
}

impl ToSchema for NewOrder {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((NewLine::name().into(), NewLine::schema()));
    }
}

/// `locations` of an order, a cart or a hold: where it may take from, in the client's order
/// of preference.
pub(super) fn locations_schema() -> ArrayBuilder {
    ArrayBuilder::new()
        .items(id_schema())
        .min_items(Some(1))
        .max_items(Some(Locations::MAX))
        .unique_items(true)
        .description(Some(
            "The locations this request may take from, in order of preference (1–50, each once); absent: every active location, in rank order. Part of the body for idempotency.",
        ))
}

/// What `ProductId` and `UserId` take.
pub(super) const ID_PATTERN: &str = "^[A-Za-z0-9_.-]{1,64}$";

fn id_schema() -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(ID_PATTERN))
}

/// `lines` of a cart or hold: 1–50, each product once (`uniqueItems` says part of that: no
/// line twice).
pub(super) fn lines_schema(description: &str) -> ArrayBuilder {
    ArrayBuilder::new()
        .items(Ref::from_schema_name(NewLine::name()))
        .min_items(Some(1))
        .max_items(Some(Lines::MAX))
        .unique_items(true)
        .description(Some(format!(
            "{description} 1–50 lines, each product once."
        )))
}

/// One line of a cart or hold.
#[derive(Deserialize, ToSchema)]
pub(super) struct NewLine {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "flash-60")]
    product_id: String,
    #[schema(value_type = i64, minimum = 1, maximum = 10000, example = 1)]
    quantity: Number,
}

/// Parses a body's lines (1–50, each product once).
pub(super) fn parse_lines(lines: &[NewLine]) -> Result<Lines, ApiError> {
    let raw: Vec<(&str, &Number)> = lines
        .iter()
        .map(|l| (l.product_id.as_str(), &l.quantity))
        .collect();
    Ok(Lines::parse(&raw)?)
}

/// Place an order (idempotent by key)
///
/// Confirmed only by a guarded `UPDATE … WHERE available_quantity >= qty` on the primary.
/// The same key from the same user with the same body returns the same order (201 again)
/// and takes stock once; with a different body it is refused (422).
#[utoipa::path(
    post,
    path = "/v1/orders",
    tag = "orders",
    params(
        ("Idempotency-Key" = String, Header, description = "1–255 printable ASCII characters, no spaces; unique per user and order",
            min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body = NewOrder,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Confirmed (or the same order again, for a repeated key and body)", body = OrderBody),
        (status = 400, description = "IDEMPOTENCY_KEY_MISSING, malformed JSON or wrong types", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 409, description = "OUT_OF_STOCK: not enough stock; nothing was written. Final for its key: the same key and body answers 409 again", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "IDEMPOTENCY_KEY_REUSED (same key, different body), INVALID_IDEMPOTENCY_KEY, INVALID_QUANTITY, INVALID_PRODUCT_ID, INVALID_USER_ID, USER_ID_REQUIRED (admin without user_id)", body = ErrorBody),
        (status = 429, description = "RATE_LIMITED: over the configured per-user order rate", body = ErrorBody,
            headers(("Retry-After" = String, description = "Seconds to wait"))),
        (status = 503, description = "OUTCOME_UNKNOWN (retry with the same key to learn the outcome), DATABASE_UNAVAILABLE, OVERLOADED, TIMEOUT; always with Retry-After", body = ErrorBody,
            headers(("Retry-After" = String, description = "Seconds to wait"))),
    )
)]

async fn place(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<NewOrder>,
) -> Result<Response, ApiError> {
    let key = super::required_key(&headers)?;
    let user = super::acting_user(&caller, body.user_id.as_deref(), "place orders")?;
    let locations = Locations::parse(body.locations.as_deref())?;
    state.checkout.known_locations(locations.get()).await?;
    let single = |product, quantity| OrderRequest {
        user: user.clone(),
        product,
        quantity,
        key: key.clone(),
        locations: locations.clone(),
    };
    let placed = match (&body.lines, &body.product_id, &body.quantity) {
        (Some(lines), None, None) => match parse_lines(lines)? {
            // A one-line cart is an order for that product: the batched fast path.
            lines if lines.get().len() == 1 => {
                let (product, quantity) = lines.get()[0].clone();
                return place_single(&state, single(product, quantity)).await;
            }
            lines => {
                let cart = CartRequest {
                    user: user.clone(),
                    lines,
                    key: key.clone(),
                    locations: locations.clone(),
                };
                state.checkout.place_cart(cart).await?
            }
        },
        (None, Some(product), Some(quantity)) => {
            let req = single(ProductId::parse(product)?, Quantity::parse(quantity)?);
            return place_single(&state, req).await;
        }
        _ => {
            return Err(ApiError::invalid(
                "INVALID_ORDER",
                "an order names either product_id and quantity, or lines",
            ));
        }
    };
    Ok(created(placed))
}

/// A placed order's answer: 201 with the order (a replay too).
pub(super) fn created(placed: Placed) -> Response {
    let (Placed::Created(order) | Placed::Replayed(order)) = placed;
    (StatusCode::CREATED, Json(order)).into_response()
}

/// A single-product order: placed where its [`Placement`] says. At its product's owner, the
/// owner's answer is this answer, unless nothing reached the owner (or it went silent), in
/// which case it is placed here under the same key.
async fn place_single(state: &AppState, req: OrderRequest) -> Result<Response, ApiError> {
    if let Some(peers) = &state.peers
        && let Placement::Owner(owner) =
            peers.placement(req.product.as_str(), state.checkout.contended(&req.product))
        && let Some(answer) = peers.place(owner, &req).await
    {
        return Ok(answer);
    }
    Ok(created(state.checkout.place(req).await?))
}

/// Loads an order the caller may see; someone else's order is a 403 (the contract's
/// "a user acting for another user").
async fn load(state: &AppState, caller: &Caller, id: &str) -> Result<Order, ApiError> {
    let not_found = || ApiError::not_found("ORDER_NOT_FOUND", "no such order");
    let id = Uuid::parse_str(id).map_err(|_| not_found())?;
    let order = state.checkout.get(id).await?;
    if !caller.may_act_for(order.user_id.as_str()) {
        return Err(ApiError::Forbidden("this order belongs to another user"));
    }
    Ok(order)
}

/// An order (its user, or admin)
#[utoipa::path(
    get,
    path = "/v1/orders/{order_id}",
    tag = "orders",
    params(("order_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The order", body = OrderBody),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "The order belongs to another user", body = ErrorBody),
        (status = 404, description = "ORDER_NOT_FOUND (also for an id that is not a UUID)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    Ok(Json(load(&state, &caller, &id).await?))
}

/// Cancel an order (its user, or admin)
///
/// Its quantity returns to stock exactly once; cancelling again returns the cancelled order.
#[utoipa::path(
    post,
    path = "/v1/orders/{order_id}/cancel",
    tag = "orders",
    params(("order_id" = uuid::Uuid, Path)),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The order, `status: cancelled`", body = OrderBody),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, description = "The order belongs to another user", body = ErrorBody),
        (status = 404, description = "ORDER_NOT_FOUND (also for an id that is not a UUID)", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn cancel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    let order = load(&state, &caller, &id).await?;
    Ok(Json(state.checkout.cancel(&order).await?))
}
