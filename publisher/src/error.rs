//! Publishing errors, shaped by what the caller does next: fix the input, fix
//! the topology, or retry later.

use std::time::Duration;

use shardline_connect::BrokerError;
use shardline_contract::EnvelopeError;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The first connection failed (unreachable broker, bad credentials, TLS).
    #[error(transparent)]
    Connect(#[from] BrokerError),
    /// The body is not an event envelope; nothing was sent.
    #[error("not publishing: {0}")]
    Envelope(#[from] EnvelopeError),
    /// A name does not fit an AMQP short string (255 bytes).
    #[error("{what} `{value}` is longer than 255 bytes")]
    Name { what: &'static str, value: String },
    /// The exchange does not exist.
    #[error(
        "exchange `{exchange}` does not exist: topology not applied? run `shardline topology apply`"
    )]
    ExchangeMissing { exchange: String },
    /// `basic.return`: no queue is bound for the routing key.
    #[error(
        "event for routing key {routing_key} was unroutable on exchange {exchange}: \
         topology not applied? run `shardline topology apply`"
    )]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    /// The broker refused to take responsibility for the event (for example a
    /// full queue with `x-overflow=reject-publish`).
    #[error(
        "broker nacked the event for routing key {routing_key} on exchange {exchange}: it was not stored \
         (a queue at its length limit with x-overflow=reject-publish?)"
    )]
    Nacked {
        exchange: String,
        routing_key: String,
    },
    /// The broker closed the channel for a reason reconnecting cannot fix
    /// (permissions, a refused argument).
    #[error("broker refused the publish: {reply}")]
    Refused { reply: String },
    /// Connection or channel lost and not regained within the reconnect budget.
    /// The unconfirmed events are kept; a later call tries again.
    #[error(
        "lost the connection to RabbitMQ at {url} and could not reconnect within {}s \
         ({unconfirmed} events unconfirmed): {cause}",
        after.as_secs()
    )]
    Disconnected {
        url: String,
        after: Duration,
        unconfirmed: usize,
        cause: String,
    },
    /// The topology does not have the configured shard count.
    #[error(transparent)]
    Topology(#[from] shardline_connect::DeclareError),
    /// The recorded topology could not be read (or adopted).
    #[error(transparent)]
    Record(#[from] Box<shardline_connect::record::RecordIoError>),
    /// The publisher's lease in the registered publishers lapsed and could
    /// not be renewed (Redis unreachable): it publishes nothing until it
    /// can register again, so that a reshard's barrier never passes an
    /// event of it. Its unconfirmed events stay queued; a later call tries
    /// again.
    #[error(
        "not publishing: this publisher's lease in the registered publishers lapsed and cannot be \
         renewed ({cause}); {unconfirmed} events wait to be sent again"
    )]
    Lease { cause: String, unconfirmed: usize },
    /// A broker operation failed while opening the publishing channel.
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
}
