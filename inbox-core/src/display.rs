//! Showing a value a publisher controls to a person: one rule for the CLI's human
//! output, the logs and any console.
//!
//! A message key, type, tenant, header, error text or payload comes from whoever can
//! publish on the exchange. Written raw to a terminal, its control characters act: ESC
//! starts a sequence that clears the screen, sets the window title or (OSC 52) writes
//! the clipboard, CSI (C1 `0x9b`) does the same on terminals that read C1 controls, a
//! newline forges a whole line of the operator's view or of a log, and a bidi override
//! makes text read in another order than it is stored. [`escape`] makes every such
//! character visible and leaves the rest as it is, so one value stays one line:
//!
//! - `\` becomes `\\` (so an escape in the output is never the publisher's own text);
//! - newline, carriage return and tab become `\n`, `\r`, `\t`;
//! - every other control character (C0 `U+0000..U+001F`, DEL `U+007F`, C1
//!   `U+0080..U+009F`), every format character (Unicode category Cf: bidi overrides and
//!   isolates, zero-width characters, the byte order mark, tag characters, ...) and the
//!   line and paragraph separators `U+2028`, `U+2029` become `\u{..}` (lower-case hex, as
//!   Rust writes them);
//! - [`escape_bytes`] shows bytes that are not UTF-8 as `\xNN`.
//!
//! ```
//! use inbox_core::display::{escape, escape_bytes, Escaped};
//! assert_eq!(escape("k-1"), "k-1");
//! assert_eq!(escape("k\u{1b}]52;c;aGk=\u{7}"), r"k\u{1b}]52;c;aGk=\u{7}");
//! assert_eq!(escape("a\nERROR fake"), r"a\nERROR fake");
//! assert_eq!(escape("\u{202e}txt.exe"), r"\u{202e}txt.exe");
//! assert_eq!(escape_bytes(b"ok\xff\x9b"), r"ok\xff\x9b");
//! assert_eq!(format!("key={}", Escaped("a\rb")), r"key=a\rb");
//! ```

use std::borrow::Cow;
use std::fmt::{self, Write as _};

/// Whether [`escape`] replaces `c`: a control character (C0, DEL, C1), a format
/// character (Unicode category Cf) or a line or paragraph separator; and `\`.
///
/// ```
/// use inbox_core::display::is_escaped;
/// assert!(is_escaped('\u{1b}') && is_escaped('\u{9b}') && is_escaped('\u{200b}'));
/// assert!(!is_escaped('a') && !is_escaped('é') && !is_escaped(' '));
/// ```
pub fn is_escaped(c: char) -> bool {
    c == '\\' || c.is_control() || is_format(c) || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Unicode's format characters (general category Cf, Unicode 15).
fn is_format(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{0600}'..='\u{0605}'
            | '\u{061c}'
            | '\u{06dd}'
            | '\u{070f}'
            | '\u{0890}'..='\u{0891}'
            | '\u{08e2}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
            | '\u{110bd}'
            | '\u{110cd}'
            | '\u{13430}'..='\u{1343f}'
            | '\u{1bca0}'..='\u{1bca3}'
            | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0001}'
            | '\u{e0020}'..='\u{e007f}'
    )
}

/// Writes `text` escaped; with `quote`, a `"` as `\"` too (for `Debug`).
fn write_escaped(out: &mut impl fmt::Write, text: &str, quote: bool) -> fmt::Result {
    let mut rest = text;
    while let Some(at) = rest.find(|c| is_escaped(c) || (quote && c == '"')) {
        out.write_str(&rest[..at])?;
        let c = rest[at..].chars().next().unwrap_or_default();
        match c {
            '"' => out.write_str("\\\"")?,
            '\\' => out.write_str(r"\\")?,
            '\n' => out.write_str(r"\n")?,
            '\r' => out.write_str(r"\r")?,
            '\t' => out.write_str(r"\t")?,
            other => write!(out, "\\u{{{:x}}}", u32::from(other))?,
        }
        rest = &rest[at + c.len_utf8()..];
    }
    out.write_str(rest)
}

/// `text` with every character that [`is_escaped`] made visible (see the module
/// docs); borrowed when there is none.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.contains(is_escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    let _ = write_escaped(&mut out, text, false);
    Cow::Owned(out)
}

/// Bytes as [`escape`]d text: UTF-8 runs escaped, every byte that is not part of valid
/// UTF-8 as `\xNN`.
pub fn escape_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        let _ = write_escaped(&mut out, chunk.valid(), false);
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

/// Displays its text [`escape`]d, without allocating: for a log field
/// (`tracing::info!(key = %Escaped(&key))`) or a `format!`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0, false)
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        write_escaped(f, self.0, true)?;
        f.write_char('"')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_character_is_made_visible() {
        for c in (0u32..0x20).chain([0x7f]).chain(0x80..0xa0) {
            let c = char::from_u32(c).unwrap_or_default();
            let shown = escape(&c.to_string()).into_owned();
            assert!(shown.starts_with('\\'), "{c:?}: {shown}");
            assert!(!shown.chars().any(char::is_control), "{c:?}: {shown}");
        }
        assert_eq!(
            escape("\u{0}\u{7f}\u{85}\u{9b}"),
            r"\u{0}\u{7f}\u{85}\u{9b}"
        );
    }

    #[test]
    fn format_characters_and_separators_are_made_visible() {
        for c in [
            '\u{202a}',
            '\u{202e}',
            '\u{2066}',
            '\u{2069}',
            '\u{200e}',
            '\u{200f}',
            '\u{061c}',
            '\u{200b}',
            '\u{feff}',
            '\u{00ad}',
            '\u{e0041}',
            '\u{2028}',
            '\u{2029}',
        ] {
            let shown = escape(&format!("a{c}b")).into_owned();
            assert_eq!(shown, format!("a\\u{{{:x}}}b", u32::from(c)));
        }
    }

    #[test]
    fn plain_text_is_borrowed_and_kept() {
        for text in ["", "k-1", "usage.recorded", "été 東京 🙂", "a b"] {
            assert!(matches!(escape(text), Cow::Borrowed(t) if t == text));
        }
    }

    #[test]
    fn escapes_are_unambiguous() {
        // A publisher's own `\n` text is not a newline the output made visible.
        assert_eq!(escape(r"a\nb"), r"a\\nb");
        assert_ne!(escape(r"a\nb"), escape("a\nb"));
        assert_eq!(escape("tab\there\r\n"), r"tab\there\r\n");
    }

    #[test]
    fn bytes_that_are_not_utf8_are_hex() {
        assert_eq!(escape_bytes(b"{\"a\":1}"), r#"{"a":1}"#);
        assert_eq!(escape_bytes(b"\x1b[2J\xc3\x28\n"), r"\u{1b}[2J\xc3(\n");
        assert_eq!(escape_bytes("\u{9b}".as_bytes()), r"\u{9b}");
        assert_eq!(escape_bytes(b"\x9b"), r"\x9b");
    }

    #[test]
    fn the_display_wrapper_writes_the_same() {
        let text = "k\u{1b}[31m\n\u{202e}\\";
        assert_eq!(Escaped(text).to_string(), escape(text));
        assert_eq!(format!("{:?}", Escaped("a\"b\n")), r#""a\"b\n""#);
    }
}
