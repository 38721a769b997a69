//! What a consumer does with a delivery: the rules of the design's steps 4–6
//! and of legacy routing.

use std::collections::BTreeSet;

use super::buckets::Bucket;
use super::map::{Map, MoveId};
use super::route::{Destination, Phase, Reshard, RouteError};

/// The queue a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// `shard.{i}`: a shard of the map, of the reshard's target, or of a shard
    /// count of before (retired, forwarding).
    Shard(u16),
    /// A move's holding queue.
    Hold(MoveId),
}

/// A reshard in progress, as the consumer knows it (read from Redis; a
/// consumer that honours a marker adds it at once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The record.
    pub reshard: Reshard,
    /// The recorded step.
    pub phase: Phase,
    /// Moves whose drain marker was honoured.
    pub drained: BTreeSet<MoveId>,
    /// Moves whose holding queue's marker was honoured.
    pub closed: BTreeSet<MoveId>,
}

/// What a consumer knows of the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum View {
    /// No reshard: the recorded map.
    Settled(Map),
    /// A reshard in progress.
    Resharding(Progress),
}

/// The consumer's decision on one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// This queue is the one that processes the bucket now.
    Process,
    /// Publish it (confirmed, through the forwarder) to the bucket's route,
    /// then ack.
    Forward(Destination),
    /// Leave it unacked and read the topology again: its queue does not
    /// process the bucket yet, and its route is this very queue.
    Wait,
}

impl View {
    /// The queue whose consumer may process `bucket`'s events now: the old
    /// shard until its move is drained, then the holding queue, then (once
    /// closed) the new shard.
    fn owner(&self, bucket: Bucket) -> Option<Source> {
        let (map, progress) = match self {
            Self::Settled(map) => (map, None),
            Self::Resharding(p) => (p.reshard.old(), Some(p)),
        };
        if let Some(p) = progress
            && let Some(id) = p.reshard.plan().move_of(bucket)
        {
            let moved = p.reshard.plan().get(id)?;
            return Some(if p.closed.contains(&id) {
                Source::Shard(p.reshard.final_shard(id)?.get())
            } else if p.drained.contains(&id) {
                Source::Hold(id)
            } else {
                Source::Shard(moved.from.get())
            });
        }
        map.shard_of(bucket).map(|s| Source::Shard(s.get()))
    }

    /// Where a new event of `bucket` goes by the generation this view read.
    fn route(&self, bucket: Bucket) -> Result<Destination, RouteError> {
        match self {
            Self::Settled(map) => map
                .shard_of(bucket)
                .map(Destination::Shard)
                .ok_or(RouteError::Bucket(bucket)),
            Self::Resharding(p) => p
                .reshard
                .route(p.phase.generation(p.reshard.from()), bucket),
        }
    }
}

/// The verdict on a delivery of `bucket` from `source`.
///
/// The owner queue processes; any other forwards to the bucket's route, in
/// queue order (a registered forwarder keeps a legacy publisher's order);
/// where that route is the queue itself (a new shard meeting a moved
/// bucket's event before its holding queue closed, a holding queue before
/// its move drained) the consumer waits.
pub fn verdict(view: &View, source: Source, bucket: Bucket) -> Result<Verdict, RouteError> {
    if view.owner(bucket) == Some(source) {
        return Ok(Verdict::Process);
    }
    let route = view.route(bucket)?;
    let here = match route {
        Destination::Shard(s) => Source::Shard(s.get()),
        Destination::Hold(id) => Source::Hold(id),
    };
    Ok(if here == source {
        Verdict::Wait
    } else {
        Verdict::Forward(route)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reshard::Buckets;
    use crate::shard::ShardCount;

    fn setup() -> (Progress, Bucket, Bucket, u16, u16) {
        let buckets = Buckets::new(ShardCount::new(2).unwrap()).unwrap();
        let reshard = Reshard::new(Map::initial(&buckets), 3).unwrap();
        let moving = reshard.plan().moves[0].buckets[0];
        let from = reshard.plan().moves[0].from.get();
        let to = reshard.plan().moves[0].to.get();
        let staying = buckets
            .all()
            .find(|&b| {
                reshard.plan().move_of(b).is_none()
                    && reshard.old().shard_of(b).unwrap().get() == from
            })
            .unwrap();
        let progress = Progress {
            reshard,
            phase: Phase::Planned,
            drained: BTreeSet::new(),
            closed: BTreeSet::new(),
        };
        (progress, moving, staying, from, to)
    }

    #[test]
    fn a_moving_bucket_is_processed_by_one_queue_at_each_step() {
        let (mut p, moving, staying, from, to) = setup();
        let m = MoveId(0);
        let at = |p: &Progress, s| verdict(&View::Resharding(p.clone()), s, moving).unwrap();
        // Before the marker: the old shard processes; the holding queue waits.
        p.phase = Phase::Draining;
        assert_eq!(at(&p, Source::Shard(from)), Verdict::Process);
        assert_eq!(at(&p, Source::Hold(m)), Verdict::Wait);
        // After it: the old shard forwards to the holding queue, which processes.
        p.drained.insert(m);
        assert_eq!(
            at(&p, Source::Shard(from)),
            Verdict::Forward(Destination::Hold(m))
        );
        assert_eq!(at(&p, Source::Hold(m)), Verdict::Process);
        // Generation g + 2: the new shard waits until the holding queue closes.
        p.phase = Phase::Closing;
        assert_eq!(at(&p, Source::Shard(to)), Verdict::Wait);
        p.closed.insert(m);
        assert_eq!(at(&p, Source::Shard(to)), Verdict::Process);
        assert!(
            matches!(at(&p, Source::Hold(m)), Verdict::Forward(Destination::Shard(s)) if s.get() == to)
        );
        // A bucket that stays is its shard's all along.
        assert_eq!(
            verdict(&View::Resharding(p.clone()), Source::Shard(from), staying),
            Ok(Verdict::Process)
        );
    }

    #[test]
    fn an_aborted_reshard_hands_each_move_back_to_its_old_shard() {
        let (mut p, moving, _, from, to) = setup();
        p.reshard = p.reshard.aborted();
        let m = MoveId(0);
        let at = |p: &Progress, s| verdict(&View::Resharding(p.clone()), s, moving).unwrap();
        // Until its holding queue closes, the steps are those of a reshard.
        p.phase = Phase::Draining;
        p.drained.insert(m);
        assert_eq!(at(&p, Source::Hold(m)), Verdict::Process);
        // Generation g + 2 routes by the old map: the old shard waits for the
        // holding queue's close, then processes; the new shard never does.
        p.phase = Phase::Closing;
        assert_eq!(at(&p, Source::Shard(from)), Verdict::Wait);
        p.closed.insert(m);
        assert_eq!(at(&p, Source::Shard(from)), Verdict::Process);
        assert!(
            matches!(at(&p, Source::Hold(m)), Verdict::Forward(Destination::Shard(s)) if s.get() == from)
        );
        assert!(
            matches!(at(&p, Source::Shard(to)), Verdict::Forward(Destination::Shard(s)) if s.get() == from)
        );
        assert_eq!(p.reshard.target(), p.reshard.old());
    }

    #[test]
    fn a_retired_queue_forwards_everything() {
        let buckets = Buckets::new(ShardCount::new(4).unwrap()).unwrap();
        let map = Map::initial(&buckets).plan(2).unwrap().target;
        let view = View::Settled(map.clone());
        for b in buckets.all().take(64) {
            let owner = map.shard_of(b).unwrap();
            assert_eq!(
                verdict(&view, Source::Shard(3), b),
                Ok(Verdict::Forward(Destination::Shard(owner)))
            );
            assert_eq!(
                verdict(&view, Source::Shard(owner.get()), b),
                Ok(Verdict::Process)
            );
        }
    }
}
