//! The pieces of the OpenAPI document that every route module shares: the one error body,
//! the freshness fields of a routed read, and the reusable error responses. A leaf: route
//! modules use it, and `openapi` merges their operations with it, so nothing runs back up.

use serde::Serialize;
use utoipa::{ToResponse, ToSchema};

/// The one error body: `{"error": {"code": "SCREAMING_SNAKE_CASE", "message": "…"}}`.
/// (Documentation only: `ApiError` writes it; a test checks the two agree.)
#[allow(dead_code)]
#[derive(Serialize, ToSchema)]
pub(crate) struct ErrorBody {
    pub(crate) error: ErrorDetail,
}

#[allow(dead_code)]
#[derive(Serialize, ToSchema)]
pub(crate) struct ErrorDetail {
    /// A stable machine-readable code, e.g. `OUT_OF_STOCK`.
    #[schema(pattern = "^[A-Z][A-Z0-9_]*$", example = "OUT_OF_STOCK")]
    pub(crate) code: String,
    /// A human sentence.
    pub(crate) message: String,
}

/// A routed read's answer: the body's own fields plus the moment the answer describes
/// (documentation only: mirrors `super::Stated`, which a test checks).
#[allow(dead_code)]
#[derive(Serialize, ToSchema)]
pub(crate) struct Stated<T> {
    #[serde(flatten)]
    pub(crate) body: T,
    /// Every commit acknowledged before this moment is included (RFC 3339, UTC).
    #[schema(format = DateTime, example = "2026-11-29T17:00:03.123Z")]
    pub(crate) as_of: String,
    /// `now - as_of` when the answer was produced (0 or near it on the primary).
    pub(crate) stale_by_ms: u64,
    /// `primary` or the replica's name (`replica-1`, …).
    #[schema(example = "replica-1")]
    pub(crate) served_by: String,
}

/// Malformed: bad JSON or types, an unknown query parameter or value, a missing header.
#[allow(dead_code)]
#[derive(ToResponse)]
pub(crate) struct BadRequest(ErrorBody);

/// No bearer token, or an invalid or expired one.
#[allow(dead_code)]
#[derive(ToResponse)]
#[response(headers(("WWW-Authenticate" = String, description = "`Bearer`")))]
pub(crate) struct Unauthorized(ErrorBody);

/// A user token acting for another user, or on an admin route.
#[allow(dead_code)]
#[derive(ToResponse)]
pub(crate) struct Forbidden(ErrorBody);

/// The body is over the limit (64 KiB).
#[allow(dead_code)]
#[derive(ToResponse)]
pub(crate) struct PayloadTooLarge(ErrorBody);

/// Valid JSON that breaks a rule (a bad id, a quantity out of range, …).
#[allow(dead_code)]
#[derive(ToResponse)]
pub(crate) struct Unprocessable(ErrorBody);

/// No safe place to answer from (the primary is unreachable, no replica is fresh enough for
/// a class that refuses), the database is busy, or the service is shedding load or timed out.
#[allow(dead_code)]
#[derive(ToResponse)]
#[response(headers(("Retry-After" = String, description = "Seconds to wait before retrying")))]
pub(crate) struct Unavailable(ErrorBody);
