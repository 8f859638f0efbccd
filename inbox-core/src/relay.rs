//! One relay round, whatever the transport: lease, check the lease, publish through
//! an [`OutboxPublisher`], mark the published rows, record every failure against its
//! own row with one backoff.

use std::time::Duration;

use crate::{
    Error, InProcessTransport, InboxStore, OutboxFailure, OutboxFate, OutboxRow, OutboxStore,
    Result, DEFAULT_OUTBOX_MAX_ATTEMPTS,
};

/// What a relay round is told: who leases, how much, for how long, and how failed
/// rows back off.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayRound {
    /// The relay's name. A round leases as `<relay>/<token>`, the token 32 random hex
    /// digits drawn per round ([`RelayRound::run`]), recorded as `leased_by`.
    pub relay: String,
    /// Most rows leased at once.
    pub limit: usize,
    /// How long the lease holds.
    pub lease_for: Duration,
    /// First delay before a failed row is tried again, doubled per attempt up to
    /// [`MAX_OUTBOX_RETRY_DELAY`](crate::MAX_OUTBOX_RETRY_DELAY) ([`OutboxFate::after`]).
    pub retry_after: Duration,
    /// Failed publications after which a row is dead. Refusals
    /// ([`Publication::refused`]) count towards it but are never a row's last: a row
    /// refused past it stays live, and is dead at its first failure of its own.
    pub max_attempts: u32,
}

impl RelayRound {
    /// A round of `relay` leasing up to `limit` rows for 30 s; failed rows due again
    /// after 1 s and doubling, dead after [`DEFAULT_OUTBOX_MAX_ATTEMPTS`].
    pub fn new(relay: impl Into<String>, limit: usize) -> Self {
        Self {
            relay: relay.into(),
            limit,
            lease_for: Duration::from_secs(30),
            retry_after: Duration::from_secs(1),
            max_attempts: DEFAULT_OUTBOX_MAX_ATTEMPTS,
        }
    }

    /// Sets how long the lease holds.
    pub fn lease_for(mut self, lease_for: Duration) -> Self {
        self.lease_for = lease_for;
        self
    }

    /// Sets the first delay of a failed row and how many failures make it dead.
    pub fn failures(mut self, retry_after: Duration, max_attempts: u32) -> Self {
        self.retry_after = retry_after;
        self.max_attempts = max_attempts;
        self
    }

    /// Leases, checks the lease still holds, publishes through `publisher`, marks
    /// the published rows and records every failed (or unreadable) row against
    /// itself. A store error while leasing is returned; one while marking or
    /// recording is kept in the report (the rows stay leased and are taken again
    /// once the lease expires), so the failures are still recorded after a failed
    /// mark.
    pub fn run<O, P>(&self, outbox: &O, publisher: &mut P) -> Result<RoundReport>
    where
        O: OutboxStore + ?Sized,
        P: OutboxPublisher + ?Sized,
    {
        // The lease's holder is this round alone: a late mark or failure of this round
        // only touches rows this very lease holds. The relay's name alone would not
        // do: after a failover that lost committed transactions, the outbox's id
        // sequence hands out the lost ids again, and another round of the same relay
        // may hold a new row under an id this round published an old row as.
        let holder = format!("{}/{}", self.relay, uuid::Uuid::new_v4().simple());
        let lease = outbox.lease(&holder, self.limit, self.lease_for)?;
        let mut report = RoundReport {
            leased: lease.rows.len() + lease.unreadable.len(),
            ..RoundReport::default()
        };
        if report.leased == 0 {
            return Ok(report);
        }
        // An expired lease may already be another relay's: publish nothing.
        let now = outbox.now();
        if now >= lease.until {
            report.expired = true;
            return Ok(report);
        }
        let within = (lease.until - now).to_std().unwrap_or_default();
        let mut publication = publisher.publish(&lease.rows, within);
        if let Some(reason) = &publication.lost {
            // No answer will come for the unanswered rows (the connection is gone), or
            // none in time (the lease ran out: any relay could take them already):
            // released as refused, they go out again after their delay instead of
            // waiting out the lease. A copy still in flight can land after a later
            // copy. It lands after a later row of its ordering key only if the
            // connection that carried it holds it past this row's next copy being
            // published and marked (a broker that stopped reading the connection,
            // under a memory alarm, say): that row is leased only once this one is
            // published and marked. The AMQP relay keeps at most 32 KiB of a round
            // queued unwritten in the client (`inbox-amqp/src/publish.rs`).
            let answered: std::collections::HashSet<i64> = (publication.published.iter())
                .chain(publication.failed.iter().map(|(id, _)| id))
                .chain(publication.refused.iter().map(|(id, _)| id))
                .copied()
                .collect();
            let unanswered: Vec<(i64, String)> = (lease.rows.iter())
                .filter(|row| !answered.contains(&row.id))
                .map(|row| (row.id, format!("no answer from the broker: {reason}")))
                .collect();
            report.unanswered = unanswered.len();
            publication.refused.extend(unanswered);
        }
        report.lost = publication.lost;
        report.confirmed = publication.published.len();
        let fate = |attempts| OutboxFate::after(self.retry_after, attempts, self.max_attempts);
        let attempts_of = |id| lease.rows.iter().find(|r| r.id == id).map(|r| r.attempts);
        report.failures = publication
            .failed
            .into_iter()
            .map(|(id, error)| OutboxFailure {
                id,
                fate: fate(attempts_of(id).unwrap_or(0)),
                error,
            })
            .chain(lease.unreadable.iter().map(|row| OutboxFailure {
                id: row.id,
                fate: fate(row.attempts),
                error: row.error.clone(),
            }))
            .chain(
                (publication.refused.into_iter()).map(|(id, error)| OutboxFailure {
                    id,
                    // Never the last attempt: the delay doubles, death never comes.
                    fate: OutboxFate::after(
                        self.retry_after,
                        attempts_of(id).unwrap_or(0),
                        u32::MAX,
                    ),
                    error,
                }),
            )
            .collect();
        // Marked only after the publisher confirmed: a relay that dies here leaves
        // the rows leased, and they are published again after the lease expires.
        match outbox.mark_published(&holder, &publication.published) {
            Ok(marked) => report.marked = marked,
            Err(err) => report.mark_error = Some(err),
        }
        if !report.failures.is_empty() {
            if let Err(err) = outbox.record_failures(&holder, &report.failures) {
                report.record_error = Some(err);
            }
        }
        Ok(report)
    }
}

/// What a round did.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct RoundReport {
    /// Rows leased, readable or not (0: nothing was due).
    pub leased: usize,
    /// The lease had expired before publishing: nothing was published or recorded.
    pub expired: bool,
    /// Rows the publisher confirmed.
    pub confirmed: usize,
    /// Confirmed rows marked published (fewer than `confirmed` when the lease was
    /// lost before marking: those are published again).
    pub marked: usize,
    /// The failures recorded (or, with `record_error`, meant to be), each with its
    /// fate.
    pub failures: Vec<OutboxFailure>,
    /// Why the publisher stopped before settling every row; the unsettled rows are
    /// released as refused (in `failures`) and taken again after their delay.
    pub lost: Option<String>,
    /// How many of `failures` are rows a lost publication left unanswered.
    pub unanswered: usize,
    /// Marking failed: the confirmed rows stay leased and are published again.
    pub mark_error: Option<Error>,
    /// Recording the failures failed: the rows are leased again when the lease
    /// expires.
    pub record_error: Option<Error>,
}

impl RoundReport {
    /// Failed rows due again later.
    pub fn retried(&self) -> usize {
        self.failures.len() - self.dead()
    }

    /// Failed rows that failed their last attempt.
    pub fn dead(&self) -> usize {
        self.failures
            .iter()
            .filter(|f| f.fate == OutboxFate::Dead)
            .count()
    }
}

/// What a relay round publishes through.
pub trait OutboxPublisher {
    /// Publishes `rows` (in id order) and waits for each to be confirmed, for at
    /// most `within` (the lease's remaining time). A row that fails on its own is
    /// listed in [`Publication::failed`] and never stops the others; one the broker
    /// refused for a reason not its own (a nack) in [`Publication::refused`].
    fn publish(&mut self, rows: &[OutboxRow], within: Duration) -> Publication;
}

/// What a publisher settled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Publication {
    /// Ids of the confirmed rows.
    pub published: Vec<i64>,
    /// Rows that failed on their own: id and what went wrong.
    pub failed: Vec<(i64, String)>,
    /// Rows the broker refused for a reason not their own (a nack: the queue cannot
    /// take anything now): id and the broker's answer. Recorded as a failed attempt
    /// with its doubling delay, but never as a row's last: a refusal, however many,
    /// never makes a row dead. The rows a lost publication left unanswered are
    /// released the same way.
    pub refused: Vec<(i64, String)>,
    /// Why publishing stopped before every row was settled (the connection was
    /// lost, or the lease ran out). The round releases the rows neither published,
    /// failed nor refused as refused (`no answer from the broker: <why>`): no answer
    /// can come for them, so they go out again after their delay rather than when
    /// the lease expires.
    pub lost: Option<String>,
}

impl Publication {
    /// Records a confirmed row.
    pub fn confirmed(&mut self, id: i64) {
        self.published.push(id);
    }

    /// Records a row that failed on its own.
    pub fn failed(&mut self, id: i64, error: impl Into<String>) {
        self.failed.push((id, error.into()));
    }

    /// Records a row the broker refused for a reason not its own.
    pub fn refused(&mut self, id: i64, error: impl Into<String>) {
        self.refused.push((id, error.into()));
    }
}

impl<S: InboxStore> OutboxPublisher for InProcessTransport<S> {
    fn publish(&mut self, rows: &[OutboxRow], _within: Duration) -> Publication {
        let mut publication = Publication::default();
        for row in rows {
            // A replay is for one group alone (see `replay_target`).
            let sent = match crate::replay_target(&row.message) {
                Some(group) => self.deliver_to(&group, row.message.to_envelope()),
                None => InProcessTransport::publish(self, row.message.to_envelope()),
            };
            match sent {
                Ok(_) => publication.confirmed(row.id),
                Err(err) => publication.failed(row.id, err.to_string()),
            }
        }
        publication
    }
}

/// One relay round into the in-process transport: lease, check the lease, publish,
/// mark. Returns how many rows were published. For embedded use (SQLite) and tests.
/// A row that fails (or cannot be read) is recorded against itself, due again after
/// a second and doubling, dead after [`DEFAULT_OUTBOX_MAX_ATTEMPTS`]; the others are
/// published. [`RelayRound::run`] takes other settings.
pub fn relay_in_process<O, S>(
    outbox: &O,
    transport: &mut InProcessTransport<S>,
    relay: &str,
    limit: usize,
) -> Result<usize>
where
    O: OutboxStore + ?Sized,
    S: InboxStore,
{
    let report = RelayRound::new(relay, limit).run(outbox, transport)?;
    match (report.mark_error, report.record_error) {
        (Some(err), _) | (None, Some(err)) => Err(err),
        (None, None) => Ok(report.marked),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use chrono::{DateTime, Utc};

    use super::*;
    use crate::{Lease, MessageKey, OutboxMessage, UnreadableRow};

    /// An outbox whose lease is fixed, recording what the round did with it.
    struct FakeOutbox {
        lease: Lease,
        now: DateTime<Utc>,
        marked: Mutex<Vec<i64>>,
        recorded: Mutex<Vec<OutboxFailure>>,
        /// How many of the marked rows are still leased.
        still_leased: usize,
        fail_mark: bool,
        /// The holder of the last lease.
        holder: Mutex<Option<String>>,
    }

    impl OutboxStore for FakeOutbox {
        fn lease(&self, relay: &str, _: usize, _: Duration) -> Result<Lease> {
            // The round's own holder: the relay's name and 32 random hex digits.
            let token = relay.strip_prefix("r/").expect(relay);
            assert!(token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()));
            let mut holder = self.holder.lock().unwrap();
            assert_ne!(holder.as_deref(), Some(relay), "a token per round");
            *holder = Some(relay.to_owned());
            Ok(self.lease.clone())
        }
        fn mark_published(&self, relay: &str, ids: &[i64]) -> Result<usize> {
            assert_eq!(self.holder.lock().unwrap().as_deref(), Some(relay));
            if self.fail_mark {
                return Err(Error::Store("database went away".into()));
            }
            self.marked.lock().unwrap().extend_from_slice(ids);
            Ok(ids.len().min(self.still_leased))
        }
        fn record_failures(&self, relay: &str, failures: &[OutboxFailure]) -> Result<()> {
            assert_eq!(self.holder.lock().unwrap().as_deref(), Some(relay));
            self.recorded.lock().unwrap().extend_from_slice(failures);
            Ok(())
        }
        fn oldest_unpublished_age(&self) -> Result<Option<Duration>> {
            Ok(None)
        }
        fn now(&self) -> DateTime<Utc> {
            self.now
        }
    }

    /// Fails the rows whose id is listed; confirms the others.
    struct FakePublisher {
        fail: Vec<i64>,
        calls: Vec<(Vec<i64>, Duration)>,
    }

    impl OutboxPublisher for FakePublisher {
        fn publish(&mut self, rows: &[OutboxRow], within: Duration) -> Publication {
            self.calls
                .push((rows.iter().map(|r| r.id).collect(), within));
            let mut publication = Publication::default();
            for row in rows {
                if self.fail.contains(&row.id) {
                    publication.failed(row.id, "unroutable");
                } else {
                    publication.confirmed(row.id);
                }
            }
            publication
        }
    }

    fn row(id: i64, attempts: i32, now: DateTime<Utc>) -> OutboxRow {
        let key = MessageKey::new(format!("k{id}")).unwrap();
        OutboxRow {
            id,
            message: OutboxMessage::new(key, "x", "t", vec![]),
            attempts,
            created_at: now,
        }
    }

    fn outbox(until_secs: i64, rows: Vec<OutboxRow>, unreadable: Vec<UnreadableRow>) -> FakeOutbox {
        let now: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
        FakeOutbox {
            lease: Lease {
                relay: "r".into(),
                until: now + chrono::Duration::seconds(until_secs),
                rows,
                unreadable,
            },
            now,
            marked: Mutex::new(vec![]),
            recorded: Mutex::new(vec![]),
            still_leased: usize::MAX,
            fail_mark: false,
            holder: Mutex::new(None),
        }
    }

    fn publisher(fail: Vec<i64>) -> FakePublisher {
        FakePublisher {
            fail,
            calls: vec![],
        }
    }

    #[test]
    fn an_expired_lease_publishes_nothing() {
        let now = "2026-01-01T00:00:00Z".parse().unwrap();
        for until in [0, -5] {
            let store = outbox(until, vec![row(1, 0, now)], vec![]);
            let mut p = publisher(vec![]);
            let report = RelayRound::new("r", 10).run(&store, &mut p).unwrap();
            assert!(report.expired);
            assert_eq!((report.leased, report.confirmed, report.marked), (1, 0, 0));
            assert!(p.calls.is_empty(), "published past the lease");
            assert!(store.marked.lock().unwrap().is_empty());
            assert!(store.recorded.lock().unwrap().is_empty());
        }
    }

    #[test]
    fn each_failure_is_recorded_against_its_row_with_the_backoff() {
        let now = "2026-01-01T00:00:00Z".parse().unwrap();
        let rows = vec![
            row(1, 0, now),
            row(2, 3, now),
            row(3, 0, now),
            row(4, 4, now),
        ];
        let unreadable = vec![UnreadableRow {
            id: 9,
            attempts: 1,
            error: "headers are not JSON".into(),
        }];
        let store = outbox(20, rows, unreadable);
        let mut p = publisher(vec![2, 4]);
        let s = Duration::from_secs(2);
        let round = RelayRound::new("r", 10).failures(s, 5);
        let report = round.run(&store, &mut p).unwrap();
        assert_eq!(p.calls, [(vec![1, 2, 3, 4], Duration::from_secs(20))]);
        assert_eq!(*store.marked.lock().unwrap(), [1, 3]);
        assert_eq!((report.confirmed, report.marked), (2, 2));
        let recorded = store.recorded.lock().unwrap().clone();
        let fates: Vec<_> = recorded.iter().map(|f| (f.id, f.fate)).collect();
        assert_eq!(
            fates,
            [
                (2, OutboxFate::RetryAfter(8 * s)),
                (4, OutboxFate::Dead),
                (9, OutboxFate::RetryAfter(2 * s)),
            ]
        );
        assert_eq!(recorded[0].error, "unroutable");
        assert_eq!(recorded[2].error, "headers are not JSON");
        assert_eq!(recorded, report.failures);
        assert_eq!((report.retried(), report.dead()), (2, 1));
    }

    /// Refuses every row (a nack of each).
    struct RefusingPublisher;

    impl OutboxPublisher for RefusingPublisher {
        fn publish(&mut self, rows: &[OutboxRow], _within: Duration) -> Publication {
            let mut publication = Publication::default();
            for row in rows {
                publication.refused(row.id, "nacked by the broker");
            }
            publication
        }
    }

    #[test]
    fn a_refusal_is_never_a_rows_last_attempt() {
        let now = "2026-01-01T00:00:00Z".parse().unwrap();
        // Row 2 is one failure from dead, row 3 far past it: a refusal kills neither,
        // and their delays double as any failure's.
        let rows = vec![row(1, 0, now), row(2, 4, now), row(3, 40, now)];
        let store = outbox(20, rows, vec![]);
        let s = Duration::from_secs(2);
        let round = RelayRound::new("r", 10).failures(s, 5);
        let report = round.run(&store, &mut RefusingPublisher).unwrap();
        let recorded = store.recorded.lock().unwrap().clone();
        let fates: Vec<_> = recorded.iter().map(|f| (f.id, f.fate)).collect();
        assert_eq!(
            fates,
            [
                (1, OutboxFate::RetryAfter(s)),
                (2, OutboxFate::RetryAfter(16 * s)),
                (3, OutboxFate::RetryAfter(crate::MAX_OUTBOX_RETRY_DELAY)),
            ]
        );
        assert_eq!(recorded[1].error, "nacked by the broker");
        assert_eq!((report.retried(), report.dead()), (3, 0));
        assert!(store.marked.lock().unwrap().is_empty());
    }

    /// Confirms row 1, fails row 2 and loses its connection before any other answer.
    struct LosingPublisher;

    impl OutboxPublisher for LosingPublisher {
        fn publish(&mut self, _rows: &[OutboxRow], _within: Duration) -> Publication {
            let mut publication = Publication::default();
            publication.confirmed(1);
            publication.failed(2, "unroutable");
            publication.lost = Some("connection reset".into());
            publication
        }
    }

    #[test]
    fn the_rows_a_lost_publication_left_unanswered_are_released_as_refused() {
        let now = "2026-01-01T00:00:00Z".parse().unwrap();
        let rows = vec![
            row(1, 0, now),
            row(2, 0, now),
            row(3, 0, now),
            row(4, 30, now),
        ];
        let store = outbox(20, rows, vec![]);
        let s = Duration::from_secs(2);
        let report = (RelayRound::new("r", 10).failures(s, 5))
            .run(&store, &mut LosingPublisher)
            .unwrap();
        assert_eq!(*store.marked.lock().unwrap(), [1]);
        let recorded = store.recorded.lock().unwrap().clone();
        let fates: Vec<_> = recorded.iter().map(|f| (f.id, f.fate)).collect();
        assert_eq!(
            fates,
            [
                (2, OutboxFate::RetryAfter(s)),
                (3, OutboxFate::RetryAfter(s)),
                // Past `max_attempts`, but no answer is never a row's last attempt.
                (4, OutboxFate::RetryAfter(crate::MAX_OUTBOX_RETRY_DELAY)),
            ]
        );
        assert_eq!(
            recorded[1].error,
            "no answer from the broker: connection reset"
        );
        assert_eq!(report.lost.as_deref(), Some("connection reset"));
        assert_eq!(
            (report.retried(), report.dead(), report.unanswered),
            (3, 0, 2)
        );
    }

    #[test]
    fn a_lease_lost_before_marking_and_a_failed_mark_are_reported() {
        let now = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut store = outbox(20, vec![row(1, 0, now), row(2, 0, now)], vec![]);
        store.still_leased = 1;
        let report = RelayRound::new("r", 10)
            .run(&store, &mut publisher(vec![]))
            .unwrap();
        assert_eq!((report.confirmed, report.marked), (2, 1));

        let mut store = outbox(20, vec![row(1, 0, now), row(2, 0, now)], vec![]);
        store.fail_mark = true;
        let report = RelayRound::new("r", 10)
            .run(&store, &mut publisher(vec![2]))
            .unwrap();
        assert!(matches!(report.mark_error, Some(Error::Store(_))));
        // The failure is still recorded after the failed mark.
        assert_eq!(store.recorded.lock().unwrap().len(), 1);
    }
}
