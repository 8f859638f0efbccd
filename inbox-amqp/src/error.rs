/// Everything that can go wrong in `inbox-amqp`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker could not be reached; lapin's error is kept, as text with every
    /// password of the URL taken out (a URL lapin cannot parse is quoted back whole).
    #[error("could not connect to {url}")]
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
    /// A connection's declarations were given up on: the connection failed while
    /// they were under way and one of them never returned. A consumer or relay that
    /// had connected before reconnects after it; the first connection of a run fails
    /// with it.
    #[error("declaring on {url} was given up: {why}")]
    Unanswered {
        /// The URL, password redacted.
        url: String,
        /// What went unanswered, and for how long.
        why: String,
    },
    /// The TLS handshake with the broker of an `amqps://` URL failed: its certificate
    /// is not trusted (`UnknownIssuer`: give its CA with `ca_cert`), is for another
    /// name, or no protocol is common; rustls's reason is the source.
    #[error("TLS with {url} failed")]
    Tls {
        /// The URL, password redacted.
        url: String,
        /// rustls's reason, as lapin reported it, passwords redacted.
        #[source]
        source: inbox_core::RedactedError,
    },
    /// An `amqps://` URL, in a build of this crate without TLS: refused before any
    /// I/O (a client without TLS would speak plain AMQP to the TLS port and wait).
    #[error("cannot connect to {url}: this build has no TLS; enable inbox-amqp's feature `rustls` for amqps:// URLs")]
    TlsUnavailable {
        /// The URL, password redacted.
        url: String,
    },
    /// A queue or exchange exists with other arguments than the ones declared.
    #[error("topology conflict on {name}: {detail}")]
    TopologyConflict {
        /// The queue or exchange.
        name: String,
        /// The broker's message, naming the argument.
        detail: String,
    },
    /// [`Topology::check`](crate::Topology::check) found an object missing: the
    /// broker answered its passive declare with NOT_FOUND.
    #[error("{kind} {name:?} does not exist: {detail}")]
    TopologyMissing {
        /// `exchange` or `queue`.
        kind: &'static str,
        /// Its name (prefixed).
        name: String,
        /// The broker's answer.
        detail: String,
    },
    /// An AMQP operation failed.
    #[error("amqp error")]
    Amqp(#[from] lapin::Error),
    /// The store failed (`inbox-core`'s error, printed as itself).
    #[error(transparent)]
    Store(inbox_core::Error),
    /// A setting was rejected before anything ran: which one, what it must be and
    /// what it was.
    #[error("invalid {setting}: expected {expected}, found {found}")]
    InvalidSetting {
        /// The setting, as its method is named (`workers`, `prefetch`, `backoff`,
        /// `exchange`, `prefix`, ...).
        setting: &'static str,
        /// What the setting must be.
        expected: &'static str,
        /// The value given.
        found: String,
    },
    /// A task of the consumer or relay panicked or was cancelled; the run ends.
    #[error("the {task} task failed")]
    TaskFailed {
        /// Which task (`consumer worker`, `store`, `relay store`).
        task: &'static str,
        /// Why it ended.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl Error {
    /// A rejected setting.
    pub(crate) fn invalid(
        setting: &'static str,
        expected: &'static str,
        found: impl std::fmt::Display,
    ) -> Self {
        Self::InvalidSetting {
            setting,
            expected,
            found: found.to_string(),
        }
    }

    /// The error of a failed connection to `url`: neither the URL nor lapin's error
    /// (nor any cause below it) keeps a password of `url`.
    /// A failed TLS handshake is [`Error::Tls`].
    pub(crate) fn connect(url: &str, source: &lapin::Error) -> Self {
        let (redacted, cause) = (
            inbox_core::redact_url(url),
            inbox_core::RedactedError::new(source, url),
        );
        if is_handshake_failure(source) {
            Self::Tls {
                url: redacted,
                source: cause,
            }
        } else {
            Self::Connect {
                url: redacted,
                source: cause,
            }
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether lapin's `err` is a TLS handshake that failed: rustls's error inside
/// lapin's I/O error.
#[cfg(feature = "rustls")]
fn is_handshake_failure(err: &lapin::Error) -> bool {
    matches!(err.kind(), lapin::ErrorKind::IOError(io)
        if io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()))
}

/// Never: a build without TLS does no handshake.
#[cfg(not(feature = "rustls"))]
fn is_handshake_failure(_: &lapin::Error) -> bool {
    false
}
