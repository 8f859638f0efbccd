//! `inbox_amqp::serve`: the consumer and the relay of one process end together. A
//! relay that cannot start stops the consumer (the process exits instead of consuming
//! while nothing publishes its outbox or an operator's replays), and the caller's
//! shutdown stops both.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::SqliteConnection;
use inbox_amqp::{CancellationToken, Consumer, Relay, Topology};
use inbox_core::{HandlerError, MessageContext};
use inbox_diesel::Store;
use inbox_test_support::amqp::amqp_url;
use inbox_test_support::{unique_name, SqliteFixture};

#[derive(serde::Deserialize)]
struct Ping {}

#[derive(inbox_core::Handler)]
#[inbox(group = "serve.pings", message = Ping, message_type = "ping", connection = SqliteConnection)]
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
    _db: SqliteFixture,
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
        let prefix = format!("{}.", unique_name("serve"));
        let topology = Topology::new("serve")
            .unwrap()
            .prefix(prefix)
            .unwrap()
            .queue_expires(Duration::from_secs(60));
        Some(Self {
            _db: db,
            store: Arc::new(store),
            topology,
            amqp,
        })
    }
}

/// A port nothing listens on: the relay's first connection is refused at once.
fn refused_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
}

#[test]
fn a_relay_that_cannot_start_stops_the_consumer() {
    let Some(scene) = Scene::new() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ended = runtime.block_on(async {
        let consumer = Consumer::new(&scene.amqp, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(refused_url(), scene.store.clone());
        let shutdown = CancellationToken::new();
        tokio::time::timeout(
            Duration::from_secs(60),
            inbox_amqp::serve(consumer, relay, shutdown),
        )
        .await
    });
    let ended = ended.expect("serve still running 60 s after its relay failed");
    let err = ended.expect_err("the relay's failure is serve's");
    assert!(
        matches!(err, inbox_amqp::Error::Connect { .. }),
        "the relay's connect error: {err:?}"
    );
}

#[test]
fn the_callers_shutdown_stops_both() {
    let Some(scene) = Scene::new() else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let ended = runtime.block_on(async {
        let consumer = Consumer::new(&scene.amqp, scene.store.clone(), scene.topology.clone());
        let relay = Relay::new(&scene.amqp, scene.store.clone());
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.cancel();
        });
        tokio::time::timeout(
            Duration::from_secs(60),
            inbox_amqp::serve(consumer, relay, shutdown),
        )
        .await
    });
    ended
        .expect("serve still running 58 s after its shutdown")
        .expect("a clean shutdown");
}
