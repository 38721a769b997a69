//! Throwaway names for `demo` and `bench`: their own exchanges, queues and Redis
//! keys on the configured vhost, removed afterwards, so real queues are never
//! touched.

use shardline_topology::{Names, TopologyOptions, broker, declare};

use crate::GlobalArgs;

/// One run's names and Redis key prefix.
pub struct Scratch {
    pub names: Names,
    pub redis_prefix: String,
    amqp: shardline_topology::AmqpTarget,
    redis: shardline_topology::RedisTarget,
    shards: shardline_topology::ShardCount,
}

impl Scratch {
    /// Declares a fresh topology named after `label` and this process.
    pub async fn create(global: &GlobalArgs, label: &str) -> anyhow::Result<Self> {
        let tag = format!("shardline-{label}-{}", std::process::id());
        let scratch = Self {
            names: Names::prefixed(&format!("{tag}.")),
            redis_prefix: format!("{}{tag}:", global.redis_prefix),
            amqp: global.amqp_url.clone(),
            redis: global.redis_url.clone(),
            shards: global.shards,
        };
        let conn = broker::connect(&scratch.amqp, &format!("shardline {label} setup")).await?;
        let options = TopologyOptions {
            shards: scratch.shards,
            ..TopologyOptions::default()
        };
        declare::apply(&conn, &scratch.names, &options).await?;
        conn.close(200, "done".into()).await.ok();
        Ok(scratch)
    }

    /// A worker configuration for every shard of this run's names.
    pub fn worker_config(&self, worker_name: &str) -> shardline_worker::Config {
        shardline_worker::Config {
            amqp: self.amqp.clone(),
            redis: self.redis.clone(),
            redis_prefix: self.redis_prefix.clone(),
            names: self.names.clone(),
            shards: self.shards,
            assign: self.shards.ids().collect(),
            worker_name: worker_name.into(),
            ..shardline_worker::Config::default()
        }
    }

    /// Deletes the queues, exchanges and Redis keys of this run.
    pub async fn remove(&self) -> anyhow::Result<()> {
        let conn = broker::connect(&self.amqp, "shardline cleanup").await?;
        declare::delete(&conn, &self.names, self.shards).await?;
        conn.close(200, "done".into()).await.ok();
        delete_redis_keys(&self.redis, &self.redis_prefix).await
    }
}

/// Deletes every Redis key starting with `prefix`.
async fn delete_redis_keys(
    redis: &shardline_topology::RedisTarget,
    prefix: &str,
) -> anyhow::Result<()> {
    let mut conn = redis.connect().await?;
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
