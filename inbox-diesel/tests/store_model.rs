//! A model-based property test of the claim path: random sequences of batches
//! (duplicates, key collisions, redeliveries, every kind of handler failure) and clock
//! advances, run against a plain in-memory model of the inbox state machine and
//! against the real store, compared after every step: decisions, claim rows, dead
//! letters and effects. A failing case shrinks to a minimal sequence.
//!
//! The model is written from the documented rules (DESIGN section 5, the README's
//! "What it guarantees"), not from the store's code. The backends rightly differ in one
//! place: a database error a handler swallows aborts the transaction on PostgreSQL (a
//! recorded failure) and not on SQLite (the effect commits).
//!
//! `INBOX_PROPTEST_CASES` sets the number of cases per backend (default
//! [`DEFAULT_CASES`]); `INBOX_PROPTEST_SEED` (a number) makes a run reproducible.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::DatabaseErrorKind;
use diesel::sql_types::{BigInt, Text};
use diesel::{PgConnection, SqliteConnection};
use inbox_core::{
    ClaimKey, Clock, DeadLetterReason, Decision, ManualClock, MessageKey, RetryPolicy,
};
use inbox_diesel::{Backend, ClaimStatus, Store, StoreConnection};
use inbox_test_support::{group, usage, Fixture, Outcome, Recorder, TestConn};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

const GROUP: &str = "model.usage";

/// Cases per backend when `INBOX_PROPTEST_CASES` is not set: about a minute for the
/// test binary on a loaded two-core machine, both backends side by side.
const DEFAULT_CASES: u32 = 1000;

/// Keys of a case: few, so that duplicates and in-batch copies are common.
const KEYS: usize = 4;
/// Bodies per key: more than one, so that key collisions happen.
const BODIES: u8 = 2;
/// The retry policy's `max_attempts`: small, so that messages dead-letter.
const MAX_ATTEMPTS: u32 = 3;
/// Not 1 s: that is the store's wait for a delivery that kept conflicting on the
/// store's own statements, which must not pass for a counted attempt.
const INITIAL: Duration = Duration::from_secs(2);
const MAX_DELAY: Duration = Duration::from_secs(6);
/// Free reruns after contention (the store's `transaction_retries`).
const TRANSACTION_RETRIES: u32 = 2;
/// The store's default crash limit: only real crashes reach it, and this test has none.
const CRASH_LIMIT: u32 = 3;

inbox_test_support::on_both_backends!(the_store_behaves_like_the_model);

// ----------------------------------------------------------------------------------
// What a case is made of.

/// What the handler does on one (key, attempt).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Writes its effect, returns `Ok`.
    Apply,
    /// Writes its effect, then fails transiently (the effect must roll back).
    Transient,
    /// Fails permanently.
    Permanent,
    /// Asks to be retried after this many seconds.
    RetryAfter(u64),
    /// Returns a serialization failure, as a statement inside it would have.
    Contention,
    /// Returns a check violation: the message's data, permanent.
    DataError,
    /// Panics.
    Panic,
    /// Writes its effect, runs a failing statement, ignores the error, returns `Ok`.
    Swallow,
}

impl fmt::Debug for Act {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Apply => f.write_str("apply"),
            Self::Transient => f.write_str("transient"),
            Self::Permanent => f.write_str("permanent"),
            Self::RetryAfter(s) => write!(f, "retry-after-{s}s"),
            Self::Contention => f.write_str("contention"),
            Self::DataError => f.write_str("data-error"),
            Self::Panic => f.write_str("panic"),
            Self::Swallow => f.write_str("swallow"),
        }
    }
}

/// One delivery: a key of the case, one of its bodies, the broker's redelivered flag.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Msg {
    key: usize,
    body: u8,
    redelivered: bool,
}

impl Msg {
    fn amount(&self) -> i64 {
        i64::from(self.body) + 1
    }
}

impl fmt::Debug for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "k{}/b{}", self.key, self.body)?;
        if self.redelivered {
            f.write_str(" redelivered")?;
        }
        Ok(())
    }
}

#[derive(Clone)]
enum Step {
    /// One `process_batch` call.
    Batch(Vec<Msg>),
    /// The clock moves on.
    Advance(Duration),
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Batch(msgs) => {
                f.write_str("batch ")?;
                f.debug_list().entries(msgs).finish()
            }
            Self::Advance(d) => write!(f, "advance {d:?}"),
        }
    }
}

#[derive(Clone)]
struct Case {
    /// `acts[key][attempt - 1]`: what the handler does on that key's attempt.
    acts: [[Act; MAX_ATTEMPTS as usize]; KEYS],
    steps: Vec<Step>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Case {{")?;
        for (key, acts) in self.acts.iter().enumerate() {
            // Only what a step can reach, so a shrunk case reads short.
            if self
                .steps
                .iter()
                .any(|s| matches!(s, Step::Batch(m) if m.iter().any(|m| m.key == key)))
            {
                writeln!(f, "    k{key} attempts 1..: {acts:?}")?;
            }
        }
        for (i, step) in self.steps.iter().enumerate() {
            writeln!(f, "    step {i}: {step:?}")?;
        }
        write!(f, "}}")
    }
}

// Boxed: the nested value trees of a debug build would otherwise overflow a test
// thread's stack.
fn act() -> BoxedStrategy<Act> {
    prop_oneof![
        3 => Just(Act::Apply),
        1 => Just(Act::Transient),
        1 => Just(Act::Permanent),
        1 => prop_oneof![Just(0), Just(1), Just(3)].prop_map(Act::RetryAfter),
        1 => Just(Act::Contention),
        1 => Just(Act::DataError),
        1 => Just(Act::Panic),
        2 => Just(Act::Swallow),
    ]
    .boxed()
}

fn msg() -> impl Strategy<Value = Msg> {
    (
        0..KEYS,
        prop_oneof![5 => Just(0u8), 1 => 1..BODIES],
        proptest::bool::weighted(0.25),
    )
        .prop_map(|(key, body, redelivered)| Msg {
            key,
            body,
            redelivered,
        })
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => proptest::collection::vec(msg(), 1..=6).prop_map(Step::Batch),
        1 => prop_oneof![
            Just(Duration::from_millis(500)),
            Just(Duration::from_secs(2)),
            Just(Duration::from_secs(4)),
            Just(Duration::from_secs(10)),
        ]
        .prop_map(Step::Advance),
    ]
}

/// What the handler does on each attempt of one key.
fn acts() -> BoxedStrategy<[Act; MAX_ATTEMPTS as usize]> {
    prop_oneof![
        2 => proptest::array::uniform3(act()),
        // A poison message: the same on every attempt.
        1 => act().prop_map(|a| [a; MAX_ATTEMPTS as usize]),
    ]
    .boxed()
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::array::uniform4(acts()),
        proptest::collection::vec(step(), 1..=16),
    )
        .prop_map(|(acts, steps)| Case { acts, steps })
}

// ----------------------------------------------------------------------------------
// The model: the documented rules, nothing else.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Started,
    Done,
    Failed,
    Dead,
}

#[derive(Clone, Debug)]
struct ModelClaim {
    body: u8,
    status: Status,
    /// Handled failures.
    attempts: u32,
    /// Starts of redelivered processing without an outcome since.
    starts: u32,
    /// When a retry is due (only while one is pending).
    next_attempt_at: Option<DateTime<Utc>>,
}

impl ModelClaim {
    /// The claim's conflict condition: a claim of the same body whose retry is due
    /// (or a start without an outcome) is taken over; anything else is not.
    fn taken_by(&self, m: &Msg, now: DateTime<Utc>) -> bool {
        matches!(self.status, Status::Failed | Status::Started)
            && self.body == m.body
            && self.next_attempt_at.is_none_or(|t| t <= now)
    }
}

/// What a handler call amounts to, once the backend had its say.
enum Call {
    Ok,
    Transient,
    Permanent,
    RetryAfter(Duration),
}

#[derive(Clone)]
struct Model {
    postgres: bool,
    acts: [[Act; MAX_ATTEMPTS as usize]; KEYS],
    now: DateTime<Utc>,
    claims: BTreeMap<usize, ModelClaim>,
    /// (key, body, reason, attempts), in the order written.
    dead_letters: Vec<(usize, u8, &'static str, i32)>,
    /// (key, amount) of every committed effect.
    effects: Vec<(usize, i64)>,
}

impl Model {
    fn new(postgres: bool, acts: [[Act; MAX_ATTEMPTS as usize]; KEYS], now: DateTime<Utc>) -> Self {
        Self {
            postgres,
            acts,
            now,
            claims: BTreeMap::new(),
            dead_letters: Vec::new(),
            effects: Vec::new(),
        }
    }

    /// A batch: rounds in which each key is claimed once. A copy with its round's
    /// owner's body takes the owner's decision (processed becomes a duplicate, a dead
    /// letter becomes already dead-lettered); a copy with another body waits for a
    /// later round and is judged against the stored claim like a delivery of its own.
    fn batch(&mut self, msgs: &[Msg]) -> Vec<Decision> {
        let mut decisions: Vec<Option<Decision>> = vec![None; msgs.len()];
        let mut pending: Vec<usize> = (0..msgs.len()).collect();
        while !pending.is_empty() {
            let mut owner_of: HashMap<usize, usize> = HashMap::new();
            let mut copies = Vec::new();
            let mut later = Vec::new();
            for i in pending {
                match owner_of.get(&msgs[i].key) {
                    None => {
                        owner_of.insert(msgs[i].key, i);
                    }
                    Some(&o) if msgs[o].body == msgs[i].body => copies.push((i, o)),
                    Some(_) => later.push(i),
                }
            }
            let mut owners: Vec<usize> = owner_of.into_values().collect();
            owners.sort_unstable();
            for o in owners {
                decisions[o] = Some(self.deliver(&msgs[o]));
            }
            for (copy, owner) in copies {
                decisions[copy] = decisions[owner].as_ref().map(|d| match d {
                    Decision::Processed | Decision::Duplicate => Decision::Duplicate,
                    Decision::DeadLettered(_) | Decision::AlreadyDeadLettered => {
                        Decision::AlreadyDeadLettered
                    }
                    other => other.clone(),
                });
            }
            pending = later;
        }
        decisions.into_iter().map(Option::unwrap).collect()
    }

    /// One delivery that owns its key in its round.
    fn deliver(&mut self, m: &Msg) -> Decision {
        if m.redelivered {
            if let Some(decision) = self.start(m) {
                return decision;
            }
        }
        let now = self.now;
        let attempts_before = match self.claims.get(&m.key) {
            None => 0,
            Some(c) if c.taken_by(m, now) => c.attempts,
            // Digest first: another body under the key is a collision, whatever the
            // stored claim's state; the stored claim is untouched.
            Some(c) if c.body != m.body => {
                self.dead_letters.push((m.key, m.body, "key_collision", 0));
                return Decision::DeadLettered(DeadLetterReason::KeyCollision);
            }
            Some(c) => {
                return match c.status {
                    Status::Done => Decision::Duplicate,
                    Status::Dead => Decision::AlreadyDeadLettered,
                    Status::Failed | Status::Started => {
                        let due = c.next_attempt_at.unwrap();
                        Decision::RetryAfter((due - now).to_std().unwrap())
                    }
                }
            }
        };
        let act = self.acts[m.key][attempts_before as usize];
        let result = match act {
            Act::Apply => Call::Ok,
            // PostgreSQL aborted the transaction: the call is a recorded failure.
            // SQLite's transaction goes on, and the effect commits.
            Act::Swallow if self.postgres => Call::Transient,
            Act::Swallow => Call::Ok,
            // Contention raised inside the handler reruns for free, then, alone, counts.
            Act::Transient | Act::Panic | Act::Contention => Call::Transient,
            // A data error from a handler does not heal by retrying.
            Act::Permanent | Act::DataError => Call::Permanent,
            Act::RetryAfter(s) => Call::RetryAfter(Duration::from_secs(s)),
        };
        let body = m.body;
        let claim = self.claims.entry(m.key).or_insert(ModelClaim {
            body,
            status: Status::Done,
            attempts: 0,
            starts: 0,
            next_attempt_at: None,
        });
        // Whatever follows is an outcome: no start is left unfinished.
        claim.starts = 0;
        if let Call::Ok = result {
            claim.status = Status::Done;
            claim.next_attempt_at = None;
            self.effects.push((m.key, m.amount()));
            return Decision::Processed;
        }
        claim.attempts = attempts_before + 1;
        let attempts = claim.attempts;
        let outcome = match result {
            Call::Ok => unreachable!(),
            Call::Permanent => Err("permanent"),
            _ if attempts >= MAX_ATTEMPTS => Err("max_attempts"),
            Call::RetryAfter(delay) => Ok(delay),
            Call::Transient => Ok(backoff(attempts)),
        };
        match outcome {
            Ok(delay) => {
                claim.status = Status::Failed;
                claim.next_attempt_at = Some(now + TimeDelta::from_std(delay).unwrap());
                Decision::RetryAfter(delay)
            }
            Err(reason) => {
                claim.status = Status::Dead;
                claim.next_attempt_at = None;
                self.dead_letters
                    .push((m.key, m.body, reason, i32::try_from(attempts).unwrap()));
                Decision::DeadLettered(match reason {
                    "permanent" => DeadLetterReason::Permanent,
                    _ => DeadLetterReason::MaxAttempts,
                })
            }
        }
    }

    /// A redelivery's start mark, under the claim's own conflict condition; too many
    /// unfinished starts end in a `crash_loop` dead letter. `None`: go on as usual.
    fn start(&mut self, m: &Msg) -> Option<Decision> {
        let now = self.now;
        let claim = match self.claims.get_mut(&m.key) {
            None => self.claims.entry(m.key).or_insert(ModelClaim {
                body: m.body,
                status: Status::Started,
                attempts: 0,
                starts: 0,
                next_attempt_at: None,
            }),
            Some(c) if c.taken_by(m, now) => c,
            // A done, dead, colliding or not-yet-due claim takes no mark.
            Some(_) => return None,
        };
        if claim.starts >= CRASH_LIMIT {
            claim.status = Status::Dead;
            claim.starts = 0;
            claim.next_attempt_at = None;
            let attempts = i32::try_from(claim.attempts).unwrap();
            self.dead_letters
                .push((m.key, m.body, "crash_loop", attempts));
            return Some(Decision::DeadLettered(DeadLetterReason::CrashLoop));
        }
        claim.status = Status::Started;
        claim.starts += 1;
        None
    }
}

/// The policy's delay after the n-th failure: `initial * 2^(n-1)`, at most `max`.
fn backoff(attempts: u32) -> Duration {
    (INITIAL * 2u32.pow(attempts - 1)).min(MAX_DELAY)
}

// ----------------------------------------------------------------------------------
// What is compared after every step.

/// A claim row as far as the rules define it.
#[derive(Debug, PartialEq, Eq)]
struct ClaimView {
    status: ClaimStatus,
    attempts: i32,
    /// Compared for claims that are not done. (A done claim keeps the `starts` of
    /// the redelivery that completed it; no rule reads them, and no done claim takes
    /// a mark.)
    starts: Option<i32>,
    /// Compared where a retry is pending (`failed`) or none can be (`dead`: none).
    /// (A done claim keeps the `next_attempt_at` of the failure before it; no rule
    /// reads it.)
    next_attempt_at: Option<DateTime<Utc>>,
    /// The payload is kept only while a retry is pending or a start is unfinished.
    has_payload: bool,
}

#[derive(Debug, PartialEq, Eq)]
struct View {
    claims: BTreeMap<String, ClaimView>,
    /// (key, amount, reason, attempts), sorted: the order of writes inside one batch
    /// is the store's business.
    dead_letters: Vec<(String, i64, String, i32)>,
    /// (key, amount), sorted.
    effects: Vec<(String, i64)>,
}

impl View {
    /// What differs, one line per part: model first, then store.
    fn diff(&self, store: &View) -> String {
        let mut out = String::new();
        let keys: std::collections::BTreeSet<&String> =
            self.claims.keys().chain(store.claims.keys()).collect();
        for key in keys {
            let (m, s) = (self.claims.get(key), store.claims.get(key));
            if m != s {
                out += &format!("  claim {key}\n    model: {m:?}\n    store: {s:?}\n");
            }
        }
        if self.dead_letters != store.dead_letters {
            out += &format!(
                "  dead letters (key, amount, reason, attempts)\n    model: {:?}\n    store: {:?}\n",
                self.dead_letters, store.dead_letters
            );
        }
        if self.effects != store.effects {
            out += &format!(
                "  effects (key, amount)\n    model: {:?}\n    store: {:?}\n",
                self.effects, store.effects
            );
        }
        out
    }
}

fn claim_view(
    status: ClaimStatus,
    attempts: i32,
    starts: i32,
    next_attempt_at: Option<DateTime<Utc>>,
    has_payload: bool,
) -> ClaimView {
    ClaimView {
        status,
        attempts,
        starts: (status != ClaimStatus::Done).then_some(starts),
        next_attempt_at: match status {
            ClaimStatus::Done => None,
            _ => next_attempt_at,
        },
        has_payload,
    }
}

impl Model {
    fn view(&self) -> View {
        let claims = self
            .claims
            .iter()
            .map(|(key, c)| {
                let status = match c.status {
                    Status::Started => ClaimStatus::Started,
                    Status::Done => ClaimStatus::Done,
                    Status::Failed => ClaimStatus::Failed,
                    Status::Dead => ClaimStatus::Dead,
                };
                let view = claim_view(
                    status,
                    i32::try_from(c.attempts).unwrap(),
                    i32::try_from(c.starts).unwrap(),
                    c.next_attempt_at,
                    matches!(c.status, Status::Failed | Status::Started),
                );
                (format!("k{key}"), view)
            })
            .collect();
        let mut dead_letters: Vec<_> = self
            .dead_letters
            .iter()
            .map(|(key, body, reason, attempts)| {
                (
                    format!("k{key}"),
                    i64::from(*body) + 1,
                    (*reason).to_owned(),
                    *attempts,
                )
            })
            .collect();
        dead_letters.sort();
        let mut effects: Vec<_> = self
            .effects
            .iter()
            .map(|(key, amount)| (format!("k{key}"), *amount))
            .collect();
        effects.sort();
        View {
            claims,
            dead_letters,
            effects,
        }
    }
}

/// Reads every effect row.
trait ReadEffects: TestConn {
    fn effects(&mut self) -> QueryResult<Vec<(String, i64)>>;
}

#[derive(QueryableByName)]
struct EffectRow {
    #[diesel(sql_type = Text)]
    message_key: String,
    #[diesel(sql_type = BigInt)]
    amount: i64,
}

macro_rules! read_effects {
    ($conn:ty) => {
        impl ReadEffects for $conn {
            fn effects(&mut self) -> QueryResult<Vec<(String, i64)>> {
                let rows: Vec<EffectRow> = diesel::sql_query(
                    "SELECT message_key, amount FROM effects ORDER BY message_key, amount",
                )
                .load(self)?;
                Ok(rows
                    .into_iter()
                    .map(|r| (r.message_key, r.amount))
                    .collect())
            }
        }
    };
}

read_effects!(PgConnection);
read_effects!(SqliteConnection);

/// A key's name in a case's views: `k0`, `k1`, ... as in the case's steps.
fn label(names: &[String], key: &str) -> String {
    names
        .iter()
        .position(|n| n == key)
        .map_or_else(|| key.to_owned(), |i| format!("k{i}"))
}

fn store_view<C: ReadEffects + StoreConnection>(
    store: &Store<C>,
    side: &mut C,
    names: &[String],
) -> Result<View, TestCaseError> {
    let g = group(GROUP);
    let mut claims = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        let key = ClaimKey::new(g.clone(), MessageKey::new(name.as_str()).unwrap());
        let found = store
            .claim_record(&key)
            .map_err(|e| TestCaseError::fail(format!("reading claim {name}: {e}")))?;
        if let Some(c) = found {
            let view = claim_view(
                c.status,
                c.attempts,
                c.starts,
                c.next_attempt_at,
                c.has_payload,
            );
            claims.insert(format!("k{i}"), view);
        }
    }
    let mut dead_letters: Vec<_> = store
        .dead_letters(&g)
        .map_err(|e| TestCaseError::fail(format!("reading dead letters: {e}")))?
        .into_iter()
        .map(|d| {
            let amount = serde_json::from_slice::<inbox_test_support::Usage>(&d.payload)
                .map_or(-1, |u| u.amount);
            (
                label(names, &d.key),
                amount,
                d.reason.as_str().to_owned(),
                d.attempts,
            )
        })
        .collect();
    dead_letters.sort();
    let effects = side
        .effects()
        .map_err(|e| TestCaseError::fail(format!("reading effects: {e}")))?
        .into_iter()
        .map(|(key, amount)| (label(names, &key), amount))
        .collect();
    Ok(View {
        claims,
        dead_letters,
        effects,
    })
}

// ----------------------------------------------------------------------------------
// The test.

fn outcome(act: Act, swallow_sql: &'static str) -> Outcome {
    match act {
        Act::Apply => Outcome::Apply,
        Act::Transient => Outcome::ApplyThenFail,
        Act::Permanent => Outcome::Permanent,
        Act::RetryAfter(s) => Outcome::RetryAfter(Duration::from_secs(s)),
        Act::Contention => Outcome::DbError(
            DatabaseErrorKind::SerializationFailure,
            "could not serialize access due to concurrent update",
        ),
        Act::DataError => Outcome::DbError(
            DatabaseErrorKind::CheckViolation,
            "new row for relation \"effects\" violates check constraint \"positive\"",
        ),
        Act::Panic => Outcome::Panic,
        Act::Swallow => Outcome::IgnoreSql(swallow_sql),
    }
}

fn cases() -> u32 {
    std::env::var("INBOX_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

fn runner() -> TestRunner {
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    match std::env::var("INBOX_PROPTEST_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
        }
        None => TestRunner::new(config),
    }
}

/// The handlers' panics are expected by the hundred: keep them off stderr, and every
/// other panic on it.
fn quiet_handler_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            if !message.starts_with("handler panicked on ") {
                default(info);
            }
        }));
    });
}

fn the_store_behaves_like_the_model<F: Fixture>(fx: &F)
where
    F::Conn: ReadEffects,
{
    quiet_handler_panics();
    let clock = ManualClock::new("2026-11-30T12:00:00Z".parse().unwrap());
    // What the handler does per (key, attempt), set by each case.
    let acts: Arc<Mutex<HashMap<String, [Act; MAX_ATTEMPTS as usize]>>> = Arc::default();
    let postgres = fx.builder().build().unwrap().backend() == Backend::Postgres;
    // A statement that fails: on PostgreSQL it aborts the transaction, on SQLite not.
    let swallow_sql = if postgres {
        "SELECT 1/0"
    } else {
        "INSERT INTO no_such_table VALUES (1)"
    };
    let table = Arc::clone(&acts);
    let handler = Recorder::new(GROUP)
        .policy(RetryPolicy::new(MAX_ATTEMPTS, INITIAL, MAX_DELAY).unwrap())
        .behaviour(move |key, ctx| {
            let act = table
                .lock()
                .unwrap()
                .get(key)
                .and_then(|a| a.get(usize::try_from(ctx.attempt()).ok()? - 1).copied())
                .unwrap_or(Act::Apply);
            outcome(act, swallow_sql)
        });
    let store = fx
        .builder()
        .clock(Arc::new(clock.clone()))
        .handler(handler)
        .transaction_retries(TRANSACTION_RETRIES)
        .crash_limit(CRASH_LIMIT)
        .build()
        .unwrap();
    let side = std::cell::RefCell::new(fx.connect());
    side.borrow_mut().create_effects().unwrap();
    let g = group(GROUP);
    static CASE: AtomicU64 = AtomicU64::new(0);
    // Steps the known disagreement explained.

    let started = Instant::now();
    let mut runner = runner();
    let result = runner.run(&case(), |case| {
        // Each case starts from empty tables and has keys no other case used.
        side.borrow_mut()
            .batch_execute(
                "DELETE FROM inbox_claims; DELETE FROM inbox_dead_letters; DELETE FROM effects",
            )
            .map_err(|e| TestCaseError::fail(format!("clearing the tables: {e}")))?;
        let n = CASE.fetch_add(1, Ordering::Relaxed);
        let names: Vec<String> = (0..KEYS).map(|k| format!("case{n}.k{k}")).collect();
        {
            let mut table = acts.lock().unwrap();
            table.clear();
            for (name, a) in names.iter().zip(case.acts) {
                table.insert(name.clone(), a);
            }
        }
        let mut model = Model::new(postgres, case.acts, clock.now());
        for (i, step) in case.steps.iter().enumerate() {
            match step {
                Step::Advance(by) => {
                    clock.advance(*by);
                    model.now += TimeDelta::from_std(*by).unwrap();
                }
                Step::Batch(msgs) => {
                    let batch: Vec<_> = msgs
                        .iter()
                        .map(|m| {
                            let env = usage(&names[m.key], m.amount());
                            if m.redelivered {
                                env.redelivered()
                            } else {
                                env
                            }
                        })
                        .collect();
                    let found = store.process_batch(&g, &batch).map_err(|e| {
                        TestCaseError::fail(format!("step {i}: process_batch failed: {e}"))
                    })?;
                    let expected = model.batch(msgs);
                    if found != expected {
                        return Err(TestCaseError::fail(format!(
                            "step {i}: decisions differ\n  model: {expected:?}\n  store: {found:?}"
                        )));
                    }
                }
            }
            let expected = model.view();
            let found = store_view(&store, &mut side.borrow_mut(), &names)?;
            if found != expected {
                return Err(TestCaseError::fail(format!(
                    "step {i}: state differs\n{}",
                    expected.diff(&found)
                )));
            }
        }
        Ok(())
    });
    let backend = if postgres { "postgres" } else { "sqlite" };
    eprintln!(
        "{backend}: {} model cases in {:.1} s",
        cases(),
        started.elapsed().as_secs_f64(),
    );
    if let Err(err) = result {
        panic!("{backend}: the store and the model disagree: {err}");
    }
}
