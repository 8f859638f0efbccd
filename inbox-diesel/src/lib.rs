#![doc = include_str!("../README.md")]
//!
//! ## Where each rule lives
//!
//! The backend folders sit above a neutral core; nothing neutral imports a backend.
//!
//! - `pg/`, `sqlite/`: all of a backend's SQL and session rules. `mod.rs` connects,
//!   migrates, sets the session up, holds the write transaction, projection locks and
//!   transaction token; `claims.rs` the claim statement (PostgreSQL: one cached
//!   statement over arrays; SQLite: row by row); `outbox.rs` leasing and NOTIFY;
//!   `retention.rs` the purges; `catalog.rs` the claim table's indexes and columns;
//!   `pg/listen.rs` the relay's LISTEN connection; `sqlite/collation.rs` declared
//!   collations.
//! - `backend`: the sealed backend contract, [`StoreConnection`] and [`ErrorClass`].
//! - `statements`: the statement traits every backend implements, and the claim
//!   upsert's conflict target and condition, built once from `ClaimKey::COLUMNS`.
//! - `rows`: the rows the statements write and read, and the public records
//!   ([`ClaimRecord`], [`DeadLetter`], [`DeadOutboxRow`]).
//! - `dsl`: the diesel DSL both backends share, written once and expanded in each.
//! - `batch/`: the state machine, one step per module: `mod.rs` orchestration and
//!   in-batch de-duplication; `retry` transaction retries and splitting; `claim`
//!   locks, claims, lookups and the pure `decide` from a stored claim to a decision;
//!   `optimistic`, `isolated`, `run` and `ownership` running handlers (savepoints,
//!   depth repair, panics, hangs, a transaction the handler ended); `failure` retries
//!   and dead letters of failed messages; `dead_letter` collisions, malformed
//!   deliveries and the broker's dead letters; `crash_loop` start marks; `metrics`.
//! - `store`: [`Store`], [`StoreBuilder`] and the state batches share, whose fields
//!   only that module touches.
//! - `idempotency`: idempotency records of requests ([`begin_request`],
//!   [`commit_request`], [`settle_request`], ...), their statement trait and their
//!   index check; each backend's statements in `pg/idempotency.rs` and
//!   `sqlite/idempotency.rs`, its catalog read by `catalog.rs`.
//! - `outbox`: [`enqueue`] and the store's [`inbox_core::OutboxStore`];
//!   `retention`: [`Retention`]; `verify`: the schema check; `slot`: the crash slot;
//!   `pool`, `url`, `tls`, `error`, `schema`: connections, URLs, TLS set-up, errors,
//!   table definitions.
#![forbid(unsafe_code)]

mod backend;
mod batch;
mod dsl;
mod error;
mod idempotency;
mod knobs;
mod operator;
mod outbox;
mod pg;
mod pool;
mod rebuild;
mod rebuild_ops;
mod retention;
mod rows;
mod schema;
mod slot;
mod sqlite;
mod statements;
mod store;
mod tls;
mod url;
mod verify;

pub use backend::{ErrorClass, StoreConnection};
pub use error::{Error, Result, SchemaProblem};
pub use idempotency::{
    abandon_request, begin_request, commit_request, purge_requests, read_request,
    refund_delivered_request, settle_request, IdempotencyConnection, NewRequest,
    IDEMPOTENCY_KEY_COLUMNS,
};
#[cfg(feature = "bench-knobs")]
pub use knobs::BenchKnobs;
pub use operator::{
    replay_refusal, BulkReport, Canary, CanaryPing, CanaryReport, DeadLetterDetails,
    DeadLetterEntry, DeadLetterFilter, DiscardOutcome, FailureGroup, GroupStats, HaltedGroup,
    LetterCount, LetterStatus, OperatorConnection, OperatorStats, PurgeReport, RedriveFilter,
    ReplayOutcome, ReplayTarget, CANARY_GROUP, CANARY_MESSAGE_TYPE,
};
pub use outbox::{
    enqueue, enqueue_all, enqueue_all_with, enqueue_with, ordering_lock_stripe, AsStoreConnection,
    EnqueueLimits, DEFAULT_MAX_OUTBOX_PAYLOAD, MAX_OUTBOX_NAME_LEN, ORDERING_LOCK_CLASS,
    ORDERING_LOCK_STRIPES, OUTBOX_CHANNEL,
};
#[doc(hidden)] // the plan tests read PostgreSQL's purge statement
pub use pg::retention::purge_statement as pg_purge_statement;
pub use pool::{PooledStoreConnection, StoreManager};
pub use rebuild::{
    RebuildConnection, RebuildRunner, Rebuilder, RunOutcome, DEFAULT_LOCK_TIMEOUT,
    DEFAULT_LOCK_TRIES, DEFAULT_REBUILD_EVERY, DEFAULT_REBUILD_WINDOW, DEFAULT_RETRY_PAUSE,
    MAX_REBUILD_EVERY, MAX_REBUILD_WINDOW,
};
pub use retention::{purge_batch, Retention, PURGE_LOCK_CLASS};
pub use rows::{ClaimRecord, ClaimStatus, DeadLetter, DeadOutboxRow, PurgeBatch, PurgeTarget};
pub use store::{
    Store, StoreBuilder, DEFAULT_BATCH_DEADLINE, DEFAULT_STATEMENT_TIMEOUT, MIGRATION_LOCK_CLASS,
};
pub use tls::init_tls;
pub use url::{redact, Backend};
