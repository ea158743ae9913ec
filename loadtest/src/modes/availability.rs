//! availability: GET availability back-to-back on one product — req/s, latency, which
//! copy answered (primary or a replica) and how stale the answers were.

use super::timed::{self, Hit};
use super::{Ctx, fresh_id, warm_up};
use crate::cli::AvailabilityArgs;
use crate::report::{AvailabilityReport, TimedMeta};
use crate::samples::Clock;
use anyhow::{Context, Result};
use std::sync::Arc;

/// Stock of the product created when none is named.
const FRESH_STOCK: u32 = 1_000_000;

pub async fn run(ctx: &Ctx, a: AvailabilityArgs) -> Result<AvailabilityReport> {
    let api = ctx.api.clone();
    let product_id = match a.product_id {
        Some(id) => {
            api.product(&id)
                .await
                .with_context(|| format!("--product-id {id} must name an existing product"))?;
            id
        }
        None => {
            let id = fresh_id("avail");
            api.create_product(&id, FRESH_STOCK, 100).await?;
            api.wait_visible(&id, &Clock::start()).await?;
            id
        }
    };
    warm_up(ctx, a.concurrency as usize).await;

    let pid: Arc<str> = product_id.as_str().into();
    let (qty, deadline, clock) = (a.qty, ctx.deadline, Clock::start());
    let call_api = api.clone();
    let t = timed::run(
        ctx,
        a.concurrency,
        a.seconds,
        a.stale_limit_ms,
        move |_, _| {
            let (api, pid) = (call_api.clone(), pid.clone());
            async move {
                match api.availability(&pid, qty, &clock, deadline).await {
                    Ok(ans) => Hit::Answer {
                        served_by: ans.served_by,
                        stale_by_ms: ans.stale_by_ms,
                    },
                    Err(label) => Hit::Failed(label),
                }
            }
        },
    )
    .await?;

    Ok(AvailabilityReport::build(
        TimedMeta {
            base_url: api.base_url().to_string(),
            product_id,
            seconds: a.seconds,
            concurrency: a.concurrency,
            qty: a.qty,
            elapsed_us: t.elapsed_us,
            stopped_by_max_seconds: t.stopped_by_max_seconds,
        },
        &t.tally,
        a.stale_limit_ms,
    ))
}
