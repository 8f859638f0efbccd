use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};

use crate::MessageKey;

/// One message as a transport delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The message's identity.
    pub message_key: MessageKey,
    /// The type string handlers are chosen by (AMQP `type`, routing key).
    pub message_type: String,
    /// The body, usually JSON.
    pub payload: Vec<u8>,
    /// Transport headers, kept with dead letters.
    pub headers: BTreeMap<String, String>,
    /// The tenant, recorded with the claim; never part of the claim key.
    pub tenant: Option<String>,
    /// When the producer says the event happened.
    pub occurred_at: Option<DateTime<Utc>>,
    /// Transport hint: the broker has delivered this message before.
    pub redelivered: bool,
    /// Transport hint: the broker's delivery count, if it keeps one.
    pub delivery_count: Option<u32>,
}

impl Envelope {
    /// A first delivery with no headers, tenant or timestamp.
    ///
    /// ```
    /// use inbox_core::{Envelope, MessageKey};
    /// let key = MessageKey::new("evt-1")?;
    /// let env = Envelope::new(key, "usage.recorded", br#"{"amount":40}"#.to_vec());
    /// assert!(!env.redelivered);
    /// # Ok::<(), inbox_core::Error>(())
    /// ```
    pub fn new(message_key: MessageKey, message_type: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            message_key,
            message_type: message_type.into(),
            payload,
            headers: BTreeMap::new(),
            tenant: None,
            occurred_at: None,
            redelivered: false,
            delivery_count: None,
        }
    }

    /// Sets the tenant.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Marks the envelope as a redelivery.
    pub fn redelivered(mut self) -> Self {
        self.redelivered = true;
        self
    }

    /// SHA-256 of the payload: the same key with another digest is a key collision.
    pub fn payload_digest(&self) -> [u8; 32] {
        payload_digest(&self.payload)
    }
}

/// SHA-256 of a payload, as stored in the claim table.
pub fn payload_digest(payload: &[u8]) -> [u8; 32] {
    Sha256::digest(payload).into()
}
