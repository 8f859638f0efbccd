//! What the consumer and the relay share about their broker connection: connecting
//! with a name and a bounded handshake, the reconnect backoff, goodbyes that never
//! wait long on a dead connection, and why a session ended.

use std::future::Future;
use std::time::Duration;

use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use inbox_core::redact_url;

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
        Ok(connected) => connected.map_err(|source| Error::Connect {
            url: redact_url(url),
            source,
        }),
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
    *backoff = (*backoff * 2).min(max);
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
