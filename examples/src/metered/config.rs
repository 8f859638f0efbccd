//! The service's settings, from the environment.
//!
//! No URL is ever printed whole: [`Config`]'s `Debug` and every [`ConfigError`] show
//! URLs through [`inbox_core::redact_url`], and the admin token is kept only as its
//! SHA-256 digest (its `Debug` shows neither).

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use inbox_core::redact_url;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Everything `metered_api` reads from its environment (see the README's table).
#[derive(Clone)]
pub struct Config {
    /// `DATABASE_URL`: the PostgreSQL database (required).
    pub database_url: String,
    /// `METERED_SCHEMA`: the schema of the service's tables (default `metered`).
    pub schema: String,
    /// `REDIS_URL` (default `redis://127.0.0.1:6379`).
    pub redis_url: String,
    /// `LISTEN_ADDR` (default `127.0.0.1:8080`; port 0 picks a free one): `/v1`.
    pub listen: SocketAddr,
    /// `METERED_ADMIN_ADDR` (default `127.0.0.1:8081`; port 0 picks a free one):
    /// `/admin`, on a listener of its own.
    pub admin_listen: SocketAddr,
    /// `METERED_ADMIN_TOKEN` (required, 16 characters or more): the bearer token of
    /// every `/admin` request.
    pub admin_token: AdminToken,
    /// `METERED_HEADER_TIMEOUT_MS`: how long a connection may take to send a
    /// request's headers, and how long it may stay open between requests
    /// (default 10000).
    pub header_timeout: Duration,
    /// `METERED_IDLE_TIMEOUT_MS`: how long a connection may make no progress in
    /// either direction (a request body that stalls, a client that stops reading
    /// its stream) before it is closed (default 30000).
    pub idle_timeout: Duration,
    /// `METERED_MAX_CONNECTIONS`: open connections on the public listener; past it
    /// new ones wait in the kernel's backlog (default 512).
    pub max_connections: usize,
    /// `METERED_AUTH_FAILURE_LIMIT`: failed authentications a client address may
    /// make in a burst, refilled at this many per minute (default 30).
    pub auth_failure_limit: u64,
    /// `METERED_DEADLINE_MS`: a request's deadline (default 30000).
    pub deadline: Duration,
    /// `METERED_SETTLE_MARGIN_MS`: how long after the deadline a settlement is due
    /// (default 5000).
    pub settle_margin: Duration,
    /// `METERED_CHUNK_DELAY_MS`: the simulated upstream's pause between chunks
    /// (default 50).
    pub chunk_delay: Duration,
    /// `METERED_RATE_LIMIT`: requests per second per API key (default 1000).
    pub rate_limit: u64,
    /// `METERED_MAX_CONCURRENCY`: streams at once per account (default 256).
    pub max_concurrency: u64,
    /// `METERED_POOL_SIZE`: PostgreSQL connections (default 16).
    pub pool_size: u32,
    /// `METERED_RELAY_POLL_MS`: how often the in-process relay looks for due
    /// settlements (default 200).
    pub relay_poll: Duration,
    /// `METERED_REDIS_PROBE_MS`: how often the health probe checks Redis in the
    /// background (default 1000; 0: only `GET /v1/health` probes).
    pub redis_probe: Option<Duration>,
    /// `METERED_IDEMPOTENCY_RETENTION_MS`: how long idempotency records are kept
    /// (default 86400000, 24 h); purged every minute in batches of 1000.
    pub idempotency_retention: Duration,
    /// `AMQP_URL`: when set, settlements go through RabbitMQ instead of in-process.
    pub amqp_url: Option<String>,
    /// `METERED_AMQP_PREFIX`: prefix of the exchange and queue names (default none).
    pub amqp_prefix: String,
    /// `METERED_AMQP_QUEUE_EXPIRES_MS`: `x-expires` of the group queues (for tests;
    /// default none).
    pub amqp_queue_expires: Option<Duration>,
}

/// Every URL redacted (its password shown as `***`).
impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &redact_url(&self.database_url))
            .field("schema", &self.schema)
            .field("redis_url", &redact_url(&self.redis_url))
            .field("listen", &self.listen)
            .field("admin_listen", &self.admin_listen)
            .field("admin_token", &self.admin_token)
            .field("header_timeout", &self.header_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_connections", &self.max_connections)
            .field("auth_failure_limit", &self.auth_failure_limit)
            .field("deadline", &self.deadline)
            .field("settle_margin", &self.settle_margin)
            .field("chunk_delay", &self.chunk_delay)
            .field("rate_limit", &self.rate_limit)
            .field("max_concurrency", &self.max_concurrency)
            .field("pool_size", &self.pool_size)
            .field("relay_poll", &self.relay_poll)
            .field("redis_probe", &self.redis_probe)
            .field("idempotency_retention", &self.idempotency_retention)
            .field("amqp_url", &self.amqp_url.as_deref().map(redact_url))
            .field("amqp_prefix", &self.amqp_prefix)
            .field("amqp_queue_expires", &self.amqp_queue_expires)
            .finish()
    }
}

/// The admin token, kept as its SHA-256 digest only.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

/// The fewest characters an admin token may have.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 16;

impl AdminToken {
    /// The token `token` (its digest).
    pub fn new(token: &str) -> Self {
        Self {
            digest: Sha256::digest(token.as_bytes()).into(),
        }
    }

    /// Whether `presented` is the token. Both sides are compared as SHA-256 digests
    /// of equal length, with `subtle`'s constant-time equality, so the time taken says
    /// nothing about how much of the token was right.
    pub fn matches(&self, presented: &str) -> bool {
        let presented: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        bool::from(self.digest[..].ct_eq(&presented[..]))
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

/// A setting that does not parse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A variable's value is not what it must be. `found` never holds a password
    /// (URLs are redacted) nor a secret (the admin token is described by its length).
    #[error("invalid {setting}: expected {expected}, found {found:?}")]
    InvalidSetting {
        /// The variable.
        setting: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it was (redacted).
        found: String,
    },
}

fn invalid(setting: &'static str, expected: &'static str, found: String) -> ConfigError {
    ConfigError::InvalidSetting {
        setting,
        expected,
        found,
    }
}

/// Where settings are read from: the environment, or a test's map.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    /// A set, non-empty value.
    fn var(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.is_empty())
    }

    fn raw(&self, name: &str) -> String {
        (self.0)(name).unwrap_or_default()
    }

    fn number(&self, name: &'static str, default: u64, min: u64) -> Result<u64, ConfigError> {
        match self.var(name) {
            None => Ok(default),
            Some(v) => v.parse::<u64>().ok().filter(|n| *n >= min).ok_or_else(|| {
                invalid(
                    name,
                    if min == 0 {
                        "a whole number"
                    } else {
                        "a whole number of at least 1"
                    },
                    v,
                )
            }),
        }
    }

    fn millis(&self, name: &'static str, default: u64, min: u64) -> Result<Duration, ConfigError> {
        self.number(name, default, min).map(Duration::from_millis)
    }

    fn address(&self, name: &'static str, default: &str) -> Result<SocketAddr, ConfigError> {
        let text = self.var(name).unwrap_or_else(|| default.to_owned());
        text.parse()
            .map_err(|_| invalid(name, "host:port, such as 127.0.0.1:8080", text))
    }

    /// `DATABASE_URL`, which must be a `postgres://` URL; a value that is not is shown
    /// redacted in the error.
    fn database_url(&self) -> Result<String, ConfigError> {
        let raw = self.raw("DATABASE_URL");
        if raw.starts_with("postgres://") || raw.starts_with("postgresql://") {
            Ok(raw)
        } else {
            Err(invalid(
                "DATABASE_URL",
                "a postgres:// URL",
                redact_url(&raw),
            ))
        }
    }

    fn admin_token(&self) -> Result<AdminToken, ConfigError> {
        let raw = self.raw("METERED_ADMIN_TOKEN");
        let chars = raw.chars().count();
        if chars < MIN_ADMIN_TOKEN_CHARS || raw.chars().any(|c| c.is_control() || c == ' ') {
            return Err(invalid(
                "METERED_ADMIN_TOKEN",
                "a secret of at least 16 printable characters without spaces",
                format!("a value of {chars} characters"),
            ));
        }
        Ok(AdminToken::new(&raw))
    }
}

impl Config {
    /// Reads the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(&|name| std::env::var(name).ok())
    }

    /// Reads the settings from `lookup` (a variable's value by its name).
    pub fn from_vars(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let v = Vars(lookup);
        let database_url = v.database_url()?;
        let schema = v
            .var("METERED_SCHEMA")
            .unwrap_or_else(|| "metered".to_owned());
        let listen = v.address("LISTEN_ADDR", "127.0.0.1:8080")?;
        let admin_listen = v.address("METERED_ADMIN_ADDR", "127.0.0.1:8081")?;
        let admin_token = v.admin_token()?;
        let redis_url = v
            .var("REDIS_URL")
            .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
        let pool_size = v.number("METERED_POOL_SIZE", 16, 1)?;
        let max_connections = v.number("METERED_MAX_CONNECTIONS", 512, 1)?;
        Ok(Self {
            database_url,
            schema,
            redis_url,
            listen,
            admin_listen,
            admin_token,
            header_timeout: v.millis("METERED_HEADER_TIMEOUT_MS", 10_000, 1)?,
            idle_timeout: v.millis("METERED_IDLE_TIMEOUT_MS", 30_000, 1)?,
            max_connections: usize::try_from(max_connections)
                .ok()
                .filter(|n| *n <= 1 << 20)
                .ok_or_else(|| {
                    invalid(
                        "METERED_MAX_CONNECTIONS",
                        "at most 1048576",
                        max_connections.to_string(),
                    )
                })?,
            auth_failure_limit: v.number("METERED_AUTH_FAILURE_LIMIT", 30, 1)?,
            deadline: v.millis("METERED_DEADLINE_MS", 30_000, 1)?,
            settle_margin: v.millis("METERED_SETTLE_MARGIN_MS", 5_000, 0)?,
            chunk_delay: v.millis("METERED_CHUNK_DELAY_MS", 50, 0)?,
            rate_limit: v.number("METERED_RATE_LIMIT", 1000, 1)?,
            max_concurrency: v.number("METERED_MAX_CONCURRENCY", 256, 1)?,
            pool_size: u32::try_from(pool_size).map_err(|_| {
                invalid(
                    "METERED_POOL_SIZE",
                    "at most 4294967295",
                    pool_size.to_string(),
                )
            })?,
            relay_poll: v.millis("METERED_RELAY_POLL_MS", 200, 1)?,
            redis_probe: Some(v.millis("METERED_REDIS_PROBE_MS", 1000, 0)?)
                .filter(|d| !d.is_zero()),
            idempotency_retention: v.millis(
                "METERED_IDEMPOTENCY_RETENTION_MS",
                inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION.as_millis() as u64,
                1,
            )?,
            amqp_url: v.var("AMQP_URL"),
            amqp_prefix: v.var("METERED_AMQP_PREFIX").unwrap_or_default(),
            amqp_queue_expires: match v.var("METERED_AMQP_QUEUE_EXPIRES_MS") {
                None => None,
                Some(_) => Some(v.millis("METERED_AMQP_QUEUE_EXPIRES_MS", 0, 1)?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_vars(&move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    const TOKEN: (&str, &str) = ("METERED_ADMIN_TOKEN", "an-admin-token-of-32-characters!");

    #[test]
    fn no_url_is_printed_whole_in_debug() {
        let config = parse(&[
            ("DATABASE_URL", "postgres://app:pg-s3cret@db/x"),
            ("REDIS_URL", "redis://:redis-s3cret@cache:6379"),
            ("AMQP_URL", "amqp://app:amqp-s3cret@broker/%2f"),
            TOKEN,
        ])
        .unwrap();
        let debug = format!("{config:?}");
        for secret in ["pg-s3cret", "redis-s3cret", "amqp-s3cret", TOKEN.1] {
            assert!(!debug.contains(secret), "{secret} in {debug}");
        }
        assert!(debug.contains("postgres://app:***@db/x"), "{debug}");
        assert!(debug.contains("amqp://app:***@broker/%2f"), "{debug}");
    }

    #[test]
    fn a_mistyped_scheme_is_refused_without_its_password() {
        let err = parse(&[("DATABASE_URL", "postgress://app:pg-s3cret@db/x"), TOKEN]).unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("pg-s3cret"), "{text}");
        assert!(!format!("{err:?}").contains("pg-s3cret"), "{err:?}");
        assert!(
            matches!(
                err,
                ConfigError::InvalidSetting { setting: "DATABASE_URL", ref found, .. }
                    if found == "postgress://app:***@db/x"
            ),
            "{err:?}"
        );
    }

    #[test]
    fn the_admin_token_is_required_and_never_echoed() {
        let url = ("DATABASE_URL", "postgres://app@db/x");
        let err = parse(&[url]).unwrap_err();
        assert!(matches!(
            err,
            ConfigError::InvalidSetting {
                setting: "METERED_ADMIN_TOKEN",
                ..
            }
        ));
        let err = parse(&[url, ("METERED_ADMIN_TOKEN", "short-s3cret")]).unwrap_err();
        assert!(!err.to_string().contains("short-s3cret"), "{err}");
        assert!(parse(&[url, TOKEN]).is_ok());
    }

    #[test]
    fn the_admin_token_matches_itself_only() {
        let token = AdminToken::new("a-token-of-some-length");
        assert!(token.matches("a-token-of-some-length"));
        assert!(!token.matches("a-token-of-some-lengtH"));
        assert!(!token.matches(""));
        assert_eq!(format!("{token:?}"), "AdminToken(***)");
    }
}
