//! Carrying out a command against a store: the database URL, opening the store,
//! and handing the command to its group's module.

use std::io::Write;

use diesel::{PgConnection, SqliteConnection};
use inbox_core::display::escape;
use inbox_core::redact_message;
use inbox_diesel::operator::{OperatorConnection, ReplayTarget};
use inbox_diesel::{Backend, Store};
use serde_json::json;

use crate::args::{Command, GlobalArgs};
use crate::commands::{claims, dead_letters, groups, purge, reports, selftest, verify};
use crate::exit;
use crate::failure::{failed, Failure, Outcome};
use crate::output::print_json;

/// Runs `command`, printing to stdout and stderr; returns the exit code.
///
/// No lock of stdout is held while the command runs, only while one piece of output
/// is written: the broker client's I/O thread logs through the host's `tracing`
/// subscriber, which may write to stdout, and a lock held across the broker calls
/// would stop that thread and with it the reply the command waits for.
pub fn run(global: &GlobalArgs, command: &Command) -> std::process::ExitCode {
    let code = run_with(global, command, &mut std::io::stdout());
    std::process::ExitCode::from(code)
}

/// Runs `command`, printing its output to `out` and its error to stderr; returns the
/// exit code. For hosts that capture the output. `out` is written once per piece of
/// output, after the database and broker calls that produce it; pass no lock that a
/// logger of the process also needs (such as [`std::io::StdoutLock`]: see [`run`]).
pub fn run_with(global: &GlobalArgs, command: &Command, out: &mut dyn Write) -> u8 {
    match execute(global, command, out) {
        Ok(()) => exit::OK,
        Err(failure) => {
            let message = redact(&failure.message, global, command);
            if global.json && !failure.reported {
                let _ = print_json(out, &json!({ "error": message, "exit_code": failure.code }));
            }
            // One line, whatever the message quotes (a driver's text, a stored key).
            eprintln!("inbox: {}", escape(&message));
            failure.code
        }
    }
}

/// `message` without the password of any URL the command was given.
fn redact(message: &str, global: &GlobalArgs, command: &Command) -> String {
    let amqp = match command {
        Command::Verify(args) => args.amqp_url.as_deref(),
        Command::Selftest(args) => args.amqp_url.as_deref(),
        _ => None,
    };
    global
        .database_url
        .iter()
        .map(String::as_str)
        .chain(amqp.into_iter().flat_map(inbox_amqp::BrokerUrls::items))
        .fold(message.to_owned(), |text, url| redact_message(&text, url))
}

fn execute(global: &GlobalArgs, command: &Command, out: &mut dyn Write) -> Outcome {
    let url = global.database_url.clone().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            "no database: set DATABASE_URL or pass --database-url",
        )
    })?;
    match database(&url)? {
        (Backend::Postgres, url) => on_store::<PgConnection>(global, &url, command, out),
        (_, url) => on_store::<SqliteConnection>(global, &url, command, out),
    }
}

/// The forms of `--database-url` the commands take, as an error says them.
const ACCEPTED_URLS: &str =
    "a postgres:// (or postgresql://) URL, or sqlite://PATH of an existing SQLite file";

/// The backend of `--database-url`: a `postgres://` or `postgresql://` URL, or a
/// `sqlite://` URL of a file that exists. Anything else (a libpq `host=... password=...`
/// string, a bare path, another scheme) is a usage error that never quotes the value:
/// it may hold a password. A missing SQLite file is never created: the operator
/// commands run no migrations, so a new file could only fail their schema check.
pub(crate) fn database(url: &str) -> Result<(Backend, String), Failure> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        return Ok((Backend::Postgres, url.to_owned()));
    }
    if lower.starts_with("sqlite:") {
        let rest = &url["sqlite:".len()..];
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if path.is_empty() {
            return Err(Failure::new(
                exit::USAGE,
                format!("--database-url (DATABASE_URL): expected {ACCEPTED_URLS}, found sqlite:// without a path"),
            ));
        }
        if !std::path::Path::new(path).is_file() {
            return Err(Failure::new(
                exit::FAILURE,
                format!("no SQLite database at {path:?} (the operator commands never create one)"),
            ));
        }
        return Ok((Backend::Sqlite, format!("sqlite://{path}")));
    }
    let found = match url.split_once("://") {
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            format!("a {scheme}:// URL")
        }
        _ => "a value of another form".to_owned(),
    };
    Err(Failure::new(
        exit::USAGE,
        format!("--database-url (DATABASE_URL): expected {ACCEPTED_URLS}; found {found} (not shown: it may hold a password)"),
    ))
}

fn open<C: OperatorConnection>(
    global: &GlobalArgs,
    url: &str,
    checked: bool,
) -> Result<Store<C>, Failure> {
    let mut builder = Store::<C>::builder(url).pool_size(2).run_migrations(false);
    if let Some(schema) = &global.schema {
        builder = builder.schema(schema.clone());
    }
    let built = if checked {
        builder.build()
    } else {
        builder.build_unchecked()
    };
    built.map_err(opening_failed)
}

/// The exit code of a store that would not open: 3 for every schema mismatch,
/// whatever the table (the claims', the operator's, a rebuild's, the idempotency
/// keys').
pub(crate) fn opening_failed(e: inbox_diesel::Error) -> Failure {
    match e {
        inbox_diesel::Error::SchemaMismatch { .. } => Failure::new(exit::SCHEMA, e.to_string()),
        // `--schema` (the only setting an operator gives the builder) refused before
        // connecting: a bad argument.
        inbox_diesel::Error::InvalidSchemaName(_) | inbox_diesel::Error::InvalidSetting { .. } => {
            Failure::new(exit::USAGE, format!("--schema (INBOX_SCHEMA): {e}"))
        }
        other => failed(other),
    }
}

fn on_store<C: OperatorConnection>(
    global: &GlobalArgs,
    url: &str,
    command: &Command,
    out: &mut dyn Write,
) -> Outcome {
    if let Command::Verify(args) = command {
        let store = open::<C>(global, url, false)?;
        return verify::verify(global, &store, args, out);
    }
    let store = open::<C>(global, url, true)?;
    let target = ReplayTarget::with_prefix(global.prefix.clone());
    match command {
        Command::DeadLetters(cmd) => dead_letters::dead_letters(global, &store, &target, cmd, out),
        Command::Claims(cmd) => claims::claims(global, &store, &target, cmd, out),
        Command::Groups(cmd) => groups::groups(global, &store, cmd, out),
        Command::Stats => groups::stats(global, &store, out),
        Command::RebuildReports { projection, limit } => {
            reports::rebuild_reports(global, &store, projection.as_deref(), *limit, out)
        }
        Command::Purge(args) => purge::purge(global, &store, args, out),
        Command::Selftest(args) => selftest::run(global, &store, args, out),
        #[cfg(feature = "web")]
        Command::Web(args) => crate::commands::web::serve(&store, target, args, out),
        Command::Verify(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_diesel::{SchemaPart, SchemaProblem};

    #[test]
    fn every_schema_mismatch_exits_3_whatever_the_table() {
        for part in [
            SchemaPart::Claims,
            SchemaPart::Idempotency,
            SchemaPart::Operator,
            SchemaPart::Rebuild,
        ] {
            let failure = opening_failed(inbox_diesel::Error::SchemaMismatch {
                part,
                problem: SchemaProblem::MissingTable,
                expected: "table t".to_owned(),
                found: "no such table".to_owned(),
                table: "t".to_owned(),
            });
            assert_eq!(failure.code, exit::SCHEMA, "{part:?}");
            assert!(
                failure.message.starts_with(part.label()),
                "{}",
                failure.message
            );
        }
    }
}
