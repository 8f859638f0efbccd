//! Mounted in a host binary, `inbox_cli::run` never installs a log subscriber: the
//! logs are the host's (a test binary of its own, so no other test installs one).

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use clap::Parser;
use inbox_test_support::{group, Fixture, SqliteFixture};

#[derive(Parser)]
struct Ops {
    #[command(flatten)]
    inbox: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: inbox_cli::Command,
}

#[test]
fn run_installs_no_subscriber() {
    let fx = SqliteFixture::new();
    let store = fx.builder().build().unwrap();
    inbox_core::GroupHalts::record_halt(
        &store,
        &inbox_core::ClaimInvariantViolated {
            group: group("billing.audit"),
            key: inbox_core::MessageKey::new("k-9").unwrap(),
            detail: "insert conflicted but no row exists".to_owned(),
        },
    )
    .unwrap();
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
