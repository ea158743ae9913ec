//! Bulk import throttled against a live replication-lag budget: the second incident's
//! 800,000-row import that left a replica 9 minutes behind must not happen again.

use crate::helpers::*;
use reqwest::StatusCode;
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

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
    // While it waits, nothing is written: the count stays put across many polls.
    let held = waiting["rows_done"].as_u64().unwrap();
    assert!(
        held < 100_000,
        "finished before the replica fell behind: {waiting}"
    );
    for _ in 0..30 {
        let j = job(&app, &id).await;
        assert_eq!(
            (j["status"].as_str(), j["rows_done"].as_u64()),
            (Some("waiting"), Some(held)),
            "{j}"
        );
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
    let id = start_import(&app, csv(20_000, "under"), "lag_budget=2s").await;
    let done = wait_status(&app, &id, "done", Duration::from_secs(60)).await;
    assert_eq!(done["paused_ms"].as_u64(), Some(0), "{done}");
    assert!(
        done["max_staleness_seen_ms"].as_u64().unwrap() < 2_000,
        "{done}"
    );

    blocking(|| cluster.set_apply_delay(1, 1500)).unwrap();
    let id = start_import(&app, csv(50_000, "over"), "lag_budget=500ms").await;
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
    assert_eq!(product_count(&app, "over").await, 50_000);
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
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["error"]["bad_lines"].as_array().unwrap().len(),
        5,
        "{body}"
    );
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
        assert!(stdout.contains("3000 of 3000 rows written"), "{stdout}");
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
