//! The map (one shard per bucket, with its generation) and the sticky plan
//! that takes it to M shards.

use std::collections::BTreeMap;

use crate::shard::{ShardCount, ShardId};

use super::buckets::{Bucket, Buckets};

/// The largest shard count a reshard may target: each shard then owns at
/// least 4 buckets.
pub const MAX_TARGET_SHARDS: u32 = 1024;

/// The recorded topology's generation; it only ever grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation after this one.
    pub fn next(self) -> Self {
        Self(self.0.saturating_add(1))
    }

    /// A reader that has seen `self` reads `read`: a lower generation means a
    /// failover lost a write its `WAIT` did not cover, and the reader stops.
    pub fn check_read(self, read: Generation) -> Result<Generation, GenerationError> {
        if read < self {
            Err(GenerationError::Backwards { seen: self, read })
        } else {
            Ok(read)
        }
    }
}

/// A generation read going backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// The topology read is older than one already seen.
    #[error("topology generation went back from {} to {}", seen.0, read.0)]
    Backwards {
        /// The highest generation seen before.
        seen: Generation,
        /// The generation just read.
        read: Generation,
    },
}

/// One shard per bucket, at a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Map {
    generation: Generation,
    count: ShardCount,
    shards: Vec<ShardId>,
}

impl Map {
    /// The first map: bucket b → shard `b mod N₀`, which routes every order as
    /// `md5 mod N₀` does.
    pub fn initial(buckets: &Buckets) -> Self {
        let first = buckets.first();
        let ids: Vec<ShardId> = first.ids().collect();
        let shards = buckets
            .all()
            .filter_map(|b| ids.get(usize::from(b.get() % first.get())).copied())
            .collect();
        Self {
            generation: Generation(1),
            count: first,
            shards,
        }
    }

    /// A map as recorded: `shards[b]` is bucket b's shard, each below
    /// `count`; a map of `count` shards leaves none of them without a bucket.
    pub fn recorded(
        generation: Generation,
        count: ShardCount,
        buckets: &Buckets,
        shards: &[u16],
    ) -> Result<Self, MapError> {
        if shards.len() != usize::from(buckets.count()) {
            return Err(MapError::Buckets {
                found: shards.len(),
                buckets: buckets.count(),
            });
        }
        let ids: Vec<ShardId> = count.ids().collect();
        let shards = shards
            .iter()
            .map(|&s| {
                ids.get(usize::from(s))
                    .copied()
                    .ok_or(MapError::Shard { shard: s, count })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let map = Self {
            generation,
            count,
            shards,
        };
        if let Some(empty) = map.loads().iter().position(|&load| load == 0) {
            return Err(MapError::Empty { shard: empty });
        }
        Ok(map)
    }

    /// The map with another generation (the first map of a record written
    /// at a later generation).
    pub fn at(mut self, generation: Generation) -> Self {
        self.generation = generation;
        self
    }

    /// Each bucket's shard number, as a record stores them.
    pub fn shard_numbers(&self) -> Vec<u16> {
        self.shards.iter().map(|s| s.get()).collect()
    }

    /// The map's generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The map's shard count.
    pub fn shard_count(&self) -> ShardCount {
        self.count
    }

    /// B, the number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.shards.len()
    }

    /// The shard of a bucket, `None` for a bucket of another bucket space.
    pub fn shard_of(&self, bucket: Bucket) -> Option<ShardId> {
        self.shards.get(bucket.index()).copied()
    }

    /// How many buckets each shard holds, indexed by shard.
    pub fn loads(&self) -> Vec<usize> {
        let mut loads = vec![0; usize::from(self.count.get())];
        for shard in &self.shards {
            if let Some(load) = loads.get_mut(usize::from(shard.get())) {
                *load += 1;
            }
        }
        loads
    }

    /// The sticky plan to `m` shards, for generation g + 2.
    ///
    /// Growing, each new shard takes ⌊B/M⌋ or ⌈B/M⌉ buckets, one at a time
    /// from the shard holding the most; shrinking, the buckets of shards ≥ M
    /// go, one at a time, to the shard holding the fewest. Ties go to the
    /// lowest shard, and a shard gives its highest bucket first. Only buckets
    /// whose shard changes move, grouped by (from, to).
    pub fn plan(&self, m: u32) -> Result<Plan, PlanError> {
        if !(1..=MAX_TARGET_SHARDS).contains(&m) {
            return Err(PlanError::ShardCount(m));
        }
        let target = ShardCount::new(m).map_err(|_| PlanError::ShardCount(m))?;
        let (n, m) = (usize::from(self.count.get()), usize::from(target.get()));
        if n == m {
            return Err(PlanError::Unchanged(target));
        }
        let ids: Vec<ShardId> = target.ids().chain(self.count.ids()).collect();
        // Buckets held by each shard of both counts, ascending.
        let mut held: Vec<Vec<usize>> = vec![Vec::new(); n.max(m)];
        for (bucket, shard) in self.shards.iter().enumerate() {
            if let Some(list) = held.get_mut(usize::from(shard.get())) {
                list.push(bucket);
            }
        }
        let mut shards = self.shards.clone();
        if m > n {
            let b = shards.len();
            let (base, extra) = (b / m, b % m);
            for new in n..m {
                // The remainder goes to the old shards first: they keep more.
                let want = base + usize::from(new < extra);
                for _ in 0..want {
                    let Some(donor) = (0..n).max_by_key(|&s| (held[s].len(), std::cmp::Reverse(s)))
                    else {
                        break;
                    };
                    let Some(bucket) = held[donor].pop() else {
                        break;
                    };
                    held[new].push(bucket);
                    if let (Some(slot), Some(&id)) = (shards.get_mut(bucket), ids.get(new)) {
                        *slot = id;
                    }
                }
            }
        } else {
            let leaving: Vec<usize> = (m..n).flat_map(|s| held[s].clone()).collect();
            let mut sorted = leaving;
            sorted.sort_unstable();
            for bucket in sorted {
                let Some(taker) = (0..m).min_by_key(|&s| (held[s].len(), s)) else {
                    break;
                };
                held[taker].push(bucket);
                if let (Some(slot), Some(&id)) = (shards.get_mut(bucket), ids.get(taker)) {
                    *slot = id;
                }
            }
        }
        let mut grouped: BTreeMap<(ShardId, ShardId), Vec<Bucket>> = BTreeMap::new();
        for (bucket, (old, new)) in self.shards.iter().zip(&shards).enumerate() {
            if old != new
                && let Some(bucket) = Bucket::from_index(bucket)
            {
                grouped.entry((*old, *new)).or_default().push(bucket);
            }
        }
        let moves = grouped
            .into_iter()
            .map(|((from, to), buckets)| Move { from, to, buckets })
            .collect();
        Ok(Plan {
            target: Map {
                generation: Generation(self.generation.0.saturating_add(2)),
                count: target,
                shards,
            },
            moves,
        })
    }
}

/// One move's number within its plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MoveId(pub u16);

/// A set of buckets going from one shard to another, through the move's
/// holding queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// The shard that held the buckets.
    pub from: ShardId,
    /// The shard that will hold them.
    pub to: ShardId,
    /// The buckets, ascending.
    pub buckets: Vec<Bucket>,
}

/// The target map and the moves that reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The map at generation g + 2.
    pub target: Map,
    /// The moves, ordered by (from, to).
    pub moves: Vec<Move>,
}

impl Plan {
    /// The move a bucket is part of, if it moves.
    pub fn move_of(&self, bucket: Bucket) -> Option<MoveId> {
        self.moves
            .iter()
            .position(|m| m.buckets.binary_search(&bucket).is_ok())
            .and_then(|i| u16::try_from(i).ok())
            .map(MoveId)
    }

    /// A move by its id.
    pub fn get(&self, id: MoveId) -> Option<&Move> {
        self.moves.get(usize::from(id.0))
    }

    /// How many buckets move.
    pub fn moved(&self) -> usize {
        self.moves.iter().map(|m| m.buckets.len()).sum()
    }
}

/// Why a recorded map was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// The map has another number of buckets than the bucket space.
    #[error("the map has {found} buckets, the topology {buckets}")]
    Buckets {
        /// Entries in the map.
        found: usize,
        /// B.
        buckets: u16,
    },
    /// A bucket's shard is not below the shard count.
    #[error("the map names shard {shard}, of {count} shards")]
    Shard {
        /// The shard named.
        shard: u16,
        /// The map's shard count.
        count: ShardCount,
    },
    /// A shard of the count owns no bucket.
    #[error("shard {shard} owns no bucket")]
    Empty {
        /// The shard without a bucket.
        shard: usize,
    },
}

/// Why no plan was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The target shard count is outside `1..=1024`.
    #[error("a reshard targets 1 to {MAX_TARGET_SHARDS} shards, got {0}")]
    ShardCount(u32),
    /// The map already has that many shards.
    #[error("the topology already has {0} shards")]
    Unchanged(ShardCount),
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn map(n0: u32) -> Map {
        Map::initial(&Buckets::new(ShardCount::new(n0).unwrap()).unwrap())
    }

    fn spread(loads: &[usize]) -> usize {
        loads.iter().max().unwrap() - loads.iter().min().unwrap()
    }

    #[test]
    fn the_initial_map_routes_as_md5_mod_n0() {
        let buckets = Buckets::new(ShardCount::new(6).unwrap()).unwrap();
        let map = Map::initial(&buckets);
        for i in 0..200 {
            let id = format!("o{i}");
            assert_eq!(
                map.shard_of(buckets.bucket_of(&id)),
                Some(ShardCount::new(6).unwrap().shard_of(&id))
            );
        }
    }

    #[test]
    fn out_of_range_targets_are_refused() {
        assert_eq!(map(4).plan(0), Err(PlanError::ShardCount(0)));
        assert_eq!(map(4).plan(1025), Err(PlanError::ShardCount(1025)));
        assert!(matches!(map(4).plan(4), Err(PlanError::Unchanged(_))));
        assert!(map(4).plan(1024).is_ok());
    }

    #[test]
    fn growing_moves_only_to_new_shards() {
        let old = map(3);
        let plan = old.plan(5).unwrap();
        for m in &plan.moves {
            assert!(m.from.get() < 3 && m.to.get() >= 3);
        }
        let loads = plan.target.loads();
        assert_eq!(plan.moved(), loads[3] + loads[4]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn plans_balance_move_least_and_repeat(n0 in 1u32..=40, steps in proptest::collection::vec(1u32..=64, 1..4)) {
            let mut current = map(n0);
            for m in steps {
                let Ok(plan) = current.plan(m) else { continue };
                prop_assert_eq!(&plan, &current.plan(m).unwrap());
                let loads = plan.target.loads();
                prop_assert_eq!(loads.len(), m as usize);
                prop_assert!(spread(&loads) <= 1, "loads {:?}", loads);
                let before = current.loads();
                let n = before.len();
                let m = m as usize;
                // Only changed buckets are in moves; every bucket is once in a move at most.
                let changed = current.shards.iter().zip(&plan.target.shards).filter(|(a, b)| a != b).count();
                prop_assert_eq!(plan.moved(), changed);
                let kept: usize = (0..n.min(m)).map(|s| before[s].min(loads[s])).sum();
                prop_assert_eq!(plan.moved(), current.bucket_count() - kept);
                if m > n {
                    // The fewest possible: old shards keep all they can of a balanced share.
                    let b = current.bucket_count();
                    let ceil = b.div_ceil(m);
                    let most_kept: usize = before.iter().map(|&l| l.min(ceil)).sum::<usize>().min(b - (m - n) * (b / m));
                    prop_assert_eq!(kept, most_kept);
                    prop_assert!(plan.moves.iter().all(|mv| usize::from(mv.from.get()) < n && usize::from(mv.to.get()) >= n));
                } else {
                    prop_assert!(plan.moves.iter().all(|mv| usize::from(mv.from.get()) >= m && usize::from(mv.to.get()) < m));
                }
                let pairs: Vec<_> = plan.moves.iter().map(|mv| (mv.from, mv.to)).collect();
                let mut sorted = pairs.clone();
                sorted.sort();
                sorted.dedup();
                prop_assert_eq!(pairs, sorted);
                current = plan.target;
            }
        }
    }
}
