//! Consumer groups halted by a claim invariant violation: the consumer records the
//! halt, an operator lists and resumes halted groups, and the consumer resumes a group
//! once its halt is gone.

use chrono::{DateTime, Utc};
use inbox_core::{ClaimInvariantViolated, ConsumerGroup, GroupHalts, MessageKey};

use crate::backend::StoreConnection;
use crate::{Error, Result, Store};

/// A consumer group's recorded halt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HaltedGroup {
    /// The consumer group.
    pub consumer_group: String,
    /// The key of the message whose claim broke the invariant.
    pub message_key: String,
    /// What was expected and what was found.
    pub detail: String,
    /// When the group halted (the store's clock).
    pub halted_at: DateTime<Utc>,
}

fn corrupt(what: &str, found: &str, err: inbox_core::InvalidName) -> Error {
    Error::Database(diesel::result::Error::DeserializationError(
        format!("recorded halt with {what} {found:?}: {err}").into(),
    ))
}

impl HaltedGroup {
    /// The violation the group halted for.
    pub fn cause(&self) -> Result<ClaimInvariantViolated> {
        Ok(ClaimInvariantViolated {
            group: ConsumerGroup::new(&self.consumer_group)
                .map_err(|e| corrupt("group", &self.consumer_group, e))?,
            key: MessageKey::new(&self.message_key)
                .map_err(|e| corrupt("message key", &self.message_key, e))?,
            detail: self.detail.clone(),
        })
    }
}

impl<C: StoreConnection> Store<C> {
    /// Every halted consumer group, by name.
    pub fn list_halted_groups(&self) -> Result<Vec<HaltedGroup>> {
        let mut conn = self.connection()?;
        Ok(C::op_halts(&mut conn)?
            .into_iter()
            .map(
                |(consumer_group, message_key, detail, halted_at)| HaltedGroup {
                    consumer_group,
                    message_key,
                    detail,
                    halted_at,
                },
            )
            .collect())
    }

    /// Resumes a halted consumer group: deletes its halt, so that every consumer of it
    /// resumes at its next poll (see `ConsumerSettings::halt_poll` in inbox-amqp).
    /// Returns whether the group was halted. Fix the cause first: a group resumed with
    /// its cause unfixed halts again on the same message.
    pub fn resume_group(&self, group: &str) -> Result<bool> {
        let group = ConsumerGroup::new(group)?;
        let mut conn = self.connection()?;
        let deleted =
            C::write_transaction(&mut *conn, |conn| C::op_delete_halt(conn, group.as_str()))?;
        if deleted == 1 {
            tracing::info!(group = %group, "consumer group resumed");
        }
        Ok(deleted == 1)
    }
}

impl<C: StoreConnection> GroupHalts for Store<C> {
    fn record_halt(&self, cause: &ClaimInvariantViolated) -> inbox_core::Result<()> {
        let now = self.clock().now();
        let row = (
            cause.group.to_string(),
            cause.key.to_string(),
            cause.detail.clone(),
            now,
        );
        let mut conn = self.connection()?;
        C::write_transaction(&mut *conn, |conn| C::op_record_halt(conn, &row))
            .map_err(Error::from)?;
        Ok(())
    }

    fn halted_groups(&self) -> inbox_core::Result<Vec<ClaimInvariantViolated>> {
        Ok(self
            .list_halted_groups()?
            .iter()
            .map(HaltedGroup::cause)
            .collect::<Result<_>>()?)
    }
}
