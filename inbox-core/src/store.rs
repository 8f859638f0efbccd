use std::sync::Arc;

use crate::{ClaimInvariantViolated, ConsumerGroup, DeadLetterReason, Decision, Envelope, Result};

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

    /// How long a transport waits for [`InboxStore::process_batch`] before it
    /// abandons the batch (acks nothing, hands the deliveries back so they come back
    /// redelivered); `None`, the default, waits as long as it takes.
    fn batch_deadline(&self) -> Option<std::time::Duration> {
        None
    }

    /// Records a dead letter for a delivery that never reached a handler: one the
    /// transport could not read (`Malformed`, under a key the transport made up; no
    /// claim is touched) or one the broker gave up on (`DeliveryLimit`: the claim is
    /// marked `dead` in the same transaction, unless its effect already happened).
    fn dead_letter(
        &self,
        group: &ConsumerGroup,
        envelope: &Envelope,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Result<DeadLetterOutcome>;
}

/// What [`InboxStore::dead_letter`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterOutcome {
    /// A dead-letter row was written (and the claim marked dead, if it has one).
    Recorded,
    /// The message's effect already committed: nothing to dead-letter.
    AlreadyDone,
    /// The message was dead-lettered before.
    AlreadyDead,
}

impl<S: InboxStore + ?Sized> InboxStore for Arc<S> {
    fn process_batch(&self, group: &ConsumerGroup, batch: &[Envelope]) -> Result<Vec<Decision>> {
        (**self).process_batch(group, batch)
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        (**self).routes()
    }

    fn batch_deadline(&self) -> Option<std::time::Duration> {
        (**self).batch_deadline()
    }

    fn dead_letter(
        &self,
        group: &ConsumerGroup,
        envelope: &Envelope,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Result<DeadLetterOutcome> {
        (**self).dead_letter(group, envelope, reason, detail)
    }
}

/// Where a store keeps its consumer groups' halts, so that a halt outlives the process
/// that saw it and an operator can lift it.
///
/// A transport that halts a group on [`Decision::Stop`] records the halt here, starts
/// a group halted while its halt is recorded, and resumes a group once its halt is no
/// longer recorded (an operator resumed it). There is no default: a store either keeps
/// halts or is not one of these.
pub trait GroupHalts: Send + Sync + 'static {
    /// Records that `cause.group` halted because of `cause`. A group halted already
    /// keeps its first record (the first cause is the one to fix).
    fn record_halt(&self, cause: &ClaimInvariantViolated) -> Result<()>;

    /// Every group halted now, each with the cause it was recorded with.
    fn halted_groups(&self) -> Result<Vec<ClaimInvariantViolated>>;
}

impl<S: GroupHalts + ?Sized> GroupHalts for Arc<S> {
    fn record_halt(&self, cause: &ClaimInvariantViolated) -> Result<()> {
        (**self).record_halt(cause)
    }

    fn halted_groups(&self) -> Result<Vec<ClaimInvariantViolated>> {
        (**self).halted_groups()
    }
}
