//! Drives one delivery to its end. The `match` in [`settle`] is the one place an
//! [`Outcome`] meets the broker: ack, sleep and retry, hold, or dead-letter then
//! ack. Dead letters go out through the publisher crate's confirmed publish, on
//! the supervisor's dead-letter connection; acks on the shard's channel.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use lapin::options::BasicAckOptions;
use shardline_publisher::{ConfirmChannel, ConfirmError};
use shardline_topology::headers::{DeadLetter, FailReason};
use shardline_topology::letters;
use shardline_topology::telemetry::outcome;
use shardline_topology::{Names, ShardId};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::breaker::Judgement;
use crate::dedup::{Done, HeldClaim, Written};
use crate::gate::Directive;
use crate::handler::HandlerError;
use crate::lookahead::{Lookahead, Ready, Tried};
use crate::metrics::ShardMetrics;
use crate::process::{Decoded, Message, Outcome, ProcessTrace, Processor};
use crate::retry::{self, Budget, Next};
use crate::store::RedisSlot;

/// While the dead-letter queue cannot take a message, how long to wait between
/// tries. The event stays unacked meanwhile: nothing is acked before its copy is.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// What one shard needs to settle its deliveries.
pub(crate) struct ShardContext {
    pub(crate) processor: Processor,
    pub(crate) names: Names,
    pub(crate) shard: ShardId,
    pub(crate) metrics: Arc<ShardMetrics>,
    /// A concurrent shard's event waits for the breaker's evidence: the
    /// shard's loop starts one event of another order beyond its slots.
    pub(crate) evidence: Notify,
}

/// How a delivery left [`settle`].
pub(crate) enum Settled {
    /// Acked (processed, duplicate or dead-lettered). `order_key` is set when
    /// the event had a seq, so its order's held successors may run.
    Done { order_key: Option<String> },
    /// A newer consumer wrote the event's order: left unacked, and the
    /// shard's consumer must stop (it lost the shard).
    Fenced,
    /// Ahead of its order's sequence: hand it to the gate, unacked.
    Hold {
        ready: Box<Ready>,
        order_key: String,
        seq: u64,
        start: bool,
    },
}

/// Processes `ready` until it is acked or held. `in_flight` holds the dedup
/// key while a claim may be held, so that a caller who abandons this future can
/// release it. `lookahead` (serial shards only) lets the commit admit the next
/// delivery in the same round trip. Log lines about the event carry its trace and span ids (fields,
/// not a per-event `tracing` span: that would format both ids for every event).
pub(crate) async fn settle(
    ctx: &ShardContext,
    dead_letters: &ConfirmChannel,
    redis: &mut RedisSlot,
    ready: Ready,
    directive: Directive,
    lookahead: Option<&mut Lookahead>,
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
    settle_traced(ctx, dead_letters, redis, delivery, lookahead, in_flight).await
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

async fn settle_traced(
    ctx: &ShardContext,
    dead_letters: &ConfirmChannel,
    redis: &mut RedisSlot,
    mut delivery: Delivery,
    mut lookahead: Option<&mut Lookahead>,
    in_flight: &mut Option<HeldClaim>,
) -> Result<Settled, lapin::Error> {
    let taken = std::time::Instant::now();
    let mut attempt = 1;
    let mut first_failed_at = None;
    let mut budget = Budget::new(ctx.processor.breaker());
    loop {
        let outcome = next_outcome(ctx, redis, &mut delivery, attempt, in_flight).await;
        let Delivery { ready, trace, .. } = &delivery;
        let decoded = ready.decoded.as_ref().ok();
        let outcome = match (outcome, decoded) {
            (Outcome::Failed { error }, Some(decoded)) => {
                first_failed_at.get_or_insert_with(SystemTime::now);
                let lookahead = lookahead.as_deref_mut();
                match retry_delay(ctx, redis, decoded, &mut budget, &error, lookahead).await {
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
                    && commit(ctx, redis, lookahead.as_deref_mut(), decoded).await
                        == Written::Fenced
                {
                    return Ok(fenced(ctx, in_flight, trace));
                }
                ready.delivery.ack(BasicAckOptions::default()).await?;
                ctx.metrics.processed(taken.elapsed());
                delivery.trace.finish(outcome::PROCESSED, attempt);
                break;
            }
            Outcome::Duplicate => {
                if let Some(decoded) = decoded {
                    ctx.processor.duplicate(redis, decoded).await;
                }
                ready.delivery.ack(BasicAckOptions::default()).await?;
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
                    dead_letter(ctx, dead_letters, redis, ready, &letter, lookahead).await?;
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
async fn next_outcome(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
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
                        .attempt(redis, &msg, decoded, attempt, admitted, bypass, trace)
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

/// A delivery ahead of its order's sequence, for the gate (unacked).
fn held(delivery: Delivery, start: bool) -> Settled {
    delivery.trace.finish(outcome::HELD, 0);
    let (order_key, seq) = delivery
        .ready
        .decoded
        .as_ref()
        .map(|d| (d.order_key.clone(), d.envelope.seq.unwrap_or_default()))
        .unwrap_or_default();
    Settled::Hold {
        ready: Box::new(delivery.ready),
        order_key,
        seq,
        start,
    }
}

/// The dead letter of `delivery`, for its reason, error text and attempts.
fn letter_of(
    ctx: &ShardContext,
    delivery: &Delivery,
    (reason, error, attempts): (FailReason, String, u32),
    first_failed_at: SystemTime,
) -> DeadLetter {
    DeadLetter {
        reason,
        error,
        retry_count: attempts,
        shard: ctx.shard.get(),
        original_routing_key: delivery.ready.delivery.routing_key.to_string(),
        first_failed_at,
        // Time-ordered: a quarantine sorts letters of one seq by it.
        id: uuid::Uuid::now_v7().to_string(),
        trace: Some(delivery.trace.span_context().clone()),
    }
}

/// After a failure that may be retried: the delay before the next attempt,
/// or `None` when the event is to be dead-lettered (its budget is spent and
/// the breaker calls it poison). An outage, or a verdict still pending after
/// the evidence wait, starts its budget again.
async fn retry_delay(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    decoded: &Decoded,
    budget: &mut Budget,
    error: &HandlerError,
    lookahead: Option<&mut Lookahead>,
) -> Option<Duration> {
    let policy = ctx.processor.retry_policy();
    match budget.after_failure(policy, ctx.processor.breaker(), error) {
        Next::Retry(after) => Some(after),
        Next::Exhausted => match judge(ctx, redis, decoded, budget, lookahead).await {
            Judgement::Poison => None,
            Judgement::Outage | Judgement::Pending => {
                *budget = Budget::new(ctx.processor.breaker());
                Some(Duration::ZERO)
            }
        },
    }
}

/// Publishes `letter` (confirmed), then writes the order state and the
/// letter's index entry in one step, then acks. `Fenced` when a newer
/// consumer wrote the order: the event stays unacked.
async fn dead_letter(
    ctx: &ShardContext,
    dead_letters: &ConfirmChannel,
    redis: &mut RedisSlot,
    ready: &Ready,
    letter: &DeadLetter,
    lookahead: Option<&mut Lookahead>,
) -> Result<Written, lapin::Error> {
    let msg = Message::of(&ready.delivery);
    let properties = letter.properties(msg.properties);
    publish_dead_letter(dead_letters, &ctx.names, &msg, letter, &properties).await?;
    let entry = letters::entry_of(&properties, msg.body);
    match &ready.decoded {
        Ok(decoded) => {
            if ctx.processor.dead_lettered(redis, decoded, &entry).await == Written::Fenced {
                return Ok(Written::Fenced);
            }
            if ctx.processor.quarantines()
                && let Some(lookahead) = lookahead
            {
                lookahead.forget_admission();
            }
        }
        Err(_) => ctx.processor.index_dead_letter(redis, &entry).await,
    }
    ready.delivery.ack(BasicAckOptions::default()).await?;
    Ok(Written::Done)
}

/// Whether an event that used its retryable attempts met a poison event or an
/// outage (`breaker.rs`): without a breaker, poison. While the verdict is
/// pending, a serial shard tries events of other orders from its window here
/// (one attempt each, left for its loop to settle), a concurrent shard asks its loop for one
/// (`ShardContext::evidence`); at most one window later without an answer
/// the event is dead-lettered as without a breaker.
async fn judge(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    decoded: &Decoded,
    budget: &Budget,
    mut lookahead: Option<&mut Lookahead>,
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
                    evidence_attempt(ctx, redis, other, lookahead).await;
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
async fn evidence_attempt(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    mut other: Ready,
    lookahead: &mut Lookahead,
) {
    if let Ok(decoded) = &other.decoded {
        let msg = Message::of(&other.delivery);
        let trace = ctx.processor.start_trace(&msg, Some(decoded));
        let admitted = other.admitted.take();
        let outcome = ctx
            .processor
            .attempt(redis, &msg, decoded, 1, admitted, false, &trace)
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
    ready.delivery.ack(BasicAckOptions::default()).await?;
    ctx.metrics.duplicate();
    Ok(())
}

/// Commits the event (dedup and gate); when the next delivery is already here
/// (serial shards), admits it in the same round trip.
async fn commit(
    ctx: &ShardContext,
    redis: &mut RedisSlot,
    lookahead: Option<&mut Lookahead>,
    done: &Decoded,
) -> Written {
    let dedup = ctx.processor.dedup();
    let done = Done {
        claim: done.claim(),
        kind: &done.kind_code,
        replay_of: done.replay_of.as_deref(),
    };
    let lookahead = lookahead.filter(|_| ctx.processor.claims_early());
    match lookahead.and_then(|lookahead| lookahead.peek(&ctx.processor)) {
        Some(Ready {
            delivery,
            decoded: Ok(next),
            admitted: admitted @ None,
            ..
        }) => {
            let admission = next.admission(delivery.redelivered, false);
            let (written, verdict) = dedup.commit_and_admit(redis, &done, &admission).await;
            *admitted = Some(verdict);
            written
        }
        _ => dedup.commit(redis, &done).await,
    }
}

/// Publishes the original body and properties, plus the dead-letter headers, to
/// the dead-letter exchange with the reason as routing key, and waits for the
/// broker's confirm. A refusal (nack, unroutable) is retried after a pause with
/// the event unacked, never skipped; a channel or connection error ends the
/// shard's consumer, for the supervisor to reconnect both connections.
async fn publish_dead_letter(
    channel: &ConfirmChannel,
    names: &Names,
    msg: &Message<'_>,
    letter: &DeadLetter,
    properties: &lapin::BasicProperties,
) -> Result<(), lapin::Error> {
    let exchange = &names.dead_letter_exchange;
    loop {
        let published = channel
            .publish(
                exchange,
                letter.reason.as_str(),
                msg.body,
                properties.clone(),
            )
            .await;
        match published {
            Ok(()) => return Ok(()),
            Err(ConfirmError::Channel(e)) => return Err(e),
            Err(refused @ ConfirmError::Unroutable { .. }) => tracing::error!(
                %exchange, error = %refused,
                "dead letter unroutable: no queue bound to the dead-letter exchange \
                 (topology not applied? run `shardline topology apply`); event kept unacked, retrying"
            ),
            Err(refused) => tracing::error!(
                %exchange, error = %refused,
                "broker refused the dead letter; event kept unacked, retrying"
            ),
        }
        tokio::time::sleep(DEAD_LETTER_RETRY).await;
    }
}
