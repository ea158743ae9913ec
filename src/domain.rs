//! Domain types: every input is parsed into one of these at the HTTP boundary, so handlers
//! and SQL never see a raw string or number that has not been checked. Nothing here knows
//! about axum or sqlx.

use serde::Serialize;
use serde_json::{Map, Value};
use std::fmt;

/// Why an input was refused; becomes a 422 with this code and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub code: &'static str,
    pub message: String,
}

fn invalid(code: &'static str, message: impl Into<String>) -> Invalid {
    Invalid {
        code,
        message: message.into(),
    }
}

/// 1–64 characters of ASCII letters, digits, `_`, `-` and `.`.
fn parse_ident(s: String, code: &'static str, what: &str) -> Result<String, Invalid> {
    if s.is_empty() || s.len() > 64 {
        return Err(invalid(
            code,
            format!("{what} must be 1 to 64 characters long"),
        ));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(invalid(
            code,
            format!("{what} may contain only ASCII letters, digits, '_', '-' and '.'"),
        ));
    }
    Ok(s)
}

macro_rules! ident_type {
    ($name:ident, $code:literal, $what:literal) => {
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn parse(s: &str) -> Result<Self, Invalid> {
                Self::parse_owned(s.to_owned())
            }
            /// [`Self::parse`] of a string already owned (no copy of it is made).
            pub fn parse_owned(s: String) -> Result<Self, Invalid> {
                parse_ident(s, $code, $what).map(Self)
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        /// Read back only through [`Self::parse`]: a value that breaks the rule is an error.
        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::parse_owned(s).map_err(|e| serde::de::Error::custom(e.message))
            }
        }
    };
}

ident_type!(ProductId, "INVALID_PRODUCT_ID", "product_id");
ident_type!(UserId, "INVALID_USER_ID", "user_id");
ident_type!(LocationId, "INVALID_LOCATION_ID", "location_id");

/// Where a request may take its units from: 1–50 locations, each once, in the client's order
/// of preference (the order matters: it is the order of choice). Empty: every active
/// location, in rank order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locations(Vec<LocationId>);

impl Locations {
    pub const MAX: usize = 50;

    /// `None` (the field absent): every active location.
    pub fn parse(given: Option<&[String]>) -> Result<Self, Invalid> {
        let Some(given) = given else {
            return Ok(Locations::default());
        };
        if given.is_empty() || given.len() > Self::MAX {
            return Err(invalid(
                "INVALID_LOCATIONS",
                format!("locations must name 1 to {} locations", Self::MAX),
            ));
        }
        let mut parsed: Vec<LocationId> = Vec::with_capacity(given.len());
        for l in given {
            let id = LocationId::parse(l)?;
            if parsed.contains(&id) {
                return Err(invalid(
                    "DUPLICATE_LOCATION",
                    format!("location {id} appears twice; name each location once"),
                ));
            }
            parsed.push(id);
        }
        Ok(Locations(parsed))
    }

    pub fn get(&self) -> &[LocationId] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// What "the same locations" means for idempotency: "" when none is named (so a body
    /// without the field fingerprints as it always did), else "@a,b" in the client's order.
    pub fn fingerprint(&self) -> String {
        if self.0.is_empty() {
            return String::new();
        }
        let names: Vec<&str> = self.0.iter().map(LocationId::as_str).collect();
        format!("@{}", names.join(","))
    }
}

/// Where units of an order, a cart or a hold came from (and go back to).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Allocation {
    #[schema(value_type = String)]
    pub product_id: ProductId,
    #[schema(value_type = String)]
    pub location_id: LocationId,
    #[schema(minimum = 1)]
    pub quantity: i32,
}

/// An order quantity: 1 to 10,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(i32);

impl Quantity {
    pub const MAX: i64 = 10_000;

    pub fn parse(n: &serde_json::Number) -> Result<Self, Invalid> {
        match whole(n) {
            Some(q) => Self::from_i64(q),
            None => Err(invalid(
                "INVALID_QUANTITY",
                "quantity must be a whole number from 1 to 10000",
            )),
        }
    }

    pub fn from_i64(q: i64) -> Result<Self, Invalid> {
        if (1..=Self::MAX).contains(&q) {
            Ok(Quantity(q as i32))
        } else {
            Err(invalid(
                "INVALID_QUANTITY",
                "quantity must be a whole number from 1 to 10000",
            ))
        }
    }

    pub fn get(self) -> i32 {
        self.0
    }
}

/// A non-negative integer below 2^31: prices in cents and stock levels.
/// A cart's or hold's lines: 1–50, each product once, kept in `product_id` order (the
/// lock order), so two bodies naming the same lines in another order are the same body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lines(Vec<(ProductId, Quantity)>);

impl Lines {
    pub const MAX: usize = 50;

    pub fn parse(lines: &[(&str, &serde_json::Number)]) -> Result<Self, Invalid> {
        if lines.is_empty() || lines.len() > Self::MAX {
            return Err(invalid(
                "INVALID_LINES",
                format!("lines must hold 1 to {} products", Self::MAX),
            ));
        }
        let mut parsed = Vec::with_capacity(lines.len());
        for (p, q) in lines {
            parsed.push((ProductId::parse(p)?, Quantity::parse(q)?));
        }
        parsed.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        if let Some(w) = parsed.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(invalid(
                "DUPLICATE_PRODUCT",
                format!("product {} appears twice; name each product once", w[0].0),
            ));
        }
        Ok(Lines(parsed))
    }

    pub fn get(&self) -> &[(ProductId, Quantity)] {
        &self.0
    }

    /// Each line's product and units, for moving stock.
    pub fn units(&self) -> Vec<(ProductId, i32)> {
        self.0.iter().map(|(p, q)| (p.clone(), q.get())).collect()
    }

    /// The lines as "p:q,p:q" in product order: what "the same lines" means.
    pub fn fingerprint(&self) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(p, q)| format!("{p}:{}", q.get()))
            .collect();
        parts.join(",")
    }
}

/// How long a hold lasts: 1–3600 s (default 600).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldTtl(u32);

impl HoldTtl {
    pub const DEFAULT: HoldTtl = HoldTtl(600);

    pub fn parse(n: &serde_json::Number) -> Result<Self, Invalid> {
        match whole(n) {
            Some(s) if (1..=3600).contains(&s) => Ok(HoldTtl(s as u32)),
            _ => Err(invalid(
                "INVALID_TTL",
                "ttl_s must be a whole number of seconds from 1 to 3600",
            )),
        }
    }

    pub fn secs(self) -> u32 {
        self.0
    }
}

/// A JSON number that is a whole number: `3`, and also `3.0` (JSON Schema, which the
/// OpenAPI document speaks, counts `3.0` as an integer, so the parsers agree with it).
/// `2.5` is not; neither is a float beyond ±2^53, where whole and rounded look alike.
fn whole(n: &serde_json::Number) -> Option<i64> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= EXACT)
            .map(|f| f as i64)
    })
}

fn parse_amount(n: &serde_json::Number, code: &'static str, what: &str) -> Result<i32, Invalid> {
    match whole(n) {
        Some(v) if (0..=i32::MAX as i64).contains(&v) => Ok(v as i32),
        _ => Err(invalid(
            code,
            format!("{what} must be a whole number from 0 to 2147483647"),
        )),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct PriceCents(i32);

impl PriceCents {
    pub fn parse(n: &serde_json::Number) -> Result<Self, Invalid> {
        parse_amount(n, "INVALID_PRICE", "price_cents").map(Self)
    }
    pub fn get(self) -> i32 {
        self.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Stock(i32);

impl Stock {
    pub fn parse(n: &serde_json::Number) -> Result<Self, Invalid> {
        parse_amount(n, "INVALID_QUANTITY", "available_quantity").map(Self)
    }
    pub fn get(self) -> i32 {
        self.0
    }
}

/// A product's `max_per_customer`: a whole number of units from 1 to 10,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct CustomerLimit(i32);

impl CustomerLimit {
    pub fn parse(n: &serde_json::Number) -> Result<Self, Invalid> {
        match whole(n) {
            Some(v) if (1..=10_000).contains(&v) => Ok(Self(v as i32)),
            _ => Err(invalid(
                "INVALID_LIMIT",
                "max_per_customer must be a whole number from 1 to 10000",
            )),
        }
    }
    pub fn get(self) -> i32 {
        self.0
    }
}

/// A product's display name: 1–200 characters, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct ProductName(String);

impl ProductName {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let trimmed = s.trim();
        if trimmed.is_empty() || trimmed.chars().count() > 200 {
            return Err(invalid(
                "INVALID_NAME",
                "name must be 1 to 200 characters long",
            ));
        }
        if trimmed.chars().any(char::is_control) {
            return Err(invalid(
                "INVALID_NAME",
                "name must not contain control characters",
            ));
        }
        Ok(Self(trimmed.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `Idempotency-Key`: 1–255 printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        if s.is_empty() || s.len() > 255 {
            return Err(invalid(
                "INVALID_IDEMPOTENCY_KEY",
                "Idempotency-Key must be 1 to 255 characters long",
            ));
        }
        if !s.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(invalid(
                "INVALID_IDEMPOTENCY_KEY",
                "Idempotency-Key must be printable ASCII without spaces",
            ));
        }
        Ok(Self(s.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A user's settings: a JSON object, at most 16 KiB serialised and 8 levels deep.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Settings(Map<String, Value>);

impl Settings {
    pub const MAX_BYTES: usize = 16 * 1024;
    pub const MAX_DEPTH: usize = 8;

    pub fn parse(v: Value) -> Result<Self, Invalid> {
        let Value::Object(map) = v else {
            return Err(invalid(
                "INVALID_SETTINGS",
                "settings must be a JSON object",
            ));
        };
        if depth(&Value::Object(map.clone())) > Self::MAX_DEPTH {
            return Err(invalid(
                "INVALID_SETTINGS",
                "settings may nest at most 8 levels deep",
            ));
        }
        let size = serde_json::to_vec(&map)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        if size > Self::MAX_BYTES {
            return Err(invalid(
                "INVALID_SETTINGS",
                "settings must be at most 16 KiB",
            ));
        }
        // PostgreSQL's jsonb cannot store U+0000; refuse it here rather than fail there.
        if serde_json::to_string(&map)
            .map(|s| s.contains("\\u0000"))
            .unwrap_or(true)
        {
            return Err(invalid(
                "INVALID_SETTINGS",
                "settings must not contain NUL characters",
            ));
        }
        Ok(Self(map))
    }

    pub fn into_value(self) -> Value {
        Value::Object(self.0)
    }
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// A profile's display name: 1–100 characters, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct DisplayName(String);

impl DisplayName {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let t = s.trim();
        if t.is_empty() || t.chars().count() > 100 || t.chars().any(char::is_control) {
            return Err(invalid(
                "INVALID_DISPLAY_NAME",
                "display_name must be 1 to 100 characters without control characters",
            ));
        }
        Ok(Self(t.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An email address of a plausible shape: `local@domain.tld`, at most 254 characters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Email(String);

impl Email {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let t = s.trim();
        let bad = || invalid("INVALID_EMAIL", "email must look like name@example.com");
        if t.len() > 254 || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad());
        }
        let (local, domain) = t.rsplit_once('@').ok_or_else(bad)?;
        if local.is_empty() || local.len() > 64 || local.contains('@') {
            return Err(bad());
        }
        if !domain.contains('.')
            || domain.starts_with('.')
            || domain.ends_with('.')
            || domain.contains("..")
        {
            return Err(bad());
        }
        Ok(Self(t.to_string()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn lines_are_kept_in_product_order_and_a_product_named_twice_is_refused() {
        let (one, two) = (serde_json::Number::from(1), serde_json::Number::from(2));
        let a = Lines::parse(&[("b", &two), ("a", &one)]).expect("valid");
        let b = Lines::parse(&[("a", &one), ("b", &two)]).expect("valid");
        assert_eq!(a.fingerprint(), "a:1,b:2");
        assert_eq!(a, b, "the same lines in another order are the same body");
        let dup = Lines::parse(&[("a", &one), ("a", &two)]).unwrap_err();
        assert_eq!(dup.code, "DUPLICATE_PRODUCT");
        assert_eq!(Lines::parse(&[]).unwrap_err().code, "INVALID_LINES");
        let many: Vec<String> = (0..51).map(|i| format!("p{i}")).collect();
        let many: Vec<(&str, &serde_json::Number)> =
            many.iter().map(|p| (p.as_str(), &one)).collect();
        assert_eq!(Lines::parse(&many).unwrap_err().code, "INVALID_LINES");
    }

    #[test]
    fn a_hold_lasts_one_second_to_an_hour() {
        for ok in [1u64, 600, 3600] {
            assert!(HoldTtl::parse(&ok.into()).is_ok());
        }
        for bad in [0u64, 3601] {
            assert!(HoldTtl::parse(&bad.into()).is_err());
        }
        assert!(HoldTtl::parse(&serde_json::Number::from_f64(1.5).expect("finite")).is_err());
    }
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn num(v: Value) -> serde_json::Number {
        match v {
            Value::Number(n) => n,
            _ => unreachable!("test passes numbers"),
        }
    }

    #[test]
    fn product_ids_follow_the_contract_charset() {
        assert!(ProductId::parse("flash-60").is_ok());
        assert!(ProductId::parse("a.b_C-9").is_ok());
        assert!(ProductId::parse(&"x".repeat(64)).is_ok());
        for bad in [
            "",
            "has space",
            "slash/no",
            "é",
            &"x".repeat(65),
            "semi;colon",
            "quote'",
        ] {
            assert_eq!(
                ProductId::parse(bad).unwrap_err().code,
                "INVALID_PRODUCT_ID",
                "{bad:?}"
            );
        }
    }

    #[test]
    fn quantities_are_one_to_ten_thousand_integers() {
        assert_eq!(Quantity::parse(&num(json!(1))).map(Quantity::get), Ok(1));
        assert_eq!(
            Quantity::parse(&num(json!(10000))).map(Quantity::get),
            Ok(10000)
        );
        // Whole numbers written as floats are integers (as JSON Schema counts them).
        assert_eq!(Quantity::parse(&num(json!(3.0))).map(Quantity::get), Ok(3));
        assert_eq!(HoldTtl::parse(&num(json!(60.0))).map(HoldTtl::secs), Ok(60));
        assert!(PriceCents::parse(&num(json!(0.0))).is_ok());
        for bad in [
            json!(0.0),
            json!(2.5),
            json!(0),
            json!(-1),
            json!(10001),
            json!(1.5),
            json!(1e30),
            json!(u64::MAX),
        ] {
            assert!(Quantity::parse(&num(bad.clone())).is_err(), "{bad}");
        }
    }

    #[test]
    fn prices_and_stock_are_below_two_to_the_31() {
        assert!(PriceCents::parse(&num(json!(0))).is_ok());
        assert!(PriceCents::parse(&num(json!(2147483647))).is_ok());
        assert!(PriceCents::parse(&num(json!(2147483648u64))).is_err());
        assert!(PriceCents::parse(&num(json!(-1))).is_err());
        assert!(Stock::parse(&num(json!(-5))).is_err());
    }

    #[test]
    fn idempotency_keys_are_printable_and_bounded() {
        assert!(IdempotencyKey::parse("order-123").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        for bad in [
            "",
            "has space",
            "tab\t",
            "nul\0",
            &"k".repeat(256),
            "ünïcode",
        ] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn settings_must_be_a_bounded_object() {
        assert!(Settings::parse(json!({"theme": "dark", "n": [1, 2, {"a": 1}]})).is_ok());
        assert!(Settings::parse(json!([1, 2])).is_err());
        assert!(Settings::parse(json!("x")).is_err());
        assert!(Settings::parse(json!({"big": "x".repeat(20_000)})).is_err());
        let deep = (0..10).fold(json!(1), |acc, _| json!({ "a": acc }));
        assert!(Settings::parse(deep).is_err());
        assert!(Settings::parse(json!({"nul": "a\u{0}b"})).is_err());
    }

    #[test]
    fn emails_need_a_plausible_shape() {
        assert!(Email::parse("ada@example.com").is_ok());
        for bad in [
            "",
            "ada",
            "ada@",
            "@example.com",
            "ada@example",
            "a da@example.com",
            "ada@.com",
            "ada@example..com",
        ] {
            assert!(Email::parse(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn product_id_parser_never_panics_and_accepts_only_the_charset(s in "\\PC{0,80}") {
            if let Ok(id) = ProductId::parse(&s) {
                prop_assert!(id.as_str().len() <= 64);
                prop_assert!(id.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)));
            }
        }

        #[test]
        fn quantity_parser_accepts_exactly_the_range(q in any::<i64>()) {
            prop_assert_eq!(Quantity::from_i64(q).is_ok(), (1..=10_000).contains(&q));
        }

        #[test]
        fn settings_parser_never_panics(s in "\\PC{0,200}") {
            if let Ok(v) = serde_json::from_str::<Value>(&s) {
                let _ = Settings::parse(v);
            }
        }
    }
}
