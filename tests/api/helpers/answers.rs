//! Answers, typed. The service's response types only serialise (and its error body is
//! private to it), so the tests read answers back into these: the contract's shapes, in one
//! place, and the assertion on an error answer.

use chrono::{DateTime, Utc};
use reqwest::{Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use uuid::Uuid;

/// A response's status and its JSON body (`null` if it has none): what the request helpers
/// return, and what [`assert_error`] reads.
pub async fn answer(resp: Response) -> (StatusCode, Value) {
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// The one error body: `{"error": {"code": "SCREAMING_SNAKE_CASE", "message": "…", …}}`.
#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    /// With 409 `OUT_OF_STOCK` for a cart or hold: the short lines.
    pub lines: Option<Vec<ShortLine>>,
    /// With 409 `LIMIT_EXCEEDED`: the limited product, its limit, the units already had.
    pub product_id: Option<String>,
    pub limit: Option<i64>,
    pub already: Option<i64>,
    /// With 422 `INVALID_CSV`: the first bad lines of the file.
    pub bad_lines: Option<Vec<Value>>,
}

/// A line a cart or hold could not have. Exactly these fields: a test comparing short lines
/// compares the whole line.
#[derive(Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShortLine {
    pub product_id: String,
    pub requested: i64,
    pub available: i64,
}

/// An order (`stockgate::checkout::Order`): the fields the tests read.
#[derive(Debug, Deserialize)]
pub struct Order {
    pub order_id: Uuid,
    pub status: OrderStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    Confirmed,
    Cancelled,
}

/// A hold (`stockgate::checkout::holds::Hold`): the fields the tests read.
#[derive(Debug, Deserialize)]
pub struct Hold {
    pub hold_id: Uuid,
    pub status: HoldStatus,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldStatus {
    Held,
    Confirmed,
    Released,
    Expired,
}

/// What every routed read adds to its body (`stockgate::http::Stated`): the moment the answer
/// describes and where it came from.
#[derive(Debug, Deserialize)]
pub struct Stated {
    pub as_of: DateTime<Utc>,
    pub stale_by_ms: u64,
    /// `primary` or a replica's name (`replica-1`, …).
    pub served_by: String,
}

/// `body` read as a `T`; panics, showing the body, if it is not one.
#[track_caller]
pub fn parse<T: DeserializeOwned>(body: &Value) -> T {
    T::deserialize(body)
        .unwrap_or_else(|e| panic!("not a {}: {e}: {body}", std::any::type_name::<T>()))
}

/// An error body's code; `""` for any other body. For filters and retry loops, and where the
/// status is already known; an assertion on an answer wants [`assert_error`].
pub fn code(body: &Value) -> &str {
    body.pointer("/error/code")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Asserts that `answer` is the error `status` `code` in the contract's shape, and returns
/// its details (a limit, the short lines) for the checks that follow.
#[track_caller]
pub fn assert_error(answer: &(StatusCode, Value), status: u16, code: &str) -> ErrorDetail {
    assert_error_for("", answer, status, code)
}

/// [`assert_error`], naming `what` was asked (a round, a product) when it fails.
#[track_caller]
pub fn assert_error_for(
    what: &str,
    answer: &(StatusCode, Value),
    status: u16,
    code: &str,
) -> ErrorDetail {
    let (got, body) = answer;
    match ErrorBody::deserialize(body) {
        Ok(b) if got.as_u16() == status && b.error.code == code => b.error,
        _ if what.is_empty() => panic!("want {status} {code}, got {got} {body}"),
        _ => panic!("{what}: want {status} {code}, got {got} {body}"),
    }
}

/// The error assertion must be able to fail: on another status, another code, or a body that
/// is not the contract's error body.
#[test]
fn assert_error_fails_on_another_status_another_code_or_a_body_not_in_the_contracts_shape() {
    let refused = |body: Value| (StatusCode::CONFLICT, body);
    let out_of_stock = json!({"error": {"code": "OUT_OF_STOCK", "message": "not enough"}});
    let e = assert_error(&refused(out_of_stock.clone()), 409, "OUT_OF_STOCK");
    assert_eq!(e.message, "not enough");
    let fails = |answer: (StatusCode, Value), status: u16, code: &'static str| {
        std::panic::catch_unwind(move || assert_error(&answer, status, code)).is_err()
    };
    assert!(fails(refused(out_of_stock.clone()), 422, "OUT_OF_STOCK"));
    assert!(fails(refused(out_of_stock), 409, "LIMIT_EXCEEDED"));
    assert!(fails(
        refused(json!({"error": {"code": "OUT_OF_STOCK"}})),
        409,
        "OUT_OF_STOCK"
    ));
    assert!(fails(
        refused(json!({"code": "OUT_OF_STOCK", "message": "flat"})),
        409,
        "OUT_OF_STOCK"
    ));
}
