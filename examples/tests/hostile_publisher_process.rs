//! The example consumer as a process, fed by a hostile publisher:
//!
//! - log forging: a `message_id`, a `type` and a header carrying `\n`, ESC and a fake
//!   `ERROR` line reach the consumer's log events escaped, so its stderr keeps one
//!   event per line and no raw control byte (`inbox_core::display::escape`);
//! - the body limit: bodies over `max_body_bytes` (the example keeps the 1 MiB
//!   default) are dead-lettered with only their first `CUT_PAYLOAD_PREFIX` bytes,
//!   their length and their SHA-256, and the consumer's peak RSS grows by about what
//!   lapin holds (the deliveries in flight, each assembled once), not by copies of
//!   each body.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use diesel::{Connection, PgConnection, RunQueryDsl};
use inbox_amqp::Topology;
use inbox_core::ConsumerGroup;
use inbox_test_support::amqp::{amqp_url, confirm_channel, connect, wait_for_confirms};
use inbox_test_support::PgFixture;
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::BasicProperties;
use sha2::{Digest, Sha256};

const GROUP: &str = "billing.daily-usage";
const TYPE: &str = "usage.recorded";

/// `cargo test` builds the package's examples next to its test binaries.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join("usage_consumer");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --example usage_consumer`",
        path.display()
    );
    path
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

/// Deletes the example's queues and exchange (they carry no expiry) when the test
/// ends, passed or not.
struct Teardown {
    amqp: String,
    topology: Topology,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Runtime::new() else {
            return;
        };
        runtime.block_on(async {
            let props = lapin::ConnectionProperties::default();
            if let Ok(conn) = lapin::Connection::connect(&self.amqp, props).await {
                let _ = self.topology.delete(&conn).await;
                let _ = conn.close(200, "done".into()).await;
            }
        });
    }
}

/// The example consumer running on a schema of its own, with its names prefixed.
struct Running {
    child: KillOnDrop,
    prefix: String,
    url: String,
    amqp: String,
    topology: Topology,
    runtime: tokio::runtime::Runtime,
    _teardown: Teardown,
    _db: PgFixture,
}

impl Running {
    fn start() -> Option<Self> {
        let amqp = amqp_url()?;
        let db = PgFixture::new()?;
        let schema = db.schema.clone();
        let sep = if db.url().contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}options=-csearch_path%3D{schema}", db.url());
        let prefix = format!("{schema}.");
        // The program's whole topology, its canary group's queues included.
        let topology = inbox_test_support::amqp::usage_consumer_topology(&prefix);
        let teardown = Teardown {
            amqp: amqp.clone(),
            topology: topology.clone(),
        };
        let child = spawn(&url, &amqp, &prefix);
        let running = Self {
            child,
            prefix,
            url,
            amqp,
            topology,
            runtime: tokio::runtime::Runtime::new().unwrap(),
            _teardown: teardown,
            _db: db,
        };
        let group = ConsumerGroup::new(GROUP).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        for queue in [running.topology.queue(&group), running.topology.dlq(&group)] {
            while !running.runtime.block_on(consumed(&running.amqp, &queue)) {
                assert!(Instant::now() < deadline, "the example did not start");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Some(running)
    }

    /// Stops the process (it must exit 0) and starts it again on the same schema and
    /// broker names, without waiting for it to consume.
    fn restart(mut self) -> Self {
        if self.child.0.is_some() {
            self.stop_child();
        }
        self.child = spawn(&self.url, &self.amqp, &self.prefix);
        self
    }

    fn pid(&self) -> u32 {
        self.child.0.as_ref().unwrap().id()
    }

    /// Publishes each (exchange, routing key, properties, body) with a confirm.
    fn publish(&self, messages: Vec<(String, String, BasicProperties, Vec<u8>)>) {
        self.runtime.block_on(async {
            let conn = connect(&self.amqp).await;
            let channel = confirm_channel(&conn).await;
            for (exchange, routing_key, props, body) in messages {
                channel
                    .basic_publish(
                        exchange.as_str().into(),
                        routing_key.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        props,
                    )
                    .await
                    .unwrap();
                // One body at a time: this process holds no more than one either.
                wait_for_confirms(&channel).await;
            }
            let _ = conn.close(200, "published".into()).await;
        });
    }

    /// Waits until `sql` counts `n` (the consumer must stay alive meanwhile).
    fn wait_for(&mut self, sql: &str, n: i64, limit: Duration) -> bool {
        let mut conn = PgConnection::establish(&self.url).unwrap();
        let deadline = Instant::now() + limit;
        loop {
            if count(&mut conn, sql) == n {
                return true;
            }
            if let Some(exited) = self.child.0.as_mut().unwrap().try_wait().unwrap() {
                let out = self.child.0.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "the consumer died ({exited}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then the process's output; it must exit 0.
    fn stop(mut self) -> Output {
        self.stop_child()
    }

    fn stop_child(&mut self) -> Output {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let out = self.child.0.take().unwrap().wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "exit {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

fn spawn(url: &str, amqp: &str, prefix: &str) -> KillOnDrop {
    KillOnDrop(Some(
        Command::new(example_binary())
            .env("DATABASE_URL", url)
            .env("AMQP_URL", amqp)
            .env("INBOX_PREFIX", prefix)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ))
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

fn count(conn: &mut PgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .map(|c| c.n)
        .unwrap_or(-1)
}

/// Whether `queue` exists and has a consumer.
async fn consumed(url: &str, queue: &str) -> bool {
    let Ok(conn) = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await
    else {
        return false;
    };
    let Ok(channel) = conn.create_channel().await else {
        return false;
    };
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = conn.close(200, "done".into()).await;
    declared.is_ok_and(|q| q.consumer_count() > 0)
}

fn props(id: &str, kind: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_type(kind.into())
        .with_delivery_mode(2)
}

fn with_header(props: BasicProperties, name: &str, value: &str) -> BasicProperties {
    let mut table = FieldTable::default();
    table.insert(
        name.into(),
        AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
    );
    props.with_headers(table)
}

/// A line that, written raw into the log, reads as an event of its own.
const FORGED: &str =
    "2026-12-01T00:00:00.000000Z ERROR inbox_amqp::consumer: FORGED database wiped";

/// Whether `c` would act on a terminal or split a line: a control character of C0
/// (other than the line feed ending each event), DEL, or one of C1.
fn raw_control(c: char) -> bool {
    (c.is_control() && c != '\n') || ('\u{80}'..='\u{9f}').contains(&c)
}

#[test]
fn forged_log_lines_stay_inside_one_event_each() {
    let Some(running) = Running::start() else {
        return;
    };
    let group = ConsumerGroup::new(GROUP).unwrap();
    let exchange = running.topology.exchange();
    let not_json = b"not a usage event".to_vec();
    let id_newline = format!("forge-newline\n{FORGED}");
    let id_escape = "forge-escape\u{1b}[2J\u{1b}]0;owned\u{7}\u{9b}31m\u{202e}";
    let type_newline = format!("{TYPE}\n{FORGED}");
    let messages = vec![
        // A key with a newline: the handler fails to decode it, logged with its key.
        (
            exchange.clone(),
            TYPE.to_owned(),
            props(&id_newline, TYPE),
            not_json.clone(),
        ),
        // A key with ESC sequences (clear screen, set title), a C1 CSI and a bidi
        // override.
        (
            exchange.clone(),
            TYPE.to_owned(),
            props(id_escape, TYPE),
            not_json.clone(),
        ),
        // A type no handler takes, with a newline.
        (
            exchange.clone(),
            TYPE.to_owned(),
            props("forge-type", &type_newline),
            not_json.clone(),
        ),
        // A header the consumer logs: a client publishing straight to the group's
        // `:dlq` sets the reason the broker would have given.
        (
            String::new(),
            running.topology.dlq(&group),
            with_header(
                props("forge-header", TYPE),
                "x-first-death-reason",
                &format!("rejected\n{FORGED}\u{1b}[8m"),
            ),
            not_json,
        ),
    ];
    running.publish(messages);
    let mut running = running;
    let settled = running.wait_for(
        "SELECT count(*)::bigint AS n FROM inbox_dead_letters",
        4,
        Duration::from_secs(60),
    );
    let out = running.stop();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(settled, "not dead-lettered in time: {stderr}");
    eprintln!("{stderr}");

    let raw: Vec<(usize, &str)> = stderr
        .lines()
        .enumerate()
        .filter(|(_, l)| l.chars().any(raw_control))
        .collect();
    assert!(raw.is_empty(), "raw control characters logged: {raw:?}");
    // Each event is one line starting with its own timestamp; a forged line would
    // start with the publisher's.
    let forged: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("2026-12-01T00:00:00.000000Z") || l.contains("\u{1b}"))
        .collect();
    assert!(forged.is_empty(), "forged log lines: {forged:?}");
    let events = |needle: &str| stderr.lines().filter(|l| l.contains(needle)).count();
    for (what, shown) in [
        (
            "the key with a newline",
            "forge-newline\\n2026-12-01T00:00:00",
        ),
        (
            "the key with ESC",
            "forge-escape\\u{1b}[2J\\u{1b}]0;owned\\u{7}\\u{9b}31m\\u{202e}",
        ),
        (
            "the header with a newline",
            "rejected\\n2026-12-01T00:00:00",
        ),
    ] {
        assert!(events(shown) >= 1, "{what} is not logged escaped: {stderr}");
    }
    // Every line that shows the forged text is an event of the consumer's own, about
    // one of these messages.
    for line in stderr.lines().filter(|l| l.contains("FORGED")) {
        assert!(
            !line.starts_with("2026-12-01T00:00:00.000000Z") && line.contains("forge-"),
            "a forged event: {line:?}"
        );
    }
}

/// `/proc/<pid>/status`'s `field` (`VmHWM`, `VmRSS`) in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb * 1024
}

const MIB: u64 = 1 << 20;

#[test]
fn oversized_bodies_are_cut_and_cost_the_consumer_only_what_lapin_holds() {
    let Some(running) = Running::start() else {
        return;
    };
    // The example's settings: 2 workers, each with the default prefetch (far above
    // the bodies sent), and the default body limit of 1 MiB. The bodies are queued
    // while the consumer is down, so all of them arrive at once when it starts: lapin
    // holds each in flight once, assembled, before handing it over.
    const BODIES: u64 = 3;
    const BODY: u64 = 32 * MIB;
    let defaults = inbox_amqp::ConsumerSettings::default();
    let in_flight = BODIES.min(defaults.workers as u64 * u64::from(defaults.prefetch));
    assert_eq!(defaults.max_body_bytes as u64, MIB);

    // The same program, started and consuming, before any body: the baseline.
    std::thread::sleep(Duration::from_secs(1));
    let before = proc_status_bytes(running.pid(), "VmHWM");
    let mut idle = running;
    idle.stop_child();
    let exchange = idle.topology.exchange();
    let mut digests: Vec<[u8; 32]> = Vec::new();
    for i in 0..BODIES {
        let mut body = vec![b'{'; BODY as usize];
        body[..8].copy_from_slice(&i.to_be_bytes());
        digests.push(Sha256::digest(&body).into());
        idle.publish(vec![(
            exchange.clone(),
            TYPE.to_owned(),
            props(&format!("oversized-{i}"), TYPE),
            body,
        )]);
    }
    let started = Instant::now();
    let mut running = idle.restart();
    let pid = running.pid();
    let settled = running.wait_for(
        "SELECT count(*)::bigint AS n FROM inbox_dead_letters WHERE reason = 'malformed'",
        BODIES as i64,
        Duration::from_secs(120),
    );
    let peak = proc_status_bytes(pid, "VmHWM");
    let elapsed = started.elapsed();
    let grown = peak.saturating_sub(before);
    eprintln!(
        "{BODIES} bodies of {} MiB over a 1 MiB limit, dead-lettered in {elapsed:?}: peak RSS \
         {} MiB, {} MiB idle, grown {} MiB",
        BODY / MIB,
        peak / MIB,
        before / MIB,
        grown / MIB
    );
    assert!(settled, "not dead-lettered in time");
    // What lapin holds: each delivery in flight, assembled once (its buffer may end
    // up to a quarter larger than the body), plus 32 MiB for everything else (the
    // runtime, the pool, frame buffers). Each copy the consumer made of a body (into
    // a letter, into a statement's parameters) would add the body again.
    let bound = in_flight * (BODY + BODY / 4) + 32 * MIB;
    assert!(
        grown <= bound,
        "the consumer grew {} MiB with {in_flight} bodies of {} MiB in flight; the bound \
         is {} MiB",
        grown / MIB,
        BODY / MIB,
        bound / MIB
    );

    let mut conn = PgConnection::establish(&running.url).unwrap();
    #[derive(diesel::QueryableByName, Debug)]
    struct Letter {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        stored: i64,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
        payload_length: Option<i64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Binary>)]
        payload_sha256: Option<Vec<u8>>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        last_error: Option<String>,
    }
    let letters: Vec<Letter> = diesel::sql_query(
        "SELECT length(payload)::bigint AS stored, payload_length, payload_sha256, last_error \
         FROM inbox_dead_letters ORDER BY id",
    )
    .load(&mut conn)
    .unwrap();
    running.stop();
    assert_eq!(letters.len(), BODIES as usize, "{letters:?}");
    for letter in &letters {
        assert_eq!(
            letter.stored,
            inbox_core::CUT_PAYLOAD_PREFIX as i64,
            "{letter:?}"
        );
        assert_eq!(letter.payload_length, Some(BODY as i64), "{letter:?}");
        let sha = letter.payload_sha256.clone().unwrap_or_default();
        assert!(digests.iter().any(|d| d[..] == sha[..]), "{letter:?}");
        assert!(
            letter
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("exceeds the limit")),
            "{letter:?}"
        );
    }
}
