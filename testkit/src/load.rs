//! A steady stream of confirmed events, as a shop's publisher sends them
//! (the cluster tests under load and the chaos soak).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardline_connect::AmqpTarget;
use shardline_publisher::{Counts, PublishError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::wait::check;
use crate::{Event, PROCESSING, TestEnv, wait_until};

/// Events per publish batch; every batch is confirmed before the next.
pub const BATCH: usize = 16;
/// One batch per this long by default: 160 events a second, well within
/// what a worker drains on two busy cores, so a backlog means an outage.
pub const PACE: Duration = Duration::from_millis(100);
/// The load's connection name (before ` @ host:port`).
pub const LOAD_CONNECTION: &str = "cluster-load";

/// The same stream of events as a shop's publisher would send it: seq 1 of
/// every order, then seq 2, …, in batches of [`BATCH`], one per [`PACE`],
/// each flushed (every confirm awaited) before the next, through a
/// `shardline_publisher::Publisher`, which reconnects and re-sends what was
/// unconfirmed by itself; a batch with a nacked event is sent again. A stop
/// ends it between batches, so every event it returns was confirmed.
pub struct Load {
    stop: CancellationToken,
    /// When each batch was confirmed.
    confirmed: Arc<Mutex<Vec<Instant>>>,
    /// Every confirmed event, with its batch's confirm time.
    log: Arc<Mutex<Vec<(Instant, Event)>>>,
    task: Option<JoinHandle<Result<Published, PublishError>>>,
}

/// What a [`Load`] published.
#[derive(Debug, Default)]
pub struct Published {
    /// Every event, each confirmed (acked) at least once.
    pub events: Vec<Event>,
    /// When each of `events` was confirmed (its batch's confirm).
    pub confirmed_at: Vec<Instant>,
    /// Summed over the publisher's connections.
    pub counts: Counts,
    /// Batches published again (on a new connection) because the broker
    /// nacked an event of theirs.
    pub nacked_batches: u64,
}

fn add(total: &mut Counts, more: Counts) {
    total.published += more.published;
    total.confirmed += more.confirmed;
    total.resent += more.resent;
    total.reconnects += more.reconnects;
}

/// Publishes `batch` once and waits for every confirm; whether the broker
/// nacked any of its events (the batch is then sent again, whole: a nack is
/// a typed result the caller acts on, and copies of events that were stored
/// are duplicates, which dedup absorbs).
async fn publish_batch(
    publisher: &mut shardline_publisher::Publisher,
    batch: &[Event],
) -> Result<bool, PublishError> {
    let mut nacked = false;
    for event in batch {
        // A nack of an earlier event of the batch surfaces here, before this
        // one is queued; the batch is sent again anyway.
        match publisher.publish(event.body.clone()).await {
            Err(PublishError::Nacked { routing_key, .. }) => {
                tracing::warn!(%routing_key, "load: an event was nacked");
                nacked = true;
            }
            other => other?,
        }
    }
    loop {
        match publisher.flush().await {
            Ok(()) => return Ok(nacked),
            Err(PublishError::Nacked { routing_key, .. }) => {
                tracing::warn!(%routing_key, "load: an event was nacked");
                nacked = true;
            }
            Err(e) => return Err(e),
        }
    }
}

impl Load {
    /// Connects through `target` (failing the test if it cannot) and starts
    /// publishing `orders`' events.
    pub async fn start(env: &TestEnv, target: AmqpTarget, orders: Vec<String>) -> Self {
        Self::start_with(env, target, orders, |_| {}).await
    }

    /// [`Self::start`] with the publisher's config changed by `configure`.
    pub async fn start_with(
        env: &TestEnv,
        target: AmqpTarget,
        orders: Vec<String>,
        configure: impl FnOnce(&mut shardline_publisher::Config),
    ) -> Self {
        Self::start_paced(env, target, orders, PACE, configure).await
    }

    /// [`Self::start_with`], one batch of [`BATCH`] events per `pace`.
    pub async fn start_paced(
        env: &TestEnv,
        target: AmqpTarget,
        orders: Vec<String>,
        pace: Duration,
        configure: impl FnOnce(&mut shardline_publisher::Config),
    ) -> Self {
        let mut config = shardline_publisher::Config {
            amqp: target,
            names: env.names.clone(),
            shards: env.shards,
            connection_name: LOAD_CONNECTION.into(),
            ..shardline_publisher::Config::default()
        };
        configure(&mut config);
        let mut publisher = shardline_publisher::Publisher::connect(config.clone())
            .await
            .unwrap_or_else(|e| panic!("the load's publisher cannot connect: {e}"));
        let (stop, confirmed) = (CancellationToken::new(), Arc::new(Mutex::new(Vec::new())));
        let shards = env.shards;
        let log = Arc::new(Mutex::new(Vec::new()));
        let (stopped, stamps, logged) = (stop.clone(), confirmed.clone(), log.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(pace);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut out = Published::default();
            'rounds: for seq in 1.. {
                let round: Vec<Event> = orders.iter().map(|o| Event::new(o, seq, shards)).collect();
                for batch in round.chunks(BATCH) {
                    tokio::select! {
                        () = stopped.cancelled() => break 'rounds,
                        _ = tick.tick() => {}
                    }
                    // A channel that a survivor opened just after a node was
                    // lost may nack every publish to a queue that node led
                    // (RabbitMQ 3.10.8, seen for minutes): send the batch
                    // again on a new connection, one pace later.
                    while publish_batch(&mut publisher, batch).await? {
                        out.nacked_batches += 1;
                        tick.tick().await;
                        add(&mut out.counts, publisher.counts());
                        publisher.close().await?;
                        publisher = shardline_publisher::Publisher::connect(config.clone()).await?;
                    }
                    let now = Instant::now();
                    stamps.lock().unwrap().push(now);
                    logged
                        .lock()
                        .unwrap()
                        .extend(batch.iter().map(|e| (now, e.clone())));
                    out.events.extend_from_slice(batch);
                    out.confirmed_at
                        .extend(std::iter::repeat_n(now, batch.len()));
                }
            }
            add(&mut out.counts, publisher.counts());
            publisher.close().await?;
            Ok(out)
        });
        Self {
            stop,
            confirmed,
            log,
            task: Some(task),
        }
    }

    /// The events confirmed so far from the `from`-th on, each with the time
    /// its batch was confirmed.
    pub fn confirmed_since(&self, from: usize) -> Vec<(Instant, Event)> {
        let log = self.log.lock().unwrap();
        log.get(from..).unwrap_or_default().to_vec()
    }

    /// Batches confirmed so far.
    pub fn batches(&self) -> usize {
        self.confirmed.lock().unwrap().len()
    }

    /// Waits until `n` batches in all are confirmed; fails at once, with the
    /// publisher's error, if the load ended.
    pub async fn wait_batches(&mut self, what: &str, n: usize) {
        self.wait(what, |stamps| stamps.len() >= n).await;
    }

    /// Waits for the first batch confirmed after `fault`, and returns the
    /// time since the last one confirmed before it: how long publishing
    /// stalled.
    pub async fn wait_resumed(&mut self, fault: Instant) -> Duration {
        self.wait("publishing to resume (a batch confirmed)", |stamps| {
            stamps.last().is_some_and(|t| *t > fault)
        })
        .await;
        let stamps = self.confirmed.lock().unwrap();
        let before = stamps.iter().rev().find(|t| **t <= fault).copied();
        let after = stamps.iter().find(|t| **t > fault).copied();
        match (before, after) {
            (Some(before), Some(after)) => after - before,
            _ => panic!("no confirm before the fault: start the fault after the load"),
        }
    }

    async fn wait(&mut self, what: &str, done: impl Fn(&[Instant]) -> bool) {
        let ended = wait_until(what, PROCESSING, || async {
            if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                return Ok(true);
            }
            let stamps = self.confirmed.lock().unwrap();
            check(done(&stamps), || {
                format!("{} batches confirmed", stamps.len())
            })
            .map(|()| false)
        })
        .await;
        if ended {
            let result = self.task.take().unwrap().await.unwrap();
            panic!(
                "the load ended while waiting for {what}: {:?}",
                result.err()
            );
        }
    }

    /// Stops between two batches; what it published.
    pub async fn stop(mut self) -> Published {
        self.stop.cancel();
        let task = self.task.take().unwrap();
        tokio::time::timeout(PROCESSING, task)
            .await
            .expect("the load did not stop")
            .unwrap()
            .unwrap_or_else(|e| panic!("the load's publisher failed: {e}"))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
