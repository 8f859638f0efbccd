//! The RabbitMQ example as a process: it stops gracefully on SIGTERM with exit 0, and
//! a startup failure exits non-zero with the error printed.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

/// The PostgreSQL URL, when both PostgreSQL and RabbitMQ are there (see
/// `inbox_test_support::services`).
fn database_url() -> Option<String> {
    let url = inbox_test_support::postgres_url()?;
    amqp_url()?;
    Some(url)
}

fn amqp_url() -> Option<String> {
    inbox_test_support::amqp::amqp_url()
}

fn example(name: &str) -> PathBuf {
    inbox_test_support::example_path(name)
}

fn example_binary() -> PathBuf {
    example("usage_consumer")
}

/// A schema of this test's own, named in the URL so the example's connections use it.
fn schema_url(base: &str, schema: &str) -> String {
    let mut conn = PgConnection::establish(base).unwrap();
    conn.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
        .unwrap();
    inbox_test_support::search_path_url(base, schema)
}

fn drop_schema(base: &str, schema: &str) {
    if let Ok(mut conn) = PgConnection::establish(base) {
        let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
    }
}

/// Kills the child if the test fails before it does (a stray consumer would keep
/// consuming from the shared broker).
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn unique(prefix: &str) -> String {
    inbox_test_support::unique_name(prefix)
}

#[test]
fn sigterm_stops_it_gracefully_with_exit_zero() {
    let Some(base) = database_url() else { return };
    let schema = unique("ex");
    let url = schema_url(&base, &schema);
    // The example's queues carry no expiry: they go, whatever the test's outcome
    // (declared before the child, so dropped after it is killed).
    let _topology = inbox_test_support::amqp::DeleteOnDrop::new(
        amqp_url().unwrap(),
        inbox_test_support::amqp::usage_consumer_topology(&format!("{schema}.")),
    );
    let mut child = KillOnDrop(Some(
        Command::new(example_binary())
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", amqp_url().unwrap())
            .env("INBOX_PREFIX", format!("{schema}."))
            // Its default log level, as a user who sets nothing gets it.
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    // Wait until it has declared its topology and created its table.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ready = false;
    while Instant::now() < deadline && !ready {
        std::thread::sleep(Duration::from_millis(100));
        let mut conn = PgConnection::establish(&url).unwrap();
        ready = conn
            .batch_execute("SELECT 1 FROM daily_usage LIMIT 1")
            .is_ok();
    }
    assert!(ready, "the example did not start");
    // Feed it as any AMQP client would: the documented message contract.
    let exchange = format!("{schema}.billing");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let amqp = amqp_url().unwrap();
        let conn = inbox_test_support::amqp::connect(&amqp).await;
        // evt-1 twice; evt-3's day is not written as the contract says.
        let events = [
            ("evt-1", "2026-11-30", 40),
            ("evt-2", "2026-11-30", 2),
            ("evt-1", "2026-11-30", 40),
            ("evt-3", "2026-11-3", 5),
        ];
        for (id, day, amount) in events {
            let body = format!(r#"{{"user_id": 42, "day": "{day}", "amount": {amount}}}"#);
            let mut headers = lapin::types::FieldTable::default();
            headers.insert(
                "tenant".into(),
                lapin::types::AMQPValue::LongString("acme".into()),
            );
            // Routed: until the example has bound its queue, it is published again.
            let props = lapin::BasicProperties::default()
                .with_message_id(id.into())
                .with_type("usage.recorded".into())
                .with_headers(headers);
            let within = Duration::from_secs(30);
            let body = body.as_bytes();
            inbox_test_support::amqp::publish_routed(
                &conn,
                &exchange,
                "usage.recorded",
                body,
                props,
                within,
            )
            .await;
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut total = 0;
    while Instant::now() < deadline && total != 42 {
        std::thread::sleep(Duration::from_millis(50));
        #[derive(diesel::QueryableByName)]
        struct Total {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            total: i64,
        }
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&url).unwrap();
        total =
            diesel::sql_query("SELECT COALESCE(SUM(total), 0)::bigint AS total FROM daily_usage")
                .get_result::<Total>(&mut conn)
                .map(|t| t.total)
                .unwrap_or(0);
    }
    assert_eq!(total, 42, "40 + 2, the duplicate applied once");
    let deadline = Instant::now() + Duration::from_secs(30);
    while sum(
        &url,
        "SELECT count(*)::bigint AS total FROM inbox_dead_letters",
    ) < 1
    {
        assert!(Instant::now() < deadline, "evt-3 was never dead-lettered");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));
    let status = Command::new("kill")
        .args(["-TERM", &child.0.as_ref().unwrap().id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}: {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "stopped after 4 deliveries: 2 processed, 1 duplicates, 0 retried, 1 dead-lettered"
        ),
        "{stdout}"
    );
    // The runtime's error line reaches stderr through the example's subscriber.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logged = stderr
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("message dead-lettered"));
    assert!(
        logged.is_some_and(|l| l.contains("key=evt-3") && l.contains("decode_error")),
        "{stderr}"
    );
    drop_schema(&base, &schema);
}

#[test]
fn a_schema_that_fails_verification_exits_non_zero_with_the_error() {
    let Some(base) = database_url() else { return };
    let schema = unique("ex");
    let url = schema_url(&base, &schema);
    // Let the store migrate once, then break the claim index behind its back.
    let first = Command::new(example_binary())
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
        .output()
        .unwrap();
    assert!(!first.status.success(), "nothing listens on port 1");
    assert!(String::from_utf8_lossy(&first.stderr)
        .contains("could not connect to amqp://guest:***@127.0.0.1:1"));
    let mut conn = PgConnection::establish(&url).unwrap();
    conn.batch_execute(
        "ALTER TABLE inbox_claims DROP CONSTRAINT inbox_claims_pkey;
         CREATE UNIQUE INDEX by_tenant ON inbox_claims (tenant, message_key);",
    )
    .unwrap();
    let out = Command::new(example_binary())
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", amqp_url().unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("startup failed: claim index mismatch"),
        "{stderr}"
    );
    assert!(
        stderr.contains("found unique (tenant, message_key)"),
        "{stderr}"
    );
    drop_schema(&base, &schema);
}

#[derive(diesel::QueryableByName)]
struct Sum {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    total: i64,
}

fn sum(url: &str, sql: &str) -> i64 {
    use diesel::RunQueryDsl;
    let mut conn = PgConnection::establish(url).unwrap();
    diesel::sql_query(sql)
        .get_result::<Sum>(&mut conn)
        .map(|s| s.total)
        .unwrap_or(-1)
}

#[test]
fn producer_and_consumer_round_trip_through_outbox_broker_and_inbox() {
    let Some(base) = database_url() else { return };
    let schema = unique("ex");
    let url = schema_url(&base, &schema);
    let prefix = format!("{schema}.");
    let _topology = inbox_test_support::amqp::DeleteOnDrop::new(
        amqp_url().unwrap(),
        inbox_test_support::amqp::usage_consumer_topology(&prefix),
    );
    let mut consumer = KillOnDrop(Some(
        Command::new(example_binary())
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", amqp_url().unwrap())
            .env("INBOX_PREFIX", &prefix)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    // The consumer declares the topology (and the bound queue) before events flow.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline
        && sum(&url, "SELECT COUNT(*)::bigint AS total FROM daily_usage") < 0
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let produced = Command::new(example("usage_producer"))
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", amqp_url().unwrap())
        .env("INBOX_PREFIX", &prefix)
        .env("USAGE_EVENTS", "300")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&produced.stdout);
    assert!(
        produced.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&produced.stderr)
    );
    assert!(stdout.contains("published 300, returned 0"), "{stdout}");
    // daily_usage ends equal to the ledger: every committed event applied once.
    let ledger = sum(
        &url,
        "SELECT COALESCE(SUM(amount), 0)::bigint AS total FROM usage_ledger",
    );
    assert!(ledger > 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut projected = 0;
    while Instant::now() < deadline && projected != ledger {
        std::thread::sleep(Duration::from_millis(50));
        projected = sum(
            &url,
            "SELECT COALESCE(SUM(total), 0)::bigint AS total FROM daily_usage",
        );
    }
    assert_eq!(projected, ledger);
    let pid = consumer.0.as_ref().unwrap().id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let out = consumer.0.take().unwrap().wait_with_output().unwrap();
    assert!(out.status.success());
    drop_schema(&base, &schema);
}

/// Busy threads while the startups run: the exit race showed under load.
fn busy(stop: &std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<()> {
    let stop = std::sync::Arc::clone(stop);
    std::thread::spawn(move || {
        let mut x = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            std::hint::black_box(x);
        }
    })
}

/// A startup that fails on the broker exits 1 every time, never SIGSEGV: a pool thread
/// still inside libpq's TLS setup at exit used to race OpenSSL's exit cleanup.
#[test]
fn an_unreachable_broker_exits_1_every_time_under_load() {
    let Some(base) = database_url() else { return };
    let schema = unique("ex");
    let url = schema_url(&base, &schema);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..2).map(|_| busy(&stop)).collect();
    let runs = 30;
    let mut bad = Vec::new();
    for run in 0..runs {
        let out = Command::new(example_binary())
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
            .output()
            .unwrap();
        if out.status.code() != Some(1) {
            bad.push((run, out.status));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in load {
        h.join().unwrap();
    }
    drop_schema(&base, &schema);
    assert!(
        bad.is_empty(),
        "{} of {runs} startups did not exit 1: {bad:?}",
        bad.len()
    );
}
