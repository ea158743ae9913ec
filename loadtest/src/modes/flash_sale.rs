//! flash-sale: little stock, many distinct buyers at once, availability pollers alongside;
//! passes only if nothing was oversold, nothing failed, no answer lied and the stock adds up
//! — and, with `--max-per-customer`, no buyer got more than the limit (buyers may try
//! several times with `--attempts-per-buyer`).

use super::Ctx;
use super::sale::{self, SaleArgs};
use crate::cli::FlashSaleArgs;
use crate::report::SaleReport;
use crate::samples::SaleRun;
use anyhow::{Result, bail};

/// Orders one run may send in all (buyers × attempts), as many as buyers alone may be.
const MAX_ORDERS: u64 = 10_000_000;

pub async fn run(ctx: &Ctx, a: FlashSaleArgs) -> Result<(SaleReport, SaleRun)> {
    let args = SaleArgs {
        mode: "flash-sale",
        id_prefix: "flash",
        product_id: a.product_id,
        stock: a.stock,
        buyers: a.buyers,
        attempts_per_buyer: a.attempts_per_buyer,
        max_per_customer: a.max_per_customer,
        concurrency: a.concurrency,
        qty: a.qty,
        pollers: a.pollers,
        locations: a.locations,
    };
    if args.orders() > MAX_ORDERS {
        bail!("--buyers x --attempts-per-buyer must be at most {MAX_ORDERS} orders");
    }
    let run = sale::run(ctx, args).await?;
    Ok((SaleReport::build(&run), run))
}
