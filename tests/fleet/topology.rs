//! `shardline topology apply`: idempotent, accepts the pika recipe's redeclare,
//! refuses a conflicting queue with a one-line error.

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};

use std::time::Duration;

use shardline_testkit::{ChildWorker, QueueType, SHARDS, TestEnv};

/// Queues (name, durable, arguments), exchanges and bindings of the vhost, sorted.
async fn snapshot(env: &TestEnv) -> Vec<String> {
    // RabbitMQ 4 lists a queue declared without arguments with the default
    // type as one; 3.10 lists none.
    let implicit_type = env.broker().run(&["-q", "version"]).await.starts_with('4');
    let mut lines = Vec::new();
    for (what, columns) in [
        ("list_queues", &["name", "durable", "arguments"][..]),
        (
            "list_exchanges",
            &["name", "type", "durable", "arguments"][..],
        ),
        (
            "list_bindings",
            &[
                "source_name",
                "destination_name",
                "routing_key",
                "arguments",
            ][..],
        ),
    ] {
        let mut args = vec!["-q", what, "-p", &env.vhost, "--no-table-headers"];
        args.extend_from_slice(columns);
        for line in env.broker().run(&args).await.lines() {
            let line = if implicit_type {
                line.replace(r#"[{"x-queue-type","classic"}]"#, "[]")
            } else {
                line.to_owned()
            };
            lines.push(format!("{what}: {line}"));
        }
    }
    lines.sort();
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_twice_changes_nothing_and_accepts_pika_redeclares() {
    let env = TestEnv::new("topo-idem").await;
    env.apply_topology().await;
    let first = snapshot(&env).await;

    for shard in 0..SHARDS {
        let queue = env.shard_queue(shard);
        assert!(
            first.contains(&format!("list_queues: {queue}\ttrue\t[]")),
            "shard queue {queue} missing, not durable or with arguments:\n{}",
            first.join("\n")
        );
        assert!(
            first.contains(&format!(
                "list_bindings: order.sharding\t{queue}\tshard.{shard}\t[]"
            )),
            "binding of {queue} missing:\n{}",
            first.join("\n")
        );
    }
    assert!(
        !first
            .iter()
            .any(|l| l.contains(&format!("{}{SHARDS}\t", env.names.queue_prefix))),
        "more shard queues than --shards {SHARDS}"
    );
    for expected in [
        "list_queues: order.events.dlq\ttrue\t[]",
        "list_exchanges: order.sharding\tdirect\ttrue\t[]",
        "list_exchanges: order.sharding.dlx\ttopic\ttrue\t[]",
        "list_bindings: order.sharding.dlx\torder.events.dlq\t#\t[]",
    ] {
        assert!(
            first.iter().any(|l| l == expected),
            "missing `{expected}`:\n{}",
            first.join("\n")
        );
    }

    env.apply_topology().await;
    assert_eq!(
        first,
        snapshot(&env).await,
        "the second apply changed the topology"
    );

    // The pika recipe: queue_declare(queue, durable=True), no arguments. A 406 here
    // would close the channel and fail every later declare too.
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    for shard in 0..SHARDS {
        let queue = env.shard_queue(shard);
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("pika-style redeclare of {queue} refused: {e}"));
    }
    assert_eq!(first, snapshot(&env).await);
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Pre-declares shard queue 0 with `argument`, then `topology apply` must exit 1
/// with one error line naming the queue and the argument, and leave it alone.
async fn apply_against_conflicting_queue(argument: &str, value: AMQPValue) {
    let env = TestEnv::new("topo-conflict").await;
    let queue = env.shard_queue(0);
    let conn = env.connect().await;
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(argument.into(), value);
    channel
        .queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();

    let out = env.cli(&["topology", "apply"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = format!(
        "status {}\nstdout:\n{}\nstderr:\n{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(out.status.code(), Some(1), "{report}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.trim_start().to_ascii_lowercase().starts_with("error"))
        .collect();
    assert_eq!(errors.len(), 1, "expected one error line: {report}");
    assert!(
        errors[0].contains(&queue),
        "error line must name {queue}: {report}"
    );
    assert!(
        errors[0].contains(argument),
        "error line must name {argument}: {report}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{report}"
    );

    let queues = env
        .broker()
        .run(&[
            "-q",
            "list_queues",
            "-p",
            &env.vhost,
            "--no-table-headers",
            "name",
            "arguments",
        ])
        .await;
    assert!(
        queues
            .lines()
            .any(|l| l.starts_with(&format!("{queue}\t")) && l.contains(argument)),
        "the conflicting queue must be left as it was:\n{queues}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_refuses_a_queue_with_other_arguments_in_one_line() {
    apply_against_conflicting_queue("x-max-length", AMQPValue::LongInt(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_refuses_a_quorum_queue_in_one_line() {
    apply_against_conflicting_queue("x-queue-type", long_string("quorum")).await;
}

/// The queue types in the environment's vhost, by name.
async fn queue_types(env: &TestEnv) -> std::collections::BTreeMap<String, String> {
    let listed = env.list_queues(&["type"]).await;
    listed
        .into_iter()
        .filter_map(|(name, mut fields)| Some((name, fields.pop()?)))
        .collect()
}

/// With quorum shard queues the DLQ is a quorum queue too (it survives a node
/// loss); a classic DLQ from an earlier apply is kept, with a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_topology_has_a_quorum_dlq_and_keeps_a_classic_one_it_finds() {
    let env = TestEnv::with_queue_type("topo-qdlq", QueueType::Quorum).await;
    env.apply_topology().await;
    let dlq = env.names.dead_letter_queue.clone();
    let types = queue_types(&env).await;
    assert_eq!(
        types.get(&dlq).map(String::as_str),
        Some("quorum"),
        "{types:?}"
    );
    assert_eq!(
        types.get(&env.shard_queue(0)).map(String::as_str),
        Some("quorum")
    );

    let older = TestEnv::with_queue_type("topo-qdlq-old", QueueType::Quorum).await;
    let conn = older.connect().await;
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            older.names.dead_letter_queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let out = older.cli(&["topology", "apply"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("kept from an earlier apply"), "{stdout}");
    assert!(
        stderr.contains("a classic queue from an earlier apply"),
        "{stderr}"
    );
    let types = queue_types(&older).await;
    assert_eq!(
        types
            .get(&older.names.dead_letter_queue)
            .map(String::as_str),
        Some("classic")
    );
}

/// The recorded topology: `topology apply` records the count and refuses
/// another in one line; `topology status` with another count says so and
/// exits 2; a publisher whose `--shards` disagrees follows the record with
/// one warning. Where the record cannot be read (Redis down), the broker's
/// shard-count check refuses a disagreeing count in one line, unless told it
/// is a migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorded_shard_count_is_followed_and_only_apply_refuses_another() {
    let env = TestEnv::new("topo-shards").await;
    env.apply_topology().await;
    let n = u32::from(SHARDS);
    let record = recorded(&env).await.expect("apply records the topology");
    assert_eq!((record.generation, u32::from(record.shards)), (1, n));
    assert_eq!(record.recorded_by, "topology apply");

    let line = refusal(&env.cli_with_shards(n * 2, &["topology", "apply"]).await);
    assert!(
        line.contains(&format!(
            "--shards {} disagrees with the topology, which has {n} shards (recorded in Redis, \
             generation 1): `topology apply` never changes the shard count",
            n * 2
        )),
        "{line}"
    );
    assert!(
        !env.queue_depths()
            .await
            .contains_key(&env.names.shard_queue_named(n)),
        "apply declared a queue beyond the record"
    );
    let status = env.cli_with_shards(n / 2, &["topology", "status"]).await;
    let stderr = String::from_utf8_lossy(&status.stderr);
    assert_eq!(status.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("run it with --shards {n}")),
        "{stderr}"
    );

    let publish = [
        "publish",
        "--order-id",
        "S1",
        "--event",
        "order.created",
        "--seq",
        "1",
    ];
    let out = env.cli_with_shards(n / 2, &publish).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("disagrees with the topology"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("following the record"), "{stderr}");
    let depths = env.queue_depths().await;
    let queue = env.shard_queue(env.shard_of("S1"));
    assert_eq!(depths.get(&queue).map(|d| d.0), Some(1), "{depths:?}");

    // Redis unreachable: the broker's check decides.
    let unreachable = |shards: u32, extra: &[&str]| {
        let mut args = env.global_args_with_shards(shards);
        if let Some(at) = args.iter().position(|a| a == "--redis-url") {
            args[at + 1] = "redis://127.0.0.1:1".into();
        }
        let mut cmd = env.shardline_command();
        cmd.args(publish).args(args).args(extra);
        async move { cmd.output().await.unwrap() }
    };
    let line = refusal(&unreachable(n * 2, &[]).await);
    assert!(
        line.contains(&format!("--shards {} does not match the topology", n * 2))
            && line.contains(&format!(
                "queue `{}` does not exist",
                env.names.shard_queue_named(n * 2 - 1)
            )),
        "{line}"
    );
    let out = unreachable(n / 2, &["--allow-shard-mismatch"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.shard_backlog().await, 2);
}

/// A topology made before records (no `{prefix}topology`) is adopted at the
/// count found on the broker, never a flag's: a worker started with another
/// `--shards` adopts the broker's count, follows it with one warning and
/// consumes every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_made_before_records_is_adopted_at_the_brokers_count() {
    let env = TestEnv::new("topo-adopt").await;
    env.apply_topology().await;
    let mut redis = env.redis().await;
    let _: () = redis::cmd("DEL")
        .arg(env.keys().topology())
        .query_async(&mut redis)
        .await
        .unwrap();
    let n = u32::from(SHARDS);
    let mut cmd = env.shardline_command();
    cmd.args(["worker", "--handler", "log", "--worker-name", "w-adopt"])
        .args(env.global_args_with_shards(n * 3));
    let mut worker = ChildWorker::spawn(&env, "w-adopt", cmd);
    worker.wait_consuming(&env).await;
    let log = worker.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("disagrees with the topology"))
        .collect();
    assert_eq!(warnings.len(), 1, "{log}");
    let line = warnings[0];
    assert!(
        line.contains(&format!(
            "--shards {} disagrees with the topology, which has {n} shards (recorded in Redis, \
             generation 1): following the record",
            n * 3
        )),
        "{line}"
    );
    let record = recorded(&env)
        .await
        .expect("the worker adopted the topology");
    assert_eq!(u32::from(record.shards), n);
    assert_eq!(record.recorded_by, "worker");
    worker.sigterm();
    assert!(worker.wait_exit(Duration::from_secs(30)).await.success());
}

/// Publishers route by the recorded map: a `Publisher` given the fleet's
/// Redis sends an order to its bucket's shard in the map (here a map at
/// generation 3 that sends every bucket to the next shard), one without it
/// by `md5 mod N` (a legacy publisher); `topology status` prints the record
/// and the routing key publishers outside shardline keep using.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_route_by_the_recorded_map_and_without_redis_by_md5_mod_n() {
    use shardline_contract::reshard::{Buckets, Generation, Map};
    let env = TestEnv::new("topo-map").await;
    env.apply_topology().await;
    let mut record = recorded(&env).await.expect("apply records the topology");
    let n = SHARDS;
    let buckets = Buckets::new(env.shards).unwrap();
    let rotated: Vec<u16> = buckets.all().map(|b| (b.get() + 1) % n).collect();
    Map::recorded(Generation(3), env.shards, &buckets, &rotated).unwrap();
    record.generation = 3;
    record.map = Some(rotated);
    let _: () = redis::cmd("SET")
        .arg(env.keys().topology())
        .arg(record.encode())
        .query_async(&mut env.redis().await)
        .await
        .unwrap();

    // Orders md5 mod N sends to shard 0; the map sends them to shard 1.
    let orders: Vec<String> = (0..)
        .map(|i| format!("map-{i}"))
        .filter(|o| env.shard_of(o) == 0)
        .take(12)
        .collect();
    let config = |redis: bool| shardline_publisher::Config {
        amqp: env.amqp_target(),
        names: env.names.clone(),
        shards: env.shards,
        redis: redis.then(|| env.ops_fleet().redis),
        redis_prefix: env.redis_prefix.clone(),
        ..shardline_publisher::Config::default()
    };
    let mut by_map = shardline_publisher::Publisher::connect(config(true))
        .await
        .unwrap();
    let mut legacy = shardline_publisher::Publisher::connect(config(false))
        .await
        .unwrap();
    let event = |order: &str| shardline_contract::NewEvent {
        order_id: shardline_contract::OrderId::new(order).unwrap(),
        event: "order.created".into(),
        seq: Some(1),
        event_id: None,
        data: serde_json::json!({}),
    };
    for order in &orders {
        by_map.publish_event(&event(order)).await.unwrap();
    }
    for order in &orders[..5] {
        legacy.publish_event(&event(order)).await.unwrap();
    }
    by_map.close().await.unwrap();
    legacy.close().await.unwrap();
    let depths = env.queue_depths().await;
    let depth = |shard: u16| depths.get(&env.shard_queue(shard)).map(|d| d.0);
    assert_eq!((depth(0), depth(1)), (Some(5), Some(12)), "{depths:?}");

    let status = env.cli(&["topology", "status"]).await;
    let stdout = String::from_utf8_lossy(&status.stdout);
    assert!(
        stdout.contains(&format!(
            "topology: {n} shards (recorded in Redis, generation 3); publishers outside \
             shardline route by shard.{{int(md5(order_id)) mod {n}}}"
        )),
        "{stdout}"
    );
}

/// The library's `Worker` reads the record too: a `Config::shards` that
/// disagrees with it is refused at start in one line that names the field
/// and the recorded count (the command line follows the record instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_worker_refuses_a_shard_count_the_record_disagrees_with() {
    let env = TestEnv::new("topo-lib-worker").await;
    env.apply_topology().await;
    let n = SHARDS;
    let mut config = env.worker_config("w-lib");
    config.shards = shardline_contract::ShardCount::new(u32::from(n) * 2).unwrap();
    config.assign = config.shards.ids().collect();
    let worker =
        shardline_worker::Worker::new(config, std::sync::Arc::new(shardline_worker::Noop)).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::time::timeout(Duration::from_secs(30), worker.run(stop)).await;
    let error = run.expect("refused at start").unwrap_err().to_string();
    assert_eq!(
        error,
        format!(
            "shards = {} disagrees with the topology, which has {n} shards (recorded in Redis, \
             generation 1): set shards to {n}",
            n * 2
        )
    );
}

/// The record in Redis, if any.
async fn recorded(env: &TestEnv) -> Option<shardline_contract::topology::TopologyRecord> {
    shardline_connect::record::read(&mut env.redis().await, &env.keys())
        .await
        .unwrap()
}

/// The one `error` line of a command that refused, after checking it exited 1.
fn refusal(out: &std::process::Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    errors[0].to_owned()
}

/// The broker probe: `topology status` reports the version read from the
/// server properties. Classic single-active-consumer is refused in one line by
/// `topology apply` and by the worker on a broker with rabbitmq-server#5460
/// (the machine's 3.10.8; fixed in 3.10.13), unless the risk is accepted; on
/// one without the bug (4.0.5) it is applied and consumed without the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_single_active_consumer_is_refused_where_the_broker_has_the_bug() {
    let env = TestEnv::new("topo-sac-probe").await;
    let version = env.broker_version().await;
    let banner = format!("RabbitMQ {version}");
    let apply = ["topology", "apply", "--single-active-consumer"];
    let accepted = if version.has_classic_sac_bug() {
        let line = refusal(&env.cli(&apply).await);
        assert!(
            line.contains(&format!("single-active-consumer: {banner}"))
                && line.contains("rabbitmq-server#5460")
                && line.contains("--accept-classic-sac-risk"),
            "{line}"
        );
        assert!(
            env.queue_depths().await.is_empty(),
            "a refused apply declares nothing"
        );
        true
    } else {
        false
    };
    let mut args = apply.to_vec();
    if accepted {
        args.push("--accept-classic-sac-risk");
    }
    let out = env.cli(&args).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("broker: {banner}")));

    if accepted {
        let mut cmd = env.shardline_command();
        cmd.args(["worker", "--handler", "noop", "--single-active-consumer"])
            .args(env.global_args());
        let line = refusal(&cmd.output().await.unwrap());
        assert!(
            line.contains(&banner) && line.contains("--accept-classic-sac-risk"),
            "{line}"
        );
    }
    // The worker consumes every shard (an in-process one: the binary would
    // run until stopped).
    let downstream = shardline_testkit::Downstream::start().await;
    let _worker = env
        .start_worker("sac", &downstream, |c| {
            c.exclusive = false;
            c.accept_classic_sac_risk = accepted;
        })
        .await;

    let out = env.cli(&["topology", "status", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let version = json["broker"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["topic"] == "version")
        .unwrap()
        .clone();
    assert!(
        version["text"].as_str().unwrap().starts_with(&banner),
        "{version}"
    );
    assert_eq!(version["verdict"], "ok");
    assert!(
        version["source"]
            .as_str()
            .unwrap()
            .starts_with("server properties of 127.0.0.1:"),
        "{version}"
    );
}

/// A worker whose flags do not match the queues' arguments (the only check
/// AMQP allows: a non-passive redeclare on a throwaway channel, 406 on a
/// mismatch) refuses to start, naming the queue, the argument and both values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_flags_are_not_the_queues_arguments_is_refused() {
    let env = TestEnv::with_queue_type("topo-args-probe", QueueType::Quorum).await;
    let out = env
        .cli(&["topology", "apply", "--delivery-limit", "12"])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let worker = |extra: &'static [&'static str]| {
        let mut cmd = env.shardline_command();
        cmd.args(["worker", "--handler", "noop"])
            .args(extra)
            .args(env.global_args());
        async move { cmd.output().await.unwrap() }
    };
    let line = refusal(&worker(&["--delivery-limit", "20"]).await);
    assert!(
        line.contains(&format!("`{}`", env.shard_queue(0)))
            && line.contains("x-delivery-limit = '12'")
            && line.contains("expects '20'")
            && line.contains("--delivery-limit"),
        "{line}"
    );
    // RabbitMQ names the first argument that differs.
    let line = refusal(&worker(&["--queue-type", "classic"]).await);
    assert!(line.contains("but this command expects none"), "{line}");
    assert_eq!(
        env.queue_depths().await.len(),
        usize::from(SHARDS) + 1,
        "the check created nothing"
    );
}
