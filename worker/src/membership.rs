//! `--assign auto`: this worker as a member of an elastic fleet.
//!
//! Every heartbeat the member renews its lease in Redis and reads the fleet
//! in the same round trip (one Lua script: `REGISTER`), then runs one
//! rebalance step ([`shardline_contract::assignment::rebalance`]) against the
//! shared assignment and writes it back if it changed, compare-and-set on the
//! generation (`CAS`). Each shard's consumer follows what the assignment gives
//! this member (a `watch` per shard): it takes a shard it was given (standing
//! by while the previous owner drains) and hands over one taken from it —
//! stops taking deliveries, finishes and acks the events in flight, closes its
//! channel without `basic.cancel` (`shard.rs`), so the read-ahead is back in
//! the queue before the next owner's consume succeeds.
//!
//! Membership decides who *should* own a shard, never who may: the exclusive
//! consumer does (invariant 1), so two members that briefly disagree never
//! consume one shard at once.
//!
//! A Redis blip must not reshuffle the fleet: leases that lapsed while Redis
//! was unreachable (for this member), or across a detected loss of Redis's
//! data (the assignment's generation went back or its document vanished),
//! count as renewed — for one lease after Redis returns nothing moves. A lost
//! assignment document is rebuilt from what every member says it owns.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use redis::Script;
use shardline_connect::RedisPool;
use shardline_contract::assignment::{self, Assignment, Members, Rules};
use shardline_contract::fleet::{FleetAssignment, MemberRecord, StaticRecord};
use shardline_contract::{Keys, ShardId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::FleetPolicy;
use crate::live::ShardWatch;

/// KEYS: members hash, assignment document, static hash. ARGV: member id,
/// worker name, lease ms, owned shards (JSON array), forget ms. Renews the
/// member's lease (keeping its join time while the lease held), forgets
/// members gone for longer than `forget ms`, and returns Redis's time, the
/// members, the assignment document and the static records.
const REGISTER: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local joined = now
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, rec = pcall(cjson.decode, old)
  if ok and type(rec) == 'table' and tonumber(rec.lease_until_ms) and tonumber(rec.lease_until_ms) >= now
     and tonumber(rec.joined_at_ms) then
    joined = tonumber(rec.joined_at_ms)
  end
end
local record = '{"member":' .. cjson.encode(ARGV[1]) .. ',"worker":' .. cjson.encode(ARGV[2])
  .. ',"joined_at_ms":' .. string.format('%d', joined)
  .. ',"lease_until_ms":' .. string.format('%d', now + tonumber(ARGV[3]))
  .. ',"lease_ms":' .. string.format('%d', tonumber(ARGV[3]))
  .. ',"owns":' .. ARGV[4] .. '}'
redis.call('HSET', KEYS[1], ARGV[1], record)
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ok, rec = pcall(cjson.decode, all[i + 1])
  if not ok or type(rec) ~= 'table' or not tonumber(rec.lease_until_ms)
     or tonumber(rec.lease_until_ms) + tonumber(ARGV[5]) < now then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return {now, redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]) or '', redis.call('HGETALL', KEYS[3])}
"#;

/// KEYS: assignment document. ARGV: the generation it is expected to have
/// (0: none), the new document. Writes it only over that generation.
const CAS: &str = r"
local current = redis.call('GET', KEYS[1])
local generation = 0
if current then
  local ok, doc = pcall(cjson.decode, current)
  if ok and type(doc) == 'table' and type(doc.assignment) == 'table' and tonumber(doc.assignment.generation) then
    generation = tonumber(doc.assignment.generation)
  end
end
if generation ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
";

/// Members gone for this many leases are forgotten.
const FORGET_AFTER_LEASES: u32 = 20;

/// The fleet metrics (registered in `metrics.rs`).
#[derive(Debug, Clone, Default)]
pub(crate) struct FleetMetrics {
    /// Shards the assignment gives this member.
    pub(crate) owned: Gauge,
    /// Live members this member sees.
    pub(crate) members: Gauge,
    /// Shards this member handed over while alive.
    pub(crate) graceful: Counter,
    /// Shards this member took from a member that was gone.
    pub(crate) crash: Counter,
}

/// One shard as the membership drives it: its live state and whether this
/// member should consume it.
pub(crate) struct ShardSlot {
    pub(crate) watch: Arc<ShardWatch>,
    pub(crate) wanted: watch::Sender<bool>,
}

/// The member and what it remembers between heartbeats.
pub(crate) struct Membership {
    policy: FleetPolicy,
    worker: String,
    keys: Keys,
    shards: Vec<ShardSlot>,
    /// Shards added while the member runs (a reshard's new queues).
    added: tokio::sync::mpsc::UnboundedReceiver<ShardSlot>,
    metrics: FleetMetrics,
    register: Script,
    cas: Script,
    /// Redis time until which no lease is judged lapsed and nothing moves.
    frozen_until_ms: u64,
    /// Redis failed since the last step that worked.
    blip: bool,
    /// The generation seen last: one lower later means Redis lost writes.
    last_generation: u64,
    /// Each shard's owner as seen last: a shard this member gains from a
    /// member that is gone counts as a crash handover.
    seen: BTreeMap<u16, String>,
}

impl Membership {
    pub(crate) fn new(
        policy: FleetPolicy,
        worker: String,
        keys: Keys,
        shards: Vec<ShardSlot>,
        added: tokio::sync::mpsc::UnboundedReceiver<ShardSlot>,
        metrics: FleetMetrics,
    ) -> Self {
        for slot in &shards {
            slot.watch.set_assigned(false);
            slot.wanted.send_replace(false);
        }
        Self {
            policy,
            worker,
            keys,
            shards,
            added,
            metrics,
            register: Script::new(REGISTER),
            cas: Script::new(CAS),
            frozen_until_ms: 0,
            blip: false,
            last_generation: 0,
            seen: BTreeMap::new(),
        }
    }

    /// Renews the lease and rebalances every heartbeat until `shutdown`.
    /// While Redis is unreachable the member keeps what it has.
    pub(crate) async fn run(mut self, pool: RedisPool, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.policy.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(member = %self.policy.member_id, lease = ?self.policy.lease, "joining the fleet (--assign auto)");
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => {
                    self.leave(&pool).await;
                    return;
                }
            }
            let step = tokio::time::timeout(self.policy.heartbeat, self.step(&pool)).await;
            match step.unwrap_or_else(|_| Err("timed out".into())) {
                Ok(()) => {}
                Err(e) => {
                    if !self.blip {
                        tracing::warn!(error = %e, "fleet membership: cannot reach Redis; keeping the shards held now");
                    }
                    self.blip = true;
                }
            }
        }
    }

    /// Stopping: gives the lease back, so that the others reassign this
    /// member's shards at their next heartbeat instead of after the lease
    /// (they stand by until its consumers have drained and closed).
    async fn leave(&self, pool: &RedisPool) {
        let left = async {
            let mut conn = pool.get().await.map_err(|e| e.to_string())?;
            redis::cmd("HDEL")
                .arg(self.keys.fleet_members())
                .arg(&self.policy.member_id)
                .query_async::<i64>(&mut conn)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(self.policy.heartbeat, left).await {
            Ok(Ok(_)) => tracing::info!(member = %self.policy.member_id, "left the fleet"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not leave the fleet; the lease lapses by itself")
            }
            Err(_) => {
                tracing::warn!("could not leave the fleet in time; the lease lapses by itself")
            }
        }
    }

    /// One heartbeat: renew, read, rebalance, follow.
    async fn step(&mut self, pool: &RedisPool) -> Result<(), String> {
        while let Ok(slot) = self.added.try_recv() {
            slot.watch.set_assigned(false);
            slot.wanted.send_replace(false);
            self.shards.push(slot);
        }
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        let owns = serde_json::to_string(&self.owned()).map_err(|e| e.to_string())?;
        let forget = self.policy.lease * FORGET_AFTER_LEASES;
        let (now, members, doc, statics): (u64, Vec<String>, String, Vec<String>) = self
            .register
            .key(self.keys.fleet_members())
            .key(self.keys.fleet_assignment())
            .key(self.keys.fleet_static())
            .arg(&self.policy.member_id)
            .arg(&self.worker)
            .arg(millis(self.policy.lease))
            .arg(owns)
            .arg(millis(forget))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        if std::mem::take(&mut self.blip) {
            self.freeze(now, "Redis is reachable again");
        }
        let members = records::<MemberRecord>(&members);
        let stored: Option<FleetAssignment> = serde_json::from_str(&doc).ok();
        let current = self.current(now, stored.as_ref(), &members);
        self.last_generation = current.generation;
        let frozen = now < self.frozen_until_ms;
        let (live, settled) = self.live_and_settled(now, frozen, &members);
        let managed = self.managed(now, &statics);
        self.metrics
            .members
            .set(i64::try_from(live.len()).unwrap_or(i64::MAX));

        let mut decided = current.clone();
        if !frozen {
            let next = assignment::rebalance(
                &current,
                &managed,
                &Members {
                    live: &live,
                    settled: &settled,
                },
                &Rules {
                    max_moves: self.policy.max_moves,
                },
            );
            // A lost document is written again even when nothing moves.
            if next.owners != current.owners || stored.is_none() {
                let next = Assignment {
                    generation: current.generation + 1,
                    owners: next.owners,
                };
                let document = FleetAssignment {
                    assignment: next.clone(),
                    decided_at_ms: now,
                };
                let json = serde_json::to_string(&document).map_err(|e| e.to_string())?;
                let expected = stored.as_ref().map_or(0, |d| d.assignment.generation);
                let written: i64 = self
                    .cas
                    .key(self.keys.fleet_assignment())
                    .arg(expected)
                    .arg(json)
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if written == 1 {
                    tracing::info!(generation = next.generation, "fleet assignment rebalanced");
                    self.last_generation = next.generation;
                    decided = next;
                }
            }
        }
        self.follow(&decided, &live);
        Ok(())
    }

    /// The assignment as stored, or rebuilt from the members' claims when
    /// Redis lost it; a generation that went back, or a lost document,
    /// freezes the fleet for a lease.
    fn current(
        &mut self,
        now: u64,
        stored: Option<&FleetAssignment>,
        members: &[MemberRecord],
    ) -> Assignment {
        match stored {
            Some(doc) => {
                if doc.assignment.generation < self.last_generation {
                    self.freeze(
                        now,
                        "the assignment's generation went back (Redis lost writes)",
                    );
                }
                doc.assignment.clone()
            }
            None => {
                if self.last_generation > 0 {
                    self.freeze(now, "the assignment is gone (Redis lost its data)");
                }
                rebuilt(members)
            }
        }
    }

    /// The live members (all of them while frozen), and those of them that
    /// held their lease for the settle time.
    fn live_and_settled(
        &self,
        now: u64,
        frozen: bool,
        members: &[MemberRecord],
    ) -> (Vec<String>, Vec<String>) {
        let live: Vec<String> = members
            .iter()
            .filter(|m| frozen || m.lease_until_ms > now)
            .map(|m| m.member.clone())
            .collect();
        let settle = millis(self.policy.settle);
        let settled: Vec<String> = members
            .iter()
            .filter(|m| live.contains(&m.member) && now.saturating_sub(m.joined_at_ms) >= settle)
            .map(|m| m.member.clone())
            .collect();
        (live, settled)
    }

    /// The shards the assignment manages: all but those a worker with a
    /// fixed `--assign` holds (its static record).
    fn managed(&self, now: u64, statics: &[String]) -> Vec<u16> {
        let held_static: BTreeSet<u16> = records::<StaticRecord>(statics)
            .into_iter()
            .filter(|r| r.until_ms > now)
            .flat_map(|r| r.shards)
            .collect();
        self.shards
            .iter()
            .map(|s| s.watch.shard.get())
            .filter(|s| !held_static.contains(s))
            .collect()
    }

    /// Nothing moves for one lease from Redis's `now`.
    fn freeze(&mut self, now: u64, why: &str) {
        self.frozen_until_ms = now + millis(self.policy.lease);
        tracing::warn!(why, frozen_for = ?self.policy.lease, "fleet membership: every lease counts as renewed; nothing moves meanwhile");
    }

    /// The shards this member should consume now.
    fn owned(&self) -> Vec<u16> {
        self.shards
            .iter()
            .filter(|s| *s.wanted.borrow())
            .map(|s| s.watch.shard.get())
            .collect()
    }

    /// Points each shard's consumer at the assignment `decided`.
    fn follow(&mut self, decided: &Assignment, live: &[String]) {
        let me = self.policy.member_id.as_str();
        let mut owned = 0_i64;
        for slot in &self.shards {
            let shard = slot.watch.shard.get();
            let owner = decided.owners.get(&shard);
            let mine = owner.is_some_and(|o| o == me);
            owned += i64::from(mine);
            let was = *slot.wanted.borrow();
            if was == mine {
                continue;
            }
            if mine {
                let from = self.seen.get(&shard);
                if from.is_some_and(|f| f != me && !live.contains(f)) {
                    self.metrics.crash.inc();
                }
                tracing::info!(
                    shard,
                    from = from.map_or("nobody", String::as_str),
                    generation = decided.generation,
                    "shard assigned to this member"
                );
            } else {
                self.metrics.graceful.inc();
                tracing::info!(
                    shard,
                    to = owner.map_or("nobody", String::as_str),
                    generation = decided.generation,
                    "shard moves to another member: handing over"
                );
            }
            slot.watch.set_assigned(mine);
            slot.wanted.send_replace(mine);
        }
        self.metrics.owned.set(owned);
        self.seen.clone_from(&decided.owners);
    }
}

/// The assignment rebuilt from what the members say they own (the document
/// was lost): a shard claimed by two goes to the one that sorts first.
fn rebuilt(members: &[MemberRecord]) -> Assignment {
    let mut owners = BTreeMap::new();
    let mut sorted: Vec<&MemberRecord> = members.iter().collect();
    sorted.sort_by(|a, b| a.member.cmp(&b.member));
    for member in sorted {
        for &shard in &member.owns {
            owners.entry(shard).or_insert_with(|| member.member.clone());
        }
    }
    Assignment {
        generation: 0,
        owners,
    }
}

/// The values of a flat `HGETALL` answer that parse as `T`.
fn records<T: serde::de::DeserializeOwned>(flat: &[String]) -> Vec<T> {
    flat.chunks(2)
        .filter_map(|pair| pair.get(1))
        .filter_map(|json| serde_json::from_str(json).ok())
        .collect()
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The shards' slots for [`Membership::new`], and for each shard the
/// receiver its consumer follows.
pub(crate) fn slots(
    watches: impl Iterator<Item = Arc<ShardWatch>>,
) -> (Vec<ShardSlot>, BTreeMap<ShardId, watch::Receiver<bool>>) {
    let mut slots = Vec::new();
    let mut receivers = BTreeMap::new();
    for watch in watches {
        let (wanted, receiver) = watch::channel(true);
        receivers.insert(watch.shard, receiver);
        slots.push(ShardSlot { watch, wanted });
    }
    (slots, receivers)
}
