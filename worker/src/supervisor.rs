//! The worker's broker connections and its shard tasks.
//!
//! Two connections: one carries every shard's deliveries and acks, the other
//! the dead letters (under a memory alarm RabbitMQ blocks a publishing
//! connection; the acks must not wait behind it). The supervisor is the one
//! owner of reconnection: when either fails, every shard task stops
//! (abandoning its in-flight event, which the broker redelivers), and the
//! supervisor makes both connections again, with capped backoff, and starts
//! the shards again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::Connection;
use shardline_connect::broker::{self, BrokerError};
use shardline_connect::{RedisPool, declare, probe, record, stamps};
use shardline_contract::reshard::Source;
use shardline_contract::shard::MAX_SHARDS;
use shardline_contract::{Keys, ShardCount, ShardId};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::attempt::Processor;
use crate::breaker::Breaker;
use crate::config::Config;
use crate::context::ShardContext;
use crate::dedup::{Dedup, RedisOrderState};
use crate::depth::{DepthPacer, Poll};
use crate::era::RedisEra;
use crate::error::WorkerError;
use crate::handler::Handler;
use crate::http::{self, Readiness};
use crate::limits;
use crate::live;
use crate::membership::{self, Membership};
use crate::metrics::Metrics;
use crate::progress::Progress;
use crate::rate::RateLimiter;
use crate::reshard;
use crate::shard::{CLOSE_TIMEOUT, Connections, ShardError, consume_shard};
use crate::status::{self, WriterHealth};
use crate::store::{Lanes, RedisHealth, RedisSlot};

const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The wait before the next broker connect: [`RECONNECT_MIN`], doubling
/// after each failed try up to [`RECONNECT_MAX`].
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(RECONNECT_MIN)
    }

    fn reset(&mut self) {
        self.0 = RECONNECT_MIN;
    }

    /// Waits the current time, then doubles it; `false` when `stop` fired.
    async fn wait(&mut self, stop: &CancellationToken) -> bool {
        let waited = tokio::select! {
            () = tokio::time::sleep(self.0) => true,
            () = stop.cancelled() => false,
        };
        self.0 = (self.0 * 2).min(RECONNECT_MAX);
        waited
    }
}
/// How often queue depths are read (passive declare), for the depth gauges:
/// the DLQ's, and each shard's while there are at most
/// `DEPTH_POLL × DEPTH_DECLARES_PER_SECOND` (125) shards.
const DEPTH_POLL: Duration = Duration::from_secs(5);
/// The most shard-queue declares a second the depth poll spends: a worker of
/// many shards refreshes each gauge less often instead of sending the broker
/// a burst of one declare per shard every [`DEPTH_POLL`].
const DEPTH_DECLARES_PER_SECOND: u32 = 25;
/// The breaker (`Config::breaker` on), open from the start when the fleet's
/// is (another worker's status document says so): a worker restarted during
/// an outage does not rediscover it with its events' budgets.
async fn start_breaker(
    config: &Config,
    pool: &RedisPool,
    metrics: &Metrics,
) -> Option<Arc<Breaker>> {
    let breaker = config
        .breaker
        .enabled
        .then(|| Breaker::new(config.breaker.clone(), metrics.breaker()))?;
    let keys = config.keys();
    let read = status::fleet_breaker(pool, &keys);
    let read = tokio::time::timeout(Duration::from_secs(2), read).await;
    match read.unwrap_or_else(|_| Err("timed out".into())) {
        Ok(Some(fleet)) if fleet.worker != config.worker_name => breaker.open_from_fleet(
            fleet.breaker.cause,
            format!(
                "the fleet's breaker is open (worker {}: {})",
                fleet.worker, fleet.breaker.reason
            ),
        ),
        Ok(_) => {}
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the fleet's breaker; starting closed")
        }
    }
    Some(breaker)
}

/// Writes this worker's status documents to Redis until `background` ends,
/// and the stopped shards' when the returned writer is finished (or dropped).
fn start_status_writer(
    config: &Config,
    pool: &RedisPool,
    metrics: &Arc<Metrics>,
    breaker: Option<Arc<Breaker>>,
    readiness: &Readiness,
    background: &CancellationToken,
) -> StatusWriter {
    let writer = status::Writer {
        pool: pool.clone(),
        metrics: metrics.clone(),
        keys: config.keys(),
        owner: config.worker_name.clone(),
        breaker,
        fixed: config.fleet.is_none(),
        takes_new_shards: follows_new_shards(config),
        health: readiness.status_writer.clone(),
    };
    let stopped = CancellationToken::new();
    let task = tokio::spawn(writer.run(background.clone(), stopped.clone()));
    StatusWriter {
        stopped: stopped.drop_guard(),
        task,
    }
}

/// The running status writer; dropping it tells it that the shards stopped.
struct StatusWriter {
    /// Cancelled when dropped: the drain is over.
    stopped: tokio_util::sync::DropGuard,
    task: tokio::task::JoinHandle<()>,
}

impl StatusWriter {
    /// After the drain: the stopped shards' documents written before the
    /// worker returns (bounded: Redis may be away).
    async fn finish(self) {
        let Self { stopped, task } = self;
        drop(stopped);
        let _ = tokio::time::timeout(status::WRITE_EVERY, task).await;
    }
}

/// What every shard's processor shares with the others.
struct Shared {
    handler: Arc<dyn Handler>,
    rate: Option<Arc<RateLimiter>>,
    breaker: Option<Arc<Breaker>>,
    era: Arc<RedisEra>,
}

/// A shard's context, with its processor.
fn shard_context(
    config: &Config,
    shard_metrics: &Arc<crate::metrics::ShardMetrics>,
    shared: &Shared,
) -> Arc<ShardContext> {
    let shard = shard_metrics.watch.shard;
    Arc::new(ShardContext {
        processor: Processor::new(
            config,
            shard,
            shared.handler.clone(),
            shard_metrics.clone(),
            shared.rate.clone(),
            shared.breaker.clone(),
        ),
        dedup: Dedup::new(config, shard, shared.era.clone()),
        names: config.names.clone(),
        shard,
        metrics: shard_metrics.clone(),
        evidence: Notify::new(),
    })
}

/// One shard task's inputs: the shard's context and whether this worker
/// should own it.
type ShardEntry = (Arc<ShardContext>, watch::Receiver<bool>);

/// The shards this worker runs: those of its start, and those a reshard
/// adds while it runs ([`grow_with_topology`]).
struct Shards {
    entries: std::sync::Mutex<Vec<ShardEntry>>,
    /// Signalled when entries were added.
    added: Notify,
}

impl Shards {
    fn new(entries: Vec<ShardEntry>) -> Self {
        Self {
            entries: std::sync::Mutex::new(entries),
            added: Notify::new(),
        }
    }

    /// The entries from `from` on.
    fn since(&self, from: usize) -> Vec<ShardEntry> {
        self.entries
            .lock()
            .map(|e| e.iter().skip(from).cloned().collect())
            .unwrap_or_default()
    }

    fn push(&self, entry: ShardEntry) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.push(entry);
        }
        self.added.notify_waiters();
    }
}

/// The shard tasks' inputs, the membership of an elastic member, the
/// topology's follower, the growth of the shard set with it and the
/// forwarder: what the consumers route by. Returns the senders that keep a
/// fixed assignment's shards wanted.
async fn start_shards(
    config: &Arc<Config>,
    metrics: &Arc<Metrics>,
    shared: Arc<Shared>,
    pool: &RedisPool,
    shutdown: &CancellationToken,
    background: &CancellationToken,
) -> (Arc<Shards>, Routing, Vec<membership::ShardSlot>) {
    let contexts: Vec<Arc<ShardContext>> = metrics
        .shards()
        .iter()
        .map(|m| shard_context(config, m, &shared))
        .collect();

    let (slots, mut wanted) = membership::slots(metrics.watches().into_iter());
    // Each shard's context with what its consumer follows: whether this
    // worker should own the shard.
    let shards = Arc::new(Shards::new(
        contexts
            .iter()
            .filter_map(|ctx| Some((ctx.clone(), wanted.remove(&ctx.shard)?)))
            .collect(),
    ));
    let (add_members, added) = tokio::sync::mpsc::unbounded_channel();
    // With a fixed `--assign` every shard stays wanted (the senders live here).
    let fixed = match &config.fleet {
        Some(policy) => {
            let member = Membership::new(
                policy.clone(),
                config.worker_name.clone(),
                config.keys(),
                slots,
                added,
                metrics.fleet(),
            );
            tokio::spawn(member.run(pool.clone(), background.clone()));
            Vec::new()
        }
        None => slots,
    };
    let followed = first_read(pool, &config.keys(), shutdown).await;
    let (follow, topology) = watch::channel(Arc::new(followed));
    tokio::spawn(reshard::follow(
        pool.clone(),
        config.keys(),
        follow,
        background.clone(),
    ));
    if follows_new_shards(config) {
        let growth = Growth {
            config: config.clone(),
            metrics: metrics.clone(),
            shared: shared.clone(),
            shards: shards.clone(),
            members: config.fleet.is_some().then_some(add_members),
        };
        tokio::spawn(grow_with_topology(
            growth,
            topology.clone(),
            background.clone(),
        ));
    }
    let forwarder = Arc::new(reshard::Forwarder::new(config));
    tokio::spawn(forwarder.clone().keep_registered(background.clone()));
    let routing = Routing {
        topology,
        forwarder,
        pool: pool.clone(),
    };
    (shards, routing, fixed)
}

/// Whether a worker consumes the shard queues a reshard adds: an elastic
/// member (`--assign auto`), or a worker of every shard (`--assign all`). A
/// fixed part keeps its shards (a reshard refuses to start unless the fixed
/// assignments cover its target).
fn follows_new_shards(config: &Config) -> bool {
    config.fleet.is_some() || config.assign.len() == usize::from(config.shards.get())
}

/// Adds a shard task for every shard queue the recorded topology serves and
/// this worker does not run yet, as the topology changes, until `stop`.
async fn grow_with_topology(
    growth: Growth,
    mut topology: watch::Receiver<Arc<reshard::Followed>>,
    stop: CancellationToken,
) {
    // The senders of a worker without membership: every shard stays wanted.
    let mut fixed = Vec::new();
    loop {
        let served = topology.borrow_and_update().served.clone();
        let ids = served.iter().filter_map(|&i| {
            ShardId::new(u32::from(i), ShardCount::new(u32::from(MAX_SHARDS)).ok()?).ok()
        });
        for shard_metrics in growth.metrics.grow(ids) {
            let ctx = shard_context(&growth.config, &shard_metrics, &growth.shared);
            // An elastic member consumes it once its membership assigns it.
            let (wanted, receiver) = watch::channel(growth.members.is_none());
            tracing::info!(shard = %ctx.shard, "the topology serves a new shard queue: consuming it");
            let slot = membership::ShardSlot {
                watch: shard_metrics.watch.clone(),
                wanted,
            };
            match &growth.members {
                Some(members) => {
                    let _ = members.send(slot);
                }
                None => {
                    slot.watch.set_assigned(true);
                    fixed.push(slot);
                }
            }
            growth.shards.push((ctx, receiver));
        }
        tokio::select! {
            changed = topology.changed() => if changed.is_err() { return },
            () = stop.cancelled() => return,
        }
    }
}

/// What [`grow_with_topology`] makes new shard tasks from.
struct Growth {
    config: Arc<Config>,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
    shards: Arc<Shards>,
    /// An elastic member's membership, which assigns the new shards.
    members: Option<tokio::sync::mpsc::UnboundedSender<membership::ShardSlot>>,
}

/// The recorded topology as the worker starts by, read until it answers:
/// no delivery is routed before the worker knows whether a reshard runs.
async fn first_read(
    pool: &RedisPool,
    keys: &Keys,
    shutdown: &CancellationToken,
) -> reshard::Followed {
    let mut backoff = Backoff::new();
    loop {
        let read = async {
            let mut conn = pool.get().await.map_err(|e| e.to_string())?;
            shardline_connect::reshard::standing(&mut conn, keys)
                .await
                .map_err(|e| e.to_string())
        };
        match read.await {
            Ok((Some(record), drained, closed)) => {
                match reshard::Followed::of(&record, drained, closed) {
                    Ok(followed) => return followed,
                    Err(e) => {
                        tracing::warn!(error = %e, "the recorded topology cannot be followed: retrying")
                    }
                }
            }
            Ok((None, ..)) => return reshard::Followed::default(),
            Err(e) => tracing::warn!(error = %e, "cannot read the recorded topology: retrying"),
        }
        if !backoff.wait(shutdown).await {
            return reshard::Followed::default();
        }
    }
}

/// Runs the worker until `shutdown` is cancelled: one consumer per assigned
/// shard, reconnecting as long as it takes once the first connection worked.
/// The same as [`Worker::new`] then [`Worker::run`].
pub async fn run(
    config: Config,
    handler: Arc<dyn Handler>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    Worker::new(config, handler)?.run(shutdown).await
}

/// A worker, built and checked but not yet connected: [`Worker::progress`]
/// can be taken before it runs.
pub struct Worker {
    config: Config,
    handler: Arc<dyn Handler>,
    metrics: Arc<Metrics>,
}

impl Worker {
    /// Checks `config` ([`Config::validate`]); connects nothing yet.
    pub fn new(config: Config, handler: Arc<dyn Handler>) -> Result<Self, WorkerError> {
        config.validate()?;
        let metrics = Arc::new(Metrics::new(
            &config.assign,
            config.backlog,
            config.stuck_after,
        ));
        Ok(Self {
            config,
            handler,
            metrics,
        })
    }

    /// What the worker has done so far and where its shards are; cheap to
    /// clone and to read while it runs.
    pub fn progress(&self) -> Progress {
        Progress::new(self.metrics.clone())
    }

    /// Runs until `shutdown` is cancelled (see [`run`]).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let Self {
            config,
            handler,
            metrics,
        } = self;
        let config = Arc::new(config);
        check_limits(&config, handler.as_ref())?;
        // Bound first: a port in use fails the start before anything connects.
        let listener = match config.metrics_addr {
            Some(addr) => Some(http::bind(addr).await?),
            None => None,
        };
        let pool = redis_pool(&config)?;
        warn_if_redis_may_evict(&pool).await;
        let era = Arc::new(RedisEra::new(config.keys().redis_era()));
        start_order_state(&pool, &config.keys(), &era).await;
        let health = Arc::new(RedisHealth::new(
            metrics.redis_outages(),
            metrics.infrastructure_failures(),
            era.clone(),
        ));
        let lanes = Lanes::new(pool.clone());
        let breaker = start_breaker(&config, &pool, &metrics).await;
        let shared = Shared {
            handler,
            rate: config.max_rate.map(RateLimiter::shared),
            breaker: breaker.clone(),
            era,
        };
        let background = shutdown.child_token();
        let _stop_background = background.clone().drop_guard();
        let (shards, routing, _fixed) = start_shards(
            &config,
            &metrics,
            Arc::new(shared),
            &pool,
            &shutdown,
            &background,
        )
        .await;
        let readiness = Arc::new(Readiness {
            metrics: metrics.clone(),
            broker: false.into(),
            redis: health.clone(),
            status_writer: Arc::new(WriterHealth::default()),
        });
        if let Some(listener) = listener {
            http::spawn(listener, config.metrics_limits, &readiness, &background);
        }
        let writer =
            start_status_writer(&config, &pool, &metrics, breaker, &readiness, &background);

        check_queues(&config).await?;
        let mut conns = Broker::connect(&config).await?;
        log_connected(&config);
        spawn_stamp_probe(&config, true);
        tokio::spawn(poll_depths(
            config.clone(),
            metrics.clone(),
            background.clone(),
        ));
        loop {
            readiness.broker.store(true, Ordering::Relaxed);
            let consume = Arc::new(conns.consume);
            let lost = run_shards(
                &consume,
                &Arc::new(conns.dead_letters),
                &config,
                &shards,
                &lanes,
                &health,
                &routing,
                &shutdown,
            )
            .await;
            readiness.broker.store(false, Ordering::Relaxed);
            if !lost || shutdown.is_cancelled() {
                break;
            }
            match reconnect(&config, &shutdown, &metrics).await {
                Some(fresh) => conns = fresh,
                None => break,
            }
        }
        writer.finish().await;
        tracing::info!("worker stopped");
        Ok(())
    }
}

/// The worker's two broker connections, made (and made again) together.
struct Broker {
    consume: Connection,
    dead_letters: Connection,
    /// Logs a memory or disk alarm's block of the dead letters' connection
    /// (a blocked dead letter keeps its event unacked; deliveries and acks
    /// go on, on the other connection).
    _blocked: broker::BlockedWatch,
}

impl Broker {
    async fn connect(config: &Config) -> Result<Self, BrokerError> {
        let consume = broker::connect(&config.amqp, &connection_name(config)).await?;
        let dead_letters = match broker::connect(&config.amqp, &dead_letters_name(config)).await {
            Ok(conn) => conn,
            Err(e) => {
                close_connection(&consume).await;
                return Err(e);
            }
        };
        Ok(Self {
            _blocked: broker::BlockedWatch::new(&dead_letters, "dead-lettering"),
            consume,
            dead_letters,
        })
    }
}

/// Runs [`probe_stamps`] in the background on a connection of its own,
/// closed after: the probe publishes, and a memory or disk alarm blocks a
/// connection that publishes (the broker stops reading it, so no channel of
/// it opens), so neither the start nor the dead letters' connection may wait
/// for it. Until it answers, no broker stamp is trusted.
fn spawn_stamp_probe(config: &Config, at_start: bool) {
    let amqp = config.amqp.clone();
    let name = format!(
        "shardline worker {} stamp probe",
        bounded(&config.worker_name, NAME_MAX)
    );
    tokio::spawn(async move {
        match broker::connect(&amqp, &name).await {
            Ok(conn) => {
                probe_stamps(&conn, at_start).await;
                close_connection(&conn).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open the stamp probe's connection: the broker's stamps are not trusted")
            }
        }
    });
}

/// Asks the broker behind `conn` whether it stamps every message itself
/// ([`stamps::broker_stamps`], a round trip of at most
/// [`stamps::PROBE_TIMEOUT`]), and counts backlog ages from its stamps if so,
/// else from the publishers' claims (docs/semantics.md §5). Says which at
/// start, and after a reconnect when it changed. A failed probe trusts no
/// stamp, with a warning; it never fails the worker.
async fn probe_stamps(conn: &Connection, at_start: bool) {
    let trusted = stamps::broker_stamps(conn).await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot tell whether the broker stamps messages: its stamps are not trusted");
        false
    });
    let before = live::trust_broker_stamps(trusted);
    if !at_start && before == trusted {
        return;
    }
    if trusted {
        tracing::info!(
            "the broker stamps every message (it overwrote a planted timestamp_in_ms): backlog ages count from its stamps"
        );
    } else {
        tracing::info!(
            "the broker does not overwrite timestamp_in_ms (RabbitMQ 3.12+: message_interceptors.incoming.set_header_timestamp.overwrite = true): \
             backlog ages count from the publishers' claims, and a WARN or PAGE resting on one is labelled publisher-claimed"
        );
    }
}

async fn close_connection(conn: &Connection) {
    match tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, "shutdown".into())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing a broker connection"),
        Err(_) => tracing::debug!("closing a broker connection: no close-ok in time; dropped"),
    }
}

/// Reads the depth of the assigned shard queues and of the dead-letter queue
/// with passive declares on one channel, for the gauges, until `stop`. Paced
/// (`crate::depth`): at most [`DEPTH_DECLARES_PER_SECOND`] shard declares a
/// second, so each shard's gauge is refreshed every max([`DEPTH_POLL`],
/// N / 25 s) (41 s at 1,024 shards), and the DLQ's every [`DEPTH_POLL`].
///
/// On a connection of its own (named `… queue depths`), made again after a
/// loss: lapin looks at every channel of a connection each time its I/O loop
/// wakes, so 50 replies a second on the consume connection of 1,024 shards
/// was a quarter of an idle worker's CPU. A failed declare (the broker closes
/// the channel: a queue deleted?) opens a new channel for the next one.
async fn poll_depths(config: Arc<Config>, metrics: Arc<Metrics>, stop: CancellationToken) {
    let mut pacer = DepthPacer::new(
        config.assign.len(),
        DEPTH_POLL,
        DEPTH_DECLARES_PER_SECOND,
        tokio::time::Instant::now(),
    );
    tracing::debug!(shards = config.assign.len(), every = ?pacer.round(), "each shard queue's depth is read once a round");
    let name = format!(
        "shardline worker {} queue depths",
        bounded(&config.worker_name, NAME_MAX)
    );
    let mut backoff = Backoff::new();
    loop {
        let connected = tokio::select! {
            connected = broker::connect(&config.amqp, &name) => connected,
            () = stop.cancelled() => return,
        };
        match connected {
            Ok(conn) => {
                backoff.reset();
                tokio::select! {
                    () = read_depths(&conn, &config, &metrics, &mut pacer) => {}
                    () = stop.cancelled() => {}
                }
                close_connection(&conn).await;
            }
            Err(e) => tracing::debug!(error = %e, "queue depth poll: cannot connect"),
        }
        if !backoff.wait(&stop).await {
            return;
        }
    }
}

/// The depth poll on `conn`, until the connection is lost.
async fn read_depths(
    conn: &Connection,
    config: &Config,
    metrics: &Metrics,
    pacer: &mut DepthPacer,
) {
    let mut channel = None;
    loop {
        let (at, poll) = pacer.next(tokio::time::Instant::now());
        tokio::time::sleep_until(at).await;
        if !conn.status().connected() {
            return;
        }
        if channel
            .as_ref()
            .is_none_or(|c: &lapin::Channel| !c.status().connected())
        {
            match conn.create_channel().await {
                Ok(fresh) => channel = Some(fresh),
                Err(e) => {
                    tracing::debug!(error = %e, "queue depth poll: cannot open a channel");
                    continue;
                }
            }
        }
        let Some(ch) = &channel else { continue };
        let (shard, queue) = match poll {
            Poll::Shard(index) => match config.assign.get(index) {
                Some(&shard) => (Some(shard), config.names.shard_queue(shard)),
                None => continue,
            },
            Poll::DeadLetters => (None, config.names.dead_letter_queue.clone()),
        };
        match declare::peek(ch, &queue).await {
            Ok(status) => match shard {
                Some(shard) => metrics.set_queue_depth(shard, status.messages),
                None => metrics.set_dlq_depth(status.messages),
            },
            Err(e) => {
                tracing::debug!(%queue, error = %e, "queue depth poll failed");
                channel = None;
            }
        }
    }
}

/// What every consumer routes by (`crate::reshard`): the followed
/// topology, the worker's forwarder, and Redis for the markers.
#[derive(Clone)]
struct Routing {
    topology: watch::Receiver<Arc<reshard::Followed>>,
    forwarder: Arc<reshard::Forwarder>,
    pool: RedisPool,
}

impl Routing {
    fn router(&self, config: &Config, source: Source, queue: String) -> reshard::Router {
        reshard::Router::new(
            source,
            queue,
            self.topology.clone(),
            self.forwarder.clone(),
            self.pool.clone(),
            config.keys(),
        )
    }
}

/// What one shard task runs with, owned (a holding queue's consumer is a
/// task of its own).
#[derive(Clone)]
struct TaskEnv {
    consume: Arc<Connection>,
    dead_letters: Arc<Connection>,
    config: Arc<Config>,
    lanes: Arc<Lanes>,
    health: Arc<RedisHealth>,
    routing: Routing,
}

impl TaskEnv {
    fn order_state(&self, dedup: Dedup) -> RedisOrderState {
        let slot = RedisSlot::new(&self.lanes, dedup.scripts(), self.health.clone());
        RedisOrderState::new(dedup, slot)
    }

    /// Consumes `router`'s queue for `ctx`'s shard until `stop`.
    async fn consume(
        &self,
        ctx: &ShardContext,
        router: &mut reshard::Router,
        redis: &mut RedisOrderState,
        stop: &CancellationToken,
        conn_lost: &CancellationToken,
    ) -> Result<(), ShardError> {
        let conns = Connections {
            consume: &self.consume,
            dead_letters: &self.dead_letters,
        };
        consume_shard(conns, &self.config, ctx, router, redis, stop, conn_lost).await
    }
}

/// Runs every shard task on the two connections until either fails or the
/// worker is told to stop, then closes both; returns whether a connection was
/// lost (rather than the worker told to stop). Shards added meanwhile
/// (`Shards::push`) get their task at once.
#[expect(clippy::too_many_arguments, reason = "the supervisor's one call")]
async fn run_shards(
    consume: &Arc<Connection>,
    dead_letters: &Arc<Connection>,
    config: &Arc<Config>,
    shards: &Shards,
    lanes: &Arc<Lanes>,
    health: &Arc<RedisHealth>,
    routing: &Routing,
    shutdown: &CancellationToken,
) -> bool {
    let conn_lost = CancellationToken::new();
    let watchers = [
        watch_connection(consume, "broker connection failed", &conn_lost),
        watch_connection(dead_letters, "dead-letter connection failed", &conn_lost),
    ];
    let env = TaskEnv {
        consume: consume.clone(),
        dead_letters: dead_letters.clone(),
        config: config.clone(),
        lanes: lanes.clone(),
        health: health.clone(),
        routing: routing.clone(),
    };
    let mut tasks = JoinSet::new();
    let mut started = 0;
    let mut lost = false;
    loop {
        let added = shards.added.notified();
        tokio::pin!(added);
        added.as_mut().enable();
        for (ctx, wanted) in shards.since(started) {
            started += 1;
            tasks.spawn(shard_task(
                env.clone(),
                ctx,
                wanted,
                shutdown.clone(),
                conn_lost.clone(),
            ));
        }
        let joined = tokio::select! {
            joined = tasks.join_next() => joined,
            () = &mut added => continue,
        };
        let Some(joined) = joined else { break };
        match joined {
            Ok((_, Ok(()))) => {}
            Ok((shard, Err(e))) => {
                if !lost && !shutdown.is_cancelled() {
                    log_shard_failure(shard, &e);
                }
                lost = true;
                conn_lost.cancel();
            }
            Err(e) => {
                tracing::error!(error = %e, "shard task crashed; restarting the connection");
                lost = true;
                conn_lost.cancel();
            }
        }
        if tasks.is_empty() {
            break;
        }
    }
    for watcher in watchers {
        watcher.abort();
    }
    // Shards first (they close their channels), then the connections.
    close_connection(consume).await;
    close_connection(dead_letters).await;
    lost
}

/// One shard's task: consumes the shard (and the holding queues of moves
/// into it) while this worker should own it; hands it over (drain, close)
/// when the fleet's assignment moves it away.
async fn shard_task(
    env: TaskEnv,
    ctx: Arc<ShardContext>,
    mut wanted: watch::Receiver<bool>,
    shutdown: CancellationToken,
    conn_lost: CancellationToken,
) -> (ShardId, Result<(), ShardError>) {
    let mut redis = env.order_state(ctx.dedup.clone());
    let queue = env.config.names.shard_queue(ctx.shard);
    let mut router = env
        .routing
        .router(&env.config, Source::Shard(ctx.shard.get()), queue);
    loop {
        match until_wanted(&mut wanted, &shutdown, &conn_lost).await {
            Wanted::Yes => {}
            Wanted::Stop => return (ctx.shard, Ok(())),
            // Idle (handed over, or never assigned): nothing to
            // clean up, but the connections must be made again.
            Wanted::ConnectionLost => return (ctx.shard, Err(ShardError::ConnectionLost)),
        }
        let stop = shutdown.child_token();
        let handover = async {
            while *wanted.borrow_and_update() {
                if wanted.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            stop.cancel();
            std::future::pending::<()>().await
        };
        let holds_stop = stop.child_token();
        let main = async {
            let consumed = env
                .consume(&ctx, &mut router, &mut redis, &stop, &conn_lost)
                .await;
            holds_stop.cancel();
            consumed
        };
        let holds = async {
            let held = consume_holds(&env, &ctx, &holds_stop, &conn_lost).await;
            // A holding queue's consumer failed: the shard's stops too, and
            // the task ends with the failure (the worker reconnects).
            if held.is_err() {
                stop.cancel();
            }
            held
        };
        let both = async {
            let (main, holds) = tokio::join!(main, holds);
            main.and(holds)
        };
        let result = tokio::select! {
            result = both => result,
            () = handover => Ok(()),
        };
        if shutdown.is_cancelled() || result.is_err() {
            return (ctx.shard, result);
        }
        tracing::info!(shard = %ctx.shard, "shard handed over");
    }
}

/// Consumes the holding queue of every move into `ctx`'s shard once the
/// move is drained (ARCHITECTURE.md, "Resharding: the protocol", step 5),
/// each with a fence of its own taken at its start, until `stop`. A holding
/// queue the reshard deleted ends its consumer; one the topology no longer
/// names (the reshard done) is stopped.
async fn consume_holds(
    env: &TaskEnv,
    ctx: &Arc<ShardContext>,
    stop: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Result<(), ShardError> {
    let mut topology = env.routing.topology.clone();
    // By queue name: a move's number repeats in the next reshard, its
    // queue's name (with the reshard's generation) does not.
    let mut running: std::collections::BTreeMap<String, CancellationToken> = Default::default();
    let mut ended = std::collections::BTreeSet::new();
    let mut tasks: JoinSet<(String, Result<(), ShardError>)> = JoinSet::new();
    let mut failed = None;
    loop {
        let wanted = topology
            .borrow_and_update()
            .holds_into(ctx.shard.get(), &env.config);
        for (id, queue) in &wanted {
            if running.contains_key(queue) || ended.contains(queue) {
                continue;
            }
            let token = stop.child_token();
            running.insert(queue.clone(), token.clone());
            let (env, ctx, queue, conn_lost) =
                (env.clone(), ctx.clone(), queue.clone(), conn_lost.clone());
            let name = queue.clone();
            let id = *id;
            tracing::info!(shard = %ctx.shard, %queue, "move drained: consuming its holding queue");
            tasks.spawn(async move {
                let mut router = env.routing.router(&env.config, Source::Hold(id), queue);
                let mut redis = env.order_state(ctx.dedup.with_own_fence());
                let consumed = env
                    .consume(&ctx, &mut router, &mut redis, &token, &conn_lost)
                    .await;
                match consumed {
                    // The reshard deleted it, empty.
                    Err(ShardError::ConsumerCancelled) => (name, Ok(())),
                    other => (name, other),
                }
            });
        }
        for (queue, token) in &running {
            if !wanted.iter().any(|(_, w)| w == queue) {
                token.cancel();
            }
        }
        tokio::select! {
            changed = topology.changed(), if failed.is_none() => {
                // The follower ends with the worker: only the stop is left.
                if changed.is_err() {
                    stop.cancelled().await;
                    break;
                }
            }
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                let (queue, result) = joined.unwrap_or_else(|e| (String::new(), Err(ShardError::Crashed(e.to_string()))));
                running.remove(&queue);
                ended.insert(queue);
                if let Err(e) = result {
                    failed.get_or_insert(e);
                    for token in running.values() {
                        token.cancel();
                    }
                }
            }
            () = stop.cancelled() => break,
        }
        if failed.is_some() && tasks.is_empty() {
            break;
        }
    }
    for token in running.values() {
        token.cancel();
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok((_, Err(e))) = joined {
            failed.get_or_insert(e);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// What an idle shard task waited for.
enum Wanted {
    /// This worker should consume the shard.
    Yes,
    /// The worker is told to stop.
    Stop,
    /// A connection failed: the task must end so that the worker reconnects
    /// (an idle task that waited on would keep the worker from it).
    ConnectionLost,
}

/// Waits until this worker should consume the shard, or the worker is told
/// to stop, or a connection is lost.
async fn until_wanted(
    wanted: &mut watch::Receiver<bool>,
    shutdown: &CancellationToken,
    conn_lost: &CancellationToken,
) -> Wanted {
    loop {
        if shutdown.is_cancelled() {
            return Wanted::Stop;
        }
        if conn_lost.is_cancelled() {
            return Wanted::ConnectionLost;
        }
        if *wanted.borrow_and_update() {
            return Wanted::Yes;
        }
        tokio::select! {
            changed = wanted.changed() => {
                if changed.is_err() {
                    return if !shutdown.is_cancelled() && *wanted.borrow() {
                        Wanted::Yes
                    } else {
                        Wanted::Stop
                    };
                }
            }
            () = shutdown.cancelled() => return Wanted::Stop,
            () = conn_lost.cancelled() => return Wanted::ConnectionLost,
        }
    }
}

/// Cancels `conn_lost` when `conn` fails. Channel errors (a standby's refused
/// consume) are the shard's business; only connection errors end every shard.
fn watch_connection(
    conn: &Connection,
    what: &'static str,
    conn_lost: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let mut events = conn.events_listener();
    let conn_lost = conn_lost.clone();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(e) = event
                && !e.is_amqp_soft_error()
            {
                tracing::warn!(error = %e, "{what}");
                conn_lost.cancel();
                return;
            }
        }
    })
}

fn log_shard_failure(shard: ShardId, e: &ShardError) {
    tracing::warn!(shard = %shard, error = %e, "shard consumer stopped; reconnecting");
}

/// Makes both connections again, with capped exponential backoff, until it
/// works or the worker is told to stop.
async fn reconnect(
    config: &Config,
    shutdown: &CancellationToken,
    metrics: &Metrics,
) -> Option<Broker> {
    let mut backoff = Backoff::new();
    let mut tries = 0u32;
    loop {
        if !backoff.wait(shutdown).await {
            return None;
        }
        tries += 1;
        match Broker::connect(config).await {
            Ok(conns) => {
                metrics.broker_reconnected();
                tracing::info!(tries, "reconnected to the broker");
                spawn_stamp_probe(config, false);
                return Some(conns);
            }
            Err(e) => tracing::warn!(tries, error = %e, "reconnect failed"),
        }
    }
}

/// The longest worker name a connection name carries, in bytes.
const NAME_MAX: usize = 64;

/// The longest shard list a connection name carries, in bytes; past it the
/// name gives the count and the span.
const SHARD_LIST_MAX: usize = 160;

/// The consuming connection's name: the worker's name and its shards, as
/// ranges (`shardline worker w1 shards 0-511,600-1023`) or, when those would
/// be longer than [`SHARD_LIST_MAX`], as a count and a span (`shardline
/// worker w1 700 shards from 3 to 1023`). Bounded — the name travels in the
/// handshake's client properties, which RabbitMQ takes only up to 4 KiB, and a
/// list of 1,024 shards was 4,370 bytes — so it only hints; which worker owns
/// which shard is in the shard status documents, which `topology status`
/// (and the console) show, and in the consumer tags (`{worker}/shard-{i}`).
fn connection_name(config: &Config) -> String {
    format!(
        "shardline worker {} {}",
        bounded(&config.worker_name, NAME_MAX),
        shard_summary(&config.assign)
    )
}

/// Says that the worker is connected, and what `--group-commit` came to
/// where it is not the default prefetch's plain serial path: the group size
/// and its repeat bound, or why `auto` is off.
fn log_connected(config: &Config) {
    tracing::info!(
        worker = %config.worker_name, shards = config.assign.len(), amqp = %config.amqp,
        "worker connected"
    );
    let grouping = config.grouping();
    if let Some(why) = grouping.off_because {
        tracing::info!(
            "group commit (auto) is off because {why}: each event is claimed, committed and acked on its own"
        );
    } else if grouping.size > 1 {
        tracing::info!(
            size = grouping.size,
            "group commit: up to {} first deliveries per shard are claimed, committed and acked together; a crash may repeat up to that many calls per shard (--group-commit 1: at most one)",
            grouping.size
        );
    }
}

/// The dead-letter connection's name (named apart from the consuming one).
fn dead_letters_name(config: &Config) -> String {
    format!(
        "shardline worker {} dead letters",
        bounded(&config.worker_name, NAME_MAX)
    )
}

/// `shards 0-3,7,9-11`, or `700 shards from 3 to 1023` past [`SHARD_LIST_MAX`].
fn shard_summary(shards: &[ShardId]) -> String {
    let mut ids: Vec<u16> = shards.iter().map(|s| s.get()).collect();
    ids.sort_unstable();
    ids.dedup();
    let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
        return "no shards".to_owned();
    };
    let mut ranges: Vec<(u16, u16)> = Vec::new();
    for id in ids.iter().copied() {
        match ranges.last_mut() {
            Some((_, end)) if u32::from(*end) + 1 == u32::from(id) => *end = id,
            _ => ranges.push((id, id)),
        }
    }
    let list = ranges
        .iter()
        .map(|&(start, end)| match start == end {
            true => start.to_string(),
            false => format!("{start}-{end}"),
        })
        .collect::<Vec<_>>()
        .join(",");
    if list.len() <= SHARD_LIST_MAX {
        format!("shards {list}")
    } else {
        format!("{} shards from {first} to {last}", ids.len())
    }
}

/// `text` cut to at most `max` bytes, on a character boundary, with `…`
/// after a cut.
fn bounded(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end]).into()
}

/// Refuses a start the process could not carry before anything connects
/// (`limits`): too few file descriptors for the shards, the handler's calls
/// in flight and the metrics endpoint. An elastic member over the channel
/// ceiling is only warned: its share of the shards is what counts.
fn check_limits(config: &Config, handler: &dyn Handler) -> Result<(), WorkerError> {
    let shards = config.assign.len();
    if config.fleet.is_some() && shards > limits::MAX_SHARDS_PER_WORKER {
        tracing::warn!(
            shards,
            ceiling = limits::MAX_SHARDS_PER_WORKER,
            "an elastic member can consume at most {} shards (one broker channel each): with fewer \
             than {} members some shards stay unconsumed",
            limits::MAX_SHARDS_PER_WORKER,
            shards.div_ceil(limits::MAX_SHARDS_PER_WORKER)
        );
    }
    let calls = shards.saturating_mul(usize::from(config.concurrency.max(1)));
    let need = limits::FileNeed::of(
        shards,
        handler.connections(calls),
        config.metrics_addr.map(|_| &config.metrics_limits),
    );
    limits::check_files(&need)?;
    Ok(())
}

/// Refuses when the broker allows fewer channels per connection than the
/// shards need (a `channel_max` set below RabbitMQ's 2,047): the shards past
/// it would fail, and the supervisor reconnect for ever.
fn check_channels(conn: &Connection, config: &Config) -> Result<(), WorkerError> {
    let channel_max = conn.configuration().channel_max();
    match limits::check_channel_max(channel_max, config.assign.len()) {
        Ok(()) => Ok(()),
        Err(e) if config.fleet.is_none() => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, "an elastic member given this many shards could not consume them all");
            Ok(())
        }
    }
}

/// Fails at start-up, naming the queue, when the topology was not applied,
/// or the broker refuses the start. Each check runs on a connection of its
/// own, closed after: lapin (4.12) never frees the id of a channel the broker
/// closed (the 404 that shows a queue missing), and a connection that has
/// opened `channel_max` channels reuses ids, so a check of 1,024 queues after
/// another would fail on a stale 404 — and the consume connection, were the
/// checks run there, would hand a shard such an id (and the worker reconnect).
async fn check_queues(config: &Config) -> Result<(), WorkerError> {
    if !config.allow_shard_mismatch {
        refuse_a_count_the_record_disagrees_with(config).await?;
    }
    on_own_connection(config, async |conn| {
        check_channels(conn, config)?;
        check_each_queue(conn, config).await
    })
    .await?;
    on_own_connection(config, async |conn| {
        declare::check_queue_arguments(conn, &config.names, &config.topology()).await?;
        if !config.allow_shard_mismatch {
            // The record that stands (a topology of before records adopted
            // at the broker's count), else the count checked on the broker.
            Box::pin(record::standing(
                &config.redis,
                &config.keys(),
                conn,
                &config.names,
                config.shards,
                "worker",
            ))
            .await?;
        }
        Ok(())
    })
    .await?;
    let facts = probe::read_all(
        &config.amqp,
        config.management.as_ref(),
        &config.names,
        config.shards,
    )
    .await;
    let findings = probe::assess(&facts, &config.probe_plan());
    if let Some(line) = probe::refusal(&findings) {
        return Err(WorkerError::Refused(line));
    }
    probe::log(&findings);
    Ok(())
}

/// A `shards` the recorded topology disagrees with is refused first, naming
/// the recorded count (it would otherwise show as a missing queue). The
/// command line follows the record before it builds the worker's config; a
/// library caller is told. Without a readable record nothing is refused here.
async fn refuse_a_count_the_record_disagrees_with(config: &Config) -> Result<(), WorkerError> {
    let Ok(mut redis) = config.redis.connect().await else {
        return Ok(());
    };
    match record::read(&mut redis, &config.keys()).await {
        Ok(Some(record)) if !record.agrees(config.shards) => {
            let then = format!("set shards to {}", record.shards);
            Err(WorkerError::Refused(
                record.config_disagreement(config.shards, &then),
            ))
        }
        _ => Ok(()),
    }
}

/// Runs `check` on a broker connection made for it, then closes it.
async fn on_own_connection(
    config: &Config,
    check: impl AsyncFnOnce(&Connection) -> Result<(), WorkerError>,
) -> Result<(), WorkerError> {
    let name = format!(
        "shardline worker {} start-up checks",
        bounded(&config.worker_name, NAME_MAX)
    );
    let conn = broker::connect(&config.amqp, &name).await?;
    let checked = check(&conn).await;
    close_connection(&conn).await;
    checked
}

/// Every assigned shard queue exists (a passive declare each).
async fn check_each_queue(conn: &Connection, config: &Config) -> Result<(), WorkerError> {
    for &shard in &config.assign {
        match declare::queue_status(conn, &config.names.shard_queue(shard)).await {
            Ok(_) => {}
            // Its shard waits for the node (`shard.rs`); the others run.
            Err(e @ declare::DeclareError::HomeNodeDown { .. }) => {
                tracing::warn!(shard = %shard, error = %e, "shard queue unavailable at start: its consumer keeps trying");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn redis_pool(config: &Config) -> Result<RedisPool, WorkerError> {
    // A ceiling, not what is held: the shards share `redis_connections`
    // (store.rs), which grow with the queues a reshard adds (its shards and
    // holding queues); the status writer, membership, the topology's
    // follower, markers, breaker and start-up checks take one for a moment.
    config
        .redis
        .pool(crate::store::redis_connections(usize::MAX) + 4)
        .map_err(WorkerError::Redis)
}

/// Records when the order-state layout was switched on (once, for the
/// fleet: `SET NX`) and reads the Redis failover era. Best effort: with Redis
/// down the shards wait for it anyway.
async fn start_order_state(pool: &RedisPool, keys: &Keys, era: &RedisEra) {
    let started: Result<(), String> = async {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        let layout = serde_json::json!({ "layout": "order-state", "since_ms": live::unix_ms() });
        redis::cmd("SET")
            .arg(keys.layout())
            .arg(layout.to_string())
            .arg("NX")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        era.check(&mut conn).await.map_err(|e| e.to_string())
    }
    .await;
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot record the order-state layout or read the Redis era at start");
    }
}

/// Warns when Redis may evict dedup keys (docs/semantics.md §3: anything but `noeviction`).
async fn warn_if_redis_may_evict(pool: &RedisPool) {
    let policy: Result<Vec<String>, String> = async {
        let mut conn = pool.get().await.map_err(|e| e.to_string())?;
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match policy {
        Ok(pair) => match pair.get(1).map(String::as_str) {
            Some("noeviction") => {}
            Some(other) => tracing::warn!(
                policy = other,
                "Redis maxmemory-policy is not `noeviction`: dedup and sequence keys may be evicted \
                 under memory pressure, letting duplicates through; set `maxmemory-policy noeviction`"
            ),
            None => {}
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot read Redis maxmemory-policy (Redis unreachable or CONFIG disabled)")
        }
    }
}

#[cfg(test)]
mod tests {
    use shardline_contract::ShardCount;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn reconnects_back_off_doubling_to_the_cap_and_stop_at_once() {
        let stop = CancellationToken::new();
        let mut backoff = Backoff::new();
        let mut waits = Vec::new();
        for _ in 0..7 {
            let before = tokio::time::Instant::now();
            assert!(backoff.wait(&stop).await);
            waits.push(before.elapsed().as_millis());
        }
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 5000, 5000]);
        backoff.reset();
        stop.cancel();
        let before = tokio::time::Instant::now();
        assert!(!backoff.wait(&stop).await, "a stop ends the wait");
        assert_eq!(before.elapsed(), Duration::ZERO);
    }

    /// A connection name stays far below the 4 KiB RabbitMQ takes in the
    /// handshake: 17 bytes of prefix, the name's 64, the shards' 7 + 160.
    const NAME_BOUND: usize = 17 + NAME_MAX + 1 + 7 + SHARD_LIST_MAX;

    fn config(name: &str, shards: u16, assign: impl IntoIterator<Item = u16>) -> Config {
        let count = ShardCount::new(u32::from(shards)).unwrap();
        Config {
            worker_name: name.to_owned(),
            shards: count,
            assign: assign
                .into_iter()
                .map(|i| ShardId::new(u32::from(i), count).unwrap())
                .collect(),
            ..Config::default()
        }
    }

    #[test]
    fn connection_names_list_shards_as_ranges() {
        let name = |assign: Vec<u16>| connection_name(&config("w1", 1024, assign));
        assert_eq!(
            name((0..1024).collect()),
            "shardline worker w1 shards 0-1023"
        );
        assert_eq!(
            name((0..512).chain(600..1024).collect()),
            "shardline worker w1 shards 0-511,600-1023"
        );
        assert_eq!(
            name(vec![9, 0, 1, 2, 7, 3]),
            "shardline worker w1 shards 0-3,7,9"
        );
        assert_eq!(
            dead_letters_name(&config("w1", 16, 0..16)),
            "shardline worker w1 dead letters"
        );
    }

    #[test]
    fn connection_names_stay_bounded_whatever_the_assignment() {
        let sparse: Vec<u16> = (0..1024).filter(|i| i % 3 != 1).collect();
        assert_eq!(
            connection_name(&config("w1", 1024, sparse.clone())),
            "shardline worker w1 683 shards from 0 to 1023"
        );
        let long = "w".repeat(5000);
        let accents = "é".repeat(2000);
        let cases = [
            config("w1", 1024, 0..1024),
            config("w1", 1024, sparse),
            config("w1", 4096, (0..4096).step_by(2)),
            config("w1", 4096, (0..4096).filter(|i| i % 7 != 0)),
            config(&long, 4096, (0..4096).step_by(2)),
            config(&accents, 1024, 0..1024),
        ];
        for config in &cases {
            for name in [connection_name(config), dead_letters_name(config)] {
                assert!(name.len() <= NAME_BOUND, "{} bytes: {name}", name.len());
            }
        }
        let cut = connection_name(&cases[5]);
        assert!(cut.starts_with("shardline worker éé"), "{cut}");
        assert!(cut.contains("é… shards 0-1023"), "{cut}");
    }

    #[test]
    fn names_are_cut_on_a_character_boundary() {
        assert_eq!(bounded("short", 64), "short");
        assert_eq!(bounded(&"x".repeat(64), 64).len(), 64);
        let long = "x".repeat(65);
        let cut = bounded(&long, 64);
        assert!(cut.len() <= 64 && cut.ends_with('…'), "{cut}");
        // 'é' is 2 bytes, '🦀' 4: a cut never splits one.
        for text in [
            "é".repeat(40),
            "🦀".repeat(20),
            format!("a{}", "🦀".repeat(20)),
        ] {
            let cut = bounded(&text, 64);
            assert!(cut.len() <= 64, "{cut}");
            assert!(cut.ends_with('…'), "{cut}");
        }
    }
}
