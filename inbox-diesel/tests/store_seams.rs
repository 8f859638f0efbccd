//! The seams of the operator writes that touch one dead letter or one claim: replay
//! against discard (both orders), replay against replay, and the replay sequence
//! across a purge of the outbox. On PostgreSQL each race is forced with a third
//! connection that holds the contested row in an open transaction: the writers queue
//! behind it (seen in `pg_blocking_pids`, never guessed from a sleep) and go in the
//! order they queued once it lets go. SQLite has one writer: two operator writes never
//! interleave there (each is one `BEGIN IMMEDIATE` transaction), so its cases are the
//! two orders, one after the other.
//!
//! The races of an operator write with a projection rebuild's cover are in the
//! workspace's `tests/tests/projection_rebuild.rs` (`operator_writes`), beside the
//! projection they need.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use inbox_core::{relay_in_process, InProcessTransport, ManualClock, RetryPolicy};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{DeadLetterFilter, DiscardOutcome, ReplayOutcome, ReplayTarget};
use inbox_diesel::{ClaimStatus, Retention, Store};
use inbox_test_support::{on_both_backends, usage, Fixture, Outcome, Recorder};

const GROUP: &str = "billing.daily-usage";

struct Scene<C: inbox_test_support::FullConnection> {
    store: Store<C>,
    clock: Arc<ManualClock>,
    healed: Arc<AtomicBool>,
}

/// One group that fails every key until healed, two attempts to a dead letter.
fn scene<F: Fixture>(fx: &F) -> Scene<F::Conn> {
    let clock = Arc::new(ManualClock::new(
        Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap(),
    ));
    let healed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&healed);
    let handler = Recorder::new(GROUP)
        .policy(RetryPolicy::new(2, Duration::from_secs(1), Duration::from_secs(1)).unwrap())
        .behaviour(move |_, _| {
            if flag.load(Ordering::SeqCst) {
                Outcome::Apply
            } else {
                Outcome::FailWith("ledger row is locked".to_owned())
            }
        });
    let store = fx.open(fx.builder().clock(clock.clone()).handler(handler));
    Scene {
        store,
        clock,
        healed,
    }
}

fn transport<C: inbox_test_support::FullConnection>(s: &Scene<C>) -> InProcessTransport<Store<C>> {
    InProcessTransport::new(s.store.clone()).with_clock(s.clock.clone())
}

/// Publishes `key` and runs it to its dead letter; returns the letter's id.
fn dead_letter<C: inbox_test_support::FullConnection>(
    s: &Scene<C>,
    t: &mut InProcessTransport<Store<C>>,
    key: &str,
) -> i64 {
    t.publish(usage(key, 5)).unwrap();
    t.run_until_idle().unwrap();
    newest_letter(s, key)
}

fn newest_letter<C: inbox_test_support::FullConnection>(s: &Scene<C>, key: &str) -> i64 {
    Operator::new(&s.store)
        .list_dead_letters(&DeadLetterFilter::default().message_key(key), 0, 1)
        .unwrap()[0]
        .id
}

fn claim_status<C: inbox_test_support::FullConnection>(s: &Scene<C>, key: &str) -> ClaimStatus {
    Operator::new(&s.store).claims_for_key(key).unwrap()[0].status
}

/// Relays the outbox to the transport and runs it; returns the rows relayed.
fn relay<C: inbox_test_support::FullConnection>(
    s: &Scene<C>,
    t: &mut InProcessTransport<Store<C>>,
) -> usize {
    let n = relay_in_process(&s.store, t, "relay-1", 100).unwrap();
    t.run_until_idle().unwrap();
    n
}

/// A discarded letter is never replayed: a replay after the discard changes nothing
/// (no copy, the claim stays dead), and answers `Discarded`.
fn a_replay_after_a_discard_enqueues_nothing<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let mut t = transport(&s);
    let id = dead_letter(&s, &mut t, "k-1");
    assert_eq!(
        Operator::new(&s.store).discard_dead_letter(id).unwrap(),
        DiscardOutcome::Discarded
    );
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(id, &ReplayTarget::default())
            .unwrap(),
        ReplayOutcome::Discarded
    );
    assert_eq!(claim_status(&s, "k-1"), ClaimStatus::Dead);
    assert_eq!(relay(&s, &mut t), 0, "nothing was enqueued");
}

/// A second replay of one letter finds it replayed: nothing more is enqueued, and a
/// letter whose claim's guard failed is left unmarked (one transaction).
fn a_letter_is_replayed_once<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let mut t = transport(&s);
    let id = dead_letter(&s, &mut t, "k-1");
    let target = ReplayTarget::default();
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(id, &target)
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 1, .. }
    ));
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(id, &target)
            .unwrap(),
        ReplayOutcome::ClaimNotDead {
            status: Some(ClaimStatus::Failed)
        }
    );
    assert_eq!(relay(&s, &mut t), 1, "one copy");
    // Dead again; the claim is taken back from under the new letter (a key
    // collision's stand-in: the claim is not dead with this payload any more).
    let again = newest_letter(&s, "k-1");
    assert_ne!(again, id);
    // The claim is dead again with the same payload: the replayed letter is still
    // not replayed a second time (its newer letter is the one to replay).
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(id, &target)
            .unwrap(),
        ReplayOutcome::ClaimNotDead {
            status: Some(ClaimStatus::Dead)
        }
    );
    assert_eq!(relay(&s, &mut t), 0, "nothing more was enqueued");
    fx.execute("UPDATE inbox_claims SET status = 'done'");
    assert_eq!(
        Operator::new(&s.store)
            .replay_dead_letter(again, &target)
            .unwrap(),
        ReplayOutcome::ClaimNotDead {
            status: Some(ClaimStatus::Done)
        }
    );
    let letter = Operator::new(&s.store)
        .dead_letter_details(again)
        .unwrap()
        .unwrap()
        .entry;
    assert_eq!(
        letter.replay_count, 0,
        "the mark was rolled back: {letter:?}"
    );
    assert_eq!(letter.replayed_at, None);
}

/// The replay sequence of a key never repeats, even once the published outbox rows
/// that carried the earlier ones are purged.
fn a_replay_sequence_never_repeats_across_a_purge<F: Fixture>(fx: &F) {
    let s = scene(fx);
    let mut t = transport(&s);
    let target = ReplayTarget::default();
    let first = dead_letter(&s, &mut t, "k-1");
    assert!(matches!(
        Operator::new(&s.store)
            .replay_dead_letter(first, &target)
            .unwrap(),
        ReplayOutcome::Replayed { sequence: 1, .. }
    ));
    assert_eq!(relay(&s, &mut t), 1); // still failing: dead again
    s.clock.advance(Duration::from_secs(60));
    let retention = Retention::new(
        Duration::from_secs(1),
        Duration::from_secs(3600),
        Duration::from_secs(1),
    )
    .unwrap();
    let purged = s.store.purge_published(&retention, 100).unwrap();
    assert_eq!(purged, 1, "the replay's row");
    let second = newest_letter(&s, "k-1");
    assert_ne!(first, second);
    s.healed.store(true, Ordering::SeqCst);
    match Operator::new(&s.store)
        .replay_dead_letter(second, &target)
        .unwrap()
    {
        ReplayOutcome::Replayed { sequence, .. } => {
            assert_eq!(sequence, 2, "the key's second replay after a purge")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(relay(&s, &mut t), 1);
    assert_eq!(claim_status(&s, "k-1"), ClaimStatus::Done);
}

on_both_backends!(
    a_replay_after_a_discard_enqueues_nothing,
    a_letter_is_replayed_once,
    a_replay_sequence_never_repeats_across_a_purge,
);

/// The races, on PostgreSQL.
mod races {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::sql_types::{BigInt, Integer};
    use diesel::PgConnection;
    use inbox_test_support::PgFixture;
    use std::thread::JoinHandle;
    use std::time::Instant;

    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }

    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
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

        fn letter(fx: &PgFixture, id: i64) -> Self {
            Self::hold(
                fx,
                &format!("SELECT 1 FROM inbox_dead_letters WHERE id = {id} FOR UPDATE"),
            )
        }

        fn claim(fx: &PgFixture, key: &str) -> Self {
            Self::hold(
                fx,
                &format!("SELECT 1 FROM inbox_claims WHERE message_key = '{key}' FOR UPDATE"),
            )
        }

        /// Backends waiting for this one, directly or behind one that does.
        fn waiters(&mut self) -> i64 {
            diesel::sql_query(format!(
                "SELECT COUNT(*) AS n FROM pg_stat_activity a \
                 WHERE {pid} = ANY(pg_blocking_pids(a.pid)) OR EXISTS ( \
                   SELECT 1 FROM pg_stat_activity b \
                   WHERE {pid} = ANY(pg_blocking_pids(b.pid)) \
                     AND b.pid = ANY(pg_blocking_pids(a.pid)))",
                pid = self.pid
            ))
            .get_result::<Count>(&mut self.monitor)
            .unwrap()
            .n
        }

        /// Waits until `n` backends wait behind this connection or `thread` ended.
        fn wait_for<T>(&mut self, n: i64, thread: &JoinHandle<T>) {
            let until = Instant::now() + Duration::from_secs(30);
            while self.waiters() < n && !thread.is_finished() {
                assert!(Instant::now() < until, "never blocked, never finished");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        fn release(mut self) {
            self.conn.batch_execute("ROLLBACK").unwrap();
        }
    }

    fn replay(s: &Scene<PgConnection>, id: i64) -> JoinHandle<ReplayOutcome> {
        let store = s.store.clone();
        std::thread::spawn(move || {
            Operator::new(&store)
                .replay_dead_letter(id, &ReplayTarget::default())
                .unwrap()
        })
    }

    fn discard(s: &Scene<PgConnection>, id: i64) -> JoinHandle<DiscardOutcome> {
        let store = s.store.clone();
        std::thread::spawn(move || Operator::new(&store).discard_dead_letter(id).unwrap())
    }

    /// The case: a discard that commits while a replay is under way (the
    /// replay waits behind its claim) used to be answered `Discarded` while the
    /// replay went on to enqueue the letter anyway. Now the replay holds the letter
    /// (marked first) and the discard waits for it: a discard answered before the
    /// replay committed means no copy, and one answered after came after the replay.
    #[test]
    fn a_discard_during_a_replay_is_never_followed_by_the_replay() {
        let Some(fx) = PgFixture::new() else { return };
        let s = scene(&fx);
        let mut t = transport(&s);
        let id = dead_letter(&s, &mut t, "k-1");
        let mut blocker = Blocker::claim(&fx, "k-1");
        let replaying = replay(&s, id);
        blocker.wait_for(1, &replaying);
        assert!(!replaying.is_finished(), "the replay waits for the claim");
        let discarding = discard(&s, id);
        blocker.wait_for(2, &discarding);
        let discarded_before_the_replay = discarding.is_finished();
        blocker.release();
        let replayed = replaying.join().unwrap();
        let discarded = discarding.join().unwrap();
        let copies = relay(&s, &mut t);
        assert_eq!(discarded, DiscardOutcome::Discarded);
        if discarded_before_the_replay {
            panic!(
                "the discard was answered while the replay was under way, and the replay \
                 then answered {replayed:?} ({copies} copies relayed)"
            );
        }
        // The discard came second: the replay's copy went out before it.
        assert!(
            matches!(replayed, ReplayOutcome::Replayed { .. }),
            "{replayed:?}"
        );
        assert_eq!(copies, 1);
    }

    /// The discard queues first for the letter, the replay second: the discard
    /// commits, the replay's guard finds the letter discarded. Before the guard the
    /// replay had read "not discarded" and marked it replayed anyway.
    #[test]
    fn a_replay_queued_behind_a_discard_is_refused() {
        let Some(fx) = PgFixture::new() else { return };
        let s = scene(&fx);
        let mut t = transport(&s);
        let id = dead_letter(&s, &mut t, "k-1");
        let mut blocker = Blocker::letter(&fx, id);
        let discarding = discard(&s, id);
        blocker.wait_for(1, &discarding);
        let replaying = replay(&s, id);
        blocker.wait_for(2, &replaying);
        blocker.release();
        let discarded = discarding.join().unwrap();
        let replayed = replaying.join().unwrap();
        assert_eq!(discarded, DiscardOutcome::Discarded);
        assert_eq!(replayed, ReplayOutcome::Discarded);
        assert_eq!(claim_status(&s, "k-1"), ClaimStatus::Dead);
        assert_eq!(relay(&s, &mut t), 0, "nothing was enqueued");
    }

    /// The replay queues first, the discard second: the replay commits (one copy),
    /// then the discard archives the replayed letter.
    #[test]
    fn a_discard_queued_behind_a_replay_comes_after_it() {
        let Some(fx) = PgFixture::new() else { return };
        let s = scene(&fx);
        let mut t = transport(&s);
        let id = dead_letter(&s, &mut t, "k-1");
        let mut blocker = Blocker::letter(&fx, id);
        let replaying = replay(&s, id);
        blocker.wait_for(1, &replaying);
        let discarding = discard(&s, id);
        blocker.wait_for(2, &discarding);
        blocker.release();
        let replayed = replaying.join().unwrap();
        let discarded = discarding.join().unwrap();
        assert!(
            matches!(replayed, ReplayOutcome::Replayed { .. }),
            "{replayed:?}"
        );
        assert_eq!(discarded, DiscardOutcome::Discarded);
        assert_eq!(relay(&s, &mut t), 1, "the replay's one copy");
    }

    /// Two replays of one letter at once: the first marks the letter and waits for
    /// the claim; the second waits for the letter, then finds it replayed. One copy.
    #[test]
    fn two_replays_of_one_letter_at_once_enqueue_one_copy() {
        let Some(fx) = PgFixture::new() else { return };
        let s = scene(&fx);
        let mut t = transport(&s);
        let id = dead_letter(&s, &mut t, "k-1");
        let mut blocker = Blocker::claim(&fx, "k-1");
        let first = replay(&s, id);
        blocker.wait_for(1, &first);
        let second = replay(&s, id);
        blocker.wait_for(2, &second);
        blocker.release();
        let outcomes = [first.join().unwrap(), second.join().unwrap()];
        let won = outcomes
            .iter()
            .filter(|o| matches!(o, ReplayOutcome::Replayed { .. }))
            .count();
        assert_eq!(won, 1, "{outcomes:?}");
        assert_eq!(relay(&s, &mut t), 1);
    }
}
