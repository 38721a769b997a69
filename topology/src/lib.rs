//! shardline's wire contract, shared by the publisher, the worker and the
//! operator tools.
//!
//! Nothing outside this crate builds a queue name or a Redis key, hashes an
//! order or parses an envelope. Modules, in the order an event meets them:
//!
//! - [`shard`]: shard count, shard ids and the md5 shard map (agrees with Python's hashlib).
//! - [`names`]: exchange, queue and routing-key names.
//! - [`order_id`]: what a valid order id is ([`OrderId`], one constructor),
//!   and its escaped key ([`OrderKey`]).
//! - [`envelope`]: the JSON event envelope, its validation and its dedup key.
//! - [`headers`]: AMQP properties and header names both sides read and write.
//! - [`w3c`]: the W3C trace context (`traceparent`/`tracestate`) codec.
//! - [`broker`]: broker addresses and connecting to RabbitMQ, with redacted URLs in every error.
//! - [`declare`]: declaring the topology (`topology apply`) and reading it back (`status`).
//! - [`probe`]: what the broker can do (its server properties) and the decision table built on it.
//! - [`management`]: the management HTTP API, for the policies AMQP cannot show.
//! - [`redis_target`]: Redis addresses (direct or through Sentinels), connections and pools.
//! - [`keys`]: the Redis keyspace.
//! - [`letters`]: the dead-letter index's entries, failure groups and normalised error text.
//! - [`status`]: the shard and worker status documents in Redis, and backlog levels.
//! - [`assignment`]: the elastic fleet's rule: who should own each shard, one rebalance step at a time.
//! - [`fleet`]: the elastic fleet's membership and assignment documents in Redis.
//! - [`telemetry`]: span names and attribute keys.

pub mod assignment;
pub mod broker;
pub mod declare;
pub mod envelope;
pub mod fleet;
pub mod headers;
pub mod keys;
pub mod letters;
pub mod management;
pub mod names;
pub mod order_id;
pub mod probe;
pub mod redis_target;
pub mod shard;
pub mod status;
pub mod telemetry;
pub mod w3c;

pub use broker::{AddressOrder, AmqpTarget, BrokerError, connect, connect_each, redact_url};
pub use declare::{ApplyReport, DeclareError, DlqKind, QueueType, ShardStatus, TopologyOptions};
pub use envelope::{Envelope, EnvelopeError, NewEvent};
pub use keys::Keys;
pub use names::Names;
pub use order_id::{OrderId, OrderIdError, OrderKey};
pub use redis_target::{PooledConnection, RedisError, RedisPool, RedisTarget};
pub use shard::{ShardCount, ShardId, ShardSet};
