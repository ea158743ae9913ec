//! Raw measurements: the run clock, one sample per request, and the record of a sale run.

use crate::locations::StockAt;
use chrono::{DateTime, Utc};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One clock for a run: monotonic offsets from `t0`, plus the wall time at `t0` so the
/// service's `as_of` timestamps can be put on the same axis.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    t0: Instant,
    t0_wall: DateTime<Utc>,
}

impl Clock {
    pub fn start() -> Self {
        Self {
            t0: Instant::now(),
            t0_wall: Utc::now(),
        }
    }

    /// Microseconds from `t0` to `t` (0 for instants before `t0`).
    pub fn us(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.t0).as_micros()).unwrap_or(u64::MAX)
    }

    /// A wall-clock time as signed microseconds from `t0` (negative: before the run).
    pub fn wall_us(&self, t: DateTime<Utc>) -> i64 {
        (t - self.t0_wall).num_microseconds().unwrap_or(i64::MAX)
    }

    /// The wall-clock time `us` microseconds after `t0`.
    pub fn wall_at(&self, us: u64) -> DateTime<Utc> {
        self.t0_wall + Duration::from_micros(us)
    }

    pub fn started_at(&self) -> DateTime<Utc> {
        self.t0_wall
    }
}

/// One entry of an order's `allocations`: units of a product taken from one location.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Allocation {
    pub product_id: String,
    pub location_id: String,
    pub quantity: u64,
}

/// Units of one product's confirmed orders' allocations per location: where the answers
/// the tool received say its units were taken from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocated(BTreeMap<String, u64>);

impl Allocated {
    /// Counts the entries of `allocations` that are `product_id`'s.
    pub fn add(&mut self, product_id: &str, allocations: &[Allocation]) {
        for a in allocations.iter().filter(|a| a.product_id == product_id) {
            *self.0.entry(a.location_id.clone()).or_default() += a.quantity;
        }
    }

    pub fn merge(&mut self, other: Allocated) {
        for (location, units) in other.0 {
            *self.0.entry(location).or_default() += units;
        }
    }

    /// Units allocated at `location_id` (0 if none).
    pub fn at(&self, location_id: &str) -> u64 {
        self.0.get(location_id).copied().unwrap_or(0)
    }

    /// The locations with allocations, by id.
    pub fn locations(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

impl FromIterator<(String, u64)> for Allocated {
    fn from_iter<I: IntoIterator<Item = (String, u64)>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

/// One entry of a product page's `stock`: what one location has left of it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Level {
    pub location_id: String,
    pub available_quantity: i64,
    pub active: bool,
}

/// How one order request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderOutcome {
    /// 201 with status "confirmed" for this many units.
    Confirmed { quantity: u32 },
    /// 409 OUT_OF_STOCK.
    OutOfStock,
    /// 409 LIMIT_EXCEEDED: the order would take its buyer past the product's
    /// `max_per_customer`; the service's `limit` and the units it says the buyer `already` had.
    LimitExceeded { limit: u32, already: u32 },
    /// Anything else, labelled by status and error code ("503 OVERLOADED", "timeout", ...).
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct OrderSample {
    /// The buyer (`buyer-{n}`) the order was placed for.
    pub buyer: u64,
    pub sent_us: u64,
    pub recv_us: u64,
    pub outcome: OrderOutcome,
}

impl OrderSample {
    pub fn latency_us(&self) -> u64 {
        self.recv_us.saturating_sub(self.sent_us)
    }
}

/// A 200 availability answer, with `as_of` already on the run's axis.
#[derive(Debug, Clone, PartialEq)]
pub struct AvailAnswer {
    pub available: bool,
    pub available_quantity: i64,
    /// Service's `as_of` as microseconds from the run's `t0` (may be negative).
    pub as_of_us: i64,
    pub stale_by_ms: u64,
    pub served_by: String,
}

#[derive(Debug, Clone)]
pub struct AvailSample {
    pub sent_us: u64,
    pub recv_us: u64,
    pub outcome: Result<AvailAnswer, String>,
}

impl AvailSample {
    pub fn latency_us(&self) -> u64 {
        self.recv_us.saturating_sub(self.sent_us)
    }
}

/// The product as read back after a run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FinalRead {
    pub available_quantity: i64,
    pub served_by: String,
    pub as_of: String,
    /// Whether `as_of` covers the last order answer (the read includes every order).
    pub covers_all_orders: bool,
    /// How long the read had to wait for an answer that covers every order.
    pub waited_ms: u64,
    /// The page's `stock`: each location's count (the per-location books show them).
    #[serde(skip)]
    pub levels: Vec<Level>,
}

/// What a flash-sale or sell-out run asked for.
#[derive(Debug, Clone)]
pub struct SaleSpec {
    pub mode: &'static str,
    pub base_url: String,
    pub product_id: String,
    pub stock: u32,
    pub buyers: u64,
    /// Orders each buyer sends, each with its own Idempotency-Key.
    pub attempts_per_buyer: u32,
    /// The fresh product's `max_per_customer`, if the run gave it one.
    pub max_per_customer: Option<u32>,
    pub concurrency: u32,
    pub qty: u32,
    pub pollers: u32,
    /// What each of the run's locations was given; empty: all at `default`.
    pub locations: Vec<StockAt>,
}

/// Everything one sale run observed.
#[derive(Debug, Clone)]
pub struct SaleRun {
    pub spec: SaleSpec,
    pub clock: Clock,
    /// From creating the product to availability answering 200 for it (before `t0`).
    pub product_visible_after_ms: u64,
    pub orders: Vec<OrderSample>,
    /// Units of the confirmed orders' allocations, per location.
    pub allocated: Allocated,
    pub avail: Vec<AvailSample>,
    /// Orders never sent because the --max-seconds safety stop came first.
    pub not_sent: u64,
    /// Pollers stopped early because the sample cap was reached.
    pub avail_capped: bool,
    pub final_read: Result<FinalRead, String>,
    pub replicas_before: Option<Value>,
    pub replicas_after: Option<Value>,
}
