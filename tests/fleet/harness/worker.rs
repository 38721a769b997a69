//! A `shardline worker` child process with its log in a file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use lapin::Connection;
use tokio::process::{Child, Command};

use super::STARTUP;
use super::env::{SHARDS, TestEnv};

const BIN: &str = env!("CARGO_BIN_EXE_shardline");

pub struct Worker {
    pub name: String,
    pub log: PathBuf,
    child: Child,
    pid: u32,
}

impl Worker {
    /// `shardline worker --handler HANDLER` on every shard of `env` with `extra`
    /// flags, and small retry delays unless `extra` sets them.
    pub fn start(env: &TestEnv, name: &str, handler: &str, extra: &[&str]) -> Self {
        Self::spawn(env, name, handler, extra, None)
    }

    /// Like [`Worker::start`], against the Redis at `redis_url` instead of the
    /// shared one (a private Redis that a test kills and restarts).
    #[allow(
        dead_code,
        reason = "used by the outages tests, which share this harness"
    )]
    pub fn start_on_redis(
        env: &TestEnv,
        name: &str,
        redis_url: &str,
        handler: &str,
        extra: &[&str],
    ) -> Self {
        Self::spawn(env, name, handler, extra, Some(redis_url))
    }

    fn spawn(
        env: &TestEnv,
        name: &str,
        handler: &str,
        extra: &[&str],
        redis_url: Option<&str>,
    ) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fleet");
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join(format!("{}-{name}.log", env.id));
        let file = File::create(&log).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.arg("worker");
        for (flag, value) in [("--retry-base", "10ms"), ("--retry-cap", "100ms")] {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        let mut global = env.global_args();
        if let Some(url) = redis_url {
            let at = global.iter().position(|a| a == "--redis-url").unwrap() + 1;
            global[at] = url.to_owned();
        }
        cmd.args(global)
            .args(["--handler", handler, "--worker-name", name])
            .args(extra)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .env(env.queue_type_env().0, env.queue_type_env().1)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true);
        let child = cmd.spawn().unwrap();
        let pid = child.id().unwrap();
        Self {
            name: name.to_owned(),
            log,
            child,
            pid,
        }
    }

    /// SIGKILL: no chance to ack or close anything.
    pub fn kill9(&mut self) {
        self.child.start_kill().unwrap();
    }

    pub fn sigterm(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM {} failed", self.pid);
    }

    /// Waits for the process to exit; fails the test if it is still running after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.unwrap(),
            Err(_) => panic!(
                "worker {} still running {timeout:?} after being told to stop; log tail:\n{}",
                self.name,
                self.log_tail(40)
            ),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Waits until this worker processes every shard; fails loudly, at once if
    /// the worker exits. Classic queues: every shard queue has exactly one
    /// consumer (this worker, when no other runs). Quorum queues: the worker
    /// logged subscribing to every shard, and every shard queue has exactly one
    /// active consumer (the queue's single-active-consumer picks it; this
    /// worker's unless another worker was active first).
    pub async fn wait_consuming(&mut self, env: &TestEnv, conn: &Connection) {
        if env.is_quorum() {
            self.wait_log_all_shards(env.taken_log_line(), STARTUP)
                .await;
        }
        // A passive declare's consumer count of a single-active-consumer quorum
        // queue counts the active consumer only (waiting ones are not in it).
        let deadline = Instant::now() + STARTUP;
        loop {
            let statuses = env.shard_statuses(conn).await;
            if statuses.iter().all(|s| s.consumers == 1) {
                return;
            }
            self.fail_if_exited("consuming every shard");
            assert!(
                Instant::now() < deadline,
                "worker {}: shard queues without exactly one (active) consumer after {STARTUP:?}: \
                 {statuses:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the worker waits on every shard without processing it: on
    /// classic queues it logged `standing by` (its exclusive consume refused);
    /// on quorum queues it has a consumer on every shard queue that the
    /// broker keeps inactive.
    pub async fn wait_standing_by(&mut self, env: &TestEnv) {
        if !env.is_quorum() {
            return self.wait_log_all_shards("standing by", STARTUP).await;
        }
        self.wait_log_all_shards(env.taken_log_line(), STARTUP)
            .await;
        let deadline = Instant::now() + STARTUP;
        loop {
            let all = env.shard_consumers().await;
            let waiting = (0..SHARDS).all(|shard| {
                let tag = format!("{}/shard-{shard}", self.name);
                all.get(&env.shard_queue(shard))
                    .is_some_and(|rows| rows.iter().any(|r| r.tag == tag && !r.active))
            });
            if waiting {
                return;
            }
            self.fail_if_exited("standing by on every shard");
            assert!(
                Instant::now() < deadline,
                "worker {}: not a waiting consumer of every shard queue after {STARTUP:?}: {all:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Fails the test (with the log tail) if the worker exited.
    #[allow(
        dead_code,
        reason = "used by the outages tests, which share this harness"
    )]
    pub fn assert_running(&mut self) {
        self.fail_if_exited("the test ended");
    }

    /// Lines of the log containing `needle`.
    #[allow(
        dead_code,
        reason = "used by the outages tests, which share this harness"
    )]
    pub fn count_lines(&self, needle: &str) -> usize {
        self.log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    fn fail_if_exited(&mut self, before: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "worker {} exited ({status}) before {before}; log tail:\n{}",
                self.name,
                self.log_tail(40)
            );
        }
    }

    /// Shards named (`shard=N`) on log lines containing `needle`.
    pub fn logged_shards(&self, needle: &str) -> BTreeSet<u16> {
        self.log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(shard_field)
            .collect()
    }

    /// How many lines containing `needle` name each shard.
    pub fn logged_shard_counts(&self, needle: &str) -> BTreeMap<u16, usize> {
        let mut counts = BTreeMap::new();
        for shard in self
            .log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(shard_field)
        {
            *counts.entry(shard).or_default() += 1;
        }
        counts
    }

    /// Waits until lines containing `needle` name every shard; fails loudly.
    pub async fn wait_log_all_shards(&mut self, needle: &str, timeout: Duration) {
        let all: Vec<u16> = (0..SHARDS).collect();
        self.wait_log_shards(needle, &all, timeout).await;
    }

    /// Waits until lines containing `needle` name each of `shards`; fails loudly,
    /// at once if the worker exits.
    pub async fn wait_log_shards(&mut self, needle: &str, shards: &[u16], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.logged_shards(needle);
            if shards.iter().all(|s| seen.contains(s)) {
                return;
            }
            self.fail_if_exited(&format!("logging `{needle}` for shards {shards:?}"));
            assert!(
                Instant::now() < deadline,
                "worker {}: `{needle}` logged for shards {seen:?} only, after {timeout:?}, \
                 expected {shards:?}; log tail:\n{}",
                self.name,
                self.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- worker {} log ({}), last 60 lines ----\n{}\n---- end of worker {} log ----",
                self.name,
                self.log.display(),
                self.log_tail(60),
                self.name
            );
        }
        let _ = self.child.start_kill();
    }
}

/// The value of the first `shard=N` field on a log line.
fn shard_field(line: &str) -> Option<u16> {
    let at = line.find("shard=")? + "shard=".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}
