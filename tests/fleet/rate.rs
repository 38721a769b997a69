//! `worker --max-rate R`: at most R handler calls per second for the whole
//! worker, whatever the backlog, the shard count or the concurrency.

use std::time::Duration;

use shardline_testkit::{
    Downstream, Publisher, TestEnv, assert_all_delivered_once_in_order, interleaved, order_ids,
};

/// Calls per second allowed.
const RATE: f64 = 50.0;
/// What the bucket lets through at once after an idle spell: a tenth of a
/// second's worth.
const BURST: usize = 5;
/// Room for a busy machine: one request's arrival may lag its start.
const SLACK: usize = 2;

/// A backlog of 1,000 events over 8 shards, consumed with 4 calls in flight
/// per shard: without the limit the downstream would see hundreds of calls a
/// second. In every window of t ≥ 1 s, the downstream's arrivals never exceed
/// 50·t + the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_never_exceed_the_rate_plus_the_burst() {
    let env = TestEnv::new("rate").await;
    env.apply_topology().await;
    let events = interleaved(&order_ids("rate", 200), 5, env.shards);
    // The backlog is there before the worker starts.
    Publisher::connect(&env).await.publish(&events).await;
    let downstream = Downstream::start().await;
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.concurrency = 4;
            c.max_rate = Some(RATE);
        })
        .await;

    let calls = assert_all_delivered_once_in_order(&env, &downstream, &events).await;

    let mut arrivals: Vec<Duration> = calls.iter().map(|c| c.started - calls[0].started).collect();
    arrivals.sort_unstable();
    let span = arrivals.last().copied().unwrap_or_default();
    // Every window that starts at an arrival and lasts t = 1 s, 2 s, …
    for (i, from) in arrivals.iter().enumerate() {
        for secs in 1..=span.as_secs() + 1 {
            let window = Duration::from_secs(secs);
            let inside = arrivals[i..]
                .iter()
                .take_while(|at| **at - *from < window)
                .count();
            let allowed = (RATE * secs as f64) as usize + BURST + SLACK;
            assert!(
                inside <= allowed,
                "{inside} calls within {secs} s from arrival {i} ({from:?}), at most {allowed} allowed"
            );
        }
    }
    // And the limit did not starve anyone: 1,000 calls at 50/s take about 20 s.
    assert!(
        span >= Duration::from_secs(18),
        "1000 calls in {span:?}: faster than {RATE}/s allows"
    );
    worker.assert_all_processed(events.len() as u64).await;
}
