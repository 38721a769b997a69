//! What the cluster tests under load share (the load itself is the test
//! kit's [`Load`]): a cluster with the quorum
//! topology spread over its nodes; workers and a publisher pinned to a node
//! (its address first, the others after, tried in the given order, so they
//! fail over to the others and nowhere else first); a steady stream of
//! confirmed batches ([`Load`]); and the guarantees every fault must keep
//! ([`assert_guarantees`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use shardline_connect::{AddressOrder, AmqpTarget};
use shardline_testkit::cluster::{CLUSTER_START, NODES};
pub(crate) use shardline_testkit::load::{LOAD_CONNECTION, Load};
use shardline_testkit::wait::check;
use shardline_testkit::{
    Call, Cluster, Downstream, Event, PROCESSING, QueueType, TestEnv, Worker,
    assert_in_order_and_complete, assert_in_order_in_effect, describe, repeats_per_shard,
    wait_all_answered, wait_until,
};

/// Orders of the load per shard (48 orders on 8 shards).
pub(crate) const ORDERS_PER_SHARD: usize = 6;
/// Generous bound on the time between the last confirm before a fault and
/// the first after it: a node's loss costs a reconnect and a queue leader
/// election, seconds.
pub(crate) const RESUME_BOUND: Duration = Duration::from_secs(30);

/// A cluster, an environment on all three nodes and `topology apply
/// --queue-type quorum` through them (leaders spread, the DLQ a quorum queue).
pub(crate) async fn quorum_cluster(name: &str) -> (Cluster, TestEnv) {
    let cluster = Cluster::start().await;
    let env = TestEnv::on_all_nodes(name, QueueType::Quorum, &cluster).await;
    env.apply_topology().await;
    (cluster, env)
}

/// The shard queues each node leads (by node index), as node `via` sees them.
pub(crate) async fn leaders(cluster: &Cluster, env: &TestEnv, via: usize) -> [Vec<String>; NODES] {
    let listed = env.list_queues_via(cluster.ctl(via), &["leader"]).await;
    let mut led: [Vec<String>; NODES] = Default::default();
    for (queue, fields) in &listed {
        let node = fields
            .first()
            .and_then(|leader| cluster.names.iter().position(|n| n == leader));
        if let (true, Some(node)) = (queue.starts_with(&env.names.queue_prefix), node) {
            led[node].push(queue.clone());
        }
    }
    led
}

/// The node leading the most shard queues (the first of equals).
pub(crate) fn busiest(led: &[Vec<String>; NODES]) -> usize {
    (0..NODES)
        .max_by_key(|&i| (led[i].len(), NODES - i))
        .unwrap_or(0)
}

/// The three addresses of `env`'s vhost with node `first`'s first, then the
/// others in node order, each with `query` (`""` or `"?heartbeat=60"`), tried
/// in the order given.
pub(crate) fn pinned(cluster: &Cluster, env: &TestEnv, first: usize, query: &str) -> AmqpTarget {
    let urls: Vec<String> = (0..NODES)
        .map(|k| (first + k) % NODES)
        .map(|i| format!("{}{query}", cluster.amqp_url(i, &env.vhost)))
        .collect();
    let target: AmqpTarget = urls.join(",").parse().unwrap();
    target.with_order(AddressOrder::Given)
}

/// The client connections of `env`'s vhost, as node `via` lists them: the
/// node each is on (from its pid, `<node.x.y.z>`) and its name.
pub(crate) async fn connections(
    cluster: &Cluster,
    env: &TestEnv,
    via: usize,
) -> Vec<(usize, String)> {
    cluster
        .ctl(via)
        .connections(&env.vhost)
        .await
        .into_iter()
        .filter_map(|(pid, name)| {
            let node = cluster
                .names
                .iter()
                .position(|n| pid.starts_with(&format!("<{n}.")))?;
            Some((node, name))
        })
        .collect()
}

/// Waits until each of `prefixes` names at least one connection of `env`'s
/// vhost and every such connection is on node `node`, its name ending in that
/// node's address; fails loudly otherwise.
pub(crate) async fn wait_connected_to(
    cluster: &Cluster,
    env: &TestEnv,
    node: usize,
    prefixes: &[&str],
) {
    let via = (node + 1) % NODES;
    let suffix = format!(" @ 127.0.0.1:{}", cluster.amqp_ports[node]);
    wait_until(
        &format!("{prefixes:?} connected to {}", cluster.names[node]),
        shardline_testkit::STARTUP,
        || async {
            let all = connections(cluster, env, via).await;
            let placed = prefixes.iter().all(|prefix| {
                let ours: Vec<&(usize, String)> =
                    all.iter().filter(|(_, n)| n.starts_with(prefix)).collect();
                !ours.is_empty()
                    && ours
                        .iter()
                        .all(|(on, name)| *on == node && name.ends_with(&suffix))
            });
            check(placed, || format!("connections (node, name): {all:?}"))
        },
    )
    .await;
}

/// Keys answered 2xx so far (cheap enough to check on every call).
pub(crate) fn answered(calls: &[Call]) -> usize {
    calls.iter().filter(|c| c.ok() && c.completed).count()
}

/// Waits until the downstream answered more than `than` calls 2xx: the
/// workers process again.
pub(crate) async fn wait_processing(downstream: &Downstream, what: &str, than: usize) {
    downstream
        .wait_for(what, PROCESSING, |calls| answered(calls) > than)
        .await;
}

/// What every fault must leave: once every event was answered and the shard
/// queues drained, each order's events reached the downstream in seq order,
/// each of them; a shard repeated at most one call per time its consumer was
/// lost (`handovers`: the event in its handler then); nothing was
/// dead-lettered and no gap given up on; and every order's state in Redis
/// says its last seq was processed, with nothing skipped and no claim left.
/// Returns the calls.
pub(crate) async fn assert_guarantees(
    env: &TestEnv,
    downstream: &Downstream,
    events: &[Event],
    workers: &[&Worker],
    handovers: u64,
) -> Vec<Call> {
    assert_guarantees_grouped(env, downstream, events, workers, handovers, 1).await
}

/// [`assert_guarantees`] for workers that commit in groups of up to `group`
/// events: a handover may repeat a group's calls, rewinding an order to the
/// first of them (`1, 2, 1, 2, 3`), never skipping or reordering a seq.
pub(crate) async fn assert_guarantees_grouped(
    env: &TestEnv,
    downstream: &Downstream,
    events: &[Event],
    workers: &[&Worker],
    handovers: u64,
    group: u64,
) -> Vec<Call> {
    let calls = wait_all_answered(env, downstream, events).await;
    if group > 1 {
        assert_in_order_in_effect(&calls, events);
    } else {
        assert_in_order_and_complete(&calls, events);
    }
    let repeats = repeats_per_shard(&calls, env);
    let bound = handovers * group;
    assert!(
        repeats.values().all(|n| *n as u64 <= bound),
        "more than {group} call(s) per handover ({handovers}) repeated on a shard: \
         {repeats:?}\n{}",
        describe(&calls[calls.len().saturating_sub(40)..])
    );
    assert_eq!(env.dlq_backlog().await, 0, "events were dead-lettered");
    for worker in workers {
        assert_eq!(worker.counts().gaps, 0, "{}", worker.describe());
    }
    assert_order_state(env, events).await;
    calls
}

/// Every order's state (`{prefix}order:{order}`): the gate `l` at the order's
/// last published seq, no seq marked never-processed (`u`), no claim left
/// (`c`), and its epoch `f` not above the fleet's epoch counter (an order a
/// reshard moved is written by its new shard's consumers).
pub(crate) async fn assert_order_state(env: &TestEnv, events: &[Event]) {
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for e in events {
        let seq = last.entry(e.order_id.as_str()).or_default();
        *seq = (*seq).max(e.seq);
    }
    let mut conn = env.redis().await;
    for (order, seq) in last {
        let state: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(env.keys().order(order))
            .query_async(&mut conn)
            .await
            .unwrap();
        let fence: Option<u64> = redis::cmd("GET")
            .arg(env.keys().epochs())
            .query_async(&mut conn)
            .await
            .unwrap();
        let epoch: Option<u64> = state.get("f").and_then(|f| f.parse().ok());
        assert!(
            state.get("l") == Some(&seq.to_string())
                && !state.contains_key("u")
                && !state.contains_key("c")
                && epoch.is_some_and(|f| fence.is_some_and(|top| f <= top)),
            "order {order}: state {state:?} (fence {fence:?}), expected l = {seq}, no u, no c"
        );
    }
}

/// After node `paused` was frozen and thawed: waits until it runs in the
/// cluster again, as node `via` sees it, healing the partition the others
/// may have recorded. `pause_minority` cannot act on a frozen node: it never
/// sees the others go, so on waking it may find them back at once and stay
/// up, while they record a partition (RabbitMQ's partitions guide,
/// "Partitions Caused by Suspend and Resume"), or it may count itself in a
/// minority and wait, paused, for a majority it does not find again. The
/// guide's recovery in both cases: restart the side trusted less, the node
/// that was paused — done once the others report the partition, or once the
/// node has not rejoined within [`REJOIN_GRACE`]. Returns how long healing
/// took when it had to be healed.
pub(crate) async fn heal_after_pause(
    cluster: &Cluster,
    paused: usize,
    via: usize,
) -> Option<Duration> {
    let mut all = cluster.names.to_vec();
    all.sort();
    let partitions = || async {
        cluster
            .ctl(via)
            .run(&["-q", "eval", "rabbit_node_monitor:partitions()."])
            .await
    };
    let thawed = Instant::now();
    let heal = wait_until(
        "the paused node to rejoin, the others to report a partition, or the grace to pass",
        CLUSTER_START,
        || async {
            let running = cluster.running_nodes(via).await;
            if running == all {
                return Ok(false);
            }
            let partitions = partitions().await;
            if partitions.contains(&cluster.names[paused]) || thawed.elapsed() > REJOIN_GRACE {
                return Ok(true);
            }
            Err(format!("running {running:?}, partitions {partitions}"))
        },
    )
    .await;
    let healing = Instant::now();
    if heal {
        cluster.ctl(paused).run(&["stop_app"]).await;
        cluster.ctl(paused).run(&["start_app"]).await;
    }
    wait_until(
        "the paused node to run in the cluster again",
        CLUSTER_START,
        || async {
            let running = cluster.running_nodes(via).await;
            let partitions = partitions().await;
            check(running == all && partitions.trim() == "[]", || {
                format!("running {running:?}, partitions {partitions}")
            })
        },
    )
    .await;
    heal.then(|| healing.elapsed())
}

/// How long a thawed node gets to rejoin by itself before it is restarted.
pub(crate) const REJOIN_GRACE: Duration = Duration::from_secs(30);
