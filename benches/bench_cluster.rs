//! The consumer on a RabbitMQ cluster of its own (three nodes on loopback, the tests'
//! harness `inbox_test_support::rabbit_cluster`): how long it is unavailable when the
//! node leading its queue is killed, and its throughput on the cluster against one
//! node (the shared broker of `AMQP_URL`).
//!
//! Unavailability, per round: the consumer (given the three URLs) drains a queue of
//! `BENCH_EVENTS` events; after a tenth, the leader's node is killed (`kill -9`); the
//! figure is the time from the kill to the first event committed on a new connection
//! (the first processed count seen after the reconnect count rose). The node is
//! started again between rounds. The relay likewise: with the default settings and
//! the leader's URL first, it publishes `BENCH_EVENTS` rows that a producer enqueues
//! at `BENCH_RATE` a second (default 1,000), one transaction each; after a tenth are
//! published the leader is killed, and the figure is the time from the kill to the
//! first row enqueued after the kill being marked published (so no row of a round
//! confirmed before the kill counts); printed beside it, when every row was out.
//! Printed: every round, p50 and max.
//!
//! Throughput: the same drain with `ConsumerSettings::default()`, from a queue filled
//! beforehand, on the cluster (replicas on all three nodes) and on one node, rounds
//! interleaved; and one relay with `RelaySettings::default()` publishing an outbox
//! backlog of as many rows into the group's queue, on the cluster and on one node;
//! printed: msg/s per round and the median of each.
//!
//! `cargo run --release -p inbox-benches --bin bench_cluster` (as root, with RabbitMQ
//! installed); `BENCH_ROUNDS` (default 3), `BENCH_EVENTS` (default 5000),
//! `BENCH_RATE` (the relay's offered rows a second, default 1000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, Topology};
use inbox_benches::{env_or, median, service_urls};
use inbox_core::{ConsumerGroup, OutboxMessage};
use inbox_diesel::Store;
use inbox_examples::usage::{quick_policy, DailyUsage, UsageDb, Workload, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{self, confirm_channel, publish, wait_for_confirms, Outgoing};
use inbox_test_support::rabbit_cluster::RabbitCluster;
use inbox_test_support::PgFixture;

/// A store on a fresh schema of its own (dropped with the fixture).
fn store(db: &PgFixture) -> Arc<Store<PgConnection>> {
    let store = Store::<PgConnection>::builder(db.url())
        .schema(&db.schema)
        .pool_size(4)
        .handler(DailyUsage::new(quick_policy()))
        .build()
        .expect("store");
    store
        .connection()
        .expect("connection")
        .create_daily_usage()
        .expect("tables");
    Arc::new(store)
}

fn topology(tag: &str) -> Topology {
    amqp::test_topology(&amqp::unique_prefix(tag), &[50, 100])
        .group(ConsumerGroup::new(GROUP).expect("group"), [MESSAGE_TYPE])
}

/// Declares `topology` on the brokers of `urls`.
async fn declare(urls: &str, topology: &Topology) {
    let conn = inbox_amqp::connect(urls, None).await.expect("connect");
    topology.declare(&conn).await.expect("declare");
    let _ = conn.close(200, "declared".into()).await;
}

/// Declares `topology` and fills its queue with `events` events, confirmed.
async fn fill(urls: &str, topology: &Topology, events: usize, seed: u64) {
    let conn = inbox_amqp::connect(urls, None).await.expect("connect");
    topology.declare(&conn).await.expect("declare");
    let channel = confirm_channel(&conn).await;
    let exchange = topology.exchange();
    for (key, event) in &Workload::generate(events, 0, seed).events {
        let body = serde_json::to_vec(event).expect("json");
        let msg = Outgoing {
            message_id: Some(key.as_str()),
            message_type: MESSAGE_TYPE,
            body: &body,
            tenant: None,
        };
        publish(&channel, &exchange, &msg).await;
    }
    wait_for_confirms(&channel).await;
    let _ = conn.close(200, "filled".into()).await;
}

/// Deletes `topology` (its queues carry no expiry on the tiers).
async fn delete(urls: &str, topology: &Topology) {
    if let Ok(conn) = inbox_amqp::connect(urls, None).await {
        let _ = topology.delete(&conn).await;
        let _ = conn.close(200, "deleted".into()).await;
    }
}

/// One unavailability round: milliseconds from the kill to the first event
/// committed after the reconnect.
fn unavailable_once(
    runtime: &tokio::runtime::Runtime,
    cluster: &mut RabbitCluster,
    events: usize,
    round: u64,
) -> f64 {
    let db = PgFixture::new().expect("DATABASE_URL");
    let topology = topology("bench-cluster");
    let urls = cluster.url_list();
    runtime.block_on(fill(&urls, &topology, events, round));
    let queue = topology.queue(&ConsumerGroup::new(GROUP).expect("group"));
    let leader = cluster.leader_of(&queue).expect("a leader");
    let consumer = Consumer::new(urls.clone(), store(&db), topology.clone())
        .with_settings(ConsumerSettings::default().connect_timeout(Duration::from_secs(2)));
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = runtime.spawn(consumer.run(shutdown.clone()));
    let tenth = u64::try_from(events / 10).unwrap_or(1);
    while stats.snapshot().processed < tenth {
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed = Instant::now();
    cluster.kill_node(leader).expect("kill");
    let gap = loop {
        let s = stats.snapshot();
        if s.reconnects >= 1 && s.processed > tenth {
            // The count moved after the reconnect: the first commit on a new
            // connection (or a batch of the old one finishing: then the gap is
            // shorter than the real one; the reconnect count is checked first).
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(120),
            "no progress after the kill: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let all = u64::try_from(events).unwrap_or(u64::MAX);
    // Every event committed once (a redelivery of a committed one is a duplicate).
    while stats.snapshot().processed < all {
        std::thread::sleep(Duration::from_millis(5));
    }
    shutdown.cancel();
    runtime.block_on(running).expect("join").expect("consumer");
    runtime.block_on(delete(&urls, &topology));
    cluster.restart_node(leader).expect("restart");
    println!(
        "round {round}: leader node {leader} killed, unavailable {:.0} ms ({:?})",
        gap.as_secs_f64() * 1000.0,
        stats.snapshot()
    );
    gap.as_secs_f64() * 1000.0
}

/// One relay unavailability round: milliseconds from the kill of the queue's leader
/// to the first row published after the relay reconnected.
fn relay_unavailable_once(
    runtime: &tokio::runtime::Runtime,
    cluster: &mut RabbitCluster,
    events: usize,
    rate: f64,
    round: u64,
) -> f64 {
    let db = PgFixture::new().expect("DATABASE_URL");
    let topology = topology("bench-relay-kill");
    let store = store(&db);
    let urls = cluster.urls();
    runtime.block_on(declare(&cluster.url_list(), &topology));
    let queue = topology.queue(&ConsumerGroup::new(GROUP).expect("group"));
    let leader = cluster.leader_of(&queue).expect("a leader");
    let mut list = vec![urls[leader].clone()];
    list.extend(
        (0..urls.len())
            .filter(|i| *i != leader)
            .map(|i| urls[i].clone()),
    );
    let producing = {
        let (store, exchange) = (Arc::clone(&store), topology.exchange());
        std::thread::spawn(move || {
            let started = Instant::now();
            for (i, (key, event)) in Workload::generate(events, 0, 500 + round)
                .events
                .iter()
                .enumerate()
            {
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let body = serde_json::to_vec(event).expect("json");
                let msg = OutboxMessage::new(key.clone(), &exchange, MESSAGE_TYPE, body);
                let mut conn = store.connection().expect("db");
                inbox_diesel::enqueue(&mut conn, &msg, store.clock().now()).expect("enqueue");
            }
        })
    };
    let relay = Relay::new(list.join(" "), Arc::clone(&store));
    let stats = relay.stats();
    let shutdown = CancellationToken::new();
    let running = runtime.spawn(relay.run(shutdown.clone()));
    let tenth = u64::try_from(events / 10).unwrap_or(1);
    let started = Instant::now();
    while stats.snapshot().published < tenth {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the relay did not start: {:?}",
            stats.snapshot()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let at_kill = stats.snapshot().published;
    let killed = Instant::now();
    cluster.kill_node(leader).expect("kill");
    let mut db = store.connection().expect("db");
    let boundary = outbox_count(&mut db, "COALESCE(MAX(id), 0)", "TRUE");
    let published_after = format!("id > {boundary} AND published_at IS NOT NULL");
    let gap = loop {
        let s = stats.snapshot();
        if outbox_count(&mut db, "COUNT(*)", &published_after) > 0 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(120),
            "no progress after the kill: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    producing.join().expect("producer");
    let all = u64::try_from(events).unwrap_or(u64::MAX);
    while stats.snapshot().published < all {
        assert!(
            killed.elapsed() < Duration::from_secs(300),
            "the relay stalled: {:?}",
            stats.snapshot()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let all_out = killed.elapsed();
    shutdown.cancel();
    runtime.block_on(running).expect("join").expect("relay");
    runtime.block_on(delete(&cluster.url_list(), &topology));
    cluster.restart_node(leader).expect("restart");
    println!(
        "round {round}: leader node {leader} killed at {at_kill} published, relay unavailable {:.0} ms, every row out {:.1} s after the kill ({:?})",
        gap.as_secs_f64() * 1000.0,
        all_out.as_secs_f64(),
        stats.snapshot()
    );
    gap.as_secs_f64() * 1000.0
}

/// `SELECT <what> AS n FROM outbox_messages WHERE <filter>`.
fn outbox_count(conn: &mut PgConnection, what: &str, filter: &str) -> i64 {
    use diesel::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    diesel::sql_query(format!(
        "SELECT {what} AS n FROM outbox_messages WHERE {filter}"
    ))
    .get_result::<N>(conn)
    .expect("outbox count")
    .n
}

/// Drains `events` from a queue filled beforehand on `urls` with the default
/// settings; msg/s.
fn drain(runtime: &tokio::runtime::Runtime, urls: &str, events: usize, seed: u64) -> f64 {
    let db = PgFixture::new().expect("DATABASE_URL");
    let topology = topology("bench-drain");
    runtime.block_on(fill(urls, &topology, events, seed));
    let consumer = Consumer::new(urls.to_owned(), store(&db), topology.clone());
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = runtime.spawn(consumer.run(shutdown.clone()));
    let all = u64::try_from(events).unwrap_or(u64::MAX);
    while stats.snapshot().processed < all {
        std::thread::sleep(Duration::from_millis(2));
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    runtime.block_on(running).expect("join").expect("consumer");
    runtime.block_on(delete(urls, &topology));
    rate
}

/// Publishes a backlog of `rows` outbox rows (enqueued beforehand) into a group
/// queue declared on `urls`, with one relay and the default settings; msg/s.
fn relay_drain(runtime: &tokio::runtime::Runtime, urls: &str, rows: usize, seed: u64) -> f64 {
    use diesel::Connection;
    let db = PgFixture::new().expect("DATABASE_URL");
    let topology = topology("bench-relay");
    let store = store(&db);
    runtime.block_on(declare(urls, &topology));
    let exchange = topology.exchange();
    {
        let mut conn = store.connection().expect("db");
        let now = store.clock().now();
        let events = Workload::generate(rows, 0, seed).events;
        for chunk in events.chunks(500) {
            conn.transaction::<_, diesel::result::Error, _>(|conn| {
                for (key, event) in chunk {
                    let body = serde_json::to_vec(event).expect("json");
                    let msg = OutboxMessage::new(key.clone(), &exchange, MESSAGE_TYPE, body);
                    inbox_diesel::enqueue(&mut *conn, &msg, now).map_err(|e| {
                        diesel::result::Error::QueryBuilderError(e.to_string().into())
                    })?;
                }
                Ok(())
            })
            .expect("backlog");
        }
    }
    let relay = Relay::new(urls.to_owned(), Arc::clone(&store));
    let stats = relay.stats();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = runtime.spawn(relay.run(shutdown.clone()));
    let all = u64::try_from(rows).unwrap_or(u64::MAX);
    while stats.snapshot().published < all {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the relay stalled: {:?}",
            stats.snapshot()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    runtime.block_on(running).expect("join").expect("relay");
    runtime.block_on(delete(urls, &topology));
    rate
}

fn main() {
    let rounds: u64 = env_or("BENCH_ROUNDS", 3);
    let events: usize = env_or("BENCH_EVENTS", 5_000);
    let (_, one_node) = service_urls();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let started = Instant::now();
    let mut cluster = RabbitCluster::start(3).expect("cluster");
    println!(
        "cluster of 3 started in {:.1} s; {rounds} rounds of {events} events",
        started.elapsed().as_secs_f64()
    );
    let gaps: Vec<f64> = (1..=rounds)
        .map(|round| unavailable_once(&runtime, &mut cluster, events, round))
        .collect();
    report_gaps("unavailable after a leader kill", &gaps);
    let rate: f64 = env_or("BENCH_RATE", 1_000.0);
    let gaps: Vec<f64> = (1..=rounds)
        .map(|round| relay_unavailable_once(&runtime, &mut cluster, events, rate, round))
        .collect();
    report_gaps("relay unavailable after a leader kill", &gaps);
    let urls = (cluster.url_list(), one_node);
    versus(
        "throughput (defaults, prefilled queue)",
        rounds,
        &urls,
        |urls, seed| drain(&runtime, urls, events, 100 + seed),
    );
    versus(
        "relay throughput (defaults, outbox backlog)",
        rounds,
        &urls,
        |urls, seed| relay_drain(&runtime, urls, events, 300 + seed),
    );
}

/// Prints `what`'s p50 and max of `gaps` (milliseconds).
fn report_gaps(what: &str, gaps: &[f64]) {
    let max = gaps.iter().copied().fold(0.0, f64::max);
    println!(
        "{what}: p50 {:.0} ms, max {max:.0} ms over {} rounds",
        median(gaps.to_vec()),
        gaps.len()
    );
}

/// Runs `run` on the cluster's URLs and on one node's, interleaved, `rounds` times
/// (its second argument tells the runs' workloads apart); prints each round's msg/s
/// and the medians.
fn versus(
    what: &str,
    rounds: u64,
    (cluster, one): &(String, String),
    mut run: impl FnMut(&str, u64) -> f64,
) {
    let (mut on_cluster, mut on_one) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let c = run(cluster, round);
        let o = run(one, 100 + round);
        println!("{what}, round {round}: cluster {c:.0} msg/s, one node {o:.0} msg/s");
        on_cluster.push(c);
        on_one.push(o);
    }
    let (c, o) = (median(on_cluster), median(on_one));
    println!(
        "{what}: cluster {c:.0} msg/s, one node {o:.0} msg/s, ratio {:.2}",
        c / o
    );
}
