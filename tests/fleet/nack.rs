//! A nacked event is sent again on a new connection, within the
//! publisher's `nack_retries`: a shard queue held full (`x-max-length` 1,
//! `x-overflow` reject-publish-dlx) nacks the second event until a consumer
//! takes the first; then the publish completes. With no retries the nack is
//! the caller's at once.

use lapin::options::{
    BasicAckOptions, BasicGetOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use shardline_contract::{Names, ShardId};
use shardline_publisher::{Config, PublishError, Publisher};
use shardline_testkit::{Event, TestEnv, wait_until};

/// The queue that gets a copy of every publish the capped shard queue refused.
const REFUSED: &str = "nack.refused";

/// An order whose events go to shard 0, and its `seq`th event.
fn event_on_shard_0(env: &TestEnv, seq: u64) -> Vec<u8> {
    let order = (0..)
        .map(|i| format!("nack-{i}"))
        .find(|o| env.shard_of(o) == 0)
        .unwrap();
    Event::new(&order, seq, env.shards).body
}

/// Holds shard 0's queue at one message: it is declared again with
/// `x-max-length` 1 and `x-overflow` reject-publish-dlx, so a second event
/// is refused with a nack, and a copy of each refused publish lands in
/// [`REFUSED`] (how the test sees a nack happen).
async fn cap_shard_0(env: &TestEnv) {
    let conn = env.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        REFUSED.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let queue = env.shard_queue(0);
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let text = |s: &str| AMQPValue::LongString(s.into());
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
    args.insert("x-overflow".into(), text("reject-publish-dlx"));
    args.insert("x-dead-letter-exchange".into(), text(""));
    args.insert("x-dead-letter-routing-key".into(), text(REFUSED));
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        env.names.exchange.as_str().into(),
        Names::routing_key(ShardId::new(0, env.shards).unwrap()).into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "done".into()).await;
}

fn config(env: &TestEnv, nack_retries: u32) -> Config {
    Config {
        amqp: env.amqp_target(),
        shards: env.shards,
        window: 1,
        connection_name: format!("nack publisher {}", env.id),
        nack_retries,
        ..Config::default()
    }
}

async fn refused(env: &TestEnv) -> u64 {
    env.queue_depths().await.get(REFUSED).map_or(0, |d| d.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_event_is_sent_again_until_the_queue_takes_it() {
    let env = TestEnv::new("nack-retry").await;
    env.apply_topology().await;
    cap_shard_0(&env).await;
    let mut publisher = Publisher::connect(config(&env, 10)).await.unwrap();
    publisher.publish(event_on_shard_0(&env, 1)).await.unwrap();
    publisher.flush().await.unwrap();

    let second = event_on_shard_0(&env, 2);
    let publishing = tokio::spawn(async move {
        publisher.publish(second).await?;
        publisher.flush().await?;
        Ok::<_, PublishError>(publisher.counts())
    });
    // Two refused copies: the second event was nacked, sent again on a new
    // connection and nacked again.
    wait_until(
        "the second event is nacked and sent again",
        std::time::Duration::from_secs(30),
        || async {
            match refused(&env).await {
                n if n >= 2 => Ok(()),
                n => Err(format!("{n} refused publishes")),
            }
        },
    )
    .await;
    assert!(
        !publishing.is_finished(),
        "the publish ended while the queue was full"
    );
    // Take the first event: the queue has room, the next re-send is stored.
    let conn = env.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let first = ch
        .basic_get(
            env.shard_queue(0).as_str().into(),
            BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("the first event is in the queue");
    first.ack(BasicAckOptions::default()).await.unwrap();
    let counts = publishing.await.unwrap().unwrap();
    assert_eq!(counts.confirmed, 2, "{counts:?}");
    assert!(
        counts.reconnects >= 2,
        "a new connection per nack: {counts:?}"
    );
    let depths = env.queue_depths().await;
    assert_eq!(depths.get(&env.shard_queue(0)), Some(&(1, 0)), "{depths:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_retries_a_nack_is_the_callers_at_once() {
    let env = TestEnv::new("nack-now").await;
    env.apply_topology().await;
    cap_shard_0(&env).await;
    let mut publisher = Publisher::connect(config(&env, 0)).await.unwrap();
    publisher.publish(event_on_shard_0(&env, 1)).await.unwrap();
    publisher.flush().await.unwrap();
    publisher.publish(event_on_shard_0(&env, 2)).await.unwrap();
    let refusal = publisher.flush().await.unwrap_err();
    assert!(matches!(refusal, PublishError::Nacked { .. }), "{refusal}");
    assert_eq!(refused(&env).await, 1);
}
