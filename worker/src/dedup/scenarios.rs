//! One suite, two stores: each scenario is a script of order-state
//! operations written once over [`OrderState`], run against the in-memory
//! fake (`memory`, on tokio's paused clock) and against the Lua scripts on
//! the real Redis (127.0.0.1:6379 or `SHARDLINE_TEST_REDIS`, a key prefix of
//! its own). After every step the reply and the state read back (orders,
//! unsequenced events, quarantines, dead-letter index, fence counter) are
//! recorded; the first step on which the two records differ fails the test.
//!
//! Every order-state script is covered with its fenced branch: admit (order
//! and event), commit, step, group, dead, release, renew; a proptest plays
//! random operation sequences of two consumers on both.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use shardline_contract::letters::IndexEntry;
use shardline_contract::{Keys, OrderKey, ShardCount, ShardId};

use super::memory::{ClaimView, EventView, MemoryOrderState, MemoryStore, OrderView};
use super::tests::{Consumer, Store};
use super::{
    Admission, Claim, DeadLettered, Done, GroupAdmit, GroupReply, OrderState, RedisOrderState,
    Start, Verdict, Written,
};
use crate::config::{Config, OnDeadLetter};

/// The orders every look reads.
const ORDERS: [&str; 2] = ["A", "B"];

/// How both stores' consumers are configured.
#[derive(Debug, Clone, Copy)]
struct Setup {
    quarantine: bool,
    max_deliveries: u32,
    /// The claim lease, when shorter than `Config::lease` allows.
    lease: Option<Duration>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            quarantine: false,
            max_deliveries: 5,
            lease: None,
        }
    }
}

impl Setup {
    fn apply(self, config: &mut Config) {
        if self.quarantine {
            config.on_dead_letter = OnDeadLetter::Quarantine;
        }
        config.max_deliveries = self.max_deliveries;
    }
}

fn shard() -> ShardId {
    shard_n(0)
}

fn shard_n(n: u16) -> ShardId {
    ShardId::new(u32::from(n), ShardCount::default()).unwrap()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap()
}

/// A letter's index entry and its cause group's description, read back.
type Indexed = Option<(IndexEntry, Option<String>)>;

/// One store and a way to read back what its consumers wrote.
trait World {
    type State: OrderState;
    /// A new consumer of shard 0 (its fence token not yet taken).
    fn consumer(&mut self) -> Self::State {
        self.consumer_of(0)
    }
    /// A new consumer of shard `n`: a move of keys is simulated by two
    /// shards' consumers writing one order.
    fn consumer_of(&mut self, n: u16) -> Self::State;
    async fn order(&mut self, order: &str) -> OrderView;
    async fn event(&mut self, dedup_key: &str) -> Option<EventView>;
    /// The letters holding the order, blocker first.
    async fn quarantine(&mut self, order: &str) -> Vec<String>;
    /// The letters indexed under the order, sorted.
    async fn letters_of(&mut self, order: &str) -> Vec<String>;
    /// A letter's index entry and its cause group's description.
    async fn letter(&mut self, id: &str) -> Indexed;
    /// The newest epoch recorded for shard 0.
    async fn fence_counter(&mut self) -> Option<u64>;
    /// The fleet's epoch counter.
    async fn fleet_epochs(&mut self) -> Option<u64>;
    /// Sets shard `n`'s epoch record, as a worker of an earlier release
    /// counting epochs per shard left it.
    async fn set_shard_epoch(&mut self, n: u16, epoch: u64);
    /// Writes a replay record, as the replay tool does.
    async fn record_replay(&mut self, id: &str, record: &str);
    /// A replay record, while unspent.
    async fn replay_record(&mut self, id: &str) -> Option<String>;
}

/// The fake.
struct Fake {
    store: MemoryStore,
    config: Config,
    setup: Setup,
}

impl Fake {
    fn new(setup: Setup) -> Self {
        let mut config = Config::default();
        setup.apply(&mut config);
        Self {
            store: MemoryStore::new(),
            config,
            setup,
        }
    }
}

impl World for Fake {
    type State = MemoryOrderState;

    fn consumer_of(&mut self, n: u16) -> MemoryOrderState {
        let consumer = self.store.consumer(&self.config, shard_n(n));
        match self.setup.lease {
            Some(lease) => consumer.with_lease(lease),
            None => consumer,
        }
    }

    async fn order(&mut self, order: &str) -> OrderView {
        self.store.order(order)
    }

    async fn event(&mut self, dedup_key: &str) -> Option<EventView> {
        self.store.event(dedup_key)
    }

    async fn quarantine(&mut self, order: &str) -> Vec<String> {
        self.store.quarantine(order)
    }

    async fn letters_of(&mut self, order: &str) -> Vec<String> {
        self.store.letters_of(order)
    }

    async fn letter(&mut self, id: &str) -> Indexed {
        let entry = self.store.letter(id)?;
        let group = self.store.group(&entry.group);
        Some((entry, group))
    }

    async fn fence_counter(&mut self) -> Option<u64> {
        let counter = self.config.keys().fence(shard().get());
        self.store.fence_counter(&counter)
    }

    async fn fleet_epochs(&mut self) -> Option<u64> {
        self.store.fence_counter(&self.config.keys().epochs())
    }

    async fn set_shard_epoch(&mut self, n: u16, epoch: u64) {
        self.store.set_fence(&self.config.keys().fence(n), epoch);
    }

    async fn record_replay(&mut self, id: &str, record: &str) {
        self.store.record_replay(id, record);
    }

    async fn replay_record(&mut self, id: &str) -> Option<String> {
        self.store.replay_record(id)
    }
}

/// The scripts on Redis.
struct Lua {
    store: Store,
    setup: Setup,
}

impl Lua {
    async fn new(name: &str, setup: Setup) -> Self {
        let mut store = Store::new(&format!("scenario-{name}")).await;
        setup.apply(&mut store.config);
        Self { store, setup }
    }

    fn keys(&self) -> Keys {
        self.store.config.keys()
    }

    async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.store.plain).await.unwrap()
    }
}

/// A claim as the scripts write it: `seq:deadline:starts:token:fence`.
fn parse_claim(c: &str) -> ClaimView {
    let parts: Vec<&str> = c.split(':').collect();
    assert_eq!(parts.len(), 5, "a claim of five parts: {c}");
    ClaimView {
        seq: parts[0].parse().unwrap(),
        starts: parts[2].parse().unwrap(),
        token: parts[3].parse().unwrap(),
        fence: parts[4].parse().unwrap(),
    }
}

impl World for Lua {
    type State = RedisOrderState;

    fn consumer_of(&mut self, n: u16) -> RedisOrderState {
        let Consumer { mut dedup, slot } = self.store.consumer_of(shard_n(n));
        if let Some(lease) = self.setup.lease {
            dedup.lease_ms = millis(lease);
        }
        RedisOrderState::new(dedup, slot)
    }

    async fn order(&mut self, order: &str) -> OrderView {
        let key = self.keys().order(order);
        let mut fields: HashMap<String, String> = self.query(redis::cmd("HGETALL").arg(key)).await;
        OrderView {
            l: fields.remove("l").map(|l| l.parse().unwrap()),
            u: fields.remove("u"),
            c: fields.remove("c").map(|c| parse_claim(&c)),
            f: fields.remove("f").map(|f| f.parse().unwrap()),
            k: fields.remove("k"),
        }
    }

    async fn event(&mut self, dedup_key: &str) -> Option<EventView> {
        let key = self.keys().dedup(dedup_key);
        let value: Option<String> = self.query(redis::cmd("GET").arg(key)).await;
        value.map(|v| {
            if v == "done" {
                return EventView::Done;
            }
            let parts: Vec<&str> = v.split(':').collect();
            assert_eq!(parts.len(), 4, "an event claim of four parts: {v}");
            EventView::Processing {
                starts: parts[2].parse().unwrap(),
                token: parts[3].parse().unwrap(),
            }
        })
    }

    async fn quarantine(&mut self, order: &str) -> Vec<String> {
        let key = self.keys().quarantine(order);
        self.query(redis::cmd("ZRANGE").arg(key).arg(0).arg(-1))
            .await
    }

    async fn letters_of(&mut self, order: &str) -> Vec<String> {
        let key = self.keys().dlq_order(order);
        let mut ids: Vec<String> = self.query(redis::cmd("SMEMBERS").arg(key)).await;
        ids.sort();
        ids
    }

    async fn letter(&mut self, id: &str) -> Indexed {
        let entry = self.store.indexed(id).await?;
        let groups = self.keys().dlq_groups();
        let group = self
            .query(redis::cmd("HGET").arg(groups).arg(&entry.group))
            .await;
        Some((entry, group))
    }

    async fn fence_counter(&mut self) -> Option<u64> {
        let key = self.keys().fence(shard().get());
        self.query(redis::cmd("GET").arg(key)).await
    }

    async fn fleet_epochs(&mut self) -> Option<u64> {
        let key = self.keys().epochs();
        self.query(redis::cmd("GET").arg(key)).await
    }

    async fn set_shard_epoch(&mut self, n: u16, epoch: u64) {
        let key = self.keys().fence(n);
        self.query::<()>(redis::cmd("SET").arg(key).arg(epoch))
            .await;
    }

    async fn record_replay(&mut self, id: &str, record: &str) {
        let key = self.keys().replay_record(id);
        self.query::<()>(redis::cmd("SET").arg(key).arg(record))
            .await;
    }

    async fn replay_record(&mut self, id: &str) -> Option<String> {
        let key = self.keys().replay_record(id);
        self.query(redis::cmd("GET").arg(key)).await
    }
}

/// What a step left behind, in both stores' shape.
#[derive(Debug, PartialEq)]
struct Look {
    orders: Vec<(OrderView, Vec<String>, Vec<String>)>,
    events: Vec<(String, Option<EventView>)>,
    letters: Vec<(String, Indexed)>,
    records: Vec<(String, Option<String>)>,
    fence: Option<u64>,
}

/// One step of a record: what was asked, what came back, what was left.
#[derive(Debug)]
struct Line {
    step: String,
    reply: String,
    look: Look,
}

/// One delivery of an event.
#[derive(Debug, Clone)]
struct Ev {
    order: OrderKey,
    kind: String,
    code: String,
    seq: Option<u64>,
    key: String,
    token: u64,
    replay_of: Option<String>,
}

impl fmt::Display for Ev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.key, self.token)?;
        match &self.replay_of {
            Some(id) => write!(f, " (replay of {id})"),
            None => Ok(()),
        }
    }
}

impl Ev {
    fn claim(&self) -> Claim<'_> {
        Claim {
            dedup_key: &self.key,
            order_key: &self.order,
            seq: self.seq,
            token: self.token,
        }
    }

    fn admission(&self, redelivered: bool, bypass: bool) -> Admission<'_> {
        Admission {
            claim: self.claim(),
            kind: &self.code,
            redelivered,
            bypass_gate: bypass || self.replay_of.is_some(),
            replay_of: self.replay_of.as_deref(),
        }
    }

    fn done(&self) -> Done<'_> {
        Done {
            claim: self.claim(),
            kind: &self.code,
            replay_of: self.replay_of.as_deref(),
        }
    }

    /// Its dead letter's index entry, as the worker builds it.
    fn entry(&self, id: &str) -> IndexEntry {
        IndexEntry {
            id: id.to_owned(),
            reason: "handler".to_owned(),
            error: "downstream answered 503".to_owned(),
            order_id: Some(self.order.to_string()),
            seq: self.seq,
            kind: Some(self.kind.clone()),
            shard: Some(0),
            first_failed_ms: 1_700_000_000_000 + self.seq.unwrap_or(0),
            attempts: Some(5),
            ..IndexEntry::default()
        }
        .grouped()
    }
}

/// A verdict as both stores can agree on it: how long to wait is on two clocks.
fn verdict_text(verdict: &Verdict) -> String {
    match verdict {
        Verdict::Wait(_) => "Wait".to_owned(),
        other => format!("{other:?}"),
    }
}

fn group_text(reply: &GroupReply) -> String {
    let verdicts: Vec<String> = reply.verdicts.iter().map(verdict_text).collect();
    format!(
        "committed {}, fenced {}, verdicts [{}]",
        reply.committed,
        reply.fenced,
        verdicts.join(", ")
    )
}

/// A scenario's run on one store: its record, and the expectations it missed.
struct Run<W: World> {
    world: W,
    lines: Vec<Line>,
    missed: Vec<String>,
    tokens: u64,
    events: BTreeSet<String>,
    letters: BTreeSet<String>,
    records: BTreeSet<String>,
}

impl<W: World> Run<W> {
    fn new(world: W) -> Self {
        Self {
            world,
            lines: Vec::new(),
            missed: Vec::new(),
            tokens: 0,
            events: BTreeSet::new(),
            letters: BTreeSet::new(),
            records: BTreeSet::new(),
        }
    }

    /// A first delivery of an event (`seq` none: unsequenced).
    fn ev(&mut self, order: &str, kind: &str, seq: Option<u64>) -> Ev {
        self.tokens += 1;
        let key = match seq {
            Some(seq) => format!("{order}:{kind}:{seq}"),
            None => format!("{order}:{kind}:-"),
        };
        if seq.is_none() {
            self.events.insert(key.clone());
        }
        Ev {
            order: shardline_contract::OrderId::new(order)
                .expect("a scenario's order id")
                .key(),
            kind: kind.to_owned(),
            code: Keys::kind_code(kind),
            seq,
            key,
            token: self.tokens,
            replay_of: None,
        }
    }

    /// Event `seq` of order "A", kind "k".
    fn a(&mut self, seq: u64) -> Ev {
        self.ev("A", "k", Some(seq))
    }

    /// Another delivery of the same event.
    fn copy(&mut self, ev: &Ev) -> Ev {
        self.tokens += 1;
        Ev {
            token: self.tokens,
            replay_of: None,
            ..ev.clone()
        }
    }

    /// The replay of dead letter `id` of the event.
    fn replay(&mut self, ev: &Ev, id: &str) -> Ev {
        Ev {
            replay_of: Some(id.to_owned()),
            ..self.copy(ev)
        }
    }

    /// Records a missed expectation (checked once both records agree).
    fn expect<T: PartialEq + fmt::Debug>(&mut self, got: &T, want: &T) {
        if got != want {
            let step = self.lines.last().map_or("", |line| line.step.as_str());
            self.missed.push(format!(
                "step {} `{step}`: got {got:?}, expected {want:?}",
                self.lines.len()
            ));
        }
    }

    fn check(&mut self, holds: bool, what: &str) {
        if !holds {
            let step = self.lines.last().map_or("", |line| line.step.as_str());
            self.missed
                .push(format!("step {} `{step}`: {what}", self.lines.len()));
        }
    }

    async fn look(&mut self) -> Look {
        let mut orders = Vec::new();
        for order in ORDERS {
            orders.push((
                self.world.order(order).await,
                self.world.quarantine(order).await,
                self.world.letters_of(order).await,
            ));
        }
        let mut events = Vec::new();
        for key in &self.events {
            events.push((key.clone(), self.world.event(key).await));
        }
        let mut letters = Vec::new();
        for id in &self.letters {
            letters.push((id.clone(), self.world.letter(id).await));
        }
        let mut records = Vec::new();
        for id in &self.records {
            records.push((id.clone(), self.world.replay_record(id).await));
        }
        Look {
            orders,
            events,
            letters,
            records,
            fence: self.world.fence_counter().await,
        }
    }

    async fn note(&mut self, step: String, reply: String) {
        let look = self.look().await;
        self.lines.push(Line { step, reply, look });
    }

    async fn order(&mut self, order: &str) -> OrderView {
        self.world.order(order).await
    }

    async fn fence(&mut self, c: &mut W::State) -> u64 {
        let token = c.fence().await.0;
        self.note("fence".to_owned(), token.to_string()).await;
        token
    }

    async fn admit(&mut self, c: &mut W::State, ev: &Ev) -> Verdict {
        self.admit_as(c, ev, false, false).await
    }

    async fn admit_as(
        &mut self,
        c: &mut W::State,
        ev: &Ev,
        redelivered: bool,
        bypass: bool,
    ) -> Verdict {
        let verdict = c.admit(&ev.admission(redelivered, bypass)).await;
        let step = format!("admit {ev} redelivered {redelivered} bypass {bypass}");
        self.note(step, verdict_text(&verdict)).await;
        verdict
    }

    async fn commit(&mut self, c: &mut W::State, ev: &Ev) -> Written {
        let written = c.commit(&ev.done()).await;
        self.note(format!("commit {ev}"), format!("{written:?}"))
            .await;
        written
    }

    async fn step(&mut self, c: &mut W::State, done: &Ev, next: &Ev) -> (Written, Verdict) {
        let (written, verdict) = c
            .commit_and_admit(&done.done(), &next.admission(false, false))
            .await;
        let reply = format!("{written:?}, {}", verdict_text(&verdict));
        self.note(format!("step {done} then {next}"), reply).await;
        (written, verdict)
    }

    async fn group(&mut self, c: &mut W::State, done: &[&Ev], next: &[(&Ev, bool)]) -> GroupReply {
        self.group_as(c, done, next, false).await
    }

    /// A group call whose admits are all `redelivered` or all not.
    async fn group_as(
        &mut self,
        c: &mut W::State,
        done: &[&Ev],
        next: &[(&Ev, bool)],
        redelivered: bool,
    ) -> GroupReply {
        let commits: Vec<Done<'_>> = done.iter().map(|ev| ev.done()).collect();
        let admits: Vec<GroupAdmit<'_>> = next
            .iter()
            .map(|(ev, chained)| GroupAdmit {
                admission: ev.admission(redelivered, false),
                seq: ev.seq.unwrap_or_default(),
                chained: *chained,
            })
            .collect();
        let reply = c.group(&commits, &admits).await;
        let names: Vec<String> = done.iter().map(ToString::to_string).collect();
        let admitted: Vec<String> = next
            .iter()
            .map(|(ev, ch)| format!("{ev} chained {ch}"))
            .collect();
        let step = format!(
            "group commits [{}] admits [{}] redelivered {redelivered}",
            names.join(", "),
            admitted.join(", ")
        );
        self.note(step, group_text(&reply)).await;
        reply
    }

    async fn dead(&mut self, c: &mut W::State, ev: &Ev, id: &str) -> Written {
        let entry = ev.entry(id);
        let dead = DeadLettered {
            claim: ev.claim(),
            id,
            replay_of: ev.replay_of.as_deref(),
            entry: &entry,
        };
        let written = c.dead_lettered(&dead).await;
        self.letters.insert(id.to_owned());
        self.note(format!("dead {ev} as {id}"), format!("{written:?}"))
            .await;
        written
    }

    /// The replay tool writes the record of dead letter `id`.
    async fn record_replay(&mut self, id: &str, record: &str) {
        self.world.record_replay(id, record).await;
        self.records.insert(id.to_owned());
        self.note(format!("record {id} = {record}"), String::new())
            .await;
    }

    /// Whether the record `id` backs a marker whose event's record is `record`.
    async fn replay_recorded(&mut self, c: &mut W::State, id: &str, record: &str) -> bool {
        let recorded = c.replay_recorded(id, record).await;
        self.note(
            format!("is {id} recorded as {record}"),
            recorded.to_string(),
        )
        .await;
        recorded
    }

    /// A replay of `id` found its event applied.
    async fn replay_applied(&mut self, c: &mut W::State, ev: &Ev, id: &str) {
        c.replay_applied(&ev.order, id).await;
        self.note(format!("replay {id} of {ev} applied"), String::new())
            .await;
    }

    async fn index(&mut self, c: &mut W::State, entry: &IndexEntry) {
        c.index_letter(entry).await;
        self.letters.insert(entry.id.clone());
        self.note(format!("index {}", entry.id), String::new())
            .await;
    }

    async fn release(&mut self, c: &mut W::State, ev: &Ev) {
        c.release(&ev.claim()).await;
        self.note(format!("release {ev}"), String::new()).await;
    }

    async fn renew(&mut self, c: &mut W::State, ev: &Ev, start: Start) {
        c.renew(&ev.claim(), start).await;
        self.note(format!("renew {ev} {start:?}"), String::new())
            .await;
    }

    async fn new_consumer(&mut self, c: &mut W::State) {
        c.new_consumer();
        self.note("new consumer".to_owned(), String::new()).await;
    }

    /// Lets time pass: the fake's paused clock jumps, Redis's runs.
    async fn pass(&mut self, d: Duration) {
        tokio::time::sleep(d).await;
        self.note(format!("{} ms pass", d.as_millis()), String::new())
            .await;
    }
}

/// A scenario's record on one store.
struct Record {
    lines: Vec<Line>,
    missed: Vec<String>,
}

impl<W: World> Run<W> {
    fn finish(self) -> (W, Record) {
        let record = Record {
            lines: self.lines,
            missed: self.missed,
        };
        (self.world, record)
    }
}

/// Fails on the first step whose reply or state differs, then on the
/// scenario's own expectations (of the scripts).
fn agree(fake: &Record, lua: &Record) {
    for (i, (f, l)) in fake.lines.iter().zip(&lua.lines).enumerate() {
        assert_eq!(f.step, l.step, "step {i}: the scenario ran differently");
        assert!(
            f.reply == l.reply,
            "step {i} `{}`: the fake replied {}, the scripts {}",
            f.step,
            f.reply,
            l.reply
        );
        assert!(
            f.look == l.look,
            "step {i} `{}`: after it the fake holds\n{:#?}\nthe scripts\n{:#?}",
            f.step,
            f.look,
            l.look
        );
    }
    assert_eq!(fake.lines.len(), lua.lines.len(), "the records' lengths");
    assert!(lua.missed.is_empty(), "{}", lua.missed.join("\n"));
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

/// Runs a scenario (a generic async fn taking `&mut Run<W>`) on both
/// stores and compares their records.
macro_rules! on_both {
    ($name:expr, $setup:expr, $scenario:path) => {{
        let setup: Setup = $setup;
        let fake = paused_runtime().block_on(async {
            let mut run = Run::new(Fake::new(setup));
            $scenario(&mut run).await;
            run.finish().1
        });
        let lua = runtime().block_on(async {
            let mut run = Run::new(Lua::new($name, setup).await);
            $scenario(&mut run).await;
            let (world, record) = run.finish();
            world.store.clean().await;
            record
        });
        agree(&fake, &lua);
    }};
}

mod cases;
mod random;
