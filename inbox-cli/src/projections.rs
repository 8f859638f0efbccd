//! `audit` and `rebuild`: the commands of the projections a binary registers (the
//! feature `rebuild`). The standalone `inbox` binary has no projection code, so it
//! cannot run them; a binary of yours mounts [`ProjectionCommand`] and names its
//! projections in the closure it gives [`run_projections`]:
//!
//! ```no_run
//! use clap::{Parser, Subcommand};
//! use diesel::PgConnection;
//! use inbox_cli::projections::{run_projections, ProjectionCommand};
//! # fn customer_totals(store: inbox_diesel::StoreBuilder<PgConnection>)
//! #     -> inbox_diesel::StoreBuilder<PgConnection> { store }
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
//!     #[command(flatten)]
//!     Inbox(inbox_cli::Command),
//!     #[command(flatten)]
//!     Projection(ProjectionCommand),
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let ops = Ops::parse();
//!     match &ops.command {
//!         OpsCommand::Inbox(command) => inbox_cli::run(&ops.inbox, command),
//!         // Your projections, registered as the consumer's store registers them:
//!         // `|store| store.projection(CustomerTotals)`.
//!         OpsCommand::Projection(command) => {
//!             run_projections::<PgConnection>(&ops.inbox, command, customer_totals)
//!         }
//!     }
//! }
//! ```
//!
//! A window is what the projection's `Rebuild::window(now, N)` names for `--window N`:
//! the last N days of a daily projection, one partition of an all-time one (which
//! ignores N), the tenants of a per-tenant one.
//!
//! Exit codes: 0 done (an audit that found drift succeeded: its report says so); 1 the
//! database failed, a hook failed, the projection lock was never granted, or another
//! runner took the rebuild lease; 2 bad arguments (no database, a URL of the other
//! backend); 3 the schema does not match; 4 no projection of that name is registered
//! (the message lists the ones there are).

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use inbox_core::display::escape;
use inbox_core::rebuild::{AuditReport, DriftRow, RebuildReport};
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::rebuild::{RebuildConnection, Rebuilder};
use inbox_diesel::{Store, StoreBuilder};
use serde::Serialize;

use crate::args::GlobalArgs;
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::{print, print_json};
use crate::run::{database, opening_failed};

/// The projection commands: `audit <projection> --window N` and
/// `rebuild <projection> --window N`. Mount them with `#[command(flatten)]` beside
/// [`Command`](crate::Command) and run them with [`run_projections`].
#[derive(Clone, Debug, Subcommand)]
pub enum ProjectionCommand {
    /// Compare a window of a projection with its recomputation from the source of
    /// truth and print the drift; writes nothing.
    Audit(WindowArgs),
    /// Recompute a window of a projection from the source of truth and replace it, a
    /// partition per transaction, while live consumers run; print what changed.
    Rebuild(WindowArgs),
}

/// Which projection, which window.
#[derive(Clone, Debug, Args)]
pub struct WindowArgs {
    /// The projection, as its rebuild hooks name it.
    pub projection: String,
    /// The window: the partitions the projection's `window(now, N)` names (for a
    /// daily projection, today (UTC) and the N-1 days before it).
    #[arg(long, visible_alias = "days", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..=3660))]
    pub window: u32,
}

/// Runs `command` on a store of connection type `C` whose builder `register` gives
/// the binary's projections (`|store| store.projection(Totals)`); prints the report
/// (one JSON document with `--json`) and returns the exit code (see the module docs).
pub fn run_projections<C>(
    global: &GlobalArgs,
    command: &ProjectionCommand,
    register: impl FnOnce(StoreBuilder<C>) -> StoreBuilder<C>,
) -> ExitCode
where
    C: OperatorConnection + RebuildConnection,
{
    ExitCode::from(run_projections_with(
        global,
        command,
        register,
        &mut std::io::stdout(),
    ))
}

/// [`run_projections`], printing the report to `out` (the error goes to stderr);
/// returns the exit code as a `u8`.
pub fn run_projections_with<C>(
    global: &GlobalArgs,
    command: &ProjectionCommand,
    register: impl FnOnce(StoreBuilder<C>) -> StoreBuilder<C>,
    out: &mut dyn Write,
) -> u8
where
    C: OperatorConnection + RebuildConnection,
{
    match execute(global, command, register, out) {
        Ok(()) => exit::OK,
        Err(failure) => {
            let message = match &global.database_url {
                Some(url) => inbox_core::redact_message(&failure.message, url),
                None => failure.message,
            };
            if global.json {
                let _ = print_json(
                    out,
                    &serde_json::json!({ "error": message, "exit_code": failure.code }),
                );
            }
            eprintln!("inbox: {}", escape(&message));
            failure.code
        }
    }
}

fn execute<C>(
    global: &GlobalArgs,
    command: &ProjectionCommand,
    register: impl FnOnce(StoreBuilder<C>) -> StoreBuilder<C>,
    out: &mut dyn Write,
) -> Outcome
where
    C: OperatorConnection + RebuildConnection,
{
    let url = global.database_url.clone().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            "no database: set DATABASE_URL or pass --database-url",
        )
    })?;
    let (_, url) = database(&url)?;
    let mut builder = Store::<C>::builder(url).pool_size(2).run_migrations(false);
    if let Some(schema) = &global.schema {
        builder = builder.schema(schema.clone());
    }
    let store = register(builder).build().map_err(|e| match e {
        inbox_diesel::Error::InvalidSetting { setting: "url", .. } => {
            Failure::new(exit::USAGE, format!("--database-url (DATABASE_URL): {e}"))
        }
        other => opening_failed(other),
    })?;
    let args = match command {
        ProjectionCommand::Audit(args) | ProjectionCommand::Rebuild(args) => args,
    };
    let rebuilder = Rebuilder::new(&store, &args.projection).map_err(|e| match e {
        inbox_diesel::Error::UnknownProjection { .. } => {
            Failure::new(exit::NOT_FOUND, e.to_string())
        }
        other => failed(other),
    })?;
    let chain = |e: inbox_diesel::Error| failed(inbox_core::ErrorChain(&e));
    match command {
        ProjectionCommand::Audit(_) => {
            let report = rebuilder.audit(args.window).map_err(chain)?;
            emit(global, out, &report, audit_text)
        }
        ProjectionCommand::Rebuild(_) => {
            let report = rebuilder.rebuild(args.window).map_err(chain)?;
            emit(global, out, &report, rebuild_text)
        }
    }
}

fn emit<T: Serialize>(
    global: &GlobalArgs,
    out: &mut dyn Write,
    report: &T,
    text: fn(&T) -> String,
) -> Outcome {
    if global.json {
        let value = serde_json::to_value(report).map_err(failed)?;
        print_json(out, &value)
    } else {
        print(out, text(report))
    }
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "none".to_owned(), |r| format!("{r:.2}"))
}

fn figure(f: Option<f64>) -> String {
    f.map_or_else(|| "none".to_owned(), |f| f.to_string())
}

fn sample_lines(out: &mut String, sample: &[DriftRow]) {
    for row in sample {
        out.push_str(&format!(
            "  {} {}: projected {}, recomputed {}\n",
            escape(&row.partition),
            escape(&row.row),
            figure(row.projected),
            figure(row.recomputed)
        ));
    }
}

/// An audit as text: one summary line, then the sample of differing rows.
pub fn audit_text(r: &AuditReport) -> String {
    let mut out = format!(
        "audit {}: {} partitions, {} rows checked, {} differing ({} extra), largest ratio {}, {} ms\n",
        escape(&r.projection),
        r.partitions,
        r.rows_checked,
        r.rows_differing,
        r.extra_rows,
        ratio(r.largest_ratio),
        r.duration_ms
    );
    sample_lines(&mut out, &r.sample);
    out
}

/// A rebuild as text: one summary line, then the rows it changed, as they were.
pub fn rebuild_text(r: &RebuildReport) -> String {
    let mut out = format!(
        "rebuild {}: {} partitions, {} rows changed, {} events covered \
         ({} claims recorded, {} converted, {} dead covered, {} dead letters resolved), \
         drift found {} rows ({} extra, largest ratio {}), {} lock waits, {} lock timeouts, {} ms\n",
        escape(&r.projection),
        r.partitions,
        r.rows_changed,
        r.events_covered,
        r.claims_recorded,
        r.claims_converted,
        r.dead_covered,
        r.dead_letters_resolved,
        r.rows_differing,
        r.extra_rows,
        ratio(r.largest_ratio),
        r.lock_waits,
        r.lock_timeouts,
        r.duration_ms
    );
    sample_lines(&mut out, &r.sample);
    out
}
