//! Command line: the options every mode shares and one subcommand per load mode.

use crate::locations::MAX_LOCATIONS;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// Flash-sale load tool and benchmark driver for stockgate. Talks HTTP only, to one
/// base URL; every run is bounded in request count and in time.
#[derive(Debug, Parser)]
#[command(name = "loadtest", version)]
pub struct Cli {
    #[command(subcommand)]
    pub mode: Mode,
    #[command(flatten)]
    pub common: Common,
}

/// Options accepted by every mode (before or after the mode name).
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// The deployment to load; nothing else is ever contacted.
    #[arg(
        long,
        global = true,
        env = "STOCKGATE_BASE_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub base_url: String,
    /// Admin bearer token (creates products and orders on behalf of distinct buyers).
    #[arg(
        long,
        global = true,
        env = "STOCKGATE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Safety stop: no request is started after this many seconds, and none outlives it.
    #[arg(long, global = true, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub max_seconds: u64,
    /// Per-request timeout in seconds (a timed-out request counts as an error).
    #[arg(long, global = true, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    pub request_timeout: u64,
    /// Also write the report as JSON to this file.
    #[arg(long, global = true, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Do not open the connection pool before the clock starts.
    #[arg(long, global = true)]
    pub no_warmup: bool,
}

#[derive(Debug, Subcommand)]
pub enum Mode {
    /// A fresh product with little stock, many distinct buyers at once, availability
    /// pollers alongside; checks nothing is oversold and no answer lies after sell-out.
    FlashSale(FlashSaleArgs),
    /// One product with huge stock, workers ordering back-to-back: confirmed orders/s.
    HotSku(HotSkuArgs),
    /// Like flash-sale, focused on how fast everyone after the sell-out is turned away.
    SellOut(SellOutArgs),
    /// GET availability back-to-back on one product: req/s, latency, who answered, staleness.
    Availability(AvailabilityArgs),
    /// Buyers hold a cart, pay (a delay), then confirm, release or walk away: checks
    /// nothing is oversold and nothing stays held once every hold has ended.
    Checkout(CheckoutArgs),
}

#[derive(Debug, Clone, Args)]
pub struct FlashSaleArgs {
    /// Units of stock the fresh product starts with.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(1..=2_000_000_000))]
    pub stock: u32,
    /// Distinct buyers; each places --attempts-per-buyer orders, each with its own
    /// Idempotency-Key.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub buyers: u64,
    /// Orders each buyer sends, each with a fresh Idempotency-Key; one buyer's attempts are
    /// queued one after another, so at --concurrency above 1 they race each other.
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub attempts_per_buyer: u32,
    /// Create the product with this max_per_customer: 409 LIMIT_EXCEEDED is then an expected
    /// answer, and the run fails if any buyer gets more units than this.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub max_per_customer: Option<u32>,
    /// Orders in flight at most.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,
    /// Units per order.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub qty: u32,
    /// Tasks polling availability continuously while the buyers run.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=1_000))]
    pub pollers: u32,
    /// Id of the product to create (must not exist yet); default flash-<timestamp>-<random>.
    #[arg(long, value_parser = parse_product_id)]
    pub product_id: Option<String>,
    /// Spread the fresh product's stock over N locations this run creates (ids unique to
    /// the run, ranked before `default`, the remainder to the first) and check the books at
    /// each: a location allocated more than it was given fails the run. 1: all at `default`.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LOCATIONS)))]
    pub locations: u32,
    /// Also write a self-contained HTML report with charts to this file.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct SellOutArgs {
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(1..=2_000_000_000))]
    pub stock: u32,
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub buyers: u64,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub qty: u32,
    /// Availability pollers alongside the buyers (none by default: this mode measures orders).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000))]
    pub pollers: u32,
    #[arg(long, value_parser = parse_product_id)]
    pub product_id: Option<String>,
    /// Spread the fresh product's stock over N locations this run creates (ids unique to
    /// the run, ranked before `default`, the remainder to the first) and check the books at
    /// each: a location allocated more than it was given fails the run. 1: all at `default`.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LOCATIONS)))]
    pub locations: u32,
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct HotSkuArgs {
    /// How long the workers order.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub seconds: u64,
    /// Workers, each with one order in flight.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub qty: u32,
    /// Stock of the fresh product.
    #[arg(long, default_value_t = 2_000_000_000, value_parser = clap::value_parser!(u32).range(1..=2_147_483_647))]
    pub stock: u32,
    /// Id of the product to create (must not exist yet); default hot-<timestamp>-<random>.
    #[arg(long, value_parser = parse_product_id)]
    pub product_id: Option<String>,
    /// Order `--product-id` as it is, without creating it (several loadtests, e.g. one per
    /// instance, on one hot product).
    #[arg(long, requires = "product_id")]
    pub existing: bool,
    /// Spread the fresh product's stock over N locations this run creates (ids unique to
    /// the run, ranked before `default`, the remainder to the first) and check the books at
    /// each: a location allocated more than it was given fails the run. 1: all at `default`.
    #[arg(long, value_name = "N", conflicts_with = "existing", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LOCATIONS)))]
    pub locations: u32,
}

#[derive(Debug, Clone, Args)]
pub struct AvailabilityArgs {
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub seconds: u64,
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,
    /// The `qty` asked about.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub qty: u32,
    /// An existing product to ask about; default: create a fresh one.
    #[arg(long, value_parser = parse_product_id)]
    pub product_id: Option<String>,
    /// Replica answers staler than this count as too stale.
    #[arg(long, default_value_t = 250)]
    pub stale_limit_ms: u64,
}

#[derive(Debug, Clone, Args)]
pub struct CheckoutArgs {
    /// Fresh products to create; every cart draws its lines from them.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub products: u32,
    /// Units of stock each product starts with.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(0..=2_000_000_000))]
    pub stock: u32,
    /// Buyers; each takes one hold (its own Idempotency-Key) and ends it one way.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub buyers: u64,
    /// Buyers in flight at once (each holds one connection while it pays).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,
    /// Distinct products per cart (at most --products).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub lines: u32,
    /// Units per cart line.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub qty: u32,
    /// Seconds each hold lasts unless confirmed or released.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=3_600))]
    pub ttl_s: u32,
    /// Shortest payment delay between hold and its ending (ms).
    #[arg(long, default_value_t = 0)]
    pub delay_min_ms: u64,
    /// Longest payment delay (ms); each buyer's is uniform in [min, max].
    #[arg(long, default_value_t = 200)]
    pub delay_max_ms: u64,
    /// Share of buyers who do not confirm (0–1).
    #[arg(long, default_value_t = 0.2, value_parser = parse_share)]
    pub abandon: f64,
    /// Share of those abandoners who release the hold; the rest walk away and let it expire.
    #[arg(long, default_value_t = 0.5, value_parser = parse_share)]
    pub release_share: f64,
    /// Seed for carts, delays and endings (default: random; printed in the report).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Spread every product's stock over N locations this run creates (ids unique to the
    /// run, ranked before `default`, the remainder to the first) and check each product's
    /// books at each: a location allocated more than it was given fails the run. 1: all at
    /// `default`.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LOCATIONS)))]
    pub locations: u32,
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err("a share is a number from 0 to 1".into()),
    }
}

/// The service's product id rule: 1–64 characters of `[A-Za-z0-9_.-]`.
pub fn parse_product_id(s: &str) -> Result<String, String> {
    let ok = (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(s.to_string())
    } else {
        Err("a product id is 1-64 characters of A-Z a-z 0-9 _ . -".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_options_go_after_the_mode() {
        let cli = Cli::try_parse_from([
            "loadtest",
            "flash-sale",
            "--base-url",
            "http://127.0.0.1:1",
            "--admin-token",
            "t",
            "--stock",
            "5",
        ])
        .expect("valid command line");
        assert_eq!(cli.common.base_url, "http://127.0.0.1:1");
        assert_eq!(cli.common.max_seconds, 300);
        let Mode::FlashSale(a) = cli.mode else {
            panic!("expected flash-sale")
        };
        assert_eq!(
            (a.stock, a.buyers, a.concurrency, a.qty, a.pollers),
            (5, 2000, 200, 1, 4)
        );
        assert_eq!((a.attempts_per_buyer, a.max_per_customer), (1, None));
        // One location, `default`, unless asked: the run of before locations.
        assert_eq!(a.locations, 1);
    }

    #[test]
    fn locations_are_1_to_50_and_not_for_an_existing_product() {
        let parse = |args: &[&str]| Cli::try_parse_from(["loadtest"].iter().chain(args));
        let at = |args: &[&str]| match parse(args).map(|cli| cli.mode) {
            Ok(Mode::SellOut(a)) => Some(a.locations),
            Ok(Mode::Checkout(a)) => Some(a.locations),
            Ok(Mode::HotSku(a)) => Some(a.locations),
            _ => None,
        };
        assert_eq!(at(&["sell-out", "--locations", "3"]), Some(3));
        assert_eq!(at(&["checkout", "--locations", "50"]), Some(50));
        assert_eq!(at(&["hot-sku", "--locations", "2"]), Some(2));
        assert!(parse(&["flash-sale", "--locations", "0"]).is_err());
        assert!(parse(&["flash-sale", "--locations", "51"]).is_err());
        // An existing product's stock is where it is: the run spreads nothing.
        let existing = [
            "hot-sku",
            "--product-id",
            "p",
            "--existing",
            "--locations",
            "2",
        ];
        assert!(parse(&existing).is_err());
        assert!(parse(&existing[..4]).is_ok());
    }

    #[test]
    fn flash_sale_takes_a_limit_and_attempts_per_buyer() {
        let parse = |extra: &[&str]| {
            let args = ["loadtest", "flash-sale"].iter().chain(extra).copied();
            Cli::try_parse_from(args).map(|cli| match cli.mode {
                Mode::FlashSale(a) => (a.attempts_per_buyer, a.max_per_customer),
                _ => panic!("expected flash-sale"),
            })
        };
        let limited = parse(&["--max-per-customer", "2", "--attempts-per-buyer", "5"]);
        assert_eq!(limited.expect("valid"), (5, Some(2)));
        // The service's range for max_per_customer is 1-10,000.
        assert!(parse(&["--max-per-customer", "0"]).is_err());
        assert!(parse(&["--max-per-customer", "10001"]).is_err());
        assert!(parse(&["--attempts-per-buyer", "0"]).is_err());
    }

    #[test]
    fn product_ids_follow_the_service_rule() {
        assert!(parse_product_id("flash-60_v1.2").is_ok());
        assert!(parse_product_id("").is_err());
        assert!(parse_product_id("has space").is_err());
        assert!(parse_product_id(&"x".repeat(65)).is_err());
    }

    #[test]
    fn shares_are_between_zero_and_one() {
        assert_eq!(parse_share("0.2"), Ok(0.2));
        assert!(parse_share("1.5").is_err());
        assert!(parse_share("-0.1").is_err());
        assert!(parse_share("x").is_err());
    }
}
