//! `cargo run --release -p inbox-benches --bin bench_rebuild`: what a rebuild costs the live
//! consumers beside it.
//!
//! A `daily_usage` store in a schema of its own on PostgreSQL; `BENCH_WORKERS` (4)
//! live workers each write 100 ledger rows for today in one transaction and then
//! process their 100 events as one batch (the folding projection, the lock taken
//! shared before the claims), for `BENCH_SECONDS` (10) twice: alone, then beside a
//! loop of rebuilds of the two-day window (`lock_timeout` `BENCH_LOCK_TIMEOUT_MS`,
//! default the store's 200 ms). Yesterday holds `BENCH_LEDGER` (20,000) rows, so each
//! rebuild reads and covers a real partition.
//!
//! Printed: the live batches' latency (p50, p99, max) in both phases, and the wait for
//! the projection lock itself as a live batch sees it, queueing behind a rebuild's
//! exclusive request included: a probe thread takes the lock shared the way a batch
//! does (`pg_advisory_xact_lock_shared` on the store's key, in a transaction) every
//! 5 ms and times the statement. Also the rebuilds' own figures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::PgConnection;
use inbox_benches::{env_or, service_urls};
use inbox_core::{ConsumerGroup, Handler, OutboxStore, ProjectionLock, RetryPolicy};
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::Store;
use inbox_examples::usage::{
    ledger_event_key, DailyUsage, UsageDb, UsageRecorded, GROUP, PROJECTION,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _) = service_urls();
    let workers: usize = env_or("BENCH_WORKERS", 4);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    let ledger: i64 = env_or("BENCH_LEDGER", 20_000);
    let lock_timeout = Duration::from_millis(env_or(
        "BENCH_LOCK_TIMEOUT_MS",
        inbox_diesel::rebuild::DEFAULT_LOCK_TIMEOUT.as_millis() as u64,
    ));
    let schema = format!("bench_rebuild_{}", std::process::id());
    let store = Store::<PgConnection>::builder(url.clone())
        .schema(schema.clone())
        .pool_size(workers as u32 + 3)
        .projection(DailyUsage::new(RetryPolicy::default()))
        .build()?;
    let result = run(&store, workers, seconds, ledger, lock_timeout);
    let mut conn = PgConnection::establish(&url)?;
    conn.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))?;
    result
}

fn run(
    store: &Store<PgConnection>,
    workers: usize,
    seconds: u64,
    ledger: i64,
    lock_timeout: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut conn = store.connection()?;
    conn.create_daily_usage()?;
    conn.create_usage_ledger()?;
    let yesterday = store.now().date_naive().pred_opt().ok_or("no yesterday")?;
    conn.batch_execute(&format!(
        "INSERT INTO usage_ledger (user_id, day, amount) \
         SELECT 1 + g % 50, '{yesterday}', 1 + g % 97 FROM generate_series(1, {ledger}) g"
    ))?;
    drop(conn);
    let lock = Handler::<PgConnection>::lock(&DailyUsage::new(RetryPolicy::default()))
        .unwrap_or_else(|| ProjectionLock::named(PROJECTION));
    let key = store.projection_lock_key(&lock);
    println!(
        "bench_rebuild: {workers} live workers, batches of 100, {seconds} s per phase, \
         {ledger} ledger rows yesterday, lock_timeout {lock_timeout:?}"
    );
    for beside_rebuilds in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let waits = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for _ in 0..workers {
            let (store, stop, latencies) =
                (store.clone(), Arc::clone(&stop), Arc::clone(&latencies));
            threads.push(std::thread::spawn(move || live(&store, &stop, &latencies)));
        }
        let probe = {
            let (store, stop, waits) = (store.clone(), Arc::clone(&stop), Arc::clone(&waits));
            std::thread::spawn(move || probe_lock(&store, key, &stop, &waits))
        };
        let rebuilds = beside_rebuilds.then(|| {
            let (store, stop) = (store.clone(), Arc::clone(&stop));
            std::thread::spawn(move || rebuild_loop(&store, lock_timeout, &stop))
        });
        std::thread::sleep(Duration::from_secs(seconds));
        stop.store(true, Ordering::SeqCst);
        for t in threads {
            t.join().map_err(|_| "a live worker panicked")??;
        }
        probe.join().map_err(|_| "the probe panicked")??;
        let phase = if beside_rebuilds {
            "beside rebuilds"
        } else {
            "alone          "
        };
        let mut l = latencies.lock().map_err(|_| "poisoned")?.clone();
        let mut w = waits.lock().map_err(|_| "poisoned")?.clone();
        println!(
            "  {phase}: {} live batches, latency {}; lock wait {} ({} probes)",
            l.len(),
            summary(&mut l),
            summary(&mut w),
            w.len()
        );
        if let Some(r) = rebuilds {
            let r = r.join().map_err(|_| "the rebuild loop panicked")??;
            println!(
                "  rebuilds: {} runs of 2 partitions, {:.0} ms each (median), {} lock waits, \
                 {} lock timeouts retried, longest lock wait {} ms, {} events covered",
                r.runs, r.median_ms, r.lock_waits, r.lock_timeouts, r.longest_wait_ms, r.covered
            );
        }
    }
    Ok(())
}

/// Writes 100 ledger rows for today, then processes their events as one batch.
fn live(
    store: &Store<PgConnection>,
    stop: &AtomicBool,
    latencies: &Mutex<Vec<Duration>>,
) -> Result<(), String> {
    let group = ConsumerGroup::new(GROUP).map_err(|e| e.to_string())?;
    let mut conn = store.connection().map_err(|e| e.to_string())?;
    let mut n = 0i64;
    while !stop.load(Ordering::SeqCst) {
        let today = store.now().date_naive();
        let batch = conn
            .transaction::<_, diesel::result::Error, _>(|conn| {
                (0..100)
                    .map(|i| {
                        let (user_id, amount) = (1 + (n + i) % 50, 1 + (n + i) % 13);
                        let id = conn.insert_ledger(user_id, today, amount)?;
                        let event = UsageRecorded {
                            user_id,
                            day: today,
                            amount,
                        };
                        Ok(event.envelope(ledger_event_key(id)))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(|e| e.to_string())?;
        n += 100;
        let started = Instant::now();
        store
            .process_batch(&group, &batch)
            .map_err(|e| e.to_string())?;
        latencies
            .lock()
            .map_err(|_| "poisoned")?
            .push(started.elapsed());
    }
    Ok(())
}

/// Takes the projection lock shared as a live batch does, every 5 ms; times the wait.
fn probe_lock(
    store: &Store<PgConnection>,
    key: i64,
    stop: &AtomicBool,
    waits: &Mutex<Vec<Duration>>,
) -> Result<(), String> {
    let mut conn = store.connection().map_err(|e| e.to_string())?;
    while !stop.load(Ordering::SeqCst) {
        let waited = conn
            .transaction::<_, diesel::result::Error, _>(|conn| {
                let started = Instant::now();
                diesel::sql_query("SELECT pg_advisory_xact_lock_shared($1)")
                    .bind::<diesel::sql_types::BigInt, _>(key)
                    .execute(conn)?;
                Ok(started.elapsed())
            })
            .map_err(|e| e.to_string())?;
        waits.lock().map_err(|_| "poisoned")?.push(waited);
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

struct Rebuilds {
    runs: usize,
    median_ms: f64,
    lock_waits: u64,
    lock_timeouts: u64,
    longest_wait_ms: u64,
    covered: u64,
}

fn rebuild_loop(
    store: &Store<PgConnection>,
    lock_timeout: Duration,
    stop: &AtomicBool,
) -> Result<Rebuilds, String> {
    let rebuilder = Rebuilder::new(store, PROJECTION)
        .map_err(|e| e.to_string())?
        .lock_timeout(lock_timeout);
    let mut r = Rebuilds {
        runs: 0,
        median_ms: 0.0,
        lock_waits: 0,
        lock_timeouts: 0,
        longest_wait_ms: 0,
        covered: 0,
    };
    let mut took = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let report = rebuilder.rebuild(2).map_err(|e| e.to_string())?;
        r.runs += 1;
        r.lock_waits += report.lock_waits;
        r.lock_timeouts += report.lock_timeouts;
        r.longest_wait_ms = r.longest_wait_ms.max(report.longest_lock_wait_ms);
        r.covered += report.events_covered;
        took.push(report.duration_ms as f64);
    }
    took.sort_by(f64::total_cmp);
    r.median_ms = took.get(took.len() / 2).copied().unwrap_or(0.0);
    Ok(r)
}

fn summary(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".to_owned();
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    format!(
        "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(at(0.5)),
        ms(at(0.99)),
        ms(samples[samples.len() - 1])
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
