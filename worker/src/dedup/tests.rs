//! The order state against the real Redis (127.0.0.1:6379, or
//! `SHARDLINE_TEST_REDIS`), each test under a key prefix of its own: the
//! per-event model it replaces, fencing, the upgrade from per-event keys.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proptest::prelude::*;
use shardline_connect::RedisTarget;
use shardline_contract::{OrderKey, ShardCount, ShardId};

use super::*;
use crate::store::{Lanes, RedisHealth};

fn redis_url() -> String {
    std::env::var("SHARDLINE_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A test's Redis: its prefix, a config using it, and a plain connection for
/// looking at (and finally deleting) what the scripts wrote.
pub(super) struct Store {
    pub(super) config: Config,
    pub(super) plain: redis::aio::MultiplexedConnection,
}

impl Store {
    pub(super) async fn new(name: &str) -> Self {
        let config = Config {
            redis: RedisTarget::parse(&redis_url()).unwrap(),
            redis_prefix: format!("test:{name}:{}:", rand::random::<u32>()),
            ..Config::default()
        };
        let plain = config.redis.connect().await.unwrap();
        Self { config, plain }
    }

    /// A consumer of shard 0: its own epoch, its own connection.
    pub(super) fn consumer(&self) -> Consumer {
        self.consumer_of(ShardId::new(0, ShardCount::default()).unwrap())
    }

    /// A consumer of `shard`: its own epoch, its own connection.
    pub(super) fn consumer_of(&self, shard: ShardId) -> Consumer {
        let era = Arc::new(RedisEra::new(self.config.keys().redis_era()));
        let dedup = Dedup::new(&self.config, shard, era.clone());
        let pool = self.config.redis.pool(2).unwrap();
        let health = Arc::new(RedisHealth::new(
            Default::default(),
            Default::default(),
            era.clone(),
        ));
        let slot = RedisSlot::new(&Lanes::new(pool), dedup.scripts(), health);
        Consumer { dedup, slot }
    }

    async fn field(&mut self, order: &str, field: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg(self.config.keys().order(order))
            .arg(field)
            .query_async(&mut self.plain)
            .await
            .unwrap()
    }

    /// The dead-letter index entry of `id`, read back.
    pub(super) async fn indexed(&mut self, id: &str) -> Option<IndexEntry> {
        let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(self.config.keys().dlq_letter(id))
            .query_async(&mut self.plain)
            .await
            .unwrap();
        IndexEntry::from_fields(&fields)
    }

    /// The members of a sorted set or set of the index.
    async fn members(&mut self, key: &str) -> Vec<String> {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut self.plain)
            .await
            .unwrap();
        let cmd = if kind == "set" {
            redis::cmd("SMEMBERS").arg(key).clone()
        } else {
            redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).clone()
        };
        let mut members: Vec<String> = cmd.query_async(&mut self.plain).await.unwrap();
        members.sort();
        members
    }

    pub(super) async fn clean(mut self) {
        let pattern = self.config.keys().everything_pattern();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut self.plain)
            .await
            .unwrap();
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(keys)
                .query_async::<()>(&mut self.plain)
                .await
                .unwrap();
        }
    }
}

/// One delivery of an event of order "A".
struct Ev {
    order: OrderKey,
    kind: String,
    seq: u64,
    key: String,
    code: String,
    token: u64,
    replay_of: Option<String>,
}

impl Ev {
    fn new(kind: &str, seq: u64) -> Self {
        Self {
            order: shardline_contract::OrderId::new("A").unwrap().key(),
            kind: kind.to_owned(),
            seq,
            key: format!("A:{kind}:{seq}"),
            code: Keys::kind_code(kind),
            token: rand::random(),
            replay_of: None,
        }
    }

    fn replay(kind: &str, seq: u64, letter: &str) -> Self {
        Self {
            replay_of: Some(letter.to_owned()),
            ..Self::new(kind, seq)
        }
    }

    /// Its dead letter's index entry, as the worker builds it.
    fn entry(&self, id: &str) -> IndexEntry {
        IndexEntry {
            id: id.to_owned(),
            reason: "handler".to_owned(),
            error: format!("order A seq {}: downstream answered 503", self.seq),
            order_id: Some("A".to_owned()),
            seq: Some(self.seq),
            kind: Some(self.kind.clone()),
            shard: Some(0),
            first_failed_ms: 1_700_000_000_000 + self.seq,
            attempts: Some(5),
            ..IndexEntry::default()
        }
        .grouped()
    }

    fn claim(&self) -> Claim<'_> {
        Claim {
            dedup_key: &self.key,
            order_key: &self.order,
            seq: Some(self.seq),
            token: self.token,
        }
    }
}

/// One consumer of shard 0, driving the scripts as the worker does.
pub(super) struct Consumer {
    pub(super) dedup: Dedup,
    pub(super) slot: RedisSlot,
}

impl Consumer {
    /// A fresh delivery through the gate.
    async fn admit(&mut self, ev: &Ev) -> Verdict {
        self.admit_as(ev, false, false).await
    }

    async fn admit_as(&mut self, ev: &Ev, bypass: bool, redelivered: bool) -> Verdict {
        let admission = Admission {
            claim: ev.claim(),
            kind: &ev.code,
            redelivered,
            bypass_gate: bypass || ev.replay_of.is_some(),
            replay_of: ev.replay_of.as_deref(),
        };
        self.dedup.admit(&mut self.slot, &admission).await
    }

    async fn commit(&mut self, ev: &Ev) -> Written {
        let done = Done {
            claim: ev.claim(),
            kind: &ev.code,
            replay_of: ev.replay_of.as_deref(),
        };
        self.dedup.commit(&mut self.slot, &done).await
    }

    /// `done`'s commit and `next`'s admit in one round trip.
    async fn step(&mut self, done: &Ev, next: &Ev) -> (Written, Verdict) {
        let commit = Done {
            claim: done.claim(),
            kind: &done.code,
            replay_of: done.replay_of.as_deref(),
        };
        let admission = Admission {
            claim: next.claim(),
            kind: &next.code,
            redelivered: false,
            bypass_gate: next.replay_of.is_some(),
            replay_of: next.replay_of.as_deref(),
        };
        self.dedup
            .commit_and_admit(&mut self.slot, &commit, &admission)
            .await
    }

    /// One group call: commits `done`, admits `next` (each with its chained flag).
    async fn group(&mut self, done: &[&Ev], next: &[(&Ev, bool)]) -> GroupReply {
        let commits: Vec<Done<'_>> = done
            .iter()
            .map(|ev| Done {
                claim: ev.claim(),
                kind: &ev.code,
                replay_of: None,
            })
            .collect();
        let admits: Vec<GroupAdmit<'_>> = next
            .iter()
            .map(|(ev, chained)| GroupAdmit {
                admission: Admission {
                    claim: ev.claim(),
                    kind: &ev.code,
                    redelivered: false,
                    bypass_gate: false,
                    replay_of: None,
                },
                seq: ev.seq,
                chained: *chained,
            })
            .collect();
        self.dedup.group(&mut self.slot, &commits, &admits).await
    }

    async fn dead_letter(&mut self, ev: &Ev, id: &str) -> Written {
        let entry = ev.entry(id);
        let dead = DeadLettered {
            claim: ev.claim(),
            id,
            replay_of: ev.replay_of.as_deref(),
            entry: &entry,
        };
        self.dedup.dead_lettered(&mut self.slot, &dead).await
    }

    async fn release(&mut self, ev: &Ev) {
        self.dedup.release(&mut self.slot, &ev.claim()).await;
    }

    async fn renew(&mut self, ev: &Ev, start: Start) {
        self.dedup.renew(&mut self.slot, &ev.claim(), start).await;
    }
}

/// The per-event model (docs/semantics.md §3 before the order state): a `done` mark per
/// (kind, seq) and the order's last passed seq.
#[derive(Debug, Default)]
struct PerEvent {
    done: BTreeSet<(String, u64)>,
    last: Option<u64>,
}

impl PerEvent {
    fn admit(&self, kind: &str, seq: u64, bypass: bool) -> Verdict {
        if self.done.contains(&(kind.to_owned(), seq)) {
            return Verdict::Duplicate;
        }
        if bypass {
            return Verdict::Claimed;
        }
        match self.last {
            None if seq == 1 => Verdict::Claimed,
            None => Verdict::Start,
            Some(l) if seq <= l => Verdict::Late,
            Some(l) if seq == l + 1 => Verdict::Claimed,
            Some(_) => Verdict::Gap,
        }
    }

    fn commit(&mut self, kind: &str, seq: u64) {
        self.done.insert((kind.to_owned(), seq));
        self.pass(seq);
    }

    fn pass(&mut self, seq: u64) {
        self.last = Some(self.last.map_or(seq, |l| l.max(seq)));
    }
}

/// What arrives: a fresh event (its kind is the seq's unless `other_kind`),
/// whether its handler succeeds, and how a held event's wait ends; or a
/// replay of the n-th dead letter made so far.
#[derive(Debug, Clone)]
enum Step {
    Event {
        seq: u64,
        other_kind: bool,
        succeeds: bool,
        apply_gap: bool,
    },
    Replay {
        letter: usize,
        succeeds: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (1u64..12, prop::bool::weighted(0.05), prop::bool::weighted(0.8), any::<bool>())
            .prop_map(|(seq, other_kind, succeeds, apply_gap)| Step::Event { seq, other_kind, succeeds, apply_gap }),
        2 => (0usize..16, prop::bool::weighted(0.8)).prop_map(|(letter, succeeds)| Step::Replay { letter, succeeds }),
    ]
}

fn kind_of(seq: u64, other: bool) -> String {
    if other {
        format!("other.{seq}")
    } else {
        format!("kind.{}", seq % 3)
    }
}

/// Runs `steps` through the order state and the per-event model side by
/// side; returns the first verdict on which they differ, if any, for a seq
/// that was only ever used with one kind (the deliberate differences are
/// for seqs reused across kinds: see ARCHITECTURE.md, "The order state").
async fn differ(steps: Vec<Step>) -> Option<String> {
    let store = Store::new("model").await;
    let mut dedup = store.consumer();
    let mut model = PerEvent::default();
    let mut letters: Vec<(String, u64, String)> = Vec::new();
    let mut kinds_of_seq: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    let mut found = None;
    for (i, step) in steps.into_iter().enumerate() {
        let (ev, succeeds, apply_gap) = match step {
            Step::Event {
                seq,
                other_kind,
                succeeds,
                apply_gap,
            } => (Ev::new(&kind_of(seq, other_kind), seq), succeeds, apply_gap),
            Step::Replay { letter, succeeds } => match letters.get(letter) {
                Some((kind, seq, id)) => (Ev::replay(kind, *seq, id), succeeds, false),
                None => continue,
            },
        };
        kinds_of_seq
            .entry(ev.seq)
            .or_default()
            .insert(ev.kind.clone());
        let bypass = ev.replay_of.is_some();
        let want = model.admit(&ev.kind, ev.seq, bypass);
        let got = dedup.admit(&ev).await;
        if got != want && found.is_none() && kinds_of_seq[&ev.seq].len() == 1 {
            found = Some(format!(
                "step {i}: {} seq {}{}: order state {got:?}, per-event {want:?}",
                ev.kind,
                ev.seq,
                if bypass { " (replay)" } else { "" }
            ));
        }
        // The worker's flow after the verdict, on the order state's verdict
        // (the model follows what the worker did).
        let letter = |letters: &mut Vec<(String, u64, String)>, ev: &Ev| {
            let id = format!("dl-{}", letters.len());
            letters.push((ev.kind.clone(), ev.seq, id.clone()));
            id
        };
        let run = match got {
            Verdict::Claimed | Verdict::TakenOver => true,
            Verdict::Start => {
                // The start grace ended: accepted as the start.
                dedup.admit_as(&ev, true, false).await == Verdict::Claimed
            }
            Verdict::Gap if apply_gap => dedup.admit_as(&ev, true, false).await == Verdict::Claimed,
            Verdict::Gap | Verdict::Late => {
                let id = letter(&mut letters, &ev);
                dedup.dead_letter(&ev, &id).await;
                model.pass(ev.seq);
                false
            }
            _ => false,
        };
        if run {
            if succeeds {
                dedup.commit(&ev).await;
                model.commit(&ev.kind, ev.seq);
            } else {
                let id = letter(&mut letters, &ev);
                dedup.dead_letter(&ev, &id).await;
                model.pass(ev.seq);
            }
        }
    }
    store.clean().await;
    found
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    /// In-order, duplicate, late, gap, dead-letter and replay events in any
    /// interleaving: the order state decides as the per-event marks did.
    #[test]
    fn the_order_state_decides_as_per_event_marks_did(steps in prop::collection::vec(step(), 1..40)) {
        let differs = runtime().block_on(differ(steps));
        prop_assert!(differs.is_none(), "{}", differs.unwrap_or_default());
    }
}

#[tokio::test]
async fn an_accepted_start_gives_up_the_seqs_before_it_and_their_replays_run() {
    let mut store = Store::new("start").await;
    let mut c = store.consumer();
    let start = Ev::new("k", 5000);
    assert_eq!(c.admit(&start).await, Verdict::Start);
    assert_eq!(c.admit_as(&start, true, false).await, Verdict::Claimed);
    assert_eq!(c.commit(&start).await, Written::Done);
    assert_eq!(store.field("A", "u").await.as_deref(), Some("1-4999"));
    // A late one is dead-lettered `late`; its replay runs and clears its mark.
    let late = Ev::new("k", 17);
    assert_eq!(c.admit(&late).await, Verdict::Late);
    c.dead_letter(&late, "dl-1").await;
    let replay = Ev::replay("k", 17, "dl-1");
    assert_eq!(c.admit(&replay).await, Verdict::Claimed);
    c.commit(&replay).await;
    assert_eq!(store.field("A", "u").await.as_deref(), Some("1-16,18-4999"));
    let again = Ev::replay("k", 17, "dl-2");
    assert_eq!(c.admit(&again).await, Verdict::Duplicate);
    assert_eq!(store.field("A", "l").await.as_deref(), Some("5000"));
    store.clean().await;
}

#[tokio::test]
async fn seqs_beyond_a_lua_number_keep_their_precision() {
    let mut store = Store::new("big").await;
    let mut c = store.consumer();
    let big = u64::MAX / 2; // 2^63 - 1
    for seq in [big - 2, big - 1, big] {
        let ev = Ev::new("k", seq);
        c.admit_as(&ev, true, false).await;
        c.commit(&ev).await;
    }
    assert_eq!(store.field("A", "l").await, Some(big.to_string()));
    assert_eq!(store.field("A", "u").await, Some(format!("1-{}", big - 3)));
    assert_eq!(c.admit(&Ev::new("k", big - 1)).await, Verdict::Duplicate);
    store.clean().await;
}

/// A stale owner (the older consumer) replays its writes out of order after
/// the newer one took the order over: nothing changes.
#[tokio::test]
async fn a_stale_owners_commit_release_and_quarantine_write_change_nothing() {
    let mut store = Store::new("fence").await;
    store.config.on_dead_letter = OnDeadLetter::Quarantine;
    let mut stale = store.consumer();
    let mut owner = store.consumer();

    // The stale consumer claims seq 1 (its epoch is taken first: older).
    let one = Ev::new("k", 1);
    assert_eq!(stale.admit(&one).await, Verdict::Claimed);
    // The newer consumer gets the redelivery, takes the claim over, and
    // moves the order to seq 3, with seq 4 in flight.
    let one_again = Ev::new("k", 1);
    assert_eq!(
        owner.admit_as(&one_again, false, true).await,
        Verdict::TakenOver
    );
    owner.commit(&one_again).await;
    for seq in 2..=3 {
        let ev = Ev::new("k", seq);
        assert_eq!(owner.admit(&ev).await, Verdict::Claimed);
        owner.commit(&ev).await;
    }
    let four = Ev::new("k", 4);
    assert_eq!(owner.admit(&four).await, Verdict::Claimed);
    let claim = store.field("A", "c").await;

    // The stale owner's commit of seq 1 (and of a later seq it also held),
    // its release and renewal, its dead letter with quarantine, its admit.
    assert_eq!(stale.commit(&one).await, Written::Fenced);
    assert_eq!(stale.commit(&Ev::new("k", 5)).await, Written::Fenced);
    stale.release(&one).await;
    stale.renew(&one, Start::Begins).await;
    assert_eq!(stale.dead_letter(&one, "dl-stale").await, Written::Fenced);
    assert_eq!(
        store.indexed("dl-stale").await,
        Some(one.entry("dl-stale")),
        "a fenced dead letter is in the DLQ all the same: its index entry is written"
    );
    let four_again = Ev::new("k", 4);
    assert_eq!(
        stale.admit_as(&four_again, false, true).await,
        Verdict::Fenced
    );

    assert_eq!(
        store.field("A", "l").await.as_deref(),
        Some("3"),
        "the gate moved back"
    );
    assert_eq!(
        store.field("A", "c").await,
        claim,
        "the newer claim was touched"
    );
    assert_eq!(
        store.field("A", "u").await,
        None,
        "a processed seq was marked"
    );
    let quarantined: i64 = redis::cmd("EXISTS")
        .arg(store.config.keys().quarantine("A"))
        .query_async(&mut store.plain)
        .await
        .unwrap();
    assert_eq!(quarantined, 0, "the stale owner quarantined the order");
    // The owner's own writes go on.
    assert_eq!(owner.commit(&four).await, Written::Done);
    assert_eq!(store.field("A", "l").await.as_deref(), Some("4"));
    store.clean().await;
}

/// The serial loop's step: a commit and the next admit in one script call,
/// the admit seeing the commit.
#[tokio::test]
async fn a_step_commits_then_admits() {
    let mut store = Store::new("step").await;
    let mut c = store.consumer();
    let one = Ev::new("k", 1);
    assert_eq!(c.admit(&one).await, Verdict::Claimed);
    let two = Ev::new("k", 2);
    assert_eq!(c.step(&one, &two).await, (Written::Done, Verdict::Claimed));
    let copy = Ev::new("k", 2);
    assert_eq!(
        c.step(&two, &copy).await,
        (Written::Done, Verdict::Duplicate)
    );
    assert_eq!(store.field("A", "l").await.as_deref(), Some("2"));
    assert_eq!(store.field("A", "c").await, None);
    store.clean().await;
}

/// Group commit: chained events run under their predecessor's claim; a
/// group's commits land in order before the next group's admits, which stop
/// at the first that is not a claim.
#[tokio::test]
async fn a_group_commits_in_order_then_admits_the_next_group() {
    let mut store = Store::new("group").await;
    let mut c = store.consumer();
    let evs: Vec<Ev> = (1..=4).map(|seq| Ev::new("k", seq)).collect();
    let six = Ev::new("k", 6);
    let first = c
        .group(&[], &[(&evs[0], false), (&evs[1], true), (&evs[2], true)])
        .await;
    assert_eq!(first.verdicts, vec![Verdict::Claimed; 3]);
    assert_eq!(store.field("A", "l").await, None, "admits commit nothing");
    let claim = store.field("A", "c").await.unwrap_or_default();
    assert!(
        claim.starts_with("1:"),
        "the order's one claim is its first event's: {claim}"
    );

    let done: Vec<&Ev> = evs[..3].iter().collect();
    let second = c
        .group(&done, &[(&evs[3], false), (&six, false), (&evs[0], false)])
        .await;
    assert_eq!((second.committed, second.fenced), (3, false));
    assert_eq!(
        second.verdicts,
        vec![Verdict::Claimed, Verdict::Gap],
        "admits stop at the first that is not a claim"
    );
    assert_eq!(store.field("A", "l").await.as_deref(), Some("3"));
    assert_eq!(store.field("A", "u").await, None, "no seq was skipped");

    let copy = Ev::new("k", 2);
    let third = c.group(&[&evs[3]], &[(&copy, false)]).await;
    assert_eq!(third.verdicts, vec![Verdict::Duplicate]);
    assert_eq!(store.field("A", "l").await.as_deref(), Some("4"));
    assert_eq!(store.field("A", "c").await, None);
    store.clean().await;
}

/// A stale owner's group commit writes nothing and admits nothing.
#[tokio::test]
async fn a_stale_owners_group_commit_changes_nothing() {
    let mut store = Store::new("group-fence").await;
    let mut stale = store.consumer();
    let mut owner = store.consumer();
    let (one, two) = (Ev::new("k", 1), Ev::new("k", 2));
    let admitted = stale.group(&[], &[(&one, false), (&two, true)]).await;
    assert_eq!(admitted.verdicts, vec![Verdict::Claimed; 2]);
    // The newer owner gets both again and processes seq 1 only.
    let one_again = Ev::new("k", 1);
    assert_eq!(
        owner.admit_as(&one_again, false, true).await,
        Verdict::TakenOver
    );
    owner.commit(&one_again).await;
    let claim = store.field("A", "c").await;

    let three = Ev::new("k", 3);
    let reply = stale.group(&[&one, &two], &[(&three, false)]).await;
    assert_eq!(
        (reply.committed, reply.fenced, reply.verdicts.len()),
        (0, true, 0)
    );
    assert_eq!(store.field("A", "l").await.as_deref(), Some("1"));
    assert_eq!(store.field("A", "c").await, claim);
    store.clean().await;
}

/// Claims are renewed and released by their own delivery only.
#[tokio::test]
async fn a_second_copy_never_releases_or_renews_the_first_copys_claim() {
    let mut store = Store::new("copies").await;
    let mut c = store.consumer();
    assert_eq!(c.admit(&Ev::new("k", 1)).await, Verdict::Claimed);
    let claim = store.field("A", "c").await;
    let copy = Ev::new("k", 1);
    assert!(matches!(c.admit(&copy).await, Verdict::Wait(_)));
    c.release(&copy).await;
    c.renew(&copy, Start::Ended).await;
    assert_eq!(store.field("A", "c").await, claim);
    store.clean().await;
}

/// State written by workers before the order state: a `gate:` key and
/// per-event `done` keys, honoured during the dedup TTL.
#[tokio::test]
async fn state_of_the_per_event_layout_is_honoured() {
    let mut store = Store::new("upgrade").await;
    let keys = store.config.keys();
    // Before the upgrade: seqs 1, 2 and 4 processed, 3 given up, gate at 4.
    let mut pipe = redis::pipe();
    pipe.cmd("SET").arg(keys.gate("A")).arg(4).ignore();
    for seq in [1, 2, 4] {
        pipe.cmd("SET")
            .arg(keys.dedup(&format!("A:k:{seq}")))
            .arg("done")
            .ignore();
    }
    pipe.query_async::<()>(&mut store.plain).await.unwrap();

    let mut c = store.consumer();
    // A duplicate of a processed event is suppressed; seq 3 was never
    // processed: late, and its replay runs (once).
    assert_eq!(c.admit(&Ev::new("k", 2)).await, Verdict::Duplicate);
    assert_eq!(c.admit(&Ev::new("k", 3)).await, Verdict::Late);
    let replay = Ev::replay("k", 3, "dl-old");
    assert_eq!(c.admit(&replay).await, Verdict::Claimed);
    c.commit(&replay).await;
    assert_eq!(
        c.admit(&Ev::replay("k", 3, "dl-again")).await,
        Verdict::Duplicate
    );
    // The order goes on from the old gate.
    let five = Ev::new("k", 5);
    assert_eq!(c.admit(&five).await, Verdict::Claimed);
    c.commit(&five).await;
    assert_eq!(store.field("A", "l").await.as_deref(), Some("5"));
    assert_eq!(store.field("A", "m").await.as_deref(), Some("4"));
    store.clean().await;
}

/// After a failover the order's state may lack its last seqs: a gap on state
/// of an earlier era waits the start grace, not the gap grace.
#[tokio::test]
async fn a_gap_on_state_from_before_a_failover_gets_the_start_grace() {
    let store = Store::new("era").await;
    let mut c = store.consumer();
    let one = Ev::new("k", 1);
    c.admit(&one).await;
    c.commit(&one).await;
    assert_eq!(c.admit(&Ev::new("k", 4)).await, Verdict::Gap);
    c.dedup.era.bump();
    assert_eq!(c.admit(&Ev::new("k", 4)).await, Verdict::Start);
    store.clean().await;
}

#[tokio::test]
async fn a_dead_letter_is_indexed_in_its_script() {
    let mut store = Store::new("index").await;
    let mut c = store.consumer();
    let keys = store.config.keys();
    let (two, three) = (Ev::new("k", 2), Ev::new("k", 3));
    for (ev, id) in [(&two, "dl-2"), (&three, "dl-3")] {
        assert_eq!(c.admit_as(ev, true, false).await, Verdict::Claimed);
        assert_eq!(c.dead_letter(ev, id).await, Written::Done);
    }
    let entry = store.indexed("dl-2").await.unwrap();
    assert_eq!(entry, two.entry("dl-2"));
    // One cause, one group: the two letters differ only in their seq.
    assert_eq!(entry.group, three.entry("dl-3").group);
    let both = vec!["dl-2".to_owned(), "dl-3".to_owned()];
    assert_eq!(store.members(&keys.dlq_letters()).await, both);
    assert_eq!(store.members(&keys.dlq_group(&entry.group)).await, both);
    assert_eq!(store.members(&keys.dlq_order("A")).await, both);
    let description: Option<String> = redis::cmd("HGET")
        .arg(keys.dlq_groups())
        .arg(&entry.group)
        .query_async(&mut store.plain)
        .await
        .unwrap();
    assert_eq!(
        description.as_deref(),
        Some("handler\norder A seq <n>: downstream answered 503")
    );

    // A letter without an envelope has no claim and no order: its own script.
    let bare = IndexEntry {
        id: "dl-bare".to_owned(),
        reason: "decode".to_owned(),
        error: "not UTF-8 JSON: invalid utf-8 sequence of 1 bytes from index 0".to_owned(),
        ..IndexEntry::default()
    }
    .grouped();
    c.dedup.index_letter(&mut c.slot, &bare).await;
    assert_eq!(store.indexed("dl-bare").await, Some(bare.clone()));
    assert_eq!(store.members(&keys.dlq_letters()).await.len(), 3);
    assert_eq!(
        store.members(&keys.dlq_order("")).await,
        Vec::<String>::new()
    );
    store.clean().await;
}
