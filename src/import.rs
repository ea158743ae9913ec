//! Bulk import of products from CSV, throttled against live replica staleness.

use crate::config::Config;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// CSV with header product_id,name,price_cents,available_quantity.
    #[arg(long)]
    pub file: PathBuf,
}

pub async fn run(_config: &Config, _args: ImportArgs) -> anyhow::Result<()> {
    eprintln!("stockgate import: not yet implemented");
    std::process::exit(2);
}
