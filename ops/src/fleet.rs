//! Where the fleet is: the broker, Redis and its key prefix, the names and
//! the shard count. Every operation takes one.

use shardline_connect::management::ManagementTarget;
use shardline_connect::{AmqpTarget, RedisTarget};
use shardline_contract::{Keys, Names, ShardCount};

use crate::Error;

/// The fleet an operation works on. `Default` is the local default fleet
/// (`amqp://guest:guest@127.0.0.1:5672/%2f`, `redis://127.0.0.1:6379`,
/// prefix `shardline:`, the default names, 16 shards).
#[derive(Debug, Clone, Default)]
pub struct Fleet {
    /// RabbitMQ address(es); the vhost is the URL's path.
    pub amqp: AmqpTarget,
    /// Redis, where the workers keep dedup, gate and status documents.
    pub redis: RedisTarget,
    /// The Redis keyspace (its prefix: default `shardline:`).
    pub keys: Keys,
    /// Exchange and queue names.
    pub names: Names,
    /// Number of shards N (default 16).
    pub shards: ShardCount,
    /// Publish even where the topology has another shard count (a
    /// shard-count migration only). Default false.
    pub allow_shard_mismatch: bool,
    /// RabbitMQ's management API, for the policies the broker probe checks.
    /// Default none.
    pub management: Option<ManagementTarget>,
}

impl Fleet {
    /// A publisher config for this fleet: one event in flight at a time.
    pub(crate) fn publisher(&self, connection_name: &str) -> shardline_publisher::Config {
        shardline_publisher::Config {
            amqp: self.amqp.clone(),
            names: self.names.clone(),
            shards: self.shards,
            redis: Some(self.redis.clone()),
            redis_prefix: self.keys.prefix().to_owned(),
            window: 1,
            connection_name: connection_name.into(),
            check_shard_count: !self.allow_shard_mismatch,
            ..shardline_publisher::Config::default()
        }
    }

    /// What the broker probe reads: every address's server properties and,
    /// with a management API, the policies on the shard queues and the DLQ.
    pub(crate) async fn probe(&self) -> shardline_connect::probe::Facts {
        shardline_connect::probe::read_all(
            &self.amqp,
            self.management.as_ref(),
            &self.names,
            self.shards,
        )
        .await
    }

    /// A broker connection named `name`.
    pub(crate) async fn connect(&self, name: &str) -> Result<lapin::Connection, Error> {
        Ok(shardline_connect::connect(&self.amqp, name).await?)
    }
}

/// Closes a connection, logging (not failing) when the broker does not answer.
pub(crate) async fn close(conn: &lapin::Connection) {
    if let Err(e) = conn.close(200, "done".into()).await {
        tracing::debug!(error = %e, "closing a connection");
    }
}

/// A Redis command's error, its password blanked out.
pub(crate) fn redis_error<'a>(
    fleet: &'a Fleet,
    what: &'static str,
) -> impl FnOnce(redis::RedisError) -> Error + 'a {
    move |e| Error::RedisCommand {
        what,
        url: fleet.redis.to_string(),
        cause: fleet.redis.scrub(&e.to_string()),
    }
}

/// An error of the recorded topology's read or write, its password blanked out.
pub(crate) fn record_error(
    fleet: &Fleet,
) -> impl FnOnce(shardline_connect::record::RecordIoError) -> Error + '_ {
    move |e| Error::RedisCommand {
        what: "the recorded topology",
        url: fleet.redis.to_string(),
        cause: fleet.redis.scrub(&e.to_string()),
    }
}

/// Every key matching `pattern` (`SCAN MATCH`, a page at a time).
pub(crate) async fn scan(
    conn: &mut impl redis::aio::ConnectionLike,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        found.extend(page);
        if next == 0 {
            return Ok(found);
        }
        cursor = next;
    }
}

/// Which shard processes an order's events now, by the recorded topology:
/// its bucket's in the map; during a reshard, a moving bucket's old shard
/// until its move is drained, then its new one (the holding queue's and
/// then the shard's consumer write it with that shard's epochs). Without a
/// record, `md5 mod N`.
#[derive(Debug, Clone)]
pub(crate) struct OrderShards {
    routing: Option<shardline_contract::topology::Routing>,
    drained: std::collections::BTreeSet<shardline_contract::reshard::MoveId>,
    fallback: shardline_contract::ShardCount,
}

impl OrderShards {
    /// Reads the record and the drained moves.
    pub(crate) async fn read(fleet: &Fleet) -> Result<Self, Error> {
        let mut redis = fleet.redis.connect().await?;
        let (record, drained, _) = shardline_connect::reshard::standing(&mut redis, &fleet.keys)
            .await
            .map_err(record_error(fleet))?;
        let routing = match record {
            Some(record) => Some(
                record
                    .routing()
                    .map_err(|e| Error::config(&[], e.to_string()))?,
            ),
            None => None,
        };
        Ok(Self {
            routing,
            drained,
            fallback: fleet.shards,
        })
    }

    /// The shard whose consumers write `order_id` now.
    pub(crate) fn of(&self, order_id: &str) -> shardline_contract::ShardId {
        let Some(routing) = &self.routing else {
            return self.fallback.shard_of(order_id);
        };
        let bucket = routing.bucket_of(order_id);
        let shard = match routing.reshard() {
            Some((reshard, _)) => match reshard.plan().move_of(bucket) {
                Some(id) if self.drained.contains(&id) => reshard.target().shard_of(bucket),
                _ => reshard.old().shard_of(bucket),
            },
            None => routing.map().shard_of(bucket),
        };
        shard.unwrap_or_else(|| self.fallback.shard_of(order_id))
    }
}
