//! loadtest: the flash-sale load tool and benchmark driver for stockgate. Talks HTTP only
//! to one base URL; never links the service.

mod cli;
mod client;
mod locations;
mod modes;
mod report;
mod samples;
mod stats;

use anyhow::Result;
use clap::Parser;
use cli::{Cli, Mode};
use client::Api;
use modes::Ctx;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("loadtest: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Runs the chosen mode, prints its report and writes the requested files; `Ok(false)`
/// when the run found a problem (oversold, failed requests, stock mismatch, ...).
async fn run(cli: Cli) -> Result<bool> {
    let common = cli.common;
    let connections = match &cli.mode {
        Mode::FlashSale(a) => a.concurrency + a.pollers,
        Mode::SellOut(a) => a.concurrency + a.pollers,
        Mode::HotSku(a) => a.concurrency,
        Mode::Availability(a) => a.concurrency,
        Mode::Checkout(a) => a.concurrency,
    } as usize
        + 4;
    let api = Api::new(
        &common.base_url,
        common.admin_token.clone(),
        connections,
        Duration::from_secs(common.request_timeout),
    )?;
    if !matches!(cli.mode, Mode::Availability(ref a) if a.product_id.is_some()) {
        api.require_token()?;
    }
    let ctx = Ctx {
        api: Arc::new(api),
        deadline: Instant::now() + Duration::from_secs(common.max_seconds),
        warmup: !common.no_warmup,
    };

    let (text, json, ok) = match cli.mode {
        Mode::FlashSale(a) => {
            let html = a.html.clone();
            let (r, run) = modes::flash_sale::run(&ctx, a).await?;
            report::html::write(html.as_deref(), &r, &run)?;
            report::outputs(&r)?
        }
        Mode::SellOut(a) => {
            let html = a.html.clone();
            let (r, run) = modes::sell_out::run(&ctx, a).await?;
            report::html::write(html.as_deref(), &r, &run)?;
            report::outputs(&r)?
        }
        Mode::HotSku(a) => {
            let r = modes::hot_sku::run(&ctx, a).await?;
            report::outputs(&r)?
        }
        Mode::Availability(a) => {
            let r = modes::availability::run(&ctx, a).await?;
            report::outputs(&r)?
        }
        Mode::Checkout(a) => {
            let r = modes::checkout::run(&ctx, a).await?;
            report::outputs(&r)?
        }
    };
    print!("{text}");
    if let Some(path) = &common.json {
        report::write_file(path, json + "\n")?;
    }
    Ok(ok)
}
