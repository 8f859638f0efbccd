//! What the benchmark binaries share: their settings from the environment.

use std::fmt::Display;
use std::str::FromStr;

/// `DATABASE_URL` and `AMQP_URL`, or the local services the tests use.
pub fn service_urls() -> (String, String) {
    (
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into()),
        std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    )
}

/// The setting `name` from the environment, or `default` when unset; a value that
/// does not parse stops the benchmark with a message saying so, rather than quietly
/// measuring something else.
pub fn env_or<T>(name: &str, default: T) -> T
where
    T: FromStr,
    T::Err: Display,
{
    match std::env::var(name) {
        Err(_) => default,
        Ok(value) => value
            .parse()
            .unwrap_or_else(|err| panic!("{name}={value:?} does not parse: {err}")),
    }
}

/// Free space, in KiB, on the file system holding `path` (`df -Pk`); `None` when
/// `df` is missing or says nothing readable.
pub fn free_disk_kib(path: &str) -> Option<u64> {
    let out = std::process::Command::new("df")
        .args(["-Pk", path])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()
}

/// Drops a benchmark's PostgreSQL schema when dropped itself, so a run that fails
/// half-way leaves nothing behind (signals: see [`drop_schema_on_signals`]).
pub struct SchemaGuard {
    url: String,
    schema: String,
}

impl SchemaGuard {
    /// Guards `schema` on the server at `url`.
    pub fn new(url: &str, schema: &str) -> Self {
        Self {
            url: url.to_owned(),
            schema: schema.to_owned(),
        }
    }
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        drop_schema(&self.url, &self.schema);
    }
}

fn drop_schema(url: &str, schema: &str) {
    use diesel::connection::SimpleConnection as _;
    use diesel::Connection as _;
    if let Ok(mut conn) = diesel::PgConnection::establish(url) {
        let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    }
}

/// On Ctrl-C or SIGTERM drops `schema` and exits with status 130 (a drop guard does
/// not run when a signal ends the process). Call inside a tokio runtime.
pub fn drop_schema_on_signals(url: &str, schema: &str) {
    let (url, schema) = (url.to_owned(), schema.to_owned());
    tokio::spawn(async move {
        inbox_amqp::shutdown_signal().await;
        eprintln!("interrupted: dropping schema {schema}");
        let _ = tokio::task::spawn_blocking(move || drop_schema(&url, &schema)).await;
        std::process::exit(130);
    });
}
