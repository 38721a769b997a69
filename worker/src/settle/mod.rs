//! Settle, the last stage: an outcome to the broker. The `match` in
//! `settle_traced` is the one place an [`Outcome`] meets the broker for the
//! serial and concurrent paths (ack, sleep and retry, hold, or dead-letter
//! then ack); a group's committed events are acked through [`acks`], the one
//! door for acks, whose `multiple` ack never covers a delivery still unacked.
//! Retries in place are `retry`'s; dead letters (published confirmed, on the
//! supervisor's dead-letter connection) are `dead_letter`'s.

pub(crate) mod acks;
mod dead_letter;

pub(crate) use dead_letter::DeadLetters;
pub(crate) mod retry;

use std::future::Future;
use std::time::{Duration, SystemTime};

use shardline_contract::telemetry::outcome;
use tokio::time::Instant;

use shardline_contract::OrderKey;

use crate::attempt::Processor;
use crate::breaker::Judgement;
use crate::context::ShardContext;
use crate::dedup::{Done, HeldClaim, OrderState, Written};
use crate::delivery::{Decoded, Directive, Message, Outcome, Ready, Tried};
use crate::handler::HandlerError;
use crate::trace::ProcessTrace;
use dead_letter::{dead_letter, letter_of};
use retry::{Budget, Next};

/// The deliveries behind the one being settled, as settling may use them
/// (intake's read-ahead is one; a concurrent shard has none): the next one,
/// to claim with this commit, and events of other orders for the breaker's
/// evidence.
pub(crate) trait Upcoming {
    /// The next delivery if the broker has already sent it; never waits.
    fn peek(&mut self, processor: &Processor) -> Option<&mut Ready>;

    /// Forgets the verdict asked for early for the next delivery (a dead
    /// letter made since may have quarantined its order).
    fn forget_admission(&mut self);

    /// An event of another order than `order_key` that may be tried as the
    /// breaker's evidence, without waiting; `None` when none has come yet.
    fn take_other(&mut self, order_key: &str, processor: &Processor) -> Option<Ready>;

    /// Waits for the broker's next delivery and keeps it (cancel-safe).
    fn arrival(&mut self, processor: &Processor) -> impl Future<Output = ()>;

    /// Puts deliveries back at the front, in their order.
    fn unpark(&mut self, deliveries: Vec<Ready>);
}

/// How a delivery left [`settle`].
pub(crate) enum Settled {
    /// Acked (processed, duplicate or dead-lettered). `order_key` is set when
    /// the event had a seq, so its order's held successors may run.
    Done { order_key: Option<OrderKey> },
    /// A newer consumer wrote the event's order: left unacked, and the
    /// shard's consumer must stop (it lost the shard).
    Fenced,
    /// Ahead of its order's sequence: hand it to the gate, unacked.
    Hold {
        ready: Box<Ready>,
        order_key: OrderKey,
        seq: u64,
        start: bool,
    },
}

/// Processes `ready` until it is acked or held. `in_flight` holds the dedup
/// key while a claim may be held, so that a caller who abandons this future can
/// release it. `lookahead` (serial shards only) lets the commit admit the next
/// delivery in the same round trip. Log lines about the event carry its trace and span ids (fields,
/// not a per-event `tracing` span: that would format both ids for every event).
pub(crate) async fn settle<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    dead_letters: &impl DeadLetters,
    store: &mut S,
    ready: Ready,
    directive: Directive,
    lookahead: Option<&mut U>,
    in_flight: &mut Option<HeldClaim>,
) -> Result<Settled, lapin::Error> {
    let mut ready = ready;
    let (trace, tried) = match ready.tried.take() {
        Some(tried) => (tried.trace, Some(tried.outcome)),
        None => (
            ctx.processor
                .start_trace(&Message::of(&ready.delivery), ready.decoded.as_ref().ok()),
            None,
        ),
    };
    let delivery = Delivery {
        ready,
        directive,
        trace,
        tried,
    };
    settle_traced(ctx, dead_letters, store, delivery, lookahead, in_flight).await
}

/// A delivery on its way through [`settle`].
struct Delivery {
    ready: Ready,
    directive: Directive,
    trace: ProcessTrace,
    /// The outcome of its first call, made already (in a group, or as the
    /// breaker's evidence).
    tried: Option<Outcome>,
}

async fn settle_traced<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    dead_letters: &impl DeadLetters,
    store: &mut S,
    mut delivery: Delivery,
    mut lookahead: Option<&mut U>,
    in_flight: &mut Option<HeldClaim>,
) -> Result<Settled, lapin::Error> {
    let taken = std::time::Instant::now();
    let mut attempt = 1;
    let mut first_failed_at = None;
    let mut budget = Budget::new(ctx.processor.breaker());
    loop {
        let outcome = next_outcome(ctx, store, &mut delivery, attempt, in_flight).await;
        let Delivery { ready, trace, .. } = &delivery;
        let decoded = ready.decoded.as_ref().ok();
        let outcome = match (outcome, decoded) {
            (Outcome::Failed { error }, Some(decoded)) => {
                first_failed_at.get_or_insert_with(SystemTime::now);
                let lookahead = lookahead.as_deref_mut();
                match retry_delay(ctx, store, decoded, &mut budget, &error, lookahead).await {
                    Some(after) => {
                        wait_to_retry(ctx, trace, attempt, after, &error).await;
                        attempt += 1;
                        continue;
                    }
                    None => retry::exhausted(&error, attempt),
                }
            }
            (Outcome::Failed { error }, None) => retry::exhausted(&error, attempt),
            (outcome, _) => outcome,
        };
        match outcome {
            Outcome::Processed => {
                if let Some(decoded) = decoded
                    && commit(ctx, store, lookahead.as_deref_mut(), decoded).await
                        == Written::Fenced
                {
                    return Ok(fenced(ctx, in_flight, trace));
                }
                acks::ack_one(&ready.delivery).await?;
                ctx.metrics.processed(taken.elapsed());
                delivery.trace.finish(outcome::PROCESSED, attempt);
                break;
            }
            Outcome::Duplicate => {
                if let Some(decoded) = decoded {
                    ctx.processor.duplicate(store, decoded).await;
                }
                acks::ack_one(&ready.delivery).await?;
                ctx.metrics.duplicate();
                delivery.trace.finish(outcome::DUPLICATE, 0);
                break;
            }
            Outcome::Fenced => return Ok(fenced(ctx, in_flight, trace)),
            // Resolved above: a failure without an event is dead-lettered.
            Outcome::Failed { .. } => continue,
            Outcome::Wait(after) => {
                trace.claim_wait(after);
                tracing::warn!(shard = %ctx.shard, wait = ?after, trace_id = %trace.span_context().trace_id(), "event claimed by another consumer; waiting for its lease");
                tokio::time::sleep(after).await;
            }
            Outcome::Hold { start } => {
                *in_flight = None;
                return Ok(held(delivery, start));
            }
            Outcome::DeadLetter {
                reason,
                error,
                attempts,
            } => {
                let failed_at = first_failed_at.unwrap_or_else(SystemTime::now);
                let letter = letter_of(ctx, &delivery, (reason, error, attempts), failed_at);
                let lookahead = lookahead.as_deref_mut();
                let ready = &delivery.ready;
                let written =
                    dead_letter(ctx, dead_letters, store, ready, &letter, lookahead).await?;
                if written == Written::Fenced {
                    // Its letter is in the DLQ; a replay of it is a
                    // duplicate if the newer owner processed the event.
                    return Ok(fenced(ctx, in_flight, &delivery.trace));
                }
                ctx.metrics.dead_lettered(reason);
                tracing::warn!(
                    shard = %ctx.shard, reason = %reason, attempts, dead_letter_id = %letter.id,
                    error = %letter.error, trace_id = %delivery.trace.span_context().trace_id(),
                    span_id = %delivery.trace.span_context().span_id(), "event dead-lettered"
                );
                let id = &letter.id;
                delivery
                    .trace
                    .dead_lettered(reason, attempts, id, &letter.error);
                break;
            }
        }
    }
    *in_flight = None;
    let order_key = delivery
        .ready
        .decoded
        .ok()
        .filter(|d| d.envelope.seq.is_some())
        .map(|d| d.order_key);
    Ok(Settled::Done { order_key })
}

/// The next outcome of `delivery`: its directed dead letter, the outcome of
/// the call made before (in a group, or as the breaker's evidence), or that
/// of attempt number `attempt`.
async fn next_outcome<S: OrderState>(
    ctx: &ShardContext,
    store: &mut S,
    delivery: &mut Delivery,
    attempt: u32,
    in_flight: &mut Option<HeldClaim>,
) -> Outcome {
    let bypass = delivery.directive == Directive::Bypass;
    let ready = &mut delivery.ready;
    match (&ready.decoded, &delivery.directive) {
        (_, Directive::DeadLetter(reason, error)) => Outcome::DeadLetter {
            reason: *reason,
            error: error.clone(),
            attempts: 0,
        },
        (Ok(decoded), _) => {
            *in_flight = Some(HeldClaim::of(decoded.claim()));
            let admitted = ready.admitted.take();
            match delivery.tried.take() {
                Some(outcome) => outcome,
                None => {
                    let msg = Message::of(&ready.delivery);
                    let trace = &delivery.trace;
                    ctx.processor
                        .attempt(store, &msg, decoded, attempt, admitted, bypass, trace)
                        .await
                }
            }
        }
        (Err(outcome), _) => outcome.clone(),
    }
}

/// Counts, traces and logs a failed attempt, then waits `after` before the next.
async fn wait_to_retry(
    ctx: &ShardContext,
    trace: &ProcessTrace,
    attempt: u32,
    after: Duration,
    error: &HandlerError,
) {
    ctx.metrics.retried();
    trace.retry(attempt, after, error);
    tracing::warn!(shard = %ctx.shard, attempt, retry_in = ?after, %error, fault = %error.fault(), trace_id = %trace.span_context().trace_id(), span_id = %trace.span_context().span_id(), "handler failed; retrying in place");
    tokio::time::sleep(after).await;
}

/// A delivery ahead of its order's sequence, for the gate (unacked). Only
/// an attempt holds an event, and only a decoded one is attempted.
fn held(delivery: Delivery, start: bool) -> Settled {
    delivery.trace.finish(outcome::HELD, 0);
    let ready = Box::new(delivery.ready);
    let order = ready
        .decoded
        .as_ref()
        .ok()
        .map(|d| (d.order_key.clone(), d.envelope.seq.unwrap_or_default()));
    match order {
        Some((order_key, seq)) => Settled::Hold {
            ready,
            order_key,
            seq,
            start,
        },
        None => {
            // Cannot happen (see above); were it to, the delivery stays
            // unacked and the consumer stops, for the broker to redeliver.
            tracing::error!("a delivery without an envelope was to be held; left unacked");
            Settled::Fenced
        }
    }
}

/// After a failure that may be retried: the delay before the next attempt,
/// or `None` when the event is to be dead-lettered (its budget is spent and
/// the breaker calls it poison). An outage, or a verdict still pending after
/// the evidence wait, starts its budget again.
async fn retry_delay<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    store: &mut S,
    decoded: &Decoded,
    budget: &mut Budget,
    error: &HandlerError,
    lookahead: Option<&mut U>,
) -> Option<Duration> {
    let policy = ctx.processor.retry_policy();
    match budget.after_failure(policy, ctx.processor.breaker(), error) {
        Next::Retry(after) => Some(after),
        Next::Exhausted => match judge(ctx, store, decoded, budget, lookahead).await {
            Judgement::Poison => None,
            Judgement::Outage | Judgement::Pending => {
                *budget = Budget::new(ctx.processor.breaker());
                Some(Duration::ZERO)
            }
        },
    }
}

/// Whether an event that used its retryable attempts met a poison event or an
/// outage (`breaker.rs`): without a breaker, poison. While the verdict is
/// pending, a serial shard tries events of other orders from its window here
/// (one attempt each, left for its loop to settle), a concurrent shard asks its loop for one
/// (`ShardContext::evidence`); at most one window later without an answer
/// the event is dead-lettered as without a breaker.
async fn judge<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    store: &mut S,
    decoded: &Decoded,
    budget: &Budget,
    mut lookahead: Option<&mut U>,
) -> Judgement {
    let Some(breaker) = ctx.processor.breaker() else {
        return Judgement::Poison;
    };
    let asked_at = Instant::now();
    let deadline = asked_at + breaker.evidence_wait();
    let mut changes = breaker.changes();
    let _judging = breaker.judging();
    let order = decoded.order_key.as_str();
    loop {
        changes.borrow_and_update();
        let judgement = breaker.judge(order, budget.since, budget.epoch, asked_at);
        if judgement != Judgement::Pending {
            return judgement;
        }
        if Instant::now() >= deadline {
            tracing::warn!(shard = %ctx.shard, order = %decoded.envelope.order_id, wait = ?breaker.evidence_wait(), "no call of another order to tell an outage from a poison event: dead-lettered as without a breaker");
            return Judgement::Poison;
        }
        match lookahead.as_deref_mut() {
            Some(lookahead) => {
                if let Some(other) = lookahead.take_other(order, &ctx.processor) {
                    evidence_attempt(ctx, store, other, lookahead).await;
                    continue;
                }
                tokio::select! {
                    _ = changes.changed() => {}
                    () = lookahead.arrival(&ctx.processor) => {}
                    () = tokio::time::sleep_until(deadline) => {}
                }
            }
            None => {
                ctx.evidence.notify_one();
                tokio::select! {
                    _ = changes.changed() => {}
                    () = tokio::time::sleep_until(deadline) => {}
                }
            }
        }
    }
}

/// The first attempt at `other`, an event of another order, as the breaker's
/// evidence: its outcome is recorded by the breaker when the call ends. The
/// event goes back, unsettled, to the front of the lookahead (the deliveries
/// before it are of other orders) with that outcome (`Ready::tried`): the
/// shard's loop settles it from there, after the waiting event.
async fn evidence_attempt<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    store: &mut S,
    mut other: Ready,
    lookahead: &mut U,
) {
    if let Ok(decoded) = &other.decoded {
        let msg = Message::of(&other.delivery);
        let trace = ctx.processor.start_trace(&msg, Some(decoded));
        let admitted = other.admitted.take();
        let outcome = ctx
            .processor
            .attempt(store, &msg, decoded, 1, admitted, false, &trace)
            .await;
        other.tried = Some(Box::new(Tried { outcome, trace }));
    }
    lookahead.unpark(vec![other]);
}

/// A write was fenced: the event stays unacked for the shard's newer owner.
fn fenced(ctx: &ShardContext, in_flight: &mut Option<HeldClaim>, trace: &ProcessTrace) -> Settled {
    *in_flight = None;
    ctx.metrics.fenced();
    tracing::warn!(shard = %ctx.shard, trace_id = %trace.span_context().trace_id(), "a newer consumer of this shard wrote the event's order: this consumer lost the shard and stops; the event stays unacked");
    Settled::Fenced
}

/// Acks a second copy of an event the gate already holds.
pub(crate) async fn ack_duplicate(ctx: &ShardContext, ready: &Ready) -> Result<(), lapin::Error> {
    acks::ack_one(&ready.delivery).await?;
    ctx.metrics.duplicate();
    Ok(())
}

/// Commits the event (dedup and gate); when the next delivery is already here
/// (serial shards), admits it in the same round trip.
async fn commit<S: OrderState, U: Upcoming>(
    ctx: &ShardContext,
    store: &mut S,
    lookahead: Option<&mut U>,
    done: &Decoded,
) -> Written {
    let done = Done {
        claim: done.claim(),
        kind: &done.kind_code,
        replay_of: done.replay_of(),
    };
    let lookahead = lookahead.filter(|_| ctx.processor.claims_early());
    match lookahead.and_then(|lookahead| lookahead.peek(&ctx.processor)) {
        Some(Ready {
            delivery,
            decoded: Ok(next),
            admitted: admitted @ None,
            ..
        }) if !next.replay_unchecked() => {
            let admission = next.admission(delivery.redelivered, false);
            let (written, verdict) = store.commit_and_admit(&done, &admission).await;
            *admitted = Some(verdict);
            written
        }
        _ => store.commit(&done).await,
    }
}

#[cfg(test)]
mod tests;
