use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;

use crate::{ConsumerGroup, Envelope, MessageKey, RetryPolicy};

/// Handles one message type for one consumer group, on a store connection `C`.
///
/// `C` is the store's connection type (`diesel::PgConnection`,
/// `diesel::SqliteConnection`): the handler's writes go through the same connection,
/// inside the transaction that records the claim, so effect and claim commit together.
/// A handler that runs on both backends implements the trait for both (or generically).
///
/// ```
/// use inbox_core::{ConsumerGroup, Handler, HandlerError, MessageContext};
///
/// #[derive(serde::Deserialize)]
/// struct UsageRecorded { amount: i64 }
///
/// struct Totals { group: ConsumerGroup }
///
/// // A stand-in connection type; a real handler uses a diesel connection.
/// struct Conn { total: i64 }
///
/// impl Handler<Conn> for Totals {
///     type Message = UsageRecorded;
///     fn group(&self) -> &ConsumerGroup { &self.group }
///     fn message_type(&self) -> &str { "usage.recorded" }
///     fn handle(&self, conn: &mut Conn, msg: UsageRecorded, _ctx: &MessageContext<'_>)
///         -> Result<(), HandlerError>
///     {
///         if msg.amount <= 0 {
///             return Err(HandlerError::permanent("amount must be positive"));
///         }
///         conn.total += msg.amount;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<C>: Send + Sync + 'static {
    /// The decoded message.
    type Message: DeserializeOwned;

    /// The consumer group this handler belongs to.
    fn group(&self) -> &ConsumerGroup;

    /// The message type string it takes (AMQP `type` and routing key).
    fn message_type(&self) -> &str;

    /// How failures are retried. Defaults to [`RetryPolicy::default`].
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    /// Decodes a payload. Defaults to JSON.
    fn decode(&self, payload: &[u8]) -> Result<Self::Message, DecodeError> {
        serde_json::from_slice(payload).map_err(DecodeError::new)
    }

    /// Applies one message. Runs inside the claim's transaction.
    fn handle(
        &self,
        conn: &mut C,
        msg: Self::Message,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError>;

    /// Applies every message this handler owns in a batch in one go (sums per row,
    /// one multi-row upsert), or returns `None` when the handler does not fold.
    ///
    /// If the fold fails, the store rolls the batch back and runs [`Handler::handle`]
    /// once per message with a savepoint each, which isolates the poison message.
    fn fold(
        &self,
        conn: &mut C,
        batch: &[(Self::Message, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        let _ = (conn, batch);
        None
    }

    /// A lock the store takes (shared) before it claims messages for this handler, or
    /// `None`. A projection rebuild takes the same lock exclusively, so it never races
    /// live consumers into a double count.
    fn lock(&self) -> Option<ProjectionLock> {
        None
    }
}

/// A named lock a store takes before it claims a batch for a handler.
///
/// [`ProjectionLock::named`] is taken shared: live batches run side by side, and a
/// projection rebuild, taking it exclusively, never races them into a double count.
/// [`ProjectionLock::serialized`] is taken exclusively by every batch: one batch of
/// the projection at a time, across processes. Use it for a handler that writes
/// shared rows one event at a time without a fold, where concurrent batches touching
/// the same rows in different orders would deadlock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProjectionLock {
    id: i64,
    exclusive: bool,
}

impl ProjectionLock {
    /// The advisory lock key of this lock in a store's `schema`: the lock's id mixed
    /// with the schema's name (FNV-1a), so stores in different schemas of one database
    /// never block each other (advisory locks are per database). Live batches and
    /// rebuilds of one store compute the same key.
    ///
    /// ```
    /// use inbox_core::ProjectionLock;
    /// let lock = ProjectionLock::named("daily_usage");
    /// assert_eq!(lock.key_in("billing"), lock.key_in("billing"));
    /// assert_ne!(lock.key_in("billing"), lock.key_in("staging"));
    /// ```
    pub fn key_in(&self, schema: &str) -> i64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let bytes = schema.bytes().chain([0u8]).chain(self.id().to_le_bytes());
        for byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        i64::from_ne_bytes(hash.to_ne_bytes())
    }

    /// A lock identified by a name (hashed to 64 bits with FNV-1a, stable across
    /// processes and versions), taken shared by live batches.
    pub fn named(name: &str) -> Self {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in name.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        Self {
            id: i64::from_ne_bytes(hash.to_ne_bytes()),
            exclusive: false,
        }
    }

    /// The same lock, taken exclusively by every batch: batches of the projection
    /// run one at a time.
    pub fn serialized(name: &str) -> Self {
        Self {
            exclusive: true,
            ..Self::named(name)
        }
    }

    /// The lock's 64-bit id (a PostgreSQL advisory lock key).
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Whether live batches take it exclusively.
    pub fn is_exclusive(&self) -> bool {
        self.exclusive
    }
}

/// What a handler knows about the message besides its body.
#[derive(Clone, Copy, Debug)]
pub struct MessageContext<'a> {
    envelope: &'a Envelope,
    group: &'a ConsumerGroup,
    attempt: u32,
    now: DateTime<Utc>,
    span: Option<&'a tracing::Span>,
}

impl<'a> MessageContext<'a> {
    /// Builds a context; stores call this.
    pub fn new(
        envelope: &'a Envelope,
        group: &'a ConsumerGroup,
        attempt: u32,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            envelope,
            group,
            attempt,
            now,
            span: None,
        }
    }

    /// The delivery's span ([`crate::trace::delivery_span`]): the handler of a
    /// batch runs inside it, so the spans a handler opens are its children. Stores
    /// call this.
    pub fn with_span(mut self, span: &'a tracing::Span) -> Self {
        self.span = Some(span);
        self
    }

    /// The delivery's span, when the store gave one.
    pub fn span(&self) -> Option<&'a tracing::Span> {
        self.span
    }

    /// The message key.
    pub fn message_key(&self) -> &'a MessageKey {
        &self.envelope.message_key
    }

    /// The consumer group.
    pub fn group(&self) -> &'a ConsumerGroup {
        self.group
    }

    /// The whole envelope (headers, tenant, occurred-at, transport hints).
    pub fn envelope(&self) -> &'a Envelope {
        self.envelope
    }

    /// The tenant, if the message carries one.
    pub fn tenant(&self) -> Option<&'a str> {
        self.envelope.tenant.as_deref()
    }

    /// Which try this is, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The store clock's time for this batch.
    pub fn now(&self) -> DateTime<Utc> {
        self.now
    }
}

/// How the runtime should treat a handler failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerErrorKind {
    /// Retry according to the handler's retry policy.
    Transient,
    /// Dead-letter now; retrying cannot help.
    Permanent,
    /// Retry after this delay instead of the policy's (still counts as an attempt).
    RetryAfter(Duration),
}

/// A handler's failure: a kind the runtime acts on, and the cause.
///
/// Like `anyhow::Error` it converts from any error (as [`HandlerErrorKind::Transient`]),
/// so `?` works inside a handler, and it does not implement `std::error::Error` itself.
/// The cause is kept, so the store can recognise a deadlock raised inside a handler
/// and retry the whole batch without counting an attempt.
pub struct HandlerError {
    kind: HandlerErrorKind,
    source: Box<dyn StdError + Send + Sync + 'static>,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn transient(cause: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        Self::with_kind(HandlerErrorKind::Transient, cause)
    }

    /// A failure no retry can fix: dead-letter now.
    pub fn permanent(cause: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        Self::with_kind(HandlerErrorKind::Permanent, cause)
    }

    /// A failure to retry after `delay`, at most [`MAX_RETRY_DELAY`](crate::MAX_RETRY_DELAY)
    /// (a longer delay saturates to it).
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_core::{HandlerError, HandlerErrorKind, MAX_RETRY_DELAY};
    /// let e = HandlerError::retry_after(Duration::MAX, "rate limited");
    /// assert_eq!(e.kind(), HandlerErrorKind::RetryAfter(MAX_RETRY_DELAY));
    /// ```
    pub fn retry_after(
        delay: Duration,
        cause: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        Self::with_kind(
            HandlerErrorKind::RetryAfter(delay.min(crate::MAX_RETRY_DELAY)),
            cause,
        )
    }

    fn with_kind(
        kind: HandlerErrorKind,
        cause: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            source: cause.into(),
        }
    }

    /// How the runtime treats it.
    pub fn kind(&self) -> HandlerErrorKind {
        self.kind
    }

    /// The cause.
    pub fn cause(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.source.as_ref()
    }

    /// The cause and its sources, outermost first.
    pub fn chain(&self) -> impl Iterator<Item = &(dyn StdError + 'static)> {
        let first: &(dyn StdError + 'static) = &*self.source;
        std::iter::successors(Some(first), |e| (*e).source())
    }

    /// The first error of type `T` in the chain.
    pub fn downcast_ref<T: StdError + 'static>(&self) -> Option<&T> {
        self.chain().find_map(|e| e.downcast_ref::<T>())
    }
}

impl<E> From<E> for HandlerError
where
    E: StdError + Send + Sync + 'static,
{
    fn from(error: E) -> Self {
        Self::transient(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.source)?;
        for cause in self.chain().skip(1) {
            write!(f, ": {cause}")?;
        }
        Ok(())
    }
}

/// A payload that does not decode into the handler's message type. Its message names
/// the failure; the decoder's error is its source (a reporter prints it once).
#[derive(Debug, thiserror::Error)]
#[error("payload does not decode")]
pub struct DecodeError(#[source] Box<dyn StdError + Send + Sync + 'static>);

impl DecodeError {
    /// Wraps a decoder's error.
    pub fn new(cause: impl Into<Box<dyn StdError + Send + Sync + 'static>>) -> Self {
        Self(cause.into())
    }
}

/// Why a handler call did not succeed, as the store sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerFailure {
    /// The payload did not decode: dead-letter as `decode_error`.
    Decode(DecodeError),
    /// The handler returned an error.
    Handler(HandlerError),
    /// The handler panicked (caught by the store).
    Panic(String),
}

impl fmt::Display for HandlerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Decode(e) => write!(f, "{e}: {}", e.0),
            Self::Handler(e) => write!(f, "{e}"),
            Self::Panic(msg) => write!(f, "handler panicked: {msg}"),
        }
    }
}

/// A handler with its message type erased: takes payload bytes, decodes them itself.
///
/// Blanket-implemented for every [`Handler`]; stores hold `Arc<dyn DynHandler<C>>`.
pub trait DynHandler<C>: Send + Sync + 'static {
    /// See [`Handler::group`].
    fn group(&self) -> &ConsumerGroup;
    /// See [`Handler::message_type`].
    fn message_type(&self) -> &str;
    /// See [`Handler::retry_policy`].
    fn retry_policy(&self) -> RetryPolicy;
    /// See [`Handler::lock`].
    fn lock(&self) -> Option<ProjectionLock>;
    /// Decodes and handles one message.
    fn handle_payload(&self, conn: &mut C, ctx: &MessageContext<'_>) -> Result<(), HandlerFailure>;
    /// Decodes every message and applies them all: one fold if the handler folds,
    /// else one `handle` each, with no isolation between them. The first failure wins,
    /// with the index of its message when one message is to blame (not for a fold).
    fn handle_all(
        &self,
        conn: &mut C,
        ctxs: &[MessageContext<'_>],
    ) -> Result<(), (Option<usize>, HandlerFailure)>;
}

impl<C, H> DynHandler<C> for H
where
    H: Handler<C>,
{
    fn group(&self) -> &ConsumerGroup {
        Handler::group(self)
    }

    fn message_type(&self) -> &str {
        Handler::message_type(self)
    }

    fn retry_policy(&self) -> RetryPolicy {
        Handler::retry_policy(self)
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Handler::lock(self)
    }

    fn handle_payload(&self, conn: &mut C, ctx: &MessageContext<'_>) -> Result<(), HandlerFailure> {
        let msg = self
            .decode(&ctx.envelope().payload)
            .map_err(HandlerFailure::Decode)?;
        self.handle(conn, msg, ctx).map_err(HandlerFailure::Handler)
    }

    fn handle_all(
        &self,
        conn: &mut C,
        ctxs: &[MessageContext<'_>],
    ) -> Result<(), (Option<usize>, HandlerFailure)> {
        let mut batch = Vec::with_capacity(ctxs.len());
        for (i, ctx) in ctxs.iter().enumerate() {
            let msg = self
                .decode(&ctx.envelope().payload)
                .map_err(|e| (Some(i), HandlerFailure::Decode(e)))?;
            batch.push((msg, *ctx));
        }
        if let Some(folded) = self.fold(conn, &batch) {
            return folded.map_err(|e| (None, HandlerFailure::Handler(e)));
        }
        for (i, (msg, ctx)) in batch.into_iter().enumerate() {
            // The handler's own spans are children of its delivery's.
            let _entered = ctx.span().map(tracing::Span::enter);
            self.handle(conn, msg, &ctx)
                .map_err(|e| (Some(i), HandlerFailure::Handler(e)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Inner);

    fn fails() -> Result<(), HandlerError> {
        Err(Outer(Inner))?;
        Ok(())
    }

    #[test]
    fn a_decode_failure_prints_its_cause_once() {
        let cause = serde_json::from_slice::<Vec<u8>>(b"[").map_err(DecodeError::new);
        let Err(err) = cause else { unreachable!() };
        let printed = HandlerFailure::Decode(err).to_string();
        assert_eq!(printed.matches("EOF while parsing").count(), 1, "{printed}");
        assert!(
            printed.starts_with("payload does not decode: "),
            "{printed}"
        );
    }

    #[test]
    fn question_mark_is_transient_and_keeps_the_chain() {
        let err = fails().unwrap_err();
        assert_eq!(err.kind(), HandlerErrorKind::Transient);
        assert!(err.downcast_ref::<Inner>().is_some());
        assert_eq!(err.to_string(), "outer: inner");
    }

    #[test]
    fn lock_names_are_stable() {
        assert_eq!(ProjectionLock::named("a"), ProjectionLock::named("a"));
        assert_ne!(ProjectionLock::named("a"), ProjectionLock::named("b"));
        assert_eq!(
            ProjectionLock::serialized("a").id(),
            ProjectionLock::named("a").id()
        );
        assert!(ProjectionLock::serialized("a").is_exclusive());
        assert!(!ProjectionLock::named("a").is_exclusive());
        // FNV-1a of "" is the offset basis.
        assert_eq!(
            ProjectionLock::named("").id(),
            i64::from_ne_bytes(0xcbf2_9ce4_8422_2325u64.to_ne_bytes())
        );
    }
}
