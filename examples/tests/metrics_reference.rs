//! docs/metrics.md lists every metric of `inbox_core::metrics::CATALOG` once, with its
//! type, unit and labels as recorded, and no metric the catalog does not have.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use inbox_core::metrics::{Label, CATALOG};

fn unit(u: metrics::Unit) -> &'static str {
    match u {
        metrics::Unit::Count => "count",
        metrics::Unit::Seconds => "seconds",
        metrics::Unit::Bytes => "bytes",
        other => other.as_str(),
    }
}

#[test]
fn the_reference_page_matches_the_catalog() {
    let page = include_str!("../../docs/metrics.md");
    // Rows of the metric tables: | `name` | type | unit | labels | meaning |
    let rows: Vec<Vec<&str>> = page
        .lines()
        .filter(|l| l.starts_with("| `inbox_"))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    for m in CATALOG {
        let name = format!("`{}`", m.name);
        let found: Vec<_> = rows.iter().filter(|r| r[0] == name).collect();
        assert_eq!(
            found.len(),
            1,
            "{} must have one row in docs/metrics.md",
            m.name
        );
        let row = found[0];
        assert_eq!(row[1], m.kind.as_str(), "{}: type", m.name);
        assert_eq!(row[2], unit(m.unit), "{}: unit", m.name);
        let labels: Vec<String> = m
            .labels
            .iter()
            .map(|l: &Label| format!("`{}`", l.as_str()))
            .collect();
        let labels = if labels.is_empty() {
            "-".to_owned()
        } else {
            labels.join(", ")
        };
        assert_eq!(row[3], labels, "{}: labels", m.name);
        assert_eq!(row[4], m.help, "{}: meaning", m.name);
    }
    for row in &rows {
        let name = row[0].trim_matches('`');
        assert!(
            CATALOG.iter().any(|m| m.name == name),
            "docs/metrics.md lists {name}, which no crate records"
        );
    }
}
