//! The model: the README's rules, written down without looking at the store's code.
//!
//! Each transition cites the README section it follows. The few rules that the
//! fixes of issue 21 change (or make precise) are in the small functions of the
//! section *Rules that issue 21 settles*, each with the rule the README (or
//! DESIGN.md section 14) states and, behind [`Known`], the behaviour of the code
//! before the fix, so that a run with `INBOX_LIFECYCLE_KNOWN_DEFECTS=all` (or a list
//! of `tokens`, `sequences`, `resolved`) looks for anything *else* on unfixed code.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use inbox_core::rebuild::days_ending;
use inbox_core::{DeadLetterReason, Decision};
use inbox_diesel::operator::DiscardOutcome;
use inbox_diesel::ClaimStatus;

use super::world::{Act, Acts, INITIAL, MAX_ATTEMPTS, MAX_DELAY};

/// Events a case can write (ledger rows, one message each).
pub(crate) const EVENTS: usize = 5;
/// Users an event can belong to.
pub(crate) const USERS: u8 = 2;
/// Callers (accounts) and idempotency keys of a case.
pub(crate) const CALLERS: u8 = 2;
pub(crate) const IDEM_KEYS: u8 = 2;
/// Request contents (fingerprints) a key can be begun with.
pub(crate) const FINGERPRINTS: u8 = 2;

/// Retention windows of the purge step.
pub(crate) const PUBLISHED_WINDOW: Duration = Duration::from_secs(10);
pub(crate) const DONE_WINDOW: Duration = Duration::from_secs(10);
pub(crate) const DISCARDED_WINDOW: Duration = Duration::from_secs(10);
pub(crate) const IDEM_WINDOW: Duration = Duration::from_secs(20);

/// One step of a case.
#[derive(Clone)]
pub(crate) enum Step {
    /// A ledger row and its event's outbox row, in one transaction (the producer).
    Write {
        user: u8,
    },
    /// A relay round: every due, unpublished outbox row is leased, delivered to the
    /// group alone (its own batch, in id order) and marked published.
    Relay,
    /// The broker delivers an event's message again (only once it was published).
    Deliver {
        event: u8,
        redelivered: bool,
    },
    /// The operator fixes the cause: the handler applies the key from now on.
    Heal {
        event: u8,
    },
    /// The clock moves forward, or back.
    Advance(u64),
    Back(u64),
    /// `replay_dead_letter` of a letter the model knows (by index, modulo).
    Replay {
        letter: u8,
    },
    /// `replay_dead_letters` of the group's pending letters.
    BulkReplay,
    /// `discard_dead_letter` of a letter the model knows.
    Discard {
        letter: u8,
    },
    /// `redrive_failed_claims` of claims overdue for this many seconds.
    Redrive {
        overdue: u64,
    },
    /// A rebuild of the window of this many days ending now.
    Rebuild {
        days: u32,
    },
    /// Every purge: published rows, done claims, discarded letters, idempotency keys.
    Purge,
    /// A consumer records a halt of the group on an event's key.
    Halt {
        event: u8,
    },
    /// `resume_group`.
    Resume,
    /// `begin_request`.
    Begin {
        caller: u8,
        key: u8,
        fp: u8,
        lease: u64,
    },
    /// `commit_request` with the token of an earlier `Execute` (by index, modulo).
    Commit {
        handle: u8,
    },
    /// `settle_request`: delivered (with a response) or refunded.
    Settle {
        handle: u8,
        delivered: bool,
    },
    /// `refund_delivered_request`.
    Refund {
        handle: u8,
    },
    /// `abandon_request`.
    Abandon {
        handle: u8,
    },
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Write { user } => write!(f, "write u{user}"),
            Self::Relay => f.write_str("relay"),
            Self::Deliver { event, redelivered } => {
                write!(
                    f,
                    "deliver e{event}{}",
                    if *redelivered { " redelivered" } else { "" }
                )
            }
            Self::Heal { event } => write!(f, "heal e{event}"),
            Self::Advance(s) => write!(f, "advance {s}s"),
            Self::Back(s) => write!(f, "back {s}s"),
            Self::Replay { letter } => write!(f, "replay letter #{letter}"),
            Self::BulkReplay => f.write_str("bulk replay (pending)"),
            Self::Discard { letter } => write!(f, "discard letter #{letter}"),
            Self::Redrive { overdue } => write!(f, "redrive overdue {overdue}s"),
            Self::Rebuild { days } => write!(f, "rebuild {days} day(s)"),
            Self::Purge => f.write_str("purge"),
            Self::Halt { event } => write!(f, "halt on e{event}"),
            Self::Resume => f.write_str("resume"),
            Self::Begin {
                caller,
                key,
                fp,
                lease,
            } => {
                write!(f, "begin a{caller}/i{key} fp{fp} lease {lease}s")
            }
            Self::Commit { handle } => write!(f, "commit #{handle}"),
            Self::Settle { handle, delivered } => write!(
                f,
                "settle #{handle} {}",
                if *delivered { "delivered" } else { "refunded" }
            ),
            Self::Refund { handle } => write!(f, "refund #{handle}"),
            Self::Abandon { handle } => write!(f, "abandon #{handle}"),
        }
    }
}

/// A case: what the handler does per event and attempt, and the steps.
#[derive(Clone)]
pub(crate) struct Case {
    pub(crate) acts: [Acts; EVENTS],
    pub(crate) steps: Vec<Step>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "Case {{")?;
        let writes = self
            .steps
            .iter()
            .filter(|s| matches!(s, Step::Write { .. }))
            .count();
        for (e, acts) in self.acts.iter().enumerate().take(writes) {
            writeln!(f, "    e{e} attempts 1..: {acts:?}")?;
        }
        for (i, step) in self.steps.iter().enumerate() {
            writeln!(f, "    step {i}: {step:?}")?;
        }
        write!(f, "}}")
    }
}

// ----------------------------------------------------------------------------------
// What a step answers, as the model predicts it and as the store gave it.

/// What a replay of one letter did (the store's `ReplayOutcome` without its outbox id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Replay {
    Replayed {
        sequence: i32,
    },
    ClaimNotDead {
        status: Option<ClaimStatus>,
    },
    Discarded,
    NotFound,
    Refused {
        reason: String,
    },
    /// Anything but `Replayed`, with nothing changed: what a replay of a letter a
    /// rebuild resolved answers is the fix's to name (see [`resolved_replay`]).
    NotReplayedResolved,
}

impl Replay {
    pub(crate) fn matches(&self, found: &Replay) -> bool {
        match self {
            Self::NotReplayedResolved => !matches!(found, Self::Replayed { .. }),
            _ => self == found,
        }
    }
}

/// An idempotency call's answer; `Execute` names the handle the model gives the
/// token (tokens are opaque: compared for equality only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Idem {
    Execute(usize),
    InFlight,
    Mismatch,
    Replay(Vec<u8>),
    Refunded,
    Committed,
    Fenced,
    Wrote(bool),
    /// A step the model does not run (nothing to act on).
    Skipped,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Out {
    Nothing,
    Decisions(Vec<Decision>),
    Replay(Replay),
    /// (matched, affected, refused, skipped)
    Bulk(u64, u64, u64, u64),
    Discard(DiscardOutcome),
    Resumed(bool),
    Idem(Idem),
}

impl Out {
    pub(crate) fn matches(&self, found: &Out) -> bool {
        match (self, found) {
            (Out::Replay(m), Out::Replay(s)) => m.matches(s),
            _ => self == found,
        }
    }
}

// ----------------------------------------------------------------------------------
// The state.

#[derive(Clone, Debug)]
pub(crate) struct Event {
    pub(crate) user: i64,
    pub(crate) day: String,
    pub(crate) amount: i64,
    /// Its producer row was published: the broker may deliver it (again) any time.
    pub(crate) published: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) status: ClaimStatus,
    pub(crate) attempts: i32,
    pub(crate) next_attempt_at: Option<DateTime<Utc>>,
    pub(crate) updated_at: DateTime<Utc>,
    /// Recorded or taken over by a rebuild: no digest, so no replay can take it.
    pub(crate) covered: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct Letter {
    pub(crate) event: usize,
    pub(crate) reason: DeadLetterReason,
    pub(crate) attempts: i32,
    pub(crate) dead_lettered_at: DateTime<Utc>,
    pub(crate) replay_count: i32,
    pub(crate) discarded_at: Option<DateTime<Utc>>,
    pub(crate) resolved: bool,
    pub(crate) purged: bool,
    /// The store's id, once matched.
    pub(crate) id: Option<i64>,
}

#[derive(Clone, Debug)]
pub(crate) struct OutboxRow {
    pub(crate) event: usize,
    pub(crate) seq: i32,
    pub(crate) available_at: DateTime<Utc>,
    pub(crate) published_at: Option<DateTime<Utc>>,
    pub(crate) purged: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum IdemStatus {
    InFlight,
    Delivered,
    Refunded,
}

#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) fp: u8,
    pub(crate) status: IdemStatus,
    /// The handle whose token the record holds.
    pub(crate) handle: usize,
    pub(crate) lease_until: DateTime<Utc>,
    pub(crate) committed_at: Option<DateTime<Utc>>,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) created_at: DateTime<Utc>,
}

#[derive(Clone)]
pub(crate) struct Model {
    /// The listed defects whose unfixed behaviour this run expects.
    pub(crate) known: Known,
    pub(crate) now: DateTime<Utc>,
    pub(crate) acts: [Acts; EVENTS],
    pub(crate) events: Vec<Event>,
    pub(crate) claims: BTreeMap<usize, Claim>,
    pub(crate) letters: Vec<Letter>,
    pub(crate) outbox: Vec<OutboxRow>,
    /// The highest replay sequence handed out per event (0: the producer's row).
    pub(crate) sequences: BTreeMap<usize, i32>,
    pub(crate) totals: BTreeMap<(i64, String), i64>,
    /// (event, halted at) of the group's halt.
    pub(crate) halt: Option<(usize, DateTime<Utc>)>,
    pub(crate) records: BTreeMap<(u8, u8), Record>,
    /// (caller, key) of each handle.
    pub(crate) handles: Vec<(u8, u8)>,
}

fn delta(d: Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}

/// The policy's delay after the n-th failure: `initial * 2^(n-1)`, at most `max`.
fn backoff(attempts: i32) -> Duration {
    let n = u32::try_from(attempts.max(1) - 1).unwrap_or(0);
    (INITIAL * 2u32.saturating_pow(n)).min(MAX_DELAY)
}

impl Model {
    pub(crate) fn new(known: Known, acts: [Acts; EVENTS], now: DateTime<Utc>) -> Self {
        Self {
            known,
            now,
            acts,
            events: Vec::new(),
            claims: BTreeMap::new(),
            letters: Vec::new(),
            outbox: Vec::new(),
            sequences: BTreeMap::new(),
            totals: BTreeMap::new(),
            halt: None,
            records: BTreeMap::new(),
            handles: Vec::new(),
        }
    }

    /// The letter a step's index names, if the model knows any.
    pub(crate) fn letter_index(&self, i: u8) -> Option<usize> {
        (!self.letters.is_empty()).then(|| usize::from(i) % self.letters.len())
    }

    /// The handle a step's index names, if any was handed out.
    pub(crate) fn handle_index(&self, i: u8) -> Option<usize> {
        (!self.handles.is_empty()).then(|| usize::from(i) % self.handles.len())
    }

    /// Whether the model runs the step (`false`: both sides skip it).
    pub(crate) fn runs(&self, step: &Step) -> bool {
        match step {
            Step::Write { .. } => self.events.len() < EVENTS,
            Step::Deliver { event, .. } => self
                .events
                .get(usize::from(*event))
                .is_some_and(|e| e.published),
            Step::Heal { event } | Step::Halt { event } => usize::from(*event) < self.events.len(),
            Step::Replay { letter } | Step::Discard { letter } => self
                .letter_index(*letter)
                .and_then(|l| self.letters[l].id)
                .is_some(),
            Step::Commit { handle }
            | Step::Settle { handle, .. }
            | Step::Refund { handle }
            | Step::Abandon { handle } => match self.handle_index(*handle) {
                None => false,
                Some(h) => !(self.known.tokens && self.stale_but_keyed(h)),
            },
            _ => true,
        }
    }

    /// A handle whose key has a record that another handle holds: before the fix a
    /// token value could repeat, so the known-defects mode does not try it.
    fn stale_but_keyed(&self, h: usize) -> bool {
        self.records
            .get(&self.handles[h])
            .is_some_and(|r| r.handle != h)
    }

    /// Runs a step and says what the store must answer.
    pub(crate) fn step(&mut self, step: &Step) -> Out {
        match *step {
            Step::Write { user } => {
                self.write(user);
                Out::Nothing
            }
            Step::Relay => Out::Decisions(self.relay()),
            Step::Deliver { event, .. } => Out::Decisions(vec![self.deliver(usize::from(event))]),
            Step::Heal { event } => {
                self.acts[usize::from(event)] = [Act::Apply; MAX_ATTEMPTS as usize];
                Out::Nothing
            }
            Step::Advance(s) => {
                self.now += delta(Duration::from_secs(s));
                Out::Nothing
            }
            Step::Back(s) => {
                self.now -= delta(Duration::from_secs(s));
                Out::Nothing
            }
            Step::Replay { letter } => match self.letter_index(letter) {
                Some(l) => Out::Replay(self.replay(l)),
                None => Out::Nothing,
            },
            Step::BulkReplay => self.bulk_replay(),
            Step::Discard { letter } => match self.letter_index(letter) {
                Some(l) => Out::Discard(self.discard(l)),
                None => Out::Nothing,
            },
            Step::Redrive { overdue } => self.redrive(overdue),
            Step::Rebuild { days } => {
                self.rebuild(days);
                Out::Nothing
            }
            Step::Purge => {
                self.purge();
                Out::Nothing
            }
            Step::Halt { event } => {
                // README, *A halted group*: "a group halted already keeps its first row".
                if self.halt.is_none() {
                    self.halt = Some((usize::from(event), self.now));
                }
                Out::Nothing
            }
            Step::Resume => Out::Resumed(self.halt.take().is_some()),
            Step::Begin {
                caller,
                key,
                fp,
                lease,
            } => Out::Idem(self.begin(caller, key, fp, lease)),
            Step::Commit { handle } => Out::Idem(self.on_handle(handle, Self::commit)),
            Step::Settle { handle, delivered } => {
                Out::Idem(self.on_handle(handle, |m, h| m.settle(h, delivered)))
            }
            Step::Refund { handle } => Out::Idem(self.on_handle(handle, Self::refund)),
            Step::Abandon { handle } => Out::Idem(self.on_handle(handle, Self::abandon)),
        }
    }

    // ------------------------------------------------------------------------------
    // The inbox (README: *What it guarantees*, *Failures advance*).

    fn write(&mut self, user: u8) {
        let e = self.events.len();
        self.events.push(Event {
            user: i64::from(user),
            day: self.now.date_naive().to_string(),
            amount: i64::try_from(e).unwrap_or(0) + 1,
            published: false,
        });
        self.sequences.insert(e, 0);
        self.outbox.push(OutboxRow {
            event: e,
            seq: 0,
            available_at: self.now,
            published_at: None,
            purged: false,
        });
    }

    fn relay(&mut self) -> Vec<Decision> {
        let now = self.now;
        // README, *The outbox*: due, unpublished rows in id order.
        let due: Vec<usize> = (0..self.outbox.len())
            .filter(|&i| {
                let r = &self.outbox[i];
                !r.purged && r.published_at.is_none() && r.available_at <= now
            })
            .collect();
        let mut decisions = Vec::new();
        for &i in &due {
            let event = self.outbox[i].event;
            decisions.push(self.deliver(event));
        }
        for &i in &due {
            self.outbox[i].published_at = Some(now);
            if self.outbox[i].seq == 0 {
                let event = self.outbox[i].event;
                self.events[event].published = true;
            }
        }
        decisions
    }

    /// One delivery of an event's message, alone in its batch.
    pub(crate) fn deliver(&mut self, e: usize) -> Decision {
        let now = self.now;
        let attempts_before = match self.claims.get(&e) {
            None => 0,
            // The claim's conflict condition: failed or started, and due.
            Some(c)
                if matches!(c.status, ClaimStatus::Failed | ClaimStatus::Started)
                    && c.next_attempt_at.is_none_or(|t| t <= now) =>
            {
                c.attempts
            }
            Some(c) => {
                return match c.status {
                    ClaimStatus::Done => Decision::Duplicate,
                    ClaimStatus::Dead => Decision::AlreadyDeadLettered,
                    _ => {
                        let due = c.next_attempt_at.unwrap_or(now);
                        Decision::RetryAfter((due - now).to_std().unwrap_or_default())
                    }
                }
            }
        };
        let act = self.acts[e][usize::try_from(attempts_before).unwrap_or(0)];
        let claim = self.claims.entry(e).or_insert(Claim {
            status: ClaimStatus::Done,
            attempts: 0,
            next_attempt_at: None,
            updated_at: now,
            covered: false,
        });
        claim.updated_at = now;
        if act == Act::Apply {
            claim.status = ClaimStatus::Done;
            claim.next_attempt_at = None;
            let ev = &self.events[e];
            *self.totals.entry((ev.user, ev.day.clone())).or_default() += ev.amount;
            return Decision::Processed;
        }
        claim.attempts = attempts_before + 1;
        let attempts = claim.attempts;
        let reason = match act {
            Act::Permanent => Some(DeadLetterReason::Permanent),
            _ if attempts >= MAX_ATTEMPTS as i32 => Some(DeadLetterReason::MaxAttempts),
            _ => None,
        };
        match reason {
            None => {
                let delay = backoff(attempts);
                claim.status = ClaimStatus::Failed;
                claim.next_attempt_at = Some(now + delta(delay));
                Decision::RetryAfter(delay)
            }
            Some(reason) => {
                claim.status = ClaimStatus::Dead;
                claim.next_attempt_at = None;
                self.letters.push(Letter {
                    event: e,
                    reason,
                    attempts,
                    dead_lettered_at: now,
                    replay_count: 0,
                    discarded_at: None,
                    resolved: false,
                    purged: false,
                    id: None,
                });
                Decision::DeadLettered(reason)
            }
        }
    }

    // ------------------------------------------------------------------------------
    // The operator (README: *Operating the inbox*, *Replay*, *Redrive*).

    fn enqueue_copy(&mut self, e: usize) -> i32 {
        let sequence = next_replay_sequence(self, e);
        self.sequences.insert(e, sequence);
        self.outbox.push(OutboxRow {
            event: e,
            seq: sequence,
            available_at: self.now,
            published_at: None,
            purged: false,
        });
        sequence
    }

    /// README, *Replay*: not found, discarded, refused for its reason, then the
    /// guarded reset of a `dead` claim with the letter's payload; only then the
    /// outbox row and the letter's replay count.
    pub(crate) fn replay(&mut self, l: usize) -> Replay {
        let now = self.now;
        let letter = self.letters[l].clone();
        if letter.purged {
            return Replay::NotFound;
        }
        if letter.resolved {
            return resolved_replay();
        }
        if letter.discarded_at.is_some() {
            return Replay::Discarded;
        }
        if letter.replay_count > 0 {
            // operating.md, *Replay*: "A letter is replayed once: a second or
            // concurrent replay of it enqueues nothing (`claim_not_dead`, with the
            // claim's status)"; a message that fails again is a new letter.
            return Replay::ClaimNotDead {
                status: self.claims.get(&letter.event).map(|c| c.status),
            };
        }
        match self.claims.get_mut(&letter.event) {
            Some(c) if c.status == ClaimStatus::Dead && !c.covered => {
                c.status = ClaimStatus::Failed;
                c.attempts = 0;
                c.next_attempt_at = Some(now);
                c.updated_at = now;
                let sequence = self.enqueue_copy(letter.event);
                let letter = &mut self.letters[l];
                letter.replay_count += 1;
                Replay::Replayed { sequence }
            }
            other => Replay::ClaimNotDead {
                status: other.map(|c| c.status),
            },
        }
    }

    fn bulk_replay(&mut self) -> Out {
        // Newest first: dead-lettered at, then id, descending.
        let mut pending: Vec<usize> = (0..self.letters.len())
            .filter(|&l| !self.letters[l].purged && letter_status(self, l) == "pending")
            .collect();
        pending.sort_by(|&a, &b| {
            (self.letters[b].dead_lettered_at, b).cmp(&(self.letters[a].dead_lettered_at, a))
        });
        let (mut affected, mut refused, mut skipped) = (0, 0, 0);
        for &l in &pending {
            match self.replay(l) {
                Replay::Replayed { .. } => affected += 1,
                Replay::Refused { .. } => refused += 1,
                _ => skipped += 1,
            }
        }
        Out::Bulk(pending.len() as u64, affected, refused, skipped)
    }

    fn discard(&mut self, l: usize) -> DiscardOutcome {
        let letter = &mut self.letters[l];
        if letter.purged {
            DiscardOutcome::NotFound
        } else if letter.discarded_at.is_some() {
            DiscardOutcome::AlreadyDiscarded
        } else {
            letter.discarded_at = Some(self.now);
            DiscardOutcome::Discarded
        }
    }

    /// README, *Redrive*: failed claims with their payload, due and unchanged for
    /// `overdue`, each sent again like a replay.
    fn redrive(&mut self, overdue: u64) -> Out {
        let now = self.now;
        let cutoff = now - delta(Duration::from_secs(overdue));
        let mut due: Vec<(DateTime<Utc>, usize)> = self
            .claims
            .iter()
            .filter(|(_, c)| {
                c.status == ClaimStatus::Failed
                    && c.next_attempt_at.is_some_and(|t| t <= cutoff)
                    && c.updated_at <= cutoff
            })
            .map(|(&e, c)| (c.next_attempt_at.unwrap_or(now), e))
            .collect();
        due.sort();
        for &(_, e) in &due {
            if let Some(c) = self.claims.get_mut(&e) {
                c.next_attempt_at = Some(now);
                c.updated_at = now;
            }
            self.enqueue_copy(e);
        }
        let n = due.len() as u64;
        Out::Bulk(n, n, 0, 0)
    }

    // ------------------------------------------------------------------------------
    // Rebuild (README: *What a rebuild does, and why it never double counts*).

    fn rebuild(&mut self, days: u32) {
        let now = self.now;
        for day in days_ending(now, days) {
            let day = day.to_string();
            self.totals.retain(|(_, d), _| *d != day);
            let mut covered: Vec<usize> = Vec::new();
            for (e, ev) in self.events.iter().enumerate() {
                if ev.day == day {
                    *self.totals.entry((ev.user, day.clone())).or_default() += ev.amount;
                    covered.push(e);
                }
            }
            for e in covered {
                match self.claims.get_mut(&e) {
                    None => {
                        self.claims.insert(
                            e,
                            Claim {
                                status: ClaimStatus::Done,
                                attempts: 0,
                                next_attempt_at: None,
                                updated_at: now,
                                covered: true,
                            },
                        );
                    }
                    Some(c) => match c.status {
                        ClaimStatus::Done => {}
                        ClaimStatus::Failed | ClaimStatus::Started => {
                            c.status = ClaimStatus::Done;
                            c.next_attempt_at = None;
                            c.updated_at = now;
                            c.covered = true;
                        }
                        _ if !c.covered => {
                            c.covered = true;
                            c.updated_at = now;
                            for letter in self.letters.iter_mut().filter(|l| l.event == e) {
                                letter.resolved = true;
                            }
                        }
                        _ => {}
                    },
                }
            }
        }
    }

    // ------------------------------------------------------------------------------
    // Retention (README: *The outbox*, retention; `purge`; idempotency keys).

    fn purge(&mut self) {
        let now = self.now;
        let cutoff = |w: Duration| now - delta(w);
        let published = cutoff(PUBLISHED_WINDOW);
        for row in &mut self.outbox {
            if row.published_at.is_some_and(|t| t < published) {
                row.purged = true;
            }
        }
        let done = cutoff(DONE_WINDOW);
        self.claims
            .retain(|_, c| !(c.status == ClaimStatus::Done && c.updated_at < done));
        let discarded = cutoff(DISCARDED_WINDOW);
        for l in &mut self.letters {
            if l.discarded_at.is_some_and(|t| t < discarded) {
                l.purged = true;
            }
        }
        // Settled records go, and uncommitted ones whose lease ended before the
        // cutoff; a committed request that is not settled yet is kept.
        let idem = cutoff(IDEM_WINDOW);
        self.records.retain(|_, r| {
            !(r.created_at < idem
                && (r.status != IdemStatus::InFlight
                    || (r.committed_at.is_none() && r.lease_until < idem)))
        });
    }

    // ------------------------------------------------------------------------------
    // Idempotency keys (README: *Idempotency keys*; inbox_core::idempotency::judge).

    fn begin(&mut self, caller: u8, key: u8, fp: u8, lease: u64) -> Idem {
        let now = self.now;
        let lease_until = now + delta(Duration::from_secs(lease));
        let handle = self.handles.len();
        match self.records.get_mut(&(caller, key)) {
            None => {
                self.records.insert(
                    (caller, key),
                    Record {
                        fp,
                        status: IdemStatus::InFlight,
                        handle,
                        lease_until,
                        committed_at: None,
                        response: None,
                        created_at: now,
                    },
                );
            }
            Some(r) if r.fp != fp => return Idem::Mismatch,
            Some(r) => match r.status {
                IdemStatus::Delivered => {
                    return Idem::Replay(r.response.clone().unwrap_or_default())
                }
                IdemStatus::Refunded => return Idem::Refunded,
                // "the lease only frees a key whose request died before its commit,
                // and only for the same fingerprint"
                IdemStatus::InFlight if r.committed_at.is_none() && r.lease_until <= now => {
                    r.handle = handle;
                    r.lease_until = lease_until;
                }
                IdemStatus::InFlight => return Idem::InFlight,
            },
        }
        self.handles.push((caller, key));
        Idem::Execute(handle)
    }

    fn on_handle(&mut self, i: u8, f: impl FnOnce(&mut Self, usize) -> Idem) -> Idem {
        match self.handle_index(i) {
            Some(h) => f(self, h),
            None => Idem::Skipped,
        }
    }

    /// The record this handle's writes are fenced to: only the one holding its token.
    fn held(&mut self, h: usize) -> Option<&mut Record> {
        let key = self.handles[h];
        self.records.get_mut(&key).filter(|r| fenced_to(r, h))
    }

    fn commit(&mut self, h: usize) -> Idem {
        let now = self.now;
        match self.held(h) {
            Some(r) if r.status == IdemStatus::InFlight && r.committed_at.is_none() => {
                r.committed_at = Some(now);
                Idem::Committed
            }
            _ => Idem::Fenced,
        }
    }

    fn settle(&mut self, h: usize, delivered: bool) -> Idem {
        match self.held(h) {
            Some(r) if r.status == IdemStatus::InFlight && r.committed_at.is_some() => {
                if delivered {
                    r.status = IdemStatus::Delivered;
                    r.response = Some(response_of(h));
                } else {
                    r.status = IdemStatus::Refunded;
                }
                Idem::Wrote(true)
            }
            _ => Idem::Wrote(false),
        }
    }

    fn refund(&mut self, h: usize) -> Idem {
        match self.held(h) {
            Some(r) if r.status == IdemStatus::Delivered => {
                r.status = IdemStatus::Refunded;
                r.response = None;
                Idem::Wrote(true)
            }
            _ => Idem::Wrote(false),
        }
    }

    fn abandon(&mut self, h: usize) -> Idem {
        let key = self.handles[h];
        match self.held(h) {
            Some(r) if r.status == IdemStatus::InFlight && r.committed_at.is_none() => {
                self.records.remove(&key);
                Idem::Wrote(true)
            }
            _ => Idem::Wrote(false),
        }
    }
}

/// The response a handle's request delivers.
pub(crate) fn response_of(h: usize) -> Vec<u8> {
    format!("response of request #{h}").into_bytes()
}

// ----------------------------------------------------------------------------------
// Rules that issue 21 settles. Each is small on purpose: adapt it here at merge.

/// Which of issue 21's listed defects a run expects unfixed (all false by default:
/// the README's rules).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Known {
    /// Item 2: fencing tokens restart after an abandon or a purge.
    pub(crate) tokens: bool,
    /// Item 6: replay sequences restart after the published rows are purged.
    pub(crate) sequences: bool,
    /// Item 6: letters a rebuild resolved are still listed pending and replayable.
    pub(crate) resolved: bool,
}

impl Known {
    /// From `INBOX_LIFECYCLE_KNOWN_DEFECTS`: `all`, or a comma-separated list.
    pub(crate) fn from_env() -> Self {
        let value = std::env::var("INBOX_LIFECYCLE_KNOWN_DEFECTS").unwrap_or_default();
        let has = |name: &str| {
            value
                .split(',')
                .any(|v| v.trim() == name || v.trim() == "all")
        };
        Self {
            tokens: has("tokens"),
            sequences: has("sequences"),
            resolved: has("resolved"),
        }
    }

    pub(crate) fn any(&self) -> bool {
        self.tokens || self.sequences || self.resolved
    }
}

/// DESIGN.md section 14, "Identities never repeat: a fencing token, a replay sequence
/// ... is never handed out twice for the same key, across deletes, purges": the next
/// sequence follows the highest ever handed out for the key, not the highest still
/// in the outbox. (Before the fix: the highest still in the outbox, plus one.)
pub(crate) fn next_replay_sequence(model: &Model, e: usize) -> i32 {
    if model.known.sequences {
        return model
            .outbox
            .iter()
            .filter(|r| r.event == e && !r.purged)
            .map(|r| r.seq)
            .max()
            .unwrap_or(0)
            + 1;
    }
    model.sequences.get(&e).copied().unwrap_or(0) + 1
}

/// README, *Idempotency keys*: "every later write of the first request is fenced by
/// its lease token": a write holds only on the record its own `Execute` created or
/// took over, never on a record created again under the key (DESIGN.md 14: "a commit
/// is fenced by the record's identity"). Tokens are opaque: the driver only checks
/// that a new one differs from every earlier one of its key ([`tokens_never_repeat`]).
fn fenced_to(record: &Record, h: usize) -> bool {
    record.handle == h
}

/// Whether a token handed out for a key must differ from every earlier one of that
/// key (DESIGN.md 14). Before the fix tokens restart at 1 after a delete.
pub(crate) fn tokens_never_repeat(model: &Model) -> bool {
    !model.known.tokens
}

/// A letter's status as `dead-letters list/show` gives it. README: "`dead` becomes
/// covered and its dead letters are marked resolved (a replay ... cannot take it)";
/// the fix gives such letters their own status, `resolved`, so they are no longer
/// listed `pending` (issue 21, item 6). Before the fix: pending or replayed.
pub(crate) fn letter_status(model: &Model, l: usize) -> &'static str {
    let letter = &model.letters[l];
    if letter.resolved && !model.known.resolved {
        "resolved"
    } else if letter.discarded_at.is_some() {
        "discarded"
    } else if letter.replay_count > 0 {
        "replayed"
    } else {
        "pending"
    }
}

/// The statuses `dead-letters show` may give: a letter both discarded and resolved
/// may be listed either way (the fix's choice).
pub(crate) fn letter_statuses(model: &Model, l: usize) -> Vec<&'static str> {
    let letter = &model.letters[l];
    if letter.resolved && letter.discarded_at.is_some() && !model.known.resolved {
        vec!["resolved", "discarded"]
    } else {
        vec![letter_status(model, l)]
    }
}

/// Whether `dead-letters show` calls the letter replayable (`replay_refusal` is
/// none). A letter a rebuild resolved is not (issue 21, item 6); before the fix it
/// was, by its reason alone.
pub(crate) fn replayable(model: &Model, l: usize) -> bool {
    !model.letters[l].resolved || model.known.resolved
}

/// What a replay of a letter a rebuild resolved answers: never `Replayed`, nothing
/// enqueued (README: "a replay, guarded by the payload digest, cannot take it").
/// Which refusal it names (`ClaimNotDead { Dead }` before the fix) is the fix's.
fn resolved_replay() -> Replay {
    Replay::NotReplayedResolved
}
