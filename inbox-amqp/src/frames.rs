//! Frames the client cannot parse, and the stack that parsing the deepest one needs.
//!
//! lapin 4.12 / amq-protocol-types 10.6 parse a content header on lapin's own I/O
//! thread (`lapin-io-loop`, spawned with the standard library's default stack, which
//! `RUST_MIN_STACK` sets). Two inputs another client may publish break it:
//!
//! - a short string (`message_id`, `type`, a header name) that is not UTF-8 fails the
//!   parse (`String::from_utf8`), and lapin fails the whole connection
//!   (`ErrorKind::ParsingError`): the consumer handles that loss (see
//!   `SessionEnd::Unreadable` and the cautious session in `consumer`);
//! - `parse_field_table` / `parse_value` recurse once per nesting level with no bound,
//!   so a deeply nested header table overflows that thread's stack and aborts the
//!   process. The consumer bounds the depth by asking for frames of at most
//!   [`FRAME_MAX`] bytes (a level costs at least 6 bytes), and the stack that the
//!   deepest such table needs is [`frame_parse_stack`]. lapin spawns that thread
//!   without a size, so the only lever is the process default that `RUST_MIN_STACK`
//!   sets: [`reserve_frame_stack`], called first thing in `main`, sets it while the
//!   process has one thread (changing the environment while another thread may read
//!   it is a data race, so it refuses then); `Consumer::run` warns when it is lower.
//!
//! What would remove the need for both mitigations is a fix in amq-protocol-types: a
//! depth limit in `parse_value` (a parse error past, say, 100 levels), and short
//! strings kept as bytes (or decoded lossily) instead of refused, so that one message
//! fails alone and the runtime dead-letters it.

/// The largest frame the consumer accepts: the `frame_max` it asks for (RabbitMQ's
/// default; a URL asking for less keeps its own).
pub const FRAME_MAX: u32 = 131_072;

/// The fewest bytes a nesting level of a header table takes: an empty name (1), the
/// `F` tag (1), the table's length (4).
const BYTES_PER_LEVEL: u32 = 6;

/// Stack lapin's parser takes per nesting level, measured with lapin 4.12.3 /
/// amq-protocol 10.6.3 on x86-64 through lapin's own two-slice parsing input: the
/// deepest table (21,835 levels with a `deep` header) parsed in 49 MiB and not in 48
/// in a release build (about 2.35 KB a level), in 270 MiB and not in 260 in a debug
/// build (about 12.9 KB a level); rounded up by a tenth.
const STACK_PER_LEVEL_RELEASE: usize = 2_600;
const STACK_PER_LEVEL_DEBUG: usize = 14_200;

/// The stack the thread parsing frames needs for the deepest header table a frame of
/// [`FRAME_MAX`] bytes holds (21,845 levels), plus 1 MiB for the rest of the thread,
/// rounded up to a MiB: 56 MiB in a release build, 297 MiB in a debug build (the
/// figure of the build this crate is compiled in).
pub fn frame_parse_stack() -> usize {
    let per_level = if cfg!(debug_assertions) {
        STACK_PER_LEVEL_DEBUG
    } else {
        STACK_PER_LEVEL_RELEASE
    };
    let levels = (FRAME_MAX / BYTES_PER_LEVEL) as usize;
    let need = levels * per_level + (1 << 20);
    need.div_ceil(1 << 20) << 20
}

/// What [`reserve_frame_stack`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameStack {
    /// `RUST_MIN_STACK` already asked for at least [`frame_parse_stack`] bytes.
    Kept,
    /// It was unset, unreadable or lower, and is now [`frame_parse_stack`].
    Set,
    /// Other threads were running, so the environment was left as it was (the
    /// consumer warns at its start when the stack is too small).
    ThreadsRunning,
    /// The thread count could not be read (a system other than Linux, or no
    /// `/proc`), so the environment was left as it was: set `RUST_MIN_STACK` before
    /// the program starts.
    Unverified,
}

/// Sets `RUST_MIN_STACK` to [`frame_parse_stack`] when it asks for less, so that
/// lapin's frame-parsing thread survives the deepest header table a frame holds.
///
/// Call it first thing in `main`, before any thread exists (a tokio runtime, a
/// connection pool, ...): the standard library reads the variable once, at the
/// first thread spawned without an explicit size, and keeps that figure for the
/// process. It counts the process's threads (`/proc/self/status`, Linux) and, with
/// more than one, changes nothing and returns [`FrameStack::ThreadsRunning`]; where
/// it cannot count them it changes nothing either ([`FrameStack::Unverified`]).
/// The value is read as the standard library reads it, untrimmed: `"58720256\n"` does
/// not parse there (it falls back to 2 MiB), so here it counts as lower and is
/// replaced. Child processes inherit the variable. `inbox_cli::service::init` calls it.
pub fn reserve_frame_stack() -> FrameStack {
    let need = frame_parse_stack();
    if suffices(std::env::var("RUST_MIN_STACK").ok().as_deref()) {
        return FrameStack::Kept;
    }
    match threads_running() {
        Some(1) => {}
        Some(_) => return FrameStack::ThreadsRunning,
        None => return FrameStack::Unverified,
    }
    std::env::set_var("RUST_MIN_STACK", need.to_string());
    FrameStack::Set
}

/// Whether a `RUST_MIN_STACK` value gives at least [`frame_parse_stack`] bytes, read
/// as the standard library reads it: untrimmed, so `"58720256\n"` gives 2 MiB there.
fn suffices(rust_min_stack: Option<&str>) -> bool {
    rust_min_stack
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|v| v >= frame_parse_stack())
}

/// The process's thread count, where the system tells it.
fn threads_running() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

/// Logs one warning when `rust_min_stack` (the `RUST_MIN_STACK` variable) is unset,
/// unreadable or below [`frame_parse_stack`]; whether it warned.
pub(crate) fn warn_on_small_stack(rust_min_stack: Option<&str>) -> bool {
    let need = frame_parse_stack();
    if suffices(rust_min_stack) {
        return false;
    }
    tracing::warn!(
        rust_min_stack = rust_min_stack.unwrap_or("unset"),
        need,
        "RUST_MIN_STACK is below the stack lapin's frame parser needs for the deepest header \
         table a frame holds; a message with such a table would abort the process. Set \
         RUST_MIN_STACK={need} before the program starts, or call \
         inbox_amqp::reserve_frame_stack first thing in main"
    );
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stack_needed_covers_the_deepest_table() {
        let need = frame_parse_stack();
        let levels = (FRAME_MAX / BYTES_PER_LEVEL) as usize;
        assert_eq!(levels, 21_845);
        assert!(need >= levels * STACK_PER_LEVEL_RELEASE);
        assert_eq!(need % (1 << 20), 0);
        let expected_mib = if cfg!(debug_assertions) { 297 } else { 56 };
        assert_eq!(need >> 20, expected_mib);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn the_thread_count_is_read() {
        // The test harness runs this test on a thread of its own.
        assert!(threads_running().is_some_and(|n| n >= 2));
    }

    #[test]
    fn with_threads_running_or_uncounted_the_environment_is_left_alone() {
        let before = std::env::var_os("RUST_MIN_STACK");
        let outcome = reserve_frame_stack();
        if before
            .as_deref()
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<usize>().ok())
            .is_some_and(|v| v >= frame_parse_stack())
        {
            assert_eq!(outcome, FrameStack::Kept);
        } else if cfg!(target_os = "linux") {
            assert_eq!(outcome, FrameStack::ThreadsRunning);
        } else {
            assert_eq!(outcome, FrameStack::Unverified);
        }
        assert_eq!(std::env::var_os("RUST_MIN_STACK"), before);
    }

    #[test]
    fn a_small_or_missing_stack_setting_warns() {
        let need = frame_parse_stack();
        assert!(warn_on_small_stack(None));
        assert!(warn_on_small_stack(Some("2097152")));
        assert!(warn_on_small_stack(Some("lots")));
        assert!(!warn_on_small_stack(Some(&need.to_string())));
        assert!(!warn_on_small_stack(Some(&(need * 2).to_string())));
        // The standard library does not trim: a trailing newline leaves 2 MiB.
        assert!(warn_on_small_stack(Some(&format!("{need}\n"))));
        assert!(warn_on_small_stack(Some(&format!(" {need}"))));
    }
}
