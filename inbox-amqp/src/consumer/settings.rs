//! The consumer's settings and their checks.

use super::*;
use crate::connection::ConnectionSettings;

/// How a [`Consumer`] runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConsumerSettings {
    /// Workers per consumer group, each with a channel of its own (default 2).
    pub workers: usize,
    /// Unacked deliveries the broker sends each worker (default 200; at least
    /// `batch_size`).
    pub prefetch: u16,
    /// Most deliveries handed to the store at once (default 100).
    pub batch_size: usize,
    /// Longest wait for a batch to fill once its first delivery arrived (default zero:
    /// a batch is what has already arrived, up to `batch_size`, and is handed over at
    /// once; under load batches grow by themselves, as deliveries pile up while the
    /// previous batch commits). A positive wait lingers for fuller batches at the cost
    /// of that much latency; `Duration::MAX` waits until the batch is full.
    pub batch_wait: Duration,
    /// Largest body accepted (default 1 MiB; at least 1, else refused); a larger one is
    /// dead-lettered as malformed with only its first `inbox_core::CUT_PAYLOAD_PREFIX`
    /// bytes, its length and its SHA-256: the consumer never copies such a body. lapin
    /// assembles a whole body before handing it over, so what a worker holds is bounded
    /// by `prefetch` times the broker's `max_message_size`, not by this setting: set the
    /// broker's limit to match it (see the RabbitMQ guide).
    pub max_body_bytes: usize,
    /// How the consumer connects: names, handshake limit, CA certificates, and the
    /// backoff it also waits after a store failure (the relay's type).
    pub connection: ConnectionSettings,
    /// How often the store's recorded halts are read (default 5 s): a halted group
    /// whose halt an operator lifted resumes within this, a group another consumer
    /// halted halts, and a halt the store failed to record is written again.
    pub halt_poll: Duration,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            workers: 2,
            prefetch: 200,
            batch_size: 100,
            batch_wait: Duration::ZERO,
            max_body_bytes: 1 << 20,
            connection: ConnectionSettings::default(),
            halt_poll: Duration::from_secs(5),
        }
    }
}

impl ConsumerSettings {
    /// Sets the workers per group.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Sets the prefetch per worker.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// Sets the batch size and the longest wait for a batch to fill (zero: take what
    /// has arrived and do not wait).
    pub fn batch(mut self, size: usize, wait: Duration) -> Self {
        self.batch_size = size;
        self.batch_wait = wait;
        self
    }

    /// Sets the largest body accepted.
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = n;
        self
    }

    /// Sets how the consumer connects, all at once.
    pub fn connection(mut self, connection: ConnectionSettings) -> Self {
        self.connection = connection;
        self
    }

    /// Sets the reconnect and store-failure backoff ([`ConnectionSettings::backoff`]).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.connection = self.connection.backoff(min, max);
        self
    }

    /// Names the connections ([`ConnectionSettings::connection_name`]).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection = self.connection.connection_name(name);
        self
    }

    /// Sets the longest wait for a connection's AMQP handshake
    /// ([`ConnectionSettings::connect_timeout`]).
    pub fn connect_timeout(mut self, within: Duration) -> Self {
        self.connection = self.connection.connect_timeout(within);
        self
    }

    /// Trusts the CA certificates of the PEM file at `path` for `amqps://`, besides
    /// the system's roots ([`ConnectionSettings::ca_cert`]).
    pub fn ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.connection = self.connection.ca_cert(path);
        self
    }

    /// Sets how often the store's recorded halts are read.
    pub fn halt_poll(mut self, every: Duration) -> Self {
        self.halt_poll = every;
        self
    }

    /// These settings, or [`Error::InvalidSetting`] naming the first one out of range; a
    /// consumer checks them again when it runs.
    pub fn checked(self) -> Result<Self> {
        self.check()?;
        Ok(self)
    }

    pub(super) fn check(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::invalid("workers", "at least 1", 0));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid("batch", "a batch size of at least 1", 0));
        }
        if self.max_body_bytes == 0 {
            // Every delivery would be over the limit and dead-lettered.
            return Err(Error::invalid("max_body_bytes", "at least 1 byte", 0));
        }
        if usize::from(self.prefetch) < self.batch_size {
            return Err(Error::invalid(
                "prefetch",
                "at least the batch size",
                format_args!("{} with a batch size of {}", self.prefetch, self.batch_size),
            ));
        }
        self.connection.check()?;
        if self.halt_poll.is_zero() {
            return Err(Error::invalid(
                "halt_poll",
                "a poll interval above zero",
                "0ns",
            ));
        }
        Ok(())
    }
}
