//! A batch of deliveries: the store's decisions, the retries scheduled on the broker,
//! and the acks, requeues and holds that settle it.

use inbox_core::trace::DeliveryOrigin;

use super::*;

/// A worker's backoffs: after a refused retry copy, and after a store failure.
pub(super) struct Backoff<'a> {
    pub(super) retry: &'a mut Duration,
    pub(super) store: &'a mut Duration,
}

/// What the store made of a batch.
pub(super) struct Stored {
    /// Per malformed delivery (its position), whether its dead letter was recorded.
    pub(super) malformed_done: Vec<(usize, bool)>,
    /// The store's decisions, one per envelope.
    pub(super) decided: inbox_core::Result<Vec<Decision>>,
    /// The envelopes read from the batch.
    pub(super) envelopes: Vec<inbox_core::Envelope>,
    /// Each envelope's position in the batch.
    pub(super) positions: Vec<usize>,
}

/// A retry to schedule: the delivery's position in its batch, the delay, the
/// message type.
pub(super) type Retry = (usize, Duration, String);

/// What scheduling a batch's retries works on.
pub(super) struct Retrying<'a> {
    pub(super) deliveries: &'a [Delivery],
    pub(super) actions: &'a mut [Action],
    /// The backoff after a refused retry copy.
    pub(super) backoff: &'a mut Duration,
    pub(super) stop: &'a CancellationToken,
    pub(super) span: &'a tracing::Span,
}

impl<S: InboxStore + GroupHalts> super::Shared<S> {
    /// Hands a batch to the store, then carries out its decisions: acks, retry
    /// copies confirmed before their originals are acked, a halt.
    pub(super) async fn handle_batch(
        self: &Arc<Self>,
        channel: &Channel,
        copies: &mut Copies,
        group: &ConsumerGroup,
        deliveries: Vec<Delivery>,
        tokens: &Tokens,
        backoff: Backoff<'_>,
    ) -> std::result::Result<(), SessionEnd> {
        let stats = &self.stats;
        stats.add(Counter::Received, deliveries.len() as u64);
        stats.add(Counter::Batches, 1);
        let span =
            tracing::debug_span!("inbox.amqp.batch", group = %group, size = deliveries.len());
        let Some(stored) = self.store_batch(group, &deliveries, &span).await? else {
            // Past twice the store's deadline: nothing is acked, everything comes back
            // redelivered, and the worker goes on.
            stats.add(Counter::Requeued, deliveries.len() as u64);
            let actions = vec![Action::Requeue; deliveries.len()];
            self.settle(channel, &deliveries, &actions).await?;
            pause(
                &tokens.stop,
                backoff.store,
                self.settings.connection.backoff_max,
            )
            .await;
            return Ok(());
        };
        let mut actions = vec![Action::Requeue; deliveries.len()];
        for (i, recorded) in stored.malformed_done {
            if recorded {
                stats.add(Counter::Malformed, 1);
                actions[i] = Action::Ack;
            }
        }
        let positions = &stored.positions;
        let decisions = match stored
            .decided
            .and_then(|d| check_decision_count(d, positions.len()))
        {
            Ok(decisions) => decisions,
            Err(err) => {
                // Nothing of the batch committed: everything comes back.
                tracing::error!(parent: &span, error = %Escaped(&ErrorChain(&err).to_string()), "store failed; requeueing the batch");
                let requeued = actions.iter().filter(|a| **a == Action::Requeue).count();
                stats.add(Counter::Requeued, requeued as u64);
                self.settle(channel, &deliveries, &actions).await?;
                // Not any delivery's fault: back off, longer each time, until the
                // store answers again.
                pause(
                    &tokens.stop,
                    backoff.store,
                    self.settings.connection.backoff_max,
                )
                .await;
                return Ok(());
            }
        };
        *backoff.store = self.settings.connection.backoff_min;

        let (retries, halt) = self.carry_out(
            group,
            decisions,
            positions,
            &stored.envelopes,
            &mut actions,
            &span,
        );
        let retrying = Retrying {
            deliveries: &deliveries,
            actions: &mut actions,
            backoff: backoff.retry,
            stop: &tokens.stop,
            span: &span,
        };
        self.schedule_retries(copies, group, retries, retrying)
            .await?;
        self.settle(channel, &deliveries, &actions).await?;
        if let Some(cause) = halt {
            self.halt_group(group, &cause, &tokens.halt).await;
        }
        Ok(())
    }

    /// Carries out core's action for each decision: an ack counted, a retry held
    /// until its copy is confirmed (returned: position, delay, message type), a stop
    /// held (returned: the cause its group halts for).
    pub(super) fn carry_out(
        &self,
        group: &ConsumerGroup,
        decisions: Vec<Decision>,
        positions: &[usize],
        envelopes: &[inbox_core::Envelope],
        actions: &mut [Action],
        span: &tracing::Span,
    ) -> (Vec<Retry>, Option<ClaimInvariantViolated>) {
        let mut halt = None;
        let mut retries = Vec::new();
        let envelopes = positions.iter().zip(envelopes);
        for (decision, (&i, envelope)) in decisions.into_iter().zip(envelopes) {
            actions[i] = match decision.action() {
                TransportAction::Ack(tally) => {
                    self.stats.record(tally);
                    Action::Ack
                }
                TransportAction::RetryThenAck(delay) => {
                    retries.push((i, delay, envelope.message_type.clone()));
                    Action::Hold
                }
                TransportAction::HoldAndStop(cause) => {
                    tracing::error!(parent: span, group = %group, key = %Escaped(envelope.message_key.as_str()), cause = %Escaped(&cause.to_string()), "delivery left unacked; its group halts");
                    // The first cause is the one recorded (and the one to fix).
                    halt.get_or_insert(cause);
                    Action::Hold
                }
            };
        }
        (retries, halt)
    }

    /// Reads the batch and hands it to the store on a blocking thread (the store is
    /// synchronous): malformed deliveries are dead-lettered, the others processed.
    /// `None` when the store took more than twice its batch deadline: its handler
    /// hangs and the database has ended its transaction by then, so the batch is
    /// abandoned (the blocking thread is left to finish on its own).
    pub(super) async fn store_batch(
        self: &Arc<Self>,
        group: &ConsumerGroup,
        deliveries: &[Delivery],
        span: &tracing::Span,
    ) -> std::result::Result<Option<Stored>, SessionEnd> {
        let mut envelopes = Vec::with_capacity(deliveries.len());
        let mut positions = Vec::with_capacity(deliveries.len());
        let mut malformed: Vec<(usize, Box<Malformed>)> = Vec::new();
        for (i, d) in deliveries.iter().enumerate() {
            match delivery::read(d, self.settings.max_body_bytes) {
                Ok(envelope) => {
                    envelopes.push(envelope);
                    positions.push(i);
                }
                Err(m) => malformed.push((i, m)),
            }
        }
        let store = Arc::clone(&self.store);
        let g = group.clone();
        // The store's spans (its batch, each delivery) open inside this batch's span;
        // the delivery spans name the exchange and the queue.
        let parent = span.clone();
        let origin = DeliveryOrigin::new(
            "rabbitmq",
            self.topology.exchange(),
            self.topology.queue(group),
        );
        let task = tokio::task::spawn_blocking(move || {
            let _entered = parent.enter();
            let malformed_done: Vec<(usize, bool)> = malformed
                .into_iter()
                .map(|(i, m)| {
                    let recorded =
                        store.dead_letter(&g, &m.envelope, DeadLetterReason::Malformed, &m.reason);
                    if let Err(err) = &recorded {
                        tracing::error!(key = %Escaped(m.envelope.message_key.as_str()), error = %Escaped(&ErrorChain(&err).to_string()), "recording a malformed delivery failed");
                    }
                    (i, recorded.is_ok())
                })
                .collect();
            let decided = if envelopes.is_empty() {
                Ok(Vec::new())
            } else {
                origin.scope(|| store.process_batch(&g, &envelopes))
            };
            Stored {
                malformed_done,
                decided,
                envelopes,
                positions,
            }
        });
        let joined = match self.store.batch_deadline() {
            Some(deadline) => match tokio::time::timeout(deadline.saturating_mul(2), task).await {
                Ok(joined) => joined,
                Err(_) => {
                    tracing::error!(parent: span, group = %group, ?deadline, "batch abandoned past its deadline; requeueing it");
                    return Ok(None);
                }
            },
            None => task.await,
        };
        joined.map(Some).map_err(|source| {
            SessionEnd::Fatal(Error::TaskFailed {
                task: "store",
                source,
            })
        })
    }

    /// Publishes each retry copy with a confirm to its tier (on the worker's
    /// [`Copies`] channel) and acks its original only once the copy is confirmed; an
    /// original whose copy was refused is requeued after a pause, and the channel
    /// replaced.
    pub(super) async fn schedule_retries(
        &self,
        copies: &mut Copies,
        group: &ConsumerGroup,
        retries: Vec<Retry>,
        r: Retrying<'_>,
    ) -> std::result::Result<(), SessionEnd> {
        if retries.is_empty() {
            return Ok(());
        }
        // The copies' tiers and properties first: the copies in flight borrow them.
        let tiers: Vec<_> = retries
            .into_iter()
            .map(|(i, delay, message_type)| {
                let d = &r.deliveries[i];
                // The copy comes back from its tier under the group queue's name as
                // routing key: the type must travel in the `type` property.
                let properties = d.properties.clone().with_type(message_type.as_str().into());
                let tier = self.topology.retry_ladder().tier_for(delay);
                let queue = self.topology.retry_queue(group, delay);
                (i, tier, queue, properties)
            })
            .collect();
        let channel = copies.channel().await?;
        let mut in_flight = InFlight::default();
        for (i, _, queue, properties) in &tiers {
            let d = &r.deliveries[*i];
            in_flight
                .publish(channel, "", queue, &d.data, properties.clone())
                .await?;
        }
        // Every copy's answer together: which copy a return was is known only then.
        let answers = in_flight.answers().await;
        let mut unconfirmed = false;
        for ((i, tier, queue, _), answer) in tiers.iter().zip(answers) {
            let i = *i;
            if matches!(answer, Ok(Confirmed::Ack)) {
                self.stats.record(Tally::Retried);
                self.stats.retried_to(*tier);
                tracing::debug!(parent: r.span, %queue, "retry scheduled");
                r.actions[i] = Action::Ack;
            } else {
                tracing::warn!(parent: r.span, %queue, backoff = ?r.backoff, "retry copy not confirmed (a full tier refuses it); requeueing the original after a pause");
                self.stats.add(Counter::Requeued, 1);
                r.actions[i] = Action::Requeue;
                unconfirmed = true;
            }
        }
        if unconfirmed {
            // A channel nacked once may go on being nacked (see `copies`).
            copies.replace().await;
            // A full tier refuses copies until it drains: an original requeued at once
            // would come straight back, in a loop as fast as the broker answers.
            wait_out(r.stop, r.backoff, self.settings.connection.backoff_max).await;
        } else {
            *r.backoff = self.settings.connection.backoff_min;
        }
        Ok(())
    }

    /// Acks, requeues or holds each delivery. One `multiple` ack covers the batch only
    /// when every delivery in it may be acked; earlier batches of this channel are
    /// settled already, so it reaches no further.
    pub(super) async fn settle(
        &self,
        channel: &Channel,
        deliveries: &[Delivery],
        actions: &[Action],
    ) -> std::result::Result<(), SessionEnd> {
        if let (Some(last), true) = (deliveries.last(), actions.iter().all(|a| *a == Action::Ack)) {
            channel
                .basic_ack(last.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
            return Ok(());
        }
        for (d, action) in deliveries.iter().zip(actions) {
            match action {
                Action::Ack => {
                    channel
                        .basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await?
                }
                Action::Requeue => {
                    channel
                        .basic_nack(
                            d.delivery_tag,
                            BasicNackOptions {
                                multiple: false,
                                requeue: true,
                            },
                        )
                        .await?
                }
                Action::Hold => {}
            }
        }
        Ok(())
    }
}
