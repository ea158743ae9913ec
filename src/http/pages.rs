//! The operations page (`/ops`) and the storefront page (`/shop/{product_id}`).

use super::AppState;
use axum::Router;

pub fn router() -> Router<AppState> {
    Router::new()
}
