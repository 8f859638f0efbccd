//! The store's connection pool: r2d2 over diesel, with a gate that lets the store
//! wait for the pool's own connection threads when it is dropped.
//!
//! r2d2 opens connections on background threads (to refill `min_idle`, or for a
//! checkout that found none idle). A process that exits while one of them is inside
//! libpq's connection setup (TLS, GSSAPI) runs those libraries' exit cleanup under a
//! live thread and can die with SIGSEGV after its work is done. So the last drop of a
//! store closes the gate (no new connection starts) and waits, bounded, until no pool
//! thread is still connecting.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use diesel::r2d2::{ConnectionManager, ManageConnection, PooledConnection, R2D2Connection};
use diesel::ConnectionError;

/// The longest a dropped store waits for a connection still being opened.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Connections being opened, and whether the store is closed.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<(bool, usize)>,
    idle: Condvar,
}

/// The r2d2 manager of a store's pool: diesel's [`ConnectionManager`] behind a gate
/// that the store closes when its last clone is dropped.
pub struct StoreManager<C: R2D2Connection + 'static> {
    inner: ConnectionManager<C>,
    gate: Arc<Gate>,
    /// To redact the driver's errors: r2d2 logs them and keeps the last one in its
    /// time-out error. Never printed.
    url: String,
}

impl<C: R2D2Connection + 'static> std::fmt::Debug for StoreManager<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreManager")
            .field("inner", &self.inner)
            .field("gate", &self.gate)
            .field("url", &crate::redact(&self.url))
            .finish()
    }
}

/// A connection checked out of a store's pool.
pub type PooledStoreConnection<C> = PooledConnection<StoreManager<C>>;

impl<C: R2D2Connection + Send + 'static> StoreManager<C> {
    pub(crate) fn new(url: String) -> (Self, Closer) {
        let gate = Arc::new(Gate::default());
        let closer = Closer(Arc::clone(&gate));
        (
            Self {
                inner: ConnectionManager::new(url.clone()),
                gate,
                url,
            },
            closer,
        )
    }
}

impl<C: R2D2Connection + Send + 'static> ManageConnection for StoreManager<C> {
    type Connection = C;
    type Error = diesel::r2d2::Error;

    fn connect(&self) -> Result<C, Self::Error> {
        {
            let mut state = self
                .gate
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if state.0 {
                return Err(diesel::r2d2::Error::ConnectionError(
                    ConnectionError::BadConnection("the store is closed".to_owned()),
                ));
            }
            state.1 += 1;
        }
        let conn = self.inner.connect().map_err(|err| match err {
            diesel::r2d2::Error::ConnectionError(source) => {
                diesel::r2d2::Error::ConnectionError(ConnectionError::BadConnection(
                    inbox_core::RedactedError::new(&source, &self.url).to_string(),
                ))
            }
            other => other,
        });
        let mut state = self
            .gate
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        state.1 -= 1;
        self.gate.idle.notify_all();
        conn
    }

    fn is_valid(&self, conn: &mut C) -> Result<(), Self::Error> {
        self.inner.is_valid(conn)
    }

    /// diesel's check (a transaction left open or broken), and, after a statement
    /// failed on this thread, a `SELECT 1`: a connection whose server session is
    /// gone (killed while idle, a primary that died) fails every later statement,
    /// and kept in the pool it would fail every later call. The pool tests nothing on
    /// check-out (a round trip per batch), so this is where a dead connection goes:
    /// the call that met it fails, the next one gets a new connection (which, with
    /// `target_session_attrs=read-write`, finds the new primary).
    fn has_broken(&self, conn: &mut C) -> bool {
        if self.inner.has_broken(conn) {
            return true;
        }
        crate::suspect::take() && self.inner.is_valid(conn).is_err()
    }
}

/// Closes a pool's gate and waits for its connecting threads; held by the store.
#[derive(Debug)]
pub(crate) struct Closer(Arc<Gate>);

impl Closer {
    /// No connection starts after this; returns once none is being opened (or after
    /// [`CLOSE_WAIT`], with a warning: a connect that hangs longer is the network's).
    pub(crate) fn close(&self) {
        let deadline = Instant::now() + CLOSE_WAIT;
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 = true;
        while state.1 > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    connecting = state.1,
                    "store dropped while pool threads were still connecting"
                );
                return;
            }
            state = self
                .0
                .idle
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(feature = "postgres")]
    fn pool_connect_errors_hold_no_password() {
        crate::init_tls();
        // libpq quotes a bad percent escape back; the pool keeps and logs that text.
        let url = "postgres://app:pa%zzss@127.0.0.1/x?password=s3%zzcret";
        let (manager, _closer) = StoreManager::<diesel::PgConnection>::new(url.to_owned());
        let Err(err) = manager.connect() else {
            panic!("connected with a bad percent escape");
        };
        for text in [err.to_string(), format!("{err:?}"), format!("{manager:?}")] {
            assert!(
                !text.contains("pa%zzss") && !text.contains("s3%zzcret"),
                "{text}"
            );
        }
        assert!(err.to_string().contains("percent"), "{err}");
    }
}
