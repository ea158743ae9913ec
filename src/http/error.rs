//! The one error type of the HTTP layer, mapped once to the contract's JSON error:
//! `{"error": {"code": "SCREAMING_SNAKE_CASE", "message": "human sentence"}}`.
//! 4xx carry a helpful message; 5xx carry none of the internals (those go to the log).

use super::responses::ErrorBody;
use crate::checkout::CheckoutError;
use crate::domain::Invalid;
use crate::routing::DbError;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: malformed JSON, wrong types, unknown query values, a missing header.
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    /// 401: missing or invalid token.
    #[error("a valid bearer token is required")]
    Unauthorized,
    /// 403: a user acting for another user, or a user on an admin route.
    #[error("{0}")]
    Forbidden(&'static str),
    /// 404: unknown product, order or route.
    #[error("{message}")]
    NotFound { code: &'static str, message: String },
    /// 405: a known route with the wrong method.
    #[error("method not allowed on this route")]
    MethodNotAllowed,
    /// 409: `OUT_OF_STOCK` (nothing written), `ALREADY_EXISTS`.
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// 409 `OUT_OF_STOCK` for a cart or hold, naming the short lines
    /// (`[{"product_id","requested","available"}]`); nothing was taken.
    #[error("not enough stock for every line; nothing was taken")]
    ShortLines(Vec<crate::checkout::Short>),
    /// 409 `LIMIT_EXCEEDED`: the request would take its user past the product's
    /// `max_per_customer`; says the limit and the units the user already has.
    #[error(
        "{product_id} is limited to {limit} per customer and you already have {already}; nothing was taken"
    )]
    LimitExceeded {
        product_id: String,
        limit: i32,
        already: i32,
    },
    /// 409 `STOCK_CHANGED`: an adjustment's `expected` is not the location's count, which
    /// the error states; nothing was written.
    #[error(
        "the location's count is {available_quantity}, not the expected one; nothing was written"
    )]
    StockChanged { available_quantity: i32 },
    /// 409 `SALE_NOT_STARTED` with `Retry-After` (seconds to the start); nothing was claimed.
    #[error("the sale has not started yet; send the same request again once it has")]
    SaleNotStarted { retry_after_s: u64 },
    /// 413: body over the limit.
    #[error("request body is larger than 64 KiB")]
    PayloadTooLarge,
    /// 422: valid JSON that breaks a rule.
    #[error("{}", .0.message)]
    Invalid(Invalid),
    /// 410 `CURSOR_EXPIRED`: an event cursor before events the retention purge removed.
    #[error("this cursor is older than the retained events; start again without `after`")]
    CursorExpired,
    /// 429 with `Retry-After`: a user over the (optional) per-user order rate.
    #[error("too many orders; slow down")]
    TooManyRequests,
    /// 503 with `Retry-After`: no safe place to answer from, or shedding load.
    #[error("{message}")]
    Unavailable { code: &'static str, message: String },
    /// 500: a bug. The cause is logged, never sent.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::NotFound {
            code,
            message: message.into(),
        }
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Conflict {
            code,
            message: message.into(),
        }
    }
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Unavailable {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Invalid(Invalid {
            code,
            message: message.into(),
        })
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict { .. }
            | ApiError::ShortLines(_)
            | ApiError::LimitExceeded { .. }
            | ApiError::StockChanged { .. }
            | ApiError::SaleNotStarted { .. } => StatusCode::CONFLICT,
            ApiError::CursorExpired => StatusCode::GONE,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest { code, .. }
            | ApiError::NotFound { code, .. }
            | ApiError::Conflict { code, .. }
            | ApiError::Unavailable { code, .. } => code,
            ApiError::Invalid(i) => i.code,
            ApiError::ShortLines(_) => "OUT_OF_STOCK",
            ApiError::CursorExpired => "CURSOR_EXPIRED",
            ApiError::LimitExceeded { .. } => "LIMIT_EXCEEDED",
            ApiError::StockChanged { .. } => "STOCK_CHANGED",
            ApiError::SaleNotStarted { .. } => "SALE_NOT_STARTED",
            ApiError::Unauthorized => "UNAUTHORIZED",
            ApiError::Forbidden(_) => "FORBIDDEN",
            ApiError::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            ApiError::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            ApiError::TooManyRequests => "RATE_LIMITED",
            ApiError::Internal(_) => "INTERNAL",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let ApiError::Internal(e) = &self {
            tracing::error!(error = ?e, "internal error");
        }
        let mut body = ErrorBody::new(self.code(), self.to_string());
        let mut retry_after = None;
        match self {
            ApiError::ShortLines(lines) => body.error.lines = Some(lines),
            ApiError::LimitExceeded {
                product_id,
                limit,
                already,
            } => {
                body.error.product_id = Some(product_id);
                body.error.limit = Some(limit);
                body.error.already = Some(already);
            }
            ApiError::StockChanged { available_quantity } => {
                body.error.available_quantity = Some(available_quantity);
            }
            ApiError::SaleNotStarted { retry_after_s } => retry_after = Some(retry_after_s),
            _ => {}
        }
        let mut response = (status, axum::Json(body)).into_response();
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<Invalid> for ApiError {
    fn from(i: Invalid) -> Self {
        ApiError::Invalid(i)
    }
}

/// Every database failure's answer, in one place.
impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        match e {
            DbError::Unavailable(why) => {
                tracing::warn!(%why, "database unavailable");
                ApiError::unavailable(
                    "DATABASE_UNAVAILABLE",
                    "the database is not answering; retry shortly",
                )
            }
            DbError::Busy(why) => {
                tracing::warn!(%why, "database busy");
                ApiError::unavailable("BUSY", "the database is busy; retry shortly")
            }
            DbError::Conflict(why) => {
                tracing::warn!(%why, "a concurrent change won");
                ApiError::unavailable("CONFLICT_RETRY", "a concurrent change won; retry")
            }
            DbError::NoFreshReplica(class) => ApiError::unavailable(
                "NO_FRESH_REPLICA",
                format!("no replica is fresh enough for {class}; retry shortly"),
            ),
            DbError::Internal(why) => ApiError::Internal(anyhow::anyhow!(why)),
            // numeric_value_out_of_range: a sum that would pass 2^31.
            e if e.sqlstate().as_deref() == Some("22003") => ApiError::invalid(
                "VALUE_OUT_OF_RANGE",
                "the resulting value would be out of range",
            ),
            DbError::Query(e) => ApiError::Internal(anyhow::Error::new(e)),
        }
    }
}

/// An error the database may have refused with a SQLSTATE.
pub trait Sqlstate {
    fn sqlstate(&self) -> Option<String>;
}

impl Sqlstate for DbError {
    fn sqlstate(&self) -> Option<String> {
        DbError::sqlstate(self)
    }
}

impl Sqlstate for CheckoutError {
    fn sqlstate(&self) -> Option<String> {
        match self {
            CheckoutError::Db(e) => e.sqlstate(),
            _ => None,
        }
    }
}

/// Answers one SQLSTATE in the handler's own words, every other failure as usual — in the
/// spirit of realworld-axum-sqlx's `on_constraint`.
pub trait OnSqlstate<T> {
    fn on_sqlstate(self, code: &str, answer: impl FnOnce() -> ApiError) -> Result<T, ApiError>;
}

impl<T, E: Sqlstate + Into<ApiError>> OnSqlstate<T> for Result<T, E> {
    fn on_sqlstate(self, code: &str, answer: impl FnOnce() -> ApiError) -> Result<T, ApiError> {
        self.map_err(|e| match e.sqlstate() {
            Some(c) if c == code => answer(),
            _ => e.into(),
        })
    }
}

/// Every checkout outcome that is not a success, in one place with the database failures.
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
            CheckoutError::Short(lines) => ApiError::ShortLines(lines),
            CheckoutError::LimitExceeded {
                product_id,
                limit,
                already,
            } => ApiError::LimitExceeded {
                product_id,
                limit,
                already,
            },
            CheckoutError::SaleNotStarted { retry_after_ms } => ApiError::SaleNotStarted {
                retry_after_s: crate::checkout::retry_after_secs(retry_after_ms),
            },
            CheckoutError::SaleEnded => ApiError::conflict(
                "SALE_ENDED",
                "the sale for this product has ended; nothing was taken",
            ),
            CheckoutError::HoldNotFound => ApiError::not_found("HOLD_NOT_FOUND", "no such hold"),
            CheckoutError::UnknownLocation(id) => {
                ApiError::invalid("UNKNOWN_LOCATION", format!("there is no location {id}"))
            }
            CheckoutError::StockChanged { available } => ApiError::StockChanged {
                available_quantity: available,
            },
            e @ (CheckoutError::HoldExpired
            | CheckoutError::HoldReleased
            | CheckoutError::HoldConfirmed) => hold_ended(&e),
            CheckoutError::RateLimited => ApiError::TooManyRequests,
            CheckoutError::OutcomeUnknown => ApiError::unavailable(
                "OUTCOME_UNKNOWN",
                "the outcome is unknown: the database did not confirm or deny the commit; retry with the same Idempotency-Key to learn it",
            ),
            CheckoutError::Refused(why) => {
                tracing::error!(%why, "the database refused an order's row");
                ApiError::unavailable(
                    "ORDER_NOT_WRITTEN",
                    "the database refused this order; nothing was written",
                )
            }
            CheckoutError::Db(e) => e.into(),
        }
    }
}

/// A hold that ended before this request: how it ended.
fn hold_ended(e: &CheckoutError) -> ApiError {
    match e {
        CheckoutError::HoldExpired => ApiError::conflict(
            "HOLD_EXPIRED",
            "the hold expired before it was confirmed; its units went back",
        ),
        CheckoutError::HoldReleased => ApiError::conflict(
            "HOLD_RELEASED",
            "the hold was released; its units went back",
        ),
        _ => ApiError::conflict(
            "HOLD_CONFIRMED",
            "the hold was confirmed and is an order now; cancel the order instead",
        ),
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        DbError::from(e).into()
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::PayloadTooLarge;
        }
        match r {
            JsonRejection::JsonDataError(e) => ApiError::bad_request("INVALID_BODY", e.body_text()),
            JsonRejection::JsonSyntaxError(e) => {
                ApiError::bad_request("MALFORMED_JSON", e.body_text())
            }
            JsonRejection::MissingJsonContentType(_) => ApiError::bad_request(
                "UNSUPPORTED_CONTENT_TYPE",
                "the body must be JSON with Content-Type: application/json",
            ),
            other => ApiError::bad_request("INVALID_BODY", other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        ApiError::bad_request("INVALID_QUERY", r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        ApiError::bad_request("INVALID_PATH", r.body_text())
    }
}
