//! `bench_relay` as a process, small: every throughput case and every latency case
//! prints its line, every message offered at the latency rate arrives, and the run's
//! schemas are gone afterwards.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[test]
fn a_small_run_prints_every_case_and_removes_what_it_created() {
    let (Some(db), Some(amqp)) = (
        inbox_test_support::postgres_url(),
        inbox_test_support::amqp::amqp_url(),
    ) else {
        return;
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_bench_relay"))
        .env("BENCH_EVENTS", "600")
        .env("BENCH_ROUNDS", "1")
        .env("BENCH_RATE", "100")
        .env("BENCH_SECONDS", "2")
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", &amqp)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The throughput cases wait until every row is published: a relay that stops
    // publishing would hang the benchmark, so it gets three minutes.
    let deadline = Instant::now() + Duration::from_secs(180);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("bench_relay did not finish in 180 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let errors = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{text}\n{errors}");
    for case in 1..=6 {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{case}. ")) && l.contains("messages/s")),
            "no line for case {case}: {text}"
        );
    }
    let latency: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("commit-to-publish at 100 msg/s"))
        .collect();
    assert_eq!(latency.len(), 3, "{text}");
    for line in latency {
        assert!(
            line.contains("(medians of 1 round(s), 200 messages)"),
            "a message offered was not received: {line}"
        );
    }

    let mut conn = PgConnection::establish(&db).unwrap();
    let schemas =
        diesel::sql_query("SELECT count(*) AS n FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind::<Text, _>(format!("relaybench_{pid}_"))
            .get_result::<Count>(&mut conn)
            .unwrap()
            .n;
    assert_eq!(schemas, 0, "schemas of relaybench_{pid} left behind");
}
