//! The relay's broker side: publishing leased outbox rows with confirms, each row's
//! failure its own, as the [`OutboxPublisher`] of the core relay round.

use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ErrorKind};
use tokio::runtime::Handle;
use tokio::time::Instant;

use inbox_core::{OutboxPublisher, OutboxRow, Publication};

use crate::publish::{confirm_channel, Confirmed, InFlight};
use crate::TENANT_HEADER;

/// Publishes rows on the relay's connection. Called by the core relay round on a
/// blocking thread: it drives the broker I/O on the runtime behind `handle`.
pub(crate) struct AmqpPublisher {
    handle: Handle,
    conn: Arc<Connection>,
    channel: Channel,
    /// The kinds of the last publication's failures, in its order.
    kinds: Vec<FailureKind>,
}

impl AmqpPublisher {
    /// A publisher on `channel` (in confirm mode) of `conn`, for the current runtime.
    pub(crate) fn new(conn: Arc<Connection>, channel: Channel) -> Self {
        Self {
            handle: Handle::current(),
            conn,
            channel,
            kinds: Vec::new(),
        }
    }

    /// Closes the channel and opens a fresh one in confirm mode (by `deadline`);
    /// `Err` says why none could be opened (the session then reconnects).
    ///
    /// Done after every round with a nacked row. A channel that published while its
    /// quorum queue had no leader (the leader's node killed) can go on being nacked
    /// for every publish after the queue has a new leader, while a new channel on the
    /// same connection is acked at once (seen with RabbitMQ 3.10 in
    /// `rabbit_cluster::kill_dash_nine_of_the_queues_leader_under_the_relay_loses_and_doubles_nothing`:
    /// thousands of nacks in three minutes). A nack for a cause that lasts (a queue
    /// over its length) costs a new channel per round, which is cheap.
    async fn replace_channel(&mut self, deadline: Instant) -> std::result::Result<(), String> {
        crate::connect::close_channel(&self.channel, "nacked; replaced").await;
        match tokio::time::timeout_at(deadline, confirm_channel(&self.conn)).await {
            Ok(Ok(fresh)) => {
                self.channel = fresh;
                Ok(())
            }
            Ok(Err(err)) => Err(format!("replacing a nacked channel failed: {err}")),
            Err(_) => {
                Err("replacing a nacked channel: no answer before the lease expired".to_owned())
            }
        }
    }

    /// Of the last publication's failures: how many were returned, nacked, and
    /// failed on their own.
    pub(crate) fn failure_kinds(&self) -> (u64, u64, u64) {
        let count = |kind| self.kinds.iter().filter(|k| **k == kind).count() as u64;
        (
            count(FailureKind::Returned),
            count(FailureKind::Nacked),
            count(FailureKind::Rejected),
        )
    }
}

/// A nack is the broker's refusal, not the row's failure: RabbitMQ nacks what a
/// queue cannot take now (a quorum queue without a leader, during an election or
/// with its majority lost; a queue over its length with `reject-publish`). So a
/// nacked row is listed as refused ([`Publication::refused`]): the relay round
/// records it with its doubling delay, but a refusal never makes a row dead (it
/// did when a nack counted as any failure: a quorum lost for a quarter of an hour
/// killed every row of the backlog, and a dead row no longer holds back the later
/// rows of its ordering key). The other rows of the round and of later rounds go
/// on, on a new channel.
impl OutboxPublisher for AmqpPublisher {
    fn publish(&mut self, rows: &[OutboxRow], within: Duration) -> Publication {
        let handle = self.handle.clone();
        let round = handle.block_on(async {
            let deadline = Instant::now() + within;
            let mut round = publish(&self.conn, &mut self.channel, rows, deadline).await;
            let nacked = round.failed.iter().any(|f| f.kind == FailureKind::Nacked);
            if nacked && round.lost.is_none() {
                if let Err(reason) = self.replace_channel(deadline).await {
                    round.lost = Some(reason);
                }
            }
            round
        });
        self.kinds = round.failed.iter().map(|f| f.kind).collect();
        let mut publication = Publication::default();
        for id in round.published {
            publication.confirmed(id);
        }
        for failure in round.failed {
            if failure.kind == FailureKind::Nacked {
                publication.refused(failure.id, failure.error);
            } else {
                publication.failed(failure.id, failure.error);
            }
        }
        publication.lost = round.lost;
        publication
    }
}

/// Why a row's publication failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FailureKind {
    /// The broker returned it as unroutable.
    Returned,
    /// The broker nacked it.
    Nacked,
    /// It failed on its own: the broker closed the channel over it, it cannot be
    /// encoded as AMQP, or the store could not read it.
    Rejected,
}

struct Failure {
    id: i64,
    error: String,
    kind: FailureKind,
}

impl Failure {
    fn of(row: &OutboxRow, error: String, kind: FailureKind) -> Self {
        Self {
            id: row.id,
            error,
            kind,
        }
    }
}

/// What a publishing round settled.
#[derive(Default)]
struct Round {
    /// Confirmed rows.
    published: Vec<i64>,
    /// Rows that failed on their own.
    failed: Vec<Failure>,
    /// Why the round stopped before settling every row (the connection was lost, or
    /// the lease ran out); the relay round releases the unsettled rows.
    lost: Option<String>,
}

fn properties(row: &OutboxRow, span: &tracing::Span) -> BasicProperties {
    let msg = &row.message;
    // The publish span's context replaces the one the row carries: the consumer's
    // delivery span is the publication's child.
    let traced;
    let stored = if span.is_disabled() {
        &msg.headers
    } else {
        let mut headers = msg.headers.clone();
        inbox_core::trace::inject_trace(span, &mut headers);
        traced = headers;
        &traced
    };
    let mut headers = FieldTable::default();
    for (k, v) in stored {
        headers.insert(
            k.as_str().into(),
            AMQPValue::LongString(LongString::from(v.as_str())),
        );
    }
    if let Some(tenant) = &msg.tenant {
        headers.insert(
            TENANT_HEADER.into(),
            AMQPValue::LongString(LongString::from(tenant.as_str())),
        );
    }
    BasicProperties::default()
        .with_message_id(msg.message_key.as_str().into())
        .with_type(msg.message_type.as_str().into())
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Why a row cannot go out as AMQP: names the protocol carries as short strings (at
/// most 255 bytes). `enqueue` refuses such rows; another producer may write them.
fn unencodable(row: &OutboxRow) -> Option<String> {
    const SHORT: usize = 255;
    let msg = &row.message;
    let fields = [
        ("exchange", msg.exchange.as_str()),
        ("routing key", msg.routing_key.as_str()),
        ("message type", msg.message_type.as_str()),
        ("message key", msg.message_key.as_str()),
    ];
    let names = msg.headers.keys().map(|k| ("header name", k.as_str()));
    fields
        .into_iter()
        .chain(names)
        .find(|(_, v)| v.len() > SHORT)
        .map(|(what, v)| {
            format!(
                "cannot be encoded as AMQP: {what} must be at most {SHORT} bytes, found {} bytes",
                v.len()
            )
        })
}

/// How one row's publication ended.
enum Settled {
    Published,
    Failed(Failure),
}

fn settled(row: &OutboxRow, confirmed: Confirmed) -> Settled {
    match confirmed {
        Confirmed::Ack => Settled::Published,
        Confirmed::Nack => Settled::Failed(Failure::of(
            row,
            "nacked by the broker".to_owned(),
            FailureKind::Nacked,
        )),
        Confirmed::Returned => {
            let msg = &row.message;
            Settled::Failed(Failure::of(
                row,
                format!(
                    "unroutable: exchange {:?} has no queue bound for routing key {:?}",
                    msg.exchange, msg.routing_key
                ),
                FailureKind::Returned,
            ))
        }
    }
}

/// The span of one row's publication (`outbox.publish`, at `info`, from the publish
/// until the broker's confirm): OpenTelemetry name `publish <exchange>`, kind
/// producer, the messaging attributes of semantic conventions
/// [`SEMCONV_VERSION`](inbox_core::trace::SEMCONV_VERSION), `outbox.row` the row's id
/// and `error.type` when the publication failed. Its parent is the trace the row
/// carries (the enqueuing span's); a row without one starts a trace of its own.
fn publish_span(row: &OutboxRow) -> tracing::Span {
    let msg = &row.message;
    let span = tracing::info_span!(
        "outbox.publish",
        otel.name = %PublishName(&msg.exchange),
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.destination.name = msg.exchange.as_str(),
        messaging.rabbitmq.destination.routing_key = msg.routing_key.as_str(),
        messaging.operation.type = "publish",
        messaging.operation.name = "publish",
        messaging.message.id = msg.message_key.as_str(),
        outbox.row = row.id,
        error.type = tracing::field::Empty,
        traceparent = tracing::field::Empty,
    );
    if !span.is_disabled() {
        inbox_core::trace::adopt_parent_from(&span, &msg.headers);
    }
    span
}

/// `publish <exchange>`; `publish` alone for the default exchange.
struct PublishName<'a>(&'a str);

impl std::fmt::Display for PublishName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            "" => f.write_str("publish"),
            exchange => write!(f, "publish {exchange}"),
        }
    }
}

/// Records on a publish span why its publication failed.
fn failed_span(span: &tracing::Span, settled: &Settled) {
    if let Settled::Failed(failure) = settled {
        let kind = match failure.kind {
            FailureKind::Returned => "unroutable",
            FailureKind::Nacked => "nacked",
            FailureKind::Rejected => "rejected",
        };
        span.record("error.type", kind);
    }
}

/// Publishes `row` into `in_flight` on `channel`.
async fn basic_publish<'r>(
    in_flight: &mut InFlight<'r>,
    channel: &'r Channel,
    row: &'r OutboxRow,
    span: &tracing::Span,
) -> lapin::Result<()> {
    let msg = &row.message;
    in_flight
        .publish(
            channel,
            &msg.exchange,
            &msg.routing_key,
            &msg.payload,
            properties(row, span),
        )
        .await
}

/// Whether a failed publication is the row's own doing: the broker closed the
/// channel over it (a soft error: 404 no such exchange, 406 over the size limit, 403
/// access refused), or it could not be encoded.
fn is_the_rows_fault(err: &lapin::Error) -> bool {
    err.is_amqp_soft_error() || matches!(err.kind(), ErrorKind::SerialisationError(_))
}

const LEASE_RAN_OUT: &str = "no publisher confirms before the lease expired";

/// Publishes the leased rows with confirms until `deadline`, each row's failure
/// recorded against that row, never stopping the others.
///
/// The rows are published in id order on one channel, then every confirm is awaited.
/// When the broker closes the channel over one row, it drops the rows after it and
/// the confirms still owed for the rows before it: which row it was is not said.
/// The unconfirmed rows are then published one at a time on a new channel until one
/// closes it again (that one is the poison, and is recorded), and the rest go on as
/// before. Each such pass blames one row or settles every row, so a round ends.
async fn publish(
    conn: &Connection,
    channel: &mut Channel,
    rows: &[OutboxRow],
    deadline: Instant,
) -> Round {
    let mut round = Round::default();
    let mut todo: Vec<&OutboxRow> = Vec::with_capacity(rows.len());
    for row in rows {
        match unencodable(row) {
            Some(error) => round
                .failed
                .push(Failure::of(row, error, FailureKind::Rejected)),
            None => todo.push(row),
        }
    }
    while !todo.is_empty() {
        let unsettled = match publish_pipelined(channel, &todo, deadline, &mut round).await {
            Ok(unsettled) => unsettled,
            Err(reason) => {
                round.lost = Some(reason);
                return round;
            }
        };
        if unsettled.is_empty() {
            break;
        }
        // A connection that is gone blames nobody: reconnect and lease again.
        if !conn.status().connected() {
            round.lost = Some("the connection closed while publishing".to_owned());
            return round;
        }
        let mut rest = unsettled.into_iter();
        for row in rest.by_ref() {
            match publish_alone(conn, channel, row, deadline).await {
                Ok(Settled::Published) => round.published.push(row.id),
                Ok(Settled::Failed(failure)) => {
                    let poison = failure.kind == FailureKind::Rejected;
                    round.failed.push(failure);
                    // Found: the rows after it go on together again.
                    if poison {
                        break;
                    }
                }
                Err(reason) => {
                    round.lost = Some(reason);
                    return round;
                }
            }
        }
        todo = rest.collect();
    }
    round
}

/// Publishes `rows` on one channel and awaits every confirm; settles what the broker
/// answered into `round` and returns the rows it did not (the channel closed), in
/// order. `Err` when the lease ran out or the connection is gone.
async fn publish_pipelined<'c, 'r: 'c>(
    channel: &'c Channel,
    rows: &[&'r OutboxRow],
    deadline: Instant,
    round: &mut Round,
) -> std::result::Result<Vec<&'r OutboxRow>, String> {
    let mut in_flight = InFlight::default();
    let mut spans = Vec::with_capacity(rows.len());
    let mut unsent = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let span = publish_span(row);
        match basic_publish(&mut in_flight, channel, row, &span).await {
            Ok(()) => spans.push(span),
            Err(_) => {
                // The channel is closing or closed; the confirms below say why.
                unsent = rows[i..].to_vec();
                break;
            }
        }
    }
    debug_assert_eq!(in_flight.len(), spans.len());
    // The rows answered before the lease ran out are settled all the same (marked
    // published, not published again); the relay round releases the others.
    let answers = in_flight.answers_by(deadline).await;
    let ran_out = answers.iter().any(Option::is_none);
    let mut unsettled = Vec::new();
    for ((row, span), answer) in rows.iter().zip(spans).zip(answers) {
        match answer {
            Some(Ok(confirmed)) => {
                let settled = settled(row, confirmed);
                failed_span(&span, &settled);
                match settled {
                    Settled::Published => round.published.push(row.id),
                    Settled::Failed(failure) => round.failed.push(failure),
                }
            }
            Some(Err(_)) => unsettled.push(*row),
            None => {}
        }
    }
    if ran_out {
        return Err(LEASE_RAN_OUT.to_owned());
    }
    unsettled.extend(unsent);
    Ok(unsettled)
}

/// Publishes one row alone, on a new channel if the last one was closed, and awaits
/// its confirm. A [`FailureKind::Rejected`] failure when the broker closed the
/// channel over it (it was the only row in flight); `Err` when the lease ran out or
/// the connection is gone.
async fn publish_alone(
    conn: &Connection,
    channel: &mut Channel,
    row: &OutboxRow,
    deadline: Instant,
) -> std::result::Result<Settled, String> {
    if !channel.status().connected() {
        match tokio::time::timeout_at(deadline, confirm_channel(conn)).await {
            Err(_) => return Err(LEASE_RAN_OUT.to_owned()),
            Ok(Err(err)) => return Err(format!("reopening the channel failed: {err}")),
            Ok(Ok(fresh)) => *channel = fresh,
        }
    }
    let span = publish_span(row);
    let mut in_flight = InFlight::default();
    let published = match basic_publish(&mut in_flight, channel, row, &span).await {
        Ok(()) => match in_flight.answers_by(deadline).await.into_iter().next() {
            Some(Some(answer)) => answer,
            Some(None) => return Err(LEASE_RAN_OUT.to_owned()),
            // One answer per publication: not reached.
            None => return Err("the broker's answer went missing".to_owned()),
        },
        Err(err) => Err(err),
    };
    let settled = match published {
        Ok(confirmed) => settled(row, confirmed),
        Err(err) if is_the_rows_fault(&err) && conn.status().connected() => {
            Settled::Failed(Failure::of(
                row,
                format!("the broker refused it and closed the channel: {err}"),
                FailureKind::Rejected,
            ))
        }
        Err(err) => return Err(format!("publishing failed: {err}")),
    };
    failed_span(&span, &settled);
    Ok(settled)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use inbox_core::{MessageKey, OutboxMessage};

    use super::*;
    use crate::test_support;

    /// Against the broker of `AMQP_URL` through a proxy of the test's: a round of
    /// 64 rows of 512 KiB with a poison row (an exchange that does not exist) fourth
    /// among them, published while the proxy holds back what the relay sends for
    /// 300 ms, so that lapin holds most of the round when the broker closes the
    /// channel over the poison. A publication lapin still holds unwritten when it
    /// answers the broker's close is written after its close-ok, on a channel the
    /// broker no longer knows, and RabbitMQ closes the whole connection for it
    /// (504): the round is lost and the poison not found. With every publication
    /// queued at once that happened every time; with one large publication held
    /// at a time (the bound of `publish::UNWRITTEN_BUDGET`, as when each write was
    /// awaited) in 2 of 21 rounds here. Three rounds on fresh connections: at
    /// least one must keep its connection, and every round that does records the
    /// poison against itself and confirms every other row.
    #[test]
    fn a_channel_closed_over_a_poison_row_costs_the_round_no_connection() {
        let Some(broker) = test_support::broker() else {
            return;
        };
        let kept: Vec<bool> = (0..3).map(|_| poisoned_round(&broker)).collect();
        assert!(
            kept.iter().any(|k| *k),
            "every round lost its connection to a 504: {kept:?}"
        );
    }

    /// One round of [`a_channel_closed_over_a_poison_row_costs_the_round_no_connection`];
    /// whether it kept its connection.
    fn poisoned_round(broker: &str) -> bool {
        test_support::runtime().block_on(async {
            let (proxy, conn, channel, queue) =
                test_support::through_proxy(broker.to_owned()).await;
            let conn = Arc::new(conn);
            let now = chrono::Utc::now();
            let rows: Vec<OutboxRow> = (0..64)
                .map(|id| {
                    let exchange = if id == 3 {
                        format!("{queue}.missing")
                    } else {
                        String::new()
                    };
                    let key = MessageKey::new(format!("row-{id}")).expect("key");
                    let message = OutboxMessage::new(key, exchange, "t", vec![1; 512 * 1024])
                        .with_routing_key(queue.clone());
                    OutboxRow {
                        id,
                        message,
                        attempts: 0,
                        created_at: now,
                    }
                })
                .collect();
            let mut publisher = AmqpPublisher::new(Arc::clone(&conn), channel);
            proxy.hold_sends(true);
            let publishing = tokio::task::spawn_blocking(move || {
                publisher.publish(&rows, Duration::from_secs(60))
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.hold_sends(false);
            let publication = publishing.await.expect("publishing");
            if let Some(lost) = &publication.lost {
                // The 504, or lapin's view of the channel it closed.
                eprintln!("the round lost its connection: {lost}");
                return false;
            }
            let failed: Vec<i64> = publication.failed.iter().map(|(id, _)| *id).collect();
            assert_eq!(failed, [3], "{:?}", publication.failed);
            assert!(
                publication.failed[0].1.contains("NOT_FOUND"),
                "{:?}",
                publication.failed
            );
            let mut published = publication.published.clone();
            published.sort_unstable();
            let others: Vec<i64> = (0..64).filter(|id| *id != 3).collect();
            assert_eq!(published, others);
            assert!(conn.status().connected());
            let _ = conn.close(200, "done".into()).await;
            true
        })
    }
}
