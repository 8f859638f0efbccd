//! `inbox selftest --relay` against a running `usage_consumer` (which enables the
//! canary handler with one line): every canary arrives once, exit 0; with the consumer
//! stopped, they are lost, exit 6 saying so.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_amqp::Topology;
use inbox_core::{ConsumerGroup, RetryLadder};
use inbox_test_support::amqp::{self, amqp_url};
use inbox_test_support::{postgres_url, unique_name};
use serde_json::Value;

/// The example, built next to this test by `cargo test --workspace`.
fn usage_consumer() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join("usage_consumer");
    assert!(
        path.exists(),
        "{} is missing: run `cargo build -p inbox-examples --example usage_consumer`",
        path.display()
    );
    path
}

struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn selftest(db: &str, amqp: &str, prefix: &str, timeout: &str) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env("DATABASE_URL", db)
        .env("AMQP_URL", amqp)
        .env("INBOX_PREFIX", prefix)
        .args([
            "--json",
            "selftest",
            "--relay",
            "--count",
            "5",
            "--timeout",
            timeout,
        ])
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    (
        out.status.code().unwrap(),
        json,
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn selftest_passes_against_a_running_consumer_and_fails_once_it_is_stopped() {
    let Some(amqp_url) = amqp_url() else { return };
    let Some(base) = postgres_url() else { return };
    let schema = unique_name("st");
    let mut conn = PgConnection::establish(&base).unwrap();
    conn.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
        .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    let db = format!("{base}{sep}options=-csearch_path%3D{schema}");
    let prefix = format!("{}.", unique_name("st"));
    let topology = Topology::new("billing")
        .unwrap()
        .prefix(prefix.clone())
        .unwrap()
        .ladder(RetryLadder::new([Duration::from_millis(50)]).unwrap())
        .group(
            ConsumerGroup::new("billing.daily-usage").unwrap(),
            ["usage.recorded"],
        )
        .group(
            ConsumerGroup::new("inbox.canary").unwrap(),
            ["inbox.canary"],
        );
    // The consumer's queues go whatever the outcome, after it (declared before it).
    let _topology = amqp::DeleteOnDrop::new(amqp_url.clone(), topology);

    let mut child = Command::new(usage_consumer())
        .env("DATABASE_URL", &db)
        .env("AMQP_URL", &amqp_url)
        .env("INBOX_PREFIX", &prefix)
        .env("INBOX_RETRY_LADDER", "50ms")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut guard = KillOnDrop(Some(child));
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("consuming"), "{first}");

    let (code, report, stderr) = selftest(&db, &amqp_url, &prefix, "30s");
    assert_eq!(code, 0, "{report} {stderr}");
    assert_eq!(report["arrived"], 5);
    assert_eq!(
        (report["lost"].as_u64(), report["doubled"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(report["latency_ms"]["p50"].as_f64().is_some(), "{report}");

    // Stopped (SIGTERM, drained): nothing consumes the canaries.
    let mut child = guard.0.take().unwrap();
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(child.wait().unwrap().success());
    let (code, report, stderr) = selftest(&db, &amqp_url, &prefix, "2s");
    assert_eq!(code, 6, "{report}");
    assert_eq!(report["lost"], 5);
    assert_eq!(report["passed"], false);
    assert!(stderr.contains("5 of 5 canaries lost"), "{stderr}");

    let _ = conn.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"));
}
