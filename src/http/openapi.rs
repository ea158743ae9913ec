//! The OpenAPI 3.1 document of the whole API, served at `GET /openapi.json`.
//!
//! It comes from the routers: each route module registers its handlers with `routes!()`
//! (`utoipa-axum`), which adds the handler's `#[utoipa::path(...)]` operation to the
//! document as it adds the route to the router, so a route cannot be served undocumented or
//! documented unserved. This file holds the base the routers' operations are merged into:
//! the info, the tags, the reusable error responses and the `bearer` security scheme.

use super::AppState;
use super::responses::*;
use std::sync::OnceLock;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default().routes(routes!(openapi_json))
}

/// The base document: everything but the operations, which the routers add.
pub(super) fn base() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The whole document: the base plus every router's operations.
pub fn document() -> utoipa::openapi::OpenApi {
    super::routes().into_openapi()
}

/// This document
///
/// The OpenAPI 3.1 description of every route, generated from the code.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "meta",
    responses(
        (status = 200, description = "The OpenAPI document", body = Object),
        (status = 503, response = Unavailable),
    )
)]
async fn openapi_json() -> axum::response::Response {
    use axum::response::IntoResponse;
    // Built once: the document is a function of the code alone.
    static JSON: OnceLock<Vec<u8>> = OnceLock::new();
    let json = JSON.get_or_init(|| serde_json::to_vec(&document()).unwrap_or_default());
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json.as_slice(),
    )
        .into_response()
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "stockgate",
        description = "Inventory and checkout that never oversells and never lets a lagging \
                       read replica decide anything that matters. Errors are always \
                       `{\"error\": {\"code\", \"message\"}}`. Any request may get 503 with \
                       `Retry-After` when the service sheds load or times out. A 500 \
                       (`INTERNAL`, no details) would be a bug: no input should reach one."
    ),
    components(
        schemas(ErrorBody, ErrorDetail),
        responses(BadRequest, Unauthorized, Forbidden, PayloadTooLarge, Unprocessable, Unavailable)
    ),
    modifiers(&BearerAuth),
    tags(
        (name = "products", description = "Products, stock and the stock gate"),
        (name = "orders", description = "Idempotent orders and cancellation"),
        (name = "holds", description = "Units held while a buyer pays, then confirmed or released"),
        (name = "users", description = "A user's own data, read-your-writes"),
        (name = "reports", description = "Revenue report, dashboard and the orders export"),
        (name = "locations", description = "Locations and transfers between them"),
        (name = "ledger", description = "Adjustments with reasons, and the movements of every count"),
        (name = "admin", description = "Replica freshness, the routing policy, bulk imports"),
        (name = "health", description = "Liveness, readiness and metrics"),
        (name = "pages", description = "The operations and storefront pages (HTML)"),
        (name = "meta", description = "This document"),
    )
)]
struct ApiDoc;

/// `bearer`: `Authorization: Bearer <JWT>` from `stockgate token`.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .description(Some(
                        "An HS256 token from `stockgate token --user ID` or `--admin`. A user \
                         token may act only for its own user id; an admin token for anyone.",
                    ))
                    .build(),
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::ApiError;
    use axum::response::IntoResponse;
    use serde_json::Value;
    use std::collections::BTreeSet;

    fn doc() -> Value {
        serde_json::to_value(document()).expect("the document serialises")
    }

    #[test]
    fn the_document_is_openapi_3_and_parses_back() {
        let text = serde_json::to_string(&document()).expect("serialise");
        let parsed: utoipa::openapi::OpenApi = serde_json::from_str(&text).expect("parse back");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert!(v["openapi"].as_str().expect("openapi").starts_with("3."));
        assert_eq!(
            parsed.paths.paths.len(),
            v["paths"].as_object().expect("paths").len()
        );
        assert!(
            parsed.paths.paths.len() >= 25,
            "the routers added their operations"
        );
        let scheme = &v["components"]["securitySchemes"]["bearer"];
        assert_eq!(scheme["scheme"], "bearer");
        assert_eq!(scheme["bearerFormat"], "JWT");
    }

    #[test]
    fn every_reference_resolves() {
        fn walk(v: &Value, doc: &Value, bad: &mut Vec<String>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        let target = r
                            .strip_prefix('#')
                            .and_then(|p| doc.pointer(p))
                            .filter(|t| !t.is_null());
                        if target.is_none() {
                            bad.push(r.clone());
                        }
                    }
                    m.values().for_each(|x| walk(x, doc, bad));
                }
                Value::Array(a) => a.iter().for_each(|x| walk(x, doc, bad)),
                _ => {}
            }
        }
        let doc = doc();
        let mut bad = Vec::new();
        walk(&doc, &doc, &mut bad);
        assert!(bad.is_empty(), "dangling $refs: {bad:?}");
    }

    /// What an operation must document, given its path, auth and body; `(status, why)`.
    fn statuses_required(path: &str, op: &Value) -> Vec<(&'static str, &'static str)> {
        let secured = op["security"]
            .as_array()
            .is_some_and(|s| s.iter().any(|r| r.get("bearer").is_some()));
        let admin = path.starts_with("/v1/admin") || path.starts_with("/v1/reports");
        assert!(
            !admin || secured,
            "{path}: an admin route needs bearer auth"
        );
        let mut required = vec![("503", "every request may be shed")];
        let rules = [
            (secured, "401", "bearer auth can fail"),
            (admin, "403", "an admin route refuses user tokens"),
            (
                op.get("requestBody").is_some(),
                "400",
                "a body can be malformed",
            ),
            (
                op.get("requestBody").is_some(),
                "413",
                "a body can be too large",
            ),
            (
                path.contains('{'),
                "400",
                "a path parameter can be malformed",
            ),
        ];
        required.extend(rules.iter().filter(|r| r.0).map(|r| (r.1, r.2)));
        required
    }

    /// An error response is a shared one (`$ref`) or has the `ErrorBody` schema.
    fn uses_error_body(response: &Value) -> bool {
        response.get("$ref").is_some()
            || response.pointer("/content/application~1json/schema/$ref")
                == Some(&Value::from("#/components/schemas/ErrorBody"))
    }

    #[test]
    fn every_operation_documents_its_errors_and_auth() {
        let doc = doc();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                let what = format!("{} {path}", method.to_uppercase());
                let responses = op["responses"].as_object().expect("responses");
                assert!(
                    responses.keys().any(|s| s.starts_with('2')),
                    "{what}: no success response"
                );
                for (status, why) in statuses_required(path, op) {
                    assert!(
                        responses.contains_key(status),
                        "{what}: no {status} ({why})"
                    );
                }
                for (status, r) in responses.iter().filter(|(s, _)| !s.starts_with('2')) {
                    assert!(uses_error_body(r), "{what} {status}: errors use ErrorBody");
                }
            }
        }
    }

    #[tokio::test]
    async fn the_error_schema_names_every_field_api_error_writes() {
        let errors = [
            ApiError::bad_request("INVALID_QUERY", "qty must be a whole number"),
            ApiError::ShortLines(vec![crate::checkout::Short {
                product_id: crate::domain::ProductId::parse("a").expect("valid"),
                requested: 2,
                available: 1,
            }]),
        ];
        let documented: BTreeSet<String> =
            doc()["components"]["schemas"]["ErrorDetail"]["properties"]
                .as_object()
                .expect("properties")
                .keys()
                .cloned()
                .collect();
        for error in errors {
            let bytes = axum::body::to_bytes(error.into_response().into_body(), 1 << 16)
                .await
                .expect("body");
            let body: Value = serde_json::from_slice(&bytes).expect("json");
            let keys = body["error"].as_object().expect("error object").keys();
            for key in keys {
                assert!(documented.contains(key), "`{key}` is not in ErrorDetail");
            }
        }
    }
}
