//! Projection rebuilds against live consumers: drift healed, rows outside the window
//! untouched, and every interleaving of a live batch and a source row with a rebuild
//! (two connections, a gate inside the rebuild's read), on PostgreSQL and SQLite.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chrono::{Days, NaiveDate, Utc};
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use inbox_core::{
    ClaimKey, ConsumerGroup, Decision, Envelope, Handler, HandlerError, HookError, MessageContext,
    ProjectionLock, Rebuild, RetryPolicy, SourceEvent,
};
use inbox_diesel::{ClaimStatus, Error, Store, StoreBuilder, StoreConnection};
use inbox_examples::usage::{
    ledger_event_key, quick_policy, DailyTotal, DailyUsage, UsageDb, UsageRecorded, GROUP,
    PROJECTION,
};
use inbox_test_support::{Fixture, PgFixture, SqliteFixture};

// ---------------------------------------------------------------------------------
// A gate the tests stop the rebuild (or a live batch) at.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// The rebuild holds the lock and is about to read the source.
    BeforeRead,
    /// The rebuild has read the source (still holding the lock, nothing written).
    AfterRead,
    /// A live batch has claimed and is about to apply (holding the lock shared).
    Live,
}

#[derive(Default)]
struct Gate {
    armed: Mutex<Option<Stage>>,
    reached: Mutex<bool>,
    reached_cv: Condvar,
    open: Mutex<bool>,
    open_cv: Condvar,
}

impl Gate {
    fn arm(&self, stage: Stage) {
        *self.armed.lock().unwrap() = Some(stage);
    }

    /// Stops the caller at `stage` once, if armed for it, until the test opens it.
    fn pass(&self, stage: Stage) {
        {
            let mut armed = self.armed.lock().unwrap();
            if *armed != Some(stage) {
                return;
            }
            *armed = None;
        }
        *self.reached.lock().unwrap() = true;
        self.reached_cv.notify_all();
        let open = self.open.lock().unwrap();
        let _unused = self
            .open_cv
            .wait_timeout_while(open, Duration::from_secs(30), |open| !*open)
            .unwrap();
    }

    fn wait_reached(&self) {
        let reached = self.reached.lock().unwrap();
        let (reached, _) = self
            .reached_cv
            .wait_timeout_while(reached, Duration::from_secs(30), |r| !*r)
            .unwrap();
        assert!(*reached, "the gate was never reached");
    }

    fn was_reached(&self) -> bool {
        *self.reached.lock().unwrap()
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.open_cv.notify_all();
    }
}

/// The usage projection with a gate in its rebuild's read and its live path.
struct Gated {
    inner: DailyUsage,
    gate: Arc<Gate>,
    with_lock: bool,
    reads: Arc<AtomicUsize>,
}

impl Gated {
    fn new(gate: &Arc<Gate>) -> Self {
        Self {
            inner: DailyUsage::new(RetryPolicy::default()),
            gate: Arc::clone(gate),
            with_lock: true,
            reads: Arc::default(),
        }
    }
}

impl<C: UsageDb> Handler<C> for Gated {
    type Message = UsageRecorded;

    fn group(&self) -> &ConsumerGroup {
        Handler::<C>::group(&self.inner)
    }

    fn message_type(&self) -> &str {
        Handler::<C>::message_type(&self.inner)
    }

    fn retry_policy(&self) -> RetryPolicy {
        quick_policy()
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: UsageRecorded,
        ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        self.gate.pass(Stage::Live);
        Handler::<C>::handle(&self.inner, conn, msg, ctx)
    }

    fn fold(
        &self,
        conn: &mut C,
        batch: &[(UsageRecorded, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        self.gate.pass(Stage::Live);
        Handler::<C>::fold(&self.inner, conn, batch)
    }

    fn lock(&self) -> Option<ProjectionLock> {
        if self.with_lock {
            Handler::<C>::lock(&self.inner)
        } else {
            None
        }
    }
}

impl<C: UsageDb> Rebuild<C> for Gated {
    type Partition = NaiveDate;
    type Source = (i64, i64);
    type Row = DailyTotal;

    fn projection(&self) -> &str {
        PROJECTION
    }

    fn window(&self, now: chrono::DateTime<Utc>, size: u32) -> Vec<NaiveDate> {
        Rebuild::<C>::window(&self.inner, now, size)
    }

    fn read_source(
        &self,
        conn: &mut C,
        day: &NaiveDate,
    ) -> Result<Vec<SourceEvent<(i64, i64)>>, HookError> {
        self.gate.pass(Stage::BeforeRead);
        let read = Rebuild::<C>::read_source(&self.inner, conn, day);
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.gate.pass(Stage::AfterRead);
        read
    }

    fn recompute(&self, day: &NaiveDate, source: &[SourceEvent<(i64, i64)>]) -> Vec<DailyTotal> {
        Rebuild::<C>::recompute(&self.inner, day, source)
    }

    fn read_projection(&self, conn: &mut C, day: &NaiveDate) -> Result<Vec<DailyTotal>, HookError> {
        Rebuild::<C>::read_projection(&self.inner, conn, day)
    }

    fn replace(&self, conn: &mut C, day: &NaiveDate, rows: &[DailyTotal]) -> Result<(), HookError> {
        Rebuild::<C>::replace(&self.inner, conn, day, rows)
    }
}

// ---------------------------------------------------------------------------------
// Helpers.

fn today() -> NaiveDate {
    Utc::now().date_naive()
}

fn days_ago(n: u64) -> NaiveDate {
    today().checked_sub_days(Days::new(n)).unwrap()
}

fn group() -> ConsumerGroup {
    ConsumerGroup::new(GROUP).unwrap()
}

/// A ledger row written and committed (as the producer's business transaction does).
#[derive(Clone, Copy, Debug)]
struct Event {
    id: i64,
    user_id: i64,
    day: NaiveDate,
    amount: i64,
}

impl Event {
    fn envelope(&self) -> Envelope {
        UsageRecorded {
            user_id: self.user_id,
            day: self.day,
            amount: self.amount,
        }
        .envelope(ledger_event_key(self.id))
    }

    fn claim_key(&self) -> ClaimKey {
        ClaimKey::new(group(), ledger_event_key(self.id))
    }
}

fn write<C: StoreConnection + UsageDb>(
    store: &Store<C>,
    user_id: i64,
    day: NaiveDate,
    amount: i64,
) -> Event {
    let id = store
        .connection()
        .unwrap()
        .insert_ledger(user_id, day, amount)
        .unwrap();
    Event {
        id,
        user_id,
        day,
        amount,
    }
}

fn setup<C: StoreConnection + UsageDb>(builder: StoreBuilder<C>, projection: Gated) -> Store<C> {
    let store = builder.projection(projection).build().unwrap();
    let mut conn = store.connection().unwrap();
    conn.create_daily_usage().unwrap();
    conn.create_usage_ledger().unwrap();
    store
}

fn deliver<C: StoreConnection>(store: &Store<C>, events: &[Event]) -> Vec<Decision> {
    let batch: Vec<Envelope> = events.iter().map(Event::envelope).collect();
    store.process_batch(&group(), &batch).unwrap()
}

fn deliver_in_thread<C: StoreConnection>(
    store: &Store<C>,
    events: &[Event],
) -> JoinHandle<Vec<Decision>> {
    let store = store.clone();
    let events = events.to_vec();
    std::thread::spawn(move || deliver(&store, &events))
}

/// Whether `thread` finishes within `patience` (it is blocked if not).
fn finishes<T>(thread: &JoinHandle<T>, patience: Duration) -> bool {
    let until = Instant::now() + patience;
    while Instant::now() < until {
        if thread.is_finished() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    thread.is_finished()
}

/// The projection's totals, and the ledger's sums, per (user, day).
fn totals<C: StoreConnection + UsageDb>(
    store: &Store<C>,
) -> std::collections::BTreeMap<(i64, NaiveDate), i64> {
    store.connection().unwrap().daily_totals().unwrap()
}

fn ledger_sums<C: StoreConnection + UsageDb>(
    store: &Store<C>,
    days: &[NaiveDate],
) -> std::collections::BTreeMap<(i64, NaiveDate), i64> {
    let mut sums = std::collections::BTreeMap::new();
    let mut conn = store.connection().unwrap();
    for day in days {
        for row in conn.ledger_of_day(*day).unwrap() {
            *sums.entry((row.user_id, *day)).or_default() += row.amount;
        }
    }
    sums
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// `SELECT COUNT(*) AS n ...` on either backend.
trait Counts {
    fn count(&mut self, sql: &str) -> i64;
}

macro_rules! counts {
    ($conn:ty) => {
        impl Counts for $conn {
            fn count(&mut self, sql: &str) -> i64 {
                diesel::sql_query(sql).get_result::<Count>(self).unwrap().n
            }
        }
    };
}
counts!(diesel::PgConnection);
counts!(diesel::SqliteConnection);

// ---------------------------------------------------------------------------------
// Must show: inflate, audit (drift, nothing written), rebuild (healed), audit (no
// drift); rows outside the window untouched.

fn drift_is_audited_then_healed_inside_the_window_only<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    let gate = Arc::new(Gate::default());
    let store = setup(fx.builder(), Gated::new(&gate));
    // Three days in the window, one outside it, every event applied live.
    let mut events = Vec::new();
    for (i, day) in [days_ago(0), days_ago(1), days_ago(2), days_ago(5)]
        .into_iter()
        .enumerate()
    {
        for user in 1..=4 {
            events.push(write(&store, user, day, 10 * (i as i64 + 1) + user));
        }
    }
    for chunk in events.chunks(5) {
        assert!(deliver(&store, chunk)
            .iter()
            .all(|d| *d == Decision::Processed));
    }
    let healthy = totals(&store);
    // A past bug re-applied events, an operator edited a row: inflate some rows, in
    // the window and outside it, and put a row the ledger has no event for.
    fx.execute(&format!(
        "UPDATE daily_usage SET total = total * 24 / 10 WHERE user_id = 1 AND day = '{}';
         UPDATE daily_usage SET total = total + 7 WHERE user_id = 2 AND day = '{}';
         INSERT INTO daily_usage (user_id, day, total) VALUES (99, '{}', 5);
         UPDATE daily_usage SET total = total * 3 WHERE user_id = 3 AND day = '{}';",
        days_ago(0),
        days_ago(2),
        days_ago(1),
        days_ago(5)
    ));
    let inflated = totals(&store);

    let rebuilder = store.rebuilder(PROJECTION).unwrap();
    let audit = rebuilder.audit(3).unwrap();
    assert_eq!(audit.partitions, 3);
    assert_eq!(audit.rows_checked, 13, "{audit:?}");
    assert_eq!(audit.rows_differing, 3, "{audit:?}");
    assert_eq!(audit.extra_rows, 1, "{audit:?}");
    let ratio = audit.largest_ratio.unwrap();
    assert!((ratio - 2.4).abs() < 0.05, "{audit:?}");
    assert_eq!(audit.sample.len(), 3);
    assert_eq!(totals(&store), inflated, "an audit writes nothing");

    let rebuilt = rebuilder.rebuild(3).unwrap();
    assert_eq!(rebuilt.partitions, 3);
    assert_eq!(rebuilt.rows_changed, 3, "{rebuilt:?}");
    assert_eq!(rebuilt.events_covered, 12, "{rebuilt:?}");
    // Every event of the window was applied live: its `done` claim stays as it is.
    assert_eq!(rebuilt.claims_recorded, 0, "{rebuilt:?}");

    let after = totals(&store);
    for ((user, day), total) in &after {
        if *day == days_ago(5) {
            assert_eq!(
                Some(total),
                inflated.get(&(*user, *day)),
                "outside the window"
            );
        } else {
            assert_eq!(
                Some(total),
                healthy.get(&(*user, *day)),
                "user {user} on {day}"
            );
        }
    }
    assert!(
        !after.contains_key(&(99, days_ago(1))),
        "the extra row is gone"
    );
    assert_eq!(
        after.get(&(3, days_ago(5))),
        Some(&(3 * healthy[&(3, days_ago(5))])),
        "rows outside the window are never touched"
    );

    let again = rebuilder.audit(3).unwrap();
    assert_eq!(again.rows_differing, 0, "{again:?}");
    assert_eq!(again.extra_rows, 0);
    assert_eq!(again.largest_ratio, Some(1.0));
    // A wider audit still sees the row outside the window.
    assert_eq!(rebuilder.audit(6).unwrap().rows_differing, 1);
}

/// The precondition, checked: a rebuild covers exactly the keys the producer gives
/// the events, so delivering every event of the ledger afterwards applies nothing.
fn after_a_rebuild_every_event_of_the_ledger_is_a_duplicate<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    let gate = Arc::new(Gate::default());
    let store = setup(fx.builder(), Gated::new(&gate));
    let mut events = Vec::new();
    for i in 0..30 {
        events.push(write(&store, 1 + i % 5, days_ago((i % 2) as u64), 1 + i));
    }
    // A few were applied live before the rebuild, the rest not yet.
    deliver(&store, &events[..7]);
    let report = store.rebuilder(PROJECTION).unwrap().rebuild(2).unwrap();
    let expected = ledger_sums(&store, &[days_ago(0), days_ago(1)]);
    for chunk in events.chunks(4) {
        let decisions = deliver(&store, chunk);
        assert!(
            decisions.iter().all(|d| *d == Decision::Duplicate),
            "{decisions:?}"
        );
    }
    assert_eq!(totals(&store), expected);
    assert_eq!(report.events_covered, 30);
    assert_eq!(report.claims_recorded, 23);
}

/// `failed` and `started` claims of covered events become done and covered (their
/// retry is a duplicate); a `dead` one becomes covered and its dead letter resolved.
fn failed_started_and_dead_claims_are_taken_over<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    let gate = Arc::new(Gate::default());
    let store = setup(fx.builder(), Gated::new(&gate));
    // User 0 does not exist for the live handler: its events fail, then die.
    let failed = write(&store, 0, days_ago(0), 5);
    let dead = write(&store, 0, days_ago(0), 6);
    let started = write(&store, 3, days_ago(0), 7);
    let done = write(&store, 4, days_ago(0), 8);
    assert!(matches!(
        deliver(&store, &[failed])[0],
        Decision::RetryAfter(_)
    ));
    loop {
        let d = deliver(&store, &[dead]);
        match &d[0] {
            Decision::RetryAfter(wait) => std::thread::sleep(*wait),
            Decision::DeadLettered(_) => break,
            other => panic!("{other:?}"),
        }
    }
    deliver(&store, &[done]);
    // A redelivered message's start mark whose process died before an outcome.
    fx.execute(&format!(
        "INSERT INTO inbox_claims (consumer_group, message_key, message_type, payload_digest, \
         status, attempts, starts, first_seen_at, updated_at, payload) \
         SELECT consumer_group, '{}', message_type, payload_digest, 'started', 0, 1, \
         first_seen_at, updated_at, payload FROM inbox_claims WHERE message_key = '{}'",
        ledger_event_key(started.id),
        ledger_event_key(failed.id)
    ));
    let done_before = store.claim_record(&done.claim_key()).unwrap().unwrap();

    let report = store.rebuilder(PROJECTION).unwrap().rebuild(1).unwrap();
    assert_eq!(report.events_covered, 4);
    assert_eq!(report.claims_recorded, 0);
    assert_eq!(report.claims_converted, 2, "{report:?}");
    assert_eq!(report.dead_covered, 1, "{report:?}");
    assert_eq!(report.dead_letters_resolved, 1, "{report:?}");

    for e in [failed, started] {
        let claim = store.claim_record(&e.claim_key()).unwrap().unwrap();
        assert_eq!(claim.status, ClaimStatus::Done);
        assert!(!claim.has_payload, "the payload is dropped");
    }
    assert_eq!(
        store
            .claim_record(&dead.claim_key())
            .unwrap()
            .unwrap()
            .status,
        ClaimStatus::Dead
    );
    assert_eq!(
        store.claim_record(&done.claim_key()).unwrap().unwrap(),
        done_before,
        "a done claim stays as it is"
    );
    let mut conn = fx.connect();
    let unresolved =
        conn.count("SELECT COUNT(*) AS n FROM inbox_dead_letters WHERE resolved_at IS NULL");
    assert_eq!(unresolved, 0, "the dead letter is resolved");
    let covered_claims = conn.count(
        "SELECT COUNT(*) AS n FROM inbox_claims WHERE covered_at IS NOT NULL AND length(payload_digest) = 0",
    );
    assert_eq!(
        covered_claims, 3,
        "failed, started and dead are marked covered"
    );

    // Their deliveries count nothing more.
    let before = totals(&store);
    assert_eq!(
        deliver(&store, &[failed, started, done]),
        vec![Decision::Duplicate; 3]
    );
    assert_eq!(
        deliver(&store, &[dead]),
        vec![Decision::AlreadyDeadLettered]
    );
    assert_eq!(totals(&store), before);
    assert_eq!(before, ledger_sums(&store, &[days_ago(0)]));
}

/// A handler with rebuild hooks and no projection lock is refused when the store is
/// built: a rebuild could not exclude its live batches.
fn a_projection_without_a_lock_is_refused_at_build<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    let gate = Arc::new(Gate::default());
    let mut unlocked = Gated::new(&gate);
    unlocked.with_lock = false;
    let err = fx.builder().projection(unlocked).build().unwrap_err();
    assert!(
        matches!(&err, Error::ProjectionWithoutLock { projection, .. } if projection == PROJECTION),
        "{err:?}"
    );
    let err = fx
        .builder()
        .projection(Gated::new(&gate))
        .build()
        .unwrap()
        .rebuilder("weekly_usage")
        .err()
        .unwrap();
    assert!(matches!(err, Error::UnknownProjection { .. }), "{err:?}");
}

/// verify_schema reports each missing rebuild object.
fn missing_rebuild_objects_are_reported<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    let gate = Arc::new(Gate::default());
    let store = setup(fx.builder(), Gated::new(&gate));
    store.verify_schema().unwrap();
    for (sabotage, repair, table) in [
        (
            "ALTER TABLE inbox_claims DROP COLUMN covered_at",
            "ALTER TABLE inbox_claims ADD COLUMN covered_at TEXT",
            "inbox_claims",
        ),
        (
            "ALTER TABLE inbox_dead_letters DROP COLUMN resolved_at",
            "ALTER TABLE inbox_dead_letters ADD COLUMN resolved_at TEXT",
            "inbox_dead_letters",
        ),
        (
            "ALTER TABLE inbox_rebuild_runs RENAME TO inbox_rebuild_runs_old; \
             CREATE TABLE inbox_rebuild_runs (projection TEXT NOT NULL, runner TEXT NOT NULL, \
             leased_until TEXT NOT NULL)",
            "DROP TABLE inbox_rebuild_runs; ALTER TABLE inbox_rebuild_runs_old RENAME TO inbox_rebuild_runs",
            "inbox_rebuild_runs",
        ),
        (
            "ALTER TABLE inbox_rebuild_runs RENAME TO inbox_rebuild_runs_old",
            "ALTER TABLE inbox_rebuild_runs_old RENAME TO inbox_rebuild_runs",
            "inbox_rebuild_runs",
        ),
    ] {
        fx.execute(sabotage);
        let err = store.verify_schema().unwrap_err();
        assert!(
            matches!(&err, Error::RebuildSchemaMismatch { table: t, .. } if t == table),
            "{sabotage}: {err:?}"
        );
        // A store refuses to start on it.
        assert!(fx.builder().projection(Gated::new(&gate)).build().is_err());
        fx.execute(repair);
    }
    store.verify_schema().unwrap();
}

inbox_test_support::on_both_backends!(
    drift_is_audited_then_healed_inside_the_window_only,
    after_a_rebuild_every_event_of_the_ledger_is_a_duplicate,
    failed_started_and_dead_claims_are_taken_over,
    a_projection_without_a_lock_is_refused_at_build,
    missing_rebuild_objects_are_reported,
);

// ---------------------------------------------------------------------------------
// The interleavings of a live batch and a source row with a rebuild, on PostgreSQL:
// two connections (the rebuild's and the live batch's), the rebuild stopped at a gate.

mod interleavings {
    use super::*;
    use diesel::PgConnection;
    use inbox_diesel::{RebuildRunner, RunOutcome};

    struct Scene {
        fx: PgFixture,
        gate: Arc<Gate>,
        reads: Arc<AtomicUsize>,
        store: Store<PgConnection>,
    }

    fn scene() -> Option<Scene> {
        let fx = PgFixture::new()?;
        let gate = Arc::new(Gate::default());
        let projection = Gated::new(&gate);
        let reads = Arc::clone(&projection.reads);
        let store = setup(fx.builder(), projection);
        Some(Scene {
            fx,
            gate,
            reads,
            store,
        })
    }

    fn rebuild_in_thread(
        store: &Store<PgConnection>,
        lock_timeout: Duration,
    ) -> JoinHandle<inbox_diesel::Result<inbox_core::RebuildReport>> {
        let rebuilder = store
            .rebuilder(PROJECTION)
            .unwrap()
            .lock_timeout(lock_timeout);
        std::thread::spawn(move || rebuilder.rebuild(1))
    }

    /// How long a test lets a blocked batch stay blocked before it opens the gate.
    const PATIENCE: Duration = Duration::from_millis(500);

    #[test]
    fn a_live_claim_committed_before_the_rebuild_is_counted_once() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        assert_eq!(deliver(&s.store, &[e]), [Decision::Processed]);
        let claim = s.store.claim_record(&e.claim_key()).unwrap().unwrap();
        let report = s.store.rebuilder(PROJECTION).unwrap().rebuild(1).unwrap();
        assert_eq!((report.rows_changed, report.events_covered), (0, 1));
        assert_eq!(report.claims_recorded, 0);
        assert_eq!(
            s.store.claim_record(&e.claim_key()).unwrap().unwrap(),
            claim
        );
        assert_eq!(deliver(&s.store, &[e]), [Decision::Duplicate]);
        assert_eq!(totals(&s.store), ledger_sums(&s.store, &[today()]));
    }

    #[test]
    fn a_live_batch_waits_for_the_rebuild_then_finds_its_event_covered() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        s.gate.arm(Stage::AfterRead);
        let rebuild = rebuild_in_thread(&s.store, DEFAULT_TIMEOUT);
        s.gate.wait_reached();
        let live = deliver_in_thread(&s.store, &[e]);
        let claimed_during_rebuild = finishes(&live, PATIENCE);
        s.gate.open();
        let report = rebuild.join().unwrap().unwrap();
        let decisions = live.join().unwrap();
        assert!(
            !claimed_during_rebuild,
            "the live batch claimed while the rebuild held the lock: {decisions:?}"
        );
        assert_eq!(
            totals(&s.store),
            ledger_sums(&s.store, &[today()]),
            "counted once: live {decisions:?}"
        );
        assert_eq!(decisions, [Decision::Duplicate]);
        assert_eq!(report.claims_recorded, 1);
    }

    #[test]
    fn a_rebuild_waits_for_a_live_batch_in_flight() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        s.gate.arm(Stage::Live);
        let live = deliver_in_thread(&s.store, &[e]);
        s.gate.wait_reached();
        let rebuild = rebuild_in_thread(&s.store, Duration::from_secs(20));
        let read_beside_the_batch =
            finishes(&rebuild, PATIENCE) || s.reads.load(Ordering::SeqCst) > 0;
        s.gate.open();
        let decisions = live.join().unwrap();
        let report = rebuild.join().unwrap().unwrap();
        assert!(
            !read_beside_the_batch,
            "the rebuild read the source while a live batch held the lock"
        );
        assert_eq!(decisions, [Decision::Processed]);
        assert_eq!(report.lock_waits, 1, "{report:?}");
        assert_eq!(report.claims_recorded, 0);
        assert_eq!(totals(&s.store), ledger_sums(&s.store, &[today()]));
    }

    #[test]
    fn a_source_row_committed_between_lock_and_read_is_counted_and_covered() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        assert_eq!(deliver(&s.store, &[e]), [Decision::Processed]);
        s.gate.arm(Stage::BeforeRead);
        let rebuild = rebuild_in_thread(&s.store, DEFAULT_TIMEOUT);
        s.gate.wait_reached();
        // Committed on another connection while the rebuild holds the lock.
        let f = write(&s.store, 1, today(), 2);
        let live = deliver_in_thread(&s.store, &[f]);
        let claimed_during_rebuild = finishes(&live, PATIENCE);
        s.gate.open();
        let report = rebuild.join().unwrap().unwrap();
        let decisions = live.join().unwrap();
        assert_eq!(
            totals(&s.store)[&(1, today())],
            42,
            "counted once: live {decisions:?}, rebuild {report:?}"
        );
        assert!(!claimed_during_rebuild, "{decisions:?}");
        assert_eq!(decisions, [Decision::Duplicate]);
        assert_eq!(report.events_covered, 2, "{report:?}");
        assert_eq!(report.claims_recorded, 1, "{report:?}");
    }

    #[test]
    fn a_source_row_committed_after_the_read_is_applied_live_after_the_rebuild() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        s.gate.arm(Stage::AfterRead);
        let rebuild = rebuild_in_thread(&s.store, DEFAULT_TIMEOUT);
        s.gate.wait_reached();
        let f = write(&s.store, 1, today(), 2);
        let live = deliver_in_thread(&s.store, &[f]);
        let claimed_during_rebuild = finishes(&live, PATIENCE);
        s.gate.open();
        let report = rebuild.join().unwrap().unwrap();
        let decisions = live.join().unwrap();
        assert_eq!(
            totals(&s.store)[&(1, today())],
            42,
            "each event counted once, none lost: live {decisions:?}, rebuild {report:?}"
        );
        assert!(!claimed_during_rebuild, "{decisions:?}");
        assert_eq!(
            report.events_covered, 1,
            "only the row the read saw: {report:?}"
        );
        assert_eq!(decisions, [Decision::Processed]);
        assert_eq!(deliver(&s.store, &[e]), [Decision::Duplicate]);
        assert_eq!(s.reads.load(Ordering::SeqCst), 1, "one read of the source");
    }

    #[test]
    fn stores_in_different_schemas_never_block_each_other() {
        let Some(a) = scene() else { return };
        let Some(b) = scene() else { return };
        let e = write(&b.store, 1, today(), 40);
        a.gate.arm(Stage::AfterRead);
        let rebuild = rebuild_in_thread(&a.store, DEFAULT_TIMEOUT);
        a.gate.wait_reached();
        let live = deliver_in_thread(&b.store, &[e]);
        let unblocked = finishes(&live, Duration::from_secs(5));
        a.gate.open();
        rebuild.join().unwrap().unwrap();
        assert!(
            unblocked,
            "a rebuild in schema {} blocked a live batch in schema {}",
            a.fx.schema, b.fx.schema
        );
        assert_eq!(live.join().unwrap(), [Decision::Processed]);
        assert_ne!(
            a.store
                .projection_lock_key(&ProjectionLock::named("daily_usage")),
            b.store
                .projection_lock_key(&ProjectionLock::named("daily_usage"))
        );
    }

    #[test]
    fn a_rebuild_retries_its_lock_and_gives_up_after_its_tries() {
        let Some(s) = scene() else { return };
        let e = write(&s.store, 1, today(), 40);
        s.gate.arm(Stage::Live);
        let live = deliver_in_thread(&s.store, &[e]);
        s.gate.wait_reached();
        let err = s
            .store
            .rebuilder(PROJECTION)
            .unwrap()
            .lock_timeout(Duration::from_millis(50))
            .lock_tries(3)
            .retry_pause(Duration::from_millis(10))
            .rebuild(1)
            .unwrap_err();
        assert!(
            matches!(err, Error::LockTimeout { tries: 3, .. }),
            "{err:?}"
        );
        // With tries enough, it gets the lock once the batch has committed.
        let patient = s
            .store
            .rebuilder(PROJECTION)
            .unwrap()
            .lock_timeout(Duration::from_millis(50))
            .retry_pause(Duration::from_millis(10));
        let rebuild = std::thread::spawn(move || patient.rebuild(1));
        std::thread::sleep(Duration::from_millis(300));
        s.gate.open();
        assert_eq!(live.join().unwrap(), [Decision::Processed]);
        let report = rebuild.join().unwrap().unwrap();
        assert!(report.lock_timeouts >= 1, "{report:?}");
        assert_eq!(totals(&s.store), ledger_sums(&s.store, &[today()]));
    }

    #[test]
    fn two_runners_never_rebuild_the_same_projection_at_once() {
        let Some(s) = scene() else { return };
        write(&s.store, 1, today(), 40);
        let runner = |id: &str| {
            RebuildRunner::new(s.store.rebuilder(PROJECTION).unwrap())
                .window(1)
                .runner_id(id)
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (before, after) = (Arc::clone(&seen), Arc::clone(&seen));
        let b = runner("b")
            .before(move |projection, window| {
                before
                    .lock()
                    .unwrap()
                    .push(format!("before {projection} {}", window.len()))
            })
            .after(move |outcome| {
                after.lock().unwrap().push(match outcome {
                    Ok(RunOutcome::Ran(r)) => format!("ran {}", r.events_covered),
                    Ok(RunOutcome::Skipped { holder }) => format!("skipped for {holder}"),
                    Err(e) => format!("failed {e}"),
                })
            });
        s.gate.arm(Stage::BeforeRead);
        let a = runner("a");
        let first = std::thread::spawn(move || a.run_once());
        s.gate.wait_reached();
        let (skipped, captured) = inbox_test_support::metrics::capture(|| b.run_once());
        s.gate.open();
        assert_eq!(
            skipped.unwrap(),
            RunOutcome::Skipped {
                holder: "a".to_owned()
            }
        );
        assert_eq!(
            captured.counter(
                "inbox_rebuild_runs_total",
                &[("projection", PROJECTION), ("outcome", "skipped")]
            ),
            1
        );
        let RunOutcome::Ran(report) = first.join().unwrap().unwrap() else {
            panic!("the first runner did not run")
        };
        assert_eq!(report.claims_recorded, 1);
        // The lease is given up at the end: the next run of b runs.
        let (ran, captured) = inbox_test_support::metrics::capture(|| b.run_once());
        assert!(matches!(ran.unwrap(), RunOutcome::Ran(_)));
        assert_eq!(
            captured.counter(
                "inbox_rebuild_runs_total",
                &[("projection", PROJECTION), ("outcome", "ran")]
            ),
            1
        );
        assert_eq!(
            captured.counter(
                "inbox_rebuild_partitions_total",
                &[("projection", PROJECTION)]
            ),
            1
        );
        assert_eq!(
            captured.counter(
                "inbox_rebuild_events_covered_total",
                &[("projection", PROJECTION)]
            ),
            1
        );
        assert_eq!(
            *seen.lock().unwrap(),
            [
                "before daily_usage 1",
                "skipped for a",
                "before daily_usage 1",
                "ran 1"
            ]
        );
    }

    const DEFAULT_TIMEOUT: Duration = inbox_diesel::DEFAULT_LOCK_TIMEOUT;

    /// On SQLite the single writer gives the same exclusion: the rebuild's write
    /// transaction keeps a live batch from claiming until it commits.
    #[test]
    fn on_sqlite_the_single_writer_excludes_live_batches_from_a_rebuild() {
        let fx = SqliteFixture::new();
        let gate = Arc::new(Gate::default());
        let store = setup(fx.builder(), Gated::new(&gate));
        let e = write(&store, 1, today(), 40);
        gate.arm(Stage::AfterRead);
        let rebuilder = store.rebuilder(PROJECTION).unwrap();
        let rebuild = std::thread::spawn(move || rebuilder.rebuild(1));
        gate.wait_reached();
        let live = deliver_in_thread(&store, &[e]);
        let claimed_during_rebuild = finishes(&live, PATIENCE);
        gate.open();
        let report = rebuild.join().unwrap().unwrap();
        let decisions = live.join().unwrap();
        assert!(!claimed_during_rebuild, "{decisions:?}");
        assert_eq!(
            totals(&store),
            ledger_sums(&store, &[today()]),
            "counted once: live {decisions:?}"
        );
        assert_eq!(decisions, [Decision::Duplicate]);
        assert_eq!(report.claims_recorded, 1);
        assert!(gate.was_reached());
    }
}
