//! Publishing with a publisher confirm: the one way the consumer (retry copies) and
//! the relay (outbox rows) put a message on the broker.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation, PublisherConfirm};

/// How the broker answered a confirmed publication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Confirmed {
    /// Routed to at least one queue and confirmed.
    Ack,
    /// The broker nacked it.
    Nack,
    /// Returned as unroutable (`mandatory`): no queue took it.
    Returned,
}

impl Confirmed {
    fn of(confirmation: Confirmation) -> Self {
        if confirmation.is_nack() {
            Self::Nack
        } else if confirmation.take_message().is_some() {
            Self::Returned
        } else {
            Self::Ack
        }
    }
}

/// A publication sent and not yet confirmed.
pub(crate) struct Pending(PublisherConfirm);

impl Pending {
    /// Waits for the broker's answer. `Err` when the channel closed first.
    pub(crate) async fn answer(self) -> lapin::Result<Confirmed> {
        self.0.await.map(Confirmed::of)
    }
}

/// Publishes `body` to `exchange` with `routing_key`, `mandatory` (an unroutable
/// message comes back as [`Confirmed::Returned`]), on a channel in confirm mode.
/// Several may be sent before their answers are awaited.
pub(crate) async fn publish_with_confirm(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> lapin::Result<Pending> {
    channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await
        .map(Pending)
}
