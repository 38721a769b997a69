//! The world the protocol runs in: a broker as weak as RabbitMQ, Redis with
//! failovers, publishers, workers and the reshard command. Each step either
//! applies or does nothing (an action that makes no sense now is skipped);
//! a step that breaks an invariant returns it as an error.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use shardline_contract::reshard::{
    Bucket, Buckets, Destination, Generation, Lease, Map, MarkerId, MarkerKind, Markers, MoveId,
    Phase, Progress, Reshard, Source, Verdict, View, verdict,
};
use shardline_contract::shard::ShardCount;

mod command;
mod publishers;
mod workers;

/// The orders every publisher publishes events of.
pub(crate) const ORDERS: [&str; 6] = [
    "order-0", "order-1", "order-2", "order-3", "order-4", "order-5",
];
/// Registered publishers (the legacy publisher is one more).
pub(crate) const PUBLISHERS: usize = 2;
/// A lease, in ticks.
const LEASE: u64 = 4;
/// The legacy publisher's id in an event.
const LEGACY: u8 = u8::MAX;
/// Forged marker ids start here; the reshard's ids stay below.
const FORGED: u64 = 1 << 40;

/// A bug the model's driver plants in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bug {
    /// Generation g + 1 (the holding queues' route) is recorded before the
    /// holding queues are declared and bound: the route's new binding comes
    /// after the old one stopped taking the bucket.
    UnbindBeforeBind,
    /// Drain and close markers go out without waiting for the barriers.
    MarkerWithoutBarrier,
    /// A consumer honours a marker whose id the record does not hold.
    ForgedMarkerHonoured,
    /// A publisher whose lease lapsed keeps reading the topology and
    /// publishing by the map it read, without registering again.
    PublishAfterLeaseLapse,
    /// The holding queue is consumed before its move is drained.
    ReleaseBeforeMarker,
    /// A consumer that a move hands keys keeps its old epoch.
    FenceFromOldScope,
}

/// How the driver runs the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cfg {
    /// The planted bug, if any.
    pub(crate) bug: Option<Bug>,
    /// Whether a publisher's lease renewal waits for the replica (`WAIT`).
    pub(crate) lease_waits: bool,
    /// The fix the model found: a publisher that registers again resends
    /// what no acknowledgement covers ([`must_resend`]), not only what is
    /// unconfirmed, and a worker acks a forward only while its lease holds.
    pub(crate) resend_uncovered: bool,
    /// The other fix the model found: a publisher routes by the generation
    /// it acknowledged, not by the newer one it read.
    pub(crate) route_by_acknowledged: bool,
}

/// One thing that can happen. Numbers pick among what exists, modulo its count.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Action {
    /// A registered (`p < PUBLISHERS`) or the legacy publisher publishes an event.
    Publish { p: u8, order: u8, sequenced: bool },
    /// The oldest message of one (channel, queue) lane is enqueued (and confirmed).
    Land(u8),
    /// A consumer starts on a queue that has none.
    Start(u8),
    /// A consumer takes its queue's next message (prefetch 1).
    Deliver(u8),
    /// A consumer settles its delivery: process, forward, honour a marker or wait.
    Settle(u8),
    /// A consumer reads the topology again and renews its forwarder's lease.
    Refresh(u8),
    /// A worker dies; with `zombie`, its in-flight write may still land later.
    CrashWorker(u8, bool),
    /// A dead worker's late write.
    ZombieWrite(u8),
    /// A registered publisher renews its lease (and acknowledges what it may).
    Renew(u8),
    /// A registered publisher registers again after its lease lapsed, and
    /// resends what was not confirmed.
    Reregister(u8),
    /// Time passes (leases lapse).
    Tick,
    /// The reshard command runs its next step.
    Command,
    /// The reshard command dies and loses what it had in memory.
    CommandCrash,
    /// A marker not honoured in time is sent again with a new id.
    Resend(u8),
    /// A marker with an id no record holds is published.
    Forge(u8, bool),
    /// Redis fails over and loses its last write if it did not wait.
    Failover,
    /// The oldest message of one lane is enqueued twice (a binding and its
    /// re-declaration overlapping, or a publish retried after a lost confirm).
    Duplicate(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Q {
    Shard(u16),
    Hold(u16),
}

impl Q {
    fn source(self) -> Source {
        match self {
            Self::Shard(i) => Source::Shard(i),
            Self::Hold(m) => Source::Hold(MoveId(m)),
        }
    }

    fn of(destination: Destination) -> Self {
        match destination {
            Destination::Shard(s) => Self::Shard(s.get()),
            Destination::Hold(m) => Self::Hold(m.0),
        }
    }
}

/// An event: its publisher, order and place in that publisher's events of the order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Ev {
    publisher: u8,
    order: u8,
    nth: u32,
    /// Sequenced events carry a seq the gate could use; the model never reads it.
    sequenced: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Msg {
    Event(Ev),
    Marker(MarkerId, MoveId, MarkerKind),
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    serial: u64,
    ev: Ev,
    routed: Generation,
}

#[derive(Debug, Clone)]
struct Publisher {
    chan: u32,
    deadline: u64,
    read: Generation,
    seen: Generation,
    /// The generation it last acknowledged.
    acknowledged: Generation,
    /// What it published and no acknowledgement covers yet.
    pending: Vec<Pending>,
    next: [u32; ORDERS.len()],
}

#[derive(Debug, Clone)]
struct Consumer {
    q: Q,
    chan: u32,
    epoch: u64,
    rank: u64,
    view: View,
    seen: Generation,
    deadline: u64,
    owned: BTreeSet<u8>,
    delivery: Option<Msg>,
    forwarding: Option<Pending>,
}

#[derive(Debug, Clone, Copy)]
struct Zombie {
    ev: Ev,
    epoch: u64,
    rank: u64,
}

#[derive(Debug, Clone)]
struct Record {
    reshard: Reshard,
    phase: Phase,
    markers: Markers,
    /// Hand-overs released by a marker no record held (only with the bug).
    forced: BTreeSet<(MoveId, MarkerKind)>,
    declared: bool,
    close_sent: bool,
    next_id: u64,
}

impl Record {
    fn honoured(&self, m: MoveId, kind: MarkerKind) -> bool {
        self.markers.is_honoured(m, kind) || self.forced.contains(&(m, kind))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Reg {
    Publisher(usize),
    Forwarder(u64),
}

/// What a run exercised, to see that the model reaches the protocol's corners.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stats {
    pub(crate) reshards: u32,
    pub(crate) moves: u32,
    pub(crate) processed: u32,
    pub(crate) processed_from_hold: u32,
    pub(crate) forwarded: u32,
    pub(crate) waits: u32,
    pub(crate) honoured: u32,
    pub(crate) refused_markers: u32,
    pub(crate) redelivered: u32,
    pub(crate) zombie_refused: u32,
    pub(crate) zombie_accepted: u32,
    pub(crate) resent_after_lapse: u32,
    pub(crate) failover_lost: u32,
}

impl Stats {
    pub(crate) fn add(&mut self, o: &Self) {
        self.reshards += o.reshards;
        self.moves += o.moves;
        self.processed += o.processed;
        self.processed_from_hold += o.processed_from_hold;
        self.forwarded += o.forwarded;
        self.waits += o.waits;
        self.honoured += o.honoured;
        self.refused_markers += o.refused_markers;
        self.redelivered += o.redelivered;
        self.zombie_refused += o.zombie_refused;
        self.zombie_accepted += o.zombie_accepted;
        self.resent_after_lapse += o.resent_after_lapse;
        self.failover_lost += o.failover_lost;
    }
}

/// The world.
pub(crate) struct World {
    pub(crate) stats: Stats,
    pub(crate) trace: bool,
    cfg: Cfg,
    buckets: Buckets,
    first: ShardCount,
    target: u32,
    now: u64,
    // Broker.
    queues: BTreeMap<Q, VecDeque<Msg>>,
    bound: BTreeSet<Q>,
    lanes: BTreeMap<(u32, Q), VecDeque<(u64, Msg)>>,
    confirmed: BTreeSet<u64>,
    serial: u64,
    chans: u32,
    // Redis.
    generation: Generation,
    map: Map,
    record: Option<Record>,
    /// The last reshard's record, which a publisher that read it still routes by.
    last: Option<Reshard>,
    fence: u64,
    order_epoch: [u64; ORDERS.len()],
    leases: BTreeMap<Reg, Lease>,
    unwaited: Option<(Reg, Option<Lease>)>,
    // Actors.
    publishers: Vec<Publisher>,
    legacy: (u32, [u32; ORDERS.len()]),
    consumers: BTreeMap<u64, Consumer>,
    next_consumer: u64,
    zombies: Vec<Zombie>,
    command: Vec<u64>,
    // What the invariants read.
    ranks: u64,
    order_rank: [u64; ORDERS.len()],
    published: BTreeSet<Ev>,
    processed: BTreeSet<(u8, u8, u32)>,
}

type Step = Result<(), String>;

impl World {
    /// A fleet first recorded with `first` shards, resharded at once to
    /// `current` (when it differs), about to be resharded to `target`.
    pub(crate) fn new(cfg: Cfg, first: u32, current: u32, target: u32) -> Self {
        let first = ShardCount::new(first).expect("first shard count");
        let buckets = Buckets::new(first).expect("buckets");
        let mut map = Map::initial(&buckets);
        if current != u32::from(first.get()) {
            map = map.plan(current).expect("setup plan").target;
        }
        let generation = map.generation();
        let mut world = Self {
            stats: Stats::default(),
            trace: false,
            cfg,
            buckets,
            first,
            target,
            now: 0,
            queues: BTreeMap::new(),
            bound: BTreeSet::new(),
            lanes: BTreeMap::new(),
            confirmed: BTreeSet::new(),
            serial: 0,
            chans: 0,
            generation,
            map,
            record: None,
            last: None,
            fence: 0,
            order_epoch: [0; ORDERS.len()],
            leases: BTreeMap::new(),
            unwaited: None,
            publishers: Vec::new(),
            legacy: (0, [0; ORDERS.len()]),
            consumers: BTreeMap::new(),
            next_consumer: 0,
            zombies: Vec::new(),
            command: Vec::new(),
            ranks: 0,
            order_rank: [0; ORDERS.len()],
            published: BTreeSet::new(),
            processed: BTreeSet::new(),
        };
        // Queues of every shard count so far, each bound to its own key (the
        // legacy publisher declares and binds `shard.{0..N₀}` at every start).
        for i in 0..u16::try_from(current.max(u32::from(first.get()))).expect("shards") {
            world.declare(Q::Shard(i));
        }
        world.legacy.0 = world.channel();
        for p in 0..PUBLISHERS {
            let chan = world.channel();
            world.publishers.push(Publisher {
                chan,
                deadline: LEASE,
                read: generation,
                seen: generation,
                acknowledged: generation,
                pending: Vec::new(),
                next: [0; ORDERS.len()],
            });
            world.leases.insert(
                Reg::Publisher(p),
                Lease {
                    deadline_ms: LEASE,
                    acknowledged: generation,
                },
            );
        }
        world
    }

    fn bug(&self, bug: Bug) -> bool {
        self.cfg.bug == Some(bug)
    }

    fn channel(&mut self) -> u32 {
        self.chans += 1;
        self.chans
    }

    fn declare(&mut self, q: Q) {
        self.queues.entry(q).or_default();
        self.bound.insert(q);
    }

    fn bucket(&self, order: u8) -> Bucket {
        self.buckets.bucket_of(ORDERS[usize::from(order)])
    }

    /// A publish: routed by the bindings of this instant, then on its lane
    /// until it lands. `mandatory`: an unroutable message comes back, and a
    /// route that names no bound queue is the protocol's fault.
    fn publish(&mut self, chan: u32, q: Q, msg: Msg) -> Result<u64, String> {
        if !self.bound.contains(&q) {
            return Err(format!(
                "no loss: {msg:?} returned unroutable, {q:?} is not bound"
            ));
        }
        self.serial += 1;
        self.lanes
            .entry((chan, q))
            .or_default()
            .push_back((self.serial, msg));
        Ok(self.serial)
    }

    /// What Redis says now, as a consumer of `q` reads it.
    fn read_view(&self, q: Option<Q>) -> View {
        match &self.record {
            None => View::Settled(self.map.clone()),
            Some(r) if r.phase == Phase::Planned => View::Settled(r.reshard.old().clone()),
            Some(r) => {
                let ids = (0..r.reshard.plan().moves.len()).map(|m| MoveId(m as u16));
                let mut drained: BTreeSet<MoveId> = ids
                    .clone()
                    .filter(|&m| r.honoured(m, MarkerKind::Drain))
                    .collect();
                let closed = ids
                    .clone()
                    .filter(|&m| r.honoured(m, MarkerKind::Close))
                    .collect();
                if let Some(Q::Hold(m)) = q
                    && self.bug(Bug::ReleaseBeforeMarker)
                {
                    drained.insert(MoveId(m));
                }
                View::Resharding(Progress {
                    reshard: r.reshard.clone(),
                    phase: r.phase,
                    drained,
                    closed,
                })
            }
        }
    }

    fn view_generation(view: &View) -> Generation {
        match view {
            View::Settled(map) => map.generation(),
            View::Resharding(p) => p.phase.generation(p.reshard.from()),
        }
    }

    /// The orders `q` processes by `view`.
    fn owned(&self, view: &View, q: Q) -> BTreeSet<u8> {
        (0..ORDERS.len() as u8)
            .filter(|&o| verdict(view, q.source(), self.bucket(o)) == Ok(Verdict::Process))
            .collect()
    }

    // ---- Broker ----

    fn duplicate(&mut self, pick: usize) {
        let busy: Vec<(u32, Q)> = self
            .lanes
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if busy.is_empty() {
            return;
        }
        let key = busy[pick % busy.len()];
        if let Some(&(_, msg)) = self.lanes.get(&key).and_then(VecDeque::front) {
            self.queues.entry(key.1).or_default().push_back(msg);
        }
    }

    fn land(&mut self, pick: usize) {
        let busy: Vec<(u32, Q)> = self
            .lanes
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if busy.is_empty() {
            return;
        }
        let key = busy[pick % busy.len()];
        if let Some((serial, msg)) = self.lanes.get_mut(&key).and_then(VecDeque::pop_front) {
            if self.trace {
                eprintln!("  t{} land #{serial} in {:?}: {msg:?}", self.now, key.1);
            }
            self.queues.entry(key.1).or_default().push_back(msg);
            self.confirmed.insert(serial);
        }
    }

    // ---- Driving ----

    /// One action, then the invariants that hold after every step.
    pub(crate) fn step(&mut self, action: Action) -> Step {
        if self.trace {
            eprintln!(
                "t{} {action:?} (gen {:?}, phase {:?})",
                self.now,
                self.generation,
                self.record.as_ref().map(|r| r.phase)
            );
        }
        match action {
            Action::Publish {
                p,
                order,
                sequenced,
            } => self.publisher_publish(usize::from(p), order % ORDERS.len() as u8, sequenced)?,
            Action::Land(pick) => self.land(usize::from(pick)),
            Action::Duplicate(pick) => self.duplicate(usize::from(pick)),
            Action::Start(pick) => self.start(usize::from(pick)),
            Action::Deliver(pick) => {
                if let Some(id) = self.consumer_id(usize::from(pick)) {
                    self.deliver(id);
                }
            }
            Action::Settle(pick) => {
                if let Some(id) = self.consumer_id(usize::from(pick)) {
                    self.settle(id)?;
                }
            }
            Action::Refresh(pick) => {
                if let Some(id) = self.consumer_id(usize::from(pick)) {
                    self.refresh(id)?;
                }
            }
            Action::CrashWorker(pick, zombie) => {
                if let Some(id) = self.consumer_id(usize::from(pick)) {
                    self.crash(id, zombie);
                }
            }
            Action::ZombieWrite(pick) => self.zombie_write(usize::from(pick))?,
            Action::Renew(p) => self.renew(usize::from(p) % PUBLISHERS)?,
            Action::Reregister(p) => self.reregister(usize::from(p) % PUBLISHERS)?,
            Action::Tick => self.now += 1,
            Action::Command => self.command()?,
            Action::CommandCrash => self.command.clear(),
            Action::Resend(pick) => self.resend(usize::from(pick))?,
            Action::Forge(pick, drain) => self.forge(usize::from(pick), drain)?,
            Action::Failover => self.failover(),
        }
        self.check()
    }

    fn check(&self) -> Step {
        let mut queues = BTreeSet::new();
        for c in self.consumers.values() {
            if !queues.insert(c.q) {
                return Err(format!("one consumer per queue: two on {:?}", c.q));
            }
        }
        Ok(())
    }

    /// Runs everything to its end, fairly, then checks that nothing was lost.
    pub(crate) fn finish(&mut self) -> Step {
        for round in 0..400 {
            if round == 1 {
                // Dead workers' late writes, once the new owners are at work.
                while !self.zombies.is_empty() {
                    self.zombie_write(0)?;
                }
            }
            for p in 0..PUBLISHERS {
                self.renew(p)?;
                self.reregister(p)?;
            }
            while self.lanes.values().any(|l| !l.is_empty()) {
                self.land(0);
            }
            let free: Vec<Q> = self
                .queues
                .keys()
                .copied()
                .filter(|q| !self.consumers.values().any(|c| c.q == *q))
                .collect();
            for q in free {
                self.start_on(q);
            }
            let ids: Vec<u64> = self.consumers.keys().copied().collect();
            for id in ids {
                self.refresh(id)?;
                for _ in 0..4 {
                    self.deliver(id);
                    self.settle(id)?;
                    while self.lanes.values().any(|l| !l.is_empty()) {
                        self.land(0);
                    }
                    self.settle(id)?;
                }
            }
            self.command()?;
            self.now += 1;
            self.check()?;
            let idle = self.record.is_none()
                && self.map.shard_count().get() as u32 == self.target
                && self.queues.values().all(VecDeque::is_empty)
                && self.consumers.values().all(|c| c.delivery.is_none())
                && self.lanes.values().all(VecDeque::is_empty);
            if idle {
                break;
            }
        }
        if self.record.is_some() {
            let phase = self.record.as_ref().map(|r| r.phase);
            return Err(format!("the reshard never finished: stuck at {phase:?}"));
        }
        let lost: Vec<&Ev> = self
            .published
            .iter()
            .filter(|ev| !self.processed.contains(&(ev.publisher, ev.order, ev.nth)))
            .collect();
        if let Some(ev) = lost.first() {
            return Err(format!(
                "no loss: {} events never processed, first {ev:?}",
                lost.len()
            ));
        }
        Ok(())
    }
}
