//! shardline's connections: everything that talks to RabbitMQ or Redis on
//! behalf of the contract (`shardline-contract`, which does no I/O).
//! Modules, from the address to what is declared:
//!
//! - [`broker`]: broker addresses and connecting to RabbitMQ, with redacted URLs in every error.
//! - [`mod@redact`]: the one redaction of every address and connection string, for every output.
//! - [`redis_target`]: Redis addresses (direct or through Sentinels), connections and pools.
//! - [`management`]: the management HTTP API, for the policies AMQP cannot show.
//! - [`probe`]: what the broker can do (its server properties) and the decision table built on it.
//! - [`declare`]: declaring the topology (`topology apply`) and reading it back (`status`).
//! - [`record`]: the recorded topology in Redis (read, written once and replicated), and
//!   adopting a topology made before records at the count found on the broker.
//! - [`inbound`]: the guarded accept loop of every HTTP port shardline serves (the worker's
//!   metrics and health port, the console): timeouts, a connection cap, body limits.
//! - [`stamps`]: whether the broker stamps messages itself (a round trip through an exclusive queue).
//! - [`otlp`]: the OTLP trace exporter the `OTEL_*` variables ask for, its credentials as basic auth.

pub mod broker;
pub mod declare;
pub mod inbound;
pub mod management;
pub mod otlp;
pub mod probe;
pub mod publishers;
pub mod record;
pub mod redact;
pub mod redis_target;
pub mod reshard;
pub mod stamps;

pub use broker::{AddressOrder, AmqpTarget, BrokerError, connect, connect_each};
pub use declare::{ApplyReport, DeclareError, DlqKind, ShardStatus, TopologyOptions};
pub use redact::{redact, scrub};
pub use redis_target::{PooledConnection, RedisError, RedisPool, RedisTarget};
