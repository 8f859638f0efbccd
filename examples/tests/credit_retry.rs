//! A transient failure re-queues the job as `job.run` attempt + 1, due after the
//! policy's capped exponential backoff (the outbox row's not-before time), so a broken
//! dependency is polled slowly; after the last attempt the job is dead and `job.dead`
//! is enqueued at once. On PostgreSQL and SQLite, on the store's manual clock.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, SqliteConnection};
use inbox_core::{
    ConsumerGroup, Decision, Envelope, ManualClock, MessageKey, OutboxStore, RetryPolicy,
};
use inbox_diesel::{Store, StoreConnection};
use inbox_examples::credit::contract::{JOB_DEAD, JOB_FAILED, JOB_RUN, LEDGER_GROUP};
use inbox_examples::credit::run::{self, Config, Roles};
use inbox_examples::credit::{CreditDb, Mix};
use serde_json::{json, Value};

/// What is due now: (type, body) of every row a lease returns, marked published.
fn due<C: StoreConnection>(store: &Store<C>) -> Vec<(String, Value)> {
    let lease = store
        .lease("retry-test", 100, Duration::from_secs(30))
        .unwrap();
    let ids: Vec<i64> = lease.rows.iter().map(|r| r.id).collect();
    store.mark_published("retry-test", &ids).unwrap();
    lease
        .rows
        .iter()
        .map(|r| {
            (
                r.message.message_type.clone(),
                serde_json::from_slice(&r.message.payload).unwrap(),
            )
        })
        .collect()
}

fn backoff_is_capped_and_the_last_attempt_dead_letters<C: StoreConnection + CreditDb>(
    url: String,
    schema: String,
) {
    let clock = ManualClock::new("2026-12-01T00:00:00Z".parse().unwrap());
    let config = Config {
        database_url: url,
        schema,
        prefix: "t.".into(),
        // Delays after attempts 1, 2, 3, 4: 1 s, 2 s, then the cap 3 s, 3 s.
        job_policy: RetryPolicy::new(5, Duration::from_secs(1), Duration::from_secs(3)).unwrap(),
        mix: Mix::default(),
    };
    let roles = Roles {
        ledger: true,
        runner: false,
    };
    let store: Store<C> =
        run::build_store(run::store_builder::<C>(&config, roles).clock(Arc::new(clock.clone())))
            .unwrap();
    let ids = run::submit(&store, &config.exchange(), "u", 40, 1).unwrap();
    let job = &ids[0];
    assert_eq!(
        due(&store),
        [(JOB_RUN.to_owned(), json!({"job_id": job, "attempt": 1}))]
    );
    let group = ConsumerGroup::new(LEDGER_GROUP).unwrap();
    let ms = Duration::from_millis(1);
    for (attempt, delay_secs) in [(1, 1), (2, 2), (3, 3), (4, 3)] {
        let body = json!({"job_id": job, "reason": "gpu_node_lost", "transient": true}).to_string();
        let envelope = Envelope::new(
            MessageKey::new(format!("fail-{attempt}")).unwrap(),
            JOB_FAILED,
            body.into_bytes(),
        );
        assert_eq!(
            store.process_batch(&group, &[envelope]).unwrap(),
            [Decision::Processed]
        );
        // Not before the delay: a broken dependency is not hammered.
        clock.advance(Duration::from_secs(delay_secs) - ms);
        assert_eq!(due(&store), [], "attempt {attempt}: the retry came early");
        clock.advance(ms);
        assert_eq!(
            due(&store),
            [(
                JOB_RUN.to_owned(),
                json!({"job_id": job, "attempt": attempt + 1})
            )],
            "attempt {attempt}"
        );
    }
    // The fifth failure is the last attempt: dead, job.dead at once, no retry.
    let body = json!({"job_id": job, "reason": "gpu_node_lost", "transient": true}).to_string();
    let envelope = Envelope::new(
        MessageKey::new("fail-5").unwrap(),
        JOB_FAILED,
        body.into_bytes(),
    );
    assert_eq!(
        store.process_batch(&group, &[envelope]).unwrap(),
        [Decision::Processed]
    );
    assert_eq!(
        due(&store),
        [(
            JOB_DEAD.to_owned(),
            json!({"job_id": job, "user_id": "u", "cost": 40, "attempts": 5, "last_error": "gpu_node_lost"})
        )]
    );
    clock.advance(Duration::from_secs(3600));
    assert_eq!(due(&store), []);
    let (jobs, ledger) = store.connection().unwrap().snapshot().unwrap();
    assert_eq!((jobs[0].state.as_str(), jobs[0].attempts), ("dead", 5));
    let entries: Vec<(&str, i64)> = ledger
        .iter()
        .map(|l| (l.entry_type.as_str(), l.amount))
        .collect();
    assert_eq!(
        entries,
        [("charge", -40), ("refund", 40)],
        "one refund for five failures"
    );
}

#[test]
fn postgres_backoff_is_capped_and_the_last_attempt_is_dead() {
    let Some(url) = inbox_test_support::postgres_url() else {
        return;
    };
    let schema = inbox_test_support::unique_name("credit_retry");
    /// Drops the schema, also when the test fails.
    struct Schema(String, String);
    impl Drop for Schema {
        fn drop(&mut self) {
            if let Ok(mut conn) = PgConnection::establish(&self.0) {
                let _ =
                    conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.1));
            }
        }
    }
    let _schema = Schema(url.clone(), schema.clone());
    backoff_is_capped_and_the_last_attempt_dead_letters::<PgConnection>(url, schema);
}

#[test]
fn sqlite_backoff_is_capped_and_the_last_attempt_is_dead() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("credit.db").to_string_lossy().into_owned();
    backoff_is_capped_and_the_last_attempt_dead_letters::<SqliteConnection>(path, String::new());
}
