//! What the consumer and the relay share about their broker connection: connecting
//! with a name and a bounded handshake, the reconnect backoff, goodbyes that never
//! wait long on a dead connection, and why a session ended (the loop that uses them
//! is in `supervisor`).

use std::future::Future;
use std::time::Duration;

use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use inbox_core::{exponential_backoff, redact_url};

use crate::{Error, Result};

/// Why a session with the broker ended.
pub(crate) enum SessionEnd {
    /// The connection or a channel was lost: reconnect.
    Lost(String),
    /// Stop for good.
    Fatal(Error),
}

impl From<lapin::Error> for SessionEnd {
    fn from(err: lapin::Error) -> Self {
        Self::Lost(err.to_string())
    }
}

/// Connects, naming the connection, and gives up when the AMQP handshake has not
/// finished `within` (a peer that accepts the connection and never answers would
/// otherwise hold it forever: heartbeats only start after the handshake). The error
/// keeps lapin's cause and hides the password.
pub(crate) async fn connect(url: &str, name: Option<&str>, within: Duration) -> Result<Connection> {
    let mut props = ConnectionProperties::default();
    if let Some(name) = name {
        props = props.with_connection_name(LongString::from(name));
    }
    match tokio::time::timeout(within, Connection::connect(url, props)).await {
        Ok(connected) => connected.map_err(|source| Error::connect(url, &source)),
        Err(_) => Err(Error::ConnectTimeout {
            url: redact_url(url),
            after: within,
        }),
    }
}

/// The longest wait for the broker to acknowledge a goodbye (a cancel or a close). A
/// connection that dies while it is being closed may never answer (lapin can send the
/// close after its I/O loop has stopped); such a connection is dropped, not waited on.
const GOODBYE_WAIT: Duration = Duration::from_secs(2);

/// Runs a goodbye for at most [`GOODBYE_WAIT`]; its outcome does not matter.
pub(crate) async fn goodbye<T>(what: &str, fut: impl Future<Output = T>) {
    if tokio::time::timeout(GOODBYE_WAIT, fut).await.is_err() {
        tracing::debug!(what, "the broker did not answer in time; giving up on it");
    }
}

/// Closes a connection politely if it is still open.
pub(crate) async fn close_connection(conn: &Connection, text: &str) {
    if conn.status().connected() {
        goodbye("connection close", conn.close(200, text.into())).await;
    }
}

/// Closes a channel politely if it is still open.
pub(crate) async fn close_channel(channel: &Channel, text: &str) {
    if channel.status().connected() {
        goodbye("channel close", channel.close(200, text.into())).await;
    }
}

/// Waits out the backoff (or the shutdown), then doubles it up to `max`.
pub(crate) async fn pause(shutdown: &CancellationToken, backoff: &mut Duration, max: Duration) {
    tokio::select! {
        () = tokio::time::sleep(*backoff) => {}
        () = shutdown.cancelled() => {}
    }
    *backoff = exponential_backoff(*backoff, 1, max);
}

/// The message of a configuration error; panics on anything else.
#[cfg(test)]
pub(crate) fn config_error(checked: Result<()>) -> String {
    match checked {
        Err(Error::Config(msg)) => msg,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// Refuses a connect timeout of zero.
pub(crate) fn check_connect_timeout(within: Duration) -> Result<()> {
    if within.is_zero() {
        return Err(Error::Config(
            "the connect timeout must be greater than zero".to_owned(),
        ));
    }
    Ok(())
}

/// Refuses a backoff that is zero or whose minimum exceeds its maximum.
pub(crate) fn check_backoff(min: Duration, max: Duration) -> Result<()> {
    if min.is_zero() || min > max {
        return Err(Error::Config(format!(
            "backoff must satisfy 0 < min <= max, found {min:?}..{max:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Display of every level of the chain, and Debug of the top.
    fn everything_printed(err: &Error) -> Vec<String> {
        let mut printed = vec![format!("{err:?}")];
        let mut level: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = level {
            printed.push(e.to_string());
            level = e.source();
        }
        printed
    }

    /// URLs lapin refuses before any I/O (or that find nothing listening), and the
    /// password each must not print.
    #[test]
    fn connect_errors_print_no_password() {
        let cases = [
            // Not a base URL: amq-protocol-uri quotes it back whole.
            ("amqp:guest:s3cret@127.0.0.1", "s3cret"),
            ("amqp:guest:s3cret@127.0.0.1/%2f", "s3cret"),
            // '?', '#' or '/' end the authority: the head of the password is a port.
            ("amqp://guest:qu?es-s3cret@127.0.0.1:1/%2f", "qu?es-s3cret"),
            ("amqp://guest:ha#sh-s3cret@127.0.0.1:1/%2f", "ha#sh-s3cret"),
            ("amqp://guest:sl4sh/s3cret@127.0.0.1:1/%2f", "sl4sh"),
            // Percent-encoded: neither form is printed.
            ("amqp://guest:p%40ss%3Fw@127.0.0.1:1/%2f", "p%40ss%3Fw"),
            ("amqp://guest:p%40ss%3Fw@127.0.0.1:1/%2f", "p@ss?w"),
            // Invalid UTF-8 once decoded.
            ("amqp://guest:p%FFs3cret@127.0.0.1:1/%2f", "p%FFs3cret"),
            ("amqp://guest:at@s3cret@127.0.0.1:1/%2f", "at@s3cret"),
            ("amqps://guest:tls-s3cret@127.0.0.1:1/%2f", "tls-s3cret"),
            ("http://guest:http-s3cret@127.0.0.1:1/", "http-s3cret"),
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        for (url, password) in cases {
            let err = match runtime.block_on(connect(url, None, Duration::from_secs(5))) {
                Ok(_) => panic!("connected to {}", redact_url(url)),
                Err(err) => err,
            };
            assert!(matches!(err, Error::Connect { .. }), "{err:?}");
            for text in everything_printed(&err) {
                assert!(!text.contains(password), "{url}: {text}");
            }
        }
    }
}
