//! Connection URLs in messages: no password of a URL is ever printed.
//!
//! A password can sit in a URL's user info (`postgres://app:s3cret@db/x`), in its query
//! string (`postgres://app@db/x?password=s3cret`, which libpq accepts) or in a libpq
//! key=value string (`host=db password=s3cret`). Drivers repeat parts of the URL in
//! their own errors (libpq: `invalid percent-encoded token: "s3%zzcret"`), so a driver's
//! error is redacted too ([`RedactedError`]), not only the URL the message names.

use std::fmt;
use std::ops::Range;

/// What stands in for a password.
const MASK: &str = "***";

/// Replaces every password in a connection string with `***`: the password of a URL's
/// user info, the value of a `password` (or `sslpassword`) query parameter, and the
/// value of such a key in a libpq key=value string.
///
/// The user info is read the way the most lenient of the drivers reads it: it ends at
/// the last `@` before the path, so a password holding `?`, `#`, `:` or `@` is hidden
/// whole; a password holding a `/` (which no driver parses) is hidden up to the last
/// `@` of the string.
///
/// ```
/// use inbox_core::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/billing"), "postgres://app:***@db:5432/billing");
/// assert_eq!(redact_url("postgres://app@db/billing"), "postgres://app@db/billing");
/// assert_eq!(redact_url("postgres://app:pa?ss@db/x"), "postgres://app:***@db/x");
/// assert_eq!(redact_url("postgres://app@db/x?password=s3cret"), "postgres://app@db/x?password=***");
/// assert_eq!(redact_url("host=db password=s3cret"), "host=db password=***");
/// ```
pub fn redact_url(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut at = 0;
    for range in secret_ranges(url) {
        out.push_str(&url[at..range.start]);
        out.push_str(MASK);
        at = range.end;
    }
    out.push_str(&url[at..]);
    out
}

/// Replaces, in a driver's message about `url`, every password of `url` with `***`:
/// each as written, percent-decoded and percent-encoded, and the pieces a driver makes
/// of a password it split at a `@`, `/`, `?`, `#`, `:` or `&` where they stand alone.
///
/// ```
/// use inbox_core::redact_message;
/// let url = "postgres://app:pa%zzss@db/x";
/// assert_eq!(
///     redact_message(r#"invalid percent-encoded token: "pa%zzss""#, url),
///     r#"invalid percent-encoded token: "***""#,
/// );
/// ```
pub fn redact_message(text: &str, url: &str) -> String {
    // The URL quoted whole prints as `redact_url` prints it; only the text around it
    // is searched for passwords (a user named like the password keeps its name).
    if url.is_empty() || !text.contains(url) {
        return redact_text(text, url);
    }
    let redacted = redact_url(url);
    text.split(url)
        .map(|part| redact_text(part, url))
        .collect::<Vec<_>>()
        .join(&redacted)
}

/// [`redact_message`] on text that does not quote the URL whole.
fn redact_text(text: &str, url: &str) -> String {
    let mut whole = Vec::new();
    let mut pieces = Vec::new();
    for range in secret_ranges(url) {
        for form in forms(&url[range]) {
            if form.contains(DELIMITERS) {
                pieces.extend(
                    form.split(DELIMITERS)
                        .filter(|p| !p.is_empty())
                        .map(str::to_owned),
                );
            }
            whole.push(form);
        }
    }
    // Longest first: a password that contains another one is hidden whole.
    whole.sort_by_key(|s| std::cmp::Reverse(s.len()));
    whole.dedup();
    pieces.sort_by_key(|s| std::cmp::Reverse(s.len()));
    pieces.dedup();
    let mut out = text.to_owned();
    for secret in &whole {
        out = out.replace(secret.as_str(), MASK);
    }
    for piece in &pieces {
        out = replace_standalone(&out, piece);
    }
    out
}

/// Where drivers split a password that was not percent-encoded.
const DELIMITERS: [char; 6] = ['@', '/', '?', '#', ':', '&'];

/// A driver's error and every cause below it, as text with the passwords of the URL it
/// was given replaced by `***` (see [`redact_message`]). The chain keeps its shape:
/// [`source`](std::error::Error::source) yields the redacted cause.
///
/// ```
/// use inbox_core::RedactedError;
/// let url = "amqp:guest:s3cret@broker";
/// let driver = std::io::Error::other(format!("invalid url: {url}"));
/// let err = RedactedError::new(&driver, url);
/// assert_eq!(err.to_string(), "invalid url: amqp:***@broker");
/// assert!(!format!("{err:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedactedError {
    message: String,
    source: Option<Box<RedactedError>>,
}

impl RedactedError {
    /// Redacts `err` and each of its sources, for a connection to `url`.
    pub fn new(err: &(dyn std::error::Error + 'static), url: &str) -> Self {
        Self {
            message: redact_message(&err.to_string(), url),
            source: err.source().map(|cause| Box::new(Self::new(cause, url))),
        }
    }

    /// The redacted message of this level of the chain.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for RedactedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Only the redacted text: the driver's own `Debug` can hold the raw URL (a
/// `NulError` keeps its bytes).
impl fmt::Debug for RedactedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("RedactedError");
        s.field("message", &self.message);
        if let Some(source) = &self.source {
            s.field("source", source);
        }
        s.finish()
    }
}

impl std::error::Error for RedactedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// Replaces `piece` where it stands alone: not inside a longer word or number.
fn replace_standalone(text: &str, piece: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut before: Option<char> = None;
    while let Some(i) = rest.find(piece) {
        let prev = rest[..i].chars().next_back().or(before);
        let next = rest[i + piece.len()..].chars().next();
        let alone =
            !prev.is_some_and(char::is_alphanumeric) && !next.is_some_and(char::is_alphanumeric);
        out.push_str(&rest[..i]);
        if alone {
            out.push_str(MASK);
            before = Some('*');
        } else {
            out.push_str(piece);
            before = piece.chars().next_back();
        }
        rest = &rest[i + piece.len()..];
    }
    out.push_str(rest);
    out
}

/// The forms a password written as `raw` can take in a driver's text.
fn forms(raw: &str) -> Vec<String> {
    let mut forms = vec![raw.to_owned()];
    if let Some(unquoted) = unquote(raw) {
        forms.push(unquoted);
    }
    let decoded = percent_decode(raw);
    forms.push(percent_decode(&raw.replace('+', " ")));
    forms.push(percent_encode(&decoded));
    forms.push(decoded);
    forms.retain(|f| !f.is_empty());
    forms
}

/// A libpq key=value value in single quotes, without them and its escapes.
fn unquote(raw: &str) -> Option<String> {
    let inner = raw.strip_prefix('\'')?;
    let inner = inner.strip_suffix('\'').unwrap_or(inner);
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    Some(out)
}

/// Percent-decodes `s`, keeping a `%` that starts no valid escape; invalid UTF-8
/// becomes U+FFFD.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escape {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encodes every byte that is not an ASCII letter or digit, as lapin does
/// when it prints a URI.
fn percent_encode(s: &str) -> String {
    use fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for byte in s.bytes() {
        if byte.is_ascii_alphanumeric() {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// Whether a key names a password (`password`, `sslpassword`, in any case).
fn is_secret_key(key: &str) -> bool {
    percent_decode(key)
        .to_ascii_lowercase()
        .contains("password")
}

/// The byte ranges of `url` that hold a password, in order, not overlapping.
fn secret_ranges(url: &str) -> Vec<Range<usize>> {
    if is_conninfo(url) {
        return conninfo_secrets(url);
    }
    let (start, rest) = match url.find("://") {
        Some(i) => (i + 3, &url[i + 3..]),
        None => (0, url),
    };
    let mut ranges = Vec::new();
    let mut query_from = start;
    if let Some(at) = userinfo_end(rest, start > 0) {
        if let Some(colon) = rest[..at].find(':') {
            ranges.push(start + colon + 1..start + at);
            // A `?` inside the password starts no query string.
            query_from = start + at;
        }
    }
    if let Some(q) = url[query_from..].find('?') {
        ranges.extend(query_secrets(url, query_from + q + 1));
    }
    ranges.retain(|r| !r.is_empty());
    ranges
}

/// Where the user info of the text after a scheme's `//` (or of a scheme-less
/// string) ends: the last `@` before the first `/`. A string whose part before the
/// first `/` is `user:x` with `x` no port list, and an `@` after it, has a password
/// with a `/` in it: its user info ends at the last `@` of the string.
fn userinfo_end(rest: &str, after_slashes: bool) -> Option<usize> {
    let slash = rest.find('/').unwrap_or(rest.len());
    if let Some(at) = rest[..slash].rfind('@') {
        return Some(at);
    }
    let head = &rest[..slash];
    if !after_slashes || head.starts_with('[') {
        return None;
    }
    let colon = head.find(':')?;
    let port = head[colon + 1..].split(',').next().unwrap_or("");
    if port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    rest.rfind('@').filter(|&at| at > slash)
}

/// The ranges of the values of password keys in the query string that starts at
/// `from`. A value runs to the next `&`.
fn query_secrets(url: &str, from: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let mut at = from;
    for pair in url[from..].split('&') {
        if let Some(eq) = pair.find('=') {
            if is_secret_key(&pair[..eq]) {
                ranges.push(at + eq + 1..at + pair.len());
            }
        }
        at += pair.len() + 1;
    }
    ranges
}

/// Whether `s` is a libpq key=value string: it starts with `keyword =`.
fn is_conninfo(s: &str) -> bool {
    let s = s.trim_start();
    let key_len = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    key_len > 0 && s[key_len..].trim_start().starts_with('=')
}

/// The ranges of the values of password keys in a libpq key=value string, quotes
/// included. Parsed as libpq does: values are single-quoted (with `\` escapes) or run
/// to the next white space.
fn conninfo_secrets(s: &str) -> Vec<Range<usize>> {
    let bytes = s.as_bytes();
    let skip_space = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    let mut ranges = Vec::new();
    let mut i = skip_space(0);
    while i < bytes.len() {
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[key_start..i];
        i = skip_space(i);
        if bytes.get(i) != Some(&b'=') {
            break;
        }
        i = skip_space(i + 1);
        let value_start = i;
        let quoted = bytes.get(i) == Some(&b'\'');
        if quoted {
            i += 1;
        }
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 1,
                b'\'' if quoted => {
                    i += 1;
                    break;
                }
                b if !quoted && b.is_ascii_whitespace() => break,
                _ => {}
            }
            i += 1;
        }
        let value_end = i.min(bytes.len());
        if is_secret_key(key) && value_end > value_start {
            ranges.push(value_start..value_end);
        }
        i = skip_space(value_end);
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(url, redacted, password)`: the URL printed and what must never show.
    const URLS: &[(&str, &str, &str)] = &[
        (
            "postgres://app:s3cret@db:5432/billing",
            "postgres://app:***@db:5432/billing",
            "s3cret",
        ),
        (
            "postgresql://u:p%40ss@h/db?sslmode=disable",
            "postgresql://u:***@h/db?sslmode=disable",
            "p%40ss",
        ),
        (
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://guest:***@127.0.0.1:5672/%2f",
            "guest@",
        ),
        (
            "postgres://app:pa?ss@db/x",
            "postgres://app:***@db/x",
            "pa?ss",
        ),
        (
            "postgres://app:pa#ss@db/x",
            "postgres://app:***@db/x",
            "pa#ss",
        ),
        (
            "postgres://app:pa:ss@db/x",
            "postgres://app:***@db/x",
            "pa:ss",
        ),
        ("postgres://u:a@b@h/db", "postgres://u:***@h/db", "a@b"),
        (
            "postgres://app:pa/ss@db/x",
            "postgres://app:***@db/x",
            "pa/ss",
        ),
        (
            "postgres://app:pa?x/y@db/x",
            "postgres://app:***@db/x",
            "pa?x/y",
        ),
        (
            "amqp://app:p?a#s@s@rabbit:5672/%2f",
            "amqp://app:***@rabbit:5672/%2f",
            "p?a#s@s",
        ),
        (
            "postgres://app:pa%zzss@db/x",
            "postgres://app:***@db/x",
            "pa%zzss",
        ),
        (
            "postgres://app@db/x?password=s3cret",
            "postgres://app@db/x?password=***",
            "s3cret",
        ),
        (
            "postgres://app@db/x?sslmode=require&password=s3%3Fcret&application_name=a",
            "postgres://app@db/x?sslmode=require&password=***&application_name=a",
            "s3%3Fcret",
        ),
        (
            "postgres://db/x?PASSWORD=s3cret",
            "postgres://db/x?PASSWORD=***",
            "s3cret",
        ),
        (
            "postgres://db/x?sslpassword=k3y",
            "postgres://db/x?sslpassword=***",
            "k3y",
        ),
        (
            "postgres://app:one@db/x?password=two",
            "postgres://app:***@db/x?password=***",
            "two",
        ),
        (
            "postgres://db?password=s3cret",
            "postgres://db?password=***",
            "s3cret",
        ),
        (
            "host=db user=app password=s3cret dbname=x",
            "host=db user=app password=*** dbname=x",
            "s3cret",
        ),
        (
            "host=db password = 's3 cr\\'et' port=5432",
            "host=db password = *** port=5432",
            "s3 cr",
        ),
        (
            "host=db password='unterminated",
            "host=db password=***",
            "unterminated",
        ),
        ("app:s3cret@db/x", "app:***@db/x", "s3cret"),
        ("amqp:guest:s3cret@rabbit", "amqp:***@rabbit", "s3cret"),
        (
            "postgres://u@db?password=x@y",
            "postgres://u@db?password=***",
            "x@y",
        ),
    ];

    /// Strings with no password come back as they were.
    const PLAIN: &[&str] = &[
        "postgres://app@db/billing",
        "postgres://app:@db/x",
        "postgres://db/x",
        "postgres://h/db@x",
        "postgres://h:5432/db?application_name=a@b",
        "postgres://[::1]:5432/db",
        "postgres://h1:5432,h2:5433/db",
        "postgres://u@h/db?sslmode=require",
        "/tmp/a.db",
        "sqlite:///tmp/a.db",
        "file:inbox.db?mode=memory",
        "",
        "host=db user=app dbname=x",
    ];

    #[test]
    fn urls_print_without_their_password() {
        for &(url, redacted, password) in URLS {
            assert_eq!(redact_url(url), redacted, "{url}");
            assert!(!redact_url(url).contains(password), "{url}");
        }
    }

    #[test]
    fn urls_without_a_password_are_untouched() {
        for &url in PLAIN {
            assert_eq!(redact_url(url), url);
        }
    }

    #[test]
    fn a_message_repeating_the_url_loses_every_password() {
        for &(url, redacted, password) in URLS {
            let message = format!("could not parse \"{url}\": bad");
            assert_eq!(
                redact_message(&message, url),
                format!("could not parse \"{redacted}\": bad"),
                "{url}"
            );
            assert!(!redact_message(&message, url).contains(password), "{url}");
        }
    }

    #[test]
    fn libpq_messages_lose_the_password() {
        let cases = [
            // A bad percent escape is quoted back whole.
            (
                "postgres://app:pa%zzss@db/x",
                r#"invalid percent-encoded token: "pa%zzss""#,
                "pa%zzss",
            ),
            (
                "postgres://app@db/x?password=s%zzt",
                r#"invalid percent-encoded token: "s%zzt""#,
                "s%zzt",
            ),
            (
                "postgres://app:pa%00ss@db/x",
                r#"forbidden value %00 in percent-encoded value: "pa%00ss""#,
                "pa%00ss",
            ),
            // libpq ends the password at the first '@': the rest becomes the host.
            (
                "postgres://app:a@b@127.0.0.1/x",
                r#"could not translate host name "b@127.0.0.1" to address"#,
                "\"b@",
            ),
            // ... and at a '/': the head becomes the port.
            (
                "postgres://app:pa/ss@127.0.0.1/x",
                r#"invalid integer value "pa" for connection option "port""#,
                "\"pa\"",
            ),
            // The decoded form, should a driver print it.
            (
                "postgres://app:p%40ss@db/x",
                "password p@ss refused",
                "p@ss",
            ),
            // The re-encoded form (lapin prints URIs encoding every non-alphanumeric).
            (
                "amqp://app:p-ss@rabbit/%2f",
                "amqp://app:p%2Dss@rabbit:5672/%2F",
                "p%2Dss",
            ),
            (
                "host=db password='se cret'",
                "password se cret refused",
                "se cret",
            ),
        ];
        for (url, message, secret) in cases {
            let redacted = redact_message(message, url);
            assert!(!redacted.contains(secret), "{url}: {redacted}");
        }
    }

    #[test]
    fn pieces_are_hidden_only_where_they_stand_alone() {
        let url = "postgres://app:pa/ss@127.0.0.1/x";
        assert_eq!(
            redact_message(r#"invalid integer value "pa" for "port": password"#, url),
            r#"invalid integer value "***" for "port": password"#
        );
    }

    #[test]
    fn messages_without_a_password_are_untouched() {
        let message = "connection to server at \"db\" (10.0.0.1), port 5432 failed: FATAL:  password authentication failed for user \"app\"";
        for &url in PLAIN {
            assert_eq!(redact_message(message, url), message, "{url}");
        }
        assert_eq!(
            redact_message(message, "postgres://app:s3cret@db/x"),
            message
        );
    }

    #[test]
    fn the_whole_chain_is_redacted() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("connect failed: s3cret")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let url = "postgres://app:s3cret@db/x";
        let driver = Outer(std::io::Error::other("inner: postgres://app:s3cret@db/x"));
        let err = RedactedError::new(&driver, url);
        let mut level: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        let mut seen = Vec::new();
        while let Some(e) = level {
            seen.push(e.to_string());
            level = e.source();
        }
        assert_eq!(
            seen,
            ["connect failed: ***", "inner: postgres://app:***@db/x"]
        );
        assert!(!format!("{err:?}").contains("s3cret"));
    }
}
