//! Group commit (`--group-commit`, serial shards): the first deliveries that
//! the broker has already sent are claimed in one Redis call, their handlers
//! run one after another, and their commits travel with the next group's
//! claims in one call; one ack (`multiple`) acks the group. Redis calls and
//! acks per event fall from one to one per group.
//!
//! What it costs: a worker that dies after a group's calls and before its
//! commit repeats those calls — up to a group per shard, where the serial
//! path repeats at most the one event in its handler (docs/semantics.md §3). So it is for
//! fast handlers whose effects are idempotent downstream.
//!
//! Only first deliveries of sequenced events join a group, and only while
//! calls are neither paused by the breaker nor rate-limited; a redelivered
//! event (it may be the one that killed the last process), a replay, an
//! unsequenced event and an event the gate released take the serial path,
//! as does every event from the first one in a group that is not claimed
//! (duplicate, gap…) or whose call fails. A group never holds two events of
//! one order unless they are consecutive seqs; the second is *chained*: it
//! runs under its predecessor's claim and its commit moves the gate on from
//! its predecessor's.

use std::collections::HashMap;

use shardline_contract::OrderKey;
use shardline_contract::telemetry::outcome;
use tokio_util::sync::CancellationToken;

use crate::attempt::Processor;
use crate::context::ShardContext;
use crate::dedup::{Done, GroupAdmit, GroupReply, HeldClaim, OrderState, Start, Verdict};
use crate::delivery::{Decoded, Message, Outcome, Ready, Tried};
use crate::intake::gate::Gate;
use crate::intake::lookahead::{Deliveries, Lookahead};
use crate::live::{published_ms, unix_ms};
use crate::settle::acks;
use crate::trace::ProcessTrace;

/// How a run of groups ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grouped {
    /// Its events are acked or back in the lookahead, in delivery order.
    Done,
    /// A newer consumer wrote an order of the group: the events not
    /// committed stay unacked, and the shard's consumer must stop.
    Fenced,
}

/// Whether a delivery may join a group: a sequenced event, first delivered,
/// not a replay, not yet admitted (or claimed early by the serial path).
pub(crate) fn joins(ready: &Ready) -> bool {
    let Ok(decoded) = &ready.decoded else {
        return false;
    };
    decoded.envelope.seq.is_some()
        && decoded.replay.is_none()
        && !ready.delivery.redelivered
        && matches!(ready.admitted, None | Some(Verdict::Claimed))
        && ready.tried.is_none()
}

/// An event of a group.
struct Member {
    ready: Ready,
    /// Runs under its order's earlier event's claim in the same group.
    chained: bool,
}

impl Member {
    fn seq(&self) -> u64 {
        self.decoded().envelope.seq.unwrap_or_default()
    }

    fn decoded(&self) -> &Decoded {
        match &self.ready.decoded {
            Ok(decoded) => decoded,
            // `joins` lets only decoded events in.
            Err(_) => unreachable!("a group member is decoded"),
        }
    }

    fn admit(&self) -> GroupAdmit<'_> {
        GroupAdmit {
            admission: self.decoded().admission(false, false),
            seq: self.seq(),
            chained: self.chained,
        }
    }

    fn done(&self) -> Done<'_> {
        let decoded = self.decoded();
        Done {
            claim: decoded.claim(),
            kind: &decoded.kind_code,
            replay_of: None,
        }
    }
}

/// Makes members of `first` and of `more` (each `joins`), up to the first
/// event of an order already in the group that is not its next seq; that one
/// and the rest are returned last.
fn members(first: Ready, more: Vec<Ready>) -> (Member, Vec<Member>, Vec<Ready>) {
    let first = Member {
        ready: first,
        chained: false,
    };
    let mut last: HashMap<OrderKey, u64> =
        HashMap::from([(first.decoded().order_key.clone(), first.seq())]);
    let mut others = Vec::with_capacity(more.len());
    let mut more = more.into_iter();
    while let Some(ready) = more.next() {
        let mut member = Member {
            ready,
            chained: false,
        };
        let (order, seq) = (member.decoded().order_key.clone(), member.seq());
        match last.get(&order) {
            Some(prev) if prev.checked_add(1) == Some(seq) => member.chained = true,
            Some(_) => {
                let rest = std::iter::once(member.ready).chain(more).collect();
                return (first, others, rest);
            }
            None => {}
        }
        last.insert(order, seq);
        others.push(member);
    }
    (first, others, Vec::new())
}

/// The members that `candidates` (each `joins`) make; the rest goes back
/// to the lookahead.
fn members_of(candidates: Vec<Ready>, lookahead: &mut Lookahead<impl Deliveries>) -> Vec<Member> {
    let mut candidates = candidates.into_iter();
    let Some(first) = candidates.next() else {
        return Vec::new();
    };
    let (first, others, rest) = members(first, candidates.collect());
    lookahead.unpark(rest);
    std::iter::once(first).chain(others).collect()
}

/// A group of two events or more, formed and not yet admitted.
pub(crate) struct Group(Vec<Member>);

impl Group {
    /// `first` and what joins it from the front of the lookahead, up to
    /// `max` events; `Err(first)` when nothing does (the serial path takes it).
    #[expect(
        clippy::result_large_err,
        reason = "the delivery comes back as it went in, unboxed like every other"
    )]
    pub(crate) fn form(
        first: Ready,
        lookahead: &mut Lookahead<impl Deliveries>,
        max: usize,
        processor: &Processor,
    ) -> Result<Self, Ready> {
        let more = lookahead.take_while(max.saturating_sub(1), processor, joins);
        let (first, others, rest) = members(first, more);
        lookahead.unpark(rest);
        if others.is_empty() {
            return Err(first.ready);
        }
        Ok(Self(std::iter::once(first).chain(others).collect()))
    }
}

/// Runs `group`, then the groups that the lookahead has after it, each up
/// to `max` events. The claims in flight are kept in `in_flight`, for the
/// caller to release if it abandons this.
#[expect(
    clippy::too_many_arguments,
    reason = "the serial loop's parts a group works with"
)]
pub(crate) async fn run_groups<S: OrderState>(
    ctx: &ShardContext,
    store: &mut S,
    lookahead: &mut Lookahead<impl Deliveries>,
    gate: &mut Gate<Ready>,
    group: Group,
    max: usize,
    shutdown: &CancellationToken,
    in_flight: &mut Vec<HeldClaim>,
) -> Result<Grouped, lapin::Error> {
    let Group(mut group) = group;
    let mut reply = call(store, &[], &group).await;
    loop {
        group = claimed(lookahead, group, reply.verdicts);
        if group.len() < 2 {
            // Not worth a group: the serial path takes it, claimed.
            let claimed = group.into_iter().map(|m| {
                let mut ready = m.ready;
                ready.admitted = Some(Verdict::Claimed);
                ready
            });
            lookahead.unpark(claimed.collect());
            return Ok(Grouped::Done);
        }
        *in_flight = group
            .iter()
            .filter(|m| !m.chained)
            .map(|m| HeldClaim::of(m.decoded().claim()))
            .collect();
        let started = std::time::Instant::now();
        let Ran { traces, failed } = run(ctx, &group).await;
        let rest = group.split_off(traces.len());
        // The next group, only when this one ran whole and nothing else waits
        // for its turn.
        let next = if rest.is_empty() && !shutdown.is_cancelled() && !gate.has_runnable() {
            let candidates = lookahead.take_while(max, &ctx.processor, joins);
            members_of(candidates, lookahead)
        } else {
            Vec::new()
        };
        reply = if group.is_empty() && next.is_empty() {
            GroupReply::default()
        } else {
            call(store, &group, &next).await
        };
        let committed = reply.committed.min(group.len());
        ack(lookahead, gate, &group[..committed]).await?;
        ctx.metrics.grouped(committed);
        for (member, trace) in group.iter().zip(traces).take(committed) {
            ctx.metrics.processed(started.elapsed());
            trace.finish(outcome::PROCESSED, 1);
            gate.passed(&member.decoded().order_key);
        }
        in_flight.clear();
        if reply.fenced {
            ctx.metrics.fenced();
            tracing::warn!(shard = %ctx.shard, uncommitted = group.len() - committed, "a newer consumer of this shard wrote an order of the group: this consumer lost the shard and stops; the group's uncommitted events stay unacked");
            return Ok(Grouped::Fenced);
        }
        if !rest.is_empty() {
            lookahead.unpark(after_failure(store, rest, failed).await);
            return Ok(Grouped::Done);
        }
        if next.is_empty() {
            return Ok(Grouped::Done);
        }
        group = next;
    }
}

/// One group call: commits `done`, admits `next`.
async fn call<S: OrderState>(store: &mut S, done: &[Member], next: &[Member]) -> GroupReply {
    let commits: Vec<Done<'_>> = done.iter().map(Member::done).collect();
    let admits: Vec<GroupAdmit<'_>> = next.iter().map(Member::admit).collect();
    store.group(&commits, &admits).await
}

/// The claimed members of a group, from the first; the others go back to
/// the lookahead, the first of them with its verdict (the serial path acts
/// on it), the rest to be admitted there.
fn claimed(
    lookahead: &mut Lookahead<impl Deliveries>,
    group: Vec<Member>,
    verdicts: Vec<Verdict>,
) -> Vec<Member> {
    let mut verdicts = verdicts.into_iter();
    let mut claimed = Vec::with_capacity(group.len());
    let mut group = group.into_iter();
    for member in group.by_ref() {
        match verdicts.next() {
            Some(Verdict::Claimed) => claimed.push(member),
            verdict => {
                let mut first = member.ready;
                first.admitted = verdict;
                lookahead.unpark(
                    std::iter::once(first)
                        .chain(group.map(|m| {
                            let mut ready = m.ready;
                            ready.admitted = None;
                            ready
                        }))
                        .collect(),
                );
                break;
            }
        }
    }
    claimed
}

/// The calls of a group, made in order up to the first that failed or
/// until calls are paused.
struct Ran {
    /// The spans of the members whose calls succeeded, from the first.
    traces: Vec<ProcessTrace>,
    /// The next member's call failed: what it made of the event, and its span.
    failed: Option<Tried>,
}

async fn run(ctx: &ShardContext, group: &[Member]) -> Ran {
    let processor = &ctx.processor;
    let mut ran = Ran {
        traces: Vec::with_capacity(group.len()),
        failed: None,
    };
    if let Some(first) = group.first() {
        ctx.metrics
            .watch
            .start_inflight(published_ms(&first.ready.delivery.properties, unix_ms()));
    }
    for member in group {
        if !processor.claims_early() {
            break;
        }
        let msg = Message::of(&member.ready.delivery);
        let trace = processor.start_trace(&msg, Some(member.decoded()));
        match processor.grouped_call(&msg, member.decoded(), &trace).await {
            Ok(()) => ran.traces.push(trace),
            Err(error) => {
                let outcome = Processor::outcome(Err(error), 1);
                ran.failed = Some(Tried { outcome, trace });
                break;
            }
        }
    }
    ctx.metrics.watch.clear_inflight();
    ran
}

/// The members from the first that did not succeed, for the serial path,
/// after the commit of those that did. A failed one goes on from its call
/// (`Ready::tried`) under a claim of its own: a chained one is admitted now
/// (its predecessor is committed), a retryable failure's start is given
/// back, as the serial path does. Members that did not run keep their
/// claims; chained ones have none and are admitted there.
async fn after_failure<S: OrderState>(
    store: &mut S,
    rest: Vec<Member>,
    mut failed: Option<Tried>,
) -> Vec<Ready> {
    let mut out = Vec::with_capacity(rest.len());
    for member in rest {
        let mut admitted = (!member.chained).then_some(Verdict::Claimed);
        let tried = failed.take();
        if tried.is_some() && member.chained {
            let admit = GroupAdmit {
                chained: false,
                ..member.admit()
            };
            admitted = store.group(&[], &[admit]).await.verdicts.into_iter().next();
        }
        let mut ready = member.ready;
        ready.admitted = admitted;
        if let Some(tried) = tried
            && ready.admitted == Some(Verdict::Claimed)
        {
            if matches!(tried.outcome, Outcome::Failed { .. })
                && let Ok(decoded) = &ready.decoded
            {
                store.renew(&decoded.claim(), Start::Ended).await;
            }
            ready.admitted = None;
            ready.tried = Some(Box::new(tried));
        }
        out.push(ready);
    }
    out
}

/// Acks the committed members (`settle::acks`): one `multiple` ack of the
/// last when they are consecutive deliveries and nothing below them is
/// unacked (the gate holds nothing, the lookahead keeps nothing earlier);
/// else one by one.
async fn ack(
    lookahead: &Lookahead<impl Deliveries>,
    gate: &Gate<Ready>,
    committed: &[Member],
) -> Result<(), lapin::Error> {
    let deliveries: Vec<&lapin::message::Delivery> =
        committed.iter().map(|m| &m.ready.delivery).collect();
    acks::ack_all(&deliveries, |high| {
        !gate.is_idle() || lookahead.keeps_below(high)
    })
    .await
}

#[cfg(test)]
mod tests {
    use futures_util::{StreamExt as _, stream};
    use tokio::time::Instant;

    use super::*;
    use crate::handler::HandlerError;
    use crate::testing::{Scripted, Shard, acked, event};

    /// A group of the first deliveries of A, B and C, formed as the serial
    /// loop forms it; run to its end. The ackers of the three deliveries.
    async fn run_group(shard: &Shard, gate: &mut Gate<Ready>) -> [lapin::Acker; 3] {
        let mut store = shard.consumer();
        let deliveries = [event(1, "A", 1), event(2, "B", 1), event(3, "C", 1)];
        let ackers = deliveries.each_ref().map(|(_, acker)| acker.clone());
        let sent: Vec<_> = deliveries.into_iter().map(|(d, _)| Ok(d)).collect();
        let mut lookahead = Lookahead::new(stream::iter(sent).chain(stream::pending()));
        let processor = &shard.ctx.processor;
        let first = lookahead.next(processor).await.unwrap().unwrap();
        let Ok(group) = Group::form(first, &mut lookahead, 8, processor) else {
            panic!("three first deliveries of three orders form a group");
        };
        let shutdown = CancellationToken::new();
        let mut in_flight = Vec::new();
        let (ctx, max) = (&shard.ctx, 8);
        let grouped = run_groups(
            ctx,
            &mut store,
            &mut lookahead,
            gate,
            group,
            max,
            &shutdown,
            &mut in_flight,
        )
        .await
        .unwrap();
        assert_eq!(grouped, Grouped::Done);
        assert!(in_flight.is_empty());
        ackers
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_is_committed_in_one_call_and_acked_with_one_multiple_ack() {
        let handler = Scripted::answering(vec![]);
        let shard = Shard::new(handler.clone());
        let mut gate = Gate::new(&shard.config);
        let ackers = run_group(&shard, &mut gate).await;
        assert_eq!(handler.calls(), 3);
        for order in ["A", "B", "C"] {
            assert_eq!(shard.order(order).l, Some(1), "{order} committed");
        }
        // A mock acker is spent only by its own ack: one `multiple` ack of
        // the last covers the other two.
        assert_eq!(ackers.each_ref().map(acked), [false, false, true]);
    }

    #[tokio::test(start_paused = true)]
    async fn with_a_held_delivery_below_each_member_is_acked_alone() {
        let handler = Scripted::answering(vec![]);
        let shard = Shard::new(handler.clone());
        let mut gate = Gate::new(&shard.config);
        let (held, held_acker) = event(0, "D", 5);
        let held = shard.ready(held);
        let key = held.decoded.as_ref().unwrap().order_key.clone();
        let now = Instant::now();
        assert!(gate.hold(Box::new(held), &key, 5, true, now).is_ok());
        let ackers = run_group(&shard, &mut gate).await;
        assert_eq!(ackers.each_ref().map(acked), [true, true, true]);
        assert!(!acked(&held_acker), "the held delivery stays unacked");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_call_ends_the_group_and_goes_on_on_the_serial_path() {
        let handler = Scripted::answering(vec![Ok(()), Err(HandlerError::retryable("503"))]);
        let shard = Shard::new(handler.clone());
        let mut gate = Gate::new(&shard.config);
        let ackers = run_group(&shard, &mut gate).await;
        assert_eq!(
            handler.calls(),
            2,
            "C's call waits for B on the serial path"
        );
        assert_eq!(shard.order("A").l, Some(1));
        assert_eq!(shard.order("B").l, None, "B is not committed");
        assert_eq!(ackers.each_ref().map(acked), [true, false, false]);
    }
}
