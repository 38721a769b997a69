//! kill -9 mid-stream: nothing lost, order kept, at most the events in flight
//! of each shard repeated (one, K with `--concurrency K`, a group with group
//! commit — by default as large as the prefetch, at most 32; one with the
//! strict `--group-commit 1`).

use std::time::Duration;

use shardline_testkit::{
    ChildWorker, Downstream, PROCESSING, Publisher, QueueType, Reply, STARTUP, TestEnv, all_ok,
    assert_in_order_and_complete, assert_in_order_in_effect, assert_orders_never_overlap, describe,
    interleaved, ok_keys, order_ids, repeats_per_shard,
};
use shardline_worker::{Config, GroupCommit};

/// The flags both workers run with.
#[derive(Clone, Copy)]
struct Flags {
    prefetch: u16,
    concurrency: u16,
    group_commit: GroupCommit,
}

impl Flags {
    const DEFAULT: Self = Self {
        prefetch: 1,
        concurrency: 1,
        group_commit: GroupCommit::Auto,
    };

    fn config(self, c: &mut Config) {
        c.prefetch = self.prefetch;
        c.concurrency = self.concurrency;
        c.group_commit = self.group_commit;
    }

    fn grouping(self) -> u16 {
        let mut config = Config::default();
        self.config(&mut config);
        config.grouping().size
    }

    /// Whether groups form: a crash may then rewind an order to its first
    /// call since its last commit (consecutive seqs share a group).
    fn groups(self) -> bool {
        self.grouping() > 1
    }

    /// Calls a kill -9 may repeat per shard: the calls in flight, or a group.
    fn repeat_bound(self) -> usize {
        usize::from(self.concurrency.max(self.grouping()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing() {
    kill_9_mid_stream(QueueType::Classic, Flags::DEFAULT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_concurrency_4_repeats_at_most_4_calls_per_shard() {
    let flags = Flags {
        concurrency: 4,
        ..Flags::DEFAULT
    };
    kill_9_mid_stream(QueueType::Classic, flags).await;
}

/// Default flags but the prefetch: groups of up to 32 (`--group-commit auto`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_prefetch_32_repeats_at_most_a_group_per_shard() {
    let flags = Flags {
        prefetch: 32,
        ..Flags::DEFAULT
    };
    assert_eq!(flags.repeat_bound(), 32);
    kill_9_mid_stream(QueueType::Classic, flags).await;
}

/// The strict setting keeps the serial path's bound at any prefetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_prefetch_32_strict_repeats_at_most_one_per_shard() {
    let flags = Flags {
        prefetch: 32,
        group_commit: GroupCommit::Fixed(1),
        ..Flags::DEFAULT
    };
    assert_eq!(flags.repeat_bound(), 1);
    kill_9_mid_stream(QueueType::Classic, flags).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_stream_loses_nothing_on_quorum_queues() {
    kill_9_mid_stream(QueueType::Quorum, Flags::DEFAULT).await;
}

async fn kill_9_mid_stream(queue_type: QueueType, flags: Flags) {
    let env = TestEnv::with_queue_type("crash", queue_type).await;
    env.apply_topology().await;
    let downstream =
        Downstream::scripted(|_, _| Reply::ok().after(Duration::from_millis(15))).await;
    let events = interleaved(&order_ids("crash", 120), 5, env.shards);
    Publisher::connect(&env).await.publish(&events).await;

    // A process: the point is kill -9.
    let (prefetch, concurrency, group_commit) = (
        flags.prefetch.to_string(),
        flags.concurrency.to_string(),
        flags.group_commit.to_string(),
    );
    let args = [
        "--prefetch",
        &prefetch,
        "--concurrency",
        &concurrency,
        "--group-commit",
        &group_commit,
    ];
    let mut first = ChildWorker::start(&env, "first", &downstream.url(), &args);
    first.wait_consuming(&env).await;
    let third = events.len() / 3;
    downstream
        .wait_for("a third of the events", PROCESSING, |calls| {
            ok_keys(calls).len() >= third
        })
        .await;
    first.kill9();
    first.wait_exit(STARTUP).await;
    let at_kill = downstream.calls();
    assert!(
        ok_keys(&at_kill).len() < events.len(),
        "the stream ended before the kill: the test proves nothing\n{}",
        describe(&at_kill)
    );

    let _second = env
        .start_worker("second", &downstream, |c| flags.config(c))
        .await;
    downstream
        .wait_for("every event after the restart", PROCESSING, |calls| {
            all_ok(calls, &events)
        })
        .await;
    env.wait_shard_queues_drained(PROCESSING).await;

    let calls = downstream.calls();
    if flags.groups() {
        assert_in_order_in_effect(&calls, &events);
    } else {
        assert_in_order_and_complete(&calls, &events);
    }
    assert_orders_never_overlap(&calls);
    let repeats = repeats_per_shard(&calls, &env);
    let bound = flags.repeat_bound();
    assert!(
        repeats.values().all(|n| *n <= bound),
        "more than the {bound} event(s) in flight repeated on a shard: {repeats:?}\n{}",
        describe(&calls)
    );
}
