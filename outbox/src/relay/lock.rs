//! One relay at a time per outbox: a session-level advisory lock, keyed by
//! the outbox's schema, held by the connection the relay reads and deletes
//! on. PostgreSQL releases it when that session ends (the relay exits, is
//! killed, or its connection is cut and the server notices), and a standby's
//! next try takes it.

use tokio_postgres::Client;

use crate::schema::Schema;

/// The first half of every outbox lock's key: `b"shln"`, so that an
/// application's own advisory locks (usually small numbers) do not collide.
const CLASS: u32 = u32::from_be_bytes(*b"shln");

/// The lock of one outbox: its key's two halves, as `pg_locks` shows them
/// (`classid`, `objid`; `objsubid` 1 for a single `bigint` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OutboxLock {
    key: i64,
}

impl OutboxLock {
    /// The lock of the outbox in `schema`: [`CLASS`] and an FNV-1a hash of
    /// the schema's name (stable across versions and machines, unlike
    /// PostgreSQL's `hashtext`, which is not promised to be).
    pub(super) fn of(schema: &Schema) -> Self {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in schema.as_str().bytes() {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        let key = (u64::from(CLASS) << 32) | u64::from(hash);
        Self {
            key: i64::from_ne_bytes(key.to_ne_bytes()),
        }
    }

    /// Takes the lock if it is free; never waits.
    pub(super) async fn try_take(self, client: &Client) -> Result<bool, tokio_postgres::Error> {
        let row = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&self.key])
            .await?;
        row.try_get(0)
    }

    /// The key's halves as `pg_locks` shows them: `classid`, `objid`.
    fn halves(self) -> (u32, u32) {
        let bits = u64::from_ne_bytes(self.key.to_ne_bytes());
        ((bits >> 32) as u32, bits as u32)
    }

    /// Whether this session still holds it: read before each batch is
    /// published, so a session that lost it (ended and replaced) stops.
    pub(super) async fn held(self, client: &Client) -> Result<bool, tokio_postgres::Error> {
        let (class, object) = self.halves();
        let row = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                 AND pid = pg_backend_pid() AND granted AND classid = $1 AND objid = $2 \
                 AND objsubid = 1)",
                &[&class, &object],
            )
            .await?;
        row.try_get(0)
    }

    /// Which backend holds it, if any: what a standby reports.
    pub(super) async fn holder(
        self,
        client: &Client,
    ) -> Result<Option<i32>, tokio_postgres::Error> {
        let (class, object) = self.halves();
        let row = client
            .query_opt(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND classid = $1 AND objid = $2 AND objsubid = 1 LIMIT 1",
                &[&class, &object],
            )
            .await?;
        row.map(|r| r.try_get(0)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::validate_schema;

    #[test]
    fn each_schema_has_its_own_key_under_the_shardline_class() {
        let public = OutboxLock::of(&validate_schema("public").expect("valid"));
        let shop = OutboxLock::of(&validate_schema("shop").expect("valid"));
        assert_ne!(public, shop);
        assert_eq!(public.halves().0, CLASS);
        assert_eq!(
            public,
            OutboxLock::of(&validate_schema("public").expect("valid"))
        );
    }
}
