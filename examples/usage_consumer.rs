//! `cargo run --example usage_consumer`: the usage projection on PostgreSQL + RabbitMQ.
//!
//! Consumes `usage.recorded` events from the topic exchange `billing` as consumer group
//! `billing.daily-usage` into `daily_usage(user_id, day, total)`, declaring its own
//! topology; it also runs the canary handler (group `inbox.canary`), which `inbox
//! selftest` sends its canaries to. Runs until SIGTERM or ctrl-c, then drains and exits 0; exits 1 with the
//! error when startup fails (no database, a schema that fails verification, a broker
//! that cannot be reached, a conflicting topology).
//!
//! Environment: `DATABASE_URL` (required, `postgres://...`), `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`), `INBOX_PREFIX` (optional prefix of the
//! exchange and queue names), `INBOX_RETRY_LADDER` (the retry tiers, comma-separated
//! durations such as `50ms,200ms`; default the framework's ladder),
//! `INBOX_MAX_ATTEMPTS` (failures before a message is dead-lettered; default the
//! framework's retry policy's), `RUST_LOG` (log filter; default
//! [`inbox_examples::DEFAULT_LOG_FILTER`]: the inbox crates at `info`, the rest at
//! `warn`).

use std::process::ExitCode;
use std::sync::Arc;

use diesel::PgConnection;
use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_core::{parse_ladder, RetryLadder, RetryPolicy};
use inbox_diesel::Store;
use inbox_examples::usage::{DailyUsage, UsageDb};

#[tokio::main]
async fn main() -> ExitCode {
    inbox_examples::init_logging();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("usage_consumer: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL must name the PostgreSQL database (postgres://...)")?;
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let prefix = std::env::var("INBOX_PREFIX").unwrap_or_default();

    // The store records the delay each retry really waits: the tier's.
    let ladder = match std::env::var("INBOX_RETRY_LADDER") {
        Ok(text) => parse_ladder(&text).map_err(|e| format!("INBOX_RETRY_LADDER: {e}"))?,
        Err(_) => RetryLadder::default(),
    };
    let policy = match std::env::var("INBOX_MAX_ATTEMPTS") {
        Ok(text) => {
            let n: u32 = text.trim().parse().map_err(|_| {
                format!("INBOX_MAX_ATTEMPTS: expected a whole number of at least 1, found {text:?}")
            })?;
            let default = RetryPolicy::default();
            RetryPolicy::new(n, default.initial(), default.max())
                .map_err(|e| format!("INBOX_MAX_ATTEMPTS: {e}"))?
        }
        Err(_) => RetryPolicy::default(),
    };
    let store_ladder = ladder.clone();
    let store = tokio::task::spawn_blocking(
        move || -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
            let store = Store::<PgConnection>::builder(database_url)
                .retry_ladder(store_ladder)
                .handler(DailyUsage::new(policy))
                // `inbox selftest` sends canaries through this consumer.
                .handler(inbox_diesel::Canary::new())
                .build()?;
            store.connection()?.create_daily_usage()?;
            Ok(store)
        },
    )
    .await?
    .map_err(|e| format!("startup failed: {e}"))?;

    let topology = Topology::new("billing")?.prefix(prefix)?.ladder(ladder);
    let consumer = Consumer::new(amqp_url, Arc::new(store), topology)
        .with_settings(ConsumerSettings::default().connection_name("usage_consumer"));
    let stats = consumer.stats();
    println!("usage_consumer: consuming; stop with ctrl-c or SIGTERM");
    consumer
        .run(cancel_on_signals(CancellationToken::new()))
        .await?;
    let s = stats.snapshot();
    println!(
        "usage_consumer: stopped after {} deliveries: {} processed, {} duplicates, {} retried, {} dead-lettered",
        s.received,
        s.processed,
        s.duplicates,
        s.retried,
        s.dead_lettered + s.malformed + s.delivery_limit
    );
    Ok(())
}
