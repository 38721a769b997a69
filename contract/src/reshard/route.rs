//! A reshard's phases as data, and where a bucket's new events go at each
//! generation.

use crate::shard::ShardId;

use super::buckets::Bucket;
use super::map::{Generation, Map, MoveId, Plan, PlanError};

/// The recorded step of one reshard, generation g → g + 2.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Plan recorded (with its marker ids); queues declared; routes still g.
    Planned,
    /// Generation g + 1: moving buckets route to their holding queue; the
    /// first barrier runs.
    Holding,
    /// Barrier 1 passed: one drain marker per move is in its old queue.
    Draining,
    /// Every move drained: holding queues are consumed by their new owners.
    Opening,
    /// Generation g + 2: moving buckets route to their new shard; the second
    /// barrier runs, then one marker per holding queue.
    Closing,
    /// Every holding queue's marker honoured: the map is g + 2.
    Done,
}

impl Phase {
    /// The step after this one.
    pub fn next(self) -> Option<Self> {
        match self {
            Self::Planned => Some(Self::Holding),
            Self::Holding => Some(Self::Draining),
            Self::Draining => Some(Self::Opening),
            Self::Opening => Some(Self::Closing),
            Self::Closing => Some(Self::Done),
            Self::Done => None,
        }
    }

    /// The generation recorded at this step, for a reshard from `from`.
    pub fn generation(self, from: Generation) -> Generation {
        match self {
            Self::Planned => from,
            Self::Holding | Self::Draining | Self::Opening => from.next(),
            Self::Closing | Self::Done => from.next().next(),
        }
    }
}

/// Where a bucket's new events are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Destination {
    /// A shard queue, `shard.{j}`.
    Shard(ShardId),
    /// A move's holding queue, `order.events.move.{g}.{i}-{j}`.
    Hold(MoveId),
}

/// One reshard's record: the map it starts from and its plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reshard {
    old: Map,
    plan: Plan,
    /// Given up after its first barrier (`topology reshard --abort`): the
    /// same steps run on, each move's events handed back to its old shard,
    /// and generation g + 2 routes by the old map.
    aborted: bool,
}

impl Reshard {
    /// A reshard of `old` to `m` shards.
    pub fn new(old: Map, m: u32) -> Result<Self, PlanError> {
        let plan = old.plan(m)?;
        Ok(Self {
            old,
            plan,
            aborted: false,
        })
    }

    /// The same reshard, given up: it ends on the old map.
    pub fn aborted(mut self) -> Self {
        self.aborted = true;
        self
    }

    /// Whether it was given up.
    pub fn is_aborted(&self) -> bool {
        self.aborted
    }

    /// The map it ends on (generation g + 2): the plan's target, or the old
    /// map when given up.
    pub fn target(&self) -> &Map {
        if self.aborted {
            &self.old
        } else {
            &self.plan.target
        }
    }

    /// The shard a move's buckets end on: its new shard, or its old one when
    /// the reshard was given up.
    pub fn final_shard(&self, id: MoveId) -> Option<ShardId> {
        let m = self.plan.get(id)?;
        Some(if self.aborted { m.from } else { m.to })
    }

    /// The map before the reshard (generation g).
    pub fn old(&self) -> &Map {
        &self.old
    }

    /// The plan: the target map (g + 2) and the moves.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Generation g, the reshard's first.
    pub fn from(&self) -> Generation {
        self.old.generation()
    }

    /// Where a publisher that read `generation` sends a bucket's event.
    pub fn route(&self, generation: Generation, bucket: Bucket) -> Result<Destination, RouteError> {
        let g = self.from();
        let map = if generation == g {
            &self.old
        } else if generation == g.next() {
            if let Some(id) = self.plan.move_of(bucket) {
                return Ok(Destination::Hold(id));
            }
            &self.old
        } else if generation == g.next().next() {
            self.target()
        } else {
            return Err(RouteError::Generation {
                generation,
                from: g,
            });
        };
        map.shard_of(bucket)
            .map(Destination::Shard)
            .ok_or(RouteError::Bucket(bucket))
    }
}

/// Why a route could not be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The generation is not one of the reshard's three.
    #[error("generation {} is not one of the reshard's ({}..={})", generation.0, from.0, from.0 + 2)]
    Generation {
        /// The generation asked for.
        generation: Generation,
        /// The reshard's first generation.
        from: Generation,
    },
    /// The bucket is not in the map's bucket space.
    #[error("bucket {} is outside the map", .0.get())]
    Bucket(Bucket),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reshard::Buckets;
    use crate::shard::ShardCount;

    #[test]
    fn routes_follow_the_three_generations() {
        let buckets = Buckets::new(ShardCount::new(2).unwrap()).unwrap();
        let reshard = Reshard::new(Map::initial(&buckets), 3).unwrap();
        let g = reshard.from();
        let moving = reshard.plan().moves[0].buckets[0];
        let staying = buckets
            .all()
            .find(|&b| reshard.plan().move_of(b).is_none())
            .unwrap();
        let old = reshard.old().shard_of(moving).unwrap();
        let new = reshard.plan().target.shard_of(moving).unwrap();
        assert_eq!(reshard.route(g, moving), Ok(Destination::Shard(old)));
        assert_eq!(
            reshard.route(g.next(), moving),
            Ok(Destination::Hold(MoveId(0)))
        );
        assert_eq!(
            reshard.route(g.next().next(), moving),
            Ok(Destination::Shard(new))
        );
        for generation in [g, g.next(), g.next().next()] {
            assert_eq!(
                reshard.route(generation, staying),
                Ok(Destination::Shard(reshard.old().shard_of(staying).unwrap()))
            );
        }
        assert!(reshard.route(Generation(g.0 + 3), moving).is_err());
        assert_eq!(Phase::Closing.generation(g), Generation(g.0 + 2));
        assert_eq!(Phase::Done.next(), None);
    }
}
