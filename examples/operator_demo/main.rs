//! `cargo run --example operator_demo -- <sqlite-file>`: a database for trying the
//! `inbox` operator commands, with no servers.
//!
//! Runs the usage projection on SQLite with the in-process transport: enqueues five
//! `usage.recorded` events on the outbox, two of them for user 0 (which the handler
//! refuses: "user 0 does not exist"), relays them, and lets the retries run out (3
//! attempts), so the file holds two dead letters of one failure group. Run again on the
//! same file, it relays whatever the outbox holds (say, replays) and processes it.

use std::process::ExitCode;
use std::time::Duration;

use chrono::NaiveDate;
use diesel::SqliteConnection;
use inbox_core::{relay_in_process, InProcessTransport, MessageKey, OutboxMessage, RetryPolicy};
use inbox_diesel::{enqueue, Store};
use inbox_examples::usage::{DailyUsage, UsageDb, UsageRecorded, MESSAGE_TYPE};

fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("operator_demo: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: operator_demo <sqlite-file>")?;
    let fresh = !std::path::Path::new(&path).exists();
    let policy = RetryPolicy::new(3, Duration::from_millis(10), Duration::from_millis(20))?;
    let store = Store::<SqliteConnection>::builder(format!("sqlite://{path}"))
        .handler(DailyUsage::new(policy))
        .setup(|conn: &mut SqliteConnection| conn.create_daily_usage())
        .build()?;
    if fresh {
        let mut conn = store.connection()?;
        let day = NaiveDate::from_ymd_opt(2026, 3, 1).ok_or("a date")?;
        for (i, user_id) in [7, 0, 8, 0, 9].into_iter().enumerate() {
            let event = UsageRecorded {
                user_id,
                day,
                amount: 10 * (i as i64 + 1),
            };
            let key = MessageKey::derive("billing", &format!("usage_ledger:{i}"), MESSAGE_TYPE);
            let msg = OutboxMessage::new(key, "billing", MESSAGE_TYPE, serde_json::to_vec(&event)?);
            enqueue(&mut conn, &msg, store.clock().now())?;
        }
    }
    let mut transport = InProcessTransport::new(store.clone());
    let relayed = relay_in_process(&store, &mut transport, "operator-demo", 100)?;
    let stats = transport.run_until_idle()?;
    println!(
        "relayed {relayed}: {} processed, {} retried, {} dead-lettered",
        stats.processed, stats.retries, stats.dead_lettered
    );
    Ok(())
}
