//! `bench_latency` as a process, at one small rate for one round: every system's line
//! is printed with its exact check passed, the SVG is written, and the run's schemas
//! and queues are gone afterwards.

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
fn a_small_run_prints_every_system_and_removes_what_it_created() {
    let (Some(db), Some(amqp)) = (
        inbox_test_support::postgres_url(),
        inbox_test_support::amqp::amqp_url(),
    ) else {
        return;
    };
    let svg = std::env::temp_dir().join(format!("bench_latency_{}.svg", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_bench_latency"))
        .env("BENCH_RATES", "50")
        .env("BENCH_SECONDS", "2")
        .env("BENCH_ROUNDS", "1")
        .env("BENCH_PUBLISHERS", "2")
        .env("BENCH_DRAIN_LIMIT_S", "30")
        .env("BENCH_SVG", &svg)
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", &amqp)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let errors = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{text}\n{errors}");
    for system in ["hand_single", "hand_batched", "rt_default", "rt_tuned"] {
        assert!(
            text.lines()
                .any(|l| l.contains(&format!("round 1: {system} at 50/s"))
                    && l.contains("exact check passed")),
            "no passed line for {system}: {text}"
        );
        assert!(
            text.lines().any(|l| l.starts_with(system)),
            "{system} missing from the table: {text}"
        );
    }
    assert!(text.contains("exact checks passed at every rate"), "{text}");
    assert!(
        text.contains("load average (1 min) during the run"),
        "{text}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(picture.matches("<polyline").count(), 4, "{picture}");
    let _ = std::fs::remove_file(&svg);

    // `run latency_<pid>_<nanos>: ...`: every schema and queue of the run is named
    // after it.
    let run = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("run "))
        .and_then(|l| l.split(':').next())
        .unwrap()
        .to_owned();
    assert!(run.starts_with("latency_"), "{run}");
    let mut conn = PgConnection::establish(&db).unwrap();
    let schemas =
        diesel::sql_query("SELECT count(*) AS n FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind::<Text, _>(&run)
            .get_result::<Count>(&mut conn)
            .unwrap()
            .n;
    assert_eq!(schemas, 0, "schemas of {run} left behind");
    let listed = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "name"])
        .output()
        .expect("rabbitmqctl, to list the broker's queues");
    assert!(listed.status.success(), "rabbitmqctl list_queues failed");
    let queues = String::from_utf8_lossy(&listed.stdout).into_owned();
    let left: Vec<&str> = queues
        .lines()
        .filter(|q| q.starts_with(&format!("{run}.")))
        .collect();
    assert!(left.is_empty(), "queues of {run} left behind: {left:?}");
}
