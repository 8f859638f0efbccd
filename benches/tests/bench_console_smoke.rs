//! `bench_console` as a process, on a small store: every page answers, the figures and
//! the plans are printed, and its database is dropped afterwards.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::Command;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[test]
fn a_small_run_prints_every_page_and_drops_its_database() {
    let Some(db) = inbox_test_support::postgres_url() else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_bench_console"))
        .env("BENCH_CLAIMS", "5000")
        .env("BENCH_LETTERS", "500")
        .env("BENCH_REQUESTS", "2")
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for page in [
        "overview",
        "failure groups",
        "dead letters",
        "a letter",
        "halted groups",
        "outbox",
        "claims of a key",
        "rebuilds",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(page)),
            "no figures for {page}: {text}"
        );
    }
    assert!(text.contains("plans: "), "{text}");
    let mut conn = PgConnection::establish(&db).unwrap();
    let left =
        diesel::sql_query("SELECT count(*) AS n FROM pg_database WHERE starts_with(datname, $1)")
            .bind::<Text, _>("bench_console_")
            .get_result::<Count>(&mut conn)
            .unwrap()
            .n;
    // Other runs (a benchmark by hand) may be going on: only this run's must be gone.
    let name = text
        .lines()
        .next()
        .and_then(|l| l.rsplit("database ").next())
        .unwrap()
        .trim()
        .to_owned();
    let mine = diesel::sql_query("SELECT count(*) AS n FROM pg_database WHERE datname = $1")
        .bind::<Text, _>(&name)
        .get_result::<Count>(&mut conn)
        .unwrap()
        .n;
    assert_eq!(
        mine, 0,
        "{name} left behind ({left} bench_console databases in all)"
    );
}
