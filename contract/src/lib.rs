//! shardline's wire contract, shared by the publisher, the worker and the
//! operator tools, without I/O: it opens no connection and runs no command
//! (that is `shardline-connect`).
//!
//! Nothing outside this crate builds a queue name or a Redis key, hashes an
//! order or parses an envelope. Modules, in the order an event meets them:
//!
//! - [`shard`]: shard count, shard ids and the md5 shard map (agrees with Python's hashlib).
//! - [`names`]: exchange, queue and routing-key names.
//! - [`rabbitmq`]: the shard queues' type and the RabbitMQ versions the declarations depend on.
//! - [`order_id`]: what a valid order id is ([`OrderId`], one constructor),
//!   and its escaped key ([`OrderKey`]).
//! - [`envelope`]: the JSON event envelope, its validation and its dedup key.
//! - [`outline`]: one streaming pass over a JSON body: its kind, its depth and
//!   its top-level envelope fields, whether or not it is a valid envelope.
//! - [`w3c`]: the W3C trace context (`traceparent`/`tracestate`) codec.
//! - [`headers`]: AMQP properties and header names both sides read and write.
//! - [`keys`]: the Redis keyspace.
//! - [`replay`]: the records that prove a replay was made by the operator tools.
//! - [`letters`]: the dead-letter index's entries, failure groups and normalised error text.
//! - [`status`]: the shard and worker status documents in Redis, and backlog levels.
//! - [`assignment`]: the elastic fleet's rule: who should own each shard, one rebalance step at a time.
//! - [`fleet`]: the elastic fleet's membership and assignment documents in Redis.
//! - [`topology`]: the recorded topology: the shard count every reader follows, and its generation.
//! - [`reshard`]: resharding's decisions (buckets, the map and its plan, routes, a
//!   consumer's verdict, the barrier, markers), checked by the model in `tests/reshard_model.rs`.
//! - [`telemetry`]: span names and attribute keys.
//! - [`text`]: outside text as a person reads it: the characters that do not
//!   show as themselves, escaped.

pub mod assignment;
pub mod envelope;
pub mod fleet;
pub mod headers;
pub mod keys;
pub mod letters;
pub mod names;
pub mod order_id;
pub mod outline;
pub mod rabbitmq;
pub mod replay;
pub mod reshard;
pub mod shard;
pub mod status;
pub mod telemetry;
pub mod text;
pub mod topology;
pub mod w3c;

pub use envelope::{Envelope, EnvelopeError, NewEvent};
pub use keys::Keys;
pub use names::Names;
pub use order_id::{OrderId, OrderIdError, OrderKey};
pub use outline::Outline;
pub use rabbitmq::{QueueType, Version};
pub use shard::{ShardCount, ShardId, ShardSet};
