//! The whole path, as an operator runs it: a handler fails some messages until a flag
//! flips, they dead-letter, `inbox dead-letters groups` shows one failure group,
//! `replay --group <fingerprint> --yes` reports the count, each message is applied once
//! by its group (never again by the other group taking the same type), and the same
//! replay run again (also twice at once) applies nothing twice. On PostgreSQL +
//! RabbitMQ the relay publishes the replay to the group's own queue; on SQLite the
//! in-process relay hands it to that group's handler.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, Topology};
use inbox_core::{
    relay_in_process, InProcessTransport, MessageKey, OutboxMessage, RetryLadder, RetryPolicy,
};
use inbox_diesel::operator::Operator;
use inbox_diesel::operator::{DeadLetterFilter, OperatorConnection};
use inbox_diesel::{enqueue, Store, StoreConnection};
use inbox_test_support::amqp::{self, amqp_url, eventually};
use inbox_test_support::tls::{self, TlsProxy};
use inbox_test_support::{
    unique_name, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture, TestConn,
};
use serde_json::Value;

const FAILING: &str = "billing.daily-usage";
const BYSTANDER: &str = "billing.audit";
const BAD: [&str; 3] = ["bad-1", "bad-22", "bad-333"];

type Calls = Arc<Mutex<Vec<String>>>;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn inbox(url: &str, extra: &[&str], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env_remove("INBOX_SCHEMA")
        .env_remove("INBOX_PREFIX")
        .env("DATABASE_URL", url)
        .args(extra)
        .args(args)
        .output()
        .unwrap()
}

fn json(o: &Output) -> Value {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn calls_of(calls: &Calls, key: &str) -> usize {
    calls.lock().unwrap().iter().filter(|k| *k == key).count()
}

/// The failing group (fails `bad-*` until healed) and a bystander taking the same type.
fn store<F: Fixture>(
    fx: &F,
    healed: &Arc<AtomicBool>,
    ladder: Option<RetryLadder>,
) -> (Store<F::Conn>, Calls, Calls) {
    let flag = Arc::clone(healed);
    let failing = Recorder::new(FAILING)
        .policy(RetryPolicy::new(2, ms(50), ms(50)).unwrap())
        .behaviour(move |key, _| {
            if key.starts_with("bad-") && !flag.load(Ordering::SeqCst) {
                Outcome::FailWith(format!("ledger row {} is locked", key.len() * 13))
            } else {
                Outcome::Apply
            }
        });
    let bystander = Recorder::new(BYSTANDER);
    let (failing_calls, bystander_calls) = (failing.calls(), bystander.calls());
    let mut builder = fx
        .builder()
        .pool_size(4)
        .handler(failing)
        .handler(bystander);
    if let Some(ladder) = ladder {
        builder = builder.retry_ladder(ladder);
    }
    let store = builder.build().unwrap();
    store.connection().unwrap().create_effects().unwrap();
    (store, failing_calls, bystander_calls)
}

fn enqueue_all<C: StoreConnection>(store: &Store<C>, exchange: &str) {
    let mut conn = store.connection().unwrap();
    for key in BAD.iter().chain(["good-1"].iter()) {
        let msg = OutboxMessage::new(
            MessageKey::new(*key).unwrap(),
            exchange,
            "usage.recorded",
            usage(key, 5).payload,
        );
        enqueue(&mut conn, &msg, store.clock().now()).unwrap();
    }
}

fn pending_letters<C: OperatorConnection>(store: &Store<C>) -> usize {
    Operator::new(store)
        .list_dead_letters(
            &DeadLetterFilter::default().status(inbox_diesel::operator::LetterStatus::Pending),
            0,
            100,
        )
        .unwrap()
        .len()
}

/// `dead-letters groups`: one failure group of three; returns its fingerprint.
fn one_failure_group(url: &str, extra: &[&str]) -> String {
    let groups = json(&inbox(url, extra, &["--json", "dead-letters", "groups"]));
    let groups = groups["failure_groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0]["count"], 3);
    assert_eq!(groups[0]["consumer_groups"][0], FAILING);
    groups[0]["fingerprint"].as_str().unwrap().to_owned()
}

fn replay(url: &str, extra: &[&str], fingerprint: &str, status: &str) -> Value {
    json(&inbox(
        url,
        extra,
        &[
            "--json",
            "dead-letters",
            "replay",
            "--group",
            fingerprint,
            "--status",
            status,
            "--yes",
        ],
    ))
}

fn applied_once<C: StoreConnection + TestConn>(
    store: &Store<C>,
    failing: &Calls,
    bystander: &Calls,
) {
    let mut conn = store.connection().unwrap();
    for key in BAD {
        // The bystander applied it at first; the healed group once, after the replay.
        assert_eq!(conn.effects_of(key).unwrap(), 2, "{key}");
        assert_eq!(
            calls_of(bystander, key),
            1,
            "{key} reached the bystander again"
        );
        assert_eq!(calls_of(failing, key), 3, "{key}: two failures, one replay");
    }
    assert_eq!(conn.effects_of("good-1").unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_and_rabbitmq_replay_a_failure_group_once() {
    let Some(amqp_url) = amqp_url() else { return };
    let Some(fx) = PgFixture::new() else { return };
    let prefix = format!("{}.", unique_name("op"));
    let ladder = RetryLadder::new([ms(50)]).unwrap();
    let healed = Arc::new(AtomicBool::new(false));
    let (store, failing, bystander) = store(&fx, &healed, Some(ladder.clone()));
    let store = Arc::new(store);
    let topology = Topology::new("billing")
        .unwrap()
        .prefix(prefix.clone())
        .unwrap()
        .ladder(ladder)
        .queue_expires(Duration::from_secs(120))
        .with_routes(inbox_core::InboxStore::routes(&*store));
    let conn = amqp::connect(&amqp_url).await;
    topology.declare(&conn).await.unwrap();
    enqueue_all(&store, &topology.exchange());

    let shutdown = CancellationToken::new();
    let consumer = Consumer::new(amqp_url.clone(), Arc::clone(&store), topology.clone())
        .with_settings(ConsumerSettings::default().workers(1));
    let consumer_stats = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let mut settings = RelaySettings::default();
    settings.poll_interval = ms(50);
    let relay = Relay::new(amqp_url.clone(), Arc::clone(&store)).with_settings(settings);
    let relaying = tokio::spawn(relay.run(shutdown.clone()));

    let dead = eventually(Duration::from_secs(30), || pending_letters(&store) == 3).await;
    assert!(dead, "the bad messages never dead-lettered");
    let url = fx.url().to_owned();
    let extra = ["--schema", fx.schema.as_str(), "--prefix", prefix.as_str()];
    let fingerprint = one_failure_group(&url, &extra);

    healed.store(true, Ordering::SeqCst);
    let report = replay(&url, &extra, &fingerprint, "pending");
    assert_eq!(report["replayed"], 3, "{report}");
    let done = eventually(Duration::from_secs(30), || {
        store.connection().unwrap().effects_of("bad-333").unwrap() == 2
            && store.connection().unwrap().effects_of("bad-1").unwrap() == 2
            && store.connection().unwrap().effects_of("bad-22").unwrap() == 2
    })
    .await;
    assert!(done, "the replays were not applied");
    // The same replay again, of the letters just replayed: nothing is enqueued.
    let again = replay(&url, &extra, &fingerprint, "replayed");
    assert_eq!(
        (again["matched"].as_u64(), again["replayed"].as_u64()),
        (Some(3), Some(0))
    );
    let again = replay(&url, &extra, &fingerprint, "pending");
    assert_eq!(again["matched"], 0);
    // Time for a wrong copy to arrive, had one been sent.
    tokio::time::sleep(ms(500)).await;
    applied_once(&store, &failing, &bystander);
    // Through the default exchange to the failing group's queue: had a replay gone to
    // the topic exchange, the bystander would have received (and absorbed) a copy.
    assert_eq!(consumer_stats.snapshot().duplicates, 0);
    let stats = json(&inbox(&url, &extra, &["--json", "stats"]));
    assert_eq!(stats["outbox"]["backlog"], 0, "{stats}");

    // verify, with the broker: the topology is there.
    let verify = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", &amqp_url)
        .args(extra)
        .args([
            "--json",
            "verify",
            "--exchange",
            "billing",
            "--retry-ladder",
            "50ms",
        ])
        .output()
        .unwrap();
    let report = json(&verify);
    assert_eq!(report["topology"], "ok", "{report}");
    // Per group (two): its queue, its `:dlq`, its `:unreadable` and one retry tier.
    assert_eq!(report["queues_checked"].as_array().unwrap().len(), 8);
    let wrong = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", &amqp_url)
        .args(extra)
        .args(["--json", "verify", "--retry-ladder", "75ms"])
        .output()
        .unwrap();
    assert_eq!(wrong.status.code(), Some(3));
    let report: Value = serde_json::from_slice(&wrong.stdout).unwrap();
    assert!(
        report["topology_error"]
            .as_str()
            .unwrap()
            .contains("retry:75ms"),
        "{report}"
    );

    // verify over amqps:// (a TLS listener of the test's own in front of the broker),
    // trusting the test CA through AMQP_CA_CERT; without it, a TLS error.
    let proxy = TlsProxy::start(amqp::host_port(&amqp_url)).await;
    let verify_over_tls = |ca: Option<&std::path::Path>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_inbox"));
        command
            .env("DATABASE_URL", &url)
            .env("AMQP_URL", proxy.url_for(&amqp_url))
            .env_remove("AMQP_CA_CERT")
            .args(extra)
            .args(["--json", "verify", "--retry-ladder", "50ms"]);
        if let Some(ca) = ca {
            command.env("AMQP_CA_CERT", ca);
        }
        command.output().unwrap()
    };
    let report = json(&verify_over_tls(Some(&tls::fixture("ca.pem"))));
    assert_eq!(report["topology"], "ok", "{report}");
    assert_eq!(report["queues_checked"].as_array().unwrap().len(), 8);
    let untrusted = verify_over_tls(None);
    // A broker the command cannot reach (here: not trusted) failed: exit 1, not 3.
    assert_eq!(untrusted.status.code(), Some(1));
    let report: Value = serde_json::from_slice(&untrusted.stdout).unwrap();
    let error = report["topology_error"].as_str().unwrap();
    assert!(
        error.contains("TLS") && error.contains("UnknownIssuer"),
        "{report}"
    );
    let seen = proxy
        .seen_once(|seen| seen.handshakes + seen.failures.len() as u64 >= 2)
        .await;
    assert_eq!((seen.handshakes, seen.failures.len()), (1, 1), "{seen:?}");

    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();
    topology.delete(&conn).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

#[test]
fn sqlite_and_the_in_process_transport_replay_a_failure_group_once() {
    let fx = SqliteFixture::new();
    let healed = Arc::new(AtomicBool::new(false));
    let (store, failing, bystander) = store(&fx, &healed, None);
    enqueue_all(&store, "billing");
    let mut transport = InProcessTransport::new(store.clone());
    let run = |transport: &mut InProcessTransport<Store<_>>| {
        let n = relay_in_process(&store, transport, "relay-1", 100).unwrap();
        transport.run_until_idle().unwrap();
        n
    };
    assert_eq!(run(&mut transport), 4);
    assert_eq!(pending_letters(&store), 3);
    let url = format!("sqlite://{}", fx.path);
    let fingerprint = one_failure_group(&url, &[]);

    healed.store(true, Ordering::SeqCst);
    // Two operators replay the same group at once: each letter is enqueued once.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| replay(&url, &[], &fingerprint, "pending"));
        let b = s.spawn(|| replay(&url, &[], &fingerprint, "pending"));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(
        a["replayed"].as_u64().unwrap() + b["replayed"].as_u64().unwrap(),
        3,
        "{a} {b}"
    );
    assert_eq!(run(&mut transport), 3);
    applied_once(&store, &failing, &bystander);
    // Again: nothing.
    let again = replay(&url, &[], &fingerprint, "replayed");
    assert_eq!(
        (again["matched"].as_u64(), again["replayed"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(run(&mut transport), 0);
    applied_once(&store, &failing, &bystander);
}
