//! Wiring: the store with the ledger's handlers, submitting jobs, the in-process run
//! (SQLite or PostgreSQL, no broker) and the RabbitMQ run (consumer and relay).

use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, Topology};
use inbox_core::{
    ConsumerGroup, Envelope, InProcessTransport, OutboxStore, RetryLadder, RetryPolicy,
};
use inbox_diesel::{enqueue, Store, StoreBuilder, StoreConnection};

use super::check::{check, Report};
use super::contract::{
    run_message, DEAD_JOBS_QUEUE, EXCHANGE, JOB_DEAD, JOB_FAILED, JOB_RUN, JOB_SUCCEEDED,
    LEDGER_GROUP, RUNNER_GROUP,
};
use super::db::CreditDb;
use super::handlers::{Ledger, RunnerHandler};
use super::runner::Mix;
use crate::usage::Rng;

/// Errors of the example's runs.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The schema the example's tables (and the store's) live in on PostgreSQL, unless
/// `CREDIT_SCHEMA` says otherwise.
pub const DEFAULT_SCHEMA: &str = "credit";

/// How a run is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// `postgres://...`, or an SQLite path (`sqlite://...`, `file:...`, a plain path).
    pub database_url: String,
    /// PostgreSQL: the schema of every table (default [`DEFAULT_SCHEMA`]).
    pub schema: String,
    /// Prefix of the exchange and queue names (`INBOX_PREFIX`).
    pub prefix: String,
    /// The job's retry policy.
    pub job_policy: RetryPolicy,
    /// The simulated runner's outcomes.
    pub mix: Mix,
}

impl Config {
    /// The exchange's name, with the prefix.
    pub fn exchange(&self) -> String {
        format!("{}{EXCHANGE}", self.prefix)
    }

    /// The ledger's settings.
    pub fn ledger(&self) -> Ledger {
        Ledger {
            exchange: self.exchange(),
            job_policy: self.job_policy,
        }
    }
}

/// The job retry policy when none is given: 4 attempts, 200 ms doubling to 5 s.
pub fn default_job_policy() -> RetryPolicy {
    RetryPolicy::new(4, Duration::from_millis(200), Duration::from_secs(5))
        .unwrap_or_else(|_| unreachable!("valid literal policy"))
}

/// Which handlers a store gets.
#[derive(Clone, Copy, Debug)]
pub struct Roles {
    /// `credit.ledger`: `job.failed`, `job.succeeded`.
    pub ledger: bool,
    /// `credit.runner`: `job.run`.
    pub runner: bool,
}

/// Builds the store (the framework's migrations and schema check, in the example's
/// schema on PostgreSQL), then applies the example's own migrations.
pub fn open_store<C: StoreConnection + CreditDb>(
    config: &Config,
    roles: Roles,
    ladder: Option<RetryLadder>,
) -> Result<Store<C>, BoxError> {
    if C::BACKEND == inbox_diesel::Backend::Postgres {
        create_schema(config)?;
    }
    let mut builder = store_builder::<C>(config, roles);
    if let Some(ladder) = ladder {
        builder = builder.retry_ladder(ladder);
    }
    build_store(builder)
}

/// Creates the PostgreSQL schema under an advisory lock: two processes starting at
/// once on a new schema would otherwise race in `CREATE SCHEMA IF NOT EXISTS`, which
/// is not safe against a concurrent creation (the loser fails on
/// `pg_namespace_nspname_index`).
fn create_schema(config: &Config) -> Result<(), BoxError> {
    use diesel::connection::SimpleConnection;
    use diesel::Connection;
    let schema = &config.schema;
    let valid = !schema.is_empty()
        && schema.len() <= 63
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        return Err(format!(
            "CREDIT_SCHEMA must be 1 to 63 characters of [a-z0-9_] starting with a letter or _, \
             found {schema:?}"
        )
        .into());
    }
    let url = &config.database_url;
    let mut conn = diesel::PgConnection::establish(url).map_err(|e| {
        format!(
            "could not connect to {}: {}",
            inbox_diesel::redact(url),
            inbox_core::RedactedError::new(&e, url)
        )
    })?;
    conn.transaction(|conn| {
        conn.batch_execute(&format!(
            "SELECT pg_advisory_xact_lock(hashtext('credit_ledger.create_schema')); \
             CREATE SCHEMA IF NOT EXISTS \"{schema}\""
        ))
    })?;
    Ok(())
}

/// The store's builder with the handlers of `roles` (in [`Config::schema`] on
/// PostgreSQL), for a caller that sets more (a clock, a pool size).
pub fn store_builder<C: StoreConnection + CreditDb>(
    config: &Config,
    roles: Roles,
) -> StoreBuilder<C> {
    let mut builder = Store::<C>::builder(config.database_url.clone()).pool_size(6);
    if C::BACKEND == inbox_diesel::Backend::Postgres {
        builder = builder.schema(config.schema.clone());
    }
    if roles.ledger {
        let (failed, succeeded) = config.ledger().handlers();
        builder = builder.handler(failed).handler(succeeded);
    }
    if roles.runner {
        builder = builder.handler(RunnerHandler::new(config.exchange(), config.mix));
    }
    builder
}

/// Builds the store with the example's own migrations as its setup: they run right
/// after the framework's, under the same migration lock, so processes that start at
/// once on a fresh database all start.
pub fn build_store<C: StoreConnection + CreditDb>(
    builder: StoreBuilder<C>,
) -> Result<Store<C>, BoxError> {
    Ok(builder
        .setup(|conn: &mut C| conn.migrate_credit())
        .build()?)
}

/// Submits `count` jobs of `user` at `cost`: each one transaction that inserts the
/// job, appends its charge and enqueues `job.run` attempt 1. Returns the job ids.
pub fn submit<C: StoreConnection + CreditDb>(
    store: &Store<C>,
    exchange: &str,
    user: &str,
    cost: i64,
    count: u32,
) -> Result<Vec<String>, BoxError> {
    let mut conn = store.connection()?;
    let mut ids = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let job_id = super::contract::new_job_id();
        let now = store.now();
        conn.write_transaction::<_, BoxError, _>(|conn| {
            conn.insert_job(&job_id, user, cost, now)?;
            enqueue(conn, &run_message(exchange, &job_id, 1), now)?;
            Ok(())
        })?;
        ids.push(job_id);
    }
    Ok(ids)
}

/// The invariants and summary over a consistent snapshot of the tables.
pub fn check_store<C: StoreConnection + CreditDb>(store: &Store<C>) -> Result<Report, BoxError> {
    let (jobs, ledger) = store.connection()?.snapshot()?;
    Ok(check(&jobs, &ledger))
}

/// Submits `jobs` jobs over 5 users with costs 1 to 100, as the simulation does.
fn submit_simulated<C: StoreConnection + CreditDb>(
    store: &Store<C>,
    exchange: &str,
    jobs: u32,
    seed: u64,
) -> Result<(), BoxError> {
    let mut rng = Rng::new(seed);
    for _ in 0..jobs {
        let user = format!("user-{}", 1 + rng.below(5));
        let cost = 1 + rng.below(100) as i64;
        submit(store, exchange, &user, cost, 1)?;
    }
    Ok(())
}

/// What the in-process run did besides the ledger.
#[derive(Clone, Copy, Debug, Default)]
pub struct InProcessStats {
    /// Deliveries handed to the store (duplicates included).
    pub delivered: u64,
    /// Duplicate deliveries acked without running a handler.
    pub duplicates: u64,
    /// Signals dead-lettered by the inbox.
    pub dead_lettered: u64,
    /// `job.dead` messages relayed (kept for inspection, not consumed).
    pub dead_jobs: u64,
}

/// `simulate N` without a broker: submits `jobs` jobs, then relays the outbox into
/// the in-process transport (delivering some messages twice, some as redeliveries)
/// and runs the ledger and the runner until nothing is left to do.
pub fn simulate_in_process<C: StoreConnection + CreditDb>(
    config: &Config,
    jobs: u32,
    timeout: Duration,
) -> Result<(Report, InProcessStats), BoxError> {
    let roles = Roles {
        ledger: true,
        runner: true,
    };
    let store = open_store::<C>(config, roles, None)?;
    submit_simulated(&store, &config.exchange(), jobs, config.mix.seed)?;
    let mut transport = InProcessTransport::new(store.clone()).batch_size(20);
    let mut rng = Rng::new(config.mix.seed ^ 0x5eed);
    let mut dead_jobs = 0;
    let started = Instant::now();
    loop {
        let lease = store.lease("credit-simulate", 500, Duration::from_secs(30))?;
        if let Some(row) = lease.unreadable.first() {
            return Err(format!("outbox row {} cannot be read: {}", row.id, row.error).into());
        }
        let mut published = Vec::with_capacity(lease.rows.len());
        for row in &lease.rows {
            published.push(row.id);
            if row.message.message_type == JOB_DEAD {
                dead_jobs += 1;
                continue;
            }
            let envelope = row.message.to_envelope();
            // The broker delivers some messages twice, some of them as redeliveries.
            let copies: Vec<Envelope> = match rng.below(10) {
                0 => vec![envelope.clone(), envelope.redelivered()],
                1 => vec![envelope.clone(), envelope],
                _ => vec![envelope],
            };
            for copy in copies {
                transport.publish(copy)?;
            }
        }
        store.mark_published("credit-simulate", &published)?;
        transport.run_until_idle()?;
        if lease.rows.is_empty() {
            if store.oldest_unpublished_age()?.is_none() {
                break;
            }
            if started.elapsed() > timeout {
                return Err(format!("the jobs did not settle within {timeout:?}").into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let t = transport.stats();
    let stats = InProcessStats {
        delivered: t.delivered,
        duplicates: t.duplicates,
        dead_lettered: t.dead_lettered,
        dead_jobs,
    };
    Ok((check_store(&store)?, stats))
}

/// The broker topology of the example: the exchange `jobs`, the queues of both
/// consumer groups (so `job.run` waits for a runner even while none runs).
pub fn topology(prefix: &str, ladder: RetryLadder) -> Result<Topology, BoxError> {
    let group = |name| ConsumerGroup::new(name);
    Ok(Topology::new(EXCHANGE)?
        .prefix(prefix)?
        .ladder(ladder)
        .group(group(RUNNER_GROUP)?, [JOB_RUN])
        .group(group(LEDGER_GROUP)?, [JOB_FAILED, JOB_SUCCEEDED]))
}

/// The queue `job.dead` messages wait in (no consumer), with the prefix.
pub fn dead_jobs_queue(prefix: &str) -> String {
    format!("{prefix}{DEAD_JOBS_QUEUE}")
}

/// The retry tiers of the handlers' own failures on RabbitMQ.
pub fn ladder() -> RetryLadder {
    RetryLadder::new([
        Duration::from_secs(1),
        Duration::from_secs(5),
        Duration::from_secs(30),
    ])
    .unwrap_or_default()
}

/// Declares [`topology`] and the dead-jobs queue bound to `job.dead`.
pub async fn declare(amqp_url: &str, prefix: &str) -> Result<(), BoxError> {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let conn = lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default())
        .await
        .map_err(|e| {
            format!(
                "could not connect to {}: {}",
                inbox_core::redact_url(amqp_url),
                inbox_core::RedactedError::new(&e, amqp_url)
            )
        })?;
    let result = async {
        let topology = topology(prefix, ladder())?;
        topology.declare(&conn).await?;
        let channel = conn.create_channel().await?;
        let queue = dead_jobs_queue(prefix);
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await?;
        channel
            .queue_bind(
                queue.as_str().into(),
                topology.exchange().as_str().into(),
                JOB_DEAD.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let _ = channel.close(200, "declared".into()).await;
        Ok::<_, BoxError>(())
    }
    .await;
    let _ = conn.close(200, "declared".into()).await;
    result
}

/// Messages ready in the example's group queues (not counting unacked ones).
pub async fn ready_messages(channel: &lapin::Channel, prefix: &str) -> Result<u64, BoxError> {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let topology = topology(prefix, ladder())?;
    let mut total = 0u64;
    for group in topology.groups() {
        let queue = channel
            .queue_declare(
                topology.queue(group).as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        total += u64::from(queue.message_count());
    }
    Ok(total)
}

/// `consume`: the ledger consumer (and with `runner` the simulated runner) on
/// RabbitMQ, plus a relay of the outbox, until `shutdown`.
pub async fn consume<C: StoreConnection + CreditDb>(
    config: Config,
    amqp_url: String,
    runner: bool,
    shutdown: CancellationToken,
) -> Result<ConsumeStats, BoxError> {
    let roles = Roles {
        ledger: true,
        runner,
    };
    let cfg = config.clone();
    let store = tokio::task::spawn_blocking(move || open_store::<C>(&cfg, roles, Some(ladder())))
        .await?
        .map_err(|e| format!("startup failed: {e}"))?;
    let store = Arc::new(store);
    declare(&amqp_url, &config.prefix).await?;
    let topology = Topology::new(EXCHANGE)?
        .prefix(config.prefix.clone())?
        .ladder(ladder());
    // One delivery per transaction: each touches one job row, so concurrent
    // transactions never lock two jobs in opposite orders.
    let consumer = Consumer::new(amqp_url.clone(), Arc::clone(&store), topology).with_settings(
        ConsumerSettings::default()
            .workers(4)
            .prefetch(20)
            .batch(1, Duration::from_millis(1))
            .connection_name("credit_ledger consume"),
    );
    let consumer_stats = consumer.stats();
    let relay = Relay::new(amqp_url, Arc::clone(&store)).with_settings(
        RelaySettings::default()
            .poll_interval(Duration::from_millis(100))
            .connection_name("credit_ledger relay"),
    );
    let relay_stats = relay.stats();
    let stop = shutdown.clone();
    let mut consuming = tokio::spawn(consumer.run(shutdown.clone()));
    let mut relaying = tokio::spawn(relay.run(shutdown.clone()));
    // Whichever ends first (an error, or the shutdown) ends the other.
    let (first, second) = tokio::select! {
        r = &mut consuming => (r, relaying),
        r = &mut relaying => (r, consuming),
    };
    stop.cancel();
    for result in [first, second.await] {
        match result {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(err.into()),
            Err(join) => return Err(join.into()),
        }
    }
    let c = consumer_stats.snapshot();
    Ok(ConsumeStats {
        received: c.received,
        processed: c.processed,
        duplicates: c.duplicates,
        dead_lettered: c.dead_lettered + c.malformed + c.delivery_limit,
        published: relay_stats.snapshot().published,
    })
}

/// What a `consume` did.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConsumeStats {
    /// Deliveries received.
    pub received: u64,
    /// Deliveries whose handler committed.
    pub processed: u64,
    /// Duplicates acked without running a handler.
    pub duplicates: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Outbox rows this process's relay published.
    pub published: u64,
}

/// `simulate N` on RabbitMQ: a consumer with the runner and a relay in this process,
/// `jobs` jobs submitted, run until every job is settled, the outbox empty, the queues
/// empty and nothing received for a while.
pub async fn simulate_amqp<C: StoreConnection + CreditDb>(
    config: Config,
    amqp_url: String,
    jobs: u32,
    timeout: Duration,
) -> Result<(Report, ConsumeStats), BoxError> {
    let cfg = config.clone();
    let store = tokio::task::spawn_blocking(move || {
        open_store::<C>(
            &cfg,
            Roles {
                ledger: false,
                runner: false,
            },
            None,
        )
    })
    .await??;
    let store = Arc::new(store);
    let shutdown = CancellationToken::new();
    declare(&amqp_url, &config.prefix).await?;
    let running = tokio::spawn(consume::<C>(
        config.clone(),
        amqp_url.clone(),
        true,
        shutdown.clone(),
    ));
    let submitter = Arc::clone(&store);
    let (exchange, seed) = (config.exchange(), config.mix.seed);
    tokio::task::spawn_blocking(move || submit_simulated(&submitter, &exchange, jobs, seed))
        .await??;
    let counter =
        lapin::Connection::connect(&amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = counter.create_channel().await?;
    let started = Instant::now();
    let mut quiet = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if running.is_finished() {
            break;
        }
        let s = Arc::clone(&store);
        let (report, unpublished) = tokio::task::spawn_blocking(move || {
            Ok::<_, BoxError>((check_store(&s)?, s.oldest_unpublished_age()?))
        })
        .await??;
        let ready = ready_messages(&channel, &config.prefix).await?;
        if report.pending == 0 && unpublished.is_none() && ready == 0 {
            quiet += 1;
        } else {
            quiet = 0;
        }
        // A second of quiet: in-flight signals (a late timeout) have landed.
        if quiet >= 5 {
            break;
        }
        if started.elapsed() > timeout {
            shutdown.cancel();
            let _ = running.await;
            return Err(format!(
                "the jobs did not settle within {timeout:?} ({} pending)",
                report.pending
            )
            .into());
        }
    }
    let _ = channel.close(200, "done".into()).await;
    let _ = counter.close(200, "done".into()).await;
    shutdown.cancel();
    let stats = running.await??;
    let report = tokio::task::spawn_blocking(move || check_store(&store)).await??;
    Ok((report, stats))
}
