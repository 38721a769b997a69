//! One delivery to an [`Outcome`]: decode, admit (dedup, sequence gate, claim),
//! call the handler.
//!
//! Nothing here acks or publishes; [`crate::settle`] maps the outcome to the
//! broker. That keeps this step drivable by tests without a consumer loop.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use shardline_topology::headers::{self, FailReason};
use shardline_topology::{Envelope, EnvelopeError, ShardId};

use crate::config::{Config, RetryPolicy};
use crate::dedup::{Admission, Dedup, Verdict};
use crate::handler::{Event, Handler, HandlerError};
use crate::stats::Stats;
use crate::store::RedisSlot;

/// A delivery as processing sees it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub body: &'a [u8],
    pub properties: &'a BasicProperties,
    pub routing_key: &'a str,
    pub redelivered: bool,
}

impl<'a> Message<'a> {
    pub fn of(delivery: &'a lapin::message::Delivery) -> Self {
        Self {
            body: &delivery.data,
            properties: &delivery.properties,
            routing_key: delivery.routing_key.as_str(),
            redelivered: delivery.redelivered,
        }
    }
}

/// What to do with a delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The handler succeeded: commit (dedup and gate), then ack.
    Processed,
    /// Processed before: ack without calling the handler.
    Duplicate,
    /// The attempt failed but may succeed: try again after `after`, keeping
    /// the claim (and so the shard's order).
    Retry {
        after: Duration,
        error: HandlerError,
    },
    /// A live claim of another consumer: look again after this long.
    Wait(Duration),
    /// Ahead of its order's sequence: hold it unacked. `start` when the order
    /// has no state yet (the start grace applies, not the gap grace).
    Hold { start: bool },
    /// Cannot succeed: publish to the dead-letter exchange, then ack.
    DeadLetter {
        reason: FailReason,
        error: String,
        /// Handler attempts made.
        attempts: u32,
    },
}

/// What survives between attempts at one delivery.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub envelope: Envelope,
    pub dedup_key: String,
    pub order_key: String,
    traceparent: Option<String>,
    published_at_ms: Option<i64>,
    /// A replay from the DLQ: it bypasses the gate.
    pub replay: bool,
    /// Quorum queues: deliveries so far (`x-delivery-count`).
    delivery_count: Option<i64>,
    token: u64,
}

impl Decoded {
    /// The admit request for this delivery.
    pub fn admission(&self, redelivered: bool, bypass_gate: bool) -> Admission<'_> {
        Admission {
            dedup_key: &self.dedup_key,
            order_key: &self.order_key,
            seq: self.envelope.seq,
            redelivered,
            bypass_gate: bypass_gate || self.replay,
            token: self.token,
        }
    }
}

/// Processes the deliveries of one shard.
pub struct Processor {
    shard: ShardId,
    handler: Arc<dyn Handler>,
    dedup: Dedup,
    retry: RetryPolicy,
    handler_timeout: Duration,
    max_body_bytes: usize,
    delivery_limit: Option<u32>,
    stats: Arc<Stats>,
}

impl Processor {
    pub fn new(
        config: &Config,
        shard: ShardId,
        handler: Arc<dyn Handler>,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            shard,
            handler,
            dedup: Dedup::new(
                &config.redis_prefix,
                config.lease(),
                config.dedup_ttl,
                config.max_deliveries,
            ),
            retry: config.retry.clone(),
            handler_timeout: config.handler_timeout,
            max_body_bytes: config.max_body_bytes,
            delivery_limit: config.delivery_limit,
            stats,
        }
    }

    pub fn dedup(&self) -> &Dedup {
        &self.dedup
    }

    /// Parses the envelope; a body that is not one is dead-lettered at once.
    pub fn decode(&self, msg: &Message<'_>) -> Result<Decoded, Outcome> {
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
        let traceparent = headers::header_str(msg.properties, headers::TRACEPARENT)
            .filter(|tp| headers::is_valid_traceparent(tp))
            .map(str::to_owned);
        Ok(Decoded {
            dedup_key: envelope.dedup_key(msg.body),
            order_key: envelope.order_key(),
            envelope,
            traceparent,
            published_at_ms: headers::header_i64(msg.properties, headers::PUBLISHED_AT_MS),
            replay: headers::header(msg.properties, headers::REPLAY).is_some(),
            delivery_count: headers::header_i64(msg.properties, headers::DELIVERY_COUNT),
            token: rand::random(),
        })
    }

    /// Attempt number `attempt` (1-based): admit the event (or renew its
    /// lease) and run the handler under its timeout. `admitted` is the first
    /// attempt's verdict when it was already asked for (pipelined with the
    /// previous event's commit). The commit is the caller's, with the ack.
    /// Waits out Redis outages.
    pub async fn attempt(
        &self,
        redis: &mut RedisSlot,
        msg: &Message<'_>,
        decoded: &Decoded,
        attempt: u32,
        admitted: Option<Verdict>,
        bypass_gate: bool,
    ) -> Outcome {
        let key = decoded.dedup_key.as_str();
        if attempt == 1 {
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
            let verdict = match admitted {
                // A hold verdict asked for early may be stale: successors released
                // by the gate may have passed since. Every other verdict stays true
                // because an order's gate only moves forward.
                Some(verdict) if !matches!(verdict, Verdict::Gap | Verdict::Start) => verdict,
                _ => {
                    self.dedup
                        .admit(redis, &decoded.admission(msg.redelivered, bypass_gate))
                        .await
                }
            };
            match verdict {
                Verdict::Claimed => {}
                Verdict::TakenOver => Stats::bump(&self.stats.takeovers),
                Verdict::Duplicate => return Outcome::Duplicate,
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
        } else {
            self.dedup.renew(redis, key).await;
        }

        let event = Event {
            envelope: &decoded.envelope,
            body: msg.body,
            dedup_key: key,
            shard: self.shard,
            attempt,
            traceparent: decoded.traceparent.as_deref(),
            published_at_ms: decoded.published_at_ms,
        };
        Stats::bump(&self.stats.handler_attempts);
        let result =
            match tokio::time::timeout(self.handler_timeout, self.handler.handle(&event)).await {
                Ok(result) => result,
                Err(_) => Err(HandlerError::Timeout(self.handler_timeout)),
            };
        match result {
            Ok(()) => Outcome::Processed,
            Err(HandlerError::Permanent(error)) => Outcome::DeadLetter {
                reason: FailReason::Handler,
                error,
                attempts: attempt,
            },
            Err(error) if attempt < self.retry.max_attempts => Outcome::Retry {
                after: self.retry.next_delay(attempt),
                error,
            },
            Err(error) => Outcome::DeadLetter {
                reason: match error {
                    HandlerError::Timeout(_) => FailReason::Timeout,
                    _ => FailReason::Handler,
                },
                error: error.to_string(),
                attempts: attempt,
            },
        }
    }

    /// Decode and first attempt in one call.
    pub async fn process_one(&self, redis: &mut RedisSlot, msg: &Message<'_>) -> Outcome {
        match self.decode(msg) {
            Ok(decoded) => self.attempt(redis, msg, &decoded, 1, None, false).await,
            Err(outcome) => outcome,
        }
    }
}
