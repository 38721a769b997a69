//! Per-order replay locks (`Keys::dlq_replay_lock`): a replay holds one for
//! each order it republishes, so that two replays of one order never
//! interleave (the second skips the order) and reconcile counts the order's
//! missing events as pending while they travel from the DLQ to the worker.
//!
//! A lock is `run:{token}` with a lease, renewed in the background while the
//! replay runs (a killed replay's locks lapse after the lease); a second
//! replay of the order waits for it, at most its `lock_wait`, then skips the
//! order; at the end it becomes `done:{token}` for a tail (the time a
//! replayed event may take to be processed), during which reconcile still
//! sees it but another replay may take the order.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use shardline_contract::OrderId;
use shardline_contract::envelope::order_key_of;
use tokio::task::JoinHandle;

use crate::fleet::redis_error;
use crate::{Error, Fleet};

/// A held lock's lease; renewed every third of it.
pub(crate) const LEASE: Duration = Duration::from_secs(10);

/// How often a replay waiting for an order's lock tries again.
const RETRY: Duration = Duration::from_millis(100);

/// KEYS: the lock. ARGV: `run:{token}`, lease ms. Taken unless another
/// replay runs the order.
const ACQUIRE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 4) == 'run:' and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
";

/// KEYS: the lock. ARGV: `run:{token}`, lease ms. Only its own.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
";

/// KEYS: the lock. ARGV: `run:{token}`, `done:{token}`, tail ms (0: delete).
const FINISH: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else
  redis.call('DEL', KEYS[1])
end
return 1
";

/// The locks one replay holds.
pub(crate) struct ReplayLocks<'a> {
    fleet: &'a Fleet,
    redis: MultiplexedConnection,
    token: String,
    tail: Duration,
    held: Arc<Mutex<Vec<String>>>,
    renewer: JoinHandle<()>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl<'a> ReplayLocks<'a> {
    /// `tail`: how long a lock stays (as `done`) after the replay ended.
    pub(crate) async fn new(fleet: &'a Fleet, tail: Duration) -> Result<Self, Error> {
        let redis = fleet.redis.connect().await?;
        let token = format!("run:{}", uuid::Uuid::new_v4());
        let held: Arc<Mutex<Vec<String>>> = Arc::default();
        let renewer = tokio::spawn(renew(redis.clone(), token.clone(), Arc::clone(&held)));
        Ok(Self {
            fleet,
            redis,
            token,
            tail,
            held,
            renewer,
        })
    }

    /// Takes the lock of `order_id`; `false` when another replay runs it.
    pub(crate) async fn take(&mut self, order_id: &OrderId) -> Result<bool, Error> {
        let key = self.fleet.keys.dlq_replay_lock(&order_id.key());
        let taken: i64 = redis::Script::new(ACQUIRE)
            .key(&key)
            .arg(&self.token)
            .arg(millis(LEASE))
            .invoke_async(&mut self.redis)
            .await
            .map_err(redis_error(self.fleet, "taking a replay lock"))?;
        if taken == 1 {
            let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            if !held.contains(&key) {
                held.push(key);
            }
        }
        Ok(taken == 1)
    }

    /// [`Self::take`], waiting up to `wait` for another replay of the order
    /// to end (or its lease to lapse); `false` after that, or on `cancel`.
    pub(crate) async fn take_waiting(
        &mut self,
        order_id: &OrderId,
        wait: Duration,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.take(order_id).await? {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline || cancel.is_cancelled() {
                return Ok(false);
            }
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                () = cancel.cancelled() => {}
            }
        }
    }

    /// Turns every held lock into its tail (or drops it without one).
    pub(crate) async fn finish(mut self) -> Result<(), Error> {
        self.renewer.abort();
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(PoisonError::into_inner));
        let done = self.token.replacen("run:", "done:", 1);
        for key in held {
            redis::Script::new(FINISH)
                .key(&key)
                .arg(&self.token)
                .arg(&done)
                .arg(millis(self.tail))
                .invoke_async::<i64>(&mut self.redis)
                .await
                .map_err(redis_error(self.fleet, "ending a replay lock"))?;
        }
        Ok(())
    }
}

impl Drop for ReplayLocks<'_> {
    fn drop(&mut self) {
        // Not finished (an error): the locks lapse after their lease.
        self.renewer.abort();
    }
}

/// Renews the held locks every third of the lease until aborted. A failed
/// renewal is logged; the lock then lapses after its lease.
async fn renew(mut redis: MultiplexedConnection, token: String, held: Arc<Mutex<Vec<String>>>) {
    let script = redis::Script::new(RENEW);
    loop {
        tokio::time::sleep(LEASE / 3).await;
        let keys = held.lock().unwrap_or_else(PoisonError::into_inner).clone();
        for key in keys {
            let renewed = script
                .key(&key)
                .arg(&token)
                .arg(millis(LEASE))
                .invoke_async::<i64>(&mut redis)
                .await;
            match renewed {
                Ok(1) => {}
                Ok(_) => {
                    tracing::warn!(lock = %key, "replay lock lost (expired and taken by another replay)")
                }
                Err(e) => tracing::warn!(lock = %key, error = %e, "renewing a replay lock"),
            }
        }
    }
}

/// The lock of a replay that is running now (not in its tail), if any:
/// while one runs, the letters it holds unacked cannot be read by others.
pub(crate) async fn running(
    fleet: &Fleet,
    redis: &mut MultiplexedConnection,
) -> Result<Option<String>, Error> {
    let keys = crate::fleet::scan(redis, &fleet.keys.dlq_replay_lock_pattern())
        .await
        .map_err(redis_error(fleet, "looking for running replays"))?;
    if keys.is_empty() {
        return Ok(None);
    }
    let values: Vec<Option<String>> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(redis)
        .await
        .map_err(redis_error(fleet, "reading replay locks"))?;
    Ok(keys
        .into_iter()
        .zip(values)
        .find(|(_, v)| v.as_deref().is_some_and(|v| v.starts_with("run:")))
        .map(|(key, _)| key))
}

/// Which of `order_ids` a replay holds (running or in its tail).
pub(crate) async fn locked(
    fleet: &Fleet,
    redis: &mut MultiplexedConnection,
    order_ids: &[&str],
) -> Result<Vec<bool>, Error> {
    if order_ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for order in order_ids {
        pipe.cmd("EXISTS")
            .arg(fleet.keys.dlq_replay_lock(&order_key_of(order)));
    }
    pipe.query_async(redis)
        .await
        .map_err(redis_error(fleet, "reading replay locks"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use shardline_connect::RedisTarget;
    use shardline_contract::Keys;
    use tokio_util::sync::CancellationToken;

    use super::*;

    fn id(order: &str) -> OrderId {
        OrderId::new(order).unwrap()
    }

    /// A fleet on the test Redis under a prefix of its own.
    fn fleet() -> Fleet {
        let url = std::env::var("SHARDLINE_TEST_REDIS")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        Fleet {
            redis: RedisTarget::parse(&url).unwrap(),
            keys: Keys::new(&format!("test:lock:{}:", uuid::Uuid::new_v4())),
            ..Fleet::default()
        }
    }

    async fn value(fleet: &Fleet, order: &str) -> (Option<String>, i64) {
        let mut redis = fleet.redis.connect().await.unwrap();
        let key = fleet.keys.dlq_replay_lock(order);
        redis::pipe()
            .cmd("GET")
            .arg(&key)
            .cmd("PTTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap()
    }

    /// Two replays of one order: the second waits while the first runs and
    /// takes the order once the first ended (its `done` tail holds nobody
    /// back, but reconcile still sees it); other orders are not held.
    #[tokio::test]
    async fn a_second_replay_of_an_order_waits_for_the_first() {
        let fleet = fleet();
        let cancel = CancellationToken::new();
        let mut first = ReplayLocks::new(&fleet, Duration::from_secs(60))
            .await
            .unwrap();
        let mut second = ReplayLocks::new(&fleet, Duration::ZERO).await.unwrap();
        assert!(first.take(&id("A")).await.unwrap());
        assert!(first.take(&id("A")).await.unwrap(), "its own lock again");
        assert!(!second.take(&id("A")).await.unwrap());
        assert!(second.take(&id("B")).await.unwrap(), "another order");
        let short = Duration::from_millis(300);
        assert!(!second.take_waiting(&id("A"), short, &cancel).await.unwrap());
        let (held, ttl) = value(&fleet, "A").await;
        assert!(held.unwrap().starts_with("run:"));
        assert!(ttl > 0 && ttl <= 10_000, "a lease: {ttl}");

        let waiting = async {
            second
                .take_waiting(&id("A"), Duration::from_secs(10), &cancel)
                .await
                .unwrap()
        };
        let ending = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            first.finish().await.unwrap();
        };
        let (taken, ()) = tokio::join!(waiting, ending);
        assert!(taken, "the first ended: the second takes the order");
        let mut redis = fleet.redis.connect().await.unwrap();
        assert_eq!(
            locked(&fleet, &mut redis, &["A", "B", "C"]).await.unwrap(),
            [true, true, false]
        );
        // Without a tail, finishing drops the locks.
        second.finish().await.unwrap();
        assert_eq!(value(&fleet, "A").await.0, None);
        assert_eq!(value(&fleet, "B").await.0, None);
    }

    #[tokio::test]
    async fn a_running_replay_refuses_a_reindex_and_its_tail_does_not() {
        let fleet = fleet();
        let mut locks = ReplayLocks::new(&fleet, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(locks.take(&id("A")).await.unwrap());
        let mut redis = fleet.redis.connect().await.unwrap();
        let running_lock = running(&fleet, &mut redis).await.unwrap();
        assert_eq!(running_lock, Some(fleet.keys.dlq_replay_lock("A")));
        let refused = crate::dlq::reindex(&fleet, &CancellationToken::new()).await;
        assert!(
            matches!(&refused, Err(Error::Refused(line)) if line.contains("a replay is running")),
            "{refused:?}"
        );
        locks.finish().await.unwrap();
        assert_eq!(
            running(&fleet, &mut redis).await.unwrap(),
            None,
            "a tail runs nothing"
        );
        let (held, ttl) = value(&fleet, "A").await;
        assert!(held.unwrap().starts_with("done:"));
        assert!(ttl > 10_000 && ttl <= 60_000, "the tail: {ttl}");
        let _: () = redis::cmd("DEL")
            .arg(fleet.keys.dlq_replay_lock("A"))
            .query_async(&mut redis)
            .await
            .unwrap();
    }
}
