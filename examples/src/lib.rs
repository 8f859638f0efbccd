//! The usage-billing projection the examples run: `usage.recorded` events folded into
//! `daily_usage(user_id, day, total)`, on PostgreSQL or SQLite with the same handler.

pub mod console;
pub mod credit;
pub mod metered;
pub mod ops;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod quickstart;
pub mod scrape;
pub mod usage;

/// The workspace README and the guides in `docs/`, whose Rust blocks `cargo test --doc`
/// compiles against the library crates (this crate depends on all of them).
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../../README.md")]
    mod readme {}
    #[doc = include_str!("../../docs/guarantees.md")]
    mod guarantees {}
    #[doc = include_str!("../../docs/testing.md")]
    mod testing {}
    #[doc = include_str!("../../docs/handlers.md")]
    mod handlers {}
    #[doc = include_str!("../../docs/rabbitmq.md")]
    mod rabbitmq {}
    #[doc = include_str!("../../docs/errors.md")]
    mod errors {}
    #[doc = include_str!("../../docs/outbox.md")]
    mod outbox {}
    #[doc = include_str!("../../docs/credit-ledger.md")]
    mod credit_ledger {}
    #[doc = include_str!("../../docs/idempotency.md")]
    mod idempotency {}
    #[doc = include_str!("../../docs/rebuilds.md")]
    mod rebuilds {}
    #[doc = include_str!("../../docs/operating.md")]
    mod operating {}
    #[doc = include_str!("../../docs/storage.md")]
    mod storage {}
    #[doc = include_str!("../../docs/performance.md")]
    mod performance {}
    #[doc = include_str!("../../docs/metrics.md")]
    mod metrics {}
    #[doc = include_str!("../../docs/tracing.md")]
    mod tracing_guide {}
    #[doc = include_str!("../../docs/console.md")]
    mod console_guide {}
    #[doc = include_str!("../../docs/postgres-failover.md")]
    mod postgres_failover {}
}

/// The log filter when `RUST_LOG` is not set: the inbox crates and the examples at
/// `info`, everything else (lapin, diesel, ...) at `warn`.
pub const DEFAULT_LOG_FILTER: &str =
    "warn,inbox_core=info,inbox_diesel=info,inbox_amqp=info,inbox_examples=info,\
     quickstart=info,usage_consumer=info,usage_producer=info,credit_ledger=info,usage_ops=info,\
     order_service=info,operator_demo=info,metered_api=info";

/// Logs `tracing` events to stderr, as a user's service would: filtered by `RUST_LOG`
/// (`RUST_LOG=debug`, `RUST_LOG=inbox_amqp=debug,warn`, ...), else by
/// [`DEFAULT_LOG_FILTER`]; one JSON object per line with `INBOX_LOG_FORMAT=json` (see
/// [`inbox_cli::logging`], the `inbox` binary's subscriber). A `RUST_LOG` that does not
/// parse is reported and the default used. Call it once, first thing in `main`; a
/// subscriber already installed (a test harness, say) is left in place.
pub fn init_logging() -> Logging {
    #[cfg(feature = "otlp")]
    if std::env::var_os(otlp::ENDPOINT_ENV).is_some() {
        return Logging {
            provider: otlp::install(DEFAULT_LOG_FILTER),
        };
    }
    inbox_cli::logging::install(DEFAULT_LOG_FILTER);
    Logging {
        #[cfg(feature = "otlp")]
        provider: None,
    }
}

/// What [`init_logging`] installed; hold it until `main` returns. With the feature
/// `otlp` and an exporter installed, dropping it flushes the spans not exported yet.
#[must_use = "hold it until main returns: dropping it flushes the exported spans"]
pub struct Logging {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Logging {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(provider) = self.provider.take() {
            if let Err(err) = provider.shutdown() {
                eprintln!("spans not flushed to the OTLP collector: {err}");
            }
        }
    }
}
