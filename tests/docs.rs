//! Documents held to what they describe, so they cannot drift apart: the README's routing
//! table to the code's policy table, and the runbook (`docs/operations.md`) to the alert
//! rules.

#![allow(clippy::expect_used)]

use stockgate::routing::policy::{POLICY, Target};

#[test]
fn the_readme_routing_table_matches_the_policy_in_the_code() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let rows: Vec<Vec<String>> = readme
        .lines()
        .skip_while(|l| !l.starts_with("| class | target | staleness budget | read-your-writes |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().trim_matches('`').to_string())
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), POLICY.len(), "one README row per query class");
    for (row, p) in rows.iter().zip(POLICY) {
        let target = match p.target {
            Target::Primary => "primary",
            Target::Replica => "replica",
        };
        let budget = match p.budget {
            Some(d) => format!("{} ms", d.as_millis()),
            None => "any replica not down".to_string(),
        };
        let ryw = if p.read_your_writes { "yes" } else { "no" };
        assert_eq!(
            row,
            &vec![
                p.class.name().to_string(),
                target.to_string(),
                budget,
                ryw.to_string()
            ],
            "README row for {}",
            p.class
        );
    }
}

/// The heading of `docs/operations.md`'s runbook, whose entries are one per alert.
const RUNBOOK_SECTION: &str = "## The alerts, and what to do about each";

/// The runbook has one entry per alert, and each alert's `runbook` annotation names its own.
#[test]
fn every_alert_has_its_runbook_entry() {
    let read = |path: &str| {
        std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).expect(path)
    };
    let rules = read("deploy/prometheus/alerts.yml");
    let runbook = read("docs/operations.md");
    // The entries are the `###` headings of the runbook's section, up to the next `##`.
    let headings: Vec<&str> = runbook
        .lines()
        .skip_while(|l| *l != RUNBOOK_SECTION)
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| l.strip_prefix("### "))
        .collect();
    let mut alerts = vec![];
    let mut current: Option<&str> = None;
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            alerts.push(name);
            current = Some(name);
        } else if let Some(link) = line.strip_prefix("runbook: ") {
            let alert = current.expect("a runbook annotation inside an alert");
            assert_eq!(
                link.trim_matches('"'),
                format!("docs/operations.md#{}", alert.to_lowercase()),
                "{alert}'s runbook link"
            );
        }
    }
    assert!(alerts.len() >= 12, "{alerts:?}");
    assert_eq!(
        headings, alerts,
        "one runbook entry per alert, in the rules' order"
    );
    let links = rules.matches("runbook: ").count();
    assert_eq!(links, alerts.len(), "every alert links its entry");
}
