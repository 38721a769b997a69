//! Reading and writing the recorded topology
//! ([`shardline_contract::topology`]) in Redis, and finding the shard count
//! of a topology made before records on the broker.

use lapin::Connection;
use redis::aio::ConnectionLike;
use shardline_contract::shard::MAX_SHARDS;
use shardline_contract::topology::{RecordError, TopologyRecord};
use shardline_contract::{Keys, Names, ShardCount};

use crate::declare::{self, DeclareError};
use crate::redis_target::{RedisError, RedisTarget};

/// How long a record's write waits for the replicas to have it.
const REPLICA_WAIT_MS: u64 = 5_000;

/// What can go wrong reading or writing the record.
#[derive(Debug, thiserror::Error)]
pub enum RecordIoError {
    /// A Redis command failed.
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis could not be reached.
    #[error("reading the recorded topology: {0}")]
    Connect(#[from] RedisError),
    /// The record a reader had read is gone (a Redis that restarted without
    /// its data, a failover that lost it): it comes back when a worker or
    /// `topology apply` adopts or records the topology again.
    #[error(
        "the recorded topology is gone from Redis: a worker's start or `shardline topology apply` records it again"
    )]
    Missing,
    /// The stored record.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The primary reports replicas and not all of them took the write in
    /// time: a failover now could lose it.
    #[error(
        "the recorded topology's write reached {acked} of the {replicas} replicas Redis reports within \
         {REPLICA_WAIT_MS} ms: not kept, try again once the replicas are connected"
    )]
    NotReplicated { acked: u64, replicas: u64 },
    /// Reading the broker.
    #[error(transparent)]
    Broker(#[from] DeclareError),
}

/// The record, if one was written.
pub async fn read(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
) -> Result<Option<TopologyRecord>, RecordIoError> {
    let text: Option<String> = redis::cmd("GET")
        .arg(keys.topology())
        .query_async(redis)
        .await?;
    Ok(text.as_deref().map(TopologyRecord::decode).transpose()?)
}

/// Writes `record` unless one exists (`SET NX`), then waits until every
/// replica the primary reports has it. Returns the record that stands:
/// `record`, or the one written before.
pub async fn write_first(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    record: &TopologyRecord,
) -> Result<TopologyRecord, RecordIoError> {
    let written: Option<String> = redis::cmd("SET")
        .arg(keys.topology())
        .arg(record.encode())
        .arg("NX")
        .query_async(redis)
        .await?;
    if written.is_none()
        && let Some(standing) = read(redis, keys).await?
    {
        return Ok(standing);
    }
    wait_for_replicas(redis).await?;
    Ok(record.clone())
}

/// Writes `record` over the one that stands (the reshard command, which
/// holds the reshard's lock, is its one writer), then waits for the
/// replicas.
pub async fn replace(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    record: &TopologyRecord,
) -> Result<(), RecordIoError> {
    let _: () = redis::cmd("SET")
        .arg(keys.topology())
        .arg(record.encode())
        .query_async(redis)
        .await?;
    wait_for_replicas(redis).await
}

/// Waits (`WAIT`) until every replica the primary reports in `INFO
/// replication` has the connection's writes; none on a standalone Redis.
pub(crate) async fn wait_for_replicas(
    redis: &mut impl ConnectionLike,
) -> Result<(), RecordIoError> {
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(redis)
        .await?;
    let replicas = connected_replicas(&info);
    if replicas == 0 {
        return Ok(());
    }
    let acked: u64 = redis::cmd("WAIT")
        .arg(replicas)
        .arg(REPLICA_WAIT_MS)
        .query_async(redis)
        .await?;
    if acked < replicas {
        return Err(RecordIoError::NotReplicated { acked, replicas });
    }
    Ok(())
}

/// `connected_slaves` of `INFO replication`.
fn connected_replicas(info: &str) -> u64 {
    info.lines()
        .find_map(|line| line.trim().strip_prefix("connected_slaves:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The shard count of a topology on the broker: the first missing shard
/// queue's index, found with about 2 log₂ N passive declares (queues
/// `0 .. N−1` exist); `None` when shard queue 0 does not exist.
pub async fn shard_count_on_broker(
    conn: &Connection,
    names: &Names,
) -> Result<Option<ShardCount>, RecordIoError> {
    let exists = async |i: u32| declare::queue_exists(conn, &names.shard_queue_named(i)).await;
    if !exists(0).await? {
        return Ok(None);
    }
    // Doubling to a missing queue, then halving between the two.
    let (mut present, mut missing) = (0u32, 1u32);
    while missing <= u32::from(MAX_SHARDS) && exists(missing).await? {
        present = missing;
        missing *= 2;
    }
    while missing - present > 1 {
        let mid = present + (missing - present) / 2;
        if exists(mid).await? {
            present = mid;
        } else {
            missing = mid;
        }
    }
    Ok(ShardCount::new(present + 1).ok())
}

/// The record that stands, adopting a topology made before records: when
/// none is written, the count found on the broker becomes generation 1
/// (never a flag's). `None` when there is neither a record nor a topology.
pub async fn read_or_adopt(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    conn: &Connection,
    names: &Names,
    adopted_by: &str,
    now_ms: u64,
) -> Result<Option<TopologyRecord>, RecordIoError> {
    if let Some(record) = read(redis, keys).await? {
        return Ok(Some(record));
    }
    let Some(found) = shard_count_on_broker(conn, names).await? else {
        return Ok(None);
    };
    let record = TopologyRecord::first(found, adopted_by, now_ms);
    let standing = write_first(redis, keys, &record).await?;
    if standing == record {
        tracing::info!(
            shards = found.get(),
            "adopted the topology on the broker as the recorded topology, generation 1"
        );
    }
    Ok(Some(standing))
}

/// What a publisher or worker configured for `configured` shards goes by:
/// the recorded topology that stands (a topology made before records
/// adopted at the broker's count); without a record or a topology,
/// `configured` checked on the broker (queue N−1 exists, queue N does not)
/// and `None`; the same, with a warning, when Redis cannot be read (the
/// worker waits out a Redis outage; the record is read again at the next
/// start). An unreadable record is an error. The caller decides what a disagreeing record means: the
/// command line and the publisher follow it with one warning
/// ([`TopologyRecord::follow_warning`]), the library worker refuses.
pub async fn standing(
    redis: &RedisTarget,
    keys: &Keys,
    conn: &Connection,
    names: &Names,
    configured: ShardCount,
    who: &str,
) -> Result<Option<TopologyRecord>, RecordIoError> {
    let now_ms = shardline_contract::status::unix_ms();
    let read = match redis.connect().await {
        Ok(mut link) => read_or_adopt(&mut link, keys, conn, names, who, now_ms).await,
        Err(e) => Err(e.into()),
    };
    match read {
        Ok(Some(record)) => return Ok(Some(record)),
        Ok(None) => {}
        Err(e @ (RecordIoError::Connect(_) | RecordIoError::Redis(_))) => tracing::warn!(
            "cannot read the recorded topology ({e}): checking --shards {configured} on the broker"
        ),
        Err(e) => return Err(e),
    }
    declare::check_shard_count(conn, names, configured).await?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_are_read_from_info_replication() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1\r\n";
        assert_eq!(connected_replicas(info), 2);
        assert_eq!(connected_replicas("role:master\r\n"), 0);
    }
}
