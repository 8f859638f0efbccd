//! The operator's side of halted groups: list them, resume one (see `crate::halts`
//! for the consumer's side).

use inbox_core::ConsumerGroup;

use crate::halts::{halted, HaltedGroup};
use crate::Result;

impl<C: super::OperatorConnection> super::Operator<C> {
    /// Every halted consumer group, by name.
    pub fn list_halted_groups(&self) -> Result<Vec<HaltedGroup>> {
        halted(self.store())
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
