//! The trace context of the span that enqueued a message reaches the consumer: stored
//! with the outbox row, sent as AMQP headers, the parent of the consumer's delivery
//! span (an in-memory OpenTelemetry exporter sees one trace), kept on a dead letter
//! and shown by `inbox dead-letters show`. One subscriber for the binary, with the
//! usual `info` filter and the W3C trace-context and baggage propagators installed
//! globally, as a program would.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use diesel::Connection as _;

use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, Topology};
use inbox_core::{
    relay_in_process, InProcessTransport, MessageKey, OutboxMessage, RetryLadder, RetryPolicy,
    Traceparent, TRACEPARENT_HEADER, TRACESTATE_HEADER,
};
use inbox_diesel::operator::DeadLetterFilter;
use inbox_diesel::operator::Operator;
use inbox_diesel::{enqueue, Store, StoreConnection};
use inbox_test_support::amqp::{self, amqp_url, eventually, DeleteOnDrop};
use inbox_test_support::{
    unique_name, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture, TestConn,
};
use opentelemetry::baggage::BaggageExt;
use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    TracerProvider as _,
};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::EnvFilter;

const GROUP: &str = "billing.daily-usage";

/// Enqueues `key` inside a span of its own; returns that span's trace id.
fn enqueue_traced<C: StoreConnection>(store: &Store<C>, exchange: &str, key: &str) -> String {
    let span = tracing::info_span!("checkout.request", key);
    let _entered = span.enter();
    let msg = OutboxMessage::new(
        MessageKey::new(key).unwrap(),
        exchange,
        "usage.recorded",
        usage(key, 3).payload,
    )
    .with_current_trace();
    let tp = msg.traceparent().expect("the current span has a context");
    let mut conn = store.connection().unwrap();
    enqueue(&mut conn, &msg, store.clock().now()).unwrap();
    tp.trace_id()
}

/// Whether a delivery span (OpenTelemetry name `process ...`, kind consumer) is in
/// the trace `trace_id`.
fn delivery_trace(spans: &[SpanData], trace_id: &str) -> bool {
    spans.iter().any(|s| {
        s.name.starts_with("process")
            && s.span_kind == SpanKind::Consumer
            && s.span_context.trace_id().to_string() == trace_id
    })
}

fn store<F: Fixture>(fx: &F, ladder: Option<RetryLadder>) -> Store<F::Conn> {
    let recorder = Recorder::new(GROUP)
        .policy(RetryPolicy::new(1, Duration::from_millis(50), Duration::from_millis(50)).unwrap())
        .behaviour(|key, _| {
            if key.starts_with("bad-") {
                Outcome::Permanent
            } else {
                Outcome::Apply
            }
        });
    let mut builder = fx.builder().handler(recorder);
    if let Some(ladder) = ladder {
        builder = builder.retry_ladder(ladder);
    }
    let store = builder.build().unwrap();
    store.connection().unwrap().create_effects().unwrap();
    store
}

/// The binary's one subscriber and exporter.
struct Telemetry {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
}

impl Telemetry {
    fn spans(&self) -> Vec<SpanData> {
        let _ = self.provider.force_flush();
        self.exporter.get_finished_spans().unwrap()
    }
}

fn telemetry() -> &'static Telemetry {
    static TELEMETRY: OnceLock<Telemetry> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        // The filter a program runs with: `info`, where the publish and delivery spans
        // are.
        let subscriber = tracing_subscriber::registry()
            .with(EnvFilter::new("info"))
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
        // Global: the AMQP consumer processes on tokio's blocking threads.
        tracing::subscriber::set_global_default(subscriber).unwrap();
        opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
            Box::new(TraceContextPropagator::new()),
            Box::new(BaggagePropagator::new()),
        ]));
        Telemetry { exporter, provider }
    })
}

#[test]
fn the_enqueuing_trace_is_the_parent_of_the_delivery_span() {
    let telemetry = telemetry();
    let (exporter, provider) = (&telemetry.exporter, &telemetry.provider);

    // SQLite and the in-process transport.
    let fx = SqliteFixture::new();
    let sqlite = store(&fx, None);
    let good = enqueue_traced(&sqlite, "billing", "good-1");
    let bad = enqueue_traced(&sqlite, "billing", "bad-1");
    assert_ne!(good, bad);
    let mut transport = InProcessTransport::new(sqlite.clone());
    assert_eq!(
        relay_in_process(&sqlite, &mut transport, "relay-1", 10).unwrap(),
        2
    );
    transport.run_until_idle().unwrap();
    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().unwrap();
    assert!(
        delivery_trace(&spans, &good),
        "no delivery span in trace {good}"
    );
    assert!(
        delivery_trace(&spans, &bad),
        "no delivery span in trace {bad}"
    );
    // Kept on the dead letter, shown by the CLI.
    let letter = Operator::new(&sqlite)
        .list_dead_letters(&DeadLetterFilter::default(), 0, 1)
        .unwrap()
        .remove(0);
    let details = Operator::new(&sqlite)
        .dead_letter_details(letter.id)
        .unwrap()
        .unwrap();
    let kept = Traceparent::parse(&details.headers[TRACEPARENT_HEADER]).unwrap();
    assert_eq!(kept.trace_id(), bad);
    let shown = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env("DATABASE_URL", format!("sqlite://{}", fx.path))
        .args(["--json", "dead-letters", "show", &letter.id.to_string()])
        .output()
        .unwrap();
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(
        Traceparent::parse(shown["traceparent"].as_str().unwrap())
            .unwrap()
            .trace_id(),
        bad
    );

    // PostgreSQL and RabbitMQ: through the relay and an AMQP header.
    let (Some(amqp_url), Some(pg)) = (amqp_url(), PgFixture::new()) else {
        return;
    };
    let ladder = RetryLadder::new([Duration::from_millis(50)]).unwrap();
    let store = Arc::new(store(&pg, Some(ladder.clone())));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let topology = Topology::new("billing")
            .unwrap()
            .prefix(format!("{}.", unique_name("tr")))
            .unwrap()
            .ladder(ladder)
            .queue_expires(Duration::from_secs(120))
            .with_routes(inbox_core::InboxStore::routes(&*store));
        let _delete = DeleteOnDrop::new(amqp_url.clone(), topology.clone());
        let conn = amqp::connect(&amqp_url).await;
        topology.declare(&conn).await.unwrap();
        let trace = enqueue_traced(&store, &topology.exchange(), "good-2");
        let shutdown = CancellationToken::new();
        let consumer = Consumer::new(amqp_url.clone(), Arc::clone(&store), topology.clone())
            .with_settings(ConsumerSettings::default().workers(1));
        let consuming = tokio::spawn(consumer.run(shutdown.clone()));
        let mut settings = RelaySettings::default();
        settings.poll_interval = Duration::from_millis(50);
        let relaying = tokio::spawn(
            Relay::new(amqp_url.clone(), Arc::clone(&store))
                .with_settings(settings)
                .run(shutdown.clone()),
        );
        let arrived = eventually(Duration::from_secs(30), || {
            let _ = provider.force_flush();
            delivery_trace(&exporter.get_finished_spans().unwrap(), &trace)
        })
        .await;
        shutdown.cancel();
        consuming.await.unwrap().unwrap();
        relaying.await.unwrap().unwrap();
        let _ = conn.close(200, "done".into()).await;
        assert!(arrived, "no delivery span in trace {trace}");
        assert_eq!(store.connection().unwrap().effects_of("good-2").unwrap(), 1);
    });
}

/// The attribute `key` of `span`, as a string.
fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| match &kv.value {
            Value::String(s) => s.as_str().to_owned(),
            other => other.to_string(),
        })
}

/// The one span of `trace` named `name`.
fn one<'s>(spans: &'s [SpanData], trace: TraceId, name: &str) -> &'s SpanData {
    let found: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace && s.name == name)
        .collect();
    assert_eq!(found.len(), 1, "{name} in {trace}: {spans:#?}");
    found[0]
}

/// What the handler saw of each delivery: its key, the `tracestate` header, the
/// baggage entry `tenant` of its span's context.
type Seen = Arc<Mutex<Vec<(String, Option<String>, Option<String>)>>>;

#[test]
fn one_trace_from_the_producer_through_the_relay_and_rabbitmq_to_the_handler() {
    let telemetry = telemetry();
    let (Some(amqp_url), Some(pg)) = (amqp_url(), PgFixture::new()) else {
        return;
    };
    let seen: Seen = Arc::default();
    let saw = Arc::clone(&seen);
    let handler = Recorder::new(GROUP).behaviour(move |key, ctx| {
        // The handler's own span: a child of the delivery span it runs in.
        let span = tracing::info_span!("usage.apply");
        let _entered = span.enter();
        let baggage = span
            .context()
            .baggage()
            .get("tenant")
            .map(|v| v.to_string());
        let tracestate = ctx.envelope().headers.get(TRACESTATE_HEADER).cloned();
        saw.lock()
            .unwrap()
            .push((key.to_owned(), tracestate, baggage));
        Outcome::Apply
    });
    let store = Arc::new(pg.builder().handler(handler).build().unwrap());
    store.connection().unwrap().create_effects().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let topology = Topology::new("billing")
        .unwrap()
        .prefix(format!("{}.", unique_name("chain")))
        .unwrap()
        .queue_expires(Duration::from_secs(120))
        .with_routes(inbox_core::InboxStore::routes(&*store));
    let exchange = topology.exchange();
    let _delete = DeleteOnDrop::new(amqp_url.clone(), topology.clone());

    // The producer's transaction runs in a request span that continues an upstream
    // trace carrying a `tracestate` and a baggage entry.
    let upstream = SpanContext::new(
        TraceId::from_bytes(*b"inbox-trace-test"),
        SpanId::from_bytes(*b"upstream"),
        TraceFlags::SAMPLED,
        true,
        TraceState::from_key_value([("vendor", "opaque")]).unwrap(),
    );
    let trace = upstream.trace_id();
    let request = tracing::info_span!("checkout.request");
    request
        .set_parent(
            opentelemetry::Context::new()
                .with_remote_span_context(upstream)
                .with_baggage([KeyValue::new("tenant", "acme")]),
        )
        .unwrap();
    let key = unique_name("chain");
    request.in_scope(|| {
        let msg = OutboxMessage::new(
            MessageKey::new(key.as_str()).unwrap(),
            exchange.as_str(),
            "usage.recorded",
            usage(&key, 3).payload,
        )
        .with_current_trace();
        assert_eq!(
            msg.headers.get(TRACESTATE_HEADER).map(String::as_str),
            Some("vendor=opaque"),
            "captured with the message: {:?}",
            msg.headers
        );
        let conn: &mut diesel::PgConnection = &mut store.connection().unwrap();
        conn.transaction(|conn| enqueue(conn, &msg, store.clock().now()))
            .unwrap();
    });
    drop(request);
    // A message enqueued with no trace context at all.
    let untraced = unique_name("untraced");
    {
        let msg = OutboxMessage::new(
            MessageKey::new(untraced.as_str()).unwrap(),
            exchange.as_str(),
            "usage.recorded",
            usage(&untraced, 1).payload,
        );
        let conn: &mut diesel::PgConnection = &mut store.connection().unwrap();
        enqueue(conn, &msg, store.clock().now()).unwrap();
    }

    runtime.block_on(async {
        let conn = amqp::connect(&amqp_url).await;
        topology.declare(&conn).await.unwrap();
        let shutdown = CancellationToken::new();
        let consumer = Consumer::new(amqp_url.clone(), Arc::clone(&store), topology.clone())
            .with_settings(ConsumerSettings::default().workers(1));
        let consuming = tokio::spawn(consumer.run(shutdown.clone()));
        let mut settings = RelaySettings::default();
        settings.poll_interval = Duration::from_millis(50);
        let relaying = tokio::spawn(
            Relay::new(amqp_url.clone(), Arc::clone(&store))
                .with_settings(settings)
                .run(shutdown.clone()),
        );
        let arrived = eventually(Duration::from_secs(30), || {
            let spans = telemetry.spans();
            delivery_trace(&spans, &trace.to_string())
                && spans.iter().any(|s| {
                    attribute(s, "messaging.message.id").as_deref() == Some(untraced.as_str())
                        && s.span_kind == SpanKind::Consumer
                })
        })
        .await;
        shutdown.cancel();
        consuming.await.unwrap().unwrap();
        relaying.await.unwrap().unwrap();
        let _ = conn.close(200, "done".into()).await;
        assert!(arrived, "no delivery span in trace {trace}");
    });
    assert_eq!(store.connection().unwrap().effects_of(&key).unwrap(), 1);
    assert_eq!(
        store.connection().unwrap().effects_of(&untraced).unwrap(),
        1
    );

    // producer transaction -> relay publish -> (broker) -> delivery -> handler.
    let spans = telemetry.spans();
    let request = one(&spans, trace, "checkout.request");
    let publish = one(&spans, trace, &format!("publish {exchange}"));
    let queue = topology.queue(&inbox_core::ConsumerGroup::new(GROUP).unwrap());
    let delivery = one(&spans, trace, &format!("process {exchange}"));
    let handler = one(&spans, trace, "usage.apply");
    assert_eq!(request.parent_span_id, SpanId::from_bytes(*b"upstream"));
    assert_eq!(publish.parent_span_id, request.span_context.span_id());
    assert_eq!(delivery.parent_span_id, publish.span_context.span_id());
    assert_eq!(handler.parent_span_id, delivery.span_context.span_id());
    assert_eq!(publish.span_kind, SpanKind::Producer);
    assert_eq!(delivery.span_kind, SpanKind::Consumer);
    for (span, expected) in [
        (
            publish,
            vec![
                ("messaging.system", "rabbitmq"),
                ("messaging.destination.name", exchange.as_str()),
                (
                    "messaging.rabbitmq.destination.routing_key",
                    "usage.recorded",
                ),
                ("messaging.operation.type", "publish"),
                ("messaging.operation.name", "publish"),
                ("messaging.message.id", key.as_str()),
            ],
        ),
        (
            delivery,
            vec![
                ("messaging.system", "rabbitmq"),
                ("messaging.destination.name", exchange.as_str()),
                ("messaging.destination.subscription.name", queue.as_str()),
                ("messaging.operation.type", "process"),
                ("messaging.operation.name", "process"),
                ("messaging.message.id", key.as_str()),
                ("messaging.consumer.group.name", GROUP),
            ],
        ),
    ] {
        for (name, value) in expected {
            assert_eq!(
                attribute(span, name).as_deref(),
                Some(value),
                "{name} of {}: {:?}",
                span.name,
                span.attributes
            );
        }
    }
    assert_eq!(
        attribute(delivery, "outcome").as_deref(),
        Some("Processed"),
        "{:?}",
        delivery.attributes
    );
    // A row without trace context starts a trace of its own at its publish span (a
    // root, not a child of the relay's long-lived span), which its delivery continues.
    let of_untraced = |kind: SpanKind| -> &SpanData {
        let found: Vec<&SpanData> = spans
            .iter()
            .filter(|s| {
                s.span_kind == kind
                    && attribute(s, "messaging.message.id").as_deref() == Some(untraced.as_str())
            })
            .collect();
        assert_eq!(found.len(), 1, "{found:#?}");
        found[0]
    };
    let (lone_publish, lone_delivery) = (
        of_untraced(SpanKind::Producer),
        of_untraced(SpanKind::Consumer),
    );
    assert_eq!(
        lone_publish.parent_span_id,
        SpanId::INVALID,
        "{lone_publish:#?}"
    );
    assert_ne!(lone_publish.span_context.trace_id(), trace);
    assert_eq!(
        lone_delivery.parent_span_id,
        lone_publish.span_context.span_id()
    );
    // The upstream `tracestate` crossed the outbox row and the broker, and so did the
    // baggage: in the delivery's headers, in its span context, in the handler's.
    assert_eq!(
        delivery.span_context.trace_state().header(),
        "vendor=opaque"
    );
    let seen = seen.lock().unwrap();
    let ours: Vec<_> = seen.iter().filter(|(k, _, _)| *k == key).collect();
    assert_eq!(
        ours,
        [&(
            key.clone(),
            Some("vendor=opaque".to_owned()),
            Some("acme".to_owned())
        )]
    );
}
