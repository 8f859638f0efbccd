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
//!   deepest such table needs is [`frame_parse_stack`]: a program sets
//!   `RUST_MIN_STACK` to at least that before any thread starts (a library must not
//!   set the process environment; `Consumer::run` warns when it is lower).
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

/// Logs one warning when `rust_min_stack` (the `RUST_MIN_STACK` variable) is unset,
/// unreadable or below [`frame_parse_stack`]; whether it warned.
pub(crate) fn warn_on_small_stack(rust_min_stack: Option<&str>) -> bool {
    let need = frame_parse_stack();
    let set = rust_min_stack.and_then(|v| v.trim().parse::<usize>().ok());
    if set.is_some_and(|set| set >= need) {
        return false;
    }
    tracing::warn!(
        rust_min_stack = rust_min_stack.unwrap_or("unset"),
        need,
        "RUST_MIN_STACK is below the stack lapin's frame parser needs for the deepest header \
         table a frame holds; a message with such a table would abort the process. Set \
         RUST_MIN_STACK={need} before the program starts"
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
    fn a_small_or_missing_stack_setting_warns() {
        let need = frame_parse_stack();
        assert!(warn_on_small_stack(None));
        assert!(warn_on_small_stack(Some("2097152")));
        assert!(warn_on_small_stack(Some("lots")));
        assert!(!warn_on_small_stack(Some(&need.to_string())));
        assert!(!warn_on_small_stack(Some(&(need * 2).to_string())));
    }
}
