//! The pieces of the OpenAPI document that every route module shares: the one error body
//! (which `ApiError` writes) and the reusable error responses. A leaf: route modules use it,
//! and `openapi` lists its responses in the document's components, so nothing runs back up.

use serde::Serialize;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder, Type};
use utoipa::{ToResponse, ToSchema};

/// The one error body: `{"error": {"code": "SCREAMING_SNAKE_CASE", "message": "…"}}`.
#[derive(Serialize, ToSchema)]
pub(crate) struct ErrorBody {
    pub(crate) error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub(crate) struct ErrorDetail {
    /// A stable machine-readable code, e.g. `OUT_OF_STOCK`.
    #[schema(pattern = "^[A-Z][A-Z0-9_]*$", example = "OUT_OF_STOCK")]
    pub(crate) code: &'static str,
    /// A human sentence.
    pub(crate) message: String,
    /// With 409 `OUT_OF_STOCK` for a cart or hold: the short lines
    /// (`{"product_id", "requested", "available"}`); nothing was taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lines: Option<Vec<crate::checkout::Short>>,
    /// With 409 `LIMIT_EXCEEDED`: the limited product, its `max_per_customer`, and the units
    /// the user already had of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) product_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) limit: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) already: Option<i32>,
    /// With 409 `STOCK_CHANGED`: the location's count, which was not the adjustment's
    /// `expected`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) available_quantity: Option<i32>,
    /// With 422 `INVALID_CSV`: the first 100 bad lines of the file; nothing was written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) bad_lines: Option<Vec<crate::import::BadLine>>,
}

impl ErrorBody {
    pub(crate) fn new(code: &'static str, message: String) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message,
                lines: None,
                product_id: None,
                limit: None,
                already: None,
                available_quantity: None,
                bad_lines: None,
            },
        }
    }
}

/// The response components below, for the document's `components(responses(…))`.
macro_rules! error_responses {
    ($( $(#[doc = $doc:literal])+ $name:ident $(, header $header:literal = $about:literal)?; )+) => {$(
        $(#[doc = $doc])+
        pub(crate) struct $name;

        impl<'r> ToResponse<'r> for $name {
            fn response() -> (&'r str, RefOr<Response>) {
                let description = [$($doc.trim()),+].join("\n");
                let json = ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build();
                let response = ResponseBuilder::new()
                    .description(description)
                    $(.header($header, HeaderBuilder::new()
                        .schema(utoipa::openapi::ObjectBuilder::new().schema_type(Type::String))
                        .description(Some($about))
                        .build()))?
                    .content("application/json", json)
                    .build();
                (stringify!($name), RefOr::T(response))
            }
        }
    )+};
}

error_responses! {
    /// Malformed: bad JSON or types, an unknown query parameter or value, a missing header.
    BadRequest;
    /// No bearer token, or an invalid or expired one.
    Unauthorized, header "WWW-Authenticate" = "`Bearer`";
    /// A user token acting for another user, or on an admin route.
    Forbidden;
    /// The body is over the limit (64 KiB).
    PayloadTooLarge;
    /// Valid JSON that breaks a rule (a bad id, a quantity out of range, …).
    Unprocessable;
    /// No safe place to answer from (the primary is unreachable, no replica is fresh enough for
    /// a class that refuses), the database is busy, or the service is shedding load or timed out.
    Unavailable, header "Retry-After" = "Seconds to wait before retrying";
}
