//! Random interleavings of the ledger's signals against a model of its state machine,
//! on PostgreSQL and SQLite: `job.failed` (transient or not, naming an attempt or
//! not), `job.succeeded` and `job.run`, for a few jobs and for jobs that do not exist,
//! each delivered any number of times (some as redeliveries), late failures after
//! the success included. After every delivery the decision, the jobs' rows, the
//! ledger, the messages enqueued on the outbox and the invariants are compared.
//!
//! `INBOX_PROPTEST_CASES` sets the cases per backend (default [`DEFAULT_CASES`]);
//! `INBOX_PROPTEST_SEED` (a number) replays a run.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, SqliteConnection};
use inbox_core::{
    ConsumerGroup, DeadLetterReason, Decision, Envelope, ManualClock, MessageKey, OutboxStore,
    RetryPolicy,
};
use inbox_diesel::{Store, StoreConnection};
use inbox_examples::credit::contract::{
    JOB_DEAD, JOB_FAILED, JOB_RUN, JOB_SUCCEEDED, LEDGER_GROUP, RUNNER_GROUP,
};
use inbox_examples::credit::run::{self, Config, Roles};
use inbox_examples::credit::{CreditDb, Mix, Outcome};
use proptest::prelude::*;
use proptest::test_runner::{
    Config as RunnerConfig, RngAlgorithm, TestCaseError, TestRng, TestRunner,
};
use serde_json::{json, Value};

/// Cases per backend when `INBOX_PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 150;

const MAX_ATTEMPTS: i32 = 3;

const MIX: Mix = Mix {
    transient: 25,
    permanent: 15,
    timeout: 20,
    double: 15,
    seed: 3,
};

#[derive(Clone, Debug)]
enum Sig {
    Failed {
        job: usize,
        reason: usize,
        transient: bool,
        attempt: Option<i32>,
    },
    Succeeded {
        job: usize,
    },
    Run {
        job: usize,
        attempt: i32,
    },
}

#[derive(Clone, Debug)]
struct Case {
    costs: Vec<i64>,
    signals: Vec<Sig>,
    /// (signal, redelivered) in delivery order.
    deliveries: Vec<(usize, bool)>,
}

const REASONS: [&str; 3] = ["timeout", "error_callback", "invalid_input"];

fn sig(jobs: usize) -> impl Strategy<Value = Sig> {
    // `jobs` itself names a job that does not exist.
    let job = 0..=jobs;
    prop_oneof![
        4 => (job.clone(), 0..REASONS.len(), proptest::bool::weighted(0.7),
              proptest::option::weighted(0.3, 1..=MAX_ATTEMPTS))
            .prop_map(|(job, reason, transient, attempt)| Sig::Failed { job, reason, transient, attempt }),
        2 => job.clone().prop_map(|job| Sig::Succeeded { job }),
        2 => (job, 1..=MAX_ATTEMPTS).prop_map(|(job, attempt)| Sig::Run { job, attempt }),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    proptest::collection::vec(1i64..1_000, 1..=3).prop_flat_map(|costs| {
        let n = costs.len();
        proptest::collection::vec(sig(n), 1..=8).prop_flat_map(move |signals| {
            let s = signals.len();
            let costs = costs.clone();
            proptest::collection::vec((0..s, proptest::bool::weighted(0.2)), 1..=24).prop_map(
                move |deliveries| Case {
                    costs: costs.clone(),
                    signals: signals.clone(),
                    deliveries,
                },
            )
        })
    })
}

/// The model's view of one job.
#[derive(Clone, Debug, PartialEq, Eq)]
struct MJob {
    state: &'static str,
    attempts: i32,
    refunded: bool,
    reclaimed: bool,
    last_error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Claim {
    Done,
    Dead,
}

struct Model {
    ids: Vec<String>,
    users: Vec<String>,
    costs: Vec<i64>,
    jobs: Vec<MJob>,
    ledger: Vec<(usize, &'static str, i64)>,
    claims: BTreeMap<String, Claim>,
    /// Messages enqueued and not yet compared.
    outbox: Vec<(String, Value)>,
}

impl Model {
    fn new(ids: Vec<String>, users: Vec<String>, costs: Vec<i64>) -> Self {
        let jobs = ids
            .iter()
            .map(|_| MJob {
                state: "queued",
                attempts: 1,
                refunded: false,
                reclaimed: false,
                last_error: None,
            })
            .collect();
        let ledger = costs
            .iter()
            .enumerate()
            .map(|(j, c)| (j, "charge", -c))
            .collect();
        let outbox = ids
            .iter()
            .map(|id| (JOB_RUN.to_owned(), json!({"job_id": id, "attempt": 1})))
            .collect();
        Self {
            ids,
            users,
            costs,
            jobs,
            ledger,
            claims: BTreeMap::new(),
            outbox,
        }
    }

    fn deliver(&mut self, key: &str, sig: &Sig) -> Decision {
        match self.claims.get(key) {
            Some(Claim::Done) => return Decision::Duplicate,
            Some(Claim::Dead) => return Decision::AlreadyDeadLettered,
            None => {}
        }
        let job = match sig {
            Sig::Failed { job, .. } | Sig::Succeeded { job } | Sig::Run { job, .. } => *job,
        };
        if job >= self.jobs.len() {
            self.claims.insert(key.to_owned(), Claim::Dead);
            return Decision::DeadLettered(DeadLetterReason::Permanent);
        }
        self.claims.insert(key.to_owned(), Claim::Done);
        let (id, cost) = (self.ids[job].clone(), self.costs[job]);
        let j = &mut self.jobs[job];
        match sig {
            Sig::Failed {
                reason,
                transient,
                attempt,
                ..
            } => {
                if !j.refunded && j.state != "delivered" {
                    j.refunded = true;
                    self.ledger.push((job, "refund", cost));
                }
                let outstanding = matches!(j.state, "queued" | "running")
                    && attempt.is_none_or(|a| a == j.attempts);
                if outstanding {
                    j.last_error = Some(REASONS[*reason].to_owned());
                    if *transient && j.attempts < MAX_ATTEMPTS {
                        j.state = "queued";
                        j.attempts += 1;
                        self.outbox.push((
                            JOB_RUN.to_owned(),
                            json!({"job_id": id, "attempt": j.attempts}),
                        ));
                    } else if *transient {
                        j.state = "dead";
                        self.outbox.push((
                            JOB_DEAD.to_owned(),
                            json!({"job_id": id, "user_id": self.users[job], "cost": cost,
                                   "attempts": j.attempts, "last_error": REASONS[*reason]}),
                        ));
                    } else {
                        j.state = "failed";
                    }
                }
            }
            Sig::Succeeded { .. } => {
                j.state = "delivered";
                if j.refunded && !j.reclaimed {
                    j.reclaimed = true;
                    self.ledger.push((job, "reclaim", -cost));
                }
            }
            Sig::Run { attempt, .. } => {
                if j.state == "queued" && j.attempts == *attempt {
                    j.state = "running";
                    let failed = |reason: &str, transient: bool| {
                        (
                            JOB_FAILED.to_owned(),
                            json!({"job_id": id, "reason": reason, "transient": transient, "attempt": attempt}),
                        )
                    };
                    let succeeded = (JOB_SUCCEEDED.to_owned(), json!({"job_id": id}));
                    match MIX.outcome(&id, *attempt) {
                        Outcome::Succeed => self.outbox.push(succeeded),
                        Outcome::Transient => {
                            self.outbox.push(failed("dependency_unavailable", true))
                        }
                        Outcome::Permanent => self.outbox.push(failed("invalid_input", false)),
                        Outcome::TimeoutThenSucceed => {
                            self.outbox.push(failed("timeout", true));
                            self.outbox.push(succeeded);
                        }
                        Outcome::TimeoutThenError => {
                            self.outbox.push(failed("timeout", true));
                            self.outbox.push(failed("error_callback", true));
                        }
                    }
                }
            }
        }
        Decision::Processed
    }
}

fn body(sig: &Sig, ids: &[String], missing: &str) -> (&'static str, String) {
    let id = |job: usize| ids.get(job).map_or(missing, String::as_str).to_owned();
    match sig {
        Sig::Failed {
            job,
            reason,
            transient,
            attempt,
        } => {
            let mut v =
                json!({"job_id": id(*job), "reason": REASONS[*reason], "transient": transient});
            if let Some(a) = attempt {
                v["attempt"] = json!(a);
            }
            (JOB_FAILED, v.to_string())
        }
        Sig::Succeeded { job } => (JOB_SUCCEEDED, json!({"job_id": id(*job)}).to_string()),
        Sig::Run { job, attempt } => (
            JOB_RUN,
            json!({"job_id": id(*job), "attempt": attempt}).to_string(),
        ),
    }
}

fn fail(what: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(what.to_string())
}

fn cases() -> u32 {
    std::env::var("INBOX_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

fn runner() -> TestRunner {
    let config = RunnerConfig {
        cases: cases(),
        failure_persistence: None,
        ..RunnerConfig::default()
    };
    match std::env::var("INBOX_PROPTEST_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(seed) => {
            let mut bytes = [0u8; 32];
            bytes[..8].copy_from_slice(&seed.to_le_bytes());
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
        }
        None => TestRunner::new(config),
    }
}

fn check_against_model<C: StoreConnection + CreditDb>(url: String, schema: String) {
    let clock = ManualClock::new("2026-12-01T00:00:00Z".parse().unwrap());
    let config = Config {
        database_url: url,
        schema,
        prefix: String::new(),
        job_policy: RetryPolicy::new(
            MAX_ATTEMPTS as u32,
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .unwrap(),
        mix: MIX,
    };
    let roles = Roles {
        ledger: true,
        runner: true,
    };
    let store: Store<C> =
        run::build_store(run::store_builder::<C>(&config, roles).clock(Arc::new(clock.clone())))
            .unwrap();
    let ledger_group = ConsumerGroup::new(LEDGER_GROUP).unwrap();
    let runner_group = ConsumerGroup::new(RUNNER_GROUP).unwrap();
    static CASE: AtomicUsize = AtomicUsize::new(0);
    let mut runner = runner();
    let result = runner.run(&case(), |case| {
        let n = CASE.fetch_add(1, Ordering::Relaxed);
        let users: Vec<String> = (0..case.costs.len())
            .map(|j| format!("case{n}-user{j}"))
            .collect();
        let mut ids = Vec::new();
        for (user, cost) in users.iter().zip(&case.costs) {
            ids.extend(run::submit(&store, &config.exchange(), user, *cost, 1).map_err(fail)?);
        }
        let missing = format!("case{n}-no-such-job");
        let mut model = Model::new(ids.clone(), users.clone(), case.costs.clone());
        compare(&store, &clock, &mut model)?;
        for (step, (s, redelivered)) in case.deliveries.iter().enumerate() {
            let sig = &case.signals[*s];
            let key = format!("case{n}-signal{s}");
            let (ty, payload) = body(sig, &ids, &missing);
            let mut envelope = Envelope::new(
                MessageKey::new(key.clone()).unwrap(),
                ty,
                payload.into_bytes(),
            );
            if *redelivered {
                envelope = envelope.redelivered();
            }
            let group = if ty == JOB_RUN {
                &runner_group
            } else {
                &ledger_group
            };
            let decided = store.process_batch(group, &[envelope]).map_err(fail)?;
            let expected = model.deliver(&key, sig);
            prop_assert_eq!(decided, vec![expected], "step {} {:?}", step, sig);
            compare(&store, &clock, &mut model)
                .map_err(|e| fail(format!("step {step} {sig:?}: {e}")))?;
        }
        Ok(())
    });
    if let Err(err) = result {
        panic!("{err}");
    }
}

/// The store against the model: jobs, ledger, enqueued messages, invariants.
fn compare<C: StoreConnection + CreditDb>(
    store: &Store<C>,
    clock: &ManualClock,
    model: &mut Model,
) -> Result<(), TestCaseError> {
    let (jobs, ledger) = store.connection().map_err(fail)?.snapshot().map_err(fail)?;
    for (j, id) in model.ids.iter().enumerate() {
        let row = jobs
            .iter()
            .find(|r| r.job_id == *id)
            .ok_or_else(|| fail(format!("job {id} missing")))?;
        let found = MJob {
            state: match row.state.as_str() {
                "queued" => "queued",
                "running" => "running",
                "delivered" => "delivered",
                "failed" => "failed",
                "dead" => "dead",
                other => return Err(fail(format!("state {other}"))),
            },
            attempts: row.attempts,
            refunded: row.refunded,
            reclaimed: row.reclaimed,
            last_error: row.last_error.clone(),
        };
        prop_assert_eq!(&found, &model.jobs[j], "job {}", j);
    }
    let found: Vec<(usize, &str, i64)> = ledger
        .iter()
        .filter_map(|l| {
            let j = model.ids.iter().position(|id| *id == l.job_id)?;
            Some((j, l.entry_type.as_str(), l.amount))
        })
        .collect();
    let want: Vec<(usize, &str, i64)> = model.ledger.iter().map(|(j, t, a)| (*j, *t, *a)).collect();
    prop_assert_eq!(found, want);
    let report = inbox_examples::credit::check(&jobs, &ledger);
    prop_assert!(report.ok, "{}", report);

    // Everything enqueued is due within a day of the store's clock.
    clock.advance(Duration::from_secs(86_400));
    let lease = store
        .lease("model", 10_000, Duration::from_secs(30))
        .map_err(fail)?;
    prop_assert!(lease.unreadable.is_empty());
    let ids: Vec<i64> = lease.rows.iter().map(|r| r.id).collect();
    store.mark_published("model", &ids).map_err(fail)?;
    let mut found: Vec<(String, Value)> = lease
        .rows
        .iter()
        .map(|r| {
            (
                r.message.message_type.clone(),
                serde_json::from_slice(&r.message.payload).unwrap_or(Value::Null),
            )
        })
        .collect();
    let mut want = std::mem::take(&mut model.outbox);
    let order = |a: &(String, Value), b: &(String, Value)| {
        (&a.0, a.1.to_string()).cmp(&(&b.0, b.1.to_string()))
    };
    found.sort_by(order);
    want.sort_by(order);
    prop_assert_eq!(found, want);
    Ok(())
}

#[test]
fn postgres_ledger_behaves_like_the_model() {
    let Some(url) = inbox_test_support::postgres_url() else {
        return;
    };
    let schema = inbox_test_support::unique_name("credit_model");
    struct Drop_(String, String);
    impl Drop for Drop_ {
        fn drop(&mut self) {
            if let Ok(mut conn) = PgConnection::establish(&self.0) {
                let _ =
                    conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.1));
            }
        }
    }
    let _guard = Drop_(url.clone(), schema.clone());
    check_against_model::<PgConnection>(url, schema);
}

#[test]
fn sqlite_ledger_behaves_like_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("credit.db").to_string_lossy().into_owned();
    check_against_model::<SqliteConnection>(path, String::new());
}
