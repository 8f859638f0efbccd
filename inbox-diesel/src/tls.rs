//! Keeps the TLS library's exit cleanup from racing connection threads.
//!
//! libpq negotiates TLS through the system OpenSSL. OpenSSL registers an `atexit`
//! handler (`OPENSSL_cleanup`) the first time it is initialised; when a process exits
//! while a pool thread is still inside `PQconnectPoll` -> `SSL_CTX_new`, that handler
//! frees what the thread is using and the process dies with SIGSEGV instead of its own
//! exit code. r2d2 opens connections on background threads (to refill `min_idle`), so
//! any program that exits soon after using the store can hit it.
//!
//! The store's own guard is its pool's gate (see the `pool` module): its last drop
//! waits until no pool thread is connecting. This is the second guard, for a process
//! that exits while a store is still alive (`std::process::exit`, a store held in a
//! static). Initialising OpenSSL first with `OPENSSL_INIT_NO_ATEXIT` (what
//! `openssl_sys::init` does) means no cleanup runs at exit: the operating system reclaims the memory, and
//! a thread still connecting simply stops with the process. OpenSSL decides this at its
//! first initialisation only, so it must happen before the process's first libpq
//! connection: the store does it before each of its own connections, and a program
//! that connects to PostgreSQL before it builds a store calls [`init_tls`] first.

/// Initialises the TLS library so that its exit cleanup never runs under a thread
/// that is still connecting. Idempotent and cheap; call it at the start of `main`
/// (or before your first `PgConnection::establish`) if your program opens PostgreSQL
/// connections before it builds a [`Store`](crate::Store). The store calls it itself
/// before every connection it opens.
///
/// ```
/// inbox_diesel::init_tls();
/// inbox_diesel::init_tls(); // once is enough; again is a no-op
/// ```
pub fn init_tls() {
    #[cfg(feature = "postgres")]
    openssl_sys::init();
}
