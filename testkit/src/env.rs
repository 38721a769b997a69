//! One isolated environment per test: its own RabbitMQ vhost, Redis key prefix
//! and PostgreSQL schema name, the vhost and the keys removed on drop (the
//! schema by its [`OrdersDb`](crate::OrdersDb)).

use std::collections::BTreeMap;
use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::Connection;
use shardline_connect::TopologyOptions;
use shardline_connect::declare::{self, ShardStatus};
use shardline_contract::QueueType;
use shardline_contract::{Keys, Names, ShardCount, ShardId};
use shardline_worker::{Config, RetryPolicy};

use crate::broker::{BrokerNode, Ctl};
use crate::cluster::Cluster;
use crate::process::assert_exited_ok;
use crate::wait::wait_until;

/// Fleet tests run with this many shards unless made with [`TestEnv::with_shards`].
pub const SHARDS: u16 = 8;
/// The machine's Redis, shared by the tests (each under its own prefix).
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The machine's RabbitMQ, shared by the tests (each in its own vhost).
pub const AMQP_BASE: &str = "amqp://guest:guest@127.0.0.1:5672";

/// Names the directory of a running private node (`scripts/rabbitmq-node
/// start`, e.g. a RabbitMQ 4.0.5 node with `RABBITMQ_ROOT`) that the tests
/// use instead of the machine's node; `RABBITMQ_ROOT` must be set as it was
/// for the start. Tests that start nodes of their own are not moved.
pub const TEST_NODE: &str = "SHARDLINE_TEST_RABBITMQ_NODE";

/// The broker of the tests that do not start one: the node [`TEST_NODE`]
/// names, else the machine's.
fn default_broker() -> (Ctl, String) {
    let Some(dir) = std::env::var_os(TEST_NODE) else {
        return (Ctl::Default, AMQP_BASE.to_owned());
    };
    let dir = std::path::PathBuf::from(dir);
    let port = std::fs::read_to_string(dir.join("amqp_port"))
        .unwrap_or_else(|e| panic!("{TEST_NODE}={}: no node there ({e})", dir.display()));
    let base = format!("amqp://guest:guest@127.0.0.1:{}", port.trim());
    let script = crate::paths::scripts().join("rabbitmq-node");
    (Ctl::Private { script, dir }, base)
}
/// The quorum queues' `x-delivery-limit` that `topology apply` sets by default.
const DELIVERY_LIMIT: u32 = shardline_connect::declare::DEFAULT_DELIVERY_LIMIT;

pub struct TestEnv {
    /// Unique slug of this test run: names the vhost, the Redis prefix, the
    /// PostgreSQL schema and log files.
    pub id: String,
    pub vhost: String,
    pub amqp_url: String,
    pub redis_prefix: String,
    /// `reconcile_<slug>`: the schema an [`OrdersDb`](crate::OrdersDb) creates.
    pub pg_schema: String,
    pub names: Names,
    pub shards: ShardCount,
    /// Type of the shard queues. Every `shardline` process of this environment
    /// gets it as `SHARDLINE_QUEUE_TYPE`, every in-process worker the matching
    /// config. Classic by default.
    pub queue_type: QueueType,
    broker: Ctl,
    /// For the kit's own polling (passive declares), opened on first use.
    probe: tokio::sync::Mutex<Option<Arc<Connection>>>,
}

impl TestEnv {
    /// A fresh vhost on the machine's broker (guest has full rights on it) and a
    /// fresh Redis prefix; classic shard queues.
    pub async fn new(name: &str) -> Self {
        Self::with_queue_type(name, QueueType::Classic).await
    }

    /// [`Self::new`] with shard queues of `queue_type`. The id ends in
    /// `-quorum` for quorum queues, so logs and vhosts say which run they are.
    pub async fn with_queue_type(name: &str, queue_type: QueueType) -> Self {
        let (ctl, base) = default_broker();
        Self::create(name, queue_type, ctl, base).await
    }

    /// [`Self::with_queue_type`] on a private node instead of the machine's.
    pub async fn on_node(name: &str, queue_type: QueueType, node: &BrokerNode) -> Self {
        Self::create(name, queue_type, node.ctl().clone(), node.amqp_base()).await
    }

    /// [`Self::with_queue_type`] on node `node` of a private [`Cluster`]: the
    /// vhost is the cluster's, the environment's URL and `rabbitmqctl` that node's.
    pub async fn on_cluster(
        name: &str,
        queue_type: QueueType,
        cluster: &Cluster,
        node: usize,
    ) -> Self {
        let (ctl, base) = (cluster.ctl(node).clone(), cluster.amqp_base(node));
        Self::create(name, queue_type, ctl, base).await
    }

    /// [`Self::on_cluster`] whose `amqp_url` lists every node (what a fleet
    /// on a cluster is given): tools connect to any node that answers.
    pub async fn on_all_nodes(name: &str, queue_type: QueueType, cluster: &Cluster) -> Self {
        let mut env = Self::on_cluster(name, queue_type, cluster, 0).await;
        env.amqp_url = (0..crate::cluster::NODES)
            .map(|i| cluster.amqp_url(i, &env.vhost))
            .collect::<Vec<_>>()
            .join(",");
        env
    }

    async fn create(name: &str, queue_type: QueueType, broker: Ctl, amqp_base: String) -> Self {
        let name = match queue_type {
            QueueType::Classic => name.to_owned(),
            QueueType::Quorum => format!("{name}-quorum"),
        };
        let id = unique_name(&name, '-');
        let vhost = format!("shardline-test.{id}");
        broker.run(&["add_vhost", &vhost]).await;
        broker
            .run(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"])
            .await;
        let slug: String = id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        // Identifiers are cut at 63 bytes; the id's unique part is its end.
        let pg_schema = format!("reconcile_{}", &slug[slug.len().saturating_sub(50)..]);
        Self {
            amqp_url: format!("{amqp_base}/{}", percent_encode(&vhost)),
            redis_prefix: format!("shardline-test:{id}:"),
            pg_schema,
            vhost,
            id,
            names: Names::default(),
            shards: ShardCount::new(u32::from(SHARDS)).unwrap(),
            queue_type,
            broker,
            probe: tokio::sync::Mutex::default(),
        }
    }

    /// `rabbitmqctl` against this environment's broker.
    pub fn broker(&self) -> &Ctl {
        &self.broker
    }

    /// `SHARDLINE_QUEUE_TYPE` for every `shardline` process of this environment
    /// (set explicitly for classic too, so that nothing inherited changes it).
    pub fn queue_type_env(&self) -> (&'static str, &'static str) {
        let value = match self.queue_type {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        };
        ("SHARDLINE_QUEUE_TYPE", value)
    }

    pub fn is_quorum(&self) -> bool {
        self.queue_type == QueueType::Quorum
    }

    pub fn shard_queue(&self, shard: u16) -> String {
        self.names
            .shard_queue(ShardId::new(u32::from(shard), self.shards).unwrap())
    }

    pub fn shard_of(&self, order_id: &str) -> u16 {
        self.shards.shard_of(order_id).get()
    }

    /// The same environment with `shards` shards instead of [`SHARDS`] (before
    /// its topology is applied).
    pub fn with_shards(mut self, shards: u16) -> Self {
        self.shards = ShardCount::new(u32::from(shards)).unwrap();
        self
    }

    /// The Redis keys of this environment.
    pub fn keys(&self) -> Keys {
        Keys::new(&self.redis_prefix)
    }

    /// The configuration `shardline worker --handler … --worker-name NAME` would
    /// build for this environment, with small retry delays (10 ms, capped at
    /// 100 ms): every shard, the queue type's consume mode and delivery limit.
    pub fn worker_config(&self, name: &str) -> Config {
        let exclusive = TopologyOptions {
            shards: self.shards,
            queue_type: self.queue_type,
            ..TopologyOptions::default()
        }
        .exclusive_consumers();
        Config {
            amqp: self.amqp_target(),
            redis: REDIS_URL.parse().unwrap(),
            redis_prefix: self.redis_prefix.clone(),
            names: self.names.clone(),
            shards: self.shards,
            assign: self.shards.ids().collect(),
            exclusive,
            delivery_limit: self.is_quorum().then_some(DELIVERY_LIMIT),
            worker_name: name.to_owned(),
            retry: RetryPolicy {
                base: Duration::from_millis(10),
                cap: Duration::from_millis(100),
                ..RetryPolicy::default()
            },
            ..Config::default()
        }
    }

    /// Runs the `shardline` binary against this environment with `args`
    /// (global flags `--amqp-url`, `--redis-url`, `--redis-prefix`, `--shards` added).
    pub async fn cli(&self, args: &[&str]) -> Output {
        self.shardline_command()
            .args(args)
            .args(self.global_args())
            .output()
            .await
            .unwrap()
    }

    /// [`Self::cli`] with `--shards shards` instead of this environment's count.
    pub async fn cli_with_shards(&self, shards: u32, args: &[&str]) -> Output {
        self.shardline_command()
            .args(args)
            .args(self.global_args_with_shards(shards))
            .output()
            .await
            .unwrap()
    }

    /// [`Self::global_args`] with `--shards shards` instead of this
    /// environment's count.
    pub fn global_args_with_shards(&self, shards: u32) -> Vec<String> {
        let mut args = self.global_args();
        if let Some(at) = args.iter().position(|a| a == "--shards") {
            args[at + 1] = shards.to_string();
        }
        args
    }

    /// The `shardline` binary with this environment's process environment
    /// (no colour, `RUST_LOG=info`, the queue type), killed on drop; no args yet.
    pub fn shardline_command(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(crate::paths::shardline());
        cmd.env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .env(self.queue_type_env().0, self.queue_type_env().1)
            .kill_on_drop(true);
        cmd
    }

    pub fn global_args(&self) -> Vec<String> {
        self.global_args_with(&self.amqp_url, REDIS_URL)
    }

    /// [`Self::global_args`] with other broker and Redis URLs (TLS, a private Redis).
    pub fn global_args_with(&self, amqp_url: &str, redis_url: &str) -> Vec<String> {
        vec![
            "--amqp-url".into(),
            amqp_url.to_owned(),
            "--redis-url".into(),
            redis_url.to_owned(),
            "--redis-prefix".into(),
            self.redis_prefix.clone(),
            "--shards".into(),
            self.shards.get().to_string(),
        ]
    }

    /// `shardline topology apply` with the defaults; fails the test unless it exits 0.
    pub async fn apply_topology(&self) {
        let out = self.cli(&["topology", "apply"]).await;
        assert_exited_ok("`shardline topology apply`", &out);
    }

    /// The AMQP port of this environment's (first) broker address.
    pub fn amqp_port(&self) -> u16 {
        let (_, rest) = self.amqp_url.split_once("@127.0.0.1:").unwrap();
        rest.split(['/', ',']).next().unwrap().parse().unwrap()
    }

    /// This environment's broker address, parsed.
    pub fn amqp_target(&self) -> shardline_connect::AmqpTarget {
        self.amqp_url.parse().unwrap()
    }

    /// The version of this environment's broker, from its server properties.
    pub async fn broker_version(&self) -> shardline_contract::rabbitmq::Version {
        let info = shardline_connect::probe::server_info(&self.amqp_url)
            .await
            .unwrap();
        info.version
            .unwrap_or_else(|| panic!("unparsable broker version {:?}", info.version_text))
    }

    pub async fn connect(&self) -> Connection {
        shardline_connect::connect(&self.amqp_target(), &format!("fleet-test {}", self.id))
            .await
            .unwrap()
    }

    /// Ready messages and consumers of every shard queue, by passive declare
    /// (on a single-active-consumer queue the count is of the active consumer
    /// only). A classic queue whose cluster node is down counts as empty and
    /// unconsumed.
    pub async fn shard_statuses(&self, conn: &Connection) -> Vec<ShardStatus> {
        let mut out = Vec::new();
        for shard in 0..self.shards.get() {
            let queue = self.shard_queue(shard);
            out.push(match declare::queue_status(conn, &queue).await {
                Ok(status) => status,
                Err(declare::DeclareError::HomeNodeDown { .. }) => ShardStatus {
                    queue,
                    messages: 0,
                    consumers: 0,
                },
                Err(e) => panic!("shard queue {queue}: {e}"),
            });
        }
        out
    }

    /// The consumers of every shard queue by passive declare (cheap, unlike
    /// `rabbitmqctl`), on a connection of the kit's own.
    pub async fn consumer_counts(&self) -> Vec<u32> {
        let conn = {
            let mut probe = self.probe.lock().await;
            match probe.as_ref() {
                Some(conn) if conn.status().connected() => conn.clone(),
                _ => probe.insert(Arc::new(self.connect().await)).clone(),
            }
        };
        self.shard_statuses(&conn)
            .await
            .iter()
            .map(|s| s.consumers)
            .collect()
    }

    /// `(messages, messages_unacknowledged)` of every queue in the vhost, as
    /// `rabbitmqctl` sees it (`messages` counts ready and unacked).
    pub async fn queue_depths(&self) -> BTreeMap<String, (u64, u64)> {
        self.try_queue_depths()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::queue_depths`], or why `rabbitmqctl` failed (for a probe that
    /// tries again).
    pub async fn try_queue_depths(&self) -> Result<BTreeMap<String, (u64, u64)>, String> {
        let args = [
            "-q",
            "list_queues",
            "-p",
            &self.vhost,
            "--no-table-headers",
            "name",
            "messages",
            "messages_unacknowledged",
        ];
        let text = self.broker.try_run(&args).await?;
        Ok(text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split('\t').map(str::trim);
                let name = parts.next()?.to_owned();
                let messages = parts.next()?.parse().ok()?;
                let unacked = parts.next()?.parse().ok()?;
                Some((name, (messages, unacked)))
            })
            .collect())
    }

    /// `rabbitmqctl list_queues name COLUMNS…` in the vhost: each queue's
    /// columns by name (through `via`, another node's `rabbitmqctl`, when given).
    pub async fn list_queues(&self, columns: &[&str]) -> BTreeMap<String, Vec<String>> {
        self.list_queues_via(&self.broker, columns).await
    }

    /// [`Self::list_queues`] through `ctl` (a cluster node's).
    pub async fn list_queues_via(
        &self,
        ctl: &Ctl,
        columns: &[&str],
    ) -> BTreeMap<String, Vec<String>> {
        let mut args = vec![
            "-q",
            "list_queues",
            "-p",
            &self.vhost,
            "--no-table-headers",
            "name",
        ];
        args.extend(columns);
        let text = ctl.run(&args).await;
        text.lines()
            .filter_map(|line| {
                let mut parts = line.split('\t').map(|p| p.trim().to_owned());
                Some((parts.next()?, parts.collect()))
            })
            .collect()
    }

    /// Messages (ready + unacked) over all shard queues.
    pub async fn shard_backlog(&self) -> u64 {
        let depths = self.queue_depths().await;
        (0..self.shards.get())
            .map(|s| depths.get(&self.shard_queue(s)).map_or(0, |d| d.0))
            .sum()
    }

    /// Messages (ready + unacked) in the dead-letter queue.
    pub async fn dlq_backlog(&self) -> u64 {
        let depths = self.queue_depths().await;
        depths.get(&self.names.dead_letter_queue).map_or(0, |d| d.0)
    }

    /// Waits until every shard queue is empty, unacked messages included: all
    /// deliveries were acked, so no handler call is in flight either.
    pub async fn wait_shard_queues_drained(&self, timeout: Duration) {
        wait_until(
            "every shard queue drained (nothing ready, nothing unacked)",
            timeout,
            || async {
                // A cluster node that was cut off or stopped may restart its
                // app for a moment after it rejoined: read again.
                let depths = self.try_queue_depths().await?;
                let busy: Vec<_> = (0..self.shards.get())
                    .map(|s| self.shard_queue(s))
                    .filter(|q| depths.get(q).is_none_or(|d| d.0 > 0))
                    .collect();
                if busy.is_empty() {
                    Ok(())
                } else {
                    Err(format!(
                        "busy {busy:?}; depths (messages, unacked): {depths:?}"
                    ))
                }
            },
        )
        .await;
    }

    /// The consumers of every shard queue, by queue (`rabbitmqctl list_consumers`:
    /// consumer tag `{worker}/shard-{n}`, whether it is the active one, its
    /// channel). A queue without consumers is absent.
    pub async fn shard_consumers(&self) -> BTreeMap<String, Vec<ConsumerRow>> {
        let text = self
            .broker
            .run(&[
                "-q",
                "list_consumers",
                "-p",
                &self.vhost,
                "--no-table-headers",
                "queue_name",
                "channel_pid",
                "consumer_tag",
                "active",
            ])
            .await;
        // rabbitmqctl prints the columns in its own order, whatever the order asked.
        let mut out: BTreeMap<String, Vec<ConsumerRow>> = BTreeMap::new();
        for line in text.lines() {
            let mut cols = line.split('\t');
            let (Some(queue), Some(channel), Some(tag), Some(active)) =
                (cols.next(), cols.next(), cols.next(), cols.next())
            else {
                continue;
            };
            out.entry(queue.to_owned()).or_default().push(ConsumerRow {
                tag: tag.to_owned(),
                active: active.trim() == "true",
                channel: channel.trim().to_owned(),
            });
        }
        out
    }

    /// Each shard's active consumer, by worker name (from its consumer tag
    /// `{worker}/shard-{n}`); shards nobody consumes are absent.
    pub async fn consuming_workers(&self) -> BTreeMap<u16, String> {
        let all = self.shard_consumers().await;
        (0..self.shards.get())
            .filter_map(|shard| {
                let rows = all.get(&self.shard_queue(shard))?;
                let active = rows.iter().find(|r| r.active)?;
                let worker = active.tag.split('/').next()?;
                Some((shard, worker.to_owned()))
            })
            .collect()
    }

    /// How many shards each worker consumes, as the broker sees it.
    pub async fn spread(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for worker in self.consuming_workers().await.into_values() {
            *counts.entry(worker).or_default() += 1;
        }
        counts
    }

    /// Waits until the shards are consumed as `expected` (worker → shard
    /// count); returns how long that took.
    pub async fn wait_spread(&self, expected: &[(&str, usize)], timeout: Duration) -> Duration {
        let started = std::time::Instant::now();
        let want: BTreeMap<String, usize> = expected
            .iter()
            .map(|(w, n)| ((*w).to_owned(), *n))
            .collect();
        crate::wait_until(&format!("shards spread as {want:?}"), timeout, || async {
            let got = self.spread().await;
            crate::wait::check(got == want, || format!("{got:?}"))
        })
        .await;
        started.elapsed()
    }

    /// `None` when every shard queue has exactly one active consumer and it is
    /// worker `owner`'s, and the queue has `consumers` consumers in all;
    /// otherwise what differs (for a failure message).
    pub async fn active_owner_mismatch(&self, owner: &str, consumers: u32) -> Option<String> {
        let all = self.shard_consumers().await;
        let mut wrong = Vec::new();
        for shard in 0..self.shards.get() {
            let queue = self.shard_queue(shard);
            let rows = all.get(&queue).map(Vec::as_slice).unwrap_or_default();
            let active: Vec<&str> = rows
                .iter()
                .filter(|r| r.active)
                .map(|r| r.tag.as_str())
                .collect();
            let expected = format!("{owner}/shard-{shard}");
            if active != [expected.as_str()] || rows.len() != consumers as usize {
                wrong.push(format!("{queue}: {rows:?}"));
            }
        }
        (!wrong.is_empty()).then(|| {
            format!(
                "expected on every shard queue {consumers} consumer(s), exactly one active, \
                 worker `{owner}`'s; got:\n  {}",
                wrong.join("\n  ")
            )
        })
    }

    /// `Ok` once worker `name` has a consumer on each of `shards`' queues and
    /// each of them has exactly one active consumer; else what is missing.
    pub async fn consumers_registered(&self, name: &str, shards: &[u16]) -> Result<(), String> {
        let all = self.shard_consumers().await;
        let missing: Vec<String> = shards
            .iter()
            .filter(|&&shard| {
                let rows = all
                    .get(&self.shard_queue(shard))
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let tag = format!("{name}/shard-{shard}");
                !rows.iter().any(|r| r.tag == tag) || rows.iter().filter(|r| r.active).count() != 1
            })
            .map(|s| self.shard_queue(*s))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "worker `{name}` not yet registered (or not exactly one active consumer) on \
                 {missing:?}; consumers: {all:?}"
            ))
        }
    }

    /// A connection to the shared Redis; the environment's keys are under
    /// its prefix ([`Self::keys`]).
    pub async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(REDIS_URL)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// The environment as the operator tools see it, on the shared Redis.
    pub fn ops_fleet(&self) -> shardline_ops::Fleet {
        self.ops_fleet_on(REDIS_URL)
    }

    /// [`Self::ops_fleet`] on the Redis at `redis_url` (a private server).
    pub fn ops_fleet_on(&self, redis_url: &str) -> shardline_ops::Fleet {
        shardline_ops::Fleet {
            amqp: self.amqp_target(),
            redis: redis_url.parse().unwrap(),
            keys: self.keys(),
            names: self.names.clone(),
            shards: self.shards,
            ..shardline_ops::Fleet::default()
        }
    }

    /// Number of Redis keys under this environment's prefix.
    pub fn redis_key_count(&self) -> usize {
        let mut con = redis::Client::open(REDIS_URL)
            .unwrap()
            .get_connection()
            .unwrap();
        scan_prefix(&mut con, &self.redis_prefix).len()
    }
}

/// One consumer of a queue, as `rabbitmqctl list_consumers` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerRow {
    pub tag: String,
    /// The single active consumer of a single-active-consumer queue (always
    /// true for other consumers).
    pub active: bool,
    /// The Erlang pid of the consumer's channel: a consumer taken again is on
    /// a new channel.
    pub channel: String,
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        match self
            .broker
            .run_blocking(&["-q", "delete_vhost", &self.vhost])
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "cleanup: delete_vhost {} failed: {}",
                self.vhost,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("cleanup: cannot run rabbitmqctl: {e}"),
        }
        let cleaned = redis::Client::open(REDIS_URL)
            .and_then(|c| c.get_connection())
            .map(|mut con| {
                for chunk in scan_prefix(&mut con, &self.redis_prefix).chunks(500) {
                    let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query(&mut con);
                }
            });
        if let Err(e) = cleaned {
            eprintln!("cleanup: Redis keys under {}: {e}", self.redis_prefix);
        }
    }
}

fn scan_prefix(con: &mut redis::Connection, prefix: &str) -> Vec<String> {
    let pattern = format!("{}*", glob_escape(prefix));
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(con)
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `s` as one URL path segment (a vhost in an AMQP URL).
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `{prefix}{sep}{pid}{sep}{n}{sep}{stamp}`: a name no other test of this
/// run or a run before it takes (the process id, a counter, the time).
pub fn unique_name(prefix: &str, sep: char) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
        % 1_000_000_000;
    format!(
        "{prefix}{sep}{}{sep}{}{sep}{stamp}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
