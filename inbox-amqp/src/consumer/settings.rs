//! The consumer's settings and their checks.

use super::*;

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
    /// Longest wait for a batch to fill once its first delivery arrived (default 10 ms).
    pub batch_wait: Duration,
    /// Largest body accepted (default 1 MiB; at least 1, else refused); a larger one is
    /// dead-lettered as malformed with only its first `inbox_core::CUT_PAYLOAD_PREFIX`
    /// bytes, its length and its SHA-256: the consumer never copies such a body. lapin
    /// assembles a whole body before handing it over, so what a worker holds is bounded
    /// by `prefetch` times the broker's `max_message_size`, not by this setting: set the
    /// broker's limit to match it (see the RabbitMQ guide).
    pub max_body_bytes: usize,
    /// First wait before reconnecting or after a store failure (default 100 ms).
    pub backoff_min: Duration,
    /// Longest such wait (default 5 s).
    pub backoff_max: Duration,
    /// The name of the consumer's connections, shown by `rabbitmqctl
    /// list_connections`: a group's workers' connection is `<name> (<group>)`, its
    /// dead-letter reader's `<name> (<group> dead letters)`.
    pub connection_name: Option<String>,
    /// Longest wait for a connection's AMQP handshake (default 30 s); a broker that
    /// accepts the connection and never answers is then tried again after backoff.
    pub connect_timeout: Duration,
    /// A PEM file of CA certificates trusted for an `amqps://` URL besides the
    /// system's roots (a broker with a private CA); read and checked once when the
    /// run starts (default none; see [`ca_cert_from_env`](crate::ca_cert_from_env)).
    pub ca_cert: Option<PathBuf>,
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
            batch_wait: Duration::from_millis(10),
            max_body_bytes: 1 << 20,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connection_name: None,
            connect_timeout: Duration::from_secs(30),
            ca_cert: None,
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

    /// Sets the batch size and the longest wait for a batch to fill.
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

    /// Sets the reconnect and store-failure backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// Names the connections (see [`ConsumerSettings::connection_name`](Self#structfield.connection_name)).
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
    /// [`Error::InvalidSetting`] (`ca_cert`).
    pub fn ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_cert = Some(path.into());
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
        check_backoff(self.backoff_min, self.backoff_max)?;
        check_connect_timeout(self.connect_timeout)?;
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
