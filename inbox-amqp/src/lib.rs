//! The RabbitMQ transport of the inbox, on lapin and tokio.
//!
//! [`Topology`] declares a topic exchange and, per consumer group, a quorum queue, a
//! ladder of retry-tier queues and a dead-letter queue. [`Consumer`] consumes every
//! group of an [`inbox_core::InboxStore`] (that keeps halts: [`inbox_core::GroupHalts`])
//! and carries out the store's decisions: it
//! never decides itself, and it never imports a database crate. [`Relay`] publishes an
//! [`inbox_core::OutboxStore`] with publisher confirms.
//!
//! `amqps://` URLs need the feature `rustls` (off by default): TLS on rustls with
//! *ring*, the system's root certificates and, for a broker with a private CA,
//! [`ConsumerSettings::ca_cert`] / [`RelaySettings::ca_cert`]. Without it such a URL
//! is [`Error::TlsUnavailable`] at once ([`TLS_BUILT`] tells the build).
//!
//! ```no_run
//! use std::sync::Arc;
//! use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, Topology};
//! # async fn run<S: inbox_core::InboxStore + inbox_core::GroupHalts>(store: S) -> Result<(), inbox_amqp::Error> {
//! let topology = Topology::new("billing")?;
//! let consumer = Consumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", Arc::new(store), topology);
//! consumer.run(cancel_on_signals(CancellationToken::new())).await
//! # }
//! ```
#![forbid(unsafe_code)]

mod brokers;
mod connect;
mod connection;
mod consumer;
mod delivery;
mod election;
mod error;
mod frames;
mod outbox_publisher;
mod publish;
mod relay;
mod serve;
mod shutdown;
mod stats;
mod supervisor;
#[cfg(test)]
mod test_support;
mod tls;
mod topology;

pub use brokers::BrokerUrls;
pub use connect::connect;
pub use connection::ConnectionSettings;
pub use consumer::{Consumer, ConsumerSettings};
pub use delivery::{OCCURRED_AT_HEADER, TENANT_HEADER};
pub use error::{Error, Result};
pub use frames::{frame_parse_stack, reserve_frame_stack, FrameStack, FRAME_MAX};
pub use relay::{
    Relay, RelaySettings, RelaySnapshot, RelayStats, DEFAULT_ROUNDS_IN_FLIGHT, MAX_ROUNDS_IN_FLIGHT,
};
pub use serve::serve;
pub use shutdown::{cancel_on_signals, shutdown_signal};
pub use stats::{ConsumerStats, StatsSnapshot};
pub use tls::{ca_cert_from_env, CA_CERT_ENV, TLS_BUILT};
pub use tokio_util::sync::CancellationToken;
pub use topology::Topology;
