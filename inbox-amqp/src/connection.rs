//! How a consumer or a relay connects to the broker: one settings type for both.

use std::path::PathBuf;
use std::time::Duration;

use crate::connect::{check_backoff, check_connect_timeout};
use crate::Result;

/// How a [`Consumer`](crate::Consumer) or a [`Relay`](crate::Relay) connects: the
/// connection's name, the handshake's time limit, the CA certificates of `amqps://`
/// and the backoff between reconnects. Both settings types hold one
/// ([`ConsumerSettings::connection`](crate::ConsumerSettings#structfield.connection),
/// [`RelaySettings::connection`](crate::RelaySettings#structfield.connection)) and
/// offer its builder methods as their own.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionSettings {
    /// The first ceiling of the wait before reconnecting (default 100 ms); a consumer,
    /// and a relay, also wait after a store failure (the relay's ceiling grows with
    /// each failed lease, mark or record in a row and falls back after a clean round). Each wait is random in `[0, ceiling]` (full
    /// jitter), the ceiling doubling after each failure, so clients that lost one
    /// broker together do not reconnect together.
    pub backoff_min: Duration,
    /// The highest ceiling (default 5 s).
    pub backoff_max: Duration,
    /// The name of the connections, shown by `rabbitmqctl list_connections`. A
    /// consumer group's workers' connection is `<name> (<group>)`, its dead-letter
    /// reader's `<name> (<group> dead letters)`; a relay's is `<name>`.
    pub connection_name: Option<String>,
    /// Longest wait for a connection's AMQP handshake (default 30 s); a broker that
    /// accepts the connection and never answers is then tried again after backoff.
    pub connect_timeout: Duration,
    /// A PEM file of CA certificates trusted for an `amqps://` URL besides the
    /// system's roots (a broker with a private CA); read and checked once when the
    /// run starts (default none; see [`ca_cert_from_env`](crate::ca_cert_from_env)).
    pub ca_cert: Option<PathBuf>,
}

impl Default for ConnectionSettings {
    fn default() -> Self {
        Self {
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connection_name: None,
            connect_timeout: Duration::from_secs(30),
            ca_cert: None,
        }
    }
}

impl ConnectionSettings {
    /// Sets the reconnect backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// Names the connections (see
    /// [`connection_name`](Self#structfield.connection_name)).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Sets the longest wait for a connection's AMQP handshake.
    pub fn connect_timeout(mut self, within: Duration) -> Self {
        self.connect_timeout = within;
        self
    }

    /// Trusts the CA certificates of the PEM file at `path` for `amqps://`, besides
    /// the system's roots. An unreadable file, one without a certificate, or a CA with
    /// a plain `amqp://` URL stops the run at its start with
    /// [`Error::InvalidSetting`](crate::Error::InvalidSetting) (`ca_cert`).
    pub fn ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_cert = Some(path.into());
        self
    }

    /// The backoff and the handshake limit in range, or
    /// [`Error::InvalidSetting`](crate::Error::InvalidSetting) naming the first one out
    /// of it (the CA file is read when the run starts).
    pub(crate) fn check(&self) -> Result<()> {
        check_backoff(self.backoff_min, self.backoff_max)?;
        check_connect_timeout(self.connect_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConsumerSettings, RelaySettings};

    #[test]
    fn the_consumer_and_the_relay_connect_alike() {
        assert_eq!(
            ConsumerSettings::default().connection,
            RelaySettings::default().connection
        );
        let (min, max) = (Duration::from_millis(20), Duration::from_secs(2));
        let within = Duration::from_secs(3);
        let consumer = ConsumerSettings::default()
            .backoff(min, max)
            .connection_name("billing")
            .connect_timeout(within)
            .ca_cert("/etc/ca.pem");
        let relay = RelaySettings::default()
            .backoff(min, max)
            .connection_name("billing")
            .connect_timeout(within)
            .ca_cert("/etc/ca.pem");
        assert_eq!(consumer.connection, relay.connection);
        let expected = ConnectionSettings {
            backoff_min: min,
            backoff_max: max,
            connection_name: Some("billing".to_owned()),
            connect_timeout: within,
            ca_cert: Some(PathBuf::from("/etc/ca.pem")),
        };
        assert_eq!(consumer.connection, expected);
        let set_at_once = RelaySettings::default().connection(expected.clone());
        assert_eq!(set_at_once.connection, expected);
    }

    #[test]
    fn both_refuse_the_same_connection_settings() {
        let bad =
            ConnectionSettings::default().backoff(Duration::from_secs(2), Duration::from_secs(1));
        let consumer = ConsumerSettings::default()
            .connection(bad.clone())
            .checked();
        let relay = RelaySettings::default().connection(bad).checked();
        assert!(consumer.is_err() && relay.is_err());
        assert_eq!(
            consumer.unwrap_err().to_string(),
            relay.unwrap_err().to_string()
        );
    }
}
