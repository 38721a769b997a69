//! Drives one delivery to its end. The `match` in [`settle`] is the one place an
//! [`Outcome`] meets the broker: ack, sleep and retry, or dead-letter then ack.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use lapin::options::{BasicAckOptions, BasicPublishOptions};
use lapin::{Channel, Confirmation};
use shardline_topology::Names;
use shardline_topology::headers::DeadLetter;

use crate::lookahead::{Lookahead, Ready};
use crate::process::{Message, Outcome, Processor};
use crate::stats::Stats;
use crate::store::RedisSlot;

/// While the dead-letter queue cannot take a message, how long to wait between
/// tries. The event stays unacked meanwhile: nothing is acked before its copy is.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// What one shard needs to settle its deliveries.
pub struct ShardContext {
    pub processor: Processor,
    pub names: Names,
    pub shard: shardline_topology::ShardId,
    pub stats: Arc<Stats>,
}

/// Processes `delivery` until it is acked (processed, duplicate or
/// dead-lettered). `in_flight` holds the dedup key while a claim may be held, so
/// that a caller who abandons this future can release it.
pub async fn settle(
    ctx: &ShardContext,
    channel: &Channel,
    redis: &mut RedisSlot,
    ready: Ready,
    lookahead: &mut Lookahead,
    in_flight: &mut Option<String>,
) -> Result<(), lapin::Error> {
    let Ready {
        delivery,
        decoded,
        mut claim,
    } = ready;
    let msg = Message::of(&delivery);
    let mut attempt = 1;
    let mut first_failed_at = None;
    loop {
        let outcome = match &decoded {
            Ok(decoded) => {
                *in_flight = Some(decoded.dedup_key.clone());
                ctx.processor
                    .attempt(redis, &msg, decoded, attempt, claim.take())
                    .await
            }
            Err(outcome) => outcome.clone(),
        };
        match outcome {
            Outcome::Processed => {
                let key = decoded
                    .as_ref()
                    .map(|d| d.dedup_key.as_str())
                    .unwrap_or_default();
                commit(ctx, redis, lookahead, key).await;
                delivery.ack(BasicAckOptions::default()).await?;
                Stats::bump(&ctx.stats.processed);
                break;
            }
            Outcome::Duplicate => {
                delivery.ack(BasicAckOptions::default()).await?;
                Stats::bump(&ctx.stats.duplicates);
                tracing::debug!(shard = %ctx.shard, "duplicate acked");
                break;
            }
            Outcome::Retry { after, error } => {
                Stats::bump(&ctx.stats.retries);
                first_failed_at.get_or_insert_with(SystemTime::now);
                tracing::warn!(shard = %ctx.shard, attempt, retry_in = ?after, %error, "handler failed; retrying in place");
                tokio::time::sleep(after).await;
                attempt += 1;
            }
            Outcome::Wait(after) => {
                tracing::warn!(shard = %ctx.shard, wait = ?after, "event claimed by another consumer; waiting for its lease");
                tokio::time::sleep(after).await;
            }
            Outcome::DeadLetter {
                reason,
                error,
                attempts,
            } => {
                let letter = DeadLetter {
                    reason,
                    error,
                    retry_count: attempts,
                    shard: ctx.shard.get(),
                    original_routing_key: msg.routing_key.to_owned(),
                    first_failed_at: first_failed_at.unwrap_or_else(SystemTime::now),
                    id: uuid::Uuid::new_v4().to_string(),
                };
                publish_dead_letter(channel, &ctx.names, &msg, &letter).await?;
                if let Ok(decoded) = &decoded {
                    ctx.processor
                        .dedup()
                        .release(redis, &decoded.dedup_key)
                        .await;
                }
                delivery.ack(BasicAckOptions::default()).await?;
                ctx.stats.dead_lettered(reason);
                tracing::warn!(
                    shard = %ctx.shard, reason = %reason, attempts, dead_letter_id = %letter.id,
                    error = %letter.error, "event dead-lettered"
                );
                break;
            }
        }
    }
    *in_flight = None;
    Ok(())
}

/// Commits `key`; when the next delivery is already here, claims it in the same
/// round trip.
async fn commit(ctx: &ShardContext, redis: &mut RedisSlot, lookahead: &mut Lookahead, key: &str) {
    let dedup = ctx.processor.dedup();
    match lookahead.peek(&ctx.processor) {
        Some(Ready {
            delivery,
            decoded: Ok(next),
            claim: claim @ None,
        }) => {
            let redelivered = delivery.redelivered;
            *claim = Some(
                dedup
                    .commit_and_claim(redis, key, &next.dedup_key, redelivered)
                    .await,
            );
        }
        _ => dedup.commit(redis, key).await,
    }
}

/// Publishes the original body and properties, plus the dead-letter headers, to
/// the dead-letter exchange with the reason as routing key, and waits for the
/// broker's confirm. A nack or an unroutable return is retried, never skipped.
async fn publish_dead_letter(
    channel: &Channel,
    names: &Names,
    msg: &Message<'_>,
    letter: &DeadLetter,
) -> Result<(), lapin::Error> {
    let properties = letter.properties(msg.properties);
    loop {
        let confirmation = channel
            .basic_publish(
                names.dead_letter_exchange.as_str().into(),
                letter.reason.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                msg.body,
                properties.clone(),
            )
            .await?
            .await?;
        match confirmation {
            Confirmation::Ack(None) | Confirmation::NotRequested => return Ok(()),
            Confirmation::Ack(Some(_)) => tracing::error!(
                exchange = %names.dead_letter_exchange,
                "dead letter unroutable: no queue bound to the dead-letter exchange \
                 (topology not applied? run `shardline topology apply`); event kept unacked, retrying"
            ),
            Confirmation::Nack(_) => tracing::error!(
                exchange = %names.dead_letter_exchange,
                "broker refused the dead letter (nack); event kept unacked, retrying"
            ),
        }
        tokio::time::sleep(DEAD_LETTER_RETRY).await;
    }
}
