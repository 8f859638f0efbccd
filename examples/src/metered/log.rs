//! Text a client or a publisher controls, made safe for a log line: one event, one
//! line. The framework's one rule, [`inbox_core::display`]: control characters (C0,
//! DEL, C1), format characters and line separators become visible escapes and a
//! backslash is doubled, so an escaped value cannot forge a line, move the cursor or
//! hide text.

use std::fmt;

pub use inbox_core::display::{escape, Escaped};

/// [`Escaped`] of a value's `Display` (an error whose text may quote a client).
pub fn escaped(value: &dyn fmt::Display) -> String {
    escape(&value.to_string()).into_owned()
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    #[test]
    fn control_characters_are_made_visible() {
        assert!(matches!(escape("plain text é"), Cow::Borrowed(_)));
        let shown = escape("a\nERROR forged\r\x1b]0;title\x07\u{85}\u{9b}2J\x7f\\");
        assert_eq!(
            shown,
            "a\\nERROR forged\\r\\u{1b}]0;title\\u{7}\\u{85}\\u{9b}2J\\u{7f}\\\\"
        );
        assert!(!shown.chars().any(char::is_control));
        assert_eq!(Escaped("x\ty").to_string(), "x\\ty");
        assert_eq!(escaped(&"e\nf"), "e\\nf");
    }
}
