//! Idempotency keys of requests on both backends: one execution per key, a committed
//! request never executed again, leases fenced by their token, bounded purges, and
//! the unique index verified at startup.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::idempotency::{
    Fingerprint, IdempotencyAnswer, IdempotencyKey, IdempotencyStatus, LeaseToken, RequestFields,
    Settlement,
};
use inbox_core::{Clock, ManualClock};
use inbox_diesel::idempotency::{
    abandon_request, begin_request, commit_request, purge_requests, read_request,
    refund_delivered_request, settle_request, NewRequest,
};
use inbox_diesel::{Error, SchemaProblem, Store};
use inbox_test_support::{Fixture, PgFixture, SqliteFixture};

const LEASE: Duration = Duration::from_secs(30);

fn start() -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(1_900_000_000, 0).unwrap()
}

fn fingerprint(text: &str, secret: &[u8]) -> Fingerprint {
    RequestFields::new()
        .field("text", text)
        .unwrap()
        .field("model", "standard")
        .unwrap()
        .fingerprint(secret)
}

struct Env<C: inbox_test_support::FullConnection> {
    store: Store<C>,
    clock: Arc<ManualClock>,
}

fn env<F: Fixture>(fx: &F) -> Env<F::Conn> {
    let clock = Arc::new(ManualClock::new(start()));
    let store = fx.builder().clock(clock.clone()).build().unwrap();
    Env { store, clock }
}

impl<C: inbox_test_support::FullConnection> Env<C> {
    fn begin(&self, caller: &str, key: &IdempotencyKey, fp: &Fingerprint) -> IdempotencyAnswer {
        let now = self.clock.now();
        let mut conn = self.store.connection().unwrap();
        let request = NewRequest {
            caller,
            key,
            fingerprint: fp,
            lease_until: now + TimeDelta::from_std(LEASE).unwrap(),
        };
        begin_request(&mut *conn, &request, now).unwrap()
    }

    /// Begins, commits and settles (refunded) `n` requests of caller `a`, keys
    /// `settled-0` .. `settled-{n-1}`.
    fn settled_requests(&self, n: usize, fp: &Fingerprint) {
        for i in 0..n {
            let k = key(&format!("settled-{i}"));
            let IdempotencyAnswer::Execute { token } = self.begin("a", &k, fp) else {
                panic!("executes");
            };
            self.commit("a", &k, token).unwrap();
            assert!(self.settle("a", &k, token, &Settlement::Refunded));
        }
    }

    fn commit(&self, caller: &str, key: &IdempotencyKey, token: LeaseToken) -> Result<(), Error> {
        let mut conn = self.store.connection().unwrap();
        commit_request(&mut *conn, caller, key, token, self.clock.now())
    }

    fn settle(
        &self,
        caller: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        s: &Settlement,
    ) -> bool {
        let mut conn = self.store.connection().unwrap();
        settle_request(&mut *conn, caller, key, token, s, self.clock.now()).unwrap()
    }
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new(k).unwrap()
}

fn a_committed_request_is_in_flight_until_settled_whatever_its_lease<F: Fixture>(fx: &F) {
    let env = env(fx);
    let (k, fp) = (key("req-1"), fingerprint("hello", b"api-key-1"));
    let IdempotencyAnswer::Execute { token } = env.begin("acct-1", &k, &fp) else {
        panic!("the first request executes");
    };
    assert_eq!(env.begin("acct-1", &k, &fp), IdempotencyAnswer::InFlight);
    env.commit("acct-1", &k, token).unwrap();
    // Long past its lease: a committed request is never executed again.
    env.clock.advance(LEASE * 10);
    assert_eq!(env.begin("acct-1", &k, &fp), IdempotencyAnswer::InFlight);
    let stored = inbox_diesel::idempotency::request_record(&env.store, "acct-1", &k)
        .unwrap()
        .unwrap();
    assert_eq!(stored.status, IdempotencyStatus::InFlight);
    assert!(stored.committed_at.is_some());
    let body = b"{\"type\":\"done\"}\n".to_vec();
    let delivered = Settlement::Delivered {
        response: body.clone(),
    };
    assert!(env.settle("acct-1", &k, token, &delivered));
    assert_eq!(
        env.begin("acct-1", &k, &fp),
        IdempotencyAnswer::Replay { response: body }
    );
    // Settled once: a second settlement (a refund racing the delivery) writes nothing.
    assert!(!env.settle("acct-1", &k, token, &Settlement::Refunded));
    // Other content, or the same content under another credential: a mismatch.
    assert_eq!(
        env.begin("acct-1", &k, &fingerprint("other", b"api-key-1")),
        IdempotencyAnswer::Mismatch
    );
    assert_eq!(
        env.begin("acct-1", &k, &fingerprint("hello", b"api-key-2")),
        IdempotencyAnswer::Mismatch
    );
    // The key is the caller's: another caller's same key is another request.
    assert!(matches!(
        env.begin("acct-2", &k, &fp),
        IdempotencyAnswer::Execute { .. }
    ));
}

fn an_expired_lease_frees_only_an_uncommitted_key_and_fences_the_first<F: Fixture>(fx: &F) {
    let env = env(fx);
    let (k, fp) = (key("req-2"), fingerprint("hello", b"secret"));
    let IdempotencyAnswer::Execute { token: first } = env.begin("a", &k, &fp) else {
        panic!("the first request executes");
    };
    env.clock.advance(LEASE - Duration::from_secs(1));
    assert_eq!(env.begin("a", &k, &fp), IdempotencyAnswer::InFlight);
    env.clock.advance(Duration::from_secs(1));
    // Another fingerprint never takes a key over.
    assert_eq!(
        env.begin("a", &k, &fingerprint("other", b"secret")),
        IdempotencyAnswer::Mismatch
    );
    let IdempotencyAnswer::Execute { token: second } = env.begin("a", &k, &fp) else {
        panic!("the lease ran out before any commit: the key is free");
    };
    // A new token, not the next number: a token never repeats for a key.
    assert_ne!(second, first);
    // The first request's late commit is fenced off: it must roll its debit back.
    match env.commit("a", &k, first) {
        Err(Error::Fenced { token, .. }) => assert_eq!(token, first),
        other => panic!("expected a fenced commit, got {other:?}"),
    }
    assert!(!env.settle("a", &k, first, &Settlement::Refunded));
    env.commit("a", &k, second).unwrap();
    assert!(env.settle("a", &k, second, &Settlement::Refunded));
    assert_eq!(env.begin("a", &k, &fp), IdempotencyAnswer::Refunded);
}

fn a_request_refused_before_its_commit_gives_its_key_back<F: Fixture>(fx: &F) {
    let env = env(fx);
    let (k, fp) = (key("req-3"), fingerprint("hello", b"secret"));
    let IdempotencyAnswer::Execute { token } = env.begin("a", &k, &fp) else {
        panic!("executes");
    };
    let mut conn = env.store.connection().unwrap();
    assert!(!abandon_request(&mut *conn, "a", &k, LeaseToken::random()).unwrap());
    assert!(abandon_request(&mut *conn, "a", &k, token).unwrap());
    assert_eq!(read_request(&mut *conn, "a", &k).unwrap(), None);
    drop(conn);
    let IdempotencyAnswer::Execute { token } = env.begin("a", &k, &fp) else {
        panic!("the key was given back");
    };
    env.commit("a", &k, token).unwrap();
    let mut conn = env.store.connection().unwrap();
    // A committed record is never given back.
    assert!(!abandon_request(&mut *conn, "a", &k, token).unwrap());
    drop(conn);
    // Unsettled, a commit mark cannot be made twice either.
    assert!(env.commit("a", &k, token).is_err());
}

fn a_delivered_request_refunded_later_answers_refunded<F: Fixture>(fx: &F) {
    let env = env(fx);
    let (k, fp) = (key("req-4"), fingerprint("hello", b"secret"));
    let IdempotencyAnswer::Execute { token } = env.begin("a", &k, &fp) else {
        panic!("executes");
    };
    let mut conn = env.store.connection().unwrap();
    let now = env.clock.now();
    // Not delivered yet: nothing to refund this way.
    commit_request(&mut *conn, "a", &k, token, now).unwrap();
    assert!(!refund_delivered_request(&mut *conn, "a", &k, token, now).unwrap());
    let body = Settlement::Delivered {
        response: b"line\n".to_vec(),
    };
    assert!(settle_request(&mut *conn, "a", &k, token, &body, now).unwrap());
    assert!(!refund_delivered_request(&mut *conn, "a", &k, LeaseToken::random(), now).unwrap());
    assert!(refund_delivered_request(&mut *conn, "a", &k, token, now).unwrap());
    assert!(!refund_delivered_request(&mut *conn, "a", &k, token, now).unwrap());
    let stored = read_request(&mut *conn, "a", &k).unwrap().unwrap();
    assert_eq!(
        (stored.status, stored.response),
        (IdempotencyStatus::Refunded, None)
    );
    drop(conn);
    assert_eq!(env.begin("a", &k, &fp), IdempotencyAnswer::Refunded);
}

fn purges_are_bounded_and_keep_unsettled_commits<F: Fixture>(fx: &F) {
    let env = env(fx);
    let fp = fingerprint("x", b"s");
    env.settled_requests(5, &fp);
    let open = key("committed-unsettled");
    let IdempotencyAnswer::Execute { token } = env.begin("a", &open, &fp) else {
        panic!("executes");
    };
    env.commit("a", &open, token).unwrap();
    let died = key("died-before-commit");
    assert!(matches!(
        env.begin("a", &died, &fp),
        IdempotencyAnswer::Execute { .. }
    ));
    let day = inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION;
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 2).unwrap(),
        0
    );
    env.clock.advance(day + LEASE + Duration::from_secs(1));
    assert!(matches!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 0),
        Err(Error::InvalidSetting {
            setting: "batch",
            ..
        })
    ));
    // The dry-run count is what the purge then deletes: the settled records and the
    // one that died before its commit, never the committed, unsettled one.
    assert_eq!(
        inbox_diesel::idempotency::count_expired_requests(&env.store, day).unwrap(),
        6
    );
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 2).unwrap(),
        6
    );
    assert_eq!(
        inbox_diesel::idempotency::count_expired_requests(&env.store, day).unwrap(),
        0
    );
    assert!(
        inbox_diesel::idempotency::request_record(&env.store, "a", &open)
            .unwrap()
            .is_some()
    );
    assert!(
        inbox_diesel::idempotency::request_record(&env.store, "a", &died)
            .unwrap()
            .is_none()
    );
    // A replay after the purge executes as a new request.
    assert!(matches!(
        env.begin("a", &key("settled-0"), &fp),
        IdempotencyAnswer::Execute { .. }
    ));
}

fn concurrent_requests_with_one_key_execute_once<F: Fixture>(fx: &F) {
    let env = Arc::new(env(fx));
    let k = key("burst");
    let fp = fingerprint("hello", b"secret");
    let answers: Vec<IdempotencyAnswer> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|_| {
                let env = Arc::clone(&env);
                let (k, fp) = (k.clone(), fp);
                s.spawn(move || env.begin("a", &k, &fp))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let executed = answers
        .iter()
        .filter(|a| matches!(a, IdempotencyAnswer::Execute { .. }))
        .count();
    assert_eq!(executed, 1, "{answers:?}");
    assert!(answers.iter().all(|a| matches!(
        a,
        IdempotencyAnswer::Execute { .. } | IdempotencyAnswer::InFlight
    )));
}

fn no_stored_column_holds_the_secret_or_the_request<F: Fixture>(fx: &F) {
    let env = env(fx);
    let k = key("secret-check");
    let secret = b"mk_raw_api_key_never_stored";
    let fp = fingerprint("the text sent", secret);
    assert!(matches!(
        env.begin("a", &k, &fp),
        IdempotencyAnswer::Execute { .. }
    ));
    let stored = inbox_diesel::idempotency::request_record(&env.store, "a", &k)
        .unwrap()
        .unwrap();
    // The store keeps the HMAC only: recomputing it needs the secret.
    assert_eq!(stored.fingerprint, fp);
    assert_ne!(stored.fingerprint, fingerprint("the text sent", b""));
    assert!(stored.response.is_none());
}

/// Issue 21, item 2 (the abandon path): request A stalls past its lease, B takes the
/// key over and is refused (abandons), C begins afresh with other content. A's late
/// commit must not land on C's record: a token never repeats for a key.
fn a_late_commit_never_lands_on_a_record_begun_after_an_abandon<F: Fixture>(fx: &F) {
    let env = env(fx);
    let k = key("aba-abandon");
    let (fp_a, fp_c) = (fingerprint("A", b"s"), fingerprint("C", b"s"));
    let IdempotencyAnswer::Execute { token: a } = env.begin("a", &k, &fp_a) else {
        panic!("A executes");
    };
    env.clock.advance(LEASE);
    let IdempotencyAnswer::Execute { token: b } = env.begin("a", &k, &fp_a) else {
        panic!("B takes the expired key over");
    };
    let mut conn = env.store.connection().unwrap();
    assert!(abandon_request(&mut *conn, "a", &k, b).unwrap());
    drop(conn);
    let IdempotencyAnswer::Execute { token: c } = env.begin("a", &k, &fp_c) else {
        panic!("C begins afresh");
    };
    println!("tokens: a={a:?} b={b:?} c={c:?}");
    match env.commit("a", &k, a) {
        Err(Error::Fenced { .. }) => {}
        other => panic!("A's late commit landed on C's record: {other:?}"),
    }
    assert_ne!(c, a, "C was handed A's token again");
    assert!(!env.settle(
        "a",
        &k,
        a,
        &Settlement::Delivered {
            response: b"A's body".to_vec()
        }
    ));
    // C's record is C's: it commits, settles, and its replays get C's response.
    env.commit("a", &k, c).unwrap();
    let body = b"C's body".to_vec();
    assert!(env.settle(
        "a",
        &k,
        c,
        &Settlement::Delivered {
            response: body.clone()
        }
    ));
    assert_eq!(
        env.begin("a", &k, &fp_c),
        IdempotencyAnswer::Replay { response: body }
    );
}

/// Issue 21, item 2 (the purge path): A stalls, its expired, uncommitted record is
/// purged a day later, C begins afresh with other content; A's late commit, settle
/// and abandon must not touch C's record.
fn a_late_commit_never_lands_on_a_record_begun_after_a_purge<F: Fixture>(fx: &F) {
    let env = env(fx);
    let k = key("aba-purge");
    let (fp_a, fp_c) = (fingerprint("A", b"s"), fingerprint("C", b"s"));
    let IdempotencyAnswer::Execute { token: a } = env.begin("a", &k, &fp_a) else {
        panic!("A executes");
    };
    let day = inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION;
    env.clock.advance(day + LEASE + Duration::from_secs(1));
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 10).unwrap(),
        1
    );
    let IdempotencyAnswer::Execute { token: c } = env.begin("a", &k, &fp_c) else {
        panic!("C begins afresh");
    };
    println!("tokens: a={a:?} c={c:?}");
    let mut conn = env.store.connection().unwrap();
    assert!(!abandon_request(&mut *conn, "a", &k, a).unwrap());
    drop(conn);
    match env.commit("a", &k, a) {
        Err(Error::Fenced { .. }) => {}
        other => panic!("A's late commit landed on C's record: {other:?}"),
    }
    assert_ne!(c, a, "C was handed A's token again");
    let stored = inbox_diesel::idempotency::request_record(&env.store, "a", &k)
        .unwrap()
        .unwrap();
    assert_eq!(stored.fingerprint, fp_c);
    assert_eq!(stored.lease_token, c);
    assert!(stored.committed_at.is_none(), "C's record was marked by A");
    env.commit("a", &k, c).unwrap();
}

/// Two writers of one record, forced to meet. On PostgreSQL `first` runs in an open
/// transaction on one connection, `second` on another while it is open; once
/// `second` waits on a lock `first` holds (or has returned without waiting),
/// `first` commits. SQLite has one writer (every store write is an immediate
/// transaction): `second`'s cannot start while `first`'s is open, so the race there
/// is `first` committed, then `second`: the same order, which the test checks.
trait Interleave: Fixture {
    fn interleave<T: Send>(
        &self,
        first: impl FnOnce(&mut Self::Conn) + Send,
        second: impl FnOnce(&mut Self::Conn) -> T + Send,
    ) -> T;
}

#[derive(diesel::QueryableByName)]
struct Pid {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

#[derive(diesel::QueryableByName)]
struct Waits {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    waits: bool,
}

impl Interleave for PgFixture {
    fn interleave<T: Send>(
        &self,
        first: impl FnOnce(&mut PgConnection) + Send,
        second: impl FnOnce(&mut PgConnection) -> T + Send,
    ) -> T {
        use diesel::prelude::*;
        let mut a = self.connect();
        let mut b = self.connect();
        let pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
            .get_result::<Pid>(&mut b)
            .unwrap()
            .pid;
        let (held_tx, held_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let holder = s.spawn(move || {
                a.transaction(|a| {
                    first(a);
                    held_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok::<_, diesel::result::Error>(())
                })
                .unwrap();
            });
            held_rx.recv().unwrap();
            let runner = s.spawn(move || second(&mut b));
            let mut watch = self.connect();
            let deadline = Instant::now() + Duration::from_secs(30);
            // Wait for a state, not for a time: `second` blocked on a lock, or done.
            loop {
                let waits = diesel::sql_query(
                    "SELECT COALESCE(bool_or(wait_event_type = 'Lock'), false) AS waits \
                     FROM pg_stat_activity WHERE pid = $1",
                )
                .bind::<diesel::sql_types::Integer, _>(pid)
                .get_result::<Waits>(&mut watch)
                .unwrap()
                .waits;
                if waits || runner.is_finished() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the second writer neither waited nor ended"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            release_tx.send(()).unwrap();
            holder.join().unwrap();
            runner.join().unwrap()
        })
    }
}

impl Interleave for SqliteFixture {
    fn interleave<T: Send>(
        &self,
        first: impl FnOnce(&mut SqliteConnection) + Send,
        second: impl FnOnce(&mut SqliteConnection) -> T + Send,
    ) -> T {
        // Each store write is its own immediate transaction: committed on return.
        first(&mut self.connect());
        second(&mut self.connect())
    }
}

/// A record of `key` whose request (token returned) has let its lease run out.
fn expired<C: inbox_test_support::FullConnection>(
    env: &Env<C>,
    k: &IdempotencyKey,
    fp: &Fingerprint,
) -> LeaseToken {
    let IdempotencyAnswer::Execute { token } = env.begin("a", k, fp) else {
        panic!("the first request executes");
    };
    env.clock.advance(LEASE);
    token
}

fn begin_on<C: inbox_test_support::FullConnection>(
    conn: &mut C,
    env: &Env<C>,
    k: &IdempotencyKey,
    fp: &Fingerprint,
) -> IdempotencyAnswer {
    let now = env.clock.now();
    let request = NewRequest {
        caller: "a",
        key: k,
        fingerprint: fp,
        lease_until: now + TimeDelta::from_std(LEASE).unwrap(),
    };
    begin_request(conn, &request, now).unwrap()
}

/// Two begins of one key: the second waits on the unique index for the first, then
/// finds the key taken (in flight; other content: mismatch), never executes too.
fn two_begins_of_one_key_execute_one<F: Interleave>(fx: &F) {
    let env = env(fx);
    let k = key("race-begin");
    let fp = fingerprint("x", b"s");
    let first = std::sync::Mutex::new(None);
    let second = fx.interleave(
        |a| *first.lock().unwrap() = Some(begin_on(a, &env, &k, &fp)),
        |b| begin_on(b, &env, &k, &fp),
    );
    assert!(matches!(
        first.into_inner().unwrap(),
        Some(IdempotencyAnswer::Execute { .. })
    ));
    assert_eq!(second, IdempotencyAnswer::InFlight);
    // The same after an expiry: two take-overs of one key, one wins.
    env.clock.advance(LEASE);
    let first = std::sync::Mutex::new(None);
    let second = fx.interleave(
        |a| *first.lock().unwrap() = Some(begin_on(a, &env, &k, &fp)),
        |b| begin_on(b, &env, &k, &fp),
    );
    assert!(matches!(
        first.into_inner().unwrap(),
        Some(IdempotencyAnswer::Execute { .. })
    ));
    assert_eq!(second, IdempotencyAnswer::InFlight);
}

/// A late commit holds the row when a take-over comes: the take-over waits, sees the
/// commit mark and answers in flight; the committed request is never run twice.
fn a_commit_ahead_of_a_takeover_keeps_the_key<F: Interleave>(fx: &F) {
    let env = env(fx);
    let k = key("race-commit-first");
    let fp = fingerprint("x", b"s");
    let a = expired(&env, &k, &fp);
    let now = env.clock.now();
    let second = fx.interleave(
        |c| commit_request(c, "a", &k, a, now).unwrap(),
        |c| begin_on(c, &env, &k, &fp),
    );
    assert_eq!(second, IdempotencyAnswer::InFlight);
    let stored = inbox_diesel::idempotency::request_record(&env.store, "a", &k)
        .unwrap()
        .unwrap();
    assert_eq!(stored.lease_token, a);
    assert!(stored.committed_at.is_some());
}

/// A take-over holds the row when the first request's late commit comes: the commit
/// waits, finds another token and is fenced; the new request's record is untouched.
fn a_takeover_ahead_of_a_late_commit_fences_it<F: Interleave>(fx: &F) {
    let env = env(fx);
    let k = key("race-takeover-first");
    let fp = fingerprint("x", b"s");
    let a = expired(&env, &k, &fp);
    let now = env.clock.now();
    let taken = std::sync::Mutex::new(None);
    let late = fx.interleave(
        |c| *taken.lock().unwrap() = Some(begin_on(c, &env, &k, &fp)),
        |c| commit_request(c, "a", &k, a, now),
    );
    assert!(
        matches!(late, Err(Error::Fenced { token, .. }) if token == a),
        "{late:?}"
    );
    let Some(IdempotencyAnswer::Execute { token: b }) = taken.into_inner().unwrap() else {
        panic!("the take-over executes");
    };
    let stored = inbox_diesel::idempotency::request_record(&env.store, "a", &k)
        .unwrap()
        .unwrap();
    assert_eq!((stored.lease_token, stored.committed_at), (b, None));
}

/// A take-over holds the row when the first request abandons: the abandon waits,
/// finds another token and deletes nothing. The other order: the abandon deletes,
/// the take-over's insert waits for it and then begins a record of its own, which
/// the first request's token can no longer touch.
fn an_abandon_racing_a_takeover_never_deletes_the_new_lease<F: Interleave>(fx: &F) {
    let env = env(fx);
    let k = key("race-abandon");
    let fp = fingerprint("x", b"s");
    let a = expired(&env, &k, &fp);
    let taken = std::sync::Mutex::new(None);
    let abandoned = fx.interleave(
        |c| *taken.lock().unwrap() = Some(begin_on(c, &env, &k, &fp)),
        |c| abandon_request(c, "a", &k, a).unwrap(),
    );
    assert!(
        !abandoned,
        "the first request's abandon deleted the take-over's record"
    );
    let Some(IdempotencyAnswer::Execute { token: b }) = taken.into_inner().unwrap() else {
        panic!("the take-over executes");
    };
    assert_eq!(
        inbox_diesel::idempotency::request_record(&env.store, "a", &k)
            .unwrap()
            .unwrap()
            .lease_token,
        b
    );

    let k = key("race-abandon-first");
    let a = expired(&env, &k, &fp);
    let second = fx.interleave(
        |c| assert!(abandon_request(c, "a", &k, a).unwrap()),
        |c| begin_on(c, &env, &k, &fp),
    );
    let IdempotencyAnswer::Execute { token: c } = second else {
        panic!("the key was given back: {second:?}");
    };
    assert_ne!(c, a);
    assert!(matches!(env.commit("a", &k, a), Err(Error::Fenced { .. })));
    env.commit("a", &k, c).unwrap();
}

/// A purge racing a late commit. The commit first: the purge passes the row by (on
/// PostgreSQL it skips the locked row; after the commit it is committed and kept
/// until settled). The purge first: the commit waits, finds no record and is
/// fenced; a new request under the key then begins a record the late one cannot touch.
fn a_purge_racing_a_late_commit_never_loses_a_committed_request<F: Interleave>(fx: &F) {
    let env = env(fx);
    let day = inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION;
    let fp = fingerprint("x", b"s");
    let k = key("race-purge-commit-first");
    let IdempotencyAnswer::Execute { token: a } = env.begin("a", &k, &fp) else {
        panic!("executes");
    };
    env.clock.advance(day + LEASE + Duration::from_secs(1));
    let now = env.clock.now();
    let purged = fx.interleave(
        |c| commit_request(c, "a", &k, a, now).unwrap(),
        |c| purge_requests(c, day, 10, now).unwrap(),
    );
    assert_eq!(purged, 0);
    // Committed, the record is kept by every later purge until it is settled.
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 10).unwrap(),
        0
    );
    let stored = inbox_diesel::idempotency::request_record(&env.store, "a", &k)
        .unwrap()
        .unwrap();
    assert!(
        stored.committed_at.is_some(),
        "a committed request lost its record"
    );

    let k = key("race-purge-first");
    let IdempotencyAnswer::Execute { token: a } = env.begin("a", &k, &fp) else {
        panic!("executes");
    };
    env.clock.advance(day + LEASE + Duration::from_secs(1));
    let now = env.clock.now();
    let late = fx.interleave(
        |c| assert_eq!(purge_requests(c, day, 10, now).unwrap(), 1),
        |c| commit_request(c, "a", &k, a, now),
    );
    assert!(matches!(late, Err(Error::Fenced { .. })), "{late:?}");
    let IdempotencyAnswer::Execute { token: c } = env.begin("a", &k, &fingerprint("other", b"s"))
    else {
        panic!("the purged key is free");
    };
    assert!(matches!(env.commit("a", &k, a), Err(Error::Fenced { .. })));
    env.commit("a", &k, c).unwrap();
}

fn a_wrong_idempotency_index_is_refused_at_startup<F: Fixture>(fx: &F, sabotage: &str) {
    env(fx); // migrations run, the schema passes
    fx.execute(sabotage);
    match fx.builder().build() {
        Err(Error::SchemaMismatch {
            part: inbox_diesel::SchemaPart::Idempotency,
            problem,
            found,
            ..
        }) => {
            assert_eq!(problem, SchemaProblem::NoClaimIndex, "{found}");
            assert!(
                found.contains("unique (idempotency_key) [by_key]"),
                "{found}"
            );
        }
        other => panic!("expected an idempotency index mismatch, got {other:?}"),
    }
    let unchecked = fx.builder().build_unchecked().unwrap();
    assert!(matches!(
        unchecked.verify_schema(),
        Err(Error::SchemaMismatch {
            part: inbox_diesel::SchemaPart::Idempotency,
            ..
        })
    ));
}

const SQLITE_SABOTAGE: &str = "DROP TABLE idempotency_keys; CREATE TABLE idempotency_keys (
    caller TEXT NOT NULL, idempotency_key TEXT NOT NULL, fingerprint BLOB NOT NULL,
    status TEXT NOT NULL, lease_token INTEGER NOT NULL, lease_until TEXT NOT NULL,
    committed_at TEXT, response BLOB, created_at TEXT NOT NULL, updated_at TEXT NOT NULL);
    CREATE UNIQUE INDEX by_key ON idempotency_keys (idempotency_key);";

const PG_SABOTAGE: &str = "ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
    CREATE UNIQUE INDEX by_key ON idempotency_keys (idempotency_key);";

inbox_test_support::on_both_backends!(
    a_committed_request_is_in_flight_until_settled_whatever_its_lease,
    an_expired_lease_frees_only_an_uncommitted_key_and_fences_the_first,
    a_request_refused_before_its_commit_gives_its_key_back,
    a_delivered_request_refunded_later_answers_refunded,
    purges_are_bounded_and_keep_unsettled_commits,
    concurrent_requests_with_one_key_execute_once,
    no_stored_column_holds_the_secret_or_the_request,
    a_late_commit_never_lands_on_a_record_begun_after_an_abandon,
    a_late_commit_never_lands_on_a_record_begun_after_a_purge,
    two_begins_of_one_key_execute_one,
    a_commit_ahead_of_a_takeover_keeps_the_key,
    a_takeover_ahead_of_a_late_commit_fences_it,
    an_abandon_racing_a_takeover_never_deletes_the_new_lease,
    a_purge_racing_a_late_commit_never_loses_a_committed_request,
);

#[test]
fn postgres_refuses_a_wrong_idempotency_index() {
    if let Some(fx) = PgFixture::new() {
        a_wrong_idempotency_index_is_refused_at_startup(&fx, PG_SABOTAGE);
    }
}

#[test]
fn sqlite_refuses_a_wrong_idempotency_index() {
    a_wrong_idempotency_index_is_refused_at_startup(&SqliteFixture::new(), SQLITE_SABOTAGE);
}

/// The idempotency purge is the retention purge: one purge of the table at a time.
/// Another instance's purge holds the table's purge lock: a second purge stops at
/// once and deletes nothing; once the lock is free, it takes every expired record,
/// batch after batch (a batch of 1 resumes where the previous one stopped).
#[test]
fn postgres_an_idempotency_purge_that_finds_another_running_leaves_the_records_to_it() {
    use diesel::connection::SimpleConnection;
    use inbox_diesel::PURGE_LOCK_CLASS;
    let Some(fx) = PgFixture::new() else { return };
    let env = env(&fx);
    let fp = fingerprint("x", b"s");
    env.settled_requests(5, &fp);
    let day = inbox_core::idempotency::DEFAULT_IDEMPOTENCY_RETENTION;
    env.clock.advance(day + LEASE + Duration::from_secs(1));
    let mut other = fx.connect();
    let lock = format!("({PURGE_LOCK_CLASS}, 'idempotency_keys'::regclass::oid::int4)");
    other
        .batch_execute(&format!("SELECT pg_advisory_lock{lock}"))
        .unwrap();
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 1).unwrap(),
        0,
        "a second purge stops at once"
    );
    let kept = (0..5)
        .filter(|i| {
            let k = key(&format!("settled-{i}"));
            inbox_diesel::idempotency::request_record(&env.store, "a", &k)
                .unwrap()
                .is_some()
        })
        .count();
    assert_eq!(kept, 5, "and deletes nothing");
    other
        .batch_execute(&format!("SELECT pg_advisory_unlock{lock}"))
        .unwrap();
    assert_eq!(
        inbox_diesel::idempotency::purge_expired_requests(&env.store, day, 1).unwrap(),
        5
    );
}
