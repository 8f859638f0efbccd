//! A hostile review of the claim path: each `review_*` test states a promise of the
//! README and an input that breaks (or, where it holds, probes) it.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::time::Duration;

use diesel::connection::SimpleConnection;
use inbox_core::ProjectionLock;
use inbox_core::{ClaimKey, DeadLetterReason, Decision, Envelope, MessageKey};
use inbox_diesel::Store;
use inbox_test_support::{all_stop, claim_key};
use inbox_test_support::{group, usage, Fixture, Outcome, PgFixture, Recorder, TestConn};

const GROUP: &str = "billing.daily-usage";

fn key(k: &str) -> ClaimKey {
    claim_key(GROUP, k)
}

/// README: "A handler that ended or restarted the store's transaction itself (COMMIT,
/// ROLLBACK, BEGIN) ... every delivery of the batch is decided Stop". A handler that
/// runs `COMMIT; BEGIN` and then hits any database error (swallowed here) leaves the
/// *new* transaction aborted: the token read-back fails, is taken for a swallowed
/// error (`TxCheck::Aborted`), and the batch is isolated. But the handler's `COMMIT`
/// already committed every claim of the batch as `done`: the isolated rerun finds
/// them and acks the whole batch as duplicates. The batch-mate `b` was never applied.
#[test]
fn review_a_restart_followed_by_an_error_is_taken_for_a_swallowed_error() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "a-rogue" {
            Outcome::IgnoreSql("COMMIT; BEGIN; SELECT 1/0")
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let decisions = store
        .process_batch(&g, &[usage("a-rogue", 1), usage("b", 1)])
        .unwrap();
    let applied_b = fx.connect().effects_of("b").unwrap();
    let claim_b = store.claim(&key("b")).unwrap().map(|c| c.status);
    assert!(
        all_stop(&decisions),
        "decisions {decisions:?}; b applied {applied_b} times, its claim {claim_b:?}"
    );
}

/// The same hole with the error propagated (`?`), the ordinary way: `COMMIT; BEGIN`
/// then a failing statement. The message that failed is acked as a duplicate and
/// its batch-mate is lost.
#[test]
fn review_a_restart_followed_by_a_propagated_error_acks_the_batch_as_duplicates() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "a-rogue" {
            Outcome::Sql("COMMIT; BEGIN; SELECT 1/0")
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    let decisions = store
        .process_batch(&g, &[usage("a-rogue", 1), usage("b", 1)])
        .unwrap();
    let applied_b = fx.connect().effects_of("b").unwrap();
    assert!(
        all_stop(&decisions),
        "decisions {decisions:?}; b applied {applied_b} times"
    );
}

/// A contention error after the handler committed the store's transaction: the
/// optimistic run returns `Retryable` before reading the token back, the batch is
/// rerun, and the rerun finds the claims the handler committed: duplicates, acked.
#[test]
fn review_a_commit_then_a_serialization_failure_reruns_into_duplicates() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "a-rogue" {
            Outcome::Sql(
                "COMMIT; DO $$ BEGIN RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001'; END $$",
            )
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().handler(handler));
    let g = group(GROUP);
    // The first try fails the store call (diesel: NotInTransaction); the transport
    // redelivers, as it must.
    let mut outcomes = Vec::new();
    let mut batch = vec![usage("a-rogue", 1), usage("b", 1)];
    let decisions = loop {
        match store.process_batch(&g, &batch) {
            Ok(decisions) => break decisions,
            Err(err) if outcomes.len() < 3 => outcomes.push(format!("{err:?}")),
            Err(err) => panic!("{err:?} after {outcomes:?}"),
        }
        batch = batch.into_iter().map(Envelope::redelivered).collect();
    };
    let applied_b = fx.connect().effects_of("b").unwrap();
    assert!(
        all_stop(&decisions),
        "errors {outcomes:?}, then decisions {decisions:?}; b applied {applied_b} times"
    );
}

/// `ROLLBACK; BEGIN` then a swallowed error: in the isolated run the savepoint is
/// gone, its rollback fails (3B001), and that is a fatal store error. Redelivered, it
/// is a store error "after a start mark", so the process adds no mark: the message
/// neither reaches a decision nor ever counts as a crash loop. Every try fails the
/// store call (and the consumer backs off as if the store were down).
#[test]
fn review_a_rollback_then_an_error_loops_forever_as_a_store_error() {
    let Some(fx) = PgFixture::new() else { return };
    let handler = Recorder::new(GROUP).behaviour(|key, _| {
        if key == "rogue" {
            Outcome::IgnoreSql("ROLLBACK; BEGIN; SELECT 1/0")
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().crash_limit(3).handler(handler));
    let g = group(GROUP);
    let mut outcomes = Vec::new();
    let first = store.process_batch(&g, &[usage("rogue", 1)]);
    outcomes.push(format!("{first:?}"));
    let env = usage("rogue", 1).redelivered();
    let mut decided = first.is_ok();
    for _ in 0..8 {
        let outcome = store.process_batch(&g, std::slice::from_ref(&env));
        outcomes.push(format!("{outcome:?}"));
        if outcome.is_ok() {
            decided = true;
            break;
        }
    }
    assert!(decided, "never decided: {outcomes:#?}");
}

/// After a handler ended, restarted or aborted the store's transaction, the pooled
/// connection (the only one) must be back outside any transaction: the next batch
/// must commit, seen from another session.
#[test]
fn review_the_pooled_connection_is_clean_after_a_handler_ended_the_transaction() {
    for sql in [
        "COMMIT",
        "COMMIT; BEGIN",
        "ROLLBACK",
        "ROLLBACK; BEGIN",
        "COMMIT; BEGIN; SELECT 1/0",
        "ROLLBACK; BEGIN; SELECT 1/0",
        "COMMIT AND CHAIN",
        "ROLLBACK AND CHAIN",
        "BEGIN",
        "SAVEPOINT s; RELEASE SAVEPOINT diesel_savepoint_1",
        "PREPARE TRANSACTION 'review'",
    ] {
        let Some(fx) = PgFixture::new() else { return };
        let handler = Recorder::new(GROUP).behaviour(move |key, _| {
            if key.starts_with("rogue") {
                Outcome::IgnoreSql(sql)
            } else {
                Outcome::Apply
            }
        });
        let store = fx.open(fx.builder().pool_size(1).handler(handler));
        let g = group(GROUP);
        for batch in [
            vec![usage("rogue-alone", 1)],
            vec![usage("a", 1), usage("rogue-mid", 1), usage("b", 1)],
            // The rogue's first call in isolation: a failing batch-mate goes first.
            vec![usage("rogue-iso", 1), usage("zz", 1)],
        ] {
            let _ = store.process_batch(&g, &batch);
        }
        for n in 0..3 {
            let k = format!("later-{n}");
            let decisions = store.process_batch(&g, &[usage(&k, 1)]);
            let seen = fx.connect().effects_of(&k).unwrap();
            let claim = fx
                .connect()
                .batch_execute(&format!(
                    "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM inbox_claims WHERE message_key = '{k}' AND status = 'done') THEN RAISE EXCEPTION 'no done claim'; END IF; END $$"
                ))
                .is_ok();
            assert!(
                matches!(decisions.as_deref(), Ok([Decision::Processed])) && seen == 1 && claim,
                "{sql}: {k}: {decisions:?}, effect seen by another session {seen}, done claim {claim}"
            );
        }
    }
}

/// README: "Only a process death counts: a start whose processing ended in a store
/// error (a lost connection, a lock wait that timed out) is remembered by the process,
/// and the next start of that message adds no mark." The hung-handler rule counts an
/// errored start as a crash once the batch outlived `batch_deadline`, measured from
/// before the lock wait. With `statement_timeout` = `batch_deadline` (allowed: "at
/// most batch_deadline"), a redelivery that merely waits behind a projection rebuild
/// holding its lock exclusively times out *at* the deadline, so each wait counts as a
/// crash and the message is dead-lettered as `crash_loop` without its handler ever
/// running. (With the defaults, 30 s / 60 s, two waits of the same batch do it: the
/// lock, then the claim row.)
#[test]
fn review_a_redelivery_waiting_behind_a_rebuild_is_dead_lettered_as_a_crash_loop() {
    let Some(fx) = PgFixture::new() else { return };
    let lock = ProjectionLock::named(&inbox_test_support::unique_name("usage-totals"));
    let handler = Recorder::new(GROUP).lock(lock);
    let calls = handler.calls();
    let store = fx.open(
        fx.builder()
            .batch_deadline(Duration::from_millis(300))
            .statement_timeout(Duration::from_millis(300))
            .crash_limit(2)
            .handler(handler),
    );
    let g = group(GROUP);
    let env = usage("k", 1).redelivered();
    let mut outcomes = Vec::new();
    {
        // A rebuild holds the projection lock exclusively.
        let mut holder = fx.connect();
        holder
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock({})",
                lock.id()
            ))
            .unwrap();
        for _ in 0..4 {
            outcomes.push(format!(
                "{:?}",
                store.process_batch(&g, std::slice::from_ref(&env))
            ));
        }
        holder.batch_execute("ROLLBACK").unwrap();
    }
    let after = store.process_batch(&g, &[env]);
    assert!(
        matches!(after.as_deref(), Ok([Decision::Processed])),
        "while the rebuild held its lock: {outcomes:#?}; after: {after:?}; handler calls {}",
        calls.lock().unwrap().len()
    );
}

/// A `malformed` dead letter is written in a transaction of its own before the rest
/// of the batch; when a batch-mate then fails the store call (here a lock wait that
/// times out), the transport acks nothing and redelivers the batch, and each
/// redelivery writes another dead letter of the same delivery. The claim path's dead
/// letters are written once (a later copy is `AlreadyDeadLettered`); these pile up,
/// one per try.
#[test]
fn review_a_malformed_delivery_is_dead_lettered_again_on_every_redelivery() {
    let Some(fx) = PgFixture::new() else { return };
    drop(fx.builder().build().unwrap());
    let lock = ProjectionLock::named(&inbox_test_support::unique_name("usage-totals"));
    let handler = Recorder::new(GROUP).lock(lock);
    let url = format!("{}?options=-c%20lock_timeout%3D100", fx.url());
    let store = Store::<diesel::PgConnection>::builder(url)
        .schema(fx.schema.clone())
        .handler(handler)
        .build()
        .unwrap();
    fx.connect().create_effects().unwrap();
    let g = group(GROUP);
    let nul = Envelope::new(
        MessageKey::new("nul").unwrap(),
        "usage\0recorded",
        b"{}".to_vec(),
    );
    let mut batch = vec![nul, usage("b", 1)];
    let mut holder = fx.connect();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({})",
            lock.id()
        ))
        .unwrap();
    for _ in 0..3 {
        assert!(store.process_batch(&g, &batch).is_err());
        batch = batch.into_iter().map(Envelope::redelivered).collect();
    }
    holder.batch_execute("ROLLBACK").unwrap();
    let decisions = store.process_batch(&g, &batch).unwrap();
    let dead = store.dead_letters(&g).unwrap();
    assert_eq!(
        dead.iter()
            .filter(|d| d.reason == DeadLetterReason::Malformed.as_str())
            .count(),
        1,
        "decisions {decisions:?}; {} dead letters: {:?}",
        dead.len(),
        dead.iter().map(|d| (&d.key, &d.reason)).collect::<Vec<_>>()
    );
}

/// A handler that changes a session setting (`SET`, not `SET LOCAL`) and commits
/// leaves it on the pooled connection: here `search_path`, which the store set once
/// when the connection was opened. The next batch on that connection runs the
/// store's own statements against another schema: another store's claim table
/// (`other`, as two services sharing a database by schema would have).
#[test]
fn review_a_handler_that_moves_the_search_path_stops_and_leaves_the_connection_clean() {
    let Some(fx) = PgFixture::new() else { return };
    let Some(other) = PgFixture::new() else {
        return;
    };
    drop(other.builder().build().unwrap());
    let set: &'static str =
        Box::leak(format!("SET search_path TO \"{}\"", other.schema).into_boxed_str());
    let handler = Recorder::new(GROUP).behaviour(move |key, _| {
        if key == "sets" {
            Outcome::IgnoreSql(set)
        } else {
            Outcome::Apply
        }
    });
    let store = fx.open(fx.builder().pool_size(1).handler(handler));
    let g = group(GROUP);
    // Moving the session's search_path is caught like ending the transaction: the
    // batch stops, naming the handler, and the connection is set up again.
    let decisions = store.process_batch(&g, &[usage("sets", 1)]).unwrap();
    assert!(
        matches!(&decisions[..], [Decision::Stop(v)] if v.detail.contains("search_path")),
        "{decisions:?}"
    );
    let next = store.process_batch(&g, &[usage("next", 1)]);
    let leaked = other
        .builder()
        .build()
        .unwrap()
        .claim(&key("next"))
        .unwrap();
    assert!(
        matches!(next.as_deref(), Ok([Decision::Processed]))
            && fx.connect().effects_of("next").unwrap() == 1
            && leaked.is_none(),
        "the next batch on the same connection: {next:?}; the other store's claim table holds {leaked:?}"
    );
}
