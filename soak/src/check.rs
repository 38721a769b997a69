//! The check of a recorded history against the invariants and the fault bounds of
//! `docs/failures.md`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use crate::history::{Call, Fleet, History, Letter, PoisonKind, Published};
use crate::schedule::FaultKind;

/// A broken invariant, one line each in its `Display`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A confirmed event with neither a 2xx call nor a dead letter.
    Lost {
        /// The event's key.
        key: String,
        /// Its shard.
        shard: u16,
    },
    /// An undecodable or invalid poison event without its letter.
    PoisonNotDeadLettered {
        /// The event's key.
        key: String,
        /// The reason its letter must carry: `decode` or `invalid`.
        reason: &'static str,
        /// Its shard.
        shard: u16,
    },
    /// An event with hostile trace headers that no call applied.
    HostileNotProcessed {
        /// The event's key.
        key: String,
        /// Its shard.
        shard: u16,
    },
    /// An order's event first applied after one with a higher seq.
    OutOfOrder {
        /// The order.
        order: String,
        /// The event applied late.
        key: String,
        /// Its seq.
        seq: u64,
        /// The highest seq applied before it.
        after: u64,
    },
    /// A shard's repeated 2xx calls over the bound of the faults that ran.
    RepeatsOverBound {
        /// The shard.
        shard: u16,
        /// Its 2xx calls beyond the first per key.
        repeats: u64,
        /// The sum of the faults' per-shard bounds.
        bound: u64,
        /// How many faults ran.
        faults: usize,
    },
    /// Two calls of one order in flight at once, not both within a stale-owner window.
    OverlapOutsideWindow {
        /// The order.
        order: String,
        /// The earlier call's key.
        a: String,
        /// The later call's key.
        b: String,
    },
    /// Two overlapping first 2xx calls of one order with different keys.
    TwoCommits {
        /// The order.
        order: String,
        /// The earlier call's key.
        a: String,
        /// The later call's key.
        b: String,
    },
    /// A normal event dead-lettered for a reason no fault that ran allows.
    DeadLetterNotAllowed {
        /// The event's key, or `?` when the letter does not tell it.
        key: String,
        /// The letter's `x-fail-reason`.
        reason: String,
    },
    /// A reshard of the schedule that never finished: the record is not at its count.
    ReshardUnfinished {
        /// The count it went to.
        to: u16,
        /// The recorded count at the end.
        shards: u16,
    },
    /// A shard without exactly one consumer at the end.
    ShardNotConsumedOnce {
        /// The shard.
        shard: u16,
        /// Its consumers at the end.
        consumers: Vec<String>,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lost { key, shard } => write!(
                f,
                "lost: event {key} (shard {shard}) was confirmed but neither applied nor dead-lettered"
            ),
            Self::PoisonNotDeadLettered { key, reason, shard } => write!(
                f,
                "poison not dead-lettered: event {key} (shard {shard}) has no letter with reason {reason}"
            ),
            Self::HostileNotProcessed { key, shard } => write!(
                f,
                "hostile headers not processed: event {key} (shard {shard}) was never applied"
            ),
            Self::OutOfOrder {
                order,
                key,
                seq,
                after,
            } => write!(
                f,
                "out of order: order {order} applied seq {seq} ({key}) after seq {after}"
            ),
            Self::RepeatsOverBound {
                shard,
                repeats,
                bound,
                faults,
            } => write!(
                f,
                "repeats over bound: shard {shard} repeated {repeats} calls, the {faults} faults allow {bound}"
            ),
            Self::OverlapOutsideWindow { order, a, b } => write!(
                f,
                "overlap outside a fault window: order {order} had {a} and {b} in flight at once"
            ),
            Self::TwoCommits { order, a, b } => write!(
                f,
                "two commits at once: order {order} applied {a} and {b} in overlapping calls"
            ),
            Self::DeadLetterNotAllowed { key, reason } => write!(
                f,
                "dead letter not allowed: event {key} dead-lettered {reason}, which no fault that ran allows"
            ),
            Self::ReshardUnfinished { to, shards } => write!(
                f,
                "reshard unfinished: the fleet was to go to {to} shards and is recorded at {shards}"
            ),
            Self::ShardNotConsumedOnce { shard, consumers } => write!(
                f,
                "shard {shard} has {} consumers at the end, not one: [{}]",
                consumers.len(),
                consumers.join(", ")
            ),
        }
    }
}

/// A dead letter of a normal event that a fault which ran allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedLetter {
    /// The event's key, or `?` when the letter does not tell it.
    pub key: String,
    /// The letter's `x-fail-reason`.
    pub reason: String,
    /// The documentation row that allows it.
    pub row: &'static str,
}

/// A shard's repeated calls and their bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeats {
    /// 2xx calls beyond the first per key.
    pub repeats: u64,
    /// The sum of the per-shard bounds of the faults that ran.
    pub bound: u64,
}

/// The outcome of [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Every broken invariant; empty when the soak passed.
    pub violations: Vec<Violation>,
    /// The dead letters of normal events that a fault allowed, with the row cited.
    pub allowed_letters: Vec<AllowedLetter>,
    /// Per shard with a call, its repeats and their bound.
    pub repeats_by_shard: BTreeMap<u16, Repeats>,
}

impl Verdict {
    /// Whether no invariant broke.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Checks the history: nothing lost, poison dead-lettered, order kept, repeats and
/// overlaps within the bounds of the faults that ran, dead letters allowed, one
/// consumer per shard at the end.
#[must_use]
pub fn check(history: &History) -> Verdict {
    let index = Index::of(history);
    let mut violations = Vec::new();
    violations.extend(lost_and_poison(history, &index));
    let orders = calls_by_order(history);
    violations.extend(out_of_order(&orders, &index));
    let repeats_by_shard = repeats_by_shard(history);
    violations.extend(repeats_over_bound(history, &repeats_by_shard));
    violations.extend(overlaps(history, &orders));
    let (letter_violations, allowed_letters) = judge_letters(history, &index);
    violations.extend(letter_violations);
    violations.extend(reshards_finished(history));
    violations.extend(consumers_at_the_end(history));
    Verdict {
        violations,
        allowed_letters,
        repeats_by_shard,
    }
}

/// Look-ups by key, built once.
struct Index<'h> {
    applied: HashSet<&'h str>,
    /// Key → the reasons of its letters.
    letters: HashMap<&'h str, Vec<&'h str>>,
    poison: HashMap<&'h str, PoisonKind>,
}

impl<'h> Index<'h> {
    fn of(history: &'h History) -> Index<'h> {
        let applied = history
            .calls
            .iter()
            .filter(|c| c.applied())
            .map(|c| c.key.as_str())
            .collect();
        let mut letters: HashMap<&str, Vec<&str>> = HashMap::new();
        for letter in &history.letters {
            if let Some(key) = &letter.key {
                letters.entry(key).or_default().push(&letter.reason);
            }
        }
        let poison = history
            .published
            .iter()
            .filter_map(|p| p.poison.map(|kind| (p.key.as_str(), kind)))
            .collect();
        Index {
            applied,
            letters,
            poison,
        }
    }

    fn dead_lettered(&self, key: &str) -> bool {
        self.letters.contains_key(key)
    }

    fn has_letter(&self, key: &str, reason: &str) -> bool {
        self.letters.get(key).is_some_and(|r| r.contains(&reason))
    }
}

/// Rules 1 and 2: every confirmed event applied or dead-lettered; poison as it must.
fn lost_and_poison(history: &History, index: &Index<'_>) -> Vec<Violation> {
    history
        .published
        .iter()
        .filter_map(|event| fate_violation(event, index))
        .collect()
}

fn fate_violation(event: &Published, index: &Index<'_>) -> Option<Violation> {
    let key = event.key.clone();
    let shard = event.shard;
    let applied = index.applied.contains(event.key.as_str());
    match event.poison {
        None if !applied && !index.dead_lettered(&event.key) => {
            Some(Violation::Lost { key, shard })
        }
        Some(PoisonKind::HostileHeaders) if !applied => {
            Some(Violation::HostileNotProcessed { key, shard })
        }
        Some(PoisonKind::Undecodable) if !index.has_letter(&event.key, "decode") => {
            Some(Violation::PoisonNotDeadLettered {
                key,
                reason: "decode",
                shard,
            })
        }
        Some(PoisonKind::InvalidEnvelope) if !index.has_letter(&event.key, "invalid") => {
            Some(Violation::PoisonNotDeadLettered {
                key,
                reason: "invalid",
                shard,
            })
        }
        _ => None,
    }
}

/// Each order's calls, sorted by start.
type CallsByOrder<'h> = BTreeMap<&'h str, Vec<&'h Call>>;

/// The history's calls grouped by order.
fn calls_by_order(history: &History) -> CallsByOrder<'_> {
    let mut orders: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for call in &history.calls {
        orders.entry(&call.order).or_default().push(call);
    }
    for calls in orders.values_mut() {
        calls.sort_by_key(|c| (c.started, c.ended));
    }
    orders
}

/// Rule 3: an order's first 2xx calls by start ascend in seq; dead-lettered events
/// are left out of the sequence.
fn out_of_order(orders: &CallsByOrder<'_>, index: &Index<'_>) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (order, calls) in orders {
        let mut highest: Option<u64> = None;
        let commits = calls
            .iter()
            .zip(first_commits(calls))
            .filter(|(c, first)| *first && !index.dead_lettered(&c.key));
        for (call, _) in commits {
            match highest {
                Some(after) if call.seq <= after => violations.push(Violation::OutOfOrder {
                    order: (*order).to_owned(),
                    key: call.key.clone(),
                    seq: call.seq,
                    after,
                }),
                _ => highest = Some(call.seq),
            }
        }
    }
    violations
}

/// The repeats per shard that one fault may cause, from `docs/failures.md`'s Bounds
/// table. Every fault counts for every shard: a node kill or a failover touches all.
fn repeat_bound(kind: &FaultKind, fleet: &Fleet) -> u64 {
    match kind {
        // "worker killed (kill -9, OOM) mid-handler": per shard 1 call at K = 1, up to
        // K with `--concurrency K`, up to G with group commit.
        FaultKind::WorkerKill9 { worker } => fleet
            .workers
            .get(usize::from(*worker))
            .map_or_else(|| fleet.largest_crash_bound(), |w| w.crash_bound()),
        // "SIGTERM, a graceful shard move": nothing.
        FaultKind::WorkerTerm { .. } => 0,
        // "a cluster node lost (quorum queues)" and "broker connection lost": per shard
        // the call in flight per loss of its consumer; any worker may lose its
        // connection, so the largest crash bound.
        FaultKind::NodeKill9 { .. } | FaultKind::Partition { .. } => fleet.largest_crash_bound(),
        // "Redis failover (asynchronous replication)": an event whose commit was lost
        // repeats; a lost group commit repeats its group.
        FaultKind::RedisFailover => fleet.largest_crash_bound(),
        // "the downstream out (breaker on)": the calls that failed are not 2xx, so they
        // are no repeats. "broker memory or disk alarm": nothing. Poison: processed
        // once or dead-lettered.
        FaultKind::DownstreamRefused
        | FaultKind::Downstream503
        | FaultKind::SlowDownstream
        | FaultKind::MemoryAlarm { .. }
        | FaultKind::Poison => 0,
        // "a reshard under load": a forwarded copy is absorbed by dedup before any
        // call; a shard whose consumer moves repeats as for a graceful move.
        FaultKind::Reshard { .. } => 0,
    }
}

/// Per shard, the 2xx calls beyond the first per key and the faults' bound. A
/// repeat counts on the shard of its own call: after a reshard an order's key
/// may repeat on its new shard.
fn repeats_by_shard(history: &History) -> BTreeMap<u16, Repeats> {
    let bound: u64 = history
        .faults
        .iter()
        .map(|record| repeat_bound(&record.fault.kind, &history.fleet))
        .sum();
    let mut shards: BTreeMap<u16, Repeats> = BTreeMap::new();
    for call in &history.calls {
        shards
            .entry(call.shard)
            .or_insert(Repeats { repeats: 0, bound });
    }
    let mut applied: Vec<&Call> = history.calls.iter().filter(|c| c.applied()).collect();
    applied.sort_by_key(|c| c.started);
    let mut seen = HashSet::new();
    for call in applied {
        if !seen.insert(call.key.as_str())
            && let Some(entry) = shards.get_mut(&call.shard)
        {
            entry.repeats += 1;
        }
    }
    shards
}

/// Rule 4: no shard repeats more than the faults that ran allow.
fn repeats_over_bound(history: &History, repeats: &BTreeMap<u16, Repeats>) -> Vec<Violation> {
    repeats
        .iter()
        .filter(|(_, r)| r.repeats > r.bound)
        .map(|(shard, r)| Violation::RepeatsOverBound {
            shard: *shard,
            repeats: r.repeats,
            bound: r.bound,
            faults: history.faults.len(),
        })
        .collect()
}

/// How long after a stale-owner fault ends an old owner may still be calling: the
/// member lease and heartbeat (until `--assign auto` moves its shards), the time the
/// cluster takes to count a silent node down (`net_ticktime` × 1.25, Erlang's
/// upper bound on tick detection), and 5 s for the old owner's in-flight call.
fn stale_owner_grace(fleet: &Fleet) -> Duration {
    fleet.member_lease
        + fleet.member_heartbeat
        + fleet.net_ticktime.mul_f64(1.25)
        + Duration::from_secs(5)
}

/// The windows `[began, ended + grace]` of the faults after which a stale owner may
/// still work while a new one has taken its shards.
fn stale_owner_windows(history: &History) -> Vec<(Duration, Duration)> {
    let grace = stale_owner_grace(&history.fleet);
    history
        .faults
        .iter()
        .filter(|r| {
            matches!(
                r.fault.kind,
                FaultKind::WorkerKill9 { .. }
                    | FaultKind::NodeKill9 { .. }
                    | FaultKind::Partition { .. }
                    | FaultKind::RedisFailover
            )
        })
        .map(|r| (r.began, r.ended + grace))
        .collect()
}

/// Per call of an order (sorted by start), whether it is the first 2xx call of its key.
fn first_commits(calls: &[&Call]) -> Vec<bool> {
    let mut seen = HashSet::new();
    calls
        .iter()
        .map(|c| c.applied() && seen.insert(c.key.as_str()))
        .collect()
}

/// Rule 5: one call at a time per order, except both calls starting inside a
/// stale-owner window (where the stale owner's call of seq s may still run
/// while the new owner repeats s and goes on to s + 1). Outside a window, two
/// overlapping first 2xx calls of different keys are named as two commits.
fn overlaps(history: &History, orders: &CallsByOrder<'_>) -> Vec<Violation> {
    let windows = stale_owner_windows(history);
    let mut violations = Vec::new();
    for (order, calls) in orders {
        let commits = first_commits(calls);
        for i in 0..calls.len() {
            let overlapping =
                (i + 1..calls.len()).take_while(|&j| calls[j].started < calls[i].ended);
            violations.extend(overlapping.filter_map(|j| {
                let both_commits = commits[i] && commits[j];
                overlap_violation(order, calls[i], calls[j], both_commits, &windows)
            }));
        }
    }
    violations
}

/// The violation, if any, of `earlier` and `later`, two calls of `order` in flight
/// at once.
fn overlap_violation(
    order: &str,
    earlier: &Call,
    later: &Call,
    both_first_commits: bool,
    windows: &[(Duration, Duration)],
) -> Option<Violation> {
    let in_window = |call: &Call| {
        windows
            .iter()
            .any(|(from, to)| (*from..=*to).contains(&call.started))
    };
    let (order, a, b) = (order.to_owned(), earlier.key.clone(), later.key.clone());
    if in_window(earlier) && in_window(later) {
        // A stale owner's call still in flight when the new owner, past its
        // repeat of the same seq, calls the next: both first 2xx calls, and
        // what the window allows (the per-order rule still holds their starts
        // to ascending seq).
        None
    } else if both_first_commits && a != b {
        Some(Violation::TwoCommits { order, a, b })
    } else {
        Some(Violation::OverlapOutsideWindow { order, a, b })
    }
}

/// Why a letter of a normal event may stand: the fault kinds that allow its reason
/// and the documentation row that says so.
fn letter_allowance(reason: &str) -> Option<(&'static [&'static str], &'static str)> {
    match reason {
        "late" => Some((
            &["redis-failover"],
            "docs/failures.md Bounds: \"a replay record lost (Redis failover) ... dead-lettered `late`\"",
        )),
        "seq-gap" => Some((
            &["redis-failover"],
            "docs/failures.md Bounds: \"Redis failover (asynchronous replication)\": a lost gate write",
        )),
        "crash-loop" => Some((
            &["worker-kill9", "worker-term", "node-kill9", "partition"],
            "ARCHITECTURE.md \"Delivery-count budget (quorum queues)\": the quorum delivery limit spent",
        )),
        _ => None,
    }
}

/// Rule 6: a normal event's letter stands only for a reason a fault that ran allows.
fn judge_letters(history: &History, index: &Index<'_>) -> (Vec<Violation>, Vec<AllowedLetter>) {
    let ran: HashSet<&str> = history.faults.iter().map(|r| r.fault.kind.name()).collect();
    let mut violations = Vec::new();
    let mut allowed = Vec::new();
    for letter in history
        .letters
        .iter()
        .filter(|l| !is_poison_letter(l, index))
    {
        let key = letter.key.clone().unwrap_or_else(|| "?".to_owned());
        let reason = letter.reason.clone();
        match letter_allowance(&letter.reason) {
            Some((kinds, row)) if kinds.iter().any(|k| ran.contains(k)) => {
                allowed.push(AllowedLetter { key, reason, row });
            }
            _ => violations.push(Violation::DeadLetterNotAllowed { key, reason }),
        }
    }
    (violations, allowed)
}

/// Whether a letter is a poison event's own (judged by rule 2): the key of an
/// undecodable or invalid poison event, or, with no key, reason `decode`/`invalid`.
fn is_poison_letter(letter: &Letter, index: &Index<'_>) -> bool {
    match &letter.key {
        Some(key) => matches!(
            index.poison.get(key.as_str()),
            Some(PoisonKind::Undecodable | PoisonKind::InvalidEnvelope)
        ),
        None => matches!(letter.reason.as_str(), "decode" | "invalid"),
    }
}

/// Rule 7: the schedule's reshard finished (the record is at its count).
fn reshards_finished(history: &History) -> Vec<Violation> {
    history
        .faults
        .iter()
        .filter_map(|record| match record.fault.kind {
            FaultKind::Reshard { to } if to != history.shards => {
                Some(Violation::ReshardUnfinished {
                    to,
                    shards: history.shards,
                })
            }
            _ => None,
        })
        .collect()
}

/// Rule 8: each shard, and each retired queue still served, has exactly one
/// consumer at the end.
fn consumers_at_the_end(history: &History) -> Vec<Violation> {
    (0..history.shards)
        .chain(history.retired.iter().copied())
        .filter_map(|shard| {
            let consumers = history
                .final_consumers
                .0
                .get(&shard)
                .cloned()
                .unwrap_or_default();
            (consumers.len() != 1).then_some(Violation::ShardNotConsumedOnce { shard, consumers })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{FaultRecord, FinalConsumers, Sample};

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn event(order: &str, seq: u64) -> Published {
        Published {
            key: format!("{order}:e{seq}:{seq}"),
            order: order.to_owned(),
            seq,
            shard: 0,
            confirmed_at: secs(seq),
            poison: None,
        }
    }

    fn call(event: &Published, started: u64, ended: u64, status: u16) -> Call {
        Call {
            key: event.key.clone(),
            order: event.order.clone(),
            seq: event.seq,
            shard: event.shard,
            started: secs(started),
            ended: secs(ended),
            status,
        }
    }

    fn letter(event: &Published, reason: &str) -> Letter {
        Letter {
            key: Some(event.key.clone()),
            order: Some(event.order.clone()),
            seq: Some(event.seq),
            reason: reason.to_owned(),
            shard: Some(event.shard),
        }
    }

    fn fault(kind: FaultKind, began: u64, ended: u64) -> FaultRecord {
        FaultRecord::at_secs(kind, began, ended)
    }

    /// Two orders of three events on shard 0, each applied once in order at 10 s,
    /// 20 s, 30 s (1 s a call); one consumer on each of two shards.
    fn clean() -> History {
        let published: Vec<Published> = ["a", "b"]
            .iter()
            .flat_map(|order| (1..=3).map(|seq| event(order, seq)))
            .collect();
        let calls = published
            .iter()
            .enumerate()
            .map(|(i, e)| {
                call(
                    e,
                    10 * e.seq + i as u64 % 3,
                    10 * e.seq + i as u64 % 3 + 1,
                    200,
                )
            })
            .collect();
        let consumers = [(0, vec!["w0".to_owned()]), (1, vec!["w1".to_owned()])];
        History {
            shards: 2,
            retired: Vec::new(),
            published,
            calls,
            letters: Vec::new(),
            faults: Vec::new(),
            samples: vec![Sample {
                at: secs(1),
                processed_per_sec: 1.0,
                backlog_age_secs: 0.0,
                cpu_percent: 5.0,
            }],
            final_consumers: FinalConsumers(consumers.into_iter().collect()),
            fleet: Fleet::soak(),
        }
    }

    fn violations(history: &History) -> Vec<Violation> {
        check(history).violations
    }

    #[test]
    fn a_clean_history_passes() {
        let verdict = check(&clean());
        assert!(verdict.passed(), "{:?}", verdict.violations);
        assert_eq!(
            verdict.repeats_by_shard[&0],
            Repeats {
                repeats: 0,
                bound: 0
            }
        );
    }

    #[test]
    fn an_event_neither_applied_nor_dead_lettered_is_lost() {
        let mut history = clean();
        history.calls.retain(|c| c.key != "b:e3:3");
        assert_eq!(
            violations(&history),
            [Violation::Lost {
                key: "b:e3:3".into(),
                shard: 0
            }]
        );
    }

    #[test]
    fn a_reordered_order_is_caught() {
        let mut history = clean();
        let (two, three) = (event("a", 2), event("a", 3));
        history.calls.retain(|c| c.order != "a" || c.seq == 1);
        history.calls.push(call(&three, 20, 21, 200));
        history.calls.push(call(&two, 30, 31, 200));
        assert_eq!(
            violations(&history),
            [Violation::OutOfOrder {
                order: "a".into(),
                key: two.key,
                seq: 2,
                after: 3
            }]
        );
    }

    #[test]
    fn a_dead_lettered_event_is_skipped_in_the_order() {
        let mut history = clean();
        let two = event("a", 2);
        history.calls.retain(|c| c.key != two.key);
        history.calls.push(call(&two, 40, 41, 200));
        history.letters.push(letter(&two, "late"));
        history.faults.push(fault(FaultKind::RedisFailover, 35, 50));
        assert!(check(&history).passed(), "{:?}", violations(&history));
    }

    #[test]
    fn repeats_over_the_bound_are_caught_and_within_it_pass() {
        let mut history = clean();
        let one = event("a", 1);
        for _ in 0..2 {
            history.calls.push(call(&one, 50, 51, 200));
        }
        let over = Violation::RepeatsOverBound {
            shard: 0,
            repeats: 2,
            bound: 1,
            faults: 1,
        };
        // Worker 2 runs the defaults: a kill -9 of it may repeat one call per shard.
        history
            .faults
            .push(fault(FaultKind::WorkerKill9 { worker: 2 }, 45, 50));
        assert_eq!(violations(&history), [over]);
        // Worker 0 runs `--concurrency 4`.
        history.faults[0] = fault(FaultKind::WorkerKill9 { worker: 0 }, 45, 50);
        assert!(check(&history).passed(), "{:?}", violations(&history));
    }

    fn overlapping(history: &mut History) -> (Published, Published) {
        let (two, three) = (event("a", 2), event("a", 3));
        history.calls.retain(|c| c.order != "a" || c.seq == 1);
        history.calls.push(call(&two, 100, 104, 0));
        history.calls.push(call(&two, 102, 103, 200));
        history.calls.push(call(&three, 110, 111, 200));
        (two, three)
    }

    #[test]
    fn an_overlap_outside_any_fault_window_is_caught() {
        let mut history = clean();
        let (two, _) = overlapping(&mut history);
        let caught = Violation::OverlapOutsideWindow {
            order: "a".into(),
            a: two.key.clone(),
            b: two.key,
        };
        assert_eq!(violations(&history), [caught]);
        // A memory alarm lets no stale owner call.
        history
            .faults
            .push(fault(FaultKind::MemoryAlarm { node: 0 }, 90, 101));
        assert_eq!(violations(&history).len(), 1);
    }

    #[test]
    fn the_same_overlap_inside_a_partitions_window_is_allowed() {
        let mut history = clean();
        overlapping(&mut history);
        // The partition healed at 80 s; the grace (5 + 1 + 12.5 + 5 s) reaches 103.5 s.
        history
            .faults
            .push(fault(FaultKind::Partition { node: 2 }, 50, 80));
        assert!(check(&history).passed(), "{:?}", violations(&history));
    }

    #[test]
    fn two_overlapping_commits_of_one_order_are_caught_outside_a_window_only() {
        let mut history = clean();
        let (two, three) = (event("a", 2), event("a", 3));
        history.calls.retain(|c| c.order != "a" || c.seq == 1);
        // The stale owner's 2 runs 60–64 s; the new owner repeats 2 and calls 3.
        history.calls.push(call(&two, 60, 64, 200));
        history.calls.push(call(&two, 61, 61, 200));
        history.calls.push(call(&three, 62, 63, 200));
        let caught = Violation::TwoCommits {
            order: "a".into(),
            a: two.key.clone(),
            b: three.key,
        };
        assert!(violations(&history).contains(&caught));
        history
            .faults
            .push(fault(FaultKind::Partition { node: 2 }, 50, 80));
        assert!(check(&history).passed(), "{:?}", violations(&history));
    }

    #[test]
    fn a_handler_letter_of_a_normal_event_is_caught() {
        let mut history = clean();
        let two = event("b", 2);
        history.calls.retain(|c| c.key != two.key);
        history.letters.push(letter(&two, "handler"));
        history.faults.push(fault(FaultKind::Downstream503, 15, 30));
        let caught = Violation::DeadLetterNotAllowed {
            key: two.key,
            reason: "handler".into(),
        };
        assert_eq!(violations(&history), [caught]);
    }

    #[test]
    fn a_late_letter_is_allowed_after_a_redis_failover_only() {
        let mut history = clean();
        let two = event("b", 2);
        history.calls.retain(|c| c.key != two.key);
        history.letters.push(letter(&two, "late"));
        let caught = Violation::DeadLetterNotAllowed {
            key: two.key.clone(),
            reason: "late".into(),
        };
        assert_eq!(violations(&history), [caught]);

        history.faults.push(fault(FaultKind::RedisFailover, 15, 30));
        let verdict = check(&history);
        assert!(verdict.passed(), "{:?}", verdict.violations);
        assert_eq!(verdict.allowed_letters.len(), 1);
        assert_eq!(verdict.allowed_letters[0].key, two.key);
        assert!(verdict.allowed_letters[0].row.contains("Redis failover"));
    }

    #[test]
    fn a_repeat_counts_on_the_shard_of_its_own_call() {
        let mut history = clean();
        let one = history.published[0].clone();
        // The order moved to shard 1 by a reshard; its first event repeats there.
        history.calls.push(Call {
            shard: 1,
            ..call(&one, 40, 41, 200)
        });
        history
            .faults
            .push(fault(FaultKind::Reshard { to: 2 }, 35, 38));
        let verdict = check(&history);
        assert_eq!(verdict.repeats_by_shard[&1].repeats, 1);
        assert_eq!(verdict.repeats_by_shard[&0].repeats, 0);
        assert_eq!(
            verdict.violations,
            [Violation::RepeatsOverBound {
                shard: 1,
                repeats: 1,
                bound: 0,
                faults: 1
            }]
        );
    }

    #[test]
    fn a_reshard_that_did_not_finish_is_caught() {
        let mut history = clean();
        history
            .faults
            .push(fault(FaultKind::Reshard { to: 3 }, 5, 20));
        assert_eq!(
            violations(&history),
            [Violation::ReshardUnfinished { to: 3, shards: 2 }]
        );
        history.shards = 3;
        history.final_consumers.0.insert(2, vec!["w2".into()]);
        assert!(violations(&history).is_empty());
    }

    #[test]
    fn a_retired_queue_without_a_consumer_is_caught() {
        let mut history = clean();
        history.retired = vec![4];
        assert_eq!(
            violations(&history),
            [Violation::ShardNotConsumedOnce {
                shard: 4,
                consumers: Vec::new()
            }]
        );
    }

    #[test]
    fn shards_without_exactly_one_consumer_are_caught() {
        let mut history = clean();
        history.shards = 3;
        history
            .final_consumers
            .0
            .insert(1, vec!["w1".into(), "w2".into()]);
        assert_eq!(
            violations(&history),
            [
                Violation::ShardNotConsumedOnce {
                    shard: 1,
                    consumers: vec!["w1".into(), "w2".into()]
                },
                Violation::ShardNotConsumedOnce {
                    shard: 2,
                    consumers: Vec::new()
                },
            ]
        );
    }

    #[test]
    fn poison_must_be_dead_lettered_with_its_reason_and_hostile_events_applied() {
        let mut history = clean();
        let mut undecodable = event("p", 1);
        undecodable.poison = Some(PoisonKind::Undecodable);
        let mut invalid = event("p", 2);
        invalid.poison = Some(PoisonKind::InvalidEnvelope);
        let mut hostile = event("h", 1);
        hostile.poison = Some(PoisonKind::HostileHeaders);
        history
            .published
            .extend([undecodable.clone(), invalid.clone(), hostile.clone()]);
        history.letters.push(letter(&invalid, "invalid"));
        history.calls.push(call(&hostile, 70, 71, 200));
        let caught = Violation::PoisonNotDeadLettered {
            key: undecodable.key.clone(),
            reason: "decode",
            shard: 0,
        };
        assert_eq!(violations(&history), [caught]);

        history.letters.push(letter(&undecodable, "decode"));
        history.calls.retain(|c| c.key != hostile.key);
        let caught = Violation::HostileNotProcessed {
            key: hostile.key,
            shard: 0,
        };
        assert_eq!(violations(&history), [caught]);
    }

    #[test]
    fn the_repeat_bounds_follow_the_fleets_flags() {
        let fleet = Fleet::soak();
        let bounds = [
            (FaultKind::WorkerKill9 { worker: 0 }, 4),
            (FaultKind::WorkerKill9 { worker: 1 }, 32),
            (FaultKind::WorkerKill9 { worker: 2 }, 1),
            (FaultKind::WorkerTerm { worker: 1 }, 0),
            (FaultKind::NodeKill9 { node: 0 }, 32),
            (FaultKind::Partition { node: 1 }, 32),
            (FaultKind::RedisFailover, 32),
            (FaultKind::Downstream503, 0),
            (FaultKind::MemoryAlarm { node: 2 }, 0),
            (FaultKind::Poison, 0),
        ];
        for (kind, bound) in bounds {
            assert_eq!(repeat_bound(&kind, &fleet), bound, "{kind}");
        }
    }

    #[test]
    fn every_violation_displays_on_one_line_naming_its_subject() {
        let lines = [
            (
                Violation::Lost {
                    key: "o:e:1".into(),
                    shard: 3,
                },
                "o:e:1",
            ),
            (
                Violation::OutOfOrder {
                    order: "o".into(),
                    key: "o:e:2".into(),
                    seq: 2,
                    after: 3,
                },
                "order o",
            ),
            (
                Violation::RepeatsOverBound {
                    shard: 7,
                    repeats: 9,
                    bound: 4,
                    faults: 2,
                },
                "shard 7",
            ),
            (
                Violation::ShardNotConsumedOnce {
                    shard: 5,
                    consumers: Vec::new(),
                },
                "shard 5",
            ),
        ];
        for (violation, subject) in lines {
            let text = violation.to_string();
            assert!(text.contains(subject) && !text.contains('\n'), "{text}");
        }
    }
}
