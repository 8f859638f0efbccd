//! Publishing with a publisher confirm: the one way the consumer (retry copies) and
//! the relay (outbox rows) put a message on the broker.
//!
//! Publications sent together on one channel are answered together ([`InFlight`]),
//! because lapin cannot say which of them the broker returned. RabbitMQ sends an
//! unroutable `mandatory` message's `basic.return` before its ack, and may ack
//! several publications in one `multiple` ack; lapin hands each return to whichever
//! confirm it settles next, and settles the confirms of a `multiple` ack in no fixed
//! order (a hash map's). With several publications in flight, a return was seen on
//! a routable row's confirm and the unroutable row's ack came back clean: the relay
//! marked a row published that no queue took, and published a delivered row again
//! (`e2e_outbox::a_round_tells_its_returned_rows_from_the_rows_acked_with_them`: 10
//! and 20 of 86 unroutable rows in two runs of a 600-row backlog). A return is therefore matched here by
//! what it carries (exchange, routing key, `message_id` and body) against every
//! publication of its set, whichever confirm lapin put it on.

use std::future::Future;
use std::pin::Pin;

use inbox_core::display::Escaped;
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Connection, PublisherConfirm};
use tokio::time::Instant;

/// A channel in confirm mode.
pub(crate) async fn confirm_channel(conn: &Connection) -> lapin::Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// How the broker answered a confirmed publication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Confirmed {
    /// Routed to at least one queue and confirmed.
    Ack,
    /// The broker nacked it.
    Nack,
    /// Returned as unroutable (`mandatory`): no queue took it.
    Returned,
}

/// What the broker sends back of a publication it returns, to know it again.
#[derive(Debug, PartialEq, Eq)]
struct Sent<'a> {
    exchange: &'a str,
    routing_key: &'a str,
    message_id: Option<ShortString>,
    body: &'a [u8],
}

impl<'a> Sent<'a> {
    /// What a returned message carries.
    fn returned(message: &'a BasicReturnMessage) -> Self {
        Self {
            exchange: message.exchange.as_str(),
            routing_key: message.routing_key.as_str(),
            message_id: message.properties.message_id().clone(),
            body: &message.data,
        }
    }
}

/// A publication's frames handed to lapin and maybe not yet written (`Writing`:
/// lapin resolves `basic_publish` once its I/O loop has written them, and what it
/// counts towards [`UNWRITTEN_BUDGET`]), written and awaiting the
/// broker's confirm, or refused by lapin while it was being written.
enum Pending<'a> {
    Writing(
        Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send + 'a>>,
        usize,
    ),
    Written(PublisherConfirm),
    Failed(lapin::Error),
}

/// How many bytes a set may have queued in lapin and not yet written before
/// [`InFlight::publish`] waits for the oldest write: each publication counts its
/// body, exchange and routing key and [`FRAME_OVERHEAD`], so at most about 60
/// small publications wait unwritten at once, and one large one.
///
/// Bounded, because lapin writes what it holds even after the broker closed the
/// channel: when the broker closes a channel over one publication (an exchange that
/// does not exist), lapin answers with `channel.close-ok` ahead of the publications
/// it still holds, then writes them on a channel the broker no longer knows, and
/// RabbitMQ closes the whole connection for that (`504 CHANNEL_ERROR - expected
/// 'channel.open'`). The round is then lost, its rows released, and the row that
/// closed the channel is not found in that round
/// (`outbox_publisher::tests::a_channel_closed_over_a_poison_row_costs_the_round_no_connection`,
/// 64 rows of 512 KiB, lost its connection with every publication queued at once).
/// The bound narrows that window and does not close it: what is queued unwritten
/// when the close arrives (at most this much, or one publication of any size)
/// still costs the connection, as the one publication held at a time did when each
/// write was awaited. Seen here only with large rows held back (the test above): a
/// round of small rows is written in a few bursts, so a close that finds
/// publications waiting needs a broker that reads slower than the relay queues.
const UNWRITTEN_BUDGET: usize = 32 * 1024;

/// What a publication counts towards [`UNWRITTEN_BUDGET`] beside its body,
/// exchange and routing key: its three frames' headers and its properties.
const FRAME_OVERHEAD: usize = 512;

/// Publications sent on one channel with confirms and not yet answered, in the
/// order they were sent. Their answers are awaited together ([`InFlight::answers`]).
///
/// A publication is queued without waiting for lapin to write it: `basic_publish`
/// queues its frames on its first poll and then waits for lapin's I/O loop to
/// have written them, so awaiting each in turn made every publication of a round
/// a handoff to that loop and back, a write of its own to the socket and a wakeup
/// of its own (the relay's CPU a row halved without it: docs/performance.md, "The
/// relay"). [`InFlight::publish`] polls it once (the frames are queued, in the
/// order of the calls, with their delivery tags) and keeps it, up to
/// [`UNWRITTEN_BUDGET`]; the writes are awaited with the confirms.
#[derive(Default)]
pub(crate) struct InFlight<'a> {
    sent: Vec<(Sent<'a>, Pending<'a>)>,
    /// Bytes queued and maybe not written, as [`UNWRITTEN_BUDGET`] counts them.
    unwritten: usize,
    /// The first publication that may not be written yet.
    oldest_unwritten: usize,
}

impl<'a> InFlight<'a> {
    /// Publishes `body` to `exchange` with `routing_key`, `mandatory` (an unroutable
    /// message comes back as [`Confirmed::Returned`]), on `channel` (in confirm
    /// mode: every publication of a set on the same one).
    ///
    /// Returns once the publication is queued in lapin, before it is written (after
    /// waiting for the oldest writes while [`UNWRITTEN_BUDGET`] or more is
    /// queued): `Err` when lapin refused it at once (the channel is closed or
    /// closing). A write that fails later is that publication's answer
    /// ([`InFlight::answers`]).
    pub(crate) async fn publish(
        &mut self,
        channel: &'a Channel,
        exchange: &'a str,
        routing_key: &'a str,
        body: &'a [u8],
        properties: BasicProperties,
    ) -> lapin::Result<()> {
        while self.unwritten >= UNWRITTEN_BUDGET {
            self.await_oldest_write().await;
        }
        let message_id = properties.message_id().clone();
        let mut writing = Box::pin(channel.basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        ));
        // The first poll queues the frames (or refuses them at once).
        let pending = match futures_lite::future::poll_once(&mut writing).await {
            Some(written) => Pending::Written(written?),
            None => {
                let cost = body.len() + exchange.len() + routing_key.len() + FRAME_OVERHEAD;
                self.unwritten += cost;
                Pending::Writing(writing, cost)
            }
        };
        let sent = Sent {
            exchange,
            routing_key,
            message_id,
            body,
        };
        self.sent.push((sent, pending));
        Ok(())
    }

    /// Waits until the oldest publication that may not be written yet is (or
    /// failed), and takes it off the bytes unwritten. Cancelled, it leaves the
    /// count as it was.
    async fn await_oldest_write(&mut self) {
        let Some((_, pending)) = self.sent.get_mut(self.oldest_unwritten) else {
            self.unwritten = 0;
            return;
        };
        if let Pending::Writing(writing, cost) = pending {
            let cost = *cost;
            *pending = match writing.await {
                Ok(confirm) => Pending::Written(confirm),
                Err(err) => Pending::Failed(err),
            };
            self.unwritten -= cost;
        }
        self.oldest_unwritten += 1;
    }

    /// How many publications are in flight.
    pub(crate) fn len(&self) -> usize {
        self.sent.len()
    }

    /// [`InFlight::answers`] as far as they came by `deadline`: `None` for each
    /// publication not answered by then.
    ///
    /// The answers that did come stand, returns and all. RabbitMQ sends a
    /// publication's return before its ack, so an acked publication's return is on
    /// a confirm settled by then (whichever one lapin put it on), and every settled
    /// confirm is read, past the first one unanswered too. A return on them that
    /// carries an unanswered publication marks nothing answered.
    pub(crate) async fn answers_by(
        self,
        deadline: Instant,
    ) -> Vec<Option<lapin::Result<Confirmed>>> {
        self.settle(Some(deadline)).await
    }

    /// Waits for the broker's answer to each publication, in the order they were
    /// sent: `Err` for one whose channel closed before it was answered.
    ///
    /// A publication is [`Confirmed::Returned`] when a return of the set carries
    /// it, whichever confirm lapin put the return on; a nack stays a nack. A
    /// return that carries none of them (the broker changed what it echoes, or a
    /// return outlived the set it belonged to) cannot say whose it was: every
    /// acked publication of the set is then taken as returned, to be published
    /// again (a copy the consumers' inboxes absorb) rather than marked done when it
    /// may have gone nowhere.
    pub(crate) async fn answers(self) -> Vec<lapin::Result<Confirmed>> {
        // Without a deadline every publication is answered.
        self.settle(None).await.into_iter().flatten().collect()
    }

    /// The answers, each awaited until `deadline` (when given) and only taken if
    /// already there after it.
    async fn settle(self, deadline: Option<Instant>) -> Vec<Option<lapin::Result<Confirmed>>> {
        let mut answers = Vec::with_capacity(self.sent.len());
        let mut returns = Vec::new();
        let mut sent = Vec::with_capacity(self.sent.len());
        let mut ran_out = false;
        for (publication, pending) in self.sent {
            let confirmed = async {
                let mut confirm = match pending {
                    Pending::Written(confirm) => confirm,
                    Pending::Writing(writing, _) => writing.await?,
                    Pending::Failed(err) => return Err(err),
                };
                (&mut confirm).await
            };
            let mut confirmed = std::pin::pin!(confirmed);
            let confirmed = match deadline {
                _ if ran_out => futures_lite::future::poll_once(&mut confirmed).await,
                None => Some(confirmed.await),
                Some(deadline) => {
                    let answered = tokio::time::timeout_at(deadline, confirmed).await.ok();
                    ran_out = answered.is_none();
                    answered
                }
            };
            answers.push(confirmed.map(|confirmed| {
                confirmed.map(|confirmation| {
                    let nacked = confirmation.is_nack();
                    returns.extend(confirmation.take_message());
                    if nacked {
                        Confirmed::Nack
                    } else {
                        Confirmed::Ack
                    }
                })
            }));
            sent.push(publication);
        }
        let returned: Vec<Sent<'_>> = returns.iter().map(Sent::returned).collect();
        mark_returned(&sent, &returned, &mut answers);
        answers
    }
}

/// Marks [`Confirmed::Returned`] each acked publication of `sent` (answered in
/// `answers`, in the same order; `None` when not answered) that one of `returned`
/// carries; when a return carries none of them, every acked one (see
/// [`InFlight::answers`]).
fn mark_returned(
    sent: &[Sent<'_>],
    returned: &[Sent<'_>],
    answers: &mut [Option<lapin::Result<Confirmed>>],
) {
    let mut mark = |answer: &mut Option<lapin::Result<Confirmed>>| {
        if matches!(answer, Some(Ok(Confirmed::Ack))) {
            *answer = Some(Ok(Confirmed::Returned));
        }
    };
    for message in returned {
        let mut known = false;
        for (publication, answer) in sent.iter().zip(answers.iter_mut()) {
            if publication == message {
                known = true;
                mark(answer);
            }
        }
        if !known {
            tracing::warn!(
                exchange = %Escaped(message.exchange),
                routing_key = %Escaped(message.routing_key),
                "the broker returned a message none of the publications in flight carried; taking every acked one as returned"
            );
            answers.iter_mut().for_each(&mut mark);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lapin::ConnectionProperties;

    use super::*;
    use crate::test_support;

    fn sent<'a>(routing_key: &'a str, id: &str, body: &'a [u8]) -> Sent<'a> {
        Sent {
            exchange: "",
            routing_key,
            message_id: Some(id.into()),
            body,
        }
    }

    fn acked(n: usize) -> Vec<Option<lapin::Result<Confirmed>>> {
        (0..n).map(|_| Some(Ok(Confirmed::Ack))).collect()
    }

    fn kinds(answers: &[Option<lapin::Result<Confirmed>>]) -> Vec<Option<Confirmed>> {
        let kind = |a: &Option<lapin::Result<Confirmed>>| a.as_ref()?.as_ref().ok().copied();
        answers.iter().map(kind).collect()
    }

    #[test]
    fn a_return_marks_the_publication_it_carries_and_no_other() {
        let set = [
            sent("q", "1", b"a"),
            sent("q", "2", b"b"),
            sent("q", "3", b"c"),
        ];
        let mut answers = acked(3);
        mark_returned(&set, &[sent("q", "2", b"b")], &mut answers);
        let ack = Some(Confirmed::Ack);
        assert_eq!(
            kinds(&answers),
            [ack, Some(Confirmed::Returned), ack],
            "whichever confirm lapin put the return on"
        );
        // Each field tells publications apart.
        for other in [
            sent("r", "2", b"b"),
            sent("q", "9", b"b"),
            sent("q", "2", b"x"),
            Sent {
                exchange: "ex",
                ..sent("q", "2", b"b")
            },
            Sent {
                message_id: None,
                ..sent("q", "2", b"b")
            },
        ] {
            let set = [other, sent("q", "2", b"b")];
            let mut answers = acked(2);
            mark_returned(&set, &[sent("q", "2", b"b")], &mut answers);
            assert_eq!(
                kinds(&answers),
                [ack, Some(Confirmed::Returned)],
                "{:?}",
                set[0]
            );
        }
    }

    #[test]
    fn a_nack_stays_a_nack_and_identical_publications_are_all_returned() {
        let set = [
            sent("q", "1", b"a"),
            sent("q", "1", b"a"),
            sent("q", "1", b"a"),
        ];
        let mut answers = vec![
            Some(Ok(Confirmed::Nack)),
            Some(Ok(Confirmed::Ack)),
            Some(Ok(Confirmed::Ack)),
        ];
        mark_returned(&set, &[sent("q", "1", b"a")], &mut answers);
        assert_eq!(
            kinds(&answers),
            [
                Some(Confirmed::Nack),
                Some(Confirmed::Returned),
                Some(Confirmed::Returned)
            ],
            "which of two identical publications came back is not known: neither is done"
        );
    }

    #[test]
    fn a_return_that_carries_no_publication_of_the_set_returns_every_acked_one() {
        let set = [
            sent("q", "1", b"a"),
            sent("q", "2", b"b"),
            sent("q", "4", b"d"),
            sent("q", "3", b"c"),
        ];
        let mut answers = vec![
            Some(Ok(Confirmed::Ack)),
            Some(Ok(Confirmed::Nack)),
            None,
            Some(Ok(Confirmed::Ack)),
        ];
        mark_returned(&set, &[sent("elsewhere", "7", b"z")], &mut answers);
        assert_eq!(
            kinds(&answers),
            [
                Some(Confirmed::Returned),
                Some(Confirmed::Nack),
                None,
                Some(Confirmed::Returned)
            ]
        );
        let mut answers = acked(4);
        mark_returned(&set, &[], &mut answers);
        assert_eq!(kinds(&answers), [Some(Confirmed::Ack); 4], "no return");
        // A return carrying an unanswered publication marks nothing answered.
        let mut answers = vec![Some(Ok(Confirmed::Ack)), None];
        mark_returned(&set[..2], &[sent("q", "2", b"b")], &mut answers);
        assert_eq!(kinds(&answers), [Some(Confirmed::Ack), None]);
    }

    /// Against the broker of `AMQP_URL`: publications to a queue that exists and to
    /// one that does not, interleaved on one channel and answered together, each
    /// answered as what happened to it. RabbitMQ acks several at once here, and
    /// lapin puts returns on other publications' confirms.
    #[test]
    fn each_publication_in_flight_is_answered_as_what_happened_to_it() {
        let Some(url) = test_support::amqp_url() else {
            return;
        };
        test_support::runtime().block_on(async {
            let conn = Connection::connect(&url, ConnectionProperties::default())
                .await
                .unwrap_or_else(|e| panic!("connect: {e}"));
            let channel = confirm_channel(&conn)
                .await
                .unwrap_or_else(|e| panic!("channel: {e}"));
            let queue = test_support::exclusive_queue(&channel).await;
            let missing = format!("{queue}.missing");
            let bodies: Vec<Vec<u8>> = (0..600).map(|n| format!("{n}").into_bytes()).collect();
            let nowhere = |n: usize| n % 7 == 3;
            for round in 0..5 {
                let mut in_flight = InFlight::default();
                for (n, body) in bodies.iter().enumerate() {
                    let routing_key = if nowhere(n) { &missing } else { &queue };
                    let properties =
                        BasicProperties::default().with_message_id(format!("{round}-{n}").into());
                    in_flight
                        .publish(&channel, "", routing_key, body, properties)
                        .await
                        .unwrap_or_else(|e| panic!("publish: {e}"));
                }
                let answers = tokio::time::timeout(Duration::from_secs(30), in_flight.answers())
                    .await
                    .unwrap_or_else(|_| panic!("no answers in 30 s"));
                assert_eq!(answers.len(), bodies.len());
                for (n, answer) in answers.iter().enumerate() {
                    let expected = if nowhere(n) {
                        Confirmed::Returned
                    } else {
                        Confirmed::Ack
                    };
                    let answer = answer.as_ref().unwrap_or_else(|e| panic!("{n}: {e}"));
                    assert_eq!(*answer, expected, "round {round}, publication {n}");
                }
            }
            let _ = conn.close(200, "done".into()).await;
        });
    }

    /// Against the broker of `AMQP_URL` through a proxy of the test's: a publication
    /// within [`UNWRITTEN_BUDGET`] is queued, not written, when `publish` returns.
    /// With the proxy not reading what the client sends, another channel of the
    /// connection fills the sockets' buffers (32 MiB it cannot write); 50 small
    /// publications then all return from `publish` though none can be written, and
    /// once the proxy reads again every one is acked. Awaiting each write (what
    /// `basic_publish` alone does) waits at the first one.
    #[test]
    fn publications_are_queued_without_waiting_for_their_writes() {
        let Some(broker) = test_support::broker() else {
            return;
        };
        test_support::runtime().block_on(async {
            let (proxy, conn, channel, queue) = test_support::through_proxy(broker).await;
            let filler = conn
                .create_channel()
                .await
                .unwrap_or_else(|e| panic!("channel: {e}"));
            proxy.hold_sends(true);
            let filling = {
                let queue = queue.clone();
                tokio::spawn(async move {
                    let body = vec![7_u8; 512 * 1024];
                    for _ in 0..64 {
                        let options = BasicPublishOptions::default();
                        let properties = BasicProperties::default();
                        let _ = filler
                            .basic_publish(
                                "".into(),
                                queue.as_str().into(),
                                options,
                                &body,
                                properties,
                            )
                            .await;
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(
                !filling.is_finished(),
                "the filler was written: the test shows nothing"
            );
            let mut in_flight = InFlight::default();
            let queued = tokio::time::timeout(Duration::from_secs(5), async {
                for n in 0..50 {
                    let properties =
                        BasicProperties::default().with_message_id(format!("{n}").into());
                    in_flight
                        .publish(&channel, "", &queue, b"small", properties)
                        .await
                        .unwrap_or_else(|e| panic!("publish {n}: {e}"));
                }
            })
            .await;
            assert!(
                queued.is_ok(),
                "a publication waited for its write behind 32 MiB held back by the proxy"
            );
            assert_eq!(in_flight.len(), 50);
            proxy.hold_sends(false);
            let answers = tokio::time::timeout(Duration::from_secs(60), in_flight.answers())
                .await
                .unwrap_or_else(|_| panic!("no answers in 60 s"));
            for (n, answer) in answers.iter().enumerate() {
                let answer = answer.as_ref().unwrap_or_else(|e| panic!("{n}: {e}"));
                assert_eq!(*answer, Confirmed::Ack, "publication {n}");
            }
            filling.await.unwrap_or_else(|e| panic!("filler: {e}"));
            let _ = conn.close(200, "done".into()).await;
        });
    }

    /// Against the broker of `AMQP_URL` through a proxy of the test's: the answers
    /// that came before the deadline stand (an acked publication is not published
    /// again, a returned one is still known as returned), and only the publications
    /// the broker had not answered by then are unanswered.
    #[test]
    fn the_answers_that_came_before_the_deadline_stand() {
        let Some(broker) = test_support::broker() else {
            return;
        };
        test_support::runtime().block_on(async {
            let (proxy, conn, channel, queue) = test_support::through_proxy(broker).await;
            let missing = format!("{queue}.missing");
            let bodies: Vec<Vec<u8>> = (0..40).map(|n| format!("{n}").into_bytes()).collect();
            let nowhere = |n: usize| n % 5 == 2;
            let mut in_flight = InFlight::default();
            for (n, body) in bodies.iter().enumerate() {
                if n == 20 {
                    // The first 20 are answered; what the broker says of the rest is
                    // held back.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    proxy.hold(true);
                }
                let routing_key = if nowhere(n) { &missing } else { &queue };
                let properties = BasicProperties::default().with_message_id(format!("{n}").into());
                in_flight
                    .publish(&channel, "", routing_key, body, properties)
                    .await
                    .unwrap_or_else(|e| panic!("publish: {e}"));
            }
            let deadline = Instant::now() + Duration::from_millis(500);
            let answers = in_flight.answers_by(deadline).await;
            assert_eq!(answers.len(), bodies.len());
            for (n, answer) in answers.iter().enumerate() {
                let answer = answer
                    .as_ref()
                    .map(|a| a.as_ref().copied().unwrap_or_else(|e| panic!("{n}: {e}")));
                let expected = match n {
                    20.. => None,
                    _ if nowhere(n) => Some(Confirmed::Returned),
                    _ => Some(Confirmed::Ack),
                };
                assert_eq!(answer, expected, "publication {n}");
            }
            proxy.hold(false);
            let _ = conn.close(200, "done".into()).await;
        });
    }
}
