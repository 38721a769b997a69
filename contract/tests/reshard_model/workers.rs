//! The workers: consumers of shard, holding and retired queues, each with a
//! registered forwarder, deciding by the verdict; their crashes and late
//! writes; the handlers' fenced writes.

use std::collections::VecDeque;

use shardline_contract::reshard::{
    Generation, Honour, Lease, MarkerId, MarkerKind, MoveId, Verdict, View, may_acknowledge,
    verdict,
};

use super::{Bug, Consumer, Ev, LEASE, Msg, Pending, Q, Reg, Step, World, Zombie};

impl World {
    pub(super) fn consumer_id(&self, pick: usize) -> Option<u64> {
        let ids: Vec<u64> = self.consumers.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[pick % ids.len()])
    }

    pub(super) fn start(&mut self, pick: usize) {
        let free: Vec<Q> = self
            .queues
            .keys()
            .copied()
            .filter(|q| !self.consumers.values().any(|c| c.q == *q))
            .collect();
        if free.is_empty() {
            return;
        }
        self.start_on(free[pick % free.len()]);
    }

    pub(super) fn start_on(&mut self, q: Q) {
        let view = self.read_view(Some(q));
        let seen = Self::view_generation(&view);
        self.fence += 1;
        self.ranks += 1;
        let owned = self.owned(&view, q);
        let chan = self.channel();
        self.next_consumer += 1;
        let id = self.next_consumer;
        self.leases.insert(
            Reg::Forwarder(id),
            Lease {
                deadline_ms: self.now + LEASE,
                acknowledged: seen,
            },
        );
        self.consumers.insert(
            id,
            Consumer {
                q,
                chan,
                epoch: self.fence,
                rank: self.ranks,
                view,
                seen,
                deadline: self.now + LEASE,
                owned,
                delivery: None,
                forwarding: None,
            },
        );
    }

    pub(super) fn refresh(&mut self, id: u64) -> Step {
        let Some(c) = self.consumers.get(&id) else {
            return Ok(());
        };
        if self.now >= c.deadline {
            // Its forwarder cannot renew: the worker stops.
            self.crash(id, false);
            return Ok(());
        }
        let q = c.q;
        let view = self.read_view(Some(q));
        let read = c
            .seen
            .check_read(Self::view_generation(&view))
            .map_err(|e| format!("generations only grow: {e}"))?;
        self.adopt(id, view);
        let confirmed = &self.confirmed;
        let c = self.consumers.get_mut(&id).ok_or("consumer")?;
        c.seen = read;
        c.deadline = self.now + LEASE;
        let unconfirmed = c
            .forwarding
            .filter(|f| !confirmed.contains(&f.serial))
            .map(|f| f.routed);
        let before = self
            .leases
            .get(&Reg::Forwarder(id))
            .map_or(Generation(0), |l| l.acknowledged);
        let acknowledged = if may_acknowledge(read, unconfirmed) {
            read
        } else {
            before
        };
        let lease = Lease {
            deadline_ms: self.now + LEASE,
            acknowledged,
        };
        self.leases.insert(Reg::Forwarder(id), lease);
        Ok(())
    }

    /// The consumer takes a view; keys a move hands it come with a new epoch.
    pub(super) fn adopt(&mut self, id: u64, view: View) {
        let Some(c) = self.consumers.get(&id) else {
            return;
        };
        let owned = self.owned(&view, c.q);
        let gained = !owned.is_subset(&c.owned);
        let fence_bug = self.bug(Bug::FenceFromOldScope);
        if gained {
            self.ranks += 1;
            if !fence_bug {
                self.fence += 1;
            }
        }
        let (fence, ranks) = (self.fence, self.ranks);
        let Some(c) = self.consumers.get_mut(&id) else {
            return;
        };
        if gained {
            c.rank = ranks;
            if !fence_bug {
                c.epoch = fence;
            }
        }
        c.owned = owned;
        c.view = view;
    }

    pub(super) fn deliver(&mut self, id: u64) {
        let Some(c) = self.consumers.get_mut(&id) else {
            return;
        };
        if c.delivery.is_some() {
            return;
        }
        c.delivery = self.queues.get_mut(&c.q).and_then(VecDeque::pop_front);
    }

    pub(super) fn crash(&mut self, id: u64, zombie: bool) {
        let Some(c) = self.consumers.remove(&id) else {
            return;
        };
        if let Some(msg) = c.delivery {
            if let Msg::Event(ev) = msg {
                let mine =
                    verdict(&c.view, c.q.source(), self.bucket(ev.order)) == Ok(Verdict::Process);
                if zombie && mine {
                    self.zombies.push(Zombie {
                        ev,
                        epoch: c.epoch,
                        rank: c.rank,
                    });
                }
            }
            self.stats.redelivered += 1;
            // Unacked: back to the head of its queue.
            self.queues.entry(c.q).or_default().push_front(msg);
        }
    }

    pub(super) fn zombie_write(&mut self, pick: usize) -> Step {
        if self.zombies.is_empty() {
            return Ok(());
        }
        let z = self.zombies.remove(pick % self.zombies.len());
        self.write(z.ev, z.epoch, z.rank, false)
    }

    /// A handler's write, fenced by the order's epoch.
    pub(super) fn write(&mut self, ev: Ev, epoch: u64, rank: u64, owner: bool) -> Step {
        let o = usize::from(ev.order);
        if epoch < self.order_epoch[o] {
            if !owner {
                self.stats.zombie_refused += 1;
            }
            return if owner {
                Err(format!(
                    "no stale write: the owner's write of {ev:?} refused, its epoch {epoch} is below the order's {}",
                    self.order_epoch[o]
                ))
            } else {
                Ok(())
            };
        }
        if rank < self.order_rank[o] {
            return Err(format!(
                "no stale write: a stale owner's write of {ev:?} (epoch {epoch}) accepted after a newer owner's"
            ));
        }
        if !owner {
            self.stats.zombie_accepted += 1;
        }
        self.order_epoch[o] = epoch;
        self.order_rank[o] = rank;
        if self.trace {
            eprintln!("  t{} write {ev:?} epoch {epoch} owner {owner}", self.now);
        }
        if self.processed.insert((ev.publisher, ev.order, ev.nth))
            && let Some(gap) =
                (0..ev.nth).find(|k| !self.processed.contains(&(ev.publisher, ev.order, *k)))
        {
            return Err(format!(
                "per-order order: {ev:?} processed first before event {gap} of the same publisher and order"
            ));
        }
        Ok(())
    }

    pub(super) fn settle(&mut self, id: u64) -> Step {
        let Some(c) = self.consumers.get(&id) else {
            return Ok(());
        };
        let Some(msg) = c.delivery else { return Ok(()) };
        if let Some(f) = c.forwarding {
            // Acked only while its lease holds, so its confirm came while the
            // barrier counted it; past that the worker stops and the event is
            // redelivered.
            if self.confirmed.contains(&f.serial)
                && (self.now < c.deadline || !self.cfg.resend_uncovered)
            {
                let c = self.consumers.get_mut(&id).ok_or("consumer")?;
                c.forwarding = None;
                c.delivery = None;
            }
            return Ok(());
        }
        let (q, epoch, rank, chan, seen) = (c.q, c.epoch, c.rank, c.chan, c.seen);
        match msg {
            Msg::Marker(marker, m, kind) => {
                if self.trace {
                    eprintln!("  t{} {q:?} honours {marker:?} {m:?} {kind:?}", self.now);
                }
                self.honour(id, marker, m, kind)
            }
            Msg::Event(ev) => {
                let bucket = self.bucket(ev.order);
                let said = verdict(&c.view, q.source(), bucket)
                    .map_err(|e| format!("nothing dead-lettered: {ev:?} has no route: {e}"))?;
                match said {
                    Verdict::Process => {
                        let truth = verdict(&self.read_view(None), q.source(), bucket);
                        if truth != Ok(Verdict::Process) {
                            return Err(format!(
                                "one queue per bucket: {q:?} processed {ev:?}, the record says {truth:?}"
                            ));
                        }
                        self.write(ev, epoch, rank, true)?;
                        self.stats.processed += 1;
                        if matches!(q, Q::Hold(_)) {
                            self.stats.processed_from_hold += 1;
                        }
                        if let Some(c) = self.consumers.get_mut(&id) {
                            c.delivery = None;
                        }
                        Ok(())
                    }
                    Verdict::Forward(destination) => {
                        if self.now >= c.deadline {
                            return Ok(());
                        }
                        let serial = self.publish(chan, Q::of(destination), Msg::Event(ev))?;
                        if let Some(c) = self.consumers.get_mut(&id) {
                            c.forwarding = Some(Pending {
                                serial,
                                ev,
                                routed: seen,
                            });
                        }
                        self.stats.forwarded += 1;
                        Ok(())
                    }
                    Verdict::Wait => {
                        self.stats.waits += 1;
                        Ok(())
                    }
                }
            }
        }
    }

    pub(super) fn honour(
        &mut self,
        id: u64,
        marker: MarkerId,
        m: MoveId,
        kind: MarkerKind,
    ) -> Step {
        let forged_ok = self.bug(Bug::ForgedMarkerHonoured);
        if let Some(r) = self.record.as_mut() {
            match r.markers.honour(marker, m, kind) {
                Ok(Honour::Honoured(..)) => self.stats.honoured += 1,
                Ok(Honour::AlreadyHonoured) => {}
                Err(_) if forged_ok => {
                    r.forced.insert((m, kind));
                }
                // Dead-lettered `control`: a control message, never an event.
                Err(_) => self.stats.refused_markers += 1,
            }
        }
        if let Some(c) = self.consumers.get_mut(&id) {
            c.delivery = None;
        }
        let view = self.read_view(self.consumers.get(&id).map(|c| c.q));
        self.adopt(id, view);
        Ok(())
    }
}
