//! The Redis state of events and orders (docs/semantics.md §3, §9), one Lua script per
//! step (the scripts are the `.lua` files next to this one, each prefixed
//! with `common.lua`).
//!
//! A sequenced event has no key of its own: its order's state, one hash
//! (`Keys::order`), stands in for per-event marks. Fields:
//!
//! | field | holds |
//! |---|---|
//! | `l` | the last passed seq: every seq at or below it was processed, unless marked in `u` |
//! | `u` | seqs at or below `l` never processed (dead-lettered, quarantined, given up), as ranges: their replays run |
//! | `c` | the claim of the order's event in flight: `seq:lease deadline ms:unfinished starts:token:fence` |
//! | `f` | the fence token of the newest consumer that wrote the order (fencing) |
//! | `e` | the Redis failover era of the last write |
//! | `m` | after an upgrade: seqs at or below it are judged by the old per-event keys |
//! | `k` | the kinds processed, 8 hex digits of md5 each (`Keys::kind_code`; reconcile) |
//!
//! An unsequenced event keeps its own key (`Keys::dedup`): its claim
//! `processing:{deadline}:{starts}:{token}` or `done`; its kind goes to its
//! order's hash.
//!
//! **Fencing.** Every consumer of a shard takes the next epoch of the fleet
//! (`FenceScope`, `take_epoch.lua`) with its first delivery (only the active
//! consumer gets deliveries) and writes with it; the
//! scripts compare tokens only: a write older than the order's `f` changes
//! nothing and tells the worker it lost the shard. Claims are given up and
//! renewed only by their own token. So a stale owner never moves a gate back,
//! never deletes or overwrites a newer claim, never re-opens a lifted
//! quarantine (`dlq release` raises the order's `f` to the epoch of its
//! shard's newest consumer).
//!
//! Round trips per event: one — the commit and the next event's admit travel
//! together when the next delivery is already here. With `--group-commit`,
//! one per group: the commits of a group's events and the admits of the
//! next group's (`group.lua`).
//!
//! **The seam.** The stages reach this state through [`OrderState`]
//! (`state.rs`; [`RedisOrderState`] runs the scripts). Unit tests use the
//! in-memory fake (`memory.rs`), held to the scripts by one scenario suite
//! run against both (`scenarios.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::{Cmd, Pipeline, Script};
use shardline_contract::letters::{INDEX_LUA, IndexEntry};
use shardline_contract::{Keys, OrderKey, ShardId};

use crate::config::{Config, OnDeadLetter};
use crate::era::RedisEra;
use crate::quarantine::{self, Blocker};
use crate::store::RedisSlot;

const COMMON: &str = include_str!("common.lua");
const ADMIT_ORDER: &str = include_str!("admit_order.lua");
const ADMIT_EVENT: &str = include_str!("admit_event.lua");
const COMMIT: &str = include_str!("commit.lua");
const RENEW: &str = include_str!("renew.lua");
const RELEASE: &str = include_str!("release.lua");
const DEAD: &str = include_str!("dead.lua");
const TAKE_EPOCH: &str = include_str!("take_epoch.lua");
const STEP: &str = include_str!("step.lua");
const GROUP: &str = include_str!("group.lua");

/// How long the evidence of an unfinished handler start of an unsequenced
/// event is kept, whatever the lease: a process that crash-loops slowly is
/// still caught. (A sequenced event's claim lives in its order's state.)
const EVIDENCE: Duration = Duration::from_secs(24 * 3600);

/// What a lease renewal says about the claim's handler start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// A handler call begins now.
    Begins,
    /// The call returned (it failed; the event waits for another attempt).
    Ended,
    /// Nothing runs; the claim is kept alive while the event waits.
    Waits,
}

/// What `admit` decided.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// The event is ours to run (`starts` = this start included).
    Claimed,
    /// Taken over from a consumer that died mid-handler.
    TakenOver,
    /// Processed before: ack and do nothing.
    Duplicate,
    /// Its seq is at or below the order's last, yet it never ran: its gap was
    /// given up. Dead-letter `late`.
    Late,
    /// A seq gap before it: hold it until the gap fills or the grace ends.
    Gap,
    /// No state for its order and seq > 1 (or state from before a Redis
    /// failover with a gap): hold it for the start grace.
    Start,
    /// A live lease on a first delivery (two copies in flight at once): wait.
    Wait(Duration),
    /// Its handler was started this many times and never finished.
    CrashLoop(u32),
    /// Its order is quarantined behind this dead letter (quarantine mode);
    /// the claim was given back.
    Quarantined(Blocker),
    /// A newer consumer of the shard wrote the order: this one lost the shard.
    Fenced,
}

/// Whether a write went through or a newer consumer had written the order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    Done,
    Fenced,
}

impl Written {
    fn of(reply: i64) -> Self {
        if reply == 0 { Self::Fenced } else { Self::Done }
    }
}

/// The claim a delivery may hold: what renewing and releasing it need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim<'a> {
    pub(crate) dedup_key: &'a str,
    pub(crate) order_key: &'a OrderKey,
    pub(crate) seq: Option<u64>,
    /// Unique per delivery.
    pub(crate) token: u64,
}

/// [`Claim`], owned: kept while a call may be abandoned.
#[derive(Debug, Clone)]
pub(crate) struct HeldClaim {
    dedup_key: String,
    order_key: OrderKey,
    seq: Option<u64>,
    token: u64,
}

impl HeldClaim {
    pub(crate) fn of(claim: Claim<'_>) -> Self {
        Self {
            dedup_key: claim.dedup_key.to_owned(),
            order_key: claim.order_key.clone(),
            seq: claim.seq,
            token: claim.token,
        }
    }

    pub(crate) fn claim(&self) -> Claim<'_> {
        Claim {
            dedup_key: &self.dedup_key,
            order_key: &self.order_key,
            seq: self.seq,
            token: self.token,
        }
    }
}

/// An `admit` request: the event and how to treat it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admission<'a> {
    pub(crate) claim: Claim<'a>,
    /// Its kind's code, `Keys::kind_code` (an earlier seq of an order that
    /// never processed this kind cannot be a duplicate of it).
    pub(crate) kind: &'a str,
    pub(crate) redelivered: bool,
    /// Skip the sequence gate (a replay, an applied gap, an accepted start).
    pub(crate) bypass_gate: bool,
    /// A replay's dead-letter id (what the quarantine check needs).
    pub(crate) replay_of: Option<&'a str>,
}

/// An event whose handler succeeded, to commit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Done<'a> {
    pub(crate) claim: Claim<'a>,
    /// Its kind's code, recorded per order for `shardline reconcile`.
    pub(crate) kind: &'a str,
    /// A replay's dead-letter id: applied, it no longer holds its order in
    /// quarantine.
    pub(crate) replay_of: Option<&'a str>,
}

/// A confirmed dead letter, to record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadLettered<'a> {
    /// The delivery's claim, given up if it holds it (its token is its own).
    pub(crate) claim: Claim<'a>,
    /// Its dead-letter id.
    pub(crate) id: &'a str,
    /// A replay's earlier dead-letter id.
    pub(crate) replay_of: Option<&'a str>,
    /// Its dead-letter index entry, written in the same script.
    pub(crate) entry: &'a IndexEntry,
}

/// A sequenced event of a group to admit (`--group-commit`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupAdmit<'a> {
    pub(crate) admission: Admission<'a>,
    pub(crate) seq: u64,
    /// The next seq of an order whose earlier event is admitted in the same
    /// group: it runs under that one's claim.
    pub(crate) chained: bool,
}

/// What one group call wrote and decided.
#[derive(Debug, Default)]
pub(crate) struct GroupReply {
    /// The commits written, from the first.
    pub(crate) committed: usize,
    /// The next commit was fenced: a newer consumer wrote its order.
    pub(crate) fenced: bool,
    /// From the first admit: claims, then at most one other verdict.
    pub(crate) verdicts: Vec<Verdict>,
}

/// An ordered fence token. The order-state scripts compare tokens only (a
/// write whose token is below the order's stored `f` changes nothing); what
/// a token is counted in is its [`FenceScope`]'s business, not theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FenceToken(u64);

impl std::fmt::Display for FenceToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where fence tokens come from: the fleet's one epoch counter
/// (`Keys::epochs`), so that an epoch taken on any shard is above every epoch
/// taken before it on any shard, and a consumer taking over moved keys
/// outranks each of their earlier writers; the shard's own record
/// (`Keys::fence`) keeps its newest consumer's epoch (`take_epoch.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FenceScope {
    shard: ShardId,
}

impl FenceScope {
    /// The fleet's counter and the shard's record, the keys of `take_epoch.lua`.
    fn keys(self, keys: &Keys) -> [String; 2] {
        [keys.epochs(), keys.fence(self.shard.get())]
    }
}

/// The consumer's fence token, taken from Redis with its first write (0: not
/// yet taken).
#[derive(Debug)]
struct Fence {
    scope: FenceScope,
    token: AtomicU64,
    taking: tokio::sync::Mutex<()>,
}

/// The order state's Lua scripts. They are the same for every shard, so they
/// are made once per process: each holds its source, some 50 KB together,
/// which a copy per shard made a 1,024-shard worker 100 MB larger.
#[derive(Debug)]
pub(crate) struct Scripts {
    admit_order: Script,
    admit_event: Script,
    commit: Script,
    renew: Script,
    release: Script,
    dead: Script,
    index: Script,
    step: Script,
    group: Script,
    take_epoch: Script,
    /// All of them, for loading after a Redis restart.
    all: Arc<[Script]>,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(Scripts::new);

impl Scripts {
    fn new() -> Self {
        let script = |body: &str| Script::new(&format!("{COMMON}\n{body}"));
        // The two scripts that are functions, run alone or as one step.
        let entry = |body: &str, name: &str| script(&format!("{body}\nreturn {name}(KEYS, ARGV)"));
        let admit_order = entry(ADMIT_ORDER, "admit_order");
        let admit_event = script(ADMIT_EVENT);
        let commit = entry(COMMIT, "commit");
        let renew = script(RENEW);
        let release = script(RELEASE);
        let dead = script(&format!("{INDEX_LUA}\n{DEAD}"));
        let index = Script::new(&format!("{INDEX_LUA}\nindex_letter(KEYS, ARGV)\nreturn 1"));
        let step = script(&format!("{COMMIT}\n{ADMIT_ORDER}\n{STEP}"));
        let group = script(&format!("{COMMIT}\n{ADMIT_ORDER}\n{GROUP}"));
        let take_epoch = Script::new(TAKE_EPOCH);
        let all = Arc::from([
            admit_order.clone(),
            admit_event.clone(),
            commit.clone(),
            renew.clone(),
            release.clone(),
            dead.clone(),
            index.clone(),
            step.clone(),
            group.clone(),
            take_epoch.clone(),
        ]);
        Self {
            admit_order,
            admit_event,
            commit,
            renew,
            release,
            dead,
            index,
            step,
            group,
            take_epoch,
            all,
        }
    }
}

/// Key layout, timings and scripts of the Redis state of one shard.
#[derive(Debug, Clone)]
pub(crate) struct Dedup {
    keys: Keys,
    shard: ShardId,
    lease_ms: u64,
    ttl_secs: u64,
    /// Of the order state: the longer of the dedup and kinds TTLs.
    order_ttl_secs: u64,
    kinds: bool,
    max_starts: u32,
    /// Quarantine mode: admit also checks the order's quarantine.
    quarantine: bool,
    fence: Arc<Fence>,
    era: Arc<RedisEra>,
}

/// The worker's clock, for claim leases (a claim's deadline is compared with
/// the clock of whichever worker reads it next: leases are tens of seconds).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn flag(b: bool) -> &'static str {
    if b { "1" } else { "0" }
}

fn seq_arg(seq: Option<u64>) -> String {
    seq.map(|s| s.to_string()).unwrap_or_default()
}

impl Dedup {
    pub(crate) fn new(config: &Config, shard: ShardId, era: Arc<RedisEra>) -> Self {
        let ttl_secs = config.dedup_ttl.as_secs().max(1);
        let kinds_ttl = config.kinds_ttl().as_secs();
        Self {
            keys: config.keys(),
            shard,
            lease_ms: u64::try_from(config.lease().as_millis()).unwrap_or(u64::MAX),
            ttl_secs,
            order_ttl_secs: ttl_secs.max(kinds_ttl),
            kinds: kinds_ttl > 0,
            max_starts: config.max_deliveries.max(1),
            quarantine: config.on_dead_letter == OnDeadLetter::Quarantine,
            fence: Arc::new(Fence {
                scope: FenceScope { shard },
                token: AtomicU64::new(0),
                taking: tokio::sync::Mutex::new(()),
            }),
            era,
        }
    }

    /// Every script's source, for loading after a Redis restart.
    pub(crate) fn scripts(&self) -> Arc<[Script]> {
        SCRIPTS.all.clone()
    }

    /// A new consumer of the shard, or its consumer taking over moved keys:
    /// it takes a new epoch with its next write.
    pub(crate) fn new_consumer(&self) {
        self.fence.token.store(0, Ordering::Relaxed);
    }

    /// The same layout for a second consumer of the shard's keys (a move's
    /// holding queue, read by the shard's owner beside the shard): a fence
    /// token of its own, taken with its first write.
    pub(crate) fn with_own_fence(&self) -> Self {
        Self {
            fence: Arc::new(Fence {
                scope: self.fence.scope,
                token: AtomicU64::new(0),
                taking: tokio::sync::Mutex::new(()),
            }),
            ..self.clone()
        }
    }

    /// The consumer's fence token, taken (`take_epoch.lua`) on first use.
    async fn fence_token(&self, redis: &mut RedisSlot) -> FenceToken {
        let token = self.fence.token.load(Ordering::Relaxed);
        if token != 0 {
            return FenceToken(token);
        }
        let _taking = self.fence.taking.lock().await;
        let token = self.fence.token.load(Ordering::Relaxed);
        if token != 0 {
            return FenceToken(token);
        }
        let take = Self::evalsha(&SCRIPTS.take_epoch, &self.fence.scope.keys(&self.keys), &[]);
        let token: u64 = redis.query(&take).await;
        self.fence.token.store(token, Ordering::Relaxed);
        tracing::debug!(shard = %self.shard, fence = token, "consumer fence token taken");
        FenceToken(token)
    }

    fn evalsha(script: &Script, keys: &[String], args: &[String]) -> Cmd {
        let bytes = keys.iter().chain(args).map(String::len).sum::<usize>() + 64;
        let mut cmd = Cmd::with_capacity(3 + keys.len() + args.len(), bytes);
        cmd.arg("EVALSHA")
            .arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        cmd
    }

    /// The keys every order-state script takes: the order's state, the
    /// event's own key, the order's quarantine.
    fn claim_keys(&self, claim: &Claim<'_>) -> [String; 3] {
        [
            self.keys.order(claim.order_key),
            self.keys.dedup(claim.dedup_key),
            self.keys.quarantine(claim.order_key),
        ]
    }

    /// `admit_order.lua`'s keys and arguments, for a sequenced event.
    fn admit_order_parts(
        &self,
        a: &Admission<'_>,
        seq: u64,
        fence: FenceToken,
    ) -> ([String; 3], Vec<String>) {
        let claim = &a.claim;
        (
            [
                self.keys.order(claim.order_key),
                self.keys.gate(claim.order_key),
                self.keys.dedup(claim.dedup_key),
            ],
            vec![
                seq.to_string(),
                self.lease_ms.to_string(),
                flag(a.redelivered).to_owned(),
                flag(a.bypass_gate).to_owned(),
                flag(a.replay_of.is_some()).to_owned(),
                self.max_starts.to_string(),
                claim.token.to_string(),
                fence.to_string(),
                self.era.get().to_string(),
                self.order_ttl_secs.to_string(),
                a.kind.to_owned(),
                flag(self.kinds).to_owned(),
                now_ms().to_string(),
            ],
        )
    }

    fn admit_cmd(&self, a: &Admission<'_>, fence: FenceToken) -> Cmd {
        let claim = &a.claim;
        match claim.seq {
            Some(seq) => {
                let (keys, args) = self.admit_order_parts(a, seq, fence);
                Self::evalsha(&SCRIPTS.admit_order, &keys, &args)
            }
            None => Self::evalsha(
                &SCRIPTS.admit_event,
                &[self.keys.dedup(claim.dedup_key)],
                &[
                    self.lease_ms.to_string(),
                    flag(a.redelivered).to_owned(),
                    self.max_starts.to_string(),
                    EVIDENCE.as_millis().to_string(),
                    claim.token.to_string(),
                ],
            ),
        }
    }

    /// The record a replay (`replay_of`) spends when it is committed or
    /// dead-lettered again; without one a key the scripts never touch.
    fn replay_record(&self, replay_of: Option<&str>) -> String {
        self.keys.replay_record(replay_of.unwrap_or_default())
    }

    /// `commit.lua`'s keys and arguments.
    fn commit_parts(&self, done: &Done<'_>, fence: FenceToken) -> ([String; 4], Vec<String>) {
        let claim = &done.claim;
        let ttl = if claim.seq.is_some() {
            self.order_ttl_secs
        } else {
            self.ttl_secs
        };
        let [order, dedup, quarantine] = self.claim_keys(claim);
        (
            [order, dedup, quarantine, self.replay_record(done.replay_of)],
            vec![
                seq_arg(claim.seq),
                claim.token.to_string(),
                fence.to_string(),
                self.era.get().to_string(),
                ttl.to_string(),
                if self.kinds {
                    done.kind.to_owned()
                } else {
                    String::new()
                },
                done.replay_of.unwrap_or_default().to_owned(),
            ],
        )
    }

    fn commit_cmd(&self, done: &Done<'_>, fence: FenceToken) -> Cmd {
        let (keys, args) = self.commit_parts(done, fence);
        Self::evalsha(&SCRIPTS.commit, &keys, &args)
    }

    /// One `step.lua` call: commit `done`, admit the sequenced `next`.
    fn step_cmd(&self, done: &Done<'_>, next: &Admission<'_>, seq: u64, fence: FenceToken) -> Cmd {
        let (mut keys, mut args) = {
            let (keys, args) = self.commit_parts(done, fence);
            (keys.to_vec(), args)
        };
        let (next_keys, next_args) = self.admit_order_parts(next, seq, fence);
        keys.extend(next_keys);
        args.extend(next_args);
        Self::evalsha(&SCRIPTS.step, &keys, &args)
    }

    /// Decides whether an event may run now and, if so, claims it: one round
    /// trip (the script, and in quarantine mode the order's quarantine head).
    pub(crate) async fn admit(&self, redis: &mut RedisSlot, admission: &Admission<'_>) -> Verdict {
        let fence = self.fence_token(redis).await;
        let mut pipe = redis::pipe();
        pipe.add_command(self.admit_cmd(admission, fence));
        let answers = self.query_admit(redis, &mut pipe, admission).await;
        self.finish_admit(redis, admission, answers).await
    }

    /// Adds the quarantine reads (quarantine mode) and runs a pipeline that
    /// ends with an admit script.
    async fn query_admit(
        &self,
        redis: &mut RedisSlot,
        pipe: &mut Pipeline,
        a: &Admission<'_>,
    ) -> Admitted {
        let (answer, head) = self.query_with_head(redis, pipe, a).await;
        Admitted {
            verdict: verdict(answer),
            head,
        }
    }

    /// Runs `pipe`, whose one reply is `T`, with the reads of `a`'s order's
    /// quarantine head added in quarantine mode.
    async fn query_with_head<T: redis::FromRedisValue>(
        &self,
        redis: &mut RedisSlot,
        pipe: &mut Pipeline,
        a: &Admission<'_>,
    ) -> (T, Option<quarantine::Head>) {
        if self.quarantine {
            quarantine::add_head_query(pipe, &self.keys, a.claim.order_key, a.replay_of);
            let (reply, head, own) = redis.query_pipeline(pipe).await;
            (reply, Some((head, own)))
        } else {
            let (reply,) = redis.query_pipeline(pipe).await;
            (reply, None)
        }
    }

    /// The claim a script granted, checked against the order's quarantine
    /// (quarantine mode): given back when the order waits behind a letter.
    async fn finish_admit(
        &self,
        redis: &mut RedisSlot,
        a: &Admission<'_>,
        answers: Admitted,
    ) -> Verdict {
        let Admitted { verdict, head } = answers;
        if !matches!(verdict, Verdict::Claimed | Verdict::TakenOver) {
            return verdict;
        }
        match head.and_then(|head| quarantine::blocker(head, a.claim.seq, a.replay_of)) {
            Some(blocker) => {
                self.release(redis, &a.claim).await;
                Verdict::Quarantined(blocker)
            }
            None => verdict,
        }
    }

    /// Commits one event and admits the next in one round trip. Redis runs
    /// them in order, so a next event that repeats this one finds it done.
    pub(crate) async fn commit_and_admit(
        &self,
        redis: &mut RedisSlot,
        done: &Done<'_>,
        next: &Admission<'_>,
    ) -> (Written, Verdict) {
        let fence = self.fence_token(redis).await;
        let mut pipe = redis::pipe();
        let ((written, kind, n), head) = match next.claim.seq {
            Some(seq) => {
                pipe.add_command(self.step_cmd(done, next, seq, fence));
                self.query_with_head(redis, &mut pipe, next).await
            }
            // Unsequenced next: the two scripts, pipelined (two replies).
            None => {
                pipe.add_command(self.commit_cmd(done, fence))
                    .add_command(self.admit_cmd(next, fence));
                if self.quarantine {
                    let (order, replay) = (next.claim.order_key, next.replay_of);
                    quarantine::add_head_query(&mut pipe, &self.keys, order, replay);
                    let (written, (kind, n), head, own): (i64, (String, i64), _, _) =
                        redis.query_pipeline(&pipe).await;
                    ((written, kind, n), Some((head, own)))
                } else {
                    let (written, (kind, n)): (i64, (String, i64)) =
                        redis.query_pipeline(&pipe).await;
                    ((written, kind, n), None)
                }
            }
        };
        let answers = Admitted {
            verdict: verdict((kind, n)),
            head,
        };
        let verdict = self.finish_admit(redis, next, answers).await;
        (Written::of(written), verdict)
    }

    /// Commits the processed events of a group, in order, then admits the
    /// events of the next group (`--group-commit`), in one round trip. The
    /// verdicts end with the first that is not a claim; none when a commit
    /// was fenced.
    pub(crate) async fn group(
        &self,
        redis: &mut RedisSlot,
        commits: &[Done<'_>],
        admits: &[GroupAdmit<'_>],
    ) -> GroupReply {
        let fence = self.fence_token(redis).await;
        let mut keys = Vec::with_capacity(4 * commits.len() + 3 * admits.len());
        let mut args = Vec::with_capacity(2 + 7 * commits.len() + 14 * admits.len());
        args.extend([commits.len().to_string(), admits.len().to_string()]);
        for done in commits {
            let (done_keys, done_args) = self.commit_parts(done, fence);
            keys.extend(done_keys);
            args.extend(done_args);
        }
        for admit in admits {
            let (admit_keys, admit_args) =
                self.admit_order_parts(&admit.admission, admit.seq, fence);
            keys.extend(admit_keys);
            args.push(flag(admit.chained).to_owned());
            args.extend(admit_args);
        }
        let (committed, fenced, verdicts): (usize, i64, Vec<(String, i64)>) = redis
            .query(&Self::evalsha(&SCRIPTS.group, &keys, &args))
            .await;
        GroupReply {
            committed,
            fenced: fenced == 1,
            verdicts: verdicts.into_iter().map(verdict).collect(),
        }
    }

    /// Marks the event processed and moves its order's gate, atomically.
    pub(crate) async fn commit(&self, redis: &mut RedisSlot, done: &Done<'_>) -> Written {
        let fence = self.fence_token(redis).await;
        Written::of(redis.query(&self.commit_cmd(done, fence)).await)
    }

    /// Extends the claim's lease, counting a handler start that begins or
    /// ended: the count is of calls that began and never returned, so a
    /// worker that dies while an event waits (for its retry, the breaker or a
    /// rate token) leaves no start behind for crash-loop protection. A claim
    /// that is no longer this delivery's is left alone.
    pub(crate) async fn renew(&self, redis: &mut RedisSlot, claim: &Claim<'_>, start: Start) {
        let delta = match start {
            Start::Begins => "1",
            Start::Ended => "-1",
            Start::Waits => "0",
        };
        let fence = self.fence_token(redis).await;
        let cmd = Self::evalsha(
            &SCRIPTS.renew,
            &self.claim_keys(claim)[..2],
            &[
                seq_arg(claim.seq),
                claim.token.to_string(),
                fence.to_string(),
                self.lease_ms.to_string(),
                delta.to_owned(),
                EVIDENCE.as_millis().to_string(),
            ],
        );
        if redis.query::<i64>(&cmd).await < 0 {
            tracing::warn!(shard = %self.shard, "the event's claim was taken over by a newer consumer");
        }
    }

    /// Gives the claim up (only this delivery's own), so that a replay is not
    /// suppressed and the next copy need not wait for the lease.
    pub(crate) async fn release(&self, redis: &mut RedisSlot, claim: &Claim<'_>) {
        let cmd = Self::evalsha(
            &SCRIPTS.release,
            &self.claim_keys(claim)[..2],
            &[seq_arg(claim.seq), claim.token.to_string()],
        );
        redis.query::<i64>(&cmd).await;
    }

    /// After a confirmed dead letter, in one round trip: gives the claim up,
    /// counts the seq as passed yet never processed (its replay runs) and, in
    /// quarantine mode, holds the order behind the letter.
    pub(crate) async fn dead_lettered(
        &self,
        redis: &mut RedisSlot,
        dead: &DeadLettered<'_>,
    ) -> Written {
        let fence = self.fence_token(redis).await;
        let claim = &dead.claim;
        let mut keys = self.claim_keys(claim).to_vec();
        keys.extend(dead.entry.script_keys(&self.keys));
        keys.push(self.replay_record(dead.replay_of));
        let mut args = vec![
            seq_arg(claim.seq),
            claim.token.to_string(),
            fence.to_string(),
            self.era.get().to_string(),
            self.order_ttl_secs.to_string(),
            if self.quarantine {
                dead.id.to_owned()
            } else {
                String::new()
            },
            dead.replay_of.unwrap_or_default().to_owned(),
            quarantine::score(claim.seq).to_string(),
        ];
        args.extend(dead.entry.script_args());
        Written::of(
            redis
                .query(&Self::evalsha(&SCRIPTS.dead, &keys, &args))
                .await,
        )
    }

    /// Whether the replay record `id` holds `record` (`replay::record` of the
    /// event that carries the id): only then is its replay marker honoured.
    pub(crate) async fn replay_recorded(
        &self,
        redis: &mut RedisSlot,
        id: &str,
        record: &str,
    ) -> bool {
        let mut get = redis::cmd("GET");
        get.arg(self.keys.replay_record(id));
        redis.query::<Option<String>>(&get).await.as_deref() == Some(record)
    }

    /// A replay found its event applied already: its letter no longer holds
    /// the order in quarantine and its record is spent, in one transaction.
    pub(crate) async fn replay_applied(
        &self,
        redis: &mut RedisSlot,
        order_key: &OrderKey,
        id: &str,
    ) {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("ZREM")
            .arg(self.keys.quarantine(order_key))
            .arg(id)
            .ignore()
            .cmd("DEL")
            .arg(self.keys.replay_record(id))
            .ignore();
        redis.query_pipeline::<()>(&pipe).await;
    }

    /// The index entry of a confirmed dead letter that holds no claim (its
    /// body was not an envelope): one script, after the confirm, before the ack.
    pub(crate) async fn index_letter(&self, redis: &mut RedisSlot, entry: &IndexEntry) {
        let cmd = Self::evalsha(
            &SCRIPTS.index,
            &entry.script_keys(&self.keys),
            &entry.script_args(),
        );
        redis.query::<i64>(&cmd).await;
    }
}

/// An admit script's verdict, and in quarantine mode the order's quarantine head.
struct Admitted {
    verdict: Verdict,
    head: Option<quarantine::Head>,
}

fn verdict((kind, n): (String, i64)) -> Verdict {
    match kind.as_str() {
        "claimed" => Verdict::Claimed,
        "takeover" => Verdict::TakenOver,
        "duplicate" => Verdict::Duplicate,
        "late" => Verdict::Late,
        "gap" => Verdict::Gap,
        "start" => Verdict::Start,
        "fenced" => Verdict::Fenced,
        "wait" => Verdict::Wait(Duration::from_millis(u64::try_from(n).unwrap_or(0).max(1))),
        "crashloop" => Verdict::CrashLoop(u32::try_from(n).unwrap_or(u32::MAX)),
        // The scripts return nothing else; treat surprises as a claim to re-check.
        _ => Verdict::Wait(Duration::from_millis(100)),
    }
}

#[cfg(test)]
pub(crate) mod memory;
#[cfg(test)]
mod scenarios;
mod state;
#[cfg(test)]
mod tests;

pub(crate) use state::{OrderState, RedisOrderState};
