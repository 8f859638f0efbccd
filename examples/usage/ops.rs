//! `cargo run --example usage_ops -- <command>`: operator commands of the usage
//! projection, with the inbox's own operator commands mounted beside them.
//!
//! - `audit daily_usage --window N`: compare the window (today, UTC, and the N-1 days
//!   before it) of `daily_usage` with its recomputation from `usage_ledger`; writes
//!   nothing.
//! - `rebuild daily_usage --window N`: recompute the window from the ledger and replace
//!   it, a day per transaction, while consumers keep running.
//! - `dead-letters ...`, `claims ...`, `groups ...`, `stats`, `verify`, `purge`,
//!   `selftest`: `inbox-cli`'s commands, as the `inbox` binary has them.
//!
//! Global options, `inbox-cli`'s: `--database-url` (or `DATABASE_URL`:
//! `postgres://...`, or `sqlite://path`), `--schema` (or `INBOX_SCHEMA`), `--prefix`
//! (or `INBOX_PREFIX`), `--json` (one JSON document instead of text). Exit codes are
//! `inbox_cli::exit`'s, for the projection commands too (see
//! `inbox_cli::projections`): 0 done (an audit that finds drift succeeded), 1 a
//! database or hook failure or a lock never granted, 2 bad arguments, 3 a schema
//! mismatch, 4 an unknown projection.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use diesel::{PgConnection, SqliteConnection};
use inbox_cli::projections::{run_projections, ProjectionCommand};
use inbox_core::RetryPolicy;
use inbox_diesel::Backend;
use inbox_examples::usage::DailyUsage;

/// Operator commands of the usage projection and of the inbox.
#[derive(Debug, Parser)]
#[command(name = "usage_ops", version)]
struct Cli {
    #[command(flatten)]
    inbox: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Every command of the binary: each command set mounts as a `#[command(flatten)]`
/// variant of its own `Subcommand` enum.
#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Projection(ProjectionCommand),
    #[command(flatten)]
    Inbox(inbox_cli::Command),
}

fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    inbox_diesel::init_tls();
    let cli = Cli::parse();
    let projection = || DailyUsage::new(RetryPolicy::default());
    match &cli.command {
        Command::Inbox(command) => inbox_cli::run(&cli.inbox, command),
        // DailyUsage has hooks for both backends: the URL picks one.
        Command::Projection(command) => {
            match cli.inbox.database_url.as_deref().map(Backend::from_url) {
                Some(Ok(Backend::Postgres)) => {
                    run_projections::<PgConnection>(&cli.inbox, command, |b| {
                        b.projection(projection())
                    })
                }
                _ => run_projections::<SqliteConnection>(&cli.inbox, command, |b| {
                    b.projection(projection())
                }),
            }
        }
    }
}
