//! A reshard in progress as the recorded topology stores it: the target
//! count, the generation it started from, the recorded step and who runs it.
//! Every reader rebuilds the plan from the map it starts from (the plan is a
//! pure function of the map and M), so the record stays small and cannot
//! disagree with it. The markers' ids and the moves they released are kept
//! beside it, each written by one script (`connect::reshard`): a consumer
//! honouring a marker never rewrites the record.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::map::{Map, MoveId, PlanError};
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
    /// Who runs it (`topology reshard` on a host, with its process id).
    pub started_by: String,
    /// When it started, in Unix milliseconds.
    pub started_at_ms: u64,
    /// Given up (`topology reshard --abort`) after its first barrier: it
    /// runs on to the old map.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aborted: bool,
}

impl ReshardState {
    /// A reshard from generation `from` to `to` shards, planned, not started.
    pub fn planned(from: u64, to: u16, started_by: &str, now_ms: u64) -> Self {
        Self {
            to,
            from,
            phase: Phase::Planned,
            started_by: started_by.to_owned(),
            started_at_ms: now_ms,
            aborted: false,
        }
    }

    /// The reshard of `old` (the map it started from) this state is at.
    pub fn reshard(&self, old: &Map) -> Result<Reshard, PlanError> {
        let reshard = Reshard::new(old.clone(), u32::from(self.to))?;
        Ok(if self.aborted {
            reshard.aborted()
        } else {
            reshard
        })
    }

    /// What a consumer decides by ([`super::verdict`]), with the moves
    /// drained and closed so far.
    pub fn progress(
        &self,
        old: &Map,
        drained: BTreeSet<MoveId>,
        closed: BTreeSet<MoveId>,
    ) -> Result<Progress, PlanError> {
        Ok(Progress {
            reshard: self.reshard(old)?,
            phase: self.phase,
            drained,
            closed,
        })
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
        let text = serde_json::to_string(&state).unwrap();
        assert!(text.contains(r#""phase":"draining""#), "{text}");
        let read: ReshardState = serde_json::from_str(&text).unwrap();
        assert_eq!(read, state);
        let progress = read
            .progress(&map, BTreeSet::from([MoveId(0)]), BTreeSet::new())
            .unwrap();
        assert_eq!(progress.reshard.plan().target.shard_count().get(), 6);
        assert!(progress.drained.contains(&MoveId(0)));
    }
}
