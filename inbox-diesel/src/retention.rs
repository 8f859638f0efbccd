//! Retention: published outbox rows and `done` claims are deleted in bounded batches
//! once they are older than a window.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::result::QueryResult;
use inbox_core::delta;

use crate::backend::StoreConnection;
use crate::{Error, Result, Store};

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
            return Err(Error::Config(format!(
                "done-claim retention ({done_claims:?}) is shorter than the longest retry \
                 delay ({longest_retry_delay:?}): a retried copy arriving after its claim \
                 was deleted would be processed again"
            )));
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

impl<C: StoreConnection> Store<C> {
    /// Deletes outbox rows published longer ago than `retention.published()`, at most
    /// `batch` rows per transaction, until a batch deletes fewer; returns how many.
    ///
    /// On PostgreSQL rows locked by another transaction are skipped (the next purge
    /// takes them), so a purge never waits for a relay.
    pub fn purge_published(&self, retention: &Retention, batch: usize) -> Result<u64> {
        self.purge(retention.published, batch, C::purge_published)
    }

    /// Deletes `done` claims last changed longer ago than `retention.done_claims()`, at
    /// most `batch` rows per transaction, until a batch deletes fewer; returns how
    /// many. Failed, started and dead claims are kept.
    ///
    /// On PostgreSQL claims locked by a running batch are skipped (the next purge
    /// takes them), so a purge never waits for, or deadlocks with, a consumer.
    pub fn purge_done_claims(&self, retention: &Retention, batch: usize) -> Result<u64> {
        self.purge(retention.done_claims, batch, C::purge_done_claims)
    }

    fn purge(
        &self,
        window: Duration,
        batch: usize,
        delete: fn(&mut C, DateTime<Utc>, i64) -> QueryResult<usize>,
    ) -> Result<u64> {
        if batch == 0 {
            return Err(Error::Config(
                "a purge batch must be at least 1 row, found 0".to_owned(),
            ));
        }
        // One cutoff for the whole purge: the loop does not chase a moving clock.
        let Some(cutoff) = self.clock().now().checked_sub_signed(delta(window)) else {
            return Ok(0); // a window reaching before the calendar: nothing is that old
        };
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let mut conn = self.connection()?;
        let mut total = 0u64;
        loop {
            let deleted = C::write_transaction(&mut *conn, |conn| delete(conn, cutoff, limit))?;
            total += deleted as u64;
            if deleted < batch {
                return Ok(total);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_claim_window_shorter_than_the_longest_retry() {
        let s = Duration::from_secs;
        let err = Retention::new(s(0), s(599), s(600))
            .unwrap_err()
            .to_string();
        assert!(err.contains("(599s)") && err.contains("(600s)"), "{err}");
        assert!(Retention::new(s(0), s(600), s(600)).is_ok());
    }
}
