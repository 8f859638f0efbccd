//! What the benchmark binaries share: their settings from the environment, the
//! runtime's consume scenarios, and the removal of what a run created.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::{Connection as _, PgConnection};
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_core::{
    ConsumerGroup, Handler, HandlerError, MessageContext, ProjectionLock, RedactedError,
    RetryPolicy,
};
use inbox_diesel::Store;
use lapin::{Connection, ConnectionProperties};

use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, Workload, GROUP, MESSAGE_TYPE};

/// `DATABASE_URL` and `AMQP_URL`, or the local services the tests use.
pub fn service_urls() -> (String, String) {
    (
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into()),
        std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    )
}

/// The setting `name` from the environment, or `default` when unset; a value that
/// does not parse stops the benchmark with a message saying so, rather than quietly
/// measuring something else.
pub fn env_or<T>(name: &str, default: T) -> T
where
    T: FromStr,
    T::Err: Display,
{
    match std::env::var(name) {
        Err(_) => default,
        Ok(value) => value
            .parse()
            .unwrap_or_else(|err| panic!("{name}={value:?} does not parse: {err}")),
    }
}

/// Statements the process's diesel connections have sent since it started, once
/// [`count_statements`] was called: one per round trip (a `batch_execute` of several
/// statements is one).
pub fn statements_sent() -> u64 {
    STATEMENTS.load(std::sync::atomic::Ordering::Relaxed)
}

static STATEMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts the statements of every diesel connection opened from now on (see
/// [`statements_sent`]).
pub fn count_statements() {
    struct Count;
    impl diesel::connection::Instrumentation for Count {
        fn on_connection_event(&mut self, event: diesel::connection::InstrumentationEvent<'_>) {
            if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
                STATEMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
    let _ = diesel::connection::set_default_instrumentation(|| Some(Box::new(Count)));
}

/// CPU time (user and system, every thread) process `pid` has used, in clock ticks
/// of [`TICKS_PER_SECOND`] (Linux `/proc/<pid>/stat`); `None` where it cannot be read.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime and stime: the 14th and 15th fields of the line, 12th and 13th here.
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some(user + system)
}

/// CPU time (as [`cpu_ticks`]) used so far by the live processes whose command name
/// is `comm` (`postgres`, `beam.smp`): a server's share of a run is the difference
/// of two readings, while its processes stay up.
pub fn cpu_ticks_of(comm: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|name| name.trim_end() == comm)
        })
        .filter_map(cpu_ticks)
        .sum()
}

/// Linux's `USER_HZ`, the unit of [`cpu_ticks`].
pub const TICKS_PER_SECOND: f64 = 100.0;

/// Free space, in KiB, on the file system holding `path` (`df -Pk`); `None` when
/// `df` is missing or says nothing readable.
pub fn free_disk_kib(path: &str) -> Option<u64> {
    let out = std::process::Command::new("df")
        .args(["-Pk", path])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()
}

/// The server's `fsync` and whether the connection to `url` negotiated TLS (`on` or
/// `off`), as a benchmark reports them.
pub fn fsync_and_tls(url: &str) -> (String, String) {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        value: String,
    }
    let mut conn = PgConnection::establish(url)
        .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, url)));
    let fsync: Setting = diesel::sql_query("SELECT current_setting('fsync') AS value")
        .get_result(&mut conn)
        .expect("fsync");
    let ssl: Setting = diesel::sql_query(
        "SELECT CASE WHEN ssl THEN 'on' ELSE 'off' END AS value FROM pg_stat_ssl \
         WHERE pid = pg_backend_pid()",
    )
    .get_result(&mut conn)
    .expect("ssl");
    (fsync.value, ssl.value)
}

/// Drops a benchmark's PostgreSQL schema when dropped itself, so a run that fails
/// half-way leaves nothing behind (signals: see [`drop_schema_on_signals`]).
pub struct SchemaGuard {
    url: String,
    schema: String,
}

impl SchemaGuard {
    /// Guards `schema` on the server at `url`.
    pub fn new(url: &str, schema: &str) -> Self {
        Self {
            url: url.to_owned(),
            schema: schema.to_owned(),
        }
    }
}

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        drop_schema(&self.url, &self.schema);
    }
}

fn drop_schema(url: &str, schema: &str) {
    use diesel::connection::SimpleConnection as _;
    use diesel::Connection as _;
    if let Ok(mut conn) = diesel::PgConnection::establish(url) {
        let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    }
}

/// On Ctrl-C or SIGTERM drops `schema` and exits with status 130 (a drop guard does
/// not run when a signal ends the process). Call inside a tokio runtime.
pub fn drop_schema_on_signals(url: &str, schema: &str) {
    let (url, schema) = (url.to_owned(), schema.to_owned());
    tokio::spawn(async move {
        inbox_amqp::shutdown_signal().await;
        eprintln!("interrupted: dropping schema {schema}");
        let _ = tokio::task::spawn_blocking(move || drop_schema(&url, &schema)).await;
        std::process::exit(130);
    });
}

/// `events` deliveries of a workload with duplicates, as the consume benchmarks send
/// them: `events * 10 / 11` distinct events, every tenth one sent again three events
/// later, the rest (if any) topped up from the start. The workload and the order of
/// its events' indexes.
pub fn workload_with_duplicates(
    events: usize,
    seed: u64,
) -> (inbox_examples::usage::Workload, Vec<usize>) {
    let unique = (events * 10 / 11).max(1);
    let workload = inbox_examples::usage::Workload::generate(unique, 0, seed);
    let mut order: Vec<usize> = Vec::with_capacity(events);
    for i in 0..unique {
        order.push(i);
        if i % 10 == 5 && order.len() < events {
            order.push(i.saturating_sub(3));
        }
    }
    while order.len() < events {
        order.push(order.len() % unique);
    }
    (workload, order)
}

/// Publishes the events of `workload` in `order` (duplicates included) to `exchange`
/// with `routing_key`, persistent, with publisher confirms; every one must be routed.
pub async fn publish_workload(
    conn: &lapin::Connection,
    exchange: &str,
    routing_key: &str,
    workload: &inbox_examples::usage::Workload,
    order: &[usize],
) -> Result<(), lapin::Error> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for &i in order {
        let (key, event) = &workload.events[i];
        let body = serde_json::to_vec(event).unwrap_or_default();
        channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                &body,
                lapin::BasicProperties::default()
                    .with_message_id(key.as_str().into())
                    .with_type(inbox_examples::usage::MESSAGE_TYPE.into())
                    .with_delivery_mode(2),
            )
            .await?;
    }
    let returned = channel.wait_for_confirms().await?;
    assert!(
        returned.is_empty(),
        "{} unroutable during fill",
        returned.len()
    );
    let _ = channel.close(200, "filled".into()).await;
    Ok(())
}

// The runtime scenarios, as functions a benchmark runs against a schema of its own
// (`bench_growth` runs them against an empty and a large claims table in turn).
/// Deliveries per batch (`BENCH_BATCH`, default 100); a consumer's prefetch is twice that.
pub fn batch_size() -> usize {
    env_or("BENCH_BATCH", 100)
}

/// Twice the batch size, at most `u16::MAX`.
pub fn prefetch() -> u16 {
    u16::try_from(2 * batch_size()).unwrap_or(u16::MAX)
}

/// Pause after filling a queue (`BENCH_SETTLE_MS`, default 1000): the broker keeps
/// writing what it just confirmed for a while.
pub fn settle() -> Duration {
    Duration::from_millis(env_or("BENCH_SETTLE_MS", 1000))
}

/// The median of `values` (0 for none).
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The lowest and highest of `values` (0, 0 when empty).
pub fn range(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (low, high)
}

/// `url` (a `postgres://` URL) naming the database `database` instead of its own,
/// its query (`?sslmode=...`) kept.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{server}/{database}?{query}"),
        None => format!("{server}/{database}"),
    }
}

/// The usage events of one run and the order they are published in: 10% duplicates,
/// every 10th unique event coming again a little later, as `bench_consume` sends them.
pub struct Deliveries {
    /// The unique events and their keys.
    pub workload: Workload,
    /// Indexes into `workload.events`, in publishing order.
    pub order: Vec<usize>,
}

impl Deliveries {
    /// `events` deliveries drawn from `seed` (another seed, other keys).
    pub fn generate(events: usize, seed: u64) -> Self {
        let (workload, order) = workload_with_duplicates(events, seed);
        Self { workload, order }
    }

    /// Publishes every delivery to `exchange` / `routing_key` with confirms, then
    /// waits [`settle`].
    pub async fn fill(&self, conn: &Connection, exchange: &str, routing_key: &str) {
        publish_workload(conn, exchange, routing_key, &self.workload, &self.order)
            .await
            .expect("publish");
        tokio::time::sleep(settle()).await;
    }
}

/// The projection without a fold: one upsert per event. `serialized`: batches take
/// the projection lock exclusively, since events of concurrent batches hit the same
/// rows in any order; one event per transaction cannot deadlock.
pub struct PerEvent {
    group: ConsumerGroup,
    serialized: bool,
}

impl PerEvent {
    /// The handler of group [`GROUP`].
    pub fn new(serialized: bool) -> Self {
        Self {
            group: ConsumerGroup::new(GROUP).expect("group"),
            serialized,
        }
    }
}

impl Handler<PgConnection> for PerEvent {
    type Message = UsageRecorded;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        MESSAGE_TYPE
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: UsageRecorded,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        conn.add_usage(msg.user_id, msg.day, msg.amount)?;
        Ok(())
    }

    fn lock(&self) -> Option<ProjectionLock> {
        self.serialized
            .then(|| ProjectionLock::serialized("daily_usage"))
    }
}

/// A runtime scenario: the consumer's settings and where it writes.
pub struct RuntimeScenario<'a> {
    /// The PostgreSQL URL.
    pub db_url: &'a str,
    /// The AMQP URL.
    pub amqp_url: &'a str,
    /// An existing schema; the store migrates it and creates `daily_usage` in it.
    pub schema: &'a str,
    /// The queue and exchange name prefix (unique per run).
    pub prefix: &'a str,
    /// Consumer workers.
    pub workers: usize,
    /// Deliveries per batch (1: the plain case).
    pub batch: usize,
    /// The folding projection ([`DailyUsage`]) rather than [`PerEvent`].
    pub fold: bool,
}

impl RuntimeScenario<'_> {
    /// The store and consumer of this scenario.
    pub fn consumer(&self) -> (Arc<Store<PgConnection>>, Consumer<Store<PgConnection>>) {
        let mut builder = Store::<PgConnection>::builder(self.db_url.to_owned())
            .schema(self.schema)
            .pool_size(self.workers as u32 + 1);
        builder = if self.fold {
            builder.handler(DailyUsage::new(RetryPolicy::default()))
        } else {
            builder.handler(PerEvent::new(self.batch > 1))
        };
        let store = builder.build().expect("store");
        store
            .connection()
            .expect("conn")
            .create_daily_usage()
            .expect("table");
        let store = Arc::new(store);
        let topology = Topology::new("bench")
            .expect("topology")
            .prefix(self.prefix)
            .expect("prefix");
        let consumer = Consumer::new(self.amqp_url.to_owned(), Arc::clone(&store), topology)
            .with_settings(
                ConsumerSettings::default()
                    .workers(self.workers)
                    .prefetch(prefetch())
                    .batch(self.batch, Duration::from_millis(5)),
            );
        (store, consumer)
    }

    /// Declares the topology (recorded in `leftovers` until deleted), fills the queue
    /// with `deliveries`, consumes them all and checks every unique event was applied
    /// exactly once; deliveries per second from the first batch to the last decision.
    pub async fn run(&self, deliveries: &Deliveries, leftovers: &Leftovers) -> f64 {
        let (store, consumer) = self.consumer();
        let conn = Connection::connect(self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, self.amqp_url)));
        let topology = consumer.topology().clone();
        leftovers.add_topology(self.prefix, &topology);
        topology.declare(&conn).await.expect("declare");
        deliveries
            .fill(&conn, &topology.exchange(), MESSAGE_TYPE)
            .await;

        let stats = consumer.stats();
        let total = deliveries.order.len() as u64;
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        // The clock starts when the first batch is handed over: connecting and
        // declaring are startup, not throughput.
        while stats.snapshot().received == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        loop {
            let s = stats.snapshot();
            let decided = s.processed + s.duplicates;
            if decided >= total {
                break;
            }
            // Poll rarely while far from the end: a quarter of the time the rest
            // should take at the pace so far, between 1 and 20 ms.
            let left = started
                .elapsed()
                .mul_f64((total - decided) as f64 / decided.max(1) as f64);
            let poll = (left / 4).clamp(Duration::from_millis(1), Duration::from_millis(20));
            tokio::time::sleep(poll).await;
        }
        let elapsed = started.elapsed();
        shutdown.cancel();
        running.await.expect("join").expect("consumer");
        let s = stats.snapshot();
        assert_eq!(
            s.processed as usize,
            deliveries.workload.events.len(),
            "{}: {s:?}",
            self.schema
        );
        let found = store
            .connection()
            .expect("conn")
            .daily_totals()
            .expect("totals");
        assert_eq!(
            found,
            deliveries.workload.expected_totals(),
            "{}: totals",
            self.schema
        );
        topology.delete(&conn).await.expect("delete topology");
        leftovers.forget_topology(self.prefix);
        total as f64 / elapsed.as_secs_f64()
    }
}

/// The hand-written loops' claims table: the key and nothing else (no digest, no
/// state, no retries), in the connection's schema.
pub const HAND_CLAIMS_TABLE: &str = "CREATE TABLE claims (consumer_group TEXT NOT NULL, \
     message_key TEXT NOT NULL, PRIMARY KEY (consumer_group, message_key));";

mod hand {
    diesel::table! {
        /// The hand-written loops' claims (see [`super::HAND_CLAIMS_TABLE`]).
        claims (consumer_group, message_key) {
            /// The consumer group.
            consumer_group -> Text,
            /// The message key.
            message_key -> Text,
        }
    }
}

/// What the hand-written per-event loops do inside their transaction, for a batch of
/// `(message key, body)` sorted by key: claim each key (a prepared `DO NOTHING`
/// insert, as the runtime's claim is prepared), then upsert the claimed events one by
/// one in (user, day) order, so that concurrent transactions lock rows in one order
/// and do not deadlock. The keys it claimed.
pub fn hand_claim_and_upsert<'a>(
    conn: &mut PgConnection,
    bodies: &'a [(String, Vec<u8>)],
) -> QueryResult<Vec<&'a str>> {
    use diesel::sql_types::{BigInt, Date};
    let mut owned: Vec<(&str, UsageRecorded)> = Vec::with_capacity(bodies.len());
    for (key, body) in bodies {
        let claimed = diesel::insert_into(hand::claims::table)
            .values((
                hand::claims::consumer_group.eq(GROUP),
                hand::claims::message_key.eq(key),
            ))
            .on_conflict_do_nothing()
            .execute(conn)?;
        if claimed == 1 {
            owned.push((key.as_str(), serde_json::from_slice(body).expect("body")));
        }
    }
    owned.sort_by_key(|(_, e)| (e.user_id, e.day));
    for (_, e) in &owned {
        diesel::sql_query(
            "INSERT INTO daily_usage (user_id, day, total) VALUES ($1, $2, $3)
             ON CONFLICT (user_id, day) DO UPDATE SET total = daily_usage.total + excluded.total",
        )
        .bind::<BigInt, _>(e.user_id)
        .bind::<Date, _>(e.day)
        .bind::<BigInt, _>(e.amount)
        .execute(conn)?;
    }
    Ok(owned.into_iter().map(|(key, _)| key).collect())
}

/// A hand-written loop's batch: `first` and what else arrives, up to `per_batch`
/// deliveries, waiting at most 5 ms for them after the first.
pub async fn hand_batch(
    consumer: &mut lapin::Consumer,
    first: lapin::message::Delivery,
    per_batch: usize,
) -> Vec<lapin::message::Delivery> {
    use futures_lite::StreamExt as _;
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
    while batch.len() < per_batch {
        match tokio::time::timeout_at(deadline, consumer.next()).await {
            Ok(Some(Ok(d))) => batch.push(d),
            _ => break,
        }
    }
    batch
}

/// A batch's `(message id, body)`, sorted by key: claims go in key order (and the
/// upserts in row order), the same in every worker, so transactions do not deadlock.
pub fn hand_bodies(batch: &[lapin::message::Delivery]) -> Vec<(String, Vec<u8>)> {
    let mut bodies: Vec<(String, Vec<u8>)> = batch
        .iter()
        .map(|d| {
            let id = d
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.as_str().to_owned());
            (id.unwrap_or_default(), d.data.clone())
        })
        .collect();
    bodies.sort();
    bodies
}

/// Runs `body` in a transaction, again after an error (a careful hand-written loop
/// retries after a deadlock), at most 10 times; panics with the last error then.
pub fn hand_transaction<T>(
    conn: &mut PgConnection,
    mut body: impl FnMut(&mut PgConnection) -> QueryResult<T>,
) -> T {
    let mut tries = 0;
    loop {
        match conn.transaction::<_, diesel::result::Error, _>(&mut body) {
            Ok(value) => return value,
            Err(err) => {
                tries += 1;
                assert!(tries < 10, "transaction: {err}");
            }
        }
    }
}

/// What a benchmark has created on the shared servers (schemas, a topology), removed
/// by [`Leftovers::remove_all`]: on drop of a [`RemoveOnDrop`] (the normal end and a
/// panic) and on Ctrl-C or SIGTERM ([`remove_on_signal`]).
///
/// Every connection the benchmark opens carries `application_name` (see
/// [`Leftovers::url`]), so that the removal can end the benchmark's own sessions
/// first: a statement still running (a long prefill) would otherwise hold its locks
/// until it noticed its client was gone.
pub struct Leftovers {
    db_url: String,
    amqp_url: String,
    application: String,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    schemas: Vec<String>,
    topologies: BTreeMap<String, Topology>,
}

impl Leftovers {
    /// The leftovers of the run named `application` (`[a-z0-9_]`).
    pub fn new(db_url: &str, amqp_url: &str, application: &str) -> Arc<Self> {
        let separator = if db_url.contains('?') { '&' } else { '?' };
        Arc::new(Self {
            db_url: format!("{db_url}{separator}application_name={application}"),
            amqp_url: amqp_url.to_owned(),
            application: application.to_owned(),
            pending: Mutex::new(Pending::default()),
        })
    }

    /// The database URL every connection of the run uses (with its `application_name`).
    pub fn url(&self) -> &str {
        &self.db_url
    }

    /// Creates `schema` (dropping one of that name first) and records it for removal;
    /// a connection whose `search_path` is the schema.
    pub fn create_schema(&self, schema: &str) -> PgConnection {
        self.pending
            .lock()
            .expect("leftovers")
            .schemas
            .push(schema.to_owned());
        let mut conn = PgConnection::establish(&self.db_url)
            .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &self.db_url)));
        conn.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             SET search_path TO {schema};"
        ))
        .expect("schema");
        conn
    }

    /// Drops `schema` now (it was created by [`Leftovers::create_schema`]).
    pub fn drop_schema(&self, schema: &str) {
        let mut pending = self.pending.lock().expect("leftovers");
        if let Ok(mut conn) = PgConnection::establish(&self.db_url) {
            if conn
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .is_ok()
            {
                pending.schemas.retain(|s| s != schema);
            }
        }
    }

    /// Records `topology` (under `id`) for deletion until [`Leftovers::forget_topology`].
    pub fn add_topology(&self, id: &str, topology: &Topology) {
        self.pending
            .lock()
            .expect("leftovers")
            .topologies
            .insert(id.to_owned(), topology.clone());
    }

    /// Forgets the topology recorded under `id` (the caller deleted it).
    pub fn forget_topology(&self, id: &str) {
        self.pending
            .lock()
            .expect("leftovers")
            .topologies
            .remove(id);
    }

    /// Ends the run's other sessions, drops its schemas and deletes its topologies;
    /// what it removed, one line each. A second call (or a concurrent one, which
    /// waits) finds nothing left.
    pub fn remove_all(&self) -> Vec<String> {
        // Held throughout, so that a concurrent call (the signal handler, then the
        // panic it causes in the main task) returns only once everything is gone.
        let mut pending = match self.pending.lock() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut removed = Vec::new();
        if !pending.schemas.is_empty() {
            match PgConnection::establish(&self.db_url) {
                Ok(mut conn) => {
                    // A session left out of the termination must not hang the exit.
                    let _ = conn.batch_execute("SET lock_timeout = '10s'");
                    let _ = diesel::sql_query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name = $1 AND pid <> pg_backend_pid()",
                    )
                    .bind::<diesel::sql_types::Text, _>(&self.application)
                    .execute(&mut conn);
                    for schema in std::mem::take(&mut pending.schemas) {
                        match conn.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                        {
                            Ok(()) => removed.push(format!("schema {schema}")),
                            Err(e) => eprintln!("could not drop schema {schema}: {e}"),
                        }
                    }
                }
                Err(e) => eprintln!(
                    "could not connect to drop schemas {:?}: {}",
                    pending.schemas,
                    RedactedError::new(&e, &self.db_url)
                ),
            }
        }
        let topologies = std::mem::take(&mut pending.topologies);
        if !topologies.is_empty() {
            // Its own runtime on its own thread: this runs inside the benchmark's
            // runtime (on drop, or on a blocking thread for a signal).
            let amqp_url = self.amqp_url.clone();
            let deleted = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(async move {
                    let mut deleted = Vec::new();
                    match Connection::connect(&amqp_url, ConnectionProperties::default()).await {
                        Ok(conn) => {
                            for (id, topology) in topologies {
                                if topology.delete(&conn).await.is_ok() {
                                    deleted.push(format!("queues {id}*"));
                                }
                            }
                        }
                        Err(e) => eprintln!(
                            "could not connect to delete queues: {}",
                            RedactedError::new(&e, &amqp_url)
                        ),
                    }
                    deleted
                })
            })
            .join()
            .unwrap_or_default();
            removed.extend(deleted);
        }
        removed
    }
}

/// Removes the [`Leftovers`] when dropped: at the end of `main`, and while a panic
/// unwinds it.
pub struct RemoveOnDrop(pub Arc<Leftovers>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for line in self.0.remove_all() {
            eprintln!("removed {line}");
        }
    }
}

/// On Ctrl-C (SIGINT) or SIGTERM: removes the leftovers and exits with 130 (143 for
/// SIGTERM), as a shell reports a process killed by the signal.
pub fn remove_on_signal(leftovers: Arc<Leftovers>) {
    use tokio::signal::unix::{signal, SignalKind};
    tokio::spawn(async move {
        let (Ok(mut interrupt), Ok(mut terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            eprintln!("could not install signal handlers: Ctrl-C leaves the schemas behind");
            return;
        };
        let code = tokio::select! {
            _ = interrupt.recv() => 130,
            _ = terminate.recv() => 143,
        };
        eprintln!("interrupted: removing what the benchmark created");
        let removed = tokio::task::spawn_blocking(move || leftovers.remove_all())
            .await
            .unwrap_or_default();
        for line in removed {
            eprintln!("removed {line}");
        }
        std::process::exit(code);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1/test", "b1"),
            "postgres://postgres@127.0.0.1/b1"
        );
        assert_eq!(
            with_database("postgres://u:p@db:5433/app?sslmode=disable", "b1"),
            "postgres://u:p@db:5433/b1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://db", "b1"), "postgres://db/b1");
    }

    #[test]
    fn the_workload_has_its_duplicates() {
        let (workload, order) = workload_with_duplicates(110, 1);
        assert_eq!((workload.events.len(), order.len()), (100, 110));
        let mut seen = std::collections::BTreeSet::new();
        assert_eq!(order.iter().filter(|i| !seen.insert(**i)).count(), 10);
    }
}
