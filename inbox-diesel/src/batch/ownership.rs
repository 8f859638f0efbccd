//! Whose the transaction is after a handler call: still the store's and usable,
//! aborted by an error the handler swallowed, or ended or restarted by the handler.
//! Read from the transaction's token before the store decides, never after a
//! `COMMIT` that PostgreSQL turned into a rollback.

use super::tx::TxError;
use crate::backend::{classify, ErrorClass, StoreConnection};

/// A handler returned `Ok` although a statement of its own had failed: PostgreSQL
/// aborted the transaction, and a `COMMIT` would silently have rolled everything back.
#[derive(Debug, thiserror::Error)]
#[error("the handler returned Ok after a database error it did not propagate (the transaction was aborted)")]
pub(super) struct SwallowedDatabaseError(#[source] pub(super) diesel::result::Error);

/// What the store finds of its transaction after a handler call.
pub(super) enum TxCheck {
    /// Still its own, and usable.
    Ours,
    /// Aborted by an error the handler swallowed.
    Aborted(diesel::result::Error),
    /// Ended or restarted by the handler.
    Replaced,
}

/// Whose the transaction is after a handler call failed.
pub(super) enum Ownership {
    /// The store's, and usable as it was.
    Usable,
    /// The store's, aborted by an error (a swallowed one, or the failing call's own);
    /// usable again after the rollback to the handlers' savepoint.
    WasAborted,
    /// Ended or restarted by the handler.
    Replaced,
}

/// After a failed handler call: an aborted transaction is rolled back to the handlers'
/// savepoint, which exists only in the store's own transaction; a rollback that fails
/// means the handler replaced it (an aborted state hides the transaction id).
pub(super) fn ownership_after_failure<C: StoreConnection>(
    conn: &mut C,
    token: Option<&str>,
) -> std::result::Result<Ownership, TxError> {
    match check_transaction(conn, token)? {
        TxCheck::Ours => Ok(Ownership::Usable),
        TxCheck::Replaced => Ok(Ownership::Replaced),
        TxCheck::Aborted(_) => match conn.batch_execute("ROLLBACK TO SAVEPOINT inbox_handlers") {
            Ok(()) => match check_transaction(conn, token)? {
                TxCheck::Ours => Ok(Ownership::WasAborted),
                _ => Ok(Ownership::Replaced),
            },
            Err(err) if classify(&err) == ErrorClass::Infrastructure => Err(err.into()),
            Err(_) => Ok(Ownership::Replaced),
        },
    }
}

/// Checks, after a handler call, that the transaction is still usable and still the
/// store's own: before the store decides, never after a `COMMIT` that PostgreSQL
/// turned into a rollback.
pub(super) fn check_transaction<C: StoreConnection>(
    conn: &mut C,
    token: Option<&str>,
) -> std::result::Result<TxCheck, TxError> {
    let Some(token) = token else {
        return Ok(TxCheck::Ours);
    };
    match C::transaction_token(conn) {
        Ok(Some(now)) if now == token => Ok(TxCheck::Ours),
        Ok(_) => Ok(TxCheck::Replaced),
        Err(err) if classify(&err) == ErrorClass::Infrastructure => Err(err.into()),
        Err(err) => Ok(TxCheck::Aborted(err)),
    }
}
