//! Retention: published outbox rows and `done` claims are deleted in bounded batches
//! once they are older than a window.

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::earlier_by;

use crate::backend::StoreConnection;
use crate::{Error, PurgeBatch, PurgeTarget, Result, Store};

/// How long published outbox rows and `done` claims are kept.
///
/// A `done` claim is what turns a late copy of a message into a duplicate: once it is
/// deleted, a copy arriving later is processed again. Copies arrive late from the
/// retry tiers, so the claim window may not be shorter than the longest retry delay:
/// with a broker transport, the longest tier of its [`RetryLadder`](inbox_core::RetryLadder)
/// (every delay is rounded up to a tier, capped at the longest); without a ladder
/// (the in-process transport), the largest [`RetryPolicy::max`](inbox_core::RetryPolicy::max)
/// of the handlers, or the longest `retry_after` a handler returns, if longer. Add
/// the broker's redelivery lag on top.
///
/// Any window is taken, from 0 (everything older than now goes) to `Duration::MAX`:
/// a window reaching before year 1 ([`EARLIEST_STORED_TIME`](inbox_core::EARLIEST_STORED_TIME))
/// keeps everything, so "keep for ever" is a window of 10,000 years (`3650000d`).
///
/// ```
/// use std::time::Duration;
/// use inbox_diesel::Retention;
/// let day = Duration::from_secs(86_400);
/// let longest_tier = Duration::from_secs(600);
/// let retention = Retention::new(day, 7 * day, longest_tier)?;
/// assert_eq!(retention.done_claims(), 7 * day);
/// assert!(Retention::new(day, Duration::from_secs(60), longest_tier).is_err());
/// # Ok::<(), inbox_diesel::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    published: Duration,
    done_claims: Duration,
}

impl Retention {
    /// Keeps published outbox rows for `published` after publication and `done`
    /// claims for `done_claims` after their last change; refuses a claim window
    /// shorter than `longest_retry_delay`.
    pub fn new(
        published: Duration,
        done_claims: Duration,
        longest_retry_delay: Duration,
    ) -> Result<Self> {
        if done_claims < longest_retry_delay {
            // A retried copy arriving after its claim was deleted would be processed
            // again.
            return Err(Error::InvalidSetting {
                setting: "done_claims",
                expected: "a retention at least as long as the longest retry delay",
                found: format!(
                    "{done_claims:?}, with a longest retry delay of {longest_retry_delay:?}"
                ),
            });
        }
        Ok(Self {
            published,
            done_claims,
        })
    }

    /// How long published outbox rows are kept.
    pub fn published(&self) -> Duration {
        self.published
    }

    /// How long `done` claims are kept.
    pub fn done_claims(&self) -> Duration {
        self.done_claims
    }
}

/// PostgreSQL: the first key of the purge lock, `pg_try_advisory_xact_lock(
/// PURGE_LOCK_CLASS, '<table>'::regclass::oid::int4)`, whose second key is the purged
/// table's oid (`inbox_claims`, `outbox_messages`, `inbox_dead_letters` or
/// `idempotency_keys` of the store's schema). Each purge batch tries it and stops when another purge holds it;
/// an operator can hold it (`SELECT pg_advisory_lock(...)`) to pause purges of a table.
pub const PURGE_LOCK_CLASS: i32 = 0x696e_6278;

/// Deletes one bounded batch of `target`'s rows older than `cutoff` in the caller's
/// transaction: at most `limit` rows, oldest first, starting at `from` (the previous
/// batch's [`PurgeBatch::resume_from`]; `None` for a purge's first batch). The
/// store's `purge_*` methods loop over it, one transaction per batch; call it
/// yourself to pace a purge (a pause between batches) or to run it in a transaction
/// of your own.
///
/// On PostgreSQL, rows another transaction holds (a consumer's running batch, a
/// relay) are skipped and left for a later purge, never waited for; and a batch first
/// tries the table's purge lock (a transaction-level advisory lock), so one purge of
/// each kind runs at a time: when another purge holds it, the batch deletes nothing
/// and says [`busy`](PurgeBatch::busy). Call it inside a transaction: the lock is
/// held until that transaction ends.
///
/// ```no_run
/// use chrono::{Duration, Utc};
/// use diesel::Connection;
/// use inbox_diesel::{purge_batch, PurgeTarget};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = diesel::PgConnection::establish("postgres://postgres@127.0.0.1/test")?;
/// let cutoff = Utc::now() - Duration::days(30);
/// let mut from = None;
/// loop {
///     let batch = conn.transaction(|conn| {
///         purge_batch(conn, PurgeTarget::DoneClaims, cutoff, 1000, from)
///     })?;
///     if batch.busy || batch.deleted < 1000 {
///         break;
///     }
///     from = batch.resume_from;
///     std::thread::sleep(std::time::Duration::from_millis(50)); // leave room for consumers
/// }
/// # Ok(())
/// # }
/// ```
pub fn purge_batch<C: StoreConnection>(
    conn: &mut C,
    target: PurgeTarget,
    cutoff: DateTime<Utc>,
    limit: usize,
    from: Option<DateTime<Utc>>,
) -> Result<PurgeBatch> {
    if limit == 0 {
        return Err(Error::invalid("batch", "at least 1 row", 0));
    }
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    Ok(C::purge_batch(conn, target, cutoff, limit, from)?)
}

/// How many of `target`'s rows a purge with `cutoff` would delete now: the dry-run
/// count beside [`purge_batch`], built from the same table, timestamp and rows, so
/// the two cannot disagree. Rows a running transaction holds are counted (a purge
/// skips them until they are free); a purge that runs later also takes the rows
/// that became eligible meanwhile.
pub fn count_purgeable<C: StoreConnection>(
    conn: &mut C,
    target: PurgeTarget,
    cutoff: DateTime<Utc>,
) -> Result<u64> {
    let n = C::count_purgeable(conn, target, cutoff)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

impl<C: StoreConnection> Store<C> {
    /// Deletes outbox rows published longer ago than `retention.published()`, at most
    /// `batch` rows per transaction, until a batch deletes fewer; returns how many.
    ///
    /// Concurrency as for [`purge_done_claims`](Self::purge_done_claims): on
    /// PostgreSQL rows a relay holds are skipped (the next purge takes them), and a
    /// second purge of published rows while one runs returns at once.
    pub fn purge_published(&self, retention: &Retention, batch: usize) -> Result<u64> {
        self.purge(PurgeTarget::PublishedOutboxRows, retention.published, batch)
    }

    /// Deletes `done` claims last changed longer ago than `retention.done_claims()`, at
    /// most `batch` rows per transaction, until a batch deletes fewer; returns how
    /// many. Failed, started and dead claims are kept.
    ///
    /// Each batch reads its rows from the retention index, oldest first, starting
    /// where the previous batch stopped (see [`purge_batch`]). On PostgreSQL claims
    /// locked by a running batch are skipped (the next purge takes them), so a purge
    /// never waits for, or deadlocks with, a consumer; and one purge of claims runs
    /// at a time per schema: a purge that finds another one running (another
    /// instance) stops at once and returns what it deleted so far (usually 0), the
    /// running one taking the rest. Run on several instances at once, purges never
    /// delete a row twice and never scan behind each other.
    pub fn purge_done_claims(&self, retention: &Retention, batch: usize) -> Result<u64> {
        self.purge(PurgeTarget::DoneClaims, retention.done_claims, batch)
    }

    /// The purge loop: one cutoff, one transaction per batch, each batch starting
    /// where the previous one stopped; it ends at a batch that deletes fewer than
    /// `batch` rows or finds another purge of the kind running.
    pub(crate) fn purge(&self, target: PurgeTarget, window: Duration, batch: usize) -> Result<u64> {
        if batch == 0 {
            return Err(Error::invalid("batch", "at least 1 row", 0));
        }
        // One cutoff for the whole purge: the loop does not chase a moving clock. A
        // window reaching before year 1 starts there, before every stored row: "keep
        // for ever" purges nothing, and never sends the database a time it cannot hold.
        let cutoff = earlier_by(self.clock().now(), window);
        let mut conn = self.connection()?;
        let mut total = 0u64;
        let mut from = None;
        loop {
            let done = C::write_transaction(&mut *conn, |conn| {
                purge_batch(conn, target, cutoff, batch, from)
            })?;
            total += done.deleted;
            if done.busy || done.deleted < batch as u64 {
                return Ok(total);
            }
            from = done.resume_from;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_claim_window_shorter_than_the_longest_retry() {
        let s = Duration::from_secs;
        let err = Retention::new(s(0), s(599), s(600)).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::InvalidSetting { setting: "done_claims", found, .. }
                    if found == "599s, with a longest retry delay of 600s"
            ),
            "{err:?}"
        );
        assert!(Retention::new(s(0), s(600), s(600)).is_ok());
    }
}
