//! shardline's wire contract, shared by the publisher and the worker.
//!
//! Nothing outside this crate builds a queue name, hashes an order or parses an
//! envelope. Modules, in the order an event meets them:
//!
//! - [`shard`]: shard count, shard ids and the md5 shard map (agrees with Python's hashlib).
//! - [`names`]: exchange, queue and routing-key names.
//! - [`envelope`]: the JSON event envelope, its validation and its dedup key.
//! - [`headers`]: AMQP properties and header names both sides read and write.
//! - [`broker`]: connecting to RabbitMQ, with redacted URLs in every error.
//! - [`declare`]: declaring the topology (`topology apply`) and reading it back (`status`).
//! - [`telemetry`]: span names and attribute keys, and the W3C trace context in AMQP headers.

pub mod broker;
pub mod declare;
pub mod envelope;
pub mod headers;
pub mod names;
pub mod shard;
pub mod telemetry;

pub use broker::{BrokerError, connect, redact_url};
pub use declare::{ApplyReport, DeclareError, QueueType, ShardStatus, TopologyOptions};
pub use envelope::{Envelope, EnvelopeError, NewEvent};
pub use names::Names;
pub use shard::{ShardCount, ShardId, ShardSet};
