use std::sync::Arc;

use crate::{ConsumerGroup, Decision, Envelope, Result};

/// A store that decides, per delivery, what a transport must do.
///
/// Transports (the in-process one here, the AMQP one in `inbox-amqp`) are generic over
/// this trait: they receive deliveries, hand a batch of one consumer group's
/// deliveries to [`InboxStore::process_batch`] (on a blocking thread when they are
/// async), and carry out the returned decisions. They never re-implement batch, retry
/// or dead-letter rules.
pub trait InboxStore: Send + Sync + 'static {
    /// Processes one consumer group's batch in one transaction and returns exactly one
    /// decision per delivery, in order.
    ///
    /// An `Err` means nothing was committed: the transport must not ack any of the
    /// batch (everything comes back).
    fn process_batch(&self, group: &ConsumerGroup, batch: &[Envelope]) -> Result<Vec<Decision>>;

    /// Every (group, message type) a registered handler takes.
    fn routes(&self) -> Vec<(ConsumerGroup, String)>;
}

impl<S: InboxStore + ?Sized> InboxStore for Arc<S> {
    fn process_batch(&self, group: &ConsumerGroup, batch: &[Envelope]) -> Result<Vec<Decision>> {
        (**self).process_batch(group, batch)
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        (**self).routes()
    }
}
