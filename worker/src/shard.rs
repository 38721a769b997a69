//! One shard's consumer: take the shard (or stand by), process deliveries — one
//! at a time, or up to `--concurrency` at once, never two of one order (the
//! rules are `intake::schedule`'s) — and on stop finish the events in flight under
//! the drain deadline.
//!
//! Stopping never sends `basic.cancel`: after a cancel the read-ahead stays
//! checked out to this channel while the exclusive lock is already free, so
//! another consumer could read past it. The shard stops taking deliveries,
//! finishes the in-flight one, then closes its channel: the broker requeues
//! the read-ahead and the held events in order.

use std::collections::HashMap;
use std::pin::Pin;

use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::protocol::AMQPSoftError;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use shardline_connect::broker::soft_error;
use shardline_connect::declare;
use shardline_contract::reshard::Source;
use shardline_contract::status::HeldRef;
use shardline_publisher::ConfirmChannel;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::attempt::Processor;
use crate::breaker::Breaker;
use crate::config::Config;
use crate::context::ShardContext;
use crate::dedup::HeldClaim;
use crate::dedup::{OrderState as _, RedisOrderState};
use crate::delivery::{Directive, Ready};
use crate::intake::gate::{Expired, Gate, Holdable as _};
use crate::intake::group::{self, Group, Grouped};
use crate::intake::lookahead::Lookahead;
use crate::intake::schedule::{Entry, Schedule};
use crate::live::{ShardState, ShardWatch, Stamp, published_ms, unix_ms};
use crate::reshard::{RouteError, Routed, Router};
use crate::settle::{Settled, ack_duplicate, settle};

/// How long closing a channel or a connection may take. lapin's close waits
/// for the broker's close-ok, and on a connection whose I/O failed a moment
/// before (its node killed) that answer never comes: unbounded, the worker
/// would never reconnect.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a member of an elastic fleet tries a shard it was given while
/// the previous owner still holds it.
const HANDOVER_RETRY: Duration = Duration::from_millis(200);

/// The supervisor's two broker connections: deliveries and acks on one, dead
/// letters on the other (a publishing connection the broker may block under a
/// memory alarm must not hold up the acks).
#[derive(Clone, Copy)]
pub(crate) struct Connections<'a> {
    pub(crate) consume: &'a Connection,
    pub(crate) dead_letters: &'a Connection,
}

/// Why a shard's consumer stopped before it was told to.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ShardError {
    #[error("broker connection lost")]
    ConnectionLost,
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
    #[error("the broker cancelled the consumer (queue deleted?)")]
    ConsumerCancelled,
    #[error("a newer consumer of the shard wrote an order's state: this one lost the shard")]
    Fenced,
    #[error("told to stop while routing a delivery")]
    Stopped,
    #[error("a holding queue's consumer task crashed: {0}")]
    Crashed(String),
}

impl From<RouteError> for ShardError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::Broker(e) => Self::Broker(e),
            RouteError::Stopped => Self::Stopped,
        }
    }
}

/// Consumes one shard until `shutdown`; returns an error when the connection
/// (or the shard's channel) fails, for the supervisor to reconnect.
pub(crate) async fn consume_shard(
    conns: Connections<'_>,
    config: &Config,
    ctx: &ShardContext,
    router: &mut Router,
    redis: &mut RedisOrderState,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<(), ShardError> {
    let tag = match router.source {
        Source::Shard(_) => format!("{}/shard-{}", config.worker_name, ctx.shard),
        Source::Hold(m) => format!("{}/move-{}-to-{}", config.worker_name, m.0, ctx.shard),
    };
    // The shard's live state is its main consumer's; a holding queue's
    // consumer beside it leaves it alone.
    let main = matches!(router.source, Source::Shard(_));
    let set_state = |state| {
        if main {
            ctx.metrics.watch.set_state(state);
        }
    };
    let dead_letters = ConfirmChannel::open(conns.dead_letters).await?;
    let taken = take_shard(
        conns.consume,
        config,
        ctx,
        &router.queue,
        &tag,
        shutdown,
        conn_lost,
    )
    .await;
    let Some((channel, consumer)) = taken.inspect_err(|_| set_state(ShardState::Idle))? else {
        set_state(ShardState::Idle);
        return Ok(());
    };
    redis.new_consumer();
    set_state(if config.exclusive {
        ShardState::Consuming
    } else {
        ShardState::Registered
    });
    let mut gate = Gate::new(config);
    let mut lookahead = Lookahead::counting(consumer, gate.bytes().clone());
    let inputs = Loop {
        config,
        ctx,
        router,
        dead_letters: &dead_letters,
        redis,
        lookahead: &mut lookahead,
        gate: &mut gate,
        shutdown,
        conn_lost,
    };
    let result = if config.concurrency > 1 {
        run_concurrent(inputs).await
    } else {
        run_consumer(inputs).await
    };
    // Told to stop while routing: as any stop.
    let result = match result {
        Err(ShardError::Stopped) => Ok(()),
        other => other,
    };
    set_state(ShardState::Idle);
    lookahead.release(redis).await;
    if result.is_ok() {
        close(&channel, &dead_letters).await;
    }
    // Only now: a consumer dropped while its channel is open sends `basic.cancel`.
    drop(lookahead);
    result
}

/// Opens the shard's channel and consumes its queue, standing by while another
/// consumer holds it. `None` when told to stop first.
///
/// A standby keeps its channel and looks before it consumes (a passive
/// declare counts the holder's exclusive consumer) instead of having its
/// consume refused: a refusal is a channel error, and lapin (4.12) never frees
/// the id of a channel the broker closed. A standby of N shards retrying every
/// second used up its connection's 2,047 ids in 2,047/N seconds, then got a
/// stale refusal on a fresh channel and reconnected — every 2 s at 1,024
/// shards, dropping any shard it held with them. Only a consume that loses a
/// race with another worker's is refused now.
async fn take_shard(
    conn: &Connection,
    config: &Config,
    ctx: &ShardContext,
    queue: &str,
    tag: &str,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<Option<(Channel, Consumer)>, ShardError> {
    let mut standing_by = false;
    let mut home_down = false;
    let mut missing = false;
    let mut kept: Option<Channel> = None;
    loop {
        if shutdown.is_cancelled() {
            return Ok(None);
        }
        let channel = match kept.take() {
            Some(channel) if channel.status().connected() => channel,
            _ => shard_channel(conn, config).await?,
        };
        let retry = match try_consume(&channel, config, queue, tag).await {
            Ok(Some(consumer)) => {
                if config.exclusive {
                    tracing::info!(shard = %ctx.shard, %queue, "shard active");
                } else {
                    tracing::info!(shard = %ctx.shard, %queue, "consuming; the queue's single-active-consumer picks the active worker");
                }
                return Ok(Some((channel, consumer)));
            }
            Ok(None) => {
                if !standing_by {
                    if queue == ctx.names.shard_queue(ctx.shard) {
                        ctx.metrics.watch.set_state(ShardState::StandingBy);
                    }
                    tracing::info!(shard = %ctx.shard, %queue, "standing by: another consumer holds the shard");
                    standing_by = true;
                }
                kept = Some(channel);
                // A member given the shard by the fleet waits only for the
                // previous owner's drain: it tries more often.
                match config.fleet {
                    Some(_) => config.standby_retry.min(HANDOVER_RETRY),
                    None => config.standby_retry,
                }
            }
            Err(e)
                if soft_error(&e, AMQPSoftError::NOTFOUND)
                    .is_some_and(|reply| declare::is_home_node_down(&reply)) =>
            {
                if !home_down {
                    tracing::warn!(shard = %ctx.shard, %queue, error = %e, "the shard queue's broker node is down (classic queue on a cluster): retrying until it is back");
                    home_down = true;
                }
                config.standby_retry
            }
            // A queue the recorded topology serves but the broker does not
            // have yet (a reshard declares it a moment after recording it),
            // or any more: looked for again, the worker's other shards go on.
            Err(e) if soft_error(&e, AMQPSoftError::NOTFOUND).is_some() => {
                if !missing {
                    tracing::warn!(shard = %ctx.shard, %queue, "the queue does not exist (yet): looking again until it does");
                    missing = true;
                }
                config.standby_retry
            }
            Err(e) => return Err(e.into()),
        };
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = shutdown.cancelled() => return Ok(None),
            _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
        }
    }
}

/// A channel for the shard's consumer, its window set.
async fn shard_channel(conn: &Connection, config: &Config) -> Result<Channel, lapin::Error> {
    let channel = conn.create_channel().await?;
    // Fixed for the consumer's life: RabbitMQ cannot widen a live consumer's
    // window, so it includes the gate's hold reserve from the start.
    channel
        .basic_qos(config.window(), BasicQosOptions::default())
        .await?;
    Ok(channel)
}

/// Consumes `queue` on `channel`; `None` while another consumer holds it
/// (exclusive consumers: seen by a passive declare, which leaves the channel
/// open, or, after a race, a refused consume, which closes it).
async fn try_consume(
    channel: &Channel,
    config: &Config,
    queue: &str,
    tag: &str,
) -> Result<Option<Consumer>, lapin::Error> {
    if config.exclusive && declare::peek(channel, queue).await?.consumers > 0 {
        return Ok(None);
    }
    let options = BasicConsumeOptions {
        exclusive: config.exclusive,
        ..BasicConsumeOptions::default()
    };
    match channel
        .basic_consume(queue.into(), tag.into(), options, FieldTable::default())
        .await
    {
        Ok(consumer) => Ok(Some(consumer)),
        Err(e) if soft_error(&e, AMQPSoftError::ACCESSREFUSED).is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

/// What a shard's consumer loop works with, serial or concurrent: the shard,
/// its channels, Redis slot, consumer and gate, and what ends it (a stop, or
/// the connection's loss).
struct Loop<'a> {
    config: &'a Config,
    ctx: &'a ShardContext,
    router: &'a mut Router,
    dead_letters: &'a ConfirmChannel,
    redis: &'a mut RedisOrderState,
    lookahead: &'a mut Lookahead,
    gate: &'a mut Gate<Ready>,
    shutdown: &'a CancellationToken,
    conn_lost: &'a CancellationToken,
}

/// Settles deliveries one at a time — first those the gate released, then the
/// broker's — until told to stop. Each commit admits the next delivery when it
/// is already here (`intake::lookahead`).
async fn run_consumer(inputs: Loop<'_>) -> Result<(), ShardError> {
    let Loop {
        config,
        ctx,
        router,
        dead_letters,
        redis,
        lookahead,
        gate,
        shutdown,
        conn_lost,
    } = inputs;
    let mut gauge = HeldGauge::new(&ctx.metrics.watch);
    let mut clock = PauseClock::new(&ctx.processor);
    let max = usize::from(config.grouping().size);
    loop {
        gauge.sync(gate);
        let (deadline, room) = clock.gate_wait(gate);
        // At the byte bound only a delivery already taken ahead is next.
        let intake = room && (!gate.is_full_of_bytes() || lookahead.has_parked());
        let (ready, directive, released) = match gate.pop_runnable() {
            Some((ready, directive)) => (ready, directive, true),
            None => {
                let next = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
                    () = clock.changed() => continue,
                    _ = sleep_until(deadline), if deadline.is_some() => {
                        clock.expire(ctx, gate);
                        continue;
                    }
                    next = lookahead.next(&ctx.processor), if intake => next,
                };
                let Some(ready) = next? else {
                    return Err(ShardError::ConsumerCancelled);
                };
                let routed = route_serial(ctx, router, redis, gate, ready, shutdown, conn_lost);
                match Box::pin(routed).await? {
                    Some(ready) => (ready, Directive::Normal, false),
                    None => continue,
                }
            }
        };
        let grouping = max > 1 && !released && group::joins(&ready) && ctx.processor.claims_early();
        let formed = if grouping {
            Group::form(ready, lookahead, max, &ctx.processor)
        } else {
            Err(ready)
        };
        let ready = match formed {
            Ok(formed) => {
                let mut claims = Vec::new();
                let grouped = {
                    let work = group::run_groups(
                        ctx,
                        redis,
                        lookahead,
                        gate,
                        formed,
                        max,
                        shutdown,
                        &mut claims,
                    );
                    tokio::pin!(work);
                    to_the_end(work, config, shutdown, conn_lost).await
                };
                match grouped {
                    Some(Ok(Grouped::Done)) => continue,
                    Some(Ok(Grouped::Fenced)) => return Err(ShardError::Fenced),
                    Some(Err(e)) => return Err(e.into()),
                    None => return abandoned(ctx, redis, claims, shutdown).await,
                }
            }
            Err(alone) => alone,
        };
        let mut in_flight = None;
        ctx.metrics
            .watch
            .start_inflight(held_published_ms(&ready, unix_ms()));
        let finished = {
            let work = settle(
                ctx,
                dead_letters,
                redis,
                ready,
                directive,
                Some(&mut *lookahead),
                &mut in_flight,
            );
            tokio::pin!(work);
            to_the_end(work, config, shutdown, conn_lost).await
        };
        ctx.metrics.watch.clear_inflight();
        match finished {
            Some(Ok(settled)) => to_gate(ctx, gate, settled).await?,
            Some(Err(e)) => return Err(e.into()),
            None => return abandoned(ctx, redis, in_flight, shutdown).await,
        }
    }
}

/// Routes a delivery of a serial shard (`crate::reshard`): the event to
/// process here, or `None` when it was forwarded or was a marker honoured.
/// Nothing else is in flight, so a marker's earlier deliveries are settled
/// but for the gate's; those of the marker's move go ahead of it.
async fn route_serial(
    ctx: &ShardContext,
    router: &mut Router,
    redis: &mut RedisOrderState,
    gate: &mut Gate<Ready>,
    mut ready: Ready,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<Option<Ready>, ShardError> {
    loop {
        match router.route(ready) {
            Routed::Process(ready) => return Ok(Some(ready)),
            Routed::ProcessRenewed(ready) => {
                redis.new_consumer();
                return Ok(Some(ready));
            }
            Routed::Forward(ready, generation) => {
                release_early_claim(ctx, redis, &ready).await;
                router.forward(ctx, &ready, generation, shutdown).await?;
                return Ok(None);
            }
            Routed::Marker(marker_ready, marker) => {
                return honour_marker(ctx, router, gate, marker_ready, marker, shutdown, conn_lost)
                    .await;
            }
            Routed::Wait(waiting) => {
                tokio::select! {
                    () = router.changed() => {}
                    _ = shutdown.cancelled() => return Err(ShardError::Stopped),
                    _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
                }
                ready = waiting;
            }
        }
    }
}

/// A marker whose earlier deliveries are settled: the gate's held events of
/// its move are forwarded ahead of it, then it is honoured and acked. A
/// marker the reshard's record does not hold comes back, to be
/// dead-lettered `control` like any unknown control message.
async fn honour_marker(
    ctx: &ShardContext,
    router: &mut Router,
    gate: &mut Gate<Ready>,
    mut ready: Ready,
    marker: crate::delivery::Marker,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<Option<Ready>, ShardError> {
    let held = gate.take_orders(|held| router.moves(held, marker.move_id));
    let honoured = async {
        router.forward_moved(ctx, held, shutdown).await?;
        router.honour(ctx, &ready.delivery, marker, shutdown).await
    };
    let answer = tokio::select! {
        answer = honoured => answer.map_err(ShardError::from)?,
        _ = conn_lost.cancelled() => return Err(ShardError::ConnectionLost),
    };
    match answer {
        Ok(()) => Ok(None),
        Err(why) => {
            tracing::warn!(shard = %ctx.shard, queue = %router.queue, error = %why, "a marker the reshard's record does not hold: dead-lettered control");
            ready.marker = None;
            Ok(Some(ready))
        }
    }
}

/// What a concurrent shard passes on a delivery routing held back with
/// (`Routed`).
struct Held<'a, 'b> {
    ctx: &'a ShardContext,
    router: &'b mut Router,
    redis: &'b mut RedisOrderState,
    gate: &'b mut Gate<Ready>,
    shutdown: &'a CancellationToken,
    conn_lost: &'a CancellationToken,
}

impl<'a, 'b> Held<'a, 'b> {
    fn of(
        ctx: &'a ShardContext,
        router: &'b mut Router,
        redis: &'b mut RedisOrderState,
        gate: &'b mut Gate<Ready>,
        shutdown: &'a CancellationToken,
        conn_lost: &'a CancellationToken,
    ) -> Self {
        Self {
            ctx,
            router,
            redis,
            gate,
            shutdown,
            conn_lost,
        }
    }

    /// A routed delivery: scheduled when processed here, forwarded (its
    /// early claim given up first); a marker or a wait stays pending.
    async fn place(
        self,
        schedule: &mut Schedule<Job>,
        pending: &mut Option<Routed>,
    ) -> Result<(), ShardError> {
        match pending.take() {
            Some(Routed::Process(ready)) => {
                schedule.push(waits(self.gate, job_entry(ready, Directive::Normal)));
            }
            Some(Routed::Forward(ready, generation)) => {
                release_early_claim(self.ctx, self.redis, &ready).await;
                self.router
                    .forward(self.ctx, &ready, generation, self.shutdown)
                    .await?;
            }
            other => *pending = other,
        }
        Ok(())
    }

    /// Passes on a delivery that waited until nothing ran (a shard with
    /// nothing running): a marker
    /// honoured (or, unknown, scheduled to be dead-lettered), or an event
    /// scheduled with a new epoch. Whether there was one.
    async fn pass_on(
        self,
        schedule: &mut Schedule<Job>,
        pending: &mut Option<Routed>,
    ) -> Result<bool, ShardError> {
        let Some(held) = pending.take_if(|p| p.needs_quiet()) else {
            return Ok(false);
        };
        let Self {
            ctx,
            router,
            redis,
            gate,
            shutdown,
            conn_lost,
        } = self;
        let ready = match held {
            Routed::Marker(ready, marker) => {
                honour_marker(ctx, router, gate, ready, marker, shutdown, conn_lost).await?
            }
            Routed::ProcessRenewed(ready) => {
                redis.new_consumer();
                Some(ready)
            }
            Routed::Process(ready) | Routed::Wait(ready) => Some(ready),
            Routed::Forward(..) => None,
        };
        if let Some(ready) = ready {
            schedule.push(waits(gate, job_entry(ready, Directive::Normal)));
        }
        Ok(true)
    }
}

/// A forwarded event's claim, taken early with the previous commit, is
/// given up: its order is processed elsewhere now.
async fn release_early_claim(ctx: &ShardContext, redis: &mut RedisOrderState, ready: &Ready) {
    if let Some(claim) = ready.held_claim()
        && tokio::time::timeout(Duration::from_secs(1), redis.release(&claim))
            .await
            .is_err()
    {
        tracing::debug!(shard = %ctx.shard, "could not release a forwarded event's claim; it expires with its lease");
    }
}

/// Runs a serial shard's `work` to its end; on stop, within the drain
/// timeout. `None` when the drain timed out or the connection was lost: the
/// event can no longer be acked on it and a standby may take it. `work`
/// comes pinned where it was made: a settle future is kilobytes, and moving
/// it per event showed as memcpy in the instruction counts.
async fn to_the_end<T>(
    mut work: Pin<&mut impl Future<Output = T>>,
    config: &Config,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Option<T> {
    tokio::select! {
        result = &mut work => Some(result),
        _ = shutdown.cancelled() => {
            tokio::time::timeout(config.drain_timeout, work).await.ok()
        }
        _ = conn_lost.cancelled() => None,
    }
}

/// After [`to_the_end`] gave up: the claims are released, and the shard's
/// consumer ends (an error unless it was told to stop).
async fn abandoned(
    ctx: &ShardContext,
    redis: &mut RedisOrderState,
    claims: impl IntoIterator<Item = HeldClaim>,
    shutdown: &CancellationToken,
) -> Result<(), ShardError> {
    abandon(ctx, redis, claims, shutdown.is_cancelled()).await;
    if shutdown.is_cancelled() {
        Ok(())
    } else {
        Err(ShardError::ConnectionLost)
    }
}

/// Tells the gate how an event left `settle`: passed (its order's held
/// successor may run) or to be held.
async fn to_gate(
    ctx: &ShardContext,
    gate: &mut Gate<Ready>,
    settled: Settled,
) -> Result<(), ShardError> {
    match settled {
        Settled::Fenced => return Err(ShardError::Fenced),
        Settled::Done { order_key } => {
            if let Some(order_key) = order_key {
                gate.passed(&order_key);
            }
        }
        Settled::Hold {
            ready,
            order_key,
            seq,
            start,
        } => match gate.hold(ready, &order_key, seq, start, Instant::now()) {
            Ok(expired) => report(ctx, expired),
            Err(copy) => ack_duplicate(ctx, &copy).await?,
        },
    }
    Ok(())
}

/// A delivery on its way through a concurrent shard.
struct Job {
    ready: Ready,
    directive: Directive,
    published: Stamp,
}

impl Job {
    /// The claim it may hold while it runs: any but a directed dead letter's.
    fn claim(&self) -> Option<HeldClaim> {
        match (&self.ready.decoded, &self.directive) {
            (Ok(decoded), Directive::Normal | Directive::Bypass) => {
                Some(HeldClaim::of(decoded.claim()))
            }
            _ => None,
        }
    }
}

/// On stop: lets the running jobs finish within the drain timeout, then
/// gives up the claims of those that did not.
async fn drain_jobs<F>(
    config: &Config,
    ctx: &ShardContext,
    redis: &mut RedisOrderState,
    mut running: FuturesUnordered<F>,
    mut started: HashMap<u64, Started>,
) -> Result<(), ShardError>
where
    F: Future<Output = (u64, RedisOrderState, Result<Settled, lapin::Error>)>,
{
    let drain = async {
        while let Some((id, _, settled)) = running.next().await {
            started.remove(&id);
            settled?;
        }
        Ok::<(), lapin::Error>(())
    };
    let drained = tokio::time::timeout(config.drain_timeout, drain).await;
    if !started.is_empty() {
        abandon(
            ctx,
            redis,
            started.into_values().filter_map(|s| s.claim),
            true,
        )
        .await;
    }
    match drained {
        Ok(Err(e)) => Err(e.into()),
        _ => Ok(()),
    }
}

impl Started {
    fn of(job: &Job, order: Option<String>, alone: bool, extra: bool) -> Self {
        Self {
            claim: job.claim(),
            order,
            alone,
            extra,
            since_ns: ShardWatch::now_ns(),
            published: job.published,
        }
    }
}

/// A started job, for the watch and for releasing its claim if abandoned.
struct Started {
    /// The claim the job may hold.
    claim: Option<HeldClaim>,
    order: Option<String>,
    alone: bool,
    /// Started beyond the slots, as the breaker's evidence attempt.
    extra: bool,
    since_ns: u64,
    published: Stamp,
}

/// Settles up to `--concurrency` deliveries at once, never two of one order
/// (`intake::schedule`), until told to stop. Each call has its own Redis slot on the
/// shard's connection; claims are not pipelined with commits here.
async fn run_concurrent(inputs: Loop<'_>) -> Result<(), ShardError> {
    let Loop {
        config,
        ctx,
        router,
        dead_letters,
        redis,
        lookahead,
        gate,
        shutdown,
        conn_lost,
    } = inputs;
    let slots = usize::from(config.concurrency);
    let watch = &ctx.metrics.watch;
    let mut schedule: Schedule<Job> = Schedule::new(slots, config.max_taken());
    let mut spare: Vec<RedisOrderState> = (0..slots).map(|_| redis.fork()).collect();
    let mut running = FuturesUnordered::new();
    let mut started: HashMap<u64, Started> = HashMap::new();
    let mut next_id = 0_u64;
    let mut gauge = HeldGauge::new(watch);
    let _clear = WaitingGauge(watch);
    let mut clock = PauseClock::new(&ctx.processor);
    // A call waits for the breaker's evidence; one event of another order
    // runs beyond the slots (`extra`) to give it.
    let mut evidence_wanted = false;
    let mut extra_running = false;
    let mut pending: Option<Routed> = None; // held back by routing: `place`
    loop {
        while let Some((ready, directive)) = gate.pop_runnable() {
            schedule.push_released(waits(gate, job_entry(ready, directive)));
        }
        if running.is_empty() && schedule.waiting() == 0 {
            let held = Held::of(ctx, router, redis, gate, shutdown, conn_lost);
            if Box::pin(held.pass_on(&mut schedule, &mut pending)).await? {
                continue;
            }
        }
        while let Some((entry, extra)) =
            next_entry(&mut schedule, evidence_wanted && !extra_running)
        {
            if extra {
                evidence_wanted = false;
                extra_running = true;
            }
            gate.bytes().sub(entry.item.ready.delivery.data.len());
            let Entry { order, alone, item } = entry;
            let id = next_id;
            next_id += 1;
            started.insert(id, Started::of(&item, order, alone, extra));
            let slot = spare.pop().unwrap_or_else(|| redis.fork());
            // Boxed once here: a job's future holds the whole settle path
            // (about 20 KB), which the set would otherwise move three times
            // per event (callgrind: a third of the concurrent path's
            // instructions were those copies).
            running.push(Box::pin(run_job(ctx, dead_letters, slot, item, id)));
        }
        gauge.sync(gate);
        sync_running(watch, &started, &schedule);
        let (deadline, room) = clock.gate_wait(gate);
        // At the byte bound no new delivery, but the breaker's evidence.
        let intake = ((schedule.accepts() && !gate.is_full_of_bytes()) || evidence_wanted)
            && room
            && pending.is_none();
        let waiting_for_topology = matches!(pending, Some(Routed::Wait(_)));
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                return drain_jobs(config, ctx, redis, running, started).await;
            }
            _ = conn_lost.cancelled() => {
                drop(running);
                abandon(ctx, redis, started.into_values().filter_map(|s| s.claim), false).await;
                return Err(ShardError::ConnectionLost);
            }
            Some((id, slot, settled)) = running.next(), if !running.is_empty() => {
                spare.push(slot);
                let Some(done) = started.remove(&id) else { continue };
                extra_running &= !done.extra;
                match settled {
                    Ok(settled) => to_gate(ctx, gate, settled).await?,
                    Err(e) => {
                        drop(running);
                        abandon(ctx, redis, started.into_values().filter_map(|s| s.claim), false).await;
                        return Err(e.into());
                    }
                }
                // Released successors go before the order's later arrivals.
                while let Some((ready, directive)) = gate.pop_runnable() {
                    schedule.push_released(waits(gate, job_entry(ready, directive)));
                }
                schedule.finish(done.order.as_deref(), done.alone);
            }
            () = ctx.evidence.notified() => evidence_wanted = true,
            () = clock.changed() => {}
            _ = sleep_until(deadline), if deadline.is_some() => clock.expire(ctx, gate),
            () = router.changed(), if waiting_for_topology => router.route_again(&mut pending),
            next = lookahead.next(&ctx.processor), if intake => {
                let ready = next?.ok_or(ShardError::ConsumerCancelled)?;
                pending = Some(router.route(ready));
            }
        }
        let held = Held::of(ctx, router, redis, gate, shutdown, conn_lost);
        Box::pin(held.place(&mut schedule, &mut pending)).await?;
    }
}

/// The next job to start: the schedule's, or beyond the slots one for the
/// breaker's `evidence` (`true` with it).
fn next_entry(schedule: &mut Schedule<Job>, evidence: bool) -> Option<(Entry<Job>, bool)> {
    match schedule.next() {
        Some(entry) => Some((entry, false)),
        None if evidence => schedule.next_extra().map(|entry| (entry, true)),
        None => None,
    }
}

/// `entry` waits to run: its body counts in the shard's decoded bytes until
/// it starts.
fn waits(gate: &Gate<Ready>, entry: Entry<Job>) -> Entry<Job> {
    gate.bytes().add(entry.item.ready.delivery.data.len());
    entry
}

/// A delivery as the schedule sees it: its order, and whether it runs alone
/// (redelivered: it may be the one that killed the last process).
fn job_entry(ready: Ready, directive: Directive) -> Entry<Job> {
    let order = ready
        .decoded
        .as_ref()
        .ok()
        .map(|d| String::from(d.order_key.clone()));
    let alone = ready.delivery.redelivered;
    let published = held_published_ms(&ready, unix_ms());
    Entry {
        order,
        alone,
        item: Job {
            ready,
            directive,
            published,
        },
    }
}

async fn run_job(
    ctx: &ShardContext,
    dead_letters: &ConfirmChannel,
    mut redis: RedisOrderState,
    job: Job,
    id: u64,
) -> (u64, RedisOrderState, Result<Settled, lapin::Error>) {
    let mut in_flight = None;
    let settled = settle(
        ctx,
        dead_letters,
        &mut redis,
        job.ready,
        job.directive,
        None::<&mut Lookahead>,
        &mut in_flight,
    )
    .await;
    (id, redis, settled)
}

/// The watch's calls in flight and waiting events, from a concurrent shard.
fn sync_running(watch: &ShardWatch, started: &HashMap<u64, Started>, schedule: &Schedule<Job>) {
    match started
        .values()
        .map(|s| (s.since_ns, s.published))
        .reduce(|a, b| (a.0.min(b.0), a.1.min(b.1)))
    {
        Some((since_ns, published)) => watch.set_inflight(started.len(), since_ns, published),
        None => watch.clear_inflight(),
    }
    let oldest = schedule.pending().map(|job| job.published).min();
    watch.set_waiting(schedule.waiting(), oldest);
}

/// Clears the watch's waiting events when a concurrent shard's consumer ends.
struct WaitingGauge<'a>(&'a ShardWatch);

impl Drop for WaitingGauge<'_> {
    fn drop(&mut self) {
        self.0.set_waiting(0, None);
    }
}

/// Keeps the shard's watch (held events, the oldest one's publish time, the
/// list of them) in step with its gate.
struct HeldGauge<'a> {
    watch: &'a ShardWatch,
    /// The gate version the watch's list of held events was taken from.
    refs_of: u64,
}

/// The held events by order and kind (undecodable ones are never held).
fn held_refs(gate: &Gate<Ready>) -> Vec<HeldRef> {
    gate.held_events()
        .filter_map(|ready| ready.decoded.as_ref().ok())
        .map(|d| HeldRef {
            order_key: d.order_key.to_string(),
            event: d.envelope.event.clone(),
        })
        .collect()
}

impl<'a> HeldGauge<'a> {
    fn new(watch: &'a ShardWatch) -> Self {
        Self { watch, refs_of: 0 }
    }

    fn sync(&mut self, gate: &Gate<Ready>) {
        let mut waiting = gate.waiting().peekable();
        // The clock is read only while the gate has something.
        let oldest = waiting.peek().is_some().then(|| {
            let now = unix_ms();
            waiting.map(|r| held_published_ms(r, now)).min()
        });
        self.watch.set_held(gate.held(), oldest.flatten());
        self.watch.set_held_bytes(gate.bytes().get());
        // Listed again only when the gate changed, not per event.
        if gate.version() != self.refs_of {
            self.watch.set_held_refs(held_refs(gate));
            self.refs_of = gate.version();
        }
    }
}

impl Drop for HeldGauge<'_> {
    fn drop(&mut self) {
        self.watch.set_held(0, None);
        self.watch.set_held_bytes(0);
    }
}

/// When an event was published; without publish time (or with one later than
/// it was received), when it was received: when the gate first held it, for
/// one it held (also once released), else `now_ms`.
fn held_published_ms(ready: &Ready, now_ms: u64) -> Stamp {
    let received = ready.held_since().map_or(now_ms, |since| {
        now_ms.saturating_sub(u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX))
    });
    published_ms(&ready.delivery.properties, received)
}

/// A shard gate's view of the breaker's paused time: while calls are paused
/// no hold times out (the loops skip the gate's deadline), and every hold's
/// grace is extended by the time calls were paused.
struct PauseClock<'a> {
    breaker: Option<&'a Breaker>,
    paused: Option<watch::Receiver<bool>>,
    /// The breaker's paused time the gate was last extended to.
    seen: Duration,
}

impl<'a> PauseClock<'a> {
    fn new(processor: &'a Processor) -> Self {
        let breaker = processor.breaker();
        Self {
            breaker,
            paused: breaker.map(Breaker::paused),
            seen: breaker.map_or(Duration::ZERO, Breaker::paused_total),
        }
    }

    /// Extends the gate's holds by the pause since last time; whether calls
    /// are paused now.
    fn sync(&mut self, gate: &mut Gate<Ready>) -> bool {
        let Some(breaker) = self.breaker else {
            return false;
        };
        let total = breaker.paused_total();
        gate.extend(total.saturating_sub(self.seen));
        self.seen = total;
        breaker.is_paused()
    }

    /// What the shard's loop waits for from its gate: the next hold to end
    /// (none while calls are paused), and whether a delivery may be taken
    /// (not at `--max-held` while paused: a gap is not given up early then).
    fn gate_wait(&mut self, gate: &mut Gate<Ready>) -> (Option<Instant>, bool) {
        let paused = self.sync(gate);
        let deadline = gate.next_deadline().filter(|_| !paused);
        (deadline, !(paused && gate.is_full()))
    }

    /// At a hold's deadline: gives up what is due, unless calls were paused
    /// meanwhile (the holds were extended instead).
    fn expire(&mut self, ctx: &ShardContext, gate: &mut Gate<Ready>) {
        if !self.sync(gate) {
            report(ctx, gate.expire(Instant::now()));
        }
    }

    /// Returns when calls are paused or resume.
    async fn changed(&mut self) {
        match &mut self.paused {
            Some(paused) => {
                if paused.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    if let Some(deadline) = deadline {
        tokio::time::sleep_until(deadline).await;
    }
}

/// Logs and counts the gaps the gate gave up on.
fn report(ctx: &ShardContext, expired: Vec<Expired>) {
    for gap in expired {
        ctx.metrics.gap();
        if gap.at_start {
            tracing::warn!(
                shard = %ctx.shard, order = %gap.order_key, seq = gap.first_seq,
                "no earlier event arrived within the start grace: accepted as the order's start (gap at start)"
            );
        } else {
            tracing::warn!(
                shard = %ctx.shard, order = %gap.order_key, first_held_seq = gap.first_seq, held = gap.events,
                "sequence gap not filled within the grace: giving up on it"
            );
        }
    }
}

/// Leaves the in-flight events unacked (the broker redelivers them) and gives
/// up their claims, so that whoever gets them next need not wait for the lease.
async fn abandon(
    ctx: &ShardContext,
    redis: &mut RedisOrderState,
    in_flight: impl IntoIterator<Item = HeldClaim>,
    draining: bool,
) {
    let claims: Vec<HeldClaim> = in_flight.into_iter().collect();
    ctx.metrics.abandoned(claims.len());
    if draining {
        tracing::warn!(shard = %ctx.shard, events = claims.len(), "drain timeout: in-flight events left unacked for redelivery");
    } else {
        tracing::warn!(shard = %ctx.shard, events = claims.len(), "connection lost: in-flight handler calls abandoned");
    }
    for held in claims {
        let claim = held.claim();
        let release = redis.release(&claim);
        if tokio::time::timeout(std::time::Duration::from_secs(1), release)
            .await
            .is_err()
        {
            tracing::warn!(shard = %ctx.shard, "could not release the claim; it expires with its lease");
        }
    }
}

/// Closes the shard's channels, without cancelling the consumer first: the
/// broker requeues the unacked read-ahead and held events in order.
async fn close(channel: &Channel, dead_letters: &ConfirmChannel) {
    for (channel, what) in [
        (channel, "the shard channel"),
        (dead_letters.channel(), "the dead-letter channel"),
    ] {
        let closing = channel.close(200, "shutdown".into());
        match tokio::time::timeout(CLOSE_TIMEOUT, closing).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "closing {what}"),
            Err(_) => tracing::debug!("closing {what}: no close-ok in time; dropped"),
        }
    }
}
