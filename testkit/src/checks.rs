//! Checks on what the downstream saw: completeness, per-order sequence,
//! exactly once, the request's shape; and order ids spread over the shards.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use shardline_contract::headers::is_valid_traceparent;

use crate::downstream::{Call, Downstream, describe};
use crate::env::TestEnv;
use crate::publish::Event;

/// Keys answered 2xx (answer handed back).
pub fn ok_keys(calls: &[Call]) -> HashSet<&str> {
    calls
        .iter()
        .filter(|c| c.ok() && c.completed)
        .map(Call::key)
        .collect()
}

/// Whether every one of `events` was answered 2xx.
pub fn all_ok(calls: &[Call], events: &[Event]) -> bool {
    let ok = ok_keys(calls);
    events.iter().all(|e| ok.contains(e.key().as_str()))
}

/// Every event of `events` reached the downstream, and per order the seqs of the
/// calls, in arrival order, never go backwards (a repeated call of the same seq
/// is allowed).
pub fn assert_in_order_and_complete(calls: &[Call], events: &[Event]) {
    let mut expected: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for e in events {
        expected
            .entry(e.order_id.as_str())
            .or_default()
            .insert(e.seq);
    }
    let seen = seqs_by_order(calls.iter());
    for (order, seqs) in &expected {
        let got = seen.get(order).cloned().unwrap_or_default();
        assert!(
            got.windows(2).all(|w| w[0] <= w[1]),
            "order {order}: downstream saw seqs {got:?}, out of order"
        );
        let got_set: BTreeSet<u64> = got.iter().copied().collect();
        assert_eq!(
            &got_set, seqs,
            "order {order}: downstream saw seqs {got:?}, expected each of {seqs:?}"
        );
    }
}

/// Every event of `events` reached the downstream, and per order each call
/// is the seq before it again, the next seq, or a rewind to a seq already
/// called: what a crash under group commit may show, where an order's calls
/// since its last commit run again from the first of them (`1, 2, 1, 2, 3`).
/// A seq is never called before the one below it; nothing is skipped.
///
/// Calls to different handler paths are different consumers' (a test gives
/// each worker a path of its own, [`Downstream::handler_named`], where their
/// calls may interleave: a cut-off grouping worker calls the rest of its
/// group after the standby took the shard over). Then each consumer's calls
/// follow the rule above from wherever it began, and together each seq is
/// called the first time only after every seq below it: in effect, at a
/// downstream that honours `Idempotency-Key`, still in order.
pub fn assert_in_order_in_effect(calls: &[Call], events: &[Event]) {
    let mut first: HashMap<&str, u64> = HashMap::new();
    for e in events {
        let lowest = first.entry(e.order_id.as_str()).or_insert(e.seq);
        *lowest = (*lowest).min(e.seq);
    }
    let mut consumers: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for c in calls {
        consumers.entry(c.path.as_str()).or_default().push(c);
    }
    for (path, calls) in consumers {
        for (order, got) in seqs_by_order(calls.iter().copied()) {
            let mut called = BTreeSet::new();
            let mut last: Option<u64> = None;
            for &seq in &got {
                let fits = last.is_none_or(|last| {
                    seq == last || seq == last + 1 || (seq < last && called.contains(&seq))
                });
                assert!(
                    fits,
                    "order {order}: {path} saw seqs {got:?}: {seq} after {last:?} is neither a \
                     repeat, the next seq nor a rewind"
                );
                called.insert(seq);
                last = Some(seq);
            }
        }
    }
    for (order, got) in seqs_by_order(calls.iter()) {
        let mut highest: Option<u64> = None;
        for &seq in &got {
            let fits = match highest {
                None => first.get(order) == Some(&seq),
                Some(highest) => seq <= highest + 1,
            };
            assert!(
                fits,
                "order {order}: downstream saw seqs {got:?}: {seq} was called before {}",
                highest.map_or_else(
                    || format!("{:?}", first.get(order)),
                    |h| (h + 1).to_string()
                )
            );
            highest = highest.max(Some(seq));
        }
    }
    let ok = ok_keys(calls);
    let missing: Vec<String> = events
        .iter()
        .map(Event::key)
        .filter(|k| !ok.contains(k.as_str()))
        .collect();
    assert!(missing.is_empty(), "never answered 2xx: {missing:?}");
}

/// The seqs of the calls of each order, in arrival order.
fn seqs_by_order<'a>(calls: impl Iterator<Item = &'a Call>) -> BTreeMap<&'a str, Vec<u64>> {
    let mut seen: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for c in calls {
        if let (Some(order), Some(seq)) = (c.order_id.as_deref(), c.seq) {
            seen.entry(order).or_default().push(seq);
        }
    }
    seen
}

/// Every event reached the downstream exactly once, and nothing else did.
pub fn assert_exactly_once(calls: &[Call], events: &[Event]) {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for c in calls {
        *count.entry(c.key()).or_default() += 1;
    }
    let repeated: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "keys called more than once: {repeated:?}"
    );
    let expected: HashSet<String> = events.iter().map(Event::key).collect();
    let unexpected: Vec<_> = count.keys().filter(|k| !expected.contains(**k)).collect();
    assert!(unexpected.is_empty(), "unexpected keys: {unexpected:?}");
    let missing: Vec<_> = expected
        .iter()
        .filter(|k| !count.contains_key(k.as_str()))
        .collect();
    assert!(missing.is_empty(), "never called: {missing:?}");
    assert_eq!(calls.len(), events.len(), "{}", describe(calls));
}

/// Two calls of one order never overlapped in time: each started after the
/// one before it was answered. Calls never answered (the worker died during
/// them) are left out.
pub fn assert_orders_never_overlap(calls: &[Call]) {
    let mut by_order: HashMap<&str, Vec<(&Call, std::time::Instant)>> = HashMap::new();
    for c in calls {
        if let (Some(order), Some(ended)) = (c.order_id.as_deref(), c.ended) {
            by_order.entry(order).or_default().push((c, ended));
        }
    }
    for (order, mut calls) in by_order {
        calls.sort_by_key(|(c, _)| c.started);
        for pair in calls.windows(2) {
            let ((before, ended), (after, _)) = (pair[0], pair[1]);
            assert!(
                after.started >= ended,
                "order {order}: call #{} (seq {:?}) started before #{} (seq {:?}) was answered",
                after.index,
                after.seq,
                before.index,
                before.seq
            );
        }
    }
}

/// The most calls in flight at once on each shard (of the order).
pub fn max_in_flight_per_shard(calls: &[Call], env: &TestEnv) -> BTreeMap<u16, usize> {
    let mut edges: BTreeMap<u16, Vec<(std::time::Instant, i32)>> = BTreeMap::new();
    for c in calls {
        let shard = env.shard_of(c.order_id.as_deref().unwrap_or(""));
        let edge = edges.entry(shard).or_default();
        edge.push((c.started, 1));
        if let Some(ended) = c.ended {
            edge.push((ended, -1));
        }
    }
    edges
        .into_iter()
        .map(|(shard, mut edge)| {
            // An answer at the instant of a start counts first.
            edge.sort();
            let mut now = 0_i32;
            let most = edge.iter().fold(0, |most, (_, d)| {
                now += d;
                most.max(now)
            });
            (shard, usize::try_from(most).unwrap_or(0))
        })
        .collect()
}

/// Calls beyond the first per key, by shard (of the order).
pub fn repeats_per_shard(calls: &[Call], env: &TestEnv) -> BTreeMap<u16, usize> {
    let mut per_shard: BTreeMap<u16, (usize, HashSet<&str>)> = BTreeMap::new();
    for c in calls {
        let shard = env.shard_of(c.order_id.as_deref().unwrap_or(""));
        let entry = per_shard.entry(shard).or_default();
        entry.0 += 1;
        entry.1.insert(c.key());
    }
    per_shard
        .into_iter()
        .map(|(shard, (n, keys))| (shard, n - keys.len()))
        .collect()
}

/// The request of every call: POST to the handler path, the original body, and
/// the headers docs/semantics.md §3 names, consistent with the envelope.
pub fn assert_request_shape(calls: &[Call], events: &[Event], env: &TestEnv) {
    let by_key: HashMap<String, &Event> = events.iter().map(|e| (e.key(), e)).collect();
    for c in calls {
        let e = by_key
            .get(c.key())
            .unwrap_or_else(|| panic!("call with unexpected Idempotency-Key: {c:?}"));
        assert_eq!(c.method, "POST", "{c:?}");
        assert_eq!(c.path, "/events", "{c:?}");
        assert_eq!(c.body, e.body, "handler must get the original bytes: {c:?}");
        assert_eq!(
            c.key(),
            format!("{}:{}:{}", e.order_id, e.event, e.seq),
            "Idempotency-Key"
        );
        assert_eq!(c.event.as_deref(), Some(e.event.as_str()), "{c:?}");
        assert_eq!(c.header("x-order-id"), Some(e.order_id.as_str()), "{c:?}");
        assert_eq!(c.header("x-seq"), Some(e.seq.to_string().as_str()), "{c:?}");
        assert_eq!(c.shard(), Some(env.shard_of(&e.order_id)), "X-Shard: {c:?}");
        assert!(c.attempt().is_some_and(|a| a >= 1), "X-Attempt: {c:?}");
        assert!(
            c.header("traceparent").is_some_and(is_valid_traceparent),
            "traceparent: {c:?}"
        );
    }
}

/// Order ids `{prefix}-{i}` chosen so that every shard has exactly `per_shard` of them.
pub fn orders_covering_shards(prefix: &str, per_shard: usize, env: &TestEnv) -> Vec<String> {
    let mut count = vec![0usize; usize::from(env.shards.get())];
    let mut out = Vec::new();
    for i in 0.. {
        if count.iter().all(|n| *n == per_shard) {
            break;
        }
        let id = format!("{prefix}-{i}");
        let shard = usize::from(env.shard_of(&id));
        if count[shard] < per_shard {
            count[shard] += 1;
            out.push(id);
        }
    }
    out
}

/// Waits until the downstream answered every one of `events` 2xx and every
/// shard queue is drained (everything acked: no redelivery can add calls
/// after that), then checks that each event reached it exactly once and each
/// order in seq order. Returns the calls for further checks.
pub async fn assert_all_delivered_once_in_order(
    env: &TestEnv,
    downstream: &Downstream,
    events: &[Event],
) -> Vec<Call> {
    let calls = wait_all_answered(env, downstream, events).await;
    assert_exactly_once(&calls, events);
    assert_in_order_and_complete(&calls, events);
    calls
}

/// Waits until every event was answered 2xx and the shard queues drained;
/// the calls then.
pub async fn wait_all_answered(
    env: &TestEnv,
    downstream: &Downstream,
    events: &[Event],
) -> Vec<Call> {
    downstream
        .wait_for(
            &format!("all {} events answered", events.len()),
            crate::PROCESSING,
            |calls| all_ok(calls, events),
        )
        .await;
    env.wait_shard_queues_drained(crate::PROCESSING).await;
    downstream.calls()
}

/// Like [`assert_all_delivered_once_in_order`], counting only the calls the
/// downstream answered 2xx (what it processed): for a downstream that was
/// out for a while, where failed calls repeat by design.
pub async fn assert_all_answered_once_in_order(
    env: &TestEnv,
    downstream: &Downstream,
    events: &[Event],
) -> Vec<Call> {
    let calls = wait_all_answered(env, downstream, events).await;
    let answered: Vec<Call> = calls.iter().filter(|c| c.ok()).cloned().collect();
    assert_exactly_once(&answered, events);
    assert_in_order_and_complete(&answered, events);
    calls
}
