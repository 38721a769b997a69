//! Whether the broker stamps messages itself, so that a backlog age can
//! count from the broker's stamp rather than from a publisher's claim
//! (docs/semantics.md §5).
//!
//! RabbitMQ 3.12+ stamps each incoming message when `rabbitmq.conf` says
//! `message_interceptors.incoming.set_header_timestamp.overwrite = true`:
//! AMQP 0-9-1 consumers get the header `timestamp_in_ms` (milliseconds) and
//! the `timestamp` property (seconds). With `overwrite = false` an existing
//! `timestamp_in_ms` is kept, so a publisher can still set it; before 3.12
//! the `rabbitmq_message_timestamp` plugin did the same (not overwriting by
//! default). Nothing in the handshake tells which, so [`broker_stamps`] asks
//! by a round trip: a message whose `timestamp_in_ms` is planted in the past
//! goes through an exclusive queue, and the broker's stamps are trusted only
//! if it came back replaced ([`overwritten`]).

use std::time::Duration;

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use shardline_contract::headers::{BROKER_TIMESTAMP_MS, header_i64};

/// The `timestamp_in_ms` planted in the probe message: 1 ms after the epoch,
/// a value no broker stamps.
pub const PLANTED_MS: i64 = 1;

/// How long the round trip may take before the broker's stamps are not
/// trusted: it runs while the worker starts.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the probe could not tell (the broker's stamps are then not trusted).
#[derive(Debug, thiserror::Error)]
pub enum StampProbeError {
    #[error("the stamp probe failed: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("the stamp probe's message did not come back from its queue")]
    Lost,
    #[error(
        "the stamp probe took longer than {}",
        humantime::format_duration(PROBE_TIMEOUT)
    )]
    TimedOut,
}

/// The broker overwrote the planted stamp: the returned `timestamp_in_ms` is
/// there and is not the planted value.
pub fn overwritten(planted: i64, returned: Option<i64>) -> bool {
    returned.is_some_and(|ms| ms != planted)
}

/// Whether the broker behind `conn` overwrites `timestamp_in_ms` on every
/// incoming message, by a round trip through an exclusive, server-named
/// queue on a channel of its own (closed after), within [`PROBE_TIMEOUT`].
pub async fn broker_stamps(conn: &Connection) -> Result<bool, StampProbeError> {
    let probe = async {
        let channel = conn.create_channel().await?;
        let result = round_trip(&channel).await;
        if let Err(e) = channel.close(200, "stamp probe done".into()).await {
            tracing::debug!(error = %e, "closing the stamp probe's channel");
        }
        result
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe)
        .await
        .unwrap_or(Err(StampProbeError::TimedOut))
}

async fn round_trip(channel: &Channel) -> Result<bool, StampProbeError> {
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..QueueDeclareOptions::default()
    };
    let queue = channel
        .queue_declare("".into(), exclusive, FieldTable::default())
        .await?;
    let name = queue.name().as_str();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut headers = FieldTable::default();
    headers.insert(
        BROKER_TIMESTAMP_MS.into(),
        AMQPValue::LongLongInt(PLANTED_MS),
    );
    channel
        .basic_publish(
            "".into(),
            name.into(),
            BasicPublishOptions::default(),
            b"",
            BasicProperties::default().with_headers(headers),
        )
        .await?
        .await?;
    let got = channel
        .basic_get(name.into(), BasicGetOptions { no_ack: true })
        .await?;
    // Exclusive: gone with the connection anyway.
    if let Err(e) = channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
    {
        tracing::debug!(error = %e, "deleting the stamp probe's queue");
    }
    let message = got.ok_or(StampProbeError::Lost)?;
    let returned = header_i64(&message.delivery.properties, BROKER_TIMESTAMP_MS);
    Ok(overwritten(PLANTED_MS, returned))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_trusted_only_when_the_broker_replaced_the_planted_one() {
        assert!(overwritten(PLANTED_MS, Some(1_764_777_600_123)));
        assert!(
            !overwritten(PLANTED_MS, Some(PLANTED_MS)),
            "kept: overwrite = false, the old plugin's default, or a broker that does not stamp"
        );
        assert!(
            !overwritten(PLANTED_MS, None),
            "removed by something else: nothing to trust"
        );
    }
}
