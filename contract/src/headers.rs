//! AMQP properties and headers: what the publisher sets, what the worker reads,
//! and what a dead letter carries (docs/semantics.md §2, §3).

use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, TraceContextExt as _};

use crate::w3c;
pub use crate::w3c::{BAGGAGE, TRACEPARENT, TRACESTATE, is_valid_traceparent, new_traceparent};

/// Publish time in milliseconds since the Unix epoch (signed 64-bit), as
/// the publisher claims it: a time later than the worker received the event
/// is ignored, an earlier one is labelled `publisher-claimed` in the backlog
/// levels (docs/semantics.md §5).
pub const PUBLISHED_AT_MS: &str = "x-published-at-ms";
/// The broker's own stamp, milliseconds since the Unix epoch: set by RabbitMQ
/// 3.12+ with `message_interceptors.incoming.set_header_timestamp` (and by
/// the older `rabbitmq_message_timestamp` plugin). Trusted only when a round
/// trip showed that the broker overwrites it (`shardline_connect::stamps`).
pub const BROKER_TIMESTAMP_MS: &str = "timestamp_in_ms";

/// Dead-letter headers.
pub const FAIL_REASON: &str = "x-fail-reason";
pub const ERROR: &str = "x-error";
pub const RETRY_COUNT: &str = "x-retry-count";
pub const SHARD: &str = "x-shard";
pub const ORIGINAL_ROUTING_KEY: &str = "x-original-routing-key";
pub const FIRST_FAILED_AT: &str = "x-first-failed-at";
pub const DEAD_LETTER_ID: &str = "x-dead-letter-id";

/// Set on a message republished from the dead-letter queue, to the id of its
/// replay record ([`crate::replay`]): with a record that matches the event,
/// the sequence gate lets it through; without one the marker is ignored.
pub const REPLAY: &str = "x-shardline-replay";
/// Marks a control message (an instruction to the worker, such as a drain
/// marker), not an event; its value names the kind.
pub const CONTROL: &str = "x-shardline-control";
/// A drain marker's single-use id (`x-shardline-control: drain` or `close`),
/// recorded by the reshard before it sent the marker.
pub const MARKER_ID: &str = "x-shardline-marker";
/// The move a drain marker hands over (its number in the reshard's plan).
pub const MARKER_MOVE: &str = "x-shardline-move";
/// When an outbox row was written (its `written_at`, milliseconds since the
/// Unix epoch): set by the outbox relay. The time of writing, not of commit
/// (PostgreSQL keeps commit times only with `track_commit_timestamp`).
pub const WRITTEN_AT_MS: &str = "x-written-at-ms";
/// The outbox relay that published the event (its `--name`).
pub const RELAY: &str = "x-shardline-relay";
/// Set on an event a worker forwarded (resharding, legacy routing) that
/// had been delivered before: a consumer before it may hold its claim, so
/// the next consumer treats the copy as a redelivery (it may take over).
pub const REDELIVERED: &str = "x-shardline-redelivered";
/// `x-shardline-control` of a move's drain marker, sent into its old shard queue.
pub const CONTROL_DRAIN: &str = "drain";
/// `x-shardline-control` of a move's close marker, sent into its holding queue.
pub const CONTROL_CLOSE: &str = "close";
/// Quorum queues: how many times the broker delivered the message before.
pub const DELIVERY_COUNT: &str = "x-delivery-count";

/// Longest `x-error` text; longer messages are cut at a character boundary.
pub const MAX_ERROR_CHARS: usize = 1024;

const PERSISTENT: u8 = 2;
const JSON: &str = "application/json";

/// Why an event was dead-lettered: the `x-fail-reason` header and the routing key
/// on the dead-letter exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// Not UTF-8 JSON.
    Decode,
    /// JSON that is not a valid envelope, or an oversize body.
    Invalid,
    /// The handler failed permanently or past the retry limit.
    Handler,
    /// The handler timed out on its last attempt.
    Timeout,
    SeqGap,
    Late,
    CrashLoop,
    Quarantined,
    /// A control message (`x-shardline-control`) the worker does not know
    /// or cannot verify: never processed as an event.
    Control,
}

impl FailReason {
    pub const ALL: [Self; 9] = [
        Self::Decode,
        Self::Invalid,
        Self::Handler,
        Self::Timeout,
        Self::SeqGap,
        Self::Late,
        Self::CrashLoop,
        Self::Quarantined,
        Self::Control,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Invalid => "invalid",
            Self::Handler => "handler",
            Self::Timeout => "timeout",
            Self::SeqGap => "seq-gap",
            Self::Late => "late",
            Self::CrashLoop => "crash-loop",
            Self::Quarantined => "quarantined",
            Self::Control => "control",
        }
    }
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FailReason {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown reason `{s}`"))
    }
}

/// Properties of a newly published event: persistent JSON with a message id,
/// a timestamp, the publish time in milliseconds and a W3C trace context.
pub fn event_properties(
    message_id: &str,
    published_at: SystemTime,
    traceparent: &str,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(TRACEPARENT.into(), long_string(traceparent));
    properties_with(message_id, published_at, headers)
}

/// [`event_properties`] with the trace context of `trace` (the publish span):
/// `traceparent`, and `tracestate` when it has one.
pub fn traced_event_properties(
    message_id: &str,
    published_at: SystemTime,
    trace: &SpanContext,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    w3c::inject(trace, &mut headers);
    properties_with(message_id, published_at, headers)
}

fn properties_with(
    message_id: &str,
    published_at: SystemTime,
    mut headers: FieldTable,
) -> BasicProperties {
    let since_epoch = published_at.duration_since(UNIX_EPOCH).unwrap_or_default();
    headers.insert(
        PUBLISHED_AT_MS.into(),
        AMQPValue::LongLongInt(i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)),
    );
    let mut props = BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_content_type(JSON.into())
        .with_timestamp(since_epoch.as_secs())
        .with_headers(headers);
    if let Ok(id) = ShortString::try_new(message_id) {
        props = props.with_message_id(id);
    }
    props
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

/// The W3C trace context in `properties`, when well-formed ([`w3c::decode`]).
pub fn remote_span_context(properties: &BasicProperties) -> Option<SpanContext> {
    w3c::decode(
        header_str(properties, TRACEPARENT),
        header_str(properties, TRACESTATE),
    )
}

/// A header value, if present.
pub fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref()?.inner().get(name)
}

/// A header as text: a long or short string that is valid UTF-8.
pub fn header_str<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a str> {
    match header(props, name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        _ => None,
    }
}

/// A header's raw bytes: a long or short string, whatever it holds.
pub fn header_bytes<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a [u8]> {
    match header(props, name)? {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}

/// A header as a signed integer, whatever integer type the publisher chose.
pub fn header_i64(props: &BasicProperties, name: &str) -> Option<i64> {
    value_i64(header(props, name)?)
}

/// An AMQP value as a signed integer, whatever integer type it was sent as.
pub fn value_i64(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::ShortShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::Timestamp(v) => i64::try_from(*v).ok(),
        _ => None,
    }
}

/// What the worker knows about a failure when it dead-letters an event.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub reason: FailReason,
    pub error: String,
    /// Handler attempts made (0 when the event never reached the handler).
    pub retry_count: u32,
    pub shard: u16,
    pub original_routing_key: String,
    pub first_failed_at: SystemTime,
    /// Unique id the DLQ commands address the dead letter by.
    pub id: String,
    /// The trace context the dead letter carries: the worker's process span,
    /// so a replay continues the trace under it. `None` keeps the original
    /// `traceparent`/`tracestate`.
    pub trace: Option<SpanContext>,
}

impl DeadLetter {
    /// The original properties with the dead-letter headers added. Existing
    /// headers are kept, the trace context too unless [`Self::trace`] replaces
    /// it; a re-dead-lettered replay gets fresh values.
    pub fn properties(&self, original: &BasicProperties) -> BasicProperties {
        let mut headers = original.headers().clone().unwrap_or_default();
        headers.insert(FAIL_REASON.into(), long_string(self.reason.as_str()));
        headers.insert(
            ERROR.into(),
            long_string(&truncate(&self.error, MAX_ERROR_CHARS)),
        );
        headers.insert(
            RETRY_COUNT.into(),
            AMQPValue::LongLongInt(i64::from(self.retry_count)),
        );
        headers.insert(SHARD.into(), AMQPValue::LongLongInt(i64::from(self.shard)));
        headers.insert(
            ORIGINAL_ROUTING_KEY.into(),
            long_string(&self.original_routing_key),
        );
        headers.insert(
            FIRST_FAILED_AT.into(),
            long_string(&humantime::format_rfc3339_millis(self.first_failed_at).to_string()),
        );
        headers.insert(DEAD_LETTER_ID.into(), long_string(&self.id));
        if let Some(trace) = &self.trace {
            w3c::inject(trace, &mut headers);
        }
        let props = original.clone().with_headers(headers);
        if props.delivery_mode().is_none() {
            props.with_delivery_mode(PERSISTENT)
        } else {
            props
        }
    }
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

fn truncate(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_properties_carry_spec_fields() {
        let tp = new_traceparent();
        let props = event_properties("m-1", SystemTime::now(), &tp);
        assert_eq!(*props.delivery_mode(), Some(2));
        assert_eq!(
            props.content_type().as_ref().map(|s| s.as_str()),
            Some(JSON)
        );
        assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert!(props.timestamp().is_some());
        assert!(header_i64(&props, PUBLISHED_AT_MS).is_some_and(|ms| ms > 0));
        assert_eq!(header_str(&props, TRACEPARENT), Some(tp.as_str()));
        assert!(is_valid_traceparent(&tp));
    }

    #[test]
    fn overlong_message_ids_are_left_out_not_fatal() {
        let props = event_properties(&"x".repeat(300), SystemTime::now(), &new_traceparent());
        assert!(props.message_id().is_none());
    }

    #[test]
    fn traceparent_validation() {
        assert!(is_valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        for bad in [
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad}");
        }
    }

    #[test]
    fn dead_letter_headers_extend_the_original() {
        let original = event_properties("m-1", SystemTime::now(), &new_traceparent());
        let dl = DeadLetter {
            reason: FailReason::Handler,
            error: "é".repeat(2000),
            retry_count: 5,
            shard: 3,
            original_routing_key: "shard.3".into(),
            first_failed_at: SystemTime::now(),
            id: "dl-1".into(),
            trace: None,
        };
        let props = dl.properties(&original);
        assert_eq!(header_str(&props, FAIL_REASON), Some("handler"));
        assert_eq!(header_i64(&props, RETRY_COUNT), Some(5));
        assert_eq!(header_i64(&props, SHARD), Some(3));
        assert_eq!(header_str(&props, DEAD_LETTER_ID), Some("dl-1"));
        assert!(header_str(&props, TRACEPARENT).is_some());
        assert_eq!(
            header_str(&props, ERROR).map(|e| e.chars().count()),
            Some(MAX_ERROR_CHARS + 1)
        );
        assert_eq!(props.message_id(), original.message_id());
        assert_eq!(
            header_str(&props, TRACEPARENT),
            header_str(&original, TRACEPARENT)
        );
    }

    #[test]
    fn dead_letters_can_carry_the_process_span_context() {
        let original = event_properties("m-1", SystemTime::now(), &new_traceparent());
        let process = w3c::random_span_context();
        let dl = DeadLetter {
            reason: FailReason::Handler,
            error: "boom".into(),
            retry_count: 1,
            shard: 0,
            original_routing_key: "shard.0".into(),
            first_failed_at: SystemTime::now(),
            id: "dl-2".into(),
            trace: Some(process.clone()),
        };
        let props = dl.properties(&original);
        assert_eq!(
            header_str(&props, TRACEPARENT),
            Some(w3c::traceparent(&process).as_str())
        );
    }

    #[test]
    fn traced_properties_carry_the_span_context() {
        let sc = w3c::random_span_context();
        let props = traced_event_properties("m-1", SystemTime::now(), &sc);
        assert_eq!(
            header_str(&props, TRACEPARENT),
            Some(w3c::traceparent(&sc).as_str())
        );
        assert!(header_str(&props, TRACESTATE).is_none());
        assert!(header_i64(&props, PUBLISHED_AT_MS).is_some());
        assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
    }

    #[test]
    fn reasons_round_trip() {
        for r in FailReason::ALL {
            assert_eq!(r.as_str().parse::<FailReason>(), Ok(r));
        }
    }
}
