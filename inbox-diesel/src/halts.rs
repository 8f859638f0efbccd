//! Consumer groups halted by a claim invariant violation: the consumer records the
//! halt and resumes a group once its halt is gone (the operator's listing and resume
//! are `operator::Operator`'s, over the same rows). Part of the inbox path, so not
//! behind a capability: the statements implement the base trait (`HaltOps`), expanded
//! by each backend from [`halt_ops`].

use chrono::{DateTime, Utc};
use inbox_core::{ClaimInvariantViolated, ConsumerGroup, GroupHalts, MessageKey};

use crate::backend::StoreConnection;
use crate::{Error, Result, Store};

/// A consumer group's recorded halt (listed by `operator::Operator`).
#[cfg_attr(not(feature = "operator"), allow(unreachable_pub, dead_code))]
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

#[cfg_attr(not(feature = "operator"), allow(unreachable_pub))]
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

/// Every halted group of `store`, by name: the inbox path's read (a consumer polls
/// it), which the operator's listing shares.
pub(crate) fn halted<C: StoreConnection>(store: &Store<C>) -> Result<Vec<HaltedGroup>> {
    let mut conn = store.connection()?;
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
        Ok(halted(self)?
            .iter()
            .map(HaltedGroup::cause)
            .collect::<Result<_>>()?)
    }
}

/// The halt statements, written once in diesel's DSL and expanded by each backend
/// (`pg/mod.rs`, `sqlite/mod.rs`). A macro still: recording a halt is an upsert
/// (`ON CONFLICT DO NOTHING`), which diesel names no type for, so a generic
/// function could not bound it, and splitting these three statements over two
/// traits reads worse than one expansion (see `dsl.rs`).
macro_rules! halt_ops {
    ($conn:ty) => {
        impl crate::statements::HaltOps for $conn {
            fn op_record_halt(
                conn: &mut Self,
                halt: &crate::statements::HaltRow,
            ) -> QueryResult<bool> {
                use crate::schema::inbox_group_halts::dsl::*;
                let written = diesel::insert_into(inbox_group_halts)
                    .values((
                        consumer_group.eq(&halt.0),
                        message_key.eq(&halt.1),
                        detail.eq(&halt.2),
                        halted_at.eq(crate::schema::Stamp(halt.3)),
                    ))
                    .on_conflict(consumer_group)
                    .do_nothing()
                    .execute(conn)?;
                Ok(written == 1)
            }

            fn op_halts(conn: &mut Self) -> QueryResult<Vec<crate::statements::HaltRow>> {
                use crate::schema::inbox_group_halts::dsl::*;
                inbox_group_halts
                    .order(consumer_group)
                    .select((consumer_group, message_key, detail, halted_at))
                    .load(conn)
            }

            fn op_delete_halt(conn: &mut Self, group: &str) -> QueryResult<usize> {
                use crate::schema::inbox_group_halts::dsl::*;
                diesel::delete(inbox_group_halts.filter(consumer_group.eq(group))).execute(conn)
            }
        }
    };
}

pub(crate) use halt_ops;
