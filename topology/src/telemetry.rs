//! Telemetry names, defined once: the tracer's name, span names, attribute keys
//! and span event names, and the W3C trace context as it travels in AMQP headers
//! (SPEC §2, §5).
//!
//! Spans follow the OpenTelemetry messaging semantic conventions; what is
//! shardline's own is under `shardline.*`. The context is always propagated:
//! when no tracer provider is installed (no OTLP export), a span is a no-op and
//! [`propagated`] stands in a fresh random context (or keeps the incoming one),
//! so a publisher → worker → downstream correlation holds without any exporter.

use std::borrow::Cow;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, InstrumentationScope};

use crate::headers::{self, TRACEPARENT, TRACESTATE};

/// Instrumentation scope of every shardline span.
pub const TRACER_NAME: &str = "shardline";

/// The tracer's instrumentation scope (name and crate version).
pub fn scope() -> InstrumentationScope {
    InstrumentationScope::builder(TRACER_NAME)
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

/// Span names (`{destination} {operation}`, the messaging conventions' form).
pub mod span {
    use super::Cow;

    /// Producer span of one published event: `{exchange} publish`.
    pub fn publish(exchange: &str) -> Cow<'static, str> {
        Cow::Owned(format!("{exchange} {}", super::op::PUBLISH))
    }

    /// Consumer span of one delivery: `{queue} process`.
    pub fn process(queue: &str) -> Cow<'static, str> {
        Cow::Owned(format!("{queue} {}", super::op::PROCESS))
    }

    /// Span of one dead letter replayed by `shardline dlq replay`:
    /// `{dead-letter queue} replay`, linked to the failed attempt's context.
    pub fn replay(dead_letter_queue: &str) -> Cow<'static, str> {
        Cow::Owned(format!("{dead_letter_queue} {}", super::op::REPLAY))
    }
}

/// `messaging.operation` values.
pub mod op {
    pub const PUBLISH: &str = "publish";
    pub const PROCESS: &str = "process";
    /// A dead letter republished by `shardline dlq replay`.
    pub const REPLAY: &str = "replay";
}

/// Attribute keys.
pub mod attr {
    /// Always `rabbitmq`.
    pub const MESSAGING_SYSTEM: &str = "messaging.system";
    pub const MESSAGING_SYSTEM_RABBITMQ: &str = "rabbitmq";
    /// `publish` or `process`.
    pub const MESSAGING_OPERATION: &str = "messaging.operation";
    /// The exchange the event was published to.
    pub const MESSAGING_DESTINATION_NAME: &str = "messaging.destination.name";
    pub const MESSAGING_ROUTING_KEY: &str = "messaging.rabbitmq.destination.routing_key";
    /// The AMQP `message_id` (the event id, or a generated uuid).
    pub const MESSAGING_MESSAGE_ID: &str = "messaging.message.id";
    pub const MESSAGING_BODY_SIZE: &str = "messaging.message.body.size";
    /// The queue a consumer span consumed from.
    pub const QUEUE: &str = "shardline.queue";
    pub const ORDER_ID: &str = "shardline.order_id";
    pub const EVENT: &str = "shardline.event";
    pub const SEQ: &str = "shardline.seq";
    pub const SHARD: &str = "shardline.shard";
    pub const DEDUP_KEY: &str = "shardline.dedup_key";
    /// How processing ended: see [`super::outcome`].
    pub const OUTCOME: &str = "shardline.outcome";
    /// The `x-fail-reason` of a dead-lettered event.
    pub const FAIL_REASON: &str = "shardline.fail_reason";
    /// The `x-dead-letter-id` of a dead-lettered event.
    pub const DEAD_LETTER_ID: &str = "shardline.dead_letter_id";
    /// Handler attempts made (on the process span; on a retry event, its number).
    pub const ATTEMPT: &str = "shardline.attempt";
    /// Delay before the next attempt, in milliseconds (on a retry event).
    pub const RETRY_IN_MS: &str = "shardline.retry_in_ms";
    /// The error text (on retry events and dead-lettered spans).
    pub const ERROR: &str = "shardline.error";
    /// On a replay span: the trace id of the failed attempt it links to.
    pub const LINKED_TRACE_ID: &str = "shardline.linked_trace_id";
}

/// `shardline.outcome` values.
pub mod outcome {
    pub const PROCESSED: &str = "processed";
    pub const DUPLICATE: &str = "duplicate";
    pub const DEAD_LETTERED: &str = "dead-lettered";
    /// Handed to the sequence gate; a later span processes it.
    pub const HELD: &str = "held";
    /// The worker stopped or lost the broker before the event was settled.
    pub const ABANDONED: &str = "abandoned";
}

/// Span event names.
pub mod event {
    /// A handler attempt failed and will be retried in place.
    pub const RETRY: &str = "retry";
    /// Another consumer's claim is live: waiting for its lease.
    pub const CLAIM_WAIT: &str = "claim wait";
    /// A publish re-sent on a new channel after a connection loss.
    pub const RESENT: &str = "resent";
}

/// The parent context an event arrived with: its `traceparent` (and
/// `tracestate`) headers. Missing, malformed or not text: an empty context, so
/// the span started under it is a new root. Never an error.
pub fn extract(properties: &BasicProperties) -> Context {
    match remote_span_context(properties) {
        Some(sc) => Context::new().with_remote_span_context(sc),
        None => Context::new(),
    }
}

/// The W3C trace context in `properties`, when well-formed (version 00,
/// lowercase hex, ids not all zero; see [`headers::is_valid_traceparent`]).
/// A malformed `tracestate` is dropped, keeping the `traceparent`.
pub fn remote_span_context(properties: &BasicProperties) -> Option<SpanContext> {
    let value = headers::header_str(properties, TRACEPARENT)?;
    if !headers::is_valid_traceparent(value) {
        return None;
    }
    let mut parts = value.split('-').skip(1);
    let trace_id = TraceId::from_hex(parts.next()?).ok()?;
    let span_id = SpanId::from_hex(parts.next()?).ok()?;
    let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
    let state = headers::header_str(properties, TRACESTATE)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace_id,
        span_id,
        // Only the sampled bit is defined; other flags are zeroed (W3C).
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        state,
    ))
}

/// The context to propagate for `cx`'s span: its own when valid; else (no
/// tracer provider, the span is a no-op without a parent) a fresh random one.
pub fn propagated(cx: &Context) -> SpanContext {
    let span = cx.span();
    let sc = span.span_context();
    if sc.is_valid() {
        sc.clone()
    } else {
        random_span_context()
    }
}

/// A new sampled span context with random ids (a root of its own).
pub fn random_span_context() -> SpanContext {
    let trace: u128 = rand::random::<u128>().max(1);
    let span: u64 = rand::random::<u64>().max(1);
    SpanContext::new(
        TraceId::from(trace),
        SpanId::from(span),
        TraceFlags::SAMPLED,
        false,
        Default::default(),
    )
}

/// The W3C `traceparent` value of `sc` (version 00).
pub fn traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// Sets `traceparent` (and `tracestate` when there is one) to `sc`, replacing
/// what was there.
pub fn inject(sc: &SpanContext, headers: &mut FieldTable) {
    headers.insert(TRACEPARENT.into(), long_string(&traceparent(sc)));
    let state = sc.trace_state().header();
    if state.is_empty() {
        if headers.contains_key(TRACESTATE) {
            let mut map = headers.inner().clone();
            map.remove(TRACESTATE);
            *headers = FieldTable::from(map);
        }
    } else {
        headers.insert(TRACESTATE.into(), long_string(&state));
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TraceContextExt as _;

    use super::*;

    fn props(traceparent: Option<AMQPValue>, tracestate: Option<&str>) -> BasicProperties {
        let mut headers = FieldTable::default();
        if let Some(tp) = traceparent {
            headers.insert(TRACEPARENT.into(), tp);
        }
        if let Some(ts) = tracestate {
            headers.insert(TRACESTATE.into(), long_string(ts));
        }
        BasicProperties::default().with_headers(headers)
    }

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_wellformed_traceparent_is_the_remote_parent() {
        let cx = extract(&props(Some(long_string(TP)), Some("vendor=abc")));
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_remote());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled());
        assert_eq!(sc.trace_state().header(), "vendor=abc");
        assert_eq!(traceparent(sc), TP);
    }

    #[test]
    fn malformed_or_missing_traceparent_starts_a_new_trace() {
        let bad = [
            None,
            Some(long_string("garbage")),
            Some(long_string("00-not-a-trace-context-at-all")),
            Some(long_string(
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            )),
            Some(long_string(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            )),
            Some(long_string(
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            )),
            Some(long_string(&format!("{TP}-extra"))),
            Some(AMQPValue::LongString(LongString::from(vec![0xff, 0xfe]))),
            Some(AMQPValue::LongLongInt(42)),
        ];
        for value in bad {
            let shown = format!("{value:?}");
            let cx = extract(&props(value, Some("vendor=abc")));
            assert!(!cx.has_active_span(), "{shown}");
            // What is propagated instead is a valid, fresh context.
            let fresh = propagated(&cx);
            assert!(fresh.is_valid(), "{shown}");
            assert!(headers::is_valid_traceparent(&traceparent(&fresh)));
        }
    }

    #[test]
    fn a_malformed_tracestate_keeps_the_traceparent() {
        let cx = extract(&props(Some(long_string(TP)), Some("not a = tracestate,,=")));
        assert!(cx.span().span_context().is_valid());
        assert!(cx.span().span_context().trace_state().header().is_empty());
    }

    #[test]
    fn propagated_keeps_a_valid_context_and_replaces_an_invalid_one() {
        let cx = extract(&props(Some(long_string(TP)), None));
        assert_eq!(traceparent(&propagated(&cx)), TP);
        let a = propagated(&Context::new());
        let b = propagated(&Context::new());
        assert_ne!(a.trace_id(), b.trace_id());
    }

    #[test]
    fn inject_replaces_both_headers() {
        let mut headers = FieldTable::default();
        headers.insert(TRACEPARENT.into(), long_string("garbage"));
        headers.insert(TRACESTATE.into(), long_string("stale=1"));
        let sc = random_span_context();
        inject(&sc, &mut headers);
        let props = BasicProperties::default().with_headers(headers);
        assert_eq!(
            headers::header_str(&props, TRACEPARENT),
            Some(traceparent(&sc).as_str())
        );
        assert_eq!(headers::header_str(&props, TRACESTATE), None);
        assert_eq!(
            remote_span_context(&props).map(|r| r.trace_id()),
            Some(sc.trace_id())
        );
    }

    #[test]
    fn span_names() {
        assert_eq!(span::publish("order.sharding"), "order.sharding publish");
        assert_eq!(
            span::process("order.events.shard.3"),
            "order.events.shard.3 process"
        );
        assert_eq!(span::replay("order.dlq"), "order.dlq replay");
    }
}
