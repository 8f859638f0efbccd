//! `replication::inspect` against a real server: the test server runs alone (no
//! standby), so its mode is `none`, it is not in recovery, and it warns of nothing.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use diesel::{Connection, PgConnection};
use inbox_diesel::replication::{inspect, inspect_store, Mode};
use inbox_test_support::{Fixture, PgFixture, SqliteFixture};

#[test]
fn a_server_without_a_standby_reports_none() {
    let Some(fx) = PgFixture::new() else {
        return;
    };
    let mut conn = PgConnection::establish(fx.url()).unwrap();
    let report = inspect(&mut conn).unwrap();
    assert!(!report.in_recovery);
    assert!(!report.synchronous_commit.is_empty());
    if report.standbys.is_empty() {
        assert_eq!(report.mode(), Mode::None);
    }
    let store = fx.builder().build().unwrap();
    assert_eq!(inspect_store(&store).unwrap(), Some(report));
}

#[test]
fn a_sqlite_store_has_no_replication() {
    let fx = SqliteFixture::new();
    let store = fx.builder().build().unwrap();
    assert_eq!(inspect_store(&store).unwrap(), None);
}
