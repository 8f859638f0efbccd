//! End to end: `usage_producer` and `usage_consumer` running while `usage_ops rebuild`
//! runs in a loop; then the loop stops, the consumer drains, and an audit with no
//! final rebuild finds zero drift. And `usage_consumer --rebuild-every` heals a row.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};
use inbox_amqp::Topology;
use inbox_core::ConsumerGroup;
use inbox_test_support::services::{url_of, Service};

/// PostgreSQL's URL (`PG_DATABASE_URL`, `DATABASE_URL` or the default local server),
/// with RabbitMQ's (`AMQP_URL` or the default) checked too: the services module's
/// rules, so a missing service fails the test or, with `INBOX_SKIP_SERVICES=1`, skips
/// it out loud.
fn database_url() -> Option<String> {
    inbox_diesel::init_tls();
    let url = url_of(Service::Postgres)?;
    // Through the AMQP fixtures: they start the broker watchdog.
    inbox_test_support::amqp::amqp_url()?;
    Some(url)
}

fn amqp_url() -> String {
    url_of(Service::Amqp).expect("checked by database_url")
}

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --example {name}`",
        path.display()
    );
    path
}

struct Schema {
    base: String,
    name: String,
    url: String,
}

impl Schema {
    fn new(base: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!("rb_{}_{nanos}", std::process::id());
        let mut conn = PgConnection::establish(base).unwrap();
        conn.batch_execute(&format!("CREATE SCHEMA \"{name}\""))
            .unwrap();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-csearch_path%3D{name}");
        Self {
            base: base.to_owned(),
            name,
            url,
        }
    }

    fn count(&self, sql: &str) -> i64 {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut conn = PgConnection::establish(&self.url).unwrap();
        diesel::sql_query(sql)
            .get_result::<N>(&mut conn)
            .map(|r| r.n)
            .unwrap_or(-1)
    }

    fn execute(&self, sql: &str) {
        let mut conn = PgConnection::establish(&self.url).unwrap();
        conn.batch_execute(sql).unwrap();
    }

    /// Rows where daily_usage and the ledger's sums disagree, over every day.
    fn mismatches(&self) -> i64 {
        self.count(
            "SELECT COUNT(*)::bigint AS n FROM daily_usage d \
             FULL JOIN (SELECT user_id, day, SUM(amount)::bigint AS total FROM usage_ledger \
                        GROUP BY 1, 2) l USING (user_id, day) \
             WHERE d.total IS DISTINCT FROM l.total",
        )
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.base) {
            let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        }
        // The consumer's queues carry no expiry: remove them (a test's consumers are
        // gone by now, being declared after the schema).
        let topology =
            inbox_test_support::amqp::usage_consumer_topology(&format!("{}.", self.name));
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            // Bounded: a broker that stopped answering must not hang the test's end.
            rt.block_on(async {
                let props = lapin::ConnectionProperties::default();
                let url = amqp_url();
                let connect = lapin::Connection::connect(&url, props);
                let within = Duration::from_secs(10);
                if let Ok(Ok(conn)) = tokio::time::timeout(within, connect).await {
                    let _ = tokio::time::timeout(within, topology.delete(&conn)).await;
                    let _ = conn.close(200, "done".into()).await;
                }
            });
        }
    }
}

/// Kills the child if the test fails before it does.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn consumer(schema: &Schema, env: &[(&str, &str)]) -> KillOnDrop {
    let child = Command::new(example("usage_consumer"))
        .envs(env.iter().copied())
        .env("DATABASE_URL", &schema.url)
        .env("AMQP_URL", amqp_url())
        .env("INBOX_PREFIX", format!("{}.", schema.name))
        .env("RUST_LOG", "warn,inbox_diesel=info,inbox_amqp=warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while schema.count("SELECT COUNT(*)::bigint AS n FROM usage_ledger") < 0 {
        assert!(Instant::now() < deadline, "the consumer did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    KillOnDrop(Some(child))
}

fn stop(mut child: KillOnDrop) -> Output {
    let pid = child.0.as_ref().unwrap().id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    child.0.take().unwrap().wait_with_output().unwrap()
}

fn usage_ops(url: &str, args: &[&str]) -> Output {
    Command::new(example("usage_ops"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "usage_ops failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn field(v: &serde_json::Value, name: &str) -> u64 {
    v[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

/// Messages ready in the group's queue (0 once the consumer has taken everything).
fn ready(schema: &Schema) -> u32 {
    let queue = Topology::new("billing")
        .unwrap()
        .prefix(format!("{}.", schema.name))
        .unwrap()
        .queue(&ConsumerGroup::new("billing.daily-usage").unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let amqp = amqp_url();
        let conn = lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let q = channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        let n = q.message_count();
        let _ = conn.close(0, "".into()).await;
        n
    })
}

/// `usage_consumer: stopped after N deliveries: P processed, D duplicates, ...`
fn consumer_stats(out: &Output) -> (u64, u64, u64) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("stopped after"))
        .unwrap_or_else(|| panic!("no stats line in {stdout}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (numbers[0], numbers[1], numbers[2])
}

#[test]
fn rebuilds_racing_live_consumers_leave_no_drift_and_turn_deliveries_into_duplicates() {
    let Some(base) = database_url() else { return };
    let schema = Schema::new(&base);
    let consuming = consumer(&schema, &[]);

    // Rebuilds of the window in a loop.
    let stop_loop = Arc::new(AtomicBool::new(false));
    let looping = {
        let stop_loop = Arc::clone(&stop_loop);
        let url = schema.url.clone();
        std::thread::spawn(move || {
            let mut reports = Vec::new();
            // Today always, yesterday every other run, the day before never: its
            // events are all applied live, beside rebuilds of the other days.
            while !stop_loop.load(Ordering::SeqCst) {
                let days = if reports.len() % 2 == 0 { "1" } else { "2" };
                let out = usage_ops(&url, &["rebuild", "daily_usage", "--days", days, "--json"]);
                reports.push(json(&out));
            }
            reports
        })
    };

    // Two rounds of the producer: the second writes its ledger while rebuilds run.
    for _ in 0..2 {
        let out = Command::new(example("usage_producer"))
            .env("DATABASE_URL", &schema.url)
            .env("AMQP_URL", amqp_url())
            .env("INBOX_PREFIX", format!("{}.", schema.name))
            .env("USAGE_EVENTS", "1500")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Let the rebuilds race the consumer a little longer, then stop them.
    std::thread::sleep(Duration::from_secs(1));
    stop_loop.store(true, Ordering::SeqCst);
    let reports = looping.join().unwrap();

    // The consumer drains: nothing ready in its queue for a while.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut quiet = 0;
    while quiet < 5 {
        assert!(Instant::now() < deadline, "the consumer never drained");
        quiet = if ready(&schema) == 0 { quiet + 1 } else { 0 };
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = stop(consuming);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (deliveries, processed, duplicates) = consumer_stats(&out);

    // No final rebuild: the audit sees what the race left.
    let audit = json(&usage_ops(
        &schema.url,
        &["audit", "daily_usage", "--days", "3", "--json"],
    ));
    let events = schema.count("SELECT COUNT(*)::bigint AS n FROM usage_ledger");
    let overlapped = reports
        .iter()
        .filter(|r| field(r, "lock_waits") > 0)
        .count();
    let covered_first: u64 = reports.iter().map(|r| field(r, "claims_recorded")).sum();
    let changed: u64 = reports.iter().map(|r| field(r, "rows_changed")).sum();
    println!(
        "{} rebuilds ({} overlapped live batches and waited for them; {} rows changed, \
         {} events covered before their delivery); consumer: {} deliveries, {} processed, \
         {} duplicates; ledger: {} events; audit: {}",
        reports.len(),
        overlapped,
        changed,
        covered_first,
        deliveries,
        processed,
        duplicates,
        events,
        audit
    );
    assert_eq!(field(&audit, "rows_differing"), 0, "{audit}");
    assert_eq!(
        schema.mismatches(),
        0,
        "daily_usage differs from the ledger"
    );
    assert_eq!(
        schema.count(
            "SELECT COUNT(*)::bigint AS n FROM inbox_claims WHERE status = 'done' \
             AND consumer_group = 'billing.daily-usage'"
        ),
        events,
        "one done claim per ledger event"
    );
    assert!(
        duplicates > 0,
        "no delivery met a covered claim: the rebuilds did not race the consumer"
    );
    assert!(processed > 0, "no event was applied live");
    assert_eq!(processed + duplicates, deliveries);
}

#[test]
fn the_consumer_rebuilds_on_its_schedule_and_heals_a_row() {
    let Some(base) = database_url() else { return };
    let schema = Schema::new(&base);
    // From the environment, as a deployment sets it.
    let consuming = consumer(
        &schema,
        &[
            ("INBOX_REBUILD_EVERY", "300ms"),
            ("INBOX_REBUILD_DAYS", "2"),
        ],
    );
    let today = chrono::Utc::now().date_naive();
    // A ledger row whose event was never applied, and an inflated row outside the
    // window (three days ago) that the schedule must leave alone.
    let old = today.checked_sub_days(chrono::Days::new(3)).unwrap();
    schema.execute(&format!(
        "INSERT INTO usage_ledger (user_id, day, amount) VALUES (7, '{today}', 40);
         INSERT INTO daily_usage (user_id, day, total) VALUES (8, '{old}', 999);"
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while schema.count(&format!(
        "SELECT COALESCE(MAX(total), 0)::bigint AS n FROM daily_usage WHERE user_id = 7 AND day = '{today}'"
    )) != 40
    {
        assert!(Instant::now() < deadline, "the scheduled rebuild never healed the row");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = stop(consuming);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("rebuilding daily_usage every 300ms over 2 days"),
        "{stdout}"
    );
    assert_eq!(
        schema.count(&format!(
            "SELECT total AS n FROM daily_usage WHERE user_id = 8 AND day = '{old}'"
        )),
        999,
        "outside the window"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("projection rebuilt"), "{stderr}");
}

#[test]
fn usage_ops_reports_and_refuses_clearly() {
    let Some(base) = database_url() else { return };
    let schema = Schema::new(&base);
    // Before any table exists: the projection commands never migrate (as the inbox's
    // own commands), so the schema check refuses, exit 3.
    let out = usage_ops(&schema.url, &["audit", "daily_usage", "--days", "2"]);
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("were the migrations run?"), "{stderr}");
    // The consumer migrates and creates the ledger; a hook's failure is exit 1.
    drop(consumer(&schema, &[]));
    schema.execute("ALTER TABLE usage_ledger RENAME TO usage_ledger_away");
    let out = usage_ops(&schema.url, &["audit", "daily_usage", "--window", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("usage_ledger"), "{stderr}");
    schema.execute("ALTER TABLE usage_ledger_away RENAME TO usage_ledger");
    let today = chrono::Utc::now().date_naive();
    schema.execute(&format!(
        "INSERT INTO usage_ledger (user_id, day, amount) VALUES (1, '{today}', 10), (2, '{today}', 5);
         INSERT INTO daily_usage (user_id, day, total) VALUES (1, '{today}', 24), (3, '{today}', 1);"
    ));
    let audit = json(&usage_ops(
        &schema.url,
        &["audit", "daily_usage", "--days", "1", "--json"],
    ));
    for name in ["rows_checked", "rows_differing", "largest_ratio"] {
        assert!(audit.get(name).is_some(), "{name} missing in {audit}");
    }
    assert_eq!(field(&audit, "rows_checked"), 3);
    assert_eq!(field(&audit, "rows_differing"), 3);
    assert_eq!(audit["largest_ratio"].as_f64(), Some(2.4));
    let text = usage_ops(&schema.url, &["audit", "daily_usage", "--days", "1"]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.starts_with("audit daily_usage: 1 partitions, 3 rows checked, 3 differing (1 extra), largest ratio 2.40"),
        "{text}"
    );
    let rebuilt = json(&usage_ops(
        &schema.url,
        &["rebuild", "daily_usage", "--days", "1", "--json"],
    ));
    for name in ["partitions", "rows_changed", "events_covered"] {
        assert!(rebuilt.get(name).is_some(), "{name} missing in {rebuilt}");
    }
    assert_eq!(field(&rebuilt, "partitions"), 1);
    assert_eq!(field(&rebuilt, "rows_changed"), 3);
    assert_eq!(field(&rebuilt, "events_covered"), 2);
    assert_eq!(schema.mismatches(), 0);
    // Bad input: an unknown projection (4, not found), a window of 0 days or no
    // number (2).
    let out = usage_ops(&schema.url, &["rebuild", "weekly_usage", "--days", "1"]);
    assert_eq!(out.status.code(), Some(4));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown projection weekly_usage: expected one of [daily_usage]"),
        "{stderr}"
    );
    for bad in [
        &["rebuild", "daily_usage", "--days", "0"][..],
        &["audit", "daily_usage", "--days", "x"],
    ] {
        assert_eq!(
            usage_ops(&schema.url, bad).status.code(),
            Some(2),
            "{bad:?}"
        );
    }
}

/// `usage_ops` mounts the inbox's operator commands beside its own, under one global
/// `--json`: they run through the real binary with `inbox`'s documents and exit codes.
#[test]
fn usage_ops_mounts_the_inbox_commands() {
    let Some(base) = database_url() else { return };
    let schema = Schema::new(&base);
    // The operator commands never migrate: before the inbox's tables exist, exit 3.
    let out = usage_ops(&schema.url, &["stats"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nor do the projection commands.
    let out = usage_ops(&schema.url, &["audit", "daily_usage", "--days", "1"]);
    assert_eq!(out.status.code(), Some(3));
    drop(consumer(&schema, &[]));
    let list = json(&usage_ops(&schema.url, &["dead-letters", "list", "--json"]));
    assert_eq!(list["dead_letters"], serde_json::json!([]), "{list}");
    assert_eq!(
        (list["offset"].as_u64(), list["limit"].as_u64()),
        (Some(0), Some(50))
    );
    let halted = json(&usage_ops(&schema.url, &["--json", "groups", "list"]));
    assert_eq!(halted, serde_json::json!({ "halted": [] }));
    let stats = json(&usage_ops(&schema.url, &["--json", "stats"]));
    assert!(stats["outbox"]["backlog"].is_u64(), "{stats}");
    let out = usage_ops(&schema.url, &["--json", "dead-letters", "show", "7"]);
    assert_eq!(out.status.code(), Some(4));
    let out = usage_ops(&schema.url, &["groups", "resume", "billing.daily-usage"]);
    assert_eq!(out.status.code(), Some(4));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("consumer group billing.daily-usage is not halted"),
        "{stderr}"
    );
    // Its own commands take the global --json in either place.
    for args in [
        &["--json", "audit", "daily_usage", "--window", "1"][..],
        &["audit", "daily_usage", "--window", "1", "--json"],
    ] {
        let audit = json(&usage_ops(&schema.url, args));
        assert_eq!(field(&audit, "rows_checked"), 0, "{audit}");
        assert_eq!(audit["projection"], "daily_usage", "{audit}");
    }
}
