//! Drain markers: honoured once, only when the reshard's record holds their
//! id as pending.

use std::collections::BTreeMap;

use super::map::MoveId;

/// A marker's single-use id, recorded before the marker is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MarkerId(pub u64);

/// Which hand-over a marker closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MarkerKind {
    /// In a move's old shard queue (step 4): the move is `drained`.
    Drain,
    /// In a move's holding queue (step 6): the holding queue is closed.
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    kind: MarkerKind,
    move_id: MoveId,
    spent: bool,
}

/// The marker ids of a reshard's record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Markers {
    entries: BTreeMap<MarkerId, Entry>,
}

/// What honouring a marker did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Honour {
    /// The id was pending and is now spent: the move is drained (or closed).
    Honoured(MoveId, MarkerKind),
    /// The id was spent before (a redelivery): ack it, release nothing.
    AlreadyHonoured,
}

impl Markers {
    /// Records `id` as pending for `move_id`'s `kind` hand-over. An id already
    /// recorded is kept as it is.
    pub fn record(&mut self, id: MarkerId, move_id: MoveId, kind: MarkerKind) {
        self.entries.entry(id).or_insert(Entry {
            kind,
            move_id,
            spent: false,
        });
    }

    /// Honours a marker read from a queue: pending → spent in one step.
    pub fn honour(
        &mut self,
        id: MarkerId,
        move_id: MoveId,
        kind: MarkerKind,
    ) -> Result<Honour, MarkerError> {
        let entry = self.entries.get_mut(&id).ok_or(MarkerError::Unknown(id))?;
        if entry.move_id != move_id || entry.kind != kind {
            return Err(MarkerError::Mismatch(id));
        }
        if entry.spent {
            return Ok(Honour::AlreadyHonoured);
        }
        entry.spent = true;
        Ok(Honour::Honoured(move_id, kind))
    }

    /// Whether some marker of `move_id`'s `kind` hand-over was honoured.
    pub fn is_honoured(&self, move_id: MoveId, kind: MarkerKind) -> bool {
        self.entries
            .values()
            .any(|e| e.spent && e.move_id == move_id && e.kind == kind)
    }
}

/// A marker that releases nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MarkerError {
    /// No record holds this id (forged, or of a cleared reshard): dead-letter it `control`.
    #[error("marker {} is not in the reshard's record", .0.0)]
    Unknown(MarkerId),
    /// The id was recorded for another move or hand-over: dead-letter it `control`.
    #[error("marker {} names another move than its record", .0.0)]
    Mismatch(MarkerId),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_is_honoured_once_and_only_when_recorded() {
        let mut markers = Markers::default();
        let (id, m) = (MarkerId(7), MoveId(1));
        assert_eq!(
            markers.honour(id, m, MarkerKind::Drain),
            Err(MarkerError::Unknown(id))
        );
        markers.record(id, m, MarkerKind::Drain);
        assert!(!markers.is_honoured(m, MarkerKind::Drain));
        assert_eq!(
            markers.honour(id, MoveId(2), MarkerKind::Drain),
            Err(MarkerError::Mismatch(id))
        );
        assert_eq!(
            markers.honour(id, m, MarkerKind::Close),
            Err(MarkerError::Mismatch(id))
        );
        assert_eq!(
            markers.honour(id, m, MarkerKind::Drain),
            Ok(Honour::Honoured(m, MarkerKind::Drain))
        );
        assert_eq!(
            markers.honour(id, m, MarkerKind::Drain),
            Ok(Honour::AlreadyHonoured)
        );
        assert!(markers.is_honoured(m, MarkerKind::Drain));
        assert!(!markers.is_honoured(m, MarkerKind::Close));
    }
}
