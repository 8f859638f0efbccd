/// Everything that can go wrong in `inbox-amqp`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker could not be reached; lapin's error is kept, as text with every
    /// password of the URL taken out (a URL lapin cannot parse is quoted back whole).
    #[error("could not connect to {url}: {source}")]
    Connect {
        /// The URL, password redacted.
        url: String,
        /// lapin's error and its causes, passwords redacted.
        #[source]
        source: inbox_core::RedactedError,
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

impl Error {
    /// The error of a failed connection to `url`: neither the URL nor lapin's error
    /// (nor any cause below it) keeps a password of `url`.
    pub(crate) fn connect(url: &str, source: &lapin::Error) -> Self {
        Self::Connect {
            url: inbox_core::redact_url(url),
            source: inbox_core::RedactedError::new(source, url),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
