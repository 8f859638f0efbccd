//! `bench_growth` as a process: it refuses to start without disk room (exit 2,
//! nothing created), and what it created is removed when it panics (exit 101) and
//! when Ctrl-C interrupts its prefill (exit 130).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output, Stdio};

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection};

/// The PostgreSQL and AMQP URLs, when both services are there.
fn urls() -> Option<(String, String)> {
    let db = inbox_test_support::postgres_url()?;
    let amqp = inbox_test_support::amqp::amqp_url()?;
    Some((db, amqp))
}

fn bench() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_bench_growth"));
    command
        .env_remove("BENCH_GROWTH_DISK_CHECK")
        .env("BENCH_ROUNDS", "1")
        .env("BENCH_EVENTS", "100")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Schemas of the run of process `pid` (`growth_<pid>_...`).
fn schemas_of(db: &str, pid: u32) -> i64 {
    let mut conn = PgConnection::establish(db).unwrap();
    diesel::sql_query("SELECT count(*) AS n FROM pg_namespace WHERE starts_with(nspname, $1)")
        .bind::<Text, _>(format!("growth_{pid}_"))
        .get_result::<Count>(&mut conn)
        .unwrap()
        .n
}

fn printed(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn it_refuses_to_start_without_disk_room() {
    let Some((db, amqp)) = urls() else { return };
    let child = bench()
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", &amqp)
        .env("BENCH_GROWTH_ROWS", "1000000000000000")
        // Were the check missing, its first write fails instead of filling the disk.
        .env("PGOPTIONS", "-c default_transaction_read_only=on")
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let printed = printed(&out);
    assert_eq!(out.status.code(), Some(2), "{printed}");
    assert!(
        printed.contains("not enough free disk space for 1000000000000000 claims"),
        "{printed}"
    );
    assert_eq!(schemas_of(&db, pid), 0, "{printed}");
}

#[test]
fn an_unknown_scenario_is_refused_naming_it() {
    let out = bench()
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("BENCH_ONLY", "fold,rt_fold")
        .output()
        .unwrap();
    let printed = printed(&out);
    assert_eq!(out.status.code(), Some(2), "{printed}");
    assert!(
        printed.contains(
            "BENCH_ONLY=\"fold,rt_fold\": expected a comma list of single, fold; found \"rt_fold\""
        ),
        "{printed}"
    );
}

#[test]
fn a_panic_after_the_prefill_drops_its_schemas() {
    let Some((db, _)) = urls() else { return };
    // The first scenario cannot reach the broker and panics.
    let child = bench()
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
        .env("BENCH_GROWTH_ROWS", "1000")
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let printed = printed(&out);
    assert_eq!(out.status.code(), Some(101), "{printed}");
    assert!(printed.contains("prefill: 1,000 claims"), "{printed}");
    assert!(
        printed.contains(&format!("removed schema growth_{pid}_full")),
        "{printed}"
    );
    assert_eq!(schemas_of(&db, pid), 0, "{printed}");
}

#[test]
fn ctrl_c_during_the_prefill_drops_its_schema() {
    let Some((db, amqp)) = urls() else { return };
    let mut child = bench()
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", &amqp)
        .env("BENCH_GROWTH_ROWS", "5000000")
        .spawn()
        .unwrap();
    let pid = child.id();
    let run = format!("growth_{pid}");
    // Until its prefill statement runs (or it ends, which fails below).
    let mut conn = PgConnection::establish(&db).unwrap();
    loop {
        let running = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = $1 \
             AND state = 'active' AND query LIKE '%generate_series%'",
        )
        .bind::<Text, _>(&run)
        .get_result::<Count>(&mut conn)
        .unwrap()
        .n;
        if running > 0 || child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(schemas_of(&db, pid), 1);
    let signalled = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let out = child.wait_with_output().unwrap();
    let printed = printed(&out);
    assert_eq!(out.status.code(), Some(130), "{printed}");
    assert!(
        printed.contains(&format!("removed schema {run}_full")),
        "{printed}"
    );
    assert_eq!(schemas_of(&db, pid), 0, "{printed}");
}
