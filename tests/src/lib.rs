//! Test fixtures: every test gets its own PostgreSQL schema or SQLite file, so tests
//! run in parallel against the shared servers and never see each other's leftovers.
//!
//! The servers are found as [`services`] says: a variable (`DATABASE_URL`, `AMQP_URL`,
//! `REDIS_URL`), else the default local address when it answers. A test whose server is
//! found nowhere fails, naming the variable to set, unless `INBOX_SKIP_SERVICES=1`
//! (it then returns early); with `INBOX_REQUIRE_SERVICES=1` (CI sets it) it always fails.

pub mod amqp;
#[cfg(feature = "testcontainers")]
pub mod containers;
pub mod metrics;
pub mod pg_cluster;
pub mod rabbit_cluster;
pub mod services;
pub mod spans;
pub mod tls;

pub use services::{services_required, services_skipped, Service};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::{
    ClaimKey, ConsumerGroup, Decision, Envelope, Handler, HandlerError, MessageContext, MessageKey,
    RetryPolicy,
};
use inbox_diesel::idempotency::IdempotencyConnection;
use inbox_diesel::operator::OperatorConnection;
use inbox_diesel::rebuild::RebuildConnection;
use inbox_diesel::{Store, StoreBuilder, StoreConnection};

/// What an error reporter could print of `err`: its `Debug`, and the `Display` of it
/// and of every cause below it (for tests that no level leaks a secret).
pub fn everything_printed(err: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut printed = vec![format!("{err:?}")];
    let mut level = Some(err);
    while let Some(e) = level {
        printed.push(e.to_string());
        level = e.source();
    }
    printed
}

/// The first level of `err`'s chain whose own message repeats the message of its
/// cause, as `(level, cause)`; `None` when every level prints only itself (a
/// reporter walking the chain then prints each cause once).
pub fn cause_printed_twice(err: &(dyn std::error::Error + 'static)) -> Option<(String, String)> {
    let mut level = Some(err);
    while let Some(e) = level {
        if let Some(cause) = e.source() {
            let (own, below) = (e.to_string(), cause.to_string());
            if !below.is_empty() && own.contains(&below) {
                return Some((own, below));
            }
        }
        level = e.source();
    }
    None
}

/// The setting an [`inbox_diesel::Error::InvalidSetting`] in `err`'s chain names
/// (the store's errors reach callers of `inbox-core` traits boxed in
/// `inbox_core::Error::Store`).
pub fn rejected_setting(err: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut level = Some(err);
    while let Some(e) = level {
        if let Some(inbox_diesel::Error::InvalidSetting { setting, .. }) =
            e.downcast_ref::<inbox_diesel::Error>()
        {
            return Some(setting);
        }
        level = e.source();
    }
    None
}

/// The PostgreSQL URL (see [`services`]), or `None` when it is found nowhere and
/// `INBOX_SKIP_SERVICES=1`; panics when it is found nowhere otherwise.
pub fn postgres_url() -> Option<String> {
    // Before this process's first libpq connection (see `inbox_diesel::init_tls`).
    inbox_diesel::init_tls();
    services::url_of(Service::Postgres)
}

/// The Redis URL (see [`services`]), or `None` when it is found nowhere and
/// `INBOX_SKIP_SERVICES=1`; panics when it is found nowhere otherwise.
pub fn redis_url() -> Option<String> {
    services::url_of(Service::Redis)
}

/// `base` (a PostgreSQL URL) with `schema` as its search path, so that every connection
/// a process opens with it (an example run as a child process, say) uses the schema.
pub fn search_path_url(base: &str, schema: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}options=-csearch_path%3D{schema}")
}

/// The path of the package's example `name`: `cargo test` builds a package's examples
/// next to its test binaries. Panics when it is missing.
pub fn example_path(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --example {name}`",
        path.display()
    );
    path
}

/// A URL that cannot connect and the password no error built from it may print (the
/// credential tests).
pub struct CredentialCase {
    /// What the case tries.
    pub name: &'static str,
    /// `{addr}` stands for the server's host:port.
    pub url: &'static str,
    /// The secret in the URL.
    pub password: &'static str,
}

/// A name no other test (or test process) uses.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs each scenario `fn name<F: Fixture>(fx: &F)` twice: as `postgres::name` on a
/// schema of its own (when PostgreSQL is configured) and as `sqlite::name` on a file
/// of its own.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[test]
                fn $name() {
                    if let Some(fx) = $crate::PgFixture::new() {
                        super::$name(&fx);
                    }
                }
            )*
        }
        mod sqlite {
            $(
                #[test]
                fn $name() {
                    super::$name(&$crate::SqliteFixture::new());
                }
            )*
        }
    };
}

/// A connection type with every capability of the store (both backends have them
/// all), for tests generic over the backend.
pub trait FullConnection:
    StoreConnection + OperatorConnection + IdempotencyConnection + RebuildConnection
{
}

impl<C> FullConnection for C where
    C: StoreConnection + OperatorConnection + IdempotencyConnection + RebuildConnection
{
}

/// A store backend under test, with a private place for its tables.
pub trait Fixture {
    /// The connection type.
    type Conn: FullConnection + TestConn;

    /// A store builder pointed at this fixture's schema or file.
    fn builder(&self) -> StoreBuilder<Self::Conn>;

    /// A fresh connection to the same schema or file, outside the store's pool.
    fn connect(&self) -> Self::Conn;

    /// The store `builder` builds, with the [`TestConn`] effects table created beside
    /// it: the start of most store tests. Panics when the store cannot be built.
    fn open(&self, builder: StoreBuilder<Self::Conn>) -> Store<Self::Conn> {
        let store = builder.build().expect("store");
        self.connect().create_effects().expect("create effects");
        store
    }

    /// Runs SQL on a fresh connection.
    fn execute(&self, sql: &str) {
        let mut conn = self.connect();
        if let Err(err) = conn.batch_execute(sql) {
            panic!("{sql}: {err}");
        }
    }
}

/// A PostgreSQL schema of one test's own, dropped afterwards.
pub struct PgFixture {
    url: String,
    /// The schema's name.
    pub schema: String,
}

impl PgFixture {
    /// A new schema, or `None` when PostgreSQL is not configured.
    pub fn new() -> Option<Self> {
        let url = postgres_url()?;
        let schema = unique_name("t");
        let mut conn = PgConnection::establish(&url).expect("connect to DATABASE_URL");
        conn.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .expect("create test schema");
        Some(Self { url, schema })
    }

    /// The server URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for PgFixture {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.url) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
    }
}

impl Fixture for PgFixture {
    type Conn = PgConnection;

    fn builder(&self) -> StoreBuilder<PgConnection> {
        Store::builder(self.url.clone()).schema(self.schema.clone())
    }

    fn connect(&self) -> PgConnection {
        let mut conn = PgConnection::establish(&self.url).expect("connect");
        conn.batch_execute(&format!("SET search_path TO \"{}\"", self.schema))
            .expect("set search_path");
        conn
    }
}

/// An SQLite file in a temporary directory of one test's own.
pub struct SqliteFixture {
    _dir: tempfile::TempDir,
    /// The file's path.
    pub path: String,
}

impl SqliteFixture {
    /// A new, empty database file.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("inbox.db").to_string_lossy().into_owned();
        Self { _dir: dir, path }
    }
}

impl Default for SqliteFixture {
    fn default() -> Self {
        Self::new()
    }
}

impl Fixture for SqliteFixture {
    type Conn = SqliteConnection;

    fn builder(&self) -> StoreBuilder<SqliteConnection> {
        Store::builder(format!("sqlite://{}", self.path))
    }

    fn connect(&self) -> SqliteConnection {
        let mut conn = SqliteConnection::establish(&self.path).expect("open sqlite file");
        conn.batch_execute("PRAGMA busy_timeout = 5000")
            .expect("busy_timeout");
        conn
    }
}

/// What tests' handlers write: an `effects` row per applied message, with no unique
/// constraint, so a message applied twice shows up as two rows.
pub trait TestConn: Connection {
    /// Creates the effects table.
    fn create_effects(&mut self) -> QueryResult<()> {
        self.batch_execute(
            "CREATE TABLE IF NOT EXISTS effects (message_key TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
    }

    /// Applies one effect.
    fn record_effect(&mut self, key: &str, amount: i64) -> QueryResult<()>;

    /// How many effects a key has.
    fn effects_of(&mut self, key: &str) -> QueryResult<i64>;

    /// All effects.
    fn effect_count(&mut self) -> QueryResult<i64>;
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

macro_rules! test_conn {
    ($conn:ty) => {
        impl TestConn for $conn {
            fn record_effect(&mut self, key: &str, amount: i64) -> QueryResult<()> {
                diesel::sql_query("INSERT INTO effects (message_key, amount) VALUES ($1, $2)")
                    .bind::<Text, _>(key)
                    .bind::<BigInt, _>(amount)
                    .execute(self)
                    .map(|_| ())
            }

            fn effects_of(&mut self, key: &str) -> QueryResult<i64> {
                diesel::sql_query("SELECT COUNT(*) AS n FROM effects WHERE message_key = $1")
                    .bind::<Text, _>(key)
                    .get_result::<Count>(self)
                    .map(|c| c.n)
            }

            fn effect_count(&mut self) -> QueryResult<i64> {
                diesel::sql_query("SELECT COUNT(*) AS n FROM effects")
                    .get_result::<Count>(self)
                    .map(|c| c.n)
            }
        }
    };
}

test_conn!(PgConnection);
test_conn!(SqliteConnection);

/// The test message.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// The amount.
    pub amount: i64,
}

/// What a [`Recorder`] does with a message.
pub type Behaviour = dyn Fn(&str, &MessageContext<'_>) -> Outcome + Send + Sync;

/// The outcome a [`Recorder`] is told to produce.
pub enum Outcome {
    /// Record the effect.
    Apply,
    /// Record the effect, then fail transiently (the effect must be rolled back).
    ApplyThenFail,
    /// Fail permanently.
    Permanent,
    /// Panic.
    Panic,
    /// Open a nested transaction, write, and panic inside it.
    PanicInNestedTransaction,
    /// Record the effect, run this SQL and ignore its result, return `Ok`: the
    /// careless handler that swallows a database error (or ends the transaction).
    IgnoreSql(&'static str),
    /// Run this SQL and propagate its error (`?`).
    Sql(&'static str),
    /// Fail as if a statement had raised a database error of this kind.
    DbError(diesel::result::DatabaseErrorKind, &'static str),
    /// Fail with a retry-after of this delay.
    RetryAfter(std::time::Duration),
    /// Sleep this long inside the handler (a handler that hangs), then apply.
    Sleep(std::time::Duration),
    /// Fail transiently with this message.
    FailWith(String),
}

/// A handler that records an effect per message and counts its calls.
pub struct Recorder {
    group: ConsumerGroup,
    message_type: String,
    policy: RetryPolicy,
    behaviour: Box<Behaviour>,
    lock: Option<inbox_core::ProjectionLock>,
    /// Keys of every call, in order.
    pub calls: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    /// A recorder for `group` taking `usage.recorded`, applying everything.
    pub fn new(group: &str) -> Self {
        Self {
            group: ConsumerGroup::new(group).expect("valid group"),
            message_type: "usage.recorded".to_owned(),
            policy: RetryPolicy::default(),
            behaviour: Box::new(|_, _| Outcome::Apply),
            lock: None,
            calls: Arc::default(),
        }
    }

    /// Declares a projection lock, taken before the batch claims.
    pub fn lock(mut self, lock: inbox_core::ProjectionLock) -> Self {
        self.lock = Some(lock);
        self
    }

    /// Sets the retry policy.
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the behaviour.
    pub fn behaviour(
        mut self,
        f: impl Fn(&str, &MessageContext<'_>) -> Outcome + Send + Sync + 'static,
    ) -> Self {
        self.behaviour = Box::new(f);
        self
    }

    /// A handle on the calls made.
    pub fn calls(&self) -> Arc<Mutex<Vec<String>>> {
        Arc::clone(&self.calls)
    }
}

impl<C: TestConn + Send + 'static> Handler<C> for Recorder {
    type Message = Usage;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        &self.message_type
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.policy
    }

    fn lock(&self) -> Option<inbox_core::ProjectionLock> {
        self.lock
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: Usage,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = ctx.message_key().as_str();
        self.calls.lock().expect("calls").push(key.to_owned());
        match (self.behaviour)(key, ctx) {
            Outcome::Apply => conn.record_effect(key, msg.amount)?,
            Outcome::ApplyThenFail => {
                conn.record_effect(key, msg.amount)?;
                return Err(HandlerError::transient(format!(
                    "{key} failed after writing"
                )));
            }
            Outcome::Permanent => return Err(HandlerError::permanent(format!("{key} is invalid"))),
            Outcome::Panic => panic!("handler panicked on {key}"),
            Outcome::IgnoreSql(sql) => {
                conn.record_effect(key, msg.amount)?;
                let _ = conn.batch_execute(sql);
            }
            Outcome::Sql(sql) => conn.batch_execute(sql)?,
            Outcome::DbError(kind, message) => {
                return Err(diesel::result::Error::DatabaseError(
                    kind,
                    Box::new(message.to_owned()),
                )
                .into())
            }
            Outcome::FailWith(message) => return Err(HandlerError::transient(message)),
            Outcome::Sleep(pause) => {
                std::thread::sleep(pause);
                conn.record_effect(key, msg.amount)?;
            }
            Outcome::RetryAfter(delay) => {
                return Err(HandlerError::retry_after(
                    delay,
                    format!("{key} asks to wait"),
                ))
            }
            Outcome::PanicInNestedTransaction => {
                let _ = conn.transaction::<(), diesel::result::Error, _>(|conn| {
                    conn.record_effect(key, msg.amount)?;
                    panic!("handler panicked inside its own transaction on {key}");
                });
            }
        }
        Ok(())
    }
}

/// A `usage.recorded` envelope with key `key` and amount `amount`.
pub fn usage(key: &str, amount: i64) -> Envelope {
    let payload = serde_json::to_vec(&Usage { amount }).expect("serialize");
    Envelope::new(
        MessageKey::new(key).expect("valid key"),
        "usage.recorded",
        payload,
    )
}

/// The claim key of `key` in `group` (both literals).
pub fn claim_key(group: &str, key: &str) -> ClaimKey {
    ClaimKey::new(self::group(group), MessageKey::new(key).expect("valid key"))
}

/// Whether every decision is `Stop`.
pub fn all_stop(decisions: &[Decision]) -> bool {
    decisions.iter().all(|d| matches!(d, Decision::Stop(_)))
}

/// The instant the tests' manual clocks start at: 2026-11-30 12:00 UTC.
pub fn start_time() -> chrono::DateTime<chrono::Utc> {
    "2026-11-30T12:00:00Z".parse().expect("timestamp")
}

/// `n` milliseconds.
pub fn ms(n: u64) -> std::time::Duration {
    std::time::Duration::from_millis(n)
}

/// A consumer group from a literal.
pub fn group(name: &str) -> ConsumerGroup {
    ConsumerGroup::new(name).expect("valid group")
}
