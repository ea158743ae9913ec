//! Products: create and restock (admin, primary), the product page and availability
//! (routed reads).

use super::error::OnSqlstate;
use super::locations::{by_location, levels_of, parse_stock};
use super::product_body::{
    NewProduct, NewProductBody, RulesPatch, check_window, parse_limit, parse_time, window_error,
};
use super::responses::{
    BadRequest, ErrorBody, Forbidden, PayloadTooLarge, Unauthorized, Unavailable, Unprocessable,
};
use super::{Admin, ApiError, AppState, Json, Path, Query, Stated, stated, with_route_headers};
use crate::checkout::Level;
use crate::checkout::{CheckoutError, Stocked, stock};
use crate::checkout::{Rules, rule_columns};
use crate::domain::{LocationId, PriceCents, ProductId, ProductName, Quantity, Stock};
use crate::routing::policy::QueryClass;
use crate::routing::{ReadCtx, Route};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Number;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(create))
        .routes(routes!(show, patch))
        .routes(routes!(restock))
        .routes(routes!(availability))
}

#[derive(Debug, Serialize, sqlx::FromRow, ToSchema)]
pub struct Product {
    #[schema(example = "flash-60")]
    pub product_id: String,
    pub name: String,
    #[schema(minimum = 0)]
    pub price_cents: i32,
    #[schema(minimum = 0)]
    pub available_quantity: i32,
    #[serde(flatten)]
    #[sqlx(flatten)]
    pub rules: Rules,
    /// On the product page: its count at every location that ever held it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[sqlx(skip)]
    pub stock: Option<Vec<Level>>,
}

impl From<Stocked> for Product {
    fn from(s: Stocked) -> Self {
        Product {
            product_id: s.product_id,
            name: s.name,
            price_cents: s.price_cents,
            available_quantity: s.available_quantity,
            rules: s.rules,
            stock: None,
        }
    }
}

/// The columns of a [`Product`].
macro_rules! product_columns {
    () => {
        concat!(
            "product_id, name, price_cents, available_quantity, ",
            rule_columns!()
        )
    };
}

/// Create a product (admin)
#[utoipa::path(
    post,
    path = "/v1/products",
    tag = "products",
    request_body = NewProductBody,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Created, on the primary", body = Stated<Product>),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 409, description = "ALREADY_EXISTS", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, response = Unprocessable),
        (status = 503, response = Unavailable),
    )
)]

async fn create(
    State(state): State<AppState>,
    _: Admin,
    Json(body): Json<NewProduct>,
) -> Result<Response, ApiError> {
    let id = ProductId::parse(&body.product_id)?;
    let name = ProductName::parse(&body.name)?;
    let price = PriceCents::parse(&body.price_cents)?;
    let stock = match (&body.available_quantity, &body.stock) {
        (Some(n), None) => vec![(LocationId::parse("default")?, Stock::parse(n)?.get())],
        (None, Some(at)) => parse_stock(at)?,
        _ => {
            return Err(ApiError::invalid(
                "INVALID_STOCK",
                "a product names either available_quantity or stock",
            ));
        }
    };
    let ids: Vec<LocationId> = stock.iter().map(|(l, _)| l.clone()).collect();
    state.checkout.known_locations(&ids).await?;
    let rules = Rules {
        max_per_customer: body
            .max_per_customer
            .as_ref()
            .map(parse_limit)
            .transpose()?,
        sale_starts_at: body
            .sale_starts_at
            .as_deref()
            .map(|t| parse_time("sale_starts_at", t))
            .transpose()?,
        sale_ends_at: body
            .sale_ends_at
            .as_deref()
            .map(|t| parse_time("sale_ends_at", t))
            .transpose()?,
    };
    check_window(&rules)?;
    let mut tx = state.db.primary().begin().await?;
    let created = stock::create(&mut tx, &id, name.as_str(), price.get(), &stock, &rules).await?;
    let Some(product) = created.map(Product::from) else {
        return Err(ApiError::conflict(
            "ALREADY_EXISTS",
            format!("product {id} already exists"),
        ));
    };
    tx.commit().await?;
    let route = state.db.written_route();
    Ok(stated(StatusCode::CREATED, product, &route))
}

/// The product page (routed read, 5 s budget)
#[utoipa::path(
    get,
    path = "/v1/products/{product_id}",
    tag = "products",
    params(("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    responses(
        (status = 200, description = "The product, and the moment it describes", body = Stated<Product>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 400, response = BadRequest),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 422, description = "INVALID_PRODUCT_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn show(State(state): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let id = ProductId::parse(&id)?;
    let read = state
        .db
        .read_existing(QueryClass::ProductPage, &ReadCtx::none(), |pool| {
            let id = id.clone();
            async move {
                // One statement, so the count and its levels are of one snapshot.
                #[derive(sqlx::FromRow)]
                struct Page {
                    #[sqlx(flatten)]
                    product: Product,
                    stock: sqlx::types::Json<Vec<Level>>,
                }
                let page = sqlx::query_as::<_, Page>(concat!(
                    "SELECT ",
                    product_columns!(),
                    ", ",
                    levels_of!(),
                    " AS stock FROM products WHERE product_id = $1"
                ))
                .bind(id.as_str())
                .fetch_optional(pool.exec())
                .await?;
                Ok(page.map(|p| Product {
                    stock: Some(p.stock.0),
                    ..p.product
                }))
            }
        })
        .await?;
    let product = read
        .value
        .ok_or_else(|| ApiError::not_found("PRODUCT_NOT_FOUND", format!("no product {id}")))?;
    Ok(stated(StatusCode::OK, product, &read.route))
}

/// Set a product's drop rules (admin)
///
/// Takes the product's row lock, so the change falls between order batches, never inside one.
#[utoipa::path(
    patch,
    path = "/v1/products/{product_id}",
    tag = "products",
    params(("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$")),
    request_body = RulesPatch,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The product after the change, on the primary", body = Stated<Product>),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_LIMIT, INVALID_DATE, INVALID_SALE_WINDOW (the end would not come after the start), INVALID_PRODUCT_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn patch(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    Json(body): Json<RulesPatch>,
) -> Result<Response, ApiError> {
    let id = ProductId::parse(&id)?;
    let limit = body
        .max_per_customer
        .map(|l| l.as_ref().map(parse_limit).transpose())
        .transpose()?;
    let starts = body
        .sale_starts_at
        .map(|t| {
            t.as_deref()
                .map(|t| parse_time("sale_starts_at", t))
                .transpose()
        })
        .transpose()?;
    let ends = body
        .sale_ends_at
        .map(|t| {
            t.as_deref()
                .map(|t| parse_time("sale_ends_at", t))
                .transpose()
        })
        .transpose()?;
    // Each rule: (whether to set it, its new value); the window is checked against what the
    // row holds, by the table's CHECK.
    let updated: Result<Option<Product>, sqlx::Error> = sqlx::query_as(concat!(
        "UPDATE products SET \
           max_per_customer = CASE WHEN $2 THEN $3 ELSE max_per_customer END, \
           sale_starts_at = CASE WHEN $4 THEN $5 ELSE sale_starts_at END, \
           sale_ends_at = CASE WHEN $6 THEN $7 ELSE sale_ends_at END, \
           updated_at = clock_timestamp() \
         WHERE product_id = $1 RETURNING ",
        product_columns!()
    ))
    .bind(id.as_str())
    .bind(limit.is_some())
    .bind(limit.flatten())
    .bind(starts.is_some())
    .bind(starts.flatten())
    .bind(ends.is_some())
    .bind(ends.flatten())
    .fetch_optional(state.db.primary().pool()?)
    .await;
    let product = match updated {
        Ok(Some(product)) => product,
        Ok(None) => {
            return Err(ApiError::not_found(
                "PRODUCT_NOT_FOUND",
                format!("no product {id}"),
            ));
        }
        Err(sqlx::Error::Database(e))
            if e.constraint() == Some("products_sale_ends_after_it_starts") =>
        {
            return Err(window_error());
        }
        Err(e) => return Err(e.into()),
    };
    // This instance's gate states the new window at once.
    state.checkout.reopened(std::slice::from_ref(&id)).await;
    let route = state.db.written_route();
    Ok(stated(StatusCode::OK, product, &route))
}

#[derive(Deserialize, ToSchema)]
struct Restock {
    /// Units to add.
    #[schema(value_type = i64, minimum = 1, maximum = 2147483647, example = 40)]
    quantity: Number,
    /// Where the units go (default `default`).
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "eu-1")]
    location_id: Option<String>,
}

/// Add stock (admin)
#[utoipa::path(
    post,
    path = "/v1/products/{product_id}/restock",
    tag = "products",
    params(
        ("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"),
        ("Idempotency-Key" = Option<String>, Header, description = "Optional. The same key with the same body answers what the first restock did and adds once; with another body: 422 IDEMPOTENCY_KEY_REUSED",
            min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body = Restock,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The product after the restock, on the primary", body = Stated<Product>),
        (status = 400, response = BadRequest),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 413, response = PayloadTooLarge),
        (status = 422, description = "INVALID_QUANTITY, STOCK_LIMIT (stock would pass 2^31 - 1), INVALID_PRODUCT_ID, INVALID_IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_REUSED", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

async fn restock(
    State(state): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    headers: HeaderMap,
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
    let key = super::idempotency_key(&headers)?;
    let location = LocationId::parse(body.location_id.as_deref().unwrap_or("default"))?;
    let done = match state
        .checkout
        .restock(&id, &location, add, key.as_ref())
        .await
    {
        Err(CheckoutError::ProductNotFound) => {
            return Err(ApiError::not_found(
                "PRODUCT_NOT_FOUND",
                format!("no product {id}"),
            ));
        }
        // numeric_value_out_of_range: the sum would pass 2^31 - 1.
        done => done.on_sqlstate("22003", || {
            ApiError::invalid("STOCK_LIMIT", "stock would exceed 2147483647")
        })?,
    };
    let route = state.db.written_route();
    Ok(stated(StatusCode::OK, Product::from(done), &route))
}

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct AvailabilityQuery {
    /// Units wanted (default 1).
    #[param(value_type = Option<i64>, minimum = 1, maximum = 10000)]
    qty: Option<String>,
    /// Only these locations (comma-separated, 1–50, each once); the answer then states
    /// `by_location`. Absent: every active location (from the stock gate, as before).
    #[param(value_type = Option<String>, example = "eu-2,eu-1")]
    locations: Option<String>,
}

#[derive(Serialize, ToSchema)]
struct Availability {
    #[schema(value_type = String)]
    product_id: ProductId,
    #[schema(minimum = 1, maximum = 10000)]
    qty: i32,
    /// `available_quantity >= qty`.
    available: bool,
    #[schema(minimum = 0)]
    available_quantity: i32,
    /// False before the product's `sale_starts_at` and from its `sale_ends_at`.
    on_sale: bool,
}

impl Availability {
    /// `Stated<Availability>` as JSON, written directly: the bytes `serde_json` makes of it
    /// (a test holds the two equal) for a fraction of the instructions: serde's flattened
    /// map and axum's growing buffer were a visible share of an answer served from memory
    /// (`bench/results/README.md`).
    fn stated_json(&self, route: &Route) -> Vec<u8> {
        let mut out = Vec::with_capacity(224);
        // A ProductId is `[A-Za-z0-9_.-]{1,64}` and an RFC 3339 time is digits and `-:.TZ`:
        // neither needs escaping. `served_by` comes from the configuration: escaped.
        out.extend_from_slice(b"{\"product_id\":\"");
        out.extend_from_slice(self.product_id.as_str().as_bytes());
        out.extend_from_slice(b"\",\"qty\":");
        push_int(&mut out, self.qty);
        out.extend_from_slice(if self.available {
            b",\"available\":true,\"available_quantity\":"
        } else {
            b",\"available\":false,\"available_quantity\":"
        });
        push_int(&mut out, self.available_quantity);
        out.extend_from_slice(if self.on_sale {
            b",\"on_sale\":true,\"as_of\":\""
        } else {
            b",\"on_sale\":false,\"as_of\":\""
        });
        out.extend_from_slice(route.as_of_rfc3339().as_bytes());
        out.extend_from_slice(b"\",\"stale_by_ms\":");
        push_int(&mut out, route.stale_by_ms());
        out.extend_from_slice(b",\"served_by\":");
        let _ = serde_json::to_writer(&mut out, route.served_by());
        out.push(b'}');
        out
    }
}

/// Appends `n` in decimal, by `itoa` (without `core::fmt`, which showed in the profile).
fn push_int(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// Availability: the stock gate (public; routed read, 250 ms budget)
#[utoipa::path(
    get,
    path = "/v1/products/{product_id}/availability",
    tag = "products",
    params(("product_id" = String, Path, pattern = "^[A-Za-z0-9_.-]{1,64}$"), AvailabilityQuery),
    responses(
        (status = 200, description = "Whether `qty` units are available, and as of when", body = Stated<Availability>,
            headers(
                ("X-Served-By" = String, description = "`primary` or the replica's name"),
                ("X-Stale-By-Ms" = u64, description = "`stale_by_ms`"),
                ("X-Route-Reason" = String, description = "Why the read went where it went"),
            )),
        (status = 400, description = "INVALID_QUERY: `qty` is not a whole number, or an unknown parameter", body = ErrorBody),
        (status = 404, description = "PRODUCT_NOT_FOUND", body = ErrorBody),
        (status = 422, description = "INVALID_QUANTITY (qty out of 1..=10000), INVALID_PRODUCT_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]

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
    if let Some(raw) = q.locations.as_deref() {
        let names: Vec<String> = raw.split(',').map(str::to_string).collect();
        let at = crate::domain::Locations::parse(Some(&names))?;
        state.checkout.known_locations(at.get()).await?;
        return by_location(&state, id, qty, at).await;
    }
    let gate = state.checkout.available(&id).await?;
    let route = gate.route;
    let available_quantity = gate
        .available
        .ok_or_else(|| ApiError::not_found("PRODUCT_NOT_FOUND", format!("no product {id}")))?;
    let body = Availability {
        product_id: id,
        qty: qty.get(),
        available: available_quantity >= qty.get(),
        available_quantity,
        on_sale: gate.window.on_sale(state.db.primary_now()),
    };
    let json = [(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    Ok(with_route_headers(
        (json, body.stated_json(&route)).into_response(),
        &route,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_availability_answer_is_the_bytes_serde_makes_of_its_stated_type() {
        for (served_by, stale_ms, qty, stock) in [
            ("primary", 0, 1, 0),
            ("replica-1", 249, 10000, i32::MAX),
            ("odd \"name\" \\ é", 17, 3, 2),
            ("replica-2", 1_000_000_000_000, 10, -5),
        ] {
            let route = Route::example(
                QueryClass::StockGate,
                served_by,
                chrono::Utc::now(),
                Duration::from_micros(stale_ms * 1000 + 1),
            );
            let body = Availability {
                product_id: ProductId::parse("flash-60.a_B").expect("valid"),
                qty,
                available: stock >= qty,
                available_quantity: stock,
                on_sale: qty % 2 == 0,
            };
            let fast = body.stated_json(&route);
            let serde = serde_json::to_vec(&super::super::Stated {
                body,
                as_of: route.as_of_rfc3339(),
                stale_by_ms: route.stale_by_ms(),
                served_by: route.served_by().to_owned(),
            })
            .expect("serializes");
            assert_eq!(String::from_utf8(fast), String::from_utf8(serde));
        }
    }
}
