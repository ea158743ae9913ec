//! The bodies the product routes take, and the checks JSON Schema cannot state for them.

use super::ApiError;
use super::locations::StockAt;
use crate::checkout::Rules;
use crate::domain::CustomerLimit;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Number;
use utoipa::openapi::schema::{
    AllOfBuilder, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type,
};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

/// A new product: the fields here ([`ProductFields`] in the OpenAPI document), and its stock
/// as one of two shapes ([`NewProductBody`]).
#[derive(Deserialize, ToSchema)]
#[schema(as = ProductFields)]
pub(super) struct NewProduct {
    /// The storefront's id: 1–64 of `A-Z a-z 0-9 _ - .`.
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "flash-60")]
    pub(super) product_id: String,
    /// 1–200 characters (trimmed), no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        example = "Flash sale sneakers",
        pattern = r"^[^\x00-\x1F\x7F-\x9F]*[^\s\x00-\x1F\x7F-\x9F][^\x00-\x1F\x7F-\x9F]*$"
    )]
    pub(super) name: String,
    #[schema(value_type = i64, minimum = 0, maximum = 2147483647, example = 8999)]
    pub(super) price_cents: Number,
    /// The stock, at `default` (one of the two shapes of [`NewProductBody`]).
    #[schema(ignore)]
    pub(super) available_quantity: Option<Number>,
    /// The stock at each of several locations (the other shape).
    #[schema(ignore)]
    pub(super) stock: Option<Vec<StockAt>>,
    /// The most units one user may hold (1–10,000); absent or `null`: no limit.
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 10000, example = 2)]
    #[serde(default)]
    pub(super) max_per_customer: Option<Number>,
    /// RFC 3339; before it, orders are 409 `SALE_NOT_STARTED`.
    #[schema(value_type = Option<String>, format = DateTime, example = "2026-12-24T18:00:00Z")]
    #[serde(default)]
    pub(super) sale_starts_at: Option<String>,
    /// RFC 3339, after `sale_starts_at`; from it, orders are 409 `SALE_ENDED`.
    #[schema(value_type = Option<String>, format = DateTime, example = "2026-12-24T20:00:00Z")]
    #[serde(default)]
    pub(super) sale_ends_at: Option<String>,
}

/// Some of a product's drop rules; a field left out stays as it is, `null` clears it.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RulesPatch {
    #[schema(value_type = Option<i64>, minimum = 1, maximum = 10000, example = 2)]
    #[serde(default, deserialize_with = "present")]
    pub(super) max_per_customer: Option<Option<Number>>,
    #[schema(value_type = Option<String>, format = DateTime, example = "2026-12-24T18:00:00Z")]
    #[serde(default, deserialize_with = "present")]
    pub(super) sale_starts_at: Option<Option<String>>,
    #[schema(value_type = Option<String>, format = DateTime, example = "2026-12-24T20:00:00Z")]
    #[serde(default, deserialize_with = "present")]
    pub(super) sale_ends_at: Option<Option<String>>,
}

/// A field that is present, `null` or not: `Some(None)` for `null` (absent is the default,
/// `None`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

pub(super) fn parse_limit(n: &Number) -> Result<i32, ApiError> {
    Ok(CustomerLimit::parse(n)?.get())
}

pub(super) fn parse_time(field: &str, raw: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            ApiError::invalid(
                "INVALID_DATE",
                format!("{field} must be an RFC 3339 date-time, e.g. 2026-12-24T18:00:00Z"),
            )
        })
}

pub(super) fn check_window(rules: &Rules) -> Result<(), ApiError> {
    match (rules.sale_starts_at, rules.sale_ends_at) {
        (Some(s), Some(e)) if e <= s => Err(window_error()),
        _ => Ok(()),
    }
}

pub(super) fn window_error() -> ApiError {
    ApiError::invalid(
        "INVALID_SALE_WINDOW",
        "sale_ends_at must come after sale_starts_at",
    )
}

/// A new product's body as the OpenAPI document states it: [`ProductFields`] and exactly one
/// of its stock's two shapes (a count at `default`, or `stock` at several locations).
pub(super) struct NewProductBody;

impl PartialSchema for NewProductBody {
    fn schema() -> RefOr<Schema> {
        let null = || ObjectBuilder::new().schema_type(Type::Null);
        let count = ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(0))
            .maximum(Some(i32::MAX))
            .examples([60]);
        let at_default = ObjectBuilder::new()
            .title(Some("At default"))
            .property("available_quantity", count)
            .required("available_quantity")
            .property("stock", null());
        let stock = ArrayBuilder::new()
            .items(Ref::from_schema_name(StockAt::name()))
            .min_items(Some(1))
            .max_items(Some(crate::domain::Locations::MAX))
            .description(Some("The stock at each of several locations, each once."));
        let spread = ObjectBuilder::new()
            .title(Some("At several locations"))
            .property("stock", stock)
            .required("stock")
            .property("available_quantity", null());
        AllOfBuilder::new()
            .item(Ref::from_schema_name(NewProduct::name()))
            .item(OneOfBuilder::new().item(at_default).item(spread))
            .into()
    }
}

impl ToSchema for NewProductBody {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((NewProduct::name().into(), NewProduct::schema()));
        schemas.push((StockAt::name().into(), StockAt::schema()));
    }
}
