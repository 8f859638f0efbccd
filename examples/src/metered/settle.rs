//! Settlement of what a dead process left: every debit enqueues a settlement
//! message due at the request's deadline plus the margin (by the store's clock, in
//! the debit's transaction). A relay publishes it when due and a consumer refunds the
//! usage if it is still `debited`, by the same guarded write as the request's own
//! refund: a finished request (delivered or refunded) makes it a no-op. Runs in every
//! instance, so a restarted instance, or any other, settles what a dead one left.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::PgConnection;
use inbox_core::{
    relay_in_process, Clock, ConsumerGroup, Handler, HandlerError, InProcessTransport,
    MessageContext, RetryPolicy,
};
use inbox_diesel::Store;

use super::db::{self, SettlementDue, SETTLEMENT_GROUP, SETTLEMENT_TYPE};
use super::log::escaped;
use super::meter::{self, Count};

/// Counters of the settlement consumer, for `GET /admin/stats` and `GET /metrics`
/// (`metered_api_settlements_total{outcome}`).
#[derive(Debug)]
pub struct SettlementStats {
    /// Settlement messages that refunded a usage left `debited`.
    pub refunded: Count,
    /// Settlement messages for a usage already settled (the usual case).
    pub already_settled: Count,
}

impl Default for SettlementStats {
    /// Registers the counters with the recorder installed now (install it first).
    fn default() -> Self {
        Self {
            refunded: Count::new(meter::SETTLEMENTS_TOTAL, &[("outcome", "refunded")]),
            already_settled: Count::new(
                meter::SETTLEMENTS_TOTAL,
                &[("outcome", "already_settled")],
            ),
        }
    }
}

/// The consumer's handler.
pub struct Settler {
    group: ConsumerGroup,
    clock: Arc<dyn Clock>,
    stats: Arc<SettlementStats>,
}

impl Settler {
    /// A handler refunding through `clock`'s time.
    pub fn new(clock: Arc<dyn Clock>, stats: Arc<SettlementStats>) -> Self {
        Self {
            #[allow(clippy::unwrap_used)] // a constant, valid name
            group: ConsumerGroup::new(SETTLEMENT_GROUP).unwrap(),
            clock,
            stats,
        }
    }
}

impl Handler<PgConnection> for Settler {
    type Message = SettlementDue;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        SETTLEMENT_TYPE
    }

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::new(20, Duration::from_millis(500), Duration::from_secs(60))
            .unwrap_or_default()
    }

    fn handle(
        &self,
        conn: &mut PgConnection,
        msg: SettlementDue,
        _ctx: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        if db::settle(conn, &msg, self.clock.now())? {
            self.stats.refunded.add(1);
            tracing::warn!(
                usage_id = msg.usage_id,
                "settlement refunded a usage its request never settled (the process died \
                 between debit and settlement)"
            );
        } else {
            self.stats.already_settled.add(1);
        }
        Ok(())
    }
}

/// Runs the in-process relay and consumer over the PostgreSQL outbox on this
/// thread until `stop` is set: lease due settlements, hand them to the settlement
/// handler, mark them published; poll every `poll` when idle.
pub fn run_in_process(store: Store<PgConnection>, poll: Duration, stop: Arc<AtomicBool>) {
    let relay_id = format!(
        "metered-{}-{}",
        std::process::id(),
        store.clock().now().timestamp_micros()
    );
    let mut transport = InProcessTransport::new(store.clone()).with_clock(store.clock().clone());
    while !stop.load(Ordering::SeqCst) {
        let published = match relay_in_process(&store, &mut transport, &relay_id, 100) {
            Ok(n) => n,
            Err(err) => {
                tracing::warn!(error = %escaped(&err), "settlement relay round failed; trying again");
                0
            }
        };
        if let Err(err) = transport.run_until_idle() {
            tracing::error!(error = %escaped(&err), "settlement consumer failed; trying again");
        }
        if published == 0 {
            std::thread::sleep(poll);
        }
    }
}
