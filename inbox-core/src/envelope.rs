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
    /// Set when `payload` is only the first [`CUT_PAYLOAD_PREFIX`] bytes of a body the
    /// transport refused as too large: the whole body's length and SHA-256. Only a
    /// dead letter (`malformed`) carries a cut payload; no handler sees one.
    pub payload_cut: Option<PayloadCut>,
}

/// How many bytes of a body over the transport's limit a dead letter keeps (4 KiB):
/// enough to tell what it was, never the body itself.
pub const CUT_PAYLOAD_PREFIX: usize = 4096;

/// What is kept of a body that was cut to its first [`CUT_PAYLOAD_PREFIX`] bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadCut {
    /// The whole body's length in bytes.
    pub length: u64,
    /// SHA-256 of the whole body.
    pub sha256: [u8; 32],
}

impl PayloadCut {
    /// The first [`CUT_PAYLOAD_PREFIX`] bytes of `body` (copied: the body itself is
    /// never cloned) and what is kept of the whole.
    ///
    /// ```
    /// use inbox_core::{PayloadCut, CUT_PAYLOAD_PREFIX};
    /// let body = vec![7u8; 10 * CUT_PAYLOAD_PREFIX];
    /// let (prefix, cut) = PayloadCut::of(&body);
    /// assert_eq!(prefix.len(), CUT_PAYLOAD_PREFIX);
    /// assert_eq!(cut.length, body.len() as u64);
    /// ```
    pub fn of(body: &[u8]) -> (Vec<u8>, Self) {
        Self::with_digest(body, payload_digest(body))
    }

    /// [`PayloadCut::of`] with the body's SHA-256 computed already.
    pub fn with_digest(body: &[u8], sha256: [u8; 32]) -> (Vec<u8>, Self) {
        let prefix = body[..body.len().min(CUT_PAYLOAD_PREFIX)].to_vec();
        let cut = Self {
            length: body.len() as u64,
            sha256,
        };
        (prefix, cut)
    }
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
            payload_cut: None,
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
