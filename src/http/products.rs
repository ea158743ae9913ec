//! Products: create and restock (admin, primary), the product page and availability
//! (routed reads).

use super::{Admin, ApiError, AppState, Json, Path, Query, stated};
use crate::domain::{PriceCents, ProductId, ProductName, Quantity, Stock};
use crate::routing::policy::QueryClass;
use crate::routing::{ReadCtx, Reason, Route};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::Number;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/products", post(create))
        .route("/v1/products/{product_id}", get(show))
        .route("/v1/products/{product_id}/restock", post(restock))
        .route("/v1/products/{product_id}/availability", get(availability))
}

#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Product {
    pub product_id: String,
    pub name: String,
    pub price_cents: i32,
    pub available_quantity: i32,
}

#[derive(Deserialize)]
struct NewProduct {
    product_id: String,
    name: String,
    price_cents: Number,
    available_quantity: Number,
}

async fn create(
    State(state): State<AppState>,
    _: Admin,
    Json(body): Json<NewProduct>,
) -> Result<Response, ApiError> {
    let id = ProductId::parse(&body.product_id)?;
    let name = ProductName::parse(&body.name)?;
    let price = PriceCents::parse(&body.price_cents)?;
    let stock = Stock::parse(&body.available_quantity)?;
    let mut tx = state.db.primary().begin().await?;
    let created: Option<Product> = sqlx::query_as(
        "INSERT INTO products (product_id, name, price_cents, available_quantity) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (product_id) DO NOTHING RETURNING product_id, name, price_cents, available_quantity",
    )
    .bind(id.as_str())
    .bind(name.as_str())
    .bind(price.get())
    .bind(stock.get())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(product) = created else {
        return Err(ApiError::conflict(
            "ALREADY_EXISTS",
            format!("product {id} already exists"),
        ));
    };
    tx.commit().await?;
    let route = Route::primary(QueryClass::Primary, Reason::PrimaryOnly, state.db.now_utc());
    Ok(stated(StatusCode::CREATED, product, &route))
}

async fn show(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let id = ProductId::parse(&id)?;
    let read = state
        .db
        .read_existing(QueryClass::ProductPage, &ReadCtx::none(), |pool| {
            let id = id.clone();
            async move {
                sqlx::query_as::<_, Product>("SELECT product_id, name, price_cents, available_quantity FROM products WHERE product_id = $1")
                    .bind(id.as_str())
                    .fetch_optional(pool.exec())
                    .await
            }
        })
        .await?;
    let product = read
        .value
        .ok_or_else(|| ApiError::not_found("PRODUCT_NOT_FOUND", format!("no product {id}")))?;
    Ok(stated(StatusCode::OK, product, &read.route))
}

#[derive(Deserialize)]
struct Restock {
    quantity: Number,
}

async fn restock(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    Json(body): Json<Restock>,
) -> Result<Response, ApiError> {
    let id = ProductId::parse(&id)?;
    let add = match body.quantity.as_i64() {
        Some(q) if (1..=i32::MAX as i64).contains(&q) => q as i32,
        _ => {
            return Err(ApiError::invalid(
                "INVALID_QUANTITY",
                "quantity must be a whole number from 1 to 2147483647",
            ));
        }
    };
    let mut tx = state.db.primary().begin().await?;
    let product: Option<Product> = sqlx::query_as(
        "UPDATE products SET available_quantity = available_quantity + $2, updated_at = clock_timestamp() \
         WHERE product_id = $1 RETURNING product_id, name, price_cents, available_quantity",
    )
    .bind(id.as_str())
    .bind(add)
    .fetch_optional(&mut *tx)
    .await
    .map_err(|e| match ApiError::from(e) {
        ApiError::Invalid(_) => ApiError::invalid("STOCK_LIMIT", "stock would exceed 2147483647"),
        other => other,
    })?;
    let product = product
        .ok_or_else(|| ApiError::not_found("PRODUCT_NOT_FOUND", format!("no product {id}")))?;
    tx.commit().await?;
    state.checkout.reopened(&id).await?;
    let route = Route::primary(QueryClass::Primary, Reason::PrimaryOnly, state.db.now_utc());
    Ok(stated(StatusCode::OK, product, &route))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AvailabilityQuery {
    qty: Option<String>,
}

#[derive(Serialize)]
struct Availability {
    product_id: String,
    qty: i32,
    available: bool,
    available_quantity: i32,
}

async fn availability(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<AvailabilityQuery>,
) -> Result<Response, ApiError> {
    let id = ProductId::parse(&id)?;
    let qty = match q.qty.as_deref() {
        None => Quantity::from_i64(1)?,
        Some(raw) => {
            let n: i64 = raw.trim().parse().map_err(|_| {
                ApiError::bad_request("INVALID_QUERY", "qty must be a whole number")
            })?;
            Quantity::from_i64(n)?
        }
    };
    let (available_quantity, route) = state.checkout.available(&id).await?;
    let available_quantity = available_quantity
        .ok_or_else(|| ApiError::not_found("PRODUCT_NOT_FOUND", format!("no product {id}")))?;
    let body = Availability {
        product_id: id.to_string(),
        qty: qty.get(),
        available: available_quantity >= qty.get(),
        available_quantity,
    };
    Ok(stated(StatusCode::OK, body, &route))
}
