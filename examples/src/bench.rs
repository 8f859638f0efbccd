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

/// Statements the process's diesel connections have sent since it started, once
/// [`count_statements`] was called: one per round trip (a `batch_execute` of several
/// statements is one).
pub fn statements_sent() -> u64 {
    STATEMENTS.load(std::sync::atomic::Ordering::Relaxed)
}

static STATEMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts the statements of every diesel connection opened from now on (see
/// [`statements_sent`]).
pub fn count_statements() {
    struct Count;
    impl diesel::connection::Instrumentation for Count {
        fn on_connection_event(&mut self, event: diesel::connection::InstrumentationEvent<'_>) {
            if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
                STATEMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
    let _ = diesel::connection::set_default_instrumentation(|| Some(Box::new(Count)));
}

/// CPU time (user and system, every thread) process `pid` has used, in clock ticks
/// of [`TICKS_PER_SECOND`] (Linux `/proc/<pid>/stat`); `None` where it cannot be read.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime and stime: the 14th and 15th fields of the line, 12th and 13th here.
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some(user + system)
}

/// Linux's `USER_HZ`, the unit of [`cpu_ticks`].
pub const TICKS_PER_SECOND: f64 = 100.0;
