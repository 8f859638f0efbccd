//! The log subscriber of a binary built on the framework: the standalone `inbox`
//! binary installs it first thing in `main`, the example programs too.
//!
//! [`run`](crate::run) never installs a subscriber: mounted in your binary, the CLI's
//! and the libraries' events go to whatever subscriber your binary installed (or
//! nowhere). Call [`install`] yourself if you want this one.
//!
//! - `RUST_LOG` filters the events, in `tracing-subscriber`'s `EnvFilter` syntax
//!   (`RUST_LOG=debug`, `RUST_LOG=inbox_amqp=debug,warn`); unset, the given default
//!   applies (for the `inbox` binary, [`DEFAULT_FILTER`]). A `RUST_LOG` that does not
//!   parse is reported on stderr and the default used.
//! - `INBOX_LOG_FORMAT` chooses the format: `text` (the default: one human-readable
//!   line per event) or `json` (one JSON object per line, for log shippers:
//!   `timestamp`, `level`, `target`, `fields` with `message` and the event's fields,
//!   and the current `span` and `spans`). Any other value is reported on stderr and
//!   `text` used.
//!
//! Logs go to stderr, so that a command's answer on stdout stays clean.

/// The variable that chooses the log format: `text` or `json`.
pub const LOG_FORMAT_ENV: &str = "INBOX_LOG_FORMAT";

/// The `inbox` binary's filter when `RUST_LOG` is not set: the framework's crates at
/// `warn` like everything else (a command's answer is on stdout; its warnings on
/// stderr).
pub const DEFAULT_FILTER: &str = "warn";

/// The format of the log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// Parses `text` or `json` (case-insensitive, surrounding blanks ignored).
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "text" => Some(Self::Text),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// Installs a subscriber that writes to stderr, filtered by `RUST_LOG` (else by
/// `default_filter`), in the format of `INBOX_LOG_FORMAT` (see the module docs).
/// Returns `false`, changing nothing, when a global subscriber was already installed.
pub fn install(default_filter: &str) -> bool {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter(default_filter))
        .with_writer(std::io::stderr);
    match log_format() {
        LogFormat::Text => builder.try_init().is_ok(),
        LogFormat::Json => builder.json().try_init().is_ok(),
    }
}

/// The filter [`install`] uses: `RUST_LOG`, else `default_filter` (a `RUST_LOG` that
/// does not parse is reported on stderr). For a program that builds its own
/// subscriber with more layers (an OpenTelemetry exporter, say).
pub fn env_filter(default_filter: &str) -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    match std::env::var("RUST_LOG") {
        Ok(directives) => EnvFilter::try_new(&directives).unwrap_or_else(|err| {
            eprintln!("ignoring RUST_LOG={directives:?} ({err}); using {default_filter}");
            EnvFilter::new(default_filter)
        }),
        Err(_) => EnvFilter::new(default_filter),
    }
}

/// The format [`install`] uses: `INBOX_LOG_FORMAT`, else text (a value other than
/// `text` or `json` is reported on stderr).
pub fn log_format() -> LogFormat {
    match std::env::var(LOG_FORMAT_ENV) {
        Ok(value) => LogFormat::parse(&value).unwrap_or_else(|| {
            eprintln!("ignoring {LOG_FORMAT_ENV}={value:?} (expected text or json); using text");
            LogFormat::Text
        }),
        Err(_) => LogFormat::Text,
    }
}

#[cfg(test)]
mod tests {
    use super::LogFormat;

    #[test]
    fn formats_parse() {
        assert_eq!(LogFormat::parse("json"), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse(" JSON\n"), Some(LogFormat::Json));
        assert_eq!(LogFormat::parse("text"), Some(LogFormat::Text));
        assert_eq!(LogFormat::parse("logfmt"), None);
    }
}
