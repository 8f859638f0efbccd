//! `cargo run --release -p inbox-benches --bin bench_retention`: retention under load, in one run.
//!
//! Pre-fills a schema's claims with `BENCH_RETENTION_ROWS` (default 2,000,000) `done`
//! claims older than the 30-day window (`generate_series`, then `VACUUM ANALYZE`),
//! then runs the folding consumer (bench_consume's `rt_fold`: 4 workers, batches of
//! 100, a quorum queue pre-filled with `BENCH_EVENTS` unique usage events, default
//! 20,000) with and without a purger deleting old claims beside it. Rounds alternate
//! the order (alone then with the purge, then the other way round), and ratios are
//! taken within a round, since this machine is shared and noisy.
//!
//! The purger runs the store's purge batch ([`inbox_diesel::purge_batch`], batches of
//! `BENCH_PURGE_BATCH`, default 1,000, each its own transaction, each starting where
//! the previous one stopped) from the consumer's first batch to its last ack, and
//! counts the buffers each batch touches in the claims table and its retention
//! index (`pg_stat_get_xact_blocks_fetched`, read in the batch's transaction).
//! Reported: ingest rate alone and with the purge, their ratio, the purge rate and
//! purge rate / ingest rate, and buffers per purge batch, first vs last.
//!
//! Before filling it checks the free disk of PostgreSQL's data directory; its schema
//! is dropped at the end, on a panic (a drop guard) and on Ctrl-C or SIGTERM; queues
//! are deleted after each scenario. Not run in CI.
//!
//! Environment: `DATABASE_URL`, `AMQP_URL` as for the tests; `BENCH_RETENTION_ROWS`,
//! `BENCH_EVENTS`, `BENCH_ROUNDS` (3), `BENCH_WORKERS` (4), `BENCH_BATCH` (100),
//! `BENCH_PURGE_BATCH` (1,000), `BENCH_PURGE_PAUSE_MS` (0: a pause between purge
//! batches, the pacing a purge under load can choose), `BENCH_SETTLE_MS` (1,000).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection as _, PgConnection};
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_benches::{drop_schema_on_signals, env_or, free_disk_kib, service_urls, SchemaGuard};
use inbox_core::{RedactedError, RetryPolicy};
use inbox_diesel::{purge_batch, PurgeTarget, Store};
use inbox_examples::usage::{DailyUsage, UsageDb, Workload, GROUP, MESSAGE_TYPE};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// The done-claim window: the pre-filled claims are older, the consumer's newer.
const WINDOW_DAYS: i64 = 30;
/// Bytes a pre-filled claim takes with its indexes, with room to spare (measured
/// about 200 on PostgreSQL 15).
const BYTES_PER_ROW: u64 = 400;

#[derive(QueryableByName)]
struct Value {
    #[diesel(sql_type = Text)]
    value: String,
}

#[derive(QueryableByName)]
struct Blocks {
    #[diesel(sql_type = BigInt)]
    blocks: i64,
}

/// Buffers this transaction touched in the claims table and its retention index.
fn blocks(conn: &mut PgConnection) -> QueryResult<i64> {
    diesel::sql_query(
        "SELECT (pg_stat_get_xact_blocks_fetched('inbox_claims'::regclass)
               + pg_stat_get_xact_blocks_fetched('inbox_claims_done'::regclass))::bigint AS blocks",
    )
    .get_result::<Blocks>(conn)
    .map(|b| b.blocks)
}

fn connect(url: &str, schema: Option<&str>) -> PgConnection {
    let mut conn = PgConnection::establish(url)
        .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, url)));
    if let Some(schema) = schema {
        conn.batch_execute(&format!("SET search_path TO {schema}"))
            .expect("search_path");
    }
    conn
}

/// What a purger did during one scenario.
#[derive(Default)]
struct Purged {
    rows: u64,
    elapsed: Duration,
    /// (rows deleted before the batch, buffers the batch touched), per full batch.
    batches: Vec<(u64, i64)>,
}

/// Deletes old claims in bounded batches until `stop` (or nothing is left).
fn purger(url: &str, schema: &str, batch: usize, stop: &AtomicBool, before: u64) -> Purged {
    let pause = Duration::from_millis(env_or("BENCH_PURGE_PAUSE_MS", 0));
    let mut conn = connect(url, Some(schema));
    let cutoff = Utc::now() - chrono::Duration::days(WINDOW_DAYS);
    let started = Instant::now();
    let mut purged = Purged::default();
    let mut from = None;
    while !stop.load(Ordering::Relaxed) {
        let (done, touched) = conn
            .transaction(|conn| {
                let start = blocks(conn)?;
                let done = purge_batch(conn, PurgeTarget::DoneClaims, cutoff, batch, from)?;
                Ok::<_, inbox_diesel::Error>((done, blocks(conn)? - start))
            })
            .expect("purge batch");
        if done.deleted == batch as u64 {
            purged.batches.push((before + purged.rows, touched));
        }
        purged.rows += done.deleted;
        if done.busy || done.deleted < batch as u64 {
            eprintln!("  the purger found nothing more to delete");
            break;
        }
        from = done.resume_from;
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
    purged.elapsed = started.elapsed();
    purged
}

struct Bench {
    db_url: String,
    amqp_url: String,
    schema: String,
    store: Arc<Store<PgConnection>>,
    events: usize,
    workers: usize,
    batch: usize,
    purge_batch: usize,
    /// Rows every purge so far deleted.
    purged_so_far: u64,
}

impl Bench {
    /// Publishes `workload` (unique events) to the consumer's exchange.
    async fn fill(&self, conn: &Connection, exchange: &str, workload: &Workload) {
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        for (key, event) in &workload.events {
            let body = serde_json::to_vec(event).expect("json");
            channel
                .basic_publish(
                    exchange.into(),
                    MESSAGE_TYPE.into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default()
                        .with_message_id(key.as_str().into())
                        .with_type(MESSAGE_TYPE.into())
                        .with_delivery_mode(2),
                )
                .await
                .expect("publish");
        }
        let returned = channel.wait_for_confirms().await.expect("confirms");
        assert!(returned.is_empty(), "unroutable during fill");
        let _ = channel.close(200, "filled".into()).await;
        tokio::time::sleep(Duration::from_millis(env_or("BENCH_SETTLE_MS", 1000))).await;
    }

    /// One scenario: the folding consumer over a fresh queue, with or without the
    /// purger; its deliveries/s and what the purger did.
    async fn scenario(&mut self, name: &str, seed: u64, purge: bool) -> (f64, Option<Purged>) {
        let topology = Topology::new("bench")
            .expect("topology")
            .prefix(format!("{}.{name}.", self.schema))
            .expect("prefix");
        let consumer = Consumer::new(self.amqp_url.clone(), Arc::clone(&self.store), topology)
            .with_settings(
                ConsumerSettings::default()
                    .workers(self.workers)
                    .prefetch(u16::try_from(2 * self.batch).unwrap_or(u16::MAX))
                    .batch(self.batch, Duration::from_millis(5)),
            );
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        consumer.topology().declare(&conn).await.expect("declare");
        let workload = Workload::generate(self.events, 0, seed);
        self.fill(&conn, &consumer.topology().exchange(), &workload)
            .await;
        let topology = consumer.topology().clone();

        let stats = consumer.stats();
        let total = self.events as u64;
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(shutdown.clone()));
        while stats.snapshot().received == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let purging = purge.then(|| {
            let (url, schema, stop) = (self.db_url.clone(), self.schema.clone(), Arc::clone(&stop));
            let (batch, before) = (self.purge_batch, self.purged_so_far);
            tokio::task::spawn_blocking(move || purger(&url, &schema, batch, &stop, before))
        });
        loop {
            let s = stats.snapshot();
            if s.processed + s.duplicates >= total {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let purged = match purging {
            Some(p) => Some(p.await.expect("purger")),
            None => None,
        };
        shutdown.cancel();
        running.await.expect("join").expect("consumer");
        let s = stats.snapshot();
        assert_eq!(s.processed, total, "{name}: {s:?}");
        topology.delete(&conn).await.expect("delete topology");
        if let Some(p) = &purged {
            self.purged_so_far += p.rows;
        }
        (total as f64 / elapsed.as_secs_f64(), purged)
    }
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

fn spread(values: &[f64]) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(0.0, f64::max);
    format!("{:.2} ({low:.2}..{high:.2})", median(values.to_vec()))
}

/// Checks the free disk of PostgreSQL's data directory against what `rows` claims
/// take (twice, for the write-ahead log); stops the benchmark when short.
fn check_disk(conn: &mut PgConnection, rows: u64) {
    let dir: Value = diesel::sql_query("SELECT current_setting('data_directory') AS value")
        .get_result(conn)
        .expect("data_directory (the benchmark needs a superuser to read it)");
    let need_kib = rows * BYTES_PER_ROW * 2 / 1024;
    match free_disk_kib(&dir.value) {
        Some(free) if free >= need_kib => println!(
            "free disk at {}: {} MiB, need about {} MiB",
            dir.value,
            free / 1024,
            need_kib / 1024
        ),
        Some(free) => panic!(
            "not enough free disk at {}: {} MiB free, about {} MiB needed for \
             BENCH_RETENTION_ROWS={rows}",
            dir.value,
            free / 1024,
            need_kib / 1024
        ),
        None => panic!("cannot read the free disk of {} (df)", dir.value),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let rows: u64 = env_or("BENCH_RETENTION_ROWS", 2_000_000);
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let workers: usize = env_or("BENCH_WORKERS", 4);
    let batch: usize = env_or("BENCH_BATCH", 100);
    let purge_batch: usize = env_or("BENCH_PURGE_BATCH", 1000).max(1);
    let schema = format!("bench_retention_{}", std::process::id());

    let mut admin = connect(&db_url, None);
    check_disk(&mut admin, rows);
    let _guard = SchemaGuard::new(&db_url, &schema);
    drop_schema_on_signals(&db_url, &schema);
    let store = Store::<PgConnection>::builder(db_url.clone())
        .schema(&schema)
        .pool_size(workers as u32 + 1)
        .handler(DailyUsage::new(RetryPolicy::default()))
        .build()
        .expect("store");
    store
        .connection()
        .expect("conn")
        .create_daily_usage()
        .expect("table");

    let filling = Instant::now();
    let mut conn = connect(&db_url, Some(&schema));
    conn.batch_execute(&format!(
        "INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest,
             status, first_seen_at, updated_at)
         SELECT '{GROUP}', 'old-' || i, '{MESSAGE_TYPE}', '\\x00', 'done', t, t
         FROM generate_series(1, {rows}) i,
              LATERAL (SELECT now() - interval '{} days' + i * interval '1 ms' AS t) at",
        2 * WINDOW_DAYS
    ))
    .expect("pre-fill");
    conn.batch_execute("VACUUM ANALYZE inbox_claims")
        .expect("vacuum");
    let size: Value =
        diesel::sql_query("SELECT pg_size_pretty(pg_total_relation_size('inbox_claims')) AS value")
            .get_result(&mut conn)
            .expect("size");
    println!(
        "{rows} done claims older than the {WINDOW_DAYS}-day window ({}) in {:.1?}; \
         {events} deliveries per scenario, {workers} workers, batch {batch}, \
         purge batch {purge_batch}",
        size.value,
        filling.elapsed()
    );

    let mut bench = Bench {
        db_url,
        amqp_url,
        schema,
        store: Arc::new(store),
        events,
        workers,
        batch,
        purge_batch,
        purged_so_far: 0,
    };
    let (mut alone, mut with) = (Vec::new(), Vec::new());
    let (mut purge_rates, mut batches) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // ABAB: each round starts with the other scenario.
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for purge in order {
            let name = format!("r{round}{}", if purge { "p" } else { "a" });
            let seed = 2 * round as u64 + u64::from(purge);
            let (rate, purged) = bench.scenario(&name, seed, purge).await;
            match purged {
                Some(p) => {
                    let purge_rate = p.rows as f64 / p.elapsed.as_secs_f64();
                    eprintln!(
                        "  round {}: with the purge {rate:.0} deliveries/s; purged {} rows \
                         at {purge_rate:.0} rows/s",
                        round + 1,
                        p.rows
                    );
                    with.push(rate);
                    purge_rates.push(purge_rate);
                    batches.extend(p.batches);
                }
                None => {
                    eprintln!("  round {}: alone {rate:.0} deliveries/s", round + 1);
                    alone.push(rate);
                }
            }
        }
    }

    let ratios: Vec<f64> = with.iter().zip(&alone).map(|(w, a)| w / a).collect();
    let keep_up: Vec<f64> = purge_rates.iter().zip(&with).map(|(p, w)| p / w).collect();
    println!();
    println!("{:<56} {:>14}", "measure (median of rounds)", "figure");
    println!(
        "{:<56} {:>14.0}",
        "ingest, folding consumer alone (deliveries/s)",
        median(alone.clone())
    );
    println!(
        "{:<56} {:>14.0}",
        "ingest, with a purger beside it (deliveries/s)",
        median(with.clone())
    );
    println!(
        "{:<56} {:>14.0}",
        "purge rate while ingesting (rows/s)",
        median(purge_rates.clone())
    );
    println!();
    println!("ratio within each round: median (lowest..highest)");
    println!(
        "{:<56} {}",
        "ingest with purge / ingest alone",
        spread(&ratios)
    );
    println!(
        "{:<56} {} (aim >= 2)",
        "purge rate / ingest rate",
        spread(&keep_up)
    );
    if let (Some(first), Some(last)) = (batches.first(), batches.last()) {
        println!(
            "buffers per purge batch of {purge_batch}: first {} (after 0 rows), last {} \
             (after {} rows deleted), {} full batches",
            first.1,
            last.1,
            last.0,
            batches.len()
        );
    }
}
