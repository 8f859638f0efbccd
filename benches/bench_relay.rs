//! `cargo run --release -p inbox-benches --bin bench_relay`: outbox relay throughput and latency.
//!
//! - Throughput: a backlog of 20,000 rows (`BENCH_EVENTS`) published, confirmed and
//!   marked, with 1 relay and with 3 relays.
//! - Latency: 500 messages/s enqueued for 6 s, one transaction each; the time from
//!   each commit to the message's arrival in a bound queue, p50 and p99, with the
//!   relay woken by PostgreSQL NOTIFY and with polling every 100 ms.
//!
//! `DATABASE_URL` and `AMQP_URL` as for the tests. Fresh schemas and queue names per
//! run, removed afterwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection as _, PgConnection};
use futures_lite::StreamExt;
use inbox_amqp::{CancellationToken, Relay, RelaySettings};
use inbox_benches::{env_or, service_urls};
use inbox_core::{MessageKey, OutboxMessage, OutboxStore, RedactedError};
use inbox_diesel::{enqueue, Store};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};

struct Bench {
    db_url: String,
    amqp_url: String,
    run: String,
}

impl Bench {
    fn store(&self, name: &str) -> Arc<Store<PgConnection>> {
        let schema = format!("{}_{name}", self.run);
        let mut conn = PgConnection::establish(&self.db_url)
            .unwrap_or_else(|e| panic!("connect: {}", RedactedError::new(&e, &self.db_url)));
        conn.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .expect("schema");
        Arc::new(
            Store::<PgConnection>::builder(self.db_url.clone())
                .schema(schema)
                .pool_size(6)
                .build()
                .expect("store"),
        )
    }

    fn drop_schema(&self, name: &str) {
        if let Ok(mut conn) = PgConnection::establish(&self.db_url) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {}_{name} CASCADE",
                self.run
            ));
        }
    }

    /// An exchange and a bound queue for the relays to publish into.
    async fn destination(&self, conn: &Connection, name: &str) -> (String, String) {
        let exchange = format!("{}.{name}", self.run);
        let queue = format!("{}.{name}.sink", self.run);
        let channel = conn.create_channel().await.expect("channel");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
        (exchange, queue)
    }

    async fn remove(&self, conn: &Connection, exchange: &str, queue: &str) {
        if let Ok(channel) = conn.create_channel().await {
            let _ = channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await;
            let _ = channel
                .exchange_delete(exchange.into(), Default::default())
                .await;
        }
    }

    fn relay(
        &self,
        store: &Arc<Store<PgConnection>>,
        id: String,
        notify: bool,
    ) -> Relay<Store<PgConnection>> {
        Relay::new(self.amqp_url.clone(), Arc::clone(store)).with_settings(
            RelaySettings::default()
                .relay_id(id)
                .lease(500, Duration::from_secs(30))
                .poll_interval(Duration::from_millis(100))
                .wake_on_notify(notify),
        )
    }

    async fn throughput(&self, relays: usize, events: usize) -> f64 {
        let name = format!("backlog{relays}");
        let store = self.store(&name);
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        let (exchange, queue) = self.destination(&conn, &name).await;
        {
            let mut db = store.connection().expect("db");
            let now = store.now();
            for chunk in (0..events).collect::<Vec<_>>().chunks(500) {
                db.transaction::<_, diesel::result::Error, _>(|db| {
                    for i in chunk {
                        let msg = OutboxMessage::new(
                            MessageKey::new(format!("backlog-{i}")).expect("key"),
                            exchange.clone(),
                            "usage.recorded",
                            br#"{"user_id":1,"day":"2026-11-30","amount":1}"#.to_vec(),
                        );
                        enqueue(&mut *db, &msg, now).map_err(|e| {
                            diesel::result::Error::QueryBuilderError(e.to_string().into())
                        })?;
                    }
                    Ok(())
                })
                .expect("backlog");
            }
        }
        let shutdown = CancellationToken::new();
        let stats: Vec<_> = (0..relays)
            .map(|r| {
                let relay = self.relay(&store, format!("{name}-{r}"), true);
                let stats = relay.stats();
                tokio::spawn(relay.run(shutdown.clone()));
                stats
            })
            .collect();
        let started = Instant::now();
        loop {
            let published: u64 = stats.iter().map(|s| s.snapshot().published).sum();
            if published as usize >= events {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        shutdown.cancel();
        self.remove(&conn, &exchange, &queue).await;
        self.drop_schema(&name);
        events as f64 / elapsed.as_secs_f64()
    }

    async fn latency(&self, notify: bool) -> (Duration, Duration, usize) {
        let name = if notify { "notify" } else { "polling" };
        let store = self.store(name);
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        let (exchange, queue) = self.destination(&conn, name).await;
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();

        let channel = conn.create_channel().await.expect("channel");
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let (seen, lat) = (Arc::clone(&committed), Arc::clone(&latencies));
        let reader = tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let arrived = Instant::now();
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.as_str().to_owned())
                    .unwrap_or_default();
                if let Some(at) = seen.lock().expect("map").get(&id) {
                    lat.lock().expect("latencies").push(arrived - *at);
                }
                let _ = d.ack(BasicAckOptions::default()).await;
            }
        });

        let shutdown = CancellationToken::new();
        tokio::spawn(
            self.relay(&store, format!("{name}-0"), notify)
                .run(shutdown.clone()),
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let total = 3_000;
        let producer = {
            let store = Arc::clone(&store);
            let committed = Arc::clone(&committed);
            tokio::task::spawn_blocking(move || {
                let mut db = store.connection().expect("db");
                let started = Instant::now();
                for i in 0..total {
                    // 500 messages per second, one transaction each.
                    let due = started + Duration::from_millis(2 * i as u64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let id = format!("lat-{i}");
                    let msg = OutboxMessage::new(
                        MessageKey::new(id.clone()).expect("key"),
                        exchange.clone(),
                        "usage.recorded",
                        b"{}".to_vec(),
                    );
                    let now = store.now();
                    db.transaction::<_, diesel::result::Error, _>(|db| {
                        enqueue(&mut *db, &msg, now).map_err(|e| {
                            diesel::result::Error::QueryBuilderError(e.to_string().into())
                        })?;
                        Ok(())
                    })
                    .expect("enqueue");
                    committed.lock().expect("map").insert(id, Instant::now());
                }
                exchange
            })
        };
        let exchange = producer.await.expect("producer");
        let deadline = Instant::now() + Duration::from_secs(30);
        while latencies.lock().expect("latencies").len() < total && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        reader.abort();
        let mut all = latencies.lock().expect("latencies").clone();
        all.sort();
        let pick = |q: f64| {
            all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        self.remove(&conn, &exchange, &queue).await;
        self.drop_schema(name);
        (pick(0.50), pick(0.99), all.len())
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    let bench = Bench {
        db_url,
        amqp_url,
        run: format!("relaybench_{}", std::process::id()),
    };
    println!("backlog of {events} rows, leases of 500; PostgreSQL fsync on");
    let one = bench.throughput(1, events).await;
    println!("1 relay:  {one:>8.0} messages/s published, confirmed and marked");
    let three = bench.throughput(3, events).await;
    println!("3 relays: {three:>8.0} messages/s");
    for notify in [true, false] {
        let (p50, p99, n) = bench.latency(notify).await;
        let mode = if notify {
            "LISTEN/NOTIFY"
        } else {
            "polling 100 ms"
        };
        println!("commit-to-publish at 500 msg/s, {mode:<14}: p50 {p50:>9.2?}  p99 {p99:>9.2?}  ({n} messages)");
    }
}
