//! Several broker addresses in one setting: the consumer (its workers' and its
//! dead-letter readers' connections), the topology's declaration and the relay take
//! a list of AMQP URLs and connect to the first node that answers; after a loss
//! they move on to the next; a list of dead nodes fails at startup as one dead URL
//! does; a list with an empty item or a bad URL is refused, naming the item.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::SqliteConnection;
use inbox_amqp::{CancellationToken, Consumer, Error, Relay, Topology};
use inbox_core::{HandlerError, MessageContext};
use inbox_diesel::Store;
use inbox_test_support::amqp::{amqp_url, host_port, Proxy};
use inbox_test_support::{unique_name, SqliteFixture};

#[derive(serde::Deserialize)]
struct Ping {}

#[derive(inbox_core::Handler)]
#[inbox(group = "brokers.pings", message = Ping, message_type = "ping", connection = SqliteConnection)]
struct Pings;

impl Pings {
    fn handle(
        &self,
        _: &mut SqliteConnection,
        _: Ping,
        _: &MessageContext<'_>,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

struct Scene {
    // Dropped first: the retry tiers carry no expiry, so the test deletes them.
    _delete: inbox_test_support::amqp::DeleteOnDrop,
    db: SqliteFixture,
    store: Arc<Store<SqliteConnection>>,
    topology: Topology,
    amqp: String,
}

impl Scene {
    fn new() -> Option<Self> {
        let amqp = amqp_url()?;
        let db = SqliteFixture::new();
        let store = Store::<SqliteConnection>::builder(format!("sqlite://{}", db.path))
            .handler(Pings)
            .build()
            .unwrap();
        let prefix = format!("{}.", unique_name("brokers"));
        let topology = Topology::new("brokers")
            .unwrap()
            .prefix(prefix)
            .unwrap()
            .queue_expires(Duration::from_secs(60));
        let routes = inbox_core::InboxStore::routes(&store);
        let delete = inbox_test_support::amqp::DeleteOnDrop::new(
            amqp.clone(),
            topology.clone().with_routes(routes),
        );
        Some(Self {
            _delete: delete,
            db,
            store: Arc::new(store),
            topology,
            amqp,
        })
    }

    /// Enqueues `n` pings numbered from `from` in the outbox.
    fn enqueue(&self, from: usize, n: usize) {
        let mut conn = self.store.connection().unwrap();
        for i in from..from + n {
            let key = inbox_core::MessageKey::derive("brokers", &format!("ping:{i}"), "ping");
            let msg = self.topology.message(key, "ping", b"{}".to_vec());
            inbox_diesel::enqueue(&mut conn, &msg, self.store.clock().now()).unwrap();
        }
    }

    /// How many outbox rows are published.
    fn published(&self) -> i64 {
        use diesel::{Connection, RunQueryDsl};
        #[derive(diesel::QueryableByName)]
        struct Count {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut conn = SqliteConnection::establish(&self.db.path).unwrap();
        let counted: Vec<Count> = diesel::sql_query(
            "SELECT COUNT(*) AS n FROM outbox_messages WHERE published_at IS NOT NULL",
        )
        .load(&mut conn)
        .unwrap();
        counted[0].n
    }
}

/// A URL whose port nothing listens on (with a password no message may print).
fn refused_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("amqp://guest:dead-s3cret@127.0.0.1:{port}/%2f")
}

/// Runs `serve` of a consumer and a relay both given `urls` until `done` holds of
/// the scene and the consumer's processed count (or 60 s pass), between `step`s.
async fn serve_until(scene: &Scene, urls: &str, mut step: impl FnMut(u64) -> Option<u64>) -> u64 {
    let consumer = Consumer::new(urls, scene.store.clone(), scene.topology.clone());
    let stats = consumer.stats();
    let relay = Relay::new(urls, scene.store.clone());
    let shutdown = CancellationToken::new();
    let serving = tokio::spawn(inbox_amqp::serve(consumer, relay, shutdown.clone()));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut target = step(0);
    let processed = loop {
        let processed = stats.snapshot().processed;
        assert!(
            !serving.is_finished(),
            "serve ended early: {:?}",
            serving.await
        );
        match target {
            Some(t) if processed >= t => target = step(processed),
            None => break processed,
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            break processed;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    shutdown.cancel();
    serving.await.unwrap().unwrap();
    processed
}

#[test]
fn a_list_whose_first_node_refuses_is_served_by_the_next() {
    let Some(scene) = Scene::new() else { return };
    scene.enqueue(0, 5);
    let urls = format!("{},{}", refused_url(), scene.amqp);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let processed = runtime.block_on(async {
        // `connect` (what `inbox verify` uses) goes through the list too.
        let conn = inbox_amqp::connect(&urls, None).await.unwrap();
        conn.close(200, "checked".into()).await.unwrap();
        serve_until(&scene, &urls, |n| (n < 5).then_some(5)).await
    });
    assert_eq!(processed, 5, "every ping consumed through the second node");
    assert_eq!(
        scene.published(),
        5,
        "every row published through the second node"
    );
}

#[test]
fn after_a_loss_the_next_node_is_tried() {
    let Some(scene) = Scene::new() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let processed = runtime.block_on(async {
        // The first "node" is the broker through a proxy, the second the broker
        // itself: once connected through the proxy, the proxy refuses and cuts.
        let proxy = Proxy::start(host_port(&scene.amqp)).await;
        let urls = format!("{} {}", proxy.url_for(&scene.amqp), scene.amqp);
        scene.enqueue(0, 5);
        serve_until(&scene, &urls, |n| match n {
            0 => Some(5),
            5 => {
                proxy.block(true);
                proxy.cut();
                scene.enqueue(5, 5);
                Some(10)
            }
            _ => None,
        })
        .await
    });
    assert_eq!(
        processed, 10,
        "the pings after the cut consumed through the next node"
    );
    assert_eq!(scene.published(), 10);
}

#[test]
fn a_list_of_dead_nodes_fails_at_startup_naming_the_last() {
    let Some(scene) = Scene::new() else { return };
    let (first, last) = (refused_url(), refused_url());
    let urls = format!("{first}\n{last}");
    let port = |url: &str| {
        url.rsplit(':')
            .next()
            .unwrap()
            .trim_end_matches("/%2f")
            .to_owned()
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (consumed, relayed, connected) = runtime.block_on(async {
        let consumer = Consumer::new(&urls, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(&urls, scene.store.clone());
        let within = Duration::from_secs(60);
        let consumed = tokio::time::timeout(within, consumer.run(CancellationToken::new()));
        let relayed = tokio::time::timeout(within, relay.run(CancellationToken::new()));
        let connected = inbox_amqp::connect(&urls, None).await;
        (
            consumed.await.unwrap(),
            relayed.await.unwrap(),
            connected.map(drop),
        )
    });
    for (who, ended) in [
        ("consumer", consumed),
        ("relay", relayed),
        ("connect", connected),
    ] {
        let err = ended.expect_err(who);
        let printed = format!("{err:?} {err}");
        assert!(
            matches!(&err, Error::Connect { url, .. } if url.contains(&format!(":{}", port(&last)))),
            "{who}: the last node's connect error: {printed}"
        );
        assert!(!printed.contains("dead-s3cret"), "{who}: {printed}");
    }
}

#[test]
fn a_bad_list_is_refused_naming_the_item() {
    let Some(scene) = Scene::new() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for (urls, named) in [
        (
            format!("{},,{}", scene.amqp, scene.amqp),
            "item 2 of 3 is empty",
        ),
        (
            format!("{} http://u:bad-s3cret@h/", scene.amqp),
            "item 2 of 2, http://u:***@h/, is not one",
        ),
    ] {
        let consumer = Consumer::new(&urls, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(&urls, scene.store.clone());
        let (consumed, relayed) = runtime.block_on(async {
            let consumed = consumer.run(CancellationToken::new()).await;
            (consumed, relay.run(CancellationToken::new()).await)
        });
        for ended in [consumed, relayed] {
            match ended {
                Err(Error::InvalidSetting { setting, found, .. }) => {
                    assert_eq!((setting, found.as_str()), ("url", named));
                }
                other => panic!("{urls}: expected a refused list, got {other:?}"),
            }
        }
    }
}
