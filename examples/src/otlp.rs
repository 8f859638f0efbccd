//! The examples' span export to an OpenTelemetry collector (the feature `otlp`): with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` set (`http://collector:4318`), every span at `info`
//! or above goes to `<endpoint>/v1/traces` as OTLP protobuf over HTTP, whatever
//! `RUST_LOG` lets through to the log lines; the W3C trace-context propagator is
//! installed, so the outbox and the consumer carry the context (see
//! docs/tracing.md). The exporter reads the standard `OTEL_EXPORTER_OTLP_*` and
//! `OTEL_BSP_*` variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, headers, timeout, the
//! batch's delay). Spans are batched on the processor's own thread and flushed when
//! the [`Logging`](crate::Logging) guard is dropped, at the end of `main`.
//!
//! opentelemetry-otlp's own code, not a hand-written exporter; its HTTP transport with
//! a blocking client, which runs on the batch processor's thread and brings no gRPC
//! stack into the build.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use inbox_cli::logging::{env_filter, log_format, LogFormat};

/// The variable that turns the export on.
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Installs the log lines (as `inbox_cli::logging::install` does) and the span
/// export; returns the provider to shut down at exit, or `None` when the exporter
/// could not be built (reported on stderr; the log lines are installed anyway).
pub(crate) fn install(default_filter: &str) -> Option<SdkTracerProvider> {
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(exporter) => exporter,
        Err(err) => {
            eprintln!("no span export to the OTLP collector ({err})");
            inbox_cli::logging::install(default_filter);
            return None;
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .build();
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("inbox-examples"))
        .with_filter(LevelFilter::INFO);
    let lines: Box<dyn Layer<_> + Send + Sync> = match log_format() {
        LogFormat::Text => Box::new(tracing_subscriber::fmt::layer().with_writer(std::io::stderr)),
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt::layer()
                .json()
                .with_writer(std::io::stderr),
        ),
    };
    let installed = tracing_subscriber::registry()
        .with(lines.with_filter(env_filter(default_filter)))
        .with(spans)
        .try_init()
        .is_ok();
    if !installed {
        // A subscriber was there first: nothing of this one is used.
        let _ = provider.shutdown();
        return None;
    }
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(provider.clone());
    Some(provider)
}
