//! `cargo run --release -p inbox-benches --bin bench_relay`: outbox relay throughput and latency.
//!
//! - Throughput: a backlog of 20,000 rows (`BENCH_EVENTS`) published, confirmed and
//!   marked: one relay with one round in flight (rounds one after another), with the
//!   default two and with four; three relays with the default; and an ordered backlog
//!   (every row has one of 1,000 ordering keys, 20 rows each, interleaved) with one
//!   relay, one round and the default. Cases are interleaved over `BENCH_ROUNDS`
//!   rounds (default 1); the median and the range are printed.
//! - Latency: `BENCH_RATE` messages/s (default 1,000) enqueued for `BENCH_SECONDS`
//!   (default 6), one transaction each, from four producer threads; the time from each
//!   commit to the message's arrival in a bound queue, p50, p99 and p999, with the
//!   relay woken by PostgreSQL NOTIFY (one round in flight and the default) and with
//!   polling every 100 ms. The achieved rate is printed beside the offered one.
//!   Interleaved over `BENCH_ROUNDS` rounds too: the median of each percentile and
//!   the range of the p99.
//!
//! `BENCH_ONLY=throughput` or `BENCH_ONLY=latency` runs one half alone;
//! `BENCH_CASES=2,3` runs only those throughput cases (numbered from 1, as printed).
//!
//! `DATABASE_URL` and `AMQP_URL` as for the tests. Fresh schemas and queue names per
//! run, removed afterwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::{Connection as _, PgConnection};
use futures_lite::StreamExt;
use inbox_amqp::{CancellationToken, Relay, RelaySettings, DEFAULT_ROUNDS_IN_FLIGHT};
use inbox_benches::{cpu_ticks, cpu_ticks_of, env_or, service_urls, TICKS_PER_SECOND};
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
        rounds: usize,
    ) -> Relay<Store<PgConnection>> {
        Relay::new(self.amqp_url.clone(), Arc::clone(store)).with_settings(
            RelaySettings::default()
                .relay_id(id)
                .lease(500, Duration::from_secs(30))
                .rounds_in_flight(rounds)
                .poll_interval(Duration::from_millis(100))
                .wake_on_notify(notify),
        )
    }

    /// Messages per second from a backlog of `events` rows; with `ordered`, every row
    /// has one of 1,000 ordering keys, interleaved.
    async fn throughput(&self, case: &Case, events: usize) -> (f64, Cpu) {
        let Case {
            relays,
            rounds,
            ordered,
            ..
        } = *case;
        let name = format!("backlog{relays}_{rounds}_{}", u8::from(ordered));
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
                        let msg = if ordered {
                            msg.with_ordering_key(format!("account-{}", i % 1_000))
                        } else {
                            msg
                        };
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
                let relay = self.relay(&store, format!("{name}-{r}"), true, rounds);
                let stats = relay.stats();
                tokio::spawn(relay.run(shutdown.clone()));
                stats
            })
            .collect();
        let started = Instant::now();
        let before = cpu();
        loop {
            let published: u64 = stats.iter().map(|s| s.snapshot().published).sum();
            if published as usize >= events {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = started.elapsed();
        let used = cpu().minus(&before);
        shutdown.cancel();
        self.remove(&conn, &exchange, &queue).await;
        self.drop_schema(&name);
        (
            events as f64 / elapsed.as_secs_f64(),
            used.per_row(events, elapsed),
        )
    }

    async fn latency(&self, rate: u64, seconds: u64, notify: bool, rounds: usize) -> Latency {
        let name = format!(
            "latency_{}_{rounds}",
            if notify { "notify" } else { "polling" }
        );
        let name = name.as_str();
        let store = self.store(name);
        let conn = Connection::connect(&self.amqp_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("amqp: {}", RedactedError::new(&e, &self.amqp_url)));
        let (exchange, queue) = self.destination(&conn, name).await;
        // When each message's transaction committed (read after the commit returns)
        // and when it arrived. Matched at the end: a message can arrive before its
        // producer has read the clock after its commit (the relay woken by the
        // commit's NOTIFY is that fast), and such a message counts as 0 ms.
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();

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
        let arrived_at = Arc::clone(&arrivals);
        let reader = tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let arrived = Instant::now();
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.as_str().to_owned())
                    .unwrap_or_default();
                arrived_at
                    .lock()
                    .expect("arrivals")
                    .entry(id)
                    .or_insert(arrived);
                let _ = d.ack(BasicAckOptions::default()).await;
            }
        });

        let shutdown = CancellationToken::new();
        tokio::spawn(
            self.relay(&store, format!("{name}-0"), notify, rounds)
                .run(shutdown.clone()),
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        const PRODUCERS: u64 = 4;
        let total = rate * seconds;
        let started = Instant::now();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let store = Arc::clone(&store);
                let committed = Arc::clone(&committed);
                let exchange = exchange.clone();
                tokio::task::spawn_blocking(move || {
                    let mut db = store.connection().expect("db");
                    // Producer p sends messages p, p + 4, ...: together, `rate` a second,
                    // one transaction each, on a schedule (open loop).
                    for i in (p..total).step_by(PRODUCERS as usize) {
                        let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
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
                })
            })
            .collect();
        for producer in producers {
            producer.await.expect("producer");
        }
        let achieved = total as f64 / started.elapsed().as_secs_f64();
        let deadline = Instant::now() + Duration::from_secs(30);
        while arrivals.lock().expect("arrivals").len() < total as usize && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        shutdown.cancel();
        reader.abort();
        let mut all: Vec<Duration> = {
            let committed = committed.lock().expect("map");
            (arrivals.lock().expect("arrivals").iter())
                .filter_map(|(id, arrived)| {
                    Some(arrived.saturating_duration_since(*committed.get(id)?))
                })
                .collect()
        };
        all.sort();
        let pick = |q: f64| {
            all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        self.remove(&conn, &exchange, &queue).await;
        self.drop_schema(name);
        Latency {
            p50: pick(0.50),
            p99: pick(0.99),
            p999: pick(0.999),
            received: all.len(),
            achieved,
        }
    }
}

/// CPU seconds used by the relay's process, PostgreSQL and RabbitMQ; once divided by
/// [`Cpu::per_row`], microseconds per row, and `busy` the share of the machine's
/// cores the three kept busy.
#[derive(Clone, Copy, Default)]
struct Cpu {
    relay: f64,
    postgres: f64,
    rabbitmq: f64,
    busy: f64,
}

fn cpu() -> Cpu {
    let seconds = |ticks: u64| ticks as f64 / TICKS_PER_SECOND;
    Cpu {
        relay: seconds(cpu_ticks(std::process::id()).unwrap_or(0)),
        postgres: seconds(cpu_ticks_of("postgres")),
        rabbitmq: seconds(cpu_ticks_of("beam.smp")),
        busy: 0.0,
    }
}

impl Cpu {
    fn minus(&self, earlier: &Cpu) -> Cpu {
        Cpu {
            relay: self.relay - earlier.relay,
            postgres: self.postgres - earlier.postgres,
            rabbitmq: self.rabbitmq - earlier.rabbitmq,
            busy: 0.0,
        }
    }

    fn per_row(&self, rows: usize, elapsed: Duration) -> Cpu {
        let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        let us = |s: f64| s * 1e6 / rows as f64;
        Cpu {
            relay: us(self.relay),
            postgres: us(self.postgres),
            rabbitmq: us(self.rabbitmq),
            busy: (self.relay + self.postgres + self.rabbitmq) / (elapsed.as_secs_f64() * cores),
        }
    }
}

/// A throughput case.
struct Case {
    label: &'static str,
    relays: usize,
    rounds: usize,
    ordered: bool,
}

struct Latency {
    p50: Duration,
    p99: Duration,
    p999: Duration,
    received: usize,
    achieved: f64,
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (db_url, amqp_url) = service_urls();
    let events: usize = env_or("BENCH_EVENTS", 20_000);
    let rounds: usize = env_or("BENCH_ROUNDS", 1).max(1);
    let rate: u64 = env_or("BENCH_RATE", 1_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 6);
    // `throughput` or `latency` runs that half alone.
    let only: String = env_or("BENCH_ONLY", String::new());
    let bench = Bench {
        db_url,
        amqp_url,
        run: format!("relaybench_{}", std::process::id()),
    };
    let default = DEFAULT_ROUNDS_IN_FLIGHT;
    let cases = [
        Case {
            label: "1 relay, 1 round in flight",
            relays: 1,
            rounds: 1,
            ordered: false,
        },
        Case {
            label: "1 relay, default rounds",
            relays: 1,
            rounds: default,
            ordered: false,
        },
        Case {
            label: "1 relay, 4 rounds in flight",
            relays: 1,
            rounds: 4,
            ordered: false,
        },
        Case {
            label: "3 relays, default rounds",
            relays: 3,
            rounds: default,
            ordered: false,
        },
        Case {
            label: "ordered, 1 relay, 1 round",
            relays: 1,
            rounds: 1,
            ordered: true,
        },
        Case {
            label: "ordered, 1 relay, default",
            relays: 1,
            rounds: default,
            ordered: true,
        },
    ];
    println!(
        "backlog of {events} rows, leases of 500, {rounds} interleaved round(s); PostgreSQL fsync on; \
         default rounds in flight: {default}"
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut cpus: Vec<Cpu> = vec![Cpu::default(); cases.len()];
    let throughput_rounds = if only == "latency" { 0 } else { rounds };
    // `BENCH_CASES=2,3`: only those cases, numbered from 1.
    let chosen: String = env_or("BENCH_CASES", String::new());
    let chosen: Vec<usize> = chosen
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let run = |n: usize| chosen.is_empty() || chosen.contains(&(n + 1));
    for _ in 0..throughput_rounds {
        for (n, ((case, seen), used)) in cases.iter().zip(&mut rates).zip(&mut cpus).enumerate() {
            if !run(n) {
                continue;
            }
            let (rate, cpu) = bench.throughput(case, events).await;
            seen.push(rate);
            *used = cpu; // the last round's
        }
    }
    for (n, ((case, seen), used)) in cases
        .iter()
        .zip(&mut rates)
        .zip(&cpus)
        .enumerate()
        .filter(|(_, ((_, s), _))| !s.is_empty())
    {
        let (low, high) = (
            seen.iter().copied().fold(f64::INFINITY, f64::min),
            seen.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "{:<30} {:>8.0} messages/s published, confirmed and marked (range {low:.0} to {high:.0})",
            format!("{}. {}", n + 1, case.label),
            median(seen)
        );
        println!(
            "{:<30} CPU per row: relay {:.0} us, PostgreSQL {:.0} us, RabbitMQ {:.0} us; \
             {:.0}% of the cores busy",
            "",
            used.relay,
            used.postgres,
            used.rabbitmq,
            used.busy * 100.0
        );
    }
    let latency_cases = if only == "throughput" {
        &[][..]
    } else {
        &[(true, 1), (true, default), (false, default)][..]
    };
    // Interleaved over the rounds like the throughput cases; each round's
    // percentiles, then the median of each and the range of the p99.
    let mut seen: Vec<Vec<Latency>> = latency_cases.iter().map(|_| Vec::new()).collect();
    for _ in 0..rounds {
        for (&(notify, rounds), seen) in latency_cases.iter().zip(&mut seen) {
            seen.push(bench.latency(rate, seconds, notify, rounds).await);
        }
    }
    for (&(notify, rounds), seen) in latency_cases.iter().zip(&seen) {
        let mode = if notify {
            format!("LISTEN/NOTIFY, {rounds} round(s)")
        } else {
            format!("polling 100 ms, {rounds} round(s)")
        };
        let ms = |pick: fn(&Latency) -> Duration| {
            let mut all: Vec<f64> = seen.iter().map(|l| pick(l).as_secs_f64() * 1e3).collect();
            median(&mut all)
        };
        let p99s: Vec<f64> = seen.iter().map(|l| l.p99.as_secs_f64() * 1e3).collect();
        let (low, high) = (
            p99s.iter().copied().fold(f64::INFINITY, f64::min),
            p99s.iter().copied().fold(0.0, f64::max),
        );
        let achieved = seen
            .iter()
            .map(|l| l.achieved)
            .fold(f64::INFINITY, f64::min);
        let received: usize = seen.iter().map(|l| l.received).sum();
        println!(
            "commit-to-publish at {rate} msg/s (achieved at least {achieved:.0}), {mode:<28}: \
             p50 {:>6.2} ms  p99 {:>6.2} ms (range {low:.2} to {high:.2})  p999 {:>6.2} ms  \
             (medians of {} round(s), {received} messages)",
            ms(|l| l.p50),
            ms(|l| l.p99),
            ms(|l| l.p999),
            seen.len(),
        );
    }
}
