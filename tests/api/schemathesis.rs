//! API fuzzing: schemathesis (from PyPI) generates requests from the service's own
//! `GET /openapi.json` and sends them to the live service on a real cluster. Any 5xx, any
//! status the document does not list, or any body that breaks its documented schema fails
//! the test, with schemathesis's output.
//!
//! The tool is found through `SCHEMATHESIS` (a path), else `.dev/venv/bin/schemathesis`
//! (what `./dev test` installs), else `schemathesis` on `PATH`. Without it the test is
//! skipped, unless `CI` is set, where it fails. `SCHEMATHESIS_SEED` replays a run;
//! `SCHEMATHESIS_ARGS` adds arguments (e.g. `--include-path-regex settings -n 300`).

use crate::helpers::{assert_error_for, code, shared_cluster, spawn_app};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Test cases per operation and phase.
const MAX_EXAMPLES: u32 = 30;
/// The whole schemathesis run is killed (and the test fails) after this.
const RUN_TIMEOUT: Duration = Duration::from_secs(100);

fn schemathesis() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SCHEMATHESIS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".dev/venv/bin/schemathesis");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("schemathesis"))
            .find(|p| p.is_file())
    })
}

/// Every documented operation is one the router serves: no fallback 404, no 405.
async fn every_documented_operation_is_routed(app: &crate::helpers::TestApp, doc: &Value) {
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, _) in item.as_object().expect("path item") {
            let concrete = path
                .replace("{product_id}", "sch-mug")
                .replace("{user_id}", "ada")
                .replace("{order_id}", "00000000-0000-0000-0000-000000000000")
                .replace("{job_id}", "00000000-0000-0000-0000-000000000000");
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
            let mut req = app
                .client
                .request(method.clone(), app.url(&concrete))
                .bearer_auth(&app.admin);
            if method == Method::POST || method == Method::PUT {
                req = req.header("content-type", "application/json").body("{}");
            }
            let resp = req.send().await.expect("request");
            let status = resp.status();
            let body: Value = resp.json().await.unwrap_or(Value::Null);
            assert_ne!(
                status,
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {concrete}"
            );
            assert!(
                !(status == StatusCode::NOT_FOUND && code(&body) == "NOT_FOUND"),
                "{method} {concrete} is documented but not routed"
            );
            checked += 1;
        }
    }
    assert!(checked >= 25, "only {checked} operations documented");
}

/// What earlier schemathesis runs found, pinned so they stay fixed without the tool.
async fn regressions_found_by_fuzzing(app: &crate::helpers::TestApp) {
    // Settings holding f64::MAX were stored, then failed to decode on read (500): jsonb prints
    // the number as 309 plain digits, which serde_json's fast float path rejected.
    let resp = app
        .client
        .put(app.url("/v1/users/fuzz-max/settings"))
        .bearer_auth(&app.admin)
        .header("content-type", "application/json")
        .body(r#"{"settings": {"big": 1.7976931348623157e308, "small": -1.7976931348623157e308}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let (status, body) = app
        .get_json("/v1/users/fuzz-max/settings", Some(&app.admin))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["settings"]["big"].as_f64(), Some(f64::MAX));
    assert_eq!(body["settings"]["small"].as_f64(), Some(f64::MIN));
    // Signed years (`-5000-01-01`) parsed as dates but are outside PostgreSQL's timestamps:
    // the report answered 500 and the export cut its stream. They are malformed: 400.
    for path in [
        "/v1/reports/revenue?date=-5000-01-01",
        "/v1/reports/revenue.txt?date=-262143-01-01",
        "/v1/exports/orders?from=-5000-01-01",
        "/v1/exports/orders?to=-262143-01-01",
    ] {
        let malformed = app.get_json(path, Some(&app.admin)).await;
        assert_error_for(path, &malformed, 400, "INVALID_QUERY");
    }
}

/// A schemathesis configuration that sends a user's token, not the admin's, to the operations
/// that act for the caller: an admin must name `user_id` there (422 `USER_ID_REQUIRED`),
/// which a schema cannot say, so admin calls would be refused for a reason the document does
/// not state. A user's token acts for itself, as the contract's examples do.
fn user_token_config(token: &str) -> TempFile {
    let mut toml = String::new();
    for operation in ["POST /v1/orders", "POST /v1/holds"] {
        toml.push_str(&format!(
            "[[operations]]\ninclude-name = \"{operation}\"\nheaders = {{ Authorization = \"Bearer {token}\" }}\n\n"
        ));
    }
    let path = std::env::temp_dir().join(format!(
        "stockgate-schemathesis-{}-{}.toml",
        std::process::id(),
        uuid::Uuid::new_v4()
    ));
    std::fs::write(&path, toml).expect("write the schemathesis config");
    TempFile(path)
}

/// A file removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `N generated, …` from schemathesis's summary (its "Test cases:" section).
fn test_cases_line(output: &str) -> Option<String> {
    let mut lines = output.lines();
    lines.find(|l| l.trim_start().starts_with("Test cases:"))?;
    lines
        .next()
        .map(|l| l.trim().to_string())
        .filter(|l| l.contains("generated"))
}

fn generated_count(line: &str) -> Option<u64> {
    line.split_whitespace().next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemathesis_finds_no_server_errors_and_no_undocumented_responses() {
    let app = spawn_app(shared_cluster()).await;

    let (status, doc) = app.get_json("/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        doc["openapi"].as_str().unwrap_or("").starts_with("3."),
        "{doc}"
    );

    for (id, stock, price) in [("sch-mug", 500, 1299), ("sch-flash", 5, 8999)] {
        let resp = app.create_product(id, stock, price).await;
        assert_eq!(resp.status(), StatusCode::CREATED, "create {id}");
    }
    // A second place, so a generated transfer can name two that exist (the hooks map every
    // well-formed location to `default` or to this one: see schemathesis_hooks.py).
    let resp = app
        .client
        .post(app.url("/v1/locations"))
        .bearer_auth(&app.admin)
        .json(&json!({"location_id": "sch-elsewhere", "name": "Elsewhere"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    let resp = app
        .client
        .put(app.url("/v1/users/ada/profile"))
        .bearer_auth(&app.admin)
        .json(&json!({"display_name": "Ada", "email": "ada@example.com"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    every_documented_operation_is_routed(&app, &doc).await;
    regressions_found_by_fuzzing(&app).await;

    let Some(tool) = schemathesis() else {
        crate::helpers::skip_outside_ci(
            "schemathesis fuzzing",
            "schemathesis not found: set SCHEMATHESIS, or run ./dev test, which installs it into .dev/venv",
        );
        return;
    };

    let seed: u64 = std::env::var("SCHEMATHESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) * 7919 + 17);
    let schema_url = app.url("/openapi.json");
    let config = user_token_config(&app.user_token("sch-user"));
    let mut cmd = tokio::process::Command::new(&tool);
    cmd.arg("--config-file")
        .arg(config.path())
        .arg("run")
        .arg(&schema_url)
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,response_schema_conformance",
        ])
        .args(["--header", &format!("Authorization: Bearer {}", app.admin)])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--phases", "examples,coverage,fuzzing"])
        // One worker: CPython 3.11 < 3.11.9 can fail `ast.parse` from several threads at once
        // ("AST constructor recursion depth mismatch"), which hypothesis does while generating.
        // One worker: CPython 3.11 before 3.11.9 can fail `ast.parse` called from several
        // threads at once ("AST constructor recursion depth mismatch"), which hypothesis does.
        .args(["--workers", "1"])
        .args(["--request-timeout", "15"])
        .args(["--seed", &seed.to_string()])
        .args(["--generation-database", "none"])
        .args(["--suppress-health-check", "all"])
        .arg("--no-color")
        // Extra arguments to narrow or widen a run, e.g. `--include-path-regex settings -n 300`.
        .args(
            std::env::var("SCHEMATHESIS_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .env("NO_COLOR", "1")
        .env(
            "SCHEMATHESIS_HOOKS",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/api/schemathesis_hooks.py"
            ),
        )
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    eprintln!(
        "running {} run {schema_url} --max-examples {MAX_EXAMPLES} --seed {seed} …",
        tool.display()
    );
    let started = Instant::now();
    let output = match tokio::time::timeout(RUN_TIMEOUT, cmd.output()).await {
        Ok(result) => result.expect("run schemathesis"),
        Err(_) => panic!("schemathesis did not finish within {RUN_TIMEOUT:?} (killed)"),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    if !stderr.trim().is_empty() {
        eprintln!("schemathesis stderr:\n{stderr}");
    }
    let cases = test_cases_line(&stdout);
    println!(
        "schemathesis: {} test cases in {:.1} s ({}), seed {seed}, exit {:?}",
        cases
            .as_deref()
            .and_then(generated_count)
            .map_or("?".to_string(), |n| n.to_string()),
        started.elapsed().as_secs_f64(),
        cases.as_deref().unwrap_or("no summary line"),
        output.status.code(),
    );
    assert!(
        output.status.success(),
        "schemathesis found failures (seed {seed}; rerun with SCHEMATHESIS_SEED={seed}); its output is above"
    );
    // The document's constraints match what the parsers enforce: schemathesis would say
    // "Schema validation mismatch" if valid-by-the-schema data were mostly rejected.
    assert!(
        !stdout.contains("Schema validation mismatch"),
        "the OpenAPI constraints do not match the API's validation (seed {seed}); its output is above"
    );
    let generated = cases.as_deref().and_then(generated_count).unwrap_or(0);
    assert!(
        generated >= 100,
        "schemathesis ran only {generated} test cases; its output is above"
    );
}
