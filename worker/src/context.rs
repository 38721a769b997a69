//! What one shard's stages share: its processor, names, metrics and the
//! evidence signal of a concurrent shard.

use std::sync::Arc;

use shardline_topology::{Names, ShardId};
use tokio::sync::Notify;

use crate::attempt::Processor;
use crate::metrics::ShardMetrics;

/// What one shard needs to take, attempt and settle its deliveries.
pub(crate) struct ShardContext {
    pub(crate) processor: Processor,
    pub(crate) names: Names,
    pub(crate) shard: ShardId,
    pub(crate) metrics: Arc<ShardMetrics>,
    /// A concurrent shard's event waits for the breaker's evidence: the
    /// shard's loop starts one event of another order beyond its slots.
    pub(crate) evidence: Notify,
}
