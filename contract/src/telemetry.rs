//! Telemetry names, defined once: the tracer's name, span names, attribute keys
//! and span event names (docs/semantics.md §5). The W3C trace context itself is coded in
//! [`crate::w3c`].
//!
//! Spans follow the OpenTelemetry messaging semantic conventions; what is
//! shardline's own is under `shardline.*`.

use std::borrow::Cow;

use opentelemetry::InstrumentationScope;

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
    /// On a header-dropped event: the header's name.
    pub const HEADER: &str = "shardline.header";
    /// On a header-dropped event: why HTTP cannot carry its value.
    pub const DROPPED_BECAUSE: &str = "shardline.dropped_because";
    /// On a failed attempt's retry event: whose fault it was (`event`,
    /// `availability`, `configuration`, `unconfirmed`).
    pub const FAULT: &str = "shardline.fault";
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
    /// An optional header the event arrived with was left out of the
    /// downstream request (or, for `traceparent`, of the trace): its value
    /// cannot travel in HTTP or is not W3C trace context.
    pub const HEADER_DROPPED: &str = "header dropped";
}

#[cfg(test)]
mod tests {
    use super::*;

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
