//! The W3C trace context as it travels in AMQP headers (docs/semantics.md §2, §5): the
//! `traceparent`/`tracestate` codec, in one place.
//!
//! The context is always propagated: when no tracer provider is installed (no
//! OTLP export), a span is a no-op and [`propagated`] stands in a fresh random
//! context (or keeps the incoming one), so a publisher → worker → downstream
//! correlation holds without any exporter. Reading the headers of a delivery
//! is [`crate::headers::extract`].

use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use opentelemetry::Context;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};

/// Header of the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";
/// Header of the W3C trace state.
pub const TRACESTATE: &str = "tracestate";
/// Header of W3C baggage: forwarded to the downstream as it arrived.
pub const BAGGAGE: &str = "baggage";

/// A fresh W3C `traceparent` (version 00, sampled) of a new trace.
pub fn new_traceparent() -> String {
    traceparent(&random_span_context())
}

/// Whether `value` is a well-formed W3C `traceparent` (version 00).
pub fn is_valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    matches!(parts.as_slice(), [v, t, s, f]
        if *v == "00" && hex(t, 32) && hex(s, 16) && hex(f, 2)
            && t.bytes().any(|b| b != b'0') && s.bytes().any(|b| b != b'0'))
}

/// The remote span context of a `traceparent` (and `tracestate`) value, when
/// well-formed (version 00, lowercase hex, ids not all zero; see
/// [`is_valid_traceparent`]). A malformed `tracestate` is dropped, keeping the
/// `traceparent`.
pub fn decode(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<SpanContext> {
    let value = traceparent?;
    if !is_valid_traceparent(value) {
        return None;
    }
    let mut parts = value.split('-').skip(1);
    let trace_id = TraceId::from_hex(parts.next()?).ok()?;
    let span_id = SpanId::from_hex(parts.next()?).ok()?;
    let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
    let state = tracestate
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

    /// What an event's headers decode to, as the worker reads them.
    fn extract(traceparent: Option<&str>, tracestate: Option<&str>) -> Context {
        match decode(traceparent, tracestate) {
            Some(sc) => Context::new().with_remote_span_context(sc),
            None => Context::new(),
        }
    }

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_wellformed_traceparent_is_the_remote_parent() {
        let cx = extract(Some(TP), Some("vendor=abc"));
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
            Some("garbage".to_owned()),
            Some("00-not-a-trace-context-at-all".to_owned()),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned()),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".to_owned()),
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01".to_owned()),
            Some(format!("{TP}-extra")),
        ];
        for value in bad {
            let shown = format!("{value:?}");
            let cx = extract(value.as_deref(), Some("vendor=abc"));
            assert!(!cx.has_active_span(), "{shown}");
            // What is propagated instead is a valid, fresh context.
            let fresh = propagated(&cx);
            assert!(fresh.is_valid(), "{shown}");
            assert!(is_valid_traceparent(&traceparent(&fresh)));
        }
    }

    #[test]
    fn a_malformed_tracestate_keeps_the_traceparent() {
        let cx = extract(Some(TP), Some("not a = tracestate,,="));
        assert!(cx.span().span_context().is_valid());
        assert!(cx.span().span_context().trace_state().header().is_empty());
    }

    #[test]
    fn propagated_keeps_a_valid_context_and_replaces_an_invalid_one() {
        let cx = extract(Some(TP), None);
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
        let text = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes()).ok(),
            _ => None,
        };
        assert_eq!(text(TRACEPARENT), Some(traceparent(&sc).as_str()));
        assert_eq!(text(TRACESTATE), None);
        assert_eq!(
            decode(text(TRACEPARENT), None).map(|r| r.trace_id()),
            Some(sc.trace_id())
        );
    }
}
