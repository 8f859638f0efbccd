//! `selftest` against a deployment: canary messages enqueued on the outbox, published
//! by the running relay, consumed by the built-in [`Canary`] handler, which records
//! each arrival; the report counts what arrived, was lost or doubled, and how long the
//! round trip took.

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_core::{ConsumerGroup, Handler, HandlerError, MessageContext, MessageKey, OutboxMessage};

use crate::{Error, Result};

/// The canary's consumer group.
pub const CANARY_GROUP: &str = "inbox.canary";

/// The canary's message type (and routing key).
pub const CANARY_MESSAGE_TYPE: &str = "inbox.canary";

/// The built-in canary handler: a consumer enables `selftest` with one line,
/// `.handler(Canary::new())` on its store builder. It records each arrival of a canary
/// message in `inbox_canary`, under the claim like any handler: a message applied twice
/// shows as doubled.
#[derive(Debug)]
pub struct Canary {
    group: ConsumerGroup,
}

impl Canary {
    /// The handler, in group [`CANARY_GROUP`].
    pub fn new() -> Self {
        Self {
            // A constant, valid group name (a unit test holds it).
            group: ConsumerGroup::new(CANARY_GROUP).expect("CANARY_GROUP is a valid group"),
        }
    }
}

impl Default for Canary {
    fn default() -> Self {
        Self::new()
    }
}

/// One canary, as enqueued: `{"run": "...", "seq": 3, "sent_at": "..."}`.
#[derive(Debug)]
pub struct CanaryPing {
    run: String,
    seq: i32,
    sent_at: DateTime<Utc>,
}

impl<'de> serde::Deserialize<'de> for CanaryPing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = serde_json::Value::deserialize(d)?;
        let run = v["run"]
            .as_str()
            .ok_or_else(|| D::Error::custom("run: a string"))?;
        let seq = v["seq"]
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .ok_or_else(|| D::Error::custom("seq: a 32-bit number"))?;
        let sent_at = v["sent_at"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .ok_or_else(|| D::Error::custom("sent_at: an RFC 3339 time"))?;
        Ok(Self {
            run: run.to_owned(),
            seq,
            sent_at: sent_at.with_timezone(&Utc),
        })
    }
}

impl<C: super::OperatorConnection> Handler<C> for Canary {
    type Message = CanaryPing;

    fn group(&self) -> &ConsumerGroup {
        &self.group
    }

    fn message_type(&self) -> &str {
        CANARY_MESSAGE_TYPE
    }

    fn handle(
        &self,
        conn: &mut C,
        msg: CanaryPing,
        _ctx: &MessageContext<'_>,
    ) -> std::result::Result<(), HandlerError> {
        // The arrival time on this process's clock (the sender's is in the payload).
        C::op_record_canary(conn, &msg.run, msg.seq, msg.sent_at, Utc::now())?;
        Ok(())
    }
}

/// What a selftest run saw.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct CanaryReport {
    /// The run's id.
    pub run: String,
    /// Canaries enqueued.
    pub sent: u32,
    /// Canaries that arrived (once or more).
    pub arrived: u32,
    /// Canaries that did not arrive.
    pub lost: u32,
    /// Canaries whose effect was applied more than once.
    pub doubled: u32,
    /// Round-trip latencies of the arrived ones (enqueue to first arrival), sorted.
    pub latencies: Vec<Duration>,
}

impl CanaryReport {
    /// The `p`-th percentile latency (nearest rank), `p` in 0..=100.
    pub fn percentile(&self, p: u32) -> Option<Duration> {
        if self.latencies.is_empty() {
            return None;
        }
        let n = self.latencies.len();
        let rank = (u64::from(p.min(100)) * n as u64).div_ceil(100).max(1) as usize;
        self.latencies.get(rank.min(n) - 1).copied()
    }
}

impl<C: super::OperatorConnection> super::Operator<C> {
    /// Enqueues `count` canary messages of run `run` on the outbox, to `exchange` with
    /// routing key [`CANARY_MESSAGE_TYPE`]; the relay publishes them.
    pub fn enqueue_canaries(&self, run: &str, count: u32, exchange: &str) -> Result<()> {
        if run.is_empty() || run.len() > 64 {
            return Err(Error::InvalidSetting {
                setting: "run",
                expected: "1 to 64 bytes",
                found: format!("{} bytes", run.len()),
            });
        }
        let mut conn = self.connection()?;
        C::write_transaction(&mut *conn, |conn| {
            for seq in 0..count {
                let now = self.clock().now();
                let payload = serde_json::json!({
                    "run": run,
                    "seq": seq,
                    "sent_at": now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                });
                let key = MessageKey::derive(
                    "inbox.selftest",
                    &format!("{run}:{seq}"),
                    CANARY_MESSAGE_TYPE,
                );
                let msg = OutboxMessage::new(
                    key,
                    exchange,
                    CANARY_MESSAGE_TYPE,
                    payload.to_string().into_bytes(),
                );
                crate::enqueue(conn, &msg, now)?;
            }
            Ok::<_, Error>(())
        })
    }

    /// What has arrived of run `run` so far, of `sent` canaries.
    pub fn canary_report(&self, run: &str, sent: u32) -> Result<CanaryReport> {
        let mut conn = self.connection()?;
        let rows = C::op_canary_arrivals(&mut conn, run)?;
        let arrived = rows.iter().filter(|r| r.3 >= 1).count() as u32;
        let doubled = rows.iter().filter(|r| r.3 > 1).count() as u32;
        let mut latencies: Vec<Duration> = rows
            .iter()
            .map(|r| (r.2 - r.1).to_std().unwrap_or(Duration::ZERO))
            .collect();
        latencies.sort();
        Ok(CanaryReport {
            run: run.to_owned(),
            sent,
            arrived,
            lost: sent.saturating_sub(arrived),
            doubled,
            latencies,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_is_valid_and_percentiles_take_the_nearest_rank() {
        assert!(ConsumerGroup::new(CANARY_GROUP).is_ok());
        let ms = Duration::from_millis;
        let report = CanaryReport {
            run: "r".to_owned(),
            sent: 4,
            arrived: 4,
            lost: 0,
            doubled: 0,
            latencies: vec![ms(10), ms(20), ms(30), ms(40)],
        };
        assert_eq!(report.percentile(50), Some(ms(20)));
        assert_eq!(report.percentile(90), Some(ms(40)));
        assert_eq!(report.percentile(0), Some(ms(10)));
        assert_eq!(report.percentile(100), Some(ms(40)));
    }
}
