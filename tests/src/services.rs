//! Where the tests find PostgreSQL, RabbitMQ and Redis, and what happens when one is
//! not there.
//!
//! Each service's URL comes from its variable (`PG_DATABASE_URL` then `DATABASE_URL`,
//! `AMQP_URL`, `REDIS_URL`). Without it, the default local address is probed with a
//! TCP connect of [`PROBE_TIMEOUT`] and used when it answers
//! ([`DEFAULT_POSTGRES_URL`], [`DEFAULT_AMQP_URL`], [`DEFAULT_REDIS_URL`]); with the
//! `testcontainers` feature, a container is started next. A test whose service is found
//! nowhere **fails**, naming the variable to set, so it is never counted as passed:
//!
//! - `INBOX_SKIP_SERVICES=1`: such a test returns early instead (it shows as passed),
//!   and the test binary writes one `skipped: ...` line per service to the terminal,
//!   past cargo test's output capture;
//! - `INBOX_REQUIRE_SERVICES=1` (CI sets it): such a test always fails, even with
//!   `INBOX_SKIP_SERVICES=1`.
//!
//! The answer is looked up once per test process and service.

use std::io::Write;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

/// PostgreSQL's default local address, probed when no variable names a server.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// RabbitMQ's default local address, probed when `AMQP_URL` is not set.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Redis's default local address, probed when `REDIS_URL` is not set.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// How long a probe of a default address waits for the TCP connect.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// A service the tests need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    /// PostgreSQL.
    Postgres,
    /// RabbitMQ.
    Amqp,
    /// Redis.
    Redis,
}

impl Service {
    /// The service's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Service::Postgres => "PostgreSQL",
            Service::Amqp => "RabbitMQ",
            Service::Redis => "Redis",
        }
    }

    /// The variables that name the service, in the order they are read.
    pub fn variables(self) -> &'static [&'static str] {
        match self {
            Service::Postgres => &["PG_DATABASE_URL", "DATABASE_URL"],
            Service::Amqp => &["AMQP_URL"],
            Service::Redis => &["REDIS_URL"],
        }
    }

    /// The default local address probed without a variable.
    pub fn default_url(self) -> &'static str {
        match self {
            Service::Postgres => DEFAULT_POSTGRES_URL,
            Service::Amqp => DEFAULT_AMQP_URL,
            Service::Redis => DEFAULT_REDIS_URL,
        }
    }

    /// Whether `url` is one of this service's URLs (a `DATABASE_URL` may name SQLite).
    fn accepts(self, url: &str) -> bool {
        let schemes: &[&str] = match self {
            Service::Postgres => &["postgres://", "postgresql://"],
            Service::Amqp => &["amqp://", "amqps://"],
            Service::Redis => &["redis://", "rediss://"],
        };
        schemes.iter().any(|s| url.starts_with(s))
    }

    fn slot(self) -> &'static OnceLock<Option<String>> {
        static POSTGRES: OnceLock<Option<String>> = OnceLock::new();
        static AMQP: OnceLock<Option<String>> = OnceLock::new();
        static REDIS: OnceLock<Option<String>> = OnceLock::new();
        match self {
            Service::Postgres => &POSTGRES,
            Service::Amqp => &AMQP,
            Service::Redis => &REDIS,
        }
    }
}

/// Whether a missing service fails the test even when skipping was asked for
/// (`INBOX_REQUIRE_SERVICES=1`).
pub fn services_required() -> bool {
    flag("INBOX_REQUIRE_SERVICES")
}

/// Whether a test whose service is missing returns early instead of failing
/// (`INBOX_SKIP_SERVICES=1`, and `INBOX_REQUIRE_SERVICES` not set).
pub fn services_skipped() -> bool {
    flag("INBOX_SKIP_SERVICES") && !services_required()
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// The service's URL (see the module's docs), or `None` when it is found nowhere and
/// `INBOX_SKIP_SERVICES=1`; panics when it is found nowhere otherwise.
pub fn url_of(service: Service) -> Option<String> {
    match service.slot().get_or_init(|| locate(service)) {
        Some(url) => Some(url.clone()),
        None => {
            unavailable(
                service,
                &format!(
                    "nothing answers at {} and {} is not set",
                    inbox_core::redact_url(service.default_url()),
                    service.variables().join(" / ")
                ),
                &format!(
                    "start it there, or set {}={}",
                    service.variables()[service.variables().len() - 1],
                    service.default_url()
                ),
            );
            None
        }
    }
}

/// Fails the calling test because `service` cannot serve it (`why`; `fix` says what
/// to do), or, with `INBOX_SKIP_SERVICES=1`, writes one `skipped:` line for the
/// service (once per process) and returns so the test can return early.
pub fn unavailable(service: Service, why: &str, fix: &str) {
    let name = service.name();
    if services_required() {
        panic!("INBOX_REQUIRE_SERVICES=1 but {name} cannot serve this test: {why}; {fix}");
    }
    if !services_skipped() {
        panic!(
            "{name} cannot serve this test: {why}; {fix}, \
             or set INBOX_SKIP_SERVICES=1 to skip the tests that need it"
        );
    }
    static SAID: [OnceLock<()>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    SAID[service as usize].get_or_init(|| {
        // Straight to the terminal: `eprintln!` would be captured by the test harness
        // and shown only for a failing test.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: INBOX_SKIP_SERVICES=1 and {name} cannot serve these tests ({why})"
        );
    });
}

/// A test that needs something of the machine's that is not a service (the server's
/// German locale, say) and does not find it. Under `INBOX_REQUIRE_SERVICES=1` (CI, whose
/// `.ci/run` provides it) the test fails; otherwise it is skipped out loud: one
/// `skipped: <test>: ...` line per test goes straight to the terminal, past cargo
/// test's output capture (the reason and its fix once per `what`), and the caller
/// returns early. A plain `cargo test --workspace` on a machine without it thus passes
/// and says which tests it did not run.
pub fn machine_lacks(what: &'static str, why: &str, fix: &str) {
    if services_required() {
        panic!("INBOX_REQUIRE_SERVICES=1 but this machine lacks {what}: {why}; {fix}");
    }
    static SAID: OnceLock<std::sync::Mutex<Vec<&'static str>>> = OnceLock::new();
    let said = SAID.get_or_init(Default::default);
    let mut said = said.lock().unwrap_or_else(|p| p.into_inner());
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let line = if said.contains(&what) {
        format!("skipped: {test}: this machine lacks {what}")
    } else {
        said.push(what);
        format!("skipped: {test}: this machine lacks {what} ({why}); {fix}")
    };
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn locate(service: Service) -> Option<String> {
    let from_env = service
        .variables()
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find(|u| service.accepts(u));
    if from_env.is_some() {
        return from_env;
    }
    if answers(service.default_url()) {
        return Some(service.default_url().to_owned());
    }
    #[cfg(feature = "testcontainers")]
    {
        let started = match service {
            Service::Postgres => Some(crate::containers::postgres()),
            Service::Amqp => Some(crate::containers::rabbitmq()),
            Service::Redis => None,
        };
        match started {
            Some(Ok(url)) => return Some(url),
            Some(Err(why)) => {
                let _ = writeln!(std::io::stderr(), "{why}");
            }
            None => {}
        }
    }
    None
}

/// Whether something accepts a TCP connection at the URL's host and port within
/// [`PROBE_TIMEOUT`].
pub fn answers(url: &str) -> bool {
    let Some(authority) = authority(url) else {
        return false;
    };
    let addrs: Vec<SocketAddr> = match authority.to_socket_addrs() {
        Ok(addrs) => addrs.collect(),
        Err(_) => return false,
    };
    addrs
        .iter()
        .any(|addr| TcpStream::connect_timeout(addr, PROBE_TIMEOUT).is_ok())
}

/// `host:port` of a URL (its scheme's default port when it names none). AMQP URLs
/// are read by lapin's URI type, as lapin reads them ([`amqp_uri`]).
/// PostgreSQL and Redis URLs keep this small split: this crate links no client
/// whose URL type it could ask (diesel hands the URL to libpq as it is), and only
/// the host and port are needed, to probe them.
pub(crate) fn authority(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    if matches!(scheme, "amqp" | "amqps") {
        return amqp_uri(url).ok().map(|uri| amqp_authority(&uri));
    }
    let host_port = rest.split(['/', '?']).next()?;
    let host_port = host_port.rsplit_once('@').map_or(host_port, |(_, h)| h);
    // A port given: after the host, or after a bracketed IPv6 address.
    let has_port = match host_port.strip_prefix('[') {
        Some(v6) => v6.contains("]:"),
        None => host_port.contains(':'),
    };
    if has_port {
        return Some(host_port.to_owned());
    }
    let port = match scheme {
        "postgres" | "postgresql" => 5432,
        "redis" | "rediss" => 6379,
        _ => return None,
    };
    Some(format!("{host_port}:{port}"))
}

/// An AMQP URL as lapin reads it (decoded user, password and vhost; the scheme's
/// default port); [`crate::amqp::uri`] is this, for the tests.
pub(crate) fn amqp_uri(url: &str) -> Result<lapin::uri::AMQPUri, String> {
    url.parse::<lapin::uri::AMQPUri>()
        .map_err(|why| format!("not an AMQP URL ({why})"))
}

/// host:port of a parsed AMQP URL.
pub(crate) fn amqp_authority(uri: &lapin::uri::AMQPUri) -> String {
    format!("{}:{}", uri.authority.host, uri.authority.port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_authority_gets_the_default_port_only_when_it_names_none() {
        let amqp = |url| authority(url).unwrap();
        assert_eq!(amqp("amqp://guest:pw@127.0.0.1/%2f"), "127.0.0.1:5672");
        assert_eq!(amqp("amqp://127.0.0.1:5673/%2f"), "127.0.0.1:5673");
        assert_eq!(amqp("amqps://broker.example"), "broker.example:5671");
        // A password holding an encoded `@` and `/`, and a `:`.
        assert_eq!(
            amqp("amqp://app:p%40ss%2Fw:rd@broker.example:5673/%2f"),
            "broker.example:5673"
        );
        // lapin's URI type (amq-protocol-uri 10.6) reads a bracketed IPv6 host as
        // `localhost`, which is where lapin connects: the helpers agree with it.
        assert_eq!(amqp("amqp://[::1]:5673"), "localhost:5673");
    }

    #[test]
    fn authority_takes_host_and_port_or_the_schemes_default() {
        assert_eq!(
            authority(DEFAULT_POSTGRES_URL).as_deref(),
            Some("127.0.0.1:5432")
        );
        assert_eq!(
            authority(DEFAULT_AMQP_URL).as_deref(),
            Some("127.0.0.1:5672")
        );
        assert_eq!(
            authority(DEFAULT_REDIS_URL).as_deref(),
            Some("127.0.0.1:6379")
        );
        assert_eq!(
            authority("postgres://u:p@db.example/x?sslmode=disable").as_deref(),
            Some("db.example:5432")
        );
        assert_eq!(authority("no scheme"), None);
    }

    #[test]
    fn a_closed_port_does_not_answer() {
        // Port 1 (tcpmux) is closed on the machines the tests run on.
        assert!(!answers("amqp://guest:guest@127.0.0.1:1/%2f"));
    }

    /// The guard of honest counts: a test whose service is missing panics (fails)
    /// unless skipping was asked for, and always with `INBOX_REQUIRE_SERVICES=1`.
    #[test]
    fn a_missing_service_fails_the_test_unless_skipping_was_asked_for() {
        let outcome = std::panic::catch_unwind(|| {
            unavailable(Service::Redis, "nothing answers (in this test)", "start it")
        });
        assert_eq!(outcome.is_err(), !services_skipped());
        if services_required() {
            assert!(outcome.is_err(), "INBOX_REQUIRE_SERVICES=1 always fails");
        }
    }

    #[test]
    fn passwords_are_hidden_in_messages() {
        assert_eq!(
            inbox_core::redact_url(DEFAULT_AMQP_URL),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
    }
}
