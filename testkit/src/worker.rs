//! An in-process worker: `shardline_worker::Worker` run on the test's runtime
//! under a cancellation token, observed through its [`Progress`].
//!
//! Its logs go to the test's captured output (shown when the test fails);
//! `SHARDLINE_TEST_LOG` sets the filter (default `info,lapin=warn`).

use std::sync::{Arc, Once};
use std::time::Duration;

use shardline_worker::{Config, Counts, Handler, Progress, ShardState, WorkerError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::env::TestEnv;
use crate::wait::wait_until;

pub struct Worker {
    pub name: String,
    shards: Vec<u16>,
    progress: Progress,
    shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), WorkerError>>>,
}

impl Worker {
    /// Checks `config` (fails the test if the worker refuses it) and runs the
    /// worker; does not wait for anything.
    pub fn spawn(config: Config, handler: Arc<dyn Handler>) -> Self {
        init_logging();
        let name = config.worker_name.clone();
        let shards = config.assign.iter().map(|s| s.get()).collect();
        let worker = shardline_worker::Worker::new(config, handler)
            .unwrap_or_else(|e| panic!("worker {name}: configuration refused: {e}"));
        let progress = worker.progress();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(worker.run(shutdown.clone()));
        Self {
            name,
            shards,
            progress,
            shutdown,
            task: Some(task),
        }
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The totals now.
    pub fn counts(&self) -> Counts {
        self.progress.counts()
    }

    /// Waits until the worker counts at least `n` events settled (processed,
    /// duplicate or dead-lettered), and returns the counts: a delivery is
    /// counted right after its ack, so a drained queue can be a moment ahead.
    pub async fn wait_settled(&self, n: u64) -> Counts {
        wait_until(
            &format!("worker {} to count {n} events settled", self.name),
            crate::STARTUP,
            || async {
                let counts = self.counts();
                crate::wait::check(counts.settled() >= n, || self.describe()).map(|()| counts)
            },
        )
        .await
    }

    /// Waits until the counts satisfy `done` (checked as they change), and
    /// returns them.
    pub async fn wait_counts(&self, what: &str, done: impl Fn(&Counts) -> bool) -> Counts {
        wait_until(
            &format!("worker {}: {what}", self.name),
            crate::PROCESSING,
            || async {
                let counts = self.counts();
                crate::wait::check(done(&counts), || self.describe()).map(|()| counts)
            },
        )
        .await
    }

    /// Waits until the gate holds at least `n` events.
    pub async fn wait_held(&self, n: u64) -> Counts {
        self.wait_counts(&format!("{n} events held"), |c| c.held >= n)
            .await
    }

    /// Waits until the downstream breaker opened (at least once).
    pub async fn wait_breaker_open(&self) -> Counts {
        self.wait_counts("the breaker opened", |c| c.breaker_trips >= 1)
            .await
    }

    /// Waits until `n` events settled, then fails the test unless every one
    /// of them was processed (none a duplicate or a dead letter).
    pub async fn assert_all_processed(&self, n: u64) {
        let counts = self.wait_settled(n).await;
        assert_eq!(counts.processed, n, "{}", self.describe());
    }

    /// Each assigned shard with its state, for failure messages.
    pub fn describe(&self) -> String {
        let states: Vec<String> = self
            .progress
            .shards()
            .iter()
            .map(|(id, state)| format!("{id}:{state:?}"))
            .collect();
        format!(
            "worker {}: shards [{}], {:?}",
            self.name,
            states.join(" "),
            self.counts()
        )
    }

    /// The states of the shards in `shards`.
    pub fn states(&self, shards: &[u16]) -> Vec<ShardState> {
        self.progress
            .shards()
            .into_iter()
            .filter(|(id, _)| shards.contains(&id.get()))
            .map(|(_, state)| state)
            .collect()
    }

    /// Whether the worker's run ended (it ends only when cancelled, or on an error).
    pub fn has_ended(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Fails the test at once if the worker's run ended (it returns only when
    /// cancelled, so an end is an error).
    pub async fn assert_running(&mut self) {
        let task = self.task.as_mut().expect("worker already joined");
        if task.is_finished() {
            let result = task.await;
            self.task = None;
            panic!("worker {} ended while it should run: {result:?}", self.name);
        }
    }

    /// Waits until the worker consumes every shard it was given: its progress
    /// says so, and every one of those shard queues has the worker's consumer
    /// and exactly one active consumer (on classic queues: the worker's; on
    /// single-active-consumer queues the broker picks). Fails loudly, at once
    /// if the worker ends.
    pub async fn wait_consuming(&mut self, env: &TestEnv) {
        self.wait_consuming_within(env, crate::STARTUP).await;
    }

    /// [`Self::wait_consuming`] with a deadline of its own (a worker of many
    /// shards on a busy machine).
    pub async fn wait_consuming_within(&mut self, env: &TestEnv, timeout: Duration) {
        let shards = self.shards.clone();
        self.wait_state(
            env,
            "consuming every assigned shard",
            &shards,
            true,
            timeout,
        )
        .await;
    }

    /// Waits until the worker consumes each of `shards`.
    pub async fn wait_consuming_shards(&mut self, env: &TestEnv, shards: &[u16]) {
        self.wait_state(
            env,
            &format!("consuming shards {shards:?}"),
            shards,
            true,
            crate::STARTUP,
        )
        .await;
    }

    /// Waits until the worker waits for another consumer on each of `shards`:
    /// classic queues: its exclusive consume was refused (`StandingBy`); quorum
    /// queues: it is a registered, inactive consumer of each queue.
    pub async fn wait_standing_by_shards(&mut self, env: &TestEnv, shards: &[u16]) {
        self.wait_state(
            env,
            &format!("standing by on shards {shards:?}"),
            shards,
            false,
            crate::STARTUP,
        )
        .await;
    }

    /// [`Self::wait_standing_by_shards`] on every assigned shard.
    pub async fn wait_standing_by(&mut self, env: &TestEnv) {
        let shards = self.shards.clone();
        self.wait_standing_by_shards(env, &shards).await;
    }

    async fn wait_state(
        &mut self,
        env: &TestEnv,
        what: &str,
        shards: &[u16],
        consuming: bool,
        timeout: Duration,
    ) {
        let quorum = env.is_quorum();
        let what = format!("worker {} {what}", self.name);
        let this = &*self;
        let task_done = || this.task.as_ref().is_some_and(JoinHandle::is_finished);
        wait_until(&what, timeout, || async {
            assert!(
                !task_done(),
                "{what}: the worker ended; {}",
                this.describe()
            );
            let states = this.states(shards);
            let wanted = |s: &ShardState| match (consuming, quorum) {
                (true, _) => matches!(s, ShardState::Consuming | ShardState::Registered),
                (false, false) => *s == ShardState::StandingBy,
                (false, true) => *s == ShardState::Registered,
            };
            if states.len() != shards.len() || !states.iter().all(wanted) {
                return Err(this.describe());
            }
            if consuming {
                // The broker's view: one (active) consumer on each of these queues.
                let counts = env.consumer_counts().await;
                let wrong: Vec<(u16, u32)> = shards
                    .iter()
                    .map(|&s| (s, counts[usize::from(s)]))
                    .filter(|(_, n)| *n != 1)
                    .collect();
                if !wrong.is_empty() {
                    return Err(format!(
                        "(shard, consumers) not 1: {wrong:?}; {}",
                        this.describe()
                    ));
                }
            }
            if !consuming && quorum {
                env.consumers_registered(&this.name, shards).await?;
                let all = env.shard_consumers().await;
                let inactive = shards.iter().all(|&shard| {
                    let tag = format!("{}/shard-{shard}", this.name);
                    all.get(&env.shard_queue(shard))
                        .is_some_and(|rows| rows.iter().any(|r| r.tag == tag && !r.active))
                });
                if !inactive {
                    return Err(format!("not a waiting consumer of every queue: {all:?}"));
                }
            }
            Ok(())
        })
        .await;
        if let Some(task) = self.task.as_mut()
            && task.is_finished()
        {
            let result = task.await;
            panic!("worker {} ended: {result:?}", self.name);
        }
    }

    /// Cancels the worker (what SIGTERM does to the binary): it stops taking
    /// deliveries, drains the in-flight event and closes its connection.
    pub fn cancel(&self) {
        self.shutdown.cancel();
    }

    /// Waits for the worker's run to end after [`Self::cancel`] (or an error);
    /// fails the test if it still runs after `timeout`.
    pub async fn join(mut self, timeout: Duration) -> Result<(), WorkerError> {
        let task = self.task.take().expect("worker already joined");
        match tokio::time::timeout(timeout, task).await {
            Ok(joined) => joined.unwrap_or_else(|e| panic!("worker {} panicked: {e}", self.name)),
            Err(_) => panic!(
                "worker {} still running {timeout:?} after being told to stop; {}",
                self.name,
                self.describe()
            ),
        }
    }

    /// Cancels and joins; the run must end cleanly within the drain timeout.
    pub async fn stop(self) {
        self.cancel();
        let name = self.name.clone();
        if let Err(e) = self.join(crate::STARTUP).await {
            panic!("worker {name} stopped with an error: {e}");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- {} ----", self.describe());
        }
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Once per test binary: the worker's logs into the captured test output.
fn init_logging() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let filter =
            std::env::var("SHARDLINE_TEST_LOG").unwrap_or_else(|_| "info,lapin=warn".to_owned());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .with_ansi(false)
            .try_init();
    });
}

/// Starting in-process workers, from the environment they run in.
impl TestEnv {
    /// Starts an in-process worker `name` calling `downstream`, with
    /// [`Self::worker_config`] changed by `configure`, and waits until it
    /// consumes every shard it was given.
    pub async fn start_worker(
        &self,
        name: &str,
        downstream: &crate::Downstream,
        configure: impl FnOnce(&mut Config),
    ) -> Worker {
        let mut config = self.worker_config(name);
        configure(&mut config);
        let mut worker = Worker::spawn(config, downstream.handler());
        worker.wait_consuming(self).await;
        worker
    }

    /// [`Self::start_worker`] with any handler.
    pub async fn start_worker_with(&self, config: Config, handler: Arc<dyn Handler>) -> Worker {
        let mut worker = Worker::spawn(config, handler);
        worker.wait_consuming(self).await;
        worker
    }
}
