//! The downstream breaker: an outage pauses the fleet instead of filling the
//! DLQ, whatever the evidence at hand (many shards, one shard with one order
//! at a time, a worker restarted in the middle); a poison event still goes to
//! the DLQ after its attempts, and never opens it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use shardline_testkit::{
    Call, Downstream, Event, Publisher, Reply, TestEnv, Worker, assert_all_answered_once_in_order,
    interleaved, order_ids,
};
use shardline_worker::OnDeadLetter;

/// What the downstream does now.
const UP: u8 = 0;
const UNAVAILABLE: u8 = 1;

/// A downstream that answers 200 while up and 503 (`Retry-After: 1`) while
/// unavailable; refusing connections is [`Downstream::refuse_connections`].
async fn flaky() -> (Downstream, Arc<AtomicU8>) {
    let phase = Arc::new(AtomicU8::new(UP));
    let downstream = {
        let phase = Arc::clone(&phase);
        Downstream::scripted(move |_, _| match phase.load(Ordering::SeqCst) {
            UP => Reply::ok(),
            _ => Reply::status(503).retry_after(1),
        })
        .await
    };
    (downstream, phase)
}

/// A downstream outage: connections refused for `refused`, then 503 for
/// `unavailable`, then up. Returns when it recovered.
async fn outage(
    downstream: &Downstream,
    phase: &AtomicU8,
    refused: Duration,
    unavailable: Duration,
) -> Instant {
    tokio::time::sleep(refused).await;
    phase.store(UNAVAILABLE, Ordering::SeqCst);
    downstream.accept_connections().await;
    tokio::time::sleep(unavailable).await;
    phase.store(UP, Ordering::SeqCst);
    Instant::now()
}

/// The first call answered 2xx after `recovered`, and how long after.
fn resumed_after(calls: &[Call], recovered: Instant) -> Duration {
    calls
        .iter()
        .filter(|c| c.ok() && c.started >= recovered)
        .map(|c| c.started - recovered)
        .min()
        .unwrap_or(Duration::MAX)
}

/// Nothing dead-lettered, every event once and in order, calls resumed
/// within 10 s of the recovery, the breaker opened and closed again.
async fn assert_outage_survived(
    env: &TestEnv,
    worker: &Worker,
    downstream: &Downstream,
    events: &[Event],
    recovered: Instant,
) {
    let calls = assert_all_answered_once_in_order(env, downstream, events).await;
    let resumed = resumed_after(&calls, recovered);
    assert!(
        resumed <= Duration::from_secs(10),
        "calls resumed {resumed:?} after the downstream recovered"
    );
    let counts = worker.wait_settled(events.len() as u64).await;
    assert_eq!(env.dlq_backlog().await, 0, "{}", worker.describe());
    assert_eq!(
        counts.processed,
        events.len() as u64,
        "{}",
        worker.describe()
    );
    assert!(
        counts.breaker_trips >= 1,
        "the breaker never opened: {counts:?}"
    );
    assert!(
        counts.breaker_paused_ms > 0,
        "the breaker never closed: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_pauses_every_shard_and_dead_letters_nothing() {
    let env = TestEnv::new("breaker-outage").await.with_shards(4);
    env.apply_topology().await;
    let (downstream, phase) = flaky().await;
    downstream.refuse_connections();
    let worker = env.start_worker("w1", &downstream, |_| {}).await;

    let events = interleaved(&order_ids("outage", 40), 3, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    let recovered = outage(
        &downstream,
        &phase,
        Duration::from_secs(20),
        Duration::from_secs(10),
    )
    .await;

    assert_outage_survived(&env, &worker, &downstream, &events, recovered).await;
    worker.stop().await;
}

/// Quarantine mode: no order is quarantined by an outage; and an order held
/// by the gate meanwhile (seq 2 arrived, seq 1 arrives during the outage)
/// waits out the outage however short its gap grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_quarantine_mode_no_order_is_quarantined_and_no_gap_times_out() {
    let env = TestEnv::new("breaker-quarantine").await.with_shards(4);
    env.apply_topology().await;
    let (downstream, phase) = flaky().await;
    let worker = env
        .start_worker("w1", &downstream, |c| {
            c.on_dead_letter = OnDeadLetter::Quarantine;
            c.gap_grace = Duration::from_secs(3);
        })
        .await;
    let publisher = Publisher::connect(&env).await;
    let held: Vec<Event> = (1..=3).map(|s| Event::new("held", s, env.shards)).collect();
    publisher.publish(&held[1..]).await;
    worker.wait_held(2).await;

    downstream.refuse_connections();
    let mut events = interleaved(&order_ids("quarantine", 40), 3, env.shards);
    publisher.publish(&events).await;
    publisher.publish(&held[..1]).await;
    let recovered = outage(
        &downstream,
        &phase,
        Duration::from_secs(12),
        Duration::from_secs(6),
    )
    .await;

    events.extend(held);
    assert_outage_survived(&env, &worker, &downstream, &events, recovered).await;
    let counts = worker.counts();
    assert_eq!(
        counts.gaps, 0,
        "a gap timed out during the outage: {counts:?}"
    );
    worker.stop().await;
}

/// The thin-evidence case: one shard, one call at a time, orders queued one
/// after the other. The first event to use its attempts is not
/// dead-lettered: an event of the next order is tried, fails too, and the
/// breaker opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shard_with_one_order_at_a_time_tells_an_outage_from_a_poison_event() {
    let env = TestEnv::new("breaker-thin").await.with_shards(1);
    env.apply_topology().await;
    let (downstream, phase) = flaky().await;
    downstream.refuse_connections();
    let worker = env
        .start_worker("w1", &downstream, |c| c.concurrency = 1)
        .await;

    let events: Vec<Event> = order_ids("thin", 20)
        .iter()
        .flat_map(|order| (1..=3).map(|seq| Event::new(order, seq, env.shards)))
        .collect();
    Publisher::connect(&env).await.publish(&events).await;
    let recovered = outage(
        &downstream,
        &phase,
        Duration::from_secs(8),
        Duration::from_secs(4),
    )
    .await;

    assert_outage_survived(&env, &worker, &downstream, &events, recovered).await;
    worker.stop().await;
}

/// A worker restarted during the outage starts from the fleet's open
/// breaker: no `crash-loop` or `seq-gap` dead letter, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_restarted_mid_outage_dead_letters_nothing() {
    let env = TestEnv::new("breaker-restart").await.with_shards(4);
    env.apply_topology().await;
    let (downstream, phase) = flaky().await;
    downstream.refuse_connections();
    let configure = |c: &mut shardline_worker::Config| c.concurrency = 4;
    let first = env.start_worker("w1", &downstream, configure).await;
    let events = interleaved(&order_ids("restart", 40), 3, env.shards);
    Publisher::connect(&env).await.publish(&events).await;
    first.wait_breaker_open().await;
    first.stop().await;

    let worker = env.start_worker("w2", &downstream, configure).await;
    let recovered = outage(
        &downstream,
        &phase,
        Duration::from_secs(6),
        Duration::from_secs(4),
    )
    .await;
    assert_outage_survived(&env, &worker, &downstream, &events, recovered).await;
    worker.stop().await;
}

/// A poison event (503 forever) among healthy traffic uses its attempts and
/// is dead-lettered as without a breaker, which never opens; a 422 is
/// dead-lettered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_is_dead_lettered_and_never_opens_the_breaker() {
    let env = TestEnv::new("breaker-poison").await.with_shards(4);
    env.apply_topology().await;
    let poison = Event::new("poison", 1, env.shards);
    let invalid = Event::new("invalid", 1, env.shards);
    let downstream = {
        let (poison, invalid) = (poison.key(), invalid.key());
        Downstream::scripted(move |call, _| {
            if call.key() == poison {
                Reply::status(503)
            } else if call.key() == invalid {
                Reply::status(422)
            } else {
                Reply::ok().after(Duration::from_millis(5))
            }
        })
        .await
    };
    let worker = env.start_worker("w1", &downstream, |_| {}).await;
    let healthy = interleaved(&order_ids("healthy", 60), 5, env.shards);
    let publisher = Publisher::connect(&env).await;
    publisher.publish(&[poison.clone(), invalid.clone()]).await;
    publisher.publish(&healthy).await;

    assert_all_answered_once_in_order(&env, &downstream, &healthy).await;
    let counts = worker.wait_settled(healthy.len() as u64 + 2).await;
    let calls = downstream.calls();
    let attempts = |key: &str| calls.iter().filter(|c| c.key() == key).count();
    let max_attempts = env.worker_config("w1").retry.max_attempts as usize;
    assert_eq!(attempts(&poison.key()), max_attempts, "{counts:?}");
    assert_eq!(attempts(&invalid.key()), 1, "{counts:?}");
    assert_eq!(env.dlq_backlog().await, 2);
    assert_eq!(
        counts.breaker_trips, 0,
        "one poison event opened the breaker"
    );
    worker.stop().await;
}
