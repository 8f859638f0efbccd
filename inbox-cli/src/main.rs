//! `inbox`: the operator commands on their own. See the crate's README.

use clap::Parser;

/// Operator commands for a transactional inbox: dead letters, claims, halted groups, stats,
/// verify, purge, selftest.
#[derive(Debug, Parser)]
#[command(name = "inbox", version)]
struct Cli {
    #[command(flatten)]
    global: inbox_cli::GlobalArgs,
    #[command(subcommand)]
    command: inbox_cli::Command,
}

fn main() -> std::process::ExitCode {
    // The library's warnings (and, with `RUST_LOG`, more) on stderr; JSON lines with
    // `INBOX_LOG_FORMAT=json`.
    inbox_cli::logging::install(inbox_cli::logging::DEFAULT_FILTER);
    inbox_diesel::init_tls();
    let cli = Cli::parse();
    inbox_cli::run(&cli.global, &cli.command)
}
