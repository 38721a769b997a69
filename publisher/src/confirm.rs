//! The one confirmed-publish path, shared by the event publisher and the
//! worker's dead letters: a channel whose type says it is in confirm mode, a
//! `mandatory` send, and the broker's confirm turned into a typed result — a
//! nack or a return is an error, never a log line.
//!
//! The caller owns the connection and the channel: nothing here reconnects.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};

const MANDATORY: BasicPublishOptions = BasicPublishOptions {
    mandatory: true,
    immediate: false,
};

/// Why the broker did not take a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `basic.return`: no queue is bound for the routing key.
    Unroutable,
    /// `basic.nack`: the broker did not store it (a full queue with
    /// `x-overflow=reject-publish`, an internal error).
    Nacked,
}

/// A confirmed publish that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ConfirmError {
    #[error("message for routing key {routing_key} was unroutable on exchange {exchange}")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error("broker nacked the message for routing key {routing_key} on exchange {exchange}")]
    Nacked {
        exchange: String,
        routing_key: String,
    },
    /// An exchange or routing key that does not fit an AMQP short string.
    #[error("{what} `{value}` is longer than 255 bytes")]
    Name { what: &'static str, value: String },
    /// The channel or connection failed; the message may or may not have
    /// reached the broker.
    #[error("broker error: {0}")]
    Channel(#[from] lapin::Error),
}

impl ConfirmError {
    /// The broker refused this one message (the channel is still usable).
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Self::Unroutable { .. } => Some(Refusal::Unroutable),
            Self::Nacked { .. } => Some(Refusal::Nacked),
            Self::Name { .. } | Self::Channel(_) => None,
        }
    }
}

/// A confirm as a result. `NotRequested` cannot happen on a
/// [`ConfirmChannel`]; were it to, the message counts as not confirmed.
pub fn outcome(confirmation: &Confirmation) -> Result<(), Refusal> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_returned)) => Err(Refusal::Unroutable),
        Confirmation::Nack(_) | Confirmation::NotRequested => Err(Refusal::Nacked),
    }
}

/// A channel in publisher-confirm mode: the only way to get one is
/// [`ConfirmChannel::open`], which turns confirms on.
#[derive(Debug, Clone)]
pub struct ConfirmChannel {
    channel: Channel,
}

impl ConfirmChannel {
    /// Opens a channel on `conn` and selects confirm mode.
    pub async fn open(conn: &Connection) -> Result<Self, lapin::Error> {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self { channel })
    }

    /// The channel itself (to declare on it, or to close it).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Whether the channel is still open.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// Sends one persistent-as-given, `mandatory` message; returns its
    /// confirm, to be awaited and read with [`outcome`].
    pub async fn send(
        &self,
        exchange: ShortString,
        routing_key: ShortString,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<PublisherConfirm, lapin::Error> {
        self.channel
            .basic_publish(exchange, routing_key, MANDATORY, body, properties)
            .await
    }

    /// Sends one message and waits for the broker's confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), ConfirmError> {
        let short = |what, value: &str| {
            ShortString::try_new(value).map_err(|_| ConfirmError::Name {
                what,
                value: value.to_owned(),
            })
        };
        let confirmation = self
            .send(
                short("exchange", exchange)?,
                short("routing key", routing_key)?,
                body,
                properties,
            )
            .await?
            .await?;
        outcome(&confirmation).map_err(|refusal| {
            let (exchange, routing_key) = (exchange.to_owned(), routing_key.to_owned());
            match refusal {
                Refusal::Unroutable => ConfirmError::Unroutable {
                    exchange,
                    routing_key,
                },
                Refusal::Nacked => ConfirmError::Nacked {
                    exchange,
                    routing_key,
                },
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirms_become_results() {
        assert_eq!(outcome(&Confirmation::Ack(None)), Ok(()));
        assert_eq!(outcome(&Confirmation::Nack(None)), Err(Refusal::Nacked));
        assert_eq!(
            outcome(&Confirmation::NotRequested),
            Err(Refusal::Nacked),
            "a confirm channel never answers NotRequested; if it did, nothing was confirmed"
        );
        let refused = ConfirmError::Nacked {
            exchange: "x".into(),
            routing_key: "r".into(),
        };
        assert_eq!(refused.refusal(), Some(Refusal::Nacked));
    }
}
