//! Many threads deliver distinct refund and reclaim signals (and copies of them) for
//! the same jobs at once, through the inbox, on PostgreSQL. Each job ends with one
//! charge, at most one refund and one reclaim, a reclaim only after a refund, and the
//! right net; every distinct signal is processed exactly once and none fails.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_core::{ConsumerGroup, Decision, Envelope, MessageKey, RetryPolicy};
use inbox_examples::credit::contract::{JOB_FAILED, JOB_SUCCEEDED, LEDGER_GROUP};
use inbox_examples::credit::run::{self, Config, Roles};
use inbox_examples::credit::{CreditDb, Mix};
use inbox_examples::usage::Rng;

/// Drops the test's schema.
struct Schema {
    url: String,
    name: String,
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.url) {
            let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        }
    }
}

const JOBS_WITH_SUCCESS: usize = 8;
const JOBS_FAILING_ONLY: usize = 4;
const SUCCESSES_PER_JOB: usize = 5;
const THREADS: usize = 16;
const ROUNDS: usize = 3;

#[test]
fn concurrent_refund_and_reclaim_signals_never_refund_or_charge_twice() {
    let Some(url) = inbox_test_support::postgres_url() else {
        return;
    };
    let mut reclaimed = 0;
    for round in 0..ROUNDS {
        let schema = Schema {
            url: url.clone(),
            name: inbox_test_support::unique_name("credit_conc"),
        };
        reclaimed += one_round(&url, &schema.name, round as u64);
    }
    // 11 failures and 5 successes per job at once: some jobs are refunded before
    // their success lands, so the refund-then-reclaim path is taken.
    assert!(reclaimed > 0, "no job was refunded and then reclaimed");
    eprintln!(
        "{reclaimed} of {} delivered jobs were refunded, then reclaimed",
        ROUNDS * JOBS_WITH_SUCCESS
    );
}

/// Returns how many jobs were refunded and then reclaimed.
fn one_round(url: &str, schema: &str, seed: u64) -> usize {
    let config = Config {
        database_url: url.to_owned(),
        schema: schema.to_owned(),
        prefix: String::new(),
        // 3 attempts: the transient failures of a job that never succeeds end it dead.
        job_policy: RetryPolicy::new(3, Duration::from_millis(10), Duration::from_millis(40))
            .unwrap(),
        mix: Mix::default(),
    };
    let roles = Roles {
        ledger: true,
        runner: false,
    };
    let store = run::build_store(
        run::store_builder::<PgConnection>(&config, roles).pool_size(THREADS as u32),
    )
    .unwrap();
    let jobs = JOBS_WITH_SUCCESS + JOBS_FAILING_ONLY;
    let mut ids = Vec::new();
    for j in 0..jobs {
        let cost = 10 + j as i64;
        ids.extend(
            run::submit(
                &store,
                &config.exchange(),
                &format!("user-{}", j % 3),
                cost,
                1,
            )
            .unwrap(),
        );
    }

    // Per job, one distinct signal per thread, all delivered at the same moment (a
    // barrier per job); then each thread delivers a copy of a neighbour's signal
    // (some as redeliveries).
    let mut rng = Rng::new(seed * 7919 + 1);
    let reasons = ["timeout", "error_callback", "oom", "node_lost"];
    let mut signals = 0;
    let mut plan: Vec<Vec<Vec<Envelope>>> = vec![Vec::new(); THREADS];
    for (j, job_id) in ids.iter().enumerate() {
        let successes = if j < JOBS_WITH_SUCCESS {
            SUCCESSES_PER_JOB
        } else {
            0
        };
        let mut of_job: Vec<Envelope> = (0..THREADS)
            .map(|i| {
                let (key, ty, body) = if i < successes {
                    (
                        format!("{job_id}.succeeded.{i}"),
                        JOB_SUCCEEDED,
                        format!(r#"{{"job_id": "{job_id}"}}"#),
                    )
                } else {
                    let reason = reasons[i % reasons.len()];
                    (
                        format!("{job_id}.failed.{i}"),
                        JOB_FAILED,
                        format!(
                            r#"{{"job_id": "{job_id}", "reason": "{reason}", "transient": true}}"#
                        ),
                    )
                };
                Envelope::new(MessageKey::new(key).unwrap(), ty, body.into_bytes())
            })
            .collect();
        signals += of_job.len();
        for i in (1..of_job.len()).rev() {
            let k = rng.below(i as u64 + 1) as usize;
            of_job.swap(i, k);
        }
        for (t, thread_plan) in plan.iter_mut().enumerate() {
            let copy = of_job[(t + 1) % THREADS].clone();
            let copy = if rng.below(2) == 0 {
                copy.redelivered()
            } else {
                copy
            };
            thread_plan.push(vec![of_job[t].clone(), copy]);
        }
    }
    let group = ConsumerGroup::new(LEDGER_GROUP).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let decisions: Arc<Mutex<Vec<(String, Decision)>>> = Arc::default();
    let threads: Vec<_> = plan
        .into_iter()
        .map(|mine| {
            let (store, group, barrier, decisions) = (
                store.clone(),
                group.clone(),
                Arc::clone(&barrier),
                Arc::clone(&decisions),
            );
            std::thread::spawn(move || {
                for step in mine {
                    barrier.wait();
                    for envelope in step {
                        let decided = store
                            .process_batch(&group, std::slice::from_ref(&envelope))
                            .unwrap();
                        let mut all = decisions.lock().unwrap();
                        all.extend(
                            decided
                                .into_iter()
                                .map(|d| (envelope.message_key.to_string(), d)),
                        );
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    // Every distinct signal processed exactly once; every copy a duplicate; nothing
    // failed, was retried or dead-lettered.
    let decisions = decisions.lock().unwrap();
    let mut processed: BTreeMap<&str, usize> = BTreeMap::new();
    for (key, decision) in decisions.iter() {
        match decision {
            Decision::Processed => *processed.entry(key).or_default() += 1,
            Decision::Duplicate => {}
            other => panic!(
                "signal {key}: {other:?}; the dead letters: {:?}",
                store.dead_letters(&group).unwrap()
            ),
        }
    }
    assert_eq!(processed.len(), signals);
    assert!(processed.values().all(|n| *n == 1), "{processed:?}");

    // The ledger: one charge, one refund, a reclaim after it for the delivered jobs.
    let report = run::check_store(&store).unwrap();
    assert!(report.ok, "{report}");
    let mut conn = store.connection().unwrap();
    let (rows, ledger) = conn.snapshot().unwrap();
    let mut reclaimed = 0;
    for (j, job_id) in ids.iter().enumerate() {
        let job = rows.iter().find(|r| r.job_id == *job_id).unwrap();
        let entries: Vec<(&str, i64)> = ledger
            .iter()
            .filter(|l| l.job_id == *job_id)
            .map(|l| (l.entry_type.as_str(), l.amount))
            .collect();
        let cost = job.cost;
        if j < JOBS_WITH_SUCCESS {
            assert_eq!(job.state, "delivered", "{job:?}");
            // A success before every failure: nothing to refund; else refund, reclaim.
            if entries.len() == 1 {
                assert_eq!(entries, [("charge", -cost)], "{job:?}");
            } else {
                assert_eq!(
                    entries,
                    [("charge", -cost), ("refund", cost), ("reclaim", -cost)],
                    "{job:?}"
                );
                reclaimed += 1;
            }
        } else {
            assert_eq!(job.state, "dead", "{job:?}");
            assert_eq!(job.attempts, 3, "{job:?}");
            assert_eq!(entries, [("charge", -cost), ("refund", cost)], "{job:?}");
        }
    }
    let delivered_cost: i64 = rows
        .iter()
        .filter(|r| r.state == "delivered")
        .map(|r| r.cost)
        .sum();
    assert_eq!(report.ledger_total, -delivered_cost);
    reclaimed
}
