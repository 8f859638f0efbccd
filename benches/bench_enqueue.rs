//! `cargo run --release -p inbox-benches --bin bench_enqueue`: what ordering keys cost a producer
//! on PostgreSQL.
//!
//! An enqueue with an ordering key first takes the key's ordering lock (one of
//! `ORDERING_LOCK_STRIPES` transaction-scoped advisory locks) and holds it until the
//! transaction commits, so the key's rows draw their ids in commit order. This
//! measures committed enqueues per second, each its own transaction (one business
//! row and one enqueue), from `BENCH_WRITERS` threads (default 4) and from one:
//!
//! - `none`: no ordering key (the baseline: no lock);
//! - `hot key`: every transaction enqueues the same key (their enqueue-to-commit
//!   sections, commit included, take turns);
//! - `many keys`: a key of its own per transaction, spread over the stripes (two
//!   writers meet only when their keys share a stripe);
//! - `bulk`: `enqueue_all` of 100 messages per transaction, without keys and with
//!   100 distinct keys (messages per second).
//!
//! Each figure is the median of `BENCH_ROUNDS` rounds (default 3) of
//! `BENCH_TRANSACTIONS` transactions per writer (default 1,000; a tenth of that for
//! the bulk rows). Figures only: no timing is asserted. `DATABASE_URL` as for the
//! tests; a fresh schema per run, dropped afterwards. SQLite takes no lock (one
//! writer at a time already orders its ids), so it is not measured.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use diesel::connection::SimpleConnection;
use diesel::{Connection as _, PgConnection};
use inbox_benches::{env_or, median, service_urls, SchemaGuard};
use inbox_core::{MessageKey, OutboxMessage, RedactedError};
use inbox_diesel::{enqueue, enqueue_all, Store, ORDERING_LOCK_STRIPES};

/// Which ordering key a transaction's messages carry.
#[derive(Clone, Copy)]
enum Keys {
    None,
    Hot,
    Many,
}

impl Keys {
    fn key(self, writer: usize, txn: usize, message: usize) -> Option<String> {
        match self {
            Keys::None => None,
            Keys::Hot => Some("hot".to_owned()),
            Keys::Many => Some(format!("user-{writer}-{txn}-{message}")),
        }
    }
}

struct Scenario {
    name: &'static str,
    keys: Keys,
    per_txn: usize,
}

const SCENARIOS: [Scenario; 5] = [
    Scenario {
        name: "none",
        keys: Keys::None,
        per_txn: 1,
    },
    Scenario {
        name: "hot key",
        keys: Keys::Hot,
        per_txn: 1,
    },
    Scenario {
        name: "many keys",
        keys: Keys::Many,
        per_txn: 1,
    },
    Scenario {
        name: "bulk, none",
        keys: Keys::None,
        per_txn: 100,
    },
    Scenario {
        name: "bulk, many keys",
        keys: Keys::Many,
        per_txn: 100,
    },
];

fn main() {
    let (db_url, _) = service_urls();
    let writers: usize = env_or("BENCH_WRITERS", 4);
    let rounds: usize = env_or("BENCH_ROUNDS", 3);
    let transactions: usize = env_or("BENCH_TRANSACTIONS", 1_000);
    let schema = format!("bench_enqueue_{}", std::process::id());
    let _guard = SchemaGuard::new(&db_url, &schema);
    let store = Arc::new(
        Store::<PgConnection>::builder(db_url.clone())
            .schema(schema.clone())
            .pool_size(u32::try_from(writers + 1).unwrap_or(u32::MAX))
            .build()
            .unwrap_or_else(|e| panic!("store: {}", RedactedError::new(&e, &db_url))),
    );
    store
        .connection()
        .expect("connection")
        .batch_execute("CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL)")
        .expect("ledger table");

    println!(
        "enqueue rate on PostgreSQL, one transaction = one ledger row + the enqueue; \
         {ORDERING_LOCK_STRIPES} ordering lock stripes; median of {rounds} rounds"
    );
    println!("| scenario | writers | messages/txn | transactions/s | messages/s | vs none |");
    println!("|---|---|---|---|---|---|");
    for threads in [1, writers] {
        let mut baseline = [0.0_f64; 2];
        for scenario in &SCENARIOS {
            let txns = if scenario.per_txn > 1 {
                (transactions / 10).max(1)
            } else {
                transactions
            };
            let rates: Vec<f64> = (0..rounds)
                .map(|round| {
                    clear(&store);
                    run(&store, scenario, threads, txns, round)
                })
                .collect();
            let rate = median(rates);
            let slot = usize::from(scenario.per_txn > 1);
            if matches!(scenario.keys, Keys::None) {
                baseline[slot] = rate;
            }
            println!(
                "| {} | {threads} | {} | {rate:.0} | {:.0} | {:.2} |",
                scenario.name,
                scenario.per_txn,
                rate * scenario.per_txn as f64,
                rate / baseline[slot],
            );
        }
    }
}

/// Empties the outbox and the ledger between rounds, so each round starts alike.
fn clear(store: &Store<PgConnection>) {
    store
        .connection()
        .expect("connection")
        .batch_execute("TRUNCATE outbox_messages, ledger")
        .expect("truncate");
}

/// Committed transactions per second of `threads` writers, `txns` each.
fn run(
    store: &Arc<Store<PgConnection>>,
    scenario: &Scenario,
    threads: usize,
    txns: usize,
    round: usize,
) -> f64 {
    let start = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|writer| {
            let store = Arc::clone(store);
            let start = Arc::clone(&start);
            let (keys, per_txn) = (scenario.keys, scenario.per_txn);
            std::thread::spawn(move || {
                let mut conn = store.connection().expect("connection");
                start.wait();
                for txn in 0..txns {
                    let messages: Vec<OutboxMessage> = (0..per_txn)
                        .map(|m| {
                            let key = format!("r{round}-w{writer}-t{txn}-m{m}");
                            let msg = OutboxMessage::new(
                                MessageKey::new(key).expect("key"),
                                "bench",
                                "bench.enqueued",
                                b"{\"amount\":1}".to_vec(),
                            );
                            match keys.key(writer, txn, m) {
                                Some(k) => msg.with_ordering_key(k),
                                None => msg,
                            }
                        })
                        .collect();
                    let now = store.clock().now();
                    conn.transaction::<_, inbox_diesel::Error, _>(|conn| {
                        conn.batch_execute("INSERT INTO ledger (amount) VALUES (1)")?;
                        if let [one] = messages.as_slice() {
                            enqueue(conn, one, now)?;
                        } else {
                            enqueue_all(conn, &messages, now)?;
                        }
                        Ok(())
                    })
                    .expect("enqueue");
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    for handle in handles {
        handle.join().expect("writer");
    }
    (threads * txns) as f64 / began.elapsed().as_secs_f64()
}
