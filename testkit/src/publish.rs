//! Raw publishing with lapin: valid envelopes, copies and malformed bodies,
//! each confirmed by the broker.

use std::time::SystemTime;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use shardline_contract::headers::{event_properties, new_traceparent};
use shardline_contract::{NewEvent, ShardCount};

use crate::env::TestEnv;

/// Event names by seq (seq 1 is `order.created`, …), cycling.
pub const EVENT_NAMES: [&str; 5] = [
    "order.created",
    "inventory.reserved",
    "payment.captured",
    "order.packed",
    "order.fulfilled",
];

#[derive(Debug, Clone)]
pub struct Event {
    pub order_id: String,
    pub event: String,
    pub seq: u64,
    pub shard: u16,
    pub body: Vec<u8>,
    /// Sent with the event (and with every copy of it).
    pub traceparent: String,
}

impl Event {
    pub fn new(order_id: &str, seq: u64, shards: ShardCount) -> Self {
        let event = EVENT_NAMES[usize::try_from((seq - 1) % 5).unwrap()].to_owned();
        let body = NewEvent {
            order_id: shardline_contract::OrderId::new(order_id).unwrap(),
            event: event.clone(),
            seq: Some(seq),
            event_id: None,
            data: serde_json::json!({ "test": true }),
        }
        .to_body()
        .unwrap();
        Self {
            order_id: order_id.to_owned(),
            event,
            seq,
            shard: shards.shard_of(order_id).get(),
            body,
            traceparent: new_traceparent(),
        }
    }

    /// The dedup key, `{order_id}:{event}:{seq}` (test ids need no escaping).
    pub fn key(&self) -> String {
        format!("{}:{}:{}", self.order_id, self.event, self.seq)
    }
}

/// Order ids `{prefix}-0` … `{prefix}-{n-1}`.
pub fn order_ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Seqs `1..=per_order` of every order, seq-major: seq 1 of every order, then
/// seq 2, ….
pub fn interleaved(orders: &[String], per_order: u64, shards: ShardCount) -> Vec<Event> {
    (1..=per_order)
        .flat_map(|seq| orders.iter().map(move |id| Event::new(id, seq, shards)))
        .collect()
}

pub struct Publisher {
    _conn: Connection,
    channel: Channel,
    exchange: String,
}

impl Publisher {
    pub async fn connect(env: &TestEnv) -> Self {
        Self::try_connect(env).await.unwrap()
    }

    /// [`Self::connect`], or why it failed (a cluster node may be down).
    pub async fn try_connect(env: &TestEnv) -> Result<Self, String> {
        let conn =
            shardline_connect::connect(&env.amqp_target(), &format!("fleet-test {}", env.id))
                .await
                .map_err(|e| e.to_string())?;
        let channel = conn.create_channel().await.map_err(|e| e.to_string())?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(Self {
            _conn: conn,
            channel,
            exchange: env.names.exchange.clone(),
        })
    }

    /// [`Self::publish_with`], or why the broker did not confirm it.
    pub async fn try_publish_with(
        &self,
        shard: u16,
        body: &[u8],
        props: BasicProperties,
    ) -> Result<(), String> {
        let confirm = self
            .publish_unconfirmed(shard, body, props)
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        if !confirm.is_ack() || confirm.take_message().is_some() {
            return Err("nacked or returned".into());
        }
        Ok(())
    }

    /// Publishes `events` in order to `shard.{shard_of(order_id)}` and waits until
    /// the broker confirmed every one as routed.
    pub async fn publish(&self, events: &[Event]) {
        let mut confirms = Vec::with_capacity(events.len());
        for e in events {
            confirms.push(self.send(e.shard, &e.body, &e.key(), &e.traceparent).await);
        }
        for (confirm, e) in confirms.into_iter().zip(events) {
            check(confirm.await, &e.key());
        }
    }

    /// Publishes `body` as is to shard `shard`, confirmed.
    pub async fn publish_raw(&self, shard: u16, body: &[u8]) {
        let confirm = self.send(shard, body, "raw", &new_traceparent()).await;
        check(confirm.await, "raw body");
    }

    /// Publishes `body` as is to shard `shard` with exactly `props` (any headers,
    /// of any AMQP type, or none), confirmed.
    pub async fn publish_with(&self, shard: u16, body: &[u8], props: BasicProperties) {
        let confirm = self.send_with(shard, body, props).await;
        check(confirm.await, "body with custom properties");
    }

    async fn send(
        &self,
        shard: u16,
        body: &[u8],
        message_id: &str,
        traceparent: &str,
    ) -> lapin::PublisherConfirm {
        let props = event_properties(message_id, SystemTime::now(), traceparent);
        self.send_with(shard, body, props).await
    }

    async fn send_with(
        &self,
        shard: u16,
        body: &[u8],
        props: BasicProperties,
    ) -> lapin::PublisherConfirm {
        self.publish_unconfirmed(shard, body, props).await.unwrap()
    }

    async fn publish_unconfirmed(
        &self,
        shard: u16,
        body: &[u8],
        props: BasicProperties,
    ) -> lapin::Result<lapin::PublisherConfirm> {
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                format!("shard.{shard}").as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
    }
}

fn check(confirm: lapin::Result<lapin::Confirmation>, what: &str) {
    let confirm = confirm.unwrap_or_else(|e| panic!("publishing {what}: {e}"));
    assert!(confirm.is_ack(), "publishing {what}: nacked by the broker");
    assert!(
        confirm.take_message().is_none(),
        "publishing {what}: returned unroutable (topology not applied?)"
    );
}
