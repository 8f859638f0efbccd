//! Why a batch transaction did not commit, as the steps report it and the retry
//! loop acts on it.

use inbox_core::HandlerFailure;

use crate::backend::{classify, ErrorClass};
use crate::Error;

/// Why a batch transaction did not commit.
pub(super) enum TxError {
    /// Deadlock, serialization failure or SQLITE_BUSY: run the batch again.
    Retryable(diesel::result::Error),
    /// A handler failed in the optimistic run: run again with a savepoint each. When
    /// the failing delivery is known (by index), its failure is recorded as is
    /// instead of calling its handler a second time.
    Isolate(Option<(usize, HandlerFailure)>),
    /// One of the store's own statements failed on a delivery's data (a data
    /// exception, SQLSTATE class 22): split the batch until the delivery is alone.
    Data(diesel::result::Error),
    /// A handler ended or restarted the store's transaction itself (named): what it
    /// committed cannot be isolated any more.
    Ended(String),
    /// Anything else: nothing committed, the transport acks nothing.
    Fatal(Error),
}

impl From<diesel::result::Error> for TxError {
    fn from(err: diesel::result::Error) -> Self {
        match classify(&err) {
            ErrorClass::Contention => Self::Retryable(err),
            ErrorClass::Data => Self::Data(err),
            // On the store's own statements a constraint error is the schema's fault
            // (a unique index the store did not verify, say), never a delivery's: fail
            // loudly and ack nothing rather than dead-letter innocent messages.
            ErrorClass::Integrity | ErrorClass::Infrastructure | ErrorClass::Other => {
                Self::Fatal(Error::Database(err))
            }
        }
    }
}

impl From<Error> for TxError {
    fn from(err: Error) -> Self {
        match err {
            Error::Database(db) => db.into(),
            other => Self::Fatal(other),
        }
    }
}
