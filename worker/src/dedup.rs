//! The two-phase dedup claim in Redis (SPEC §3).
//!
//! `SET key processing NX PX <lease> GET` before the handler, `SET key done EX
//! <ttl>` after it: two round trips per event. A key that is `done` marks a
//! duplicate; a `processing` key left by a crashed worker is taken over when the
//! broker redelivers its event (the broker redelivers only once the old
//! consumer's channel is gone, so nobody else is still working on it).

use std::time::Duration;

use redis::Cmd;

use crate::store::RedisSlot;

const PROCESSING: &str = "processing";
const DONE: &str = "done";

/// Deletes a claim only while it is still a lease, never a `done` mark.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                       return redis.call('DEL', KEYS[1]) end return 0";

/// What a claim attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// The event is ours to process.
    Claimed,
    /// Taken over from a consumer that died mid-handler.
    TakenOver,
    /// Processed before: ack and do nothing.
    Duplicate,
    /// A live lease on a first delivery (two copies of one event in flight at
    /// once): wait this long, then claim again.
    HeldElsewhere(Duration),
}

/// Key layout and timings of the dedup store.
#[derive(Debug, Clone)]
pub struct Dedup {
    prefix: String,
    lease_ms: u64,
    ttl_secs: u64,
}

impl Dedup {
    pub fn new(redis_prefix: &str, lease: Duration, ttl: Duration) -> Self {
        Self {
            prefix: format!("{redis_prefix}dedup:"),
            lease_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            ttl_secs: ttl.as_secs().max(1),
        }
    }

    /// The Redis key holding the state of `dedup_key`.
    pub fn key(&self, dedup_key: &str) -> String {
        format!("{}{dedup_key}", self.prefix)
    }

    fn claim_cmd(&self, key: &str) -> Cmd {
        let mut set = Cmd::new();
        set.arg("SET")
            .arg(key)
            .arg(PROCESSING)
            .arg("NX")
            .arg("PX")
            .arg(self.lease_ms)
            .arg("GET");
        set
    }

    fn commit_cmd(&self, key: &str) -> Cmd {
        let mut set = Cmd::new();
        set.arg("SET")
            .arg(key)
            .arg(DONE)
            .arg("EX")
            .arg(self.ttl_secs);
        set
    }

    /// Claims `dedup_key` for one handler run: one round trip on the usual path.
    pub async fn claim(&self, redis: &mut RedisSlot, dedup_key: &str, redelivered: bool) -> Claim {
        let previous: Option<String> = redis.query(&self.claim_cmd(&self.key(dedup_key))).await;
        self.claimed(redis, dedup_key, previous, redelivered).await
    }

    /// Commits `done_key` and claims `next_key` in one round trip: the next
    /// event's claim rides along with this one's commit. Redis runs them in
    /// order, so a next event that repeats this one finds it `done`.
    pub async fn commit_and_claim(
        &self,
        redis: &mut RedisSlot,
        done_key: &str,
        next_key: &str,
        next_redelivered: bool,
    ) -> Claim {
        let mut pipe = redis::pipe();
        pipe.add_command(self.commit_cmd(&self.key(done_key)))
            .ignore()
            .add_command(self.claim_cmd(&self.key(next_key)));
        let (previous,): (Option<String>,) = redis.query_pipeline(&pipe).await;
        self.claimed(redis, next_key, previous, next_redelivered)
            .await
    }

    /// What a claim's `GET` answer means.
    async fn claimed(
        &self,
        redis: &mut RedisSlot,
        dedup_key: &str,
        previous: Option<String>,
        redelivered: bool,
    ) -> Claim {
        match previous.as_deref() {
            None => Claim::Claimed,
            Some(DONE) => Claim::Duplicate,
            Some(_) if redelivered => {
                self.renew(redis, dedup_key).await;
                Claim::TakenOver
            }
            Some(_) => {
                let ttl_ms: i64 = redis
                    .query(Cmd::new().arg("PTTL").arg(self.key(dedup_key)))
                    .await;
                Claim::HeldElsewhere(Duration::from_millis(
                    u64::try_from(ttl_ms).unwrap_or(0).max(1),
                ))
            }
        }
    }

    /// Extends the lease before another attempt.
    pub async fn renew(&self, redis: &mut RedisSlot, dedup_key: &str) {
        let mut set = Cmd::new();
        set.arg("SET")
            .arg(self.key(dedup_key))
            .arg(PROCESSING)
            .arg("PX")
            .arg(self.lease_ms);
        redis.query::<()>(&set).await;
    }

    /// Marks the event processed for the dedup TTL.
    pub async fn commit(&self, redis: &mut RedisSlot, dedup_key: &str) {
        redis
            .query::<()>(&self.commit_cmd(&self.key(dedup_key)))
            .await;
    }

    /// Gives the claim up, so that a replay is not suppressed.
    pub async fn release(&self, redis: &mut RedisSlot, dedup_key: &str) {
        let mut eval = Cmd::new();
        eval.arg("EVAL")
            .arg(RELEASE)
            .arg(1)
            .arg(self.key(dedup_key))
            .arg(PROCESSING);
        redis.query::<i64>(&eval).await;
    }
}
