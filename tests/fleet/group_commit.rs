//! `--group-commit N`: read-ahead events claimed, committed and acked in
//! groups — every event once, each order in seq order, duplicates and gaps
//! leaving the group for the serial path, a failed call going on there from
//! its attempt. kill -9 with groups is in `crash.rs`.

use std::time::Duration;

use shardline_testkit::{
    Call, Downstream, PROCESSING, Publisher, Reply, TestEnv, assert_all_delivered_once_in_order,
    assert_in_order_and_complete, describe, dlq, interleaved, order_ids,
};

use shardline_worker::GroupCommit;

const GROUP: u16 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_process_every_event_once_in_order_with_duplicates_and_gaps() {
    let env = TestEnv::new("group").await;
    env.apply_topology().await;
    let downstream = Downstream::start().await;
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.prefetch = 32;
            c.group_commit = GroupCommit::Fixed(GROUP);
        })
        .await;
    let publisher = Publisher::connect(&env).await;

    // Seq 1 of all orders, then seq 2, …: groups of many orders, chained
    // where an order's seqs meet in one group.
    let events = interleaved(&order_ids("grp", 300), 5, env.shards);
    publisher.publish(&events).await;
    let calls = assert_all_delivered_once_in_order(&env, &downstream, &events).await;
    let counts = worker.wait_settled(events.len() as u64).await;
    assert!(
        counts.grouped > events.len() as u64 / 2,
        "most events should go in groups: {counts:?}"
    );

    // Copies of processed events: fresh deliveries that join groups and
    // leave them as duplicates, never called.
    publisher.publish(&events[..200]).await;
    worker.wait_settled(events.len() as u64 + 200).await;
    // An order whose seq 2 comes last: seq 3 waits in the gate, then runs.
    let late: Vec<_> = interleaved(&order_ids("grp-gap", 1), 3, env.shards);
    publisher.publish(&[late[0].clone(), late[2].clone()]).await;
    worker.wait_held(1).await;
    publisher.publish(&late[1..2]).await;
    let mut all = events.clone();
    all.extend(late);
    let calls_after = assert_all_delivered_once_in_order(&env, &downstream, &all).await;
    assert_eq!(
        calls_after.len(),
        calls.len() + 3,
        "a duplicate reached the downstream:\n{}",
        describe(&calls_after)
    );
    let counts = worker.wait_settled(all.len() as u64 + 200).await;
    assert_eq!(counts.duplicates, 200, "{counts:?}");
    assert_eq!(counts.processed, all.len() as u64, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_call_in_a_group_goes_on_from_its_attempt_on_the_serial_path() {
    let env = TestEnv::new("group-fail").await;
    env.apply_topology().await;
    let conn = env.connect().await;
    let mut events = interleaved(&order_ids("grpf", 60), 4, env.shards);
    // An order whose seqs follow each other in its queue: chained in groups.
    events.extend(interleaved(&order_ids("grpf-chain", 1), 6, env.shards));
    // Two events fail once (retryable; the second is chained), one for good.
    let (flaky, broken, chained) = (events[70].key(), events[130].key(), events[242].key());
    let downstream = {
        let (flaky, broken, chained) = (flaky.clone(), broken.clone(), chained.clone());
        Downstream::scripted(move |call, before| {
            let key = call.key();
            let first = !before.iter().any(|c| c.key() == key);
            if (key == flaky || key == chained) && first {
                Reply::status(503)
            } else if key == broken {
                Reply::status(422)
            } else {
                Reply::ok()
            }
        })
        .await
    };
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.prefetch = 32;
            c.group_commit = GroupCommit::Fixed(GROUP);
            c.retry.base = Duration::from_millis(10);
        })
        .await;
    Publisher::connect(&env).await.publish(&events).await;
    let counts = worker.wait_settled(events.len() as u64).await;
    env.wait_shard_queues_drained(PROCESSING).await;
    let calls = downstream.calls();
    let report = describe(&calls);

    let of = |key: &str| -> Vec<&Call> { calls.iter().filter(|c| c.key() == key).collect() };
    let attempts = |key: &str| -> Vec<(Option<u32>, u16)> {
        of(key).iter().map(|c| (c.attempt(), c.status)).collect()
    };
    assert_eq!(
        attempts(&flaky),
        [(Some(1), 503), (Some(2), 200)],
        "the retry goes on from the group's attempt:\n{report}"
    );
    assert_eq!(
        attempts(&chained),
        [(Some(1), 503), (Some(2), 200)],
        "{report}"
    );
    assert_eq!(
        attempts(&broken),
        [(Some(1), 422)],
        "a permanent failure is called once:\n{report}"
    );
    let processed: Vec<_> = events
        .iter()
        .filter(|e| e.key() != broken)
        .cloned()
        .collect();
    let answered: Vec<Call> = calls.iter().filter(|c| c.ok()).cloned().collect();
    assert_in_order_and_complete(&answered, &processed);
    assert_eq!(answered.len(), processed.len(), "{report}");
    assert_eq!(counts.dead_lettered_total(), 1, "{counts:?}");
    assert_eq!(dlq::depth(&env, &conn).await, 1);
    assert!(counts.grouped > 0, "nothing went in groups: {counts:?}");
}
