//! A reshard in progress as the recorded topology stores it: the target
//! count, the recorded step, the moves drained and closed, and the markers'
//! single-use ids. Every reader rebuilds the plan from the map it starts
//! from (the plan is a pure function of the map and M), so the record stays
//! small and cannot disagree with it.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::map::{Map, MoveId, PlanError};
use super::marker::{MarkerId, MarkerKind, Markers};
use super::route::{Phase, Reshard};
use super::verdict::Progress;

/// The stored form of a reshard in progress (in `TopologyRecord::reshard`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReshardState {
    /// M, the target shard count.
    pub to: u16,
    /// Generation g, the map's when the reshard started (the record's `map`
    /// stays that map until the reshard is done).
    pub from: u64,
    /// The recorded step.
    pub phase: Phase,
    /// Moves whose drain marker was honoured.
    #[serde(default)]
    pub drained: BTreeSet<u16>,
    /// Moves whose holding queue's marker was honoured.
    #[serde(default)]
    pub closed: BTreeSet<u16>,
    /// Every marker id sent, with its move, hand-over and whether it was
    /// honoured.
    #[serde(default)]
    pub markers: Vec<MarkerEntry>,
    /// Who runs it (`topology reshard` on a host, with its process id).
    pub started_by: String,
    /// When it started, in Unix milliseconds.
    pub started_at_ms: u64,
}

/// One marker id of the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerEntry {
    /// The single-use id.
    pub id: u64,
    /// The move it closes.
    #[serde(rename = "move")]
    pub move_id: u16,
    /// The hand-over: a drain marker (old shard) or a close marker (holding queue).
    pub kind: MarkerKind,
    /// Honoured (spent).
    #[serde(default)]
    pub spent: bool,
}

impl ReshardState {
    /// A reshard from generation `from` to `to` shards, planned, not started.
    pub fn planned(from: u64, to: u16, started_by: &str, now_ms: u64) -> Self {
        Self {
            to,
            from,
            phase: Phase::Planned,
            drained: BTreeSet::new(),
            closed: BTreeSet::new(),
            markers: Vec::new(),
            started_by: started_by.to_owned(),
            started_at_ms: now_ms,
        }
    }

    /// The reshard of `old` (the map it started from) this state is at.
    pub fn reshard(&self, old: &Map) -> Result<Reshard, PlanError> {
        Reshard::new(old.clone(), u32::from(self.to))
    }

    /// What a consumer decides by ([`super::verdict`]).
    pub fn progress(&self, old: &Map) -> Result<Progress, PlanError> {
        Ok(Progress {
            reshard: self.reshard(old)?,
            phase: self.phase,
            drained: self.drained.iter().map(|&m| MoveId(m)).collect(),
            closed: self.closed.iter().map(|&m| MoveId(m)).collect(),
        })
    }

    /// The marker ids as the pure rules read them.
    pub fn markers(&self) -> Markers {
        let mut markers = Markers::default();
        for m in &self.markers {
            markers.record(MarkerId(m.id), MoveId(m.move_id), m.kind);
        }
        markers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reshard::Buckets;
    use crate::shard::ShardCount;

    #[test]
    fn a_state_reads_back_and_rebuilds_its_plan() {
        let map = Map::initial(&Buckets::new(ShardCount::new(4).unwrap()).unwrap());
        let mut state = ReshardState::planned(1, 6, "test", 1);
        state.phase = Phase::Draining;
        state.drained.insert(0);
        state.markers.push(MarkerEntry {
            id: 99,
            move_id: 0,
            kind: MarkerKind::Drain,
            spent: true,
        });
        let text = serde_json::to_string(&state).unwrap();
        assert!(text.contains(r#""phase":"draining""#), "{text}");
        let read: ReshardState = serde_json::from_str(&text).unwrap();
        assert_eq!(read, state);
        let progress = read.progress(&map).unwrap();
        assert_eq!(progress.reshard.plan().target.shard_count().get(), 6);
        assert!(progress.drained.contains(&MoveId(0)));
        assert!(read.markers().is_honoured(MoveId(0), MarkerKind::Drain));
    }
}
