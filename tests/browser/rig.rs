//! A real fleet for one scenario: its own vhost and Redis prefix
//! ([`TestEnv`]), the topology, a worker `w1` calling a downstream that fails
//! order `bx` seq 2 for good until fixed, and the console served in-process
//! with an admin and a read-only token. [`Rig::run`] plays a scenario and
//! answers its steps.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shardline_testkit::console::{ADMIN, ServedConsole, VIEWER};
use shardline_testkit::dlq::{index_groups, indexed, wait_depth, wait_indexed};
use shardline_testkit::paths::scratch;
use shardline_testkit::{
    Call, Downstream, Event, PROCESSING, Publisher, Reply, TestEnv, Worker, all_ok,
};

use crate::driver::Driver;

const WORKER: &str = "w1";
/// The order whose seq 2 the downstream refuses (422) until fixed.
const ORDER: &str = "bx";

/// A malformed body that is not UTF-8: markup, a bidi override, a
/// zero-width space and bytes no UTF-8 text has.
pub(crate) const HOSTILE_BYTES: &[u8] =
    b"<script>window.__pwned=1</script> \xe2\x80\xaegnp.exe \xe2\x80\x8b \xff\xfe end";
/// A malformed body that is UTF-8 (not JSON): markup and invisible characters.
pub(crate) const HOSTILE_TEXT: &str =
    "<script>window.__pwned=1</script><img src=x onerror=alert(1)> \u{202e}gnp.exe \u{200b} end";

pub(crate) struct Rig {
    env: TestEnv,
    downstream: Downstream,
    fixed: Arc<AtomicBool>,
    publisher: Publisher,
    worker: Worker,
    console: ServedConsole,
}

impl Rig {
    pub(crate) async fn start(name: &str) -> Self {
        Self::start_with(name, Duration::ZERO).await
    }

    /// [`Self::start`] with a downstream that takes `latency` per call.
    pub(crate) async fn start_with(name: &str, latency: Duration) -> Self {
        let env = TestEnv::new(name).await;
        env.apply_topology().await;
        let fixed = Arc::new(AtomicBool::new(false));
        let failing = Event::new(ORDER, 2, env.shards).key();
        let downstream = Downstream::scripted({
            let fixed = Arc::clone(&fixed);
            move |call, _| {
                if call.key() == failing && !fixed.load(Ordering::SeqCst) {
                    Reply::status(422)
                } else {
                    Reply::ok().after(latency)
                }
            }
        })
        .await;
        let worker = env.start_worker(WORKER, &downstream, |_| {}).await;
        let publisher = Publisher::connect(&env).await;

        let console = ServedConsole::start(&env, None).await;
        Self {
            env,
            downstream,
            fixed,
            publisher,
            worker,
            console,
        }
    }

    /// Plays `scenario` in the browser, answering each step, until it passes;
    /// then checks that the worker and the console still run and stops them.
    pub(crate) async fn run(mut self, scenario: &str) {
        let vars = [
            (
                "SHARDLINE_CONSOLE_URL",
                format!("http://{}/", self.console.addr),
            ),
            ("SHARDLINE_ADMIN_TOKEN", ADMIN.to_owned()),
            ("SHARDLINE_VIEWER_TOKEN", VIEWER.to_owned()),
            ("SHARDLINE_SHARDS", self.env.shards.get().to_string()),
            ("SHARDLINE_WORKER", WORKER.to_owned()),
            (
                "SHARDLINE_SCREENSHOTS_DIR",
                std::env::var("SHARDLINE_SCREENSHOTS_DIR").unwrap_or_default(),
            ),
        ];
        let log = scratch("browser").join(format!("{}-{scenario}.log", self.env.id));
        let mut driver = Driver::spawn(scenario, &vars, log);
        while let Some(step) = driver.step().await {
            let value = self.answer(&step).await;
            driver.ok(&value).await;
        }
        self.console.stop().await;
        self.worker.assert_running().await;
        self.worker.stop().await;
    }

    /// Does what step `step` asks; the value the script gets back.
    async fn answer(&mut self, step: &str) -> String {
        match step {
            "inject-failure" => self.inject_failure().await,
            "fix-downstream" => {
                self.fixed.store(true, Ordering::SeqCst);
                String::new()
            }
            "replayed" => {
                self.check_replayed().await;
                String::new()
            }
            "check-untouched" => {
                self.check_untouched().await;
                String::new()
            }
            "publish-hostile" => self.publish_hostile().await,
            "fleet-busy" => {
                self.fleet_busy().await;
                String::new()
            }
            other => panic!("the browser asked for an unknown step {other:?}"),
        }
    }

    fn order(&self, seq: u64) -> Event {
        Event::new(ORDER, seq, self.env.shards)
    }

    /// `bx` 1 (applied) and 2 (refused for good: a dead letter); the id of
    /// its failure group once the index holds it.
    async fn inject_failure(&self) -> String {
        let events = [self.order(1), self.order(2)];
        self.publisher.publish(&events).await;
        self.downstream
            .wait_for("bx 1 answered 2xx", PROCESSING, |calls| {
                all_ok(calls, &events[..1])
            })
            .await;
        wait_indexed(&self.env, 1, PROCESSING).await;
        let groups = index_groups(&self.env).await;
        assert_eq!(groups.len(), 1, "failure groups: {groups:?}");
        groups.into_keys().next().unwrap()
    }

    /// After the page's replay: `bx` 2 arrived once fixed, then `bx` 3,
    /// published now, follows; the downstream applied 1, 2, 3 in that order
    /// and the DLQ and its index are empty.
    async fn check_replayed(&self) {
        let next = [self.order(3)];
        self.downstream
            .wait_for("bx 2 answered 2xx after the replay", PROCESSING, |calls| {
                all_ok(calls, &[self.order(2)])
            })
            .await;
        self.publisher.publish(&next).await;
        let calls = self
            .downstream
            .wait_for("bx 3 answered 2xx", PROCESSING, |calls| {
                all_ok(calls, &next)
            })
            .await;
        assert_eq!(
            applied_seqs(&calls, ORDER),
            [1, 2, 3],
            "bx as the downstream applied it"
        );
        let conn = self.env.connect().await;
        wait_depth(&self.env, &conn, 0, PROCESSING).await;
        wait_indexed(&self.env, 0, PROCESSING).await;
    }

    /// A refused action changed nothing: the letter is still in the DLQ and
    /// its index, and `bx` 2 was never applied.
    async fn check_untouched(&self) {
        assert_eq!(indexed(&self.env).await, 1);
        let conn = self.env.connect().await;
        wait_depth(&self.env, &conn, 1, PROCESSING).await;
        assert_eq!(applied_seqs(&self.downstream.calls(), ORDER), [1]);
    }

    /// Publishes [`HOSTILE_BYTES`] and [`HOSTILE_TEXT`] straight to shard 0;
    /// the worker dead-letters each as malformed. Their letter ids, in that
    /// order, separated by a space.
    async fn publish_hostile(&self) -> String {
        let mut ids = Vec::new();
        for (n, body) in [HOSTILE_BYTES, HOSTILE_TEXT.as_bytes()]
            .into_iter()
            .enumerate()
        {
            let before = self.letter_ids().await;
            self.publisher.publish_raw(0, body).await;
            wait_indexed(&self.env, n as u64 + 1, PROCESSING).await;
            let after = self.letter_ids().await;
            let new: Vec<&String> = after.difference(&before).collect();
            assert_eq!(new.len(), 1, "new letters: {new:?}");
            ids.push(new[0].clone());
        }
        ids.join(" ")
    }

    /// For the pictures: two failure groups (a refused event and a malformed
    /// body), then 4,000 events queued behind the downstream's latency: a
    /// backlog that lasts about half a minute.
    async fn fleet_busy(&self) {
        self.inject_failure().await;
        self.publisher.publish_raw(0, HOSTILE_TEXT.as_bytes()).await;
        wait_indexed(&self.env, 2, PROCESSING).await;
        let orders: Vec<String> = (0..200).map(|i| format!("demo-{i}")).collect();
        let events = shardline_testkit::interleaved(&orders, 20, self.env.shards);
        self.publisher.publish(&events).await;
    }

    /// The ids in the dead-letter index.
    async fn letter_ids(&self) -> BTreeSet<String> {
        redis::cmd("ZRANGE")
            .arg(self.env.keys().dlq_letters())
            .arg(0)
            .arg(-1)
            .query_async(&mut self.env.redis().await)
            .await
            .unwrap()
    }
}

/// The seqs of `order` the downstream answered 2xx, in arrival order.
fn applied_seqs(calls: &[Call], order: &str) -> Vec<u64> {
    calls
        .iter()
        .filter(|c| c.ok() && c.order_id.as_deref() == Some(order))
        .filter_map(|c| c.seq)
        .collect()
}
