use std::fmt;

use uuid::Uuid;

use crate::names;

/// Root namespace of derived message keys (a fixed UUIDv5 of this crate's name).
const KEY_ROOT: Uuid = Uuid::from_u128(0x6c0f_5b1e_8d3a_5f4e_9b7a_1c2d_3e4f_5a6b);

/// A message key or consumer group name that breaks its rules (the rules are the
/// `inbox-names` crate's, shared with the derive), with what was wrong with it.
///
/// Its own type, not [`Error`](crate::Error): a name is checked before anything else
/// of the crate runs. `?` turns it into [`Error::InvalidName`](crate::Error::InvalidName).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidName {
    /// A message key is empty, longer than 255 bytes or holds a NUL byte.
    #[error("invalid message key: {0}")]
    MessageKey(String),
    /// A consumer group name breaks the name rules.
    #[error("invalid consumer group: {0}")]
    ConsumerGroup(String),
}

/// The identity of a message: what makes two deliveries "the same message".
///
/// 1 to 255 bytes. Derive it from the object that produced the message with
/// [`MessageKey::derive`] so that a retried producer transaction yields the same key.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageKey(String);

impl MessageKey {
    /// Wraps an existing key, checking its length (1 to 255 bytes).
    ///
    /// ```
    /// use inbox_core::MessageKey;
    /// assert!(MessageKey::new("order-17:paid").is_ok());
    /// assert!(MessageKey::new("").is_err());
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidName> {
        let key = key.into();
        names::check_message_key(&key).map_err(InvalidName::MessageKey)?;
        Ok(Self(key))
    }

    /// Derives a key as the UUIDv5 of (namespace, object id, event kind).
    ///
    /// The same three inputs always give the same key, so a producer that retries
    /// its transaction emits a message the inbox recognises as a duplicate. The parts
    /// are length-prefixed, so `("a:b", "c")` and `("a", "b:c")` never collide, and a
    /// different namespace (a tenant, a service) never collides with another.
    ///
    /// The object id must never name two objects. An id drawn from a database
    /// sequence (`BIGSERIAL`) can: a failover to an asynchronous standby loses the
    /// last committed transactions together with the sequence's advance, and the
    /// next object gets a lost object's id. If the lost object's message had already
    /// left, the new object's message has its key and is dropped as a duplicate. On
    /// such a database derive from an identity that does not come round again (a
    /// random UUID column, a business key), or keep commits on a synchronous standby
    /// (docs/postgres-failover.md).
    ///
    /// ```
    /// use inbox_core::MessageKey;
    /// let a = MessageKey::derive("billing", "usage-event-981", "usage.recorded");
    /// let b = MessageKey::derive("billing", "usage-event-981", "usage.recorded");
    /// assert_eq!(a, b);
    /// assert_ne!(a, MessageKey::derive("billing", "usage-event-982", "usage.recorded"));
    /// ```
    pub fn derive(namespace: &str, object_id: &str, event_kind: &str) -> Self {
        let ns = Uuid::new_v5(&KEY_ROOT, namespace.as_bytes());
        let mut name = Vec::with_capacity(object_id.len() + event_kind.len() + 16);
        for part in [object_id, event_kind] {
            name.extend_from_slice(&(part.len() as u64).to_be_bytes());
            name.extend_from_slice(part.as_bytes());
        }
        Self(Uuid::new_v5(&ns, &name).to_string())
    }

    /// The key as stored in the claim table.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for MessageKey {
    type Error = InvalidName;
    fn try_from(value: &str) -> Result<Self, InvalidName> {
        Self::new(value)
    }
}

/// One logical consumer, for example `billing.daily-usage`.
///
/// `[a-z0-9._-]`, 1 to 100 bytes. The alphabet leaves out `:`, which transports use
/// to name a group's retry tiers and dead-letter queue, so no group's name can be
/// another group's tier.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsumerGroup(String);

impl ConsumerGroup {
    /// Validates and wraps a group name.
    ///
    /// ```
    /// use inbox_core::ConsumerGroup;
    /// assert!(ConsumerGroup::new("billing.daily-usage").is_ok());
    /// assert!(ConsumerGroup::new("Billing").is_err());
    /// assert!(ConsumerGroup::new("billing:retry").is_err());
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidName> {
        let name = name.into();
        names::check_group_name(&name).map_err(InvalidName::ConsumerGroup)?;
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ConsumerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for ConsumerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for ConsumerGroup {
    type Error = InvalidName;
    fn try_from(value: &str) -> Result<Self, InvalidName> {
        Self::new(value)
    }
}

/// The claim's identity: (consumer group, message key).
///
/// This is the only key a store uses to insert, look up, update or dead-letter a
/// claim, on every path, and exactly what the claim table's unique index enforces.
/// The tenant is deliberately not part of it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimKey {
    /// The consumer group.
    pub group: ConsumerGroup,
    /// The message key.
    pub key: MessageKey,
}

impl ClaimKey {
    /// Builds a claim key.
    pub fn new(group: ConsumerGroup, key: MessageKey) -> Self {
        Self { group, key }
    }

    /// The names of the claim table's key columns, in index order.
    pub const COLUMNS: [&'static str; 2] = ["consumer_group", "message_key"];
}

impl fmt::Display for ClaimKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.group, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_nul_byte() {
        assert!(matches!(
            MessageKey::new("order\0-17"),
            Err(InvalidName::MessageKey(msg)) if msg.contains("NUL byte")
        ));
    }

    #[test]
    fn key_length_bounds() {
        assert!(MessageKey::new("k").is_ok());
        assert!(MessageKey::new("k".repeat(255)).is_ok());
        let err = MessageKey::new("k".repeat(256)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid message key: message key must be at most 255 bytes, found 256 bytes"
        );
        assert!(MessageKey::new("").is_err());
    }

    #[test]
    fn derived_keys_are_stable_and_separated() {
        let a = MessageKey::derive("tenant-a", "obj-1", "created");
        assert_eq!(a, MessageKey::derive("tenant-a", "obj-1", "created"));
        assert_ne!(a, MessageKey::derive("tenant-b", "obj-1", "created"));
        assert_ne!(a, MessageKey::derive("tenant-a", "obj-1", "deleted"));
        // Length prefixes keep part boundaries apart.
        assert_ne!(
            MessageKey::derive("n", "a:b", "c"),
            MessageKey::derive("n", "a", "b:c")
        );
        assert_eq!(a.as_str().len(), 36);
        assert!(MessageKey::new(a.as_str()).is_ok());
    }

    #[test]
    fn group_names() {
        for ok in ["a", "billing.daily-usage", "x_1", &"a".repeat(100)] {
            assert!(ConsumerGroup::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "A", "a b", "a:retry", "ü", &"a".repeat(101)] {
            assert!(ConsumerGroup::new(bad).is_err(), "{bad}");
        }
    }
}
