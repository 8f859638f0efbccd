//! Several broker addresses in one setting: the nodes of a RabbitMQ cluster.
//!
//! Wherever the consumer, its dead-letter readers, the relay, [`connect`](crate::connect)
//! and the `inbox` CLI take a broker URL (`AMQP_URL`), they take a list of them in one
//! string: the URLs separated by whitespace (spaces, tabs, newlines), or by a comma
//! that a URL scheme follows (`amqp://a:5672/%2f,amqps://b:5671/%2f`; spaces after
//! the comma are allowed). Neither can occur inside an AMQP URL unescaped: a URL
//! holds no whitespace, and a comma directly followed by `amqp://` or `amqps://`
//! inside one (in a password, say) must be written `%2C`. A string of one URL reads
//! exactly as before.
//!
//! A connection tries the URLs in their order: the first connection of a run goes
//! through the list until one node answers (and fails, with the last node's error,
//! when none does); a later one moves to the next node after each failed attempt or
//! lost connection, waiting out the same jittered backoff as with one URL, so a dead
//! node is left at once and a whole dead cluster is not hammered.
//!
//! A list of two or more URLs is checked when the run starts: an empty item or one
//! that is not an AMQP URL is refused with
//! [`Error::InvalidSetting`](crate::Error::InvalidSetting) (setting `url`) naming the
//! item by its position and its text, password hidden. No error or log line prints a
//! password of any item.

use inbox_core::redact_url;

use crate::{Error, Result};

/// The broker URLs of one setting, in the order they are tried: separated by
/// whitespace, or by a comma that a URL scheme follows
/// (`amqp://a:5672/%2f,amqps://b:5671/%2f`); a comma directly followed by `amqp://`
/// or `amqps://` inside a URL (in a password, say) must be written `%2C`.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrls(Vec<String>);

impl BrokerUrls {
    /// Reads a setting of one or more URLs (separated as [`BrokerUrls`]
    /// says). One URL is taken as it is (a bad one fails when connecting, as
    /// it always has); every item of a longer list must parse as an AMQP URL.
    ///
    /// ```
    /// use inbox_amqp::BrokerUrls;
    /// let urls = BrokerUrls::parse("amqp://a:5672/%2f, amqp://b:5672/%2f amqp://c/%2f").unwrap();
    /// assert_eq!(urls.len(), 3);
    /// assert!(BrokerUrls::parse("amqp://a/%2f,,amqp://b/%2f").is_err());
    /// ```
    pub fn parse(setting: &str) -> Result<Self> {
        let items = split(setting);
        if items.is_empty() {
            return Err(Error::invalid("url", "one or more AMQP URLs", "nothing"));
        }
        if items.len() > 1 {
            for (at, item) in items.iter().enumerate() {
                check_item(at, item, items.len())?;
            }
        }
        Ok(Self(items.into_iter().map(str::to_owned).collect()))
    }

    /// The items of `setting` as [`parse`](Self::parse) splits it, unchecked: for
    /// hiding the password of each in a message that may quote any of them.
    pub fn items(setting: &str) -> Vec<&str> {
        split(setting)
    }

    /// `setting` with every password of every item hidden, the items separated by a
    /// space (for a message that quotes a whole setting).
    ///
    /// ```
    /// use inbox_amqp::BrokerUrls;
    /// assert_eq!(
    ///     BrokerUrls::redact("amqp://u:s3cret@a/%2f,amqp://v:t0p@b/%2f"),
    ///     "amqp://u:***@a/%2f amqp://v:***@b/%2f",
    /// );
    /// ```
    pub fn redact(setting: &str) -> String {
        split(setting)
            .into_iter()
            .map(redact_url)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The URLs, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// How many there are (at least one).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true: a list holds at least one URL.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `at`-th URL, counting round the list.
    pub(crate) fn get(&self, at: usize) -> &str {
        &self.0[at % self.0.len()]
    }
}

/// The list with every password hidden, items separated by a space.
impl std::fmt::Display for BrokerUrls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted: Vec<String> = self.0.iter().map(|u| redact_url(u)).collect();
        f.write_str(&redacted.join(" "))
    }
}

/// As [`Display`](std::fmt::Display): no password.
impl std::fmt::Debug for BrokerUrls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BrokerUrls({self})")
    }
}

/// Whether `rest` starts with a URL scheme a list separates at.
fn starts_with_scheme(rest: &str) -> bool {
    let head = |n: usize| rest.get(..n).map(str::to_ascii_lowercase);
    head(7).as_deref() == Some("amqp://") || head(8).as_deref() == Some("amqps://")
}

/// The items of `setting`. Separators are whitespace and commas: a comma before a
/// scheme (`a,amqp://b`) and a comma that ends a word (`a, b`, `a,` at the end). A
/// comma that follows another separating comma, or starts the list, separates
/// nothing and leaves an empty item (`a,,amqp://b`, `a , , b`), which [`check_item`]
/// refuses. A setting of one word and no comma before a scheme is one item exactly
/// as written.
fn split(setting: &str) -> Vec<&str> {
    // Each word's URLs and separating commas, in order (`None` a comma).
    let mut tokens: Vec<Option<&str>> = Vec::new();
    let mut split_at_scheme = false;
    // Each piece of a word is a URL and its trailing commas, each a separator.
    for word in setting.split_whitespace() {
        let mut start = 0;
        let mut pieces = Vec::new();
        for (i, _) in word.match_indices(',') {
            if starts_with_scheme(&word[i + 1..]) {
                // The comma before the scheme ends this piece: counted as its own.
                pieces.push(&word[start..=i]);
                split_at_scheme = true;
                start = i + 1;
            }
        }
        pieces.push(&word[start..]);
        for piece in pieces {
            let url = piece.trim_end_matches(',');
            if !url.is_empty() {
                tokens.push(Some(url));
            }
            tokens.extend(std::iter::repeat_n(None, piece.len() - url.len()));
        }
    }
    let mut words = setting.split_whitespace();
    if let (Some(word), None) = (words.next(), words.next()) {
        if !split_at_scheme {
            return vec![word];
        }
    }
    let mut items = Vec::new();
    let mut after_comma = true;
    for token in tokens {
        match token {
            Some(url) => {
                items.push(url);
                after_comma = false;
            }
            None if after_comma => items.push(""),
            None => after_comma = true,
        }
    }
    items
}

/// Refuses the `at`-th of `count` items when it is empty or no AMQP URL.
fn check_item(at: usize, item: &str, count: usize) -> Result<()> {
    let nth = at + 1;
    if item.is_empty() {
        return Err(Error::invalid(
            "url",
            "AMQP URLs separated by whitespace or commas, none empty",
            format_args!("item {nth} of {count} is empty"),
        ));
    }
    if item.parse::<lapin::uri::AMQPUri>().is_err() {
        return Err(Error::invalid(
            "url",
            "AMQP URLs (amqp:// or amqps://) separated by whitespace or commas",
            format_args!("item {nth} of {count}, {}, is not one", redact_url(item)),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(setting: &str) -> Vec<String> {
        BrokerUrls::parse(setting)
            .unwrap_or_else(|e| panic!("{setting}: {e}"))
            .iter()
            .map(str::to_owned)
            .collect()
    }

    fn refused(setting: &str) -> String {
        match BrokerUrls::parse(setting) {
            Err(Error::InvalidSetting { setting, found, .. }) => {
                assert_eq!(setting, "url");
                found
            }
            other => panic!("{setting}: expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn lists_split_at_whitespace_and_at_commas_before_a_scheme() {
        let (a, b, c) = ("amqp://u:p@a:5672/%2f", "amqps://b:5671/v", "amqp://c/%2f");
        for setting in [
            format!("{a} {b} {c}"),
            format!("{a}\n{b}\t{c}\n"),
            format!("{a},{b},{c}"),
            format!("{a}, {b} ,{c}"),
            format!("{a} , {b} , {c}"),
            format!("  {a},\n  {b},\n  {c},\n"),
            format!("{a},AMQPS://b:5671/v,{c}").replace("AMQPS://b:5671/v", b),
        ] {
            assert_eq!(items(&setting), [a, b, c], "{setting:?}");
        }
    }

    #[test]
    fn one_url_reads_as_before_commas_and_all() {
        // A comma inside one URL (a password) not before a scheme is the URL's.
        let url = "amqp://u:pa,ss@h:5672/%2f";
        assert_eq!(items(url), [url]);
        // One item is not checked here: connecting reports a bad one, as before.
        assert_eq!(items("amqp:not-a-url"), ["amqp:not-a-url"]);
        assert_eq!(items(" amqp://h/%2f,\n"), ["amqp://h/%2f,"]);
    }

    #[test]
    fn empty_items_and_bad_urls_are_refused_by_position() {
        assert_eq!(refused(""), "nothing");
        assert_eq!(refused("  \n "), "nothing");
        for setting in [
            "amqp://a/%2f , , amqp://b/%2f",
            "amqp://a/%2f,,amqp://b/%2f",
            "amqp://a/%2f, ,amqp://b/%2f",
        ] {
            assert_eq!(refused(setting), "item 2 of 3 is empty", "{setting}");
        }
        assert_eq!(refused(", amqp://a/%2f"), "item 1 of 2 is empty");
        let found = refused("amqp://a/%2f http://u:s3cret@b/ amqp://c/%2f");
        assert_eq!(found, "item 2 of 3, http://u:***@b/, is not one");
        let found = refused("amqp://a/%2f amqp://u:s3cret@b:notaport/%2f");
        assert!(found.starts_with("item 2 of 2, "), "{found}");
        assert!(!found.contains("s3cret"), "{found}");
    }

    #[test]
    fn no_password_is_printed() {
        let urls = BrokerUrls::parse("amqp://u:s3cret@a/%2f amqps://v:t0p@b/%2f").unwrap();
        for text in [urls.to_string(), format!("{urls:?}")] {
            assert!(!text.contains("s3cret") && !text.contains("t0p"), "{text}");
        }
        assert_eq!(
            BrokerUrls::redact("amqp://u:s3cret@a/%2f,amqp://v:t0p@b/%2f"),
            "amqp://u:***@a/%2f amqp://v:***@b/%2f"
        );
    }
}
