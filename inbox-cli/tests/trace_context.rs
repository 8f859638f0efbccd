//! The W3C trace context of the span that enqueued a message reaches the consumer:
//! stored with the outbox row, sent as an AMQP header, the parent of the consumer's
//! delivery span (an in-memory OpenTelemetry exporter sees one trace id), kept on a
//! dead letter and shown by `inbox dead-letters show`.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Relay, RelaySettings, Topology};
use inbox_core::{
    relay_in_process, InProcessTransport, MessageKey, OutboxMessage, RetryLadder, RetryPolicy,
    Traceparent, TRACEPARENT_HEADER,
};
use inbox_diesel::operator::DeadLetterFilter;
use inbox_diesel::operator::Operator;
use inbox_diesel::{enqueue, Store, StoreConnection};
use inbox_test_support::amqp::{self, amqp_url, eventually};
use inbox_test_support::{
    unique_name, usage, Fixture, Outcome, PgFixture, Recorder, SqliteFixture, TestConn,
};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

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

fn delivery_trace(spans: &[SpanData], trace_id: &str) -> bool {
    spans
        .iter()
        .any(|s| s.name == "inbox.delivery" && s.span_context.trace_id().to_string() == trace_id)
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

#[test]
fn the_enqueuing_trace_is_the_parent_of_the_delivery_span() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
    // Global: the AMQP consumer processes on tokio's blocking threads.
    tracing::subscriber::set_global_default(subscriber).unwrap();

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
        topology.delete(&conn).await.unwrap();
        let _ = conn.close(200, "done".into()).await;
        assert!(arrived, "no delivery span in trace {trace}");
        assert_eq!(store.connection().unwrap().effects_of("good-2").unwrap(), 1);
    });
}
