//! The reader of a group's dead-letter queue: what the broker dead-lettered, recorded
//! in the store.

use super::*;

/// The prefetch of a dead-letter queue's reader.
pub(super) const DLQ_PREFETCH: u16 = 20;

impl<S: InboxStore + GroupHalts> super::Shared<S> {
    /// Reads the group's broker dead-letter queue (deliveries over the delivery limit)
    /// into the store: a dead letter, and the claim marked dead in the same transaction.
    pub(super) async fn dead_letter_reader(
        self: Arc<Self>,
        channel: Channel,
        group: ConsumerGroup,
        tokens: Tokens,
        pace: Pace,
    ) -> std::result::Result<(), SessionEnd> {
        channel
            .basic_qos(pace.prefetch, BasicQosOptions::default())
            .await?;
        let queue = self.topology.dlq(&group);
        let tag = format!("inbox-dlq-{}-{}", group, channel.id());
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        loop {
            let next = tokio::select! {
                biased;
                () = tokens.stop.cancelled() => break,
                () = tokens.halt.halted.cancelled() => break,
                next = consumer.next() => next,
            };
            let d = match next {
                Some(Ok(d)) => d,
                Some(Err(err)) => return Err(err.into()),
                None => {
                    return Err(SessionEnd::Lost(format!(
                        "consumer of {queue} was cancelled"
                    )))
                }
            };
            let (envelope, reason, detail) = self.broker_dead_letter(&group, &d);
            // A store that cannot record it now keeps the message here, unacked: a
            // nack would requeue it into a queue with no dead-letter target of its
            // own, where a delivery limit drops it. The same delivery is tried again
            // with backoff until the store answers or the session ends (then the
            // broker returns it to the queue).
            let mut backoff = self.settings.connection.backoff_min;
            let recorded = loop {
                let store = Arc::clone(&self.store);
                let (g, env, why) = (group.clone(), envelope.clone(), detail.clone());
                let outcome =
                    tokio::task::spawn_blocking(move || store.dead_letter(&g, &env, reason, &why))
                        .await
                        .map_err(|source| {
                            SessionEnd::Fatal(Error::TaskFailed {
                                task: "store",
                                source,
                            })
                        })?;
                match outcome {
                    Ok(outcome) => break Some(outcome),
                    Err(err) => {
                        tracing::error!(group = %group, key = %Escaped(envelope.message_key.as_str()), error = %Escaped(&ErrorChain(&err).to_string()), ?backoff, "recording a broker dead letter failed; keeping the message and trying again");
                        tokio::select! {
                            biased;
                            () = tokens.stop.cancelled() => break None,
                            () = tokens.halt.halted.cancelled() => break None,
                            () = tokio::time::sleep(next_pause(&mut backoff, self.settings.connection.backoff_max)) => {}
                        }
                    }
                }
            };
            let Some(outcome) = recorded else { break };
            if outcome == DeadLetterOutcome::Recorded {
                self.stats.add(Counter::DeliveryLimit, 1);
            }
            channel
                .basic_ack(d.delivery_tag, BasicAckOptions::default())
                .await?;
            pace.settled(1)?;
        }
        stop_consuming(&channel, &tag, &tokens, "inbox dead-letter reader stopping").await;
        Ok(())
    }

    /// What the store records of a delivery from the broker's dead-letter queue: its
    /// envelope (with the deliveries the broker counted), the reason and the detail.
    pub(super) fn broker_dead_letter(
        &self,
        group: &ConsumerGroup,
        d: &Delivery,
    ) -> (inbox_core::Envelope, DeadLetterReason, String) {
        let table = d.properties.headers().as_ref();
        let headers = delivery::headers(table);
        let broker_reason = headers
            .get("x-first-death-reason")
            .map_or("unknown", String::as_str);
        // The same body limit as the workers': a body over it (one a client
        // published straight to the `:dlq`) is cut, never stored whole.
        match delivery::read(d, self.settings.max_body_bytes) {
            Ok(mut envelope) => {
                let group_queue = self.topology.queue(group);
                let limit = self.topology.group_delivery_limit();
                envelope.delivery_count = delivery::deliveries_at_limit(table, &group_queue, limit);
                let detail = match envelope.delivery_count {
                    Some(n) => format!(
                        "the broker dead-lettered the message ({broker_reason}) after {n} deliveries"
                    ),
                    None => format!("the broker dead-lettered the message ({broker_reason})"),
                };
                (envelope, DeadLetterReason::DeliveryLimit, detail)
            }
            Err(m) => (m.envelope, DeadLetterReason::Malformed, m.reason),
        }
    }
}
