//! Redis access for one shard: a connection checked out once and kept, and
//! outages waited out (no processing without dedup).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_redis::{Connection, Pool};
use prometheus_client::metrics::counter::Counter;
use redis::{Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, Script, ServerErrorKind};

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
}

impl RedisHealth {
    pub(crate) fn new(outages: Counter) -> Self {
        Self {
            down: AtomicBool::new(false),
            outages,
        }
    }

    pub(crate) fn is_up(&self) -> bool {
        !self.down.load(Ordering::Relaxed)
    }

    fn went_down(&self, error: &RedisError) {
        if !self.down.swap(true, Ordering::Relaxed) {
            self.outages.inc();
            tracing::error!(error = %error, "Redis unreachable: shards paused until it returns");
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
    pool: Pool,
    /// Loaded again when Redis answers NOSCRIPT (after a restart or a flush).
    scripts: Vec<Script>,
    conn: Option<Connection>,
    health: Arc<RedisHealth>,
}

impl RedisSlot {
    pub(crate) fn new(pool: Pool, scripts: Vec<Script>, health: Arc<RedisHealth>) -> Self {
        Self {
            pool,
            scripts,
            conn: None,
            health,
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
                    return value;
                }
                Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    if let Err(error) = self.load_scripts().await {
                        self.conn = None;
                        self.health.went_down(&error);
                        tokio::time::sleep(backoff).await;
                    }
                }
                Err(error) => {
                    self.conn = None;
                    self.health.went_down(&error);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        }
    }

    async fn load_scripts(&mut self) -> Result<(), RedisError> {
        let Some(conn) = &mut self.conn else {
            return Ok(());
        };
        for script in &self.scripts {
            script
                .load_async::<deadpool_redis::Connection>(conn)
                .await?;
        }
        Ok(())
    }

    async fn try_query<T: FromRedisValue>(
        &mut self,
        request: Request<'_>,
    ) -> Result<T, RedisError> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let fresh = self.pool.get().await.map_err(pool_error)?;
                self.conn.insert(fresh)
            }
        };
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

fn pool_error(e: deadpool_redis::PoolError) -> RedisError {
    match e {
        deadpool_redis::PoolError::Backend(e) => e,
        other => RedisError::from(std::io::Error::other(other.to_string())),
    }
}
