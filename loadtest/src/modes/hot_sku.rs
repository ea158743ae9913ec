//! hot-sku: one product with huge stock and C workers ordering back-to-back — the
//! confirmed orders/s one hot row sustains through the whole service.

use super::timed::{self, Hit, TimedSpec};
use super::{Ctx, fresh_id, run_tag, warm_up};
use crate::cli::HotSkuArgs;
use crate::report::TimedReport;
use crate::samples::OrderOutcome;
use anyhow::Result;
use std::sync::Arc;

pub async fn run(ctx: &Ctx, a: HotSkuArgs) -> Result<TimedReport> {
    let api = ctx.api.clone();
    let product_id = a.product_id.unwrap_or_else(|| fresh_id("hot"));
    if !a.existing {
        api.create_product(&product_id, a.stock, 100).await?;
    }
    warm_up(ctx, a.concurrency as usize).await;

    let pid: Arc<str> = product_id.as_str().into();
    let tag: Arc<str> = run_tag().into();
    let (qty, deadline) = (a.qty, ctx.deadline);
    let spec = TimedSpec {
        product_id,
        seconds: a.seconds,
        concurrency: a.concurrency,
        qty: a.qty,
        stale_limit_ms: u64::MAX,
    };
    let (meta, tally) = timed::run(ctx, spec, move |w, i| {
        let (api, pid, tag) = (api.clone(), pid.clone(), tag.clone());
        async move {
            let user = format!("hot-{w}");
            let key = format!("lt-{tag}-{w}-{i}");
            match api.place_order(&pid, &user, qty, &key, deadline).await {
                OrderOutcome::Confirmed { quantity } => Hit::Confirmed(quantity),
                OrderOutcome::OutOfStock => Hit::OutOfStock,
                // The hot product has no limit: a refusal for one is wrong.
                OrderOutcome::LimitExceeded { .. } => Hit::Failed("409 LIMIT_EXCEEDED".into()),
                OrderOutcome::Failed(label) => Hit::Failed(label),
            }
        }
    })
    .await?;

    Ok(TimedReport::hot_sku(meta, &tally))
}
