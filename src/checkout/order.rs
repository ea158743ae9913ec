//! What an order is: its row, its lines, its status, and the request that places one.

use super::status::OrderStatus;
use crate::domain::{Allocation, IdempotencyKey, Locations, ProductId, Quantity, UserId};
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use uuid::Uuid;

/// The columns of an [`Order`], in its field order: the one list every query uses (a
/// macro, so queries stay string literals).
macro_rules! order_columns {
    () => {
        "order_id, product_id, quantity, user_id, status, total_cents, created_at, cancelled_at, unit_price_cents, allocations"
    };
}
pub(crate) use order_columns;

/// [`order_columns!`] as a value, for the tests that hold SQL to it.
pub const ORDER_COLUMNS: &str = order_columns!();

/// The id of a new row in `orders`, `holds` or `restocks`: time-ordered (UUID v7), so each
/// insert lands on the right-hand page of its primary-key index, which stays in memory,
/// instead of on a random page of an index that outgrows it (measured against random v4 ids
/// on a large `orders` table: `bench/results/`).
pub(crate) fn new_row_id() -> Uuid {
    Uuid::now_v7()
}

/// An order as it is stored and handled: a single-line order or a cart ([`Shape`]), its
/// user, its status and its lines, every id and quantity already of its checked type (a
/// value the database's own checks let in always parses; one that did not would fail the
/// read, never be dropped). The API states it as [`OrderBody`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(into = "OrderBody")]
pub struct Order {
    pub order_id: Uuid,
    pub shape: Shape,
    pub user_id: UserId,
    pub status: OrderStatus,
    pub total_cents: i64,
    pub created_at: DateTime<Utc>,
    pub cancelled_at: Option<DateTime<Utc>>,
    /// A single-line order's unit price (its one line's); 0 on a cart's row.
    pub(crate) unit_price_cents: i32,
    /// Every line of the order (a single-line order has one).
    pub lines: Vec<OrderLine>,
    /// Where every unit came from (none for a refusal), as the row states it.
    pub allocations: Allocations,
}

/// What an order's row says it is for.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    /// One product: the row names it and its quantity.
    Single {
        product_id: ProductId,
        quantity: Quantity,
    },
    /// Several products: the row names none, its lines are in `order_lines`.
    Cart,
}

impl<'r> sqlx::FromRow<'r, PgRow> for Order {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        use sqlx::{Column, Row};
        Order::read(row, row.try_column("order_id")?.ordinal())
    }
}

impl Order {
    /// The order whose [`order_columns!`] start at column `first` of `row`, read by place
    /// ([`at`]).
    pub(crate) fn read(row: &PgRow, first: usize) -> Result<Self, sqlx::Error> {
        let shape = match (
            at(row, first + 1, "product_id")?,
            at(row, first + 2, "quantity")?,
        ) {
            (Some(product_id), Some(quantity)) => Shape::Single {
                product_id,
                quantity,
            },
            (None, None) => Shape::Cart,
            _ => {
                return Err(sqlx::Error::ColumnDecode {
                    index: "product_id".into(),
                    source: "a row with a product but no quantity, or the other way round".into(),
                });
            }
        };
        Ok(Order {
            order_id: at(row, first, "order_id")?,
            shape,
            user_id: at(row, first + 3, "user_id")?,
            status: at(row, first + 4, "status")?,
            total_cents: at(row, first + 5, "total_cents")?,
            created_at: at(row, first + 6, "created_at")?,
            cancelled_at: at(row, first + 7, "cancelled_at")?,
            unit_price_cents: at(row, first + 8, "unit_price_cents")?,
            lines: vec![],
            allocations: at(row, first + 9, "allocations")?,
        })
    }
}

/// Column `i` of `row`, which must be named `name`: read by its place, so no row looks the
/// name up again (a hash of it each time: the batch statement returns 21 columns for every
/// order, and those lookups were a measurable share of the service's CPU per order), and
/// checked by name, so a column list that drifts from its reader fails the read instead of
/// filling a field with its neighbour.
pub(crate) fn at<'r, T>(row: &'r PgRow, i: usize, name: &str) -> Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use sqlx::{Column, Row};
    match row.columns().get(i) {
        Some(c) if c.name() == name => row.try_get(i),
        _ => Err(sqlx::Error::ColumnNotFound(format!("{name} (column {i})"))),
    }
}

/// Where an order's units came from, exactly as its row holds them: `orders.allocations`, a
/// jsonb array of `{product_id, location_id, quantity}` that only the order functions write,
/// from checked ids. An answer states it as the database wrote it; it is parsed into checked
/// [`Allocation`]s only where the service acts on it (a cancel's give-back). Parsing every
/// answer's allocations and writing them again cost each order more service CPU than
/// anything else locations added (`bench/results/README.md`, "The 1,000-product gap").
#[derive(Debug, Clone)]
pub struct Allocations(Box<RawValue>);

impl Allocations {
    /// No units from anywhere (`[]`): a refusal's.
    pub fn none() -> Self {
        Allocations(RawValue::from_string("[]".into()).expect("[] is JSON"))
    }

    /// Each allocation, its ids checked.
    pub fn parse(&self) -> Result<Vec<Allocation>, sqlx::Error> {
        serde_json::from_str(self.0.get()).map_err(|e| sqlx::Error::ColumnDecode {
            index: "allocations".into(),
            source: e.into(),
        })
    }
}

impl PartialEq for Allocations {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

impl Serialize for Allocations {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl sqlx::Type<sqlx::Postgres> for Allocations {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <sqlx::types::Json<Box<RawValue>> as sqlx::Type<sqlx::Postgres>>::type_info()
    }
    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <sqlx::types::Json<Box<RawValue>> as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for Allocations {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let raw =
            <sqlx::types::Json<Box<RawValue>> as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Ok(Allocations(raw.0))
    }
}

/// The checked types read straight from their columns (`text`, `int4`), each through its own
/// parser: a value that breaks the rule fails the read, it is never dropped or passed on.
macro_rules! decoded_as {
    ($name:ty, $ty:ty, $parse:expr) => {
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <$ty as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <$ty as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(
                value: sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let raw = <&'r $ty as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                $parse(raw).map_err(|e: crate::domain::Invalid| e.message.into())
            }
        }
    };
}
decoded_as!(ProductId, str, ProductId::parse);
decoded_as!(UserId, str, UserId::parse);

impl sqlx::Type<sqlx::Postgres> for Quantity {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <i32 as sqlx::Type<sqlx::Postgres>>::type_info()
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for Quantity {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let raw = <i32 as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        Quantity::from_i64(raw.into()).map_err(|e| e.message.into())
    }
}

/// A column's value parsed into its checked type; a value that does not parse fails the read.
pub(crate) fn column<T>(
    parsed: Result<T, crate::domain::Invalid>,
    name: &str,
) -> Result<T, sqlx::Error> {
    parsed.map_err(|e| sqlx::Error::ColumnDecode {
        index: name.into(),
        source: e.message.into(),
    })
}

/// An order as the API states it (the contract's shape): a single-line order names its
/// product and quantity, a cart does not.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Order)]
pub struct OrderBody {
    order_id: Uuid,
    /// A single-line order's product; absent for a cart (see `lines`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    product_id: Option<ProductId>,
    /// A single-line order's quantity; absent for a cart.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<i32>, minimum = 1, maximum = 10000)]
    quantity: Option<Quantity>,
    #[schema(value_type = String)]
    user_id: UserId,
    /// `confirmed` or `cancelled`.
    #[schema(value_type = String, pattern = "^(confirmed|cancelled)$", example = "confirmed")]
    status: OrderStatus,
    total_cents: i64,
    created_at: DateTime<Utc>,
    cancelled_at: Option<DateTime<Utc>>,
    /// Every line of the order (a single-line order has one).
    lines: Vec<OrderLine>,
    /// Where every unit came from: each line's units by location.
    #[schema(value_type = Vec<Allocation>)]
    allocations: Allocations,
}

impl From<Order> for OrderBody {
    fn from(o: Order) -> Self {
        let (product_id, quantity) = match o.shape {
            Shape::Single {
                product_id,
                quantity,
            } => (Some(product_id), Some(quantity)),
            Shape::Cart => (None, None),
        };
        OrderBody {
            order_id: o.order_id,
            product_id,
            quantity,
            user_id: o.user_id,
            status: o.status,
            total_cents: o.total_cents,
            created_at: o.created_at,
            cancelled_at: o.cancelled_at,
            lines: o.lines,
            allocations: o.allocations,
        }
    }
}

/// One product of an order.
#[derive(Debug, Clone, Serialize, PartialEq, sqlx::FromRow, utoipa::ToSchema)]
pub struct OrderLine {
    #[schema(value_type = String)]
    pub product_id: ProductId,
    #[schema(value_type = i32, minimum = 1, maximum = 10000)]
    pub quantity: Quantity,
    pub unit_price_cents: i32,
}

impl Order {
    /// The products of its lines.
    pub(crate) fn products(&self) -> Vec<ProductId> {
        self.lines.iter().map(|l| l.product_id.clone()).collect()
    }

    /// A single-line order with its one line stated; a cart is completed by [`with_lines`].
    pub(crate) fn complete(mut self) -> Order {
        if let Shape::Single {
            product_id,
            quantity,
        } = &self.shape
            && self.lines.is_empty()
        {
            self.lines = vec![OrderLine {
                product_id: product_id.clone(),
                quantity: *quantity,
                unit_price_cents: self.unit_price_cents,
            }];
        }
        self
    }
}

/// An order with every line stated, reading a cart's lines with `exec`.
pub(crate) async fn with_lines<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    order: Order,
) -> Result<Order, sqlx::Error> {
    if let Shape::Single { .. } = order.shape {
        return Ok(order.complete());
    }
    let lines = sqlx::query_as(
        "SELECT product_id, quantity, unit_price_cents FROM order_lines WHERE order_id = $1 ORDER BY product_id",
    )
    .bind(order.order_id)
    .fetch_all(exec)
    .await?;
    Ok(Order { lines, ..order })
}

#[derive(Debug, Clone)]
pub struct OrderRequest {
    pub user: UserId,
    pub product: ProductId,
    pub quantity: Quantity,
    pub key: IdempotencyKey,
    /// Where it may take from (empty: every active location).
    pub locations: Locations,
}

impl OrderRequest {
    /// What "the same body" means for idempotency (the locations named, when any, are part
    /// of it; a body naming none fingerprints as it always did).
    pub(crate) fn fingerprint(&self) -> String {
        format!(
            "{}:{}{}",
            self.product,
            self.quantity.get(),
            self.locations.fingerprint()
        )
    }

    /// The (user, key) this request is idempotent under.
    pub(crate) fn key_pair(&self) -> (&str, &str) {
        (self.user.as_str(), self.key.as_str())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Placed {
    /// A new order: stock was taken.
    Created(Order),
    /// The same key and body as an earlier order: that order, nothing taken.
    Replayed(Order),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_row_ids_are_time_ordered_so_inserts_append_to_the_key_index() {
        let ids: Vec<Uuid> = (0..10_000).map(|_| new_row_id()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        assert_eq!(ids[0].get_version_num(), 7);
    }

    fn written(json: &str) -> Allocations {
        Allocations(RawValue::from_string(json.into()).expect("JSON"))
    }

    // Mutations that fail this test: `Serialize` writing parsed allocations again (the keys
    // in another order, the spaces gone); `parse` reading ids as plain strings.
    #[test]
    fn allocations_are_answered_as_written_and_parsed_with_their_ids_checked() {
        // As jsonb writes them: its own key order, a space after each colon and comma.
        let text = r#"[{"quantity": 2, "product_id": "p-1", "location_id": "north"}]"#;
        let held = written(text);
        assert_eq!(serde_json::to_string(&held).expect("serializes"), text);
        let parsed = held.parse().expect("parses");
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].product_id.as_str(), "p-1");
        assert_eq!(parsed[0].location_id.as_str(), "north");
        assert_eq!(parsed[0].quantity, 2);
        // An id that breaks the id rule is never handed to a give-back.
        let bad = written(r#"[{"quantity": 1, "product_id": "p 1", "location_id": "north"}]"#);
        assert!(bad.parse().is_err());
        assert_eq!(Allocations::none().parse().expect("parses"), vec![]);
    }
}
