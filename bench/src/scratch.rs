//! Throwaway names for the demo and the bench ([`shardline_ops::scratch`]):
//! their own exchanges, queues and Redis keys on the configured vhost,
//! removed afterwards, so real queues are never touched.

use shardline_contract::Names;
use shardline_ops::{Fleet, scratch};

/// One run's names and Redis key prefix.
#[derive(Debug)]
pub struct Scratch {
    pub names: Names,
    pub redis_prefix: String,
    fleet: Fleet,
}

impl Scratch {
    /// Declares a fresh topology beside `base`, named after `label` and this
    /// process.
    pub async fn create(base: &Fleet, label: &str) -> Result<Self, shardline_ops::Error> {
        let tag = format!("shardline-{label}-{}", std::process::id());
        let fleet = scratch::fleet(base, &tag);
        scratch::declare(&fleet, &format!("shardline {label} setup")).await?;
        Ok(Self {
            names: fleet.names.clone(),
            redis_prefix: fleet.keys.prefix().to_owned(),
            fleet,
        })
    }

    /// Where the run's names are: the base fleet's broker, Redis and shard
    /// count with the run's names and key prefix.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// A worker configuration for every shard of this run's names.
    pub fn worker_config(&self, worker_name: &str) -> shardline_worker::Config {
        shardline_worker::Config {
            amqp: self.fleet.amqp.clone(),
            redis: self.fleet.redis.clone(),
            redis_prefix: self.redis_prefix.clone(),
            names: self.names.clone(),
            shards: self.fleet.shards,
            assign: self.fleet.shards.ids().collect(),
            worker_name: worker_name.into(),
            ..shardline_worker::Config::default()
        }
    }

    /// Deletes the queues, exchanges and Redis keys of this run.
    pub async fn remove(&self) -> Result<(), shardline_ops::Error> {
        scratch::remove(&self.fleet).await
    }
}
