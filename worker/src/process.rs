//! One delivery to an [`Outcome`]: decode, claim, call the handler, commit.
//!
//! Nothing here acks or publishes; [`crate::settle`] maps the outcome to the
//! broker. That keeps this step drivable by tests without a consumer loop.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use shardline_topology::headers::{self, FailReason};
use shardline_topology::{Envelope, EnvelopeError, ShardId};

use crate::config::{Config, RetryPolicy};
use crate::dedup::{Claim, Dedup};
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
    /// The handler succeeded: commit the dedup key, then ack.
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
    traceparent: Option<String>,
    published_at_ms: Option<i64>,
}

/// Processes the deliveries of one shard.
pub struct Processor {
    shard: ShardId,
    handler: Arc<dyn Handler>,
    dedup: Dedup,
    retry: RetryPolicy,
    handler_timeout: Duration,
    max_body_bytes: usize,
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
            dedup: Dedup::new(&config.redis_prefix, config.lease(), config.dedup_ttl),
            retry: config.retry.clone(),
            handler_timeout: config.handler_timeout,
            max_body_bytes: config.max_body_bytes,
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
            envelope,
            traceparent,
            published_at_ms: headers::header_i64(msg.properties, headers::PUBLISHED_AT_MS),
        })
    }

    /// Attempt number `attempt` (1-based): claim (or renew) the dedup key and run
    /// the handler under its timeout. `claimed` is the first attempt's claim when it
    /// was already made (pipelined with the previous event's commit). The commit
    /// is the caller's, with the ack. Waits out Redis outages.
    pub async fn attempt(
        &self,
        redis: &mut RedisSlot,
        msg: &Message<'_>,
        decoded: &Decoded,
        attempt: u32,
        claimed: Option<Claim>,
    ) -> Outcome {
        let key = decoded.dedup_key.as_str();
        if attempt == 1 {
            let claim = match claimed {
                Some(claim) => claim,
                None => self.dedup.claim(redis, key, msg.redelivered).await,
            };
            match claim {
                Claim::Claimed => {}
                Claim::TakenOver => Stats::bump(&self.stats.takeovers),
                Claim::Duplicate => return Outcome::Duplicate,
                Claim::HeldElsewhere(ttl) => return Outcome::Wait(ttl),
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
            Ok(decoded) => self.attempt(redis, msg, &decoded, 1, None).await,
            Err(outcome) => outcome,
        }
    }
}
