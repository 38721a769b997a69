//! Resharding in the worker (ARCHITECTURE.md, "Resharding: the protocol"):
//! following the recorded topology, deciding per delivery whether its queue
//! processes it, forwards it or waits ([`verdict`]), honouring the markers,
//! and the worker's forwarder, one registered publisher.
//!
//! A worker follows the topology without a restart: [`follow`] reads the
//! record and the moves released so far every [`FOLLOW_EVERY`] and publishes
//! what it read ([`Followed`]); each consumer's [`Router`] decides by the
//! latest. The supervisor starts consumers for the queues the record serves
//! (a reshard's target shards, the holding queues of moves into this
//! worker's shards once drained, the retired queues of a shrink).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use shardline_connect::{RedisPool, reshard as stored};
use shardline_contract::headers;
use shardline_contract::reshard::{
    Generation, Honour, MarkerKind, MoveId, Source, Verdict, View, verdict,
};
use shardline_contract::topology::{GenerationWatch, Routing, TopologyRecord};
use shardline_contract::{Keys, OrderId};
use shardline_publisher::Publisher;
use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::context::ShardContext;
use crate::delivery::{Marker, Ready};

/// How often a worker reads the recorded topology and the released moves.
pub(crate) const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// How long a failed forward waits before it is tried again.
const FORWARD_RETRY: Duration = Duration::from_secs(1);

/// What the worker knows of the topology.
#[derive(Debug, Clone, Default)]
pub(crate) struct Followed {
    /// The routing and the consumer's view; `None` without a record (every
    /// queue processes what it gets, as before resharding).
    pub(crate) routed: Option<(Routing, View)>,
    /// The shard queues the record serves (`TopologyRecord::served`).
    pub(crate) served: BTreeSet<u16>,
}

impl Followed {
    /// What `record` (with the moves drained and closed so far) says.
    pub(crate) fn of(
        record: &TopologyRecord,
        drained: BTreeSet<MoveId>,
        closed: BTreeSet<MoveId>,
    ) -> Result<Self, shardline_contract::topology::RecordError> {
        Ok(Self {
            routed: Some(record.view(drained, closed)?),
            served: record.served(),
        })
    }

    /// The generation publishers route by now.
    pub(crate) fn generation(&self) -> Generation {
        self.routed
            .as_ref()
            .map_or(Generation(0), |(routing, _)| routing.generation())
    }

    /// The moves into shard `to` whose holding queue its owner consumes now
    /// (drained), with the queue's name.
    pub(crate) fn holds_into(&self, to: u16, config: &Config) -> Vec<(MoveId, String)> {
        let Some((_, View::Resharding(progress))) = &self.routed else {
            return Vec::new();
        };
        let from = progress.reshard.from().0;
        progress
            .reshard
            .plan()
            .moves
            .iter()
            .enumerate()
            .filter(|(_, m)| m.to.get() == to)
            .filter_map(|(i, m)| {
                let id = MoveId(u16::try_from(i).ok()?);
                progress
                    .drained
                    .contains(&id)
                    .then(|| (id, config.names.hold_queue(from, m.from, m.to)))
            })
            .collect()
    }

    /// What a consumer of `source` does with an event of `order_id`.
    fn decide(&self, source: Source, order_id: &str) -> Decision {
        let Some((routing, view)) = &self.routed else {
            return Decision::Process;
        };
        let bucket = routing.bucket_of(order_id);
        match verdict(view, source, bucket) {
            Ok(Verdict::Process) => Decision::Process,
            Ok(Verdict::Forward(_)) => Decision::Forward(routing.generation()),
            Ok(Verdict::Wait) => Decision::Wait,
            // Not met (every bucket has a route); processing here loses nothing.
            Err(e) => {
                tracing::warn!(error = %e, order = %order_id.escape_debug(), "no route for the order: processed where it is");
                Decision::Process
            }
        }
    }

    /// The moves whose buckets `source` keeps: closed moves into a shard
    /// (its consumer takes a new epoch before it writes their keys).
    fn closed_into(&self, source: Source) -> BTreeSet<MoveId> {
        let (Some((_, View::Resharding(progress))), Source::Shard(j)) = (&self.routed, source)
        else {
            return BTreeSet::new();
        };
        progress
            .closed
            .iter()
            .copied()
            .filter(|id| {
                progress
                    .reshard
                    .final_shard(*id)
                    .is_some_and(|s| s.get() == j)
            })
            .collect()
    }
}

/// A consumer's decision on one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Process,
    /// Forward it, by a route at least this generation's.
    Forward(Generation),
    /// Leave it unacked until the topology changes.
    Wait,
}

/// Reads the record and the released moves every [`FOLLOW_EVERY`] until
/// `stop`, publishing each change. A generation lower than one seen stops
/// the following, loudly: the consumers keep deciding by the last map read
/// (a failover lost a write; docs/operating/topology.md).
pub(crate) async fn follow(
    pool: RedisPool,
    keys: Keys,
    sender: watch::Sender<Arc<Followed>>,
    stop: CancellationToken,
) {
    let mut generations = GenerationWatch::default();
    // The record as written and the released moves: a reshard's last write
    // keeps the generation of its step before (g + 2), so the text is compared.
    let mut seen: Option<(String, BTreeSet<MoveId>, BTreeSet<MoveId>)> = None;
    let mut failing = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(FOLLOW_EVERY) => {}
            () = stop.cancelled() => return,
        }
        let read = async {
            let mut conn = pool.get().await.map_err(|e| e.to_string())?;
            stored::standing(&mut conn, &keys)
                .await
                .map_err(|e| e.to_string())
        };
        let (record, drained, closed) = match tokio::time::timeout(FOLLOW_EVERY * 4, read).await {
            Ok(Ok(read)) => {
                failing = false;
                read
            }
            Ok(Err(e)) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e, "cannot read the recorded topology: deciding by the last one read");
                }
                continue;
            }
            Err(_) => continue,
        };
        let Some(record) = record else { continue };
        if let Err(e) = generations.observe(&record) {
            tracing::error!(error = %e, "stopped following the recorded topology");
            return;
        }
        let now = (record.encode(), drained.clone(), closed.clone());
        if seen.as_ref() == Some(&now) {
            continue;
        }
        match Followed::of(&record, drained, closed) {
            Ok(followed) => {
                tracing::info!(
                    generation = record.generation,
                    shards = record.shards,
                    reshard = ?record.reshard.as_ref().map(|r| (r.to, r.phase)),
                    drained = now.1.len(),
                    closed = now.2.len(),
                    "following the recorded topology"
                );
                sender.send_replace(Arc::new(followed));
                seen = Some(now);
            }
            Err(e) => tracing::warn!(error = %e, "the recorded topology cannot be followed"),
        }
    }
}

/// The worker's forwarder: one registered publisher (it takes part in the
/// reshard's barriers), connected on first use and kept registered while
/// the worker runs.
pub(crate) struct Forwarder {
    config: shardline_publisher::Config,
    publisher: Mutex<Option<Publisher>>,
}

impl Forwarder {
    pub(crate) fn new(config: &Config) -> Self {
        let publisher = shardline_publisher::Config {
            amqp: config.amqp.clone(),
            names: config.names.clone(),
            shards: config.shards,
            redis: Some(config.redis.clone()),
            redis_prefix: config.redis_prefix.clone(),
            window: 1,
            connection_name: format!("shardline worker {} forwarder", config.worker_name),
            // Follows the record (without it a publisher routes by md5 mod
            // shards, and a forward would go back where it came from).
            check_shard_count: true,
            ..shardline_publisher::Config::default()
        };
        Self {
            config: publisher,
            publisher: Mutex::new(None),
        }
    }

    /// Publishes `delivery` (properties and body as they are) to its order's
    /// route at `generation` or later, confirmed. The routing key it went to.
    async fn forward(
        &self,
        body: &[u8],
        properties: &lapin::BasicProperties,
        order_id: &OrderId,
        generation: Generation,
    ) -> Result<String, shardline_publisher::PublishError> {
        let mut slot = self.publisher.lock().await;
        let publisher = match slot.as_mut() {
            Some(publisher) => publisher,
            None => slot.insert(Publisher::connect(self.config.clone()).await?),
        };
        let sent = publisher
            .forward(order_id, body.to_vec(), properties.clone(), generation)
            .await;
        if sent.is_err() {
            // A fresh one next time: this one's channel may be gone.
            *slot = None;
        }
        sent
    }

    /// Keeps the lease renewed while idle (a registered publisher that
    /// neither renews nor lapses would hold a barrier), until `stop`.
    pub(crate) async fn keep_registered(self: Arc<Self>, stop: CancellationToken) {
        let every = shardline_connect::publishers::LEASE / 4;
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = stop.cancelled() => break,
            }
            let mut slot = self.publisher.lock().await;
            if let Some(publisher) = slot.as_mut()
                && let Err(e) = publisher.flush().await
            {
                tracing::warn!(error = %e, "the forwarder lost its registration; registering again at its next forward");
                *slot = None;
            }
        }
        if let Some(publisher) = self.publisher.lock().await.take()
            && let Err(e) = publisher.close().await
        {
            tracing::debug!(error = %e, "closing the forwarder");
        }
    }
}

/// One consumer's side of resharding: its queue, what it decides by, and
/// where it forwards and honours.
pub(crate) struct Router {
    pub(crate) source: Source,
    pub(crate) queue: String,
    topology: watch::Receiver<Arc<Followed>>,
    forwarder: Arc<Forwarder>,
    pool: RedisPool,
    keys: Keys,
    /// Closed moves into this shard it took a new epoch for.
    renewed_for: BTreeSet<MoveId>,
}

/// What the loop does with a delivery after routing.
pub(crate) enum Routed {
    /// Process it here.
    Process(Ready),
    /// Process it here, with a new epoch first: its bucket came with a move
    /// this consumer had not written before.
    ProcessRenewed(Ready),
    /// To forward, by a route at least this generation's: its early claim
    /// is given up first ([`Router::forward`]).
    Forward(Ready, Generation),
    /// A marker: honour it once every earlier delivery is settled.
    Marker(Ready, Marker),
    /// Wait for the topology to change, then route it again.
    Wait(Ready),
}

impl Routed {
    /// It waits until nothing of its shard runs (a concurrent shard).
    pub(crate) fn needs_quiet(&self) -> bool {
        matches!(self, Self::Marker(..) | Self::ProcessRenewed(_))
    }
}

/// Why routing stopped the consumer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteError {
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
    #[error("stopped")]
    Stopped,
}

impl Router {
    pub(crate) fn new(
        source: Source,
        queue: String,
        topology: watch::Receiver<Arc<Followed>>,
        forwarder: Arc<Forwarder>,
        pool: RedisPool,
        keys: Keys,
    ) -> Self {
        Self {
            source,
            queue,
            topology,
            forwarder,
            pool,
            keys,
            renewed_for: BTreeSet::new(),
        }
    }

    /// What to do with `ready`: a marker is handed back to be honoured, an
    /// event its queue does not process is forwarded (confirmed, then
    /// acked) here.
    pub(crate) fn route(&mut self, ready: Ready) -> Routed {
        if let Some(marker) = ready.marker {
            return Routed::Marker(ready, marker);
        }
        let Ok(decoded) = &ready.decoded else {
            return Routed::Process(ready);
        };
        let followed = self.topology.borrow_and_update().clone();
        match followed.decide(self.source, decoded.envelope.order_id.as_str()) {
            Decision::Process => {
                let closed = followed.closed_into(self.source);
                if closed.is_subset(&self.renewed_for) {
                    Routed::Process(ready)
                } else {
                    self.renewed_for = closed;
                    Routed::ProcessRenewed(ready)
                }
            }
            Decision::Wait => Routed::Wait(ready),
            Decision::Forward(generation) => Routed::Forward(ready, generation),
        }
    }

    /// Routes a delivery that waited for the topology again.
    pub(crate) fn route_again(&mut self, pending: &mut Option<Routed>) {
        if let Some(Routed::Wait(ready)) = pending.take() {
            *pending = Some(self.route(ready));
        }
    }

    /// Forwards `ready` (retrying until it is confirmed or the consumer
    /// stops), then acks it. A redelivered event is forwarded marked
    /// [`headers::REDELIVERED`]: a consumer before this one may hold its
    /// claim, which the next one takes over as from a redelivery.
    pub(crate) async fn forward(
        &self,
        ctx: &ShardContext,
        ready: &Ready,
        generation: Generation,
        stop: &CancellationToken,
    ) -> Result<(), RouteError> {
        let Ok(decoded) = &ready.decoded else {
            return Ok(());
        };
        let order_id = &decoded.envelope.order_id;
        let properties = if ready.delivery.redelivered {
            let mut table = ready
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default();
            table.insert(headers::REDELIVERED.into(), AMQPValue::Boolean(true));
            ready.delivery.properties.clone().with_headers(table)
        } else {
            ready.delivery.properties.clone()
        };
        loop {
            match self
                .forwarder
                .forward(&ready.delivery.data, &properties, order_id, generation)
                .await
            {
                Ok(routing_key) => {
                    tracing::debug!(queue = %self.queue, order = %order_id, to = %routing_key, "forwarded");
                    break;
                }
                Err(e) => {
                    tracing::warn!(queue = %self.queue, error = %e, retry_in = ?FORWARD_RETRY, "cannot forward an event; it stays unacked");
                    tokio::select! {
                        () = tokio::time::sleep(FORWARD_RETRY) => {}
                        () = stop.cancelled() => return Err(RouteError::Stopped),
                    }
                }
            }
        }
        ready.delivery.ack(BasicAckOptions::default()).await?;
        ctx.metrics.forwarded();
        Ok(())
    }

    /// Returns when the topology changed (or at once when the follower ended).
    pub(crate) async fn changed(&mut self) {
        if self.topology.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The events of `held` whose order this queue no longer processes
    /// (a marker just moved their bucket): forwarded, in their order, each
    /// ahead of its gap, for the new owner's gate to hold.
    pub(crate) async fn forward_moved(
        &self,
        ctx: &ShardContext,
        held: Vec<Ready>,
        stop: &CancellationToken,
    ) -> Result<(), RouteError> {
        let generation = self.topology.borrow().generation();
        for ready in held {
            self.forward(ctx, &ready, generation, stop).await?;
        }
        Ok(())
    }

    /// Whether `ready`'s order is of a bucket `move_id` moves (a held
    /// event its marker hands over).
    pub(crate) fn moves(&self, ready: &Ready, move_id: MoveId) -> bool {
        let Ok(decoded) = &ready.decoded else {
            return false;
        };
        let followed = self.topology.borrow();
        let Some((routing, View::Resharding(progress))) = &followed.routed else {
            return false;
        };
        let bucket = routing.bucket_of(decoded.envelope.order_id.as_str());
        progress.reshard.plan().move_of(bucket) == Some(move_id)
    }

    /// Honours `marker` (every earlier delivery of the queue is settled),
    /// then acks it; a marker the reshard's record does not hold is
    /// dead-lettered `control` by the caller (`Err`). Redis failing is
    /// retried until it answers or the consumer stops.
    pub(crate) async fn honour(
        &mut self,
        ctx: &ShardContext,
        delivery: &Delivery,
        marker: Marker,
        stop: &CancellationToken,
    ) -> Result<Result<(), String>, RouteError> {
        let answer = loop {
            let tried = async {
                let mut conn = self.pool.get().await.map_err(|e| e.to_string())?;
                stored::honour(
                    &mut conn,
                    &self.keys,
                    marker.id,
                    marker.move_id,
                    marker.kind,
                )
                .await
                .map_err(|e| e.to_string())
            };
            match tried.await {
                Ok(answer) => break answer,
                Err(e) => {
                    tracing::warn!(queue = %self.queue, error = %e, "cannot honour a marker yet; it stays unacked");
                    tokio::select! {
                        () = tokio::time::sleep(FORWARD_RETRY) => {}
                        () = stop.cancelled() => return Err(RouteError::Stopped),
                    }
                }
            }
        };
        match answer {
            Ok(Honour::Honoured(move_id, kind)) => {
                ctx.metrics.marker_honoured();
                tracing::info!(queue = %self.queue, move_id = move_id.0, kind = ?kind, "marker honoured");
                // Decide by it at once, not at the next read.
                self.wait_for_release(move_id, kind, stop).await?;
            }
            Ok(Honour::AlreadyHonoured) => {
                tracing::info!(queue = %self.queue, marker = marker.id.0, "marker honoured before (a redelivery)");
            }
            Err(e) => return Ok(Err(e.to_string())),
        }
        delivery.ack(BasicAckOptions::default()).await?;
        Ok(Ok(()))
    }

    /// Waits until the follower has read `move_id` released, so that the
    /// next delivery is decided with it.
    async fn wait_for_release(
        &mut self,
        move_id: MoveId,
        kind: MarkerKind,
        stop: &CancellationToken,
    ) -> Result<(), RouteError> {
        loop {
            let released = {
                let followed = self.topology.borrow_and_update();
                match &followed.routed {
                    Some((_, View::Resharding(p))) => match kind {
                        MarkerKind::Drain => p.drained.contains(&move_id),
                        MarkerKind::Close => p.closed.contains(&move_id),
                    },
                    _ => true,
                }
            };
            if released {
                return Ok(());
            }
            tokio::select! {
                () = self.changed() => {}
                () = stop.cancelled() => return Err(RouteError::Stopped),
            }
        }
    }
}
