//! The metrics a user scrapes. The running example consumer's `/metrics`
//! (`INBOX_METRICS_ADDR`): after a known workload (processed, duplicates, dead letters
//! by reason) the documented series carry exactly the workload's counts, each metric
//! with its `# HELP` and `# TYPE`. And docs/metrics.md lists every metric of
//! `inbox_core::metrics::CATALOG` once, with its type, unit and labels as recorded,
//! and no metric the catalog does not have.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_core::metrics::{Label, CATALOG};
use inbox_test_support::metrics::scrape;

const GROUP: &str = "billing.daily-usage";

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

/// Kills the child if the test fails before it does.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The samples of a scrape: `name{labels}` -> value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_owned(), value.parse().unwrap())
        })
        .collect()
}

/// Publishes `(message id, body)` events as any AMQP client would, each confirmed and
/// routed (retried until the example has declared its exchange and bound its queue).
async fn publish(amqp: &str, exchange: &str, events: &[(&str, String)]) {
    let conn = inbox_test_support::amqp::connect(amqp).await;
    for (id, body) in events {
        let props = lapin::BasicProperties::default()
            .with_message_id((*id).into())
            .with_type("usage.recorded".into());
        let within = Duration::from_secs(30);
        let body = body.as_bytes();
        inbox_test_support::amqp::publish_routed(
            &conn,
            exchange,
            "usage.recorded",
            body,
            props,
            within,
        )
        .await;
    }
    let _ = conn.close(200, "done".into()).await;
}

fn usage(amount: i64) -> String {
    format!(r#"{{"user_id": 42, "day": "2026-11-30", "amount": {amount}}}"#)
}

/// Scrapes until every `(series, value)` of `want` is there, or fails after 30 s.
fn wait_for(addr: &str, want: &[(String, f64)]) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(addr);
        let got = samples(&text);
        if want.iter().all(|(k, v)| got.get(k) == Some(v)) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "waiting for {want:?} in:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn series(name: &str, labels: &str) -> String {
    format!("{name}{{{labels}}}")
}

#[test]
fn a_scrape_after_a_known_workload_shows_the_documented_series_exactly() {
    let Some(base) = inbox_test_support::postgres_url() else {
        return;
    };
    let amqp = inbox_test_support::amqp::amqp_url().unwrap();
    let schema = inbox_test_support::unique_name("exm");
    let url = schema_url(&base, &schema);
    let prefix = format!("{schema}.");
    let _topology = inbox_test_support::amqp::DeleteOnDrop::new(
        amqp.clone(),
        inbox_test_support::amqp::usage_consumer_topology(&prefix),
    );
    let mut child = KillOnDrop(
        Command::new(inbox_test_support::example_path("usage_consumer"))
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", &amqp)
            .env("INBOX_PREFIX", &prefix)
            .env("INBOX_METRICS_ADDR", "127.0.0.1:0")
            .env("INBOX_OPERATOR_GAUGES_EVERY", "100ms")
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The address it listens on, from its first line.
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the example never said where its metrics are");
        if let Some(rest) = line.strip_prefix("usage_consumer: metrics on http://") {
            break rest.strip_suffix("/metrics").unwrap().to_owned();
        }
    };

    let g = format!("group=\"{GROUP}\"");
    let exchange = format!("{prefix}billing");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // First copies: three valid events, two that cannot be decoded (dead-lettered at
    // once as decode_error).
    runtime.block_on(publish(
        &amqp,
        &exchange,
        &[
            ("evt-1", usage(40)),
            ("evt-2", usage(2)),
            ("evt-4", usage(7)),
            (
                "evt-3",
                r#"{"user_id": 42, "day": "2026-11-3", "amount": 5}"#.to_owned(),
            ),
            ("evt-5", "not json".to_owned()),
        ],
    ));
    wait_for(
        &addr,
        &[
            (series("inbox_processed_total", &g), 3.0),
            (
                series(
                    "inbox_dead_lettered_total",
                    &format!("{g},reason=\"decode_error\""),
                ),
                2.0,
            ),
        ],
    );
    // Then: two redelivered copies, and evt-4's key with another payload.
    runtime.block_on(publish(
        &amqp,
        &exchange,
        &[
            ("evt-1", usage(40)),
            ("evt-2", usage(2)),
            ("evt-4", usage(8)),
        ],
    ));
    wait_for(
        &addr,
        &[
            (series("inbox_duplicates_total", &g), 2.0),
            (series("inbox_key_collisions_total", &g), 1.0),
        ],
    );
    // Nothing else arrives late: the figures hold.
    std::thread::sleep(Duration::from_millis(300));
    let text = scrape(&addr);
    let got = samples(&text);
    let expected = [
        (series("inbox_processed_total", &g), 3.0),
        (series("inbox_duplicates_total", &g), 2.0),
        (series("inbox_key_collisions_total", &g), 1.0),
        (
            series(
                "inbox_dead_lettered_total",
                &format!("{g},reason=\"decode_error\""),
            ),
            2.0,
        ),
        (
            series(
                "inbox_dead_lettered_total",
                &format!("{g},reason=\"key_collision\""),
            ),
            1.0,
        ),
        (series("inbox_group_halted", &g), 0.0),
    ];
    for (k, v) in &expected {
        assert_eq!(got.get(k), Some(v), "{k} in:\n{text}");
    }
    // The operator gauges, published every 100 ms: the pending dead letters per reason
    // (summed over their failure groups), no outbox backlog.
    let pending = |got: &BTreeMap<String, f64>, reason: &str| -> f64 {
        let label = format!("reason=\"{reason}\"");
        got.iter()
            .filter(|(k, _)| k.starts_with("inbox_dead_letters_pending{") && k.contains(&label))
            .map(|(_, v)| v)
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(&addr);
        let got = samples(&text);
        let figures = (
            pending(&got, "decode_error"),
            pending(&got, "key_collision"),
            got.get("inbox_outbox_backlog").copied(),
        );
        if figures == (2.0, 1.0, Some(0.0)) {
            break;
        }
        assert!(Instant::now() < deadline, "{figures:?} in:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // No other dead-letter reason, no retry, no phantom conflict was counted.
    let dead: Vec<_> = got
        .keys()
        .filter(|k| k.starts_with("inbox_dead_lettered_total{"))
        .collect();
    assert_eq!(dead.len(), 2, "{dead:?}");
    for absent in ["inbox_retried_total", "inbox_phantom_conflicts_total"] {
        assert!(
            !got.keys().any(|k| k.starts_with(absent)),
            "{absent} in:\n{text}"
        );
    }
    // Each metric of the catalog that was recorded carries its help and type.
    for m in CATALOG {
        if got
            .keys()
            .any(|k| k.starts_with(&format!("{}{{", m.name)) || k == m.name)
        {
            assert!(
                text.contains(&format!("# HELP {} {}\n", m.name, m.help)),
                "{} help in:\n{text}",
                m.name
            );
            assert!(
                text.contains(&format!("# TYPE {} {}\n", m.name, m.kind.as_str())),
                "{} type in:\n{text}",
                m.name
            );
        }
    }
    drop(child);
    drop_schema(&base, &schema);
}

fn unit(u: metrics::Unit) -> &'static str {
    match u {
        metrics::Unit::Count => "count",
        metrics::Unit::Seconds => "seconds",
        metrics::Unit::Bytes => "bytes",
        other => other.as_str(),
    }
}

#[test]
fn the_reference_page_matches_the_catalog() {
    let page = include_str!("../../docs/metrics.md");
    // Rows of the metric tables: | `name` | type | unit | labels | meaning |
    let rows: Vec<Vec<&str>> = page
        .lines()
        .filter(|l| l.starts_with("| `inbox_"))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    for m in CATALOG {
        let name = format!("`{}`", m.name);
        let found: Vec<_> = rows.iter().filter(|r| r[0] == name).collect();
        assert_eq!(
            found.len(),
            1,
            "{} must have one row in docs/metrics.md",
            m.name
        );
        let row = found[0];
        assert_eq!(row[1], m.kind.as_str(), "{}: type", m.name);
        assert_eq!(row[2], unit(m.unit), "{}: unit", m.name);
        let labels: Vec<String> = m
            .labels
            .iter()
            .map(|l: &Label| format!("`{}`", l.as_str()))
            .collect();
        let labels = if labels.is_empty() {
            "-".to_owned()
        } else {
            labels.join(", ")
        };
        assert_eq!(row[3], labels, "{}: labels", m.name);
        assert_eq!(row[4], m.help, "{}: meaning", m.name);
    }
    for row in &rows {
        let name = row[0].trim_matches('`');
        assert!(
            CATALOG.iter().any(|m| m.name == name),
            "docs/metrics.md lists {name}, which no crate records"
        );
    }
}

/// Every metric the library crates record is named by a constant of the catalog
/// (`inbox_core::metrics`), never by a string literal, so none escapes its description
/// or the `inbox_` namespace.
#[test]
fn the_library_crates_record_metrics_by_the_catalog_s_names() {
    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in [
        "inbox-core",
        "inbox-diesel",
        "inbox-amqp",
        "inbox-cli",
        "inbox-outbox",
    ] {
        rust_files(&root.join(krate).join("src"), &mut files);
    }
    let mut sites = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for macro_name in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(macro_name) {
                let before = &text[..at];
                if before.ends_with("describe_") {
                    continue;
                }
                let name = text[at + macro_name.len()..].trim_start();
                assert!(
                    !name.starts_with('"'),
                    "{}: {macro_name} names its metric by a literal, not by inbox_core::metrics",
                    file.display()
                );
                sites += 1;
            }
        }
    }
    assert!(
        sites >= 30,
        "found only {sites} recording sites: is the scan still looking?"
    );
}
