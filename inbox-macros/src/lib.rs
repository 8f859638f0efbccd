//! `#[derive(Handler)]` for the handler structs of `inbox-core`.
//!
//! Use it through inbox-core, which re-exports it behind its `derive` feature:
//!
//! ```toml
//! inbox-core = { version = "0.1", features = ["derive"] }
//! ```
//!
//! `use inbox_core::Handler;` then brings both the trait and the derive. See
//! [`macro@Handler`] for the attributes.
#![forbid(unsafe_code)]

use proc_macro::TokenStream;
use syn::{parse_macro_input, DeriveInput};

mod attr;
mod ctxt;
mod expand;
// The consumer group name rules, shared with inbox-core at run time.
use inbox_names as names;
mod retry;

/// Implements `inbox_core::Handler` for a handler struct, from an `#[inbox(...)]`
/// attribute, checked at compile time.
///
/// You write the struct (with whatever state it needs: a pool, a clock, a config) and
/// an inherent method that handles one decoded message; the derive writes the
/// consumer group, the message type and its decoding, the retry policy, the hooks and
/// one `Handler<C>` impl per connection type.
///
/// ```
/// use std::collections::BTreeMap;
///
/// use inbox_core::{Handler, HandlerError, MessageContext, ProjectionLock};
///
/// /// `usage.recorded`, JSON on the wire.
/// #[derive(serde::Deserialize)]
/// pub struct UsageRecorded {
///     pub user_id: i64,
///     pub amount: i64,
/// }
///
/// /// The writes the projection makes. A real application implements it for
/// /// `diesel::PgConnection` and `diesel::SqliteConnection` (one upsert each), so the
/// /// handler's writes commit in the transaction that records the claim.
/// pub trait UsageDb {
///     fn add_usage(&mut self, user_id: i64, amount: i64) -> std::io::Result<()>;
/// }
///
/// #[derive(Handler)]
/// #[inbox(
///     group = "billing.daily-usage",
///     message = UsageRecorded,
///     message_type = "usage.recorded",
///     connection = impl UsageDb, // or a list: [PgConnection, SqliteConnection]
///     max_attempts = 8,
///     backoff(initial = "1s", max = "5m"),
///     fold = Self::add_batch,
///     lock = Self::projection_lock,
/// )]
/// pub struct DailyUsage {
///     /// State: amounts above this are refused.
///     limit: i64,
/// }
///
/// impl DailyUsage {
///     /// One message, inside the claim's transaction.
///     fn handle<C: UsageDb>(
///         &self,
///         conn: &mut C,
///         msg: UsageRecorded,
///         _ctx: &MessageContext<'_>,
///     ) -> Result<(), HandlerError> {
///         self.check(&msg)?;
///         conn.add_usage(msg.user_id, msg.amount)?; // an I/O error is transient
///         Ok(())
///     }
///
///     /// A whole batch in one write per user (the fast path).
///     fn add_batch<C: UsageDb>(
///         &self,
///         conn: &mut C,
///         batch: &[(UsageRecorded, MessageContext<'_>)],
///     ) -> Result<(), HandlerError> {
///         let mut sums = BTreeMap::new();
///         for (msg, _) in batch {
///             self.check(msg)?;
///             *sums.entry(msg.user_id).or_insert(0) += msg.amount;
///         }
///         for (user_id, amount) in sums {
///             conn.add_usage(user_id, amount)?;
///         }
///         Ok(())
///     }
///
///     /// Taken shared before claims; a rebuild of `daily_usage` takes it exclusive.
///     fn projection_lock(&self) -> ProjectionLock {
///         ProjectionLock::named("daily_usage")
///     }
///
///     fn check(&self, msg: &UsageRecorded) -> Result<(), HandlerError> {
///         if msg.amount <= 0 || msg.amount > self.limit {
///             return Err(HandlerError::permanent(format!("bad amount {}", msg.amount)));
///         }
///         Ok(())
///     }
/// }
///
/// // A stand-in connection, so this example runs without a database.
/// #[derive(Default)]
/// struct Memory(BTreeMap<i64, i64>);
///
/// impl UsageDb for Memory {
///     fn add_usage(&mut self, user_id: i64, amount: i64) -> std::io::Result<()> {
///         *self.0.entry(user_id).or_insert(0) += amount;
///         Ok(())
///     }
/// }
///
/// let handler = DailyUsage { limit: 1_000 };
/// assert_eq!(Handler::<Memory>::group(&handler).as_str(), "billing.daily-usage");
/// assert_eq!(Handler::<Memory>::message_type(&handler), "usage.recorded");
/// assert_eq!(Handler::<Memory>::retry_policy(&handler).max_attempts(), 8);
/// assert_eq!(
///     Handler::<Memory>::lock(&handler),
///     Some(ProjectionLock::named("daily_usage"))
/// );
/// let msg = Handler::<Memory>::decode(&handler, br#"{"user_id": 7, "amount": 40}"#)?;
/// # let key = inbox_core::MessageKey::derive("billing", "usage-event-1", "usage.recorded");
/// # let envelope = inbox_core::Envelope::new(key, "usage.recorded", Vec::new());
/// # let group = inbox_core::ConsumerGroup::new("billing.daily-usage")?;
/// # let ctx = MessageContext::new(&envelope, &group, 1, inbox_core::Clock::now(&inbox_core::SystemClock));
/// let mut conn = Memory::default();
/// // What the store calls, inside the claim's transaction:
/// assert!(Handler::handle(&handler, &mut conn, msg, &ctx).is_ok());
/// assert_eq!(conn.0[&7], 40);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Attributes
///
/// Inside `#[inbox(...)]` (one attribute or several, each key at most once):
///
/// | key | value | |
/// |---|---|---|
/// | `group` | `"billing.daily-usage"` | required; the consumer group, checked at compile time by the rules of `ConsumerGroup::new` (`[a-z0-9._-]`, 1 to 100 bytes) |
/// | `message` | a type | required; the decoded message (`Handler::Message`), must be `serde::de::DeserializeOwned`; payloads are decoded as JSON |
/// | `message_type` | `"usage.recorded"` | required, not empty; the string the transport dispatches on (AMQP `type` and routing key) |
/// | `connection` | `[PgConnection, SqliteConnection]`, `PgConnection` or `impl Trait + ...` | required; a list gets one `impl Handler<C>` per type, `impl Bounds` one impl generic over every connection `C: Bounds` |
/// | `handle` | a path | optional; the function handling one message, default `Self::handle` |
/// | `fold` | a path | optional; implements `Handler::fold` |
/// | `lock` | `"name"`, `serialized("name")` or a path | optional; implements `Handler::lock`: `ProjectionLock::named("name")` (batches side by side, a rebuild exclusive), `ProjectionLock::serialized("name")` (one batch at a time: for a handler writing shared rows one event at a time), or what the path returns |
/// | `max_attempts` | an integer | optional, at least 1; default 8 |
/// | `backoff` | `(initial = "1s", max = "5m")` | optional, each part optional; durations are a whole number and `ms`, `s`, `m` or `h`; initial above zero and not above max; defaults 1s and 5m |
/// | `retry_policy` | a path | optional, instead of `max_attempts`/`backoff`: a method computing the policy at run time (from the handler's configuration, say) |
///
/// The paths are called with the handler first, like methods, and may be generic over
/// the connection:
///
/// - `handle`: `fn(&self, &mut C, Message, &MessageContext<'_>) -> Result<(), E>`,
///   for any `E: Into<HandlerError>` (`HandlerError`, or any error, which counts as
///   transient). The default is an inherent method named `handle`; without one the
///   derive fails to compile (E0034, "multiple applicable items") rather than call
///   the trait's `handle` back forever.
/// - `fold`: `fn(&self, &mut C, &[(Message, MessageContext<'_>)]) -> Result<(), E>`.
///   Naming a fold makes the handler fold every batch; a handler that decides per
///   batch implements `Handler` by hand.
/// - `lock`: `fn(&self) -> ProjectionLock`.
/// - `retry_policy`: `fn(&self) -> RetryPolicy`.
///
/// Without `max_attempts`, `backoff` and `retry_policy` the handler keeps
/// `RetryPolicy::default()`.
///
/// # Generic structs
///
/// The impls carry the struct's generics and bounds, and, for a generic struct,
/// `where Self: Send + Sync + 'static` (the trait's supertraits). Bounds the message or
/// the handling method needs go on the struct: `struct Relay<M: DeserializeOwned>`.
///
/// # Errors
///
/// Every mistake in the attributes is reported at its token, all of them in one
/// build: unknown, duplicated or missing keys, a malformed group name, an empty
/// message type, `max_attempts = 0`, unparsable durations, a zero initial backoff or
/// one above the max, `retry_policy` together with `max_attempts`/`backoff`, an empty
/// or repeated connection list, `#[inbox]` on a field, and the derive on an enum or a
/// union. A message type that is not `DeserializeOwned` fails at `message = ...`.
#[proc_macro_derive(Handler, attributes(inbox))]
pub fn derive_handler(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive(&input, &quote::quote!(::inbox_core))
        .unwrap_or_else(|errors| errors)
        .into()
}

/// The same derive for applications that depend on the facade crate `inbox-outbox`
/// alone: the generated code names inbox-core through the facade's hidden re-export.
/// Hidden: the facade re-exports it as `Handler`; nobody names it.
#[doc(hidden)]
#[proc_macro_derive(FacadeHandler, attributes(inbox))]
pub fn derive_facade_handler(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand::derive(
        &input,
        &quote::quote!(::inbox_outbox::__private::inbox_core),
    )
    .unwrap_or_else(|errors| errors)
    .into()
}
