//! `cargo run --example quickstart`: 1,000 usage events, some delivered two or three
//! times and 3 that always fail, through the in-process transport into a
//! `daily_usage` projection. SQLite in a temporary directory by default; with
//! `DATABASE_URL=postgres://...` the same handler runs on PostgreSQL (schema
//! `inbox_quickstart`, dropped and recreated).
//!
//! Exits non-zero if any daily total differs from the sum of its unique events.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default
//! [`inbox_examples::DEFAULT_LOG_FILTER`]).

use std::process::ExitCode;
use std::time::Instant;

use inbox_examples::quickstart;

fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    let started = Instant::now();
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(err) => {
            eprintln!("quickstart: cannot create a temporary directory: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (url, schema) = match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres") => {
            if let Err(err) = reset_schema(&url) {
                eprintln!("quickstart: {err}");
                return ExitCode::FAILURE;
            }
            (url, Some("inbox_quickstart"))
        }
        _ => (
            dir.path()
                .join("quickstart.db")
                .to_string_lossy()
                .into_owned(),
            None,
        ),
    };
    match quickstart::run(&url, schema, 1_000) {
        Ok(report) => {
            println!("{report}");
            println!("elapsed:        {:.2?}", started.elapsed());
            if report.mismatches.is_empty() && report.dead_letters == 3 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(err) => {
            eprintln!("quickstart failed: {}", inbox_core::ErrorChain(&*err));
            ExitCode::FAILURE
        }
    }
}

fn reset_schema(url: &str) -> Result<(), String> {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let mut conn = diesel::PgConnection::establish(url).map_err(|e| {
        // libpq's message can quote the password back: redact it too.
        format!(
            "could not connect to {}: {}",
            inbox_diesel::redact(url),
            inbox_core::RedactedError::new(&e, url)
        )
    })?;
    conn.batch_execute("DROP SCHEMA IF EXISTS inbox_quickstart CASCADE")
        .map_err(|e| e.to_string())
}
