//! The features composed: a model-based test across the whole lifecycle, and the
//! interleavings where two writers meet on one row forced with locks and gates.
//!
//! **The model test** (`the_lifecycle_behaves_like_the_model`, on both backends):
//! random sequences of producer writes (a ledger row and its outbox row in one
//! transaction), relay rounds, broker deliveries and redeliveries, handlers that fail
//! transiently, permanently or panic per key and attempt (to dead letters), fixes of
//! the cause, replays, bulk replays, discards, redrives, rebuilds of the window,
//! retention purges, group halts and resumes, and idempotency keys (begin, take-over
//! after the lease, commit, settle, refund, abandon, purge, reuse of a key), with the
//! clock stepped forward and back. After every step the projection, the claims, the
//! dead letters, the outbox rows, the idempotency records and the halts are compared
//! with a model written from the README's rules (`lifecycle/model.rs`); a failing
//! case shrinks to a minimal sequence. `INBOX_MODEL_CASES` sets the cases per backend
//! (default 40: with the seams, about a minute for the binary on a quiet two-core
//! machine), `INBOX_MODEL_SEED` replays a run, `INBOX_MODEL_TALLY=1` prints how often
//! each transition was reached, and `INBOX_LIFECYCLE_KNOWN_DEFECTS=all` (or
//! `tokens,sequences,resolved`) expects the unfixed behaviour of issue 21's listed
//! defects, to look for anything else on code that does not have the fixes yet. The
//! rules those fixes settle sit in small functions at the end of `lifecycle/model.rs`,
//! and the token's type in `lifecycle::Token`: adapt them there at the merge.
//!
//! **The forced interleavings** (module `lifecycle::seams`): each pair of writers that can meet
//! on one row across the features, forced with two connections (a row lock held by a
//! third connection that decides who queues first, an open transaction, a gate inside
//! the rebuild), never with sleeps; each checks that the outcome is one a serial
//! order gives.
//!
//! Each test runs as `lifecycle::seams::postgres::<name>` (forced with locks) and
//! `lifecycle::seams::sqlite::<name>` (both serial orders):
//!
//! | writers | row | test |
//! |---|---|---|
//! | replay / rebuild cover | a dead claim in the window | `a_replay_landing_inside_a_rebuild_is_counted_once` |
//! | bulk replay / rebuild cover | a dead claim in the window | `a_bulk_replay_landing_inside_a_rebuild_is_counted_once` |
//! | redrive / rebuild cover | a failed claim in the window | `a_redrive_landing_inside_a_rebuild_is_counted_once` |
//! | discard / replay | a dead letter | `a_discard_committed_during_a_replay_is_never_replayed` |
//! | purge, then a new request / a stalled request's commit | an idempotency record | `a_late_commit_after_a_purge_never_lands_on_the_new_request` |
//! | take-over and abandon, then a new request / a stalled request's commit | an idempotency record | `a_late_commit_after_an_abandon_never_lands_on_the_new_request` |
//! | take-over / commit of the expired request | an idempotency record | `a_take_over_waiting_on_a_commit_never_executes_twice`, `a_commit_waiting_on_a_take_over_is_fenced` (SQLite: `a_take_over_and_a_commit_in_either_order_never_execute_twice`) |
//!
//! SQLite has one writer: every write transaction of the store is `BEGIN IMMEDIATE`,
//! so two writers never overlap there; each interleaving reduces to the two serial
//! orders, and the SQLite variants run both.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod lifecycle;

inbox_test_support::on_both_backends!(the_lifecycle_behaves_like_the_model);

fn the_lifecycle_behaves_like_the_model<F: inbox_test_support::Fixture>(fx: &F)
where
    F::Conn: lifecycle::world::LcDb,
{
    lifecycle::run_model(fx);
}
