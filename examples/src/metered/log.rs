//! Text a client or a publisher controls, made safe for a log line: one event, one
//! line. Control characters (C0, DEL, C1) become visible escapes and a backslash is
//! doubled, so an escaped value cannot forge a line, move the cursor or hide text.
//!
//! The same behaviour as `inbox_core::display::{escape, Escaped}`, which the example
//! switches to once it is in the crate.

use std::borrow::Cow;
use std::fmt;

/// `text` with `\n`, `\r`, `\t` as themselves escaped, every other control
/// character as `\x1b` (C0, DEL) or `\u{85}` (C1) and `\` as `\\`; borrowed when
/// nothing needs escaping.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    c == '\\' || c.is_control()
}

/// Displays its text [`escape`]d: `tracing::warn!(error = %Escaped(&text), ...)`.
#[derive(Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

impl fmt::Debug for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// [`Escaped`] of a value's `Display` (an error whose text may quote a client).
pub fn escaped(value: &dyn fmt::Display) -> String {
    escape(&value.to_string()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_made_visible() {
        assert!(matches!(escape("plain text é"), Cow::Borrowed(_)));
        assert_eq!(
            escape("a\nERROR forged\r\x1b]0;title\x07\u{85}\u{9b}2J\x7f\\"),
            "a\\nERROR forged\\r\\x1b]0;title\\x07\\u{85}\\u{9b}2J\\x7f\\\\"
        );
        assert_eq!(Escaped("x\ty").to_string(), "x\\ty");
    }
}
