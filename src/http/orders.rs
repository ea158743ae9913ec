//! Orders: place (idempotent), look up, cancel.

use super::{ApiError, AppState, Json, Path};
use crate::auth::Caller;
use crate::checkout::{CheckoutError, Order, OrderRequest, Placed};
use crate::domain::{IdempotencyKey, ProductId, Quantity, UserId};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::Number;
use uuid::Uuid;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/orders", post(place))
        .route("/v1/orders/{order_id}", get(show))
        .route("/v1/orders/{order_id}/cancel", post(cancel))
}

impl From<CheckoutError> for ApiError {
    fn from(e: CheckoutError) -> Self {
        match e {
            CheckoutError::OutOfStock => ApiError::conflict(
                "OUT_OF_STOCK",
                "not enough stock for this order; nothing was written",
            ),
            CheckoutError::ProductNotFound => {
                ApiError::not_found("PRODUCT_NOT_FOUND", "no such product")
            }
            CheckoutError::OrderNotFound => ApiError::not_found("ORDER_NOT_FOUND", "no such order"),
            CheckoutError::KeyReused => ApiError::invalid(
                "IDEMPOTENCY_KEY_REUSED",
                "this Idempotency-Key was already used with a different body; use a new key for a new order",
            ),
            CheckoutError::Db(e) => e.into(),
        }
    }
}

#[derive(Deserialize)]
struct NewOrder {
    product_id: String,
    quantity: Number,
    /// Admin tokens name the user they order for; user tokens may omit it.
    user_id: Option<String>,
}

async fn place(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(body): Json<NewOrder>,
) -> Result<Response, ApiError> {
    let key = match headers.get("idempotency-key") {
        None => {
            return Err(ApiError::bad_request(
                "IDEMPOTENCY_KEY_MISSING",
                "the Idempotency-Key header is required",
            ));
        }
        Some(v) => IdempotencyKey::parse(v.to_str().map_err(|_| {
            ApiError::invalid(
                "INVALID_IDEMPOTENCY_KEY",
                "Idempotency-Key must be printable ASCII",
            )
        })?)?,
    };
    let product = ProductId::parse(&body.product_id)?;
    let quantity = Quantity::parse(&body.quantity)?;
    let user = match (&caller, body.user_id.as_deref()) {
        (Caller::User(me), None) => me.clone(),
        (_, Some(named)) => {
            let named = UserId::parse(named)?;
            if !caller.may_act_for(&named) {
                return Err(ApiError::Forbidden(
                    "a user may place orders only for themselves",
                ));
            }
            named
        }
        (Caller::Admin, None) => {
            return Err(ApiError::invalid(
                "USER_ID_REQUIRED",
                "an admin placing an order must name user_id",
            ));
        }
    };
    let placed = state
        .checkout
        .place(OrderRequest {
            user,
            product,
            quantity,
            key,
        })
        .await?;
    let (status, order) = match placed {
        Placed::Created(o) => (StatusCode::CREATED, o),
        Placed::Replayed(o) => (StatusCode::CREATED, o),
    };
    Ok((status, Json(order)).into_response())
}

/// Loads an order the caller may see; someone else's order is a 403 (the contract's
/// "a user acting for another user").
async fn load(state: &AppState, caller: &Caller, id: &str) -> Result<Order, ApiError> {
    let not_found = || ApiError::not_found("ORDER_NOT_FOUND", "no such order");
    let id = Uuid::parse_str(id).map_err(|_| not_found())?;
    let order = state.checkout.get(id).await?;
    match caller {
        Caller::Admin => Ok(order),
        Caller::User(me) if me.as_str() == order.user_id => Ok(order),
        Caller::User(_) => Err(ApiError::Forbidden("this order belongs to another user")),
    }
}

async fn show(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    Ok(Json(load(&state, &caller, &id).await?))
}

async fn cancel(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    let order = load(&state, &caller, &id).await?;
    Ok(Json(state.checkout.cancel(&order).await?))
}
