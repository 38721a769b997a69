//! The reshard command: one idempotent step at a time from the recorded
//! phase, the barriers, markers sent again with new ids, forged markers, and
//! Redis's failover.

use std::collections::BTreeSet;

use shardline_contract::reshard::{
    Barrier, Generation, MarkerId, MarkerKind, Markers, MoveId, Phase, Reshard, barrier,
};

use super::{Bug, FORGED, Msg, Q, Record, Step, World};

/// The channel the command publishes its markers on.
const COMMAND_CHANNEL: u32 = 0;

impl World {
    pub(super) fn command(&mut self) -> Step {
        let Some(r) = self.record.as_ref() else {
            if self.map.shard_count().get() as u32 == self.target {
                return Ok(());
            }
            let reshard = Reshard::new(self.map.clone(), self.target).map_err(|e| e.to_string())?;
            let mut markers = Markers::default();
            let mut next_id = 0;
            for m in 0..reshard.plan().moves.len() {
                for kind in [MarkerKind::Drain, MarkerKind::Close] {
                    next_id += 1;
                    markers.record(MarkerId(next_id), MoveId(m as u16), kind);
                }
            }
            self.record = Some(Record {
                reshard,
                phase: Phase::Planned,
                markers,
                forced: BTreeSet::new(),
                declared: false,
                close_sent: false,
                next_id,
            });
            return Ok(());
        };
        let from = r.reshard.from();
        let moves = r.reshard.plan().moves.clone();
        let (phase, declared, close_sent) = (r.phase, r.declared, r.close_sent);
        let declare_first = !self.bug(Bug::UnbindBeforeBind);
        if !declared && (declare_first || phase >= Phase::Holding) {
            for j in 0..self.target as u16 {
                self.declare(Q::Shard(j));
            }
            for m in 0..moves.len() as u16 {
                self.declare(Q::Hold(m));
            }
            self.record_mut()?.declared = true;
            return Ok(());
        }
        match phase {
            Phase::Planned => {
                self.generation = from.next();
                self.record_mut()?.phase = Phase::Holding;
            }
            Phase::Holding => {
                if self.command.is_empty() {
                    if !self.barrier_open(from.next()) {
                        return Ok(());
                    }
                    for (m, mv) in moves.iter().enumerate() {
                        let id = Self::marker_id(MoveId(m as u16), MarkerKind::Drain);
                        let chan = COMMAND_CHANNEL;
                        let serial = self.publish(
                            chan,
                            Q::Shard(mv.from.get()),
                            Msg::Marker(id, MoveId(m as u16), MarkerKind::Drain),
                        )?;
                        self.command.push(serial);
                    }
                } else if self.command.iter().all(|s| self.confirmed.contains(s)) {
                    self.command.clear();
                    self.record_mut()?.phase = Phase::Draining;
                }
            }
            Phase::Draining => {
                let r = self.record.as_ref().ok_or("record")?;
                if (0..moves.len()).all(|m| r.honoured(MoveId(m as u16), MarkerKind::Drain)) {
                    self.record_mut()?.phase = Phase::Opening;
                }
            }
            Phase::Opening => {
                self.generation = from.next().next();
                self.record_mut()?.phase = Phase::Closing;
            }
            Phase::Closing if !close_sent => {
                if self.command.is_empty() {
                    if !self.barrier_open(from.next().next()) {
                        return Ok(());
                    }
                    for m in 0..moves.len() as u16 {
                        let id = Self::marker_id(MoveId(m), MarkerKind::Close);
                        let chan = COMMAND_CHANNEL;
                        let serial = self.publish(
                            chan,
                            Q::Hold(m),
                            Msg::Marker(id, MoveId(m), MarkerKind::Close),
                        )?;
                        self.command.push(serial);
                    }
                } else if self.command.iter().all(|s| self.confirmed.contains(s)) {
                    self.command.clear();
                    self.record_mut()?.close_sent = true;
                }
            }
            Phase::Closing => {
                let r = self.record.as_ref().ok_or("record")?;
                if (0..moves.len()).all(|m| r.honoured(MoveId(m as u16), MarkerKind::Close)) {
                    self.stats.reshards += 1;
                    self.stats.moves += moves.len() as u32;
                    self.map = r.reshard.plan().target.clone();
                    self.last = self.record.take().map(|r| r.reshard);
                    // The holding queues are unbound; what they still hold is forwarded.
                    for m in 0..moves.len() as u16 {
                        self.bound.remove(&Q::Hold(m));
                    }
                }
            }
            Phase::Done => {}
        }
        Ok(())
    }

    pub(super) fn record_mut(&mut self) -> Result<&mut Record, String> {
        self.record.as_mut().ok_or_else(|| "no record".to_owned())
    }

    /// The id of the move's first marker of this kind (ids are recorded in pairs at plan time).
    pub(super) fn marker_id(m: MoveId, kind: MarkerKind) -> MarkerId {
        let base = u64::from(m.0) * 2 + 1;
        MarkerId(if kind == MarkerKind::Drain {
            base
        } else {
            base + 1
        })
    }

    pub(super) fn barrier_open(&self, target: Generation) -> bool {
        self.bug(Bug::MarkerWithoutBarrier)
            || barrier(self.leases.values(), target, self.now) == Barrier::Open
    }

    pub(super) fn resend(&mut self, pick: usize) -> Step {
        let Some(r) = self.record.as_ref() else {
            return Ok(());
        };
        let moves = r.reshard.plan().moves.clone();
        if moves.is_empty() {
            return Ok(());
        }
        let m = MoveId((pick % moves.len()) as u16);
        let (kind, q) = match r.phase {
            Phase::Draining => (
                MarkerKind::Drain,
                Q::Shard(moves[usize::from(m.0)].from.get()),
            ),
            Phase::Closing if r.close_sent => (MarkerKind::Close, Q::Hold(m.0)),
            _ => return Ok(()),
        };
        if r.honoured(m, kind) {
            return Ok(());
        }
        let r = self.record_mut()?;
        r.next_id += 1;
        let id = MarkerId(r.next_id);
        r.markers.record(id, m, kind);
        self.publish(COMMAND_CHANNEL, q, Msg::Marker(id, m, kind))?;
        Ok(())
    }

    pub(super) fn forge(&mut self, pick: usize, drain: bool) -> Step {
        let Some(r) = self.record.as_ref() else {
            return Ok(());
        };
        let moves = &r.reshard.plan().moves;
        if moves.is_empty() || !r.declared {
            return Ok(());
        }
        let m = pick % moves.len();
        let (kind, q) = if drain {
            (MarkerKind::Drain, Q::Shard(moves[m].from.get()))
        } else {
            (MarkerKind::Close, Q::Hold(m as u16))
        };
        self.publish(
            u32::MAX,
            q,
            Msg::Marker(MarkerId(FORGED + pick as u64), MoveId(m as u16), kind),
        )?;
        Ok(())
    }

    pub(super) fn failover(&mut self) {
        if let Some((reg, before)) = self.unwaited.take() {
            self.stats.failover_lost += 1;
            match before {
                Some(lease) => self.leases.insert(reg, lease),
                None => self.leases.remove(&reg),
            };
        }
    }
}
