//! The service's settings, from the environment.

use std::net::SocketAddr;
use std::time::Duration;

/// Everything `metered_api` reads from its environment (see the README's table).
#[derive(Clone, Debug)]
pub struct Config {
    /// `DATABASE_URL`: the PostgreSQL database (required).
    pub database_url: String,
    /// `METERED_SCHEMA`: the schema of the service's tables (default `metered`).
    pub schema: String,
    /// `REDIS_URL` (default `redis://127.0.0.1:6379`).
    pub redis_url: String,
    /// `LISTEN_ADDR` (default `127.0.0.1:8080`; port 0 picks a free one).
    pub listen: SocketAddr,
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

/// A setting that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("invalid {name}: expected {expected}, found {found:?}")]
pub struct ConfigError {
    /// The variable.
    pub name: &'static str,
    /// What it must be.
    pub expected: &'static str,
    /// What it was.
    pub found: String,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn number(name: &'static str, default: u64, min: u64) -> Result<u64, ConfigError> {
    match var(name) {
        None => Ok(default),
        Some(v) => v
            .parse::<u64>()
            .ok()
            .filter(|n| *n >= min)
            .ok_or(ConfigError {
                name,
                expected: if min == 0 {
                    "a whole number"
                } else {
                    "a whole number of at least 1"
                },
                found: v,
            }),
    }
}

fn millis(name: &'static str, default: u64, min: u64) -> Result<Duration, ConfigError> {
    number(name, default, min).map(Duration::from_millis)
}

impl Config {
    /// Reads the environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        let database_url = var("DATABASE_URL")
            .filter(|u| u.starts_with("postgres://") || u.starts_with("postgresql://"))
            .ok_or(ConfigError {
                name: "DATABASE_URL",
                expected: "a postgres:// URL",
                found: std::env::var("DATABASE_URL").unwrap_or_default(),
            })?;
        let schema = var("METERED_SCHEMA").unwrap_or_else(|| "metered".to_owned());
        let listen_text = var("LISTEN_ADDR").unwrap_or_else(|| "127.0.0.1:8080".to_owned());
        let listen = listen_text.parse().map_err(|_| ConfigError {
            name: "LISTEN_ADDR",
            expected: "host:port, such as 127.0.0.1:8080",
            found: listen_text.clone(),
        })?;
        let redis_url = var("REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
        let pool_size = number("METERED_POOL_SIZE", 16, 1)?;
        Ok(Self {
            database_url,
            schema,
            redis_url,
            listen,
            deadline: millis("METERED_DEADLINE_MS", 30_000, 1)?,
            settle_margin: millis("METERED_SETTLE_MARGIN_MS", 5_000, 0)?,
            chunk_delay: millis("METERED_CHUNK_DELAY_MS", 50, 0)?,
            rate_limit: number("METERED_RATE_LIMIT", 1000, 1)?,
            max_concurrency: number("METERED_MAX_CONCURRENCY", 256, 1)?,
            pool_size: u32::try_from(pool_size).map_err(|_| ConfigError {
                name: "METERED_POOL_SIZE",
                expected: "at most 4294967295",
                found: pool_size.to_string(),
            })?,
            relay_poll: millis("METERED_RELAY_POLL_MS", 200, 1)?,
            redis_probe: Some(millis("METERED_REDIS_PROBE_MS", 1000, 0)?).filter(|d| !d.is_zero()),
            idempotency_retention: millis(
                "METERED_IDEMPOTENCY_RETENTION_MS",
                inbox_core::DEFAULT_IDEMPOTENCY_RETENTION.as_millis() as u64,
                1,
            )?,
            amqp_url: var("AMQP_URL"),
            amqp_prefix: var("METERED_AMQP_PREFIX").unwrap_or_default(),
            amqp_queue_expires: match var("METERED_AMQP_QUEUE_EXPIRES_MS") {
                None => None,
                Some(_) => Some(millis("METERED_AMQP_QUEUE_EXPIRES_MS", 0, 1)?),
            },
        })
    }
}
