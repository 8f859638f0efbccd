/// Everything that can go wrong in `inbox-amqp`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker could not be reached.
    #[error("could not connect to {url}: {source}")]
    Connect {
        /// The URL, password redacted.
        url: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// The broker accepted the connection but did not finish the AMQP handshake in
    /// time.
    #[error("could not connect to {url}: no AMQP handshake within {after:?}")]
    ConnectTimeout {
        /// The URL, password redacted.
        url: String,
        /// How long the handshake was given.
        after: std::time::Duration,
    },
    /// A queue or exchange exists with other arguments than the ones declared.
    #[error("topology conflict on {name}: {detail}")]
    TopologyConflict {
        /// The queue or exchange.
        name: String,
        /// The broker's message, naming the argument.
        detail: String,
    },
    /// An AMQP operation failed.
    #[error("amqp error: {0}")]
    Amqp(#[from] lapin::Error),
    /// The store failed.
    #[error("store error: {0}")]
    Store(#[source] inbox_core::Error),
    /// A setting was rejected.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
