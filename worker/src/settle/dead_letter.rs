//! Dead-lettering: an event that cannot succeed is published, confirmed, to
//! the dead-letter exchange with its reason as routing key; only then is its
//! order state written (with the letter's index entry, in one script) and
//! the event acked. A refusal is retried with the event unacked, never
//! skipped.

use std::future::Future;
use std::time::{Duration, SystemTime};

use lapin::BasicProperties;

use shardline_contract::headers::{DeadLetter, FailReason};
use shardline_contract::{Names, letters};
use shardline_publisher::{ConfirmChannel, ConfirmError};

use super::{Delivery, Upcoming, acks};
use crate::context::ShardContext;
use crate::dedup::{OrderState, Written};
use crate::delivery::{Message, Ready};

/// Where dead letters go, each confirmed by the broker before its event is
/// acked: the shard's dead-letter channel ([`ConfirmChannel`]), or in unit
/// tests a fake that records them.
pub(crate) trait DeadLetters {
    /// Publishes one dead letter and waits for the broker's confirm.
    fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> impl Future<Output = Result<(), ConfirmError>> + Send;
}

impl DeadLetters for ConfirmChannel {
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), ConfirmError> {
        ConfirmChannel::publish(self, exchange, routing_key, body, properties).await
    }
}

/// While the dead-letter queue cannot take a message, how long to wait between
/// tries. The event stays unacked meanwhile: nothing is acked before its copy is.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// The dead letter of `delivery`, for its reason, error text and attempts.
pub(super) fn letter_of(
    ctx: &ShardContext,
    delivery: &Delivery,
    (reason, error, attempts): (FailReason, String, u32),
    first_failed_at: SystemTime,
) -> DeadLetter {
    DeadLetter {
        reason,
        error,
        retry_count: attempts,
        shard: ctx.shard.get(),
        original_routing_key: delivery.ready.delivery.routing_key.to_string(),
        first_failed_at,
        // Time-ordered: a quarantine sorts letters of one seq by it.
        id: uuid::Uuid::now_v7().to_string(),
        trace: Some(delivery.trace.span_context().clone()),
    }
}

/// Publishes `letter` (confirmed), then writes the order state and the
/// letter's index entry in one step, then acks. `Fenced` when a newer
/// consumer wrote the order: the event stays unacked.
pub(super) async fn dead_letter<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    dead_letters: &impl DeadLetters,
    store: &mut S,
    ready: &Ready,
    letter: &DeadLetter,
    lookahead: Option<&mut U>,
) -> Result<Written, lapin::Error> {
    let msg = Message::of(&ready.delivery);
    let properties = letter.properties(msg.properties);
    publish_dead_letter(dead_letters, &ctx.names, &msg, letter, &properties).await?;
    let entry = letters::entry_of(&properties, msg.body);
    match &ready.decoded {
        Ok(decoded) => {
            if ctx.processor.dead_lettered(store, decoded, &entry).await == Written::Fenced {
                return Ok(Written::Fenced);
            }
            if ctx.processor.quarantines()
                && let Some(lookahead) = lookahead
            {
                lookahead.forget_admission();
            }
        }
        Err(_) => ctx.processor.index_dead_letter(store, &entry).await,
    }
    acks::ack_one(&ready.delivery).await?;
    Ok(Written::Done)
}

/// Publishes the original body and properties, plus the dead-letter headers, to
/// the dead-letter exchange with the reason as routing key, and waits for the
/// broker's confirm. A refusal (nack, unroutable) is retried after a pause with
/// the event unacked, never skipped; a channel or connection error ends the
/// shard's consumer, for the supervisor to reconnect both connections.
async fn publish_dead_letter(
    channel: &impl DeadLetters,
    names: &Names,
    msg: &Message<'_>,
    letter: &DeadLetter,
    properties: &lapin::BasicProperties,
) -> Result<(), lapin::Error> {
    let exchange = &names.dead_letter_exchange;
    loop {
        let published = channel
            .publish(
                exchange,
                letter.reason.as_str(),
                msg.body,
                properties.clone(),
            )
            .await;
        match published {
            Ok(()) => return Ok(()),
            Err(ConfirmError::Channel(e)) => return Err(e),
            Err(refused @ ConfirmError::Unroutable { .. }) => tracing::error!(
                %exchange, error = %refused,
                "dead letter unroutable: no queue bound to the dead-letter exchange \
                 (topology not applied? run `shardline topology apply`); event kept unacked, retrying"
            ),
            Err(refused) => tracing::error!(
                %exchange, error = %refused,
                "broker refused the dead letter; event kept unacked, retrying"
            ),
        }
        tokio::time::sleep(DEAD_LETTER_RETRY).await;
    }
}
