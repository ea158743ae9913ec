//! Raw measurements: the run clock, one sample per request, and the record of a sale run.

use chrono::{DateTime, Utc};
use serde_json::Value;
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
}

/// Everything one sale run observed.
#[derive(Debug, Clone)]
pub struct SaleRun {
    pub spec: SaleSpec,
    pub clock: Clock,
    /// From creating the product to availability answering 200 for it (before `t0`).
    pub product_visible_after_ms: u64,
    pub orders: Vec<OrderSample>,
    pub avail: Vec<AvailSample>,
    /// Orders never sent because the --max-seconds safety stop came first.
    pub not_sent: u64,
    /// Pollers stopped early because the sample cap was reached.
    pub avail_capped: bool,
    pub final_read: Result<FinalRead, String>,
    pub replicas_before: Option<Value>,
    pub replicas_after: Option<Value>,
}
