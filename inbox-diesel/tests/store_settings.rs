//! Settings at their edges, against real PostgreSQL and SQLite: every duration, window
//! and count a user sets either is refused when it is set (or when the store is built,
//! before it connects) with `InvalidSetting`, or saturates to a documented bound: a
//! window reaching before year 1 keeps everything ("for ever"), a lease or a retry
//! ending after year 9999 ends there, a timeout past what PostgreSQL takes (2^31 - 1
//! ms) waits that long. Never a database error later.
//!
//! Also: a retry's remaining wait after the clock stepped back is at most
//! `MAX_RETRY_DELAY`, and an application's setup SQL given to the builder runs under
//! the migration lock, so two processes starting at once on a fresh schema both start.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{NaiveDate, TimeDelta};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::idempotency::{IdempotencyAnswer, IdempotencyKey, RequestFields};
use inbox_core::rebuild::{HookError, ProjectionRow, Rebuild, SourceEvent};
use inbox_core::{
    ConsumerGroup, Decision, ErrorChain, Handler, HandlerError, ManualClock, MessageContext,
    ProjectionLock, LATEST_STORED_TIME, MAX_DATABASE_TIMEOUT, MAX_RETRY_DELAY,
};
use inbox_diesel::idempotency::{begin_request, NewRequest};
use inbox_diesel::operator::DeadLetterFilter;
use inbox_diesel::operator::Operator;
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::rebuild::{RebuildRunner, RunOutcome, MAX_REBUILD_WINDOW};
use inbox_diesel::{Retention, Store, MIGRATION_LOCK_CLASS};
use inbox_test_support::{
    claim_key, rejected_setting, start_time, unique_name, usage, Fixture, Outcome, PgFixture,
    Recorder, SqliteFixture, TestConn,
};

const GROUP: &str = "billing.daily-usage";

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// 10,000 years: "keep for ever" as an operator writes it (`--done-claims 3650000d`).
fn ten_thousand_years() -> Duration {
    secs(10_000 * 365 * 86_400)
}

/// 2^31 ms: one past the longest timeout PostgreSQL takes.
fn two_pow_31_ms() -> Duration {
    Duration::from_millis(1 << 31)
}

inbox_test_support::on_both_backends!(
    a_retention_of_ten_thousand_years_keeps_everything_and_purges_nothing,
    a_retention_of_zero_purges_every_done_claim,
    store_timeouts_past_what_postgres_takes_are_refused_before_connecting,
    a_rebuild_lock_timeout_past_what_postgres_takes_waits_the_longest_it_can,
    a_retry_after_the_clock_stepped_back_waits_at_most_the_longest_retry_delay,
    a_retry_ending_after_year_9999_is_stored_as_ending_then,
    a_rebuild_schedule_of_any_length_runs_and_stops,
    a_request_lease_ending_after_year_9999_still_holds_the_key,
    a_dead_letter_filter_reaching_before_year_1_lists_every_letter,
);

fn clocked<F: Fixture>(fx: &F, recorder: Recorder) -> (Store<F::Conn>, ManualClock) {
    let clock = ManualClock::new(start_time());
    let store = fx.open(
        fx.builder()
            .clock(Arc::new(clock.clone()))
            .handler(recorder),
    );
    (store, clock)
}

fn a_retention_of_ten_thousand_years_keeps_everything_and_purges_nothing<F: Fixture>(fx: &F) {
    let (store, clock) = clocked(fx, Recorder::new(GROUP));
    let group = ConsumerGroup::new(GROUP).unwrap();
    assert_eq!(
        store.process_batch(&group, &[usage("k-1", 1)]).unwrap(),
        [Decision::Processed]
    );
    clock.advance(secs(86_400));
    for window in [ten_thousand_years(), Duration::MAX] {
        let retention = Retention::new(window, window, secs(600)).unwrap();
        let counted = Operator::new(&store)
            .count_purgeable(&retention, window)
            .unwrap();
        assert_eq!(counted.done_claims, 0, "{window:?}");
        assert_eq!(counted.published_outbox_rows, 0, "{window:?}");
        assert_eq!(counted.discarded_dead_letters, 0, "{window:?}");
        assert_eq!(store.purge_published(&retention, 1).unwrap(), 0);
        assert_eq!(store.purge_done_claims(&retention, 1).unwrap(), 0);
        assert_eq!(
            Operator::new(&store)
                .purge_discarded_dead_letters(window, 1)
                .unwrap(),
            0
        );
        assert_eq!(
            inbox_diesel::idempotency::purge_expired_requests(&store, window, 1).unwrap(),
            0
        );
    }
    assert!(store
        .claim_record(&claim_key(GROUP, "k-1"))
        .unwrap()
        .is_some());
}

fn a_retention_of_zero_purges_every_done_claim<F: Fixture>(fx: &F) {
    let (store, clock) = clocked(fx, Recorder::new(GROUP));
    let group = ConsumerGroup::new(GROUP).unwrap();
    store
        .process_batch(&group, &[usage("k-1", 1), usage("k-2", 1)])
        .unwrap();
    clock.advance(secs(1));
    let zero = Retention::new(Duration::ZERO, Duration::ZERO, Duration::ZERO).unwrap();
    assert_eq!(
        Operator::new(&store)
            .count_purgeable(&zero, Duration::ZERO)
            .unwrap()
            .done_claims,
        2
    );
    assert_eq!(store.purge_done_claims(&zero, 1).unwrap(), 2);
    assert!(
        store.purge_done_claims(&zero, 0).is_err(),
        "a batch of 0 rows"
    );
}

fn store_timeouts_past_what_postgres_takes_are_refused_before_connecting<F: Fixture>(fx: &F) {
    let refused = |builder: inbox_diesel::StoreBuilder<F::Conn>| match builder.build() {
        Ok(_) => None,
        Err(err) => Some(rejected_setting(&err).unwrap_or_else(|| panic!("{err:?}"))),
    };
    assert_eq!(
        refused(fx.builder().batch_deadline(two_pow_31_ms())),
        Some("batch_deadline")
    );
    assert_eq!(
        refused(fx.builder().batch_deadline(Duration::MAX)),
        Some("batch_deadline")
    );
    assert_eq!(
        refused(fx.builder().batch_deadline(Duration::ZERO)),
        Some("batch_deadline")
    );
    assert_eq!(
        refused(fx.builder().statement_timeout(Duration::ZERO)),
        Some("statement_timeout")
    );
    assert_eq!(refused(fx.builder().pool_size(0)), Some("pool_size"));
    assert_eq!(refused(fx.builder().crash_limit(0)), Some("crash_limit"));
    // The longest PostgreSQL takes, and the shortest: both build and run.
    for (deadline, statement) in [
        (MAX_DATABASE_TIMEOUT, MAX_DATABASE_TIMEOUT),
        (Duration::from_millis(1), Duration::from_millis(1)),
    ] {
        let store = fx
            .builder()
            .batch_deadline(deadline)
            .statement_timeout(statement)
            .pool_size(1)
            .crash_limit(u32::MAX)
            .transaction_retries(u32::MAX)
            .build()
            .unwrap();
        if deadline == MAX_DATABASE_TIMEOUT {
            // (A 1 ms statement timeout cancels the catalog reads: the store runs, and
            // its slower statements fail as they would.)
            store.verify_schema().unwrap();
        }
    }
}

/// A projection with nothing in it: enough for a rebuild to take its lock and lease.
struct Empty {
    group: ConsumerGroup,
}

#[derive(Clone, Debug, PartialEq)]
struct NoRow;

impl ProjectionRow for NoRow {
    fn row_key(&self) -> String {
        String::new()
    }

    fn measure(&self) -> f64 {
        0.0
    }
}

impl<C: TestConn + Send + 'static> Handler<C> for Empty {
    type Message = serde_json::Value;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        "usage.recorded"
    }

    fn lock(&self) -> Option<ProjectionLock> {
        Some(ProjectionLock::named("empty"))
    }

    fn handle(
        &self,
        _: &mut C,
        _: serde_json::Value,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

impl<C: TestConn + Send + 'static> Rebuild<C> for Empty {
    type Partition = NaiveDate;
    type Source = ();
    type Row = NoRow;

    fn projection(&self) -> &str {
        "empty"
    }

    fn window(&self, now: chrono::DateTime<chrono::Utc>, size: u32) -> Vec<NaiveDate> {
        inbox_core::rebuild::days_ending(now, size)
    }

    fn read_source(&self, _: &mut C, _: &NaiveDate) -> Result<Vec<SourceEvent<()>>, HookError> {
        Ok(Vec::new())
    }

    fn recompute(&self, _: &NaiveDate, _: &[SourceEvent<()>]) -> Vec<NoRow> {
        Vec::new()
    }

    fn read_projection(&self, _: &mut C, _: &NaiveDate) -> Result<Vec<NoRow>, HookError> {
        Ok(Vec::new())
    }

    fn replace(&self, _: &mut C, _: &NaiveDate, _: &[NoRow]) -> Result<(), HookError> {
        Ok(())
    }
}

fn with_projection<F: Fixture>(fx: &F) -> Store<F::Conn>
where
    Empty: Rebuild<F::Conn>,
{
    fx.open(fx.builder().projection(Empty {
        group: ConsumerGroup::new(GROUP).unwrap(),
    }))
}

fn a_rebuild_lock_timeout_past_what_postgres_takes_waits_the_longest_it_can<F: Fixture>(fx: &F)
where
    Empty: Rebuild<F::Conn>,
{
    let store = with_projection(fx);
    for timeout in [
        Duration::ZERO,
        Duration::from_millis(1),
        MAX_DATABASE_TIMEOUT,
        two_pow_31_ms(),
        Duration::MAX,
    ] {
        let rebuilder = Rebuilder::new(&store, "empty")
            .unwrap()
            .lock_timeout(timeout)
            .lock_tries(0)
            .retry_pause(Duration::MAX);
        let report = rebuilder.rebuild(1);
        assert!(report.is_ok(), "lock_timeout {timeout:?}: {report:?}");
    }
    // The window: 1 to MAX_REBUILD_WINDOW partitions (`--days`), refused otherwise
    // before anything is read.
    let rebuilder = Rebuilder::new(&store, "empty").unwrap();
    assert_eq!(rebuilder.window(1).unwrap().len(), 1);
    assert_eq!(
        rebuilder.window(MAX_REBUILD_WINDOW).unwrap().len(),
        MAX_REBUILD_WINDOW as usize
    );
    for size in [0, MAX_REBUILD_WINDOW + 1, u32::MAX] {
        let err = rebuilder.audit(size).unwrap_err();
        assert_eq!(rejected_setting(&err), Some("days"), "{size}: {err:?}");
    }
}

fn a_retry_after_the_clock_stepped_back_waits_at_most_the_longest_retry_delay<F: Fixture>(fx: &F) {
    let recorder =
        Recorder::new(GROUP).behaviour(|_, _| Outcome::RetryAfter(Duration::from_secs(30)));
    let (store, clock) = clocked(fx, recorder);
    let group = ConsumerGroup::new(GROUP).unwrap();
    let first = store.process_batch(&group, &[usage("k-1", 1)]).unwrap();
    assert_eq!(first, [Decision::RetryAfter(secs(30))]);
    // An NTP step back by two years: the stored retry is now two years away.
    clock.set(start_time() - TimeDelta::days(2 * 366));
    let again = store
        .process_batch(&group, &[usage("k-1", 1).redelivered()])
        .unwrap();
    match again.as_slice() {
        [Decision::RetryAfter(wait)] => assert!(
            *wait <= MAX_RETRY_DELAY,
            "a retry {wait:?} away, past MAX_RETRY_DELAY ({MAX_RETRY_DELAY:?})"
        ),
        other => panic!("expected a retry, found {other:?}"),
    }
}

fn a_retry_ending_after_year_9999_is_stored_as_ending_then<F: Fixture>(fx: &F) {
    let recorder = Recorder::new(GROUP).behaviour(|_, _| Outcome::RetryAfter(MAX_RETRY_DELAY));
    let (store, clock) = clocked(fx, recorder);
    // A clock set (by mistake, or by an attacker) to the last day the stores hold.
    clock.set(LATEST_STORED_TIME - TimeDelta::days(1));
    let group = ConsumerGroup::new(GROUP).unwrap();
    store.process_batch(&group, &[usage("k-1", 1)]).unwrap();
    let record = store
        .claim_record(&claim_key(GROUP, "k-1"))
        .unwrap()
        .unwrap();
    assert_eq!(record.next_attempt_at, Some(LATEST_STORED_TIME));
}

fn a_rebuild_schedule_of_any_length_runs_and_stops<F: Fixture>(fx: &F)
where
    Empty: Rebuild<F::Conn>,
{
    let store = with_projection(fx);
    for (every, lease) in [
        (Duration::ZERO, Duration::ZERO),
        (Duration::from_millis(1), Duration::from_millis(1)),
        (Duration::MAX, Duration::MAX),
    ] {
        let stop = Arc::new(AtomicBool::new(false));
        let ran = Arc::new(AtomicBool::new(false));
        let (stop_after, ran_after) = (Arc::clone(&stop), Arc::clone(&ran));
        let runner = RebuildRunner::new(Rebuilder::new(&store, "empty").unwrap())
            .every(every)
            .lease(lease)
            .window(1)
            .after(move |outcome| {
                ran_after.store(matches!(outcome, Ok(RunOutcome::Ran(_))), Ordering::SeqCst);
                stop_after.store(true, Ordering::SeqCst);
            });
        runner.run(&stop);
        assert!(
            ran.load(Ordering::SeqCst),
            "every {every:?}, lease {lease:?}"
        );
    }
}

fn a_dead_letter_filter_reaching_before_year_1_lists_every_letter<F: Fixture>(fx: &F) {
    let (store, _clock) = clocked(
        fx,
        Recorder::new(GROUP).behaviour(|_, _| Outcome::Permanent),
    );
    let group = ConsumerGroup::new(GROUP).unwrap();
    store.process_batch(&group, &[usage("k-1", 1)]).unwrap();
    let now = start_time();
    // `dead-letters list --since 3650000d` (10,000 years ago) and `--until` as far ahead.
    let filter = DeadLetterFilter::default()
        .since(now - TimeDelta::days(10_000 * 366))
        .until(chrono::DateTime::<chrono::Utc>::MAX_UTC);
    assert_eq!(
        Operator::new(&store)
            .list_dead_letters(&filter, 0, 10)
            .unwrap()
            .len(),
        1
    );
    // Paging at its edges: `--offset` and `--limit` saturate, 0 lists nothing.
    assert_eq!(
        Operator::new(&store)
            .list_dead_letters(&filter, 0, 1)
            .unwrap()
            .len(),
        1
    );
    assert!(Operator::new(&store)
        .list_dead_letters(&filter, 0, 0)
        .unwrap()
        .is_empty());
    assert_eq!(
        Operator::new(&store)
            .list_dead_letters(&filter, 0, usize::MAX)
            .unwrap()
            .len(),
        1
    );
    assert!(Operator::new(&store)
        .list_dead_letters(&filter, usize::MAX, usize::MAX)
        .unwrap()
        .is_empty());
}

fn a_request_lease_ending_after_year_9999_still_holds_the_key<F: Fixture>(fx: &F) {
    let store = fx.builder().build().unwrap();
    let key = IdempotencyKey::new("req-1").unwrap();
    let fingerprint = RequestFields::new()
        .field("text", "hello")
        .unwrap()
        .fingerprint(b"secret");
    let now = start_time();
    // A deadline far past what the stores hold (a caller's "no deadline").
    let begin = |at| {
        let request = NewRequest {
            caller: "acct-1",
            key: &key,
            fingerprint: &fingerprint,
            lease_until: chrono::DateTime::<chrono::Utc>::MAX_UTC,
        };
        begin_request(&mut *store.connection().unwrap(), &request, at).unwrap()
    };
    assert!(matches!(begin(now), IdempotencyAnswer::Execute { .. }));
    // A day later the lease still holds: the request is in flight, never run twice.
    let again = begin(now + TimeDelta::days(1));
    assert!(
        !matches!(again, IdempotencyAnswer::Execute { .. }),
        "a second execution: {again:?}"
    );
    let record = inbox_diesel::idempotency::request_record(&store, "acct-1", &key)
        .unwrap()
        .unwrap();
    assert_eq!(record.lease_until, LATEST_STORED_TIME);
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Builds a store with the application's setup (two tables, as the usage example has),
/// its connections named `app`.
fn start_with_setup(fx: &PgFixture, app: &str) -> inbox_diesel::Result<Store<PgConnection>> {
    let url = format!("{}?application_name={app}", fx.url());
    Store::<PgConnection>::builder(url)
        .schema(fx.schema.clone())
        .setup(|conn: &mut PgConnection| {
            conn.batch_execute(
                "CREATE TABLE IF NOT EXISTS app_totals (user_id BIGINT NOT NULL, day DATE NOT NULL, \
                 total BIGINT NOT NULL, PRIMARY KEY (user_id, day)); \
                 CREATE TABLE IF NOT EXISTS app_ledger (id BIGSERIAL PRIMARY KEY, \
                 user_id BIGINT NOT NULL, amount BIGINT NOT NULL)",
            )
        })
        .build()
}

/// Two processes of one program start at once on a fresh schema: both wait for the
/// migration lock a third connection holds, then run. Each one's setup SQL runs under
/// the lock, so the second sees the first's tables committed; run outside it, the two
/// `CREATE TABLE IF NOT EXISTS` meet in the catalog and one fails with a unique
/// violation on `pg_type`. SQLite has one writer: each DDL statement takes the write
/// lock and is checked again under it, so the race cannot occur there (the SQLite
/// test below starts two setups at a barrier and sees both start).
#[test]
fn two_setups_started_at_once_on_a_fresh_schema_both_start() {
    for round in 0..5 {
        let Some(fx) = PgFixture::new() else { return };
        let app = unique_name("setup");
        let mut holder = PgConnection::establish(fx.url()).unwrap();
        let lock = |holder: &mut PgConnection, verb: &str| {
            diesel::sql_query(format!("SELECT pg_advisory_{verb}($1, hashtext($2))"))
                .bind::<Integer, _>(MIGRATION_LOCK_CLASS)
                .bind::<Text, _>(&fx.schema)
                .execute(holder)
                .unwrap();
        };
        lock(&mut holder, "lock");
        let started = std::thread::scope(|s| {
            let starts: Vec<_> = (0..2)
                .map(|_| s.spawn(|| start_with_setup(&fx, &app)))
                .collect();
            // Released only once both wait for it.
            loop {
                let waiting: Count = diesel::sql_query(
                    "SELECT count(*) AS n FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event_type = 'Lock'",
                )
                .bind::<Text, _>(&app)
                .get_result(&mut holder)
                .unwrap();
                if waiting.n == 2 {
                    break;
                }
                std::thread::yield_now();
            }
            lock(&mut holder, "unlock");
            starts
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for start in started {
            if let Err(err) = start {
                panic!("round {round}: a start failed: {}", ErrorChain(&err));
            }
        }
    }
}

#[test]
fn two_sqlite_setups_started_at_once_both_start() {
    for round in 0..5 {
        two_sqlite_setups_at_a_barrier(round);
    }
}

fn two_sqlite_setups_at_a_barrier(round: usize) {
    let fx = SqliteFixture::new();
    let barrier = std::sync::Barrier::new(2);
    let started: Vec<_> = std::thread::scope(|s| {
        let starts: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    fx.builder()
                        .setup(|conn: &mut SqliteConnection| {
                            conn.batch_execute(
                                "CREATE TABLE IF NOT EXISTS app_totals (user_id BIGINT NOT NULL, \
                                 day TEXT NOT NULL, total BIGINT NOT NULL, PRIMARY KEY (user_id, day)); \
                                 CREATE TABLE IF NOT EXISTS app_ledger (id INTEGER PRIMARY KEY, \
                                 user_id BIGINT NOT NULL, amount BIGINT NOT NULL)",
                            )
                        })
                        .build()
                })
            })
            .collect();
        starts.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for start in started {
        if let Err(err) = start {
            panic!("round {round}: a start failed: {}", ErrorChain(&err));
        }
    }
}

/// A store of one backend refuses a URL of the other before it connects: a SQLite
/// store never takes `postgres://...` as a file name (and creates nothing), and the
/// error never shows the URL's password.
#[test]
fn a_url_of_the_other_backend_is_refused_before_connecting() {
    let dir = std::env::temp_dir().join(unique_name("other_backend"));
    std::fs::create_dir_all(&dir).unwrap();
    let cwd = std::env::current_dir().unwrap();
    let url = "postgres://app:s3cret@127.0.0.1:1/billing";
    let err = Store::<SqliteConnection>::builder(url).build().unwrap_err();
    assert_eq!(rejected_setting(&err), Some("url"), "{err}");
    assert!(!err.to_string().contains("s3cret"), "{err}");
    assert!(err.to_string().contains("app:***@"), "{err}");
    assert!(!cwd.join("postgres:").exists());
    let sqlite = format!("sqlite://{}", dir.join("x.db").display());
    let err = Store::<PgConnection>::builder(&sqlite).build().unwrap_err();
    assert_eq!(rejected_setting(&err), Some("url"), "{err}");
    assert!(!dir.join("x.db").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    // libpq's key=value strings name no scheme: a PostgreSQL store passes them on (and
    // fails to connect to this closed port, not on the setting).
    let err = Store::<PgConnection>::builder("host=127.0.0.1 port=1 user=app password=s3cret")
        .build()
        .unwrap_err();
    assert_eq!(rejected_setting(&err), None, "{err}");
    // And a file: URL is SQLite's.
    let err = Store::<PgConnection>::builder("file:/tmp/x.db")
        .build()
        .unwrap_err();
    assert_eq!(rejected_setting(&err), Some("url"), "{err}");
}

/// A SQLite store refuses libpq's multi-host forms (the URL and the `key=value`
/// string) before it connects: it creates no file named after them, and the error
/// never shows the password. A PostgreSQL store passes both on to libpq.
#[test]
fn a_sqlite_store_refuses_multi_host_postgres_urls() {
    let dir = std::env::temp_dir().join(unique_name("multi_host"));
    std::fs::create_dir_all(&dir).unwrap();
    let cwd = std::env::current_dir().unwrap();
    for url in [
        "host=127.0.0.1,127.0.0.2 port=1,1 user=app password=s3cret target_session_attrs=read-write",
        "postgres://app:s3cret@127.0.0.1:1,127.0.0.2:1/billing?target_session_attrs=read-write",
    ] {
        let err = Store::<SqliteConnection>::builder(url).build().unwrap_err();
        assert_eq!(rejected_setting(&err), Some("url"), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(!format!("{err:?}").contains("s3cret"), "{err:?}");
        assert!(!cwd.join(url).exists());
        // The PostgreSQL store fails on the closed ports, not on the setting.
        let err = Store::<PgConnection>::builder(url).build().unwrap_err();
        assert_eq!(rejected_setting(&err), None, "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
