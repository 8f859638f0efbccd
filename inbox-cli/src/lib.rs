//! Operator subcommands for a transactional inbox, as clap types you mount in your own
//! binary next to your projections' commands, and the standalone `inbox` binary.
//!
//! ```no_run
//! use clap::{Parser, Subcommand};
//!
//! #[derive(Parser)]
//! struct Ops {
//!     #[command(flatten)]
//!     inbox: inbox_cli::GlobalArgs,
//!     #[command(subcommand)]
//!     command: OpsCommand,
//! }
//!
//! #[derive(Subcommand)]
//! enum OpsCommand {
//!     /// The inbox's own commands: dead-letters, claims, groups, stats, verify, ...
//!     #[command(flatten)]
//!     Inbox(inbox_cli::Command),
//!     /// A command of your own.
//!     Rebuild,
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let ops = Ops::parse();
//!     match &ops.command {
//!         OpsCommand::Inbox(command) => inbox_cli::run(&ops.inbox, command),
//!         OpsCommand::Rebuild => std::process::ExitCode::SUCCESS,
//!     }
//! }
//! ```
//!
//! Exit codes are in [`exit`]; the JSON documents and the commands are described in
//! the workspace README ("Operating the inbox").
#![forbid(unsafe_code)]

mod args;
mod output;
mod run;
mod selftest;

pub use args::{
    ClaimCommand, Command, DeadLetterCommand, FilterArgs, GlobalArgs, GroupCommand, PurgeArgs,
    SelftestArgs, StatusArg, VerifyArgs,
};
pub use run::{run, run_with, Failure};

/// The exit codes of every command.
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// The database or broker failed (unreachable, a statement failed).
    pub const FAILURE: u8 = 1;
    /// Bad arguments, or a bulk change without `--yes` (nothing was changed).
    pub const USAGE: u8 = 2;
    /// The schema (or, for `verify`, the topology) does not match what the inbox needs.
    pub const SCHEMA: u8 = 3;
    /// No dead letter of that id, no claim of that key, no halt of that group.
    pub const NOT_FOUND: u8 = 4;
    /// A replay refused: the letter's reason is not replayable, or it is discarded.
    pub const REFUSED: u8 = 5;
    /// `selftest`: a canary was lost or doubled.
    pub const SELFTEST_FAILED: u8 = 6;
}
