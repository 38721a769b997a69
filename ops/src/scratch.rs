//! Throwaway names for demos and benchmarks: their own exchanges, queues and
//! Redis key prefix on the configured vhost and database, declared for one
//! run and removed afterwards, so that real queues are never touched.

use shardline_connect::{TopologyOptions, declare};
use shardline_contract::{Keys, Names};

use crate::fleet::close;
use crate::{Error, Fleet};

/// `base` with names and a key prefix of its own, tagged `tag` (names
/// `{tag}.…`, keys `{prefix}{tag}:…`).
pub fn fleet(base: &Fleet, tag: &str) -> Fleet {
    Fleet {
        names: Names::prefixed(&format!("{tag}.")),
        keys: Keys::new(&format!("{}{tag}:", base.keys.prefix())),
        ..base.clone()
    }
}

/// Declares `fleet`'s topology with the default options, on a connection
/// named `connection_name`.
pub async fn declare(fleet: &Fleet, connection_name: &str) -> Result<(), Error> {
    let conn = fleet.connect(connection_name).await?;
    let options = TopologyOptions {
        shards: fleet.shards,
        ..TopologyOptions::default()
    };
    let conns = [conn];
    let declared = declare::apply(&conns, &fleet.names, &options).await;
    close(&conns[0]).await;
    declared?;
    Ok(())
}

/// Deletes `fleet`'s queues, exchanges and every Redis key under its prefix.
pub async fn remove(fleet: &Fleet) -> Result<(), Error> {
    let conn = fleet.connect("shardline cleanup").await?;
    let deleted = declare::delete(&conn, &fleet.names, fleet.shards).await;
    close(&conn).await;
    deleted?;
    delete_keys(fleet).await.map(drop)
}

/// Deletes every Redis key under `fleet`'s prefix; how many there were.
pub async fn delete_keys(fleet: &Fleet) -> Result<u64, Error> {
    let failed = |e: redis::RedisError| Error::from(fleet.redis.error(&e));
    let mut conn = fleet.redis.connect().await?;
    let keys = crate::fleet::scan(&mut conn, &fleet.keys.everything_pattern())
        .await
        .map_err(failed)?;
    let mut deleted = 0;
    for chunk in keys.chunks(1000) {
        deleted += redis::cmd("UNLINK")
            .arg(chunk)
            .query_async::<u64>(&mut conn)
            .await
            .map_err(failed)?;
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_names_and_keys_are_their_own() {
        let scratch = fleet(&Fleet::default(), "shardline-demo-7");
        assert_eq!(scratch.names.exchange, "shardline-demo-7.order.sharding");
        assert_eq!(scratch.keys.prefix(), "shardline:shardline-demo-7:");
        assert_eq!(
            scratch.keys.everything_pattern(),
            "shardline:shardline-demo-7:*"
        );
    }
}
