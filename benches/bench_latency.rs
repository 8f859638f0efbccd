//! `cargo run --release -p inbox-benches --bin bench_latency`: publish-to-commit latency
//! under an offered load, in one run.
//!
//! An open-loop publisher offers fixed rates (`BENCH_RATES`, default
//! `200,1000,5000,20000` msg/s) for `BENCH_SECONDS` each (default 10): message `i` is
//! due at `start + i / rate` and goes out when it is due, whether or not the consumer
//! keeps up. It spreads the messages over `BENCH_PUBLISHERS` connections (default 4,
//! a channel and a task each), persistent, on channels in confirm mode whose confirms
//! are awaited once at the end; the report gives the rate it achieved (messages over
//! the time from the first due instant to the last send) beside the offered one.
//! Every message carries the wall-clock time it was sent, nanoseconds since the UNIX
//! epoch, in the header `x-published-ns` (one machine, one clock).
//!
//! The workload is `bench_consume`'s: usage events, 10% duplicates (every tenth event
//! sent again three events later), a quorum queue per system and rate (the runtime's
//! topology, declared the same way for every system), PostgreSQL as the server has
//! it. Four systems, each round starting one system later:
//!
//! - `hand_single`: the hand-written lapin + diesel loop of `bench_consume`, claim +
//!   upsert + commit + ack per message, `BENCH_WORKERS` (4) workers, prefetch 200;
//! - `hand_batched`: the same loop taking up to 100 deliveries, waiting at most 5 ms
//!   for them, one commit and one `multiple` ack per batch;
//! - `rt_default`: the runtime with `ConsumerSettings::default()` and the store
//!   builder's default pool, the example's folding projection (`DailyUsage`);
//! - `rt_tuned`: the runtime as the performance guide runs it (`rt_fold`): 4
//!   workers, prefetch 200, batches of 100 waiting at most 5 ms, a pool of 5, the
//!   folding projection.
//!
//! Latency of a message: from the `x-published-ns` of its first copy to the moment
//! the COMMIT of the transaction that applied it returned, read from the wall clock
//! in the same process. The hand-written loops read it right after their commit. The
//! runtime is timed without touching its code: its handler is `DailyUsage` wrapped to
//! note each message's key and publish time on the thread it runs on, and a diesel
//! instrumentation on every connection stamps the noted messages when a statement
//! ending in `COMMIT` finishes without error on that thread (the store commits on
//! the thread that ran the handlers), and forgets them on a `ROLLBACK`. So both
//! include the commit's round trip and exclude the ack. Duplicates are not timed:
//! their effect committed with the first copy.
//!
//! Sustained: the publisher achieved at least 95% of the offered rate, and every
//! unique event was committed within `BENCH_DRAIN_MS` (default 250) of the last
//! send. A rate is reported sustained when it was so in a majority of rounds. After
//! the drain window the benchmark waits (up to `BENCH_DRAIN_LIMIT_S`, default 300) for
//! the rest, then checks exactly: the projection equals the unique events' totals,
//! every unique event committed exactly once (one stamp each, no key stamped twice,
//! every stamp carrying a publish time) and, for the runtime, its counters agree. Any
//! difference panics.
//!
//! Also printed: the machine's load average (`/proc/loadavg`) at the start and end and
//! its range over the run; an SVG of p99 against offered load per system (log-log) is
//! written to `BENCH_SVG` (default `target/bench_latency.svg`). Every schema and queue
//! is removed at the end, on a panic and on Ctrl-C or SIGTERM.
//!
//! Environment: `DATABASE_URL`, `AMQP_URL` as for the tests; `BENCH_RATES`,
//! `BENCH_SECONDS`, `BENCH_ROUNDS` (3), `BENCH_WORKERS` (4), `BENCH_PUBLISHERS`,
//! `BENCH_DRAIN_MS`, `BENCH_DRAIN_LIMIT_S`, `BENCH_SVG`, `BENCH_ONLY` (a comma list
//! of `hand_single,hand_batched,rt_default,rt_tuned`).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::connection::{Instrumentation, InstrumentationEvent, SimpleConnection};
use diesel::{Connection as _, PgConnection};
use futures_lite::StreamExt;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, ConsumerStats, Topology};
use inbox_benches::{
    env_or, median, remove_on_signal, service_urls, Deliveries, Leftovers, RemoveOnDrop,
    HAND_CLAIMS_TABLE,
};
use inbox_core::{
    ConsumerGroup, Handler, HandlerError, MessageContext, ProjectionLock, RedactedError,
    RetryPolicy,
};
use inbox_diesel::Store;
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, GROUP, MESSAGE_TYPE};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};

/// The header carrying the publish time, nanoseconds since the UNIX epoch.
const PUBLISHED_HEADER: &str = "x-published-ns";

const SYSTEMS: [&str; 4] = ["hand_single", "hand_batched", "rt_default", "rt_tuned"];

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// When each unique event's effect committed: key -> (published, committed), in ns
/// since the epoch; keys stamped a second time (a doubled effect).
#[derive(Default)]
struct Stamps {
    committed: HashMap<String, (u64, u64)>,
    doubled: Vec<String>,
}

static STAMPS: Mutex<Option<Stamps>> = Mutex::new(None);

fn stamp(key: String, published: u64, committed: u64) {
    let mut stamps = STAMPS.lock().expect("stamps");
    let stamps = stamps.get_or_insert_with(Stamps::default);
    if stamps
        .committed
        .insert(key.clone(), (published, committed))
        .is_some()
    {
        stamps.doubled.push(key);
    }
}

fn committed_count() -> usize {
    STAMPS
        .lock()
        .expect("stamps")
        .as_ref()
        .map_or(0, |s| s.committed.len())
}

fn take_stamps() -> Stamps {
    STAMPS.lock().expect("stamps").take().unwrap_or_default()
}

thread_local! {
    /// The runtime's messages handled on this thread in the open transaction.
    static PENDING: RefCell<Vec<(String, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Stamps the messages its thread noted when a COMMIT returns; forgets them on a
/// rollback. Installed on every diesel connection of the process.
struct CommitClock;

impl Instrumentation for CommitClock {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        let InstrumentationEvent::FinishQuery { query, error, .. } = event else {
            return;
        };
        PENDING.with(|pending| {
            let mut pending = pending.borrow_mut();
            if pending.is_empty() {
                return;
            }
            let sql = query.to_string();
            let sql = sql.trim_end().trim_end_matches(';');
            if sql.ends_with("COMMIT") && error.is_none() {
                let at = now_ns();
                // A batch whose fold failed runs its handlers again after a rollback to
                // its savepoint (left noted above): one stamp per key and commit.
                pending.sort();
                pending.dedup_by(|a, b| a.0 == b.0);
                for (key, published) in pending.drain(..) {
                    stamp(key, published, at);
                }
            } else if sql.ends_with("COMMIT")
                || (sql.contains("ROLLBACK") && !sql.contains("ROLLBACK TO SAVEPOINT"))
            {
                pending.clear();
            }
        });
    }
}

fn published_of(ctx: &MessageContext<'_>) -> u64 {
    ctx.envelope()
        .headers
        .get(PUBLISHED_HEADER)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The example's folding projection, noting what it handles for [`CommitClock`].
struct Timed(DailyUsage);

impl Timed {
    fn note(ctx: &MessageContext<'_>) {
        let key = ctx.message_key().as_str().to_owned();
        PENDING.with(|p| p.borrow_mut().push((key, published_of(ctx))));
    }
}

impl Handler<PgConnection> for Timed {
    type Message = UsageRecorded;

    fn group(&self) -> &ConsumerGroup {
        Handler::<PgConnection>::group(&self.0)
    }

    fn message_type(&self) -> &str {
        Handler::<PgConnection>::message_type(&self.0)
    }

    fn retry_policy(&self) -> RetryPolicy {
        Handler::<PgConnection>::retry_policy(&self.0)
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: UsageRecorded,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        Self::note(ctx);
        Handler::<PgConnection>::handle(&self.0, conn, msg, ctx)
    }

    fn fold(
        &self,
        conn: &mut PgConnection,
        batch: &[(UsageRecorded, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        for (_, ctx) in batch {
            Self::note(ctx);
        }
        Handler::<PgConnection>::fold(&self.0, conn, batch)
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Handler::<PgConnection>::lock(&self.0)
    }
}

/// One system at one rate in one round.
struct Measure {
    offered: f64,
    achieved: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    /// Seconds from the last send until every unique event had committed.
    drained: f64,
    sustained: bool,
}

struct Bench {
    leftovers: Arc<Leftovers>,
    amqp_url: String,
    run: String,
    workers: usize,
    publishers: usize,
    seconds: f64,
    drain: Duration,
    drain_limit: Duration,
    loads: Mutex<Vec<f64>>,
}

/// The 1-minute load average.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Bench {
    async fn amqp(&self) -> Connection {
        Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)))
    }

    /// Publishes `deliveries` open loop at `rate` to `exchange`; the achieved rate and
    /// the instant of the last send.
    async fn publish(&self, deliveries: &Deliveries, exchange: &str, rate: f64) -> (f64, Instant) {
        let total = deliveries.order.len();
        let mut channels = Vec::new();
        let mut connections = Vec::new();
        for _ in 0..self.publishers {
            let conn = self.amqp().await;
            let channel = conn.create_channel().await.expect("channel");
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .expect("confirms");
            channels.push(channel);
            connections.push(conn);
        }
        // The messages, encoded before the clock starts.
        let messages: Arc<Vec<(String, Vec<u8>)>> = Arc::new(
            deliveries
                .order
                .iter()
                .map(|&i| {
                    let (key, event) = &deliveries.workload.events[i];
                    (
                        key.as_str().to_owned(),
                        serde_json::to_vec(event).expect("event"),
                    )
                })
                .collect(),
        );
        let start = tokio::time::Instant::now() + Duration::from_millis(20);
        let mut tasks = Vec::new();
        for (k, channel) in channels.into_iter().enumerate() {
            let messages = Arc::clone(&messages);
            let exchange = exchange.to_owned();
            let publishers = self.publishers;
            tasks.push(tokio::spawn(async move {
                let mut i = k;
                while i < total {
                    let due = start + Duration::from_secs_f64(i as f64 / rate);
                    if due > tokio::time::Instant::now() {
                        tokio::time::sleep_until(due).await;
                    }
                    let (key, body) = &messages[i];
                    let mut headers = FieldTable::default();
                    headers.insert(
                        PUBLISHED_HEADER.into(),
                        AMQPValue::LongString(LongString::from(now_ns().to_string())),
                    );
                    channel
                        .basic_publish(
                            exchange.as_str().into(),
                            MESSAGE_TYPE.into(),
                            BasicPublishOptions::default(),
                            body,
                            lapin::BasicProperties::default()
                                .with_message_id(key.as_str().into())
                                .with_type(MESSAGE_TYPE.into())
                                .with_delivery_mode(2)
                                .with_headers(headers),
                        )
                        .await
                        .expect("publish");
                    i += publishers;
                }
                let last = Instant::now();
                let returned = channel.wait_for_confirms().await.expect("confirms");
                assert!(
                    returned.is_empty(),
                    "{} messages unroutable",
                    returned.len()
                );
                let _ = channel.close(200, "published".into()).await;
                last
            }));
        }
        let mut last = Instant::now();
        let mut first = true;
        for task in tasks {
            let at = task.await.expect("publisher");
            if first || at > last {
                last = at;
                first = false;
            }
        }
        for conn in connections {
            let _ = conn.close(200, "published".into()).await;
        }
        // Message i is due i / rate after start and never goes out earlier: the
        // intervals sent over the time they took.
        let elapsed = last.saturating_duration_since(start.into_std());
        let intervals = (total as f64 - 1.0).max(1.0);
        (
            intervals / elapsed.as_secs_f64().max(intervals / rate),
            last,
        )
    }

    /// Waits for `unique` commits: the seconds from `last_send` until the last one,
    /// and whether they came within the drain window. Panics past the drain limit.
    async fn drain(&self, unique: usize, last_send: Instant, name: &str) -> (f64, bool) {
        loop {
            if committed_count() >= unique {
                let drained = last_send.elapsed();
                return (drained.as_secs_f64(), drained <= self.drain);
            }
            assert!(
                last_send.elapsed() < self.drain_limit,
                "{name}: {} of {unique} unique events committed {:?} after the last send",
                committed_count(),
                self.drain_limit
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The exact checks: every unique event committed once, the projection equals the
    /// unique events' totals. The sorted latencies, in ms.
    fn check(&self, name: &str, deliveries: &Deliveries, conn: &mut PgConnection) -> Vec<f64> {
        let stamps = take_stamps();
        assert!(
            stamps.doubled.is_empty(),
            "{name}: {} events committed twice, e.g. {:?}",
            stamps.doubled.len(),
            stamps.doubled.first()
        );
        let unique = deliveries.workload.events.len();
        assert_eq!(stamps.committed.len(), unique, "{name}: events committed");
        for (key, _) in &deliveries.workload.events {
            assert!(
                stamps.committed.contains_key(key.as_str()),
                "{name}: {} never committed",
                key.as_str()
            );
        }
        let totals = conn.daily_totals().expect("totals");
        assert_eq!(
            totals,
            deliveries.workload.expected_totals(),
            "{name}: the projection differs from the unique events"
        );
        let mut latencies: Vec<f64> = stamps
            .committed
            .values()
            .map(|&(published, committed)| {
                assert!(published > 0, "{name}: a message without its publish time");
                committed.saturating_sub(published) as f64 / 1e6
            })
            .collect();
        latencies.sort_by(f64::total_cmp);
        latencies
    }

    /// The runtime (`tuned`: as the performance guide runs it, else its defaults)
    /// consuming into `schema`: its declared topology, counters and task.
    async fn start_runtime(
        &self,
        tuned: bool,
        schema: &str,
        prefix: &str,
        id: &str,
        amqp: &Connection,
        shutdown: CancellationToken,
    ) -> (Topology, Arc<ConsumerStats>, tokio::task::JoinHandle<()>) {
        let mut builder = Store::<PgConnection>::builder(self.leftovers.url().to_owned())
            .schema(schema)
            .handler(Timed(DailyUsage::new(RetryPolicy::default())));
        if tuned {
            builder = builder.pool_size(self.workers as u32 + 1);
        }
        let store = builder.build().expect("store");
        store
            .connection()
            .expect("conn")
            .create_daily_usage()
            .expect("table");
        let topology = Topology::new("bench")
            .expect("topology")
            .prefix(prefix)
            .expect("prefix");
        let settings = if tuned {
            ConsumerSettings::default()
                .workers(self.workers)
                .prefetch(200)
                .batch(100, Duration::from_millis(5))
        } else {
            ConsumerSettings::default()
        };
        let consumer =
            Consumer::new(self.amqp_url.clone(), Arc::new(store), topology).with_settings(settings);
        let topology = consumer.topology().clone();
        self.leftovers.add_topology(id, &topology);
        topology.declare(amqp).await.expect("declare");
        let stats = consumer.stats();
        let running = tokio::spawn(async move {
            consumer.run(shutdown).await.expect("consumer");
        });
        (topology, stats, running)
    }

    /// The hand-written loop's workers (`per_batch` deliveries a transaction)
    /// consuming into `schema` (tables created through `setup`): the declared topology
    /// and the workers' tasks.
    #[allow(clippy::too_many_arguments)] // one call site, each argument named there
    async fn start_hand(
        &self,
        per_batch: usize,
        setup: &mut PgConnection,
        schema: &str,
        prefix: &str,
        id: &str,
        amqp: &Connection,
        shutdown: &CancellationToken,
    ) -> (Topology, Vec<tokio::task::JoinHandle<()>>) {
        setup.batch_execute(HAND_CLAIMS_TABLE).expect("claims");
        setup.create_daily_usage().expect("table");
        let group = ConsumerGroup::new(GROUP).expect("group");
        let topology = Topology::new("bench")
            .expect("topology")
            .prefix(prefix)
            .expect("prefix")
            .group(group.clone(), [MESSAGE_TYPE]);
        self.leftovers.add_topology(id, &topology);
        topology.declare(amqp).await.expect("declare");
        let mut running = Vec::new();
        for _ in 0..self.workers {
            let mut db = PgConnection::establish(self.leftovers.url()).unwrap_or_else(|e| {
                panic!("connect: {}", RedactedError::new(&e, self.leftovers.url()))
            });
            db.batch_execute(&format!("SET search_path TO {schema}"))
                .expect("path");
            let channel = amqp.create_channel().await.expect("channel");
            channel
                .basic_qos(200, BasicQosOptions::default())
                .await
                .expect("qos");
            let consumer = channel
                .basic_consume(
                    topology.queue(&group).as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume");
            running.push(tokio::spawn(hand_worker(
                channel,
                consumer,
                Arc::new(Mutex::new(db)),
                per_batch,
                shutdown.clone(),
            )));
        }
        (topology, running)
    }

    /// Runs `system` at `rate` with a fresh schema and topology.
    async fn run_one(&self, system: &str, id: &str, rate: f64, deliveries: &Deliveries) -> Measure {
        let schema = format!("{}_{id}", self.run.replace('.', "_"));
        let prefix = format!("{}.{id}.", self.run);
        let mut setup = self.leftovers.create_schema(&schema);
        take_stamps();
        let amqp = self.amqp().await;
        let shutdown = CancellationToken::new();
        let mut running = Vec::new();
        let (topology, consumer_stats) = if system.starts_with("rt_") {
            let tuned = system == "rt_tuned";
            let (topology, stats, task) = self
                .start_runtime(tuned, &schema, &prefix, id, &amqp, shutdown.clone())
                .await;
            running.push(task);
            (topology, Some(stats))
        } else {
            let per_batch = if system == "hand_single" { 1 } else { 100 };
            let (topology, tasks) = self
                .start_hand(
                    per_batch, &mut setup, &schema, &prefix, id, &amqp, &shutdown,
                )
                .await;
            running.extend(tasks);
            (topology, None)
        };
        // Let the consumers connect and start consuming before the first message.
        tokio::time::sleep(Duration::from_millis(500)).await;

        let (achieved, last_send) = self.publish(deliveries, &topology.exchange(), rate).await;
        let unique = deliveries.workload.events.len();
        let (drained, in_time) = self.drain(unique, last_send, id).await;
        // Duplicates are acked after the last commit: wait for the runtime's counters.
        if let Some(stats) = &consumer_stats {
            let total = deliveries.order.len() as u64;
            let since = Instant::now();
            loop {
                let s = stats.snapshot();
                if s.processed + s.duplicates >= total {
                    break;
                }
                assert!(since.elapsed() < self.drain_limit, "{id}: {s:?}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        shutdown.cancel();
        for task in running {
            task.await.expect("consumer task");
        }
        if let Some(stats) = &consumer_stats {
            let s = stats.snapshot();
            assert_eq!(s.processed as usize, unique, "{id}: {s:?}");
            assert_eq!(
                (s.retried, s.dead_lettered, s.malformed),
                (0, 0, 0),
                "{id}: {s:?}"
            );
        }
        let latencies = self.check(id, deliveries, &mut setup);
        drop(setup);
        topology.delete(&amqp).await.expect("delete topology");
        self.leftovers.forget_topology(id);
        self.leftovers.drop_schema(&schema);
        let _ = amqp.close(200, "done".into()).await;
        self.loads.lock().expect("loads").push(load_average());
        Measure {
            offered: rate,
            achieved,
            p50: percentile(&latencies, 0.5),
            p99: percentile(&latencies, 0.99),
            p999: percentile(&latencies, 0.999),
            drained,
            sustained: in_time && achieved >= 0.95 * rate,
        }
    }
}

/// A hand-written consumer worker (`bench_consume`'s loop, timing each commit): up to
/// `per_batch` deliveries (waiting at most 5 ms for more once the first is there),
/// claimed and upserted in one transaction, one `multiple` ack; until `shutdown`.
async fn hand_worker(
    channel: lapin::Channel,
    mut consumer: lapin::Consumer,
    db: Arc<Mutex<PgConnection>>,
    per_batch: usize,
    shutdown: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            next = consumer.next() => match next {
                Some(Ok(d)) => d,
                _ => return,
            },
        };
        let batch = inbox_benches::hand_batch(&mut consumer, first, per_batch).await;
        let bodies = inbox_benches::hand_bodies(&batch);
        // The first copy's publish time, should a duplicate share the batch.
        let mut published: HashMap<String, u64> = HashMap::new();
        for d in &batch {
            let Some(id) = d.properties.message_id().as_ref() else {
                continue;
            };
            let at = d.properties.headers().as_ref().and_then(|h| {
                match h.inner().get(PUBLISHED_HEADER)? {
                    AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).parse().ok(),
                    _ => None,
                }
            });
            if let Some(at) = at {
                published.entry(id.as_str().to_owned()).or_insert(at);
            }
        }
        let db = Arc::clone(&db);
        tokio::task::spawn_blocking(move || {
            let mut conn = db.lock().expect("db");
            let claimed: Vec<String> = inbox_benches::hand_transaction(&mut conn, |conn| {
                inbox_benches::hand_claim_and_upsert(conn, &bodies)
                    .map(|keys| keys.into_iter().map(str::to_owned).collect())
            });
            let at = now_ns();
            for key in claimed {
                let published = published.get(&key).copied().unwrap_or(0);
                stamp(key, published, at);
            }
        })
        .await
        .expect("blocking");
        let last = batch.last().map(|d| d.delivery_tag).unwrap_or_default();
        channel
            .basic_ack(last, BasicAckOptions { multiple: true })
            .await
            .expect("ack");
    }
}

/// A system's points: (offered rate, p99 in ms, sustained).
type Series<'a> = (&'a str, Vec<(f64, f64, bool)>);

/// The SVG: p99 (ms, log) against offered load (msg/s, log), a line per system;
/// a filled point where the rate was sustained, a hollow one where it was not.
fn svg(rates: &[f64], series: &[Series<'_>], load: (f64, f64)) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 440.0, 70.0, 170.0, 40.0, 60.0);
    let xs: Vec<f64> = rates.iter().map(|r| r.log10()).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.1))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let y0 = ys
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .log10()
        .floor();
    let y1 = ys
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max)
        .log10()
        .ceil()
        .max(y0 + 1.0);
    let (x1, x0) = if x1 > x0 { (x1, x0) } else { (x0 + 1.0, x0) };
    let px = |rate: f64| left + (rate.log10() - x0) / (x1 - x0) * (w - left - right);
    let py = |ms: f64| top + (1.0 - (ms.log10() - y0) / (y1 - y0)) * (h - top - bottom);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="22" font-size="14">publish-to-commit p99 against offered load (load average {:.2} to {:.2})</text>"#,
        load.0, load.1
    );
    let mut decade = y0;
    while decade <= y1 {
        let y = py(10f64.powf(decade));
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{} ms</text>"##,
            w - right,
            left - 6.0,
            y + 4.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    for &rate in rates {
        let x = px(rate);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{rate}</text>"##,
            h - bottom,
            h - bottom + 16.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">offered load, msg/s (hollow: not sustained)</text>"#,
        (left + w - right) / 2.0,
        h - 18.0
    );
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
    for (n, (name, points)) in series.iter().enumerate() {
        let color = colors[n % colors.len()];
        let path: Vec<String> = points
            .iter()
            .filter(|p| p.1.is_finite() && p.1 > 0.0)
            .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(rate, p99, sustained) in points.iter().filter(|p| p.1.is_finite() && p.1 > 0.0) {
            let fill = if sustained { color } else { "white" };
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{fill}" stroke="{color}" stroke-width="2"/>"#,
                px(rate),
                py(p99)
            );
        }
        let ly = top + 20.0 + n as f64 * 20.0;
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{name}</text>"#,
            w - right + 12.0,
            w - right + 32.0,
            w - right + 38.0,
            ly + 4.0
        );
    }
    out.push_str("</svg>\n");
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let rates: Vec<f64> = std::env::var("BENCH_RATES")
        .unwrap_or_else(|_| "200,1000,5000,20000".into())
        .split(',')
        .map(|r| {
            let rate: f64 = r
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("BENCH_RATES: {r:?} is not a rate in msg/s: {e}"));
            assert!(rate > 0.0, "BENCH_RATES: {rate} is not a positive rate");
            rate
        })
        .collect();
    let seconds: f64 = env_or("BENCH_SECONDS", 10.0);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let only = std::env::var("BENCH_ONLY").ok();
    let systems: Vec<&str> = SYSTEMS
        .into_iter()
        .filter(|s| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|n| n == *s))
        })
        .collect();
    assert!(!systems.is_empty(), "BENCH_ONLY names none of {SYSTEMS:?}");
    // Named as the tests' queues are (`<tag>_<pid>_<nanos>.`), so that CI's sweep
    // knows them should a run be killed outright.
    let run = format!(
        "latency_{}_{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    );
    let leftovers = Leftovers::new(&db_url, &amqp_url, &run);
    let _remove = RemoveOnDrop(Arc::clone(&leftovers));
    remove_on_signal(Arc::clone(&leftovers));
    let _ = diesel::connection::set_default_instrumentation(|| Some(Box::new(CommitClock)));
    let bench = Bench {
        leftovers,
        amqp_url,
        run: run.clone(),
        workers: env_or("BENCH_WORKERS", 4),
        publishers: env_or("BENCH_PUBLISHERS", 4usize).max(1),
        seconds,
        drain: Duration::from_millis(env_or("BENCH_DRAIN_MS", 250)),
        drain_limit: Duration::from_secs(env_or("BENCH_DRAIN_LIMIT_S", 300)),
        loads: Mutex::new(vec![load_average()]),
    };
    {
        let (fsync, tls) = inbox_benches::fsync_and_tls(bench.leftovers.url());
        println!(
            "run {run}: rates {rates:?} msg/s, {seconds} s each, {rounds} rounds, {} workers \
             (rt_default: its own), {} publishers; PostgreSQL fsync={}, TLS={}; load average {:.2}",
            bench.workers,
            bench.publishers,
            fsync,
            tls,
            load_average()
        );
    }

    let mut results: BTreeMap<(&str, u64), Vec<Measure>> = BTreeMap::new();
    for round in 0..rounds {
        for &rate in &rates {
            let events = ((rate * bench.seconds).round() as usize).max(2);
            let deliveries = Deliveries::generate(events, 2026 + round as u64);
            for k in 0..systems.len() {
                let system = systems[(k + round) % systems.len()];
                let id = format!("{system}{round}_{}", rate as u64);
                let m = bench.run_one(system, &id, rate, &deliveries).await;
                println!(
                    "  round {}: {system} at {rate}/s: achieved {:.0}/s, p50 {:.2} ms, p99 {:.2} ms, \
                     p99.9 {:.2} ms, all committed {:.2} s after the last send, sustained {}, \
                     exact check passed ({} unique of {} deliveries), load average {:.2}",
                    round + 1,
                    m.achieved,
                    m.p50,
                    m.p99,
                    m.p999,
                    m.drained,
                    if m.sustained { "yes" } else { "no" },
                    deliveries.workload.events.len(),
                    deliveries.order.len(),
                    load_average()
                );
                results.entry((system, rate as u64)).or_default().push(m);
            }
        }
    }
    let loads = bench.loads.lock().expect("loads").clone();
    let (low, high) = inbox_benches::range(&loads);
    let of = |ms: &[Measure], f: fn(&Measure) -> f64| median(ms.iter().map(f).collect());
    report(&rates, &systems, rounds, &results, (low, high));
    let series: Vec<Series<'_>> = systems
        .iter()
        .map(|system| {
            let points = rates
                .iter()
                .filter_map(|&rate| {
                    let ms = results.get(&(*system, rate as u64))?;
                    Some((rate, of(ms, |m| m.p99), sustained(ms)))
                })
                .collect();
            (*system, points)
        })
        .collect();
    let path = std::env::var("BENCH_SVG").unwrap_or_else(|_| "target/bench_latency.svg".into());
    if let Some(dir) = std::path::Path::new(&path).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&path, svg(&rates, &series, (low, high)))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    println!("svg: {path}");
    println!("exact checks passed at every rate: every unique event committed once, projection = unique events");
}

/// Whether a system sustained a rate: in most rounds.
fn sustained(ms: &[Measure]) -> bool {
    2 * ms.iter().filter(|m| m.sustained).count() > ms.len()
}

/// Prints the table (medians of the rounds), the ratios of issue 28 and the load.
fn report(
    rates: &[f64],
    systems: &[&str],
    rounds: usize,
    results: &BTreeMap<(&str, u64), Vec<Measure>>,
    (low, high): (f64, f64),
) {
    println!();
    println!("latency, publish to commit, ms (median of {rounds} rounds)");
    println!(
        "{:<13} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9}  sustained",
        "system", "offered", "achieved", "p50", "p99", "p99.9", "drain s"
    );
    let of = |ms: &[Measure], f: fn(&Measure) -> f64| median(ms.iter().map(f).collect());
    for system in systems {
        for &rate in rates {
            let Some(ms) = results.get(&(*system, rate as u64)) else {
                continue;
            };
            println!(
                "{system:<13} {:>8.0} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>9.2}  {} ({} of {})",
                of(ms, |m| m.offered),
                of(ms, |m| m.achieved),
                of(ms, |m| m.p50),
                of(ms, |m| m.p99),
                of(ms, |m| m.p999),
                of(ms, |m| m.drained),
                if sustained(ms) { "yes" } else { "no" },
                ms.iter().filter(|m| m.sustained).count(),
                ms.len()
            );
        }
    }
    println!();
    println!(
        "rt_default p99 / hand_single p99, within each round, at the rates hand_single sustains:"
    );
    for &rate in rates {
        let (Some(rt), Some(hand)) = (
            results.get(&("rt_default", rate as u64)),
            results.get(&("hand_single", rate as u64)),
        ) else {
            continue;
        };
        if !sustained(hand) {
            continue;
        }
        let ratios: Vec<f64> = rt.iter().zip(hand).map(|(r, h)| r.p99 / h.p99).collect();
        let (lo, hi) = inbox_benches::range(&ratios);
        println!(
            "  at {rate}/s: {:.2} ({lo:.2}..{hi:.2}; aim <= 1.25)",
            median(ratios)
        );
    }
    let highest = |system: &str| {
        rates
            .iter()
            .copied()
            .filter(|&r| {
                results
                    .get(&(system, r as u64))
                    .is_some_and(|ms| sustained(ms))
            })
            .fold(None, |best: Option<f64>, r| {
                Some(best.map_or(r, |b| b.max(r)))
            })
    };
    match (highest("rt_default"), highest("hand_batched")) {
        (Some(rt), Some(hand)) => println!(
            "highest sustained rate: rt_default {rt}/s / hand_batched {hand}/s = {:.2} (aim >= 0.9; \
             only the offered rates are tried)",
            rt / hand
        ),
        (rt, hand) => println!(
            "highest sustained rate: rt_default {rt:?} / hand_batched {hand:?}: no ratio"
        ),
    }
    println!(
        "load average (1 min) during the run: {low:.2} to {high:.2}; at the end {:.2}",
        load_average()
    );
}
