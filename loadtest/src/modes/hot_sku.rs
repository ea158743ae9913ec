//! hot-sku: one product with huge stock and C workers ordering back-to-back — the
//! confirmed orders/s one hot row sustains through the whole service. With `--locations N`
//! the stock is spread over N locations of the run's own, and each location's books are
//! read back and checked afterwards.

use super::timed::{self, Hit, TimedSpec};
use super::{Ctx, create_locations, fresh_id, run_tag, warm_up};
use crate::cli::HotSkuArgs;
use crate::client::Api;
use crate::locations::Stock;
use crate::report::{PerLocation, TimedReport};
use crate::samples::{Allocated, OrderOutcome};
use anyhow::Result;
use std::sync::Arc;

pub async fn run(ctx: &Ctx, a: HotSkuArgs) -> Result<TimedReport> {
    let api = ctx.api.clone();
    let product_id = a.product_id.unwrap_or_else(|| fresh_id("hot"));
    let mut stock = Stock::Default(a.stock);
    if !a.existing {
        stock = Stock::spread(a.stock, &create_locations(&api, a.locations).await?);
        api.create_product(&product_id, &stock, 100).await?;
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
    let order_api = api.clone();
    let (meta, tally) = timed::run(ctx, spec, move |w, i| {
        let (api, pid, tag) = (order_api.clone(), pid.clone(), tag.clone());
        async move {
            let user = format!("hot-{w}");
            let key = format!("lt-{tag}-{w}-{i}");
            match api.place_order(&pid, &user, qty, &key, deadline).await {
                (OrderOutcome::Confirmed { quantity }, allocations) => Hit::Confirmed {
                    product_id: pid,
                    units: quantity,
                    allocations,
                },
                (OrderOutcome::OutOfStock, _) => Hit::OutOfStock,
                // The hot product has no limit: a refusal for one is wrong.
                (OrderOutcome::LimitExceeded { .. }, _) => Hit::Failed("409 LIMIT_EXCEEDED".into()),
                (OrderOutcome::Failed(label), _) => Hit::Failed(label),
            }
        }
    })
    .await?;

    let books = per_location(&api, &meta.product_id, &stock, &tally.allocated).await;
    Ok(TimedReport::hot_sku(meta, &tally, books))
}

/// The books at each location of a product the run spread over several, read back once
/// every order has been answered; `None` when its stock is all at `default`.
async fn per_location(
    api: &Api,
    product_id: &str,
    stock: &Stock,
    allocated: &Allocated,
) -> Option<PerLocation> {
    let given = stock.at()?;
    let read = api.final_read(product_id, chrono::Utc::now()).await.ok();
    let levels = read.as_ref().map(|r| r.levels.as_slice());
    Some(PerLocation::of(given, allocated, levels))
}
