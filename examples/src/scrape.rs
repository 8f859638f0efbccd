//! `/metrics` in the Prometheus text format, for the example programs: the recorder of
//! `metrics-exporter-prometheus`, the inbox metrics described once
//! ([`inbox_core::metrics::describe`]), and a route that renders them.
//!
//! The consumers and relays (`usage_consumer`, `usage_producer`, `order_service`,
//! `credit_ledger`) serve it on a listener of their own when [`METRICS_ADDR_ENV`]
//! (`INBOX_METRICS_ADDR`, e.g. `127.0.0.1:9464`; port 0 picks a free one) is set,
//! and print `<program>: metrics on http://<address>/metrics` on stdout once it
//! listens; unset, they install no recorder and the metrics cost nothing.
//! `usage_consumer` also publishes the operator gauges there (outbox backlog, pending
//! dead letters per failure group, ...; [`publish_operator_gauges`]) every
//! `INBOX_OPERATOR_GAUGES_EVERY` (default 30 s). The metered
//! API serves `/metrics` on its admin router. Histograms (the `_seconds` ones) are
//! exported with the buckets of [`SECONDS_BUCKETS`]. See `docs/metrics.md`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use inbox_diesel::operator::Operator;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The variable naming the address the example programs serve `/metrics` on.
pub const METRICS_ADDR_ENV: &str = "INBOX_METRICS_ADDR";

/// The variable setting how often `usage_consumer` publishes the operator gauges
/// (`30s` by default; units `ms`, `s`, `m`, `h`) while it serves `/metrics`.
pub const OPERATOR_GAUGES_EVERY_ENV: &str = "INBOX_OPERATOR_GAUGES_EVERY";

/// How often the operator gauges are published when [`OPERATOR_GAUGES_EVERY_ENV`] is
/// not set.
pub const OPERATOR_GAUGES_EVERY: Duration = Duration::from_secs(30);

/// Publishes `operator`'s gauges ([`Operator::publish_operator_gauges`]) at once and
/// then every `every` until `stop` is set: a blocking loop, for a thread of its own.
/// A failed publication is logged and tried again at the next turn.
pub fn publish_operator_gauges<C: inbox_diesel::operator::OperatorConnection>(
    operator: &Operator<C>,
    every: Duration,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        if let Err(err) = operator.publish_operator_gauges() {
            tracing::warn!(error = %err, "publishing the operator gauges failed");
        }
        let until = std::time::Instant::now() + every;
        while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(50).min(every));
        }
    }
}

/// The buckets of every `_seconds` histogram, in seconds.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// How often the recorder's histograms are drained into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Installs the Prometheus recorder as the process's global recorder, describes the
/// inbox metrics, and keeps its histograms up to date (a task on the current tokio
/// runtime). Returns the handle that renders the text format.
pub fn install_recorder() -> Result<PrometheusHandle, BoxError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), SECONDS_BUCKETS)?
        .install_recorder()?;
    inbox_core::metrics::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// A router with `GET /metrics`: the text format of `handle`.
pub fn metrics_router<S: Clone + Send + Sync + 'static>(handle: PrometheusHandle) -> Router<S> {
    Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    handle.render(),
                )
            }
        }),
    )
}

/// When `INBOX_METRICS_ADDR` is set: installs the recorder, listens on the address
/// and serves `/metrics` there (a task on the current tokio runtime), prints
/// `<program>: metrics on http://<address>/metrics` and returns the address it listens
/// on. Unset, does nothing and returns `None`.
pub async fn serve_from_env(program: &str) -> Result<Option<SocketAddr>, BoxError> {
    let Ok(addr) = std::env::var(METRICS_ADDR_ENV) else {
        return Ok(None);
    };
    let handle = install_recorder()?;
    let listener = tokio::net::TcpListener::bind(addr.trim())
        .await
        .map_err(|e| format!("{METRICS_ADDR_ENV}={addr:?}: cannot listen: {e}"))?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, metrics_router::<()>(handle)).await {
            tracing::error!(error = %err, "the metrics listener failed");
        }
    });
    println!("{program}: metrics on http://{local}/metrics");
    Ok(Some(local))
}

/// [`serve_from_env`] for a program without a runtime of its own (one that hands its
/// consumer and relay to `inbox_cli::service::serve`): a thread with a one-thread
/// tokio runtime serves `/metrics` (and keeps the histograms up to date) for the rest
/// of the process. Call it after `inbox_cli::service::init`.
pub fn spawn_from_env(program: &str) -> Result<Option<SocketAddr>, BoxError> {
    if std::env::var_os(METRICS_ADDR_ENV).is_none() {
        return Ok(None);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let program = program.to_owned();
    std::thread::Builder::new()
        .name("metrics".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let served = serve_from_env(&program).await.map_err(|e| e.to_string());
                let _ = tx.send(served);
                std::future::pending::<()>().await;
            });
        })?;
    Ok(rx.recv().map_err(|_| "the metrics thread ended")??)
}
