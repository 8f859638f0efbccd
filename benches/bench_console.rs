//! `cargo run --release -p inbox-benches --bin bench_console`: the web console's pages on a
//! large store, p50 and p99 per page, and the plans of their statements.
//!
//! Fills a database of its own (`bench_console_<pid>`) with `BENCH_LETTERS` (default
//! 100,000) dead letters in 16 failure groups over two consumer groups, spread over
//! the last day, and `BENCH_CLAIMS` (default 10,000,000) claims, 99% of them `done`
//! over the last two days, the rest `failed` (waiting for a retry): first a few dozen
//! through the store itself (so every column is what the store writes), then copied
//! with `generate_series`, then `VACUUM ANALYZE`. A handful of rebuild reports and a
//! halted group are recorded through the store too.
//!
//! Then it asks every page of the console (in-process, through the router, as a
//! browser would: `Accept: text/html`), `BENCH_REQUESTS` (default 50) times each,
//! pages interleaved round by round, after two warm-up rounds, and prints p50, p99 and
//! max per page, with the machine's load average before and after.
//!
//! Plans: afterwards it turns on `auto_explain` for the database (`ALTER DATABASE ...
//! SET session_preload_libraries = 'auto_explain'`, every statement logged with its
//! plan at `LOG`), asks every page once more through a new pool, and reads the plans
//! from the server's log (`BENCH_PG_LOG`, default
//! `/var/log/postgresql/postgresql-15-main.log`; skipped when it cannot be read),
//! printing each statement's scan nodes and flagging a sequential scan of the claims
//! or the dead letters.
//!
//! The database is dropped at the end and on a panic. Run by hand; CI runs a small
//! smoke run (`benches/tests/bench_console_smoke.rs`: 5,000 claims, 500 letters).

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel::PgConnection;
use inbox_benches::{env_or, service_urls, with_database};
use inbox_core::{
    ClaimInvariantViolated, ConsumerGroup, Envelope, GroupHalts, Handler, HandlerError,
    MessageContext, MessageKey, RetryPolicy,
};
use inbox_diesel::operator::Operator;
use inbox_diesel::Store;
use tower::ServiceExt;

const GROUPS: [&str; 2] = ["billing.daily-usage", "billing.invoices"];
/// Seeded letters per consumer group (each its own failure group's error).
const SEEDS: usize = 8;

/// Fails every message permanently, with one of eight errors by the key's number.
struct Failing {
    group: ConsumerGroup,
}

impl Handler<PgConnection> for Failing {
    type Message = serde_json::Value;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::new(1, Duration::from_millis(1), Duration::from_millis(1)).expect("policy")
    }

    fn handle(
        &self,
        _: &mut PgConnection,
        _: serde_json::Value,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        let key = ctx.message_key().as_str();
        let n: usize = key
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let what = [
            "ledger", "invoice", "account", "meter", "plan", "quota", "price", "tax",
        ][n % 8];
        Err(HandlerError::permanent(format!(
            "{what} row {} is locked by transaction {}",
            n * 7,
            n * 131
        )))
    }
}

fn exec(conn: &mut PgConnection, sql: &str) {
    if let Err(e) = conn.batch_execute(sql) {
        panic!("{sql}: {e}");
    }
}

#[derive(QueryableByName)]
struct Column {
    #[diesel(sql_type = Text)]
    column_name: String,
}

/// The table's columns but `id`, in order.
fn columns(conn: &mut PgConnection, table: &str) -> Vec<String> {
    diesel::sql_query(
        "SELECT column_name::text AS column_name FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = $1 AND column_name <> 'id'
         ORDER BY ordinal_position",
    )
    .bind::<Text, _>(table)
    .load::<Column>(conn)
    .expect("columns")
    .into_iter()
    .map(|c| c.column_name)
    .collect()
}

/// `INSERT INTO table (cols) SELECT <cols, some replaced> FROM table t CROSS JOIN
/// generate_series(1, n) g WHERE <filter>`.
fn copy_rows(conn: &mut PgConnection, table: &str, n: u64, replace: &[(&str, &str)], filter: &str) {
    let cols = columns(conn, table);
    let select: Vec<String> = cols
        .iter()
        .map(|c| {
            replace
                .iter()
                .find(|(name, _)| name == c)
                .map_or_else(|| format!("t.{c}"), |(_, e)| (*e).to_owned())
        })
        .collect();
    exec(
        conn,
        &format!(
            "INSERT INTO {table} ({}) SELECT {} FROM {table} t CROSS JOIN generate_series(1, {n}) g WHERE {filter}",
            cols.join(", "),
            select.join(", ")
        ),
    );
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn count(conn: &mut PgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<Count>(conn)
        .expect("count")
        .n
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "-".to_owned())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Db {
    admin: String,
    name: String,
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.admin) {
            let _ = conn.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

fn main() {
    let (admin, _) = service_urls();
    let claims: u64 = env_or("BENCH_CLAIMS", 10_000_000);
    let letters: u64 = env_or("BENCH_LETTERS", 100_000);
    let requests: usize = env_or("BENCH_REQUESTS", 50);
    let pg_log: String = env_or(
        "BENCH_PG_LOG",
        "/var/log/postgresql/postgresql-15-main.log".to_owned(),
    );
    let db = Db {
        admin: admin.clone(),
        name: format!("bench_console_{}", std::process::id()),
    };
    exec(
        &mut PgConnection::establish(&admin).expect("connect"),
        &format!("CREATE DATABASE {}", db.name),
    );
    let url = with_database(&admin, &db.name);
    println!("bench_console: {letters} dead letters, {claims} claims, {requests} requests per page; database {}", db.name);

    // Seed through the store: letters with every column the store writes.
    let started = Instant::now();
    let mut builder = Store::<PgConnection>::builder(url.clone());
    for g in GROUPS {
        builder = builder.handler(Failing {
            group: ConsumerGroup::new(g).expect("group"),
        });
    }
    let store = builder.build().expect("store");
    for g in GROUPS {
        let group = ConsumerGroup::new(g).expect("group");
        for i in 0..SEEDS {
            let env = Envelope::new(
                MessageKey::new(format!("seed-{g}-{i}")).expect("key"),
                "usage.recorded",
                format!(
                    r#"{{"user_id":{i},"amount":{},"note":"<script>alert(1)</script>"}}"#,
                    i * 3
                )
                .into_bytes(),
            );
            store.process_batch(&group, &[env]).expect("seed");
        }
    }
    store
        .record_halt(&ClaimInvariantViolated {
            group: ConsumerGroup::new(GROUPS[1]).expect("group"),
            key: MessageKey::new("seed-halt").expect("key"),
            detail: "claim seed-halt vanished after its insert was refused".to_owned(),
        })
        .expect("halt");
    // A connection of its own: the store's have a statement timeout.
    let mut conn = PgConnection::establish(&url).expect("connect");
    exec(&mut conn, "SET statement_timeout = 0");
    let per_seed = (letters / (GROUPS.len() * SEEDS) as u64).max(1);
    copy_rows(
        &mut conn,
        "inbox_dead_letters",
        per_seed,
        &[
            ("message_key", "t.message_key || '-' || g"),
            (
                "dead_lettered_at",
                "now() - (g % 86400) * interval '1 second'",
            ),
        ],
        "t.message_key LIKE 'seed-%'",
    );
    // Claims: a `done` template per group and a `failed` one, copied.
    let done = claims * 99 / 100 / GROUPS.len() as u64;
    let failed = (claims - done * GROUPS.len() as u64) / GROUPS.len() as u64;
    exec(
        &mut conn,
        "UPDATE inbox_claims SET status = 'done', payload = NULL WHERE message_key LIKE 'seed-%-0'",
    );
    exec(&mut conn, "UPDATE inbox_claims SET status = 'failed', next_attempt_at = now() + interval '1 hour' WHERE message_key LIKE 'seed-%-1'");
    copy_rows(
        &mut conn,
        "inbox_claims",
        done,
        &[
            ("message_key", "'c-' || t.consumer_group || '-' || g"),
            ("updated_at", "now() - (g % 172800) * interval '1 second'"),
            (
                "first_seen_at",
                "now() - (g % 172800) * interval '1 second'",
            ),
        ],
        "t.message_key LIKE 'seed-%-0'",
    );
    copy_rows(
        &mut conn,
        "inbox_claims",
        failed,
        &[
            ("message_key", "'f-' || t.consumer_group || '-' || g"),
            ("updated_at", "now() - (g % 3600) * interval '1 second'"),
        ],
        "t.message_key LIKE 'seed-%-1'",
    );
    exec(&mut conn, "VACUUM ANALYZE inbox_claims");
    exec(&mut conn, "VACUUM ANALYZE inbox_dead_letters");
    let n_claims = count(&mut conn, "SELECT count(*) AS n FROM inbox_claims");
    let n_letters = count(&mut conn, "SELECT count(*) AS n FROM inbox_dead_letters");
    drop(conn);
    println!(
        "filled: {n_claims} claims, {n_letters} dead letters in {:.0} s",
        started.elapsed().as_secs_f64()
    );

    let operator = Operator::new(&store);
    let some = operator
        .list_dead_letters(&Default::default(), 0, 1)
        .expect("a letter");
    let letter = some[0].id;
    let fp = some[0].failure_group.clone();
    let pages: Vec<(&str, String)> = vec![
        ("overview", "/".to_owned()),
        ("failure groups", "/failures".to_owned()),
        ("dead letters", "/letters".to_owned()),
        (
            "letters of a failure group",
            format!("/letters?failure_group={fp}"),
        ),
        (
            "letters of a group, page 20",
            format!("/letters?consumer_group={}&offset=1000&limit=50", GROUPS[0]),
        ),
        ("a letter", format!("/letters/{letter}")),
        ("halted groups", "/halts".to_owned()),
        ("outbox", "/outbox".to_owned()),
        (
            "claims of a key",
            format!("/claims?key=c-{}-4242", GROUPS[0]),
        ),
        ("rebuilds", "/rebuilds".to_owned()),
    ];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let app = inbox_web::Console::new(operator).router();
    let ask = |path: &str| -> (StatusCode, f64) {
        let req = Request::builder()
            .uri(path)
            .header(header::ACCEPT, "text/html")
            .header(header::HOST, "127.0.0.1")
            .body(Body::empty())
            .expect("request");
        let t = Instant::now();
        let response = runtime.block_on(async {
            let r = app.clone().oneshot(req).await.expect("answer");
            let status = r.status();
            let _ = axum::body::to_bytes(r.into_body(), usize::MAX).await;
            status
        });
        (response, t.elapsed().as_secs_f64() * 1000.0)
    };
    let load_before = load_average();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); pages.len()];
    for round in 0..requests + 2 {
        for (i, (name, path)) in pages.iter().enumerate() {
            let (status, ms) = ask(path);
            assert_eq!(status, StatusCode::OK, "{name} {path}");
            if round >= 2 {
                times[i].push(ms);
            }
        }
    }
    println!(
        "load average before {load_before}, after {}",
        load_average()
    );
    println!(
        "{:<30} {:>9} {:>9} {:>9}",
        "page", "p50 ms", "p99 ms", "max ms"
    );
    for ((name, _), t) in pages.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        println!(
            "{name:<30} {:>9.1} {:>9.1} {:>9.1}",
            percentile(t, 0.5),
            percentile(t, 0.99),
            t[t.len() - 1]
        );
    }

    // Plans: auto_explain on for new sessions of this database only.
    let Ok(meta) = std::fs::metadata(&pg_log) else {
        println!("plans: skipped ({pg_log} cannot be read; set BENCH_PG_LOG)");
        return;
    };
    exec(
        &mut PgConnection::establish(&admin).expect("connect"),
        &format!(
            "ALTER DATABASE {0} SET session_preload_libraries = 'auto_explain';
             ALTER DATABASE {0} SET auto_explain.log_min_duration = 0;
             ALTER DATABASE {0} SET application_name = 'bench_console_plans'",
            db.name
        ),
    );
    let explained = Store::<PgConnection>::builder(url)
        .pool_size(1)
        .build()
        .expect("store");
    let app = inbox_web::Console::new(Operator::new(&explained)).router();
    let from = meta.len();
    for (_, path) in &pages {
        let req = Request::builder()
            .uri(path.as_str())
            .header(header::ACCEPT, "text/html")
            .header(header::HOST, "127.0.0.1")
            .body(Body::empty())
            .expect("request");
        runtime.block_on(async {
            let r = app.clone().oneshot(req).await.expect("answer");
            let _ = axum::body::to_bytes(r.into_body(), usize::MAX).await;
        });
    }
    std::thread::sleep(Duration::from_millis(500));
    let log = std::fs::read(&pg_log).unwrap_or_default();
    let tail = String::from_utf8_lossy(&log[usize::try_from(from).unwrap_or(0).min(log.len())..])
        .into_owned();
    let mut seq_scans = 0;
    let mut statements = 0;
    for plan in tail.split("LOG:  duration:").skip(1) {
        let first = plan.lines().nth(1).unwrap_or_default().trim().to_owned();
        if !plan.contains("inbox_") && !plan.contains("outbox_") {
            continue;
        }
        statements += 1;
        let scans: Vec<String> = plan
            .lines()
            .filter_map(|l| {
                let l = l.trim().trim_start_matches("->").trim();
                let node = l.split("  (").next().unwrap_or(l);
                (node.contains(" Scan") || node.starts_with("Seq Scan")).then(|| node.to_owned())
            })
            .collect();
        let seq = scans.iter().any(|s| {
            s.starts_with("Seq Scan on inbox_claims")
                || s.starts_with("Seq Scan on inbox_dead_letters")
        });
        if seq {
            seq_scans += 1;
        }
        println!(
            "{} {first:.110}\n    {}",
            if seq { "SEQ" } else { "ok " },
            scans.join("; ")
        );
    }
    println!("plans: {statements} statements on the inbox's tables, {seq_scans} with a sequential scan of the claims or the dead letters");
}
