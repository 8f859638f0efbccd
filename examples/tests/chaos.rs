//! Chaos against the example processes: `usage_producer` writes ledger rows with their
//! events and relays them, `usage_consumer` projects them into `daily_usage`, while
//! this test kills the consumer with SIGKILL again and again, terminates the consumer's
//! own PostgreSQL backends, closes, freezes and stalls its broker connection through a
//! proxy of the test's own, and kills the producer's relay mid-publish. At the end the
//! projection equals the ledger's sums exactly, and nothing was dead-lettered.
//!
//! It runs `INBOX_CHAOS_SECONDS` of chaos (default 40, about a minute and a half in
//! all); set it higher for a longer run. It lives in the examples' package because
//! `cargo test` builds a package's examples next to its test binaries.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, PgConnection, RunQueryDsl};
use inbox_test_support::amqp::{host_port, Proxy};

fn services() -> Option<(String, String)> {
    let db = inbox_test_support::postgres_url()?;
    Some((db, inbox_test_support::amqp::amqp_url()?))
}

fn example(name: &str) -> PathBuf {
    inbox_test_support::example_path(name)
}

fn chaos_seconds() -> u64 {
    std::env::var("INBOX_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40)
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(diesel::QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    line: String,
}

/// A monitoring connection of the test's own (its backends are never terminated).
struct Db {
    url: String,
    conn: Option<PgConnection>,
}

impl Db {
    fn count(&mut self, sql: &str) -> i64 {
        for _ in 0..50 {
            if self.conn.is_none() {
                self.conn = PgConnection::establish(&self.url).ok();
            }
            if let Some(conn) = self.conn.as_mut() {
                match diesel::sql_query(sql).get_result::<Count>(conn) {
                    Ok(c) => return c.n,
                    Err(_) => self.conn = None,
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{sql} never answered");
    }

    fn lines(&mut self, sql: &str) -> Vec<String> {
        let conn = self.conn.get_or_insert_with(|| {
            PgConnection::establish(&self.url).expect("connect to DATABASE_URL")
        });
        diesel::sql_query(sql)
            .load::<Line>(conn)
            .unwrap()
            .into_iter()
            .map(|l| l.line)
            .collect()
    }

    fn projected(&mut self) -> i64 {
        self.count("SELECT COALESCE(SUM(total), 0)::bigint AS n FROM daily_usage")
    }
}

/// Every (user, day) whose projected total differs from the ledger's sum.
const MISMATCHES: &str = "SELECT format('user %s on %s: ledger %s, projected %s', \
     COALESCE(l.user_id, p.user_id), COALESCE(l.day, p.day), l.total, p.total) AS line \
     FROM (SELECT user_id, day, SUM(amount)::bigint AS total FROM usage_ledger GROUP BY 1, 2) l \
     FULL JOIN daily_usage p ON p.user_id = l.user_id AND p.day = l.day \
     WHERE l.total IS DISTINCT FROM p.total ORDER BY 1";

/// Kills the child if the test fails first (a stray consumer keeps consuming).
struct Proc(Option<Child>);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn log_file(dir: &Path, name: &str) -> (Stdio, Stdio) {
    let file = File::options()
        .create(true)
        .append(true)
        .open(dir.join(name))
        .unwrap();
    (file.try_clone().unwrap().into(), file.into())
}

/// One test's schema, names, proxy and processes.
struct Scene {
    base: String,
    schema: String,
    /// The schema's URL for the consumer, with its own `application_name`.
    consumer_db: String,
    /// The schema's URL for the producer.
    producer_db: String,
    prefix: String,
    amqp: String,
    /// The broker through the proxy, with a 2 s heartbeat (a frozen connection is
    /// noticed within about 4 s).
    consumer_amqp: String,
    logs: tempfile::TempDir,
}

impl Scene {
    fn consumer(&self) -> Proc {
        let (out, err) = log_file(self.logs.path(), "consumer.log");
        Proc(Some(
            Command::new(example("usage_consumer"))
                .env("DATABASE_URL", &self.consumer_db)
                .env("AMQP_URL", &self.consumer_amqp)
                .env("INBOX_PREFIX", &self.prefix)
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap(),
        ))
    }

    fn producer(&self, events: u64) -> Proc {
        let (out, err) = log_file(self.logs.path(), "producer.log");
        Proc(Some(
            Command::new(example("usage_producer"))
                .env("DATABASE_URL", &self.producer_db)
                .env("AMQP_URL", &self.amqp)
                .env("INBOX_PREFIX", &self.prefix)
                .env("USAGE_EVENTS", events.to_string())
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap(),
        ))
    }

    fn db(&self) -> Db {
        Db {
            url: self.producer_db.clone(),
            conn: None,
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.path().join(name)).unwrap_or_default()
    }
}

/// The schema's URL: its search path and an `application_name` of its own.
fn schema_url(base: &str, schema: &str, app: &str) -> String {
    let url = inbox_test_support::search_path_url(base, schema);
    format!("{url}&application_name={app}")
}

/// What the chaos did, for the report.
#[derive(Debug, Default)]
struct Tally {
    consumer_kills: u64,
    kills_skipped: u64,
    backends_terminated: i64,
    cuts: u64,
    freezes: u64,
    stalls: u64,
    refusals: u64,
}

/// Waits until the consumer has declared its queue and created its table.
fn wait_ready(db: &mut Db, proxy_rt: &tokio::runtime::Runtime, amqp: &str, queue: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let table = db.count(
            "SELECT COUNT(*)::bigint AS n FROM pg_tables \
             WHERE schemaname = current_schema() AND tablename = 'daily_usage'",
        );
        let declared = proxy_rt.block_on(async {
            let Ok(conn) =
                lapin::Connection::connect(amqp, lapin::ConnectionProperties::default()).await
            else {
                return false;
            };
            let Ok(channel) = conn.create_channel().await else {
                return false;
            };
            let ok = channel
                .queue_declare(
                    queue.into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .is_ok();
            let _ = conn.close(200, "checked".into()).await;
            ok
        });
        if table == 1 && declared {
            // The binding follows the declaration at once.
            std::thread::sleep(Duration::from_millis(300));
            return;
        }
        assert!(Instant::now() < deadline, "the consumer did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Producer rounds until `stop`: each writes `events` ledger rows and relays them;
/// every second round's relay is killed with SIGKILL mid-publish: once the consumer has
/// claimed some of the round's events and before the relay has marked them all
/// published (its leases expire and a later round publishes them again).
fn produce(scene: &Scene, stop: &AtomicBool, relay_kills: &AtomicU64, events: u64) {
    let mut db = scene.db();
    let mut round = 0u64;
    let rows = |db: &mut Db| {
        let exists = db.count(
            "SELECT COUNT(*)::bigint AS n FROM pg_tables \
             WHERE schemaname = current_schema() AND tablename = 'usage_ledger'",
        );
        if exists == 1 {
            db.count("SELECT COUNT(*)::bigint AS n FROM usage_ledger")
        } else {
            0
        }
    };
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let written_before = rows(&mut db);
        let mut producer = scene.producer(events);
        let kill = round.is_multiple_of(2);
        loop {
            let child = producer.0.as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "{}", scene.log("producer.log"));
                break;
            }
            // Mid-publish: some of this round's events have reached the consumer
            // through the broker, and the relay has not marked them all published.
            let relayed = |db: &mut Db| {
                db.count("SELECT COUNT(*)::bigint AS n FROM inbox_claims") > written_before
                    && db.count(
                        "SELECT COUNT(*)::bigint AS n FROM outbox_messages \
                         WHERE published_at IS NULL",
                    ) > 0
            };
            if kill && rows(&mut db) >= written_before + events as i64 && relayed(&mut db) {
                child.kill().unwrap();
                child.wait().unwrap();
                relay_kills.fetch_add(1, Ordering::SeqCst);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        producer.0 = None;
    }
}

#[test]
fn the_example_processes_under_chaos_end_with_the_projection_exact() {
    let Some((base, amqp)) = services() else {
        return;
    };
    let started = Instant::now();
    let id = inbox_test_support::unique_name("chaos");
    // application_name holds 63 bytes; the unique name is shorter.
    let app = format!("{id}_c");
    let schema = id.clone();
    PgConnection::establish(&base)
        .unwrap()
        .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt.block_on(Proxy::start(host_port(&amqp)));
    let scene = Scene {
        base: base.clone(),
        schema: schema.clone(),
        consumer_db: schema_url(&base, &schema, &app),
        producer_db: schema_url(&base, &schema, &format!("{id}_p")),
        prefix: format!("{id}."),
        consumer_amqp: format!("{}?heartbeat=2", proxy.url_for(&amqp)),
        amqp: amqp.clone(),
        logs: tempfile::tempdir().unwrap(),
    };
    let topology = inbox_test_support::amqp::usage_consumer_topology(&scene.prefix);
    let queue = topology.queue(&inbox_core::ConsumerGroup::new("billing.daily-usage").unwrap());
    // The queues go whatever the outcome, after the programs (declared before them).
    let _topology = inbox_test_support::amqp::DeleteOnDrop::new(amqp.clone(), topology);

    let mut db = scene.db();
    let mut consumer = scene.consumer();
    wait_ready(&mut db, &rt, &amqp, &queue);

    let stop = AtomicBool::new(false);
    let relay_kills = AtomicU64::new(0);
    let mut tally = Tally::default();
    let chaos = Duration::from_secs(chaos_seconds());
    std::thread::scope(|s| {
        let producing = s.spawn(|| produce(&scene, &stop, &relay_kills, 400));
        let until = Instant::now() + chaos;
        let mut at_restart = db.projected();
        let mut step = 0u64;
        let mut kill_pending = false;
        // At least the chaos time, and on until the kills the test promises have
        // happened (a loaded machine skips more of them), within a hard bound.
        let hard_limit = until + Duration::from_secs(150);
        let promised =
            |tally: &Tally| tally.consumer_kills >= 3 && relay_kills.load(Ordering::SeqCst) >= 1;
        while !producing.is_finished()
            && Instant::now() < hard_limit
            && (Instant::now() < until || !promised(&tally))
        {
            std::thread::sleep(Duration::from_millis(700 + (step * 173) % 900));
            step += 1;
            let action = if kill_pending { 0 } else { step % 6 };
            match action {
                0 | 3 => {
                    // A kill only once the process has acked work beyond what it was
                    // redelivered, and no claim holds an unfinished start: each kill
                    // then costs any message at most one start, and the crash-loop rule
                    // rightly stays silent.
                    let advanced = db.projected() > at_restart;
                    let started = db.count(
                        "SELECT COUNT(*)::bigint AS n FROM inbox_claims WHERE status = 'started'",
                    );
                    if advanced && started == 0 {
                        kill_and_restart(&mut consumer, &scene);
                        at_restart = db.projected();
                        tally.consumer_kills += 1;
                        kill_pending = false;
                    } else {
                        // Tried again at the next step.
                        tally.kills_skipped += 1;
                        kill_pending = true;
                    }
                }
                1 => {
                    tally.backends_terminated += db.count(&format!(
                        "SELECT COUNT(*)::bigint AS n FROM (SELECT pg_terminate_backend(pid) \
                         FROM pg_stat_activity WHERE application_name = '{app}') t"
                    ));
                }
                2 => {
                    proxy.cut();
                    tally.cuts += 1;
                }
                4 => {
                    // A partition: both ways silent until the heartbeats notice.
                    proxy.freeze();
                    tally.freezes += 1;
                    std::thread::sleep(Duration::from_secs(5));
                    proxy.cut();
                }
                _ => {
                    if step % 12 == 5 {
                        // New connections accepted and never answered, then released.
                        proxy.stall(true);
                        proxy.cut();
                        std::thread::sleep(Duration::from_secs(2));
                        proxy.stall(false);
                        proxy.cut();
                        tally.stalls += 1;
                    } else {
                        rt.block_on(proxy.cut_refusing_for(Duration::from_secs(1)));
                        tally.refusals += 1;
                    }
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
        producing.join().unwrap();
    });
    let chaos_took = started.elapsed();

    // The rest of the outbox, once the killed relays' leases expire (30 s).
    let mut drain = scene.producer(0);
    let status = drain.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "{}", scene.log("producer.log"));
    let ledger = db.count("SELECT COALESCE(SUM(amount), 0)::bigint AS n FROM usage_ledger");
    let events = db.count("SELECT COUNT(*)::bigint AS n FROM usage_ledger");
    let unpublished =
        db.count("SELECT COUNT(*)::bigint AS n FROM outbox_messages WHERE published_at IS NULL");
    assert_eq!(unpublished, 0, "the relay left rows behind");
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline && db.projected() != ledger {
        std::thread::sleep(Duration::from_millis(200));
    }
    let mismatches = db.lines(MISMATCHES);
    let dead = db.lines(
        "SELECT format('%s %s: %s', message_key, reason, last_error) AS line \
         FROM inbox_dead_letters ORDER BY id",
    );
    let claims = db.count("SELECT COUNT(*)::bigint AS n FROM inbox_claims WHERE status = 'done'");

    let report = format!(
        "{events} events ({ledger} units), {claims} done claims, {} relay kills, {tally:?}; \
         chaos for {chaos:?}, {:?} in all",
        relay_kills.load(Ordering::SeqCst),
        started.elapsed(),
    );
    eprintln!("chaos: {report} (chaos phase {chaos_took:?})");
    assert!(
        mismatches.is_empty() && dead.is_empty() && claims == events,
        "{report}\nmismatches: {mismatches:#?}\ndead letters: {dead:#?}\nconsumer log:\n{}",
        scene.log("consumer.log")
    );
    assert!(tally.consumer_kills >= 3, "{report}");
    assert!(relay_kills.load(Ordering::SeqCst) >= 1, "{report}");

    // It still stops gracefully.
    let child = consumer.0.take().unwrap();
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", scene.log("consumer.log"));

    let _ = PgConnection::establish(&scene.base).map(|mut c| {
        c.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            scene.schema
        ))
    });
}

/// Kills the consumer with SIGKILL and starts a new one.
fn kill_and_restart(consumer: &mut Proc, scene: &Scene) {
    if let Some(child) = consumer.0.as_mut() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    *consumer = scene.consumer();
}
