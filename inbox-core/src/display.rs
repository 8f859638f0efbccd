//! Showing text a publisher controls to a person: in a log line, a terminal, a page.
//!
//! A message id, a type, a tenant, a header or an error text comes from whoever
//! published the message. Written as it is, a `\n` in it starts a second, well-formed
//! log line (a forged `ERROR` event), an ESC drives the terminal of whoever runs
//! `tail -f`, and a bidi override shows a key other than the stored one. [`escape`]
//! makes every such character visible: one value stays one line of plain text.
//!
//! ```
//! use inbox_core::display::{escape, Escaped};
//! assert_eq!(escape("evt-1"), "evt-1");
//! assert_eq!(escape("a\nERROR forged"), "a\\u{a}ERROR forged");
//! assert_eq!(format!("{}", Escaped("\u{1b}[2J")), "\\u{1b}[2J");
//! // In a tracing event: `tracing::warn!(key = %Escaped(&key), "...")`.
//! ```

use std::borrow::Cow;
use std::fmt;

/// Whether `c` is shown escaped: C0 controls (all of them, `\t` and `\n` included),
/// DEL, C1 controls, the line and paragraph separators, and the Unicode format
/// characters that reorder or hide text (bidi marks, embeddings, overrides and
/// isolates, zero-width characters, the soft hyphen, the byte-order mark, the
/// interlinear annotation marks); the backslash too, so that an escape is unambiguous.
fn needs_escape(c: char) -> bool {
    matches!(
        c,
        '\u{0}'..='\u{1f}'
            | '\u{7f}'..='\u{9f}'
            | '\\'
            | '\u{ad}'
            | '\u{61c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
    )
}

/// `s` with every character a terminal or a log reader would act on made visible:
/// controls and format characters as `\u{..}` (lower-case hex), the backslash as
/// `\\`. Borrowed when nothing needed escaping.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        push_escaped(&mut out, c);
    }
    Cow::Owned(out)
}

fn push_escaped(out: &mut String, c: char) {
    use std::fmt::Write as _;
    match c {
        '\\' => out.push_str("\\\\"),
        c if needs_escape(c) => {
            // Writing to a String cannot fail.
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
        c => out.push(c),
    }
}

/// A value shown through [`escape`], for a `tracing` field (`key = %Escaped(&key)`)
/// or a `format!`.
#[derive(Clone, Copy, Debug)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_borrowed_and_unchanged() {
        assert!(matches!(escape("usage.recorded é 日本"), Cow::Borrowed(_)));
    }

    #[test]
    fn controls_format_characters_and_the_backslash_are_made_visible() {
        assert_eq!(escape("a\nb\r\tc"), "a\\u{a}b\\u{d}\\u{9}c");
        assert_eq!(escape("\u{1b}]0;title\u{7}"), "\\u{1b}]0;title\\u{7}");
        assert_eq!(escape("\u{7f}\u{85}\u{9b}"), "\\u{7f}\\u{85}\\u{9b}");
        assert_eq!(escape("key\u{202e}fdp"), "key\\u{202e}fdp");
        assert_eq!(escape("a\u{2028}b\u{feff}"), "a\\u{2028}b\\u{feff}");
        assert_eq!(escape("\\u{a}"), "\\\\u{a}");
        assert_eq!(escape("\0"), "\\u{0}");
    }

    #[test]
    fn an_escaped_value_has_no_control_character_left() {
        let all: String = (0u32..0x3000).filter_map(char::from_u32).collect();
        let shown = escape(&all);
        // Judged by the standard library's idea of a control character (C0, DEL, C1).
        assert!(!shown.chars().any(char::is_control));
        assert_eq!(format!("{}", Escaped(&all)), shown);
    }
}
