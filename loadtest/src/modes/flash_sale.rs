//! flash-sale: little stock, many distinct buyers at once, availability pollers alongside;
//! passes only if nothing was oversold, nothing failed, no answer lied and the stock adds up.

use super::Ctx;
use super::sale::{self, SaleArgs};
use crate::cli::FlashSaleArgs;
use crate::report::SaleReport;
use crate::samples::SaleRun;
use anyhow::Result;

pub async fn run(ctx: &Ctx, a: FlashSaleArgs) -> Result<(SaleReport, SaleRun)> {
    let run = sale::run(
        ctx,
        SaleArgs {
            mode: "flash-sale",
            id_prefix: "flash",
            product_id: a.product_id,
            stock: a.stock,
            buyers: a.buyers,
            concurrency: a.concurrency,
            qty: a.qty,
            pollers: a.pollers,
        },
    )
    .await?;
    Ok((SaleReport::build(&run), run))
}
