//! The OpenAPI 3.1 document of the whole API, served at `GET /openapi.json`.
//!
//! It is generated from the code: each route module carries `#[utoipa::path(...)]` on its
//! handlers, `ToSchema` on its bodies and a `pub(super) struct Api` listing its operations;
//! this file merges them with the shared pieces (the error body, the freshness fields of a
//! routed read, the reusable error responses and the `bearer` security scheme). A test
//! checks that every route the router serves is documented, and nothing more.

use super::responses::*;
use super::{AppState, admin, health, holds, imports, orders, products, reports, users};
use axum::Router;
use axum::routing::get;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

pub fn router() -> Router<AppState> {
    Router::new().route("/openapi.json", get(openapi_json))
}

/// The whole document: the shared parts here plus every route module's operations.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    for part in [
        products::Api::openapi(),
        orders::Api::openapi(),
        holds::Api::openapi(),
        users::Api::openapi(),
        reports::Api::openapi(),
        admin::Api::openapi(),
        imports::Api::openapi(),
        health::Api::openapi(),
    ] {
        doc.merge(part);
    }
    doc
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
async fn openapi_json() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(document())
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "stockgate",
        description = "Inventory and checkout that never oversells and never lets a lagging \
                       read replica decide anything that matters. Errors are always \
                       `{\"error\": {\"code\", \"message\"}}`; nothing answers 500. Any request \
                       may get 503 with `Retry-After` when the service sheds load or times out."
    ),
    paths(openapi_json, ops_page, shop_page, ops_js, shop_js, pages_css),
    components(
        schemas(ErrorBody, ErrorDetail),
        responses(BadRequest, Unauthorized, Forbidden, PayloadTooLarge, Unprocessable, Unavailable)
    ),
    modifiers(&BearerAuth),
    tags(
        (name = "products", description = "Products, stock and the stock gate"),
        (name = "orders", description = "Idempotent orders and cancellation"),
        (name = "users", description = "A user's own data, read-your-writes"),
        (name = "reports", description = "Revenue report, dashboard and the orders export"),
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

// The pages module serves static HTML, JS and CSS; its routes are documented here.

/// The operations page
///
/// Static HTML; the page asks for an admin token and reads the JSON API.
#[utoipa::path(
    get,
    path = "/ops",
    tag = "pages",
    responses(
        (status = 200, description = "The page", content_type = "text/html", body = String),
        (status = 503, response = Unavailable),
    )
)]
#[allow(dead_code)]
fn ops_page() {}

/// The storefront page of a product
///
/// Static HTML; a well-formed id that names no product still gets the page, which shows
/// the API's 404.
#[utoipa::path(
    get,
    path = "/shop/{product_id}",
    tag = "pages",
    params(
        ("product_id" = String, Path, description = "1–64 of `A-Z a-z 0-9 _ - .`",
            pattern = "^[A-Za-z0-9_.-]{1,64}$"),
    ),
    responses(
        (status = 200, description = "The page", content_type = "text/html", body = String),
        (status = 400, response = BadRequest),
        (status = 404, description = "No such route", body = ErrorBody),
        (status = 422, description = "INVALID_PRODUCT_ID", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
#[allow(dead_code)]
fn shop_page() {}

/// The operations page's script
#[utoipa::path(
    get,
    path = "/static/ops.js",
    tag = "pages",
    responses(
        (status = 200, description = "JavaScript", content_type = "text/javascript", body = String),
        (status = 503, response = Unavailable),
    )
)]
#[allow(dead_code)]
fn ops_js() {}

/// The storefront page's script
#[utoipa::path(
    get,
    path = "/static/shop.js",
    tag = "pages",
    responses(
        (status = 200, description = "JavaScript", content_type = "text/javascript", body = String),
        (status = 503, response = Unavailable),
    )
)]
#[allow(dead_code)]
fn shop_js() {}

/// The pages' stylesheet
#[utoipa::path(
    get,
    path = "/static/pages.css",
    tag = "pages",
    responses(
        (status = 200, description = "CSS", content_type = "text/css", body = String),
        (status = 503, response = Unavailable),
    )
)]
#[allow(dead_code)]
fn pages_css() {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::ApiError;
    use axum::response::IntoResponse;
    use serde::Serialize;
    use serde_json::Value;
    use std::collections::BTreeSet;

    fn doc() -> Value {
        serde_json::to_value(document()).expect("the document serialises")
    }

    /// `(METHOD, path)` of every `.route("path", get(..).post(..))` in `src/http/*.rs`.
    fn routes_in_source() -> BTreeSet<(String, String)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/http");
        let mut routes = BTreeSet::new();
        for entry in std::fs::read_dir(dir).expect("src/http") {
            let path = entry.expect("dir entry").path();
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read source");
            // The served code: before any test module, without comments.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let code: String = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| format!("{l}\n"))
                .collect();
            for (route, args) in route_calls(&code) {
                let methods = methods_in(&args);
                assert!(
                    !methods.is_empty(),
                    "{}: no method router found for {route}",
                    path.display()
                );
                for m in methods {
                    routes.insert((m, route.clone()));
                }
            }
        }
        routes
    }

    /// Each `.route("…", …)` call: its path and the text of its remaining arguments.
    fn route_calls(text: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find(".route(") {
            rest = &rest[i + ".route(".len()..];
            let Some(after_quote) = rest.trim_start().strip_prefix('"') else {
                continue; // e.g. `db.route(QueryClass::…)`, not a router
            };
            let Some(end) = after_quote.find('"') else {
                break;
            };
            let route = after_quote[..end].to_string();
            // The arguments run to the `)` that closes `.route(`.
            let args = &after_quote[end + 1..];
            let mut depth = 1usize;
            let mut close = args.len();
            for (j, c) in args.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            close = j;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            out.push((route, args[..close].to_string()));
        }
        out
    }

    fn methods_in(args: &str) -> Vec<String> {
        let bytes = args.as_bytes();
        let mut found = Vec::new();
        for m in ["get", "post", "put", "patch", "delete", "head", "options"] {
            let needle = format!("{m}(");
            let mut from = 0;
            while let Some(i) = args[from..].find(&needle) {
                let at = from + i;
                let before = at.checked_sub(1).map(|b| bytes[b]);
                if !matches!(before, Some(b) if b.is_ascii_alphanumeric() || b == b'_' || b == b':')
                {
                    found.push(m.to_uppercase());
                    break;
                }
                from = at + needle.len();
            }
        }
        found
    }

    fn routes_in_document(doc: &Value) -> BTreeSet<(String, String)> {
        let mut routes = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, _) in item.as_object().expect("path item") {
                routes.insert((method.to_uppercase(), path.clone()));
            }
        }
        routes
    }

    #[test]
    fn the_document_lists_exactly_the_routes_the_router_serves() {
        let served = routes_in_source();
        assert!(
            served.len() >= 25,
            "the source scan found too few routes: {served:?}"
        );
        let documented = routes_in_document(&doc());
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let unserved: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty(),
            "routes without OpenAPI docs (add #[utoipa::path] and list the handler in the module's `Api`): {undocumented:?}"
        );
        assert!(
            unserved.is_empty(),
            "documented routes that the router does not serve: {unserved:?}"
        );
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

    #[test]
    fn every_operation_documents_its_errors_and_auth() {
        let doc = doc();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                let responses = op["responses"].as_object().expect("responses");
                let has = |s: &str| responses.contains_key(s);
                let what = format!("{} {path}", method.to_uppercase());
                assert!(has("503"), "{what}: every request may be shed with 503");
                assert!(
                    responses.keys().any(|s| s.starts_with('2')),
                    "{what}: no success response"
                );
                let secured = op["security"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|r| r.get("bearer").is_some()));
                if secured {
                    assert!(has("401"), "{what}: bearer auth but no 401");
                }
                if path.starts_with("/v1/admin") || path.starts_with("/v1/reports") {
                    assert!(
                        secured && has("403"),
                        "{what}: admin route needs bearer + 403"
                    );
                }
                if op.get("requestBody").is_some() {
                    assert!(
                        has("400") && has("413"),
                        "{what}: a body can be malformed or too large"
                    );
                }
                if path.contains('{') {
                    assert!(has("400"), "{what}: a path parameter can be malformed");
                }
                for (status, r) in responses {
                    if status.starts_with('4') || status.starts_with('5') {
                        let json = r.pointer("/content/application~1json/schema/$ref");
                        let reused = r.get("$ref").is_some();
                        assert!(
                            reused
                                || json.and_then(Value::as_str)
                                    == Some("#/components/schemas/ErrorBody"),
                            "{what} {status}: errors use the ErrorBody schema"
                        );
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn the_error_schema_matches_what_api_error_writes() {
        let response =
            ApiError::bad_request("INVALID_QUERY", "qty must be a whole number").into_response();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .expect("body");
        let body: Value = serde_json::from_slice(&bytes).expect("json");
        let keys = |v: &Value| -> BTreeSet<String> {
            v.as_object().expect("object").keys().cloned().collect()
        };
        let documented = serde_json::to_value(ErrorBody {
            error: ErrorDetail {
                code: "INVALID_QUERY".into(),
                message: "qty must be a whole number".into(),
            },
        })
        .expect("json");
        assert_eq!(body, documented);
        let schemas = &doc()["components"]["schemas"];
        assert_eq!(
            keys(&schemas["ErrorDetail"]["properties"]),
            keys(&body["error"])
        );
    }

    #[test]
    fn the_stated_schema_mirrors_what_routed_reads_write() {
        #[derive(Serialize)]
        struct Body {
            x: u8,
        }
        let real = serde_json::to_value(crate::http::Stated {
            body: Body { x: 1 },
            as_of: "2026-11-29T17:00:03.123Z".into(),
            stale_by_ms: 5,
            served_by: "replica-1".into(),
        })
        .expect("json");
        let mirror = serde_json::to_value(Stated {
            body: Body { x: 1 },
            as_of: "2026-11-29T17:00:03.123Z".into(),
            stale_by_ms: 5,
            served_by: "replica-1".into(),
        })
        .expect("json");
        assert_eq!(real, mirror);
    }
}
