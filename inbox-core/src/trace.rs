//! W3C trace context across the outbox: a `traceparent` captured when a message is
//! enqueued travels in its headers (stored with the outbox row, sent as an AMQP
//! header, kept on a dead letter) and becomes the parent of the consumer's delivery
//! span.
//!
//! Without the `opentelemetry` feature a traceparent is set explicitly
//! ([`OutboxMessage::with_traceparent`]) and recorded on the delivery span as a field.
//! With it, [`OutboxMessage::with_current_trace`] captures the current span's context
//! (through `tracing-opentelemetry`), and the delivery span's OpenTelemetry parent is
//! the enqueuing span: one trace from the producer's request to the consumer's handler.

use std::fmt;

use crate::{Envelope, OutboxMessage};

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

/// Makes the producer's trace the parent of a delivery's span: with the
/// `opentelemetry` feature its OpenTelemetry parent (call it before the span is first
/// entered); without, nothing (the delivery span records the traceparent as a field
/// where it declares one). A delivery without a valid `traceparent` keeps its span's
/// own parent.
pub fn adopt_trace_parent(span: &tracing::Span, envelope: &Envelope) {
    let Some(traceparent) = envelope.traceparent() else {
        return;
    };
    span.record("traceparent", tracing::field::display(traceparent));
    #[cfg(feature = "opentelemetry")]
    otel::set_parent(span, traceparent);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::Traceparent;
    use crate::OutboxMessage;

    pub(super) fn set_parent(span: &tracing::Span, tp: Traceparent) {
        let remote = SpanContext::new(
            TraceId::from_bytes(tp.trace_id.to_be_bytes()),
            SpanId::from_bytes(tp.span_id.to_be_bytes()),
            TraceFlags::new(tp.flags),
            true,
            TraceState::default(),
        );
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }

    impl Traceparent {
        /// The current `tracing` span's OpenTelemetry context, if it has a valid one
        /// (a `tracing-opentelemetry` layer is installed and the span is recorded).
        pub fn current() -> Option<Self> {
            let context = tracing::Span::current().context();
            let span = context.span();
            let sc = span.span_context();
            if !sc.is_valid() {
                return None;
            }
            Self::new(
                u128::from_be_bytes(sc.trace_id().to_bytes()),
                u64::from_be_bytes(sc.span_id().to_bytes()),
                sc.trace_flags().to_u8(),
            )
        }
    }

    impl OutboxMessage {
        /// Carries the current span's trace context to the consumer, if it has one.
        pub fn with_current_trace(self) -> Self {
            match Traceparent::current() {
                Some(tp) => self.with_traceparent(tp),
                None => self,
            }
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
