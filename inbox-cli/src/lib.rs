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
//! Exit codes are in [`exit`]; the commands, their JSON documents and their exit codes
//! are described in the crate's README (its manual), the operating guide in the
//! workspace's `docs/operating.md`.
//!
//! What a publisher sent is hostile input here: every value a command prints for a
//! person goes through [`inbox_core::display::escape`] (one record per line, no
//! control or format character reaches the terminal), and the JSON documents write
//! those characters as `\u` escapes. [`run`] holds no process-wide lock (not stdout's)
//! across a database or broker call, so a host whose logger writes to stdout gets
//! every answer. No URL's password is printed, in errors or in the arguments' `Debug`.
//!
//! [`run`] never installs a log subscriber: in your binary the logs are your
//! subscriber's. The standalone `inbox` binary installs [`logging::install`]'s
//! (`RUST_LOG`, and `INBOX_LOG_FORMAT=json` for one JSON object per line).
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod args;
mod commands;
mod failure;
pub mod logging;
mod output;
#[cfg(feature = "rebuild")]
#[cfg_attr(docsrs, doc(cfg(feature = "rebuild")))]
pub mod projections;
mod run;
pub mod service;

#[cfg(feature = "web")]
pub use args::WebArgs;
pub use args::{
    ClaimCommand, Command, DeadLetterCommand, FilterArgs, GlobalArgs, GroupCommand, PurgeArgs,
    SelftestArgs, StatusArg, VerifyArgs,
};
pub use failure::Failure;
pub use run::{run, run_with};

/// The exit codes of every command.
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// The database or broker failed (unreachable, a refused login or TLS handshake, a
    /// missing SQLite file, a statement failed).
    pub const FAILURE: u8 = 1;
    /// Bad arguments (an invalid `--schema`, a `--database-url` of another form,
    /// `verify` with nothing to check), or a bulk change without `--yes` (nothing was
    /// changed).
    pub const USAGE: u8 = 2;
    /// The schema (or, for `verify`, the topology: a missing exchange or queue) does
    /// not match what the inbox needs.
    pub const SCHEMA: u8 = 3;
    /// No dead letter of that id, no claim of that key, no halt of that group.
    pub const NOT_FOUND: u8 = 4;
    /// A replay refused: the letter's reason is not replayable, or it is discarded,
    /// or a projection rebuild resolved it (counted its event).
    pub const REFUSED: u8 = 5;
    /// `selftest`: a canary was lost or doubled.
    pub const SELFTEST_FAILED: u8 = 6;
}
