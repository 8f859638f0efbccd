//! The example consumer as a process, sent a header table nested as deep as a frame
//! of `inbox_amqp::FRAME_MAX` bytes allows, between two valid events: lapin's
//! recursive parser must not overflow its thread's stack (the example sets
//! `RUST_MIN_STACK`), the neighbours are applied once, the poison (not a valid usage
//! event) is dead-lettered, and SIGTERM still ends the process with exit 0.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use diesel::{Connection, PgConnection, RunQueryDsl};
use inbox_test_support::amqp::{amqp_url, raw};
use inbox_test_support::PgFixture;

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
    topology: inbox_amqp::Topology,
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

/// A tagged table value (`F`) nesting `depth` tables, each the only entry of the one
/// around it under an empty name: 6 bytes a level, the fewest AMQP allows.
fn nested_with_empty_names(depth: usize) -> Vec<u8> {
    let mut value = vec![b'F', 0, 0, 0, 0];
    for _ in 1..depth {
        let mut outer = vec![b'F'];
        outer.extend(((1 + value.len()) as u32).to_be_bytes());
        outer.push(0); // the empty name
        outer.extend(value);
        value = outer;
    }
    value
}

/// The deepest `deep` header whose content-header frame still fits in `frame_max`
/// bytes, with this message id and type.
fn deepest_headers(frame_max: u32, id: &[u8], kind: &[u8]) -> (Vec<u8>, usize) {
    // Frame: type 1, channel 2, size 4, end 1. Header: class 2, weight 2, body size
    // 8, flags 2, the table (length 4, name "deep" 1 + 4, the value), delivery mode
    // 1, message id 1 + n, type 1 + n.
    let fixed = 8 + 14 + 4 + 5 + 1 + (1 + id.len()) + (1 + kind.len());
    let budget = frame_max as usize - fixed;
    let depth = 1 + (budget - 5) / 6;
    let headers = raw::table(&[(b"deep", nested_with_empty_names(depth))]);
    (headers, depth)
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

fn body(user: i64, amount: i64) -> Vec<u8> {
    format!(r#"{{"user_id": {user}, "day": "2026-11-30", "amount": {amount}}}"#).into_bytes()
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
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    let _ = conn.close(200, "done".into()).await;
    declared.is_ok_and(|q| q.consumer_count() > 0)
}

#[test]
fn a_table_as_deep_as_a_frame_allows_costs_its_neighbours_nothing() {
    let Some(amqp) = amqp_url() else { return };
    let Some(db) = PgFixture::new() else { return };
    let schema = db.schema.clone();
    let sep = if db.url().contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}options=-csearch_path%3D{schema}", db.url());
    let prefix = format!("{schema}.");
    let topology = inbox_test_support::amqp::usage_consumer_topology(&prefix);
    let _teardown = Teardown {
        amqp: amqp.clone(),
        topology,
    };
    let mut child = KillOnDrop(Some(
        Command::new(example_binary())
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", &amqp)
            .env("INBOX_PREFIX", &prefix)
            // The example's own setting, as a user who sets nothing gets it.
            .env_remove("RUST_MIN_STACK")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let queue = format!("{prefix}billing.daily-usage");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !runtime.block_on(consumed(&amqp, &queue)) {
        assert!(Instant::now() < deadline, "the example did not start");
        std::thread::sleep(Duration::from_millis(100));
    }

    let exchange = format!("{prefix}billing");
    let kind = b"usage.recorded";
    let (headers, depth) = deepest_headers(inbox_amqp::FRAME_MAX, b"deep-poison", kind);
    eprintln!("a header table {depth} levels deep");
    let started = Instant::now();
    runtime.block_on(async {
        for (i, poison) in [(1i64, false), (0, true), (3, false)] {
            let (id, headers, payload) = if poison {
                (
                    b"deep-poison".to_vec(),
                    Some(headers.clone()),
                    br#"{"case": "deep"}"#.to_vec(),
                )
            } else {
                (format!("deep-neighbour-{i}").into_bytes(), None, body(7, i))
            };
            let props = raw::Properties {
                message_id: Some(id),
                message_type: Some(kind.to_vec()),
                headers,
            };
            let within = Duration::from_secs(120);
            raw::publish_within(&amqp, &exchange, "usage.recorded", &props, &payload, within)
                .await
                .unwrap_or_else(|e| panic!("publish: {e}"));
        }
    });

    eprintln!("published in {:?}", started.elapsed());
    let mut conn = PgConnection::establish(&url).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let settled = loop {
        let total = count(
            &mut conn,
            "SELECT COALESCE(SUM(total), 0)::bigint AS n FROM daily_usage",
        );
        let dead = count(
            &mut conn,
            "SELECT count(*)::bigint AS n FROM inbox_dead_letters \
             WHERE message_key = 'deep-poison' AND reason = 'decode_error'",
        );
        if let Some(exited) = child.0.as_mut().unwrap().try_wait().unwrap() {
            let out = child.0.take().unwrap().wait_with_output().unwrap();
            panic!(
                "the consumer died ({exited}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if total == 4 && dead == 1 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("settled {settled} after {:?}", started.elapsed());
    let all_dead = count(
        &mut conn,
        "SELECT count(*)::bigint AS n FROM inbox_dead_letters",
    );

    let status = Command::new("kill")
        .args(["-TERM", &child.0.as_ref().unwrap().id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(settled, "not settled in time: {stdout} {stderr}");
    assert!(
        out.status.success(),
        "exit {:?}: {stdout} {stderr}",
        out.status
    );
    assert_eq!(all_dead, 1, "only the poison is a dead letter");
    // Three deliveries, none redelivered: the neighbours were applied once, the
    // poison dead-lettered as not a usage event.
    assert!(
        stdout.contains(
            "stopped after 3 deliveries: 2 processed, 0 duplicates, 0 retried, 1 dead-lettered"
        ),
        "{stdout} {stderr}"
    );
}
