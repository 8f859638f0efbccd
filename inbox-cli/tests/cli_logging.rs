//! The `inbox` binary's logs: `RUST_LOG` filters them, `INBOX_LOG_FORMAT=json` writes
//! one JSON object per line on stderr; mounted, `inbox_cli::run` installs no subscriber
//! (no test of this binary installs one in its own process).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output};

use clap::Parser;

use inbox_test_support::{group, Fixture, SqliteFixture};

const HALTED: &str = "billing.audit";

/// A SQLite database with `billing.audit` halted.
fn halted_database() -> SqliteFixture {
    let fx = SqliteFixture::new();
    let store = fx.builder().build().unwrap();
    inbox_core::GroupHalts::record_halt(
        &store,
        &inbox_core::ClaimInvariantViolated {
            group: group(HALTED),
            key: inbox_core::MessageKey::new("k-9").unwrap(),
            detail: "insert conflicted but no row exists".to_owned(),
        },
    )
    .unwrap();
    fx
}

/// `inbox groups resume billing.audit` with `env`: inbox-diesel logs the resume at
/// `info` (target `inbox_diesel::operator::halts`).
fn resume(fx: &SqliteFixture, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inbox"));
    cmd.env_remove("RUST_LOG")
        .env_remove("INBOX_LOG_FORMAT")
        .env_remove("INBOX_SCHEMA")
        .env("DATABASE_URL", format!("sqlite://{}", fx.path));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.args(["groups", "resume", HALTED]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

#[test]
fn rust_log_and_the_json_format_show_the_librarys_info_event_as_a_json_line() {
    let fx = halted_database();
    let out = resume(&fx, &[("RUST_LOG", "info"), ("INBOX_LOG_FORMAT", "json")]);
    let err = stderr(&out);
    let line = err
        .lines()
        .find(|l| l.contains("consumer group resumed"))
        .unwrap_or_else(|| panic!("no log line of the resume on stderr: {err:?}"));
    let event: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(event["level"], "INFO", "{event}");
    assert_eq!(event["target"], "inbox_diesel::operator::halts", "{event}");
    assert_eq!(
        event["fields"]["message"], "consumer group resumed",
        "{event}"
    );
    assert_eq!(event["fields"]["group"], HALTED, "{event}");
    assert!(event["timestamp"].is_string(), "{event}");
    // The answer stays alone on stdout.
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.starts_with("resumed consumer group billing.audit"),
        "{stdout}"
    );
}

#[test]
fn rust_log_filters_and_the_default_format_is_text() {
    let fx = halted_database();
    let text = stderr(&resume(&fx, &[("RUST_LOG", "inbox_diesel=info")]));
    let line = text
        .lines()
        .find(|l| l.contains("consumer group resumed"))
        .unwrap_or_else(|| panic!("no log line of the resume on stderr: {text:?}"));
    assert!(line.contains(" INFO ") && !line.starts_with('{'), "{line}");
    assert!(line.contains("group=billing.audit"), "{line}");

    // Without RUST_LOG, the default filter (`warn`) keeps the info event out.
    let fx = halted_database();
    let quiet = stderr(&resume(&fx, &[]));
    assert!(!quiet.contains("consumer group resumed"), "{quiet}");
}

/// A host binary's command line.
#[derive(Parser)]
struct Ops {
    #[command(flatten)]
    inbox: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: inbox_cli::Command,
}

/// Mounted in a host binary, `inbox_cli::run` never installs a log subscriber: the
/// logs are the host's.
#[test]
fn run_installs_no_subscriber() {
    let fx = halted_database();
    let url = format!("sqlite://{}", fx.path);
    // A command whose library code logs (the resume, at info).
    let ops = Ops::try_parse_from([
        "ops",
        "--database-url",
        &url,
        "groups",
        "resume",
        "billing.audit",
    ])
    .unwrap();
    assert_eq!(
        inbox_cli::run(&ops.inbox, &ops.command),
        std::process::ExitCode::SUCCESS
    );
    assert!(
        !tracing::dispatcher::has_been_set(),
        "inbox_cli::run installed a global subscriber"
    );
}
