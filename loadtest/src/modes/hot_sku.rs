//! hot-sku: one product with huge stock and C workers ordering back-to-back — the
//! confirmed orders/s one hot row sustains through the whole service.

use super::timed::{self, Hit};
use super::{Ctx, fresh_id, run_tag, warm_up};
use crate::cli::HotSkuArgs;
use crate::report::{HotSkuReport, TimedMeta};
use crate::samples::OrderOutcome;
use anyhow::Result;
use std::sync::Arc;

pub async fn run(ctx: &Ctx, a: HotSkuArgs) -> Result<HotSkuReport> {
    let api = ctx.api.clone();
    let product_id = a.product_id.unwrap_or_else(|| fresh_id("hot"));
    if !a.existing {
        api.create_product(&product_id, a.stock, 100).await?;
    }
    warm_up(ctx, a.concurrency as usize).await;

    let pid: Arc<str> = product_id.as_str().into();
    let tag: Arc<str> = run_tag().into();
    let (qty, deadline) = (a.qty, ctx.deadline);
    let call_api = api.clone();
    let t = timed::run(ctx, a.concurrency, a.seconds, u64::MAX, move |w, i| {
        let (api, pid, tag) = (call_api.clone(), pid.clone(), tag.clone());
        async move {
            let user = format!("hot-{w}");
            let key = format!("lt-{tag}-{w}-{i}");
            match api.place_order(&pid, &user, qty, &key, deadline).await {
                OrderOutcome::Confirmed { quantity } => Hit::Confirmed(quantity),
                OrderOutcome::OutOfStock => Hit::OutOfStock,
                OrderOutcome::Failed(label) => Hit::Failed(label),
            }
        }
    })
    .await?;

    Ok(HotSkuReport::build(
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
    ))
}
