//! Projection rebuilds against live consumers: drift healed, rows outside the window
//! untouched, and every interleaving of a live batch and a source row with a rebuild
//! (two connections, a gate inside the rebuild's read), on PostgreSQL and SQLite.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chrono::{Days, NaiveDate, Utc};
use diesel::prelude::*;
use diesel::sql_types::BigInt;
use inbox_core::rebuild::{HookError, Rebuild, SourceEvent};
use inbox_core::{
    ClaimKey, ConsumerGroup, Decision, Envelope, Handler, HandlerError, MessageContext,
    ProjectionLock, RetryPolicy,
};
use inbox_diesel::operator::Operator;
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::{ClaimStatus, Error, Store, StoreBuilder};
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
    /// Once set, user 0 exists: its events (replayed, say) apply.
    healed: Arc<AtomicBool>,
}

impl Gated {
    fn new(gate: &Arc<Gate>) -> Self {
        Self {
            inner: DailyUsage::new(RetryPolicy::default()),
            gate: Arc::clone(gate),
            with_lock: true,
            reads: Arc::default(),
            healed: Arc::default(),
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
        if msg.user_id == 0 && self.healed.load(Ordering::SeqCst) {
            conn.add_usage(msg.user_id, msg.day, msg.amount)?;
            return Ok(());
        }
        Handler::<C>::handle(&self.inner, conn, msg, ctx)
    }

    fn fold(
        &self,
        conn: &mut C,
        batch: &[(UsageRecorded, MessageContext<'_>)],
    ) -> Option<Result<(), HandlerError>> {
        self.gate.pass(Stage::Live);
        if self.healed.load(Ordering::SeqCst) {
            return None;
        }
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

fn write<C: inbox_test_support::FullConnection + UsageDb>(
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

fn setup<C: inbox_test_support::FullConnection + UsageDb>(
    builder: StoreBuilder<C>,
    projection: Gated,
) -> Store<C> {
    let store = builder.projection(projection).build().unwrap();
    let mut conn = store.connection().unwrap();
    conn.create_daily_usage().unwrap();
    conn.create_usage_ledger().unwrap();
    store
}

fn deliver<C: inbox_test_support::FullConnection>(
    store: &Store<C>,
    events: &[Event],
) -> Vec<Decision> {
    let batch: Vec<Envelope> = events.iter().map(Event::envelope).collect();
    store.process_batch(&group(), &batch).unwrap()
}

fn deliver_in_thread<C: inbox_test_support::FullConnection>(
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
fn totals<C: inbox_test_support::FullConnection + UsageDb>(
    store: &Store<C>,
) -> std::collections::BTreeMap<(i64, NaiveDate), i64> {
    store.connection().unwrap().daily_totals().unwrap()
}

fn ledger_sums<C: inbox_test_support::FullConnection + UsageDb>(
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

    let rebuilder = Rebuilder::new(&store, PROJECTION).unwrap();
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
    let report = Rebuilder::new(&store, PROJECTION)
        .unwrap()
        .rebuild(2)
        .unwrap();
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

    let report = Rebuilder::new(&store, PROJECTION)
        .unwrap()
        .rebuild(1)
        .unwrap();
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
    let store = fx.builder().projection(Gated::new(&gate)).build().unwrap();
    let err = Rebuilder::new(&store, "weekly_usage").err().unwrap();
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
            // Schema-qualified, as every schema check names its table.
            matches!(&err, Error::SchemaMismatch { part: inbox_diesel::SchemaPart::Rebuild, table: t, .. }
                if t.rsplit_once('.').map(|(_, bare)| bare) == Some(table)),
            "{sabotage}: {err:?}"
        );
        // A store refuses to start on it.
        assert!(fx.builder().projection(Gated::new(&gate)).build().is_err());
        fx.execute(repair);
    }
    store.verify_schema().unwrap();
}

// ---------------------------------------------------------------------------------
// Operator writes against a rebuild: replay, bulk replay and redrive take no
// projection lock (they cannot know its name), so the cover locks the rows it
// depends on. An event is counted once whichever commits first.

/// Delivers `e` (user 0) until it is dead-lettered.
fn dead_letter<C: inbox_test_support::FullConnection>(store: &Store<C>, e: Event) {
    loop {
        match &deliver(store, &[e])[0] {
            Decision::RetryAfter(wait) => std::thread::sleep(*wait),
            Decision::DeadLettered(_) => return,
            other => panic!("{other:?}"),
        }
    }
}

/// The id of the dead letter of `e`'s key.
fn letter_of<C: inbox_test_support::FullConnection>(store: &Store<C>, e: Event) -> i64 {
    let filter = inbox_diesel::operator::DeadLetterFilter::default()
        .message_key(ledger_event_key(e.id).to_string());
    let letters = Operator::new(store)
        .list_dead_letters(&filter, 0, 10)
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    letters[0].id
}

/// The letter's status, as list and JSON name it.
fn letter_status<C: inbox_test_support::FullConnection>(store: &Store<C>, id: i64) -> &'static str {
    Operator::new(store)
        .dead_letter_details(id)
        .unwrap()
        .unwrap()
        .entry
        .status
        .as_str()
}

/// After an operator write and a rebuild, in either order: a replay that enqueued a
/// copy left a claim the copy finds covered (a duplicate); one the rebuild came
/// before it was refused, the letter resolved. The copy is delivered, healed, and
/// the projection counts the event once.
fn settle_and_check<C: inbox_test_support::FullConnection + UsageDb>(
    store: &Store<C>,
    healed: &AtomicBool,
    e: Event,
    letter: i64,
    outcome: &inbox_diesel::operator::ReplayOutcome,
) {
    use inbox_diesel::operator::ReplayOutcome;
    healed.store(true, Ordering::SeqCst);
    let claim = store.claim_record(&e.claim_key()).unwrap().unwrap();
    match outcome {
        ReplayOutcome::Replayed { .. } => {
            // The replay's copy arrives (the same envelope, its key's claim decides).
            let decisions = deliver(store, &[e]);
            assert_eq!(
                totals(store),
                ledger_sums(store, &[today()]),
                "the replay's copy was {decisions:?} after the rebuild summed its event \
                 (claim before the copy: {claim:?})"
            );
            assert_eq!(decisions, [Decision::Duplicate]);
            assert_eq!(
                claim.status,
                ClaimStatus::Done,
                "the rebuild saw the replay's failed claim and covered it: {claim:?}"
            );
            assert_eq!(letter_status(store, letter), "replayed");
        }
        ReplayOutcome::Refused { .. } => {
            assert_eq!(claim.status, ClaimStatus::Dead, "{claim:?}");
            assert_eq!(letter_status(store, letter), "resolved");
            assert_eq!(deliver(store, &[e]), [Decision::AlreadyDeadLettered]);
        }
        other => panic!("the replay answered {other:?}"),
    }
    assert_eq!(
        totals(store),
        ledger_sums(store, &[today()]),
        "the event is counted once (replay: {outcome:?})"
    );
}

/// SQLite has one writer: a replay and a rebuild's cover are never interleaved (each
/// is one `BEGIN IMMEDIATE` transaction), so the two orders are the only cases; on
/// PostgreSQL `operator_writes` forces the interleavings with row locks.
fn a_replay_before_or_after_a_rebuild_counts_its_event_once<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb,
{
    let gate = Arc::new(Gate::default());
    let projection = Gated::new(&gate);
    let healed = Arc::clone(&projection.healed);
    let store = setup(fx.builder(), projection);
    let before = write(&store, 0, today(), 5);
    let after = write(&store, 0, today(), 6);
    dead_letter(&store, before);
    dead_letter(&store, after);
    let target = inbox_diesel::operator::ReplayTarget::default();
    // Replayed before the rebuild: the rebuild covers the replay's failed claim.
    let first = letter_of(&store, before);
    let replayed = Operator::new(&store)
        .replay_dead_letter(first, &target)
        .unwrap();
    assert!(
        matches!(
            replayed,
            inbox_diesel::operator::ReplayOutcome::Replayed { .. }
        ),
        "{replayed:?}"
    );
    let report = Rebuilder::new(&store, PROJECTION)
        .unwrap()
        .rebuild(1)
        .unwrap();
    assert_eq!((report.claims_converted, report.dead_covered), (1, 1));
    // Replayed after: refused, the letter resolved; bulk replay refuses it too.
    let second = letter_of(&store, after);
    assert_eq!(letter_status(&store, second), "resolved");
    let details = Operator::new(&store)
        .dead_letter_details(second)
        .unwrap()
        .unwrap();
    assert!(details.replay_refusal.is_some(), "{details:?}");
    let bulk = Operator::new(&store)
        .replay_dead_letters(
            &inbox_diesel::operator::DeadLetterFilter::default()
                .message_key(ledger_event_key(after.id).to_string()),
            None,
            &target,
        )
        .unwrap();
    assert_eq!((bulk.affected, bulk.refused), (0, 1), "{bulk:?}");
    let refused = Operator::new(&store)
        .replay_dead_letter(second, &target)
        .unwrap();
    settle_and_check(&store, &healed, before, first, &replayed);
    settle_and_check(&store, &healed, after, second, &refused);
}

inbox_test_support::on_both_backends!(
    drift_is_audited_then_healed_inside_the_window_only,
    after_a_rebuild_every_event_of_the_ledger_is_a_duplicate,
    failed_started_and_dead_claims_are_taken_over,
    a_projection_without_a_lock_is_refused_at_build,
    missing_rebuild_objects_are_reported,
    a_replay_before_or_after_a_rebuild_counts_its_event_once,
    rebuilds_and_audits_leave_reports_ok_or_failed_and_bounded,
);

// ---------------------------------------------------------------------------------
// Stored reports: every rebuild and audit leaves one, ok or failed, read through the
// operator API; a projection keeps its newest 100; a report that cannot be stored
// fails nothing.

fn rebuilds_and_audits_leave_reports_ok_or_failed_and_bounded<F: Fixture>(fx: &F)
where
    F::Conn: UsageDb + Counts,
{
    use inbox_diesel::operator::{RebuildOutcome, RebuildReportKind, KEPT_REBUILD_REPORTS};

    let gate = Arc::new(Gate::default());
    let store = setup(fx.builder(), Gated::new(&gate));
    let mut events = Vec::new();
    for day in [days_ago(0), days_ago(1)] {
        for user in 1..=3 {
            events.push(write(&store, user, day, 10 + user));
        }
    }
    deliver(&store, &events);
    fx.execute(&format!(
        "UPDATE daily_usage SET total = total * 2 WHERE user_id = 1 AND day = '{}'",
        days_ago(0)
    ));
    let operator = Operator::new(&store);
    assert!(operator.rebuild_reports(None, 10).unwrap().is_empty());

    let rebuilder = Rebuilder::new(&store, PROJECTION).unwrap();
    let audit = rebuilder.audit(2).unwrap();
    let rebuilt = rebuilder.rebuild(2).unwrap();
    let reports = operator.rebuild_reports(Some(PROJECTION), 10).unwrap();
    assert_eq!(reports.len(), 2, "{reports:?}");
    // Newest first: the rebuild, then the audit, with the figures they returned.
    let (r, a) = (&reports[0], &reports[1]);
    assert!(r.id > a.id);
    assert_eq!(
        (r.kind, r.outcome, r.error.as_deref()),
        (RebuildReportKind::Rebuild, RebuildOutcome::Ok, None)
    );
    assert_eq!(r.projection, PROJECTION);
    assert_eq!(
        (
            r.partitions,
            r.rows_checked,
            r.rows_differing,
            r.rows_changed,
            r.extra_rows
        ),
        (
            rebuilt.partitions,
            rebuilt.rows_checked,
            rebuilt.rows_differing,
            rebuilt.rows_changed,
            rebuilt.extra_rows
        )
    );
    assert_eq!((r.partitions, r.rows_changed, r.events_covered), (2, 1, 6));
    assert_eq!(
        (
            r.events_covered,
            r.claims_recorded,
            r.claims_converted,
            r.dead_letters_resolved
        ),
        (
            rebuilt.events_covered,
            rebuilt.claims_recorded,
            rebuilt.claims_converted,
            rebuilt.dead_letters_resolved
        )
    );
    assert_eq!(
        (r.lock_waits, r.lock_timeouts, r.duration_ms),
        (
            rebuilt.lock_waits,
            rebuilt.lock_timeouts,
            rebuilt.duration_ms
        )
    );
    assert_eq!(r.largest_ratio, rebuilt.largest_ratio);
    assert_eq!(
        r.drift_sample,
        serde_json::to_value(&rebuilt.sample).unwrap()
    );
    assert!(r.started_at <= r.finished_at);
    assert_eq!(
        (a.kind, a.outcome),
        (RebuildReportKind::Audit, RebuildOutcome::Ok)
    );
    assert_eq!(
        (
            a.partitions,
            a.rows_checked,
            a.rows_differing,
            a.extra_rows,
            a.largest_ratio
        ),
        (
            audit.partitions,
            audit.rows_checked,
            audit.rows_differing,
            audit.extra_rows,
            audit.largest_ratio
        )
    );
    assert_eq!(
        (a.rows_differing, a.rows_changed, a.events_covered),
        (1, 0, 0)
    );
    assert_eq!(a.drift_sample, serde_json::to_value(&audit.sample).unwrap());
    assert_eq!(a.drift_sample.as_array().map(Vec::len), Some(1));

    // A rebuild whose hook fails (its table is gone) leaves a failed report with its
    // error, and still returns the error.
    fx.execute("ALTER TABLE daily_usage RENAME TO daily_usage_away");
    let err = rebuilder.rebuild(1).unwrap_err();
    assert!(matches!(err, Error::RebuildHook { .. }), "{err:?}");
    let failed = &operator.rebuild_reports(Some(PROJECTION), 1).unwrap()[0];
    assert_eq!(
        (failed.kind, failed.outcome),
        (RebuildReportKind::Rebuild, RebuildOutcome::Failed)
    );
    let error = failed.error.as_deref().unwrap();
    assert!(
        error.contains(PROJECTION) && error.contains("daily_usage"),
        "{error}"
    );
    assert_eq!(failed.partitions, 0);
    fx.execute("ALTER TABLE daily_usage_away RENAME TO daily_usage");

    // The bound: another projection's reports stay; this one keeps its newest 100.
    fx.execute(
        "INSERT INTO inbox_rebuild_reports (projection, kind, started_at, finished_at, outcome, \
         partitions, rows_checked, rows_differing, rows_changed, extra_rows, events_covered, \
         claims_recorded, claims_converted, dead_letters_resolved, lock_waits, lock_timeouts, \
         duration_ms, drift_sample) SELECT 'other', kind, started_at, finished_at, outcome, \
         partitions, rows_checked, rows_differing, rows_changed, extra_rows, events_covered, \
         claims_recorded, claims_converted, dead_letters_resolved, lock_waits, lock_timeouts, \
         duration_ms, drift_sample FROM inbox_rebuild_reports",
    );
    for _ in 0..KEPT_REBUILD_REPORTS {
        rebuilder.audit(1).unwrap();
    }
    let count = |projection: &str| {
        fx.connect().count(&format!(
            "SELECT COUNT(*) AS n FROM inbox_rebuild_reports WHERE projection = '{projection}'"
        ))
    };
    assert_eq!(count(PROJECTION), KEPT_REBUILD_REPORTS as i64);
    assert_eq!(count("other"), 3);
    let kept = operator.rebuild_reports(Some(PROJECTION), 1000).unwrap();
    assert_eq!(kept.len(), KEPT_REBUILD_REPORTS);
    assert!(
        kept.iter().all(|k| k.kind == RebuildReportKind::Audit),
        "the oldest went first"
    );
    assert_eq!(
        operator.rebuild_reports(None, 1000).unwrap().len(),
        KEPT_REBUILD_REPORTS + 3
    );
    assert_eq!(operator.rebuild_reports(None, 5).unwrap().len(), 5);

    // A report that cannot be recorded is logged; the rebuild is done all the same.
    fx.execute("ALTER TABLE inbox_rebuild_reports RENAME TO inbox_rebuild_reports_away");
    let done = rebuilder.rebuild(2).unwrap();
    assert_eq!(done.partitions, 2);
    fx.execute("ALTER TABLE inbox_rebuild_reports_away RENAME TO inbox_rebuild_reports");
}

// ---------------------------------------------------------------------------------
// The interleavings of a live batch and a source row with a rebuild, on PostgreSQL:
// two connections (the rebuild's and the live batch's), the rebuild stopped at a gate.

mod interleavings {
    use super::*;
    use diesel::PgConnection;
    use inbox_diesel::rebuild::{RebuildRunner, RunOutcome};

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
    ) -> JoinHandle<inbox_diesel::Result<inbox_core::rebuild::RebuildReport>> {
        let rebuilder = Rebuilder::new(store, PROJECTION)
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
        let report = Rebuilder::new(&s.store, PROJECTION)
            .unwrap()
            .rebuild(1)
            .unwrap();
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
        let err = Rebuilder::new(&s.store, PROJECTION)
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
        let patient = Rebuilder::new(&s.store, PROJECTION)
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
            RebuildRunner::new(Rebuilder::new(&s.store, PROJECTION).unwrap())
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

    const DEFAULT_TIMEOUT: Duration = inbox_diesel::rebuild::DEFAULT_LOCK_TIMEOUT;

    /// On SQLite the single writer gives the same exclusion: the rebuild's write
    /// transaction keeps a live batch from claiming until it commits.
    #[test]
    fn on_sqlite_the_single_writer_excludes_live_batches_from_a_rebuild() {
        let fx = SqliteFixture::new();
        let gate = Arc::new(Gate::default());
        let store = setup(fx.builder(), Gated::new(&gate));
        let e = write(&store, 1, today(), 40);
        gate.arm(Stage::AfterRead);
        let rebuilder = Rebuilder::new(&store, PROJECTION).unwrap();
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

// ---------------------------------------------------------------------------------
// Operator writes racing a rebuild's cover on PostgreSQL, forced with row locks: a
// third connection holds a row the cover needs, the rebuild waits behind it (seen in
// `pg_blocking_pids`, not guessed from a sleep), the operator write runs, the third
// connection lets go.

mod operator_writes {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::sql_types::Integer;
    use diesel::PgConnection;
    use inbox_diesel::operator::{DeadLetterFilter, RedriveFilter, ReplayOutcome, ReplayTarget};

    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }

    /// A connection holding one row lock in an open transaction.
    struct Blocker {
        conn: PgConnection,
        pid: i32,
        monitor: PgConnection,
    }

    impl Blocker {
        fn hold(fx: &PgFixture, sql: &str) -> Self {
            let mut conn = fx.connect();
            conn.batch_execute("BEGIN").unwrap();
            conn.batch_execute(sql).unwrap();
            let pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
                .get_result::<Pid>(&mut conn)
                .unwrap()
                .pid;
            Self {
                conn,
                pid,
                monitor: fx.connect(),
            }
        }

        fn claim(fx: &PgFixture, e: Event) -> Self {
            Self::hold(
                fx,
                &format!(
                    "SELECT 1 FROM inbox_claims WHERE message_key = '{}' FOR UPDATE",
                    ledger_event_key(e.id)
                ),
            )
        }

        fn letter(fx: &PgFixture, id: i64) -> Self {
            Self::hold(
                fx,
                &format!("SELECT 1 FROM inbox_dead_letters WHERE id = {id} FOR UPDATE"),
            )
        }

        /// Backends waiting for this one (`depth` 1), or for one of those (`depth` 2).
        fn waiters(&mut self, depth: u8) -> i64 {
            let sql = match depth {
                1 => format!(
                    "SELECT COUNT(*) AS n FROM pg_stat_activity \
                     WHERE {} = ANY(pg_blocking_pids(pid))",
                    self.pid
                ),
                _ => format!(
                    "SELECT COUNT(*) AS n FROM pg_stat_activity a WHERE EXISTS ( \
                       SELECT 1 FROM pg_stat_activity b \
                       WHERE {} = ANY(pg_blocking_pids(b.pid)) \
                         AND b.pid = ANY(pg_blocking_pids(a.pid)))",
                    self.pid
                ),
            };
            diesel::sql_query(sql)
                .get_result::<Count>(&mut self.monitor)
                .unwrap()
                .n
        }

        /// Waits until `thread` waits behind this connection (at `depth`) or ended.
        fn wait_behind<T>(&mut self, depth: u8, thread: &JoinHandle<T>) {
            let until = Instant::now() + Duration::from_secs(30);
            while self.waiters(depth) == 0 && !thread.is_finished() {
                assert!(Instant::now() < until, "never blocked, never finished");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        fn release(mut self) {
            self.conn.batch_execute("ROLLBACK").unwrap();
        }
    }

    struct Scene {
        fx: PgFixture,
        healed: Arc<AtomicBool>,
        store: Store<PgConnection>,
        /// Two dead events of user 0, `low`'s key sorting before `high`'s.
        low: Event,
        high: Event,
    }

    fn scene() -> Option<Scene> {
        let fx = PgFixture::new()?;
        let gate = Arc::new(Gate::default());
        let projection = Gated::new(&gate);
        let healed = Arc::clone(&projection.healed);
        let store = setup(fx.builder(), projection);
        let a = write(&store, 0, today(), 5);
        let b = write(&store, 0, today(), 6);
        let (low, high) = if ledger_event_key(a.id).to_string() < ledger_event_key(b.id).to_string()
        {
            (a, b)
        } else {
            (b, a)
        };
        // In key order, so the claims' and the letters' order agree.
        dead_letter(&store, low);
        dead_letter(&store, high);
        Some(Scene {
            fx,
            healed,
            store,
            low,
            high,
        })
    }

    /// Every lock wait of the rebuild's transaction is bounded by its lock timeout:
    /// long enough here for the test to release the blocker.
    fn rebuild_in_thread(
        store: &Store<PgConnection>,
    ) -> JoinHandle<inbox_diesel::Result<inbox_core::rebuild::RebuildReport>> {
        let rebuilder = Rebuilder::new(store, PROJECTION)
            .unwrap()
            .lock_timeout(Duration::from_secs(60));
        std::thread::spawn(move || rebuilder.rebuild(1))
    }

    fn replay_in_thread(
        store: &Store<PgConnection>,
        letter: i64,
        bulk: bool,
    ) -> JoinHandle<ReplayOutcome> {
        let store = store.clone();
        std::thread::spawn(move || {
            let target = ReplayTarget::default();
            if !bulk {
                return Operator::new(&store)
                    .replay_dead_letter(letter, &target)
                    .unwrap();
            }
            let key = Operator::new(&store)
                .dead_letter_details(letter)
                .unwrap()
                .unwrap()
                .entry
                .message_key;
            let report = Operator::new(&store)
                .replay_dead_letters(&DeadLetterFilter::default().message_key(key), None, &target)
                .unwrap();
            // The single replay's answer, as the bulk report counts it.
            match (report.affected, report.refused) {
                (1, 0) => ReplayOutcome::Replayed {
                    sequence: 0,
                    outbox_id: 0,
                },
                (0, 1) => Operator::new(&store)
                    .replay_dead_letter(letter, &target)
                    .unwrap(),
                _ => panic!("bulk replay: {report:?}"),
            }
        })
    }

    /// The cover waits behind the claim of the lower key while the replay of the
    /// higher key's letter runs: before the cover locked its rows in one step, the
    /// replay committed `dead -> failed` between the cover's statements, the rebuild
    /// summed the event and the replay's copy was applied on top (counted twice).
    fn a_replay_landing_inside_the_cover(bulk: bool) {
        let Some(s) = scene() else { return };
        let letter = letter_of(&s.store, s.high);
        let mut blocker = Blocker::claim(&s.fx, s.low);
        let rebuild = rebuild_in_thread(&s.store);
        blocker.wait_behind(1, &rebuild);
        assert!(
            !rebuild.is_finished(),
            "the cover waits for the locked claim"
        );
        let replay = replay_in_thread(&s.store, letter, bulk);
        blocker.wait_behind(2, &replay);
        blocker.release();
        let report = rebuild.join().unwrap().unwrap();
        let outcome = replay.join().unwrap();
        assert_eq!(report.events_covered, 2, "{report:?}");
        settle_and_check(&s.store, &s.healed, s.high, letter, &outcome);
    }

    #[test]
    fn a_replay_landing_inside_the_cover_counts_its_event_once() {
        a_replay_landing_inside_the_cover(false);
    }

    #[test]
    fn a_bulk_replay_landing_inside_the_cover_counts_its_event_once() {
        a_replay_landing_inside_the_cover(true);
    }

    /// The cover waits behind the lower key's letter before it locks anything of the
    /// higher key: the replay of the higher key commits first, and the rebuild sees
    /// it (the replay's failed claim is covered, its copy a duplicate).
    #[test]
    fn a_replay_committed_before_the_cover_locks_its_rows_is_seen_by_it() {
        let Some(s) = scene() else { return };
        let low_letter = letter_of(&s.store, s.low);
        let letter = letter_of(&s.store, s.high);
        assert!(low_letter < letter, "letters in key order");
        let mut blocker = Blocker::letter(&s.fx, low_letter);
        let rebuild = rebuild_in_thread(&s.store);
        blocker.wait_behind(1, &rebuild);
        let replay = replay_in_thread(&s.store, letter, false);
        blocker.wait_behind(2, &replay);
        blocker.release();
        rebuild.join().unwrap().unwrap();
        let outcome = replay.join().unwrap();
        assert!(
            matches!(outcome, ReplayOutcome::Replayed { .. }),
            "the replay committed before the cover locked its rows: {outcome:?}"
        );
        settle_and_check(&s.store, &s.healed, s.high, letter, &outcome);
    }

    /// The cover holds the lower key's rows and waits behind the higher key's claim;
    /// the replay of the lower key waits for the cover, then finds its letter
    /// resolved: refused, nothing enqueued.
    #[test]
    fn a_replay_of_a_key_the_cover_holds_waits_and_is_refused() {
        let Some(s) = scene() else { return };
        let letter = letter_of(&s.store, s.low);
        let mut blocker = Blocker::claim(&s.fx, s.high);
        let rebuild = rebuild_in_thread(&s.store);
        blocker.wait_behind(1, &rebuild);
        let replay = replay_in_thread(&s.store, letter, false);
        blocker.wait_behind(2, &replay);
        blocker.release();
        rebuild.join().unwrap().unwrap();
        let outcome = replay.join().unwrap();
        assert!(
            matches!(outcome, ReplayOutcome::Refused { .. }),
            "{outcome:?}"
        );
        settle_and_check(&s.store, &s.healed, s.low, letter, &outcome);
    }

    /// A redrive of a failed claim the cover is about to take: it commits first (the
    /// cover waits behind the lower key) and the rebuild converts the redriven claim,
    /// or it waits for the cover and finds the claim done: skipped. Counted once.
    #[test]
    fn a_redrive_racing_the_cover_counts_its_event_once() {
        let Some(s) = scene() else { return };
        // A failed claim with its payload kept, due: user 0's next event, failed once.
        let e = write(&s.store, 0, today(), 7);
        let wait = match &deliver(&s.store, &[e])[0] {
            Decision::RetryAfter(wait) => *wait,
            other => panic!("{other:?}"),
        };
        std::thread::sleep(wait);
        let (blocked, redriven) =
            if ledger_event_key(s.low.id).to_string() < ledger_event_key(e.id).to_string() {
                (s.low, e)
            } else {
                (s.high, e)
            };
        let mut blocker = Blocker::claim(&s.fx, blocked);
        let rebuild = rebuild_in_thread(&s.store);
        blocker.wait_behind(1, &rebuild);
        let store = s.store.clone();
        let key = ledger_event_key(redriven.id).to_string();
        let redrive = std::thread::spawn(move || {
            Operator::new(&store)
                .redrive_failed_claims(
                    &RedriveFilter::default()
                        .message_key(key)
                        .overdue_for(Duration::ZERO),
                    None,
                    &ReplayTarget::default(),
                )
                .unwrap()
        });
        blocker.wait_behind(2, &redrive);
        blocker.release();
        rebuild.join().unwrap().unwrap();
        let report = redrive.join().unwrap();
        s.healed.store(true, Ordering::SeqCst);
        let claim = s
            .store
            .claim_record(&redriven.claim_key())
            .unwrap()
            .unwrap();
        assert_eq!(claim.status, ClaimStatus::Done, "{report:?} {claim:?}");
        // The redriven copy, if one was enqueued, is a duplicate.
        assert_eq!(deliver(&s.store, &[redriven]), [Decision::Duplicate]);
        assert_eq!(totals(&s.store), ledger_sums(&s.store, &[today()]));
    }
}
