//! The operations page (`/ops`) and the storefront page (`/shop/{product_id}`).
//!
//! Both are static HTML + JS embedded in the binary; the browser fetches its data from the
//! JSON API (the ops page with an admin token it asks for once and keeps in
//! `sessionStorage`). Nothing is loaded from anywhere but this service, and the content
//! security policy says so.

use super::responses::{BadRequest, ErrorBody, Unavailable};
use super::{ApiError, AppState, Path};
use crate::domain::ProductId;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

const OPS_HTML: &str = include_str!("../../static/ops.html");
const SHOP_HTML: &str = include_str!("../../static/shop.html");
const OPS_JS: &str = include_str!("../../static/ops.js");
const SHOP_JS: &str = include_str!("../../static/shop.js");
const COMMON_JS: &str = include_str!("../../static/common.js");
const PAGES_CSS: &str = include_str!("../../static/pages.css");

const HTML: &str = "text/html; charset=utf-8";

/// Scripts, styles and requests only from this origin; no inline script; no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default()
        .routes(routes!(ops_page))
        .routes(routes!(shop_page))
        .routes(routes!(ops_js))
        .routes(routes!(shop_js))
        .routes(routes!(common_js))
        .routes(routes!(pages_css))
}

/// A static page or file at `$path`: its handler and its OpenAPI operation, one per asset.
macro_rules! static_asset {
    ($(#[doc = $doc:literal])* $name:ident, $path:literal, $what:literal, $mime:literal, $body:expr) => {
        $(#[doc = $doc])*
        #[utoipa::path(
            get,
            path = $path,
            tag = "pages",
            responses(
                (status = 200, description = $what, content_type = $mime, body = String),
                (status = 503, response = Unavailable),
            )
        )]
        async fn $name() -> Response {
            asset(concat!($mime, "; charset=utf-8"), $body)
        }
    };
}

static_asset!(
    /// The operations page
    ///
    /// Static HTML; the page asks for an admin token and reads the JSON API.
    ops_page, "/ops", "The page", "text/html", OPS_HTML
);
static_asset!(
    /// The operations page's script
    ops_js, "/static/ops.js", "JavaScript", "text/javascript", OPS_JS
);
static_asset!(
    /// The storefront page's script
    shop_js, "/static/shop.js", "JavaScript", "text/javascript", SHOP_JS
);
static_asset!(
    /// The helpers both pages' scripts share
    common_js, "/static/common.js", "JavaScript", "text/javascript", COMMON_JS
);
static_asset!(
    /// The pages' stylesheet
    pages_css, "/static/pages.css", "CSS", "text/css", PAGES_CSS
);

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
async fn shop_page(Path(id): Path<String>) -> Result<Response, ApiError> {
    // Checked here, so a malformed id is the contract's JSON error.
    ProductId::parse(&id)?;
    Ok(asset(HTML, SHOP_HTML))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Pages change with each build and are tiny; always revalidate.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Tokens may arrive in `?token=`; never pass the URL on.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if content_type == HTML {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        );
    }
    response
}
