//! The operator's writes: replay (one letter, or a filter's), discard, redrive and the
//! purge of discarded letters. How each meets the others and a rebuild on the same
//! rows is the parent module's account ("Where two writers touch the same row").

use super::*;

/// Headers a replayed copy does not carry over: the broker's own (`x-...`) and an
/// earlier replay's.
pub(super) fn replay_headers(stored: &str, group: &str, sequence: i32) -> String {
    let mut headers: BTreeMap<String, String> = serde_json::from_str(stored).unwrap_or_default();
    headers.retain(|k, _| !k.starts_with("x-") && !k.starts_with("inbox-replay-"));
    headers.insert(REPLAY_GROUP_HEADER.to_owned(), group.to_owned());
    headers.insert(REPLAY_SEQUENCE_HEADER.to_owned(), sequence.to_string());
    serde_json::to_string(&headers).unwrap_or_else(|_| "{}".to_owned())
}

/// How often a replay is tried again after contention, or when a replay sequence
/// written before the counter existed took the number.
const SEQUENCE_RETRIES: u32 = 5;

/// Why a resolved letter is not replayed.
pub(super) const RESOLVED_ADVICE: &str =
    "a projection rebuild counted this event already (the letter is \
     resolved): a replay would count it twice; discard the letter";

/// Ends a replay's transaction without writing: an answer decided by a guard (the
/// transaction rolls back, so a letter marked before the claim's guard failed is
/// unmarked), or a database error.
enum Undo {
    Answer(ReplayOutcome),
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for Undo {
    fn from(err: diesel::result::Error) -> Self {
        Self::Database(err)
    }
}

impl<C: OperatorConnection> Operator<C> {
    /// Replays one dead letter, in one transaction decided by two guarded writes,
    /// never by a read before them: first the letter is marked replayed where it is
    /// neither discarded, nor replayed, nor resolved by a rebuild; only then is its
    /// claim taken where it is `dead` with the letter's payload digest (it becomes a
    /// due `failed` claim with no attempts or starts). Only if both touched their row
    /// is an outbox row enqueued for the letter's group alone, with the original
    /// message key and the key's next replay sequence; otherwise the transaction rolls
    /// back and nothing was written.
    pub fn replay_dead_letter(&self, id: i64, target: &ReplayTarget) -> Result<ReplayOutcome> {
        let mut conn = self.connection()?;
        let mut tries = 0;
        loop {
            let now = self.clock().now();
            let attempt = C::write_transaction(&mut *conn, |conn| {
                let Some(letter) = C::op_letter(conn, id)? else {
                    return Err(Undo::Answer(ReplayOutcome::NotFound));
                };
                // The reason never changes: read once, it decides nothing that a
                // concurrent writer could change.
                if let Some(advice) = letter.reason.replay_refusal() {
                    // Nothing is written either way: the read only picks the answer.
                    if letter.discarded {
                        return Err(Undo::Answer(ReplayOutcome::Discarded));
                    }
                    return Err(Undo::Answer(ReplayOutcome::Refused {
                        reason: letter.reason,
                        advice,
                    }));
                }
                // The guard on the letter: a discard, a replay or a rebuild that
                // committed first leaves nothing to mark (and one still open holds the
                // row until it commits).
                if C::op_mark_replayed(conn, letter.id, now)? != 1 {
                    return Err(Undo::Answer(Self::why_not_replayed(conn, &letter)?));
                }
                let digest = payload_digest(&letter.payload);
                // The guard on the claim: only the transaction that takes the dead
                // claim enqueues (a rebuild's cover empties the digest).
                let took = C::op_reset_dead_claim(
                    conn,
                    &letter.group,
                    &letter.key,
                    &digest,
                    &letter.payload,
                    now,
                )?;
                if took != 1 {
                    let status = C::op_claim_state(conn, &letter.group, &letter.key)?
                        .and_then(|(s, _)| ClaimStatus::parse(&s));
                    return Err(Undo::Answer(ReplayOutcome::ClaimNotDead { status }));
                }
                let sequence = C::op_next_sequence(conn, &letter.key)?;
                let headers = replay_headers(&letter.headers, &letter.group, sequence);
                let routing_key = target.queue(&letter.group);
                let outbox_id = C::op_insert_replay(
                    conn,
                    &NewReplay {
                        key: &letter.key,
                        routing_key: &routing_key,
                        message_type: &letter.message_type,
                        tenant: letter.tenant.as_deref(),
                        payload: &letter.payload,
                        headers: &headers,
                        sequence,
                        now,
                    },
                )?;
                C::notify_enqueue(conn)?;
                Ok::<_, Undo>(ReplayOutcome::Replayed {
                    sequence,
                    outbox_id,
                })
            });
            match attempt {
                Ok(outcome) => {
                    metrics::counter!(inbox_core::metrics::REPLAYS_TOTAL, "kind" => "replay")
                        .increment(1);
                    tracing::info!(id, ?outcome, "dead letter replayed");
                    return Ok(outcome);
                }
                Err(Undo::Answer(outcome)) => return Ok(outcome),
                // An older sequence the counter does not know of (written before the
                // counter existed) took the number: the next try takes the next one.
                Err(Undo::Database(diesel::result::Error::DatabaseError(
                    diesel::result::DatabaseErrorKind::UniqueViolation,
                    _,
                ))) if tries < SEQUENCE_RETRIES => tries += 1,
                Err(Undo::Database(err))
                    if crate::backend::is_retryable(&err) && tries < SEQUENCE_RETRIES =>
                {
                    tries += 1;
                }
                Err(Undo::Database(err)) => return Err(err.into()),
            }
        }
    }

    /// Why a letter's guarded mark touched nothing, read after the guard (in the same
    /// transaction, which rolls back).
    pub(super) fn why_not_replayed(
        conn: &mut C,
        letter: &ops::Letter,
    ) -> std::result::Result<ReplayOutcome, diesel::result::Error> {
        Ok(match C::op_letter(conn, letter.id)? {
            None => ReplayOutcome::NotFound,
            Some(now) if now.discarded => ReplayOutcome::Discarded,
            Some(now) if now.resolved => ReplayOutcome::Refused {
                reason: now.reason,
                advice: RESOLVED_ADVICE,
            },
            // Replayed already: its claim says where that replay stands.
            Some(now) => ReplayOutcome::ClaimNotDead {
                status: C::op_claim_state(conn, &now.group, &now.key)?
                    .and_then(|(s, _)| ClaimStatus::parse(&s)),
            },
        })
    }

    /// Replays up to `limit` letters matching `filter` (oldest of the newest first:
    /// the filter's order), each in its own transaction; see
    /// [`replay_dead_letter`](Self::replay_dead_letter).
    pub fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: Option<usize>,
        target: &ReplayTarget,
    ) -> Result<BulkReport> {
        let ids = self.matching_ids(filter, limit)?;
        let mut report = BulkReport {
            matched: ids.len() as u64,
            ..BulkReport::default()
        };
        for id in ids {
            match self.replay_dead_letter(id, target)? {
                ReplayOutcome::Replayed { .. } => report.affected += 1,
                ReplayOutcome::Refused { .. } => report.refused += 1,
                _ => report.skipped += 1,
            }
        }
        Ok(report)
    }

    /// Discards (archives) one letter: kept until a purge of discarded letters, never
    /// replayed, listed only when asked for.
    pub fn discard_dead_letter(&self, id: i64) -> Result<DiscardOutcome> {
        let now = self.clock().now();
        let mut conn = self.connection()?;
        Ok(C::write_transaction(&mut *conn, |conn| {
            if C::op_discard(conn, id, now)? == 1 {
                return Ok::<_, diesel::result::Error>(DiscardOutcome::Discarded);
            }
            Ok(match C::op_letter(conn, id)? {
                Some(_) => DiscardOutcome::AlreadyDiscarded,
                None => DiscardOutcome::NotFound,
            })
        })?)
    }

    /// Discards up to `limit` letters matching `filter`.
    pub fn discard_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: Option<usize>,
    ) -> Result<BulkReport> {
        let ids = self.matching_ids(filter, limit)?;
        let mut report = BulkReport {
            matched: ids.len() as u64,
            ..BulkReport::default()
        };
        for id in ids {
            match self.discard_dead_letter(id)? {
                DiscardOutcome::Discarded => report.affected += 1,
                _ => report.skipped += 1,
            }
        }
        Ok(report)
    }

    /// Sends failed claims again whose retry copy was lost: due, and unchanged, for at
    /// least `filter.overdue_for`, with their payload kept. Each is marked by a write
    /// guarded by the `updated_at` it was read with (so two redrives at once send it
    /// once) and enqueued for its group alone, like a replay. A copy that was only
    /// late, not lost, is then a duplicate of the redriven one: the claim absorbs it.
    pub fn redrive_failed_claims(
        &self,
        filter: &RedriveFilter,
        limit: Option<usize>,
        target: &ReplayTarget,
    ) -> Result<BulkReport> {
        let now = self.clock().now();
        // A window reaching before year 1 starts there: nothing is that overdue.
        let cutoff = inbox_core::earlier_by(now, filter.overdue_for);
        let mut conn = self.connection()?;
        let candidates = C::op_redrivable(
            &mut conn,
            filter.consumer_group.as_deref(),
            filter.message_key.as_deref(),
            cutoff,
            as_limit(limit.unwrap_or(usize::MAX)),
        )?;
        let mut report = BulkReport {
            matched: candidates.len() as u64,
            ..BulkReport::default()
        };
        for claim in candidates {
            let mut tries = 0;
            loop {
                let attempt = C::write_transaction(&mut *conn, |conn| {
                    if C::op_touch_redriven(conn, &claim.group, &claim.key, claim.updated_at, now)?
                        != 1
                    {
                        return Ok(false);
                    }
                    let sequence = C::op_next_sequence(conn, &claim.key)?;
                    let headers = replay_headers("{}", &claim.group, sequence);
                    let routing_key = target.queue(&claim.group);
                    C::op_insert_replay(
                        conn,
                        &NewReplay {
                            key: &claim.key,
                            routing_key: &routing_key,
                            message_type: &claim.message_type,
                            tenant: claim.tenant.as_deref(),
                            payload: &claim.payload,
                            headers: &headers,
                            sequence,
                            now,
                        },
                    )?;
                    C::notify_enqueue(conn)?;
                    Ok::<_, diesel::result::Error>(true)
                });
                match attempt {
                    Ok(true) => {
                        metrics::counter!(inbox_core::metrics::REPLAYS_TOTAL, "kind" => "redrive")
                            .increment(1);
                        report.affected += 1;
                    }
                    Ok(false) => report.skipped += 1,
                    Err(diesel::result::Error::DatabaseError(
                        diesel::result::DatabaseErrorKind::UniqueViolation,
                        _,
                    )) if tries < SEQUENCE_RETRIES => {
                        tries += 1;
                        continue;
                    }
                    Err(err) => return Err(err.into()),
                }
                break;
            }
        }
        Ok(report)
    }

    /// Deletes dead letters discarded longer than `window` ago, at most `batch` per
    /// transaction, until a batch deletes fewer; returns how many. Concurrency as for
    /// [`purge_done_claims`](crate::Store::purge_done_claims): on PostgreSQL one purge of
    /// discarded letters runs at a time per schema, a second one returns at once.
    pub fn purge_discarded_dead_letters(&self, window: Duration, batch: usize) -> Result<u64> {
        self.purge(crate::PurgeTarget::DiscardedDeadLetters, window, batch)
    }
}
