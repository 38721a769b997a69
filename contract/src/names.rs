//! Exchange, queue and routing-key names.
//!
//! The defaults are those of the classic pika recipe, so a shop's existing
//! publishers interoperate. Environments are separated by vhost, not by renaming;
//! a prefix exists for throwaway runs (`shardline demo`, `shardline bench`).

use crate::shard::ShardId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// Direct exchange the publishers send to, routing key `shard.{i}`.
    pub exchange: String,
    /// Shard queue `i` is `{queue_prefix}{i}`.
    pub queue_prefix: String,
    /// Topic exchange dead letters are published to, routing key = the reason.
    pub dead_letter_exchange: String,
    /// Queue bound to the dead-letter exchange with `#`.
    pub dead_letter_queue: String,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            exchange: "order.sharding".into(),
            queue_prefix: "order.events.shard.".into(),
            dead_letter_exchange: "order.sharding.dlx".into(),
            dead_letter_queue: "order.events.dlq".into(),
        }
    }
}

impl Names {
    /// The default names with `prefix` in front of each.
    pub fn prefixed(prefix: &str) -> Self {
        let d = Self::default();
        Self {
            exchange: format!("{prefix}{}", d.exchange),
            queue_prefix: format!("{prefix}{}", d.queue_prefix),
            dead_letter_exchange: format!("{prefix}{}", d.dead_letter_exchange),
            dead_letter_queue: format!("{prefix}{}", d.dead_letter_queue),
        }
    }

    pub fn shard_queue(&self, shard: ShardId) -> String {
        format!("{}{}", self.queue_prefix, shard)
    }

    /// Shard queue `i`'s name for any `i`, also beyond the configured count
    /// (what a shard-count check looks for).
    pub fn shard_queue_named(&self, i: u32) -> String {
        format!("{}{i}", self.queue_prefix)
    }

    pub fn routing_key(shard: ShardId) -> String {
        format!("shard.{shard}")
    }

    /// The holding queue of a reshard's move from shard `from` to `to`, the
    /// reshard starting at generation `g`: `order.events.move.{g}.{from}-{to}`
    /// with the default names (the shard queues' prefix without its `shard.`).
    pub fn hold_queue(&self, g: u64, from: ShardId, to: ShardId) -> String {
        let stem = self
            .queue_prefix
            .strip_suffix("shard.")
            .unwrap_or(&self.queue_prefix);
        format!("{stem}move.{g}.{from}-{to}")
    }

    /// The routing key of that holding queue: `move.{g}.{from}-{to}`.
    pub fn hold_routing_key(g: u64, from: ShardId, to: ShardId) -> String {
        format!("move.{g}.{from}-{to}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{ShardCount, ShardId};

    #[test]
    fn default_names_match_the_pika_recipe() {
        let names = Names::default();
        let shard = ShardId::new(3, ShardCount::default()).unwrap();
        assert_eq!(names.shard_queue(shard), "order.events.shard.3");
        assert_eq!(Names::routing_key(shard), "shard.3");
        assert_eq!(names.exchange, "order.sharding");
        assert_eq!(names.dead_letter_exchange, "order.sharding.dlx");
        assert_eq!(names.dead_letter_queue, "order.events.dlq");
        assert_eq!(Names::prefixed("demo.").exchange, "demo.order.sharding");
    }
}
