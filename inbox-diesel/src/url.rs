use crate::{Error, Result};

/// The database a URL points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// `postgres://` or `postgresql://` (one host or libpq's list,
    /// `postgres://h1:5432,h2:5432/db?target_session_attrs=read-write`), or a libpq
    /// `key=value` string whose first keyword is libpq's (`host=h1,h2 port=5432,5432
    /// dbname=db target_session_attrs=read-write`).
    Postgres,
    /// `sqlite://path`, `file:path`, or a plain file path.
    Sqlite,
}

impl Backend {
    /// Picks the backend from the URL's scheme, or from the first keyword of a libpq
    /// `key=value` string (which names no scheme, and is never taken for a file path).
    ///
    /// ```
    /// use inbox_diesel::Backend;
    /// assert_eq!(Backend::from_url("postgres://app@db/billing")?, Backend::Postgres);
    /// assert_eq!(
    ///     Backend::from_url("postgres://app@db1:5432,db2:5432/billing?target_session_attrs=read-write")?,
    ///     Backend::Postgres,
    /// );
    /// assert_eq!(
    ///     Backend::from_url("host=db1,db2 port=5432,5432 dbname=billing target_session_attrs=read-write")?,
    ///     Backend::Postgres,
    /// );
    /// assert_eq!(Backend::from_url("sqlite:///tmp/inbox.db")?, Backend::Sqlite);
    /// assert_eq!(Backend::from_url("/tmp/inbox.db")?, Backend::Sqlite);
    /// assert!(Backend::from_url("mysql://root:hunter2@db/x").is_err());
    /// # Ok::<(), inbox_diesel::Error>(())
    /// ```
    pub fn from_url(url: &str) -> Result<Self> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("postgres://")
            || lower.starts_with("postgresql://")
            || is_conninfo(url)
        {
            Ok(Self::Postgres)
        } else if lower.starts_with("sqlite:")
            || lower.starts_with("file:")
            || !lower.contains("://")
        {
            Ok(Self::Sqlite)
        } else {
            Err(Error::UnsupportedUrl { url: redact(url) })
        }
    }
}

/// libpq's connection keywords (PostgreSQL 15, `libpq-connect`'s "Parameter Key
/// Words"), lower case as libpq requires.
const LIBPQ_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "requiressl",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
    "sslcertmode",
    "require_auth",
];

/// Whether `url` is a libpq `key=value` connection string: it starts with one of
/// libpq's keywords followed by `=` (a file named `host=x` must be given as
/// `sqlite://host=x`).
pub(crate) fn is_conninfo(url: &str) -> bool {
    let s = url.trim_start();
    let key_len = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    LIBPQ_KEYWORDS.contains(&&s[..key_len]) && s[key_len..].trim_start().starts_with('=')
}

/// The path diesel's SQLite driver takes for a `sqlite://` URL.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // SQLite's only
pub(crate) fn sqlite_path(url: &str) -> &str {
    url.strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url)
}

/// Replaces the password of a URL's user info with `***`.
///
/// ```
/// use inbox_diesel::redact;
/// assert_eq!(redact("postgres://app:s3cret@db:5432/billing"), "postgres://app:***@db:5432/billing");
/// assert_eq!(redact("postgres://app@db/billing"), "postgres://app@db/billing");
/// ```
pub fn redact(url: &str) -> String {
    inbox_core::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_only_the_password() {
        assert_eq!(
            redact("postgresql://u:p%40ss@h/db?sslmode=disable"),
            "postgresql://u:***@h/db?sslmode=disable"
        );
        assert_eq!(
            redact("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("/tmp/a.db"), "/tmp/a.db");
        // An '@' in the path is not user info.
        assert_eq!(redact("postgres://h/db@x"), "postgres://h/db@x");
        // A password containing '@' is still hidden whole.
        assert_eq!(redact("postgres://u:a@b@h/db"), "postgres://u:***@h/db");
    }

    #[test]
    fn redacts_passwords_with_delimiters_and_in_the_query() {
        for (url, redacted) in [
            ("postgres://app:pa?ss@db/x", "postgres://app:***@db/x"),
            ("postgres://app:pa#ss@db/x", "postgres://app:***@db/x"),
            ("postgres://app:pa/ss@db/x", "postgres://app:***@db/x"),
            ("postgres://app:pa:ss@db/x", "postgres://app:***@db/x"),
            ("postgres://app:pa%zzss@db/x", "postgres://app:***@db/x"),
            (
                "postgres://app@db/x?password=s3cret",
                "postgres://app@db/x?password=***",
            ),
            ("host=db password=s3cret", "host=db password=***"),
            (
                "amqp://guest:p%3Fss@rabbit/%2f",
                "amqp://guest:***@rabbit/%2f",
            ),
            (
                "amqp://guest:p?ss@rabbit/%2f",
                "amqp://guest:***@rabbit/%2f",
            ),
        ] {
            assert_eq!(redact(url), redacted, "{url}");
        }
    }

    #[test]
    fn multi_host_urls_and_conninfo_strings_are_postgres() {
        for url in [
            "postgres://app:s3cret@db1:5432,db2:5433/billing?target_session_attrs=read-write",
            "postgresql://db1,db2/billing",
            "host=db1,db2 port=5432,5433 dbname=billing target_session_attrs=read-write",
            "  dbname = billing host=/run/postgresql",
            "target_session_attrs=read-write host=db1,db2",
        ] {
            assert_eq!(Backend::from_url(url).unwrap(), Backend::Postgres, "{url}");
        }
        // Not libpq keywords: file paths, as before.
        for url in ["/tmp/a.db", "inbox.db", "hosts=1.db", "data/host=x.db"] {
            assert_eq!(Backend::from_url(url).unwrap(), Backend::Sqlite, "{url}");
        }
    }

    #[test]
    fn redacts_passwords_of_multi_host_urls_and_conninfo_strings() {
        for (url, redacted) in [
            (
                "postgres://app:s3cret@db1:5432,db2:5433/billing?target_session_attrs=read-write",
                "postgres://app:***@db1:5432,db2:5433/billing?target_session_attrs=read-write",
            ),
            (
                "postgres://app@db1,db2/billing?password=s3cret&target_session_attrs=read-write",
                "postgres://app@db1,db2/billing?password=***&target_session_attrs=read-write",
            ),
            (
                "host=db1,db2 port=5432,5433 password=s3cret target_session_attrs=read-write",
                "host=db1,db2 port=5432,5433 password=*** target_session_attrs=read-write",
            ),
            (
                "host=db1,db2 password='s3 cret' dbname=billing",
                "host=db1,db2 password=*** dbname=billing",
            ),
        ] {
            assert_eq!(redact(url), redacted, "{url}");
            assert!(!redact(url).contains("s3"), "{url}");
        }
    }

    #[test]
    fn unsupported_url_error_hides_the_password() {
        for (url, password) in [
            ("mysql://root:hunter2@db/x", "hunter2"),
            ("mysql://root:hun?ter2@db/x", "hun?ter2"),
            ("MYSQL://root:hun@ter2@db/x", "hun@ter2"),
            ("mysql://root@db/x?password=hunter2", "hunter2"),
        ] {
            let err = Backend::from_url(url).unwrap_err();
            assert!(matches!(err, Error::UnsupportedUrl { .. }), "{err:?}");
            for text in [err.to_string(), format!("{err:?}")] {
                assert!(!text.contains(password), "{text}");
            }
        }
        let err = Backend::from_url("mysql://root:hunter2@db/x").unwrap_err();
        assert!(err.to_string().contains("mysql://root:***@db/x"), "{err}");
    }
}
