//! Trace context across the outbox and the broker, and the spans that carry it.
//!
//! A message's trace context travels in its headers: captured when it is enqueued,
//! stored with the outbox row, sent as AMQP headers by the relay, kept on a dead
//! letter, and made the parent of the consumer's delivery span.
//!
//! Without the `opentelemetry` feature the context is a W3C `traceparent` set
//! explicitly ([`OutboxMessage::with_traceparent`]), carried unchanged and recorded on
//! the delivery span as a field. With it, the context is injected and extracted
//! through OpenTelemetry's global text-map propagator
//! (`opentelemetry::global::set_text_map_propagator`), so W3C `traceparent` and
//! `tracestate`, baggage, B3 or any other propagator the program installs travel
//! through the outbox and the broker; the headers always carry a `traceparent` as
//! well (the W3C form of the same span context), which is what a dead letter shows
//! and what is extracted when the installed propagator finds nothing (OpenTelemetry's
//! default propagator is a no-op one).
//!
//! The spans follow OpenTelemetry's messaging semantic conventions, version
//! [`SEMCONV_VERSION`]: the relay's `publish <exchange>` span (kind producer) and the
//! store's `process <exchange>` delivery span (kind consumer), both at `info`, named
//! and kinded through `tracing-opentelemetry`'s `otel.name` and `otel.kind` fields.
//! The guide is `docs/tracing.md`.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;

use crate::{ConsumerGroup, Envelope, OutboxMessage};

/// The header carrying the W3C trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A W3C `traceparent` (version 00): trace id, parent span id, flags.
///
/// ```
/// use inbox_core::Traceparent;
/// let tp = Traceparent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
/// assert_eq!(tp.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// assert_eq!(tp.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// assert!(Traceparent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traceparent {
    trace_id: u128,
    span_id: u64,
    flags: u8,
}

impl Traceparent {
    /// A traceparent from its parts; `None` for an all-zero trace or span id.
    pub fn new(trace_id: u128, span_id: u64, flags: u8) -> Option<Self> {
        (trace_id != 0 && span_id != 0).then_some(Self {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Parses `00-<32 hex>-<16 hex>-<2 hex>` (lower case); `None` otherwise.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if parts.next().is_some()
            || version != "00"
            || !hex(trace, 32)
            || !hex(span, 16)
            || !hex(flags, 2)
        {
            return None;
        }
        Self::new(
            u128::from_str_radix(trace, 16).ok()?,
            u64::from_str_radix(span, 16).ok()?,
            u8::from_str_radix(flags, 16).ok()?,
        )
    }

    /// The trace id, 32 lower-case hex digits.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The parent span id, 16 lower-case hex digits.
    pub fn span_id(&self) -> String {
        format!("{:016x}", self.span_id)
    }

    /// Whether the trace is sampled.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for Traceparent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

impl OutboxMessage {
    /// Carries this trace context to the consumer (the `traceparent` header).
    pub fn with_traceparent(mut self, traceparent: Traceparent) -> Self {
        self.headers
            .insert(TRACEPARENT_HEADER.to_owned(), traceparent.to_string());
        self
    }

    /// The trace context this message carries, if a valid one.
    pub fn traceparent(&self) -> Option<Traceparent> {
        self.headers
            .get(TRACEPARENT_HEADER)
            .and_then(|t| Traceparent::parse(t))
    }
}

impl Envelope {
    /// The trace context the producer sent, if a valid one.
    pub fn traceparent(&self) -> Option<Traceparent> {
        self.headers
            .get(TRACEPARENT_HEADER)
            .and_then(|t| Traceparent::parse(t))
    }
}

/// The version of OpenTelemetry's semantic conventions (messaging) the spans follow.
pub const SEMCONV_VERSION: &str = "1.27.0";

/// The header carrying the W3C `tracestate` (written by the W3C propagator).
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Where a transport received a batch from, recorded on each delivery span the store
/// opens while [`DeliveryOrigin::scope`] runs: the messaging system
/// (`messaging.system`), the destination the producer published to
/// (`messaging.destination.name`; for RabbitMQ the exchange) and the queue consumed
/// (`messaging.destination.subscription.name`).
///
/// ```
/// use inbox_core::trace::DeliveryOrigin;
/// let origin = DeliveryOrigin::new("rabbitmq", "billing", "billing.daily-usage");
/// let processed = origin.scope(|| 42); // the store's `process_batch` goes here
/// assert_eq!(processed, 42);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryOrigin {
    system: &'static str,
    destination: String,
    subscription: String,
}

thread_local! {
    static ORIGIN: RefCell<Option<DeliveryOrigin>> = const { RefCell::new(None) };
}

impl DeliveryOrigin {
    /// An origin: the system (`rabbitmq`), the destination (exchange), the queue.
    pub fn new(
        system: &'static str,
        destination: impl Into<String>,
        subscription: impl Into<String>,
    ) -> Self {
        Self {
            system,
            destination: destination.into(),
            subscription: subscription.into(),
        }
    }

    /// Runs `f` (the store's batch) with this origin on the current thread's delivery
    /// spans; the previous origin is back afterwards, also when `f` panics.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<DeliveryOrigin>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                ORIGIN.with(|o| *o.borrow_mut() = previous);
            }
        }
        let _restore = Restore(ORIGIN.with(|o| o.borrow_mut().replace(self.clone())));
        f()
    }
}

/// Opens the span of one delivery (`inbox.delivery`, at `info`): OpenTelemetry name
/// `process <destination>` (`process` without an origin), kind consumer, the
/// messaging attributes of [`SEMCONV_VERSION`] (`messaging.system`,
/// `messaging.destination.name`, `messaging.destination.subscription.name` from the
/// current [`DeliveryOrigin`]; `messaging.operation.type` and
/// `messaging.operation.name` `process`, `messaging.message.id` the message key,
/// `messaging.consumer.group.name` the group), plus `group`, `key`, and the empty
/// `attempt`, `outcome` and `traceparent` the store records. Its parent is the
/// producer's trace ([`adopt_trace_parent`]); a delivery that carries none starts a
/// trace of its own. Stores call this; the handler runs inside the span.
pub fn delivery_span(group: &ConsumerGroup, envelope: &Envelope) -> tracing::Span {
    let span = ORIGIN.with(|origin| {
        let origin = origin.borrow();
        let origin = origin.as_ref();
        let key = envelope.message_key.as_str();
        tracing::info_span!(
            "inbox.delivery",
            otel.name = %ProcessName(origin),
            otel.kind = "consumer",
            messaging.system = origin.map(|o| o.system),
            messaging.destination.name = origin.map(|o| o.destination.as_str()),
            messaging.destination.subscription.name = origin.map(|o| o.subscription.as_str()),
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.message.id = key,
            messaging.consumer.group.name = group.as_str(),
            group = group.as_str(),
            key = %crate::display::Escaped(key),
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
            traceparent = tracing::field::Empty,
        )
    });
    if !span.is_disabled() {
        adopt_trace_parent(&span, envelope);
    }
    span
}

/// `process <destination>`, written only when the span is enabled.
struct ProcessName<'a>(Option<&'a DeliveryOrigin>);

impl fmt::Display for ProcessName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(o) => write!(f, "process {}", o.destination),
            None => f.write_str("process"),
        }
    }
}

/// Makes the producer's trace the parent of a delivery's span (call it before the
/// span is first entered). Records the `traceparent` field when the headers carry a
/// valid one. With the `opentelemetry` feature, the span's OpenTelemetry parent is the
/// context the global propagator extracts from the headers (or, when it finds none,
/// the `traceparent` header's); a delivery that carries no context gets an empty
/// parent, so it starts a trace of its own instead of joining the long-lived span of
/// the worker that received it.
pub fn adopt_trace_parent(span: &tracing::Span, envelope: &Envelope) {
    adopt_parent_from(span, &envelope.headers);
}

/// [`adopt_trace_parent`] for any headers (the relay's publish span reads an outbox
/// row's).
pub fn adopt_parent_from(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    let traceparent = headers
        .get(TRACEPARENT_HEADER)
        .and_then(|t| Traceparent::parse(t));
    if let Some(tp) = traceparent {
        span.record("traceparent", tracing::field::display(tp));
    }
    #[cfg(feature = "opentelemetry")]
    otel::set_parent(span, headers, traceparent);
}

/// Writes `span`'s trace context into `headers`, replacing the context they carried:
/// with the `opentelemetry` feature through the global propagator (the fields it
/// names are removed first), then the W3C `traceparent` of the same context unless
/// the propagator wrote one. Without the feature, or when the span has no valid
/// context (no OpenTelemetry layer, the span filtered out), the headers are left as
/// they are.
pub fn inject_trace(span: &tracing::Span, headers: &mut BTreeMap<String, String>) {
    #[cfg(feature = "opentelemetry")]
    otel::inject(span, headers);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, headers);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use std::collections::BTreeMap;

    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use opentelemetry::Context;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{Traceparent, TRACEPARENT_HEADER};
    #[cfg(test)]
    use crate::Envelope;
    use crate::OutboxMessage;

    /// Message headers as a propagator's carrier.
    struct Headers<'a>(&'a BTreeMap<String, String>);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).map(String::as_str)
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(String::as_str).collect()
        }
    }

    struct HeadersMut<'a>(&'a mut BTreeMap<String, String>);

    impl Injector for HeadersMut<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key.to_owned(), value);
        }
    }

    /// The context `propagator` finds in `headers`; without a valid span in it, the
    /// `traceparent` header's (what a program with the no-op propagator wrote).
    pub(super) fn extract_with(
        propagator: &dyn TextMapPropagator,
        headers: &BTreeMap<String, String>,
        traceparent: Option<Traceparent>,
    ) -> Context {
        // From an empty context: `extract` would start from the current one, and a
        // delivery opened inside another span would take that span as its parent.
        let cx = propagator.extract_with_context(&Context::new(), &Headers(headers));
        let found = {
            let span = cx.span();
            let sc = span.span_context();
            // A propagator's find is remote; the no-op propagator answers with the
            // current context whatever it is given.
            sc.is_valid() && sc.is_remote()
        };
        if found {
            return cx;
        }
        // Whatever else it holds is not the message's: start afresh.
        let cx = Context::new();
        match traceparent {
            Some(tp) => cx.with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(tp.trace_id.to_be_bytes()),
                SpanId::from_bytes(tp.span_id.to_be_bytes()),
                TraceFlags::new(tp.flags),
                true,
                TraceState::default(),
            )),
            None => cx,
        }
    }

    pub(super) fn set_parent(
        span: &tracing::Span,
        headers: &BTreeMap<String, String>,
        traceparent: Option<Traceparent>,
    ) {
        let cx = opentelemetry::global::get_text_map_propagator(|p| {
            extract_with(p, headers, traceparent)
        });
        // An empty context makes the span a root; an error means no OpenTelemetry
        // layer, where there is nothing to parent.
        let _ = span.set_parent(cx);
    }

    /// Writes `cx` into `headers` through `propagator`, then its `traceparent`.
    pub(super) fn inject_with(
        propagator: &dyn TextMapPropagator,
        cx: &opentelemetry::Context,
        headers: &mut BTreeMap<String, String>,
    ) {
        let Some(tp) = of_context(cx) else {
            return;
        };
        let mut wrote_traceparent = false;
        for field in propagator.fields() {
            wrote_traceparent |= field == TRACEPARENT_HEADER;
            headers.remove(field);
        }
        propagator.inject_context(cx, &mut HeadersMut(headers));
        if !wrote_traceparent {
            headers.insert(TRACEPARENT_HEADER.to_owned(), tp.to_string());
        }
    }

    pub(super) fn inject(span: &tracing::Span, headers: &mut BTreeMap<String, String>) {
        if span.is_disabled() {
            return;
        }
        let cx = span.context();
        opentelemetry::global::get_text_map_propagator(|p| inject_with(p, &cx, headers));
    }

    fn of_context(cx: &opentelemetry::Context) -> Option<Traceparent> {
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        Traceparent::new(
            u128::from_be_bytes(sc.trace_id().to_bytes()),
            u64::from_be_bytes(sc.span_id().to_bytes()),
            sc.trace_flags().to_u8(),
        )
    }

    impl Traceparent {
        /// The current `tracing` span's OpenTelemetry context, if it has a valid one
        /// (a `tracing-opentelemetry` layer is installed and the span is recorded).
        pub fn current() -> Option<Self> {
            of_context(&tracing::Span::current().context())
        }
    }

    impl OutboxMessage {
        /// Carries the current span's trace context to the consumer, through the
        /// global propagator (`traceparent` and `tracestate` with the W3C one,
        /// `baggage`, `b3`, ...) plus the W3C `traceparent`; unchanged when the
        /// current span has no valid context.
        pub fn with_current_trace(mut self) -> Self {
            super::inject_trace(&tracing::Span::current(), &mut self.headers);
            self
        }
    }

    #[cfg(test)]
    mod tests {
        #![allow(clippy::unwrap_used)]

        use opentelemetry::propagation::text_map_propagator::FieldIter;
        use opentelemetry::trace::noop::NoopTextMapPropagator;

        use super::*;

        /// A propagator with a format of its own (as B3 has): one `x-test-trace`
        /// header, `<trace id>:<span id>`.
        #[derive(Debug)]
        struct OneHeader(Vec<String>);

        impl OneHeader {
            fn new() -> Self {
                Self(vec!["x-test-trace".to_owned()])
            }
        }

        impl TextMapPropagator for OneHeader {
            fn inject_context(&self, cx: &Context, injector: &mut dyn Injector) {
                let span = cx.span();
                let sc = span.span_context();
                if sc.is_valid() {
                    injector.set(
                        "x-test-trace",
                        format!("{}:{}", sc.trace_id(), sc.span_id()),
                    );
                }
            }

            fn extract_with_context(&self, cx: &Context, extractor: &dyn Extractor) -> Context {
                let Some((trace, span)) = extractor
                    .get("x-test-trace")
                    .and_then(|v| v.split_once(':'))
                else {
                    return cx.clone();
                };
                let (Ok(trace), Ok(span)) = (TraceId::from_hex(trace), SpanId::from_hex(span))
                else {
                    return cx.clone();
                };
                cx.with_remote_span_context(SpanContext::new(
                    trace,
                    span,
                    TraceFlags::SAMPLED,
                    true,
                    TraceState::default(),
                ))
            }

            fn fields(&self) -> FieldIter<'_> {
                FieldIter::new(&self.0)
            }
        }

        fn context(trace: u128, span: u64) -> Context {
            Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from(trace),
                SpanId::from(span),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ))
        }

        fn ids(cx: &Context) -> (TraceId, SpanId) {
            let span = cx.span();
            let sc = span.span_context();
            (sc.trace_id(), sc.span_id())
        }

        /// The delivery span of an envelope with `headers`, opened inside a
        /// long-lived span (a worker's) under a subscriber at `debug`: its parent
        /// span id and the worker's.
        fn delivery_parent(headers: &[(&str, &str)]) -> (SpanId, SpanId) {
            use opentelemetry::trace::TracerProvider as _;
            use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
            use tracing_subscriber::layer::SubscriberExt;

            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let subscriber = tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
            tracing::subscriber::with_default(subscriber, || {
                let worker = tracing::info_span!("worker");
                let _entered = worker.enter();
                let mut envelope =
                    Envelope::new(crate::MessageKey::new("k").unwrap(), "t", Vec::new());
                for (k, v) in headers {
                    envelope.headers.insert((*k).to_owned(), (*v).to_owned());
                }
                let group = crate::ConsumerGroup::new("g").unwrap();
                let span = super::super::delivery_span(&group, &envelope);
                span.in_scope(|| {});
            });
            let _ = provider.force_flush();
            let spans = exporter.get_finished_spans().unwrap();
            let worker = spans.iter().find(|s| s.name == "worker").unwrap();
            let delivery = spans.iter().find(|s| s.name == "process").unwrap();
            (delivery.parent_span_id, worker.span_context.span_id())
        }

        #[test]
        fn a_delivery_without_context_starts_a_trace_of_its_own() {
            let (parent, worker) = delivery_parent(&[]);
            assert_ne!(worker, SpanId::INVALID);
            assert_eq!(parent, SpanId::INVALID, "not the worker's child");
        }

        #[test]
        fn a_delivery_with_a_traceparent_is_its_child() {
            let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            let (parent, _) = delivery_parent(&[(TRACEPARENT_HEADER, tp)]);
            assert_eq!(parent, SpanId::from(0x00f0_67aa_0ba9_02b7));
        }

        #[test]
        fn another_format_replaces_the_carried_context_and_adds_a_w3c_traceparent() {
            let stale = "00-0000000000000000000000000000000a-000000000000000b-01";
            let mut headers = BTreeMap::from([
                ("x-test-trace".to_owned(), "stale".to_owned()),
                (TRACEPARENT_HEADER.to_owned(), stale.to_owned()),
                ("tenant".to_owned(), "acme".to_owned()),
            ]);
            inject_with(&OneHeader::new(), &context(0x1234, 0x56), &mut headers);
            assert_eq!(
                headers["x-test-trace"],
                "00000000000000000000000000001234:0000000000000056"
            );
            assert_eq!(
                headers[TRACEPARENT_HEADER],
                "00-00000000000000000000000000001234-0000000000000056-01"
            );
            assert_eq!(headers["tenant"], "acme");
            // The propagator's context wins over a `traceparent` that disagrees.
            headers.insert(TRACEPARENT_HEADER.to_owned(), stale.to_owned());
            let back = extract_with(&OneHeader::new(), &headers, Traceparent::parse(stale));
            assert_eq!(ids(&back), (TraceId::from(0x1234), SpanId::from(0x56)));
        }

        #[test]
        fn with_the_no_op_propagator_the_traceparent_carries_the_context() {
            let mut headers = BTreeMap::new();
            let propagator = NoopTextMapPropagator::new();
            inject_with(&propagator, &context(0x1234, 0x56), &mut headers);
            assert_eq!(headers.len(), 1, "{headers:?}");
            let tp = Traceparent::parse(&headers[TRACEPARENT_HEADER]);
            let back = extract_with(&propagator, &headers, tp);
            assert_eq!(ids(&back), (TraceId::from(0x1234), SpanId::from(0x56)));
            assert!(back.span().span_context().is_remote());
        }

        #[test]
        fn without_a_valid_context_the_headers_stay_as_they_are() {
            let carried = "00-0000000000000000000000000000000a-000000000000000b-01";
            let mut headers = BTreeMap::from([(TRACEPARENT_HEADER.to_owned(), carried.to_owned())]);
            inject_with(&OneHeader::new(), &Context::new(), &mut headers);
            assert_eq!(headers.len(), 1);
            assert_eq!(headers[TRACEPARENT_HEADER], carried);
            let none = extract_with(&OneHeader::new(), &BTreeMap::new(), None);
            assert!(!none.span().span_context().is_valid());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_version_00_in_lower_case_hex() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = Traceparent::parse(good).unwrap();
        assert!(tp.sampled());
        assert_eq!(tp.span_id(), "00f067aa0ba902b7");
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(Traceparent::parse(bad), None, "{bad:?}");
        }
    }
}
