//! One isolated environment per test: its own RabbitMQ vhost and Redis key prefix,
//! both removed on drop.

use std::collections::BTreeMap;
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::Connection;
use shardline_topology::declare::{self, ShardStatus};
use shardline_topology::{Names, QueueType, ShardCount, ShardId};

/// Every fleet test runs with this many shards.
pub const SHARDS: u16 = 8;
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
const AMQP_BASE: &str = "amqp://guest:guest@127.0.0.1:5672";
const BIN: &str = env!("CARGO_BIN_EXE_shardline");

pub struct TestEnv {
    /// Unique slug of this test run: names the vhost, the Redis prefix and log files.
    pub id: String,
    pub vhost: String,
    pub amqp_url: String,
    pub redis_prefix: String,
    pub names: Names,
    pub shards: ShardCount,
    /// Type of the shard queues. Every `shardline` process the harness starts
    /// gets it as `SHARDLINE_QUEUE_TYPE` (`topology apply` and the worker read
    /// it; other subcommands ignore it). Classic by default.
    pub queue_type: QueueType,
}

/// The worker's log line when it takes a shard with an exclusive consumer (classic queues).
const TAKEN_EXCLUSIVE: &str = "shard active";
/// The worker's log line when it consumes a single-active-consumer queue (quorum):
/// the broker, not the worker, decides whether it is the active one.
const TAKEN_SAC: &str = "consuming; the queue's single-active-consumer picks the active worker";

impl TestEnv {
    /// A fresh vhost (guest has full rights on it) and a fresh Redis prefix;
    /// classic shard queues.
    pub async fn new(name: &str) -> Self {
        Self::with_queue_type(name, QueueType::Classic).await
    }

    /// [`Self::new`] with shard queues of `queue_type` (quorum: `topology apply`
    /// declares them so, and the worker consumes them non-exclusively). The id
    /// ends in `-quorum` for quorum queues, so that logs and vhosts say which
    /// run they belong to.
    pub async fn with_queue_type(name: &str, queue_type: QueueType) -> Self {
        let name = match queue_type {
            QueueType::Classic => name.to_owned(),
            QueueType::Quorum => format!("{name}-quorum"),
        };
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros()
            % 1_000_000_000;
        let id = format!(
            "{name}-{}-{}-{stamp}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let vhost = format!("shardline-test.{id}");
        rabbitmqctl(&["add_vhost", &vhost]).await;
        rabbitmqctl(&["set_permissions", "-p", &vhost, "guest", ".*", ".*", ".*"]).await;
        Self {
            amqp_url: format!("{AMQP_BASE}/{}", percent_encode(&vhost)),
            redis_prefix: format!("shardline-test:{id}:"),
            vhost,
            id,
            names: Names::default(),
            shards: ShardCount::new(u32::from(SHARDS)).unwrap(),
            queue_type,
        }
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

    /// What the worker logs (with `shard=N`) when it has subscribed to a shard
    /// queue: `shard active` on classic queues (it holds the exclusive consumer);
    /// on quorum queues the single-active-consumer line (it may be waiting).
    pub fn taken_log_line(&self) -> &'static str {
        if self.is_quorum() {
            TAKEN_SAC
        } else {
            TAKEN_EXCLUSIVE
        }
    }

    pub fn shard_queue(&self, shard: u16) -> String {
        self.names
            .shard_queue(ShardId::new(u32::from(shard), self.shards).unwrap())
    }

    pub fn shard_of(&self, order_id: &str) -> u16 {
        self.shards.shard_of(order_id).get()
    }

    /// Runs the `shardline` binary against this environment's vhost with `args`
    /// (global flags `--amqp-url`, `--redis-url`, `--redis-prefix`, `--shards` added).
    pub async fn cli(&self, args: &[&str]) -> Output {
        tokio::process::Command::new(BIN)
            .args(args)
            .args(self.global_args())
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .env(self.queue_type_env().0, self.queue_type_env().1)
            .kill_on_drop(true)
            .output()
            .await
            .unwrap()
    }

    pub fn global_args(&self) -> Vec<String> {
        vec![
            "--amqp-url".into(),
            self.amqp_url.clone(),
            "--redis-url".into(),
            REDIS_URL.into(),
            "--redis-prefix".into(),
            self.redis_prefix.clone(),
            "--shards".into(),
            SHARDS.to_string(),
        ]
    }

    /// `shardline topology apply` with the defaults; fails the test unless it exits 0.
    pub async fn apply_topology(&self) {
        let out = self.cli(&["topology", "apply"]).await;
        assert!(
            out.status.success(),
            "`shardline topology apply` failed with {}:\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// This environment's broker address, parsed.
    pub fn amqp_target(&self) -> shardline_topology::AmqpTarget {
        self.amqp_url.parse().unwrap()
    }

    pub async fn connect(&self) -> Connection {
        shardline_topology::connect(&self.amqp_target(), &format!("fleet-test {}", self.id))
            .await
            .unwrap()
    }

    /// Ready messages and consumers of every shard queue, by passive declare.
    pub async fn shard_statuses(&self, conn: &Connection) -> Vec<ShardStatus> {
        let mut out = Vec::new();
        for shard in 0..SHARDS {
            out.push(
                declare::queue_status(conn, &self.shard_queue(shard))
                    .await
                    .unwrap(),
            );
        }
        out
    }

    /// `(messages, messages_unacknowledged)` of every queue in the vhost, as
    /// `rabbitmqctl` sees it (`messages` counts ready and unacked).
    pub async fn queue_depths(&self) -> BTreeMap<String, (u64, u64)> {
        let text = rabbitmqctl(&[
            "-q",
            "list_queues",
            "-p",
            &self.vhost,
            "--no-table-headers",
            "name",
            "messages",
            "messages_unacknowledged",
        ])
        .await;
        text.lines()
            .filter_map(|line| {
                let mut parts = line.split_whitespace();
                let name = parts.next()?.to_owned();
                let messages = parts.next()?.parse().ok()?;
                let unacked = parts.next()?.parse().ok()?;
                Some((name, (messages, unacked)))
            })
            .collect()
    }

    /// Messages (ready + unacked) over all shard queues.
    pub async fn shard_backlog(&self) -> u64 {
        let depths = self.queue_depths().await;
        (0..SHARDS)
            .map(|s| depths.get(&self.shard_queue(s)).map_or(0, |d| d.0))
            .sum()
    }

    /// Waits until every shard queue is empty, unacked messages included: all
    /// deliveries were acked.
    pub async fn wait_shard_queues_drained(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let depths = self.queue_depths().await;
            let busy: Vec<_> = (0..SHARDS)
                .map(|s| self.shard_queue(s))
                .filter(|q| depths.get(q).is_none_or(|d| d.0 > 0))
                .collect();
            if busy.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "shard queues not drained within {timeout:?}: {busy:?}; depths (messages, unacked): {depths:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The consumers of every shard queue, by queue (`rabbitmqctl list_consumers`:
    /// consumer tag `{worker}/shard-{n}` and whether it is the active one). A
    /// queue without consumers is absent.
    pub async fn shard_consumers(&self) -> BTreeMap<String, Vec<ConsumerRow>> {
        let text = rabbitmqctl(&[
            "-q",
            "list_consumers",
            "-p",
            &self.vhost,
            "--no-table-headers",
            "queue_name",
            "consumer_tag",
            "active",
        ])
        .await;
        let mut out: BTreeMap<String, Vec<ConsumerRow>> = BTreeMap::new();
        for line in text.lines() {
            let mut cols = line.split('\t');
            let (Some(queue), Some(tag), Some(active)) = (cols.next(), cols.next(), cols.next())
            else {
                continue;
            };
            out.entry(queue.to_owned()).or_default().push(ConsumerRow {
                tag: tag.to_owned(),
                active: active.trim() == "true",
            });
        }
        out
    }

    /// `None` when every shard queue has exactly one active consumer and it is
    /// worker `owner`'s, and the queue has `consumers` consumers in all;
    /// otherwise what differs (for a failure message).
    pub async fn active_owner_mismatch(&self, owner: &str, consumers: u32) -> Option<String> {
        let all = self.shard_consumers().await;
        let mut wrong = Vec::new();
        for shard in 0..SHARDS {
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
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let out = std::process::Command::new("rabbitmqctl")
            .args(["-q", "delete_vhost", &self.vhost])
            .output();
        match out {
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

fn percent_encode(s: &str) -> String {
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

/// Runs `rabbitmqctl args`; fails the test with its output unless it succeeds.
pub async fn rabbitmqctl(args: &[&str]) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .expect("cannot run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed with {}:\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
