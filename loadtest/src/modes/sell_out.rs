//! sell-out: like flash-sale, but about the crowd that arrives after the stock is gone —
//! how fast the service turns them away (rejections/s after the sell-out moment).

use super::Ctx;
use super::sale::{self, SaleArgs};
use crate::cli::SellOutArgs;
use crate::report::SaleReport;
use crate::samples::SaleRun;
use anyhow::Result;

pub async fn run(ctx: &Ctx, a: SellOutArgs) -> Result<(SaleReport, SaleRun)> {
    let run = sale::run(
        ctx,
        SaleArgs {
            mode: "sell-out",
            id_prefix: "sellout",
            product_id: a.product_id,
            stock: a.stock,
            buyers: a.buyers,
            attempts_per_buyer: 1,
            max_per_customer: None,
            concurrency: a.concurrency,
            qty: a.qty,
            pollers: a.pollers,
            locations: a.locations,
        },
    )
    .await?;
    Ok((SaleReport::build(&run), run))
}
