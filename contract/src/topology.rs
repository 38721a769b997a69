//! The recorded topology: the shard count the fleet runs on, kept in Redis
//! (`{prefix}topology`, JSON) with a generation that only grows.
//!
//! Queue arguments are immutable and plain AMQP cannot list a broker's queues
//! or bindings, so the broker alone cannot say how many shards the fleet has:
//! a queue `order.events.shard.19` may be a stray of an `apply --shards 20`.
//! The record is the answer every reader takes. `topology apply` writes it
//! (or adopts a topology made before records, at the count found on the
//! broker, never a flag's); workers and publishers follow it, with one
//! warning when their `--shards` disagrees; only `apply` refuses another
//! count. Resharding (ARCHITECTURE.md, "Resharding: the protocol") is the one
//! way the count changes, and each change writes the next generation.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::OrderId;
use crate::reshard::{
    Bucket, Buckets, BucketsError, Destination, Generation, Map, MapError, MoveId, Phase,
    PlanError, Progress, Reshard, ReshardState, View,
};
use crate::shard::{ShardCount, ShardError, ShardId};

/// The record as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyRecord {
    /// Grows by one with every change; never goes back.
    pub generation: u64,
    /// The shard count now.
    pub shards: u16,
    /// The shard count the topology was first recorded with: what a
    /// publisher outside the project (md5 mod N) routes by.
    pub first_shards: u16,
    /// B, the buckets orders hash to (`int(md5) mod B`), fixed with the first
    /// shard count (a record of before buckets has none: 0 reads as the
    /// first count's B).
    #[serde(default)]
    pub buckets: u16,
    /// Each bucket's shard; absent while the map is the first one (bucket b
    /// → shard `b mod N₀`, which routes every order as `md5 mod N₀`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map: Option<Vec<u16>>,
    /// A reshard in progress: `map` is then the map it started from, and
    /// routes follow its phase (ARCHITECTURE.md, "Resharding: the protocol").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reshard: Option<ReshardState>,
    /// Shard queues of a count of before that the map no longer names (a
    /// shrink's `shard.{i}` with i ≥ M): still consumed, every event forwarded
    /// by the map, until `topology reshard` retires them (ARCHITECTURE.md,
    /// "Legacy routing").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retired: Vec<u16>,
    /// What wrote this generation (`topology apply`, or the tool or worker
    /// that adopted a topology made before records).
    pub recorded_by: String,
    /// When, in Unix milliseconds.
    pub recorded_at_ms: u64,
}

/// A record that cannot be read, or a generation that went backwards.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The stored text is not a record.
    #[error(
        "the recorded topology is unreadable ({0}): fix or delete the key, then run `shardline topology apply`"
    )]
    Unreadable(String),
    /// The stored count is not a shard count.
    #[error("the recorded topology has an impossible shard count: {0}")]
    Shards(#[from] ShardError),
    /// Its bucket count is not the one its first shard count makes.
    #[error("the recorded topology has {found} buckets where its first shard count makes {made}")]
    BucketCount { found: u16, made: u16 },
    /// Its first shard count makes no bucket space.
    #[error("the recorded topology's buckets: {0}")]
    Buckets(#[from] BucketsError),
    /// Its map does not fit its bucket space or shard count.
    #[error("the recorded topology's map is impossible: {0}")]
    Map(#[from] MapError),
    /// Its reshard in progress cannot be planned from its map, or its
    /// generations disagree.
    #[error("the recorded topology's reshard in progress is impossible: {0}")]
    Reshard(String),
    /// A generation lower than one seen before: a Redis failover lost a
    /// write that waited for no replica, or the key was rewritten by hand.
    #[error(
        "the recorded topology went back from generation {seen} to {found}: a Redis failover lost \
         its last write, or it was rewritten; stopping rather than routing by an older map"
    )]
    WentBackwards {
        /// The highest generation this reader saw.
        seen: u64,
        /// The one found now.
        found: u64,
    },
}

impl TopologyRecord {
    /// Generation 1 of a topology of `shards`, written by `recorded_by`.
    pub fn first(shards: ShardCount, recorded_by: &str, now_ms: u64) -> Self {
        Self {
            generation: 1,
            shards: shards.get(),
            first_shards: shards.get(),
            buckets: Buckets::new(shards).map_or(0, |b| b.count()),
            map: None,
            reshard: None,
            retired: Vec::new(),
            recorded_by: recorded_by.to_owned(),
            recorded_at_ms: now_ms,
        }
    }

    /// The record as stored (JSON).
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads a stored record.
    pub fn decode(text: &str) -> Result<Self, RecordError> {
        let record: Self =
            serde_json::from_str(text).map_err(|e| RecordError::Unreadable(e.to_string()))?;
        record.routing()?;
        Ok(record)
    }

    /// How the record routes orders: the bucket space of its first shard
    /// count and its map.
    pub fn routing(&self) -> Result<Routing, RecordError> {
        let count = self.shard_count()?;
        let first = ShardCount::new(u32::from(self.first_shards))?;
        let buckets = Buckets::new(first)?;
        if self.buckets != 0 && self.buckets != buckets.count() {
            return Err(RecordError::BucketCount {
                found: self.buckets,
                made: buckets.count(),
            });
        }
        let (generation, reshard) = match &self.reshard {
            Some(state) => {
                let from = Generation(state.from);
                if state.phase.generation(from) != Generation(self.generation) {
                    return Err(RecordError::Reshard(format!(
                        "generation {} at phase {:?} of a reshard from generation {}",
                        self.generation, state.phase, state.from
                    )));
                }
                (from, Some(state))
            }
            None => (Generation(self.generation), None),
        };
        let map = match &self.map {
            Some(shards) => Map::recorded(generation, count, &buckets, shards)?,
            None if count == first => Map::initial(&buckets).at(generation),
            None => {
                return Err(RecordError::Map(MapError::Buckets {
                    found: 0,
                    buckets: buckets.count(),
                }));
            }
        };
        let reshard = match reshard {
            Some(state) => Some((
                state
                    .reshard(&map)
                    .map_err(|e: PlanError| RecordError::Reshard(e.to_string()))?,
                state.phase,
            )),
            None => None,
        };
        Ok(Routing {
            buckets,
            map,
            reshard,
        })
    }

    /// What a consumer decides by ([`verdict`](crate::reshard::verdict)):
    /// the map, or the reshard in progress with the moves `drained` and
    /// `closed` so far (read beside the record, `connect::reshard`).
    pub fn view(
        &self,
        drained: BTreeSet<MoveId>,
        closed: BTreeSet<MoveId>,
    ) -> Result<(Routing, View), RecordError> {
        let routing = self.routing()?;
        let view = match &routing.reshard {
            Some((reshard, phase)) => View::Resharding(Progress {
                reshard: reshard.clone(),
                phase: *phase,
                drained,
                closed,
            }),
            None => View::Settled(routing.map.clone()),
        };
        Ok((routing, view))
    }

    /// Every shard queue the fleet consumes: the map's, during a reshard the
    /// target's too, and the retired ones (each forwards what its owner does
    /// not process).
    pub fn served(&self) -> BTreeSet<u16> {
        let target = self.reshard.as_ref().map_or(0, |r| r.to);
        (0..self.shards.max(target))
            .chain(self.retired.iter().copied())
            .collect()
    }

    /// The shard count now.
    pub fn shard_count(&self) -> Result<ShardCount, ShardError> {
        ShardCount::new(u32::from(self.shards))
    }

    /// Whether a reader configured with `configured` shards agrees.
    pub fn agrees(&self, configured: ShardCount) -> bool {
        self.shards == configured.get()
    }

    /// The routing key a publisher outside the project (the pika recipe)
    /// uses, at every generation: the **first** shard count's, which the
    /// fleet serves (after a reshard, by forwarding) so that such a
    /// publisher never changes its N.
    pub fn outside_routing(&self) -> String {
        format!("shard.{{int(md5(order_id)) mod {}}}", self.first_shards)
    }

    /// What the record says, for a one-line message: `16 shards (recorded,
    /// generation 1)`.
    pub fn describe(&self) -> String {
        format!(
            "{} shards (recorded in Redis, generation {})",
            self.shards, self.generation
        )
    }

    /// `--shards {configured} disagrees with the topology, which has 16
    /// shards (recorded in Redis, generation 1)`: the start of every line
    /// about a disagreeing count.
    pub fn disagreement(&self, configured: ShardCount) -> String {
        format!(
            "--shards {configured} disagrees with the topology, which has {}",
            self.describe()
        )
    }

    /// The same for a library's config, naming its field instead of a flag:
    /// `shards = 8 disagrees with the topology, which has 16 shards (…)`,
    /// then what follows (`following the record`, or `set shards to 16`).
    pub fn config_disagreement(&self, configured: ShardCount, then: &str) -> String {
        format!(
            "shards = {configured} disagrees with the topology, which has {}: {then}",
            self.describe()
        )
    }

    /// `topology apply`'s refusal of another count.
    pub fn apply_refusal(&self, configured: ShardCount) -> String {
        format!(
            "{}: `topology apply` never changes the shard count (run it with --shards {}; a change \
             of count is a reshard: ARCHITECTURE.md, \"Resharding: the protocol\")",
            self.disagreement(configured),
            self.shards
        )
    }

    /// `topology status`'s refusal of another count: it would show a part
    /// of the shards, or queues that are not shards.
    pub fn status_refusal(&self, configured: ShardCount) -> String {
        format!(
            "{}: run it with --shards {}",
            self.disagreement(configured),
            self.shards
        )
    }

    /// The warning of a worker or publisher whose `--shards` disagrees and
    /// that follows the record.
    pub fn follow_warning(&self, configured: ShardCount) -> String {
        format!(
            "{}: following the record (set --shards {} or SHARDLINE_SHARDS={} to silence this)",
            self.disagreement(configured),
            self.shards,
            self.shards
        )
    }
}

/// How orders are routed at one generation: an order's shard is its bucket's
/// in the map (docs/semantics.md, "Which shard an order goes to"). Until
/// the first reshard the map is the first one, which routes as `md5 mod N₀`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routing {
    buckets: Buckets,
    /// The map (at a reshard's start, while one runs).
    map: Map,
    /// A reshard in progress and its recorded step.
    reshard: Option<(Reshard, Phase)>,
}

impl Routing {
    /// Where a publisher sends the order's new events at this generation:
    /// its bucket's shard, or during a move its move's holding queue.
    pub fn destination(&self, order_id: &OrderId) -> Destination {
        let bucket = self.buckets.bucket_of(order_id.as_str());
        let routed = match &self.reshard {
            Some((reshard, phase)) => reshard.route(phase.generation(reshard.from()), bucket).ok(),
            None => self.map.shard_of(bucket).map(Destination::Shard),
        };
        // Every bucket of the space has a shard (`Map::recorded` checks).
        routed.unwrap_or_else(|| {
            Destination::Shard(self.map.shard_count().shard_of(order_id.as_str()))
        })
    }

    /// The order's shard: its bucket's in the newest map (during a reshard,
    /// its move's target once its holding route is recorded).
    pub fn shard_of(&self, order_id: &OrderId) -> ShardId {
        self.route(order_id).0
    }

    /// The order's shard and the routing key of its new events at this
    /// generation (`shard.{j}`, or during a move `move.{g}.{i}-{j}`), from
    /// one hash of the order id: a publisher needs both for every event.
    pub fn route(&self, order_id: &OrderId) -> (ShardId, String) {
        let hold = |id| {
            let (r, _) = self.reshard.as_ref()?;
            let m = r.plan().get(id)?;
            Some((
                r.final_shard(id)?,
                crate::Names::hold_routing_key(r.from().0, m.from, m.to),
            ))
        };
        let shard = |shard| (shard, crate::Names::routing_key(shard));
        match self.destination(order_id) {
            Destination::Shard(s) => shard(s),
            // Every move of the plan is recorded: the fallback is not met.
            Destination::Hold(id) => hold(id)
                .unwrap_or_else(|| shard(self.map.shard_count().shard_of(order_id.as_str()))),
        }
    }

    /// The order's bucket.
    pub fn bucket_of(&self, order_id: &str) -> Bucket {
        self.buckets.bucket_of(order_id)
    }

    /// The generation publishers route by now (during a reshard, its phase's).
    pub fn generation(&self) -> Generation {
        match &self.reshard {
            Some((reshard, phase)) => phase.generation(reshard.from()),
            None => self.map.generation(),
        }
    }

    /// The map's shard count (during a reshard, the count it started from).
    pub fn shard_count(&self) -> ShardCount {
        self.map.shard_count()
    }

    /// The routing key of the order's new events at this generation.
    pub fn routing_key(&self, order_id: &OrderId) -> String {
        self.route(order_id).1
    }

    /// A reshard in progress and its recorded step.
    pub fn reshard(&self) -> Option<(&Reshard, Phase)> {
        self.reshard.as_ref().map(|(r, p)| (r, *p))
    }

    /// The count outside publishers route by (`md5 mod N₀`).
    pub fn first_shards(&self) -> ShardCount {
        self.buckets.first()
    }

    /// The map.
    pub fn map(&self) -> &Map {
        &self.map
    }
}

/// The highest generation a reader has seen, so that one lower is caught.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationWatch {
    highest: u64,
}

impl GenerationWatch {
    /// Takes `record` in; an error when its generation is below one seen.
    pub fn observe(&mut self, record: &TopologyRecord) -> Result<(), RecordError> {
        if record.generation < self.highest {
            return Err(RecordError::WentBackwards {
                seen: self.highest,
                found: record.generation,
            });
        }
        self.highest = record.generation;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(n: u32) -> ShardCount {
        ShardCount::new(n).unwrap()
    }

    #[test]
    fn a_record_reads_back_what_was_written() {
        let record = TopologyRecord::first(count(16), "topology apply", 1_700_000_000_000);
        assert_eq!(TopologyRecord::decode(&record.encode()).unwrap(), record);
        assert_eq!(record.generation, 1);
        assert_eq!(record.first_shards, 16);
    }

    fn order(id: &str) -> OrderId {
        OrderId::new(id).unwrap()
    }

    #[test]
    fn the_first_map_routes_as_md5_mod_the_first_count_and_a_record_of_before_buckets_reads() {
        let record = TopologyRecord::first(count(6), "topology apply", 0);
        assert_eq!(record.buckets, 4098);
        assert!(!record.encode().contains("\"map\""), "{}", record.encode());
        let routing = record.routing().unwrap();
        for id in ["A1", "order-17", "Z", "ünïcode"] {
            assert_eq!(routing.shard_of(&order(id)), count(6).shard_of(id), "{id}");
        }
        // A record written before buckets existed (no `buckets`, no `map`).
        let before = r#"{"generation":1,"shards":16,"first_shards":16,"recorded_by":"x","recorded_at_ms":0}"#;
        let read = TopologyRecord::decode(before).unwrap();
        assert_eq!(
            read.routing().unwrap().shard_of(&order("A1")),
            count(16).shard_of("A1")
        );
    }

    #[test]
    fn a_recorded_map_routes_by_bucket_and_an_impossible_one_is_refused() {
        let mut record = TopologyRecord::first(count(4), "topology apply", 0);
        let plan = record.routing().unwrap().map().plan(6).unwrap();
        record.generation = 3;
        record.shards = 6;
        record.map = Some(plan.target.shard_numbers());
        let read = TopologyRecord::decode(&record.encode()).unwrap();
        let routing = read.routing().unwrap();
        assert_eq!(routing.shard_count(), count(6));
        assert_eq!(routing.first_shards(), count(4));
        let moved = (0..200)
            .map(|i| format!("order-{i}"))
            .filter(|id| routing.shard_of(&order(id)) != count(4).shard_of(id))
            .count();
        assert!(moved > 0 && moved < 200, "{moved} of 200 moved");
        // A map naming a shard beyond the count, or of another length.
        let mut wrong = record.clone();
        wrong.shards = 5;
        assert!(matches!(
            TopologyRecord::decode(&wrong.encode()),
            Err(RecordError::Map(_))
        ));
        wrong = record.clone();
        wrong.map.as_mut().unwrap().pop();
        assert!(matches!(
            TopologyRecord::decode(&wrong.encode()),
            Err(RecordError::Map(_))
        ));
        wrong = record;
        wrong.buckets = 7;
        assert!(matches!(
            TopologyRecord::decode(&wrong.encode()),
            Err(RecordError::BucketCount { .. })
        ));
    }

    #[test]
    fn during_a_reshard_moving_orders_route_to_their_holding_queue_then_to_their_new_shard() {
        let mut record = TopologyRecord::first(count(4), "topology apply", 0);
        let mut state = ReshardState::planned(1, 6, "test", 0);
        let old = record.routing().unwrap();
        let plan = state.reshard(old.map()).unwrap().plan().clone();
        let orders: Vec<OrderId> = (0..300).map(|i| order(&format!("o-{i}"))).collect();
        let moving: Vec<&OrderId> = orders
            .iter()
            .filter(|o| {
                plan.target.shard_of(old.buckets.bucket_of(o.as_str())) != Some(old.shard_of(o))
            })
            .collect();
        assert!(!moving.is_empty());
        for (phase, generation) in [
            (Phase::Planned, 1),
            (Phase::Holding, 2),
            (Phase::Closing, 3),
        ] {
            state.phase = phase;
            record.generation = generation;
            record.reshard = Some(state.clone());
            let routing = TopologyRecord::decode(&record.encode())
                .unwrap()
                .routing()
                .unwrap();
            for o in &orders {
                let key = routing.routing_key(o);
                let new = plan
                    .target
                    .shard_of(old.buckets.bucket_of(o.as_str()))
                    .unwrap();
                let expected = match phase {
                    Phase::Holding if moving.contains(&o) => {
                        crate::Names::hold_routing_key(1, old.shard_of(o), new)
                    }
                    Phase::Closing => crate::Names::routing_key(new),
                    _ => crate::Names::routing_key(old.shard_of(o)),
                };
                assert_eq!(key, expected, "{o} at {phase:?}");
            }
        }
        // A generation that is not the phase's is refused.
        record.generation = 2;
        assert!(matches!(
            TopologyRecord::decode(&record.encode()),
            Err(RecordError::Reshard(_))
        ));
    }

    #[test]
    fn an_unreadable_or_impossible_record_is_an_error_naming_the_way_out() {
        let junk = TopologyRecord::decode("{\"generation\":").unwrap_err();
        assert!(junk.to_string().contains("topology apply"), "{junk}");
        let zero =
            r#"{"generation":1,"shards":0,"first_shards":4,"recorded_by":"x","recorded_at_ms":0}"#;
        assert!(matches!(
            TopologyRecord::decode(zero),
            Err(RecordError::Shards(_))
        ));
    }

    #[test]
    fn apply_refuses_another_count_and_followers_are_told_how_to_agree() {
        let record = TopologyRecord::first(count(16), "topology apply", 0);
        assert!(record.agrees(count(16)));
        assert!(!record.agrees(count(20)));
        let refusal = record.apply_refusal(count(20));
        assert!(
            refusal.starts_with(
                "--shards 20 disagrees with the topology, which has 16 shards (recorded in Redis, \
                 generation 1): `topology apply` never changes"
            ),
            "{refusal}"
        );
        assert!(
            record
                .status_refusal(count(8))
                .ends_with("run it with --shards 16")
        );
        assert!(
            record
                .follow_warning(count(8))
                .contains("following the record (set --shards 16")
        );
    }

    #[test]
    fn a_generation_that_goes_back_stops_the_reader() {
        let mut watch = GenerationWatch::default();
        let mut record = TopologyRecord::first(count(4), "t", 0);
        record.generation = 3;
        watch.observe(&record).unwrap();
        watch.observe(&record).unwrap();
        record.generation = 2;
        let err = watch.observe(&record).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("the recorded topology went back from generation 3 to 2"),
            "{err}"
        );
    }
}
