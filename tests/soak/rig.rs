//! The soak's stage and its faults: the cluster, the Sentinels, the workers,
//! the load and the downstream, and what each fault of the schedule does to
//! them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use shardline_contract::topology::TopologyRecord;
use shardline_soak::{
    Fault, FaultKind, FaultRecord, FinalConsumers, Fleet, PoisonKind, SHARDS, Schedule,
};
use shardline_testkit::load::Load;
use shardline_testkit::pg::{PG_URL, ScratchSchema};
use shardline_testkit::sentinel::SentinelSet;
use shardline_testkit::wait::{check, try_wait_until, wait_until};
use shardline_testkit::{
    ChildWorker, Cluster, Downstream, Event, Publisher, QueueType, Reply, TestEnv, order_ids,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::Settings;

/// Orders of the load: the resharding issue's "at least 200 orders".
const ORDERS: usize = 200;
/// Orders the outbox writer appends to (apart from the load's).
const OUTBOX_ORDERS: usize = 40;
/// One outbox transaction (one row) per this long.
const OUTBOX_PACE: Duration = Duration::from_millis(50);
/// The event name of the outbox's rows.
const OUTBOX_EVENT: &str = "order.updated";
/// What the downstream answers in each mode.
const NORMAL: u8 = 0;
const UNAVAILABLE: u8 = 1;
const SLOW: u8 = 2;
/// A slow downstream's answer time.
const SLOW_ANSWER: Duration = Duration::from_millis(300);
/// A memory watermark far below what a node uses: the alarm goes off at once.
const ALARM: &str = "0.0000001";
/// How long a stopped worker may take to drain and exit.
const STOP: Duration = Duration::from_secs(30);
/// How long a fault waits for a node's broker app that a partition stopped
/// (seen: about two minutes after the heal).
const APP_BACK: Duration = Duration::from_secs(240);
/// How long the reshard is run again after failures (a fault cut it off, step 0
/// refused while a breaker was open or the backlog old) before the soak gives up
/// on it; the check then reports it unfinished.
const RESHARD_TRIES: Duration = Duration::from_secs(240);
/// One run of the reshard command before it is killed and run again (it resumes).
const RESHARD_RUN: Duration = Duration::from_secs(90);

pub(crate) struct Rig {
    pub(crate) cluster: Cluster,
    pub(crate) env: TestEnv,
    pub(crate) downstream: Downstream,
    mode: Arc<AtomicU8>,
    redis: Mutex<SentinelSet>,
    workers: Vec<Mutex<Slot>>,
    flags: Vec<Vec<String>>,
    load: Mutex<Option<Load>>,
    /// The load's confirmed events once it stopped, with their confirm times.
    published: std::sync::Mutex<Vec<(Instant, Event)>>,
    /// Poison and hostile events sent, with their confirm times.
    poison: std::sync::Mutex<Vec<(Instant, shardline_soak::Published)>>,
    /// When the reshard finished, if it did.
    resharded: std::sync::Mutex<Option<Instant>>,
    /// The outbox's schema in the machine's PostgreSQL (dropped on drop).
    outbox: ScratchSchema,
    /// The two relays: one publishes, the other stands by.
    relays: Vec<Mutex<Option<ChildWorker>>>,
    /// The outbox writer and what it committed: (order, seq, commit time).
    writer: Mutex<Option<(CancellationToken, tokio::task::JoinHandle<()>)>>,
    committed: Arc<std::sync::Mutex<Vec<(String, u64, Instant)>>>,
}

/// A worker's process and how often it was started.
struct Slot {
    child: Option<ChildWorker>,
    starts: u32,
}

impl Rig {
    pub(crate) async fn start(settings: &Settings, fleet: &Fleet) -> Self {
        let cluster = Cluster::start().await;
        let env = TestEnv::on_all_nodes("soak", QueueType::Quorum, &cluster).await;
        assert_eq!(
            env.shards.get(),
            SHARDS,
            "the schedule's reshard starts from SHARDS"
        );
        let redis = SentinelSet::start(&env.id).await;
        // The record goes where the fleet reads it: the Sentinels' Redis.
        let applied = env
            .shardline_command()
            .args(["topology", "apply"])
            .args(env.global_args_with(&env.amqp_url, &redis.url()))
            .output()
            .await
            .unwrap();
        shardline_testkit::process::assert_exited_ok("`shardline topology apply`", &applied);
        let mode = Arc::new(AtomicU8::new(NORMAL));
        let downstream = {
            let mode = mode.clone();
            Downstream::scripted(move |_, _| match mode.load(Ordering::SeqCst) {
                UNAVAILABLE => Reply::status(503),
                SLOW => Reply::ok().after(SLOW_ANSWER),
                _ => Reply::ok(),
            })
            .await
        };
        let flags = fleet
            .workers
            .iter()
            .map(|w| {
                vec![
                    "--concurrency".to_owned(),
                    w.concurrency.to_string(),
                    "--prefetch".to_owned(),
                    w.prefetch.to_string(),
                ]
            })
            .collect();
        let rig = Self {
            cluster,
            env,
            downstream,
            mode,
            redis: Mutex::new(redis),
            workers: (0..fleet.workers.len())
                .map(|_| {
                    Mutex::new(Slot {
                        child: None,
                        starts: 0,
                    })
                })
                .collect(),
            flags,
            load: Mutex::new(None),
            published: std::sync::Mutex::new(Vec::new()),
            poison: std::sync::Mutex::new(Vec::new()),
            resharded: std::sync::Mutex::new(None),
            outbox: ScratchSchema::new("soak_outbox"),
            relays: Vec::new(),
            writer: Mutex::new(None),
            committed: Arc::new(std::sync::Mutex::new(Vec::new())),
        };
        for i in 0..rig.workers.len() {
            rig.start_worker(i).await;
        }
        let mut rig = rig;
        rig.start_outbox().await;
        let orders = order_ids(&format!("{}-order", rig.env.id), ORDERS);
        let pace = Duration::from_secs_f64(
            shardline_testkit::load::BATCH as f64 / f64::from(settings.rate.max(1)),
        );
        let load = Load::start_paced(&rig.env, rig.env.amqp_target(), orders, pace, |c| {
            c.connection_name = "soak-load".into();
        })
        .await;
        *rig.load.lock().await = Some(load);
        rig
    }

    /// The outbox in a schema of the soak's own, two relays on it (through
    /// the cluster and the Sentinels, like the workers), and a writer that
    /// appends one row per transaction to orders of its own.
    async fn start_outbox(&mut self) {
        let installed = self
            .env
            .shardline_command()
            .args(["outbox", "install", "--database-url", PG_URL])
            .args(["--schema", &self.outbox.name])
            .output()
            .await
            .unwrap();
        shardline_testkit::process::assert_exited_ok("`shardline outbox install`", &installed);
        let redis_url = self.redis.lock().await.url();
        for name in ["relay-0", "relay-1"] {
            let mut cmd = self.env.shardline_command();
            cmd.args(["outbox", "relay", "--database-url", PG_URL])
                .args(["--schema", &self.outbox.name, "--name", name])
                .args(self.env.global_args_with(&self.env.amqp_url, &redis_url));
            self.relays
                .push(Mutex::new(Some(ChildWorker::spawn(&self.env, name, cmd))));
        }
        let stop = CancellationToken::new();
        let (stopped, committed) = (stop.clone(), Arc::clone(&self.committed));
        let (schema, orders) = (
            self.outbox.name.clone(),
            order_ids(&format!("{}-outbox", self.env.id), OUTBOX_ORDERS),
        );
        let task = tokio::spawn(async move {
            let client = shardline_testkit::pg::client().await;
            let append =
                format!("SELECT {schema}.shardline_outbox_append($1, '{OUTBOX_EVENT}', '{{}}')");
            let mut tick = tokio::time::interval(OUTBOX_PACE);
            for i in 0.. {
                tokio::select! {
                    () = stopped.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let order = &orders[i % orders.len()];
                let row = client.query_one(&append, &[order]).await.unwrap();
                let seq = u64::try_from(row.get::<_, i64>(0)).unwrap();
                committed
                    .lock()
                    .unwrap()
                    .push((order.clone(), seq, Instant::now()));
            }
        });
        *self.writer.lock().await = Some((stop, task));
    }

    async fn start_worker(&self, i: usize) {
        let mut slot = self.workers[i].lock().await;
        slot.starts += 1;
        let redis_url = self.redis.lock().await.url();
        let mut cmd = self.env.shardline_command();
        // The workers log at info; RUST_LOG, when set, says otherwise.
        if let Ok(filter) = std::env::var("RUST_LOG") {
            cmd.env("RUST_LOG", filter);
        }
        cmd.arg("worker")
            .args(self.env.global_args_with(&self.env.amqp_url, &redis_url))
            .args(["--assign", "auto", "--worker-name", &format!("w{i}")])
            .args(["--handler", &self.downstream.url()])
            .args(&self.flags[i]);
        let name = format!("w{i}-start{}", slot.starts);
        slot.child = Some(ChildWorker::spawn(&self.env, &name, cmd));
    }

    /// Runs every fault of `schedule` at its time (offsets from `start`), each
    /// in a task of its own so that they overlap as scheduled; returns what
    /// happened once the last one ended and the run's time is up.
    pub(crate) async fn run_schedule(
        &self,
        schedule: &Schedule,
        start: Instant,
    ) -> Vec<FaultRecord> {
        let runs = schedule.faults().iter().map(|fault| async move {
            tokio::time::sleep_until((start + fault.start).into()).await;
            let began = start.elapsed();
            self.inject(fault).await;
            tokio::time::sleep_until((start + fault.start + fault.length).into()).await;
            self.end(fault).await;
            let record = FaultRecord {
                fault: *fault,
                began,
                ended: start.elapsed(),
            };
            println!(
                "soak: {} from {:?} to {:?}",
                fault.kind, record.began, record.ended
            );
            record
        });
        let records = futures_util::future::join_all(runs).await;
        tokio::time::sleep_until((start + schedule.run()).into()).await;
        records
    }

    async fn inject(&self, fault: &Fault) {
        match fault.kind {
            FaultKind::WorkerKill9 { worker } => {
                let mut slot = self.workers[usize::from(worker)].lock().await;
                if let Some(child) = slot.child.as_mut() {
                    child.kill9();
                    child.wait_exit(STOP).await;
                }
            }
            FaultKind::WorkerTerm { worker } => {
                let mut slot = self.workers[usize::from(worker)].lock().await;
                if let Some(child) = slot.child.as_mut() {
                    child.sigterm();
                    child.wait_exit(STOP).await;
                }
            }
            FaultKind::NodeKill9 { node } => self.cluster.kill9(usize::from(node)).await,
            FaultKind::Partition { node } => self.cluster.partition(usize::from(node)).await,
            FaultKind::RedisFailover => {
                let mut redis = self.redis.lock().await;
                let old = redis.kill_primary().await;
                redis.wait_failed_over(old).await;
                redis.restart_node(old).await;
            }
            FaultKind::DownstreamRefused => self.downstream.refuse_connections(),
            FaultKind::Downstream503 => self.mode.store(UNAVAILABLE, Ordering::SeqCst),
            FaultKind::SlowDownstream => self.mode.store(SLOW, Ordering::SeqCst),
            FaultKind::MemoryAlarm { node } => self.set_watermark(node, ALARM).await,
            FaultKind::Poison => self.send_poison().await,
            FaultKind::Reshard { to } => self.reshard(to).await,
        }
    }

    async fn end(&self, fault: &Fault) {
        match fault.kind {
            FaultKind::WorkerKill9 { worker } | FaultKind::WorkerTerm { worker } => {
                self.start_worker(usize::from(worker)).await;
            }
            FaultKind::NodeKill9 { node } => self.cluster.restart(usize::from(node)).await,
            FaultKind::Partition { .. } => self.cluster.heal().await,
            FaultKind::DownstreamRefused => self.downstream.accept_connections().await,
            FaultKind::Downstream503 | FaultKind::SlowDownstream => {
                self.mode.store(NORMAL, Ordering::SeqCst);
            }
            FaultKind::MemoryAlarm { node } => self.set_watermark(node, "0.4").await,
            FaultKind::RedisFailover | FaultKind::Poison | FaultKind::Reshard { .. } => {}
        }
    }

    /// `topology reshard --to to`, run again after every failure (it resumes
    /// at its recorded step) until it finishes or [`RESHARD_TRIES`] passed.
    async fn reshard(&self, to: u16) {
        let tries = Instant::now();
        for attempt in 1.. {
            let redis_url = self.redis.lock().await.url();
            let mut cmd = self.env.shardline_command();
            cmd.args(["topology", "reshard", "--to", &to.to_string()])
                .args(self.env.global_args_with(&self.env.amqp_url, &redis_url));
            let outcome = tokio::time::timeout(RESHARD_RUN, cmd.output()).await;
            match outcome {
                Ok(Ok(out)) if out.status.success() => {
                    *self.resharded.lock().unwrap() = Some(Instant::now());
                    println!(
                        "soak: reshard to {to} finished at attempt {attempt}:\n{}",
                        String::from_utf8_lossy(&out.stdout)
                    );
                    return;
                }
                Ok(Ok(out)) => println!(
                    "soak: reshard attempt {attempt} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Ok(Err(e)) => println!("soak: reshard attempt {attempt} did not run: {e}"),
                Err(_) => println!("soak: reshard attempt {attempt} ran {RESHARD_RUN:?}: killed"),
            }
            if tries.elapsed() > RESHARD_TRIES {
                println!("soak: the reshard to {to} did not finish in {RESHARD_TRIES:?}");
                return;
            }
            // A pause between attempts, not a synchronisation: what refused
            // (an open breaker, an old backlog, a node away) has no event to await.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    /// The topology the fleet is recorded at now, read from the Redis primary.
    pub(crate) async fn topology(&self) -> TopologyRecord {
        let port = self.redis.lock().await.primary_port().await;
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        shardline_connect::record::read(&mut conn, &self.env.keys())
            .await
            .unwrap()
            .expect("the topology is recorded")
    }

    /// When the reshard finished, if it did.
    pub(crate) fn resharded(&self) -> Option<Instant> {
        *self.resharded.lock().unwrap()
    }

    /// Sets a node's memory high watermark, waiting while its broker app is
    /// stopped: a node cut off a moment ago may pause itself again for a
    /// while after it rejoined (`pause_minority`), and the command needs the
    /// app.
    async fn set_watermark(&self, node: u8, fraction: &str) {
        let ctl = self.cluster.ctl(usize::from(node));
        let what = format!("node {node}'s broker to take a memory watermark of {fraction}");
        wait_until(&what, APP_BACK, || async {
            ctl.try_run(&["set_vm_memory_high_watermark", fraction])
                .await
                .map(drop)
        })
        .await;
    }

    /// One undecodable body, one invalid envelope and one valid event with
    /// hostile trace headers, each confirmed (or left out if the broker did
    /// not confirm it: a poison event the broker never took proves nothing).
    async fn send_poison(&self) {
        let Ok(publisher) = Publisher::try_connect(&self.env).await else {
            return;
        };
        let n = self.poison.lock().unwrap().len();
        let hostile = Event::new(&format!("{}-hostile-{n}", self.env.id), 1, self.env.shards);
        let sends: [(PoisonKind, String, u16, Vec<u8>); 3] = [
            (
                PoisonKind::Undecodable,
                format!("soak-undecodable-{n}"),
                0,
                b"\xff\xfe not json".to_vec(),
            ),
            (
                PoisonKind::InvalidEnvelope,
                format!("soak-invalid-{n}"),
                1,
                br#"{"order_id": 7, "seq": "three"}"#.to_vec(),
            ),
            (
                PoisonKind::HostileHeaders,
                hostile.key(),
                hostile.shard,
                hostile.body.clone(),
            ),
        ];
        for (kind, key, shard, body) in sends {
            let props = poison_properties(&key, kind);
            if publisher
                .try_publish_with(shard, &body, props)
                .await
                .is_ok()
            {
                let (order, seq) = match kind {
                    PoisonKind::HostileHeaders => (hostile.order_id.clone(), hostile.seq),
                    _ => (String::new(), 0),
                };
                self.poison.lock().unwrap().push((
                    Instant::now(),
                    shardline_soak::Published {
                        key,
                        order,
                        seq,
                        shard,
                        confirmed_at: Duration::ZERO,
                        poison: Some(kind),
                    },
                ));
            }
        }
    }

    /// The load's events confirmed from the `from`-th on (none once stopped).
    pub(crate) async fn confirmed_since(&self, from: usize) -> Vec<(Instant, Event)> {
        self.load
            .lock()
            .await
            .as_ref()
            .map_or_else(Vec::new, |load| load.confirmed_since(from))
    }

    /// Stops the load between two batches (every event it sent was
    /// confirmed) and the outbox writer after its transaction.
    pub(crate) async fn stop_load(&self) {
        if let Some((stop, task)) = self.writer.lock().await.take() {
            stop.cancel();
            task.await.unwrap();
        }
        if let Some(load) = self.load.lock().await.take() {
            let published = load.stop().await;
            *self.published.lock().unwrap() = published
                .confirmed_at
                .into_iter()
                .zip(published.events)
                .collect();
        }
    }

    /// Every confirmed event, the load's and the poison, as the check reads them.
    pub(crate) fn published(&self, start: Instant) -> Vec<shardline_soak::Published> {
        let since = |at: Instant| at.saturating_duration_since(start);
        let load = self.published.lock().unwrap();
        let events = load.iter().map(|(at, e)| shardline_soak::Published {
            key: e.key(),
            order: e.order_id.clone(),
            seq: e.seq,
            shard: e.shard,
            confirmed_at: since(*at),
            poison: None,
        });
        let poison = self.poison.lock().unwrap();
        let poison = poison.iter().map(|(at, p)| shardline_soak::Published {
            confirmed_at: since(*at),
            ..p.clone()
        });
        // A committed outbox row is an event the relay must publish: it
        // counts as published from its commit.
        let committed = self.committed.lock().unwrap();
        let rows = committed
            .iter()
            .map(|(order, seq, at)| shardline_soak::Published {
                key: format!("{order}:{OUTBOX_EVENT}:{seq}"),
                order: order.clone(),
                seq: *seq,
                shard: self.env.shard_of(order),
                confirmed_at: since(*at),
                poison: None,
            });
        events.chain(poison).chain(rows).collect()
    }

    /// Waits until every shard queue and every reshard's holding queue is
    /// empty (nothing ready, nothing unacked), no holding queue is left and
    /// the outbox is empty, or `timeout` passes; the check then says what is
    /// missing.
    pub(crate) async fn settle(&self, timeout: Duration) {
        let prefix = &self.env.names.queue_prefix;
        let holds = format!("{}move.", prefix.strip_suffix("shard.").unwrap_or(prefix));
        let drained = try_wait_until("the shard queues to drain", timeout, || async {
            let depths = self.env.try_queue_depths().await?;
            let shards_empty = depths
                .iter()
                .filter(|(name, _)| name.starts_with(prefix.as_str()))
                .all(|(_, d)| d.0 == 0);
            let holds_gone = !depths.keys().any(|name| name.starts_with(&holds));
            let outbox_left = self.outbox_left().await?;
            check(shards_empty && holds_gone && outbox_left == 0, || {
                format!("depths {depths:?}, {outbox_left} outbox rows")
            })
        })
        .await;
        if let Err(e) = drained {
            println!("soak: {e}");
        }
    }

    /// Rows still in the outbox (not yet published and confirmed).
    async fn outbox_left(&self) -> Result<i64, String> {
        let client = shardline_testkit::pg::try_client(PG_URL)
            .await
            .map_err(|e| e.to_string())?;
        let query = format!("SELECT count(*) FROM {}.shardline_outbox", self.outbox.name);
        let row = client
            .query_one(&query, &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok(row.get(0))
    }

    /// The active consumers of each queue `topology` serves (its shards and
    /// retired queues), once each has exactly one (the elastic fleet settles
    /// after the last restart) or after a minute.
    pub(crate) async fn final_consumers(&self, topology: &TopologyRecord) -> FinalConsumers {
        let served = topology.served();
        let read = || async {
            let queues = self.env.shard_consumers().await;
            let map: std::collections::BTreeMap<u16, Vec<String>> = served
                .iter()
                .map(|&s| {
                    let rows = queues.get(&self.env.names.shard_queue_named(u32::from(s)));
                    let tags = rows
                        .into_iter()
                        .flatten()
                        .filter(|r| r.active)
                        .map(|r| r.tag.clone())
                        .collect();
                    (s, tags)
                })
                .collect();
            map
        };
        let settled = try_wait_until(
            "one consumer per shard",
            Duration::from_secs(60),
            || async {
                let consumers = read().await;
                check(consumers.values().all(|tags| tags.len() == 1), || {
                    format!("consumers {consumers:?}")
                })
            },
        )
        .await;
        if let Err(e) = settled {
            println!("soak: {e}");
        }
        FinalConsumers(read().await)
    }

    /// Ends every process of the stage (also done on drop, on failure).
    pub(crate) async fn stop(&self) {
        for relay in &self.relays {
            if let Some(mut child) = relay.lock().await.take() {
                child.sigterm();
                let _ = tokio::time::timeout(STOP, child.wait_exit(STOP)).await;
            }
        }
        for slot in &self.workers {
            if let Some(mut child) = slot.lock().await.child.take() {
                child.sigterm();
                let _ = tokio::time::timeout(STOP, child.wait_exit(STOP)).await;
            }
        }
    }
}

/// A poison event's properties: persistent, its key as the message id (the
/// dead letter keeps it), and for the hostile kind trace headers HTTP cannot
/// carry.
fn poison_properties(key: &str, kind: PoisonKind) -> BasicProperties {
    let mut headers = FieldTable::default();
    if kind == PoisonKind::HostileHeaders {
        headers.insert(
            "traceparent".into(),
            AMQPValue::LongString("00-zz\r\nx-injected: 1".into()),
        );
        headers.insert(
            "tracestate".into(),
            AMQPValue::LongString("k=v\0".repeat(200).into()),
        );
        headers.insert(
            "baggage".into(),
            AMQPValue::LongString(vec![0xff, 0xfe].into()),
        );
    }
    BasicProperties::default()
        .with_message_id(key.into())
        .with_delivery_mode(2)
        .with_headers(headers)
}
