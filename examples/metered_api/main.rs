//! `cargo run --example metered_api`: the metered speech API on PostgreSQL, with Redis
//! as an advisory cache and settlements relayed in-process (or through RabbitMQ when
//! `AMQP_URL` is set).
//!
//! Prints `metered_api: admin on http://ADDR` and then
//! `metered_api: listening on http://ADDR` once it serves; runs until SIGTERM or
//! ctrl-c; exits 1 with the error when startup fails, and when its settlement
//! consumer or relay stops for good (a service that cannot settle must not take
//! money). Settings (see the README): `DATABASE_URL` (required),
//! `METERED_ADMIN_TOKEN` (required), `METERED_ADMIN_ADDR`, `REDIS_URL`, `LISTEN_ADDR`,
//! `METERED_HEADER_TIMEOUT_MS`, `METERED_IDLE_TIMEOUT_MS`, `METERED_MAX_CONNECTIONS`,
//! `METERED_AUTH_FAILURE_LIMIT`, `METERED_SCHEMA`,
//! `METERED_DEADLINE_MS`, `METERED_SETTLE_MARGIN_MS`, `METERED_CHUNK_DELAY_MS`,
//! `METERED_RATE_LIMIT`, `METERED_MAX_CONCURRENCY`, `METERED_POOL_SIZE`,
//! `METERED_RELAY_POLL_MS`, `METERED_REDIS_PROBE_MS`, `METERED_IDEMPOTENCY_RETENTION_MS`,
//! `AMQP_URL`, `METERED_AMQP_PREFIX`.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, Topology};
use inbox_core::{Clock, SystemClock};
use inbox_diesel::Store;
use inbox_examples::metered::app::{App, ServiceStats};
use inbox_examples::metered::auth_limit::AuthFailures;
use inbox_examples::metered::config::Config;
use inbox_examples::metered::db;
use inbox_examples::metered::http::{admin_router, router};
use inbox_examples::metered::log::escaped;
use inbox_examples::metered::redis::{Advisory, Redis};
use inbox_examples::metered::serve::{self, ConnectionStats, Limits};
use inbox_examples::metered::settle::{self, SettlementStats, Settler};

/// Connections the admin listener holds at most.
const ADMIN_MAX_CONNECTIONS: usize = 16;

/// The first fatal end of a background task: the service stops and exits 1.
#[derive(Clone, Default)]
struct Fatal(Arc<Mutex<Option<String>>>);

impl Fatal {
    fn set(&self, why: String, shutdown: &CancellationToken) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(why);
        shutdown.cancel();
    }

    fn take(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let _logging = inbox_examples::init_logging();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("metered_api: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let config = Config::from_env()?;
    // First: the counters below register with the recorder installed at their creation.
    let metrics = inbox_examples::scrape::install_recorder().map_err(|e| e.to_string())?;
    inbox_examples::metered::meter::describe();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let settlements = Arc::new(SettlementStats::default());
    let settler = Settler::new(Arc::clone(&clock), Arc::clone(&settlements));
    let (url, schema, pool_size) = (
        config.database_url.clone(),
        config.schema.clone(),
        config.pool_size,
    );
    let store_clock = Arc::clone(&clock);
    let store = tokio::task::spawn_blocking(
        move || -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
            let store = Store::<PgConnection>::builder(url)
                .schema(schema)
                .pool_size(pool_size)
                .clock(store_clock)
                .handler(settler)
                .build()?;
            // Under a transaction-scoped advisory lock of the example's own: two
            // instances starting at once on a fresh database both start.
            db::create_schema(&mut *store.connection()?)?;
            Ok(store)
        },
    )
    .await?
    .map_err(|e| format!("startup failed: {e}"))?;

    let shutdown = CancellationToken::new();
    let fatal = Fatal::default();
    let stop_relay = Arc::new(AtomicBool::new(false));
    let mut background = Vec::new();
    let exchange = match &config.amqp_url {
        None => {
            let (store, poll, stop) = (store.clone(), config.relay_poll, Arc::clone(&stop_relay));
            background.push(tokio::task::spawn_blocking(move || {
                settle::run_in_process(store, poll, stop)
            }));
            "metered".to_owned()
        }
        Some(amqp) => {
            // The broker must take this service's credentials before it serves: a
            // service that cannot settle would leave a crash between debit and
            // refund unhealed. The consumer and relay then fail at once on their
            // own first connection too, and any fatal end of theirs stops the service.
            let probe = inbox_amqp::connect(amqp, None)
                .await
                .map_err(|e| format!("startup failed: the settlement broker: {e}"))?;
            let _ = probe.close(200, "metered_api startup check".into()).await;
            let mut topology = Topology::new("metered")?.prefix(config.amqp_prefix.clone())?;
            if let Some(expires) = config.amqp_queue_expires {
                topology = topology.queue_expires(expires);
            }
            let exchange = topology.exchange();
            let consumer = Consumer::new(amqp.clone(), Arc::new(store.clone()), topology)
                .with_settings(ConsumerSettings::default().connection_name("metered_api"));
            let relay = Relay::new(amqp.clone(), Arc::new(store.clone())).with_settings(
                RelaySettings::default()
                    .connection_name("metered_api relay")
                    .poll_interval(config.relay_poll),
            );
            let (c, r) = (shutdown.clone(), shutdown.clone());
            let (cf, rf) = (fatal.clone(), fatal.clone());
            background.push(tokio::spawn(async move {
                if let Err(e) = consumer.run(c.clone()).await {
                    let why = escaped(&inbox_core::ErrorChain(&e));
                    tracing::error!(error = %why, "settlement consumer stopped; stopping");
                    cf.set(format!("settlement consumer stopped: {why}"), &c);
                }
            }));
            background.push(tokio::spawn(async move {
                if let Err(e) = relay.run(r.clone()).await {
                    let why = escaped(&inbox_core::ErrorChain(&e));
                    tracing::error!(error = %why, "settlement relay stopped; stopping");
                    rf.set(format!("settlement relay stopped: {why}"), &r);
                }
            }));
            exchange
        }
    };

    // Idempotency records expire after the retention, in bounded purges.
    let (purge_store, retention, purge_stop) = (
        store.clone(),
        config.idempotency_retention,
        shutdown.clone(),
    );
    tokio::spawn(async move {
        loop {
            let store = purge_store.clone();
            match tokio::task::spawn_blocking(move || {
                inbox_diesel::idempotency::purge_expired_requests(&store, retention, 1000)
            })
            .await
            {
                Ok(Ok(0)) => {}
                Ok(Ok(n)) => tracing::info!(purged = n, "expired idempotency keys purged"),
                Ok(Err(e)) => {
                    tracing::warn!(error = %escaped(&e), "purging idempotency keys failed")
                }
                Err(e) => tracing::warn!(error = %escaped(&e), "purging idempotency keys failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
                _ = purge_stop.cancelled() => return,
            }
        }
    });

    let redis = Redis::new(&config.redis_url)?;
    let prefix = format!("metered:{}", config.schema);
    let (listen, admin_listen) = (config.listen, config.admin_listen);
    let limits = Limits {
        max_connections: config.max_connections,
        header_timeout: config.header_timeout,
        idle_timeout: config.idle_timeout,
    };
    let auth_failures = AuthFailures::new(config.auth_failure_limit);
    let connections = Arc::new(ConnectionStats::new("public"));
    let app = Arc::new(App {
        config,
        store,
        advisory: Advisory::new(redis, prefix),
        settlements,
        stats: ServiceStats::default(),
        exchange,
        auth_failures,
        connections: Arc::clone(&connections),
        metrics,
    });
    // The only place that may declare the Redis connection dead.
    if let Some(every) = app.config.redis_probe {
        let probe_app = Arc::clone(&app);
        let probe_stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = probe_stop.cancelled() => return,
                }
                probe_app.advisory.redis().probe().await;
            }
        });
    }

    let admin_listener = tokio::net::TcpListener::bind(admin_listen)
        .await
        .map_err(|e| format!("could not listen on {admin_listen}: {e}"))?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("could not listen on {listen}: {e}"))?;
    if cfg!(feature = "test-hooks") {
        println!("metered_api: test hooks on ([fail-after:N] in a text fails its stream)");
    }
    println!(
        "metered_api: admin on http://{}",
        admin_listener.local_addr()?
    );
    println!(
        "metered_api: listening on http://{}",
        listener.local_addr()?
    );
    std::io::stdout().flush()?;
    let signal_stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = inbox_amqp::shutdown_signal() => signal_stop.cancel(),
            () = signal_stop.cancelled() => {}
        }
    });
    let admin_limits = Limits {
        max_connections: ADMIN_MAX_CONNECTIONS,
        ..limits
    };
    tokio::join!(
        serve::serve(
            listener,
            router(Arc::clone(&app)),
            limits,
            connections,
            shutdown.clone(),
        ),
        serve::serve(
            admin_listener,
            admin_router(Arc::clone(&app)),
            admin_limits,
            Arc::new(ConnectionStats::new("admin")),
            shutdown.clone(),
        ),
    );
    shutdown.cancel();
    stop_relay.store(true, Ordering::SeqCst);
    for task in background {
        let _ = task.await;
    }
    if let Some(why) = fatal.take() {
        return Err(why.into());
    }
    println!("metered_api: stopped");
    Ok(())
}
