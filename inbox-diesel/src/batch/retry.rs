//! Transaction retries: the batch transaction is run again after contention
//! (bounded), then split in halves; a data error on the store's own statements splits
//! the batch until the delivery is alone.

use std::time::{Duration, Instant};

use inbox_core::display::Escaped;
use inbox_core::{ConsumerGroup, Decision};

use super::claim::{phantom, Attempt};
use super::delivery::Delivery;
use super::metrics::record_metrics;
use super::run::{depth, Mode};
use super::tx::TxError;
use crate::backend::StoreConnection;
use crate::store::Inner;
use crate::{Error, Result};

/// How long a delivery waits when its transaction kept deadlocking even alone.
pub(super) const CONTENDED_RETRY: Duration = Duration::from_secs(1);

impl<C: StoreConnection> Inner<C> {
    /// Runs a batch transaction; after contention again (bounded), then split in
    /// halves; a delivery alone whose free reruns are spent runs once more with a
    /// contention error inside its handler counted as an attempt. A data error on the
    /// store's own statements splits the batch until the delivery is alone, which is
    /// then dead-lettered as `malformed`: no single delivery fails its batch forever.
    pub(super) fn run_with_retries(
        &self,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
    ) -> Result<Vec<(usize, Decision)>> {
        let mut tries = 0;
        let mut count_contention = false;
        loop {
            let mut conn = self.connection()?;
            let outcome = self.run_transaction(&mut conn, group, items, count_contention);
            drop(conn);
            let err = match outcome {
                Ok(decisions) => {
                    record_metrics(group, decisions.iter().map(|(_, d)| d));
                    return Ok(decisions);
                }
                Err(TxError::Fatal(err)) => return Err(err),
                Err(TxError::Retryable(err)) => err,
                Err(TxError::Data(err)) => return self.split_on_data_error(group, items, &err),
                Err(TxError::Ended(handler)) => {
                    let detail = format!(
                        "handler {handler} ended or restarted the store's transaction itself (or \
                         moved its session's search_path); claims and effects of its batch may \
                         have committed without their decisions"
                    );
                    let decisions: Vec<(usize, Decision)> = items
                        .iter()
                        .map(|d| (d.idx, phantom(group, &d.env.message_key, &detail)))
                        .collect();
                    record_metrics(group, decisions.iter().map(|(_, d)| d));
                    return Ok(decisions);
                }
                Err(TxError::Isolate(_)) => {
                    return Err(Error::Internal("isolation requested by an isolated run"))
                }
            };
            tries += 1;
            metrics::counter!(inbox_core::metrics::BATCH_CONFLICTS_TOTAL, "group" => group.to_string())
                .increment(1);
            tracing::warn!(group = %group, tries, error = %err, "batch transaction conflicted");
            if tries <= self.settings().transaction_retries {
                std::thread::sleep(Duration::from_millis(5 * u64::from(tries)));
                continue;
            }
            if items.len() > 1 {
                let (left, right) = items.split_at(items.len() / 2);
                let mut decisions = self.run_with_retries(group, left)?;
                decisions.extend(self.run_with_retries(group, right)?);
                return Ok(decisions);
            }
            if !count_contention {
                // Alone, free reruns spent: once more, and this time contention raised
                // inside the handler is its failure (an attempt), so a message that
                // always conflicts climbs the retry ladder instead of looping forever.
                count_contention = true;
                continue;
            }
            // Still conflicting on the store's own statements: not the message's
            // fault, so no attempt is counted.
            let decisions: Vec<(usize, Decision)> = items
                .iter()
                .map(|d| (d.idx, Decision::RetryAfter(CONTENDED_RETRY)))
                .collect();
            record_metrics(group, decisions.iter().map(|(_, d)| d));
            return Ok(decisions);
        }
    }

    /// A data error on the store's own statements: halves until the delivery is
    /// alone, then its dead letter (`malformed`), with what could not be stored kept.
    fn split_on_data_error(
        &self,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
        err: &diesel::result::Error,
    ) -> Result<Vec<(usize, Decision)>> {
        match items {
            [d] => {
                let why = format!("the store could not write the delivery: {err}");
                Ok(vec![(
                    d.idx,
                    self.dead_letter_malformed(group, d.env, &why)?,
                )])
            }
            _ => {
                tracing::warn!(group = %group, size = items.len(), error = %Escaped(&err.to_string()), "a delivery's data failed its batch: splitting");
                let (left, right) = items.split_at(items.len() / 2);
                let mut decisions = self.run_with_retries(group, left)?;
                decisions.extend(self.run_with_retries(group, right)?);
                Ok(decisions)
            }
        }
    }

    fn run_transaction(
        &self,
        conn: &mut C,
        group: &ConsumerGroup,
        items: &[&Delivery<'_, C>],
        count_contention: bool,
    ) -> std::result::Result<Vec<(usize, Decision)>, TxError> {
        let started = Instant::now();
        let now = self.now();
        // Counting contention needs a savepoint per message (a deadlock aborts the
        // transaction), so that run is isolated from the start.
        let first = if count_contention {
            Mode::Isolated { count_contention }
        } else {
            Mode::Optimistic
        };
        let ended = std::cell::Cell::new(None);
        let attempt = Attempt {
            group,
            items,
            now,
            ended: &ended,
        };
        let outcome = match self.attempt(conn, &attempt, first, None) {
            Err(TxError::Isolate(known)) => self.attempt(
                conn,
                &attempt,
                Mode::Isolated {
                    count_contention: false,
                },
                known,
            ),
            other => other,
        };
        if let Some(handler) = ended.take() {
            // The connection goes back to the pool: as the store set it up, not as the
            // handler left it.
            self.restore_session(conn)?;
            return Err(TxError::Ended(handler));
        }
        let decisions = outcome?;
        let left = depth(conn)?;
        if left != 0 {
            return Err(TxError::Fatal(Error::TransactionDepth {
                expected: 0,
                found: left,
            }));
        }
        metrics::histogram!(inbox_core::metrics::BATCH_COMMIT_SECONDS, "group" => group.to_string())
            .record(started.elapsed().as_secs_f64());
        Ok(decisions)
    }
}
