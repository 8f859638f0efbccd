//! A service binary's process wiring, in two calls: [`init`] first thing in `main`,
//! and [`serve`] to consume and relay until ctrl-c or SIGTERM.
//!
//! ```no_run
//! use diesel::PgConnection;
//! use inbox_cli::service;
//! use inbox_diesel::Store;
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let _process = service::init(); // before any thread: the stack, the logs
//!     // Built here, off any async runtime (add its handlers before `build`).
//!     let store = Store::<PgConnection>::builder("postgres://postgres@127.0.0.1/test").build()?;
//!     let amqp = service::amqp_url(); // AMQP_URL, else a local RabbitMQ
//!     service::serve(&amqp, store, inbox_amqp::Topology::new("shop")?)?;
//!     Ok(())
//! }
//! ```
//!
//! Why `init` must come first: lapin parses frames on a thread it spawns without a
//! stack size, and its parser recurses once per level of a header table, so another
//! client's deeply nested table needs far more than the default stack
//! ([`inbox_amqp::frame_parse_stack`]). The standard library takes that thread's
//! stack from `RUST_MIN_STACK`, read once, at the first thread spawned; it can only be
//! set safely while the process has one thread ([`inbox_amqp::reserve_frame_stack`]).

use std::sync::Arc;

use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, FrameStack, Relay, Topology};
use inbox_core::{GroupHalts, InboxStore, OutboxStore};

/// The log filter [`init`] installs when `RUST_LOG` is not set: `info`, lapin's own
/// lines off (the consumer and the relay log what lapin reports to them as their own;
/// lapin's raw lines include a returned message's body and an error at every clean
/// shutdown). `RUST_LOG=info,lapin=warn` brings them back.
pub const SERVICE_LOG_FILTER: &str = "info,lapin=off,amq_protocol=off";

/// The broker [`amqp_url`] names when `AMQP_URL` is not set.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The broker's URL: `AMQP_URL`, else [`DEFAULT_AMQP_URL`] (a local RabbitMQ).
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL")
        .ok()
        .filter(|url| !url.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_AMQP_URL.to_owned())
}

/// What [`init`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "the stack is set only if init ran before any thread: check `frame_stack`"]
pub struct Process {
    /// Whether lapin's frame-parsing thread gets the stack it needs.
    pub frame_stack: FrameStack,
    /// Whether a log subscriber was installed (`false`: one was there already).
    pub logging: bool,
}

/// Prepares the process for a consumer: the stack lapin's frame parser needs
/// ([`inbox_amqp::reserve_frame_stack`]: set while the process has one thread, left
/// alone, and reported in [`Process::frame_stack`], when it has more or they cannot be
/// counted), then a log
/// subscriber on stderr ([`crate::logging::install`] with [`SERVICE_LOG_FILTER`]:
/// `RUST_LOG`, `INBOX_LOG_FORMAT=json`), unless one is installed already.
///
/// Call it first thing in a synchronous `main`, before a runtime or a pool exists.
/// When other threads run, or their number cannot be read (not Linux), it leaves
/// `RUST_MIN_STACK` alone and says so on stderr.
pub fn init() -> Process {
    let frame_stack = inbox_amqp::reserve_frame_stack();
    let logging = crate::logging::install(SERVICE_LOG_FILTER);
    let need = inbox_amqp::frame_parse_stack();
    match frame_stack {
        FrameStack::ThreadsRunning => eprintln!(
            "inbox_cli::service::init ran after other threads started, so RUST_MIN_STACK \
             was left as it was; call it first thing in main, or set RUST_MIN_STACK={need}"
        ),
        FrameStack::Unverified => eprintln!(
            "inbox_cli::service::init cannot count this process's threads here, so \
             RUST_MIN_STACK was left as it was; set RUST_MIN_STACK={need} before the \
             program starts"
        ),
        _ => {}
    }
    Process {
        frame_stack,
        logging,
    }
}

/// Why [`serve`] ended other than by a signal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The tokio runtime could not be built.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The consumer or the relay failed (the other was stopped).
    #[error(transparent)]
    Amqp(#[from] inbox_amqp::Error),
}

/// Runs a consumer of every handler of `store`, through `topology`, and a relay of
/// its outbox, on a multi-threaded tokio runtime of its own, until ctrl-c or SIGTERM
/// (then both drain and it returns `Ok`); see [`inbox_amqp::serve`] for how one's
/// failure stops the other.
///
/// Both connect to `amqp_url` with the default settings, and with the CA of
/// `AMQP_CA_CERT` when it is set ([`inbox_amqp::CA_CERT_ENV`]). Build the store before
/// (its pool connects synchronously) and call it from a synchronous `main`, not from
/// inside a runtime. For settings of your own, build a [`Consumer`] and a [`Relay`]
/// and run them with [`inbox_amqp::serve`].
pub fn serve<S>(amqp_url: &str, store: S, topology: Topology) -> Result<(), ServeError>
where
    S: InboxStore + GroupHalts + OutboxStore,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(async {
        let store = Arc::new(store);
        let (mut consumer_settings, mut relay_settings) = Default::default();
        if let Some(ca) = inbox_amqp::ca_cert_from_env() {
            consumer_settings = inbox_amqp::ConsumerSettings::default().ca_cert(&ca);
            relay_settings = inbox_amqp::RelaySettings::default().ca_cert(ca);
        }
        let consumer =
            Consumer::new(amqp_url, store.clone(), topology).with_settings(consumer_settings);
        let relay = Relay::new(amqp_url, store).with_settings(relay_settings);
        let shutdown = cancel_on_signals(CancellationToken::new());
        Ok(inbox_amqp::serve(consumer, relay, shutdown).await?)
    })
}
