//! `amqps://` end to end: the consumer and the relay reach the shared broker through
//! a TLS listener of the test's own ([`TlsProxy`]: the committed test certificate for
//! `localhost`, forwarding plain AMQP to the broker), trusting the test CA through
//! `ca_cert`. Without that CA, or with another one, connecting fails at once with
//! [`Error::Tls`] and rustls's reason; no error prints the URL's password.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Error, Relay, RelaySettings};
use inbox_core::{MessageKey, OutboxMessage, OutboxStore, RetryPolicy};
use inbox_diesel::{enqueue, Store};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, MESSAGE_TYPE};
use inbox_test_support::amqp::{self, amqp_url, eventually, host_port};
use inbox_test_support::tls::{fixture, TlsProxy};
use inbox_test_support::{everything_printed, ms, Fixture, PgFixture};

/// The byte a TLS connection opens with: a handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

struct World {
    _db: PgFixture,
    url: String,
    store: Arc<Store<PgConnection>>,
    topology: inbox_amqp::Topology,
    proxy: TlsProxy,
}

impl World {
    async fn new() -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let topology = amqp::test_topology(&amqp::unique_prefix("tls"), &[50, 100, 200]);
        let store = db
            .builder()
            .pool_size(4)
            .retry_ladder(topology.retry_ladder().clone())
            .handler(DailyUsage::new(RetryPolicy::default()))
            .build()
            .unwrap();
        store.connection().unwrap().create_daily_usage().unwrap();
        let topology = topology.with_routes(inbox_core::InboxStore::routes(&store));
        let proxy = TlsProxy::start(host_port(&url)).await;
        Some(Self {
            _db: db,
            url,
            store: Arc::new(store),
            topology,
            proxy,
        })
    }

    /// The broker's URL as `amqps://localhost:<proxy>`, with `password` if given.
    fn tls_url(&self, password: Option<&str>) -> String {
        let url = self.proxy.url_for(&self.url);
        match password {
            Some(password) => url.replacen(":guest@", &format!(":{password}@"), 1),
            None => url,
        }
    }

    fn consumer(&self, url: String, settings: ConsumerSettings) -> Consumer<Store<PgConnection>> {
        Consumer::new(url, Arc::clone(&self.store), self.topology.clone()).with_settings(
            settings
                .workers(2)
                .batch(50, ms(5))
                .connect_timeout(Duration::from_secs(5)),
        )
    }

    fn relay(&self, url: String, settings: RelaySettings) -> Relay<Store<PgConnection>> {
        Relay::new(url, Arc::clone(&self.store)).with_settings(
            settings
                .poll_interval(ms(50))
                .connect_timeout(Duration::from_secs(5)),
        )
    }

    /// Enqueues `n` usage events, one business transaction each; their totals.
    fn enqueue(&self, n: u64) -> BTreeMap<(i64, NaiveDate), i64> {
        let mut totals = BTreeMap::new();
        let mut conn = self.store.connection().unwrap();
        for i in 0..n {
            let e = UsageRecorded {
                user_id: 1 + (i % 7) as i64,
                day: NaiveDate::from_ymd_opt(2026, 12, 1).unwrap() + chrono::Days::new(i % 2),
                amount: 1 + (i % 13) as i64,
            };
            *totals.entry((e.user_id, e.day)).or_default() += e.amount;
            let msg = OutboxMessage::new(
                MessageKey::derive("billing", &format!("tls-{i}"), MESSAGE_TYPE),
                self.topology.exchange(),
                MESSAGE_TYPE,
                serde_json::to_vec(&e).unwrap(),
            );
            enqueue(&mut conn, &msg, self.store.now()).unwrap();
        }
        totals
    }

    async fn cleanup(&self) {
        let conn = amqp::connect(&self.url).await;
        self.topology.delete(&conn).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_and_relay_over_amqps_apply_every_event_once() {
    let Some(world) = World::new().await else {
        return;
    };
    let ca = fixture("ca.pem");
    let url = world.tls_url(None);
    // The exchange and queues, declared over TLS too (the relay's rows need them).
    let conn = inbox_amqp::connect(&url, Some(&ca)).await.unwrap();
    world.topology.declare(&conn).await.unwrap();
    let _ = conn.close(200, "declared".into()).await;

    let expected = world.enqueue(300);
    let shutdown = CancellationToken::new();
    let consumer = world.consumer(url.clone(), ConsumerSettings::default().ca_cert(&ca));
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = world.relay(url, RelaySettings::default().ca_cert(&ca));
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));

    // Done, or one of them stopped (its error is then shown below).
    let done = eventually(Duration::from_secs(60), || {
        consuming.is_finished()
            || relaying.is_finished()
            || (consumed.snapshot().processed >= 300 && relayed.snapshot().published >= 300)
    })
    .await;
    shutdown.cancel();
    let (consumer_ran, relay_ran) = (consuming.await.unwrap(), relaying.await.unwrap());
    world.cleanup().await;
    consumer_ran.unwrap();
    relay_ran.unwrap();
    assert!(done, "{:?}", world.proxy.seen());

    let (consumed, relayed) = (consumed.snapshot(), relayed.snapshot());
    assert_eq!(relayed.published, 300, "{relayed:?}");
    assert_eq!(
        (
            consumed.processed,
            consumed.duplicates,
            consumed.dead_lettered
        ),
        (300, 0, 0),
        "{consumed:?}"
    );
    let totals = world.store.connection().unwrap().daily_totals().unwrap();
    assert_eq!(totals, expected);

    // Every connection spoke TLS from its first byte: the declaring one, the
    // consumer's two (group queues, dead letters) and the relay's.
    let seen = world.proxy.seen_once(|seen| seen.handshakes >= 4).await;
    assert!(seen.failures.is_empty(), "{seen:?}");
    assert!(seen.handshakes >= 4, "{seen:?}");
    assert!(
        seen.first_bytes.len() as u64 >= seen.handshakes
            && seen.first_bytes.iter().all(|&b| b == TLS_HANDSHAKE),
        "{seen:?}"
    );
}

/// The error of a connection refused by rustls: a TLS error whose causes name the
/// reason, the password nowhere.
fn assert_tls_refused(who: &str, err: &Error, password: &str) {
    assert!(matches!(err, Error::Tls { .. }), "{who}: {err:?}");
    let printed = everything_printed(err);
    assert!(
        printed.iter().any(|t| t.contains("UnknownIssuer")),
        "{who}: the certificate's issuer is not trusted: {printed:?}"
    );
    for text in &printed {
        assert!(
            !text.contains(password),
            "{who}: {password:?} printed in {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_ca_or_with_another_the_connection_is_refused_at_once() {
    let Some(world) = World::new().await else {
        return;
    };
    let password = "tls-Wr0ng-s3cret";
    let url = world.tls_url(Some(password));
    let other_ca = fixture("other-ca.pem");
    let cases = [
        (
            "no CA",
            ConsumerSettings::default(),
            RelaySettings::default(),
        ),
        (
            "an unrelated CA",
            ConsumerSettings::default().ca_cert(&other_ca),
            RelaySettings::default().ca_cert(&other_ca),
        ),
    ];
    for (case, consumer, relay) in cases {
        let consumed = world
            .consumer(url.clone(), consumer)
            .run(CancellationToken::new())
            .await;
        let err = consumed.expect_err("the consumer ran");
        assert_tls_refused(&format!("consumer, {case}"), &err, password);
        let relayed = world
            .relay(url.clone(), relay)
            .run(CancellationToken::new())
            .await;
        let err = relayed.expect_err("the relay ran");
        assert_tls_refused(&format!("relay, {case}"), &err, password);
    }
    let ca = Some(other_ca.as_path());
    let err = inbox_amqp::connect(&url, ca).await.expect_err("connected");
    assert_tls_refused("connect", &err, password);

    // Nothing got past TLS: every connection was a TLS handshake that failed.
    let seen = world.proxy.seen_once(|seen| seen.failures.len() >= 5).await;
    assert_eq!(seen.handshakes, 0, "{seen:?}");
    assert!(seen.failures.len() >= 5, "{seen:?}");
    assert!(
        seen.first_bytes.iter().all(|&b| b == TLS_HANDSHAKE),
        "{seen:?}"
    );
}

/// With the right CA, the broker itself refuses a wrong password: over TLS as over
/// plain AMQP, the error hides it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_over_amqps_is_not_printed() {
    let Some(world) = World::new().await else {
        return;
    };
    let ca = fixture("ca.pem");
    for password in ["tls-Wr0ng-s3cret", "tls-p%40ss%3Fw"] {
        let url = world.tls_url(Some(password));
        let consumed = world
            .consumer(url.clone(), ConsumerSettings::default().ca_cert(&ca))
            .run(CancellationToken::new())
            .await;
        let relayed = world
            .relay(url, RelaySettings::default().ca_cert(&ca))
            .run(CancellationToken::new())
            .await;
        for (who, ran) in [("consumer", consumed), ("relay", relayed)] {
            let err = ran.expect_err("ran with a wrong password");
            assert!(matches!(err, Error::Connect { .. }), "{who}: {err:?}");
            for text in everything_printed(&err) {
                assert!(!text.contains(password), "{who}: {password:?} in {text}");
                assert!(
                    !text.contains("tls-p@ss?w"),
                    "{who}: decoded password in {text}"
                );
            }
        }
    }
    let seen = world.proxy.seen_once(|seen| seen.handshakes >= 4).await;
    assert!(seen.handshakes >= 4, "TLS itself succeeded: {seen:?}");
}

/// A CA file that holds no certificate stops the run at its start, naming the
/// setting; so does a CA given with a plain `amqp://` URL (it would be ignored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_ca_setting_is_refused_before_connecting() {
    let Some(world) = World::new().await else {
        return;
    };
    let not_a_ca = fixture("server.key");
    let cases = [
        (world.tls_url(None), not_a_ca.clone()),
        (world.tls_url(None), fixture("no-such.pem")),
        (world.url.clone(), fixture("ca.pem")),
    ];
    for (url, ca) in cases {
        let consumed = world
            .consumer(url.clone(), ConsumerSettings::default().ca_cert(&ca))
            .run(CancellationToken::new())
            .await;
        let relayed = world
            .relay(url, RelaySettings::default().ca_cert(&ca))
            .run(CancellationToken::new())
            .await;
        for ran in [consumed, relayed] {
            let err = ran.expect_err("ran with an unusable CA");
            assert!(
                matches!(
                    err,
                    Error::InvalidSetting {
                        setting: "ca_cert",
                        ..
                    }
                ),
                "{}: {err:?}",
                ca.display()
            );
        }
    }
    assert_eq!(world.proxy.seen().first_bytes, Vec::<u8>::new());
}
