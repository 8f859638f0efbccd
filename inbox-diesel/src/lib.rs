#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod backend;
mod batch;
mod dsl;
mod error;
mod outbox;
mod pg;
mod pool;
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
pub use outbox::{
    enqueue, enqueue_with, AsStoreConnection, EnqueueLimits, DEFAULT_MAX_OUTBOX_PAYLOAD,
    MAX_OUTBOX_NAME_LEN, OUTBOX_CHANNEL,
};
pub use pool::{PooledStoreConnection, StoreManager};
pub use retention::Retention;
pub use rows::{ClaimRecord, ClaimStatus, DeadLetter, DeadOutboxRow};
pub use store::{Store, StoreBuilder, DEFAULT_BATCH_DEADLINE, DEFAULT_STATEMENT_TIMEOUT};
pub use tls::init_tls;
pub use url::{redact, Backend};
