//! The outbox end to end against real PostgreSQL and RabbitMQ: business transactions
//! enqueue, relays publish with confirms, the inbox consumes. Each test has its own
//! schema and broker names and removes them.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Date};
use diesel::PgConnection;
use futures_lite::StreamExt;
use inbox_amqp::{
    CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, RelaySnapshot, Topology,
};
use inbox_core::{
    EnqueueOutcome, Lease, MessageKey, OutboxFailure, OutboxMessage, OutboxStore, RetryPolicy,
};
use inbox_diesel::{enqueue, Store};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, MESSAGE_TYPE};
use inbox_test_support::amqp::{self, amqp_url, eventually, Cuts, Proxy};
use inbox_test_support::ms;
use inbox_test_support::{Fixture, PgFixture};

struct World {
    db: PgFixture,
    url: String,
    prefix: String,
    store: Arc<Store<PgConnection>>,
    topology: Topology,
}

impl World {
    fn new() -> Option<Self> {
        let url = amqp_url()?;
        let db = PgFixture::new()?;
        let prefix = amqp::unique_prefix("t");
        let topology = amqp::test_topology(&prefix, &[50, 100, 200]);
        let store = db
            .builder()
            .pool_size(8)
            .retry_ladder(topology.retry_ladder().clone())
            .handler(DailyUsage::new(RetryPolicy::default()))
            .build()
            .unwrap();
        let mut conn = store.connection().unwrap();
        conn.create_daily_usage().unwrap();
        conn.batch_execute(
            "CREATE TABLE usage_ledger (id BIGSERIAL PRIMARY KEY, user_id BIGINT NOT NULL,
             day DATE NOT NULL, amount BIGINT NOT NULL)",
        )
        .unwrap();
        drop(conn);
        let topology = topology.with_routes(inbox_core::InboxStore::routes(&store));
        Some(Self {
            db,
            url,
            prefix,
            store: Arc::new(store),
            topology,
        })
    }

    /// A world whose topology is declared on the broker.
    async fn declared() -> Option<Self> {
        let world = Self::new()?;
        let conn = amqp::connect(&world.url).await;
        world.topology.declare(&conn).await.unwrap();
        Some(world)
    }

    fn exchange(&self) -> String {
        self.topology.exchange()
    }

    /// A plain queue of the test's own (`<prefix><name>`), bound to the exchange for
    /// `routing_key`; with the channel that declared it.
    async fn bound_queue(
        &self,
        conn: &lapin::Connection,
        name: &str,
        routing_key: &str,
    ) -> (lapin::Channel, String) {
        let queue = format!("{}{name}", self.prefix);
        let channel = conn.create_channel().await.unwrap();
        channel
            .queue_declare(
                queue.as_str().into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.as_str().into(),
                self.exchange().as_str().into(),
                routing_key.into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        (channel, queue)
    }

    /// One business transaction: a ledger row and its event, committed or rolled back.
    fn record_usage(&self, conn: &mut PgConnection, key: &str, e: &UsageRecorded, commit: bool) {
        let msg = OutboxMessage::new(
            MessageKey::derive("billing", key, MESSAGE_TYPE),
            self.exchange(),
            MESSAGE_TYPE,
            serde_json::to_vec(e).unwrap(),
        )
        .with_tenant("acme");
        let now = self.store.now();
        let outcome = conn.transaction::<_, diesel::result::Error, _>(|conn| {
            diesel::sql_query(
                "INSERT INTO usage_ledger (user_id, day, amount) VALUES ($1, $2, $3)",
            )
            .bind::<BigInt, _>(e.user_id)
            .bind::<Date, _>(e.day)
            .bind::<BigInt, _>(e.amount)
            .execute(conn)?;
            let enqueued = enqueue(conn, &msg, now)
                .map_err(|err| diesel::result::Error::QueryBuilderError(err.to_string().into()))?;
            assert!(matches!(enqueued, EnqueueOutcome::Enqueued { .. }));
            if commit {
                Ok(())
            } else {
                Err(diesel::result::Error::RollbackTransaction)
            }
        });
        assert_eq!(outcome.is_ok(), commit);
    }

    /// The ledger's sums per (user, day): the source of truth.
    fn ledger_totals(&self) -> BTreeMap<(i64, NaiveDate), i64> {
        #[derive(QueryableByName)]
        struct Row {
            #[diesel(sql_type = BigInt)]
            user_id: i64,
            #[diesel(sql_type = Date)]
            day: NaiveDate,
            #[diesel(sql_type = BigInt)]
            total: i64,
        }
        let rows: Vec<Row> = diesel::sql_query(
            "SELECT user_id, day, SUM(amount)::bigint AS total FROM usage_ledger GROUP BY user_id, day",
        )
        .load(&mut self.db.connect())
        .unwrap();
        rows.into_iter()
            .map(|r| ((r.user_id, r.day), r.total))
            .collect()
    }

    fn projection(&self) -> BTreeMap<(i64, NaiveDate), i64> {
        self.store.connection().unwrap().daily_totals().unwrap()
    }

    fn unpublished(&self) -> i64 {
        #[derive(QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        diesel::sql_query("SELECT COUNT(*) AS n FROM outbox_messages WHERE published_at IS NULL")
            .get_result::<N>(&mut self.db.connect())
            .unwrap()
            .n
    }

    fn relay(&self, id: &str, url: &str) -> Relay<Store<PgConnection>> {
        Relay::new(url, Arc::clone(&self.store)).with_settings(
            RelaySettings::default()
                .relay_id(id)
                .lease(200, Duration::from_secs(5))
                .poll_interval(ms(100))
                .retry_after(ms(50))
                .backoff(ms(50), ms(500))
                .connect_timeout(Duration::from_secs(1)),
        )
    }

    fn consumer(&self) -> Consumer<Store<PgConnection>> {
        Consumer::new(
            self.url.clone(),
            Arc::clone(&self.store),
            self.topology.clone(),
        )
        .with_settings(
            ConsumerSettings::default()
                .workers(2)
                .prefetch(200)
                .batch(100, ms(5)),
        )
    }

    async fn cleanup(&self) {
        let conn = amqp::connect(&self.url).await;
        self.topology.delete(&conn).await.unwrap();
    }
}

fn event(i: u64) -> UsageRecorded {
    UsageRecorded {
        user_id: 1 + (i % 17) as i64,
        day: NaiveDate::from_ymd_opt(2026, 11, 28).unwrap() + chrono::Days::new(i % 3),
        amount: 1 + (i % 50) as i64,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_relays_and_inbox_apply_every_committed_event_once() {
    let Some(world) = World::declared().await else {
        return;
    };
    let world = Arc::new(world);
    let shutdown = CancellationToken::new();
    let consumer = world.consumer();
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relays: Vec<_> = (0..3)
        .map(|r| {
            let relay = world.relay(&format!("relay-{r}"), &world.url);
            let stats = relay.stats();
            (stats, tokio::spawn(relay.run(shutdown.clone())))
        })
        .collect();

    // 4 writers, 2,500 business transactions each; every 10th rolls back.
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let world = Arc::clone(&world);
            tokio::task::spawn_blocking(move || {
                let mut conn = world.db.connect();
                for i in 0..2_500u64 {
                    let n = w * 10_000 + i;
                    world.record_usage(&mut conn, &format!("ledger-{n}"), &event(n), i % 10 != 9);
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let done = eventually(Duration::from_secs(120), || {
        let s = consumed.snapshot();
        s.processed >= 9_000
    })
    .await;
    assert!(done, "{:?}", consumed.snapshot());
    assert!(eventually(Duration::from_secs(30), || world.unpublished() == 0).await);
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    let mut published = 0;
    for (stats, relay) in relays {
        relay.await.unwrap().unwrap();
        published += stats.snapshot().published;
    }
    assert_eq!(
        published, 9_000,
        "each committed event published once in the normal case"
    );
    assert_eq!(consumed.snapshot().processed, 9_000);
    // None of the rolled-back events was published; every committed one applied once.
    assert_eq!(world.projection(), world.ledger_totals());
    world.cleanup().await;
}

/// The real store, except that marking never comes back: the relay is killed (its
/// task aborted) while it waits, after the broker confirmed the batch.
struct DiesBeforeMarking {
    inner: Arc<Store<PgConnection>>,
    confirmed: Arc<std::sync::atomic::AtomicBool>,
}

impl OutboxStore for DiesBeforeMarking {
    fn lease(&self, relay: &str, limit: usize, lease_for: Duration) -> inbox_core::Result<Lease> {
        self.inner.lease(relay, limit, lease_for)
    }

    fn mark_published(&self, _: &str, _: &[i64]) -> inbox_core::Result<usize> {
        self.confirmed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(Duration::from_secs(2));
        Err(inbox_core::Error::Store(
            "the relay was killed before marking".into(),
        ))
    }

    fn record_failures(&self, relay: &str, f: &[OutboxFailure]) -> inbox_core::Result<()> {
        self.inner.record_failures(relay, f)
    }

    fn oldest_unpublished_age(&self) -> inbox_core::Result<Option<Duration>> {
        self.inner.oldest_unpublished_age()
    }

    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.inner.now()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_between_publish_and_mark_publishes_again_and_totals_stay_exact() {
    let Some(world) = World::declared().await else {
        return;
    };
    let mut conn = world.db.connect();
    for n in 0..300 {
        world.record_usage(&mut conn, &format!("ledger-{n}"), &event(n), true);
    }
    // The doomed relay publishes a lease of 300; once the broker has confirmed it, the
    // relay is killed before it can mark anything.
    let confirmed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let doomed = Relay::new(
        world.url.clone(),
        Arc::new(DiesBeforeMarking {
            inner: Arc::clone(&world.store),
            confirmed: Arc::clone(&confirmed),
        }),
    )
    .with_settings(
        RelaySettings::default()
            .relay_id("doomed")
            .lease(300, ms(500)),
    );
    let doomed = tokio::spawn(doomed.run(CancellationToken::new()));
    assert!(
        eventually(Duration::from_secs(30), || confirmed
            .load(std::sync::atomic::Ordering::SeqCst))
        .await
    );
    doomed.abort();
    assert!(doomed.await.unwrap_err().is_cancelled());
    assert_eq!(world.unpublished(), 300, "nothing was marked");

    // After its lease expires, a healthy relay publishes the rows again.
    let shutdown = CancellationToken::new();
    let consumer = world.consumer();
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = world.relay("healthy", &world.url);
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    assert!(eventually(Duration::from_secs(60), || world.unpublished() == 0).await);
    assert!(
        eventually(Duration::from_secs(60), || {
            let s = consumed.snapshot();
            s.processed + s.duplicates >= 600
        })
        .await
    );
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();
    assert_eq!(relayed.snapshot().published, 300);
    let s = consumed.snapshot();
    assert_eq!(
        (s.processed, s.duplicates),
        (300, 300),
        "the second copy was absorbed"
    );
    assert_eq!(world.projection(), world.ledger_totals());
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_keys_reach_the_queue_in_id_order_across_three_relays() {
    let Some(world) = World::new() else { return };
    let conn = amqp::connect(&world.url).await;
    world.topology.declare(&conn).await.unwrap();
    // A plain queue of the test's own, read back by one consumer.
    let (channel, queue) = world.bound_queue(&conn, "ordered", "ordered.event").await;
    let mut db = world.db.connect();
    let now = world.store.now();
    for i in 0..300u32 {
        let key = format!("k{}", i % 5);
        let msg = OutboxMessage::new(
            MessageKey::new(format!("ordered-{i}")).unwrap(),
            world.exchange(),
            "ordered.event",
            format!("{key}:{i}").into_bytes(),
        )
        .with_ordering_key(key);
        enqueue(&mut db, &msg, now).unwrap();
    }
    let shutdown = CancellationToken::new();
    let relays: Vec<_> = (0..3)
        .map(|r| {
            tokio::spawn(
                world
                    .relay(&format!("ordered-{r}"), &world.url)
                    .run(shutdown.clone()),
            )
        })
        .collect();
    assert!(eventually(Duration::from_secs(60), || world.unpublished() == 0).await);
    shutdown.cancel();
    for relay in relays {
        relay.await.unwrap().unwrap();
    }
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "reader".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let mut last: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..300 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let body = String::from_utf8(d.data.clone()).unwrap();
        let (key, seq) = body.split_once(':').unwrap();
        let seq: u32 = seq.parse().unwrap();
        if let Some(prev) = last.insert(key.to_owned(), seq) {
            assert!(seq > prev, "{key}: {seq} arrived after {prev}");
        }
        d.ack(Default::default()).await.unwrap();
    }
    assert_eq!(last.len(), 5);
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    world.cleanup().await;
}

/// A store whose lease of one row stalls until the test lets it go: the round that
/// leased the row is stuck after its lease committed and before publishing.
struct StallsOnRow {
    inner: Arc<Store<PgConnection>>,
    row: i64,
    stalled: std::sync::atomic::AtomicBool,
    release: std::sync::Mutex<bool>,
    released: std::sync::Condvar,
}

impl StallsOnRow {
    fn let_go(&self) {
        *self.release.lock().unwrap() = true;
        self.released.notify_all();
    }
}

impl OutboxStore for StallsOnRow {
    fn lease(&self, relay: &str, limit: usize, lease_for: Duration) -> inbox_core::Result<Lease> {
        let lease = self.inner.lease(relay, limit, lease_for)?;
        if lease.rows.iter().any(|r| r.id == self.row) {
            self.stalled
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let mut go = self.release.lock().unwrap();
            while !*go {
                go = self.released.wait(go).unwrap();
            }
        }
        Ok(lease)
    }

    fn mark_published(&self, relay: &str, ids: &[i64]) -> inbox_core::Result<usize> {
        self.inner.mark_published(relay, ids)
    }

    fn record_failures(&self, relay: &str, f: &[OutboxFailure]) -> inbox_core::Result<()> {
        self.inner.record_failures(relay, f)
    }

    fn oldest_unpublished_age(&self) -> inbox_core::Result<Option<Duration>> {
        self.inner.oldest_unpublished_age()
    }

    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.inner.now()
    }

    fn wait_for_enqueue(&self, timeout: Duration) -> inbox_core::Result<bool> {
        self.inner.wait_for_enqueue(timeout)
    }
}

/// Rounds in flight at once: while one round is stuck between its lease and its
/// publishing, the relay's other round goes on publishing, and still never takes the
/// stuck row's ordering key's next row, which would overtake it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_round_does_not_stop_the_next_nor_let_its_keys_next_row_overtake() {
    let Some(world) = World::new() else { return };
    let conn = amqp::connect(&world.url).await;
    world.topology.declare(&conn).await.unwrap();
    let (channel, queue) = world.bound_queue(&conn, "overlap", "overlap.#").await;
    let mut db = world.db.connect();
    let now = world.store.now();
    let row = |name: &str, key: Option<&str>| {
        let msg = OutboxMessage::new(
            MessageKey::new(format!("overlap-{name}")).unwrap(),
            world.exchange(),
            "overlap.event",
            name.as_bytes().to_vec(),
        );
        match key {
            Some(key) => msg.with_ordering_key(key),
            None => msg,
        }
    };
    let first = match enqueue(&mut db, &row("k1", Some("k")), now).unwrap() {
        EnqueueOutcome::Enqueued { id } => id,
        other => panic!("{other:?}"),
    };
    for i in 0..20 {
        enqueue(&mut db, &row(&format!("x{i}"), None), now).unwrap();
    }
    enqueue(&mut db, &row("k2", Some("k")), now).unwrap();

    let store = Arc::new(StallsOnRow {
        inner: Arc::clone(&world.store),
        row: first,
        stalled: false.into(),
        release: false.into(),
        released: std::sync::Condvar::new(),
    });
    let relay = Relay::new(world.url.clone(), Arc::clone(&store)).with_settings(
        RelaySettings::default()
            .relay_id("overlap")
            .rounds_in_flight(2)
            .lease(1, Duration::from_secs(60))
            .poll_interval(ms(50)),
    );
    let stats = relay.stats();
    let shutdown = CancellationToken::new();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    // The other round publishes every unkeyed row while the first is stuck...
    let others = eventually(Duration::from_secs(30), || {
        store.stalled.load(std::sync::atomic::Ordering::SeqCst) && stats.snapshot().published == 20
    })
    .await;
    // ...and leaves k2 alone: its key's earlier row k1 is leased, not published.
    tokio::time::sleep(ms(500)).await;
    let (published, unpublished) = (stats.snapshot().published, world.unpublished());
    store.let_go();
    assert!(others, "published while a round was stuck: {published}");
    assert_eq!((published, unpublished), (20, 2), "k2 must wait for k1");
    assert!(eventually(Duration::from_secs(30), || world.unpublished() == 0).await);
    shutdown.cancel();
    relaying.await.unwrap().unwrap();

    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "reader".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let mut keyed = Vec::new();
    for _ in 0..22 {
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let body = String::from_utf8(d.data.clone()).unwrap();
        if body.starts_with('k') {
            keyed.push(body);
        }
        d.ack(Default::default()).await.unwrap();
    }
    assert_eq!(keyed, ["k1", "k2"]);
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_message_is_recorded_and_retried_without_blocking_others() {
    let Some(world) = World::new() else { return };
    let conn = amqp::connect(&world.url).await;
    world.topology.declare(&conn).await.unwrap();
    let mut db = world.db.connect();
    let now = world.store.now();
    let lost = OutboxMessage::new(
        MessageKey::new("nowhere-1").unwrap(),
        world.exchange(),
        "usage.nowhere",
        b"{}".to_vec(),
    );
    enqueue(&mut db, &lost, now).unwrap();
    for n in 0..50 {
        world.record_usage(&mut db, &format!("ledger-{n}"), &event(n), true);
    }
    let shutdown = CancellationToken::new();
    let consumer = world.consumer();
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = world.relay("r", &world.url);
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    assert!(
        eventually(Duration::from_secs(30), || consumed.snapshot().processed
            >= 50)
        .await
    );
    assert!(eventually(Duration::from_secs(30), || relayed.snapshot().returned >= 2).await);
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        attempts: i32,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
        last_error: Option<String>,
    }
    let row: Row = diesel::sql_query(
        "SELECT attempts, last_error FROM outbox_messages WHERE message_key = 'nowhere-1' AND published_at IS NULL",
    )
    .get_result(&mut world.db.connect())
    .unwrap();
    assert!(row.attempts >= 2, "retried: {}", row.attempts);
    assert!(row.last_error.unwrap().contains("unroutable"));
    // Once something is bound for it, the retry goes through.
    let (channel, queue) = world.bound_queue(&conn, "nowhere", "usage.nowhere").await;
    assert!(eventually(Duration::from_secs(30), || world.unpublished() == 0).await);
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();
    let s: RelaySnapshot = relayed.snapshot();
    assert_eq!(s.published, 51);
    assert_eq!(world.projection(), world.ledger_totals());
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    world.cleanup().await;
}

/// The broker sends an unroutable row's return before its ack, and may ack several
/// rows at once (`multiple`): lapin hands a return to whichever confirm it settles
/// next, in no fixed order. A round of routable rows with unroutable ones among them
/// must still tell which rows came back: every routable row reaches its queue once
/// and is marked published, no unroutable row is marked published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_tells_its_returned_rows_from_the_rows_acked_with_them() {
    const ROWS: usize = 600;
    let Some(world) = World::declared().await else {
        return;
    };
    let conn = amqp::connect(&world.url).await;
    let (channel, queue) = world.bound_queue(&conn, "counted", "usage.counted").await;
    let mut db = world.db.connect();
    let now = world.store.now();
    let mut routable = std::collections::BTreeSet::new();
    for n in 0..ROWS {
        let nowhere = n % 7 == 3;
        let key = format!("{}-{n}", if nowhere { "nowhere" } else { "counted" });
        let routing_key = if nowhere {
            "usage.nowhere"
        } else {
            "usage.counted"
        };
        let msg = OutboxMessage::new(
            MessageKey::new(&key).unwrap(),
            world.exchange(),
            routing_key,
            key.clone().into_bytes(),
        );
        enqueue(&mut db, &msg, now).unwrap();
        if !nowhere {
            routable.insert(key);
        }
    }
    let unroutable = (ROWS - routable.len()) as u64;
    let shutdown = CancellationToken::new();
    let relay = world.relay("r", &world.url);
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    // Every routable row published, every unroutable one returned at least twice.
    let settled = eventually(Duration::from_secs(60), || {
        let s = relayed.snapshot();
        s.published >= routable.len() as u64 && s.returned >= 2 * unroutable
    })
    .await;
    shutdown.cancel();
    relaying.await.unwrap().unwrap();
    let s: RelaySnapshot = relayed.snapshot();
    assert!(settled, "{s:?}");
    assert_eq!(s.published, routable.len() as u64, "{s:?}");
    #[derive(QueryableByName)]
    struct Key {
        #[diesel(sql_type = diesel::sql_types::Text)]
        message_key: String,
    }
    let published: std::collections::BTreeSet<String> =
        diesel::sql_query("SELECT message_key FROM outbox_messages WHERE published_at IS NOT NULL")
            .load::<Key>(&mut db)
            .unwrap()
            .into_iter()
            .map(|k| k.message_key)
            .collect();
    assert_eq!(published, routable, "the rows marked published");
    // What reached the queue: each routable row once.
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "counter".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let mut arrived = BTreeMap::<String, u32>::new();
    while let Ok(Some(d)) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await {
        let d = d.unwrap();
        *arrived
            .entry(String::from_utf8(d.data.clone()).unwrap())
            .or_default() += 1;
        d.ack(Default::default()).await.unwrap();
    }
    let doubled: Vec<_> = arrived.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "published twice: {doubled:?}");
    let keys: std::collections::BTreeSet<String> = arrived.into_keys().collect();
    assert_eq!(keys, routable, "the rows that reached the queue");
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    world.cleanup().await;
}

/// Writers commit `rows` events while a relay publishes them through a proxy that
/// cuts its connection as `cuts` says once `cut_after` are published: the relay
/// reconnects, never stalls, and the consumer applies every event exactly once.
async fn relay_through_cuts(rows: u64, cut_after: u64, cuts: Cuts) {
    let Some(world) = World::declared().await else {
        return;
    };
    let world = Arc::new(world);
    let proxy = Proxy::start(amqp::host_port(&world.url)).await;
    let shutdown = CancellationToken::new();
    let consumer = world.consumer();
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = world.relay("cut", &proxy.url_for(&world.url));
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    let writer = {
        let world = Arc::clone(&world);
        tokio::task::spawn_blocking(move || {
            let mut conn = world.db.connect();
            for n in 0..rows {
                world.record_usage(&mut conn, &format!("ledger-{n}"), &event(n), true);
                if n % 100 == 0 {
                    std::thread::sleep(ms(20));
                }
            }
        })
    };
    assert!(
        eventually(Duration::from_secs(60), || relayed.snapshot().published
            >= cut_after)
        .await
    );
    proxy.cut_as(cuts).await;
    writer.await.unwrap();
    assert!(
        eventually(Duration::from_secs(90), || world.unpublished() == 0).await,
        "the relay stalled: {:?}",
        relayed.snapshot()
    );
    assert!(
        eventually(Duration::from_secs(60), || consumed.snapshot().processed
            >= rows)
        .await
    );
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();
    // Cuts during a reconnect's backoff find no connection to cut.
    let least = if let Cuts::Repeatedly(_) = cuts { 3 } else { 1 };
    let s = relayed.snapshot();
    assert!(s.reconnects >= least, "{s:?}");
    assert_eq!(consumed.snapshot().processed, rows);
    assert_eq!(world.projection(), world.ledger_totals());
    world.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_connection_cut_for_seconds_then_everything_is_published() {
    let refuse_for = Duration::from_secs(2);
    relay_through_cuts(1_500, 200, Cuts::Once { refuse_for }).await;
}

/// Twenty cuts land wherever the relay happens to be: publishing, waiting for
/// confirms, reconnecting or closing a connection that is already dead. It must never
/// wait forever on a connection that will not answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_cut_again_and_again_mid_publish_never_stalls() {
    relay_through_cuts(4_000, 50, Cuts::Repeatedly(20)).await;
}

/// The broker falls silent mid-stream without closing anything, as in a network
/// partition: no confirm ever comes. The relay gives up when its lease runs out (5 s
/// here), long before a missed heartbeat would tell it, and publishes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_whose_broker_falls_silent_publishes_again_after_its_lease() {
    relay_through_cuts(1_500, 200, Cuts::Freeze).await;
}

/// After a cut, the broker accepts new connections for 3 s and never answers them:
/// each reconnect gives up at its connect timeout (1 s here) and tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_reconnect_stalled_mid_handshake_is_given_up_and_tried_again() {
    let stall_for = Duration::from_secs(3);
    relay_through_cuts(1_500, 200, Cuts::Stalling { stall_for }).await;
}

#[derive(QueryableByName, Debug)]
struct FateRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = diesel::sql_types::Integer)]
    attempts: i32,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    dead: bool,
}

/// A row for an exchange that does not exist (the broker closes the channel with 404)
/// and a row the store cannot read sit among good rows. Each poison is recorded
/// against itself until it is dead; every row before and after it is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_are_recorded_dead_and_never_stop_the_rows_around_them() {
    let Some(world) = World::declared().await else {
        return;
    };
    let mut db = world.db.connect();
    for n in 0..5 {
        world.record_usage(&mut db, &format!("ledger-{n}"), &event(n), true);
    }
    let now = world.store.now();
    let missing = OutboxMessage::new(
        MessageKey::new("poison-404").unwrap(),
        format!("{}missing", world.prefix),
        MESSAGE_TYPE,
        b"{}".to_vec(),
    );
    let EnqueueOutcome::Enqueued { id: poison } = enqueue(&mut db, &missing, now).unwrap() else {
        panic!("enqueued")
    };
    let unreadable_msg = OutboxMessage::new(
        MessageKey::new("poison-headers").unwrap(),
        world.exchange(),
        MESSAGE_TYPE,
        b"{}".to_vec(),
    );
    let EnqueueOutcome::Enqueued { id: unreadable } =
        enqueue(&mut db, &unreadable_msg, now).unwrap()
    else {
        panic!("enqueued")
    };
    // Written by another producer that stores headers its own way.
    db.batch_execute(&format!(
        "UPDATE outbox_messages SET headers = 'trace=abc' WHERE id = {unreadable}"
    ))
    .unwrap();
    for n in 5..10 {
        world.record_usage(&mut db, &format!("ledger-{n}"), &event(n), true);
    }

    let shutdown = CancellationToken::new();
    let consumer = world.consumer();
    let consumed = consumer.stats();
    let consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let relay = Relay::new(world.url.clone(), Arc::clone(&world.store)).with_settings(
        RelaySettings::default()
            .relay_id("poisoned")
            .lease(200, Duration::from_secs(5))
            .poll_interval(ms(100))
            .retry_after(ms(50))
            .max_attempts(3)
            .backoff(ms(50), ms(500)),
    );
    let relayed = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    let fates = || -> Vec<FateRow> {
        diesel::sql_query(
            "SELECT id, attempts, last_error, dead_at IS NOT NULL AS dead FROM outbox_messages \
             WHERE published_at IS NULL ORDER BY id",
        )
        .load(&mut world.db.connect())
        .unwrap()
    };
    let settled = eventually(Duration::from_secs(60), || {
        let left = fates();
        left.len() == 2 && left.iter().all(|r| r.dead)
    })
    .await;
    assert!(settled, "{:?} {:?}", fates(), relayed.snapshot());
    assert!(
        eventually(Duration::from_secs(30), || consumed.snapshot().processed
            >= 10)
        .await
    );
    shutdown.cancel();
    consuming.await.unwrap().unwrap();
    relaying.await.unwrap().unwrap();

    let left = fates();
    assert_eq!(
        left.iter().map(|r| r.id).collect::<Vec<_>>(),
        [poison, unreadable]
    );
    assert!(left.iter().all(|r| r.attempts == 3), "{left:?}");
    let error = left[0].last_error.as_deref().unwrap();
    assert!(
        error.contains("NOT_FOUND") && error.contains("missing"),
        "{error}"
    );
    let error = left[1].last_error.as_deref().unwrap();
    assert!(error.contains("headers are not a JSON object"), "{error}");
    let listed: Vec<i64> = world
        .store
        .dead_outbox_rows(10)
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, [poison, unreadable]);
    let s = relayed.snapshot();
    assert_eq!((s.published, s.dead, s.rejected), (10, 2, 6), "{s:?}");
    assert_eq!(consumed.snapshot().processed, 10);
    assert_eq!(world.projection(), world.ledger_totals());
    world.cleanup().await;
}
