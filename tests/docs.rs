//! Documents held to what they describe, so they cannot drift apart: the README's routing
//! table to the code's policy table; the configuration tables (the README's, `src/config.rs`'s
//! module doc) and `.env.example` to the variables the code reads and their defaults; the
//! runbook (`docs/operations.md`) to the alert rules; every relative link in the README,
//! `docs/` and `bench/results/README.md` to a file that exists; and the README's Layout
//! (no circle between the top-level modules of `src/`, listed from the top to the leaves) to
//! the imports in `src/`.

#![allow(clippy::expect_used)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use stockgate::config::Config;
use stockgate::routing::policy::{POLICY, Target};

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).expect(path)
}

/// The body rows of the markdown table whose header row is `header`, each cell trimmed.
fn table(text: &str, header: &str) -> Vec<Vec<String>> {
    text.lines()
        .skip_while(|l| !l.starts_with(header))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

#[test]
fn the_readme_routing_table_matches_the_policy_in_the_code() {
    let readme = read("README.md");
    let rows: Vec<Vec<String>> = table(
        &readme,
        "| class | target | staleness budget | read-your-writes |",
    )
    .into_iter()
    .map(|row| {
        row.iter()
            .map(|c| c.trim_matches('`').to_string())
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

/// The header row of the configuration tables, in the README and in `src/config.rs`'s `//!`.
const CONFIG_TABLE: &str = "| variable | meaning | default |";

/// Read outside `Config`: by `tracing_subscriber`'s `EnvFilter` in `src/telemetry.rs`.
const LOG_FILTER: &str = "RUST_LOG";

/// Every variable `Config::from_lookup` asks for, found by asking it: a variable added to
/// `config.rs` is on this list without anyone writing it down. Then `RUST_LOG`.
fn variables_the_code_reads() -> Vec<String> {
    let asked = RefCell::new(Vec::new());
    Config::from_lookup(|key| {
        asked.borrow_mut().push(key.to_string());
        None
    })
    .expect("nothing set is a valid configuration");
    let mut names = asked.into_inner();
    names.push(LOG_FILTER.to_string());
    names
}

/// `(variable, default)` per row of a configuration table, the default cell as written.
fn config_rows(text: &str) -> Vec<(String, String)> {
    table(text, CONFIG_TABLE)
        .into_iter()
        .map(|row| {
            assert_eq!(row.len(), 3, "a configuration row has three cells: {row:?}");
            (row[0].trim_matches('`').to_string(), row[2].clone())
        })
        .collect()
}

/// The table in `src/config.rs`'s module doc, without its `//! ` prefixes.
fn module_doc_rows() -> Vec<(String, String)> {
    let doc: String = read("src/config.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.trim_start()))
        .collect();
    config_rows(&doc)
}

/// Fails naming what `documented` lacks and what it has that the code does not read.
fn assert_same_variables(documented: &[String], what: &str) {
    let code = variables_the_code_reads();
    let missing: Vec<_> = code.iter().filter(|n| !documented.contains(n)).collect();
    let unknown: Vec<_> = documented.iter().filter(|n| !code.contains(n)).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "{what}: missing {missing:?}; not read by the code {unknown:?}"
    );
    let mut once = documented.to_vec();
    once.sort();
    once.dedup();
    assert_eq!(
        once.len(),
        documented.len(),
        "{what} names a variable twice"
    );
}

/// The README's table and `config.rs`'s list the same variables, in the same order, with the
/// same defaults, and those are exactly the variables the code reads.
#[test]
fn the_configuration_tables_list_every_variable_the_code_reads() {
    let readme = config_rows(&read("README.md"));
    let module_doc = module_doc_rows();
    let names = |rows: &[(String, String)]| rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>();
    assert_same_variables(&names(&readme), "the README's configuration table");
    assert_eq!(
        names(&module_doc),
        names(&readme),
        "src/config.rs's table against the README's, row by row"
    );
    for ((name, readme_default), (_, doc_default)) in readme.iter().zip(&module_doc) {
        assert_eq!(
            readme_default, doc_default,
            "{name}'s default: README against src/config.rs"
        );
    }
}

/// A default written as one literal (`` `5000` ``) is held to the code: setting the variable
/// to it must give the configuration that leaving it unset gives. A default in words must be
/// one of the forms below; "the number of CPUs" is held the same way, the others (a required
/// or an empty value) have no value to set.
#[test]
fn every_documented_default_is_the_one_the_code_uses() {
    let unset = format!(
        "{:?}",
        Config::from_lookup(|_| None).expect("nothing set is valid")
    );
    for (name, default) in config_rows(&read("README.md")) {
        if name == LOG_FILTER {
            let telemetry = read("src/telemetry.rs");
            for value in default.split('`').skip(1).step_by(2) {
                assert!(
                    telemetry.contains(&format!("\"{value}\"")),
                    "{name}'s default {value:?} is not a filter in src/telemetry.rs"
                );
            }
            continue;
        }
        let value = match literal(&default) {
            Some(v) => v.to_string(),
            None if default == "the number of CPUs" => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .to_string(),
            None => {
                assert!(
                    default.starts_with("required") || default.starts_with("empty"),
                    "{name}'s default {default:?}: a literal, `the number of CPUs`, \
                     `required …` or `empty …`"
                );
                continue;
            }
        };
        let set = Config::from_lookup(|k| (k == name).then(|| value.clone()))
            .unwrap_or_else(|e| panic!("{name}={value}, its documented default, is refused: {e}"));
        assert_eq!(
            format!("{set:?}"),
            unset,
            "{name}={value} (the documented default) is not what the code does when it is unset"
        );
    }
}

/// `` `x` `` → `x`: a cell that is exactly one code span.
fn literal(cell: &str) -> Option<&str> {
    let inner = cell.strip_prefix('`')?.strip_suffix('`')?;
    (!inner.contains('`')).then_some(inner)
}

/// `.env.example` has one entry per variable the code reads, and none for any other. An entry
/// is `NAME=value` or, commented out, `# NAME=value`: commented when a line there would do
/// nothing (`RUST_LOG`, read before `.env`) or should not be set by copying the file.
#[test]
fn env_example_names_every_variable_once() {
    let entries: Vec<String> = read(".env.example")
        .lines()
        .map(|l| l.trim_start_matches('#').trim_start())
        .filter_map(|l| l.split_once('='))
        .map(|(name, _)| name)
        .filter(|name| {
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_string)
        .collect();
    assert_same_variables(&entries, ".env.example");
}

/// Every `](target)` in the README, `docs/` and `bench/results/README.md` that is not a URL
/// names a file or folder that exists, relative to the document (anchors are not checked).
#[test]
fn every_relative_link_in_the_documents_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut documents = vec![root.join("README.md"), root.join("bench/results/README.md")];
    markdown_under(&root.join("docs"), &mut documents);
    assert!(documents.len() > 4, "{documents:?}");
    let mut broken = vec![];
    for doc in &documents {
        let text = std::fs::read_to_string(doc).expect("a document");
        for target in text.split("](").skip(1).filter_map(|s| s.split(')').next()) {
            let path = target.split('#').next().unwrap_or_default();
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let dir = doc.parent().expect("a document's folder");
            if !dir.join(path).exists() {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}

fn markdown_under(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("docs/") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            markdown_under(&path, found);
        } else if path.extension().is_some_and(|e| e == "md") {
            found.push(path);
        }
    }
}

/// The README's Layout command, verbatim: the scan [`imports_between_modules`] does in Rust.
/// Every `crate::name` outside a comment line of a file under `src/X` is an import of `name`
/// by `X`; `tsort` then prints the modules from the top down, or names a loop.
const LAYOUT_SCAN: &str = "grep -rEo '^[[:space:]]*//.*|crate::[a-z_]+' src \
    | sed -nE 's#^src/([a-z_]+)[^:]*:crate::#\\1 #p' | awk '$1 != $2' | sort -u | tsort";

/// The README's `## Layout` section.
fn layout_section() -> String {
    read("README.md")
        .lines()
        .skip_while(|l| *l != "## Layout")
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// `(importer, imported)` for every pair of distinct top-level modules of `src/` (a file
/// `X.rs` or a folder `X/`) where a line of `X` that is not a comment names `crate::Y`.
fn imports_between_modules() -> BTreeSet<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_under(&src, &mut files);
    let mut edges = BTreeSet::new();
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src/");
        let top = module_name(
            &relative
                .components()
                .next()
                .expect("a name")
                .as_os_str()
                .to_string_lossy(),
        );
        let text = std::fs::read_to_string(&file).expect("a source file");
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (at, _) in line.match_indices("crate::") {
                let name: String = line[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !name.is_empty() && name != top {
                    edges.insert((top.clone(), name));
                }
            }
        }
    }
    edges
}

/// `main.rs` → `main`, `http` → `http`.
fn module_name(entry: &str) -> String {
    entry
        .trim_end_matches(".rs")
        .trim_end_matches('/')
        .to_string()
}

fn rust_under(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_under(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// A loop among `edges`, as the modules along it, if there is one: what `tsort` reports.
fn a_loop(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    let mut from: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        from.entry(a).or_default().push(b);
    }
    // Peel off modules that import nothing left; what remains holds a loop.
    let mut left: BTreeSet<&str> = edges
        .iter()
        .flat_map(|(a, b)| [a.as_str(), b.as_str()])
        .collect();
    while let Some(leaf) = left.iter().copied().find(|m| {
        from.get(m)
            .is_none_or(|to| to.iter().all(|t| !left.contains(t)))
    }) {
        left.remove(leaf);
    }
    // Walk from any module left, always to one left, until a module comes round again.
    let mut path = vec![*left.first()?];
    loop {
        let last = path[path.len() - 1];
        let next = from[last].iter().copied().find(|t| left.contains(t))?;
        if let Some(at) = path.iter().position(|m| *m == next) {
            let mut found: Vec<String> = path[at..].iter().map(|m| m.to_string()).collect();
            found.push(next.to_string());
            return Some(found);
        }
        path.push(next);
    }
}

/// The top-level modules the README's layout listing names under `src/`, in its order: the
/// first column of each entry, where one entry may name several (`a.rs, b.rs`).
fn listed_modules(layout: &str) -> Vec<String> {
    layout
        .lines()
        .skip_while(|l| *l != "src/")
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .filter_map(|l| l.strip_prefix("  "))
        .filter(|l| !l.starts_with(' '))
        .flat_map(|l| l.split("  ").next().unwrap_or_default().split(", "))
        .map(|entry| {
            assert!(
                entry.ends_with(".rs") || entry.ends_with('/'),
                "a layout entry is a file or a folder: {entry:?}"
            );
            module_name(entry)
        })
        .collect()
}

/// The README's Layout command finds no circle between the top-level modules, run here as
/// the same scan (the command held verbatim to the README's). Mutations seen to fail it:
/// `use crate::http::error::ApiError;` added to `src/checkout/error.rs` (checkout -> http ->
/// checkout); the README's command without its comment-line rule.
#[test]
fn the_readme_layout_command_finds_no_circle_between_modules() {
    let command: String = layout_section()
        .split("```sh\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .expect("the Layout section's command")
        .lines()
        .map(|l| l.trim().trim_end_matches('\\').trim_end())
        .collect::<Vec<_>>()
        .join(" ");
    assert_eq!(
        command, LAYOUT_SCAN,
        "the README's Layout command is the scan this test does"
    );
    let edges = imports_between_modules();
    assert!(edges.len() > 20, "the scan finds the imports: {edges:?}");
    if let Some(found) = a_loop(&edges) {
        panic!("the modules import in a circle: {}", found.join(" -> "));
    }
}

/// The README's layout listing names every module of `src/` once and runs from the top to
/// the leaves: no module imports one listed above it. Mutations seen to fail it:
/// `use crate::metrics::Metrics;` added to `src/domain.rs` (no circle, but an import running
/// up the listing); `routing/` moved above `checkout/` in the listing; `peers.rs` listed again.
#[test]
fn the_readme_layout_lists_every_module_above_what_it_imports() {
    let listed = listed_modules(&layout_section());
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut on_disk: Vec<String> = std::fs::read_dir(&src)
        .expect("src/")
        .map(|e| module_name(&e.expect("an entry").file_name().to_string_lossy()))
        .filter(|m| m != "lib")
        .collect();
    on_disk.sort();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(
        sorted, on_disk,
        "the listing names every module of src/ (but lib.rs) once"
    );
    let place = |m: &str| listed.iter().position(|l| l == m);
    let upward: Vec<_> = imports_between_modules()
        .into_iter()
        .filter(|(a, b)| matches!((place(a), place(b)), (Some(a), Some(b)) if a > b))
        .collect();
    assert!(
        upward.is_empty(),
        "imports running up the README's listing (importer, imported): {upward:?}"
    );
}
