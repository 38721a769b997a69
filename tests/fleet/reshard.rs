//! Resharding (ARCHITECTURE.md, "Resharding: the protocol"), part by part
//! against the real broker and Redis: the publishers' side of the confirm
//! barrier.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use shardline_contract::reshard::{
    Barrier, Destination, Generation, Lease, Phase, ReshardState, barrier,
};
use shardline_contract::status::unix_ms;
use shardline_contract::{NewEvent, OrderId};
use shardline_testkit::TestEnv;

/// One event of each order at `seq`.
async fn round(publisher: &mut shardline_publisher::Publisher, orders: &[OrderId], seq: u64) {
    for order in orders {
        let event = NewEvent {
            order_id: order.clone(),
            event: "order.updated".into(),
            seq: Some(seq),
            event_id: None,
            data: serde_json::json!({}),
        };
        publisher.publish_event(&event).await.unwrap();
    }
}

/// Every message of `queue`, taken (`basic.get`, acked): (order, seq).
async fn take_all(channel: &lapin::Channel, queue: &str) -> Vec<(String, u64)> {
    let mut taken = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let body: serde_json::Value = serde_json::from_slice(&message.delivery.data).unwrap();
        taken.push((
            body["order_id"].as_str().unwrap().to_owned(),
            body["seq"].as_u64().unwrap(),
        ));
    }
    taken
}

/// A publisher of the project follows the recorded topology's generation
/// through the barrier: registered at connect with the generation it read
/// (its live lease holds the barrier to the next), it acknowledges a newer
/// one (a reshard at its holding step, generation 2) when its lease is next
/// renewed, after confirming what it routed by the older map, and routes by
/// it from then on: a moving order's events go to its move's holding queue,
/// each after every event of the order in its old shard queue. The barrier
/// opens on the acknowledgement; a closed publisher leaves the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_acknowledges_a_new_generation_when_it_renews_then_routes_by_it() {
    let env = TestEnv::new("reshard-ack").await;
    env.apply_topology().await;
    let mut redis = env.redis().await;
    let keys = env.keys();
    let config = shardline_publisher::Config {
        amqp: env.amqp_target(),
        names: env.names.clone(),
        shards: env.shards,
        redis: Some(env.ops_fleet().redis),
        redis_prefix: env.redis_prefix.clone(),
        ..shardline_publisher::Config::default()
    };
    let mut publisher = shardline_publisher::Publisher::connect(config)
        .await
        .unwrap();
    let id = publisher.registration().expect("registered").to_owned();
    let registered = || async {
        let mut redis = env.redis().await;
        shardline_connect::publishers::all(&mut redis, &keys)
            .await
            .unwrap()
            .into_iter()
            .find(|p| p.id == id)
    };
    let lease = registered().await.expect("in the registry").lease;
    assert_eq!(lease.acknowledged, Generation(1));
    assert_eq!(
        barrier(&[lease], Generation(2), unix_ms()),
        Barrier::Waiting(1),
        "a live lease that acknowledged generation 1 holds the barrier to 2"
    );

    // The reshard's holding step, as its command records it: generation 2,
    // holding queues declared and bound first.
    let mut record = shardline_connect::record::read(&mut redis, &keys)
        .await
        .unwrap()
        .unwrap();
    let m = env.shards.get() + 2;
    let mut state = ReshardState::planned(1, m, "test", 0);
    state.phase = Phase::Holding;
    let routing = record.routing().unwrap();
    let reshard = state.reshard(routing.map()).unwrap();
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let mut holds = BTreeMap::new();
    for mv in &reshard.plan().moves {
        let queue = env.names.hold_queue(1, mv.from, mv.to);
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let key = shardline_contract::Names::hold_routing_key(1, mv.from, mv.to);
        channel
            .queue_bind(
                queue.as_str().into(),
                env.names.exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        holds.insert(queue, mv.from);
    }
    record.generation = 2;
    record.reshard = Some(state);
    let _: () = redis::cmd("SET")
        .arg(keys.topology())
        .arg(record.encode())
        .query_async(&mut redis)
        .await
        .unwrap();
    let next = record.routing().unwrap();
    // `topology status` counts it as live and behind until it renews (it
    // renews only as it publishes).
    let status = env.cli(&["topology", "status"]).await;
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(
        stdout.contains("registered publishers: 1 live (1 on an older generation), 0 lapsed"),
        "{stdout}"
    );

    // Publish round after round over 60 orders until the publisher
    // acknowledged generation 2 (its renewal is due every lease / 3), then
    // one round more.
    let orders: Vec<OrderId> = (0..60)
        .map(|i| OrderId::new(format!("ack-{i}")).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    loop {
        seq += 1;
        round(&mut publisher, &orders, seq).await;
        let acked = registered().await.map(|p| p.lease.acknowledged);
        if acked == Some(Generation(2)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "generation 2 not acknowledged in 30 s: {acked:?}"
        );
    }
    let leases = async || -> Vec<Lease> {
        shardline_connect::publishers::all(&mut env.redis().await, &keys)
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.lease)
            .collect()
    };
    assert_eq!(
        barrier(&leases().await, Generation(2), unix_ms()),
        Barrier::Open
    );
    round(&mut publisher, &orders, seq + 1).await;
    publisher.close().await.unwrap();
    assert!(
        leases().await.is_empty(),
        "a closed publisher leaves the registry"
    );

    // Per moving order: all of its old queue's seqs before all of its
    // holding queue's.
    let mut moving = 0;
    for order in &orders {
        if let Destination::Hold(_) = next.destination(order) {
            moving += 1;
        }
    }
    assert!(moving > 0, "no order of 60 moves");
    let mut old_max: BTreeMap<String, u64> = BTreeMap::new();
    for shard in 0..env.shards.get() {
        for (order, seq) in take_all(&channel, &env.shard_queue(shard)).await {
            let top = old_max.entry(order).or_default();
            *top = (*top).max(seq);
        }
    }
    let mut held = 0;
    for queue in holds.keys() {
        for (order, seq) in take_all(&channel, queue).await {
            held += 1;
            let before = old_max.get(&order).copied().unwrap_or(0);
            assert!(
                seq > before,
                "{order}: seq {seq} held while {before} went to its old shard"
            );
            let routed = next.destination(&OrderId::new(&order).unwrap());
            assert!(
                matches!(routed, Destination::Hold(_)),
                "{order} is not moving"
            );
        }
    }
    assert!(held > 0, "nothing reached a holding queue");
}

/// `topology reshard --to M --plan` reads the recorded topology and prints
/// the moves without changing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reshard_plan_is_printed_and_nothing_changes() {
    let env = TestEnv::new("reshard-plan").await;
    env.apply_topology().await;
    let before = env.queue_depths().await;
    let n = env.shards.get();
    let to = (n + 2).to_string();
    let out = env
        .cli(&["topology", "reshard", "--to", &to, "--plan"])
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with(&format!("reshard {n} → {to} shards (generation 1")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "new shard queues: {}",
            env.names.shard_queue_named(u32::from(n))
        )),
        "{stdout}"
    );
    assert_eq!(
        env.queue_depths().await.len(),
        before.len(),
        "nothing declared"
    );
    let record = shardline_connect::record::read(&mut env.redis().await, &env.keys())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((record.generation, record.reshard), (1, None));
}

/// A marker is honoured once, and only when its id was recorded pending for
/// its move and hand-over: the script marks it spent and releases its move
/// in one step; a repeat releases nothing more, a forged id or one of another
/// move nothing at all (against the real Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_is_honoured_once_and_a_forged_one_releases_nothing() {
    use shardline_connect::reshard::{honour, record_marker, released};
    use shardline_contract::reshard::{Honour, MarkerError, MarkerId, MarkerKind, MoveId};
    let env = TestEnv::new("reshard-marker").await;
    let (mut redis, keys) = (env.redis().await, env.keys());
    let (id, mv) = (MarkerId(0x5eed_cafe_f00d), MoveId(3));
    record_marker(&mut redis, &keys, id, mv, MarkerKind::Drain)
        .await
        .unwrap();
    let forged = honour(&mut redis, &keys, MarkerId(7), mv, MarkerKind::Drain)
        .await
        .unwrap();
    assert_eq!(forged, Err(MarkerError::Unknown(MarkerId(7))));
    let other_move = honour(&mut redis, &keys, id, MoveId(4), MarkerKind::Drain)
        .await
        .unwrap();
    assert_eq!(other_move, Err(MarkerError::Mismatch(id)));
    let other_kind = honour(&mut redis, &keys, id, mv, MarkerKind::Close)
        .await
        .unwrap();
    assert_eq!(other_kind, Err(MarkerError::Mismatch(id)));
    assert_eq!(
        released(&mut redis, &keys).await.unwrap(),
        Default::default()
    );

    let first = honour(&mut redis, &keys, id, mv, MarkerKind::Drain)
        .await
        .unwrap();
    assert_eq!(first, Ok(Honour::Honoured(mv, MarkerKind::Drain)));
    let again = honour(&mut redis, &keys, id, mv, MarkerKind::Drain)
        .await
        .unwrap();
    assert_eq!(again, Ok(Honour::AlreadyHonoured));
    let (drained, closed) = released(&mut redis, &keys).await.unwrap();
    assert_eq!(drained.into_iter().collect::<Vec<_>>(), [mv]);
    assert!(closed.is_empty());
    // Recording it again (a resumed reshard) keeps it spent.
    record_marker(&mut redis, &keys, id, mv, MarkerKind::Drain)
        .await
        .unwrap();
    let after = honour(&mut redis, &keys, id, mv, MarkerKind::Drain)
        .await
        .unwrap();
    assert_eq!(after, Ok(Honour::AlreadyHonoured));
}

/// Publishes `events` in order in batches of `batch`, `pause` apart, through
/// the project's publisher (routing by the recorded map, registered in the
/// barrier).
async fn publish_by_the_map(
    env: &TestEnv,
    events: Vec<shardline_testkit::Event>,
    batch: usize,
    pause: Duration,
) -> tokio::task::JoinHandle<Sent> {
    let config = shardline_publisher::Config {
        amqp: env.amqp_target(),
        names: env.names.clone(),
        shards: env.shards,
        redis: Some(env.ops_fleet().redis),
        redis_prefix: env.redis_prefix.clone(),
        connection_name: "reshard-test project publisher".into(),
        ..shardline_publisher::Config::default()
    };
    let mut publisher = shardline_publisher::Publisher::connect(config)
        .await
        .unwrap();
    tokio::spawn(async move {
        let mut sent = Sent::new();
        for chunk in events.chunks(batch) {
            for event in chunk {
                sent.insert((event.order_id.clone(), event.seq), Instant::now());
                publisher.publish(event.body.clone()).await.unwrap();
            }
            publisher.flush().await.unwrap();
            tokio::time::sleep(pause).await;
        }
        publisher.close().await.unwrap();
        sent
    })
}

/// When each event (order, seq) was published.
type Sent = BTreeMap<(String, u64), Instant>;

/// The longest wait from publish to first call over `events`, and its
/// 99th percentile.
fn waits(sent: &Sent, calls: &[shardline_testkit::Call]) -> (Duration, Duration) {
    let mut first: BTreeMap<(String, u64), Instant> = BTreeMap::new();
    for call in calls {
        if let (Some(order), Some(seq)) = (&call.order_id, call.seq) {
            first.entry((order.clone(), seq)).or_insert(call.started);
        }
    }
    let mut waits: Vec<Duration> = sent
        .iter()
        .filter_map(|(key, at)| Some(first.get(key)?.saturating_duration_since(*at)))
        .collect();
    waits.sort();
    let p99 = waits
        .get(waits.len() * 99 / 100)
        .copied()
        .unwrap_or_default();
    (waits.last().copied().unwrap_or_default(), p99)
}

/// Publishes `events` like the pika recipe: `shard.{md5 mod N}` for the N
/// the test started with, whatever the topology does.
async fn publish_like_the_recipe(
    env: &TestEnv,
    events: Vec<shardline_testkit::Event>,
    batch: usize,
    pause: Duration,
) -> tokio::task::JoinHandle<Sent> {
    let publisher = shardline_testkit::Publisher::connect(env).await;
    tokio::spawn(async move {
        let mut sent = Sent::new();
        for chunk in events.chunks(batch) {
            let now = Instant::now();
            sent.extend(chunk.iter().map(|e| ((e.order_id.clone(), e.seq), now)));
            publisher.publish(chunk).await;
            tokio::time::sleep(pause).await;
        }
        sent
    })
}

/// 4 → 8 shards under load (ARCHITECTURE.md, "Resharding: the protocol"):
/// two `--assign auto` workers, the project's publisher routing by the
/// recorded map and a recipe publisher on `md5 mod 4` publish ordered events
/// of their own orders throughout; `topology reshard --to 8` runs and one
/// worker is killed -9 in the middle and started again. Every event is
/// called, each order's in seq order; nothing is dead-lettered; the eight
/// shard queues are consumed at the end, the holding queues are gone, and
/// the recipe publisher's events of moved orders were forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_grows_from_4_to_8_shards_under_load_and_keeps_each_order_in_order() {
    let env = TestEnv::new("reshard-grow").await.with_shards(4);
    env.apply_topology().await;
    let downstream = shardline_testkit::Downstream::with_latency(Duration::from_millis(1)).await;
    let member = |name: &str| {
        shardline_testkit::ChildWorker::start(
            &env,
            name,
            &downstream.url(),
            &["--assign", "auto", "--member-id", name],
        )
    };
    let mut a = member("a");
    let mut b = member("b");
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;

    let by_map = shardline_testkit::interleaved(
        &shardline_testkit::order_ids("grow-map", 120),
        24,
        env.shards,
    );
    let by_recipe = shardline_testkit::interleaved(
        &shardline_testkit::order_ids("grow-recipe", 120),
        24,
        env.shards,
    );
    // About 170 events a second together, for about 17 s.
    let pace = Duration::from_millis(140);
    let map_publisher = publish_by_the_map(&env, by_map.clone(), 12, pace).await;
    let recipe_publisher = publish_like_the_recipe(&env, by_recipe.clone(), 12, pace).await;
    processing(&downstream, 300).await;

    let reshard = {
        let mut command = env.shardline_command();
        command
            .args(["topology", "reshard", "--to", "8"])
            .args(env.global_args())
            .kill_on_drop(true);
        command.output()
    };
    let kill = async {
        // In the middle: once the reshard is recorded.
        shardline_testkit::wait::wait_until(
            "the reshard to start",
            Duration::from_secs(30),
            || async {
                let running = record_of(&env).await.reshard.is_some();
                shardline_testkit::wait::check(running, || "not yet".into())
            },
        )
        .await;
        a.kill9();
        a = member("a");
    };
    let (out, ()) = tokio::join!(reshard, kill);
    let out = out.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("resharded 4 → 8 shards"), "{stdout}");

    let mut sent = map_publisher.await.unwrap();
    sent.extend(recipe_publisher.await.unwrap());
    let events: Vec<_> = by_map.iter().chain(&by_recipe).cloned().collect();
    let calls = called_in_order(&env, &downstream, &events).await;
    let (longest, p99) = waits(&sent, &calls);
    assert!(
        longest < Duration::from_secs(30),
        "an event waited {longest:?} from publish to its first call (WARN: 30 s)"
    );

    let record = shardline_connect::record::read(&mut env.redis().await, &env.keys())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (record.shards, record.generation, record.reshard),
        (8, 3, None)
    );
    shardline_testkit::wait::wait_until(
        "8 shard queues consumed",
        Duration::from_secs(30),
        || async {
            let all = env.shard_consumers().await;
            let consumed = (0..8)
                .filter(|&s| {
                    all.get(&env.names.shard_queue_named(s))
                        .is_some_and(|rows| rows.iter().any(|r| r.active))
                })
                .count();
            shardline_testkit::wait::check(consumed == 8, || format!("{consumed} of 8"))
        },
    )
    .await;
    let depths = env.queue_depths().await;
    assert!(
        depths.keys().all(|q| !q.contains(".move.")),
        "holding queues left: {depths:?}"
    );
    eprintln!(
        "reshard 4 → 8 under load: {} events called in order, publish → first call \
         longest {longest:?}, p99 {p99:?}; reshard output:\n{stdout}",
        events.len()
    );
    a.sigterm();
    b.sigterm();
    a.wait_exit(Duration::from_secs(30)).await;
    b.wait_exit(Duration::from_secs(30)).await;
}

/// Waits until `downstream` was called `calls` times: the load runs.
async fn processing(downstream: &shardline_testkit::Downstream, calls: usize) {
    downstream
        .wait_for(
            "the load to be processed",
            shardline_testkit::PROCESSING,
            |seen| seen.len() >= calls,
        )
        .await;
}

/// Every event called, each order's in seq order, and nothing
/// dead-lettered.
async fn called_in_order(
    env: &TestEnv,
    downstream: &shardline_testkit::Downstream,
    events: &[shardline_testkit::Event],
) -> Vec<shardline_testkit::Call> {
    let calls = shardline_testkit::wait_all_answered(env, downstream, events).await;
    shardline_testkit::assert_in_order_and_complete(&calls, events);
    assert_eq!(env.dlq_backlog().await, 0, "nothing dead-lettered");
    calls
}

/// Stops the workers (SIGTERM), each within 30 s.
async fn stop(members: &mut [shardline_testkit::ChildWorker]) {
    for member in members {
        member.sigterm();
        member.wait_exit(Duration::from_secs(30)).await;
    }
}

/// Two `--assign auto` workers calling `downstream`.
fn two_members(
    env: &TestEnv,
    downstream: &shardline_testkit::Downstream,
) -> [shardline_testkit::ChildWorker; 2] {
    two_members_with(env, downstream, &[])
}

/// [`two_members`] with more flags.
fn two_members_with(
    env: &TestEnv,
    downstream: &shardline_testkit::Downstream,
    more: &[&str],
) -> [shardline_testkit::ChildWorker; 2] {
    ["a", "b"].map(|name| {
        let mut args = vec!["--assign", "auto", "--member-id", name];
        args.extend_from_slice(more);
        shardline_testkit::ChildWorker::start(env, name, &downstream.url(), &args)
    })
}

/// `topology reshard --to M`, to its end: its output.
async fn reshard(env: &TestEnv, to: u16) -> String {
    let out = env
        .shardline_command()
        .args(["topology", "reshard", "--to", &to.to_string()])
        .args(env.global_args())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `topology reshard --to M`, killed -9 once it printed a line containing
/// `at`: what it printed.
async fn reshard_killed_at(env: &TestEnv, to: u16, at: &str) -> String {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = env
        .shardline_command()
        .args(["topology", "reshard", "--to", &to.to_string()])
        .args(env.global_args())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = String::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        printed.push_str(&line);
        printed.push('\n');
        if line.contains(at) {
            child.start_kill().unwrap();
            child.wait().await.unwrap();
            return printed;
        }
    }
    panic!("the reshard ended without printing {at:?}:\n{printed}");
}

/// The recorded topology.
async fn record_of(env: &TestEnv) -> shardline_contract::topology::TopologyRecord {
    shardline_connect::record::read(&mut env.redis().await, &env.keys())
        .await
        .unwrap()
        .unwrap()
}

/// 8 → 6 shards (a shrink, not a divisor) under the project's publisher and
/// a recipe publisher on `md5 mod 8` that starts again half-way (declaring
/// and binding all eight queues again, as the recipe does at every start):
/// every event called, each order in seq order, nothing dead-lettered;
/// queues 6 and 7 are retired (recorded as such), still consumed, and what
/// the recipe publisher still sends them is forwarded to the orders' shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_shrinks_from_8_to_6_shards_and_serves_the_retired_queues() {
    let env = TestEnv::new("reshard-shrink").await.with_shards(8);
    env.apply_topology().await;
    let downstream = shardline_testkit::Downstream::with_latency(Duration::from_millis(1)).await;
    let mut members = two_members(&env, &downstream);
    env.wait_spread(&[("a", 4), ("b", 4)], Duration::from_secs(30))
        .await;
    let orders = |prefix| shardline_testkit::order_ids(prefix, 100);
    let by_map = shardline_testkit::interleaved(&orders("shrink-map"), 20, env.shards);
    let by_recipe = shardline_testkit::interleaved(&orders("shrink-recipe"), 20, env.shards);
    let (first, second) = by_recipe.split_at(by_recipe.len() / 2);
    let pace = Duration::from_millis(100);
    let map_publisher = publish_by_the_map(&env, by_map.clone(), 10, pace).await;
    let recipe_publisher = publish_like_the_recipe(&env, first.to_vec(), 10, pace).await;
    processing(&downstream, 200).await;

    let (stdout, ()) = tokio::join!(reshard(&env, 6), async {
        recipe_publisher.await.unwrap();
        // The recipe starts again: declares and binds its eight queues.
        let conn = shardline_connect::connect(&env.amqp_target(), "recipe restart")
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        for i in 0..8 {
            let queue = env.names.shard_queue_named(i);
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            channel
                .queue_bind(
                    queue.as_str().into(),
                    env.names.exchange.as_str().into(),
                    format!("shard.{i}").as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
    });
    assert!(stdout.contains("resharded 8 → 6 shards"), "{stdout}");
    publish_like_the_recipe(&env, second.to_vec(), 10, pace)
        .await
        .await
        .unwrap();
    map_publisher.await.unwrap();

    let events: Vec<_> = by_map.iter().chain(&by_recipe).cloned().collect();
    called_in_order(&env, &downstream, &events).await;
    let record = record_of(&env).await;
    assert_eq!(
        (record.shards, record.retired.clone(), record.reshard),
        (6, vec![6, 7], None)
    );
    let consumers = env.shard_consumers().await;
    for retired in [6, 7] {
        let queue = env.names.shard_queue_named(retired);
        assert!(
            consumers
                .get(&queue)
                .is_some_and(|rows| rows.iter().any(|r| r.active)),
            "retired {queue} is consumed"
        );
    }
    stop(&mut members).await;
}

/// The reshard command killed -9 in the middle, twice (after its first
/// barrier, after the drain markers), and run again: each run resumes at
/// the recorded step, taking over the lock of the run that died, and the
/// last one finishes; a publish throughout is called in order, complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_killed_mid_way_resumes_when_run_again() {
    let env = TestEnv::new("reshard-resume").await.with_shards(4);
    env.apply_topology().await;
    let downstream = shardline_testkit::Downstream::with_latency(Duration::from_millis(1)).await;
    let mut members = two_members(&env, &downstream);
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;
    let events =
        shardline_testkit::interleaved(&shardline_testkit::order_ids("resume", 80), 20, env.shards);
    let publisher = publish_by_the_map(&env, events.clone(), 8, Duration::from_millis(80)).await;

    let first = reshard_killed_at(&env, 6, "phase Draining").await;
    assert_eq!(
        record_of(&env).await.reshard.map(|r| r.phase),
        Some(Phase::Draining),
        "{first}"
    );
    let second = reshard_killed_at(&env, 6, "phase Closing").await;
    assert!(second.contains("took over the lock"), "{second}");
    assert!(second.contains("resuming"), "{second}");
    let last = reshard(&env, 6).await;
    assert!(last.contains("resharded 4 → 6 shards"), "{last}");
    assert!(last.contains("resumed"), "{last}");

    publisher.await.unwrap();
    called_in_order(&env, &downstream, &events).await;
    let record = record_of(&env).await;
    assert_eq!((record.shards, record.reshard), (6, None));
    stop(&mut members).await;
}

/// Step 0 refuses, in one line and before writing anything, a reshard the
/// fleet could not follow: with no worker running, and with a fixed worker
/// (`--assign 0-2`: a part, which keeps its shards) whose shards do not
/// cover the target's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_the_fleet_cannot_follow_is_refused() {
    let env = TestEnv::new("reshard-refused").await.with_shards(4);
    env.apply_topology().await;
    let refused = |out: std::process::Output| {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        stderr
    };
    let alone = refused(env.cli(&["topology", "reshard", "--to", "6"]).await);
    assert!(alone.contains("no worker reports its status"), "{alone}");

    let mut fixed = shardline_testkit::ChildWorker::start(
        &env,
        "fixed",
        "http://127.0.0.1:1/unused",
        &["--assign", "0-2"],
    );
    env.wait_spread(&[("fixed", 3)], Duration::from_secs(30))
        .await;
    shardline_testkit::wait::wait_until(
        "the worker's status document",
        Duration::from_secs(10),
        || async {
            let out = env.cli(&["topology", "reshard", "--to", "6"]).await;
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            shardline_testkit::wait::check(!stderr.contains("no worker reports"), || stderr.clone())
        },
    )
    .await;
    let uncovered = refused(env.cli(&["topology", "reshard", "--to", "6"]).await);
    assert!(
        uncovered.contains("no worker would consume shards 3, 4, 5 of the target"),
        "{uncovered}"
    );
    assert_eq!(record_of(&env).await.reshard, None, "nothing recorded");
    fixed.sigterm();
    fixed.wait_exit(Duration::from_secs(30)).await;
}

/// `--abort` gives a reshard up in its middle (killed after its drain
/// markers): the same steps run on with each move handed back to its old
/// shard, and the fleet is on N again (the grown reshard's new queues
/// retired, empty), a publish throughout called in order; a reshard past
/// its second barrier refuses `--abort` in one line saying how to go back.
/// A reshard given flags the topology was not applied with is refused by
/// the broker before anything is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_is_aborted_in_its_middle_and_refused_after_its_second_barrier() {
    let env = TestEnv::new("reshard-abort").await.with_shards(4);
    env.apply_topology().await;
    let downstream = shardline_testkit::Downstream::with_latency(Duration::from_millis(1)).await;
    let mut members = two_members(&env, &downstream);
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;
    let orders = |prefix| shardline_testkit::order_ids(prefix, 60);
    let by_map = shardline_testkit::interleaved(&orders("abort-map"), 20, env.shards);
    let by_recipe = shardline_testkit::interleaved(&orders("abort-recipe"), 20, env.shards);
    let pace = Duration::from_millis(60);
    let map_publisher = publish_by_the_map(&env, by_map.clone(), 8, pace).await;
    let recipe_publisher = publish_like_the_recipe(&env, by_recipe.clone(), 8, pace).await;

    let wrong = env
        .cli(&["topology", "reshard", "--to", "6", "--queue-type", "quorum"])
        .await;
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert_eq!(wrong.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("already exists with"), "{stderr}");
    assert_eq!(record_of(&env).await.reshard, None, "nothing recorded");

    reshard_killed_at(&env, 6, "phase Opening").await;
    let out = env.cli(&["topology", "reshard", "--abort"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("the reshard to 6 shards was abandoned"),
        "{stdout}"
    );
    let record = record_of(&env).await;
    assert_eq!(
        (
            record.shards,
            record.generation,
            record.reshard,
            record.retired
        ),
        (4, 3, None, vec![4, 5])
    );
    let depths = env.queue_depths().await;
    assert!(
        depths.keys().all(|q| !q.contains(".move.")),
        "holding queues left: {depths:?}"
    );

    reshard_killed_at(&env, 6, "phase Closing").await;
    let out = env.cli(&["topology", "reshard", "--abort"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("can no longer go back") && stderr.contains("--to 6"),
        "{stderr}"
    );
    let last = reshard(&env, 6).await;
    assert!(last.contains("resharded 4 → 6 shards"), "{last}");

    map_publisher.await.unwrap();
    recipe_publisher.await.unwrap();
    let events: Vec<_> = by_map.iter().chain(&by_recipe).cloned().collect();
    called_in_order(&env, &downstream, &events).await;
    stop(&mut members).await;
}

/// An order quarantined before a reshard moves it (its seq 2 dead-lettered,
/// 3..5 quarantined behind it), with a worker of every shard in quarantine
/// mode: after 4 → 8 and the fix, `dlq replay` delivers 2..5 in order on the
/// order's new shard and lifts the quarantine; a later event, published by
/// the old routing (md5 mod 4), is forwarded and flows on the new shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_order_moved_by_a_reshard_is_replayed_on_its_new_shard() {
    use shardline_contract::reshard::{Buckets, Map};
    use shardline_testkit::dlq::{text, wait_depth, wait_indexed};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let env = TestEnv::new("reshard-quarantine").await.with_shards(4);
    env.apply_topology().await;
    let buckets = Buckets::new(env.shards).unwrap();
    let plan = Map::initial(&buckets).plan(8).unwrap();
    let x = (0..)
        .map(|i| format!("rq-{i}"))
        .find(|id| plan.move_of(buckets.bucket_of(id)).is_some())
        .unwrap();
    let new_shard = plan.target.shard_of(buckets.bucket_of(&x)).unwrap().get();
    let xs: Vec<_> = (1..=6)
        .map(|s| shardline_testkit::Event::new(&x, s, env.shards))
        .collect();
    let fixed = Arc::new(AtomicBool::new(false));
    let downstream =
        shardline_testkit::Downstream::failing_until_fixed(xs[1].key(), Arc::clone(&fixed)).await;
    let mut worker = env
        .start_worker("w1", &downstream, |c| {
            c.on_dead_letter = shardline_worker::OnDeadLetter::Quarantine;
        })
        .await;
    let publisher = shardline_testkit::Publisher::connect(&env).await;
    publisher.publish(&xs[..5]).await;
    let conn = env.connect().await;
    wait_depth(&env, &conn, 4, shardline_testkit::PROCESSING).await;
    wait_indexed(&env, 4, shardline_testkit::PROCESSING).await;

    let stdout = reshard(&env, 8).await;
    assert!(stdout.contains("resharded 4 → 8 shards"), "{stdout}");
    fixed.store(true, Ordering::SeqCst);
    let replay = env.cli(&["dlq", "replay", "--order-id", &x]).await;
    assert!(replay.status.success(), "{}", text(&replay));
    assert!(
        String::from_utf8_lossy(&replay.stdout).contains("quarantine lifted"),
        "{}",
        text(&replay)
    );
    publisher.publish(&xs[5..]).await;
    let calls = downstream
        .wait_for(
            "X 1..6 answered 2xx",
            shardline_testkit::PROCESSING,
            |calls| shardline_testkit::all_ok(calls, &xs),
        )
        .await;
    let ok: Vec<(u64, Option<String>)> = calls
        .iter()
        .filter(|c| c.ok() && c.order_id.as_deref() == Some(x.as_str()))
        .map(|c| (c.seq.unwrap_or(0), c.header("x-shard").map(str::to_owned)))
        .collect();
    assert_eq!(
        ok.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6],
        "{ok:?}"
    );
    assert!(
        ok[1..]
            .iter()
            .all(|(_, shard)| shard.as_deref() == Some(&*new_shard.to_string())),
        "replayed and later events on shard {new_shard}: {ok:?}"
    );
    assert_eq!(env.dlq_backlog().await, 0, "the DLQ is empty");
    worker.assert_running().await;
}

/// A reshard of workers with `--concurrency 4` (markers wait until nothing
/// of their shard runs): 4 → 6 under the project's and a recipe publisher,
/// every event called, each order in seq order, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_fleet_reshards_and_keeps_each_order_in_order() {
    let env = TestEnv::new("reshard-concurrent").await.with_shards(4);
    env.apply_topology().await;
    let downstream = shardline_testkit::Downstream::with_latency(Duration::from_millis(2)).await;
    let mut members = two_members_with(&env, &downstream, &["--concurrency", "4"]);
    env.wait_spread(&[("a", 2), ("b", 2)], Duration::from_secs(30))
        .await;
    let orders = |prefix| shardline_testkit::order_ids(prefix, 80);
    let by_map = shardline_testkit::interleaved(&orders("conc-map"), 16, env.shards);
    let by_recipe = shardline_testkit::interleaved(&orders("conc-recipe"), 16, env.shards);
    let pace = Duration::from_millis(80);
    let map_publisher = publish_by_the_map(&env, by_map.clone(), 10, pace).await;
    let recipe_publisher = publish_like_the_recipe(&env, by_recipe.clone(), 10, pace).await;
    processing(&downstream, 150).await;
    let stdout = reshard(&env, 6).await;
    assert!(stdout.contains("resharded 4 → 6 shards"), "{stdout}");
    map_publisher.await.unwrap();
    recipe_publisher.await.unwrap();
    let events: Vec<_> = by_map.iter().chain(&by_recipe).cloned().collect();
    called_in_order(&env, &downstream, &events).await;
    stop(&mut members).await;
}
