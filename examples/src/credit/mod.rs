//! The credit ledger of refund-then-reclaim, on the framework.
//!
//! A usage-billed system charges credits when a job is submitted and refunds them
//! when the job fails; when a "failed" job turns out to have succeeded after all, the
//! refund is reclaimed. The ledger is append-only (`charge -cost`, `refund +cost`,
//! `reclaim -cost`), the balance is its sum, and every refund and reclaim is one
//! conditional write guarded by the job's current state; the database's unique
//! `(job_id, entry_type)` and CHECK constraints refuse a second one anyway. Signals
//! arrive through the inbox (de-duplicated per message id); retries go out through
//! the outbox with a not-before time from the framework's `RetryPolicy`; a job that
//! used up its attempts becomes `dead` and a `job.dead` message is kept for
//! inspection. See the README's "Credit ledger" section for the message contract and
//! the `credit_ledger` commands.

pub mod check;
pub mod contract;
pub mod db;
pub mod handlers;
pub mod run;
pub mod runner;

pub use check::{check, Report, Violation};
pub use db::{CreditDb, JobRow, JobState, LedgerRow};
pub use handlers::{FailedHandler, Ledger, RunnerHandler, SucceededHandler};
pub use runner::{Mix, Outcome};
