//! The operations page (`/ops`) and the storefront page (`/shop/{product_id}`).
//!
//! Both are static HTML + JS embedded in the binary; the browser fetches its data from the
//! JSON API (the ops page with an admin token it asks for once and keeps in
//! `sessionStorage`). Nothing is loaded from anywhere but this service, and the content
//! security policy says so.

use super::{ApiError, AppState, Path};
use crate::domain::ProductId;
use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const OPS_HTML: &str = include_str!("../../static/ops.html");
const SHOP_HTML: &str = include_str!("../../static/shop.html");
const OPS_JS: &str = include_str!("../../static/ops.js");
const SHOP_JS: &str = include_str!("../../static/shop.js");
const PAGES_CSS: &str = include_str!("../../static/pages.css");

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// Scripts, styles and requests only from this origin; no inline script; no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/ops", get(ops))
        .route("/shop/{product_id}", get(shop))
        .route("/static/ops.js", get(|| async { asset(JS, OPS_JS) }))
        .route("/static/shop.js", get(|| async { asset(JS, SHOP_JS) }))
        .route("/static/pages.css", get(|| async { asset(CSS, PAGES_CSS) }))
}

async fn ops() -> Response {
    asset(HTML, OPS_HTML)
}

/// The product id is checked here, so a malformed one is the contract's JSON error; a
/// well-formed id that names no product gets the page, which shows the API's 404.
async fn shop(Path(id): Path<String>) -> Result<Response, ApiError> {
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
