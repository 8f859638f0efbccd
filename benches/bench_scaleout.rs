//! `cargo run --release -p inbox-benches --bin bench_scaleout`: several consumer processes of one
//! group.
//!
//! 20,000 usage events with 10% duplicates are published into the group's quorum queue;
//! then 1, 2 or 4 consumer processes (this binary again, as `BENCH_SCALEOUT_CHILD`: the
//! runtime's folding consumer of the `daily_usage` projection, each with
//! `BENCH_WORKERS` workers) consume them into one schema of one database. Each process
//! builds its store and says it is ready; all are told to go at once. The clock runs
//! from the first delivery any of them receives to the moment the processes together
//! have decided every delivery (each reports its count every 2 ms). Then each is
//! stopped with SIGTERM and must exit 0, and the run is checked exactly: the
//! projection equals the sum of the unique events, every unique event was processed
//! once (no claim twice), every duplicate acked as one, no retry, no dead letter, the
//! queue empty.
//!
//! Measured during each run: deadlocks and rollbacks (`pg_stat_database` deltas; the
//! benchmark has a database of its own, so nobody else's count in them), the store's
//! batch reruns after a deadlock or serialization failure (`inbox_batch_conflicts_total`,
//! read from a `metrics` recorder in each process), the CPU of the consumer processes,
//! of their PostgreSQL backends, of RabbitMQ and of the whole machine
//! (`/proc/<pid>/stat` and `/proc/stat` deltas), and what the backends wait on
//! (`pg_stat_activity` sampled every 10 ms).
//!
//! Rounds run 1, 2, 4, 1, 2, 4, ... (`BENCH_ROUNDS`, default 3); the report gives each
//! process count's median rate and range, and the median and range of its ratio to one
//! process within a round.
//!
//! Environment: `DATABASE_URL`, `AMQP_URL` as for the tests; `BENCH_EVENTS`
//! (deliveries, default 20,000), `BENCH_PROCESSES` (default `1,2,4`), `BENCH_WORKERS`
//! (workers per process, 4), `BENCH_BATCH` (100; prefetch is twice that),
//! `BENCH_ROUNDS` (3), `BENCH_SETTLE_MS` (1000), `BENCH_USERS` (the users the events
//! fall on, 20: with 3 days, 60 projection rows). The database `scaleout_<pid>` and
//! every queue are removed at the end, after a failed check, and on SIGINT or SIGTERM
//! (the benchmark then exits 130); a consumer process stops when its parent is gone.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{Connection as _, PgConnection};
use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_benches::{
    env_or, median, publish_workload, range, service_urls, with_database, workload_with_duplicates,
};
use inbox_core::{RedactedError, RetryPolicy};
use inbox_diesel::Store;
use inbox_examples::usage::{DailyUsage, Rng, UsageDb, Workload, MESSAGE_TYPE};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

/// Names the child mode: `<schema> <prefix>`.
const CHILD_ENV: &str = "BENCH_SCALEOUT_CHILD";

/// The topic exchange of every run (each run's prefix makes its names unique).
const EXCHANGE: &str = "scaleout";

fn batch_size() -> usize {
    env_or("BENCH_BATCH", 100)
}

fn workers() -> usize {
    env_or("BENCH_WORKERS", 4)
}

fn prefetch() -> u16 {
    u16::try_from(2 * batch_size()).unwrap_or(u16::MAX)
}

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

// ---------------------------------------------------------------------------------
// The consumer process.

/// Counts every counter the framework records (the store's batch conflicts, its
/// decisions); gauges and histograms are dropped.
#[derive(Default)]
struct Counting {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

impl Counting {
    fn totals(&self) -> Vec<(String, u64)> {
        self.counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), v.load(Ordering::Relaxed)))
            .collect()
    }
}

impl metrics::Recorder for &'static Counting {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        // The name alone: every counter here is of the one group.
        let cell = self
            .counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.name().to_owned())
            .or_default()
            .clone();
        metrics::Counter::from_arc(cell)
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Writes one line of the protocol to the parent.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The folding consumer over `<schema>` and the queue of `<prefix>`: says `ready`
/// once its store is built, consumes once the parent writes `go`, reports `first
/// <unix ns>` at its first delivery and `decided <n>` as its count changes, and stops
/// on SIGTERM (or when the parent's end of the pipe closes), then prints its counters.
async fn child(spec: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let Some((schema, prefix)) = spec.split_once(' ') else {
        return Err(format!("{CHILD_ENV}: expected <schema> <prefix>, found {spec:?}").into());
    };
    let counting: &'static Counting = Box::leak(Box::default());
    metrics::set_global_recorder(counting).map_err(|_| "a metrics recorder was already set")?;
    let (db_url, amqp_url) = service_urls();
    let schema = schema.to_owned();
    let store = tokio::task::spawn_blocking(move || {
        Store::<PgConnection>::builder(db_url)
            .schema(schema)
            .pool_size(workers() as u32 + 1)
            .projection(DailyUsage::new(RetryPolicy::default()))
            .build()
    })
    .await??;
    let topology = Topology::new(EXCHANGE)?.prefix(prefix)?;
    let consumer = Consumer::new(amqp_url, Arc::new(store), topology).with_settings(
        ConsumerSettings::default()
            .workers(workers())
            .prefetch(prefetch())
            .batch(batch_size(), Duration::from_millis(5))
            .connection_name(format!("bench_scaleout {}", std::process::id())),
    );
    let stats = consumer.stats();
    let shutdown = cancel_on_signals(CancellationToken::new());
    let (go_tx, go_rx) = tokio::sync::oneshot::channel();
    let orphaned = shutdown.clone();
    std::thread::spawn(move || {
        let mut lines = std::io::stdin().lock().lines();
        if matches!(lines.next(), Some(Ok(line)) if line == "go") {
            let _ = go_tx.send(());
        }
        // The parent is gone when its end closes: stop rather than run on alone.
        for _ in lines {}
        orphaned.cancel();
    });
    say("ready");
    if go_rx.await.is_err() {
        return Ok(());
    }
    let running = tokio::spawn(consumer.run(shutdown));
    let (mut first, mut reported) = (false, 0);
    while !running.is_finished() {
        let s = stats.snapshot();
        if !first && s.received > 0 {
            first = true;
            say(&format!("first {}", unix_ns()));
        }
        let decided = s.processed + s.duplicates + s.retried + s.dead_lettered + s.malformed;
        if decided != reported {
            reported = decided;
            say(&format!("decided {decided}"));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    running.await??;
    let s = stats.snapshot();
    say(&format!(
        "stats received={} processed={} duplicates={} retried={} dead_lettered={} \
         malformed={} delivery_limit={} requeued={} batches={} reconnects={}",
        s.received,
        s.processed,
        s.duplicates,
        s.retried,
        s.dead_lettered,
        s.malformed,
        s.delivery_limit,
        s.requeued,
        s.batches,
        s.reconnects
    ));
    for (name, value) in counting.totals() {
        say(&format!("counter {name}={value}"));
    }
    say("done");
    Ok(())
}

// ---------------------------------------------------------------------------------
// Cleanup: the benchmark's database and queues go whatever happens.

struct Cleanup {
    admin_url: String,
    amqp_url: String,
    database: String,
    topologies: Mutex<Vec<Topology>>,
    children: Mutex<Vec<u32>>,
    /// Held while cleaning up: a second caller waits for the first to finish.
    done: Mutex<bool>,
    /// Set by SIGINT or SIGTERM: whatever fails after it is the interruption.
    interrupted: AtomicBool,
}

impl Cleanup {
    /// Kills what still runs, deletes the queues, drops the database. Runs once.
    fn run(&self, rt: &tokio::runtime::Handle) {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        if *done {
            return;
        }
        *done = true;
        for pid in
            std::mem::take(&mut *self.children.lock().unwrap_or_else(PoisonError::into_inner))
        {
            signal(pid, "KILL");
        }
        let topologies = std::mem::take(
            &mut *self
                .topologies
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        if !topologies.is_empty() {
            rt.block_on(async {
                if let Ok(conn) =
                    Connection::connect(&self.amqp_url, ConnectionProperties::default()).await
                {
                    for topology in &topologies {
                        if let Err(err) = topology.delete(&conn).await {
                            eprintln!(
                                "could not delete the queues of {}: {err}",
                                topology.exchange()
                            );
                        }
                    }
                    let _ = conn.close(200, "cleaned up".into()).await;
                }
            });
        }
        match PgConnection::establish(&self.admin_url) {
            Ok(mut conn) => {
                if let Err(err) = conn.batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.database
                )) {
                    eprintln!("could not drop database {}: {err}", self.database);
                }
            }
            Err(err) => eprintln!(
                "could not drop database {}: {}",
                self.database,
                RedactedError::new(&err, &self.admin_url)
            ),
        }
    }

    fn forget_child(&self, pid: u32) {
        self.children
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|p| *p != pid);
    }
}

/// Sends `SIGname` to `pid` (through `kill(1)`: the examples take no libc).
fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

// ---------------------------------------------------------------------------------
// Sampling: CPU from /proc, waits from pg_stat_activity.

/// utime + stime of a process, in clock ticks.
fn proc_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start at the state, field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// (busy, all) ticks of the whole machine.
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|v| v.parse().ok())
        .collect();
    let all: u64 = values.iter().sum();
    let idle = values.get(3)? + values.get(4)?;
    Some((all - idle, all))
}

/// The pids of the processes whose command is `comm`.
fn pids_named(comm: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm)
        })
        .collect()
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU of one run's window, in cores (1.0 = one core busy all along).
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    consumers: f64,
    backends: f64,
    rabbitmq: f64,
    machine: f64,
}

#[derive(QueryableByName)]
struct Activity {
    #[diesel(sql_type = Integer)]
    pid: i32,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Text)]
    wait: String,
    #[diesel(sql_type = Text)]
    query: String,
}

/// The statement a backend runs, by what it touches.
fn statement(query: &str) -> &'static str {
    let q = query.trim_start();
    if q.contains("advisory") {
        "the projection lock"
    } else if q.contains("daily_usage") {
        "the upsert of daily_usage"
    } else if q.starts_with("INSERT INTO inbox_claims") {
        "the claim"
    } else if q.contains("inbox_claims") {
        "a claim lookup"
    } else if q.starts_with("COMMIT") {
        "COMMIT"
    } else if q.contains("pg_current_xact_id") {
        "the transaction check"
    } else {
        "another statement"
    }
}

/// What one sampling thread saw.
#[derive(Default)]
struct Samples {
    waits: BTreeMap<String, u64>,
    samples: u64,
    cpu: Cpu,
}

/// Samples every 10 ms until `stop`: the backends of the benchmark's database (what
/// each waits on) and the CPU ticks of the consumers, those backends, RabbitMQ and
/// the machine.
fn sample(db_url: &str, children: Vec<u32>, stop: &AtomicBool) -> Samples {
    let mut out = Samples::default();
    let Ok(mut conn) = PgConnection::establish(db_url) else {
        return out;
    };
    let rabbit = pids_named("beam.smp");
    let ticks = |pids: &[u32]| -> BTreeMap<u32, u64> {
        pids.iter()
            .filter_map(|p| Some((*p, proc_ticks(*p)?)))
            .collect()
    };
    let started = Instant::now();
    let machine_start = machine_ticks();
    let (children_start, rabbit_start) = (ticks(&children), ticks(&rabbit));
    let mut backends: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    loop {
        let finishing = stop.load(Ordering::Relaxed);
        let rows: Vec<Activity> = diesel::sql_query(
            "SELECT pid, coalesce(state, '') AS state, \
             coalesce(wait_event_type || ':' || wait_event, '') AS wait, \
             left(coalesce(query, ''), 200) AS query \
             FROM pg_stat_activity WHERE datname = current_database() \
             AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        .load(&mut conn)
        .unwrap_or_default();
        for row in &rows {
            let pid = row.pid as u32;
            if let Some(t) = proc_ticks(pid) {
                backends.entry(pid).or_insert((t, t)).1 = t;
            }
            let what = match (row.state.as_str(), row.wait.as_str()) {
                ("active", "") => format!("on CPU in {}", statement(&row.query)),
                ("active", wait) => format!("{wait} in {}", statement(&row.query)),
                ("idle in transaction", _) => {
                    format!("idle in transaction after {}", statement(&row.query))
                }
                _ => continue,
            };
            *out.waits.entry(what).or_default() += 1;
        }
        out.samples += 1;
        if finishing {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let children_end = ticks(&children);
    let hz = clock_ticks_per_second();
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let cores = |ticks: u64| ticks as f64 / hz / seconds;
    let delta = |start: &BTreeMap<u32, u64>, end: &BTreeMap<u32, u64>| -> u64 {
        end.iter()
            .map(|(p, t)| t.saturating_sub(*start.get(p).unwrap_or(t)))
            .sum()
    };
    out.cpu.consumers = cores(delta(&children_start, &children_end));
    out.cpu.backends = cores(backends.values().map(|(a, b)| b - a).sum());
    out.cpu.rabbitmq = cores(delta(&rabbit_start, &ticks(&rabbit)));
    if let (Some((b0, a0)), Some((b1, a1))) = (machine_start, machine_ticks()) {
        // In cores: the share of all ticks that were busy, times the cores.
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        out.cpu.machine = (b1 - b0) as f64 / (a1 - a0).max(1) as f64 * n;
    }
    out
}

// ---------------------------------------------------------------------------------
// The parent.

#[derive(QueryableByName)]
struct DbCounts {
    #[diesel(sql_type = BigInt)]
    deadlocks: i64,
    #[diesel(sql_type = BigInt)]
    rollbacks: i64,
}

fn db_counts(conn: &mut PgConnection) -> DbCounts {
    diesel::sql_query(
        "SELECT deadlocks, xact_rollback AS rollbacks FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .get_result(conn)
    .expect("pg_stat_database")
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn count(conn: &mut PgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .n
}

/// One run's figures.
#[derive(Default)]
struct RunReport {
    rate: f64,
    deadlocks: i64,
    rollbacks: i64,
    conflicts: u64,
    retried: u64,
    received: u64,
    batches: u64,
    samples: Samples,
}

struct Bench {
    db_url: String,
    amqp_url: String,
    run: String,
    workload: Workload,
    order: Vec<usize>,
    cleanup: Arc<Cleanup>,
    rt: tokio::runtime::Handle,
}

/// A consumer process and the end of its stdin.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Bench {
    fn connect(&self) -> PgConnection {
        PgConnection::establish(&self.db_url)
            .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &self.db_url)))
    }

    fn amqp(&self) -> Connection {
        self.rt
            .block_on(Connection::connect(
                &self.amqp_url,
                ConnectionProperties::default(),
            ))
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)))
    }

    /// One run with `n` processes; `id` names its schema and queues.
    fn run_once(&self, n: usize, id: &str) -> RunReport {
        let schema = format!("{}_{id}", self.run);
        let prefix = format!("{}.{id}.", self.run);
        let mut conn = self.connect();
        conn.batch_execute(&format!("CREATE SCHEMA {schema}"))
            .expect("schema");

        // The parent migrates the schema and declares and fills the queue, so the
        // processes start on a ready schema (and never migrate it side by side).
        let store = Store::<PgConnection>::builder(self.db_url.clone())
            .schema(schema.clone())
            .pool_size(1)
            .projection(DailyUsage::new(RetryPolicy::default()))
            .build()
            .expect("store");
        store
            .connection()
            .expect("conn")
            .create_daily_usage()
            .expect("table");
        let topology = Topology::new(EXCHANGE)
            .expect("topology")
            .prefix(prefix.clone())
            .expect("prefix");
        let consumer = Consumer::new(self.amqp_url.clone(), Arc::new(store), topology);
        let topology = consumer.topology().clone();
        let queue = topology
            .groups()
            .next()
            .map(|g| topology.queue(g))
            .expect("a group");
        self.cleanup
            .topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(topology.clone());
        let amqp = self.amqp();
        self.rt.block_on(async {
            topology.declare(&amqp).await.expect("declare");
            publish_workload(
                &amqp,
                &topology.exchange(),
                MESSAGE_TYPE,
                &self.workload,
                &self.order,
            )
            .await
            .expect("fill");
            // The broker keeps writing what it just confirmed: let it finish first.
            tokio::time::sleep(Duration::from_millis(env_or("BENCH_SETTLE_MS", 1000))).await;
        });
        let before = db_counts(&mut conn);

        let (lines_tx, lines) = mpsc::channel::<(usize, String)>();
        let exe = std::env::current_exe().expect("own path");
        let stack = std::env::var("RUST_MIN_STACK")
            .unwrap_or_else(|_| inbox_amqp::frame_parse_stack().to_string());
        let mut procs: Vec<Proc> = (0..n)
            .map(|i| {
                let mut child = Command::new(&exe)
                    .env(CHILD_ENV, format!("{schema} {prefix}"))
                    .env("DATABASE_URL", &self.db_url)
                    .env("AMQP_URL", &self.amqp_url)
                    .env("RUST_MIN_STACK", &stack)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("consumer process");
                self.cleanup
                    .children
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(child.id());
                let stdout = child.stdout.take().expect("stdout");
                let tx = lines_tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                        if tx.send((i, line)).is_err() {
                            break;
                        }
                    }
                    let _ = tx.send((i, "eof".to_owned()));
                });
                let stdin = child.stdin.take();
                Proc { child, stdin }
            })
            .collect();
        drop(lines_tx);
        let next = |what: &str| -> (usize, String) {
            lines
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|_| {
                    panic!("{id}: no word from the consumer processes while {what}")
                })
        };
        let mut ready = 0;
        while ready < n {
            match next("they started") {
                (_, line) if line == "ready" => ready += 1,
                (i, line) => panic!("{id}: process {i} said {line:?} before it was ready"),
            }
        }

        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (url, stop) = (self.db_url.clone(), Arc::clone(&stop));
            let pids = procs.iter().map(|p| p.child.id()).collect();
            std::thread::spawn(move || sample(&url, pids, &stop))
        };
        for p in &mut procs {
            let stdin = p.stdin.as_mut().expect("stdin");
            writeln!(stdin, "go")
                .and_then(|()| stdin.flush())
                .expect("go");
        }
        let total = self.order.len() as u64;
        let mut decided = vec![0u64; n];
        let mut first: Option<u128> = None;
        let end = loop {
            let (i, line) = next("they consumed");
            if let Some(ns) = line.strip_prefix("first ").and_then(|v| v.parse().ok()) {
                first = Some(first.map_or(ns, |f: u128| f.min(ns)));
            } else if let Some(d) = line.strip_prefix("decided ").and_then(|v| v.parse().ok()) {
                decided[i] = d;
                if decided.iter().sum::<u64>() >= total {
                    break unix_ns();
                }
            } else {
                panic!("{id}: process {i} said {line:?} while consuming");
            }
        };
        stop.store(true, Ordering::Relaxed);
        let samples = sampler.join().expect("sampler");
        let first = first.expect("a first delivery");
        let rate = total as f64 / ((end - first) as f64 / 1e9);

        // SIGTERM each: it drains and exits 0.
        for p in &procs {
            signal(p.child.id(), "TERM");
        }
        let mut report = RunReport {
            rate,
            samples,
            ..RunReport::default()
        };
        let (mut processed, mut duplicates, mut left) = (0u64, 0u64, n);
        while left > 0 {
            let (i, line) = next("they stopped");
            if line == "eof" {
                left -= 1;
            } else if let Some(stats) = line.strip_prefix("stats ") {
                let field = |name: &str| -> u64 {
                    stats
                        .split(' ')
                        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or_else(|| panic!("{id}: process {i}: no {name} in {stats:?}"))
                };
                processed += field("processed");
                duplicates += field("duplicates");
                report.retried += field("retried");
                report.batches += field("batches");
                report.received += field("received");
                for bad in ["dead_lettered", "malformed", "delivery_limit", "requeued"] {
                    assert_eq!(field(bad), 0, "{id}: process {i}: {bad} in {stats:?}");
                }
            } else if let Some(counter) = line.strip_prefix("counter ") {
                if let Some(v) = counter.strip_prefix("inbox_batch_conflicts_total=") {
                    report.conflicts += v.parse::<u64>().unwrap_or(0);
                }
            }
        }
        for mut p in procs {
            drop(p.stdin.take());
            let status = p.child.wait().expect("wait");
            self.cleanup.forget_child(p.child.id());
            assert!(
                status.success(),
                "{id}: a consumer process exited with {status} after SIGTERM"
            );
        }
        // Backends flush their statistics as they exit.
        std::thread::sleep(Duration::from_millis(500));
        let after = db_counts(&mut conn);
        report.deadlocks = after.deadlocks - before.deadlocks;
        report.rollbacks = after.rollbacks - before.rollbacks;

        // Exact: every unique event once, every duplicate acked as one, nothing left.
        let unique = self.workload.events.len() as u64;
        assert_eq!(processed, unique, "{id}: processed (a claim taken twice?)");
        assert_eq!(duplicates, total - unique, "{id}: duplicates");
        assert_eq!(report.retried, 0, "{id}: retried");
        conn.batch_execute(&format!("SET search_path TO {schema}"))
            .expect("path");
        assert_eq!(
            conn.daily_totals().expect("totals"),
            self.workload.expected_totals(),
            "{id}: the projection is not the sum of the unique events"
        );
        assert_eq!(
            count(
                &mut conn,
                "SELECT count(*) AS n FROM inbox_claims WHERE status = 'done' AND attempts = 0"
            ),
            unique as i64,
            "{id}: done claims"
        );
        assert_eq!(
            count(&mut conn, "SELECT count(*) AS n FROM inbox_claims"),
            unique as i64,
            "{id}: claims"
        );
        assert_eq!(
            count(&mut conn, "SELECT count(*) AS n FROM inbox_dead_letters"),
            0,
            "{id}: dead letters"
        );
        self.rt.block_on(async {
            let channel = amqp.create_channel().await.expect("channel");
            let q = channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .expect("queue");
            assert_eq!(q.message_count(), 0, "{id}: deliveries left in the queue");
            topology.delete(&amqp).await.expect("delete topology");
            let _ = amqp.close(200, "run done".into()).await;
        });
        self.cleanup
            .topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|t| t.exchange() != topology.exchange());
        conn.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .expect("drop schema");
        report
    }
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let _logging = inbox_examples::init_logging();
        return match runtime.block_on(child(&spec)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("bench_scaleout consumer: {err}");
                ExitCode::FAILURE
            }
        };
    }
    let (admin_url, amqp_url) = service_urls();
    let database = format!("scaleout_{}", std::process::id());
    let cleanup = Arc::new(Cleanup {
        admin_url: admin_url.clone(),
        amqp_url: amqp_url.clone(),
        database: database.clone(),
        topologies: Mutex::new(Vec::new()),
        children: Mutex::new(Vec::new()),
        done: Mutex::new(false),
        interrupted: AtomicBool::new(false),
    });
    // SIGINT or SIGTERM: clean up, then exit as interrupted.
    {
        let cleanup = Arc::clone(&cleanup);
        let signalled = runtime.block_on(async { cancel_on_signals(CancellationToken::new()) });
        runtime.spawn(async move {
            signalled.cancelled().await;
            cleanup.interrupted.store(true, Ordering::SeqCst);
            let rt = tokio::runtime::Handle::current();
            let _ = tokio::task::spawn_blocking(move || cleanup.run(&rt)).await;
            eprintln!("bench_scaleout: interrupted; database and queues removed");
            std::process::exit(130);
        });
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        bench(&admin_url, &amqp_url, &database, &cleanup, runtime.handle())
    }));
    cleanup.run(runtime.handle());
    if cleanup.interrupted.load(Ordering::SeqCst) {
        eprintln!("bench_scaleout: interrupted; database and queues removed");
        return ExitCode::from(130);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

fn bench(
    admin_url: &str,
    amqp_url: &str,
    database: &str,
    cleanup: &Arc<Cleanup>,
    rt: &tokio::runtime::Handle,
) {
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let counts: Vec<usize> = std::env::var("BENCH_PROCESSES")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .unwrap_or_else(|| panic!("BENCH_PROCESSES: {n:?} is not a process count"))
        })
        .collect();
    let (mut workload, order) = workload_with_duplicates(events, 2026);
    // The workload's events fall on 20 users over 3 days: 60 rows, nearly all of which
    // every batch of 100 writes. More users spread the same events over more rows.
    let users: u64 = env_or("BENCH_USERS", 20);
    if users != 20 {
        let mut rng = Rng::new(users);
        for (_, event) in &mut workload.events {
            event.user_id = 1 + rng.below(users.max(1)) as i64;
        }
    }
    {
        let mut admin = PgConnection::establish(admin_url)
            .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, admin_url)));
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .expect("create database");
    }
    let bench = Bench {
        db_url: with_database(admin_url, database),
        amqp_url: amqp_url.to_owned(),
        run: format!("so{}", std::process::id()),
        workload,
        order,
        cleanup: Arc::clone(cleanup),
        rt: rt.clone(),
    };
    println!(
        "{events} deliveries ({} unique) over {users} users and 3 days, processes {counts:?}, \
         {} workers each, batch {}, {rounds} rounds; one database, one schema and one \
         quorum queue per run",
        bench.workload.events.len(),
        workers(),
        batch_size(),
    );
    {
        #[derive(QueryableByName)]
        struct Settings {
            #[diesel(sql_type = Text)]
            fsync: String,
            #[diesel(sql_type = Text)]
            ssl: String,
        }
        let s: Settings = diesel::sql_query(
            "SELECT current_setting('fsync') AS fsync, \
             CASE WHEN ssl THEN 'on' ELSE 'off' END AS ssl \
             FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        )
        .get_result(&mut bench.connect())
        .expect("settings");
        println!("PostgreSQL fsync={}, TLS={}", s.fsync, s.ssl);
    }
    let mut runs: BTreeMap<usize, Vec<RunReport>> = BTreeMap::new();
    for round in 0..rounds {
        for &n in &counts {
            let report = bench.run_once(n, &format!("r{round}n{n}"));
            eprintln!(
                "  round {}: {n} processes: {:.0} deliveries/s, {} batches, {} conflicts, {} deadlocks",
                round + 1,
                report.rate,
                report.batches,
                report.conflicts,
                report.deadlocks
            );
            runs.entry(n).or_default().push(report);
        }
    }
    print_report(&counts, &runs);
}

fn print_report(counts: &[usize], runs: &BTreeMap<usize, Vec<RunReport>>) {
    let base = counts.first().copied().unwrap_or(1);
    println!();
    println!(
        "{:>9} {:>14} {:>17} {:>22} {:>9} {:>9} {:>9} {:>8}",
        "processes",
        "deliveries/s",
        "range",
        format!("ratio to {base} (range)"),
        "deadlocks",
        "conflicts",
        "rollbacks",
        "retried"
    );
    for n in counts {
        let Some(reports) = runs.get(n) else { continue };
        let rates: Vec<f64> = reports.iter().map(|r| r.rate).collect();
        let (low, high) = range(&rates);
        let ratios: Vec<f64> = reports
            .iter()
            .zip(&runs[&base])
            .map(|(r, b)| r.rate / b.rate)
            .collect();
        let (rlow, rhigh) = range(&ratios);
        println!(
            "{n:>9} {:>14.0} {:>17} {:>22} {:>9} {:>9} {:>9} {:>8}",
            median(rates.clone()),
            format!("{low:.0}..{high:.0}"),
            format!("{:.2} ({rlow:.2}..{rhigh:.2})", median(ratios)),
            reports.iter().map(|r| r.deadlocks).sum::<i64>(),
            reports.iter().map(|r| r.conflicts).sum::<u64>(),
            reports.iter().map(|r| r.rollbacks).sum::<i64>(),
            reports.iter().map(|r| r.retried).sum::<u64>(),
        );
    }
    println!("(deadlocks, conflicts, rollbacks, retried: totals over the rounds)");
    println!();
    println!(
        "CPU during the runs, in cores (median of rounds; the machine has {}):",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>18}",
        "processes", "consumers", "backends", "rabbitmq", "machine", "deliveries/batch"
    );
    for n in counts {
        let Some(reports) = runs.get(n) else { continue };
        let cpu = |f: fn(&Cpu) -> f64| median(reports.iter().map(|r| f(&r.samples.cpu)).collect());
        let per_batch = median(
            reports
                .iter()
                .map(|r| r.received as f64 / r.batches.max(1) as f64)
                .collect(),
        );
        println!(
            "{n:>9} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {per_batch:>18.1}",
            cpu(|c| c.consumers),
            cpu(|c| c.backends),
            cpu(|c| c.rabbitmq),
            cpu(|c| c.machine),
        );
    }
    println!();
    println!("what the database's backends were doing (share of samples, all rounds):");
    for n in counts {
        let Some(reports) = runs.get(n) else { continue };
        let mut waits: BTreeMap<&str, u64> = BTreeMap::new();
        let mut samples = 0;
        for r in reports {
            samples += r.samples.samples;
            for (k, v) in &r.samples.waits {
                *waits.entry(k.as_str()).or_default() += v;
            }
        }
        let seen: u64 = waits.values().sum();
        let mut waits: Vec<(&str, u64)> = waits.into_iter().collect();
        waits.sort_by_key(|w| std::cmp::Reverse(w.1));
        println!(
            "  {n} processes: {samples} samples, {:.1} backends busy or in a transaction per sample",
            seen as f64 / samples.max(1) as f64,
        );
        let share = |k: u64| 100.0 * k as f64 / seen.max(1) as f64;
        for (what, k) in waits.iter().take(10) {
            println!("    {:>4.1}%  {what}", share(*k));
        }
        // Totals over statements (the projection lock said even when nothing waited
        // on it: live batches take it shared).
        // (label, text, whether the text starts the entry or ends it)
        let groups = [
            ("Lock:advisory (the projection lock)", "Lock:advisory", true),
            ("Lock:transactionid", "Lock:transactionid", true),
            ("in COMMIT", "in COMMIT", false),
            ("idle in transaction", "idle in transaction", true),
        ];
        for (label, text, starts) in groups {
            let k: u64 = waits
                .iter()
                .filter(|(w, _)| {
                    if starts {
                        w.starts_with(text)
                    } else {
                        w.ends_with(text)
                    }
                })
                .map(|(_, k)| k)
                .sum();
            println!("    {:>4.1}%  {label}, all statements", share(k));
        }
    }
}
