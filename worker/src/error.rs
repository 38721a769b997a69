//! Why a worker did not start or stopped for good, shaped by what the caller
//! does next: fix the configuration, or look at the broker, Redis or topology.
//! Connection losses after the start never surface here: the supervisor
//! reconnects.

use std::net::SocketAddr;

use shardline_connect::broker::BrokerError;
use shardline_connect::declare::DeclareError;

use crate::config::ConfigError;
use crate::limits::LimitError;

/// A worker that cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A setting is invalid ([`crate::Config::validate`]).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The first connection to the broker failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A shard queue is missing (topology not applied?).
    #[error(transparent)]
    Topology(#[from] DeclareError),
    /// The Redis pool could not be built.
    #[error(transparent)]
    Redis(#[from] shardline_connect::RedisError),
    /// The broker or the process allows fewer channels or file descriptors
    /// than the worker's shards need.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// The broker probe refused the start: the line names the problem and the fix.
    #[error("{0}")]
    Refused(String),
    /// `metrics_addr` cannot be served.
    #[error("metrics_addr {0}")]
    MetricsAddr(#[from] BindError),
}

/// An address the HTTP endpoint cannot listen on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{addr}: {cause}")]
pub struct BindError {
    pub addr: SocketAddr,
    /// `address in use`, or the system's words.
    pub cause: String,
}
