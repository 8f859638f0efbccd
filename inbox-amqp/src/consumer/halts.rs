//! A group halted by a claim invariant violation: its run halts, the store records
//! it, polls tell when an operator resumed it.

use super::*;

impl<S: InboxStore + GroupHalts> super::Shared<S> {
    /// The group's current run.
    pub(super) fn run_of(&self, group: &ConsumerGroup) -> Option<Arc<Run>> {
        let cell = self.halts.get(group)?;
        Some(Arc::clone(
            &cell.lock().unwrap_or_else(PoisonError::into_inner),
        ))
    }

    /// Halts a consumer group's run (once): logged, counted, its tasks told, and the
    /// halt recorded in the store. A halt the store fails to record stays halted
    /// here, and the next poll writes it again.
    pub(super) async fn halt_group(
        &self,
        group: &ConsumerGroup,
        cause: &ClaimInvariantViolated,
        run: &Run,
    ) {
        if run.resumed.is_cancelled() {
            // A batch of a run resumed since: its delivery, held, goes back to the
            // queue, and the current run stops on it again if the cause is not fixed.
            tracing::warn!(group = %group, cause = %Escaped(&cause.to_string()), "a stop of a run resumed since; its delivery goes back to the queue");
            return;
        }
        self.halt_run(
            group,
            cause,
            run,
            "halted; the other groups go on; fix the cause, then resume it (inbox groups resume)",
        );
        self.record_halt(group, cause, run).await;
    }

    /// Marks `run` halted for `cause` and tells its tasks.
    pub(super) fn halt_run(
        &self,
        group: &ConsumerGroup,
        cause: &ClaimInvariantViolated,
        run: &Run,
        why: &str,
    ) {
        let _ = run.cause.set(cause.clone());
        if self.stats.halt(group, cause.to_string()) {
            tracing::error!(group = %group, cause = %Escaped(&cause.to_string()), "consumer group {why}");
            metrics::gauge!(inbox_core::metrics::GROUP_HALTED, "group" => group.to_string())
                .set(1.0);
        }
        run.halted.cancel();
    }

    /// Writes `run`'s halt to the store; remembers whether it is recorded.
    pub(super) async fn record_halt(
        &self,
        group: &ConsumerGroup,
        cause: &ClaimInvariantViolated,
        run: &Run,
    ) {
        let store = Arc::clone(&self.store);
        let c = cause.clone();
        match tokio::task::spawn_blocking(move || store.record_halt(&c)).await {
            Ok(Ok(())) => run.recorded.store(true, Ordering::SeqCst),
            Ok(Err(err)) => {
                tracing::error!(group = %group, error = %ErrorChain(&err), "recording the halt failed; the group stays halted and the halt is written again at the next poll");
            }
            Err(err) => {
                tracing::error!(group = %group, error = %err, "recording the halt failed; the group stays halted and the halt is written again at the next poll");
            }
        }
    }

    /// Reads the recorded halts and acts on them: a halt this consumer could not
    /// record is written again; a group recorded halted halts; a group this consumer
    /// halted, whose halt was recorded and is gone now, resumes.
    pub(super) async fn poll_halts(&self) -> Result<()> {
        // Taken before the read: only a halt recorded before it can be found lifted.
        let before: Vec<(&ConsumerGroup, Arc<Run>, bool)> = self
            .halts
            .keys()
            .filter_map(|g| {
                let run = self.run_of(g)?;
                let recorded = run.halted.is_cancelled() && run.recorded.load(Ordering::SeqCst);
                Some((g, run, recorded))
            })
            .collect();
        for (group, run, recorded) in &before {
            if let (false, Some(cause)) = (*recorded, run.cause.get()) {
                self.record_halt(group, cause, run).await;
            }
        }
        let store = Arc::clone(&self.store);
        let halted = tokio::task::spawn_blocking(move || store.halted_groups())
            .await
            .map_err(|source| Error::TaskFailed {
                task: "store",
                source,
            })?
            .map_err(Error::Store)?;
        let halted: BTreeMap<&ConsumerGroup, &ClaimInvariantViolated> =
            halted.iter().map(|c| (&c.group, c)).collect();
        for (group, run, recorded) in before {
            match halted.get(group) {
                Some(cause) if !run.halted.is_cancelled() => {
                    run.recorded.store(true, Ordering::SeqCst);
                    self.halt_run(group, cause, &run, "halted: its halt is recorded; resume it once the cause is fixed (inbox groups resume)");
                }
                None if recorded => self.resume(group, &run),
                _ => {}
            }
        }
        Ok(())
    }

    /// Resumes a halted group: a fresh run replaces `run`, whose tasks let go of what
    /// they held (it goes back to the queue), and the sessions start the new run's
    /// tasks.
    pub(super) fn resume(&self, group: &ConsumerGroup, run: &Arc<Run>) {
        let Some(cell) = self.halts.get(group) else {
            return;
        };
        {
            let mut current = cell.lock().unwrap_or_else(PoisonError::into_inner);
            if !Arc::ptr_eq(&current, run) {
                return;
            }
            *current = Arc::default();
        }
        self.stats.resume(group);
        metrics::gauge!(inbox_core::metrics::GROUP_HALTED, "group" => group.to_string()).set(0.0);
        tracing::info!(group = %group, "consumer group resumed: its halt is no longer recorded");
        run.resumed.cancel();
        self.resumes.send_modify(|n| *n += 1);
    }
}
