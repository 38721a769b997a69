//! One shard's consumer: take the shard (or stand by), process deliveries one at
//! a time, and on stop finish the in-flight event under the drain deadline.

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use shardline_topology::broker::soft_error;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::lookahead::Lookahead;
use crate::settle::{ShardContext, settle};
use crate::store::RedisSlot;

/// Why a shard's consumer stopped before it was told to.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("broker connection lost")]
    ConnectionLost,
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker cancelled the consumer (queue deleted?)")]
    ConsumerCancelled,
}

/// Consumes one shard until `shutdown`; returns an error when the connection
/// (or the shard's channel) fails, for the supervisor to reconnect.
pub async fn consume_shard(
    conn: &Connection,
    config: &Config,
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<(), ShardError> {
    let queue = ctx.names.shard_queue(ctx.shard);
    let tag = format!("{}/shard-{}", config.worker_name, ctx.shard);
    let mut standing_by = false;
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let channel = conn.create_channel().await?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let consumed = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions {
                    exclusive: config.exclusive,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        let consumer = match consumed {
            Ok(consumer) => consumer,
            Err(e) if soft_error(&e, AMQPSoftError::ACCESSREFUSED).is_some() => {
                if !standing_by {
                    tracing::info!(shard = %ctx.shard, %queue, "standing by: another consumer holds the shard");
                    standing_by = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(config.standby_retry) => continue,
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
                }
            }
            Err(e) => return Err(e.into()),
        };
        tracing::info!(shard = %ctx.shard, %queue, "shard active");
        let mut lookahead = Lookahead::new(consumer);

        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => None,
                _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
                next = lookahead.next(&ctx.processor) => Some(next),
            };
            let ready = match next {
                None => break,
                Some(Ok(None)) => return Err(ShardError::ConsumerCancelled),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(Some(ready))) => ready,
            };
            let mut in_flight = None;
            let finished = {
                let work = settle(ctx, &channel, redis, ready, &mut lookahead, &mut in_flight);
                tokio::pin!(work);
                tokio::select! {
                    result = &mut work => Some(result),
                    _ = shutdown.cancelled() => {
                        tokio::time::timeout(config.drain_timeout, &mut work).await.ok()
                    }
                    // The event can no longer be acked on this connection and a
                    // standby may take it: stop working on it.
                    _ = conn_lost.cancelled() => None,
                }
            };
            match finished {
                Some(result) => result?,
                None => {
                    abandon(ctx, redis, in_flight, shutdown.is_cancelled()).await;
                    lookahead.release(&ctx.processor, redis).await;
                    if !shutdown.is_cancelled() {
                        return Err(ShardError::ConnectionLost);
                    }
                    break;
                }
            }
        }
        lookahead.release(&ctx.processor, redis).await;
        stop(&channel, &tag).await;
        return Ok(());
    }
}

/// Leaves the in-flight event unacked (the broker redelivers it) and gives up
/// its claim, so that whoever gets it next need not wait for the lease.
async fn abandon(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    in_flight: Option<String>,
    draining: bool,
) {
    if draining {
        tracing::warn!(shard = %ctx.shard, "drain timeout: in-flight event left unacked for redelivery");
    } else {
        tracing::warn!(shard = %ctx.shard, "connection lost: in-flight handler call abandoned");
    }
    if let Some(key) = in_flight {
        let release = ctx.processor.dedup().release(redis, &key);
        if tokio::time::timeout(std::time::Duration::from_secs(1), release)
            .await
            .is_err()
        {
            tracing::warn!(shard = %ctx.shard, "could not release the claim; it expires with its lease");
        }
    }
}

/// Cancels the consumer and closes the channel; unacked read-ahead returns to
/// the queue.
async fn stop(channel: &Channel, tag: &str) {
    if let Err(e) = channel
        .basic_cancel(tag.into(), BasicCancelOptions::default())
        .await
    {
        tracing::debug!(error = %e, "cancelling the consumer");
    }
    if let Err(e) = channel.close(200, "shutdown".into()).await {
        tracing::debug!(error = %e, "closing the shard channel");
    }
}
