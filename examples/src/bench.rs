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
