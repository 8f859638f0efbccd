//! The examples' span export (the feature `otlp`), against a collector of the test's
//! own on loopback: `usage_consumer` with `OTEL_EXPORTER_OTLP_ENDPOINT` set sends its
//! delivery spans to `/v1/traces` as OTLP protobuf over HTTP, each the child of the
//! `traceparent` the message carried, and flushes them when it stops.
//!
//! Runs against the example built with the feature:
//! `cargo build -p inbox-examples --example usage_consumer --features otlp && cargo test -p inbox-examples --features otlp --test otlp_export`
//! (as `.ci/run` does).

#![cfg(feature = "otlp")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

/// One request the collector received: its request line, content type and body.
#[derive(Clone, Debug)]
struct Export {
    request_line: String,
    content_type: String,
    body: Vec<u8>,
}

/// An OTLP/HTTP collector that accepts every request with 200 and keeps it.
fn collector() -> (String, Arc<Mutex<Vec<Export>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&seen);
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let keep = Arc::clone(&keep);
            std::thread::spawn(move || serve(stream, &keep));
        }
    });
    (addr, seen)
}

/// Serves the requests of one (kept-alive) connection.
fn serve(stream: TcpStream, seen: &Mutex<Vec<Export>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let (mut length, mut content_type) = (0usize, String::new());
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().unwrap_or(0),
                "content-type" => content_type = value.trim().to_owned(),
                _ => {}
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        seen.lock().unwrap().push(Export {
            request_line: request_line.trim_end().to_owned(),
            content_type,
            body,
        });
        let reply =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if writer.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn hex(bytes: &str) -> Vec<u8> {
    (0..bytes.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&bytes[i..i + 2], 16).unwrap())
        .collect()
}

/// Kills the child if the test fails before it stops.
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Publishes one event with a `traceparent` header, confirmed and routed (retried
/// until the example has declared its exchange and bound its queue).
async fn publish(amqp: &str, exchange: &str, traceparent: &str) {
    let conn = inbox_test_support::amqp::connect(amqp).await;
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        "traceparent".into(),
        lapin::types::AMQPValue::LongString(traceparent.into()),
    );
    let props = lapin::BasicProperties::default()
        .with_message_id("evt-otlp-1".into())
        .with_type("usage.recorded".into())
        .with_headers(headers);
    let body = br#"{"user_id": 42, "day": "2026-11-30", "amount": 5}"#;
    let within = Duration::from_secs(30);
    inbox_test_support::amqp::publish_routed(
        &conn,
        exchange,
        "usage.recorded",
        body,
        props,
        within,
    )
    .await;
    let _ = conn.close(200, "done".into()).await;
}

#[test]
fn the_consumer_exports_its_delivery_span_as_the_child_of_the_message_trace() {
    let Some(base) = inbox_test_support::postgres_url() else {
        return;
    };
    let amqp = inbox_test_support::amqp::amqp_url().unwrap();
    let schema = inbox_test_support::unique_name("otlp");
    PgConnection::establish(&base)
        .unwrap()
        .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
        .unwrap();
    let url = inbox_test_support::search_path_url(&base, &schema);
    let prefix = format!("{schema}.");
    let _topology = inbox_test_support::amqp::DeleteOnDrop::new(
        amqp.clone(),
        inbox_test_support::amqp::usage_consumer_topology(&prefix),
    );
    let (collector, seen) = collector();
    let mut child = KillOnDrop(Some(
        Command::new(inbox_test_support::example_path("usage_consumer"))
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", &amqp)
            .env("INBOX_PREFIX", &prefix)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let exchange = format!("{prefix}billing");
    tokio::runtime::Runtime::new().unwrap().block_on(publish(
        &amqp,
        &exchange,
        &format!("00-{trace_id}-{parent}-01"),
    ));
    // Processed (the claim is done), then stopped as an operator stops it: the spans
    // still in the batch are flushed on the way out.
    let mut conn = PgConnection::establish(&url).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let done: Result<N, _> = diesel::RunQueryDsl::get_result(
            diesel::sql_query(
                "SELECT COUNT(*)::bigint AS n FROM inbox_claims WHERE status = 'done'",
            ),
            &mut conn,
        );
        if done.is_ok_and(|d| d.n == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "the event was never processed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = child.0.as_ref().unwrap().id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exports = seen.lock().unwrap().clone();
    assert!(!exports.is_empty(), "no request reached the collector");
    for export in &exports {
        assert_eq!(export.request_line, "POST /v1/traces HTTP/1.1");
        assert_eq!(export.content_type, "application/x-protobuf");
    }
    // The delivery span, by its name and attributes, in the message's trace and the
    // child of its span (protobuf keeps strings and ids as their bytes).
    let name = format!("process {exchange}");
    let delivery = exports
        .iter()
        .find(|e| contains(&e.body, name.as_bytes()))
        .unwrap_or_else(|| panic!("no span {name:?} in {} exports", exports.len()));
    for attribute in [
        &b"messaging.system"[..],
        b"rabbitmq",
        b"messaging.consumer.group.name",
        b"billing.daily-usage",
        b"evt-otlp-1",
    ] {
        assert!(
            contains(&delivery.body, attribute),
            "{:?} missing",
            String::from_utf8_lossy(attribute)
        );
    }
    assert!(contains(&delivery.body, &hex(trace_id)), "not in the trace");
    assert!(
        contains(&delivery.body, &hex(parent)),
        "not the parent's child"
    );
    drop(conn);
    let _ = PgConnection::establish(&base)
        .map(|mut c| c.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")));
}
