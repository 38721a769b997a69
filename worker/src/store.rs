//! Redis access for one shard: a connection checked out once and kept, and
//! outages waited out (no processing without dedup). A shard with several
//! calls in flight gives each its own [`RedisSlot::fork`]; the forks share the
//! shard's one multiplexed connection.

use crate::era::RedisEra;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use redis::aio::MultiplexedConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, Script, ServerErrorKind};
use shardline_topology::redis_target::{PooledConnection, RedisPool, is_not_primary};

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

/// One shard's Redis connection. Round trips per event: the claim and the commit.
pub(crate) struct RedisSlot {
    pool: RedisPool,
    /// Loaded again when Redis answers NOSCRIPT (after a restart or a flush).
    scripts: Arc<[Script]>,
    conn: Option<Link>,
    /// The connection the slot's forks share, by generation: a fork that
    /// fails drops it only if it is still the one that failed.
    shared: Arc<Mutex<Option<Link>>>,
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

impl RedisSlot {
    pub(crate) fn new(pool: RedisPool, scripts: Vec<Script>, health: Arc<RedisHealth>) -> Self {
        Self {
            pool,
            scripts: scripts.into(),
            conn: None,
            shared: Arc::default(),
            health,
        }
    }

    /// Another slot on the same connection, for a concurrent call of the shard.
    pub(crate) fn fork(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            scripts: self.scripts.clone(),
            conn: None,
            shared: self.shared.clone(),
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
                    // that another fork replaced would keep its pooled object
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
    /// the forks, and keeps it from going back to the pool.
    fn drop_conn(&mut self) {
        let Some(failed) = self.conn.take() else {
            return;
        };
        failed.pooled.discard();
        if let Ok(mut shared) = self.shared.lock()
            && shared
                .as_ref()
                .is_some_and(|link| link.generation == failed.generation)
        {
            *shared = None;
        }
    }

    /// The shared connection, or a new one from the pool. One made before
    /// the Sentinels switched the primary is dropped first: the old primary
    /// may still take writes (lost once it is converted to a replica).
    async fn link(&mut self) -> Result<&mut Link, RedisError> {
        if self
            .conn
            .as_ref()
            .is_some_and(|link| link.pooled.is_stale())
        {
            self.drop_conn();
        }
        if self.conn.is_none() {
            let current = self.shared.lock().ok().and_then(|shared| shared.clone());
            let current = match current {
                Some(link) if link.pooled.is_stale() => {
                    self.conn = Some(link);
                    self.drop_conn();
                    None
                }
                current => current,
            };
            let link = match current {
                Some(link) => link,
                None => {
                    let pooled = self.pool.get().await?;
                    // A new connection may reach a new primary (a failover).
                    // Best effort: a Redis that refuses INFO keeps the era.
                    if let Err(e) = self.health.era.check(&mut pooled.shared()).await {
                        tracing::debug!(error = %e, "cannot read the Redis replication id");
                    }
                    let mut shared = self
                        .shared
                        .lock()
                        .map_err(|_| RedisError::from(std::io::Error::other("poisoned")))?;
                    // A fork may have connected meanwhile: share its connection.
                    match shared.as_ref() {
                        Some(link) => link.clone(),
                        None => {
                            let generation = rand::random();
                            let link = Link {
                                generation,
                                conn: pooled.shared(),
                                pooled: Arc::new(pooled),
                            };
                            shared.insert(link).clone()
                        }
                    }
                }
            };
            self.conn = Some(link);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| RedisError::from(std::io::Error::other("no connection")))
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
