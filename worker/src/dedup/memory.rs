//! An in-memory order state for unit tests: the Lua scripts' semantics in
//! plain Rust over maps, behind the same [`OrderState`] seam.
//!
//! It keeps what the scripts keep: per order its last passed seq (`l`), its
//! never-processed seqs as ranges (`u`), its one claim (`c`), the fence
//! token of its last writer (`f`) and its kinds (`k`); per unsequenced event
//! its claim or `done`; per order its quarantine (dead-letter ids by seq);
//! the dead-letter index entries; the replay records; and the fence counters. The scenario suite
//! (`scenarios`) holds it to the scripts.
//!
//! Left out, and tested against Redis only: the failover era (field `e`:
//! a gap on state of an earlier era is a start), the upgrade from per-event
//! keys (field `m`, the legacy `gate:` and `done` keys) and key expiry (TTLs;
//! evidence of unsequenced starts). Leases run on one clock, tokio's (paused
//! in tests), where the scripts read the worker's clock (admit of a
//! sequenced event) and Redis's `TIME` (renewals, unsequenced admits).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use shardline_contract::ShardId;
use shardline_contract::envelope::order_key_of;
use shardline_contract::letters::IndexEntry;
use tokio::time::Instant;

use shardline_contract::OrderKey;

use super::{
    Admission, Claim, DeadLettered, Done, FenceScope, FenceToken, GroupAdmit, GroupReply,
    OrderState, Start, Verdict, Written,
};
use crate::config::{Config, OnDeadLetter};
use crate::quarantine;

/// An order's state as both stores show it (the claim's lease deadline left
/// out: it is on two clocks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct OrderView {
    pub(crate) l: Option<u64>,
    /// The never-processed ranges, as the scripts write them: `1-4,7`.
    pub(crate) u: Option<String>,
    pub(crate) c: Option<ClaimView>,
    pub(crate) f: Option<u64>,
    pub(crate) k: Option<String>,
}

/// An order's claim, without its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimView {
    pub(crate) seq: u64,
    pub(crate) starts: u32,
    pub(crate) token: u64,
    pub(crate) fence: u64,
}

/// An unsequenced event's own key: its claim (without its deadline) or `done`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EventView {
    Processing { starts: u32, token: u64 },
    Done,
}

/// Sorted, disjoint, non-adjacent ranges of seqs (the scripts' `u`).
#[derive(Debug, Clone, Default)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    fn contains(&self, seq: u64) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= seq && seq <= hi)
    }

    /// Adds `lo..=hi`, merged with the ranges it overlaps or touches.
    fn mark(&mut self, lo: u64, hi: u64) {
        self.0.push((lo, hi));
        self.0.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for &(lo, hi) in &self.0 {
            match merged.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        self.0 = merged;
    }

    fn unmark(&mut self, seq: u64) {
        let mut out = Vec::with_capacity(self.0.len() + 1);
        for &(lo, hi) in &self.0 {
            if lo <= seq && seq <= hi {
                if lo < seq {
                    out.push((lo, seq - 1));
                }
                if seq < hi {
                    out.push((seq + 1, hi));
                }
            } else {
                out.push((lo, hi));
            }
        }
        self.0 = out;
    }

    fn render(&self) -> Option<String> {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|&(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}-{hi}")
                }
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(","))
    }
}

/// The claim of an order's event in flight (`c`).
#[derive(Debug, Clone)]
struct OrderClaim {
    seq: u64,
    deadline: u64,
    starts: u32,
    token: u64,
    fence: u64,
}

/// One order's hash.
#[derive(Debug, Clone, Default)]
struct Order {
    l: Option<u64>,
    u: Ranges,
    c: Option<OrderClaim>,
    f: Option<u64>,
    /// Kind codes, 8 characters each.
    k: String,
}

impl Order {
    /// A write of a consumer older than the order's last writer.
    fn stale(&self, fence: u64) -> bool {
        self.f.is_some_and(|f| f > fence)
    }

    fn has_kind(&self, code: &str) -> bool {
        self.k.as_bytes().chunks(8).any(|c| c == code.as_bytes())
    }

    /// The gate moved to `seq` (never back); the seqs it skips are marked.
    fn advance(&mut self, seq: u64) {
        match self.l {
            None => {
                if seq > 1 {
                    self.u.mark(1, seq - 1);
                }
                self.l = Some(seq);
            }
            Some(l) if seq <= l => {}
            Some(l) => {
                if seq - 1 > l {
                    self.u.mark(l + 1, seq - 1);
                }
                self.l = Some(seq);
            }
        }
    }

    fn drop_claim_of(&mut self, token: u64) {
        if self.c.as_ref().is_some_and(|c| c.token == token) {
            self.c = None;
        }
    }

    fn view(&self) -> OrderView {
        OrderView {
            l: self.l,
            u: self.u.render(),
            c: self.c.as_ref().map(|c| ClaimView {
                seq: c.seq,
                starts: c.starts,
                token: c.token,
                fence: c.fence,
            }),
            f: self.f,
            k: (!self.k.is_empty()).then(|| self.k.clone()),
        }
    }
}

/// An unsequenced event's own key.
#[derive(Debug, Clone)]
enum Event {
    Processing {
        deadline: u64,
        starts: u32,
        token: u64,
    },
    Done,
}

impl Event {
    fn token(&self) -> Option<u64> {
        match self {
            Self::Processing { token, .. } => Some(*token),
            Self::Done => None,
        }
    }
}

/// Everything the scripts write, in memory.
#[derive(Debug)]
struct Memory {
    clock: Instant,
    orders: HashMap<String, Order>,
    events: HashMap<String, Event>,
    /// Per order: the dead-letter ids holding it, by (score, id) like a sorted set.
    quarantines: HashMap<String, Vec<(f64, String)>>,
    letters: BTreeMap<String, IndexEntry>,
    letters_of_order: HashMap<String, BTreeSet<String>>,
    /// Per cause group: its description, set once.
    groups: HashMap<String, String>,
    fences: HashMap<String, u64>,
    /// Replay records, by dead-letter id.
    records: HashMap<String, String>,
}

/// A test's in-memory order state, shared by the consumers made from it.
#[derive(Debug, Clone)]
pub(crate) struct MemoryStore {
    memory: Arc<Mutex<Memory>>,
}

impl MemoryStore {
    /// An empty store; its clock starts now (tokio's: pause it in tests).
    pub(crate) fn new() -> Self {
        Self {
            memory: Arc::new(Mutex::new(Memory {
                clock: Instant::now(),
                orders: HashMap::new(),
                events: HashMap::new(),
                quarantines: HashMap::new(),
                letters: BTreeMap::new(),
                letters_of_order: HashMap::new(),
                groups: HashMap::new(),
                fences: HashMap::new(),
                records: HashMap::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A consumer of `shard` with `config`'s settings, as `Dedup::new` reads them.
    pub(crate) fn consumer(&self, config: &Config, shard: ShardId) -> MemoryOrderState {
        MemoryOrderState {
            store: self.clone(),
            settings: Settings {
                fence_keys: FenceScope { shard }.keys(&config.keys()),
                lease_ms: u64::try_from(config.lease().as_millis()).unwrap_or(u64::MAX),
                max_starts: config.max_deliveries.max(1),
                quarantine: config.on_dead_letter == OnDeadLetter::Quarantine,
                kinds: config.kinds_ttl().as_secs() > 0,
            },
            fence: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(crate) fn order(&self, order_key: &str) -> OrderView {
        self.lock()
            .orders
            .get(order_key)
            .map(Order::view)
            .unwrap_or_default()
    }

    pub(crate) fn event(&self, dedup_key: &str) -> Option<EventView> {
        self.lock().events.get(dedup_key).map(|event| match event {
            Event::Processing { starts, token, .. } => EventView::Processing {
                starts: *starts,
                token: *token,
            },
            Event::Done => EventView::Done,
        })
    }

    /// The dead-letter ids holding the order, blocker first.
    pub(crate) fn quarantine(&self, order_key: &str) -> Vec<String> {
        self.lock()
            .quarantines
            .get(order_key)
            .map(|set| set.iter().map(|(_, id)| id.clone()).collect())
            .unwrap_or_default()
    }

    pub(crate) fn letter(&self, id: &str) -> Option<IndexEntry> {
        self.lock().letters.get(id).cloned()
    }

    /// The dead-letter ids indexed under an order, sorted.
    pub(crate) fn letters_of(&self, order_key: &str) -> Vec<String> {
        self.lock()
            .letters_of_order
            .get(order_key)
            .map(|ids| ids.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// A cause group's description.
    pub(crate) fn group(&self, group: &str) -> Option<String> {
        self.lock().groups.get(group).cloned()
    }

    /// Writes a replay record, as the replay tool does before it republishes.
    pub(crate) fn record_replay(&self, id: &str, record: &str) {
        self.lock().records.insert(id.to_owned(), record.to_owned());
    }

    /// A replay record, while it is unspent.
    pub(crate) fn replay_record(&self, id: &str) -> Option<String> {
        self.lock().records.get(id).cloned()
    }

    /// The value of a fence key: the fleet's counter, or a shard's newest epoch.
    pub(crate) fn fence_counter(&self, counter: &str) -> Option<u64> {
        self.lock().fences.get(counter).copied()
    }

    /// Sets a fence key, as a worker of an earlier release left it.
    pub(crate) fn set_fence(&self, counter: &str, value: u64) {
        self.lock().fences.insert(counter.to_owned(), value);
    }
}

/// What `Dedup::new` reads from the config, for the fake.
#[derive(Debug, Clone)]
struct Settings {
    /// The fleet's epoch counter and the shard's newest epoch (the names the
    /// Redis keys have).
    fence_keys: [String; 2],
    lease_ms: u64,
    max_starts: u32,
    quarantine: bool,
    kinds: bool,
}

/// One consumer's handle on a [`MemoryStore`].
#[derive(Debug)]
pub(crate) struct MemoryOrderState {
    store: MemoryStore,
    settings: Settings,
    /// The consumer's fence token, shared by its forks (0: not yet taken).
    fence: Arc<AtomicU64>,
}

impl MemoryOrderState {
    /// The same consumer with another claim lease (`Config::lease` has a
    /// floor of 30 s; scenarios of expiry set both stores' shorter).
    pub(crate) fn with_lease(mut self, lease: Duration) -> Self {
        self.settings.lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        self
    }

    fn take_fence(&self) -> u64 {
        let token = self.fence.load(Ordering::Relaxed);
        if token != 0 {
            return token;
        }
        // `take_epoch.lua`: the fleet's counter, raised above the shard's record.
        let mut memory = self.store.lock();
        let [fleet, shard] = &self.settings.fence_keys;
        let recorded = memory.fences.get(shard).copied().unwrap_or(0);
        let counter = memory.fences.entry(fleet.clone()).or_default();
        *counter = (*counter + 1).max(recorded + 1);
        let epoch = *counter;
        memory.fences.insert(shard.clone(), epoch);
        self.fence.store(epoch, Ordering::Relaxed);
        epoch
    }

    /// An admit, then (quarantine mode) the order's quarantine head, as
    /// `Dedup::admit` does.
    fn admit_now(&self, a: &Admission<'_>, fence: u64) -> Verdict {
        let mut memory = self.store.lock();
        let verdict = match a.claim.seq {
            Some(seq) => memory.admit_order(&self.settings, a, seq, fence),
            None => memory.admit_event(&self.settings, a),
        };
        if !self.settings.quarantine || !matches!(verdict, Verdict::Claimed | Verdict::TakenOver) {
            return verdict;
        }
        match memory.blocker(a) {
            Some(blocker) => {
                memory.release(&a.claim);
                Verdict::Quarantined(blocker)
            }
            None => verdict,
        }
    }
}

impl Memory {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// `admit_order.lua`.
    fn admit_order(&mut self, s: &Settings, a: &Admission<'_>, seq: u64, fence: u64) -> Verdict {
        let now = self.now_ms();
        let order = self
            .orders
            .get(a.claim.order_key.as_str())
            .cloned()
            .unwrap_or_default();
        if order.stale(fence) {
            return Verdict::Fenced;
        }
        match order.l {
            Some(l) if seq <= l => {
                let never = order.u.contains(seq) || (s.kinds && !order.has_kind(a.kind));
                if !never {
                    return Verdict::Duplicate;
                }
                if a.replay_of.is_none() {
                    return Verdict::Late;
                }
            }
            _ if a.bypass_gate => {}
            None if seq != 1 => return Verdict::Start,
            Some(l) if seq.saturating_sub(1) > l => return Verdict::Gap,
            _ => {}
        }
        let (mut starts, mut verdict) = (1, Verdict::Claimed);
        if let Some(c) = order.c.as_ref().filter(|c| c.seq == seq) {
            if c.token == a.claim.token {
                return Verdict::Claimed;
            }
            if !a.redelivered && c.deadline > now {
                return Verdict::Wait(Duration::from_millis(c.deadline - now));
            }
            if c.starts >= s.max_starts {
                return Verdict::CrashLoop(c.starts);
            }
            (starts, verdict) = (c.starts + 1, Verdict::TakenOver);
        }
        let order = self
            .orders
            .entry(a.claim.order_key.to_string())
            .or_default();
        order.c = Some(OrderClaim {
            seq,
            deadline: now.saturating_add(s.lease_ms),
            starts,
            token: a.claim.token,
            fence,
        });
        order.f = Some(fence);
        verdict
    }

    /// `admit_event.lua` (no fencing: an unsequenced event's key is its own).
    fn admit_event(&mut self, s: &Settings, a: &Admission<'_>) -> Verdict {
        let now = self.now_ms();
        let (mut starts, mut verdict) = (1, Verdict::Claimed);
        match self.events.get(a.claim.dedup_key) {
            Some(Event::Done) => return Verdict::Duplicate,
            Some(&Event::Processing {
                deadline,
                starts: n,
                token,
            }) => {
                if token == a.claim.token {
                    return Verdict::Claimed;
                }
                if !a.redelivered && deadline > now {
                    return Verdict::Wait(Duration::from_millis(deadline - now));
                }
                if n >= s.max_starts {
                    return Verdict::CrashLoop(n);
                }
                (starts, verdict) = (n + 1, Verdict::TakenOver);
            }
            None => {}
        }
        self.events.insert(
            a.claim.dedup_key.to_owned(),
            Event::Processing {
                deadline: now.saturating_add(s.lease_ms),
                starts,
                token: a.claim.token,
            },
        );
        verdict
    }

    /// `commit.lua`.
    fn commit(&mut self, s: &Settings, done: &Done<'_>, fence: u64) -> Written {
        let claim = &done.claim;
        let order = self.orders.entry(claim.order_key.to_string()).or_default();
        if order.stale(fence) {
            return Written::Fenced;
        }
        match claim.seq {
            None => {
                self.events.insert(claim.dedup_key.to_owned(), Event::Done);
            }
            Some(seq) => {
                match order.l {
                    Some(l) if seq <= l => order.u.unmark(seq),
                    _ => order.advance(seq),
                }
                order.drop_claim_of(claim.token);
            }
        }
        order.f = Some(fence);
        if s.kinds && !done.kind.is_empty() && !order.has_kind(done.kind) {
            order.k.push_str(done.kind);
        }
        if let Some(id) = done.replay_of {
            self.leave(claim.order_key, id);
            self.records.remove(id);
        }
        Written::Done
    }

    /// `dead.lua`: the index entry first, fenced or not.
    fn dead(&mut self, s: &Settings, dead: &DeadLettered<'_>, fence: u64) -> Written {
        self.index(dead.entry);
        let claim = &dead.claim;
        let stale = self
            .orders
            .get(claim.order_key.as_str())
            .is_some_and(|order| order.stale(fence));
        if stale {
            return Written::Fenced;
        }
        match claim.seq {
            None => {
                if self.events.get(claim.dedup_key).and_then(Event::token) == Some(claim.token) {
                    self.events.remove(claim.dedup_key);
                }
            }
            Some(seq) => {
                let order = self.orders.entry(claim.order_key.to_string()).or_default();
                order.drop_claim_of(claim.token);
                order.advance(seq);
                order.u.mark(seq, seq);
                order.f = Some(fence);
            }
        }
        if let Some(replayed) = dead.replay_of {
            self.records.remove(replayed);
        }
        if s.quarantine && !dead.id.is_empty() {
            if let Some(replayed) = dead.replay_of {
                self.leave(claim.order_key, replayed);
            }
            self.enter(claim.order_key, dead.id, quarantine::score(claim.seq));
        }
        Written::Done
    }

    /// `release.lua`: only the delivery's own claim goes.
    fn release(&mut self, claim: &Claim<'_>) {
        match claim.seq {
            None => {
                if self.events.get(claim.dedup_key).and_then(Event::token) == Some(claim.token) {
                    self.events.remove(claim.dedup_key);
                }
            }
            Some(_) => {
                if let Some(order) = self.orders.get_mut(claim.order_key.as_str()) {
                    order.drop_claim_of(claim.token);
                }
            }
        }
    }

    /// `renew.lua`: false when the claim is not the delivery's.
    fn renew(&mut self, s: &Settings, claim: &Claim<'_>, delta: i64, fence: u64) -> bool {
        let deadline = self.now_ms().saturating_add(s.lease_ms);
        let starts = |n: u32| u32::try_from((i64::from(n) + delta).max(0)).unwrap_or(u32::MAX);
        match claim.seq {
            None => {
                let n = match self.events.get(claim.dedup_key) {
                    None => 0,
                    Some(Event::Done) => return false,
                    Some(&Event::Processing { starts, token, .. }) if token == claim.token => {
                        starts
                    }
                    Some(Event::Processing { .. }) => return false,
                };
                self.events.insert(
                    claim.dedup_key.to_owned(),
                    Event::Processing {
                        deadline,
                        starts: starts(n),
                        token: claim.token,
                    },
                );
            }
            Some(seq) => {
                let order = self.orders.entry(claim.order_key.to_string()).or_default();
                if order.stale(fence) {
                    return false;
                }
                let n = match &order.c {
                    None => 0,
                    Some(c) if c.token == claim.token => c.starts,
                    Some(_) => return false,
                };
                order.c = Some(OrderClaim {
                    seq,
                    deadline,
                    starts: starts(n),
                    token: claim.token,
                    fence,
                });
            }
        }
        true
    }

    /// `INDEX_LUA`'s `index_letter`.
    fn index(&mut self, entry: &IndexEntry) {
        self.letters.insert(entry.id.clone(), entry.clone());
        self.groups
            .entry(entry.group.clone())
            .or_insert_with(|| entry.group().description());
        if let Some(order_id) = &entry.order_id {
            self.letters_of_order
                .entry(order_key_of(order_id))
                .or_default()
                .insert(entry.id.clone());
        }
    }

    /// The letter `id` holds its order (`ZADD`).
    fn enter(&mut self, order_key: &str, id: &str, score: f64) {
        let set = self.quarantines.entry(order_key.to_owned()).or_default();
        set.retain(|(_, member)| member != id);
        set.push((score, id.to_owned()));
        set.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    }

    /// The letter `id` no longer holds its order (`ZREM`); an empty set goes.
    fn leave(&mut self, order_key: &str, id: &str) {
        if let Some(set) = self.quarantines.get_mut(order_key) {
            set.retain(|(_, member)| member != id);
            if set.is_empty() {
                self.quarantines.remove(order_key);
            }
        }
    }

    /// The dead letter an admitted event must wait behind (quarantine mode).
    fn blocker(&self, a: &Admission<'_>) -> Option<quarantine::Blocker> {
        let set = self.quarantines.get(a.claim.order_key.as_str())?;
        let head: Vec<(String, f64)> = set
            .first()
            .map(|(s, id)| (id.clone(), *s))
            .into_iter()
            .collect();
        let own = set
            .iter()
            .find(|(_, id)| Some(id.as_str()) == a.replay_of)
            .map(|(s, _)| *s);
        quarantine::blocker((head, own), a.claim.seq, a.replay_of)
    }
}

impl OrderState for MemoryOrderState {
    fn fork(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
            fence: self.fence.clone(),
        }
    }

    fn new_consumer(&self) {
        self.fence.store(0, Ordering::Relaxed);
    }

    #[cfg(test)]
    async fn fence(&mut self) -> FenceToken {
        FenceToken(self.take_fence())
    }

    async fn admit(&mut self, admission: &Admission<'_>) -> Verdict {
        let fence = self.take_fence();
        self.admit_now(admission, fence)
    }

    async fn commit(&mut self, done: &Done<'_>) -> Written {
        let fence = self.take_fence();
        self.store.lock().commit(&self.settings, done, fence)
    }

    async fn commit_and_admit(
        &mut self,
        done: &Done<'_>,
        next: &Admission<'_>,
    ) -> (Written, Verdict) {
        let fence = self.take_fence();
        let written = self.store.lock().commit(&self.settings, done, fence);
        (written, self.admit_now(next, fence))
    }

    async fn group(&mut self, commits: &[Done<'_>], admits: &[GroupAdmit<'_>]) -> GroupReply {
        let fence = self.take_fence();
        let mut memory = self.store.lock();
        for (i, done) in commits.iter().enumerate() {
            if memory.commit(&self.settings, done, fence) == Written::Fenced {
                return GroupReply {
                    committed: i,
                    fenced: true,
                    verdicts: Vec::new(),
                };
            }
        }
        let mut verdicts = Vec::with_capacity(admits.len());
        for admit in admits {
            let verdict = if admit.chained {
                Verdict::Claimed
            } else {
                memory.admit_order(&self.settings, &admit.admission, admit.seq, fence)
            };
            let claimed = verdict == Verdict::Claimed;
            verdicts.push(verdict);
            if !claimed {
                break;
            }
        }
        GroupReply {
            committed: commits.len(),
            fenced: false,
            verdicts,
        }
    }

    async fn renew(&mut self, claim: &Claim<'_>, start: Start) {
        let delta = match start {
            Start::Begins => 1,
            Start::Ended => -1,
            Start::Waits => 0,
        };
        let fence = self.take_fence();
        self.store.lock().renew(&self.settings, claim, delta, fence);
    }

    async fn release(&mut self, claim: &Claim<'_>) {
        self.store.lock().release(claim);
    }

    async fn dead_lettered(&mut self, dead: &DeadLettered<'_>) -> Written {
        let fence = self.take_fence();
        self.store.lock().dead(&self.settings, dead, fence)
    }

    async fn index_letter(&mut self, entry: &IndexEntry) {
        self.store.lock().index(entry);
    }

    async fn replay_recorded(&mut self, id: &str, record: &str) -> bool {
        self.store.lock().records.get(id).map(String::as_str) == Some(record)
    }

    async fn replay_applied(&mut self, order_key: &OrderKey, id: &str) {
        let mut memory = self.store.lock();
        memory.leave(order_key, id);
        memory.records.remove(id);
    }
}
