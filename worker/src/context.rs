//! What one shard's stages share: its processor, its order state's layout
//! (`Dedup`), names, metrics and the evidence signal of a concurrent shard.

use std::sync::Arc;

use shardline_contract::{Names, ShardId};
use tokio::sync::Notify;

use crate::attempt::Processor;
use crate::dedup::Dedup;
use crate::metrics::ShardMetrics;

/// What one shard needs to take, attempt and settle its deliveries.
pub(crate) struct ShardContext {
    pub(crate) processor: Processor,
    /// The layout, timings and scripts of the shard's order state, and its
    /// consumer's fence token: what each connection to it is made from.
    pub(crate) dedup: Dedup,
    pub(crate) names: Names,
    pub(crate) shard: ShardId,
    pub(crate) metrics: Arc<ShardMetrics>,
    /// A concurrent shard's event waits for the breaker's evidence: the
    /// shard's loop starts one event of another order beyond its slots.
    pub(crate) evidence: Notify,
}
