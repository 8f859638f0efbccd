//! How a replayed dead letter is addressed: to one consumer group alone.
//!
//! A replay keeps the original message key (a new key would be a new claim, and the
//! message would be applied twice), so it must not reach the groups that applied the
//! message already: it is published through the default exchange (`""`) straight to
//! the group's own queue, never to the topic exchange. The in-process transport has no
//! queues: it reads the group from [`REPLAY_GROUP_HEADER`].

use crate::{ConsumerGroup, OutboxMessage};

/// The header naming the one consumer group a replayed message is for.
pub const REPLAY_GROUP_HEADER: &str = "inbox-replay-group";

/// The header carrying a replay's sequence number (1 for the first replay of a key,
/// 2 for the next, ...). A message dead-lettered again after a replay keeps it in its
/// dead letter's headers.
pub const REPLAY_SEQUENCE_HEADER: &str = "inbox-replay-sequence";

/// The consumer group a message is addressed to alone, if it is a replay: published to
/// the default exchange with a valid [`REPLAY_GROUP_HEADER`].
///
/// ```
/// use inbox_core::{replay_target, MessageKey, OutboxMessage, REPLAY_GROUP_HEADER};
/// let key = MessageKey::new("k-1").unwrap();
/// let mut msg = OutboxMessage::new(key, "", "usage.recorded", b"{}".to_vec())
///     .with_routing_key("billing.daily-usage");
/// assert_eq!(replay_target(&msg), None);
/// msg.headers.insert(REPLAY_GROUP_HEADER.to_owned(), "billing.daily-usage".to_owned());
/// assert_eq!(replay_target(&msg).unwrap().as_str(), "billing.daily-usage");
/// ```
pub fn replay_target(message: &OutboxMessage) -> Option<ConsumerGroup> {
    if !message.exchange.is_empty() {
        return None;
    }
    let group = message.headers.get(REPLAY_GROUP_HEADER)?;
    ConsumerGroup::new(group.as_str()).ok()
}
