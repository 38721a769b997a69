//! Redis access for the shards of one worker: a few multiplexed connections
//! (lanes) that the shards share, at most [`redis_connections`] of them, and
//! outages waited out (no processing without dedup). A shard with several
//! calls in flight gives each its own [`RedisSlot::fork`]; the forks ride on
//! the shard's lane.
//!
//! Shared, because one connection per shard made a worker of 1,024 shards
//! hold 1,024 sockets: a common soft file limit, and with Redis's default
//! `maxclients` (10,000) a fleet of nine such workers. A multiplexed
//! connection pipelines the requests of every shard on it, so C connections
//! carry what N did.
//!
//! The order state stays right on a shared connection because nothing in it
//! depends on which connection a call travels on:
//! - every admit (claim), commit, renew, release and dead letter is one Lua
//!   script (a step's commit and next admit one pipeline), and Redis runs a
//!   script atomically: another shard's request on the same connection runs
//!   before or after it, never inside it;
//! - a shard's own calls are sequential (each awaited before the next is
//!   sent), and a multiplexed connection writes requests and reads replies in
//!   order, so a shard's writes reach Redis in the order it made them; the
//!   forks of a shard at K > 1 carry calls of different orders (never two of
//!   one order), whose relative order never mattered;
//! - fencing is by the consumer's epoch and the claim's token, arguments of
//!   the scripts, never by connection identity: a reconnect (or another
//!   shard's traffic) changes nothing about who owns a claim or an order.
//!
//! A broken lane is dropped once (by its generation: a shard that saw the
//! failure late never drops the lane's new connection) and made again by one
//! of its shards while the others wait for that attempt and share its result
//! ([`Lane`]), so a failure seen by every shard of a lane costs one new
//! connection and one era check, not one per shard.

use crate::era::RedisEra;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use redis::aio::MultiplexedConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, Script, ServerErrorKind};
use shardline_connect::redis_target::{PooledConnection, RedisPool, is_not_primary};
use tokio::time::Instant;

/// The most Redis connections a worker's shards share, whatever their number.
const MAX_CONNECTIONS: usize = 16;

/// How many Redis connections a worker of `shards` shards holds for them:
/// one per shard up to [`MAX_CONNECTIONS`] (16), then 16.
///
/// Why 16: Redis runs commands one at a time, so more connections add no
/// server throughput; a multiplexed connection pipelines thousands of
/// requests. A few of them still spread the client's work (each connection's
/// reader and writer is one task) over the runtime's threads, keep one
/// shard's large pipeline (a group commit) from delaying every other shard's
/// reply, and limit what one broken connection pauses to 1/16 of the shards.
/// 16 sockets per worker lets Redis's default `maxclients` (10,000) serve
/// some 600 workers, and a worker's file descriptors stay far below 1,024.
/// The status writer, the membership and the start-up checks take their own
/// connection from the same pool, one at a time, besides these.
pub(crate) fn redis_connections(shards: usize) -> usize {
    shards.min(MAX_CONNECTIONS)
}

/// Backoff between reconnection attempts while Redis is down.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Whether Redis is reachable, shared by the shards of one worker so that an
/// outage is logged once, not once per shard or event.
#[derive(Debug)]
pub(crate) struct RedisHealth {
    down: AtomicBool,
    /// Bumped once per outage.
    outages: Counter,
    /// The infrastructure failures (`shardline_attempt_failures{cause="infrastructure"}`),
    /// bumped with `outages`.
    infrastructure: Counter,
    /// Checked on every new connection: a new primary moves it on.
    era: Arc<RedisEra>,
}

impl RedisHealth {
    pub(crate) fn new(outages: Counter, infrastructure: Counter, era: Arc<RedisEra>) -> Self {
        Self {
            down: AtomicBool::new(false),
            outages,
            infrastructure,
            era,
        }
    }

    pub(crate) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Relaxed)
    }

    fn went_down(&self, error: &RedisError) {
        if !self.down.swap(true, Ordering::Relaxed) {
            self.outages.inc();
            self.infrastructure.inc();
            if is_not_primary(error) {
                tracing::error!(error = %error, "Redis node is no longer the primary (failover): its connections are dropped, shards paused until the primary answers");
            } else {
                tracing::error!(error = %error, "Redis unreachable: shards paused until it returns");
            }
        }
    }

    fn came_back(&self) {
        if self.down.swap(false, Ordering::Relaxed) {
            tracing::info!("Redis reachable again: shards resumed");
        }
    }
}

/// The worker's lanes, with the shards on each: a shard joins the lane with
/// the fewest shards, after a new lane is added if there are fewer lanes than
/// [`redis_connections`] of the shards joined. Lanes are kept when their
/// shards leave: a broker reconnect starts the shards again, on the same
/// lanes, whose Redis connections need not be made again. The lanes'
/// connections come from the worker's pool.
#[derive(Debug)]
pub(crate) struct Lanes {
    pool: RedisPool,
    lanes: Mutex<Vec<(Arc<Lane>, usize)>>,
}

impl Lanes {
    pub(crate) fn new(pool: RedisPool) -> Arc<Self> {
        Arc::new(Self {
            pool,
            lanes: Mutex::default(),
        })
    }

    /// A place for one more shard.
    fn join(self: &Arc<Self>) -> Seat {
        let mut lanes = locked(&self.lanes);
        let shards = lanes.iter().map(|(_, shards)| shards).sum::<usize>() + 1;
        if lanes.len() < redis_connections(shards) {
            lanes.push((Arc::default(), 0));
        }
        let index = (0..lanes.len())
            .min_by_key(|&i| lanes[i].1)
            .unwrap_or_default();
        let (lane, shards) = &mut lanes[index];
        *shards += 1;
        Seat {
            lane: lane.clone(),
            lanes: self.clone(),
            index,
        }
    }

    fn leave(&self, index: usize) {
        if let Some((_, shards)) = locked(&self.lanes).get_mut(index) {
            *shards = shards.saturating_sub(1);
        }
    }

    #[cfg(test)]
    fn shards(&self) -> Vec<usize> {
        locked(&self.lanes)
            .iter()
            .map(|(_, shards)| *shards)
            .collect()
    }
}

/// The data behind `mutex`, also after a panic elsewhere: what these locks
/// guard is whole after every statement.
fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A shard's place on a lane, given up when the shard's slot is dropped.
#[derive(Debug)]
struct Seat {
    lane: Arc<Lane>,
    lanes: Arc<Lanes>,
    index: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.lanes.leave(self.index);
    }
}

/// One shared connection: the link its shards use now, by generation, and
/// the turn to make a new one. The turn is what keeps a broken lane from a
/// thundering herd: its shards all fail at once, but one of them connects
/// while the others wait for the turn and then take that connection, or,
/// when the attempt failed less than [`RETRY_MIN`] ago, its error (and back
/// off) without trying again themselves.
#[derive(Debug, Default)]
struct Lane {
    link: Mutex<Option<Link>>,
    turn: tokio::sync::Mutex<()>,
    /// The last failed attempt to connect: when, and why.
    failure: Mutex<Option<(Instant, RedisError)>>,
}

impl Lane {
    fn current(&self) -> Option<Link> {
        locked(&self.link).clone()
    }

    fn set(&self, link: Link) {
        *locked(&self.link) = Some(link);
    }

    /// Forgets `failed` if it is still the lane's connection.
    fn forget(&self, failed: &Link) {
        let mut link = locked(&self.link);
        if link
            .as_ref()
            .is_some_and(|link| link.generation == failed.generation)
        {
            *link = None;
        }
    }

    fn failed(&self, error: &RedisError) {
        *locked(&self.failure) = Some((Instant::now(), error.clone()));
    }

    /// The error of an attempt that failed just now, to share.
    fn recent_failure(&self) -> Option<RedisError> {
        locked(&self.failure)
            .as_ref()
            .filter(|(at, _)| at.elapsed() < RETRY_MIN)
            .map(|(_, error)| error.clone())
    }
}

/// One shard's access to Redis, on its lane. Round trips per event: the
/// claim and the commit.
pub(crate) struct RedisSlot {
    /// Loaded again when Redis answers NOSCRIPT (after a restart or a flush).
    scripts: Arc<[Script]>,
    /// The lane's link while a request is under way.
    conn: Option<Link>,
    lane: Arc<Lane>,
    /// The worker's lanes and their pool.
    lanes: Arc<Lanes>,
    /// The shard's place on its lane (forks have none of their own).
    _seat: Option<Seat>,
    health: Arc<RedisHealth>,
}

/// A multiplexed connection (cloning it shares it) and its generation. The
/// pooled object goes back to the pool when the last clone is dropped, unless
/// the link failed: then it is detached and closed, never recycled (a recycle
/// only PINGs, which a demoted primary still answers), so that the next
/// checkout opens a new connection (through the Sentinels: to the new primary).
#[derive(Clone)]
struct Link {
    generation: u64,
    conn: MultiplexedConnection,
    pooled: Arc<PooledConnection>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link({})", self.generation)
    }
}

impl RedisSlot {
    /// A shard's slot, on the worker's lane with the fewest shards.
    pub(crate) fn new(
        lanes: &Arc<Lanes>,
        scripts: Arc<[Script]>,
        health: Arc<RedisHealth>,
    ) -> Self {
        let seat = lanes.join();
        Self {
            scripts,
            conn: None,
            lane: seat.lane.clone(),
            lanes: lanes.clone(),
            _seat: Some(seat),
            health,
        }
    }

    /// Another slot on the same lane, for a concurrent call of the shard.
    pub(crate) fn fork(&self) -> Self {
        Self {
            scripts: self.scripts.clone(),
            conn: None,
            lane: self.lane.clone(),
            lanes: self.lanes.clone(),
            _seat: None,
            health: self.health.clone(),
        }
    }

    /// Runs `cmd`, waiting out any outage: the shard pauses rather than
    /// processing without dedup. Cancel by dropping the future.
    pub(crate) async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> T {
        self.run(Request::Cmd(cmd)).await
    }

    /// Runs `pipeline` in one round trip, waiting out any outage like [`Self::query`].
    pub(crate) async fn query_pipeline<T: FromRedisValue>(&mut self, pipeline: &Pipeline) -> T {
        self.run(Request::Pipeline(pipeline)).await
    }

    async fn run<T: FromRedisValue>(&mut self, request: Request<'_>) -> T {
        let mut backoff = RETRY_MIN;
        loop {
            match self.try_query(request).await {
                Ok(value) => {
                    self.health.came_back();
                    // Not kept while idle: an idle fork holding a connection
                    // that the lane replaced would keep its pooled object
                    // checked out, and enough of them exhaust the pool.
                    self.conn = None;
                    return value;
                }
                Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    if let Err(error) = self.load_scripts().await {
                        self.drop_conn();
                        self.health.went_down(&error);
                        tokio::time::sleep(backoff).await;
                    }
                }
                Err(error) => {
                    self.drop_conn();
                    self.health.went_down(&error);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        }
    }

    async fn load_scripts(&mut self) -> Result<(), RedisError> {
        let Some(link) = &mut self.conn else {
            return Ok(());
        };
        for script in self.scripts.iter() {
            script.load_async(&mut link.conn).await?;
        }
        Ok(())
    }

    /// Forgets the connection that failed, here and (if still the same) for
    /// the lane, and keeps it from going back to the pool.
    fn drop_conn(&mut self) {
        let Some(failed) = self.conn.take() else {
            return;
        };
        failed.pooled.discard();
        self.lane.forget(&failed);
    }

    /// The lane's connection, or a new one. One made before the Sentinels
    /// switched the primary is dropped first: the old primary may still take
    /// writes (lost once it is converted to a replica).
    async fn link(&mut self) -> Result<&mut Link, RedisError> {
        if self
            .conn
            .as_ref()
            .is_some_and(|link| link.pooled.is_stale())
        {
            self.drop_conn();
        }
        if self.conn.is_none() {
            let link = match self.fresh_current() {
                Some(link) => link,
                // Boxed: the pool's checkout (a Sentinel lookup included) is
                // an 11 KB future, which every Redis call of every stage would
                // otherwise carry and move for a path taken once a connection.
                None => Box::pin(self.connect()).await?,
            };
            self.conn = Some(link);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| RedisError::from(std::io::Error::other("no connection")))
    }

    /// The lane's connection, unless it is stale (then dropped).
    fn fresh_current(&mut self) -> Option<Link> {
        let link = self.lane.current()?;
        if link.pooled.is_stale() {
            self.conn = Some(link);
            self.drop_conn();
            return None;
        }
        Some(link)
    }

    /// A new connection for the lane, made by one shard at a time: a shard
    /// that waited for its turn takes the connection another made meanwhile,
    /// or that one's error when it just failed (and backs off like it).
    async fn connect(&mut self) -> Result<Link, RedisError> {
        let lane = self.lane.clone();
        let _turn = lane.turn.lock().await;
        if let Some(link) = self.fresh_current() {
            return Ok(link);
        }
        if let Some(error) = self.lane.recent_failure() {
            return Err(error);
        }
        let pooled = match self.lanes.pool.get().await {
            Ok(pooled) => pooled,
            Err(error) => {
                self.lane.failed(&error);
                return Err(error);
            }
        };
        // A new connection may reach a new primary (a failover).
        // Best effort: a Redis that refuses INFO keeps the era.
        if let Err(e) = self.health.era.check(&mut pooled.shared()).await {
            tracing::debug!(error = %e, "cannot read the Redis replication id");
        }
        let link = Link {
            generation: rand::random(),
            conn: pooled.shared(),
            pooled: Arc::new(pooled),
        };
        self.lane.set(link.clone());
        Ok(link)
    }

    async fn try_query<T: FromRedisValue>(
        &mut self,
        request: Request<'_>,
    ) -> Result<T, RedisError> {
        let conn = &mut self.link().await?.conn;
        match request {
            Request::Cmd(cmd) => cmd.query_async(conn).await,
            Request::Pipeline(pipeline) => pipeline.query_async(conn).await,
        }
    }
}

#[derive(Clone, Copy)]
enum Request<'a> {
    Cmd(&'a Cmd),
    Pipeline(&'a Pipeline),
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use futures_util::future::join_all;
    use shardline_connect::RedisTarget;

    use super::*;

    fn redis_url() -> String {
        std::env::var("SHARDLINE_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    #[test]
    fn a_worker_holds_a_connection_per_shard_up_to_sixteen() {
        let cases = [
            (0, 0),
            (1, 1),
            (3, 3),
            (16, 16),
            (17, 16),
            (64, 16),
            (1024, 16),
        ];
        for (shards, connections) in cases {
            assert_eq!(redis_connections(shards), connections, "{shards} shards");
        }
    }

    /// Lanes over a pool that is never asked for a connection.
    fn idle_lanes() -> Arc<Lanes> {
        let target = RedisTarget::parse("redis://127.0.0.1:1").unwrap();
        Lanes::new(target.pool(1).unwrap())
    }

    #[test]
    fn shards_spread_evenly_over_the_lanes_which_outlive_them() {
        let lanes = idle_lanes();
        let seats: Vec<Seat> = (0..64).map(|_| lanes.join()).collect();
        assert_eq!(lanes.shards(), [4; 16]);
        let first: BTreeSet<usize> = seats.iter().map(|s| s.index).collect();
        assert_eq!(first.len(), 16);
        drop(seats);
        assert_eq!(lanes.shards(), [0; 16]);

        // Started again (a broker reconnect): the same lanes, evenly.
        let again: Vec<Seat> = (0..20).map(|_| lanes.join()).collect();
        let mut spread = lanes.shards();
        spread.sort_unstable();
        assert_eq!(spread, [[1; 12].as_slice(), &[2; 4]].concat());
        drop(again);

        let small = idle_lanes();
        let _seats: Vec<Seat> = (0..3).map(|_| small.join()).collect();
        assert_eq!(small.shards(), [1, 1, 1], "a lane per shard below 16");
    }

    async fn client_ids(slots: &mut [RedisSlot]) -> BTreeSet<u64> {
        let mut cmd = redis::cmd("CLIENT");
        cmd.arg("ID");
        let ids = join_all(slots.iter_mut().map(|slot| slot.query::<u64>(&cmd))).await;
        ids.into_iter().collect()
    }

    /// A worker-sized set of shard slots against the real Redis: at most
    /// `redis_connections(64)` connections, and after those are killed
    /// every slot is served again, on one new connection per lane.
    #[tokio::test]
    async fn sixty_four_shards_share_sixteen_connections_and_recover_from_a_kill() {
        let target = RedisTarget::parse(&redis_url()).unwrap();
        // Sized as the supervisor sizes it: room for a connection per shard.
        let pool = target.pool(64 + 1).unwrap();
        let era_key = format!("test:lanes:{}:redis:era", rand::random::<u32>());
        let outages = Counter::default();
        let health = Arc::new(RedisHealth::new(
            outages.clone(),
            Counter::default(),
            Arc::new(RedisEra::new(era_key.clone())),
        ));
        let lanes = Lanes::new(pool.clone());
        let mut slots: Vec<RedisSlot> = (0..64)
            .map(|_| RedisSlot::new(&lanes, Arc::new([]), health.clone()))
            .collect();
        let wanted = redis_connections(slots.len());

        let before = client_ids(&mut slots).await;
        assert_eq!(before.len(), wanted, "{before:?}");
        assert_eq!(
            pool.connections(),
            wanted,
            "no connection beyond the lanes'"
        );

        let mut plain = target.connect().await.unwrap();
        for id in &before {
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async::<()>(&mut plain)
                .await
                .unwrap();
        }
        let after = tokio::time::timeout(Duration::from_secs(30), client_ids(&mut slots))
            .await
            .expect("every slot is served again");
        assert_eq!(after.len(), wanted, "{after:?}");
        assert!(after.is_disjoint(&before), "{before:?} {after:?}");
        assert_eq!(
            pool.connections(),
            wanted,
            "one new connection per lane, not one per shard"
        );
        assert_eq!(outages.get(), 1, "one outage, counted and logged once");
        assert!(health.is_up());

        redis::cmd("DEL")
            .arg(&era_key)
            .query_async::<()>(&mut plain)
            .await
            .unwrap();
    }
}
