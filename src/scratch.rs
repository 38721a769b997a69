//! Throwaway names for `demo` and `bench` ([`shardline_ops::scratch`]): their
//! own exchanges, queues and Redis keys on the configured vhost, removed
//! afterwards, so real queues are never touched.

use shardline_contract::Names;
use shardline_ops::{Fleet, scratch};

use crate::{Flags as _, GlobalArgs};

/// One run's names and Redis key prefix.
pub(crate) struct Scratch {
    pub names: Names,
    pub redis_prefix: String,
    fleet: Fleet,
}

impl Scratch {
    /// Declares a fresh topology named after `label` and this process.
    pub(crate) async fn create(global: &GlobalArgs, label: &str) -> anyhow::Result<Self> {
        let tag = format!("shardline-{label}-{}", std::process::id());
        let fleet = scratch::fleet(&global.fleet(), &tag);
        scratch::declare(&fleet, &format!("shardline {label} setup"))
            .await
            .flags()?;
        Ok(Self {
            names: fleet.names.clone(),
            redis_prefix: fleet.keys.prefix().to_owned(),
            fleet,
        })
    }

    /// A worker configuration for every shard of this run's names.
    pub(crate) fn worker_config(&self, worker_name: &str) -> shardline_worker::Config {
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
    pub(crate) async fn remove(&self) -> anyhow::Result<()> {
        scratch::remove(&self.fleet).await.flags()
    }
}
