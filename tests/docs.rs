//! The README's routing table is checked against the code's policy table, so the two cannot
//! drift apart.

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
