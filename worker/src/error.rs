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
    /// The recorded topology could not be read or adopted.
    #[error(transparent)]
    Record(#[from] shardline_connect::record::RecordIoError),
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

impl WorkerError {
    /// Whether a setting was refused as given ([`WorkerError::Config`]): a
    /// front end reports a usage error (the command line exits 2). Every
    /// other error is found on the way: the broker, Redis, the probe's
    /// refusal, the limits, an address in use.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Config(_))
    }
}

/// An address the HTTP endpoint cannot listen on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{addr}: {cause}")]
pub struct BindError {
    pub addr: SocketAddr,
    /// `address in use`, or the system's words.
    pub cause: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Problem;

    #[test]
    fn only_a_refused_setting_is_a_usage_error() {
        let prefetch = ConfigError {
            field: "prefetch",
            problem: Problem::Below {
                min: "1",
                got: None,
            },
        };
        assert!(WorkerError::Config(prefetch).is_usage());
        assert!(!WorkerError::Refused("largest-message: lower --max-body-bytes".into()).is_usage());
    }
}
