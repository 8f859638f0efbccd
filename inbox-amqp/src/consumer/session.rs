//! A session of a connection: its group's workers, each consuming its queue.

use super::*;

/// What to do with one delivery once the store has decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Ack,
    /// Put back (requeue): comes back flagged redelivered.
    Requeue,
    /// Leave unacked: its retry copy is not confirmed yet, or its group halts.
    Hold,
}

/// Ends a consumer of `channel`: cancels it, holds its deliveries while its group is
/// halted, then closes the channel.
pub(super) async fn stop_consuming(channel: &Channel, tag: &str, tokens: &Tokens, reason: &str) {
    goodbye(
        "consumer cancel",
        channel.basic_cancel(tag.into(), BasicCancelOptions::default()),
    )
    .await;
    tokens.hold_while_halted().await;
    close_channel(channel, reason).await;
}

impl<S: InboxStore + GroupHalts> super::Shared<S> {
    /// One connection's session: `group`'s workers or its dead-letter reader, each
    /// on a channel of its own, until one of them ends it.
    pub(super) async fn session(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        group: &ConsumerGroup,
        shutdown: &CancellationToken,
        caution: &Caution,
        ends: &Ends,
        role: Role,
    ) -> std::result::Result<(), SessionEnd> {
        let stop = shutdown.child_token();
        let cautious = caution.is_on();
        let pace = match role {
            Role::Workers => Pace::new(cautious, self.settings.prefetch, self.settings.batch_size),
            Role::DeadLetters => Pace::new(cautious, DLQ_PREFETCH, 1),
        };
        if cautious {
            tracing::info!(
                group = %group,
                dead_letters = role == Role::DeadLetters,
                "cautious session: one reader, prefetch 1, until {} deliveries are settled",
                pace.relax.as_ref().map_or(0, |(n, _)| *n)
            );
        }
        let workers = match role {
            Role::Workers if !cautious => self.settings.workers,
            _ => 1,
        };
        let mut tasks = JoinSet::new();
        // The run whose tasks this session started: once the group resumed (a new
        // run, not halted) it gets tasks of its own; while it is halted, none.
        let mut started: Option<Arc<Run>> = None;
        let mut resumes = self.resumes.subscribe();
        loop {
            if !stop.is_cancelled() {
                resumes.borrow_and_update();
                if let Some(run) = self.run_of(group) {
                    let fresh = started.as_ref().is_none_or(|r| !Arc::ptr_eq(r, &run));
                    if fresh && !self.stats.is_halted(group) && !run.halted.is_cancelled() {
                        started = Some(Arc::clone(&run));
                        let tokens = || Tokens {
                            stop: stop.clone(),
                            halt: Arc::clone(&run),
                        };
                        if role == Role::Workers {
                            metrics::gauge!(inbox_core::metrics::GROUP_HALTED, "group" => group.to_string())
                                .set(0.0);
                        }
                        for worker in 0..workers {
                            let channel = match conn.create_channel().await {
                                Ok(channel) => channel,
                                Err(err) => {
                                    // The tasks started already finish their batch:
                                    // drained, never aborted.
                                    stop.cancel();
                                    caution.record(ends, err.into());
                                    break;
                                }
                            };
                            let task = Arc::clone(self);
                            match role {
                                Role::DeadLetters => {
                                    let reader = task.dead_letter_reader(
                                        channel,
                                        group.clone(),
                                        tokens(),
                                        pace.clone(),
                                    );
                                    tasks.spawn(reader);
                                }
                                Role::Workers => {
                                    let span = tracing::info_span!(
                                        "inbox.amqp.worker",
                                        group = %group,
                                        worker
                                    );
                                    let worker = task.worker(
                                        Arc::clone(conn),
                                        channel,
                                        group.clone(),
                                        tokens(),
                                        pace.clone(),
                                    );
                                    tasks.spawn(worker.instrument(span));
                                }
                            }
                        }
                    }
                }
            }
            let joined = tokio::select! {
                joined = tasks.join_next(), if !tasks.is_empty() => joined,
                // Every group halted (or the session ends): hold the connection until
                // a group resumes or the session ends.
                () = stop.cancelled(), if tasks.is_empty() => return ends.take(),
                changed = resumes.changed(), if !stop.is_cancelled() => {
                    if changed.is_err() {
                        stop.cancel();
                    }
                    continue;
                }
            };
            let Some(joined) = joined else { continue };
            let ended = joined.unwrap_or_else(|err| {
                Err(SessionEnd::Fatal(Error::TaskFailed {
                    task: "consumer worker",
                    source: err,
                }))
            });
            if let Err(end) = ended {
                // One task's end ends the session: the others finish their batch. The
                // gravest end is the session's, recorded as it comes (see `Ends`).
                stop.cancel();
                caution.record(ends, end);
            }
        }
    }

    /// A worker consuming `group` on `channel`, its retry copies on a channel of
    /// their own of `conn` (see [`Copies`]). Ending with `Err` ends the session and
    /// closes the connection, both channels with it.
    pub(super) async fn worker(
        self: Arc<Self>,
        conn: Arc<Connection>,
        channel: Channel,
        group: ConsumerGroup,
        tokens: Tokens,
        pace: Pace,
    ) -> std::result::Result<(), SessionEnd> {
        let mut copies = Copies::new(conn);
        let settings = &self.settings;
        let mut retry_backoff = settings.connection.backoff_min;
        let mut store_backoff = settings.connection.backoff_min;
        channel
            .basic_qos(pace.prefetch, BasicQosOptions::default())
            .await?;
        let queue = self.topology.queue(&group);
        let tag = format!("inbox-{}-{}", group, channel.id());
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        loop {
            let first = tokio::select! {
                biased;
                () = tokens.stop.cancelled() => break,
                () = tokens.halt.halted.cancelled() => break,
                next = consumer.next() => next,
            };
            let mut batch = match first {
                Some(Ok(delivery)) => vec![delivery],
                Some(Err(err)) => return Err(err.into()),
                None => {
                    return Err(SessionEnd::Lost(format!(
                        "consumer of {queue} was cancelled"
                    )))
                }
            };
            fill(
                &mut consumer,
                &mut batch,
                pace.batch_size,
                settings.batch_wait,
            )
            .await?;
            let backoff = Backoff {
                retry: &mut retry_backoff,
                store: &mut store_backoff,
            };
            let size = batch.len();
            self.handle_batch(&channel, &mut copies, &group, batch, &tokens, backoff)
                .await?;
            if tokens.halt.halted.is_cancelled() {
                // What it holds stays held: never a relaxed end, which would close the
                // channel and hand the stopping delivery back.
                break;
            }
            pace.settled(size)?;
        }
        // No new deliveries; what was prefetched and not handled goes back to the
        // queue when the channel closes.
        stop_consuming(&channel, &tag, &tokens, "inbox worker stopping").await;
        copies.close().await;
        Ok(())
    }
}
