//! Idempotency keys for requests: what a replayed request is answered, decided from
//! the stored record, and the fingerprint that proves a replay is the same request.
//!
//! A request carries an idempotency key, chosen by the client, unique per caller (an
//! account: one key means one request across all of the account's credentials). The
//! store keeps one record per (caller, key): its [`Fingerprint`], a state
//! ([`IdempotencyStatus`]), a lease with a fencing token, whether the request's
//! effect (a debit) committed, and, once delivered, the saved response.
//!
//! The fingerprint is an HMAC-SHA-256 over a canonical encoding of the request's
//! fields ([`RequestFields`]), keyed by a secret the store never holds (a metered API
//! uses the caller's raw API key). The database alone therefore cannot tell what was
//! sent, and the same request sent with another credential does not match.
//!
//! ```
//! use inbox_core::idempotency::{IdempotencyKey, RequestFields};
//!
//! let key = IdempotencyKey::new("order-17-attempt")?;
//! let fields = RequestFields::new()
//!     .field("text", "hello")?
//!     .field("model", "standard")?;
//! let first = fields.fingerprint(b"sk_live_secret");
//! assert_eq!(first, fields.fingerprint(b"sk_live_secret"));
//! assert_ne!(first, fields.fingerprint(b"sk_live_other"));
//! # let _ = key;
//! # Ok::<(), inbox_core::Error>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::Error;

/// The longest idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// What [`Error::InvalidIdempotencyKey`] expects of a key's length; kept in step with
/// [`MAX_IDEMPOTENCY_KEY_LEN`] by the assertion below.
const KEY_LENGTHS: &str = "1 to 255 bytes";
const _: () = assert!(MAX_IDEMPOTENCY_KEY_LEN == 255);

/// How long idempotency records are kept by default (24 hours): a replay arriving
/// later executes as a new request.
pub const DEFAULT_IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The domain separation prefix of the canonical encoding (its version).
const ENCODING_TAG: &[u8] = b"inbox-idempotency-fields-v1\0";

/// A client's idempotency key: 1 to 255 bytes of printable ASCII (`0x20` to `0x7e`),
/// as the value of an `Idempotency-Key` header can carry it.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Checks and wraps a key.
    ///
    /// ```
    /// use inbox_core::idempotency::IdempotencyKey;
    /// assert!(IdempotencyKey::new("a3f1-retry").is_ok());
    /// assert!(IdempotencyKey::new("").is_err());
    /// assert!(IdempotencyKey::new("x".repeat(256)).is_err());
    /// assert!(IdempotencyKey::new("tab\there").is_err());
    /// ```
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(Error::InvalidIdempotencyKey {
                expected: KEY_LENGTHS,
                found: format!("{} bytes", key.len()),
            });
        }
        if let Some(bad) = key.bytes().find(|b| !(0x20..=0x7e).contains(b)) {
            return Err(Error::InvalidIdempotencyKey {
                expected: "printable ASCII",
                found: format!("byte 0x{bad:02x}"),
            });
        }
        Ok(Self(key))
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An HMAC-SHA-256 of a request's canonical fields: 32 bytes.
///
/// Compared in constant time: the comparison takes as long whichever byte differs.
#[derive(Clone, Copy, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The length of a fingerprint in bytes.
    pub const LEN: usize = 32;

    /// A fingerprint read back from storage; `None` unless it is 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }

    /// The bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl PartialEq for Fingerprint {
    /// `subtle`'s constant-time equality: no early exit at the first differing byte.
    fn eq(&self, other: &Self) -> bool {
        bool::from(self.0[..].ct_eq(&other.0[..]))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A prefix is enough to tell two apart in a log.
        write!(f, "Fingerprint(")?;
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The fencing token of a lease on an idempotency key: 16 random bytes, new at every
/// begin and every take-over.
///
/// A token never repeats for a key: not after the record is abandoned and begun
/// again, not after a purge, not after a database failover that rolls rows back
/// together with any sequence. A counter would (token 1 of a deleted record is token
/// 1 of the next one, and a late write of the first request would land on the
/// second's record); a random value does not, so a token names one lease of one
/// record, and a write fenced by it reaches that record or none. It is drawn from the
/// operating system's generator (a version 4 UUID: 122 random bits).
///
/// `Display` and `FromStr` give 32 lower-case hex digits, for logs and for callers
/// that carry a token between processes.
///
/// ```
/// use inbox_core::idempotency::LeaseToken;
///
/// let token = LeaseToken::random();
/// assert_ne!(token, LeaseToken::random());
/// let text = token.to_string();
/// assert_eq!(text.len(), 32);
/// assert_eq!(text.parse::<LeaseToken>()?, token);
/// assert_eq!(LeaseToken::from_slice(token.as_bytes()), Some(token));
/// # Ok::<(), inbox_core::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken([u8; 16]);

impl LeaseToken {
    /// The length of a token in bytes.
    pub const LEN: usize = 16;

    /// A new token, never handed out before.
    pub fn random() -> Self {
        Self(uuid::Uuid::new_v4().into_bytes())
    }

    /// A token from its bytes (as stored or sent).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// A token read back from storage; `None` unless it is 16 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 16]>::try_from(bytes).ok().map(Self)
    }

    /// The bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({self})")
    }
}

impl FromStr for LeaseToken {
    type Err = Error;

    /// 32 hex digits, either case.
    fn from_str(s: &str) -> Result<Self, Error> {
        let invalid = || Error::InvalidLeaseToken {
            expected: "32 hex digits",
            found: format!("{} bytes", s.len()),
        };
        if s.len() != 2 * Self::LEN || !s.is_ascii() {
            return Err(invalid());
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| {
                Error::InvalidLeaseToken {
                    expected: "32 hex digits",
                    found: format!("{:?} at byte {}", &s[2 * i..2 * i + 2], 2 * i),
                }
            })?;
        }
        Ok(Self(bytes))
    }
}

/// The fields of a request that make it "the same request", by name.
///
/// The canonical encoding sorts the fields by name and length-prefixes every name
/// and value, so no two different field sets encode alike (`("a", "bc")` and
/// `("ab", "c")` differ), and the order in which they were added does not matter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestFields {
    fields: BTreeMap<String, Vec<u8>>,
}

impl RequestFields {
    /// No fields yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a field; a name given twice is refused.
    pub fn field(mut self, name: &str, value: impl AsRef<[u8]>) -> Result<Self, Error> {
        if self.fields.contains_key(name) {
            return Err(Error::InvalidRequestFields {
                expected: "each field name once",
                found: format!("field {name:?} twice"),
            });
        }
        self.fields.insert(name.to_owned(), value.as_ref().to_vec());
        Ok(self)
    }

    /// The canonical encoding: a version tag, then per field in name order the
    /// name's length (u32, big-endian), the name, the value's length (u64,
    /// big-endian) and the value.
    pub fn canonical_encoding(&self) -> Vec<u8> {
        let size: usize = self
            .fields
            .iter()
            .map(|(k, v)| 12 + k.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(ENCODING_TAG.len() + size);
        out.extend_from_slice(ENCODING_TAG);
        for (name, value) in &self.fields {
            out.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u64).to_be_bytes());
            out.extend_from_slice(value);
        }
        out
    }

    /// The HMAC-SHA-256 of the canonical encoding keyed by `secret` (the caller's raw
    /// credential, which the store never sees).
    pub fn fingerprint(&self, secret: &[u8]) -> Fingerprint {
        // HMAC takes a key of any length (a longer one is hashed first).
        let Ok(mut mac) = <Hmac<Sha256> as Mac>::new_from_slice(secret) else {
            unreachable!("HMAC accepts keys of every length")
        };
        mac.update(&self.canonical_encoding());
        Fingerprint(mac.finalize().into_bytes().into())
    }
}

/// The state of an idempotency record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyStatus {
    /// The request runs (or died): replays answer 409 `idempotency_in_flight`.
    InFlight,
    /// The response was delivered and saved: replays get it again, free.
    Delivered,
    /// The request's effect was compensated (refunded): replays answer 409
    /// `idempotency_refunded`.
    Refunded,
}

impl IdempotencyStatus {
    /// The status as stored.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Delivered => "delivered",
            Self::Refunded => "refunded",
        }
    }

    /// The status from its stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "in_flight" => Self::InFlight,
            "delivered" => Self::Delivered,
            "refunded" => Self::Refunded,
            _ => return None,
        })
    }
}

/// One stored idempotency record.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdempotencyRecord {
    /// Whose key it is (an account).
    pub caller: String,
    /// The client's key.
    pub key: String,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The state.
    pub status: IdempotencyStatus,
    /// The fencing token of the lease: a new random one at every begin and take-over,
    /// so the writes of a request whose lease was taken over, or whose record was
    /// deleted and begun again, are refused.
    pub lease_token: LeaseToken,
    /// Until when the lease protects a request whose effect has not committed.
    pub lease_until: DateTime<Utc>,
    /// When the request's effect (its debit) committed: from then on the key is never
    /// executed again, whatever the lease says.
    pub committed_at: Option<DateTime<Utc>>,
    /// The saved response (the complete body delivered), once delivered.
    pub response: Option<Vec<u8>>,
    /// When the key was first used.
    pub created_at: DateTime<Utc>,
    /// When the record last changed.
    pub updated_at: DateTime<Utc>,
}

impl IdempotencyRecord {
    /// A record of (caller, key) in `status`, its lease, commit and times not set
    /// (a token of zero bytes, times at the epoch): for a store reading its rows, and
    /// for tests.
    pub fn from_parts(
        caller: &str,
        key: &str,
        fingerprint: Fingerprint,
        status: IdempotencyStatus,
    ) -> Self {
        Self {
            caller: caller.to_owned(),
            key: key.to_owned(),
            fingerprint,
            status,
            lease_token: LeaseToken([0; 16]),
            lease_until: DateTime::UNIX_EPOCH,
            committed_at: None,
            response: None,
            created_at: DateTime::UNIX_EPOCH,
            updated_at: DateTime::UNIX_EPOCH,
        }
    }
}

/// What to do with a request that carries an idempotency key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdempotencyAnswer {
    /// The key is this request's: execute it, fencing every later write with `token`.
    Execute {
        /// The lease's fencing token.
        token: LeaseToken,
    },
    /// Another request with this key runs, or committed its effect and is not settled
    /// yet: 409 `idempotency_in_flight`.
    InFlight,
    /// The key was used for another request (another fingerprint): 422
    /// `idempotency_mismatch`.
    Mismatch,
    /// The request was delivered: answer with the saved response, charge nothing.
    Replay {
        /// The complete body delivered the first time.
        response: Vec<u8>,
    },
    /// The request's effect was refunded: 409 `idempotency_refunded`.
    Refunded,
}

impl IdempotencyAnswer {
    /// The machine-readable error code of a refusal, `None` for execute and replay.
    pub fn error_code(&self) -> Option<&'static str> {
        match self {
            Self::InFlight => Some("idempotency_in_flight"),
            Self::Mismatch => Some("idempotency_mismatch"),
            Self::Refunded => Some("idempotency_refunded"),
            Self::Execute { .. } | Self::Replay { .. } => None,
        }
    }
}

/// How a stored record answers a request with `fingerprint` at `now`, when the key
/// was not free (the store's conditional insert or take-over did not give it).
///
/// The fingerprint is compared first: another request under a used key is a
/// mismatch whatever the state. Then: delivered replays the saved response (a
/// delivered record without one is [`Judgement::Corrupt`]), refunded refuses, and in
/// flight refuses unless the lease has expired *and* the effect never committed:
/// only then may the key be taken over ([`Judgement::TakeOver`]). A committed request
/// is never executed again; it is in flight until it is settled.
pub fn judge(
    record: &IdempotencyRecord,
    fingerprint: &Fingerprint,
    now: DateTime<Utc>,
) -> Judgement {
    if record.fingerprint != *fingerprint {
        return Judgement::Answer(IdempotencyAnswer::Mismatch);
    }
    match record.status {
        IdempotencyStatus::Delivered => match &record.response {
            Some(response) => Judgement::Answer(IdempotencyAnswer::Replay {
                response: response.clone(),
            }),
            None => Judgement::Corrupt("a delivered record holds no response"),
        },
        IdempotencyStatus::Refunded => Judgement::Answer(IdempotencyAnswer::Refunded),
        IdempotencyStatus::InFlight => {
            if record.committed_at.is_none() && record.lease_until <= now {
                Judgement::TakeOver {
                    token: record.lease_token,
                }
            } else {
                Judgement::Answer(IdempotencyAnswer::InFlight)
            }
        }
    }
}

/// The outcome of [`judge`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Judgement {
    /// Answer the request so.
    Answer(IdempotencyAnswer),
    /// The lease of a request that died before its effect committed has expired: the
    /// key may be taken over from the lease with this token.
    TakeOver {
        /// The expired lease's token.
        token: LeaseToken,
    },
    /// The record breaks an invariant of the store.
    Corrupt(&'static str),
}

/// How a request that executed is settled.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement {
    /// Delivered: the complete response, saved for replays.
    Delivered {
        /// The body delivered.
        response: Vec<u8>,
    },
    /// Compensated: replays are refused.
    Refunded,
}

impl Settlement {
    /// The state it leaves the record in.
    pub fn status(&self) -> IdempotencyStatus {
        match self {
            Self::Delivered { .. } => IdempotencyStatus::Delivered,
            Self::Refunded => IdempotencyStatus::Refunded,
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;

    use super::*;

    fn fields(text: &str) -> RequestFields {
        RequestFields::new()
            .field("text", text)
            .and_then(|f| f.field("model", "standard"))
            .expect("fields")
    }

    fn record(status: IdempotencyStatus, committed: bool, lease_in_secs: i64) -> IdempotencyRecord {
        let now = DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time");
        IdempotencyRecord {
            caller: "7".into(),
            key: "k".into(),
            fingerprint: fields("hello").fingerprint(b"secret"),
            status,
            lease_token: LeaseToken([3; 16]),
            lease_until: now + TimeDelta::seconds(lease_in_secs),
            committed_at: committed.then_some(now),
            response: (status == IdempotencyStatus::Delivered).then(|| b"body".to_vec()),
            created_at: now,
            updated_at: now,
        }
    }

    fn at() -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp(1_800_000_000, 0).expect("time")
    }

    #[test]
    fn the_fingerprint_is_an_hmac_sha256_of_the_canonical_encoding() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mac = <Hmac<Sha256> as Mac>::new_from_slice(b"Jefe")
            .map(|mut m| {
                m.update(b"what do ya want for nothing?");
                m.finalize().into_bytes()
            })
            .expect("hmac");
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let f = fields("hello");
        let mut direct = <Hmac<Sha256> as Mac>::new_from_slice(b"k").expect("hmac");
        direct.update(&f.canonical_encoding());
        let direct: [u8; 32] = direct.finalize().into_bytes().into();
        assert_eq!(f.fingerprint(b"k").as_bytes(), &direct);
    }

    #[test]
    fn the_encoding_is_canonical_and_unambiguous() {
        let a = RequestFields::new()
            .field("model", "m")
            .and_then(|f| f.field("text", "t"))
            .expect("fields");
        let b = RequestFields::new()
            .field("text", "t")
            .and_then(|f| f.field("model", "m"))
            .expect("fields");
        assert_eq!(a.canonical_encoding(), b.canonical_encoding());
        let split1 = RequestFields::new().field("a", "bc").expect("fields");
        let split2 = RequestFields::new().field("ab", "c").expect("fields");
        assert_ne!(split1.canonical_encoding(), split2.canonical_encoding());
        let empty = RequestFields::new().field("a", "").expect("fields");
        assert_ne!(
            empty.canonical_encoding(),
            RequestFields::new().canonical_encoding()
        );
        assert!(RequestFields::new()
            .field("a", "1")
            .and_then(|f| f.field("a", "2"))
            .is_err());
    }

    #[test]
    fn fingerprints_that_differ_in_any_one_byte_are_not_equal() {
        let fp = fields("hello").fingerprint(b"secret");
        for i in 0..Fingerprint::LEN {
            let mut bytes = *fp.as_bytes();
            bytes[i] ^= 0x80;
            assert_ne!(Fingerprint::from_slice(&bytes), Some(fp), "byte {i}");
        }
        assert_eq!(Fingerprint::from_slice(fp.as_bytes()), Some(fp));
    }

    #[test]
    fn another_secret_or_other_fields_give_another_fingerprint() {
        let f = fields("hello");
        assert_eq!(f.fingerprint(b"one"), f.fingerprint(b"one"));
        assert_ne!(f.fingerprint(b"one"), f.fingerprint(b"two"));
        assert_ne!(f.fingerprint(b"one"), fields("hellO").fingerprint(b"one"));
        let fp = f.fingerprint(b"one");
        assert_eq!(Fingerprint::from_slice(fp.as_bytes()), Some(fp));
        assert_eq!(Fingerprint::from_slice(&[0; 31]), None);
    }

    #[test]
    fn keys_are_one_to_255_printable_bytes() {
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert!(IdempotencyKey::new("x".repeat(256)).is_err());
        assert!(IdempotencyKey::new("").is_err());
        assert!(IdempotencyKey::new("a\0b").is_err());
        assert!(IdempotencyKey::new("é").is_err());
        assert!(IdempotencyKey::new(" spaced key ~").is_ok());
    }

    #[test]
    fn a_replay_with_other_content_is_a_mismatch_whatever_the_state() {
        let other = fields("other").fingerprint(b"secret");
        for status in [
            IdempotencyStatus::InFlight,
            IdempotencyStatus::Delivered,
            IdempotencyStatus::Refunded,
        ] {
            assert_eq!(
                judge(&record(status, true, -10), &other, at()),
                Judgement::Answer(IdempotencyAnswer::Mismatch)
            );
        }
        let another_key = fields("hello").fingerprint(b"another api key");
        assert_eq!(
            judge(
                &record(IdempotencyStatus::Delivered, true, 0),
                &another_key,
                at()
            ),
            Judgement::Answer(IdempotencyAnswer::Mismatch)
        );
    }

    #[test]
    fn states_answer_as_the_table_says() {
        let same = fields("hello").fingerprint(b"secret");
        assert_eq!(
            judge(
                &record(IdempotencyStatus::Delivered, true, -10),
                &same,
                at()
            ),
            Judgement::Answer(IdempotencyAnswer::Replay {
                response: b"body".to_vec()
            })
        );
        assert_eq!(
            judge(&record(IdempotencyStatus::Refunded, true, 10), &same, at()),
            Judgement::Answer(IdempotencyAnswer::Refunded)
        );
        assert_eq!(
            judge(&record(IdempotencyStatus::InFlight, false, 10), &same, at()),
            Judgement::Answer(IdempotencyAnswer::InFlight)
        );
        let mut broken = record(IdempotencyStatus::Delivered, true, 0);
        broken.response = None;
        assert!(matches!(judge(&broken, &same, at()), Judgement::Corrupt(_)));
    }

    #[test]
    fn a_committed_request_is_never_taken_over_whatever_its_lease() {
        let same = fields("hello").fingerprint(b"secret");
        assert_eq!(
            judge(
                &record(IdempotencyStatus::InFlight, true, -3600),
                &same,
                at()
            ),
            Judgement::Answer(IdempotencyAnswer::InFlight)
        );
        // Only an uncommitted request whose lease ran out frees its key.
        assert_eq!(
            judge(&record(IdempotencyStatus::InFlight, false, 0), &same, at()),
            Judgement::TakeOver {
                token: LeaseToken([3; 16])
            }
        );
        assert_eq!(
            judge(&record(IdempotencyStatus::InFlight, false, 1), &same, at()),
            Judgement::Answer(IdempotencyAnswer::InFlight)
        );
    }

    #[test]
    fn lease_tokens_are_random_and_read_back_as_written() {
        let tokens: std::collections::HashSet<LeaseToken> =
            (0..1000).map(|_| LeaseToken::random()).collect();
        assert_eq!(tokens.len(), 1000);
        let t = LeaseToken::from_bytes([0xab; 16]);
        assert_eq!(t.to_string(), "ab".repeat(16));
        assert_eq!("AB".repeat(16).parse::<LeaseToken>().expect("hex"), t);
        assert_eq!(format!("{t:?}"), format!("LeaseToken({})", "ab".repeat(16)));
        for bad in [
            "",
            "ab",
            &"ab".repeat(17),
            &"zz".repeat(16),
            &"é".repeat(16),
        ] {
            assert!(
                matches!(
                    bad.parse::<LeaseToken>(),
                    Err(Error::InvalidLeaseToken { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(LeaseToken::from_slice(&[1; 15]), None);
        assert_eq!(LeaseToken::from_slice(&[1; 16]), Some(LeaseToken([1; 16])));
    }

    #[test]
    fn error_codes_of_refusals() {
        assert_eq!(
            IdempotencyAnswer::InFlight.error_code(),
            Some("idempotency_in_flight")
        );
        assert_eq!(
            IdempotencyAnswer::Mismatch.error_code(),
            Some("idempotency_mismatch")
        );
        assert_eq!(
            IdempotencyAnswer::Refunded.error_code(),
            Some("idempotency_refunded")
        );
        assert_eq!(
            IdempotencyAnswer::Execute {
                token: LeaseToken::random()
            }
            .error_code(),
            None
        );
        for s in [
            IdempotencyStatus::InFlight,
            IdempotencyStatus::Delivered,
            IdempotencyStatus::Refunded,
        ] {
            assert_eq!(IdempotencyStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(IdempotencyStatus::parse("debited"), None);
    }
}
