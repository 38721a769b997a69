//! Publisher configuration: a plain struct, filled by the CLI or by code.

use std::time::Duration;

use shardline_connect::{AmqpTarget, RedisTarget};
use shardline_contract::{Keys, Names, ShardCount};

/// How a [`Publisher`](crate::Publisher) connects and how hard it pushes.
#[derive(Debug, Clone)]
pub struct Config {
    /// The broker: one address or several (`amqps://` for TLS); the vhost is
    /// the URL's path. Default `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub amqp: AmqpTarget,
    /// Exchange and queue names; events go to `names.exchange`. Default: the pika
    /// recipe's names.
    pub names: Names,
    /// Number of shards `N`: what the publisher routes by without a recorded
    /// topology (`shard.{md5 mod N}`). With one (see `redis`) the record's
    /// map decides and a disagreeing N is followed with one warning.
    /// Default 16.
    pub shards: ShardCount,
    /// The Redis of the recorded topology (`{redis_prefix}topology`): the
    /// publisher routes by the record's map, as resharding needs. Without
    /// it the publisher routes by `shards` alone and is served as a legacy
    /// publisher (docs/semantics.md, "Which shard an order goes to"): after
    /// a reshard its events take one forward each. Default none.
    pub redis: Option<RedisTarget>,
    /// The key prefix of the fleet's Redis keys. Default `shardline:`.
    pub redis_prefix: String,
    /// Most events sent but not yet confirmed. At the bound a publish first waits
    /// for the oldest confirm (backpressure). Larger windows hide more round trips
    /// but re-send more after a connection loss. Default 256; 0 is treated as 1.
    pub window: usize,
    /// Connection name shown by `rabbitmqctl list_connections`. Default
    /// `shardline-publisher`.
    pub connection_name: String,
    /// Largest body [`Publisher::publish`](crate::Publisher::publish) accepts, in
    /// bytes. Only a sanity bound: the worker's own limit (default 1 MiB) decides
    /// what it processes. Default 16 MiB.
    pub max_body_bytes: usize,
    /// First pause before reconnecting after the connection or channel is lost;
    /// doubled per failed attempt. Default 100 ms.
    pub reconnect_min: Duration,
    /// Longest pause between reconnect attempts. Default 5 s.
    pub reconnect_max: Duration,
    /// How long one outage may last before publishing fails with
    /// [`PublishError::Disconnected`](crate::PublishError::Disconnected); the
    /// unconfirmed events stay queued and a later call tries again. Default 60 s.
    pub reconnect_give_up: Duration,
    /// How long the oldest sent event may go unconfirmed, not counting time
    /// the broker blocked the connection (a memory or disk alarm), before the
    /// connection is given up and made again — to another address of a
    /// cluster if this node stopped answering — and the window re-sent.
    /// Default 30 s.
    pub confirm_timeout: Duration,
    /// A nacked event is sent again, on a new connection, this many times in
    /// a row (pausing 1 s, 2 s, … up to 5 s between) before publishing
    /// fails with [`PublishError::Nacked`](crate::PublishError::Nacked): on
    /// a cluster a channel opened right after a node's loss may nack every
    /// publish to a queue that node led while a new connection is served,
    /// and a full queue with `x-overflow=reject-publish` takes events again
    /// once drained. 0 fails on the first nack. Default 10 (about 40 s).
    pub nack_retries: u32,
    /// Check at connect that the topology has `shards` shard queues: the
    /// recorded topology's count when there is one (followed), else on the
    /// broker (queue N−1 exists, queue N does not); a publisher with another
    /// N than the workers' would split one order over two queues. Off only
    /// during a hand-made shard-count migration (then `shards` routes,
    /// record or not). Default on.
    pub check_shard_count: bool,
}

impl Config {
    /// The fleet's Redis keys.
    pub fn keys(&self) -> Keys {
        Keys::new(&self.redis_prefix)
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp: AmqpTarget::default(),
            names: Names::default(),
            shards: ShardCount::default(),
            redis: None,
            redis_prefix: "shardline:".into(),
            window: 256,
            connection_name: "shardline-publisher".into(),
            max_body_bytes: 16 * 1024 * 1024,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            reconnect_give_up: Duration::from_secs(60),
            confirm_timeout: Duration::from_secs(30),
            nack_retries: 10,
            check_shard_count: true,
        }
    }
}
