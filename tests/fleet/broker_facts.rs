//! What shardline's guarantees rest on in the broker, checked on the real one
//! (3.10.8 in the `tests` step, 4.0.5 in `fleet4`): where a returned or a
//! nacked message re-enters a quorum queue and what it spends, when the
//! broker dead-letters against `x-delivery-limit`, the arguments `topology
//! apply` declares, prefetch (per consumer and global) and the largest
//! message. The table is in docs/operating/rabbitmq-versions.md.

use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use shardline_contract::headers;
use shardline_contract::rabbitmq::Version;
use shardline_testkit::{QueueType, TestEnv, wait_until};

/// Bound on every wait for the broker.
const WAIT: Duration = Duration::from_secs(30);

/// A delivery as the facts need it: its body and its `x-delivery-count`
/// (`None` when the broker sent none, as on a first delivery).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    body: String,
    count: Option<i64>,
}

impl Seen {
    fn of(delivery: &Delivery) -> Self {
        Self {
            body: String::from_utf8_lossy(&delivery.data).into_owned(),
            count: headers::header_i64(&delivery.properties, headers::DELIVERY_COUNT),
        }
    }
}

fn bodies(seen: &[Seen]) -> Vec<&str> {
    seen.iter().map(|s| s.body.as_str()).collect()
}

fn counts(seen: &[Seen]) -> Vec<i64> {
    seen.iter().map(|s| s.count.unwrap_or(0)).collect()
}

/// `m1` … `mN`.
fn messages(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("m{i}")).collect()
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// The `x-delivery-limit` that means "none" on `version`: from 4.0 an absent
/// limit is 20, so none must be asked for with -1.
fn no_limit(version: Version) -> Option<i64> {
    version.quorum_limit_by_default().then_some(-1)
}

/// Declares the durable quorum queue `name` with `x-delivery-limit` = `limit`
/// (no argument at all for `None`), dead-lettering through the default
/// exchange to the classic queue `dead` when given (declared too).
async fn declare_quorum(conn: &Connection, name: &str, limit: Option<i64>, dead: Option<&str>) {
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    if let Some(limit) = limit {
        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    }
    if let Some(dead) = dead {
        ch.queue_declare(
            dead.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        args.insert("x-dead-letter-exchange".into(), text(""));
        args.insert("x-dead-letter-routing-key".into(), text(dead));
    }
    ch.queue_declare(name.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    let _ = ch.close(200, "declared".into()).await;
}

/// Publishes `bodies` to `queue` in order, persistent, each confirmed.
async fn publish(conn: &Connection, queue: &str, bodies: &[String]) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for body in bodies {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            confirm.is_ack() && confirm.take_message().is_none(),
            "{body} to {queue}: not confirmed as routed"
        );
    }
    let _ = ch.close(200, "published".into()).await;
}

/// A new channel with per-consumer prefetch `prefetch` (global=false, as the
/// worker sets it) and a consumer of `queue` on it.
async fn consume(conn: &Connection, queue: &str, prefetch: u16) -> (Channel, Consumer) {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(prefetch, BasicQosOptions::default())
        .await
        .unwrap();
    let consumer = ch
        .basic_consume(
            queue.into(),
            "facts".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (ch, consumer)
}

/// The consumer's next delivery, within [`WAIT`].
async fn next(consumer: &mut Consumer) -> Delivery {
    tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("no delivery within 30 s")
        .expect("the consumer ended")
        .expect("the consumer failed")
}

/// Ready messages of `queue` (a passive declare).
async fn ready(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.unwrap();
    let declared = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = ch.close(200, "peeked".into()).await;
    declared.message_count()
}

/// Waits until `queue` has `n` ready messages.
async fn wait_ready(conn: &Connection, queue: &str, n: u32) {
    wait_until(&format!("{n} ready in {queue}"), WAIT, || async {
        match ready(conn, queue).await {
            got if got == n => Ok(()),
            got => Err(format!("{got} ready")),
        }
    })
    .await;
}

/// How the consumer holding the read-ahead leaves.
#[derive(Debug, Clone, Copy)]
enum Leaving {
    /// Its channel closes; a new consumer comes once the queue has every
    /// message ready again (a stop, then a start).
    ChannelClosed,
    /// Its connection closes while a single-active-consumer standby waits
    /// (a worker's crash, its standby taking over).
    ConnectionClosedUnderStandby,
}

/// Publishes m1..m10 to `queue`, takes m1..m5 on a channel with prefetch 5
/// without acking, leaves as `leaving` says, and returns what the next
/// consumer receives (every delivery acked).
async fn read_ahead_returned(
    env: &TestEnv,
    conn: &Connection,
    queue: &str,
    leaving: Leaving,
) -> Vec<Seen> {
    publish(conn, queue, &messages(10)).await;
    let active = env.connect().await;
    let (ch, mut consumer) = consume(&active, queue, 5).await;
    let mut first = Vec::new();
    for _ in 0..5 {
        first.push(Seen::of(&next(&mut consumer).await));
    }
    assert_eq!(bodies(&first), messages(5), "{queue}: {first:?}");
    assert_eq!(counts(&first), [0; 5], "{queue}: {first:?}");
    let (ch, mut consumer) = match leaving {
        Leaving::ChannelClosed => {
            ch.close(200, "returning the read-ahead".into())
                .await
                .unwrap();
            wait_ready(conn, queue, 10).await;
            consume(conn, queue, 10).await
        }
        Leaving::ConnectionClosedUnderStandby => {
            let standby = consume(conn, queue, 10).await;
            active.close(200, "gone".into()).await.unwrap();
            standby
        }
    };
    let mut again = Vec::new();
    for _ in 0..10 {
        let delivery = next(&mut consumer).await;
        again.push(Seen::of(&delivery));
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = ch.close(200, "done".into()).await;
    again
}

/// Per-order order across a worker crash, a deploy or a shard move: the
/// read-ahead a closed channel or connection leaves unacked goes back to the
/// head of the quorum queue, in order, so the next consumer (a standby taking
/// over included) sees the order's events in sequence. Each returned message
/// spends one delivery count (on 3.10.8 and 4.0.5 alike; from 4.3 such a
/// return spends none, read from its docs); the others carry no
/// `x-delivery-count`. Checked on shard queues as `topology apply` declares
/// them (limit 20, single-active-consumer) and on a quorum queue without a
/// limit, like the DLQ, whose tools return the letters they read by closing
/// their channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_read_ahead_reenters_a_quorum_queue_at_its_head_in_order() {
    let env = TestEnv::with_queue_type("facts-return", QueueType::Quorum).await;
    env.apply_topology().await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let unlimited = "facts.unlimited";
    declare_quorum(&conn, unlimited, no_limit(version), None).await;

    for (queue, leaving) in [
        (env.shard_queue(0), Leaving::ChannelClosed),
        (env.shard_queue(1), Leaving::ConnectionClosedUnderStandby),
        (unlimited.to_owned(), Leaving::ChannelClosed),
    ] {
        let again = read_ahead_returned(&env, &conn, &queue, leaving).await;
        assert_eq!(
            bodies(&again),
            messages(10),
            "RabbitMQ {version}, {queue}, {leaving:?}: {again:?}"
        );
        assert_eq!(
            counts(&again),
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
            "RabbitMQ {version}, {queue}, {leaving:?}: a return spends one: {again:?}"
        );
    }
}

/// Publishes m1..m5 to `queue`, takes m1 with prefetch 1, nacks it with
/// requeue, and returns every delivery until each message was acked once.
async fn nacked_once(conn: &Connection, queue: &str) -> Vec<Seen> {
    publish(conn, queue, &messages(5)).await;
    let (ch, mut consumer) = consume(conn, queue, 1).await;
    let first = next(&mut consumer).await;
    let mut seen = vec![Seen::of(&first)];
    first
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await
        .unwrap();
    for _ in 0..5 {
        let delivery = next(&mut consumer).await;
        seen.push(Seen::of(&delivery));
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    let _ = ch.close(200, "done".into()).await;
    seen
}

/// For users who requeue by nack (shardline never does: it retries in place
/// and dead-letters itself): a `basic.nack` with requeue spends one delivery
/// count, and the message goes back to the head of a quorum queue with a
/// delivery limit but to its back on one without (no argument before 4.0,
/// -1 from 4.0), so on such a queue a nack reorders. The same on 3.10.8 and
/// 4.0.5. (A closed channel's return goes to the head either way:
/// [`returned_read_ahead_reenters_a_quorum_queue_at_its_head_in_order`].)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_with_requeue_reenters_at_the_head_with_a_delivery_limit_and_at_the_back_without() {
    let env = TestEnv::with_queue_type("facts-nack", QueueType::Quorum).await;
    env.apply_topology().await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let (limited, unlimited) = ("facts.limit20", "facts.unlimited");
    declare_quorum(&conn, limited, Some(20), None).await;
    declare_quorum(&conn, unlimited, no_limit(version), None).await;

    // The shard queue adds single-active-consumer and a dead-letter exchange
    // to the limit: they change nothing here.
    for queue in [limited, env.shard_queue(0).as_str()] {
        let seen = nacked_once(&conn, queue).await;
        assert_eq!(
            bodies(&seen),
            ["m1", "m1", "m2", "m3", "m4", "m5"],
            "RabbitMQ {version}, {queue}: back at the head: {seen:?}"
        );
        assert_eq!(
            counts(&seen),
            [0, 1, 0, 0, 0, 0],
            "RabbitMQ {version}, {queue}"
        );
    }
    let seen = nacked_once(&conn, unlimited).await;
    assert_eq!(
        bodies(&seen),
        ["m1", "m2", "m3", "m4", "m5", "m1"],
        "RabbitMQ {version}, {unlimited}: back at the back: {seen:?}"
    );
    assert_eq!(counts(&seen), [0, 0, 0, 0, 0, 1], "RabbitMQ {version}");
}

/// How the one message of `queue` fared when delivered and returned by a
/// closed channel again and again: the `x-delivery-count` of each delivery
/// (0 when absent), and whether the broker dead-lettered it to `dead` in the
/// end (else it was delivered `rounds` times).
async fn returned_until_dead(
    conn: &Connection,
    queue: &str,
    dead: &str,
    rounds: usize,
) -> (Vec<i64>, bool) {
    let mut delivered = Vec::new();
    loop {
        let (ch, mut consumer) = consume(conn, queue, 1).await;
        delivered.push(Seen::of(&next(&mut consumer).await).count.unwrap_or(0));
        ch.close(200, "returning".into()).await.unwrap();
        let dead_lettered = wait_until("the message back or dead-lettered", WAIT, || async {
            match (ready(conn, queue).await, ready(conn, dead).await) {
                (1, 0) => Ok(false),
                (0, 1) => Ok(true),
                other => Err(format!("(ready, dead) = {other:?}")),
            }
        })
        .await;
        if dead_lettered || delivered.len() == rounds {
            return (delivered, dead_lettered);
        }
    }
}

/// The `reason` of the first `x-death` entry of the letter in `dead`.
async fn death_reason(conn: &Connection, dead: &str) -> Option<String> {
    let ch = conn.create_channel().await.unwrap();
    let letter = ch
        .basic_get(dead.into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a dead letter");
    let deaths = headers::header(&letter.properties, "x-death")?;
    let AMQPValue::FieldArray(deaths) = deaths else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    match first.inner().get("reason")? {
        AMQPValue::LongString(reason) => Some(reason.to_string()),
        _ => None,
    }
}

/// The worker's own dead-lettering (reason `crash-loop`, with its headers)
/// comes before the broker's: the worker dead-letters a delivery whose
/// `x-delivery-count` is the limit − 1, so that delivery must come. With
/// `x-delivery-limit` 3 the broker delivers the message with counts 0, 1, 2
/// and 3 (limit + 1 deliveries) and dead-letters it (`x-death` reason
/// `delivery_limit`) at the return after the one with count 3, when the count
/// would pass the limit: the worker's turn (count 2) comes, and one more
/// delivery (count 3) would too. The same on 3.10.8 and 4.0.5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_delivers_counts_up_to_the_limit_then_dead_letters() {
    let env = TestEnv::with_queue_type("facts-limit", QueueType::Quorum).await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let (queue, dead) = ("facts.limit3", "facts.limit3.dead");
    let limit = 3;
    declare_quorum(&conn, queue, Some(limit), Some(dead)).await;
    publish(&conn, queue, &messages(1)).await;

    let (delivered, dead_lettered) = returned_until_dead(&conn, queue, dead, 10).await;
    assert!(
        delivered.contains(&(limit - 1)),
        "RabbitMQ {version}: the worker's turn, count {}, never came: {delivered:?}",
        limit - 1
    );
    assert_eq!(delivered, [0, 1, 2, 3], "RabbitMQ {version}");
    assert!(dead_lettered, "RabbitMQ {version}: {delivered:?}");
    assert_eq!(
        death_reason(&conn, dead).await.as_deref(),
        Some("delivery_limit"),
        "RabbitMQ {version}"
    );
}

/// `topology apply` sets `x-delivery-limit` on the shard queues and, from
/// 4.0, -1 on the DLQ: this checks what an absent limit means on the broker
/// (none before 4.0, 20 from 4.0), by returning one message 22 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_delivery_limit_is_none_before_4_0_and_20_from_4_0() {
    let env = TestEnv::with_queue_type("facts-default", QueueType::Quorum).await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let (queue, dead) = ("facts.default", "facts.default.dead");
    declare_quorum(&conn, queue, None, Some(dead)).await;
    publish(&conn, queue, &messages(1)).await;

    let (delivered, dead_lettered) = returned_until_dead(&conn, queue, dead, 22).await;
    let expected: Vec<i64> = if version.quorum_limit_by_default() {
        (0..=20).collect()
    } else {
        (0..22).collect()
    };
    assert_eq!(delivered, expected, "RabbitMQ {version}");
    assert_eq!(
        dead_lettered,
        version.quorum_limit_by_default(),
        "RabbitMQ {version}: {delivered:?}"
    );
}

/// The arguments of `queue` as `rabbitmqctl list_queues` prints them, and its type.
fn type_and_arguments<'a>(
    listed: &'a std::collections::BTreeMap<String, Vec<String>>,
    queue: &str,
) -> (&'a str, &'a str) {
    let fields = listed
        .get(queue)
        .unwrap_or_else(|| panic!("no queue {queue}: {listed:?}"));
    (fields[0].as_str(), fields[1].as_str())
}

/// Dead-letter browsing requeues (`dlq show`/`replay`/`purge`/`reindex`), so
/// the DLQ must have no delivery limit: `topology apply` declares it quorum
/// with `x-delivery-limit` -1 from 4.0 (an absent limit is 20 there) and with
/// none before; the shard queues carry the limit the worker counts against (20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_apply_declares_the_dlq_without_a_delivery_limit_and_the_shard_queues_with_20() {
    let env = TestEnv::with_queue_type("facts-args", QueueType::Quorum).await;
    env.apply_topology().await;
    let version = env.broker_version().await;
    let listed = env.list_queues(&["type", "arguments"]).await;

    let (kind, args) = type_and_arguments(&listed, &env.names.dead_letter_queue);
    assert_eq!(kind, "quorum", "RabbitMQ {version}: {args}");
    if version.quorum_limit_by_default() {
        assert!(
            args.contains(r#"{"x-delivery-limit",-1}"#),
            "RabbitMQ {version}: {args}"
        );
    } else {
        assert!(
            !args.contains("x-delivery-limit"),
            "RabbitMQ {version}: {args}"
        );
    }
    for shard in 0..env.shards.get() {
        let queue = env.shard_queue(shard);
        let (kind, args) = type_and_arguments(&listed, &queue);
        assert_eq!(kind, "quorum", "{queue}: {args}");
        assert!(
            args.contains(r#"{"x-delivery-limit",20}"#),
            "RabbitMQ {version}, {queue}: {args}"
        );
    }
}

/// The worker's window: `basic.qos` with global=false before the consume
/// lets its one consumer hold exactly N unacked on a quorum queue (3 of 10
/// delivered, 7 left ready, no fourth delivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_consumer_prefetch_lets_one_consumer_hold_n_unacked() {
    let env = TestEnv::with_queue_type("facts-qos", QueueType::Quorum).await;
    env.apply_topology().await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let queue = env.shard_queue(0);
    publish(&conn, &queue, &messages(10)).await;

    let (_ch, mut consumer) = consume(&conn, &queue, 3).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(Seen::of(&next(&mut consumer).await));
    }
    assert_eq!(bodies(&held), messages(3), "RabbitMQ {version}");
    // The other seven wait in the queue: none was sent past the window.
    wait_ready(&conn, &queue, 7).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(500), consumer.next())
            .await
            .is_err(),
        "RabbitMQ {version}: a fourth delivery past prefetch 3"
    );
}

/// shardline sets per-consumer QoS only, so global QoS never meets its
/// quorum queues: on 3.10.8 and 4.0.5 alike a consume of a quorum queue on a
/// channel with `basic.qos` global=true is refused with 540 NOT_IMPLEMENTED
/// ("does not support global qos"), which closes the connection. (4.3
/// denies global QoS on every queue type, read from its docs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_prefetch_is_refused_by_a_quorum_queue() {
    let env = TestEnv::with_queue_type("facts-global", QueueType::Quorum).await;
    env.apply_topology().await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let queue = env.shard_queue(0);

    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(2, BasicQosOptions { global: true })
        .await
        .unwrap();
    let refused = ch
        .basic_consume(
            queue.as_str().into(),
            "facts".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map(|_| ())
        .expect_err("a consume with global QoS was accepted");
    let text = format!("{refused:?}");
    assert!(
        text.contains("NOTIMPLEMENTED") && text.contains("does not support global qos"),
        "RabbitMQ {version}: {text}"
    );
    wait_until("the connection closed", WAIT, || async {
        shardline_testkit::wait::check(!conn.status().connected(), || {
            format!("{:?}", conn.status())
        })
    })
    .await;
}

/// `--max-body-bytes` must leave room for a dead letter under the broker's
/// `max_message_size`, 128 MiB by default before 4.0 and 16 MiB from 4.0: a
/// body of 16 MiB + 1 KiB is confirmed by 3.10.8 and refused by 4.0.5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_16_mib_is_refused_from_4_0_only() {
    let env = TestEnv::new("facts-size").await;
    let version = env.broker_version().await;
    let conn = env.connect().await;
    let queue = "facts.size";
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let body = vec![b'x'; 16 * 1024 * 1024 + 1024];
    let sent = async {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &body,
            BasicProperties::default(),
        )
        .await?
        .await
    }
    .await;
    if version.default_max_message() < body.len() {
        let refused = sent.map(|_| ()).expect_err("the body was accepted");
        let text = format!("{refused:?}");
        assert!(
            text.contains("PRECONDITION_FAILED") || text.contains("PRECONDITIONFAILED"),
            "RabbitMQ {version}: {text}"
        );
        assert!(text.contains("max size"), "RabbitMQ {version}: {text}");
    } else {
        assert!(sent.unwrap().is_ack(), "RabbitMQ {version}");
        wait_ready(&conn, queue, 1).await;
    }
}
