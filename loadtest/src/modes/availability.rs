//! availability: GET availability back-to-back on one product — req/s, latency, which
//! copy answered (primary or a replica) and how stale the answers were.

use super::timed::{self, Hit, TimedSpec};
use super::{Ctx, fresh_id, warm_up};
use crate::cli::AvailabilityArgs;
use crate::locations::Stock;
use crate::report::TimedReport;
use crate::samples::Clock;
use anyhow::{Context, Result};
use std::sync::Arc;

/// Stock of the product created when none is named.
const FRESH_STOCK: u32 = 1_000_000;

pub async fn run(ctx: &Ctx, a: AvailabilityArgs) -> Result<TimedReport> {
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
            api.create_product(&id, &Stock::Default(FRESH_STOCK), 100)
                .await?;
            api.wait_visible(&id, &Clock::start()).await?;
            id
        }
    };
    warm_up(ctx, a.concurrency as usize).await;

    let pid: Arc<str> = product_id.as_str().into();
    let (qty, deadline, clock) = (a.qty, ctx.deadline, Clock::start());
    let spec = TimedSpec {
        product_id,
        seconds: a.seconds,
        concurrency: a.concurrency,
        qty: a.qty,
        stale_limit_ms: a.stale_limit_ms,
    };
    let (meta, tally) = timed::run(ctx, spec, move |_, _| {
        let (api, pid) = (api.clone(), pid.clone());
        async move {
            match api.availability(&pid, qty, &clock, deadline).await {
                Ok(ans) => Hit::Answer {
                    served_by: ans.served_by,
                    stale_by_ms: ans.stale_by_ms,
                },
                Err(label) => Hit::Failed(label),
            }
        }
    })
    .await?;
    Ok(TimedReport::availability(meta, &tally, a.stale_limit_ms))
}
