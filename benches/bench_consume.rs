//! `cargo run --release -p inbox-benches --bin bench_consume`: consumer throughput, in one run.
//!
//! 20,000 usage events with 10% duplicates, pre-filled into a quorum queue, consumed
//! into PostgreSQL (fsync as the server has it) by 4 workers, seven ways:
//!
//! - the runtime, batch size 1, one handler call per event;
//! - the runtime, batches of 100, one handler call per event;
//! - the runtime, batches of 100, the folding projection;
//! - a hand-written lapin + diesel loop: claim, upsert, commit, ack, per message;
//! - a hand-written batched loop: one upsert per event, one commit, one multiple ack;
//! - a hand-written folding loop: one claim statement, one upsert of the sums;
//! - no database at all (the broker ceiling): one multiple ack per batch.
//!
//! Each scenario's clock runs from its first whole batch to its last ack (connecting,
//! declaring and filling are not timed), after a pause that lets the broker finish
//! writing the filled queue; the runtime's end is seen by polling its counters, at
//! most a quarter of the remaining time late (1 to 20 ms). The hand-written loops'
//! claims are prepared statements, as the runtime's are. Rounds run every scenario in
//! turn, each round starting one scenario later; the report gives the median rate of
//! each and the median and range of the ratios taken within a round, since this
//! machine is shared and a slow spell should fall on both sides of a ratio. Last, the
//! folding consumer runs alone in a child process (this binary again) to measure its
//! own peak RSS.
//!
//! Every scenario's database connections use the same URL (so the same `sslmode`
//! and TLS, reported per scenario from `pg_stat_ssl`) and every queue is a quorum
//! queue. The report also gives each scenario's statements (round trips) per
//! delivery, counted by a diesel instrumentation over the consume window.
//!
//! Two more scenarios measure what the per-delivery spans cost: `rt_single_spans` and
//! `rt_fold_spans` are `rt_single` and `rt_fold` with spans on. The process holds one
//! global subscriber: a reloadable `EnvFilter` (`off` for every other scenario, `info`
//! for these two, as a program's `RUST_LOG=info`) and a `tracing-opentelemetry` layer
//! whose tracer provider sends every span through the SDK's batch processor to an
//! exporter that drops them, with the W3C propagator installed (inbox-core's
//! `opentelemetry` feature). The workload's messages carry no trace context, so each
//! delivery span starts a trace of its own. Reported as ratios to the same scenario
//! with spans off within each round, and in the CPU per delivery.
//!
//! Built with `--features bench-knobs`, the rounds also run the cost table's
//! scenarios: the runtime at batch size 1 with one guarantee switched off each
//! (`knob_digest`, `knob_checks`, `knob_takeover`, `knob_lookup`, `knob_narrow`,
//! `knob_bare`; see inbox-diesel's `BenchKnobs`), reported as ratios to `rt_single`
//! within each round. Never a production build.
//!
//! Environment: `DATABASE_URL`, `AMQP_URL` as for the tests; `BENCH_EVENTS`
//! (deliveries, default 20,000), `BENCH_WORKERS` (4), `BENCH_BATCH` (100; prefetch is
//! twice that), `BENCH_ROUNDS` (3), `BENCH_SETTLE_MS` (1000), `BENCH_ONLY` (a comma
//! list of `ceiling,hand_single,hand_batched,hand_fold,rt_single,rt_batched,rt_fold,`
//! `rt_single_spans,rt_fold_spans,rss`
//! and, with the feature, the `knob_*` scenarios), and
//! `BENCH_PERF_CTL=<fifo>` to profile only the consume windows with
//! `perf record -D -1 --control fifo:<fifo>`. Every run uses fresh schemas and queue
//! names and removes them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::NaiveDate;
use diesel::connection::SimpleConnection;
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, Text};
use diesel::{Connection as _, PgConnection};
use futures_lite::StreamExt;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_benches::{
    count_statements, cpu_ticks, env_or, publish_workload, service_urls, statements_sent,
    workload_with_duplicates, TICKS_PER_SECOND,
};
use inbox_core::{
    ConsumerGroup, Handler, HandlerError, MessageContext, ProjectionLock, RedactedError,
    RetryPolicy,
};
use inbox_diesel::Store;
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, Workload, GROUP, MESSAGE_TYPE};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};

/// Deliveries per batch (`BENCH_BATCH`); each consumer's prefetch is twice that.
fn batch_size() -> usize {
    env_or("BENCH_BATCH", 100)
}

type Totals = BTreeMap<(i64, NaiveDate), i64>;

/// The projection without a fold: one upsert per event (what the hand-written loops
/// do). `serialized`: batches take the projection lock exclusively, since events of
/// concurrent batches hit the same rows in any order (the hand-written batched loop
/// sorts its rows for the same reason); one event per transaction cannot deadlock.
struct PerEvent {
    group: ConsumerGroup,
    serialized: bool,
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

struct Bench {
    workers: usize,
    db_url: String,
    amqp_url: String,
    run: String,
    workload: Workload,
    order: Vec<usize>,
    /// Highest peak RSS seen while a runtime scenario ran.
    runtime_peak_kib: Mutex<u64>,
    /// Statements (round trips) per delivery in each scenario's consume window.
    statements: Mutex<BTreeMap<String, Vec<f64>>>,
    /// Whether each scenario's database connections negotiated TLS (`pg_stat_ssl`).
    tls: Mutex<BTreeMap<String, bool>>,
    /// The `application_name` of every database connection of this run.
    app: String,
    /// A connection of its own that reads which backends serve the run.
    monitor: Mutex<PgConnection>,
    /// CPU time per delivery in each scenario's consume window, in µs: this process
    /// (every thread) and the PostgreSQL backends serving it.
    cpu: Mutex<BTreeMap<String, Vec<(f64, f64)>>>,
}

impl Bench {
    fn schema(&self, name: &str) -> String {
        format!("{}_{name}", self.run)
    }

    fn fresh_schema(&self, name: &str) -> (String, PgConnection) {
        let schema = self.schema(name);
        let mut conn = PgConnection::establish(&self.db_url)
            .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &self.db_url)));
        conn.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; SET search_path TO {schema};"
        ))
        .expect("schema");
        (schema, conn)
    }

    fn drop_schema(&self, name: &str) {
        if let Ok(mut conn) = PgConnection::establish(&self.db_url) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                self.schema(name)
            ));
        }
    }

    /// Publishes the workload (with its duplicates) to `exchange` / `routing_key`.
    async fn fill(&self, conn: &Connection, exchange: &str, routing_key: &str) {
        publish_workload(conn, exchange, routing_key, &self.workload, &self.order)
            .await
            .expect("publish");
        // The broker keeps writing what it just confirmed (a quorum queue moves its log
        // into segment files) for a while: let that finish before any clock starts.
        tokio::time::sleep(settle()).await;
    }

    /// Every unique event applied exactly once.
    fn check_totals(&self, store: &Store<PgConnection>, name: &str) {
        let found = store
            .connection()
            .expect("conn")
            .daily_totals()
            .expect("totals");
        assert_eq!(found, self.workload.expected_totals(), "{name}: totals");
    }

    /// Declares a runtime consumer's topology and fills its queue; the connection.
    async fn declare_and_fill(&self, consumer: &Consumer<Store<PgConnection>>) -> Connection {
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        consumer.topology().declare(&conn).await.expect("declare");
        self.fill(&conn, &consumer.topology().exchange(), MESSAGE_TYPE)
            .await;
        conn
    }

    /// Notes whether `conn` (one of `scenario`'s) negotiated TLS.
    fn note_tls(&self, scenario: &str, conn: &mut PgConnection) {
        #[derive(QueryableByName)]
        struct Ssl {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            ssl: bool,
        }
        let ssl: Ssl =
            diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .get_result(conn)
                .expect("pg_stat_ssl");
        self.tls
            .lock()
            .expect("tls")
            .insert(scenario.to_owned(), ssl.ssl);
    }

    /// The run's PostgreSQL backends (other than the monitor) and the CPU ticks each
    /// has used.
    fn backends(&self) -> BTreeMap<u32, u64> {
        #[derive(QueryableByName)]
        struct Pid {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            pid: i32,
        }
        let pids: Vec<Pid> = diesel::sql_query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
        )
        .bind::<Text, _>(&self.app)
        .load(&mut *self.monitor.lock().expect("monitor"))
        .expect("backends");
        pids.into_iter()
            .filter_map(|p| {
                let pid = u32::try_from(p.pid).ok()?;
                Some((pid, cpu_ticks(pid)?))
            })
            .collect()
    }

    /// Notes the CPU per delivery of `scenario`: this process's ticks between two
    /// counts, and the run's backends' since `server_before`.
    fn note_cpu(&self, scenario: &str, client: (u64, u64), server_before: &BTreeMap<u32, u64>) {
        let server: u64 = self
            .backends()
            .iter()
            .map(|(pid, after)| after.saturating_sub(server_before.get(pid).copied().unwrap_or(0)))
            .sum();
        let per = |ticks: u64| ticks as f64 / TICKS_PER_SECOND * 1e6 / self.order.len() as f64;
        self.cpu
            .lock()
            .expect("cpu")
            .entry(scenario.to_owned())
            .or_default()
            .push((per(client.1.saturating_sub(client.0)), per(server)));
    }

    /// Notes the statements per delivery of `scenario` between two counts.
    fn note_statements(&self, scenario: &str, from: u64, to: u64) {
        let per = (to - from) as f64 / self.order.len() as f64;
        self.statements
            .lock()
            .expect("statements")
            .entry(scenario.to_owned())
            .or_default()
            .push(per);
    }

    /// A runtime scenario; `variant` names it: `rt_fold` folds, a `knob_*` one has
    /// its bench knobs.
    async fn runtime(&self, name: &str, variant: &str, batch: usize) -> f64 {
        let (schema, _) = self.fresh_schema(name);
        let (store, consumer) = runtime_consumer(
            &self.db_url,
            &self.amqp_url,
            &schema,
            &format!("{}.{name}.", self.run),
            self.workers,
            batch,
            variant,
        );
        let conn = self.declare_and_fill(&consumer).await;
        let topology = consumer.topology().clone();
        self.note_tls(variant, &mut store.connection().expect("conn"));

        // Every connection of the pool open before the clock starts, as the
        // hand-written loops open theirs: none pays its TLS handshake in the window.
        let held: Vec<_> = (0..=self.workers)
            .map(|_| store.connection().expect("conn"))
            .collect();
        drop(held);
        let stats = consumer.stats();
        let total = self.order.len() as u64;
        let shutdown = CancellationToken::new();
        reset_peak_rss();
        let spawned = Instant::now();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        // The clock starts when the first batch is handed over, as in the hand-written
        // loops: connecting and declaring the topology are startup, not throughput.
        // Spinning (tokio's timers tick in milliseconds) is over before it starts.
        while stats.snapshot().received == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let sent_before = statements_sent();
        let client_before = cpu_ticks(std::process::id()).unwrap_or(0);
        let server_before = self.backends();
        perf_control("enable");
        eprintln!(
            "  {name}: connected and declared in {:?}",
            started - spawned
        );
        loop {
            let s = stats.snapshot();
            let decided = s.processed + s.duplicates;
            if decided >= total {
                break;
            }
            // Polling wakes the runtime the consumer shares, so it polls rarely while
            // far from the end: a quarter of the time the rest should take at the pace
            // so far, between 1 and 20 ms (the end is seen at most that late).
            let left = started
                .elapsed()
                .mul_f64((total - decided) as f64 / decided.max(1) as f64);
            let poll = (left / 4).clamp(Duration::from_millis(1), Duration::from_millis(20));
            tokio::time::sleep(poll).await;
        }
        let elapsed = started.elapsed();
        self.note_statements(variant, sent_before, statements_sent());
        let client_after = cpu_ticks(std::process::id()).unwrap_or(0);
        self.note_cpu(variant, (client_before, client_after), &server_before);
        perf_control("disable");
        shutdown.cancel();
        running.await.expect("join").expect("consumer");
        if let Some(kib) = peak_rss_kib() {
            let mut peak = self.runtime_peak_kib.lock().expect("peak");
            *peak = (*peak).max(kib);
        }
        let s = stats.snapshot();
        eprintln!(
            "  {name}: {} batches, {:.1} deliveries each",
            s.batches,
            s.received as f64 / s.batches.max(1) as f64
        );
        assert_eq!(
            s.processed as usize,
            self.workload.events.len(),
            "{name}: {s:?}"
        );
        self.check_totals(&store, name);
        topology.delete(&conn).await.expect("delete topology");
        self.drop_schema(name);
        total as f64 / elapsed.as_secs_f64()
    }

    /// A hand-written loop (`scenario`): `per_batch` deliveries per transaction and ack
    /// (1 = per message).
    async fn handwritten(&self, name: &str, scenario: &str, per_batch: usize, mode: Hand) -> f64 {
        let database = mode != Hand::NoDatabase;
        let (schema, mut setup) = self.fresh_schema(name);
        setup
            .batch_execute(inbox_benches::HAND_CLAIMS_TABLE)
            .expect("claims");
        setup.create_daily_usage().expect("table");
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        let queue = format!("{}.{name}", self.run);
        let channel = conn.create_channel().await.expect("channel");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("quorum")),
        );
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .expect("queue");
        self.fill(&conn, "", &queue).await;

        let total = self.order.len();
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // The clock runs from the first whole batch to the last ack, as for the runtime.
        let first_batch = Arc::new(std::sync::OnceLock::new());
        let finished = Arc::new(std::sync::OnceLock::new());
        let mut tasks = Vec::new();
        // Each backend's CPU counted from when its connection is set up.
        let mut server_before = self.backends();
        let mut open = Vec::new();
        for _ in 0..self.workers {
            let db = if database {
                let mut c = PgConnection::establish(&self.db_url).unwrap_or_else(|e| {
                    panic!("connect: {}", RedactedError::new(&e, &self.db_url))
                });
                c.batch_execute(&format!("SET search_path TO {schema}"))
                    .expect("path");
                self.note_tls(scenario, &mut c);
                // This backend's CPU counts from here (after its TLS handshake);
                // the workers spawned before it are already consuming.
                #[derive(QueryableByName)]
                struct Pid {
                    #[diesel(sql_type = diesel::sql_types::Integer)]
                    pid: i32,
                }
                let own: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
                    .get_result(&mut c)
                    .expect("pid");
                if let Ok(pid) = u32::try_from(own.pid) {
                    server_before.insert(pid, cpu_ticks(pid).unwrap_or(0));
                }
                let db = Arc::new(Mutex::new(c));
                // Open until the backends' CPU is read, after the workers end.
                open.push(Arc::clone(&db));
                Some(db)
            } else {
                None
            };
            let channel = conn.create_channel().await.expect("channel");
            channel
                .basic_qos(prefetch(), BasicQosOptions::default())
                .await
                .expect("qos");
            let mut consumer = channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume");
            let done = Arc::clone(&done);
            let finished = Arc::clone(&finished);
            let first_batch = Arc::clone(&first_batch);
            tasks.push(tokio::spawn(async move {
                while done.load(std::sync::atomic::Ordering::Relaxed) < total {
                    let next =
                        tokio::time::timeout(Duration::from_millis(50), consumer.next()).await;
                    let Ok(Some(Ok(first))) = next else { continue };
                    let batch = inbox_benches::hand_batch(&mut consumer, first, per_batch).await;
                    // As for the runtime: the clock starts when a first batch is whole.
                    let at = (
                        Instant::now(),
                        statements_sent(),
                        cpu_ticks(std::process::id()).unwrap_or(0),
                    );
                    if first_batch.set(at).is_ok() {
                        perf_control("enable");
                    }
                    if let Some(db) = &db {
                        let db = Arc::clone(db);
                        let bodies = inbox_benches::hand_bodies(&batch);
                        tokio::task::spawn_blocking(move || {
                            let mut conn = db.lock().expect("db");
                            inbox_benches::hand_transaction(&mut conn, |conn| {
                                if mode == Hand::Fold {
                                    return hand_fold(conn, &bodies);
                                }
                                inbox_benches::hand_claim_and_upsert(conn, &bodies).map(drop)
                            });
                        })
                        .await
                        .expect("blocking");
                    }
                    let last = batch.last().map(|d| d.delivery_tag).unwrap_or_default();
                    channel
                        .basic_ack(last, BasicAckOptions { multiple: true })
                        .await
                        .expect("ack");
                    let before = done.fetch_add(batch.len(), std::sync::atomic::Ordering::Relaxed);
                    if before + batch.len() >= total {
                        // The last ack: the others notice within their 50 ms poll.
                        let _ = finished.set((
                            Instant::now(),
                            statements_sent(),
                            cpu_ticks(std::process::id()).unwrap_or(0),
                        ));
                        perf_control("disable");
                    }
                }
            }));
        }
        for task in tasks {
            task.await.expect("worker");
        }
        let (end, sent_after, client_after) = *finished.get().expect("every delivery acked");
        let (start, sent_before, client_before) = *first_batch.get().expect("a delivery");
        let elapsed = end - start;
        self.note_statements(scenario, sent_before, sent_after);
        if database {
            self.note_cpu(scenario, (client_before, client_after), &server_before);
        }
        drop(open);
        if database {
            let totals: Totals = setup.daily_totals().expect("totals");
            assert_eq!(totals, self.workload.expected_totals(), "{name}: totals");
        }
        delete(&conn, &[queue]).await;
        self.drop_schema(name);
        total as f64 / elapsed.as_secs_f64()
    }
}

/// What a hand-written loop does with a batch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hand {
    /// Nothing: the broker ceiling.
    NoDatabase,
    /// A claim and an upsert per event.
    PerEvent,
    /// One claim statement for the batch, one upsert of the sums (the example's).
    Fold,
}

/// The folding loop's claim of a whole batch, prepared once per connection like the
/// runtime's (a query fragment: diesel caches no raw SQL).
struct ClaimKeys<'a> {
    keys: Vec<&'a str>,
}

impl QueryId for ClaimKeys<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for ClaimKeys<'_> {
    type SqlType = Text;
}

impl RunQueryDsl<PgConnection> for ClaimKeys<'_> {}

impl QueryFragment<Pg> for ClaimKeys<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO claims (consumer_group, message_key) SELECT ");
        out.push_bind_param::<Text, _>(&GROUP)?;
        out.push_sql(", k FROM unnest(");
        out.push_bind_param::<Array<Text>, _>(&self.keys)?;
        out.push_sql("::text[]) k ON CONFLICT DO NOTHING RETURNING message_key");
        Ok(())
    }
}

/// The least a folding loop can do: claim the batch's keys in one statement (a
/// two-column claims table, no digest, no state), sum what it claimed per row, write
/// the sums in one upsert.
fn hand_fold(conn: &mut PgConnection, bodies: &[(String, Vec<u8>)]) -> QueryResult<()> {
    let keys: Vec<&str> = bodies.iter().map(|(k, _)| k.as_str()).collect();
    let claimed: Vec<String> = ClaimKeys { keys }.load(conn)?;
    let mut claimed: std::collections::HashSet<String> = claimed.into_iter().collect();
    let mut sums: BTreeMap<(i64, NaiveDate), i64> = BTreeMap::new();
    for (key, body) in bodies {
        // A key twice in the batch was claimed once: count it once.
        if claimed.remove(key) {
            let e: UsageRecorded = serde_json::from_slice(body).expect("body");
            *sums.entry((e.user_id, e.day)).or_default() += e.amount;
        }
    }
    let rows: Vec<(i64, NaiveDate, i64)> = sums.into_iter().map(|((u, d), a)| (u, d, a)).collect();
    conn.add_usage_rows(&rows)
}

async fn delete(conn: &Connection, queues: &[String]) {
    for queue in queues {
        if let Ok(channel) = conn.create_channel().await {
            let _ = channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

/// `BENCH_PERF_CTL=<fifo>`: tells `perf record -D -1 --control fifo:<fifo>` to sample
/// only while deliveries are consumed (not while the queues fill).
fn perf_control(command: &str) {
    use std::io::Write as _;
    if let Some(path) = std::env::var_os("BENCH_PERF_CTL") {
        if let Ok(mut fifo) = std::fs::OpenOptions::new().write(true).open(path) {
            let _ = writeln!(fifo, "{command}");
        }
    }
}

/// Pause after filling a queue (`BENCH_SETTLE_MS`, default 1000).
fn settle() -> Duration {
    Duration::from_millis(env_or("BENCH_SETTLE_MS", 1000))
}

fn prefetch() -> u16 {
    u16::try_from(2 * batch_size()).unwrap_or(u16::MAX)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The store and consumer of a runtime scenario (in the bench, or in the child
/// process that measures the consumer's own memory).
fn runtime_consumer(
    db_url: &str,
    amqp_url: &str,
    schema: &str,
    prefix: &str,
    workers: usize,
    batch: usize,
    variant: &str,
) -> (Arc<Store<PgConnection>>, Consumer<Store<PgConnection>>) {
    // The folding projection for the folding scenario and the memory measure.
    let fold = matches!(variant, "rt_fold" | "rt_fold_spans" | "rss");
    let mut builder = Store::<PgConnection>::builder(db_url.to_owned())
        .schema(schema)
        .pool_size(workers as u32 + 1);
    #[cfg(feature = "bench-knobs")]
    if let Some(knobs) = knobs::of(variant) {
        builder = builder.bench_knobs(knobs);
    }
    builder = if fold {
        builder.handler(DailyUsage::new(RetryPolicy::default()))
    } else {
        builder.handler(PerEvent {
            group: ConsumerGroup::new(GROUP).expect("group"),
            serialized: batch > 1,
        })
    };
    let store = builder.build().expect("store");
    store
        .connection()
        .expect("conn")
        .create_daily_usage()
        .expect("table");
    if knobs::narrow(variant) {
        // The benchmark's own schema: the claim key and nothing else.
        store
            .connection()
            .expect("conn")
            .batch_execute(
                "DROP TABLE inbox_claims CASCADE; CREATE TABLE inbox_claims (
                 consumer_group TEXT NOT NULL, message_key TEXT NOT NULL,
                 PRIMARY KEY (consumer_group, message_key));",
            )
            .expect("narrow claims");
    }
    let store = Arc::new(store);
    let topology = Topology::new("bench")
        .expect("topology")
        .prefix(prefix)
        .expect("prefix");
    let consumer = Consumer::new(amqp_url.to_owned(), Arc::clone(&store), topology).with_settings(
        ConsumerSettings::default()
            .workers(workers)
            .prefetch(prefetch())
            .batch(batch, Duration::from_millis(5)),
    );
    (store, consumer)
}

/// `BENCH_CHILD=<schema> <prefix> <deliveries>`: the folding consumer alone in a
/// process, over a queue the parent filled; prints its peak RSS when done.
async fn child_consumer(spec: &str, db_url: &str, amqp_url: &str, workers: usize) {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [schema, prefix, total] = parts[..] else {
        panic!("BENCH_CHILD: expected <schema> <prefix> <deliveries>, found {spec:?}");
    };
    let total: u64 = total.parse().expect("deliveries");
    let (_store, consumer) = runtime_consumer(
        db_url,
        amqp_url,
        schema,
        prefix,
        workers,
        batch_size(),
        "rt_fold",
    );
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    loop {
        let s = stats.snapshot();
        if s.processed + s.duplicates >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.expect("join").expect("consumer");
    println!("peak_rss_kib {}", peak_rss_kib().expect("VmHWM"));
}

impl Bench {
    /// The folding consumer in a process of its own (this binary again, as
    /// `BENCH_CHILD`): its peak RSS, without the workload and the other scenarios.
    async fn consumer_rss_kib(&self) -> u64 {
        let name = "rss";
        let (schema, _) = self.fresh_schema(name);
        let prefix = format!("{}.{name}.", self.run);
        let (store, consumer) = runtime_consumer(
            &self.db_url,
            &self.amqp_url,
            &schema,
            &prefix,
            self.workers,
            batch_size(),
            "rss",
        );
        let conn = self.declare_and_fill(&consumer).await;
        let exe = std::env::current_exe().expect("own path");
        let spec = format!("{schema} {prefix} {}", self.order.len());
        let out = tokio::task::spawn_blocking(move || {
            std::process::Command::new(exe)
                .env("BENCH_CHILD", spec)
                .output()
                .expect("child consumer")
        })
        .await
        .expect("join");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "child consumer: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let kib = stdout
            .lines()
            .find_map(|l| l.strip_prefix("peak_rss_kib "))
            .and_then(|n| n.parse().ok())
            .expect("the child printed its peak RSS");
        self.check_totals(&store, name);
        consumer
            .topology()
            .delete(&conn)
            .await
            .expect("delete topology");
        self.drop_schema(name);
        kib
    }
}

/// Resets the process's peak RSS to its current RSS (Linux: `clear_refs` 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let workers: usize = env_or("BENCH_WORKERS", 4);
    if let Ok(spec) = std::env::var("BENCH_CHILD") {
        child_consumer(&spec, &db_url, &amqp_url, workers).await;
        return;
    }
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    // Duplicates spread through the stream: every 10th unique event comes again later.
    let (workload, order) = workload_with_duplicates(events, 2026);
    let run = format!("bench_{}", std::process::id());
    // One application_name for every connection of the run (the same URL for every
    // scenario), by which the run's backends are found.
    let db_url = format!(
        "{db_url}{}application_name={run}",
        if db_url.contains('?') { '&' } else { '?' }
    );
    let monitor = PgConnection::establish(&db_url)
        .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &db_url)));
    let bench = Bench {
        workers,
        db_url,
        amqp_url,
        workload,
        order,
        runtime_peak_kib: Mutex::new(0),
        statements: Mutex::new(BTreeMap::new()),
        tls: Mutex::new(BTreeMap::new()),
        app: run.clone(),
        monitor: Mutex::new(monitor),
        cpu: Mutex::new(BTreeMap::new()),
        run,
    };
    count_statements();
    {
        let (fsync, tls) = inbox_benches::fsync_and_tls(&bench.db_url);
        println!(
            "{events} deliveries ({} unique), {} workers, batch {}; PostgreSQL fsync={}, TLS={}",
            bench.workload.events.len(),
            bench.workers,
            batch_size(),
            fsync,
            tls
        );
    }

    // BENCH_ONLY=rt_single,hand_single runs a subset (the others print as 0); `rss`
    // is the consumer's own memory, measured once after the rounds.
    let only = std::env::var("BENCH_ONLY").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    // Rounds run every scenario in turn, so that a slow spell of this shared machine
    // falls on all of them; ratios are taken within a round.
    let batch = batch_size();
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let mut names = vec![
        "ceiling",
        "hand_single",
        "hand_batched",
        "hand_fold",
        "rt_single",
        "rt_batched",
        "rt_fold",
        "rt_single_spans",
        "rt_fold_spans",
    ];
    let spans = spans::install();
    if cfg!(feature = "bench-knobs") {
        names.extend(knobs::SCENARIOS.iter().map(|(name, _)| *name));
    }
    let mut rates: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        // Each round starts one scenario later, so that no scenario always runs last
        // (after the others' writes) or first.
        for k in 0..names.len() {
            let name = names[(k + round) % names.len()];
            if !wanted(name) {
                continue;
            }
            let id = format!("{name}{round}");
            let rate = match name {
                "ceiling" => bench.handwritten(&id, name, batch, Hand::NoDatabase).await,
                "hand_single" => bench.handwritten(&id, name, 1, Hand::PerEvent).await,
                "hand_batched" => bench.handwritten(&id, name, batch, Hand::PerEvent).await,
                "hand_fold" => bench.handwritten(&id, name, batch, Hand::Fold).await,
                "rt_batched" | "rt_fold" => bench.runtime(&id, name, batch).await,
                "rt_single_spans" | "rt_fold_spans" => {
                    spans.set(true);
                    let batch = if name == "rt_fold_spans" { batch } else { 1 };
                    let rate = bench.runtime(&id, name, batch).await;
                    spans.set(false);
                    rate
                }
                // rt_single, and the cost table's knob_* (batch size 1 too).
                _ => bench.runtime(&id, name, 1).await,
            };
            eprintln!("  round {}: {name}: {rate:.0} deliveries/s", round + 1);
            rates.entry(name).or_default().push(rate);
        }
    }
    let consumer_rss = if wanted("rss") {
        Some(bench.consumer_rss_kib().await)
    } else {
        None
    };
    let rate = |name: &str| rates.get(name).map_or(0.0, |r| median(r.clone()));

    println!();
    println!(
        "{:<58} {:>12}",
        "scenario (median of rounds)", "deliveries/s"
    );
    for (name, label) in [
        (
            "ceiling",
            "no database, one multiple ack per batch (broker ceiling)",
        ),
        (
            "hand_single",
            "hand-written: claim + upsert + commit + ack per message",
        ),
        (
            "hand_batched",
            "hand-written: batches, one upsert per event, one commit",
        ),
        (
            "hand_fold",
            "hand-written: batches, one claim, one upsert of the sums",
        ),
        ("rt_single", "runtime: batch size 1"),
        ("rt_batched", "runtime: batches, one handler call per event"),
        ("rt_fold", "runtime: batches, folding projection"),
        ("rt_single_spans", "runtime: batch size 1, spans on (info)"),
        (
            "rt_fold_spans",
            "runtime: batches, folding projection, spans on (info)",
        ),
    ] {
        println!("{label:<58} {:>12.0}", rate(name));
    }
    println!();
    println!("ratio within each round: median (lowest..highest)");
    for (label, num, den, aim) in [
        (
            "runtime batch 1 / hand-written per message",
            "rt_single",
            "hand_single",
            0.9,
        ),
        (
            "runtime batched / hand-written batched",
            "rt_batched",
            "hand_batched",
            0.7,
        ),
        (
            "runtime folding / broker ceiling",
            "rt_fold",
            "ceiling",
            0.6,
        ),
        (
            "runtime folding / hand-written folding",
            "rt_fold",
            "hand_fold",
            0.0,
        ),
        (
            "hand-written folding / broker ceiling",
            "hand_fold",
            "ceiling",
            0.0,
        ),
        (
            "runtime batch 1: spans on / spans off",
            "rt_single_spans",
            "rt_single",
            0.0,
        ),
        (
            "runtime folding: spans on / spans off",
            "rt_fold_spans",
            "rt_fold",
            0.0,
        ),
    ] {
        let (Some(n), Some(d)) = (rates.get(num), rates.get(den)) else {
            continue;
        };
        let ratios: Vec<f64> = n.iter().zip(d).map(|(n, d)| n / d).collect();
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(0.0, f64::max);
        let aim = if aim > 0.0 {
            format!("; aim >= {aim}")
        } else {
            String::new()
        };
        println!(
            "{label:<44} {:.2} ({low:.2}..{high:.2}{aim})",
            median(ratios)
        );
    }
    knobs::print_costs(&rates);
    let cpu = bench.cpu.lock().expect("cpu");
    if !cpu.is_empty() {
        println!();
        println!(
            "CPU per delivery in the consume window, µs (median of rounds; this process, \
             its PostgreSQL backends, both)"
        );
        for name in &names {
            if let Some(per) = cpu.get(*name) {
                let client = median(per.iter().map(|c| c.0).collect());
                let server = median(per.iter().map(|c| c.1).collect());
                let both = median(per.iter().map(|c| c.0 + c.1).collect());
                println!("  {name:<14} {client:>8.0} {server:>8.0} {both:>8.0}");
            }
        }
        if let (Some(rt), Some(hand)) = (cpu.get("rt_single"), cpu.get("hand_single")) {
            let ratios: Vec<f64> = rt
                .iter()
                .zip(hand)
                .map(|(r, h)| (h.0 + h.1) / (r.0 + r.1))
                .collect();
            let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let high = ratios.iter().copied().fold(0.0, f64::max);
            println!(
                "  hand_single CPU / rt_single CPU per delivery, within each round: {:.2} ({low:.2}..{high:.2})",
                median(ratios)
            );
        }
        for (name, off) in knobs::SCENARIOS {
            if let (Some(knob), Some(full)) = (cpu.get(*name), cpu.get("rt_single")) {
                let saved: Vec<f64> = knob
                    .iter()
                    .zip(full)
                    .map(|(k, f)| (f.0 + f.1) - (k.0 + k.1))
                    .collect();
                println!(
                    "  {off:<48} costs {:>5.0} µs CPU per delivery (median of rounds)",
                    median(saved)
                );
            }
        }
    }
    drop(cpu);
    let statements = bench.statements.lock().expect("statements");
    if !statements.is_empty() {
        println!();
        println!("statements (round trips) per delivery in the consume window: median of rounds");
        for name in &names {
            if let Some(per) = statements.get(*name) {
                println!("  {name:<14} {:.2}", median(per.clone()));
            }
        }
    }
    drop(statements);
    let tls = bench.tls.lock().expect("tls");
    if !tls.is_empty() {
        let list: Vec<String> = tls
            .iter()
            .map(|(name, on)| format!("{name} {}", if *on { "on" } else { "off" }))
            .collect();
        println!(
            "PostgreSQL TLS of each scenario's connections (pg_stat_ssl): {}",
            list.join(", ")
        );
        println!("every scenario's queue: quorum; every scenario's database URL: the same");
    }
    drop(tls);
    if let Some(kib) = consumer_rss {
        println!(
            "peak RSS of the folding consumer in a process of its own: {:.1} MiB (aim < 64)",
            kib as f64 / 1024.0
        );
    }
    let runtime_peak = *bench.runtime_peak_kib.lock().expect("peak");
    if runtime_peak > 0 {
        println!(
            "peak RSS of this process while the runtime consumed: {:.1} MiB \
             (with the workload and what earlier scenarios left)",
            runtime_peak as f64 / 1024.0
        );
    }
}

/// The cost table: the runtime at batch size 1 with one guarantee switched off each
/// (inbox-diesel's `bench-knobs`, benchmark builds only), against the full runtime
/// (`rt_single`) in the same round.
mod knobs {
    use std::collections::BTreeMap;

    /// Each scenario and what it switches off.
    pub(crate) const SCENARIOS: &[(&str, &str)] = &[
        ("knob_digest", "payload digest (SHA-256; zero digests)"),
        ("knob_checks", "commit checks (savepoint, token, check)"),
        ("knob_takeover", "takeover clause (DO NOTHING)"),
        ("knob_lookup", "duplicate lookup (acked unread)"),
        (
            "knob_narrow",
            "status/retry/digest columns (2-column table)",
        ),
        ("knob_bare", "all of the above"),
    ];

    #[cfg(feature = "bench-knobs")]
    pub(crate) fn of(variant: &str) -> Option<inbox_diesel::BenchKnobs> {
        let mut knobs = inbox_diesel::BenchKnobs::full();
        match variant {
            "knob_digest" => knobs.digest = false,
            "knob_checks" => knobs.commit_checks = false,
            "knob_takeover" => knobs.takeover = false,
            "knob_lookup" => knobs.lookup = false,
            "knob_narrow" => knobs.narrow_claims = true,
            "knob_bare" => {
                knobs.digest = false;
                knobs.commit_checks = false;
                knobs.narrow_claims = true;
            }
            _ => return None,
        }
        Some(knobs)
    }

    /// Whether the scenario claims into a two-column table of its own schema.
    pub(crate) fn narrow(variant: &str) -> bool {
        cfg!(feature = "bench-knobs") && matches!(variant, "knob_narrow" | "knob_bare")
    }

    pub(crate) fn print_costs(rates: &BTreeMap<&str, Vec<f64>>) {
        let Some(full) = rates.get("rt_single") else {
            return;
        };
        let mut printed = false;
        for (name, off) in SCENARIOS {
            let Some(knob) = rates.get(name) else {
                continue;
            };
            if !printed {
                println!();
                println!(
                    "what each guarantee costs at batch size 1: rate with it off / rt_single, \
                     within each round"
                );
                println!(
                    "{:<48} {:>20} {:>12}",
                    "switched off", "median (low..high)", "share"
                );
                printed = true;
            }
            let ratios: Vec<f64> = knob.iter().zip(full).map(|(k, f)| k / f).collect();
            let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let high = ratios.iter().copied().fold(0.0, f64::max);
            let mid = super::median(ratios);
            // The share of the full runtime's time per message the guarantee takes.
            println!(
                "{off:<48} {:>20} {:>11.0}%",
                format!("{mid:.2} ({low:.2}..{high:.2})"),
                (1.0 - 1.0 / mid) * 100.0
            );
        }
    }
}

/// The per-delivery spans switched on and off between scenarios.
mod spans {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{reload, EnvFilter, Registry};

    /// An exporter that drops what it is given: the spans are built, batched and
    /// handed over as to a real one, and nothing is sent.
    #[derive(Debug)]
    struct Discard;

    impl SpanExporter for Discard {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            drop(batch);
            Ok(())
        }
    }

    /// The filter of the process's one subscriber.
    pub(crate) struct Switch {
        filter: reload::Handle<EnvFilter, Registry>,
        // Kept alive: dropping the provider shuts its batch processor down.
        _provider: SdkTracerProvider,
    }

    /// Installs the global subscriber, spans off.
    pub(crate) fn install() -> Switch {
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(Discard)
            .build();
        let (filter, handle) = reload::Layer::new(EnvFilter::new("off"));
        let subscriber = tracing_subscriber::registry()
            .with(filter)
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bench_consume")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        Switch {
            filter: handle,
            _provider: provider,
        }
    }

    impl Switch {
        /// Spans at `info` (on) or none (off).
        pub(crate) fn set(&self, on: bool) {
            let filter = EnvFilter::new(if on { "info" } else { "off" });
            self.filter
                .reload(filter)
                .expect("the subscriber is installed");
        }
    }
}
