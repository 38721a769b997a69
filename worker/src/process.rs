//! One delivery to an [`Outcome`]: decode, admit (dedup, sequence gate, claim),
//! call the handler.
//!
//! Nothing here acks or publishes; `settle.rs` maps the outcome to the broker.
//! [`ProcessTrace`] is the delivery's consumer span.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use opentelemetry::context::FutureExt as _;
use opentelemetry::global::{self, BoxedTracer};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use shardline_topology::headers::{self, FailReason};
use shardline_topology::letters::IndexEntry;
use shardline_topology::telemetry::{self, attr, op, outcome};
use shardline_topology::{Envelope, EnvelopeError, ShardId, w3c};

use shardline_topology::Keys;

use crate::breaker::{self, Breaker, Permit};
use crate::config::{Config, OnDeadLetter, RetryPolicy};
use crate::control;
use crate::dedup::{Admission, Claim as HeldBy, DeadLettered, Dedup, Start, Verdict, Written};
use crate::era::RedisEra;
use crate::handler::{self, Event, Fault, Handler, HandlerError};
use crate::metrics::ShardMetrics;
use crate::quarantine;
use crate::rate::RateLimiter;
use crate::store::RedisSlot;

/// A delivery as processing sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Message<'a> {
    pub(crate) body: &'a [u8],
    pub(crate) properties: &'a BasicProperties,
    /// The exchange it was published to.
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) redelivered: bool,
}

impl<'a> Message<'a> {
    pub(crate) fn of(delivery: &'a lapin::message::Delivery) -> Self {
        Self {
            body: &delivery.data,
            properties: &delivery.properties,
            exchange: delivery.exchange.as_str(),
            routing_key: delivery.routing_key.as_str(),
            redelivered: delivery.redelivered,
        }
    }
}

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    /// The handler succeeded: commit (dedup and gate), then ack.
    Processed,
    /// Processed before: ack without calling the handler.
    Duplicate,
    /// The attempt failed but may succeed (the claim is kept, and so the
    /// order's place): `settle` decides, with the event's retry budget, whether
    /// and when it is tried again.
    Failed { error: HandlerError },
    /// A live claim of another consumer: look again after this long.
    Wait(Duration),
    /// Ahead of its order's sequence: hold it unacked. `start` when the order
    /// has no state yet (the start grace applies, not the gap grace).
    Hold { start: bool },
    /// A newer consumer of the shard wrote the event's order: this consumer
    /// lost the shard. Leave the event unacked and stop consuming.
    Fenced,
    /// Cannot succeed: publish to the dead-letter exchange, then ack.
    DeadLetter {
        reason: FailReason,
        error: String,
        /// Handler attempts made.
        attempts: u32,
    },
}

/// The claim an event holds while it waits for the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// None yet (the admit comes after the wait).
    None,
    /// Made early with the previous commit: its start is counted.
    Started,
    /// Held across a failed attempt: its start was given back.
    Idle,
}

/// What survives between attempts at one delivery.
#[derive(Debug, Clone)]
pub(crate) struct Decoded {
    pub(crate) envelope: Envelope,
    pub(crate) dedup_key: String,
    pub(crate) order_key: String,
    /// Its kind's code in the order state (`Keys::kind_code`), computed once.
    pub(crate) kind_code: String,
    published_at_ms: Option<i64>,
    /// A replay from the DLQ (the dead-letter id it replays): it bypasses the gate.
    pub(crate) replay_of: Option<String>,
    /// Quorum queues: deliveries so far (`x-delivery-count`).
    delivery_count: Option<i64>,
    token: u64,
}

impl Decoded {
    /// The admit request for this delivery.
    pub(crate) fn admission(&self, redelivered: bool, bypass_gate: bool) -> Admission<'_> {
        Admission {
            claim: self.claim(),
            kind: &self.kind_code,
            redelivered,
            bypass_gate: bypass_gate || self.replay_of.is_some(),
            replay_of: self.replay_of.as_deref(),
        }
    }

    /// The claim this delivery makes (or may hold).
    pub(crate) fn claim(&self) -> HeldBy<'_> {
        HeldBy {
            dedup_key: &self.dedup_key,
            order_key: &self.order_key,
            seq: self.envelope.seq,
            token: self.token,
        }
    }
}

/// Processes the deliveries of one shard.
pub(crate) struct Processor {
    shard: ShardId,
    handler: Arc<dyn Handler>,
    dedup: Dedup,
    retry: RetryPolicy,
    handler_timeout: Duration,
    max_body_bytes: usize,
    delivery_limit: Option<u32>,
    /// Quarantine mode (`OnDeadLetter::Quarantine`): events of a quarantined order are
    /// dead-lettered `quarantined`.
    quarantine: bool,
    keys: Keys,
    metrics: Arc<ShardMetrics>,
    /// The worker's call rate limit (`Config::max_rate`), shared by its shards.
    rate: Option<Arc<RateLimiter>>,
    /// The worker's downstream breaker (`Config::breaker`), shared by its shards.
    breaker: Option<Arc<Breaker>>,
    /// How often a claim is kept alive while its event waits for the breaker.
    keep_alive: Duration,
    /// The global tracer as it was when the shard started (a no-op without
    /// a provider).
    tracer: BoxedTracer,
    queue: String,
    span_name: Cow<'static, str>,
}

impl Processor {
    pub(crate) fn new(
        config: &Config,
        shard: ShardId,
        handler: Arc<dyn Handler>,
        metrics: Arc<ShardMetrics>,
        rate: Option<Arc<RateLimiter>>,
        breaker: Option<Arc<Breaker>>,
        era: Arc<RedisEra>,
    ) -> Self {
        Self {
            rate,
            breaker,
            keep_alive: config.lease() / 3,
            shard,
            handler,
            dedup: Dedup::new(config, shard, era),
            retry: config.retry.clone(),
            handler_timeout: config.handler_timeout,
            max_body_bytes: config.max_body_bytes,
            delivery_limit: config.delivery_limit,
            quarantine: config.on_dead_letter == OnDeadLetter::Quarantine,
            keys: config.keys(),
            metrics,
            tracer: global::tracer_with_scope(telemetry::scope()),
            span_name: telemetry::span::process(&config.names.shard_queue(shard)),
            queue: config.names.shard_queue(shard),
        }
    }

    pub(crate) fn dedup(&self) -> &Dedup {
        &self.dedup
    }

    /// The worker's breaker, when it has one (`Config::breaker` enabled).
    pub(crate) fn breaker(&self) -> Option<&Breaker> {
        self.breaker.as_deref()
    }

    /// Whether the next delivery may be claimed early, with the current
    /// commit: not while calls are paused or rate-limited, so that an event
    /// waiting for its turn never holds a counted handler start.
    pub(crate) fn claims_early(&self) -> bool {
        self.rate.is_none() && !self.breaker.as_ref().is_some_and(|b| b.is_paused())
    }

    /// How failed attempts are retried (`Config::retry`).
    pub(crate) fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// Parses the envelope; a body that is not one is dead-lettered at once.
    /// A control message is recognised first, by its header, and never
    /// decoded as an event (`control.rs`).
    pub(crate) fn decode(&self, msg: &Message<'_>) -> Result<Decoded, Outcome> {
        if let Some(message) = control::recognise(msg.properties) {
            let control::Verdict::DeadLetter { reason, error } = control::handle(&message);
            return Err(Outcome::DeadLetter {
                reason,
                error,
                attempts: 0,
            });
        }
        let envelope = Envelope::parse(msg.body, self.max_body_bytes).map_err(|e| {
            let reason = match e {
                EnvelopeError::Decode(_) => FailReason::Decode,
                EnvelopeError::Invalid(_) => FailReason::Invalid,
            };
            Outcome::DeadLetter {
                reason,
                error: e.to_string(),
                attempts: 0,
            }
        })?;
        Ok(Decoded {
            dedup_key: envelope.dedup_key(msg.body),
            order_key: envelope.order_key(),
            kind_code: Keys::kind_code(&envelope.event),
            envelope,
            published_at_ms: headers::header_i64(msg.properties, headers::PUBLISHED_AT_MS),
            replay_of: headers::header(msg.properties, headers::REPLAY).map(|_| {
                headers::header_str(msg.properties, headers::REPLAY)
                    .unwrap_or_default()
                    .to_owned()
            }),
            delivery_count: headers::header_i64(msg.properties, headers::DELIVERY_COUNT),
            token: rand::random(),
        })
    }

    /// Attempt number `attempt` (1-based): admit the event (or renew its
    /// lease) and run the handler under its timeout. Every handler attempt of
    /// every shard, serial or concurrent, passes through here and nowhere else:
    /// the breaker's wait comes first, before the admit counts a start; the
    /// rate limit's token right before the call. `admitted` is the first
    /// attempt's verdict when it was already asked for (pipelined with the
    /// previous event's commit). The commit is the caller's, with the ack.
    /// Waits out Redis outages.
    #[expect(
        clippy::too_many_arguments,
        reason = "one attempt's inputs, each from a different owner (settle, lookahead, gate)"
    )]
    pub(crate) async fn attempt(
        &self,
        redis: &mut RedisSlot,
        msg: &Message<'_>,
        decoded: &Decoded,
        attempt: u32,
        admitted: Option<Verdict>,
        bypass_gate: bool,
        trace: &ProcessTrace,
    ) -> Outcome {
        let permit = if attempt == 1 {
            if let (Some(limit), Some(count)) = (self.delivery_limit, decoded.delivery_count)
                && count >= i64::from(limit.saturating_sub(1))
            {
                return Outcome::DeadLetter {
                    reason: FailReason::CrashLoop,
                    error: format!(
                        "delivered {count} times; the queue's delivery limit is {limit}"
                    ),
                    attempts: 0,
                };
            }
            // A hold verdict asked for early may be stale: successors released
            // by the gate may have passed since. Every other verdict stays true
            // because an order's gate only moves forward.
            let early = admitted.filter(|v| !matches!(v, Verdict::Gap | Verdict::Start));
            let (verdict, permit) = match early {
                Some(v @ (Verdict::Claimed | Verdict::TakenOver)) => {
                    let permit = self.wait_turn(redis, decoded, Claim::Started).await;
                    (v, permit)
                }
                Some(v) => (v, None),
                None => {
                    let permit = self.wait_turn(redis, decoded, Claim::None).await;
                    let admission = decoded.admission(msg.redelivered, bypass_gate);
                    (self.dedup.admit(redis, &admission).await, permit)
                }
            };
            match verdict {
                Verdict::Claimed => {}
                Verdict::TakenOver => self.metrics.took_over(),
                Verdict::Duplicate => return Outcome::Duplicate,
                Verdict::Fenced => return Outcome::Fenced,
                Verdict::Wait(ttl) => return Outcome::Wait(ttl),
                Verdict::Gap => return Outcome::Hold { start: false },
                Verdict::Start => return Outcome::Hold { start: true },
                Verdict::Late => {
                    return Outcome::DeadLetter {
                        reason: FailReason::Late,
                        error: format!(
                            "seq {} arrived after its order moved past it (its gap was given up)",
                            decoded.envelope.seq.unwrap_or_default()
                        ),
                        attempts: 0,
                    };
                }
                Verdict::Quarantined(blocker) => {
                    let order = &decoded.envelope.order_id;
                    return Outcome::DeadLetter {
                        reason: FailReason::Quarantined,
                        error: format!(
                            "order {order} is quarantined behind seq {} (dead letter {}); replay the order's dead letters or `shardline dlq release --order-id {order}`",
                            blocker.seq, blocker.id
                        ),
                        attempts: 0,
                    };
                }
                Verdict::CrashLoop(starts) => {
                    return Outcome::DeadLetter {
                        reason: FailReason::CrashLoop,
                        error: format!(
                            "the handler was started {starts} times and the worker died each time"
                        ),
                        attempts: starts,
                    };
                }
            }
            permit
        } else {
            // The claim is ours and its last start ended: kept alive while
            // waiting, counted again when the call begins (the lease counts
            // from the call).
            let permit = self.wait_turn(redis, decoded, Claim::Idle).await;
            self.dedup
                .renew(redis, &decoded.claim(), Start::Begins)
                .await;
            permit
        };

        let result = self.call(msg, decoded, attempt, permit, trace).await;
        if matches!(&result, Err(e) if e.is_retryable()) {
            self.dedup
                .renew(redis, &decoded.claim(), Start::Ended)
                .await;
        }
        Self::outcome(result, attempt)
    }

    /// What a call's result makes of the event (a retryable failure's start
    /// is given back by the caller).
    pub(crate) fn outcome(result: Result<(), HandlerError>, attempt: u32) -> Outcome {
        match result {
            Ok(()) => Outcome::Processed,
            Err(error) if !error.is_retryable() => Outcome::DeadLetter {
                reason: FailReason::Handler,
                error: error.to_string(),
                attempts: attempt,
            },
            Err(error) => Outcome::Failed { error },
        }
    }

    /// One handler call: the rate limit's token, the handler under its
    /// timeout, the result recorded with the breaker's `permit`.
    async fn call(
        &self,
        msg: &Message<'_>,
        decoded: &Decoded,
        attempt: u32,
        permit: Option<Permit<'_>>,
        trace: &ProcessTrace,
    ) -> Result<(), HandlerError> {
        self.rate_token().await;
        let event = Event {
            envelope: &decoded.envelope,
            body: msg.body,
            dedup_key: &decoded.dedup_key,
            shard: self.shard,
            attempt,
            trace: trace.context(),
            traceparent: trace.traceparent(),
            published_at_ms: decoded.published_at_ms,
            baggage: headers::header_bytes(msg.properties, headers::BAGGAGE),
        };
        self.metrics.attempt();
        // The process span is the current context inside the handler, for
        // handlers whose own instrumentation reads it.
        let handled = self
            .handler
            .handle(&event)
            .with_context(trace.context().clone());
        let result = match tokio::time::timeout(self.handler_timeout, handled).await {
            Ok(result) => result,
            Err(_) => Err(HandlerError::timeout(self.handler_timeout)),
        };
        if let Err(e) = &result {
            self.metrics.attempt_failed(e.fault());
        }
        if let Some(permit) = permit {
            permit.record(breaker_verdict(&result, attempt));
        }
        result
    }

    /// The first call of a claimed event of a group (`--group-commit`): the
    /// breaker's permit (the group runs only while calls are not paused),
    /// then the call.
    pub(crate) async fn grouped_call(
        &self,
        msg: &Message<'_>,
        decoded: &Decoded,
        trace: &ProcessTrace,
    ) -> Result<(), HandlerError> {
        let permit = match &self.breaker {
            Some(breaker) => Some(breaker.admit(&decoded.order_key).await),
            None => None,
        };
        self.call(msg, decoded, 1, permit, trace).await
    }

    /// Waits until the breaker lets a handler call start (at once when
    /// closed) — before the admit counts a start, outside the call's timeout,
    /// and not an attempt. A claim the event holds is kept alive while the
    /// breaker keeps it waiting, its start not counted meanwhile.
    async fn wait_turn(
        &self,
        redis: &mut RedisSlot,
        decoded: &Decoded,
        claim: Claim,
    ) -> Option<Permit<'_>> {
        match &self.breaker {
            None => None,
            Some(breaker) if !breaker.is_paused() => Some(breaker.admit(&decoded.order_key).await),
            Some(breaker) => {
                if claim == Claim::Started {
                    self.dedup
                        .renew(redis, &decoded.claim(), Start::Ended)
                        .await;
                }
                let admit = breaker.admit(&decoded.order_key);
                tokio::pin!(admit);
                let permit = loop {
                    tokio::select! {
                        permit = &mut admit => break permit,
                        () = tokio::time::sleep(self.keep_alive), if claim != Claim::None => {
                            self.dedup.renew(redis, &decoded.claim(), Start::Waits).await;
                        }
                    }
                };
                if claim == Claim::Started {
                    self.dedup
                        .renew(redis, &decoded.claim(), Start::Begins)
                        .await;
                }
                Some(permit)
            }
        }
    }

    /// Waits for a token of the worker's rate limit, if it has one: right
    /// before the call (outside its timeout, not an attempt), so that calls,
    /// not admits, keep to the rate.
    async fn rate_token(&self) {
        if let Some(rate) = &self.rate {
            rate.acquire().await;
        }
    }

    /// Quarantine mode is on.
    pub(crate) fn quarantines(&self) -> bool {
        self.quarantine
    }

    /// After its dead letter `id` is confirmed, in one round trip: gives the
    /// claim up (so that a replay is not suppressed), counts the seq as
    /// passed yet never processed and, in quarantine mode, holds the order.
    /// The letter's index entry is written in the same script, fenced or not.
    pub(crate) async fn dead_lettered(
        &self,
        redis: &mut RedisSlot,
        decoded: &Decoded,
        entry: &IndexEntry,
    ) -> Written {
        let dead = DeadLettered {
            claim: decoded.claim(),
            id: &entry.id,
            replay_of: decoded.replay_of.as_deref(),
            entry,
        };
        self.dedup.dead_lettered(redis, &dead).await
    }

    /// Indexes a confirmed dead letter that had no envelope (so no claim).
    pub(crate) async fn index_dead_letter(&self, redis: &mut RedisSlot, entry: &IndexEntry) {
        self.dedup.index_letter(redis, entry).await;
    }

    /// A duplicate needs nothing, unless it is a replay: a second dead letter
    /// of an applied event no longer holds its order in quarantine.
    pub(crate) async fn duplicate(&self, redis: &mut RedisSlot, decoded: &Decoded) {
        if let Some(id) = &decoded.replay_of {
            quarantine::leave(redis, &self.keys, &decoded.order_key, id).await;
        }
    }

    /// Opens the delivery's consumer span, `{queue} process`, as a child of the
    /// context in its headers (a new root when that is missing or malformed).
    /// Attributes are only built when the span records.
    pub(crate) fn start_trace(&self, msg: &Message<'_>, decoded: Option<&Decoded>) -> ProcessTrace {
        let parent = headers::extract(msg.properties);
        let span = self
            .tracer
            .span_builder(self.span_name.clone())
            .with_kind(SpanKind::Consumer)
            .start_with_context(&self.tracer, &parent);
        let recording = span.is_recording();
        let mut cx = parent.with_span(span);
        let span_context = w3c::propagated(&cx);
        if !recording && !cx.span().span_context().is_valid() {
            // No provider and no parent: a fresh context still correlates the
            // downstream call, the dead letter and the log lines.
            cx = Context::new().with_remote_span_context(span_context.clone());
        }
        if recording {
            cx.span().set_attributes(self.span_attributes(msg, decoded));
            if let Some(why) = dropped_traceparent(msg.properties) {
                cx.span().add_event(
                    telemetry::event::HEADER_DROPPED,
                    vec![
                        KeyValue::new(attr::HEADER, headers::TRACEPARENT),
                        KeyValue::new(attr::DROPPED_BECAUSE, why),
                    ],
                );
            }
        }
        let traceparent = w3c::traceparent(&span_context);
        ProcessTrace {
            cx,
            span_context,
            traceparent,
            recording,
            finished: false,
        }
    }

    fn span_attributes(&self, msg: &Message<'_>, decoded: Option<&Decoded>) -> Vec<KeyValue> {
        let mut attributes = vec![
            KeyValue::new(attr::MESSAGING_SYSTEM, attr::MESSAGING_SYSTEM_RABBITMQ),
            KeyValue::new(attr::MESSAGING_OPERATION, op::PROCESS),
            KeyValue::new(attr::MESSAGING_DESTINATION_NAME, msg.exchange.to_owned()),
            KeyValue::new(attr::MESSAGING_ROUTING_KEY, msg.routing_key.to_owned()),
            KeyValue::new(
                attr::MESSAGING_BODY_SIZE,
                i64::try_from(msg.body.len()).unwrap_or(i64::MAX),
            ),
            KeyValue::new(attr::QUEUE, self.queue.clone()),
            KeyValue::new(attr::SHARD, i64::from(self.shard.get())),
        ];
        if let Some(id) = msg.properties.message_id() {
            attributes.push(KeyValue::new(
                attr::MESSAGING_MESSAGE_ID,
                id.as_str().to_owned(),
            ));
        }
        if let Some(d) = decoded {
            attributes.push(KeyValue::new(
                attr::ORDER_ID,
                d.envelope.order_id.to_string(),
            ));
            attributes.push(KeyValue::new(attr::EVENT, d.envelope.event.clone()));
            attributes.push(KeyValue::new(attr::DEDUP_KEY, d.dedup_key.clone()));
            if let Some(seq) = d.envelope.seq.and_then(|s| i64::try_from(s).ok()) {
                attributes.push(KeyValue::new(attr::SEQ, seq));
            }
        }
        attributes
    }
}

/// Why an incoming `traceparent` was not continued (the span is a new root),
/// when there was one.
fn dropped_traceparent(properties: &BasicProperties) -> Option<String> {
    headers::header(properties, headers::TRACEPARENT)?;
    let Some(bytes) = headers::header_bytes(properties, headers::TRACEPARENT) else {
        return Some("not text".into());
    };
    if let Err(why) = handler::sendable(bytes, handler::TRACEPARENT_LIMIT) {
        return Some(why.to_string());
    }
    let valid = std::str::from_utf8(bytes).is_ok_and(headers::is_valid_traceparent);
    (!valid).then(|| "not a W3C traceparent".into())
}

/// What a call's result tells the breaker: only its fault decides.
fn breaker_verdict(result: &Result<(), HandlerError>, attempt: u32) -> breaker::Verdict {
    let Err(error) = result else {
        return breaker::Verdict::Success;
    };
    match (error.fault(), error) {
        (Fault::Availability, _) => breaker::Verdict::Failure {
            first: attempt == 1,
            retry_after: error.retry_after(),
        },
        (Fault::Configuration, _) => breaker::Verdict::Misconfigured {
            error: error.to_string(),
        },
        (Fault::Unconfirmed, HandlerError::Refused { answer, .. }) => breaker::Verdict::Refused {
            answer: answer.clone(),
            error: error.to_string(),
        },
        _ => breaker::Verdict::Neutral,
    }
}

/// One delivery's consumer span (`{queue} process`) and what is propagated from
/// it: the handler's context and `traceparent`, and a dead letter's trace
/// context. Ends when settled; dropped unsettled (stop, lost connection), it
/// ends with outcome `abandoned`.
pub(crate) struct ProcessTrace {
    cx: Context,
    span_context: SpanContext,
    traceparent: String,
    recording: bool,
    finished: bool,
}

impl ProcessTrace {
    /// The context holding the process span: the parent of handler spans.
    pub(crate) fn context(&self) -> &Context {
        &self.cx
    }

    /// The span context propagated downstream and onto a dead letter: the
    /// process span's, or (no tracer provider) the incoming one, else a fresh one.
    pub(crate) fn span_context(&self) -> &SpanContext {
        &self.span_context
    }

    pub(crate) fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// A failed attempt, to be retried after `after`.
    pub(crate) fn retry(&self, attempt: u32, after: Duration, error: &HandlerError) {
        if self.recording {
            self.cx.span().add_event(
                telemetry::event::RETRY,
                vec![
                    KeyValue::new(attr::ATTEMPT, i64::from(attempt)),
                    KeyValue::new(
                        attr::RETRY_IN_MS,
                        i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    ),
                    KeyValue::new(attr::ERROR, error.to_string()),
                    KeyValue::new(attr::FAULT, error.fault().as_str()),
                ],
            );
        }
    }

    /// Waiting for another consumer's claim to lapse.
    pub(crate) fn claim_wait(&self, after: Duration) {
        if self.recording {
            self.cx.span().add_event(
                telemetry::event::CLAIM_WAIT,
                vec![KeyValue::new(
                    attr::RETRY_IN_MS,
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                )],
            );
        }
    }

    /// Ends the span with `outcome` (a [`telemetry::outcome`] value) after
    /// `attempts` handler attempts.
    pub(crate) fn finish(mut self, outcome: &'static str, attempts: u32) {
        self.end(outcome, attempts, Vec::new());
    }

    /// Ends the span of a dead-lettered event, with an error status.
    pub(crate) fn dead_lettered(
        mut self,
        reason: FailReason,
        attempts: u32,
        id: &str,
        error: &str,
    ) {
        if self.recording {
            self.cx.span().set_status(Status::error(error.to_owned()));
        }
        self.end(
            outcome::DEAD_LETTERED,
            attempts,
            vec![
                KeyValue::new(attr::FAIL_REASON, reason.as_str()),
                KeyValue::new(attr::DEAD_LETTER_ID, id.to_owned()),
                KeyValue::new(attr::ERROR, error.to_owned()),
            ],
        );
    }

    fn end(&mut self, outcome: &'static str, attempts: u32, mut more: Vec<KeyValue>) {
        self.finished = true;
        if !self.recording {
            return;
        }
        more.push(KeyValue::new(attr::OUTCOME, outcome));
        more.push(KeyValue::new(attr::ATTEMPT, i64::from(attempts)));
        let span = self.cx.span();
        span.set_attributes(more);
        span.end();
    }
}

impl Drop for ProcessTrace {
    fn drop(&mut self) {
        if !self.finished {
            self.end(outcome::ABANDONED, 0, Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use shardline_topology::ShardCount;

    use super::*;
    use crate::handler::Noop;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn processor() -> Processor {
        let config = Config::default();
        let shard = ShardId::new(3, ShardCount::default()).unwrap();
        let metrics = crate::metrics::Metrics::new(&[shard], config.backlog, config.stuck_after);
        Processor::new(
            &config,
            shard,
            Arc::new(Noop),
            metrics.shards()[0].clone(),
            None,
            None,
            Arc::new(RedisEra::new(config.keys().redis_era())),
        )
    }

    fn with_traceparent(value: Option<&[u8]>) -> BasicProperties {
        let mut headers = FieldTable::default();
        if let Some(v) = value {
            headers.insert(
                headers::TRACEPARENT.into(),
                AMQPValue::LongString(LongString::from(v.to_vec())),
            );
        }
        BasicProperties::default().with_headers(headers)
    }

    fn trace_of(props: &BasicProperties) -> ProcessTrace {
        let msg = Message {
            body: br#"{"order_id":"A1","event":"order.created","seq":1}"#,
            properties: props,
            exchange: "order.sharding",
            routing_key: "shard.3",
            redelivered: false,
        };
        let p = processor();
        let decoded = p.decode(&msg).ok();
        p.start_trace(&msg, decoded.as_ref())
    }

    /// No tracer provider is installed in unit tests: the incoming context is
    /// what the handler and a dead letter get.
    #[test]
    fn a_valid_traceparent_is_continued() {
        let trace = trace_of(&with_traceparent(Some(TP.as_bytes())));
        assert_eq!(trace.traceparent(), TP);
        assert!(trace.context().span().span_context().is_valid());
    }

    #[test]
    fn a_malformed_or_missing_traceparent_starts_a_new_trace() {
        for bad in [
            None,
            Some(&b"garbage"[..]),
            Some(&b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..]),
            Some(&[0xff, 0xfe][..]),
        ] {
            let a = trace_of(&with_traceparent(bad));
            let b = trace_of(&with_traceparent(bad));
            assert!(headers::is_valid_traceparent(a.traceparent()), "{bad:?}");
            assert_ne!(a.traceparent(), TP);
            assert_ne!(
                a.span_context().trace_id(),
                b.span_context().trace_id(),
                "{bad:?}: each is a new root"
            );
            // The handler's context agrees with what is sent downstream.
            assert_eq!(
                a.context().span().span_context().trace_id(),
                a.span_context().trace_id()
            );
        }
    }
}
