//! The quickstart end to end, on SQLite and on PostgreSQL: every daily total equals
//! the sum of its unique events, and the 3 poison events are dead-lettered.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use inbox_examples::quickstart;
use inbox_examples::usage::{diff_totals, Workload};
use inbox_test_support::{PgFixture, SqliteFixture};

fn check(report: &quickstart::Report) {
    assert!(report.mismatches.is_empty(), "{report}");
    assert_eq!(report.dead_letters, 3, "{report}");
    assert_eq!(report.stats.dead_lettered, 3);
    assert_eq!(
        report.stats.processed, 997,
        "every other event applied once"
    );
    assert!(
        report.stats.duplicates > 0,
        "the transport delivered copies"
    );
    assert!(
        report.stats.retries >= 9,
        "poison retried before dead-lettering"
    );
}

#[test]
fn quickstart_on_sqlite() {
    let fx = SqliteFixture::new();
    check(&quickstart::run(&fx.path, None, 1_000).expect("run"));
}

#[test]
fn quickstart_on_postgres() {
    let Some(fx) = PgFixture::new() else { return };
    check(&quickstart::run(fx.url(), Some(&fx.schema), 1_000).expect("run"));
}

#[test]
fn a_wrong_total_is_reported() {
    let workload = Workload::generate(50, 0, 3);
    let expected = workload.expected_totals();
    let mut found = expected.clone();
    let first = *found.keys().next().expect("a row");
    *found.get_mut(&first).expect("row") += 40;
    let diffs = diff_totals(&expected, &found);
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert!(diffs[0].contains("expected"), "{diffs:?}");
}
