//! `stockgate`: thin entry point. Telemetry, then the command line; configuration errors
//! are one line on stderr and exit 2, run-time failures one line and exit 1.

use clap::Parser;
use stockgate::cli::{self, Cli, Failure};

/// mimalloc instead of glibc's malloc: side by side under wrk on 2 cores, 5–10 % less CPU per
/// request (availability 10.3 → 9.7 µs, an order 22.2 → 20.2 µs), for ~10 MiB more RSS.
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
    }
}
