//! The interleavings that matter where two features write one row, forced with two
//! connections and locks, never with sleeps.
//!
//! On PostgreSQL a third connection (the *holder*) takes the row lock first
//! (`SELECT ... FOR UPDATE`, or an open transaction that wrote the row); the test
//! starts the first writer and waits until the server shows it blocked by the holder
//! (`pg_blocking_pids`, read in a loop: the test waits for a state of the lock graph,
//! never for time to pass), then starts the second writer and waits until it is
//! blocked too, or has finished; then the holder commits, and the writers go in the
//! order they queued. Each outcome is then compared with the model run in the serial
//! order the store's answers name: the outcome must be one that a serial order gives.
//!
//! On SQLite every write transaction of the store is `BEGIN IMMEDIATE`: one writer at
//! a time, so two writers never overlap and each interleaving reduces to its two
//! serial orders, which the SQLite variants run one after the other (a fresh world
//! each), compared with the model the same way.

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{Array, Integer};
use diesel::PgConnection;
use inbox_diesel::idempotency::{begin_request, commit_request, NewRequest};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{DeadLetterFilter, LetterStatus, RedriveFilter, ReplayTarget};
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::Error;
use inbox_test_support::{Fixture, PgFixture, SqliteFixture};

use super::model::{Idem, Out, Step};
use super::world::{Act, Acts, LcDb, PROJECTION};
use super::{fingerprint, idem_key, replay_of, Scenario};

// ----------------------------------------------------------------------------------
// Locks, seen from the server.

#[derive(QueryableByName)]
struct Pid {
    #[diesel(sql_type = Integer)]
    pid: i32,
}

fn backend_pid(conn: &mut PgConnection) -> i32 {
    diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(conn)
        .unwrap()
        .pid
}

/// The backends waiting for a lock one of `holders` holds (or queues ahead for).
fn blocked_by(observer: &mut PgConnection, holders: &[i32]) -> Vec<i32> {
    diesel::sql_query(
        "SELECT pid FROM pg_stat_activity WHERE pg_blocking_pids(pid) && $1::int[] ORDER BY pid",
    )
    .bind::<Array<Integer>, _>(holders)
    .load::<Pid>(observer)
    .unwrap()
    .into_iter()
    .map(|p| p.pid)
    .collect()
}

/// Waits until `state` holds: a state of the lock graph or a thread, polled; the
/// bound only turns a hang into a failure.
fn wait_until(what: &str, mut state: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(60);
    while !state() {
        assert!(Instant::now() < until, "never reached: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A connection holding the claim row of `key` locked in an open transaction.
fn hold_claim(fx: &PgFixture, key: &str) -> (PgConnection, i32) {
    let mut holder = fx.connect();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM inbox_claims WHERE consumer_group = '{}' \
             AND message_key = '{key}' FOR UPDATE",
            super::world::GROUP
        ))
        .unwrap();
    let pid = backend_pid(&mut holder);
    (holder, pid)
}

/// The one backend blocked by `holders` other than `known`, once there is one.
fn next_blocked(observer: &mut PgConnection, holders: &[i32], known: &[i32]) -> i32 {
    let mut found = None;
    wait_until("a second writer blocked", || {
        found = blocked_by(observer, holders)
            .into_iter()
            .find(|p| !known.contains(p));
        found.is_some()
    });
    found.unwrap()
}

// ----------------------------------------------------------------------------------
// An operator write that moves a claim a rebuild covers (issue 21, item 1).

#[derive(Clone, Copy, Debug)]
enum Op {
    Replay,
    BulkReplay,
    Redrive,
}

impl Op {
    /// What event 0's handler does: dies at once (a dead letter to replay), or
    /// fails once (a failed claim to redrive).
    fn acts(self) -> Acts {
        match self {
            Op::Replay | Op::BulkReplay => [Act::Permanent; 2],
            Op::Redrive => [Act::Transient, Act::Apply],
        }
    }

    fn step(self) -> Step {
        match self {
            Op::Replay => Step::Replay { letter: 0 },
            Op::BulkReplay => Step::BulkReplay,
            Op::Redrive => Step::Redrive { overdue: 5 },
        }
    }
}

/// Event 0 written, relayed and failed: dead with a letter (replays), or failed and
/// overdue (redrive); then the cause is fixed, so that a copy would apply.
fn before_the_operator<C: inbox_test_support::FullConnection + LcDb>(s: &mut Scenario<C>, op: Op) {
    s.step(Step::Write { user: 0 });
    s.step(Step::Relay);
    s.step(Step::Heal { event: 0 });
    if let Op::Redrive = op {
        s.step(Step::Advance(7));
    }
}

/// Runs the operator's write on the store (another thread may run it).
fn operator_write<C: inbox_test_support::FullConnection>(
    store: &inbox_diesel::Store<C>,
    op: Op,
    letter: Option<i64>,
) -> Out {
    let target = ReplayTarget::default();
    match op {
        Op::Replay => Out::Replay(replay_of(
            Operator::new(store)
                .replay_dead_letter(letter.unwrap(), &target)
                .unwrap(),
        )),
        Op::BulkReplay => {
            let filter = DeadLetterFilter::default()
                .consumer_group(super::world::GROUP)
                .status(LetterStatus::Pending);
            let r = Operator::new(store)
                .replay_dead_letters(&filter, None, &target)
                .unwrap();
            Out::Bulk(r.matched, r.affected, r.refused, r.skipped)
        }
        Op::Redrive => {
            let filter = RedriveFilter::default()
                .consumer_group(super::world::GROUP)
                .overdue_for(Duration::from_secs(5));
            let r = Operator::new(store)
                .redrive_failed_claims(&filter, None, &target)
                .unwrap();
            Out::Bulk(r.matched, r.affected, r.refused, r.skipped)
        }
    }
}

fn rebuild<C: inbox_test_support::FullConnection>(store: &inbox_diesel::Store<C>) {
    Rebuilder::new(store, PROJECTION)
        .unwrap()
        .lock_timeout(Duration::from_secs(60))
        .rebuild(1)
        .unwrap();
}

/// After the two writers: the relay delivers whatever copy was enqueued; the model
/// checks that the event counted once, in the serial order the answer names.
fn settle_and_judge<C: inbox_test_support::FullConnection + LcDb>(
    s: &mut Scenario<C>,
    op: Op,
    found: &Out,
    operator_first: bool,
) {
    let mut report = String::new();
    let rebuild_step = Step::Rebuild { days: 1 };
    let order = if operator_first {
        [op.step(), rebuild_step]
    } else {
        [rebuild_step, op.step()]
    };
    for step in &order {
        let answer = if matches!(step, Step::Rebuild { .. }) {
            Out::Nothing
        } else {
            found.clone()
        };
        if let Err(diff) = s.expect(step, &answer) {
            report += &format!("{step:?}\n{diff}");
        }
    }
    if let Err(diff) = s.compare() {
        report += &format!("after both:\n{diff}");
    }
    let relay = Step::Relay;
    let relayed = s.d.run(&s.m, &relay).unwrap();
    if let Err(diff) = s.expect(&relay, &relayed) {
        report += &format!("relaying the copy:\n{diff}");
    }
    if let Err(diff) = s.compare() {
        report += &format!("after relaying the copy:\n{diff}");
    }
    let totals = s.d.side.all_totals().unwrap();
    let sums = super::ledger_sums(&s.m);
    if totals != sums {
        report += &format!(
            "the projection does not count each event once: totals {totals:?}, ledger {sums:?}\n"
        );
    }
    assert!(
        report.is_empty(),
        "{op:?} and a rebuild, the {} first: no serial order gives this\n{report}",
        if operator_first {
            "operator"
        } else {
            "rebuild"
        }
    );
}

/// PostgreSQL: the operator's write queues first on the claim row, the rebuild's
/// cover behind it; the holder lets them go in that order.
fn pg_operator_write_inside_a_rebuild(fx: &PgFixture, op: Op) {
    let mut s = Scenario::new(fx, op.acts());
    before_the_operator(&mut s, op);
    let letter = s.m.letters.first().and_then(|l| l.id);
    let key = s.d.key(0);
    let mut observer = fx.connect();
    let (mut holder, holder_pid) = hold_claim(fx, &key);
    let store = s.d.store.clone();
    let operator = std::thread::spawn(move || operator_write(&store, op, letter));
    let op_pid = next_blocked(&mut observer, &[holder_pid], &[]);
    let store = s.d.store.clone();
    let rebuilder = std::thread::spawn(move || rebuild(&store));
    // The rebuild queues behind the operator on the row, or (a rebuild that does not
    // touch the row) commits while the operator still waits.
    wait_until("the rebuild blocked or done", || {
        rebuilder.is_finished()
            || blocked_by(&mut observer, &[holder_pid, op_pid])
                .into_iter()
                .any(|p| p != op_pid)
    });
    let rebuild_first = rebuilder.is_finished();
    holder.batch_execute("COMMIT").unwrap();
    let found = operator.join().unwrap();
    rebuilder.join().unwrap();
    // Whoever queued first on the row wrote first.
    settle_and_judge(&mut s, op, &found, !rebuild_first);
}

/// SQLite: one writer, so the two serial orders.
fn sqlite_operator_write_and_rebuild(fx: &SqliteFixture, op: Op) {
    for operator_first in [true, false] {
        let mut s = Scenario::new(fx, op.acts());
        before_the_operator(&mut s, op);
        let letter = s.m.letters.first().and_then(|l| l.id);
        let found = if operator_first {
            let found = operator_write(&s.d.store, op, letter);
            rebuild(&s.d.store);
            found
        } else {
            rebuild(&s.d.store);
            operator_write(&s.d.store, op, letter)
        };
        settle_and_judge(&mut s, op, &found, operator_first);
    }
}

// ----------------------------------------------------------------------------------
// A discard racing a replay of one letter (issue 21, item 3).

/// The model in the serial order the answers name: a discard that answered
/// `Discarded` before the replay committed came first.
fn judge_discard_and_replay<C: inbox_test_support::FullConnection + LcDb>(
    s: &mut Scenario<C>,
    discard: &Out,
    replay: &Out,
    discard_first: bool,
) {
    let letter_steps = (Step::Discard { letter: 0 }, Step::Replay { letter: 0 });
    let mut report = String::new();
    let steps = if discard_first {
        [(letter_steps.0, discard), (letter_steps.1, replay)]
    } else {
        [(letter_steps.1, replay), (letter_steps.0, discard)]
    };
    for (step, found) in &steps {
        if let Err(diff) = s.expect(step, found) {
            report += &format!("{step:?}\n{diff}");
        }
    }
    if let Err(diff) = s.compare() {
        report += &format!("after both:\n{diff}");
    }
    assert!(
        report.is_empty(),
        "a discard and a replay of one letter, the {} answering first: no serial order gives this\n{report}",
        if discard_first { "discard" } else { "replay" }
    );
}

fn dead_letter<C: inbox_test_support::FullConnection + LcDb>(s: &mut Scenario<C>) -> i64 {
    s.step(Step::Write { user: 0 });
    s.step(Step::Relay);
    s.step(Step::Heal { event: 0 });
    s.m.letters[0].id.unwrap()
}

fn pg_discard_during_a_replay(fx: &PgFixture) {
    let mut s = Scenario::new(fx, [Act::Permanent; 2]);
    let id = dead_letter(&mut s);
    let key = s.d.key(0);
    let mut observer = fx.connect();
    let (mut holder, holder_pid) = hold_claim(fx, &key);
    let store = s.d.store.clone();
    let replay = std::thread::spawn(move || {
        Out::Replay(replay_of(
            Operator::new(&store)
                .replay_dead_letter(id, &ReplayTarget::default())
                .unwrap(),
        ))
    });
    let replay_pid = next_blocked(&mut observer, &[holder_pid], &[]);
    let store = s.d.store.clone();
    let discard = std::thread::spawn(move || {
        Out::Discard(Operator::new(&store).discard_dead_letter(id).unwrap())
    });
    // The discard either answers while the replay is still blocked, or waits for a
    // row the replay holds.
    wait_until("the discard answered or blocked", || {
        discard.is_finished()
            || !blocked_by(&mut observer, &[holder_pid, replay_pid])
                .into_iter()
                .all(|p| p == replay_pid)
    });
    let discard_first = discard.is_finished();
    holder.batch_execute("COMMIT").unwrap();
    let replay = replay.join().unwrap();
    let discard = discard.join().unwrap();
    judge_discard_and_replay(&mut s, &discard, &replay, discard_first);
}

fn sqlite_discard_and_replay(fx: &SqliteFixture) {
    for discard_first in [true, false] {
        let mut s = Scenario::new(fx, [Act::Permanent; 2]);
        let id = dead_letter(&mut s);
        let target = ReplayTarget::default();
        let (discard, replay) = if discard_first {
            let d = Out::Discard(Operator::new(&s.d.store).discard_dead_letter(id).unwrap());
            let r = Out::Replay(replay_of(
                Operator::new(&s.d.store)
                    .replay_dead_letter(id, &target)
                    .unwrap(),
            ));
            (d, r)
        } else {
            let r = Out::Replay(replay_of(
                Operator::new(&s.d.store)
                    .replay_dead_letter(id, &target)
                    .unwrap(),
            ));
            let d = Out::Discard(Operator::new(&s.d.store).discard_dead_letter(id).unwrap());
            (d, r)
        };
        judge_discard_and_replay(&mut s, &discard, &replay, discard_first);
    }
}

// ----------------------------------------------------------------------------------
// Idempotency records (issue 21, item 2).

/// Request #0 begins (lease 5 s) and stalls; `meanwhile` runs (a purge, or a take-over
/// and an abandon) and another request with other content begins afresh under the
/// key; then #0's late commit arrives, inside the transaction #0 opened before all of
/// that on its own connection (PostgreSQL; on SQLite, whose single writer would
/// make everyone wait for that transaction, #0's transaction opens at its commit).
fn late_commit<F: Fixture>(fx: &F, meanwhile: &[Step], own_transaction_first: bool)
where
    F::Conn: LcDb,
{
    let mut s = Scenario::new(fx, [Act::Apply; 2]);
    // Show where a repeated token leads, rather than stop at the repetition.
    s.d.check_tokens = false;
    let begin = |fp| Step::Begin {
        caller: 0,
        key: 0,
        fp,
        lease: 5,
    };
    s.step(begin(0));
    let token = s.d.tokens[0];
    let mut late = fx.connect();
    if own_transaction_first {
        late.batch_execute("BEGIN").unwrap();
        late.insert_ledger(100, "the stalled request's effect", 0, "2026-11-30", 1)
            .unwrap();
    }
    s.step(Step::Advance(30));
    for step in meanwhile {
        s.step(step.clone());
    }
    let fresh = s.step(begin(1));
    assert!(
        matches!(fresh, Out::Idem(Idem::Execute(_))),
        "the new request executes: {fresh:?}"
    );
    if !own_transaction_first {
        late.batch_execute("BEGIN").unwrap();
    }
    let caller = s.d.caller(0);
    let committed = commit_request(&mut late, &caller, &idem_key(0), token, s.m.now);
    let found = match committed {
        Ok(()) => Out::Idem(Idem::Committed),
        Err(Error::Fenced { .. }) => Out::Idem(Idem::Fenced),
        Err(err) => panic!("commit: {err}"),
    };
    // A fenced request rolls its transaction back; one that was not commits.
    let end = if found == Out::Idem(Idem::Fenced) {
        "ROLLBACK"
    } else {
        "COMMIT"
    };
    late.batch_execute(end).unwrap();
    let mut report = String::new();
    if let Err(diff) = s.expect(&Step::Commit { handle: 0 }, &found) {
        report += &format!("the stalled request's late commit\n{diff}");
    }
    if let Err(diff) = s.compare() {
        report += &format!("after it:\n{diff}");
    }
    // The new request's own commit holds, and its replays get its own response.
    let newest = u8::try_from(s.m.handles.len() - 1).unwrap();
    for step in [
        Step::Commit { handle: newest },
        Step::Settle {
            handle: newest,
            delivered: true,
        },
        begin(1),
    ] {
        match s.d.run(&s.m, &step) {
            Ok(found) => {
                if let Err(diff) = s.expect(&step, &found) {
                    report += &format!("{step:?}\n{diff}");
                }
            }
            Err(err) => report += &format!("{step:?}: {err}\n"),
        }
    }
    if let Err(diff) = s.compare() {
        report += &format!("after the new request settled:\n{diff}");
    }
    assert!(
        report.is_empty(),
        "a stalled request's commit landed on another request's record\n{report}"
    );
}

fn purge_then_reuse() -> Vec<Step> {
    vec![Step::Purge]
}

fn take_over_then_abandon() -> Vec<Step> {
    vec![
        Step::Begin {
            caller: 0,
            key: 0,
            fp: 0,
            lease: 5,
        },
        Step::Abandon { handle: 1 },
    ]
}

/// A take-over and a commit of the expired request meet on the record: the one that
/// holds the row (an open transaction on its own connection) decides, the other
/// waits and then sees it.
fn pg_take_over_and_commit(fx: &PgFixture, commit_first: bool) {
    let mut s = Scenario::new(fx, [Act::Apply; 2]);
    let begin = Step::Begin {
        caller: 0,
        key: 0,
        fp: 0,
        lease: 5,
    };
    s.step(begin.clone());
    s.step(Step::Advance(10));
    let token = s.d.tokens[0];
    let now = s.m.now;
    let caller = s.d.caller(0);
    let mut observer = fx.connect();
    let mut first = fx.connect();
    let first_pid = backend_pid(&mut first);
    let fp = fingerprint(0);
    let key = idem_key(0);
    let request = |caller: &str| {
        (
            caller.to_owned(),
            key.clone(),
            fp,
            now + chrono::TimeDelta::seconds(5),
        )
    };
    let (found_commit, found_begin);
    if commit_first {
        // The commit holds the row in its open transaction; the take-over queues.
        let mut taker = None;
        first
            .transaction::<_, Error, _>(|conn| {
                commit_request(conn, &caller, &key, token, now)?;
                let store = s.d.store.clone();
                let (c, k, f, lease_until) = request(&caller);
                taker = Some(std::thread::spawn(move || {
                    let mut conn = store.connection().unwrap();
                    let r = NewRequest {
                        caller: &c,
                        key: &k,
                        fingerprint: &f,
                        lease_until,
                    };
                    begin_request(&mut *conn, &r, now).unwrap()
                }));
                next_blocked(&mut observer, &[first_pid], &[]);
                Ok(())
            })
            .unwrap();
        found_commit = Out::Idem(Idem::Committed);
        found_begin = taker.unwrap().join().unwrap();
    } else {
        // The take-over holds the row in its open transaction; the commit queues.
        let mut committer = None;
        let (c, k, f, lease_until) = request(&caller);
        found_begin = first
            .transaction::<_, Error, _>(|conn| {
                let r = NewRequest {
                    caller: &c,
                    key: &k,
                    fingerprint: &f,
                    lease_until,
                };
                let answer = begin_request(conn, &r, now)?;
                let store = s.d.store.clone();
                let (c, k) = (caller.clone(), key.clone());
                committer = Some(std::thread::spawn(move || {
                    let mut conn = store.connection().unwrap();
                    match commit_request(&mut *conn, &c, &k, token, now) {
                        Ok(()) => Out::Idem(Idem::Committed),
                        Err(Error::Fenced { .. }) => Out::Idem(Idem::Fenced),
                        Err(err) => panic!("commit: {err}"),
                    }
                }));
                next_blocked(&mut observer, &[first_pid], &[]);
                Ok(answer)
            })
            .unwrap();
        found_commit = committer.unwrap().join().unwrap();
    }
    let found_begin = match found_begin {
        inbox_core::idempotency::IdempotencyAnswer::Execute { token } => {
            s.d.tokens.push(token);
            Out::Idem(Idem::Execute(s.d.tokens.len() - 1))
        }
        inbox_core::idempotency::IdempotencyAnswer::InFlight => Out::Idem(Idem::InFlight),
        other => panic!("begin answered {other:?}"),
    };
    judge_take_over(&mut s, &found_commit, &found_begin, commit_first);
}

fn judge_take_over<C: inbox_test_support::FullConnection + LcDb>(
    s: &mut Scenario<C>,
    commit: &Out,
    begin: &Out,
    commit_first: bool,
) {
    let commit_step = (Step::Commit { handle: 0 }, commit);
    let begin_step = (
        Step::Begin {
            caller: 0,
            key: 0,
            fp: 0,
            lease: 5,
        },
        begin,
    );
    let steps = if commit_first {
        [commit_step, begin_step]
    } else {
        [begin_step, commit_step]
    };
    let mut report = String::new();
    for (step, found) in &steps {
        if let Err(diff) = s.expect(step, found) {
            report += &format!("{step:?}\n{diff}");
        }
    }
    if let Err(diff) = s.compare() {
        report += &format!("after both:\n{diff}");
    }
    assert!(
        report.is_empty(),
        "a take-over and a commit, the {} first: no serial order gives this\n{report}",
        if commit_first { "commit" } else { "take-over" }
    );
}

fn sqlite_take_over_and_commit(fx: &SqliteFixture) {
    for commit_first in [true, false] {
        let mut s = Scenario::new(fx, [Act::Apply; 2]);
        let begin = Step::Begin {
            caller: 0,
            key: 0,
            fp: 0,
            lease: 5,
        };
        s.step(begin.clone());
        s.step(Step::Advance(10));
        if commit_first {
            s.step(Step::Commit { handle: 0 });
            s.step(begin);
        } else {
            s.step(begin);
            s.step(Step::Commit { handle: 0 });
        }
    }
}

// ----------------------------------------------------------------------------------
// Replay sequences across a purge of the published rows (issue 21, item 6).

/// A letter replayed, its copy failing again into a second letter, the published rows
/// purged, the second letter replayed: its sequence follows the first replay's, never
/// repeats it (no race: an identity that must survive a purge).
fn replay_sequence_across_a_purge<F: Fixture>(fx: &F)
where
    F::Conn: LcDb,
{
    let mut s = Scenario::new(fx, [Act::Permanent; 2]);
    s.step(Step::Write { user: 0 });
    s.step(Step::Relay);
    s.step(Step::Replay { letter: 0 });
    s.step(Step::Relay);
    s.step(Step::Advance(30));
    s.step(Step::Purge);
    let step = Step::Replay { letter: 1 };
    let found = s.d.run(&s.m, &step).unwrap();
    let mut report = String::new();
    if let Err(diff) = s.expect(&step, &found) {
        report += &diff;
    }
    if let Err(diff) = s.compare() {
        report += &diff;
    }
    assert!(
        report.is_empty(),
        "the second replay of a key after the published rows were purged\n{report}"
    );
}

// ----------------------------------------------------------------------------------
// The tests.

pub(crate) mod postgres {
    use super::*;

    fn with_pg(f: impl FnOnce(&PgFixture)) {
        super::super::world::quiet_handler_panics();
        if let Some(fx) = PgFixture::new() {
            f(&fx);
        }
    }

    #[test]
    fn a_replay_landing_inside_a_rebuild_is_counted_once() {
        with_pg(|fx| pg_operator_write_inside_a_rebuild(fx, Op::Replay));
    }

    #[test]
    fn a_bulk_replay_landing_inside_a_rebuild_is_counted_once() {
        with_pg(|fx| pg_operator_write_inside_a_rebuild(fx, Op::BulkReplay));
    }

    #[test]
    fn a_redrive_landing_inside_a_rebuild_is_counted_once() {
        with_pg(|fx| pg_operator_write_inside_a_rebuild(fx, Op::Redrive));
    }

    #[test]
    fn a_discard_committed_during_a_replay_is_never_replayed() {
        with_pg(pg_discard_during_a_replay);
    }

    #[test]
    fn a_late_commit_after_a_purge_never_lands_on_the_new_request() {
        with_pg(|fx| late_commit(fx, &purge_then_reuse(), true));
    }

    #[test]
    fn a_late_commit_after_an_abandon_never_lands_on_the_new_request() {
        with_pg(|fx| late_commit(fx, &take_over_then_abandon(), true));
    }

    #[test]
    fn a_replay_sequence_is_never_handed_out_twice_for_a_key() {
        with_pg(replay_sequence_across_a_purge);
    }

    #[test]
    fn a_take_over_waiting_on_a_commit_never_executes_twice() {
        with_pg(|fx| pg_take_over_and_commit(fx, true));
    }

    #[test]
    fn a_commit_waiting_on_a_take_over_is_fenced() {
        with_pg(|fx| pg_take_over_and_commit(fx, false));
    }
}

pub(crate) mod sqlite {
    use super::*;

    fn with_sqlite(f: impl FnOnce(&SqliteFixture)) {
        super::super::world::quiet_handler_panics();
        f(&SqliteFixture::new());
    }

    #[test]
    fn a_replay_landing_inside_a_rebuild_is_counted_once() {
        with_sqlite(|fx| sqlite_operator_write_and_rebuild(fx, Op::Replay));
    }

    #[test]
    fn a_bulk_replay_landing_inside_a_rebuild_is_counted_once() {
        with_sqlite(|fx| sqlite_operator_write_and_rebuild(fx, Op::BulkReplay));
    }

    #[test]
    fn a_redrive_landing_inside_a_rebuild_is_counted_once() {
        with_sqlite(|fx| sqlite_operator_write_and_rebuild(fx, Op::Redrive));
    }

    #[test]
    fn a_discard_committed_during_a_replay_is_never_replayed() {
        with_sqlite(sqlite_discard_and_replay);
    }

    #[test]
    fn a_late_commit_after_a_purge_never_lands_on_the_new_request() {
        with_sqlite(|fx| late_commit(fx, &purge_then_reuse(), false));
    }

    #[test]
    fn a_late_commit_after_an_abandon_never_lands_on_the_new_request() {
        with_sqlite(|fx| late_commit(fx, &take_over_then_abandon(), false));
    }

    #[test]
    fn a_replay_sequence_is_never_handed_out_twice_for_a_key() {
        with_sqlite(replay_sequence_across_a_purge);
    }

    #[test]
    fn a_take_over_and_a_commit_in_either_order_never_execute_twice() {
        with_sqlite(sqlite_take_over_and_commit);
    }
}
