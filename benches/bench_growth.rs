//! `cargo run --release -p inbox-benches --bin bench_growth`: the consumer on a large claims table.
//!
//! A claims table that has run for months holds tens of millions of `done` rows. This
//! benchmark fills `inbox_claims` of a schema of its own with `BENCH_GROWTH_ROWS`
//! (default 10,000,000) of them in one `INSERT ... SELECT generate_series` (keys shaped
//! like the runtime's: UUID text; 32-byte digests; the message type; timestamps
//! spread over the eight weeks before now, oldest first, so a retention window would
//! cut some), with the table's indexes dropped during the insert and built again
//! from their own definitions afterwards (the claim key's as full as random inserts
//! leave it), then `VACUUM (ANALYZE)`s it.
//!
//! It then runs two of the runtime scenarios `bench_consume` measures, with the same
//! handlers and consumer settings (`inbox_benches::RuntimeScenario`): batch
//! size 1, and batches with the folding projection.
//! Each runs once on an empty claims table (a fresh schema) and once on the full one,
//! interleaved within a round (empty, full; the next round full, empty), on the same
//! deliveries (a new set of keys each round, so the full table never sees a key
//! twice). The report gives each scenario's median rate on both, the median and range
//! of the full / empty ratios taken within a round, the claims table's blocks per
//! delivery (shared-buffer hits and reads), and the table's and each index's size.
//!
//! Before anything it checks free space where PostgreSQL keeps its data (`df -P` of
//! `data_directory`, which must be on this machine) against an estimate of 600 bytes
//! per claim plus 1 GiB, and refuses to start (exit code 2) without room. Its schemas
//! and queues are removed at the end, on a panic, and on Ctrl-C or SIGTERM.
//!
//! Environment: `DATABASE_URL`, `AMQP_URL`; `BENCH_GROWTH_ROWS` (10,000,000),
//! `BENCH_GROWTH_DISK_CHECK=off` (skip the free-space check, for a server whose data
//! directory is elsewhere), `BENCH_ONLY` (`single`, `fold` or both, comma separated),
//! `BENCH_ROUNDS` (3), `BENCH_EVENTS` (deliveries per scenario run, 20,000),
//! `BENCH_WORKERS` (4), `BENCH_BATCH` (100), `BENCH_SETTLE_MS` (1000).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::Utc;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Double, Text, Timestamptz};
use diesel::PgConnection;
use inbox_benches::{
    batch_size, env_or, median, remove_on_signal, service_urls, Deliveries, Leftovers,
    RemoveOnDrop, RuntimeScenario,
};
use inbox_core::RedactedError;
use inbox_examples::usage::{GROUP, MESSAGE_TYPE};

/// Bytes of disk per prefilled claim the check asks for: the row and its index
/// entries take about 300 (see the README's figures), and the WAL written alongside
/// about as much again before checkpoints recycle it.
const BYTES_PER_CLAIM: u64 = 600;
/// Room kept free beyond the estimate.
const RESERVE_BYTES: u64 = 1 << 30;
/// The span the prefilled claims' timestamps cover, ending now.
const PREFILL_SPAN: Duration = Duration::from_secs(8 * 7 * 86_400);

#[derive(QueryableByName)]
struct Value {
    #[diesel(sql_type = Text)]
    value: String,
}

fn setting(conn: &mut PgConnection, sql: &str) -> String {
    diesel::sql_query(sql)
        .get_result::<Value>(conn)
        .map(|v| v.value)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Why the benchmark will not start.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error(
        "not enough free disk space for {rows} claims: need about {need} \
         ({BYTES_PER_CLAIM} bytes per claim plus 1 GiB), found {free} free on {dir}; \
         lower BENCH_GROWTH_ROWS or free some space"
    )]
    NoRoom {
        rows: u64,
        need: Bytes,
        free: Bytes,
        dir: String,
    },
    #[error(
        "cannot check free disk space on PostgreSQL's data directory {dir:?}: {why}; \
         run the benchmark on the database machine, or set BENCH_GROWTH_DISK_CHECK=off \
         if you know there is room"
    )]
    Unchecked { dir: String, why: String },
}

/// Free bytes on the file system of `dir`, from `df -P -k` (POSIX output: one header
/// line, then the file system's line with its available 1024-byte blocks fourth).
fn free_bytes(dir: &str) -> Result<u64, String> {
    if !std::path::Path::new(dir).is_dir() {
        return Err("it is not a directory on this machine".into());
    }
    let out = std::process::Command::new("df")
        .args(["-P", "-k", dir])
        .output()
        .map_err(|e| format!("df: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "df: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .nth(1)
        .and_then(|line| line.split_whitespace().nth(3))
        .and_then(|kib| kib.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| format!("df printed {stdout:?}"))
}

fn check_disk(conn: &mut PgConnection, rows: u64) -> Result<(), Refusal> {
    if std::env::var("BENCH_GROWTH_DISK_CHECK").as_deref() == Ok("off") {
        println!("disk: check skipped (BENCH_GROWTH_DISK_CHECK=off)");
        return Ok(());
    }
    // `data_directory` needs superuser or pg_read_all_settings.
    let dir = diesel::sql_query("SELECT current_setting('data_directory') AS value")
        .get_result::<Value>(conn)
        .map(|v| v.value)
        .map_err(|e| Refusal::Unchecked {
            dir: "(unknown)".into(),
            why: format!("reading data_directory: {e}"),
        })?;
    let free = free_bytes(&dir).map_err(|why| Refusal::Unchecked {
        dir: dir.clone(),
        why,
    })?;
    let need = rows * BYTES_PER_CLAIM + RESERVE_BYTES;
    if free < need {
        return Err(Refusal::NoRoom {
            rows,
            need: Bytes(need),
            free: Bytes(free),
            dir,
        });
    }
    println!(
        "disk: {} free on {dir}, about {} needed ({BYTES_PER_CLAIM} bytes per claim plus 1 GiB)",
        Bytes(free),
        Bytes(need)
    );
    Ok(())
}

/// A size in bytes, printed in MiB or GiB.
#[derive(Debug, Clone, Copy)]
struct Bytes(u64);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kib = self.0 as f64 / 1024.0;
        if kib >= 1024.0 * 1024.0 {
            write!(f, "{:.2} GiB", kib / (1024.0 * 1024.0))
        } else if kib >= 1024.0 {
            write!(f, "{:.1} MiB", kib / 1024.0)
        } else {
            write!(f, "{kib:.0} KiB")
        }
    }
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[derive(QueryableByName)]
struct IndexDef {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Text)]
    def: String,
    #[diesel(sql_type = Bool)]
    is_constraint: bool,
}

/// The claims table's indexes as they can be created again: a constraint's as
/// `ALTER TABLE ... ADD CONSTRAINT`, others as their `CREATE INDEX`.
fn claim_indexes(conn: &mut PgConnection) -> Vec<IndexDef> {
    diesel::sql_query(
        "SELECT i.relname::text AS name, \
                CASE WHEN c.oid IS NULL THEN pg_get_indexdef(i.oid) \
                     ELSE pg_get_constraintdef(c.oid) END AS def, \
                c.oid IS NOT NULL AS is_constraint \
         FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
         LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid \
         WHERE x.indrelid = to_regclass('inbox_claims') ORDER BY i.relname",
    )
    .load(conn)
    .expect("claim indexes")
}

/// Seconds each step of the prefill took.
struct Prefill {
    insert: f64,
    indexes: f64,
    vacuum: f64,
}

/// Fills the claims table of the connection's schema with `rows` done claims of the
/// benchmark's group, then builds its indexes and vacuums it.
fn prefill(conn: &mut PgConnection, rows: u64) -> Prefill {
    conn.batch_execute("SET statement_timeout = 0; SET maintenance_work_mem = '256MB'")
        .expect("session settings");
    let indexes = claim_indexes(conn);
    // Building an index from sorted rows is far quicker than 10 M random inserts into
    // it; the definitions come from the catalog, so they are the migrations' own.
    for index in &indexes {
        let drop = if index.is_constraint {
            format!("ALTER TABLE inbox_claims DROP CONSTRAINT {}", index.name)
        } else {
            format!("DROP INDEX {}", index.name)
        };
        conn.batch_execute(&drop).expect("drop index");
    }
    let started = Instant::now();
    let now = Utc::now();
    let first = now - chrono::Duration::from_std(PREFILL_SPAN).expect("span");
    diesel::sql_query(
        "INSERT INTO inbox_claims (consumer_group, message_key, message_type, tenant, \
             payload_digest, status, attempts, starts, first_seen_at, updated_at) \
         SELECT $1, md5('prefill-' || i)::uuid::text, $2, NULL, \
             sha256(convert_to('prefill-' || i, 'UTF8')), 'done', 0, 0, \
             $3 + make_interval(secs => i * $4), \
             $3 + make_interval(secs => i * $4 + 0.015) \
         FROM generate_series(1, $5) AS i",
    )
    .bind::<Text, _>(GROUP)
    .bind::<Text, _>(MESSAGE_TYPE)
    .bind::<Timestamptz, _>(first)
    .bind::<Double, _>(PREFILL_SPAN.as_secs_f64() / rows as f64)
    .bind::<BigInt, _>(rows as i64)
    .execute(conn)
    .expect("prefill");
    let insert = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for index in &indexes {
        let create = if index.is_constraint && !index.def.contains(" WITH (") {
            // The claim key is random (UUIDs), and a B-tree grown by random inserts
            // settles at about 70% full leaves (111 bytes per claim measured here,
            // against 86 for a fresh build at the default 90%). Built at 70 and then
            // reset to the definition's own default, the index has the size and the
            // room for inserts of an old one, instead of splitting a leaf at nearly
            // every insert of the first rounds.
            format!(
                "ALTER TABLE inbox_claims ADD CONSTRAINT {name} {def} WITH (fillfactor = 70); \
                 ALTER INDEX {name} RESET (fillfactor)",
                name = index.name,
                def = index.def
            )
        } else if index.is_constraint {
            format!(
                "ALTER TABLE inbox_claims ADD CONSTRAINT {} {}",
                index.name, index.def
            )
        } else {
            // The other indexes grow at their right edge (`updated_at`, due times),
            // as a fresh build packs them.
            index.def.clone()
        };
        conn.batch_execute(&create).expect("create index");
    }
    let indexes = started.elapsed().as_secs_f64();
    let started = Instant::now();
    // What autovacuum would have done to a table this old: the visibility map and
    // hint bits set, statistics current.
    conn.batch_execute("VACUUM (ANALYZE) inbox_claims")
        .expect("vacuum");
    Prefill {
        insert,
        indexes,
        vacuum: started.elapsed().as_secs_f64(),
    }
}

#[derive(QueryableByName)]
struct Size {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = BigInt)]
    bytes: i64,
}

/// The claims table, its indexes together and each index.
fn sizes(conn: &mut PgConnection) -> Vec<Size> {
    diesel::sql_query(
        "SELECT 'table (pg_relation_size)' AS name, pg_relation_size('inbox_claims') AS bytes \
         UNION ALL SELECT 'indexes (pg_indexes_size)', pg_indexes_size('inbox_claims') \
         UNION ALL (SELECT 'index ' || i.relname, pg_relation_size(i.oid) \
             FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
             WHERE x.indrelid = to_regclass('inbox_claims') ORDER BY i.relname)",
    )
    .load(conn)
    .expect("sizes")
}

fn print_sizes(title: &str, conn: &mut PgConnection) {
    let claims: i64 = diesel::sql_query("SELECT count(*) AS bytes, '' AS name FROM inbox_claims")
        .get_result::<Size>(conn)
        .map(|s| s.bytes)
        .expect("count");
    println!("{title} ({} claims):", thousands(claims as u64));
    for size in sizes(conn) {
        println!(
            "  {:<40} {:>12}  {:>6.1} bytes per claim",
            size.name,
            Bytes(size.bytes as u64).to_string(),
            size.bytes as f64 / claims.max(1) as f64
        );
    }
}

/// The claims table's block counters (`pg_statio_user_tables`) in `schema`.
#[derive(QueryableByName, Clone, Copy, Default)]
struct Blocks {
    #[diesel(sql_type = BigInt)]
    heap_hit: i64,
    #[diesel(sql_type = BigInt)]
    heap_read: i64,
    #[diesel(sql_type = BigInt)]
    idx_hit: i64,
    #[diesel(sql_type = BigInt)]
    idx_read: i64,
}

impl Blocks {
    fn read(url: &str, schema: &str) -> Self {
        // The runtime's sessions have just ended; their counters reach the shared
        // statistics as they exit.
        std::thread::sleep(Duration::from_millis(500));
        let mut conn = PgConnection::establish(url).expect("connect");
        diesel::sql_query(
            "SELECT coalesce(sum(heap_blks_hit), 0)::bigint AS heap_hit, \
                    coalesce(sum(heap_blks_read), 0)::bigint AS heap_read, \
                    coalesce(sum(idx_blks_hit), 0)::bigint AS idx_hit, \
                    coalesce(sum(idx_blks_read), 0)::bigint AS idx_read \
             FROM pg_statio_user_tables WHERE schemaname = $1 AND relname = 'inbox_claims'",
        )
        .bind::<Text, _>(schema)
        .get_result(&mut conn)
        .expect("statio")
    }

    fn since(self, before: Self) -> Self {
        Self {
            heap_hit: self.heap_hit - before.heap_hit,
            heap_read: self.heap_read - before.heap_read,
            idx_hit: self.idx_hit - before.idx_hit,
            idx_read: self.idx_read - before.idx_read,
        }
    }

    fn add(&mut self, other: Self) {
        self.heap_hit += other.heap_hit;
        self.heap_read += other.heap_read;
        self.idx_hit += other.idx_hit;
        self.idx_read += other.idx_read;
    }
}

#[derive(QueryableByName)]
struct PlanLine {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    line: String,
}

/// The buffers and WAL of one claim of `keys` new keys, in the claim statement's
/// shape (an `unnest` insert with the takeover clause), rolled back: the plan's
/// `Buffers:` and `WAL:` lines of its top node.
fn explain_claim(conn: &mut PgConnection, keys: usize, seed: &str) -> String {
    conn.batch_execute("BEGIN").expect("begin");
    let lines: Vec<PlanLine> = diesel::sql_query(
        "EXPLAIN (ANALYZE, BUFFERS, WAL, COSTS OFF, TIMING OFF) \
         INSERT INTO inbox_claims (consumer_group, message_key, message_type, tenant, \
             payload_digest, status, attempts, starts, first_seen_at, updated_at) \
         SELECT $1, k.message_key, $2, NULL, sha256(convert_to(k.message_key, 'UTF8')), \
             'done', 0, 0, $3, $3 \
         FROM unnest(ARRAY(SELECT md5($4 || i)::uuid::text FROM generate_series(1, $5) i \
             ORDER BY 1)) AS k(message_key) \
         ON CONFLICT (consumer_group, message_key) DO UPDATE SET status = 'done', \
             payload = NULL, updated_at = EXCLUDED.updated_at \
         WHERE inbox_claims.status IN ('failed', 'started') \
             AND inbox_claims.payload_digest = excluded.payload_digest \
             AND (inbox_claims.next_attempt_at IS NULL OR inbox_claims.next_attempt_at <= $3) \
         RETURNING message_key, attempts",
    )
    .bind::<Text, _>(GROUP)
    .bind::<Text, _>(MESSAGE_TYPE)
    .bind::<Timestamptz, _>(Utc::now())
    .bind::<Text, _>(seed)
    .bind::<BigInt, _>(keys as i64)
    .load(conn)
    .expect("explain");
    conn.batch_execute("ROLLBACK").expect("rollback");
    // The top node's lines come first (its children are indented further).
    lines
        .iter()
        .map(|l| l.line.trim())
        .filter(|l| l.starts_with("Buffers:") || l.starts_with("WAL:"))
        .take(2)
        .collect::<Vec<_>>()
        .join("; ")
}

const SCENARIOS: [(&str, &str); 2] = [
    ("single", "runtime: batch size 1"),
    ("fold", "runtime: batches, folding projection"),
];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let rows: u64 = env_or("BENCH_GROWTH_ROWS", 10_000_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 3).max(1);
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    let workers: usize = env_or("BENCH_WORKERS", 4);
    let batch = batch_size();
    let scenarios: Vec<(&str, &str)> = match std::env::var("BENCH_ONLY") {
        Err(_) => SCENARIOS.to_vec(),
        Ok(only) => {
            let names: Vec<&str> = only.split(',').map(str::trim).collect();
            if let Some(bad) = names
                .iter()
                .find(|n| !SCENARIOS.iter().any(|(name, _)| name == *n))
            {
                eprintln!(
                    "bench_growth: BENCH_ONLY={only:?}: expected a comma list of single, fold; \
                     found {bad:?}"
                );
                std::process::exit(2);
            }
            SCENARIOS
                .into_iter()
                .filter(|(name, _)| names.contains(name))
                .collect()
        }
    };
    let run = format!("growth_{}", std::process::id());
    let leftovers = Leftovers::new(&db_url, &amqp_url, &run);
    let _remove = RemoveOnDrop(leftovers.clone());
    remove_on_signal(leftovers.clone());
    let url = leftovers.url().to_owned();

    let mut conn = PgConnection::establish(&url)
        .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &db_url)));
    println!(
        "{} prefilled claims; {events} deliveries per scenario run, {workers} workers, \
         batch {batch}, {rounds} rounds; PostgreSQL {}, fsync={}, TLS={}, shared_buffers={}",
        thousands(rows),
        setting(
            &mut conn,
            "SELECT current_setting('server_version') AS value"
        ),
        setting(&mut conn, "SELECT current_setting('fsync') AS value"),
        setting(
            &mut conn,
            "SELECT CASE WHEN ssl THEN 'on' ELSE 'off' END AS value \
             FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        ),
        setting(
            &mut conn,
            "SELECT current_setting('shared_buffers') AS value"
        ),
    );
    if let Err(refusal) = check_disk(&mut conn, rows) {
        eprintln!("bench_growth: {refusal}");
        std::process::exit(2);
    }
    drop(conn);

    // The full schema: migrated by a store like every scenario's, then filled.
    let full = format!("{run}_full");
    let mut setup = leftovers.create_schema(&full);
    drop(
        RuntimeScenario {
            db_url: &url,
            amqp_url: &amqp_url,
            schema: &full,
            prefix: &format!("{run}.setup."),
            workers: 1,
            batch: 1,
            fold: true,
        }
        .consumer(),
    );
    let started = Instant::now();
    let (mut setup, times) = tokio::task::spawn_blocking(move || {
        let times = prefill(&mut setup, rows);
        (setup, times)
    })
    .await
    .expect("prefill");
    println!(
        "prefill: {} claims in {:.1} s (insert {:.1} s, indexes {:.1} s, vacuum and analyze {:.1} s)",
        thousands(rows),
        started.elapsed().as_secs_f64(),
        times.insert,
        times.indexes,
        times.vacuum
    );
    print_sizes("inbox_claims after the prefill", &mut setup);

    let mut rates: BTreeMap<(&str, bool), Vec<f64>> = BTreeMap::new();
    let mut blocks: BTreeMap<(&str, bool), Blocks> = BTreeMap::new();
    let mut delivered = 0u64;
    for round in 0..rounds {
        for (s, (name, _)) in scenarios.iter().enumerate() {
            // The same deliveries on both tables, new keys every time.
            let deliveries = Deliveries::generate(events, 4_000 + (round * 2 + s) as u64);
            // Empty first in even rounds, full first in odd ones.
            for side in [round % 2 == 1, round % 2 == 0] {
                let (schema, before) = if side {
                    // The previous run's sums would fail this run's check.
                    setup
                        .batch_execute("DROP TABLE IF EXISTS daily_usage")
                        .expect("drop daily_usage");
                    (full.clone(), Blocks::read(&url, &full))
                } else {
                    let schema = format!("{run}_empty{round}_{name}");
                    drop(leftovers.create_schema(&schema));
                    (schema, Blocks::default())
                };
                let scenario = RuntimeScenario {
                    db_url: &url,
                    amqp_url: &amqp_url,
                    schema: &schema,
                    prefix: &format!(
                        "{run}.{round}.{name}.{}.",
                        if side { "full" } else { "empty" }
                    ),
                    workers,
                    batch: if *name == "single" { 1 } else { batch },
                    fold: *name == "fold",
                };
                let rate = scenario.run(&deliveries, &leftovers).await;
                let used = Blocks::read(&url, &schema).since(before);
                blocks.entry((name, side)).or_default().add(used);
                if !side {
                    leftovers.drop_schema(&schema);
                }
                eprintln!(
                    "  round {}: {name} on the {} table: {rate:.0} deliveries/s",
                    round + 1,
                    if side { "full" } else { "empty" }
                );
                rates.entry((name, side)).or_default().push(rate);
            }
            delivered += deliveries.order.len() as u64;
        }
    }

    println!();
    println!(
        "{:<38} {:>14} {:>14}   full / empty within a round: median (range)",
        "scenario (median of rounds)", "empty: del/s", "full: del/s",
    );
    for &(name, label) in &scenarios {
        let empty = &rates[&(name, false)];
        let full = &rates[&(name, true)];
        let ratios: Vec<f64> = full.iter().zip(empty).map(|(f, e)| f / e).collect();
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(0.0, f64::max);
        println!(
            "{label:<38} {:>14.0} {:>14.0}   {:.2} ({low:.2}..{high:.2}; aim >= 0.8)",
            median(empty.clone()),
            median(full.clone()),
            median(ratios)
        );
    }
    println!();
    println!("inbox_claims blocks per delivery (heap and indexes; hit = in shared_buffers, read = from the OS)");
    println!(
        "{:<46} {:>10} {:>10} {:>10} {:>10}",
        "scenario, table", "heap hit", "heap read", "index hit", "index read"
    );
    let per_side = (delivered / scenarios.len() as u64).max(1) as f64;
    for &(name, label) in &scenarios {
        for side in [false, true] {
            let b = blocks[&(name, side)];
            println!(
                "{:<46} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                format!("{label}, {}", if side { "full" } else { "empty" }),
                b.heap_hit as f64 / per_side,
                b.heap_read as f64 / per_side,
                b.idx_hit as f64 / per_side,
                b.idx_read as f64 / per_side
            );
        }
    }
    println!();
    println!("one claim statement of new keys, rolled back (EXPLAIN ANALYZE, BUFFERS, WAL):");
    let empty = format!("{run}_explain");
    let mut explain = leftovers.create_schema(&empty);
    drop(
        RuntimeScenario {
            db_url: &url,
            amqp_url: &amqp_url,
            schema: &empty,
            prefix: &format!("{run}.explain."),
            workers: 1,
            batch: 1,
            fold: true,
        }
        .consumer(),
    );
    for keys in [1, batch] {
        for attempt in 0..2 {
            for (side, conn) in [("empty", &mut explain), ("full", &mut setup)] {
                let seed = format!("explain-{keys}-{attempt}-");
                println!(
                    "  {keys:>4} keys, {side:<5} table: {}",
                    explain_claim(conn, keys, &seed)
                );
            }
        }
    }
    drop(explain);
    leftovers.drop_schema(&empty);
    println!();
    print_sizes("inbox_claims after the rounds", &mut setup);
    drop(setup);
}
