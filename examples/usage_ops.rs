//! `cargo run --example usage_ops -- <command>`: operator commands of the usage
//! projection.
//!
//! - `audit daily_usage --days N [--json]`: compare the window (today, UTC, and the
//!   N-1 days before it) of `daily_usage` with its recomputation from `usage_ledger`;
//!   writes nothing.
//! - `rebuild daily_usage --days N [--json]`: recompute the window from the ledger and
//!   replace it, a day per transaction, while consumers keep running.
//!
//! `DATABASE_URL` names the database (`postgres://...`, or `sqlite://path`). Exit code
//! 0 on success (an audit that finds drift succeeded), 1 on an error (printed on
//! stderr: no database, an unknown projection, a missing table, a lock never
//! granted), 2 on a command line clap refuses.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::RetryPolicy;
use inbox_diesel::{Backend, Store, StoreConnection};
use inbox_examples::ops::ProjectionCommand;
use inbox_examples::usage::{DailyUsage, UsageDb};

/// Operator commands of the usage projection.
#[derive(Debug, Parser)]
#[command(name = "usage_ops", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Every command of the binary. Other command sets mount as further variants
/// (`#[command(flatten)]` of their own `Subcommand` enum).
#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Projection(ProjectionCommand),
}

fn main() -> ExitCode {
    inbox_examples::init_logging();
    let cli = Cli::parse();
    match run(&cli.command) {
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
            eprintln!(
                "usage_ops: {}",
                inbox_core::redact_message(&message, &database_url())
            );
            ExitCode::FAILURE
        }
    }
}

fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_default()
}

fn run(command: &Command) -> Result<String, Box<dyn std::error::Error>> {
    let url = database_url();
    if url.is_empty() {
        return Err("DATABASE_URL must name the database (postgres://... or sqlite://path)".into());
    }
    match Backend::from_url(&url)? {
        Backend::Postgres => on::<PgConnection>(url, command),
        _ => on::<SqliteConnection>(url, command),
    }
}

fn on<C: StoreConnection + UsageDb>(
    url: String,
    command: &Command,
) -> Result<String, Box<dyn std::error::Error>> {
    let store = Store::<C>::builder(url)
        .pool_size(2)
        .projection(DailyUsage::new(RetryPolicy::default()))
        .build()?;
    match command {
        Command::Projection(projection) => Ok(projection.run(&store)?),
    }
}
