//! The peer listener (`STOCKGATE_PEERS`): where other instances send the orders of products
//! this instance owns ([`super`]). Not part of the public API: it listens on its own
//! address and takes admin tokens only (peers sign them with the shared secret).

use super::{ALIVE_PATH, MAX_FORWARD, PATH, WireAnswer, WireOrder};
use crate::auth::Caller;
use crate::checkout::OrderRequest;
use crate::domain::{IdempotencyKey, Locations, ProductId, Quantity, UserId};
use crate::http::{ApiError, AppState, Json, Limits};
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The largest forwarded request: [`MAX_FORWARD`] orders of the longest ids and keys, every
/// character of a key escaped, is under 1 MiB.
const BODY_LIMIT: usize = 4 << 20;

/// The peer listener's routes, behind the public port's layers (panics caught, metrics,
/// load shedding, the request timeout) with `limits`, but for a body limit sized for a
/// forwarded batch.
pub fn router(state: AppState, limits: Limits) -> Router {
    let routes = Router::new()
        .route(PATH, axum::routing::post(place))
        .route(ALIVE_PATH, axum::routing::get(alive))
        .fallback(crate::http::not_found)
        .method_not_allowed_fallback(crate::http::method_not_allowed);
    let metrics = state.metrics.clone();
    crate::http::served(
        routes,
        state,
        &metrics,
        Limits {
            body: BODY_LIMIT,
            ..limits
        },
    )
}

/// A sign of life for a peer that has waited long for an answer (the client, [`super::Peers`]): no token, no
/// database, nothing to learn from it but that this process runs.
async fn alive() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// Places every order as if its client had sent it here, all at once (they join this
/// instance's batches), and answers each as `POST /v1/orders` would have.
async fn place(
    State(state): State<AppState>,
    caller: Caller,
    Json(orders): Json<Vec<WireOrder>>,
) -> Result<Json<Vec<WireAnswer>>, ApiError> {
    if !caller.is_admin() {
        return Err(ApiError::Forbidden("peers sign admin tokens"));
    }
    if orders.len() > MAX_FORWARD {
        return Err(ApiError::invalid(
            "TOO_MANY_ORDERS",
            format!("a peer forwards at most {MAX_FORWARD} orders at once"),
        ));
    }
    let answers = futures::future::join_all(orders.into_iter().map(|o| {
        let state = state.clone();
        async move { answer(place_one(&state, o).await).await }
    }))
    .await;
    Ok(Json(answers))
}

async fn place_one(state: &AppState, o: WireOrder) -> Response {
    let req = (|| {
        Ok::<_, ApiError>(OrderRequest {
            user: UserId::parse(&o.user)?,
            product: ProductId::parse(&o.product)?,
            quantity: Quantity::parse(&o.quantity.into())?,
            key: IdempotencyKey::parse(&o.key)?,
            locations: Locations::parse((!o.locations.is_empty()).then_some(&o.locations[..]))?,
        })
    })();
    match req {
        Ok(req) => match state.checkout.place(req).await {
            Ok(placed) => crate::http::orders::created(placed),
            Err(e) => ApiError::from(e).into_response(),
        },
        Err(e) => e.into_response(),
    }
}

async fn answer(response: Response) -> WireAnswer {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    // Every answer of this service is JSON; a body that could not be read says null.
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .ok()
        .and_then(|b| String::from_utf8(b.to_vec()).ok())
        .and_then(|s| serde_json::value::RawValue::from_string(s).ok())
        .unwrap_or_else(|| {
            serde_json::value::RawValue::from_string("null".into()).expect("null is JSON")
        });
    WireAnswer {
        status,
        retry_after,
        body,
    }
}
