//! The channel a worker publishes its retry copies on: its own, apart from the one
//! it consumes on, opened when a batch first needs it and replaced after a nack.
//!
//! A channel that published while a quorum queue had no leader (its leader's node
//! killed) can go on being nacked for every publish after the queue has a new
//! leader, while a new channel is acked at once (RabbitMQ 3.10; the relay's side of
//! it is `outbox_publisher::AmqpPublisher::replace_channel`). Copies published on
//! the consuming channel could only get a new one by ending the consumer, every
//! delivery it holds redelivered. On a channel of their own, a batch with a copy not
//! confirmed closes it, and the next batch's copies go on a fresh one; the originals
//! of the refused copies are requeued after a pause, as before.

use std::sync::Arc;

use lapin::{Channel, Connection};

use crate::connect::close_channel;
use crate::publish::confirm_channel;

/// A worker's channel for retry copies, in confirm mode; none until needed.
pub(super) struct Copies {
    conn: Arc<Connection>,
    channel: Option<Channel>,
}

impl Copies {
    /// No channel yet: the first batch with a copy opens one on `conn`.
    pub(super) fn new(conn: Arc<Connection>) -> Self {
        Self {
            conn,
            channel: None,
        }
    }

    /// The channel, a fresh one when there is none or the last one closed.
    pub(super) async fn channel(&mut self) -> lapin::Result<&Channel> {
        // Closed under us (the broker closed it, or the connection failed).
        if self
            .channel
            .as_ref()
            .is_some_and(|c| !c.status().connected())
        {
            self.channel = None;
        }
        match &mut self.channel {
            Some(channel) => Ok(channel),
            slot @ None => Ok(slot.insert(confirm_channel(&self.conn).await?)),
        }
    }

    /// Closes the channel after a copy it published was not confirmed: the next
    /// batch's copies go on a fresh one.
    pub(super) async fn replace(&mut self) {
        if let Some(channel) = self.channel.take() {
            close_channel(&channel, "a retry copy was not confirmed; replaced").await;
        }
    }

    /// Closes the channel when its worker stops.
    pub(super) async fn close(&mut self) {
        if let Some(channel) = self.channel.take() {
            close_channel(&channel, "inbox worker stopping").await;
        }
    }
}
