//! The books after the run: wait until the service lists nothing of ours as held, then
//! read every product's stock back (in all, and per location).

use super::Plan;
use crate::client::{Api, error_label};
use crate::report::PerLocation;
use crate::report::checkout::ProductCheck;
use crate::samples::Allocated;
use anyhow::{Context, Result, bail};
use chrono::{DateTime, Utc};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The contract lets an expired hold's units come back up to 5 s after `expires_at`; the
/// grace covers our clock against the service's and one poll interval.
const EXPIRY_BOUND: Duration = Duration::from_secs(5);
const EXPIRY_GRACE: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(200);

#[derive(Deserialize)]
struct HeldBody {
    units_held: Vec<HeldLine>,
}

#[derive(Deserialize)]
struct HeldLine {
    product_id: String,
    units: i64,
}

/// Units of our products the service still lists as held.
async fn units_held(api: &Api, ours: &HashMap<String, usize>, deadline: Instant) -> Result<u64> {
    let a = api
        .admin_call(Method::GET, "/v1/admin/holds", None, None, deadline)
        .await
        .map_err(|label| anyhow::anyhow!("GET /v1/admin/holds: {label}"))?;
    if a.status != StatusCode::OK {
        bail!(
            "GET /v1/admin/holds: HTTP {}",
            error_label(a.status, &a.body)
        );
    }
    let held: HeldBody =
        serde_json::from_slice(&a.body).context("GET /v1/admin/holds: unexpected body")?;
    Ok(held
        .units_held
        .iter()
        .filter(|h| ours.contains_key(&h.product_id))
        .map(|h| h.units.max(0) as u64)
        .sum())
}

/// Polls until nothing of ours is held, giving up at `last_end` + the contract's 5 s +
/// grace. Returns the units still held (0 on success) and how long it took.
pub(super) async fn wait_holds_ended(
    api: &Api,
    ours: &HashMap<String, usize>,
    last_end: Option<DateTime<Utc>>,
) -> Result<(u64, Duration)> {
    let start = Instant::now();
    let left = last_end
        .map(|e| (e - Utc::now()).to_std().unwrap_or_default())
        .unwrap_or_default();
    let give_up = start + left + EXPIRY_BOUND + EXPIRY_GRACE;
    loop {
        let held = units_held(api, ours, give_up + POLL).await?;
        if held == 0 || Instant::now() >= give_up {
            return Ok((held, start.elapsed()));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Reads every product back once the holds have ended and checks its books against the
/// units we saw confirmed (and, when its stock was spread, each location's against the
/// units allocated there).
pub(super) async fn read_books(
    plan: &Plan,
    units: &[u64],
    allocated: &[Allocated],
) -> Result<Vec<ProductCheck>> {
    let end = Utc::now();
    let mut per_product = Vec::with_capacity(plan.products.len());
    for (i, id) in plan.products.iter().enumerate() {
        let read = plan.api.final_read(id, end).await?;
        let given = u64::from(plan.a.stock);
        let mut p = ProductCheck::new(id.clone(), given, units[i], read.available_quantity);
        p.served_by = read.served_by;
        p.covers_end = read.covers_all_orders;
        p.per_location = plan
            .stock
            .at()
            .map(|given| PerLocation::of(given, &allocated[i], Some(&read.levels)));
        per_product.push(p);
    }
    Ok(per_product)
}
