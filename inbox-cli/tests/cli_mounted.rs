//! The commands mounted in a host binary that logs to stdout (tracing-subscriber's
//! default writer), as the README tells hosts to mount them: every command answers
//! with its documented exit code, none hangs. The broker client's I/O thread logs
//! through the host's subscriber; a command that held stdout's lock across the broker
//! calls stopped that thread, and with it the reply the command waited for (a missing
//! exchange hung for two minutes, then blamed a heartbeat).
//!
//! Each command runs on a thread of its own; one that does not answer within
//! [`ANSWER_WITHIN`] fails the test (a bound on a hang, not a timing of the command).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::ExitCode;
use std::sync::{mpsc, Once};
use std::time::Duration;

use clap::Parser;
use inbox_cli::exit;
use inbox_test_support::amqp::{self, amqp_url, test_topology, unique_prefix};
use inbox_test_support::{group, Fixture, SqliteFixture};

/// Longer than any answer (a refused login, a 404 on a passive declare, a local
/// database), far shorter than the hang (two minutes).
const ANSWER_WITHIN: Duration = Duration::from_secs(20);

/// A host binary's command line, mounted as the crate docs show.
#[derive(Parser)]
struct Ops {
    #[command(flatten)]
    inbox: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: inbox_cli::Command,
}

/// The host's logger: tracing-subscriber's default, writing to stdout, everything
/// from the broker client included.
fn log_to_stdout() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(std::io::stdout)
            .init();
    });
}

/// Runs the mounted command through `inbox_cli::run` (stdout, stderr) and returns its
/// exit code, or fails when it does not answer.
fn answer(db: &str, args: &[&str]) -> ExitCode {
    log_to_stdout();
    let mut argv = vec!["ops", "--database-url", db];
    argv.extend_from_slice(args);
    let ops = Ops::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(inbox_cli::run(&ops.inbox, &ops.command));
    });
    rx.recv_timeout(ANSWER_WITHIN)
        .unwrap_or_else(|_| panic!("{args:?} did not answer within {ANSWER_WITHIN:?}"))
}

fn code(n: u8) -> ExitCode {
    ExitCode::from(n)
}

fn sqlite() -> (SqliteFixture, String) {
    let fx = SqliteFixture::new();
    drop(fx.builder().build().unwrap());
    let url = format!("sqlite://{}", fx.path);
    (fx, url)
}

#[test]
fn every_command_answers_under_a_stdout_logger() {
    let (_fx, db) = sqlite();
    for (args, expected) in [
        (&["dead-letters", "list"][..], exit::OK),
        (&["dead-letters", "show", "1"], exit::NOT_FOUND),
        (&["dead-letters", "groups"], exit::OK),
        (&["dead-letters", "replay", "1"], exit::NOT_FOUND),
        (&["dead-letters", "replay", "--yes"], exit::OK),
        (&["dead-letters", "discard", "1"], exit::NOT_FOUND),
        (&["dead-letters", "discard", "--yes"], exit::OK),
        (&["claims", "show", "k-1"], exit::NOT_FOUND),
        (&["claims", "redrive", "--yes"], exit::OK),
        (&["groups", "list"], exit::OK),
        (&["groups", "resume", "billing.audit"], exit::NOT_FOUND),
        (&["stats"], exit::OK),
        (&["purge", "--dry-run"], exit::OK),
        (&["purge"], exit::OK),
    ] {
        assert_eq!(answer(&db, args), code(expected), "{args:?}");
    }
    // `verify` and `selftest` with a broker: the tests below.
}

#[test]
fn verify_answers_at_once_for_a_missing_exchange_or_queue() {
    let Some(amqp_url) = amqp_url() else { return };
    let (_fx, db) = sqlite();
    let prefix = unique_prefix("mounted");
    let g = "billing.daily-usage";
    let topology = test_topology(&prefix, &[50]).group(group(g), ["usage.recorded"]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let conn = runtime.block_on(amqp::connect(&amqp_url));
    runtime.block_on(topology.declare(&conn)).unwrap();
    let verify = |extra: &[&str]| {
        let mut args = vec![
            "--prefix",
            &prefix,
            "verify",
            "--amqp-url",
            &amqp_url,
            "--retry-ladder",
            "50ms",
        ];
        args.extend_from_slice(extra);
        answer(&db, &args)
    };
    // The topology is there.
    assert_eq!(
        verify(&["--exchange", "billing", "--consumer-group", g]),
        code(exit::OK)
    );
    // A missing exchange, a missing queue: the topology does not match (exit 3).
    assert_eq!(
        verify(&["--exchange", "no-such-exchange", "--consumer-group", g]),
        code(exit::SCHEMA)
    );
    assert_eq!(
        verify(&["--consumer-group", "billing.no-such-group"]),
        code(exit::SCHEMA)
    );
    // No claim yet and no group named: nothing to check is no "ok" (exit 2).
    assert_eq!(verify(&["--exchange", "billing"]), code(exit::USAGE));
    runtime.block_on(topology.delete(&conn)).unwrap();
    let _ = runtime.block_on(conn.close(200, "done".into()));
}

#[test]
fn a_broker_that_refuses_the_connection_or_the_login_fails_with_exit_1() {
    let Some(amqp_url) = amqp_url() else { return };
    let (_fx, db) = sqlite();
    let refused = "amqp://guest:guest@127.0.0.1:1/%2f".to_owned();
    let bad_login = format!(
        "amqp://inbox-nobody:wrong-pw@{}/%2f",
        amqp::host_port(&amqp_url)
    );
    for broker in [&refused, &bad_login] {
        let verify = [
            "verify",
            "--amqp-url",
            broker,
            "--consumer-group",
            "billing.daily-usage",
        ];
        assert_eq!(answer(&db, &verify), code(exit::FAILURE), "{broker}");
        for relay in [true, false] {
            let mut selftest = vec!["selftest", "--amqp-url", broker, "--timeout", "2s"];
            if relay {
                selftest.push("--relay");
            }
            assert_eq!(
                answer(&db, &selftest),
                code(exit::FAILURE),
                "{broker} {selftest:?}"
            );
        }
    }
}

/// The order service's operator tool.
#[derive(Parser)]
#[command(name = "order_ops")]
struct Hosted {
    #[command(flatten)]
    inbox: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: HostedCommand,
}

#[derive(clap::Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once
enum HostedCommand {
    #[command(flatten)]
    Inbox(inbox_cli::Command),
    /// Rebuild the order totals.
    Rebuild,
}

/// Mounting the commands leaves the host's `--help` its own: its header is the host's
/// doc comment, never one of inbox-cli's types.
#[test]
fn mounting_leaves_the_hosts_help_header_alone() {
    use clap::CommandFactory;
    let help = Hosted::command().render_help().to_string();
    assert!(
        help.starts_with("The order service's operator tool\n"),
        "{help}"
    );
    for theirs in ["Options every subcommand takes", "The operator subcommands"] {
        assert!(!help.contains(theirs), "{help}");
    }
    assert!(help.contains("Rebuild the order totals"), "{help}");
    assert!(help.contains("dead-letters"), "{help}");
    let bare = Ops::command().render_help().to_string();
    assert!(!bare.contains("Options every subcommand takes"), "{bare}");
}
