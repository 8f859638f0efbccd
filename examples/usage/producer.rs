//! `cargo run --example usage_producer`: the producer half of the round trip.
//!
//! Writes `USAGE_EVENTS` (default 1,000) usage ledger rows, each with its
//! `usage.recorded` event enqueued on the outbox in the same transaction, then relays
//! the outbox to the topic exchange `billing` with publisher confirms until it is
//! empty. The events' days are spread over today (UTC) and the two days before it
//! (relative days), so a two-day rebuild window always holds data. Run
//! `usage_consumer` beside it (same `DATABASE_URL`, `AMQP_URL`,
//! `INBOX_PREFIX`) and its `daily_usage` ends equal to the ledger's sums: outbox ->
//! broker -> inbox, every effect once. `AMQP_URL` may be `amqps://...` with the
//! feature `rustls` of `inbox-examples`; `AMQP_CA_CERT` names a PEM file of CA
//! certificates the relay trusts besides the system's roots.
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default
//! [`inbox_examples::DEFAULT_LOG_FILTER`]), as JSON lines with `INBOX_LOG_FORMAT=json`.
//! With `INBOX_METRICS_ADDR` (`host:port`), the relay's metrics are served at
//! `/metrics` there (see [`inbox_examples::scrape`]).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Date};
use diesel::PgConnection;
use inbox_amqp::{cancel_on_signals, CancellationToken, Relay, RelaySettings, Topology};
use inbox_core::{OutboxMessage, OutboxStore};
use inbox_diesel::{enqueue, Store};
use inbox_examples::usage::{
    create_usage_tables, ledger_event_key, Rng, UsageRecorded, MESSAGE_TYPE,
};

#[tokio::main]
async fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("usage_producer: {}", inbox_core::ErrorChain(&*err));
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    inbox_examples::scrape::serve_from_env("usage_producer")
        .await
        .map_err(|e| e.to_string())?;
    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL must name the PostgreSQL database (postgres://...)")?;
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let prefix = std::env::var("INBOX_PREFIX").unwrap_or_default();
    let events: u64 = std::env::var("USAGE_EVENTS")
        .ok()
        .map(|n| n.parse())
        .transpose()
        .map_err(|e| format!("USAGE_EVENTS must be a number: {e}"))?
        .unwrap_or(1_000);
    let exchange = Topology::new("billing")?.prefix(prefix)?.exchange();

    let store = Arc::new(
        tokio::task::spawn_blocking(move || {
            Store::<PgConnection>::builder(database_url)
                // Under the migration lock: a consumer starting at once creates the
                // ledger too.
                .setup(create_usage_tables)
                .build()
        })
        .await??,
    );
    let writer = Arc::clone(&store);
    let exchange_name = exchange.clone();
    tokio::task::spawn_blocking(move || write_ledger(&writer, &exchange_name, events))
        .await?
        .map_err(|e| e.to_string())?;
    println!("usage_producer: {events} ledger rows and events committed; relaying to {exchange}");

    let shutdown = cancel_on_signals(CancellationToken::new());
    let mut settings = RelaySettings::default().poll_interval(Duration::from_millis(200));
    if let Some(ca) = inbox_amqp::ca_cert_from_env() {
        settings = settings.ca_cert(ca);
    }
    let relay = Relay::new(amqp_url, Arc::clone(&store)).with_settings(settings);
    let stats = relay.stats();
    let relaying = tokio::spawn(relay.run(shutdown.clone()));
    loop {
        let store = Arc::clone(&store);
        let left = tokio::task::spawn_blocking(move || store.oldest_unpublished_age()).await??;
        if left.is_none() || shutdown.is_cancelled() || relaying.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    relaying.await??;
    let s = stats.snapshot();
    println!(
        "usage_producer: published {}, returned {}, nacked {}",
        s.published, s.returned, s.nacked
    );
    Ok(())
}

/// One business transaction per event: the ledger row and its outbox message commit
/// together, or neither does.
fn write_ledger(
    store: &Store<PgConnection>,
    exchange: &str,
    events: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = store.connection()?;
    let mut rng = Rng::new(std::process::id().into());
    for _ in 0..events {
        // Today (UTC) or one of the two days before it.
        let today = store.now().date_naive();
        let day = today
            .checked_sub_days(chrono::Days::new(rng.below(3)))
            .ok_or("no date three days before today")?;
        let event = UsageRecorded {
            user_id: 1 + rng.below(20) as i64,
            day,
            amount: 1 + rng.below(100) as i64,
        };
        let now = store.now();
        conn.transaction::<_, Box<dyn std::error::Error + Send + Sync>, _>(|conn| {
            let id: i64 = diesel::select(diesel::dsl::sql::<BigInt>(
                "nextval(pg_get_serial_sequence('usage_ledger', 'id'))",
            ))
            .get_result(conn)?;
            diesel::sql_query(
                "INSERT INTO usage_ledger (id, user_id, day, amount) VALUES ($1, $2, $3, $4)",
            )
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(event.user_id)
            .bind::<Date, _>(event.day)
            .bind::<BigInt, _>(event.amount)
            .execute(conn)?;
            // The key comes from the ledger row: a retried transaction gets a new row,
            // and so a new key; a re-sent event of this row always has this one.
            let key = ledger_event_key(id);
            let message =
                OutboxMessage::new(key, exchange, MESSAGE_TYPE, serde_json::to_vec(&event)?);
            enqueue(conn, &message, now)?;
            Ok(())
        })?;
    }
    Ok(())
}
