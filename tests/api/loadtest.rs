//! The load tool (`loadtest`, its own binary: it talks HTTP only and never links the service)
//! run against a real service, its report held to what the database says.
//!
//! The binary is `LOADTEST_BIN`, else `loadtest` beside this test binary in `target/`:
//! `cargo build -p loadtest` first (`./dev test` does). A missing or stale one (older than
//! `loadtest/`'s sources) skips the test outside CI and fails it in CI.

use crate::helpers::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Units per location.
type PerLocation = BTreeMap<String, i64>;

/// The newest modification time of `dir` and everything under it.
fn newest(dir: &Path) -> SystemTime {
    let mut latest = std::fs::metadata(dir).unwrap().modified().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let at = if path.is_dir() {
            newest(&path)
        } else {
            std::fs::metadata(&path).unwrap().modified().unwrap()
        };
        latest = latest.max(at);
    }
    latest
}

/// The loadtest binary, if there is a fresh one (see the module doc).
fn loadtest_bin(test: &str) -> Option<PathBuf> {
    let bin = match std::env::var_os("LOADTEST_BIN") {
        Some(path) => PathBuf::from(path),
        // This binary is target/<profile>/deps/api-<hash>; loadtest is target/<profile>/.
        None => std::env::current_exe()
            .unwrap()
            .parent()?
            .parent()?
            .join("loadtest"),
    };
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest");
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
    let problem = match built {
        None => "is missing",
        Some(at) if at < newest(&sources) => "is older than loadtest's sources",
        Some(_) => return Some(bin),
    };
    let reason = format!("{} {problem}: cargo build -p loadtest", bin.display());
    skip_outside_ci(test, &reason);
    None
}

/// Runs the tool with `args` against `app` and returns its JSON report, asserting it
/// exited 0 (its verdict: OK); the text report is printed.
async fn run_loadtest(bin: &Path, app: &TestApp, args: &[&str]) -> Value {
    let json = std::env::temp_dir().join(format!("loadtest-{}.json", uuid::Uuid::new_v4()));
    let out = tokio::process::Command::new(bin)
        .args(args)
        .args(["--base-url", &app.address, "--admin-token", &app.admin])
        .args(["--max-seconds", "120", "--json"])
        .arg(&json)
        .kill_on_drop(true)
        .output()
        .await
        .expect("run loadtest");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "loadtest {args:?}: {}\n{text}\n{err}",
        out.status
    );
    let report = std::fs::read_to_string(&json).expect("the --json report");
    let _ = std::fs::remove_file(&json);
    serde_json::from_str(&report).unwrap()
}

/// The report's per-location column `field`, by location: of the locations the stock was
/// spread over (`spread` true), or of all its rows.
fn column(report: &Value, field: &str, spread: bool) -> PerLocation {
    let books = &report["per_location"];
    let rows = books["locations"].as_array().unwrap();
    let n = if spread {
        books["spread_over"].as_u64().unwrap() as usize
    } else {
        rows.len()
    };
    rows.iter()
        .take(n)
        .map(|r| {
            let id = r["location_id"].as_str().unwrap().to_string();
            (id, r[field].as_i64().unwrap())
        })
        .collect()
}

/// Each location's count of `product`, from the database.
async fn levels_in_db(app: &TestApp, product: &str) -> PerLocation {
    let rows: Vec<(String, i32)> = sqlx::query_as(
        "SELECT location_id, available_quantity FROM stock_levels WHERE product_id = $1",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap();
    rows.into_iter().map(|(l, n)| (l, i64::from(n))).collect()
}

/// Units of `product` in confirmed orders' allocations, per location, from the database.
async fn allocated_in_db(app: &TestApp, product: &str) -> PerLocation {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT a->>'location_id', sum((a->>'quantity')::bigint)::bigint \
           FROM orders o, jsonb_array_elements(o.allocations) a \
          WHERE o.status = 'confirmed' AND a->>'product_id' = $1 \
          GROUP BY 1",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap();
    rows.into_iter().collect()
}

// Mutations that fail this test: the tool not counting an answer's allocations
// (`add_allocations` dropped from `Sale::buy`: every location's books are off, the run FAILs
// and exits 1); the tool creating the product with its whole stock at `default` while it
// books 9/7/7 at its own locations (`create_limited_product` always sending
// `available_quantity`); the tool not reading the page's `stock` back (`levels: Vec::new()`
// in `final_read`: nothing is left anywhere, so no location balances).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flash_sale_spread_over_three_locations_books_each_location_as_the_database_does() {
    let test = "flash_sale_spread_over_three_locations_books_each_location_as_the_database_does";
    let Some(bin) = loadtest_bin(test) else {
        return;
    };
    let app = spawn_app(shared_cluster()).await;
    // 23 units: 9, 7 and 7. Buyers of 2 take 2 from the first location that has them, so
    // three 1s are left, and one order has to be split over two locations before the last
    // unit can be sold to nobody.
    let report = run_loadtest(
        &bin,
        &app,
        &[
            "flash-sale",
            "--locations",
            "3",
            "--stock",
            "23",
            "--qty",
            "2",
            "--buyers",
            "30",
            "--concurrency",
            "8",
            "--pollers",
            "1",
        ],
    )
    .await;
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["per_location"]["oversold"], 0, "{report}");
    let product = report["product_id"].as_str().unwrap();

    let given = column(&report, "given", true);
    assert_eq!(given.values().copied().collect::<Vec<_>>(), [9, 7, 7]);
    // The run's own locations, ranked 10, 11, 12 (before `default`, at 100).
    let ranks: Vec<(String, i32)> = sqlx::query_as(
        "SELECT location_id, rank FROM locations WHERE location_id = ANY($1) ORDER BY rank",
    )
    .bind(given.keys().cloned().collect::<Vec<_>>())
    .fetch_all(&app.primary)
    .await
    .unwrap();
    let ranks: Vec<i32> = ranks.iter().map(|(_, r)| *r).collect();
    assert_eq!(ranks, [10, 11, 12]);

    // The tool's numbers are the database's: what it saw allocated, what it read as left.
    let left = levels_in_db(&app, product).await;
    let allocated = allocated_in_db(&app, product).await;
    assert_eq!(column(&report, "left", false), left, "{report}");
    let nonzero =
        |m: PerLocation| -> PerLocation { m.into_iter().filter(|(_, n)| *n != 0).collect() };
    assert_eq!(
        nonzero(column(&report, "allocated", false)),
        allocated,
        "{report}"
    );
    for (location, g) in &given {
        let sold = allocated.get(location).copied().unwrap_or(0);
        assert_eq!(*g, sold + left[location], "{location}: {report}");
    }
    assert_eq!(allocated.values().sum::<i64>(), 22, "{report}");
}
