//! The publisher library across broker outages, mid-stream: its connection
//! force-closed, and the broker application stopped and started. docs/semantics.md §4:
//! per-order publish order holds across reconnects, unconfirmed events are
//! re-sent in their original order, nothing is lost.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::BasicGetOptions;
use shardline_publisher::{Config, Counts, Publisher as LibPublisher};

use shardline_testkit::broker::NODE_START;
use shardline_testkit::{
    BrokerNode, PROCESSING, SHARDS, TestEnv, interleaved, orders_covering_shards, wait_until,
};

#[derive(Debug, Clone, Copy)]
enum Outage {
    CloseConnection,
    BrokerRestart,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn publisher_survives_its_connection_being_closed() {
    publisher_survives("close-publisher", Outage::CloseConnection).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts a private RabbitMQ node: scripts/test runs it alone"]
async fn publisher_survives_a_broker_restart() {
    publisher_survives("restart-publisher", Outage::BrokerRestart).await;
}

/// Events published back to back, then a pause: so that the outage is likely
/// to find events unconfirmed (the re-send path), while the stream lasts a few
/// seconds (2400 events at ~530/s).
const BURST: usize = 32;
const BURST_EVERY: Duration = Duration::from_millis(60);
/// The pace while the outage command runs.
const SLOW_BURST_EVERY: Duration = Duration::from_millis(400);
/// Seqs per order.
const PER_ORDER: u64 = 20;

/// Publishes 2400 events (120 orders × 20, seq-major) in bursts, with a window
/// of 64, and hits it with the outage after a quarter. Then every event is in
/// its order's shard queue; per order the first copies come in seq order;
/// every extra copy is accounted for by the publisher's re-sends.
async fn publisher_survives(name: &str, outage: Outage) {
    let node = BrokerNode::start().await;
    let env = TestEnv::on_node(name, shardline_testkit::QueueType::Classic, &node).await;
    env.apply_topology().await;
    let events = interleaved(
        &orders_covering_shards(name, 15, &env),
        PER_ORDER,
        env.shards,
    );
    let total = events.len();
    let connection_name = format!("outage publisher {}", env.id);
    let config = Config {
        amqp: env.amqp_target(),
        shards: env.shards,
        window: 64,
        connection_name: connection_name.clone(),
        reconnect_give_up: NODE_START,
        ..Config::default()
    };
    let mut publisher = LibPublisher::connect(config).await.unwrap();
    let pid = env
        .broker()
        .one_connection(&env.vhost, &connection_name)
        .await;

    let published = Arc::new(AtomicUsize::new(0));
    let bodies: Vec<Vec<u8>> = events.iter().map(|e| e.body.clone()).collect();
    // While the outage command runs (rabbitmqctl takes seconds on a busy
    // machine), bursts slow down, so that publishing is still under way when
    // the outage lands instead of having ended.
    let slow = Arc::new(AtomicBool::new(false));
    let task = {
        let published = Arc::clone(&published);
        let slow = Arc::clone(&slow);
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(BURST_EVERY);
            for (i, body) in bodies.into_iter().enumerate() {
                if i % BURST == 0 {
                    pace.tick().await;
                    if slow.load(Ordering::SeqCst) {
                        tokio::time::sleep(SLOW_BURST_EVERY).await;
                    }
                }
                publisher
                    .publish(body)
                    .await
                    .unwrap_or_else(|e| panic!("publishing event #{i}: {e}"));
                published.store(i + 1, Ordering::Relaxed);
            }
            publisher.flush().await.expect("flush");
            let counts = publisher.counts();
            publisher.close().await.expect("close");
            counts
        })
    };

    wait_until("a quarter of the events published", PROCESSING, || async {
        let n = published.load(Ordering::Relaxed);
        assert!(
            !task.is_finished(),
            "publisher stopped at {n} of {total} events"
        );
        if n >= total / 4 {
            Ok(())
        } else {
            Err(format!("{n} of {total} published"))
        }
    })
    .await;
    slow.store(true, Ordering::SeqCst);
    match outage {
        Outage::CloseConnection => env.broker().close_connection(&pid).await,
        Outage::BrokerRestart => node.stop_app().await,
    }
    let at_outage = published.load(Ordering::Relaxed);
    slow.store(false, Ordering::SeqCst);
    assert!(
        at_outage < total,
        "publishing ended before the outage: the test proves nothing"
    );
    if let Outage::BrokerRestart = outage {
        node.start_app().await;
    }
    let counts: Counts = tokio::time::timeout(PROCESSING, task)
        .await
        .expect("publisher did not finish after the outage")
        .expect("publisher task failed");
    assert_eq!(counts.published, total as u64, "{counts:?}");
    assert_eq!(counts.confirmed, total as u64, "{counts:?}");
    assert!(
        counts.reconnects >= 1,
        "the publisher never noticed the outage: {counts:?}"
    );

    let queued = drain(&env).await;
    let expected_shard: HashMap<&str, u16> = events
        .iter()
        .map(|e| (e.order_id.as_str(), e.shard))
        .collect();
    let mut first_copies: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut copies: HashMap<(String, u64), usize> = HashMap::new();
    for (shard, order, seq) in &queued {
        assert_eq!(
            expected_shard.get(order.as_str()),
            Some(shard),
            "order {order} seq {seq} in the wrong shard queue"
        );
        let n = copies.entry((order.clone(), *seq)).or_default();
        if *n == 0 {
            first_copies.entry(order.clone()).or_default().push(*seq);
        }
        *n += 1;
    }
    for (order, seqs) in &first_copies {
        assert_eq!(
            seqs,
            &(1..=PER_ORDER).collect::<Vec<_>>(),
            "order {order}: first copies in the queue in this order"
        );
    }
    assert_eq!(
        first_copies.len(),
        expected_shard.len(),
        "orders missing from the queues"
    );
    let extra = queued.len() - copies.len();
    assert!(
        extra as u64 <= counts.resent,
        "{extra} extra copies but only {} re-sends: {counts:?}",
        counts.resent
    );
    eprintln!(
        "{outage:?}: {total} events, outage at {at_outage}, {} queued ({extra} extra copies), {counts:?}",
        queued.len()
    );
}

/// Sets `key` to `text` on the Redis at `url`.
async fn restore(url: String, key: String, text: String) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(text)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Every message of every shard queue as `(shard, order_id, seq)`, in queue
/// order, taken with `basic.get` (auto-ack) until the queue is empty.
async fn drain(env: &TestEnv) -> Vec<(u16, String, u64)> {
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    for shard in 0..SHARDS {
        let queue = env.shard_queue(shard);
        while let Some(message) = channel
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let json: serde_json::Value = serde_json::from_slice(&message.delivery.data).unwrap();
            let order = json["order_id"].as_str().unwrap().to_owned();
            let seq = json["seq"].as_u64().unwrap();
            out.push((shard, order, seq));
        }
    }
    out
}

/// A publisher given the fleet's Redis (a private, non-persistent server)
/// whose Redis dies for longer than its lease (10 s): while the lease holds
/// it publishes on; once it lapses, a publish waits until Redis answers and
/// holds the record again (restored here as a persistent Redis would keep
/// it), registers again and sends its window again. Every event reaches its
/// shard queue, each order's seqs ascending (re-sent copies may repeat).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills a private Redis for longer than a lease: scripts/test runs it alone"]
async fn a_publisher_whose_lease_lapses_waits_for_redis_registers_again_and_loses_nothing() {
    let env = TestEnv::new("lease-lapse").await;
    env.apply_topology().await;
    let keys = env.keys();
    let record = shardline_connect::record::read(&mut env.redis().await, &keys)
        .await
        .unwrap()
        .unwrap();
    let mut redis = shardline_testkit::redis::RedisServer::start(&env.id).await;
    let (key, text) = (keys.topology(), record.encode());
    restore(redis.url(), key.clone(), text.clone()).await;
    let config = Config {
        amqp: env.amqp_target(),
        names: env.names.clone(),
        shards: env.shards,
        redis: Some(redis.url().parse().unwrap()),
        redis_prefix: env.redis_prefix.clone(),
        ..Config::default()
    };
    let mut publisher = LibPublisher::connect(config).await.unwrap();
    let orders: Vec<String> = (0..8).map(|i| format!("lapse-{i}")).collect();
    let event = |order: &str, seq: u64| shardline_contract::NewEvent {
        order_id: shardline_contract::OrderId::new(order).unwrap(),
        event: "order.updated".into(),
        seq: Some(seq),
        event_id: None,
        data: serde_json::json!({}),
    };
    let mut seq = 0;
    for order in &orders {
        publisher.publish_event(&event(order, 1)).await.unwrap();
    }
    seq += 1;
    redis.kill9();
    let killed = std::time::Instant::now();
    // Publish a round every 250 ms until a publish waits (the lease lapsed);
    // bring Redis back, with the record, 3 s after the lease's end.
    let url = redis.url();
    let revive = tokio::spawn(async move {
        tokio::time::sleep_until((killed + Duration::from_secs(13)).into()).await;
        redis.restart().await;
        restore(url, key, text).await;
        redis
    });
    let mut waited = Duration::ZERO;
    while killed.elapsed() < Duration::from_secs(20) {
        seq += 1;
        for order in &orders {
            let started = std::time::Instant::now();
            publisher.publish_event(&event(order, seq)).await.unwrap();
            waited = waited.max(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    publisher.close().await.unwrap();
    let _redis = revive.await.unwrap();
    assert!(
        waited >= Duration::from_secs(1),
        "no publish waited for the lease: the longest took {waited:?}"
    );

    let mut seen: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (_, order, seq) in drain(&env).await {
        seen.entry(order).or_default().push(seq);
    }
    for order in &orders {
        let seqs = seen.get(order).cloned().unwrap_or_default();
        let mut firsts: Vec<u64> = Vec::new();
        for s in &seqs {
            if !firsts.contains(s) {
                firsts.push(*s);
            }
        }
        assert_eq!(
            firsts,
            (1..=seq).collect::<Vec<_>>(),
            "{order}: first arrivals in order, none missing ({seqs:?})"
        );
    }
}
