//! The publishers: registered ones with a lease, routing by the generation
//! they acknowledged and resending on registering again, and the legacy one
//! (`shard.{md5 mod N₀}`), outside the barrier.

use shardline_contract::reshard::{Generation, Lease, may_acknowledge, must_resend};

use super::{Bug, Ev, LEASE, LEGACY, Msg, ORDERS, Pending, Q, Reg, Step, World};

impl World {
    pub(super) fn publisher_publish(&mut self, p: usize, order: u8, sequenced: bool) -> Step {
        let Some(publisher) = self.publishers.get(p) else {
            return self.legacy_publish(order, sequenced);
        };
        if self.now >= publisher.deadline && !self.bug(Bug::PublishAfterLeaseLapse) {
            return Ok(());
        }
        // It routes by the generation it acknowledged: a route switched while
        // events of the older route are unconfirmed would let a lapse put
        // those behind the marker and the new route's ahead of them.
        let read = if self.cfg.route_by_acknowledged {
            publisher.acknowledged
        } else {
            publisher.read
        };
        let q = self.route_by(read, order)?;
        let publisher = &mut self.publishers[p];
        let ev = Ev {
            publisher: p as u8,
            order,
            nth: publisher.next[usize::from(order)],
            sequenced,
        };
        publisher.next[usize::from(order)] += 1;
        let chan = publisher.chan;
        let serial = self.publish(chan, q, Msg::Event(ev))?;
        self.publishers[p].pending.push(Pending {
            serial,
            ev,
            routed: read,
        });
        self.published.insert(ev);
        Ok(())
    }

    /// Where a publisher that read `read` sends an order's event (it keeps
    /// the map or record it read).
    pub(super) fn route_by(&self, read: Generation, order: u8) -> Result<Q, String> {
        let bucket = self.bucket(order);
        if read == self.map.generation() {
            return Ok(Q::Shard(self.map.shard_of(bucket).ok_or("bucket")?.get()));
        }
        let reshard = self
            .record
            .as_ref()
            .map(|r| &r.reshard)
            .or(self.last.as_ref())
            .ok_or("no record")?;
        Ok(Q::of(
            reshard.route(read, bucket).map_err(|e| e.to_string())?,
        ))
    }

    pub(super) fn legacy_publish(&mut self, order: u8, sequenced: bool) -> Step {
        let q = Q::Shard(self.first.shard_of(ORDERS[usize::from(order)]).get());
        let ev = Ev {
            publisher: LEGACY,
            order,
            nth: self.legacy.1[usize::from(order)],
            sequenced,
        };
        self.legacy.1[usize::from(order)] += 1;
        self.publish(self.legacy.0, q, Msg::Event(ev))?;
        self.published.insert(ev);
        Ok(())
    }

    pub(super) fn write_lease(&mut self, reg: Reg, lease: Lease) {
        let before = self.leases.insert(reg, lease);
        self.unwaited = (!self.cfg.lease_waits).then_some((reg, before));
    }

    pub(super) fn renew(&mut self, p: usize) -> Step {
        let Some(publisher) = self.publishers.get(p) else {
            return Ok(());
        };
        if self.now >= publisher.deadline {
            if self.bug(Bug::PublishAfterLeaseLapse) {
                // The renewal failed; the publisher reads the topology anyway
                // and goes on as if it were renewed, without registering again.
                let read = self.generation;
                let publisher = &mut self.publishers[p];
                publisher.read = read;
                publisher.seen = read;
                publisher.acknowledged = read;
            }
            return Ok(());
        }
        let read = publisher
            .seen
            .check_read(self.generation)
            .map_err(|e| format!("generations only grow: {e}"))?;
        let confirmed = &self.confirmed;
        let publisher = &mut self.publishers[p];
        publisher.read = read;
        publisher.seen = read;
        publisher.deadline = self.now + LEASE;
        let unconfirmed = publisher
            .pending
            .iter()
            .filter(|x| !confirmed.contains(&x.serial))
            .map(|x| x.routed);
        if may_acknowledge(read, unconfirmed) {
            publisher.acknowledged = read;
        }
        let acknowledged = publisher.acknowledged;
        // An acknowledgement covers what was routed by an older map.
        publisher
            .pending
            .retain(|x| !confirmed.contains(&x.serial) || x.routed >= acknowledged);
        let lease = Lease {
            deadline_ms: publisher.deadline,
            acknowledged,
        };
        self.write_lease(Reg::Publisher(p), lease);
        Ok(())
    }

    pub(super) fn reregister(&mut self, p: usize) -> Step {
        let Some(publisher) = self.publishers.get(p) else {
            return Ok(());
        };
        if self.now < publisher.deadline {
            return Ok(());
        }
        let chan = self.channel();
        let confirmed = &self.confirmed;
        let publisher = &mut self.publishers[p];
        let read = self.generation;
        let acknowledged = publisher.acknowledged;
        let uncovered = self.cfg.resend_uncovered;
        let resend: Vec<Pending> = publisher
            .pending
            .drain(..)
            .filter(|x| {
                let done = confirmed.contains(&x.serial);
                if uncovered {
                    must_resend(x.routed, done, acknowledged, read)
                } else {
                    !done
                }
            })
            .collect();
        publisher.chan = chan;
        publisher.deadline = self.now + LEASE;
        publisher.acknowledged = read;
        publisher.read = read;
        publisher.seen = read;
        self.write_lease(
            Reg::Publisher(p),
            Lease {
                deadline_ms: self.now + LEASE,
                acknowledged: read,
            },
        );
        // What may sit behind a marker goes again, first, by the map just read.
        self.stats.resent_after_lapse += resend.len() as u32;
        for x in resend {
            let q = self.route_by(read, x.ev.order)?;
            let serial = self.publish(chan, q, Msg::Event(x.ev))?;
            self.publishers[p].pending.push(Pending {
                serial,
                ev: x.ev,
                routed: read,
            });
        }
        Ok(())
    }
}
