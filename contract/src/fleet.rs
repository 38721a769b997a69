//! The elastic fleet's documents in Redis (`--assign auto`): who is a member,
//! who should own each shard, and which shards fixed-assignment workers hold.
//! The worker writes them; `topology status` and the console read them.
//! The rule that decides the assignment is [`crate::assignment`].

use serde::{Deserialize, Serialize};

use crate::assignment::Assignment;

/// One member as it registers itself every heartbeat (`Keys::fleet_members`,
/// field = member id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// `--member-id` (default host name and process id; the pod name on Kubernetes).
    pub member: String,
    /// `--worker-name`, for logs and the broker's connection list.
    pub worker: String,
    /// Unix milliseconds (Redis's clock) since the member holds its lease
    /// without a lapse: a member is given shards only once it has held it
    /// for the settle time.
    pub joined_at_ms: u64,
    /// Unix milliseconds (Redis's clock) when the lease lapses unless renewed.
    pub lease_until_ms: u64,
    /// The lease's length (`--member-lease`).
    #[serde(default)]
    pub lease_ms: u64,
    /// The shards it was assigned and works on: the assignment is rebuilt
    /// from these if its document is lost (Redis restarted empty).
    #[serde(default)]
    pub owns: Vec<u16>,
}

/// The assignment document (`Keys::fleet_assignment`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FleetAssignment {
    pub assignment: Assignment,
    /// Unix milliseconds (Redis's clock) when this generation was decided.
    #[serde(default)]
    pub decided_at_ms: u64,
}

/// A fixed-assignment worker's shards (`Keys::fleet_static`, field = worker
/// name): the shards it consumes, not those it stands by for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StaticRecord {
    pub shards: Vec<u16>,
    /// Unix milliseconds after which the record is stale (its worker stopped writing).
    pub until_ms: u64,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_assignment_document_round_trips_with_shard_keys() {
        let doc = FleetAssignment {
            assignment: Assignment {
                generation: 7,
                owners: [(0, "a".to_owned()), (11, "b".to_owned())].into(),
            },
            decided_at_ms: 1_764_590_000_000,
        };
        let json = serde_json::to_string(&doc).unwrap();
        assert_eq!(
            json,
            r#"{"assignment":{"generation":7,"owners":{"0":"a","11":"b"}},"decided_at_ms":1764590000000}"#
        );
        assert_eq!(serde_json::from_str::<FleetAssignment>(&json).unwrap(), doc);
    }
}
