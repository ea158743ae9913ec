//! `GET /v1/admin/overview`: what the ops page draws besides the replicas, worked out here
//! from the running configuration and the service's own counters (rates over the last
//! minute, see [`crate::rates`]), so the page renders and never computes.

use super::responses::{Forbidden, Unauthorized, Unavailable};
use super::{Admin, AppState, Json};
use crate::rates::{Rates, Snapshot};
use crate::routing::policy::{POLICY, QueryClass, Target};
use axum::extract::State;
use serde::Serialize;
use std::time::Instant;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default().routes(routes!(overview))
}

const DECISIONS: &str = "stockgate_routing_decisions_total";
const FALLBACKS: &str = "stockgate_routing_fallbacks_total";
const ORDERS: &str = "stockgate_orders_total";
const HOLDS: &str = "stockgate_holds_total";
const RYW_FAILURES: &str = "stockgate_ryw_store_failures_total";
/// The counters the overview turns into rates.
const COUNTERS: &[&str] = &[DECISIONS, FALLBACKS, ORDERS, HOLDS, RYW_FAILURES];

#[derive(Serialize, ToSchema)]
struct Overview {
    /// Seconds the rates below cover: up to a minute (less while the instance is young or
    /// nobody has looked lately). Null on an instance's first overview, which has nothing
    /// earlier to compare with; every rate is null then.
    rates_over_s: Option<f64>,
    thresholds: ThresholdsView,
    /// Routed reads per second of each query class, in the policy table's order.
    routing: Vec<ClassRates>,
    fallbacks: FallbacksView,
    /// Order attempts per second by outcome (`confirmed`, `out_of_stock`, …).
    orders_per_s: Vec<LabelRate>,
    /// Holds per second by event (`taken`, `confirmed`, `released`, `expired`).
    holds_per_s: Vec<LabelRate>,
    /// Units in holds that have not ended, all products (as of the last sweep).
    units_held: i64,
    read_your_writes: RywView,
}

/// The thresholds in force, from the running configuration and the policy table.
#[derive(Serialize, ToSchema)]
struct ThresholdsView {
    /// The stock gate's staleness budget.
    stock_gate_budget_ms: u64,
    /// Staleness at which a healthy replica becomes `lagging` (`STOCKGATE_EVICT_AFTER_MS`).
    eviction_threshold_ms: u64,
    /// A lagging replica is readmitted after staying under half the eviction threshold this long.
    readmit_after_ms: u64,
}

#[derive(Serialize, ToSchema)]
struct ClassRates {
    /// The query class, e.g. `stock_gate`.
    class: &'static str,
    /// Where the class reads: `primary` or `replica`.
    #[schema(value_type = String, pattern = "^(primary|replica)$")]
    target: Target,
    replica_per_s: Option<f64>,
    primary_per_s: Option<f64>,
    /// Refused with 503 (a class set to refuse rather than load the primary).
    refused_per_s: Option<f64>,
    /// Reads of a replica class that went to the primary (part of `primary_per_s`).
    fallbacks_per_s: Option<f64>,
}

#[derive(Serialize, ToSchema)]
struct FallbacksView {
    /// Every class's fallbacks per second.
    per_s: Option<f64>,
    /// Each class and reason that has fallen back since the instance started, the busiest
    /// now first.
    by_reason: Vec<FallbackReason>,
}

#[derive(Serialize, ToSchema)]
struct FallbackReason {
    class: String,
    /// `no_fresh_replica`, `replica_failed`, `read_your_writes`, …
    reason: String,
    per_s: Option<f64>,
    since_start: u64,
}

#[derive(Serialize, ToSchema)]
struct LabelRate {
    /// The outcome or event.
    label: String,
    per_s: Option<f64>,
}

#[derive(Serialize, ToSchema)]
struct RywView {
    /// `in_process` or `redis`.
    #[schema(pattern = "^(in_process|redis)$")]
    store: &'static str,
    healthy: bool,
    /// How long a write pins its user's reads.
    ttl_ms: u64,
    /// Store operations failing per second (reads then go to the primary).
    failures_per_s: Option<f64>,
}

/// Rates, states and thresholds for the ops page (admin)
#[utoipa::path(
    get,
    path = "/v1/admin/overview",
    tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Rates over the last minute, states and the thresholds in force", body = Overview),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 503, response = Unavailable),
    )
)]
async fn overview(State(state): State<AppState>, _: Admin) -> Json<Overview> {
    let snapshot = Snapshot::of(&state.metrics.registry, COUNTERS);
    let rates = state
        .rates
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .observe(Instant::now(), snapshot.clone());
    let ryw = state.db.ryw();
    let thresholds = state.db.thresholds();
    let gate_budget = QueryClass::StockGate.policy().budget();
    Json(Overview {
        rates_over_s: rates.as_ref().map(|r| r.span.as_secs_f64()),
        thresholds: ThresholdsView {
            stock_gate_budget_ms: gate_budget.as_millis() as u64,
            eviction_threshold_ms: thresholds.evict_after.as_millis() as u64,
            readmit_after_ms: thresholds.readmit_after.as_millis() as u64,
        },
        routing: POLICY
            .iter()
            .map(|p| ClassRates::of(p.class.name(), p.target, rates.as_ref()))
            .collect(),
        fallbacks: FallbacksView::of(&snapshot, rates.as_ref()),
        orders_per_s: LabelRate::all(&snapshot, ORDERS, "outcome", rates.as_ref()),
        holds_per_s: LabelRate::all(&snapshot, HOLDS, "event", rates.as_ref()),
        units_held: state.metrics.units_held.get(),
        read_your_writes: RywView {
            store: ryw.kind(),
            healthy: ryw.healthy().await,
            ttl_ms: ryw.ttl().as_millis() as u64,
            failures_per_s: rates.as_ref().map(|r| r.rate(RYW_FAILURES, &[])),
        },
    })
}

impl ClassRates {
    fn of(class: &'static str, target: Target, rates: Option<&Rates>) -> ClassRates {
        let decided =
            |to: &str| rates.map(|r| r.rate(DECISIONS, &[("class", class), ("target", to)]));
        ClassRates {
            class,
            target,
            replica_per_s: decided("replica"),
            primary_per_s: decided("primary"),
            refused_per_s: decided("refused"),
            fallbacks_per_s: rates.map(|r| r.rate(FALLBACKS, &[("class", class)])),
        }
    }
}

impl FallbacksView {
    fn of(now: &Snapshot, rates: Option<&Rates>) -> FallbacksView {
        let mut by_reason: Vec<FallbackReason> = now
            .0
            .iter()
            .filter(|((family, _), total)| family == FALLBACKS && **total > 0.0)
            .map(|((_, labels), total)| {
                let label = |k: &str| {
                    labels
                        .iter()
                        .find(|(lk, _)| lk == k)
                        .map(|(_, v)| v.clone())
                        .unwrap_or_default()
                };
                let (class, reason) = (label("class"), label("reason"));
                FallbackReason {
                    per_s: rates
                        .map(|r| r.rate(FALLBACKS, &[("class", &class), ("reason", &reason)])),
                    class,
                    reason,
                    since_start: *total as u64,
                }
            })
            .collect();
        by_reason.sort_by(|a, b| {
            b.per_s
                .unwrap_or(0.0)
                .total_cmp(&a.per_s.unwrap_or(0.0))
                .then(b.since_start.cmp(&a.since_start))
        });
        FallbacksView {
            per_s: rates.map(|r| r.rate(FALLBACKS, &[])),
            by_reason,
        }
    }
}

impl LabelRate {
    /// One entry per value of `key` among `family`'s series.
    fn all(now: &Snapshot, family: &str, key: &str, rates: Option<&Rates>) -> Vec<LabelRate> {
        now.label_values(family, key)
            .into_iter()
            .map(|label| LabelRate {
                per_s: rates.map(|r| r.rate(family, &[(key, &label)])),
                label,
            })
            .collect()
    }
}
