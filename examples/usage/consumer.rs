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
//! `amqp://guest:guest@127.0.0.1:5672/%2f`; `amqps://...` with the feature `rustls` of
//! `inbox-examples`), `INBOX_METRICS_ADDR` (optional `host:port`: serve `/metrics` in
//! the Prometheus text format there, see [`inbox_examples::scrape`]),
//! `INBOX_OPERATOR_GAUGES_EVERY` (how often the operator gauges are published there;
//! default `30s`), `AMQP_CA_CERT` (optional PEM file of CA certificates trusted for
//! `amqps://` besides the system's roots), `INBOX_PREFIX` (optional prefix of the
//! exchange and queue names), `INBOX_RETRY_LADDER` (the retry tiers, comma-separated
//! durations such as `50ms,200ms`; default the framework's ladder),
//! `INBOX_MAX_ATTEMPTS` (failures before a message is dead-lettered; default the
//! framework's retry policy's), `RUST_LOG` (log filter; default
//! [`inbox_examples::DEFAULT_LOG_FILTER`]: the inbox crates at `info`, the rest at
//! `warn`), `INBOX_LOG_FORMAT` (`text` or `json`), `RUST_MIN_STACK` (raised to [`inbox_amqp::frame_parse_stack`] when lower: the
//! stack lapin's frame parser needs for the deepest header table a frame holds).
//!
//! Scheduled rebuild (optional): `--rebuild-every 1h` (or `INBOX_REBUILD_EVERY=1h`;
//! units `ms`, `s`, `m`, `h`) runs the `daily_usage` rebuild beside consuming, at once
//! and then every interval, over `--rebuild-days N` (or `INBOX_REBUILD_DAYS`, default
//! 2: today, UTC, and yesterday). Runners of several consumer processes take turns: one
//! rebuilds, the others skip that run and log it.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Parser;

use diesel::PgConnection;
use inbox_amqp::{cancel_on_signals, CancellationToken, Consumer, ConsumerSettings, Topology};
use inbox_core::{parse_ladder, RetryLadder, RetryPolicy};
use inbox_diesel::rebuild::RebuildRunner;
use inbox_diesel::rebuild::Rebuilder;
use inbox_diesel::Store;
use inbox_examples::ops::ScheduleArgs;
use inbox_examples::usage::{create_usage_tables, DailyUsage, PROJECTION};

/// The usage projection on PostgreSQL + RabbitMQ (see the module docs).
#[derive(Debug, Parser)]
#[command(name = "usage_consumer", version, about)]
struct Cli {
    #[command(flatten)]
    schedule: ScheduleArgs,
}

fn main() -> ExitCode {
    // First, before any thread exists: the stack lapin's frame parser needs (see
    // `inbox_amqp::reserve_frame_stack`); a larger `RUST_MIN_STACK` of the user's is kept.
    let _ = inbox_amqp::reserve_frame_stack();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("usage_consumer: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let _logging = inbox_examples::init_logging();
        match run(cli).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("usage_consumer: {}", inbox_core::ErrorChain(&*err));
                ExitCode::FAILURE
            }
        }
    })
}

/// The consumer's settings: its connection's name, and the CA of `AMQP_CA_CERT`.
fn consumer_settings() -> ConsumerSettings {
    let settings = ConsumerSettings::default().connection_name("usage_consumer");
    match inbox_amqp::ca_cert_from_env() {
        Some(ca) => settings.ca_cert(ca),
        None => settings,
    }
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let metrics_addr = inbox_examples::scrape::serve_from_env("usage_consumer")
        .await
        .map_err(|e| e.to_string())?;
    let gauges_every = match std::env::var(inbox_examples::scrape::OPERATOR_GAUGES_EVERY_ENV) {
        Ok(text) => match inbox_core::parse_duration(&text) {
            Ok(every) if every.is_zero() => {
                return Err("INBOX_OPERATOR_GAUGES_EVERY: expected a duration above 0".into())
            }
            Ok(every) => every,
            Err(e) => return Err(format!("INBOX_OPERATOR_GAUGES_EVERY: {e}").into()),
        },
        Err(_) => inbox_examples::scrape::OPERATOR_GAUGES_EVERY,
    };
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
                .projection(DailyUsage::new(policy))
                // `inbox selftest` sends canaries through this consumer.
                .handler(inbox_diesel::operator::Canary::new())
                // Under the migration lock: a producer starting at once creates the
                // ledger too.
                .setup(create_usage_tables)
                .build()?;
            Ok(store)
        },
    )
    .await?
    .map_err(|e| format!("startup failed: {e}"))?;

    // The scheduled rebuild runs on a thread of its own beside the consumer.
    let stop_rebuilds = Arc::new(AtomicBool::new(false));
    // Refused before any background task starts: an early return after one would
    // wait for it forever.
    let topology = Topology::new("billing")?.prefix(prefix)?.ladder(ladder);

    let rebuilds = match cli.schedule.rebuild_every {
        Some(every) => {
            let runner = RebuildRunner::new(Rebuilder::new(&store, PROJECTION)?)
                .every(every)
                .window(cli.schedule.rebuild_days);
            println!(
                "usage_consumer: rebuilding {PROJECTION} every {every:?} over {} days",
                cli.schedule.rebuild_days
            );
            let stop = Arc::clone(&stop_rebuilds);
            Some(tokio::task::spawn_blocking(move || runner.run(&stop)))
        }
        None => None,
    };

    // With `/metrics` served, the operator gauges too, on a thread of their own.
    let gauges = metrics_addr.map(|_| {
        let operator = inbox_diesel::operator::Operator::new(&store);
        let stop = Arc::clone(&stop_rebuilds);
        tokio::task::spawn_blocking(move || {
            inbox_examples::scrape::publish_operator_gauges(&operator, gauges_every, &stop)
        })
    });

    let consumer =
        Consumer::new(amqp_url, Arc::new(store), topology).with_settings(consumer_settings());
    let stats = consumer.stats();
    println!("usage_consumer: consuming; stop with ctrl-c or SIGTERM");
    let consumed = consumer
        .run(cancel_on_signals(CancellationToken::new()))
        .await;
    stop_rebuilds.store(true, Ordering::Relaxed);
    if let Some(rebuilds) = rebuilds {
        rebuilds.await?;
    }
    if let Some(gauges) = gauges {
        gauges.await?;
    }
    consumed?;
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
