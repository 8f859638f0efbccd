//! The credit ledger end to end, as processes, on PostgreSQL + RabbitMQ: two
//! `credit_ledger consume --runner` processes, one killed with SIGKILL mid-run, jobs
//! submitted with `credit_ledger submit`, and `credit_ledger check --json` at the end;
//! and signals published by a plain AMQP client as the documented contract says.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use inbox_core::ConsumerGroup;
use inbox_examples::credit::contract::LEDGER_GROUP;
use inbox_examples::credit::run::{self, Config, Roles};
use inbox_examples::credit::{CreditDb, Mix};
use serde_json::Value;

/// The servers as the test support finds them (a variable, else the default local
/// address); a missing one fails the test unless `INBOX_SKIP_SERVICES=1`.
fn services() -> Option<(String, String)> {
    let db = inbox_test_support::postgres_url()?;
    Some((db, inbox_test_support::amqp::amqp_url()?))
}

/// `cargo test` builds the package's examples next to its test binaries.
fn binary() -> PathBuf {
    inbox_test_support::example_path("credit_ledger")
}

/// Kills the child if the test fails first (a stray consumer keeps consuming).
struct Proc(Option<Child>);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Proc {
    fn pid(&self) -> String {
        self.0.as_ref().unwrap().id().to_string()
    }
}

/// One test's schema, names and logs; removes them when dropped.
struct Scene {
    db: String,
    amqp: String,
    schema: String,
    prefix: String,
    logs: tempfile::TempDir,
    runtime: tokio::runtime::Runtime,
}

impl Scene {
    fn new(db: String, amqp: String) -> Self {
        let schema = inbox_test_support::unique_name("credit_e2e");
        let prefix = format!("{schema}.");
        Self {
            db,
            amqp,
            schema,
            prefix,
            logs: tempfile::tempdir().unwrap(),
            runtime: tokio::runtime::Runtime::new().unwrap(),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(binary());
        cmd.env("DATABASE_URL", &self.db)
            .env("AMQP_URL", &self.amqp)
            .env("CREDIT_SCHEMA", &self.schema)
            .env("INBOX_PREFIX", &self.prefix)
            .env("CREDIT_RETRY_INITIAL_MS", "100")
            .env("CREDIT_RETRY_MAX_MS", "1000");
        cmd
    }

    fn consumer(&self, name: &str, runner: bool) -> Proc {
        let file = File::create(self.logs.path().join(name)).unwrap();
        let mut cmd = self.command();
        cmd.arg("consume");
        if runner {
            cmd.arg("--runner");
        }
        Proc(Some(
            cmd.stdout(file.try_clone().unwrap())
                .stderr(file)
                .spawn()
                .unwrap(),
        ))
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.path().join(name)).unwrap_or_default()
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).output().unwrap()
    }

    fn submit(&self, user: &str, cost: i64, count: u32) -> Vec<String> {
        let out = self.run(&[
            "submit",
            "--user",
            user,
            "--cost",
            &cost.to_string(),
            "--count",
            &count.to_string(),
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ids: Vec<String> = stdout.lines().map(str::to_owned).collect();
        assert_eq!(ids.len(), count as usize, "{stdout}");
        ids
    }

    /// `check --json`: (exit code, report).
    fn check(&self) -> (Option<i32>, Value) {
        let out = self.run(&["check", "--json"]);
        let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "check --json printed no JSON ({e}): {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (out.status.code(), report)
    }

    fn config(&self) -> Config {
        Config {
            database_url: self.db.clone(),
            schema: self.schema.clone(),
            prefix: self.prefix.clone(),
            job_policy: run::default_job_policy(),
            mix: Mix::default(),
        }
    }

    /// A queue's (ready messages, consumers), or `None` while it does not exist.
    fn queue(&self, name: &str) -> Option<(u32, u32)> {
        self.runtime.block_on(async {
            let conn =
                lapin::Connection::connect(&self.amqp, lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let channel = conn.create_channel().await.unwrap();
            let found = channel
                .queue_declare(
                    name.into(),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .ok()
                .map(|q| (q.message_count(), q.consumer_count()));
            let _ = conn.close(200, "counted".into()).await;
            found
        })
    }

    fn group_queue(&self, group: &str) -> String {
        format!("{}{group}", self.prefix)
    }

    /// Publishes as any AMQP client would: routing key = `type`, a message id, JSON.
    fn publish(&self, message_id: &str, message_type: &str, body: &str) {
        let exchange = format!("{}jobs", self.prefix);
        self.runtime.block_on(async {
            let conn =
                lapin::Connection::connect(&self.amqp, lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let channel = conn.create_channel().await.unwrap();
            channel
                .confirm_select(lapin::options::ConfirmSelectOptions::default())
                .await
                .unwrap();
            let confirm = channel
                .basic_publish(
                    exchange.as_str().into(),
                    message_type.into(),
                    lapin::options::BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    body.as_bytes(),
                    lapin::BasicProperties::default()
                        .with_message_id(message_id.into())
                        .with_type(message_type.into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(
                confirm.is_ack() && confirm.take_message().is_none(),
                "{message_type} was not routed"
            );
            let _ = conn.close(200, "published".into()).await;
        });
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.db) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
        let topology = run::topology(&self.prefix, run::ladder()).unwrap();
        let dead = run::dead_jobs_queue(&self.prefix);
        let amqp = self.amqp.clone();
        self.runtime.block_on(async {
            if let Ok(conn) =
                lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default()).await
            {
                if let Ok(channel) = conn.create_channel().await {
                    let _ = channel
                        .queue_delete(
                            dead.as_str().into(),
                            lapin::options::QueueDeleteOptions::default(),
                        )
                        .await;
                }
                let _ = topology.delete(&conn).await;
                let _ = conn.close(200, "test over".into()).await;
            }
        });
    }
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

fn state_count(report: &Value, state: &str) -> u64 {
    report["by_state"][state].as_u64().unwrap_or(0)
}

#[test]
fn two_consumers_one_killed_with_sigkill_mid_run_every_invariant_holds() {
    let Some((db, amqp)) = services() else { return };
    let scene = Scene::new(db, amqp);
    let a = scene.consumer("a.log", true);
    let mut b = scene.consumer("b.log", true);
    // Both consume: 4 workers each on the runner's queue.
    let runner_queue = scene.group_queue("credit.runner");
    let deadline = Instant::now() + Duration::from_secs(60);
    while scene
        .queue(&runner_queue)
        .is_none_or(|(_, consumers)| consumers < 8)
    {
        assert!(
            Instant::now() < deadline,
            "the consumers never started: {} {}",
            scene.log("a.log"),
            scene.log("b.log")
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Three submitters at once, each printing its job ids.
    let submitters: Vec<(Child, u32)> = [("alice", 40, 80), ("bob", 7, 60), ("carol", 1_000, 40)]
        .into_iter()
        .map(|(user, cost, count)| {
            let child = scene
                .command()
                .args([
                    "submit",
                    "--user",
                    user,
                    "--cost",
                    &cost.to_string(),
                    "--count",
                    &count.to_string(),
                ])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            (child, count)
        })
        .collect();

    // Mid-run: ten jobs settled, most not (watched over SQL: a `check` process is
    // slower than the consumers).
    let mut conn = PgConnection::establish(&scene.db).unwrap();
    let settled_sql = format!(
        "SELECT count(*) AS n FROM \"{}\".jobs WHERE state IN ('delivered', 'failed', 'dead')",
        scene.schema
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let settled = loop {
        let n =
            diesel::RunQueryDsl::get_result::<Count>(diesel::sql_query(&settled_sql), &mut conn)
                .unwrap()
                .n;
        if n >= 10 {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "no job settled: {}",
            scene.log("a.log")
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut a = a;
    let killed = Command::new("kill")
        .args(["-KILL", &a.pid()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = a.0.take().unwrap().wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{status:?}");
    eprintln!("killed consumer a with {settled} jobs settled");
    let mut ids = Vec::new();
    for (child, count) in submitters {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let printed: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(printed.len(), count as usize);
        ids.extend(printed);
    }

    // More work for the survivor, then everything settles.
    ids.extend(scene.submit("dave", 13, 20));
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last = Value::Null;
    let mut quiet = 0;
    let ledger_queue = scene.group_queue("credit.ledger");
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let (code, report) = scene.check();
        let idle = [&runner_queue, &ledger_queue]
            .iter()
            .all(|q| scene.queue(q).is_some_and(|(ready, _)| ready == 0));
        if report["pending"].as_u64() == Some(0) && idle && report == last {
            quiet += 1;
        } else {
            quiet = 0;
        }
        assert_eq!(code, Some(0), "{report:#}");
        last = report;
        if quiet >= 6 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the jobs never settled: {last:#}\n{}",
            scene.log("b.log")
        );
    }

    let (code, report) = scene.check();
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["ok"], Value::Bool(true), "{report:#}");
    assert_eq!(report["violations"], serde_json::json!([]));
    assert_eq!(report["jobs"].as_u64(), Some(200));
    assert_eq!(report["pending"].as_u64(), Some(0));
    assert_eq!(report["ledger"]["charge"]["rows"].as_u64(), Some(200));
    assert_eq!(
        report["ledger"]["charge"]["sum"].as_i64(),
        Some(-(80 * 40 + 60 * 7 + 40 * 1_000 + 20 * 13))
    );
    let delivered = state_count(&report, "delivered");
    let failed = state_count(&report, "failed");
    let dead = state_count(&report, "dead");
    assert_eq!(delivered + failed + dead, 200, "{report:#}");
    assert!(
        delivered > 0 && report["ledger"]["reclaim"]["rows"].as_u64() > Some(0),
        "{report:#}"
    );
    let balance: i64 = report["balance"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_i64().unwrap())
        .sum();
    assert_eq!(balance, report["ledger_total"].as_i64().unwrap());
    // Every dead job's `job.dead` waits in the dead-jobs queue (a job delivered
    // after it was dead, a late success, keeps its message; a relay killed between
    // publishing and marking publishes again).
    let (dead_messages, _) = scene.queue(&run::dead_jobs_queue(&scene.prefix)).unwrap();
    eprintln!(
        "{delivered} delivered, {failed} failed, {dead} dead; {dead_messages} job.dead messages"
    );
    assert!(
        u64::from(dead_messages) >= dead,
        "{dead_messages} job.dead messages: {report:#}"
    );
    // The store agrees, read over its own API: every job's rows.
    let store = run::open_store::<PgConnection>(
        &scene.config(),
        Roles {
            ledger: false,
            runner: false,
        },
        None,
    )
    .unwrap();
    let (jobs, _) = store.connection().unwrap().snapshot().unwrap();
    assert_eq!(jobs.len(), ids.len());
    assert!(jobs.iter().all(|j| ids.contains(&j.job_id)));
    drop(store);

    let term = Command::new("kill")
        .args(["-TERM", &b.pid()])
        .status()
        .unwrap();
    assert!(term.success());
    let out = b.0.take().unwrap().wait().unwrap();
    assert!(out.success(), "{out:?} {}", scene.log("b.log"));
    assert!(
        scene.log("b.log").contains("stopped after"),
        "{}",
        scene.log("b.log")
    );
}

#[test]
fn signals_from_any_client_follow_the_contract() {
    let Some((db, amqp)) = services() else { return };
    let scene = Scene::new(db, amqp);
    // No runner: `job.run` messages wait in the runner's queue.
    let mut consumer = scene.consumer("ledger.log", false);
    let ledger_queue = scene.group_queue("credit.ledger");
    let deadline = Instant::now() + Duration::from_secs(60);
    while scene
        .queue(&ledger_queue)
        .is_none_or(|(_, consumers)| consumers < 4)
    {
        assert!(
            Instant::now() < deadline,
            "the consumer never started: {}",
            scene.log("ledger.log")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let ids = scene.submit("erin", 40, 3);
    let (recovered, first_success, refused) = (&ids[0], &ids[1], &ids[2]);
    let store = run::open_store::<PgConnection>(
        &scene.config(),
        Roles {
            ledger: false,
            runner: false,
        },
        None,
    )
    .unwrap();
    let job = |id: &str| {
        let (jobs, ledger) = store.connection().unwrap().snapshot().unwrap();
        let job = jobs.into_iter().find(|j| j.job_id == id).unwrap();
        let entries: Vec<(String, i64)> = ledger
            .into_iter()
            .filter(|l| l.job_id == id)
            .map(|l| (l.entry_type, l.amount))
            .collect();
        (job, entries)
    };
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: never happened\n{}",
                scene.log("ledger.log")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };

    // A timeout (delivered twice), then the job turns out to have succeeded.
    let timeout = format!(r#"{{"job_id": "{recovered}", "reason": "timeout", "transient": true}}"#);
    scene.publish("t-1", "job.failed", &timeout);
    scene.publish("t-1", "job.failed", &timeout);
    wait("the refund and the retry", &|| {
        job(recovered).0.attempts == 2
    });
    let (j, entries) = job(recovered);
    assert_eq!((j.state.as_str(), j.refunded), ("queued", true));
    assert_eq!(entries, [("charge".into(), -40), ("refund".into(), 40)]);
    scene.publish(
        "s-1",
        "job.succeeded",
        &format!(r#"{{"job_id": "{recovered}"}}"#),
    );
    wait("the reclaim", &|| job(recovered).0.reclaimed);
    let (j, entries) = job(recovered);
    assert_eq!(j.state, "delivered");
    assert_eq!(
        entries,
        [
            ("charge".into(), -40),
            ("refund".into(), 40),
            ("reclaim".into(), -40)
        ]
    );

    // Success first; the late timeout refunds nothing.
    scene.publish(
        "s-2",
        "job.succeeded",
        &format!(r#"{{"job_id": "{first_success}"}}"#),
    );
    wait("the delivery", &|| {
        job(first_success).0.state == "delivered"
    });
    scene.publish(
        "t-2",
        "job.failed",
        &format!(r#"{{"job_id": "{first_success}", "reason": "timeout", "transient": true}}"#),
    );
    // A permanent failure: refunded, failed, no retry.
    scene.publish(
        "p-3",
        "job.failed",
        &format!(r#"{{"job_id": "{refused}", "reason": "invalid_input", "transient": false}}"#),
    );
    wait("the permanent failure", &|| {
        job(refused).0.state == "failed"
    });
    // A signal for a job that does not exist, and one the contract refuses.
    scene.publish(
        "x-4",
        "job.failed",
        r#"{"job_id": "no-such-job", "reason": "timeout", "transient": true}"#,
    );
    scene.publish("x-5", "job.succeeded", r#"{"job": "missing field"}"#);
    let group = ConsumerGroup::new(LEDGER_GROUP).unwrap();
    wait("two dead letters", &|| {
        store.dead_letters(&group).unwrap().len() == 2
    });
    let mut letters: Vec<(String, String)> = store
        .dead_letters(&group)
        .unwrap()
        .into_iter()
        .map(|d| (d.key, d.reason.as_str().to_owned()))
        .collect();
    letters.sort();
    assert_eq!(
        letters,
        [
            ("x-4".into(), "permanent".into()),
            ("x-5".into(), "decode_error".into())
        ]
    );
    // Loud: the unknown job's dead letter is an error line naming the job.
    let log = scene.log("ledger.log");
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("key=x-4") && l.contains("no-such-job")),
        "{log}"
    );
    let (j, entries) = job(first_success);
    assert_eq!((j.state.as_str(), j.refunded), ("delivered", false));
    assert_eq!(entries, [("charge".into(), -40)]);
    let (j, entries) = job(refused);
    assert_eq!(
        (j.attempts, j.last_error.as_deref()),
        (1, Some("invalid_input"))
    );
    assert_eq!(entries, [("charge".into(), -40), ("refund".into(), 40)]);

    // Attempt 1 of each job and attempt 2 of the recovered one wait for a runner.
    let runner_queue = scene.group_queue("credit.runner");
    wait("four job.run messages", &|| {
        scene
            .queue(&runner_queue)
            .is_some_and(|(ready, _)| ready == 4)
    });
    let (code, report) = scene.check();
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["ledger_total"].as_i64(), Some(-80), "{report:#}");
    assert_eq!(report["balance"]["erin"].as_i64(), Some(-80));
    drop(store);

    let term = Command::new("kill")
        .args(["-TERM", &consumer.pid()])
        .status()
        .unwrap();
    assert!(term.success());
    let out = consumer.0.take().unwrap().wait().unwrap();
    assert!(out.success(), "{}", scene.log("ledger.log"));
}

#[test]
fn bad_usage_exits_2_and_a_violation_exits_1() {
    let Some((db, amqp)) = services() else { return };
    let scene = Scene::new(db, amqp);
    for args in [
        &["submit", "--user", "u", "--cost", "0"][..],
        &["submit", "--user", "u", "--cost", "-5"],
        &["submit", "--user", "", "--cost", "5"],
        &["submit", "--user", "u", "--cost", "5", "--count", "0"],
        &["simulate", "0"],
        &["frobnicate"],
    ] {
        let out = scene.run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    let out = scene
        .command()
        .env("CREDIT_SCHEMA", "no\"such")
        .args(["check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("credit_ledger:"));

    let ids = scene.submit("frank", 5, 1);
    let (code, report) = scene.check();
    assert_eq!(
        (code, report["pending"].as_u64()),
        (Some(0), Some(1)),
        "{report:#}"
    );
    // A refund behind the guards' back (the flag left unset): check names it, exit 1.
    let mut conn = PgConnection::establish(&scene.db).unwrap();
    conn.batch_execute(&format!(
        "INSERT INTO \"{}\".credit_ledger (job_id, entry_type, amount, created_at) VALUES ('{}', 'refund', 5, now())",
        scene.schema, ids[0]
    ))
    .unwrap();
    let (code, report) = scene.check();
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(report["ok"], Value::Bool(false));
    let invariants: Vec<&str> = report["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["invariant"].as_str().unwrap())
        .collect();
    assert_eq!(invariants, ["refund_flag"], "{report:#}");
    // The database refuses a second refund, and any change to the ledger.
    let second = conn.batch_execute(&format!(
        "INSERT INTO \"{}\".credit_ledger (job_id, entry_type, amount, created_at) VALUES ('{}', 'refund', 5, now())",
        scene.schema, ids[0]
    ));
    assert!(second.is_err());
    let update = conn.batch_execute(&format!(
        "UPDATE \"{}\".credit_ledger SET amount = -1",
        scene.schema
    ));
    assert!(update.unwrap_err().to_string().contains("append-only"));
}
