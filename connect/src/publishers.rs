//! The registered publishers of resharding's confirm barrier
//! (ARCHITECTURE.md, "Resharding: the protocol"): `{prefix}publishers`, a
//! hash of publisher id → `{lease deadline ms}:{acknowledged generation}:{name}`.
//!
//! A publisher of the project registers when it connects and renews its
//! lease every [`LEASE`] / 3; a renewal counts only once every replica has
//! it (`WAIT`, as every write of the record), so a failover cannot lose a
//! lease the publisher relies on. It acknowledges a generation only when
//! everything it published before reading it is confirmed, and it stops
//! publishing before its lease ends when it cannot renew: a lapsed lease is
//! a silent publisher, which the barrier may pass.

use std::time::Duration;

use redis::aio::ConnectionLike;
use shardline_contract::Keys;
use shardline_contract::reshard::{Generation, Lease};

use crate::record::{RecordIoError, wait_for_replicas};

/// How long a lease lasts from its renewal.
pub const LEASE: Duration = Duration::from_secs(10);

/// One registered publisher as the hash holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// Its id (unique per publisher instance).
    pub id: String,
    /// What it is (`publish`, `load`, `dlq replay`, a worker's forwarder…).
    pub name: String,
    /// Its lease and the generation it acknowledged.
    pub lease: Lease,
}

impl Registered {
    fn value(&self) -> String {
        format!(
            "{}:{}:{}",
            self.lease.deadline_ms, self.lease.acknowledged.0, self.name
        )
    }

    fn parse(id: &str, value: &str) -> Option<Self> {
        let mut parts = value.splitn(3, ':');
        let deadline_ms = parts.next()?.parse().ok()?;
        let acknowledged = Generation(parts.next()?.parse().ok()?);
        let name = parts.next().unwrap_or_default().to_owned();
        Some(Self {
            id: id.to_owned(),
            name,
            lease: Lease {
                deadline_ms,
                acknowledged,
            },
        })
    }
}

/// Registers or renews `publisher`'s lease, returning once every replica
/// has it: only then may the publisher count on it.
pub async fn renew(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    publisher: &Registered,
) -> Result<(), RecordIoError> {
    let _: () = redis::cmd("HSET")
        .arg(keys.publishers())
        .arg(&publisher.id)
        .arg(publisher.value())
        .query_async(redis)
        .await?;
    wait_for_replicas(redis).await
}

/// Removes a publisher that closed (its lease would lapse by itself).
pub async fn leave(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    id: &str,
) -> Result<(), RecordIoError> {
    let _: () = redis::cmd("HDEL")
        .arg(keys.publishers())
        .arg(id)
        .query_async(redis)
        .await?;
    Ok(())
}

/// Every registered publisher; an entry that does not parse is skipped
/// (and named in a warning): it cannot hold the barrier.
pub async fn all(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
) -> Result<Vec<Registered>, RecordIoError> {
    let entries: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.publishers())
        .query_async(redis)
        .await?;
    Ok(entries
        .iter()
        .filter_map(|(id, value)| {
            let parsed = Registered::parse(id, value);
            if parsed.is_none() {
                tracing::warn!(publisher = %id, "a registered publisher's entry is unreadable: ignored");
            }
            parsed
        })
        .collect())
}

/// Removes the entries whose lease ended more than `grace` before `now_ms`
/// (publishers that died): the reshard command's housekeeping.
pub async fn prune(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    now_ms: u64,
    grace: Duration,
) -> Result<usize, RecordIoError> {
    let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    let gone: Vec<String> = all(redis, keys)
        .await?
        .into_iter()
        .filter(|p| p.lease.deadline_ms.saturating_add(grace_ms) < now_ms)
        .map(|p| p.id)
        .collect();
    for id in &gone {
        leave(redis, keys, id).await?;
    }
    Ok(gone.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_and_a_name_may_hold_colons() {
        let registered = Registered {
            id: "p-1".into(),
            name: "dlq replay: host:42".into(),
            lease: Lease {
                deadline_ms: 1_700_000_000_000,
                acknowledged: Generation(3),
            },
        };
        assert_eq!(
            Registered::parse("p-1", &registered.value()),
            Some(registered)
        );
        assert_eq!(Registered::parse("p-2", "junk"), None);
    }
}
