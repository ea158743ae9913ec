//! `stockgate`: thin entry point. Telemetry, then the command line; configuration errors
//! are one line on stderr and exit 2, run-time failures one line and exit 1 (`verify`: 1 when
//! stock disagrees with its ledger, 2 when it could not check).

use clap::Parser;
use stockgate::cli::{self, Cli, Failure};

/// mimalloc instead of glibc's malloc: side by side under wrk it took less CPU per request
/// for a little more memory (the figures: `bench/results/`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    stockgate::telemetry::init(matches!(cli.command, cli::Command::Serve));
    match cli::run(cli).await {
        Ok(()) => {}
        Err(Failure::Config(msg)) => {
            eprintln!("stockgate: configuration error: {msg}");
            std::process::exit(2);
        }
        Err(Failure::Runtime(e)) => {
            eprintln!("stockgate: error: {e:#}");
            std::process::exit(1);
        }
        Err(Failure::Disagreement) => std::process::exit(1),
        Err(Failure::Unchecked(e)) => {
            eprintln!("stockgate: could not check: {e:#}");
            std::process::exit(2);
        }
    }
}
