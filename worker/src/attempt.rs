//! Attempt, the second stage: one attempt at a decoded event to an
//! [`Outcome`] — admit (dedup, sequence gate, claim), the breaker's
//! admission, the rate token, the handler call under its timeout, and what
//! the breaker learns from the call's fault.
//!
//! Nothing here acks or publishes; the settle stage maps the outcome to the
//! broker. The delivery's consumer span starts here (`start_trace`).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use opentelemetry::context::FutureExt as _;
use opentelemetry::global::{self, BoxedTracer};
use opentelemetry::trace::{Span as _, SpanKind, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use shardline_contract::headers::{self, FailReason};
use shardline_contract::letters::IndexEntry;
use shardline_contract::telemetry::{self, attr, op};
use shardline_contract::{ShardId, w3c};

use crate::breaker::{self, Breaker, Permit};
use crate::config::{Config, OnDeadLetter, RetryPolicy};

use crate::dedup::{DeadLettered, OrderState, Start, Verdict, Written};
use crate::delivery::{Decoded, Message, Outcome};
use crate::handler::{self, Event, Fault, Handler, HandlerError};
use crate::metrics::ShardMetrics;
use crate::rate::RateLimiter;
use crate::trace::ProcessTrace;

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

/// Processes the deliveries of one shard.
pub(crate) struct Processor {
    shard: ShardId,
    handler: Arc<dyn Handler>,
    retry: RetryPolicy,
    handler_timeout: Duration,
    max_body_bytes: usize,
    delivery_limit: Option<u32>,
    /// Quarantine mode (`OnDeadLetter::Quarantine`): events of a quarantined order are
    /// dead-lettered `quarantined`.
    quarantine: bool,
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
    ) -> Self {
        Self {
            rate,
            breaker,
            keep_alive: config.lease() / 3,
            shard,
            handler,
            retry: config.retry.clone(),
            handler_timeout: config.handler_timeout,
            max_body_bytes: config.max_body_bytes,
            delivery_limit: config.delivery_limit,
            quarantine: config.on_dead_letter == OnDeadLetter::Quarantine,
            metrics,
            tracer: global::tracer_with_scope(telemetry::scope()),
            span_name: telemetry::span::process(&config.names.shard_queue(shard)),
            queue: config.names.shard_queue(shard),
        }
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
    pub(crate) async fn attempt<S: OrderState>(
        &self,
        store: &mut S,
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
                    let permit = self.wait_turn(store, decoded, Claim::Started).await;
                    (v, permit)
                }
                Some(v) => (v, None),
                None => {
                    let permit = self.wait_turn(store, decoded, Claim::None).await;
                    self.check_replay(store, decoded).await;
                    let admission = decoded.admission(msg.redelivered, bypass_gate);
                    (store.admit(&admission).await, permit)
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
                        error: late_error(decoded),
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
            let permit = self.wait_turn(store, decoded, Claim::Idle).await;
            store.renew(&decoded.claim(), Start::Begins).await;
            permit
        };

        let result = self.call(msg, decoded, attempt, permit, trace).await;
        if matches!(&result, Err(e) if e.is_retryable()) {
            store.renew(&decoded.claim(), Start::Ended).await;
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
    async fn wait_turn<S: OrderState>(
        &self,
        store: &mut S,
        decoded: &Decoded,
        claim: Claim,
    ) -> Option<Permit<'_>> {
        match &self.breaker {
            None => None,
            Some(breaker) if !breaker.is_paused() => Some(breaker.admit(&decoded.order_key).await),
            Some(breaker) => {
                if claim == Claim::Started {
                    store.renew(&decoded.claim(), Start::Ended).await;
                }
                let admit = breaker.admit(&decoded.order_key);
                tokio::pin!(admit);
                let permit = loop {
                    tokio::select! {
                        permit = &mut admit => break permit,
                        () = tokio::time::sleep(self.keep_alive), if claim != Claim::None => {
                            store.renew(&decoded.claim(), Start::Waits).await;
                        }
                    }
                };
                if claim == Claim::Started {
                    store.renew(&decoded.claim(), Start::Begins).await;
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

    /// The largest body decoded as an envelope (`Config::max_body_bytes`).
    pub(crate) fn max_body_bytes(&self) -> usize {
        self.max_body_bytes
    }

    /// Quarantine mode is on.
    pub(crate) fn quarantines(&self) -> bool {
        self.quarantine
    }

    /// After its dead letter `id` is confirmed, in one round trip: gives the
    /// claim up (so that a replay is not suppressed), counts the seq as
    /// passed yet never processed and, in quarantine mode, holds the order.
    /// The letter's index entry is written in the same script, fenced or not.
    pub(crate) async fn dead_lettered<S: OrderState>(
        &self,
        store: &mut S,
        decoded: &Decoded,
        entry: &IndexEntry,
    ) -> Written {
        let dead = DeadLettered {
            claim: decoded.claim(),
            id: &entry.id,
            replay_of: decoded.replay_of(),
            entry,
        };
        store.dead_lettered(&dead).await
    }

    /// Indexes a confirmed dead letter that had no envelope (so no claim).
    pub(crate) async fn index_dead_letter<S: OrderState>(&self, store: &mut S, entry: &IndexEntry) {
        store.index_letter(entry).await;
    }

    /// A duplicate needs nothing, unless it is a replay: a second dead letter
    /// of an applied event no longer holds its order in quarantine, and its
    /// replay record is spent.
    pub(crate) async fn duplicate<S: OrderState>(&self, store: &mut S, decoded: &Decoded) {
        if let Some(id) = decoded.replay_of() {
            store.replay_applied(&decoded.order_key, id).await;
        }
    }

    /// Checks a replay marker against its replay record, once per delivery
    /// and before its first admit (so before the quarantine check): honoured
    /// only when the record the replay tool wrote matches this event; else
    /// the event is gated like a fresh one and the ignored marker counted,
    /// once per delivery however often it is admitted again.
    async fn check_replay<S: OrderState>(&self, store: &mut S, decoded: &Decoded) {
        let Some(marker) = decoded.replay.as_ref() else {
            return;
        };
        if !marker.unchecked() {
            return;
        }
        let honoured = store.replay_recorded(&marker.id, &marker.record).await;
        marker.checked(honoured);
        if !honoured {
            self.metrics.replay_marker_ignored();
            tracing::warn!(
                shard = %self.shard,
                order_id = %decoded.envelope.order_id,
                seq = decoded.envelope.seq,
                marker = %shardline_contract::text::shown(&marker.id),
                "replay marker ignored: no replay record matches the event; it is gated like a fresh event"
            );
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
        ProcessTrace::new(cx, span_context, traceparent, recording)
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
/// Why a seq below its order's gate is dead-lettered `late`; an ignored
/// replay marker is named, with what the operator can do.
fn late_error(decoded: &Decoded) -> String {
    let seq = decoded.envelope.seq.unwrap_or_default();
    let late = format!("seq {seq} arrived after its order moved past it (its gap was given up)");
    match &decoded.replay {
        Some(marker) => format!(
            "{late}; its replay marker {:?} has no matching replay record (spent, expired, forged, or lost in a Redis failover): replay this letter again with `shardline dlq replay`",
            marker.id
        ),
        None => late,
    }
}

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

/// A processor for unit tests: default settings, the `noop` handler, no
/// breaker or rate limit (nothing here touches Redis until an attempt).
#[cfg(test)]
pub(crate) fn test_processor() -> Processor {
    test_processor_with(&Config::default(), Arc::new(crate::handler::Noop))
}

/// A processor of shard 3 for unit tests with `config` and `handler`, no
/// breaker or rate limit.
#[cfg(test)]
pub(crate) fn test_processor_with(config: &Config, handler: Arc<dyn Handler>) -> Processor {
    let shard = ShardId::new(3, shardline_contract::ShardCount::default()).expect("shard 3 of 16");
    let metrics = crate::metrics::Metrics::new(&[shard], config.backlog, config.stuck_after);
    Processor::new(
        config,
        shard,
        handler,
        metrics.shards()[0].clone(),
        None,
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldTable, LongString};

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

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
        let p = test_processor();
        let decoded = crate::intake::decode(&msg, p.max_body_bytes()).ok();
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
