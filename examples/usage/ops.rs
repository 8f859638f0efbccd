//! `cargo run --example usage_ops -- <command>`: operator commands of the usage
//! projection, with the inbox's own operator commands mounted beside them.
//!
//! - `audit daily_usage --days N`: compare the window (today, UTC, and the N-1 days
//!   before it) of `daily_usage` with its recomputation from `usage_ledger`; writes
//!   nothing.
//! - `rebuild daily_usage --days N`: recompute the window from the ledger and replace
//!   it, a day per transaction, while consumers keep running.
//! - `dead-letters ...`, `claims ...`, `groups ...`, `stats`, `verify`, `purge`,
//!   `selftest`: `inbox-cli`'s commands, as the `inbox` binary has them.
//!
//! Global options, `inbox-cli`'s: `--database-url` (or `DATABASE_URL`:
//! `postgres://...`, or `sqlite://path`), `--schema` (or `INBOX_SCHEMA`), `--prefix`
//! (or `INBOX_PREFIX`), `--json` (one JSON document instead of text). Exit codes of the
//! projection commands: 0 on success (an audit that finds drift succeeded), 1 on an
//! error (printed on stderr: no database, an unknown projection, a missing table, a
//! lock never granted), 2 on a command line clap refuses; the inbox commands exit
//! with `inbox_cli::exit`'s codes.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::RetryPolicy;
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::rebuild::RebuildConnection;
use inbox_diesel::{Backend, Store};
use inbox_examples::ops::ProjectionCommand;
use inbox_examples::usage::{DailyUsage, UsageDb};

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
    inbox_examples::init_logging();
    inbox_diesel::init_tls();
    let cli = Cli::parse();
    match &cli.command {
        Command::Inbox(command) => inbox_cli::run(&cli.inbox, command),
        Command::Projection(command) => projection(&cli.inbox, command),
    }
}

fn projection(global: &inbox_cli::GlobalArgs, command: &ProjectionCommand) -> ExitCode {
    let url = global.database_url.clone().unwrap_or_default();
    match run(global, &url, command) {
        Ok(out) => {
            print!("{out}");
            if !out.ends_with('\n') {
                println!();
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            let mut message = err.to_string();
            let mut source = err.source();
            while let Some(cause) = source {
                message.push_str(": ");
                message.push_str(&cause.to_string());
                source = cause.source();
            }
            eprintln!("usage_ops: {}", inbox_core::redact_message(&message, &url));
            ExitCode::FAILURE
        }
    }
}

fn run(
    global: &inbox_cli::GlobalArgs,
    url: &str,
    command: &ProjectionCommand,
) -> Result<String, Box<dyn std::error::Error>> {
    if url.is_empty() {
        return Err("DATABASE_URL must name the database (postgres://... or sqlite://path)".into());
    }
    match Backend::from_url(url)? {
        Backend::Postgres => on::<PgConnection>(global, url, command),
        _ => on::<SqliteConnection>(global, url, command),
    }
}

fn on<C: OperatorConnection + RebuildConnection + UsageDb>(
    global: &inbox_cli::GlobalArgs,
    url: &str,
    command: &ProjectionCommand,
) -> Result<String, Box<dyn std::error::Error>> {
    let mut builder = Store::<C>::builder(url)
        .pool_size(2)
        .projection(DailyUsage::new(RetryPolicy::default()));
    if let Some(schema) = &global.schema {
        builder = builder.schema(schema.clone());
    }
    Ok(command.run(&builder.build()?, global.json)?)
}
