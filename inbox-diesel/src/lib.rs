#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod backend;
mod batch;
mod error;
mod operator;
mod ops;
mod outbox;
mod pg;
mod pool;
mod retention;
mod schema;
mod slot;
mod sqlite;
mod store;
mod tls;
mod url;
mod verify;

pub use backend::{ErrorClass, StoreConnection};
pub use error::{Error, Result, SchemaProblem};
pub use operator::{
    replay_refusal, BulkReport, Canary, CanaryPing, CanaryReport, DeadLetterDetails,
    DeadLetterEntry, DeadLetterFilter, DiscardOutcome, FailureGroup, GroupStats, LetterCount,
    LetterStatus, OperatorStats, PurgeReport, RedriveFilter, ReplayOutcome, ReplayTarget,
    CANARY_GROUP, CANARY_MESSAGE_TYPE,
};
pub use outbox::{
    enqueue, enqueue_with, AsStoreConnection, DeadOutboxRow, EnqueueLimits,
    DEFAULT_MAX_OUTBOX_PAYLOAD, MAX_OUTBOX_NAME_LEN, OUTBOX_CHANNEL,
};
pub use pool::{PooledStoreConnection, StoreManager};
pub use retention::Retention;
pub use store::{
    ClaimRecord, ClaimStatus, DeadLetter, Store, StoreBuilder, DEFAULT_BATCH_DEADLINE,
    DEFAULT_STATEMENT_TIMEOUT,
};
pub use tls::init_tls;
pub use url::{redact, Backend};
