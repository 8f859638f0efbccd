//! Whether the connection this thread holds may be gone: a statement on it failed.
//!
//! The store's errors are made (converted from diesel's) on the thread that holds the
//! connection, and that thread returns it to the pool, whose `has_broken` then looks
//! (see `pool.rs`). Its own module so that the error type and the pool both reach it
//! without reaching each other.

use std::cell::Cell;

thread_local! {
    /// Whether a statement failed on this thread since the pool last took a
    /// connection back from it.
    static SUSPECT: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread's connection as possibly gone.
pub(crate) fn mark() {
    SUSPECT.with(|s| s.set(true));
}

/// Whether a statement failed on this thread since the last call, clearing the mark.
pub(crate) fn take() -> bool {
    SUSPECT.with(|s| s.replace(false))
}
