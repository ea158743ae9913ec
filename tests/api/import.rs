//! Bulk import throttled against a live replication-lag budget: the second incident's
//! 800,000-row import that left a replica 9 minutes behind must not happen again. And an
//! import states counts, it does not overwrite stock: an operator's re-run of yesterday's
//! file put 3 sold units of 10 back on sale (issue 13, item 3). Jobs can be stopped and are
//! dropped an hour after they end (item 7).

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stockgate::clock::ManualClock;

fn csv(rows: usize, prefix: &str) -> String {
    let mut s = String::from("product_id,name,price_cents,available_quantity\n");
    for i in 0..rows {
        s.push_str(&format!(
            "{prefix}-{i},Imported product {i},{},{}\n",
            100 + i % 900,
            i % 1000
        ));
    }
    s
}

async fn start_import(app: &TestApp, body: String, query: &str) -> String {
    let resp = app
        .client
        .post(app.url(&format!("/v1/admin/imports?{query}")))
        .bearer_auth(&app.admin)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    resp.json::<Value>().await.unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn job(app: &TestApp, id: &str) -> Value {
    app.get_json(&format!("/v1/admin/imports/{id}"), Some(&app.admin))
        .await
        .1
}

async fn wait_status(app: &TestApp, id: &str, status: &str, timeout: Duration) -> Value {
    app.wait_for(&format!("import {status}"), timeout, || async {
        job(app, id).await["status"] == status
    })
    .await;
    job(app, id).await
}

async fn product_count(app: &TestApp, prefix: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM products WHERE product_id LIKE $1")
        .bind(format!("{prefix}-%"))
        .fetch_one(&app.primary)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_paused_during_an_import_stops_it_until_resumed_and_every_row_arrives() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    let id = start_import(&app, csv(100_000, "p"), "lag_budget=200ms&batch_size=200").await;
    blocking(|| cluster.pause_replay(1)).unwrap();
    let waiting = wait_status(&app, &id, "waiting", Duration::from_secs(30)).await;
    assert!(
        waiting["waiting"]
            .as_str()
            .unwrap()
            .starts_with("replica-1 at "),
        "{waiting}"
    );
    // While it waits, nothing is written: the primary's row count stays put across many
    // polls of a job that still says it is waiting.
    let held = product_count(&app, "p").await;
    assert!(
        held < 100_000,
        "finished before the replica fell behind: {waiting}"
    );
    for _ in 0..30 {
        let j = job(&app, &id).await;
        assert_eq!(j["status"].as_str(), Some("waiting"), "{j}");
        assert_eq!(product_count(&app, "p").await, held, "written while {j}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    blocking(|| cluster.resume_replay(1)).unwrap();
    let done = wait_status(&app, &id, "done", Duration::from_secs(120)).await;
    assert_eq!(done["rows_done"].as_u64(), Some(100_000));
    assert!(done["paused_ms"].as_u64().unwrap() >= 1_500, "{done}");
    assert_eq!(product_count(&app, "p").await, 100_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_apply_delay_under_the_budget_lets_the_import_run_and_over_it_makes_it_wait() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    blocking(|| cluster.set_apply_delay(1, 300)).unwrap();
    // Precondition: the delay is in force (with WAL moving, replica-1 reads ~300 ms behind).
    {
        let _wal = WalTicker::start(app.primary.clone());
        app.wait_for(
            "the 300 ms delay to show",
            Duration::from_secs(10),
            || async {
                app.replica_states()
                    .await
                    .iter()
                    .any(|(n, _, st)| n == "replica-1" && st.unwrap_or(0) >= 250)
            },
        )
        .await;
    }
    let id = start_import(&app, csv(20_000, "under"), "lag_budget=2s").await;
    let done = wait_status(&app, &id, "done", Duration::from_secs(60)).await;
    assert_eq!(done["paused_ms"].as_u64(), Some(0), "{done}");
    assert!(
        done["max_staleness_seen_ms"].as_u64().unwrap() < 2_000,
        "{done}"
    );

    blocking(|| cluster.set_apply_delay(1, 1500)).unwrap();
    // Ten batches: each after the first waits for the 1.5 s delay to be replayed.
    let id = start_import(&app, csv(10_000, "over"), "lag_budget=500ms").await;
    let waiting = wait_status(&app, &id, "waiting", Duration::from_secs(30)).await;
    assert!(
        waiting["waiting"]
            .as_str()
            .unwrap()
            .contains("> 500 ms budget"),
        "{waiting}"
    );
    let done = wait_status(&app, &id, "done", Duration::from_secs(120)).await;
    assert!(done["paused_ms"].as_u64().unwrap() > 0, "{done}");
    assert_eq!(product_count(&app, "over").await, 10_000);
    blocking(|| cluster.set_apply_delay(1, 0)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_down_replica_is_reported_and_does_not_hold_the_import_hostage() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    blocking(|| cluster.stop_replica(2)).unwrap();
    app.wait_for("replica-2 down", Duration::from_secs(5), || async {
        app.replica_state("replica-2").await == "down"
    })
    .await;
    let id = start_import(&app, csv(5_000, "d"), "").await;
    let done = wait_status(&app, &id, "done", Duration::from_secs(60)).await;
    assert_eq!(
        done["down_replicas"],
        serde_json::json!(["replica-2"]),
        "{done}"
    );
    assert_eq!(product_count(&app, "d").await, 5_000);
    // Asked to wait for it, the import waits and says why.
    let id = start_import(&app, csv(5_000, "w"), "wait_for_down=true").await;
    let waiting = wait_status(&app, &id, "waiting", Duration::from_secs(10)).await;
    assert_eq!(waiting["waiting"], "replica-2 is down");
    assert_eq!(product_count(&app, "w").await, 0);
    blocking(|| cluster.start_replica(2)).unwrap();
    wait_status(&app, &id, "done", Duration::from_secs(60)).await;
    assert_eq!(product_count(&app, "w").await, 5_000);
}

fn run_import(app: &TestApp, file: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stockgate"))
        .args(["import", "--file"])
        .arg(file)
        .args(extra)
        .env("DATABASE_URL", shared_cluster().primary_url(&app.database))
        .env(
            "STOCKGATE_REPLICA_URLS",
            shared_cluster().replica_urls(&app.database),
        )
        .env("STOCKGATE_TOKEN_SECRET", SECRET)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_csv_is_refused_with_line_numbers_and_nothing_partial() {
    let app = spawn_app(shared_cluster()).await;
    let dir = std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.csv");
    let mut text = csv(10, "m").into_bytes();
    text.extend_from_slice(b"m-neg,Negative,100,-5\nm-num,Bad number,12x,1\nm-1,Duplicate,1,1\n");
    text.extend_from_slice(b"m-latin,caf\xe9,1,1\n");
    text.extend_from_slice(format!("m-huge,{},1,1\n", "x".repeat(10 * 1024 * 1024)).as_bytes());
    std::fs::write(&file, &text).unwrap();
    let out = blocking(|| run_import(&app, &file, &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for (line, what) in [
        (12, "out of range"),
        (13, "not a whole number"),
        (14, "duplicate"),
        (15, "UTF-8"),
        (16, "limit"),
    ] {
        assert!(
            stderr.contains(&format!("bad.csv:{line}: ")) && stderr.contains(what),
            "line {line} ({what}) in:\n{stderr}"
        );
    }
    assert!(stderr.contains("nothing was written"), "{stderr}");
    assert_eq!(product_count(&app, "m").await, 0);
    // A missing column: the whole file is refused, saying so.
    std::fs::write(dir.join("cols.csv"), "product_id,name,price_cents\nx,y,1\n").unwrap();
    let out = blocking(|| run_import(&app, &dir.join("cols.csv"), &[]));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("available_quantity"));
    // The endpoint refuses the same file with the bad lines listed.
    let resp = app
        .client
        .post(app.url("/v1/admin/imports"))
        .bearer_auth(&app.admin)
        .body(text.clone())
        .send()
        .await
        .unwrap();
    let refused = assert_error(&answer(resp).await, 422, "INVALID_CSV");
    assert_eq!(refused.bad_lines.map(|l| l.len()), Some(5));
    // With --skip-invalid, the valid rows go in and the bad ones are reported.
    let out = blocking(|| run_import(&app, &file, &["--skip-invalid"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(product_count(&app, "m").await, 10);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn importing_the_same_file_twice_is_harmless() {
    let app = spawn_app(shared_cluster()).await;
    let dir = std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ok.csv");
    std::fs::write(&file, csv(3_000, "twice")).unwrap();
    for _ in 0..2 {
        let out = blocking(|| run_import(&app, &file, &["--lag-budget", "2s"]));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("3000 of 3000 rows applied"), "{stdout}");
    }
    assert_eq!(product_count(&app, "twice").await, 3_000);
    let stock: i32 = sqlx::query_scalar(
        "SELECT available_quantity FROM products WHERE product_id = 'twice-1234'",
    )
    .fetch_one(&app.primary)
    .await
    .unwrap();
    assert_eq!(stock, 234);
    let _ = std::fs::remove_dir_all(dir);
}

/// A file of `(product_id, count)` lines.
fn stated(lines: &[(&str, i64)]) -> String {
    let mut s = String::from("product_id,name,price_cents,available_quantity\n");
    for (id, count) in lines {
        s.push_str(&format!("{id},Product {id},500,{count}\n"));
    }
    s
}

/// What one import did, however it was run.
#[derive(Debug, PartialEq)]
struct Applied {
    /// The import's id: the job's, or the one the CLI printed first.
    id: String,
    created: u64,
    changed: u64,
    unchanged: u64,
    clamped: u64,
    report: String,
}

#[derive(Clone, Copy, Debug)]
enum Via {
    Cli,
    Job,
}

async fn import_via(app: &TestApp, via: Via, text: String) -> Applied {
    match via {
        Via::Cli => {
            let dir =
                std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("counts.csv");
            std::fs::write(&file, text).unwrap();
            let out = blocking(|| run_import(app, &file, &["--lag-budget", "2s"]));
            let _ = std::fs::remove_dir_all(dir);
            let stdout = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            // "… rows applied in … : 0 new, 1 changed, 1 unchanged; 1 clamped at 0 (…): a, b; …"
            let count = |what: &str| -> u64 {
                let end = stdout.find(what).map(|i| &stdout[..i]).unwrap_or_default();
                let start = end
                    .trim_end()
                    .rfind(|c: char| !c.is_ascii_digit())
                    .map_or(0, |i| i + 1);
                end.trim_end()[start..].parse().unwrap_or(0)
            };
            // "import <uuid>: N rows from …"
            let id = stdout
                .strip_prefix("import ")
                .and_then(|rest| rest.split(':').next())
                .unwrap_or_default()
                .to_owned();
            Applied {
                id,
                created: count(" new,"),
                changed: count(" changed,"),
                unchanged: count(" unchanged"),
                clamped: count(" clamped at 0"),
                report: stdout,
            }
        }
        Via::Job => {
            let id = start_import(app, text, "lag_budget=2s").await;
            let done = wait_status(app, &id, "done", Duration::from_secs(30)).await;
            let n = |k: &str| done[k].as_u64().unwrap();
            Applied {
                id,
                created: n("rows_created"),
                changed: n("rows_changed"),
                unchanged: n("rows_unchanged"),
                clamped: n("rows_clamped"),
                report: done.to_string(),
            }
        }
    }
}

async fn sell(app: &TestApp, product: &str, units: usize) {
    for i in 0..units {
        let resp = app
            .order("buyer", &format!("{product}-sale-{i}"), product, 1)
            .await;
        assert_eq!(resp.status(), StatusCode::CREATED, "sale {i} of {product}");
    }
}

/// The incident, end to end: imported 10, sold 3, and an operator re-runs the file.
async fn an_import_keeps_what_was_sold(via: Via) {
    let app = spawn_app(shared_cluster()).await;
    let (p, other) = ("keep-10", "keep-other");
    let first = import_via(&app, via, stated(&[(p, 10), (other, 4)])).await;
    assert_eq!((first.created, first.changed), (2, 0), "{}", first.report);
    sell(&app, p, 3).await;
    // The precondition: the sales are in, on the primary.
    assert_eq!(app.confirmed_orders(p).await, (3, 3));
    assert_eq!(app.stock_on_primary(p).await, 7);

    // The same file again: nothing changes (the bug put the 3 sold units back: 10).
    let rerun = import_via(&app, via, stated(&[(p, 10), (other, 4)])).await;
    assert_eq!(app.stock_on_primary(p).await, 7, "{}", rerun.report);
    assert_eq!(
        (rerun.created, rerun.changed, rerun.unchanged),
        (0, 0, 2),
        "{}",
        rerun.report
    );

    // A recount finds 5 more: they are added to what is left.
    let recount = import_via(&app, via, stated(&[(p, 15), (other, 4)])).await;
    assert_eq!(app.stock_on_primary(p).await, 12, "{}", recount.report);
    assert_eq!(
        (recount.changed, recount.unchanged, recount.clamped),
        (1, 1, 0),
        "{}",
        recount.report
    );

    // A count lowered to 2 while 3 were sold since the product was first stated: stock
    // would be 12 + 2 - 15 = -1. It stops at 0, and the import says so.
    let lowered = import_via(&app, via, stated(&[(p, 2), (other, 4)])).await;
    assert_eq!(app.stock_on_primary(p).await, 0, "{}", lowered.report);
    assert_eq!(lowered.clamped, 1, "{}", lowered.report);
    assert!(
        lowered.report.contains(p),
        "the clamped product is named: {}",
        lowered.report
    );
    // The other product and the orders were never touched.
    assert_eq!(app.stock_on_primary(other).await, 4);
    assert_eq!(app.confirmed_orders(p).await, (3, 3));

    // Each import that moved stock is one `stock.changed` of reason `import` with the
    // difference it made: the new products' counts (the creating statement), then +5 and -12
    // for the restated one (the restating statement); the re-run that changed nothing has
    // none. Mutations: `'delta', stock` instead of `'delta', delta` in `stock::restate` (the
    // new stock reported as the change: 12 and 0), `'reason', 'restock'` in
    // `stock::create_many`.
    let feed = feed_until(&app, "the lowered count's event", |e| {
        e["type"] == "stock.changed"
            && e["data"]["product_id"] == p
            && e["data"]["available_quantity"] == 0
    })
    .await;
    let changes = |id: &str| -> Vec<(String, i64, i64)> {
        feed.iter()
            .filter(|e| e["type"] == "stock.changed" && e["data"]["product_id"] == id)
            .map(|e| {
                let d = &e["data"];
                (
                    d["reason"].as_str().unwrap_or("").to_owned(),
                    d["delta"].as_i64().unwrap(),
                    d["available_quantity"].as_i64().unwrap(),
                )
            })
            .collect()
    };
    let import = |delta, available| ("import".to_owned(), delta, available);
    assert_eq!(
        changes(p),
        [import(10, 10), import(5, 12), import(-12, 0)],
        "{via:?}"
    );
    assert_eq!(changes(other), [import(4, 4)], "{via:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_running_an_import_from_the_cli_after_sales_keeps_the_sold_units_sold() {
    an_import_keeps_what_was_sold(Via::Cli).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_running_an_import_job_after_sales_keeps_the_sold_units_sold() {
    an_import_keeps_what_was_sold(Via::Job).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_product_created_through_the_api_is_restated_from_its_creation_count() {
    let app = spawn_app(shared_cluster()).await;
    assert_eq!(
        app.create_product("made-20", 20, 100).await.status(),
        StatusCode::CREATED
    );
    sell(&app, "made-20", 2).await;
    assert_eq!(app.stock_on_primary("made-20").await, 18);
    // The file states what the product was created with: the 2 sold stay sold.
    let applied = import_via(&app, Via::Job, stated(&[("made-20", 20)])).await;
    assert_eq!(
        app.stock_on_primary("made-20").await,
        18,
        "{}",
        applied.report
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recount_that_restocks_a_sold_out_product_reopens_this_instances_gate_at_once() {
    let app = spawn_app(shared_cluster()).await;
    // The gate answers a sold-out product from memory until that answer is 250 ms old. A
    // recount that lands inside that window must be seen at once. Each attempt sells out a
    // new product, imports +5 and asks; it only counts if the answer came back within
    // 250 ms of the sale (else the cached "0" had expired anyway and proves nothing).
    let mut proven = 0;
    for attempt in 0..10 {
        let p = format!("reopen-{attempt}");
        assert_eq!(
            app.create_product(&p, 1, 100).await.status(),
            StatusCode::CREATED
        );
        let sale = Instant::now();
        sell(&app, &p, 1).await;
        let id = start_import(&app, stated(&[(&p, 6)]), "lag_budget=2s").await;
        wait_status(&app, &id, "done", Duration::from_secs(30)).await;
        let resp = app.availability(&p, 1).await;
        let within = sale.elapsed() < Duration::from_millis(250);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(app.stock_on_primary(&p).await, 5);
        if within {
            assert_eq!(body["available_quantity"], 5, "attempt {attempt}: {body}");
            proven += 1;
            if proven == 3 {
                return;
            }
        }
    }
    panic!(
        "only {proven} of 10 attempts answered within 250 ms of the sale; the machine is too loaded to prove anything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_job_finishes_its_batch_writes_no_more_and_says_cancelled() {
    let app = spawn_app(shared_cluster()).await;
    // stop-0 exists with another count, so the first batch must lock its row to restate it.
    assert_eq!(
        app.create_product("stop-0", 1, 100).await.status(),
        StatusCode::CREATED
    );
    let mut locker = app.primary.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM products WHERE product_id = 'stop-0' FOR UPDATE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let rows: Vec<(String, i64)> = (0..6).map(|i| (format!("stop-{i}"), 10)).collect();
    let lines: Vec<(&str, i64)> = rows.iter().map(|(id, n)| (id.as_str(), *n)).collect();
    let id = start_import(&app, stated(&lines), "batch_size=2&lag_budget=1h").await;
    // The precondition: the first batch is in flight, blocked on that row.
    app.wait_for(
        "the first batch waits for the row lock",
        Duration::from_secs(10),
        || async { sessions_waiting(&app.primary, "Lock", "%KEY UPDATE OF p%").await == 1 },
    )
    .await;
    assert_eq!(job(&app, &id).await["rows_done"], 0);

    let resp = app
        .client
        .delete(app.url(&format!("/v1/admin/imports/{id}")))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let stopping: Value = resp.json().await.unwrap();
    assert_eq!(stopping["status"], "stopping", "{stopping}");
    assert_eq!(stopping["job_id"], id.as_str());

    locker.commit().await.unwrap();
    let cancelled = wait_status(&app, &id, "cancelled", Duration::from_secs(10)).await;
    // The batch in flight went in whole; nothing after it.
    assert_eq!(cancelled["rows_done"], 2, "{cancelled}");
    assert!(cancelled["ended_at"].is_string(), "{cancelled}");
    assert_eq!(app.stock_on_primary("stop-0").await, 10);
    assert_eq!(product_count(&app, "stop").await, 2);
    // It stays cancelled: a second stop answers the same; an unknown job is a 404 error.
    let again = app
        .client
        .delete(app.url(&format!("/v1/admin/imports/{id}")))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.json::<Value>().await.unwrap()["status"], "cancelled");
    let unknown = app
        .client
        .delete(app.url(&format!("/v1/admin/imports/{}", uuid::Uuid::new_v4())))
        .bearer_auth(&app.admin)
        .send()
        .await
        .unwrap();
    assert_error(&answer(unknown).await, 404, "IMPORT_NOT_FOUND");
    // Re-running the file continues: the other four arrive, the two in stay as they are.
    let rest = import_via(&app, Via::Job, stated(&lines)).await;
    assert_eq!((rest.created, rest.unchanged), (4, 2), "{}", rest.report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_job_is_answered_for_an_hour_and_then_dropped() {
    let clock = ManualClock::new();
    let app = spawn_app_with(AppOptions {
        clock: clock.clone() as Arc<dyn stockgate::clock::Clock>,
        ..AppOptions::new(shared_cluster())
    })
    .await;
    let id = start_import(&app, stated(&[("drop-1", 3)]), "").await;
    let done = wait_status(&app, &id, "done", Duration::from_secs(30)).await;
    let ended = chrono::DateTime::parse_from_rfc3339(done["ended_at"].as_str().unwrap()).unwrap();
    let expires =
        chrono::DateTime::parse_from_rfc3339(done["expires_at"].as_str().unwrap()).unwrap();
    assert_eq!(expires - ended, chrono::Duration::hours(1), "{done}");

    clock.advance(Duration::from_secs(59 * 60));
    let (status, _) = app
        .get_json(&format!("/v1/admin/imports/{id}"), Some(&app.admin))
        .await;
    assert_eq!(status, StatusCode::OK, "still within the hour");

    // Past the hour (by a second: the wall clock the job's times are stated on is re-anchored
    // every second, which may move a mapping by microseconds).
    clock.advance(Duration::from_secs(61));
    let gone = app
        .get_json(&format!("/v1/admin/imports/{id}"), Some(&app.admin))
        .await;
    assert_error(&gone, 404, "IMPORT_NOT_FOUND");
    assert_eq!(
        app.state.imports.len(),
        0,
        "the job and its results are gone, not hidden"
    );
}

/// Ctrl-C of `stockgate import` while it waits for a paused replica: it stops after the
/// batch in flight, says it was interrupted (exit 1), writes nothing more, and re-running the
/// same file finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_stops_a_cli_import_after_its_batch_and_re_running_the_file_finishes_it() {
    let cluster = private_cluster();
    let app = spawn_app(&cluster).await;
    let dir = std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("big.csv");
    std::fs::write(&file, csv(100_000, "cc")).unwrap();
    let import = || {
        Command::new(env!("CARGO_BIN_EXE_stockgate"))
            .args([
                "import",
                "--lag-budget",
                "200ms",
                "--batch-size",
                "500",
                "--file",
            ])
            .arg(&file)
            .env("DATABASE_URL", cluster.primary_url(&app.database))
            .env(
                "STOCKGATE_REPLICA_URLS",
                cluster.replica_urls(&app.database),
            )
            .env("STOCKGATE_TOKEN_SECRET", SECRET)
            .current_dir(std::env::temp_dir())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let child = import();
    // The import is killed if the test fails before it has exited (and been reaped).
    struct KillOnDrop(Option<u32>);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if let Some(pid) = self.0 {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
    let mut guard = KillOnDrop(Some(child.id()));
    // Precondition: it has written some batches; then a paused replica holds it up.
    app.wait_for("the import under way", Duration::from_secs(30), || async {
        product_count(&app, "cc").await > 0
    })
    .await;
    blocking(|| cluster.pause_replay(1)).unwrap();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()));
    let out = blocking(|| rx.recv_timeout(Duration::from_secs(30)))
        .expect("the import did not stop within 30 s of Ctrl-C");
    guard.0 = None;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    let written = product_count(&app, "cc").await;
    assert!(
        (1..50_000).contains(&written),
        "{written} rows after Ctrl-C"
    );
    blocking(|| cluster.resume_replay(1)).unwrap();
    assert_eq!(
        product_count(&app, "cc").await,
        written,
        "nothing written after it exited"
    );
    let out = blocking(|| import().wait_with_output().unwrap());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(product_count(&app, "cc").await, 100_000);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file with a `location_id` column: `(product, location, count)` lines ("" leaves the
/// cell empty: `default`).
fn stated_at(lines: &[(&str, &str, i64)]) -> String {
    let mut s = String::from("product_id,name,price_cents,location_id,available_quantity\n");
    for (id, at, count) in lines {
        s.push_str(&format!("{id},Product {id},500,{at},{count}\n"));
    }
    s
}

async fn create_location(app: &TestApp, id: &str) {
    let resp = app
        .client
        .post(app.url("/v1/locations"))
        .bearer_auth(&app.admin)
        .json(&serde_json::json!({"location_id": id, "name": format!("Site {id}")}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED, "location {id}");
}

async fn set_location_active(app: &TestApp, id: &str, active: bool) {
    let resp = app
        .client
        .patch(app.url(&format!("/v1/locations/{id}")))
        .bearer_auth(&app.admin)
        .json(&serde_json::json!({ "active": active }))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "location {id} active={active}"
    );
}

/// A product's levels on the primary: location → (count, stated count).
async fn levels(app: &TestApp, product: &str) -> Vec<(String, i64, Option<i64>)> {
    sqlx::query_as::<_, (String, i32, Option<i32>)>(
        "SELECT location_id, available_quantity, stated_quantity FROM stock_levels \
          WHERE product_id = $1 ORDER BY location_id COLLATE \"C\"",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap()
    .into_iter()
    .map(|(l, n, s)| (l, n.into(), s.map(i64::from)))
    .collect()
}

/// A product's movements of reason `import`, oldest first: (location, delta, ref, count after).
async fn import_movements(app: &TestApp, product: &str) -> Vec<(String, i64, String, i64)> {
    sqlx::query_as::<_, (String, i32, Option<String>, i32)>(
        "SELECT location_id, delta, ref, available_after FROM movements \
          WHERE product_id = $1 AND reason = 'import' ORDER BY movement_id",
    )
    .bind(product)
    .fetch_all(&app.primary)
    .await
    .unwrap()
    .into_iter()
    .map(|(l, d, r, a)| (l, d.into(), r.unwrap_or_default(), a.into()))
    .collect()
}

/// Sells `units` of `product`, one order each, from `location` only.
async fn sell_at(app: &TestApp, product: &str, location: &str, units: usize) {
    for i in 0..units {
        let body =
            serde_json::json!({"product_id": product, "quantity": 1, "locations": [location]});
        let key = format!("{product}-{location}-sale-{i}");
        let (status, got) = send_as(
            app,
            reqwest::Method::POST,
            "/v1/orders",
            "buyer",
            Some(&key),
            body,
        )
        .await;
        assert_eq!(
            status,
            StatusCode::CREATED,
            "sale {i} of {product} at {location}: {got}"
        );
        assert_eq!(got["allocations"][0]["location_id"], location, "{got}");
    }
}

fn level(at: &str, count: i64, stated: i64) -> (String, i64, Option<i64>) {
    (at.to_owned(), count, Some(stated))
}

/// Issue 46: an import states counts per (product, location), each location on its own.
async fn an_import_states_each_location_on_its_own(via: Via) {
    let app = spawn_app(shared_cluster()).await;
    create_location(&app, "north").await;
    create_location(&app, "south").await;
    let (p, q) = ("loc-p", "loc-q");
    let file = |north, south| stated_at(&[(p, "north", north), (p, "south", south), (q, "", 3)]);

    // A new product kept at two locations: each level gets its count, the product their
    // sum, and no `default` level is made for it. Mutation: the location column ignored
    // (every row written at `default`: a duplicate level, or 14 at default).
    let first = import_via(&app, via, file(10, 4)).await;
    assert_eq!((first.created, first.changed), (3, 0), "{}", first.report);
    assert_eq!(
        levels(&app, p).await,
        [level("north", 10, 10), level("south", 4, 4)]
    );
    assert_eq!(app.stock_on_primary(p).await, 14);
    assert_eq!(levels(&app, q).await, [level("default", 3, 3)]);
    assert_eq!(app.stock_on_primary(q).await, 3);

    // 3 sold at north, then the same file again: nothing written, the sales stay sold.
    // Mutation: `stated_quantity = u.stated` dropped from the levels' UPDATE (the level's
    // last given count then reads as its 7 left, and the re-run puts north back to 10).
    sell_at(&app, p, "north", 3).await;
    assert_eq!(app.stock_on_primary(p).await, 11, "the sales are in");
    let rerun = import_via(&app, via, file(10, 4)).await;
    assert_eq!(
        (rerun.created, rerun.changed, rerun.unchanged),
        (0, 0, 3),
        "{}",
        rerun.report
    );
    assert_eq!(
        levels(&app, p).await,
        [level("north", 7, 10), level("south", 4, 4)]
    );
    assert_eq!(import_movements(&app, p).await.len(), 2);

    // A recount of south (+2) moves south only: north keeps its sales. Mutation: the levels'
    // UPDATE matched on the product alone (`s.location_id = u.loc` dropped: north gets +2).
    let recount = import_via(&app, via, file(10, 6)).await;
    assert_eq!(
        (recount.changed, recount.unchanged, recount.clamped),
        (1, 2, 0),
        "{}",
        recount.report
    );
    assert_eq!(
        levels(&app, p).await,
        [level("north", 7, 10), level("south", 6, 6)]
    );
    assert_eq!(app.stock_on_primary(p).await, 13);

    // North lowered to 2 with 3 sold since: 7 + 2 - 10 = -1 stops at 0, counted and named as
    // clamped; the movement records the change made (-7), not the one asked (-8). Mutations:
    // `restated.clamped` not counted; the level's delta pushed as `file − stated` (-8) with
    // the movement's delta taken from `u.delta` instead of `moved`.
    let lowered = import_via(&app, via, file(2, 6)).await;
    assert_eq!(lowered.clamped, 1, "{}", lowered.report);
    assert!(lowered.report.contains("loc-p@north"), "{}", lowered.report);
    assert_eq!(
        levels(&app, p).await,
        [level("north", 0, 2), level("south", 6, 6)]
    );
    assert_eq!(app.stock_on_primary(p).await, 6);

    // Each change is one movement, reason `import`, ref the import that made it. Mutation:
    // `ref` bound to NULL (as before every import had an id).
    let by = |a: &Applied, at: &str, delta, after| (at.to_owned(), delta, a.id.clone(), after);
    assert!(!first.id.is_empty() && first.id != lowered.id, "{first:?}");
    assert_eq!(
        import_movements(&app, p).await,
        [
            by(&first, "north", 10, 10),
            by(&first, "south", 4, 4),
            by(&recount, "south", 2, 6),
            by(&lowered, "north", -7, 0),
        ]
    );
    assert_eq!(
        import_movements(&app, q).await,
        [by(&first, "default", 3, 3)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_import_with_locations_restates_each_location_on_its_own() {
    an_import_states_each_location_on_its_own(Via::Cli).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_job_with_locations_restates_each_location_on_its_own() {
    an_import_states_each_location_on_its_own(Via::Job).await;
}

/// An inactive location's stock is not counted as available: an import restates its level
/// (and writes its movement) but the product's count does not move. Mutation: the `active`
/// join dropped from `gained` in `stock::import::restate` (the product's count would gain the
/// inactive level's change: 5 + 6, and 7 for the new product).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inactive_locations_level_is_restated_but_the_products_count_does_not_move() {
    let app = spawn_app(shared_cluster()).await;
    create_location(&app, "closed").await;
    let (r, fresh) = ("inact-r", "inact-new");
    import_via(
        &app,
        Via::Job,
        stated_at(&[(r, "default", 5), (r, "closed", 4)]),
    )
    .await;
    assert_eq!(app.stock_on_primary(r).await, 9);
    set_location_active(&app, "closed", false).await;
    assert_eq!(app.stock_on_primary(r).await, 5, "the deactivation is in");

    let file = stated_at(&[(r, "default", 5), (r, "closed", 10), (fresh, "closed", 7)]);
    let applied = import_via(&app, Via::Job, file).await;
    assert_eq!(
        (applied.created, applied.changed, applied.unchanged),
        (1, 1, 1),
        "{}",
        applied.report
    );
    assert_eq!(
        levels(&app, r).await,
        [level("closed", 10, 10), level("default", 5, 5)]
    );
    assert_eq!(app.stock_on_primary(r).await, 5);
    assert_eq!(levels(&app, fresh).await, [level("closed", 7, 7)]);
    assert_eq!(app.stock_on_primary(fresh).await, 0);
    assert_eq!(import_movements(&app, r).await.last().map(|m| m.1), Some(6));
    // Reactivated, the restated level counts.
    set_location_active(&app, "closed", true).await;
    assert_eq!(app.stock_on_primary(r).await, 15);
    assert_eq!(app.stock_on_primary(fresh).await, 7);
}

/// A location that does not exist is found before anything is written: the CLI names the
/// line and the location and writes none of the file; a (product, location) twice is a bad
/// line too. Mutation: `set_aside_unknown_locations` not called (the batch fails on the
/// foreign key: no line named, exit without "unknown location"), or called after the first
/// batch (with `--batch-size 1`, the lines before it are written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_location_is_a_bad_line_named_before_anything_is_written() {
    let app = spawn_app(shared_cluster()).await;
    create_location(&app, "east").await;
    let dir = std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("where.csv");
    let text = stated_at(&[
        ("unk-1", "east", 5),
        ("unk-2", "", 4),
        ("unk-3", "atlantis", 2),
        ("unk-1", "east", 6),
        ("unk-4", "east", 1),
    ]);
    std::fs::write(&file, &text).unwrap();
    let out = blocking(|| run_import(&app, &file, &["--batch-size", "1"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("where.csv:4: unknown location atlantis"),
        "{stderr}"
    );
    assert!(
        stderr.contains("where.csv:5: duplicate product_id unk-1 at location east"),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was written"), "{stderr}");
    assert_eq!(product_count(&app, "unk").await, 0);

    // The endpoint refuses it the same way, before starting a job.
    let resp = app
        .client
        .post(app.url("/v1/admin/imports"))
        .bearer_auth(&app.admin)
        .body(text)
        .send()
        .await
        .unwrap();
    let refused = assert_error(&answer(resp).await, 422, "INVALID_CSV");
    let lines: Vec<u64> = refused
        .bad_lines
        .unwrap_or_default()
        .iter()
        .filter_map(|b| b["line"].as_u64())
        .collect();
    assert_eq!(lines, [4, 5]);
    assert_eq!(product_count(&app, "unk").await, 0);

    // Skipping them, the rest goes in.
    let out = blocking(|| run_import(&app, &file, &["--skip-invalid"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(product_count(&app, "unk").await, 3);
    assert_eq!(levels(&app, "unk-1").await, [level("east", 5, 5)]);
    let _ = std::fs::remove_dir_all(dir);
}

/// A binary from before per-location imports (a rolling deploy) states `default`'s count in
/// `products.stated_quantity` only; the levels trigger carries it to the level, so an import by
/// this binary afterwards moves the level by what that binary stated, and what it sold since
/// stays sold. The test's own pool is such a session: it does not set `stockgate.levels`.
// Mutation: the trigger without `stated_quantity = NEW.stated_quantity` (or the update trigger
// not firing on `stated_quantity`): the level keeps the creation's 10, and our import of 20
// adds 10 units that the older binary's own import had already added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_binarys_stated_count_is_the_one_our_import_restates_from() {
    let app = spawn_app(shared_cluster()).await;
    let made = app.create_product("old-1", 10, 100).await;
    assert_eq!(made.status(), StatusCode::CREATED);
    // The older binary: sells 3, then imports a file stating 20 (its rule: +10, keeping the sale).
    sqlx::raw_sql(
        "UPDATE products SET available_quantity = available_quantity - 3 WHERE product_id = 'old-1'; \
         UPDATE products SET stated_quantity = 20, available_quantity = available_quantity + 10 WHERE product_id = 'old-1';",
    )
    .execute(&app.primary)
    .await
    .unwrap();
    let level = "SELECT available_quantity, stated_quantity FROM stock_levels WHERE product_id = 'old-1' AND location_id = 'default'";
    let got: (i32, Option<i32>) = sqlx::query_as(level).fetch_one(&app.primary).await.unwrap();
    assert_eq!(
        got,
        (17, Some(20)),
        "the level follows the older binary's writes"
    );
    // This binary imports the same file: nothing moves.
    let dir = std::env::temp_dir().join(format!("sg-import-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("old.csv");
    std::fs::write(
        &file,
        "product_id,name,price_cents,available_quantity\nold-1,Product old-1,100,20\n",
    )
    .unwrap();
    let out = blocking(|| run_import(&app, &file, &[]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: (i32, Option<i32>) = sqlx::query_as(level).fetch_one(&app.primary).await.unwrap();
    assert_eq!(got, (17, Some(20)), "the sold units stay sold");
    let _ = std::fs::remove_dir_all(dir);
}
