//! The Redis failover era: a number the fleet bumps whenever the Redis primary
//! it writes to is not the one it saw before (a failover to a replica, or a
//! restart that lost data), told apart by the primary's replication id
//! (`INFO replication`: `master_replid`, new whenever a replica is promoted).
//!
//! Every order-state write records the era it was made in. An asynchronous
//! replica may lack the primary's last writes, so an order whose state is from
//! an earlier era and shows a gap may only have lost its last seqs (they were
//! processed and acked): its next event waits the start grace, not the gap
//! grace, and is then accepted as the order's start — it is not dead-lettered
//! `seq-gap` for a gap that will never fill.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use redis::Script;
use redis::aio::ConnectionLike;

/// KEYS: the era hash. ARGV: the primary's replication id. The era after
/// this primary was seen: a new id bumps it once, whoever sees it first.
const SEEN: &str = r"
local era, replid = unpack(redis.call('HMGET', KEYS[1], 'era', 'replid'))
if not era then
  redis.call('HSET', KEYS[1], 'era', 1, 'replid', ARGV[1])
  return 1
end
if replid ~= ARGV[1] then
  era = redis.call('HINCRBY', KEYS[1], 'era', 1)
  redis.call('HSET', KEYS[1], 'replid', ARGV[1])
end
return tonumber(era)
";

/// The era the worker writes with, shared by its shards.
#[derive(Debug)]
pub(crate) struct RedisEra {
    key: String,
    current: AtomicU64,
    /// The replication id last checked.
    replid: Mutex<Option<String>>,
    seen: Script,
}

impl RedisEra {
    pub(crate) fn new(key: String) -> Self {
        Self {
            key,
            current: AtomicU64::new(0),
            replid: Mutex::new(None),
            seen: Script::new(SEEN),
        }
    }

    /// A failover seen (tests of what the era changes).
    #[cfg(test)]
    pub(crate) fn bump(&self) {
        self.current.fetch_add(1, Ordering::Relaxed);
    }

    /// The era of this worker's writes.
    pub(crate) fn get(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }

    /// Checks the primary behind a new connection: a replication id other
    /// than the last one checked (or, at start, than the fleet's record)
    /// moves the era on. Called when a connection is opened, not per event.
    pub(crate) async fn check<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> Result<(), redis::RedisError> {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(conn)
            .await?;
        let Some(replid) = replication_id(&info) else {
            return Ok(());
        };
        let known = self
            .replid
            .lock()
            .map(|r| r.as_deref() == Some(replid))
            .unwrap_or(false);
        if known && self.get() != 0 {
            return Ok(());
        }
        let era: u64 = self
            .seen
            .key(&self.key)
            .arg(replid)
            .invoke_async(conn)
            .await?;
        let before = self.current.swap(era, Ordering::Relaxed);
        if before != 0 && before != era {
            tracing::warn!(
                era,
                "Redis failed over (a new primary): gaps of orders written before wait the start grace"
            );
        }
        if let Ok(mut r) = self.replid.lock() {
            *r = Some(replid.to_owned());
        }
        Ok(())
    }
}

/// `master_replid` from `INFO replication`.
fn replication_id(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.strip_prefix("master_replid:"))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replication_id_is_read_from_info() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_replid:8f1d2c\r\nmaster_replid2:0000\r\n";
        assert_eq!(replication_id(info), Some("8f1d2c"));
        assert_eq!(replication_id("role:master\r\n"), None);
    }
}
