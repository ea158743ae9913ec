//! The `stockgate` command line (the contract's subcommands).

mod import;
mod verify;

use crate::auth::{Caller, Tokens};
use crate::clock::SystemClock;
use crate::config::{Config, ConfigError, parse_duration};
use crate::domain::UserId;
use crate::routing::freshness::ReplicaState;
use crate::startup::{self, Application};
use clap::{Args, Parser, Subcommand};
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "stockgate",
    version,
    about = "Inventory and checkout that never oversells and never lets a lagging replica decide"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the HTTP service until SIGINT/SIGTERM, then drain in-flight requests and exit 0.
    Serve,
    /// Apply the migrations in migrations/ to the primary (safe to run twice).
    Migrate,
    /// Print one line per replica: name, state, staleness, lag in bytes.
    Replicas,
    /// Print a bearer token for a user or an admin, signed with STOCKGATE_TOKEN_SECRET.
    Token(TokenArgs),
    /// Bulk-load products and stock from CSV, throttled against a live replication-lag budget.
    Import(import::ImportArgs),
    /// Check every product's stock at every location against its ledger; one line per
    /// disagreement. Exit 0: all agree; 1: some disagree; 2: could not check.
    Verify,
}

#[derive(Args)]
pub struct TokenArgs {
    #[command(flatten)]
    who: Who,
    /// How long the token is valid, e.g. 24h, 30m, 90s.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    ttl: Duration,
}

#[derive(Args)]
#[group(required = true, multiple = false)]
struct Who {
    /// The user the token acts for.
    #[arg(long)]
    user: Option<String>,
    /// An admin token.
    #[arg(long)]
    admin: bool,
}

/// How a subcommand failed: configuration (exit 2) or at run time (exit 1); for `verify`,
/// stock that disagrees with its ledger (exit 1, the report is on stdout) or a check that
/// could not be made (exit 2).
pub enum Failure {
    Config(ConfigError),
    Runtime(anyhow::Error),
    Disagreement,
    Unchecked(anyhow::Error),
}

impl From<ConfigError> for Failure {
    fn from(e: ConfigError) -> Self {
        Failure::Config(e)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        match e.downcast::<ConfigError>() {
            Ok(c) => Failure::Config(c),
            Err(e) => Failure::Runtime(e),
        }
    }
}

pub async fn run(cli: Cli) -> Result<(), Failure> {
    let config = Config::from_env()?;
    match cli.command {
        Command::Serve => serve(&config).await,
        Command::Migrate => {
            startup::migrate(config.require_database_url()?).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Replicas => replicas(&config).await,
        Command::Token(args) => token(&config, args),
        Command::Import(args) => import::run(&config, args).await.map_err(Failure::from),
        Command::Verify => match verify::run(&config).await {
            Ok(verify::Found::Agreement) => Ok(()),
            Ok(verify::Found::Disagreement) => Err(Failure::Disagreement),
            Err(e) => Err(Failure::Unchecked(e)),
        },
    }
}

/// `stockgate serve`: until SIGINT/SIGTERM, then drain.
async fn serve(config: &Config) -> Result<(), Failure> {
    config.require_database_url()?;
    let app = Application::build(config).await?;
    tracing::info!(listen = %config.listen, replicas = config.replica_urls.len(), "stockgate serving");
    app.run_until(startup::shutdown_signal())
        .await
        .map_err(|e| Failure::Runtime(e.into()))?;
    tracing::info!("stopped");
    Ok(())
}

/// `stockgate replicas`: one line per replica, as the freshness monitor measures it.
async fn replicas(config: &Config) -> Result<(), Failure> {
    config.require_database_url()?;
    let (db, _monitor) = startup::build_db(
        config,
        Arc::new(SystemClock),
        &crate::metrics::Metrics::new(),
    )
    .await?;
    // Give the monitor a few samples to measure with.
    tokio::time::sleep(config.monitor_interval * 6 + Duration::from_millis(200)).await;
    let status = db.replica_status();
    if status.is_empty() {
        println!(
            "no replicas configured (STOCKGATE_REPLICA_URLS is empty): every read goes to the primary"
        );
    }
    for r in status {
        let staleness = match (r.state, r.staleness) {
            (ReplicaState::Down, _) | (_, None) => "-".to_string(),
            (_, Some(d)) => format!("{} ms", d.as_millis()),
        };
        let lag = r
            .lag_bytes
            .map(|b| format!("{b} B"))
            .unwrap_or_else(|| "-".into());
        let why = r.last_error.map(|e| format!("  ({e})")).unwrap_or_default();
        println!(
            "{:<10}  {:<8}  {:>10}  {:>12}{why}",
            r.name,
            r.state.as_str(),
            staleness,
            lag
        );
    }
    Ok(())
}

/// `stockgate token`: a signed bearer token for a user or an admin.
fn token(config: &Config, args: TokenArgs) -> Result<(), Failure> {
    let tokens = Tokens::new(config.require_token_secret()?);
    let caller = match (args.who.user, args.who.admin) {
        (Some(u), _) => Caller::User(
            UserId::parse(&u)
                .map_err(|e| Failure::Config(ConfigError(format!("--user: {}", e.message))))?,
        ),
        (None, _) => Caller::Admin,
    };
    println!("{}", tokens.issue(&caller, args.ttl)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_read_like_the_contract() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in ["", "s", "5x", "-1s", "0s", "1e400s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
