//! A transactional inbox and outbox for Rust services: at-least-once delivery in,
//! exactly-once *effects* in the database. One dependency for an application: this
//! crate re-exports the `inbox-*` crates behind features, with a [`prelude`].
//!
//! | feature | what it adds | default |
//! |---|---|---|
//! | `derive` | `#[derive(Handler)]` (generated code resolves through this crate) | on |
//! | `amqp` | [`amqp`]: the RabbitMQ consumer and the outbox relay | off |
//! | `cli` | [`cli`]: the operator commands to mount in your binary (turns on `operator`) | off |
//! | `operator` | `store::operator`: dead letters, replay, discard, redrive, stats, halts, canaries | off |
//! | `rebuild` | `store::rebuild`: projection rebuilds and audits | off |
//! | `idempotency` | `store::idempotency`: idempotency keys of requests | off |
//! | `web` | [`web`]: the operator web console, an axum `Router` to mount (and `inbox web` with `cli`) | off |
//! | `rustls` | `amqps://` URLs | off |
//!
//! The store ([`store`], inbox-diesel) runs on PostgreSQL and SQLite; [`diesel`] is
//! re-exported so that the connection types and queries need no second dependency.
//!
//! ```
//! use inbox_outbox::prelude::*;
//! use inbox_outbox::diesel::SqliteConnection;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { cents: i64 }
//!
//! #[derive(Handler)]
//! #[inbox(group = "shop.orders", message = OrderPlaced, message_type = "order.placed",
//!         connection = [SqliteConnection])]
//! struct Orders;
//!
//! impl Orders {
//!     fn handle(&self, _: &mut SqliteConnection, order: OrderPlaced, _: &MessageContext<'_>)
//!         -> Result<(), HandlerError> {
//!         if order.cents < 0 { return Err(HandlerError::permanent("negative amount")); }
//!         Ok(())
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let url = format!("sqlite://{}", dir.path().join("shop.db").display());
//! let store = Store::<SqliteConnection>::builder(url).handler(Orders).build()?;
//! let mut transport = InProcessTransport::new(store);
//! let order = Envelope::new(MessageKey::derive("shop", "order-1", "order.placed"),
//!                           "order.placed", br#"{"cents":1250}"#.to_vec());
//! transport.publish(order.clone())?;
//! transport.publish(order)?; // delivered twice: handled once
//! let stats = transport.run_until_idle()?;
//! assert_eq!((stats.processed, stats.duplicates), (1, 1));
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// The date and time types of the API (`Rebuild::window`'s `now`, a clock's instants).
pub use chrono;
pub use diesel;
/// Types, traits and rules: envelopes, keys, handlers, retry policies, decisions, the
/// in-process transport (the `inbox-core` crate).
#[doc(inline)]
pub use inbox_core as core_types;
/// The store on PostgreSQL and SQLite: claims, dead letters, the outbox, rebuilds,
/// idempotency keys, retention (the `inbox-diesel` crate).
#[doc(inline)]
pub use inbox_diesel as store;

/// The RabbitMQ transport: topology, the consumer, the outbox relay (the `inbox-amqp`
/// crate).
#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
#[doc(inline)]
pub use inbox_amqp as amqp;

/// The operator commands, to mount in your own binary (the `inbox-cli` crate).
#[cfg(feature = "cli")]
#[cfg_attr(docsrs, doc(cfg(feature = "cli")))]
#[doc(inline)]
pub use inbox_cli as cli;

/// The operator web console, to mount in your service (the `inbox-web` crate).
#[cfg(feature = "web")]
#[cfg_attr(docsrs, doc(cfg(feature = "web")))]
#[doc(inline)]
pub use inbox_web as web;

/// What most applications use, in one `use inbox_outbox::prelude::*;`.
pub mod prelude {
    #[cfg(feature = "derive")]
    pub use crate::Handler;
    #[cfg(not(feature = "derive"))]
    pub use inbox_core::Handler;
    pub use inbox_core::{
        ClaimKey, ConsumerGroup, Envelope, HandlerError, InProcessTransport, MessageContext,
        MessageKey, OutboxMessage, RetryPolicy,
    };
    pub use inbox_diesel::{enqueue, Store, StoreBuilder};

    #[cfg(feature = "amqp")]
    pub use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, Relay, Topology};
}

// The trait from its own path and the facade's derive under the same name, as
// `inbox_core::Handler` brings the trait and inbox-core's derive.
#[cfg(feature = "derive")]
#[doc(inline)]
pub use inbox_core::handler_trait::Handler;
#[cfg(not(feature = "derive"))]
pub use inbox_core::Handler;
/// `#[derive(Handler)]`: implements the [`Handler`](trait@Handler) trait from an
/// `#[inbox(...)]` attribute; see `inbox_macros::Handler` for the attributes.
#[cfg(feature = "derive")]
pub use inbox_macros::FacadeHandler as Handler;

/// The guide `docs/service.md`, whose blocks compile against this crate alone (with
/// its features `cli` and `rebuild`; the guide's own `Cargo.toml` adds clap, serde and
/// serde_json).
#[cfg(all(doctest, feature = "cli", feature = "rebuild"))]
#[doc = include_str!("../../docs/service.md")]
mod service_guide {}

/// What the derive's generated code names; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use inbox_core;
}
