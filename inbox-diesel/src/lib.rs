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
//! - `backend`: the sealed backend contract of the inbox path and the relay,
//!   [`StoreConnection`], and [`ErrorClass`]. It names no optional capability.
//!
//! The optional capabilities are public modules, each with its own entry point and
//! its own sealed trait extending [`StoreConnection`], implemented by both backends:
//!
//! - [`operator`]: [`operator::Operator`], built from a store (dead letters, replay,
//!   discard, redrive, stats, halts, canaries, gauges), bound by
//!   [`operator::OperatorConnection`];
//! - [`rebuild`]: [`rebuild::Rebuilder`] and [`rebuild::RebuildRunner`], built from a
//!   store and a registered projection, bound by [`rebuild::RebuildConnection`];
//! - [`idempotency`]: free functions on a connection ([`idempotency::begin_request`],
//!   [`idempotency::commit_request`], ...) or a store
//!   ([`idempotency::purge_expired_requests`]), bound by
//!   [`idempotency::IdempotencyConnection`].
//!
//! Their statements live beside the inbox path's in each backend folder
//! (`pg/operator.rs`, `pg/rebuild.rs`, `pg/idempotency.rs`, and SQLite's).
//! - `statements`: the statement traits every backend implements, and the claim
//!   upsert's conflict target and condition, built once from `ClaimKey::COLUMNS`.
//! - `rows`: the rows the statements write and read, and the public records
//!   ([`ClaimRecord`], [`DeadLetter`], [`DeadOutboxRow`]).
//! - `dsl`: the diesel DSL both backends share, written once: functions generic over
//!   the connection, and a macro expanded in each backend for the statements a
//!   generic function cannot bound (upserts, borrowed payloads).
//! - `batch/`: the state machine, one step per module: `mod.rs` orchestration and
//!   in-batch de-duplication; `retry` transaction retries and splitting; `claim`
//!   locks, claims, lookups and the pure `decide` from a stored claim to a decision;
//!   `optimistic`, `isolated`, `run` and `ownership` running handlers (savepoints,
//!   depth repair, panics, hangs, a transaction the handler ended); `failure` retries
//!   and dead letters of failed messages; `dead_letter` collisions, malformed
//!   deliveries and the broker's dead letters; `crash_loop` start marks; `metrics`.
//! - `store`: [`Store`], [`StoreBuilder`] and the state batches share, whose fields
//!   only that module touches.
//! - `outbox`: [`enqueue`] and the store's [`inbox_core::OutboxStore`];
//!   `retention`: [`Retention`]; `verify`: the schema check; `slot`: the crash slot;
//!   `reports`: the stored rebuild and audit reports (written by `rebuild`, read by
//!   `operator`); `fingerprint`: a dead letter's failure group, stored on every letter, and the
//!   backfill of letters written before the column existed;
//!   `pool`, `url`, `tls`, `error`, `schema`: connections, URLs, TLS set-up, errors,
//!   the one table set of both backends and its timestamp type.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
compile_error!("inbox-diesel needs a backend: enable its feature `postgres`, `sqlite` or both");

mod backend;
mod batch;
mod dsl;
mod error;
mod fingerprint;
mod halts;
#[cfg(feature = "idempotency")]
#[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
pub mod idempotency;
mod knobs;
#[cfg(feature = "operator")]
#[cfg_attr(docsrs, doc(cfg(feature = "operator")))]
pub mod operator;
mod outbox;
#[cfg(feature = "postgres")]
mod pg;
mod pool;
#[cfg(feature = "rebuild")]
#[cfg_attr(docsrs, doc(cfg(feature = "rebuild")))]
pub mod rebuild;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod replication;
mod reports;
mod retention;
mod rows;
mod schema;
mod slot;
#[cfg(feature = "sqlite")]
mod sqlite;
mod statements;
mod store;
mod suspect;
mod tls;
mod url;
mod verify;

pub use backend::{ErrorClass, StoreConnection};
pub use error::{Error, Result, SchemaPart, SchemaProblem};
#[cfg(feature = "bench-knobs")]
pub use knobs::BenchKnobs;
pub use outbox::{
    enqueue, enqueue_all, enqueue_all_with, enqueue_with, ordering_lock_stripe, AsStoreConnection,
    EnqueueLimits, DEFAULT_MAX_OUTBOX_PAYLOAD, MAX_OUTBOX_NAME_LEN, ORDERING_LOCK_CLASS,
    ORDERING_LOCK_STRIPES, OUTBOX_CHANNEL,
};
#[doc(hidden)] // the plan tests read PostgreSQL's purge statement
#[cfg(feature = "postgres")]
pub use pg::retention::purge_statement as pg_purge_statement;
pub use pool::{PooledStoreConnection, StoreManager};
pub use retention::{count_purgeable, purge_batch, Retention, PURGE_LOCK_CLASS};
pub use rows::{ClaimRecord, ClaimStatus, DeadLetter, DeadOutboxRow, PurgeBatch, PurgeTarget};
pub use store::{
    Store, StoreBuilder, DEFAULT_BATCH_DEADLINE, DEFAULT_STATEMENT_TIMEOUT, MIGRATION_LOCK_CLASS,
};
pub use tls::init_tls;
pub use url::{redact, Backend};
