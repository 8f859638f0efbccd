//! The lifecycle model test's generator and driver: a case's steps run against the
//! model ([`model`]) and the real store, and everything the rules define is compared
//! after every step.

pub(crate) mod model;
pub(crate) mod seams;
pub(crate) mod world;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeDelta, Utc};
use inbox_core::idempotency::{
    Fingerprint, IdempotencyAnswer, IdempotencyKey, IdempotencyStatus, RequestFields, Settlement,
};
use inbox_core::{
    ClaimInvariantViolated, ClaimKey, ConsumerGroup, GroupHalts, ManualClock, MessageKey,
    OutboxMessage, OutboxStore,
};
use inbox_diesel::idempotency::{
    abandon_request, begin_request, commit_request, read_request, refund_delivered_request,
    settle_request, NewRequest,
};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{
    DeadLetterFilter, LetterStatus, RedriveFilter, ReplayOutcome, ReplayTarget,
};
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::{enqueue, Backend, ClaimStatus, Error, Retention, Store};
use inbox_test_support::Fixture;
use proptest::prelude::*;
use proptest::strategy::Union;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use model::{Case, Idem, IdemStatus, Model, Out, Replay, Step, EVENTS};
use world::{Act, Acts, LcDb, Projection, Recorded, GROUP, MAX_ATTEMPTS, MAX_DELAY, PROJECTION};

/// Cases per backend when `INBOX_MODEL_CASES` is not set: together with the forced
/// interleavings, about a minute for both backends on a loaded two-core machine.
pub(crate) const DEFAULT_CASES: u32 = 40;

/// The idempotency lease token, as `begin_request` hands it out. Opaque: the test
/// only stores tokens and compares them for equality (issue 21 makes it a random
/// 128-bit type; change this alias, and nothing else, at that merge).
pub(crate) type Token = inbox_core::idempotency::LeaseToken;

// ----------------------------------------------------------------------------------
// The generator: small alphabets, so that shrinking finds short cases.

fn act() -> BoxedStrategy<Act> {
    prop_oneof![
        2 => Just(Act::Apply),
        2 => Just(Act::Transient),
        1 => Just(Act::Permanent),
        1 => Just(Act::Panic),
    ]
    .boxed()
}

fn acts() -> BoxedStrategy<Acts> {
    prop_oneof![
        2 => proptest::array::uniform2(act()),
        // A poison message: the same on every attempt.
        1 => act().prop_map(|a| [a; MAX_ATTEMPTS as usize]),
    ]
    .boxed()
}

fn step() -> BoxedStrategy<Step> {
    let small = |n: u8| 0..n;
    Union::new_weighted(vec![
        (
            4,
            small(model::USERS)
                .prop_map(|user| Step::Write { user })
                .boxed(),
        ),
        (5, Just(Step::Relay).boxed()),
        (
            5,
            (0..EVENTS as u8, proptest::bool::weighted(0.25))
                .prop_map(|(event, redelivered)| Step::Deliver { event, redelivered })
                .boxed(),
        ),
        (
            1,
            (0..EVENTS as u8)
                .prop_map(|event| Step::Heal { event })
                .boxed(),
        ),
        (
            4,
            prop_oneof![Just(1u64), Just(3), Just(7), Just(30), Just(86_400)]
                .prop_map(Step::Advance)
                .boxed(),
        ),
        (
            1,
            prop_oneof![Just(5u64), Just(86_400)]
                .prop_map(Step::Back)
                .boxed(),
        ),
        (
            4,
            small(8).prop_map(|letter| Step::Replay { letter }).boxed(),
        ),
        (2, Just(Step::BulkReplay).boxed()),
        (
            2,
            small(8).prop_map(|letter| Step::Discard { letter }).boxed(),
        ),
        (
            1,
            prop_oneof![Just(0u64), Just(5)]
                .prop_map(|overdue| Step::Redrive { overdue })
                .boxed(),
        ),
        (
            2,
            (1..=2u32).prop_map(|days| Step::Rebuild { days }).boxed(),
        ),
        (2, Just(Step::Purge).boxed()),
        (
            1,
            (0..EVENTS as u8)
                .prop_map(|event| Step::Halt { event })
                .boxed(),
        ),
        (1, Just(Step::Resume).boxed()),
        (
            3,
            (
                small(model::CALLERS),
                small(model::IDEM_KEYS),
                small(model::FINGERPRINTS),
                prop_oneof![Just(5u64), Just(60)],
            )
                .prop_map(|(caller, key, fp, lease)| Step::Begin {
                    caller,
                    key,
                    fp,
                    lease,
                })
                .boxed(),
        ),
        (
            2,
            small(8).prop_map(|handle| Step::Commit { handle }).boxed(),
        ),
        (
            2,
            (small(8), any::<bool>())
                .prop_map(|(handle, delivered)| Step::Settle { handle, delivered })
                .boxed(),
        ),
        (
            1,
            small(8).prop_map(|handle| Step::Refund { handle }).boxed(),
        ),
        (
            1,
            small(8).prop_map(|handle| Step::Abandon { handle }).boxed(),
        ),
    ])
    .boxed()
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::array::uniform5(acts()),
        proptest::collection::vec(step(), 1..=60),
    )
        .prop_map(|(acts, steps)| Case { acts, steps })
}

// ----------------------------------------------------------------------------------
// The driver: the same step on the store.

/// The store side of a run.
pub(crate) struct Driver<C: inbox_test_support::FullConnection + LcDb> {
    pub(crate) store: Store<C>,
    pub(crate) clock: ManualClock,
    pub(crate) side: C,
    pub(crate) acts: Arc<Mutex<std::collections::HashMap<String, Acts>>>,
    /// This case's key prefix.
    prefix: String,
    /// Tokens by handle (as the model numbers `Execute`s).
    pub(crate) tokens: Vec<Token>,
    /// Whether `begin` fails at once when a token repeats for its key (the seams
    /// turn it off to show what a repeated token leads to).
    pub(crate) check_tokens: bool,
}

fn fail(at: &str, err: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("{at}: {err}"))
}

pub(crate) fn group() -> ConsumerGroup {
    match ConsumerGroup::new(GROUP) {
        Ok(g) => g,
        Err(err) => panic!("{err}"),
    }
}

pub(crate) fn fingerprint(fp: u8) -> Fingerprint {
    match RequestFields::new().field("content", format!("content {fp}")) {
        Ok(fields) => fields.fingerprint(b"the caller's secret"),
        Err(err) => panic!("{err}"),
    }
}

pub(crate) fn idem_key(key: u8) -> IdempotencyKey {
    match IdempotencyKey::new(format!("request-{key}")) {
        Ok(k) => k,
        Err(err) => panic!("{err}"),
    }
}

fn status_name(s: IdempotencyStatus) -> &'static str {
    s.as_str()
}

fn model_status_name(s: &IdemStatus) -> &'static str {
    match s {
        IdemStatus::InFlight => "in_flight",
        IdemStatus::Delivered => "delivered",
        IdemStatus::Refunded => "refunded",
    }
}

/// A claim row as far as the rules define it: status, attempts, whether the payload
/// is kept, and the due time of a pending retry.
type ClaimView = (ClaimStatus, i32, bool, Option<DateTime<Utc>>);
/// A letter: reason, attempts, status, replay count, replayable.
type LetterView = (String, i32, String, i32, bool);
/// An idempotency record: fingerprint, status, committed, response, lease end, the
/// handle whose token it holds.
type RecordView = (
    u8,
    &'static str,
    bool,
    Option<Vec<u8>>,
    DateTime<Utc>,
    Option<usize>,
);

impl<C: inbox_test_support::FullConnection + LcDb> Driver<C> {
    pub(crate) fn new<F: Fixture<Conn = C>>(fx: &F, start: DateTime<Utc>) -> Self {
        let clock = ManualClock::new(start);
        let projection = Projection::new();
        let acts = Arc::clone(&projection.acts);
        let store = match fx
            .builder()
            .clock(Arc::new(clock.clone()))
            .projection(projection)
            .transaction_retries(2)
            .build()
        {
            Ok(s) => s,
            Err(err) => panic!("building the store: {err}"),
        };
        let mut side = fx.connect();
        if let Err(err) = side.create_world() {
            panic!("creating the world's tables: {err}");
        }
        Self {
            store,
            clock,
            side,
            acts,
            prefix: String::new(),
            tokens: Vec::new(),
            check_tokens: true,
        }
    }

    pub(crate) fn key(&self, e: usize) -> String {
        format!("{}.e{e}", self.prefix)
    }

    pub(crate) fn caller(&self, caller: u8) -> String {
        format!("{}.a{caller}", self.prefix)
    }

    fn label(&self, key: &str) -> String {
        key.strip_prefix(&format!("{}.", self.prefix))
            .unwrap_or(key)
            .to_owned()
    }

    pub(crate) fn start_case(
        &mut self,
        prefix: String,
        case: &Case,
        start: DateTime<Utc>,
    ) -> Result<(), TestCaseError> {
        self.side
            .clear_world()
            .map_err(|e| fail("clearing the tables", e))?;
        self.prefix = prefix;
        self.tokens.clear();
        self.clock.set(start);
        let mut acts = self.acts.lock().unwrap_or_else(|e| e.into_inner());
        acts.clear();
        for (e, a) in case.acts.iter().enumerate() {
            acts.insert(format!("{}.e{e}", self.prefix), *a);
        }
        Ok(())
    }

    fn recorded(&self, model: &Model, e: usize) -> Recorded {
        let ev = &model.events[e];
        Recorded {
            user: ev.user,
            day: ev.day.clone(),
            amount: ev.amount,
        }
    }

    /// Runs `step` on the store, given the model *before* the step.
    pub(crate) fn run(&mut self, model: &Model, step: &Step) -> Result<Out, String> {
        let now = model.now;
        let target = ReplayTarget::default();
        let e = |s: &str| s.to_owned();
        Ok(match *step {
            Step::Write { user } => {
                let ev = model.events.len();
                let key = self.key(ev);
                let record = Recorded {
                    user: i64::from(user),
                    day: now.date_naive().to_string(),
                    amount: i64::try_from(ev).unwrap_or(0) + 1,
                };
                let payload = serde_json::to_vec(&record).map_err(|x| x.to_string())?;
                let message = OutboxMessage::new(
                    MessageKey::new(key.as_str()).map_err(|x| x.to_string())?,
                    "lifecycle",
                    world::MESSAGE_TYPE,
                    payload,
                );
                let mut conn = self.store.connection().map_err(|x| x.to_string())?;
                let conn: &mut C = &mut conn;
                conn.transaction::<_, Error, _>(|conn| {
                    conn.insert_ledger(
                        i64::try_from(ev).unwrap_or(0),
                        &key,
                        record.user,
                        &record.day,
                        record.amount,
                    )?;
                    enqueue(conn, &message, now)?;
                    Ok(())
                })
                .map_err(|x| format!("writing the event: {x}"))?;
                Out::Nothing
            }
            Step::Relay => {
                let lease = self
                    .store
                    .lease("lifecycle-relay", 100, Duration::from_secs(60))
                    .map_err(|x| format!("lease: {x}"))?;
                if !lease.unreadable.is_empty() {
                    return Err(format!("unreadable outbox rows: {:?}", lease.unreadable));
                }
                let mut decisions = Vec::new();
                for row in &lease.rows {
                    let envelope = row.message.to_envelope();
                    let mut found = self
                        .store
                        .process_batch(&group(), &[envelope])
                        .map_err(|x| format!("process_batch: {x}"))?;
                    decisions.append(&mut found);
                }
                let ids: Vec<i64> = lease.rows.iter().map(|r| r.id).collect();
                self.store
                    .mark_published("lifecycle-relay", &ids)
                    .map_err(|x| format!("mark_published: {x}"))?;
                Out::Decisions(decisions)
            }
            Step::Deliver { event, redelivered } => {
                let ev = usize::from(event);
                let mut envelope = self.recorded(model, ev).envelope(&self.key(ev));
                if redelivered {
                    envelope = envelope.redelivered();
                }
                Out::Decisions(
                    self.store
                        .process_batch(&group(), &[envelope])
                        .map_err(|x| format!("process_batch: {x}"))?,
                )
            }
            Step::Heal { event } => {
                let key = self.key(usize::from(event));
                self.acts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, [Act::Apply; MAX_ATTEMPTS as usize]);
                Out::Nothing
            }
            Step::Advance(_) | Step::Back(_) => Out::Nothing,
            Step::Replay { letter } => {
                let Some(id) = model.letter_index(letter).and_then(|l| model.letters[l].id) else {
                    return Ok(Out::Nothing);
                };
                let outcome = Operator::new(&self.store)
                    .replay_dead_letter(id, &target)
                    .map_err(|x| format!("replay: {x}"))?;
                Out::Replay(replay_of(outcome))
            }
            Step::BulkReplay => {
                let filter = DeadLetterFilter::default()
                    .consumer_group(GROUP)
                    .status(LetterStatus::Pending);
                let r = Operator::new(&self.store)
                    .replay_dead_letters(&filter, None, &target)
                    .map_err(|x| format!("bulk replay: {x}"))?;
                Out::Bulk(r.matched, r.affected, r.refused, r.skipped)
            }
            Step::Discard { letter } => {
                let Some(id) = model.letter_index(letter).and_then(|l| model.letters[l].id) else {
                    return Ok(Out::Nothing);
                };
                Out::Discard(
                    Operator::new(&self.store)
                        .discard_dead_letter(id)
                        .map_err(|x| format!("discard: {x}"))?,
                )
            }
            Step::Redrive { overdue } => {
                let filter = RedriveFilter::default()
                    .consumer_group(GROUP)
                    .overdue_for(Duration::from_secs(overdue));
                let r = Operator::new(&self.store)
                    .redrive_failed_claims(&filter, None, &target)
                    .map_err(|x| format!("redrive: {x}"))?;
                Out::Bulk(r.matched, r.affected, r.refused, r.skipped)
            }
            Step::Rebuild { days } => {
                Rebuilder::new(&self.store, PROJECTION)
                    .map_err(|x| x.to_string())?
                    .lock_timeout(Duration::from_secs(10))
                    .rebuild(days)
                    .map_err(|x| format!("rebuild: {x}"))?;
                Out::Nothing
            }
            Step::Purge => {
                let retention =
                    Retention::new(model::PUBLISHED_WINDOW, model::DONE_WINDOW, MAX_DELAY)
                        .map_err(|x| x.to_string())?;
                let s = &self.store;
                s.purge_published(&retention, 1000)
                    .map_err(|x| format!("purge published: {x}"))?;
                s.purge_done_claims(&retention, 1000)
                    .map_err(|x| format!("purge done claims: {x}"))?;
                Operator::new(s)
                    .purge_discarded_dead_letters(model::DISCARDED_WINDOW, 1000)
                    .map_err(|x| format!("purge discarded: {x}"))?;
                inbox_diesel::idempotency::purge_expired_requests(s, model::IDEM_WINDOW, 1000)
                    .map_err(|x| format!("purge idempotency keys: {x}"))?;
                Out::Nothing
            }
            Step::Halt { event } => {
                let cause = ClaimInvariantViolated {
                    group: group(),
                    key: MessageKey::new(self.key(usize::from(event)))
                        .map_err(|x| x.to_string())?,
                    detail: e("a halt recorded by the lifecycle test"),
                };
                self.store
                    .record_halt(&cause)
                    .map_err(|x| format!("record_halt: {x}"))?;
                Out::Nothing
            }
            Step::Resume => Out::Resumed(
                Operator::new(&self.store)
                    .resume_group(GROUP)
                    .map_err(|x| format!("resume: {x}"))?,
            ),
            Step::Begin {
                caller,
                key,
                fp,
                lease,
            } => Out::Idem(self.begin(model, caller, key, fp, lease)?),
            Step::Commit { handle } => {
                let Some(h) = model.handle_index(handle) else {
                    return Ok(Out::Idem(Idem::Skipped));
                };
                let (caller, key) = self.held(model, h);
                let mut conn = self.store.connection().map_err(|x| x.to_string())?;
                Out::Idem(
                    match commit_request(&mut *conn, &caller, &key, self.tokens[h], now) {
                        Ok(()) => Idem::Committed,
                        Err(Error::Fenced { .. }) => Idem::Fenced,
                        Err(err) => return Err(format!("commit: {err}")),
                    },
                )
            }
            Step::Settle { handle, delivered } => {
                let Some(h) = model.handle_index(handle) else {
                    return Ok(Out::Idem(Idem::Skipped));
                };
                let (caller, key) = self.held(model, h);
                let settlement = if delivered {
                    Settlement::Delivered {
                        response: model::response_of(h),
                    }
                } else {
                    Settlement::Refunded
                };
                let mut conn = self.store.connection().map_err(|x| x.to_string())?;
                Out::Idem(Idem::Wrote(
                    settle_request(&mut *conn, &caller, &key, self.tokens[h], &settlement, now)
                        .map_err(|x| format!("settle: {x}"))?,
                ))
            }
            Step::Refund { handle } => {
                let Some(h) = model.handle_index(handle) else {
                    return Ok(Out::Idem(Idem::Skipped));
                };
                let (caller, key) = self.held(model, h);
                let mut conn = self.store.connection().map_err(|x| x.to_string())?;
                Out::Idem(Idem::Wrote(
                    refund_delivered_request(&mut *conn, &caller, &key, self.tokens[h], now)
                        .map_err(|x| format!("refund: {x}"))?,
                ))
            }
            Step::Abandon { handle } => {
                let Some(h) = model.handle_index(handle) else {
                    return Ok(Out::Idem(Idem::Skipped));
                };
                let (caller, key) = self.held(model, h);
                let mut conn = self.store.connection().map_err(|x| x.to_string())?;
                Out::Idem(Idem::Wrote(
                    abandon_request(&mut *conn, &caller, &key, self.tokens[h])
                        .map_err(|x| format!("abandon: {x}"))?,
                ))
            }
        })
    }

    fn held(&self, model: &Model, h: usize) -> (String, IdempotencyKey) {
        let (caller, key) = model.handles[h];
        (self.caller(caller), idem_key(key))
    }

    fn begin(
        &mut self,
        model: &Model,
        caller: u8,
        key: u8,
        fp: u8,
        lease: u64,
    ) -> Result<Idem, String> {
        let now = model.now;
        let fingerprint = fingerprint(fp);
        let key_value = idem_key(key);
        let caller_name = self.caller(caller);
        let lease_until = now + TimeDelta::seconds(i64::try_from(lease).unwrap_or(0));
        let request = NewRequest {
            caller: &caller_name,
            key: &key_value,
            fingerprint: &fingerprint,
            lease_until,
        };
        let mut conn = self.store.connection().map_err(|x| x.to_string())?;
        let answer = begin_request(&mut *conn, &request, now).map_err(|x| format!("begin: {x}"))?;
        Ok(match answer {
            IdempotencyAnswer::Execute { token } => {
                if self.check_tokens && model::tokens_never_repeat(model) {
                    let repeated = (0..self.tokens.len()).find(|&h| {
                        model.handles.get(h) == Some(&(caller, key)) && self.tokens[h] == token
                    });
                    if let Some(h) = repeated {
                        return Err(format!(
                            "begin handed out the token of request #{h} again for the same key \
                             (a fencing token must never repeat for a key)"
                        ));
                    }
                }
                self.tokens.push(token);
                Idem::Execute(self.tokens.len() - 1)
            }
            IdempotencyAnswer::InFlight => Idem::InFlight,
            IdempotencyAnswer::Mismatch => Idem::Mismatch,
            IdempotencyAnswer::Replay { response } => Idem::Replay(response),
            IdempotencyAnswer::Refunded => Idem::Refunded,
            other => return Err(format!("begin answered {other:?}")),
        })
    }

    /// Matches the store's letters to the model's new ones (by key, in id order).
    fn match_letters(&mut self, model: &mut Model) -> Result<(), String> {
        let stored = self.side.letter_ids().map_err(|x| x.to_string())?;
        let taken: std::collections::BTreeSet<i64> =
            model.letters.iter().filter_map(|l| l.id).collect();
        let mut free: Vec<(i64, String)> = stored
            .into_iter()
            .filter(|(id, _)| !taken.contains(id))
            .collect();
        for l in 0..model.letters.len() {
            if model.letters[l].id.is_some() || model.letters[l].purged {
                continue;
            }
            let key = self.key(model.letters[l].event);
            if let Some(pos) = free.iter().position(|(_, k)| *k == key) {
                model.letters[l].id = Some(free.remove(pos).0);
            }
        }
        Ok(())
    }

    /// Compares everything the rules define; `Err` names what differs.
    pub(crate) fn compare(&mut self, model: &mut Model) -> Result<(), String> {
        self.match_letters(model)?;
        let mut out = String::new();
        let g = group();
        // Claims.
        for e in 0..model.events.len() {
            let key = ClaimKey::new(
                g.clone(),
                MessageKey::new(self.key(e)).map_err(|x| x.to_string())?,
            );
            let found: Option<ClaimView> = self
                .store
                .claim_record(&key)
                .map_err(|x| x.to_string())?
                .map(|c| {
                    let failed = c.status == ClaimStatus::Failed;
                    (
                        c.status,
                        c.attempts,
                        c.has_payload,
                        c.next_attempt_at.filter(|_| failed),
                    )
                });
            let expected: Option<ClaimView> = model.claims.get(&e).map(|c| {
                let pending = matches!(c.status, ClaimStatus::Failed | ClaimStatus::Started);
                let failed = c.status == ClaimStatus::Failed;
                (
                    c.status,
                    c.attempts,
                    pending,
                    c.next_attempt_at.filter(|_| failed),
                )
            });
            if found != expected {
                out += &format!("  claim e{e}\n    model: {expected:?}\n    store: {found:?}\n");
            }
        }
        // Dead letters.
        let stored = self.side.letter_ids().map_err(|x| x.to_string())?;
        let known: std::collections::BTreeSet<i64> = model
            .letters
            .iter()
            .filter(|l| !l.purged)
            .filter_map(|l| l.id)
            .collect();
        let unknown: Vec<String> = stored
            .iter()
            .filter(|(id, _)| !known.contains(id))
            .map(|(id, k)| format!("#{id} of {}", self.label(k)))
            .collect();
        if !unknown.is_empty() {
            out += &format!("  letters the model does not have: {unknown:?}\n");
        }
        for l in 0..model.letters.len() {
            let letter = &model.letters[l];
            if letter.purged {
                continue;
            }
            let Some(id) = letter.id else {
                out += &format!(
                    "  letter #{l} (e{}, {}) missing from the store\n",
                    letter.event,
                    letter.reason.as_str()
                );
                continue;
            };
            let statuses = model::letter_statuses(model, l);
            let expected: LetterView = (
                letter.reason.as_str().to_owned(),
                letter.attempts,
                statuses[0].to_owned(),
                letter.replay_count,
                model::replayable(model, l),
            );
            let found = match Operator::new(&self.store)
                .dead_letter_details(id)
                .map_err(|x| x.to_string())?
            {
                None => {
                    out += &format!("  letter #{l} (id {id}) gone from the store\n");
                    continue;
                }
                Some(d) => {
                    let status = d.entry.status.as_str().to_owned();
                    let status = if statuses.contains(&status.as_str()) {
                        statuses[0].to_owned()
                    } else {
                        status
                    };
                    (
                        d.entry.reason.as_str().to_owned(),
                        d.entry.attempts,
                        status,
                        d.entry.replay_count,
                        d.replay_refusal.is_none(),
                    )
                }
            };
            if found != expected {
                out += &format!(
                    "  letter #{l} (e{}, id {id}): (reason, attempts, status, replays, replayable)\n    model: {expected:?}\n    store: {found:?}\n",
                    letter.event
                );
            }
        }
        // Outbox rows.
        let mut found: Vec<(String, i32, bool)> = self
            .side
            .outbox_rows()
            .map_err(|x| x.to_string())?
            .into_iter()
            .map(|(k, s, p)| (self.label(&k), s, p))
            .collect();
        found.sort();
        let mut expected: Vec<(String, i32, bool)> = model
            .outbox
            .iter()
            .filter(|r| !r.purged)
            .map(|r| (format!("e{}", r.event), r.seq, r.published_at.is_some()))
            .collect();
        expected.sort();
        if found != expected {
            out += &format!(
                "  outbox rows (key, replay sequence, published)\n    model: {expected:?}\n    store: {found:?}\n"
            );
        }
        // The projection.
        let found = self.side.all_totals().map_err(|x| x.to_string())?;
        if found != model.totals {
            out += &format!(
                "  totals (user, day) -> total\n    model: {:?}\n    store: {found:?}\n",
                model.totals
            );
        }
        // Idempotency records.
        let mut conn = self.store.connection().map_err(|x| x.to_string())?;
        for caller in 0..model::CALLERS {
            for key in 0..model::IDEM_KEYS {
                let record = read_request(&mut *conn, &self.caller(caller), &idem_key(key))
                    .map_err(|x| x.to_string())?;
                let found: Option<RecordView> = record.map(|r| {
                    let fp = (0..model::FINGERPRINTS)
                        .find(|&f| fingerprint(f) == r.fingerprint)
                        .unwrap_or(u8::MAX);
                    let holder = (0..self.tokens.len()).rev().find(|&h| {
                        model.handles.get(h) == Some(&(caller, key))
                            && self.tokens[h] == r.lease_token
                    });
                    (
                        fp,
                        status_name(r.status),
                        r.committed_at.is_some(),
                        r.response.clone(),
                        r.lease_until,
                        holder,
                    )
                });
                let expected: Option<RecordView> = model.records.get(&(caller, key)).map(|r| {
                    (
                        r.fp,
                        model_status_name(&r.status),
                        r.committed_at.is_some(),
                        r.response.clone(),
                        r.lease_until,
                        Some(r.handle),
                    )
                });
                if found != expected {
                    out += &format!(
                        "  idempotency record a{caller}/i{key} (fingerprint, status, committed, response, lease until, token of request #)\n    model: {expected:?}\n    store: {found:?}\n"
                    );
                }
            }
        }
        drop(conn);
        // Halts.
        let found: Vec<(String, String, DateTime<Utc>)> = Operator::new(&self.store)
            .list_halted_groups()
            .map_err(|x| x.to_string())?
            .into_iter()
            .map(|h| (h.consumer_group, self.label(&h.message_key), h.halted_at))
            .collect();
        let expected: Vec<(String, String, DateTime<Utc>)> = model
            .halt
            .iter()
            .map(|(e, at)| (GROUP.to_owned(), format!("e{e}"), *at))
            .collect();
        if found != expected {
            out += &format!("  halts\n    model: {expected:?}\n    store: {found:?}\n");
        }
        if out.is_empty() {
            Ok(())
        } else {
            Err(out)
        }
    }
}

pub(crate) fn replay_of(outcome: ReplayOutcome) -> Replay {
    match outcome {
        ReplayOutcome::Replayed { sequence, .. } => Replay::Replayed { sequence },
        ReplayOutcome::ClaimNotDead { status } => Replay::ClaimNotDead { status },
        ReplayOutcome::Discarded => Replay::Discarded,
        ReplayOutcome::NotFound => Replay::NotFound,
        ReplayOutcome::Refused { reason, .. } => Replay::Refused {
            reason: reason.as_str().to_owned(),
        },
        other => Replay::Refused {
            reason: format!("{other:?}"),
        },
    }
}

// ----------------------------------------------------------------------------------
// The run.

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `INBOX_MODEL_CASES` cases (default [`DEFAULT_CASES`]) per backend;
/// `INBOX_MODEL_SEED` replays a run; `INBOX_LIFECYCLE_KNOWN_DEFECTS=all` (or `tokens,sequences,resolved`) expects the
/// unfixed behaviour of issue 21's listed defects (see the model's last section), to
/// look for anything else on unfixed code.
pub(crate) fn run_model<F: Fixture>(fx: &F)
where
    F::Conn: LcDb,
{
    world::quiet_handler_panics();
    let cases = env_u64("INBOX_MODEL_CASES")
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(DEFAULT_CASES);
    let known = model::Known::from_env();
    let start: DateTime<Utc> = inbox_test_support::start_time();
    let driver = std::cell::RefCell::new(Driver::new(fx, start));
    let backend = match driver.borrow().store.backend() {
        Backend::Postgres => "postgres",
        _ => "sqlite",
    };
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..Config::default()
    };
    let mut runner = match env_u64("INBOX_MODEL_SEED") {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
        }
        None => TestRunner::new(config),
    };
    static CASE: AtomicU64 = AtomicU64::new(0);
    let started = Instant::now();
    let steps_run = AtomicU64::new(0);
    let seen: Mutex<BTreeMap<String, u64>> = Mutex::default();
    let result = runner.run(&case(), |case| {
        let n = CASE.fetch_add(1, Ordering::Relaxed);
        let mut driver = driver.borrow_mut();
        driver.start_case(format!("c{n}"), &case, start)?;
        let mut model = Model::new(known, case.acts, start);
        for (i, step) in case.steps.iter().enumerate() {
            if !model.runs(step) {
                continue;
            }
            steps_run.fetch_add(1, Ordering::Relaxed);
            let found = driver
                .run(&model, step)
                .map_err(|e| fail(&format!("step {i} ({step:?})"), e))?;
            let resolved_before = model.letters.iter().filter(|l| l.resolved).count();
            let expected = model.step(step);
            driver.clock.set(model.now);
            tally(&seen, step, &expected);
            if model.letters.iter().filter(|l| l.resolved).count() > resolved_before {
                tally_one(&seen, "rebuild resolves a letter".to_owned());
            }
            if !expected.matches(&found) {
                return Err(TestCaseError::fail(format!(
                    "step {i} ({step:?}): answers differ\n  model: {expected:?}\n  store: {found:?}"
                )));
            }
            driver.compare(&mut model).map_err(|d| {
                TestCaseError::fail(format!("step {i} ({step:?}): state differs\n{d}"))
            })?;
        }
        Ok(())
    });
    eprintln!(
        "{backend}: {cases} lifecycle cases ({} steps run, shrinking included) in {:.1} s{}",
        steps_run.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
        if known.any() {
            format!(", unfixed behaviour expected: {known:?}")
        } else {
            String::new()
        },
    );
    if std::env::var("INBOX_MODEL_TALLY").is_ok_and(|v| v == "1") {
        for (what, n) in seen.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            eprintln!("{backend}:   {n:>6}  {what}");
        }
    }
    if let Err(err) = result {
        panic!("{backend}: the store and the lifecycle model disagree: {err}");
    }
}

/// A hand-written case: a driver and its model, stepped together, each step's
/// answers and the whole state compared (the forced interleavings build on it).
pub(crate) struct Scenario<C: inbox_test_support::FullConnection + LcDb> {
    pub(crate) d: Driver<C>,
    pub(crate) m: Model,
}

impl<C: inbox_test_support::FullConnection + LcDb> Scenario<C> {
    /// A fresh world whose handler does `acts` for event 0 (and applies the rest).
    pub(crate) fn new<F: Fixture<Conn = C>>(fx: &F, acts0: Acts) -> Self {
        let start = inbox_test_support::start_time();
        let mut d = Driver::new(fx, start);
        let mut acts = [[Act::Apply; MAX_ATTEMPTS as usize]; EVENTS];
        acts[0] = acts0;
        let case = Case {
            acts,
            steps: Vec::new(),
        };
        static SCENARIO: AtomicU64 = AtomicU64::new(0);
        let n = SCENARIO.fetch_add(1, Ordering::Relaxed);
        if let Err(err) = d.start_case(format!("s{n}"), &case, start) {
            panic!("{err:?}");
        }
        let m = Model::new(model::Known::from_env(), acts, start);
        Self { d, m }
    }

    /// Runs a step on both sides; panics when the answers or the states differ.
    pub(crate) fn step(&mut self, step: Step) -> Out {
        let found = match self.d.run(&self.m, &step) {
            Ok(found) => found,
            Err(err) => panic!("{step:?}: {err}"),
        };
        if let Err(diff) = self.expect(&step, &found) {
            panic!("{step:?}:\n{diff}");
        }
        if let Err(diff) = self.compare() {
            panic!("{step:?}: state differs\n{diff}");
        }
        found
    }

    /// Applies a step to the model only and checks that the store's answer `found`
    /// (run by the caller, concurrently) is the model's; `Err` says what differs.
    pub(crate) fn expect(&mut self, step: &Step, found: &Out) -> Result<(), String> {
        let expected = self.m.step(step);
        self.d.clock.set(self.m.now);
        if !expected.matches(found) {
            return Err(format!(
                "  answers differ\n    model: {expected:?}\n    store: {found:?}\n"
            ));
        }
        Ok(())
    }

    /// Compares the states; `Err` says what differs.
    pub(crate) fn compare(&mut self) -> Result<(), String> {
        self.d.compare(&mut self.m)
    }
}

/// Counts what the steps did (`INBOX_MODEL_TALLY=1` prints it): how often each
/// transition of the model was reached.
fn tally(seen: &Mutex<BTreeMap<String, u64>>, step: &Step, out: &Out) {
    let name = format!("{step:?}");
    let name = name.split(' ').next().unwrap_or("").to_owned();
    match out {
        Out::Decisions(ds) => {
            for d in ds {
                let d = format!("{d:?}");
                let d = d.split('(').next().unwrap_or("").to_owned();
                tally_one(seen, format!("{name}: {d}"));
            }
        }
        Out::Replay(r) => tally_one(seen, format!("{name}: {r:?}")),
        Out::Bulk(_, affected, _, skipped) => tally_one(
            seen,
            format!(
                "{name}: {} affected, {} skipped",
                (*affected).min(1),
                (*skipped).min(1)
            ),
        ),
        Out::Idem(i) => {
            let i = format!("{i:?}");
            let i = i.split('(').next().unwrap_or("").to_owned();
            tally_one(seen, format!("{name}: {i}"));
        }
        other => {
            let o = format!("{other:?}");
            tally_one(
                seen,
                format!("{name}: {}", o.split('(').next().unwrap_or("")),
            );
        }
    }
}

fn tally_one(seen: &Mutex<BTreeMap<String, u64>>, what: String) {
    *seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(what)
        .or_default() += 1;
}

/// The totals a ledger's events sum to, per (user, day): what a projection that
/// counted every event once holds.
pub(crate) fn ledger_sums(model: &Model) -> BTreeMap<(i64, String), i64> {
    let mut sums = BTreeMap::new();
    for ev in &model.events {
        *sums.entry((ev.user, ev.day.clone())).or_default() += ev.amount;
    }
    sums
}
