//! Declaring the topology (`topology apply`) and reading it back (`topology status`).
//!
//! Shard queues carry no x-arguments by default, so that the pika recipe's
//! `queue_declare(queue, durable=True)` redeclares them without a 406. The opt-in
//! flags add arguments; publishers must then declare identically.

use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::broker::soft_error;
use crate::probe::Plan;
use shardline_contract::Names;
use shardline_contract::ShardCount;
use shardline_contract::rabbitmq::{QueueType, Version};

/// The default `x-delivery-limit` of quorum shard queues, from the budget
/// in ARCHITECTURE.md ("Delivery-count budget"): every return of an
/// unacked delivery spends one, for every event in the consumer's window —
/// two poison events' crash loops (2 × `--max-deliveries` 5), a rolling
/// restart of three nodes (3), a deploy that moves the shard (2), a
/// partition (1) and two hours of downstream outage at RabbitMQ's 30 min
/// consumer timeout (4).
pub const DEFAULT_DELIVERY_LIMIT: u32 = 2 * 5 + 3 + 2 + 1 + 4;

/// How the shard queues are declared.
#[derive(Debug, Clone)]
pub struct TopologyOptions {
    pub shards: ShardCount,
    /// `x-single-active-consumer`: the broker picks one consumer, the rest wait.
    /// Off by default (exclusive consumers do the same without queue arguments).
    pub single_active_consumer: bool,
    pub queue_type: QueueType,
    /// Quorum queues only: `x-delivery-limit`. Kept well above the worker's
    /// crash-loop limit because reconnects, handovers and failovers count
    /// too. Default [`DEFAULT_DELIVERY_LIMIT`] (20).
    pub delivery_limit: u32,
    /// Declare classic single-active-consumer queues although the broker
    /// has the bug that can stop their failover (`probe`). Default false.
    pub accept_classic_sac_risk: bool,
    /// The broker's version as the probe read it (the lowest of a
    /// cluster's): from 4.0 a quorum DLQ says "no delivery limit" with -1.
    pub broker_version: Option<Version>,
}

impl Default for TopologyOptions {
    fn default() -> Self {
        Self {
            shards: ShardCount::default(),
            single_active_consumer: false,
            queue_type: QueueType::Classic,
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            accept_classic_sac_risk: false,
            broker_version: None,
        }
    }
}

impl TopologyOptions {
    /// Whether consumers take the shard with an exclusive consumer (true) or rely
    /// on the queue's single-active-consumer (false).
    pub fn exclusive_consumers(&self) -> bool {
        !self.single_active_consumer && self.queue_type == QueueType::Classic
    }

    /// What the broker probe checks for consumers of this topology.
    pub fn plan(&self) -> Plan {
        Plan {
            queue_type: self.queue_type,
            classic_single_active_consumer: self.single_active_consumer
                && self.queue_type == QueueType::Classic,
            accept_classic_sac_risk: self.accept_classic_sac_risk,
            delivery_limit: (self.queue_type == QueueType::Quorum).then_some(self.delivery_limit),
            ..Plan::default()
        }
    }

    /// The x-arguments of every shard queue: none by default.
    pub fn shard_queue_arguments(&self, names: &Names) -> FieldTable {
        let mut args = FieldTable::default();
        if self.single_active_consumer || self.queue_type == QueueType::Quorum {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        if self.queue_type == QueueType::Quorum {
            args.insert("x-queue-type".into(), text("quorum"));
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
            );
            args.insert(
                "x-dead-letter-exchange".into(),
                text(&names.dead_letter_exchange),
            );
            args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            args.insert("x-overflow".into(), text("reject-publish"));
        }
        args
    }
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

fn describe(args: &FieldTable) -> String {
    args.inner()
        .iter()
        .map(|(k, v)| {
            let v = match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                AMQPValue::Boolean(b) => b.to_string(),
                AMQPValue::LongLongInt(n) => n.to_string(),
                other => format!("{other:?}"),
            };
            format!("{k}={v}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What `apply` declared.
#[derive(Debug, Clone)]
pub struct ApplyReport {
    pub shard_queues: Vec<String>,
    /// The x-arguments publishers must declare the shard queues with, when any.
    pub publishers_must_declare: Option<String>,
    pub dead_letter_queue: DlqKind,
    /// Broker nodes the shard queues were declared through.
    pub nodes: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DeclareError {
    #[error(
        "queue `{queue}` already exists with {argument} = {current} but this apply declares {declared}: \
         apply with the flags it was created with, or drain and delete it to change it"
    )]
    Conflict {
        queue: String,
        argument: String,
        current: String,
        declared: String,
    },
    /// A shard queue exists with other arguments than the command expects.
    #[error(
        "shard queue `{queue}` has {found}: \
         give it the flags the topology was applied with (--queue-type, --single-active-consumer, --delivery-limit)"
    )]
    Mismatch {
        queue: String,
        /// `x-delivery-limit = '12' but this command expects '20'`.
        found: String,
    },
    #[error("{what} `{name}` was refused: {reply}")]
    Refused {
        what: &'static str,
        name: String,
        reply: String,
    },
    #[error("queue `{0}` does not exist: run `shardline topology apply`")]
    Missing(String),
    /// A classic queue of a cluster whose node is down: it exists, and
    /// comes back with its node.
    #[error("queue `{queue}` is on a broker node that is down: {reply}")]
    HomeNodeDown { queue: String, reply: String },
    #[error("no broker connection to declare through")]
    NoConnection,
    /// The configured shard count is not the topology's.
    #[error(
        "--shards {configured} does not match the topology: {found}; every publisher and worker must use the topology's shard count, \
         or one order's events would land in two queues (during a shard-count migration, pass --allow-shard-mismatch)"
    )]
    ShardCount { configured: u32, found: String },
    #[error("broker error: {0}")]
    Broker(#[from] lapin::Error),
}

/// Declares exchanges, shard queues, bindings and the dead-letter queue.
/// Idempotent. With connections to several nodes of a cluster, shard queue
/// `i` is declared through `conns[i mod n]`: RabbitMQ 3.x puts a new quorum
/// queue's leader (and a classic queue) on the node that declared it, so the
/// leaders spread over the nodes with no queue argument and no policy.
pub async fn apply(
    conns: &[Connection],
    names: &Names,
    opts: &TopologyOptions,
) -> Result<ApplyReport, DeclareError> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let Some(conn) = conns.first() else {
        return Err(DeclareError::NoConnection);
    };
    let ch = conn.create_channel().await?;
    let mut node_channels = Vec::with_capacity(conns.len());
    for other in &conns[1..] {
        node_channels.push(other.create_channel().await?);
    }
    declare_exchange(&ch, &names.exchange, ExchangeKind::Direct, durable).await?;
    declare_exchange(
        &ch,
        &names.dead_letter_exchange,
        ExchangeKind::Topic,
        durable,
    )
    .await?;

    let args = opts.shard_queue_arguments(names);
    let mut shard_queues = Vec::with_capacity(usize::from(opts.shards.get()));
    for (i, shard) in opts.shards.ids().enumerate() {
        let queue = names.shard_queue(shard);
        let on = match i % conns.len() {
            0 => &ch,
            n => &node_channels[n - 1],
        };
        declare_queue(on, &queue, &args).await?;
        ch.queue_bind(
            queue.as_str().into(),
            names.exchange.as_str().into(),
            Names::routing_key(shard).into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        shard_queues.push(queue);
    }
    for other in &node_channels {
        close_quietly(other).await;
    }
    let dead_letter_queue = declare_dead_letter_queue(conn, ch, names, opts).await?;
    let ch = dead_letter_queue.channel;
    ch.queue_bind(
        names.dead_letter_queue.as_str().into(),
        names.dead_letter_exchange.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    close_quietly(&ch).await;
    Ok(ApplyReport {
        shard_queues,
        publishers_must_declare: (!args.inner().is_empty()).then(|| describe(&args)),
        dead_letter_queue: dead_letter_queue.kind,
        nodes: conns.len(),
    })
}

/// The dead-letter queue as declared, and the channel to go on with.
struct DeadLetterQueue {
    channel: Channel,
    kind: DlqKind,
}

/// What kind of dead-letter queue the topology has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DlqKind {
    Classic,
    /// With quorum shard queues: it survives the loss of a node. No
    /// delivery limit (browsing by requeue would spend it; 3.x has none by
    /// default).
    Quorum,
    /// Quorum shard queues, but the DLQ was made classic before (an earlier
    /// version): kept, as a queue's type cannot change in place.
    ClassicKept,
}

/// Declares the DLQ: quorum when the shard queues are. A classic DLQ made
/// before is kept (its type cannot change; the channel the refusal closed is
/// opened again).
async fn declare_dead_letter_queue(
    conn: &Connection,
    ch: Channel,
    names: &Names,
    opts: &TopologyOptions,
) -> Result<DeadLetterQueue, DeclareError> {
    let queue = &names.dead_letter_queue;
    if opts.queue_type == QueueType::Classic {
        declare_queue(&ch, queue, &FieldTable::default()).await?;
        return Ok(DeadLetterQueue {
            channel: ch,
            kind: DlqKind::Classic,
        });
    }
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), text("quorum"));
    if opts
        .broker_version
        .is_some_and(Version::quorum_limit_by_default)
    {
        quorum.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(-1));
    }
    match declare_queue(&ch, queue, &quorum).await {
        Ok(()) => Ok(DeadLetterQueue {
            channel: ch,
            kind: DlqKind::Quorum,
        }),
        Err(DeclareError::Conflict { argument, .. }) if argument == "x-queue-type" => {
            tracing::warn!(%queue, "the dead-letter queue is a classic queue from an earlier apply: kept (a queue's type cannot change); it does not survive the loss of its node — drain it (`shardline dlq replay`), delete it and apply again to make it a quorum queue");
            let ch = conn.create_channel().await?;
            declare_queue(&ch, queue, &FieldTable::default()).await?;
            Ok(DeadLetterQueue {
                channel: ch,
                kind: DlqKind::ClassicKept,
            })
        }
        Err(DeclareError::Conflict { argument, .. }) if argument == "x-delivery-limit" => {
            tracing::warn!(%queue, "the dead-letter queue was declared before RabbitMQ 4.0 without x-delivery-limit, which from 4.0 means a limit of 20: browsing it by requeue would dead-letter its letters; give it a policy with `delivery-limit: -1`, or drain it, delete it and apply again");
            let ch = conn.create_channel().await?;
            let mut without_limit = FieldTable::default();
            without_limit.insert("x-queue-type".into(), text("quorum"));
            declare_queue(&ch, queue, &without_limit).await?;
            Ok(DeadLetterQueue {
                channel: ch,
                kind: DlqKind::Quorum,
            })
        }
        Err(e) => Err(e),
    }
}

async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
    options: ExchangeDeclareOptions,
) -> Result<(), DeclareError> {
    ch.exchange_declare(name.into(), kind, options, FieldTable::default())
        .await
        .map_err(
            |e| match soft_error(&e, AMQPSoftError::PRECONDITIONFAILED) {
                Some(reply) => DeclareError::Refused {
                    what: "exchange",
                    name: name.to_owned(),
                    reply,
                },
                None => e.into(),
            },
        )
}

/// Declares one durable queue with `args`.
async fn declare_queue(ch: &Channel, queue: &str, args: &FieldTable) -> Result<(), DeclareError> {
    ch.queue_declare(queue.into(), QueueDeclareOptions::durable(), args.clone())
        .await
        .map_err(
            |e| match soft_error(&e, AMQPSoftError::PRECONDITIONFAILED) {
                Some(reply) => conflict(queue, &reply),
                None => e.into(),
            },
        )?;
    Ok(())
}

/// Reads RabbitMQ's "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/':
/// received none but current is the value 'quorum' of type 'longstr'" into one line.
fn conflict(queue: &str, reply: &str) -> DeclareError {
    let first_quoted = |s: &str| s.split('\'').nth(1).map(str::to_owned);
    let value = |s: &str| {
        if s.trim_start().starts_with("none") {
            "none".to_owned()
        } else {
            first_quoted(s).map_or_else(|| "another value".into(), |v| format!("'{v}'"))
        }
    };
    let (head, values) = reply.split_once("received ").unwrap_or((reply, ""));
    let (declared, current) = values
        .split_once(" but current is ")
        .unwrap_or((values, ""));
    DeclareError::Conflict {
        queue: queue.to_owned(),
        argument: first_quoted(head).unwrap_or_else(|| "an argument".into()),
        current: value(current),
        declared: value(declared),
    }
}

/// Checks that the topology has `shards` shard queues: queue N−1 exists and
/// queue N does not (a passive declare each, on a throwaway channel: a
/// missing queue closes it). A publisher with another N than the workers'
/// would split an order over two queues.
pub async fn check_shard_count(
    conn: &Connection,
    names: &Names,
    shards: ShardCount,
) -> Result<(), DeclareError> {
    let n = u32::from(shards.get());
    let mismatch = |found: String| DeclareError::ShardCount {
        configured: n,
        found,
    };
    let last = names.shard_queue_named(n - 1);
    if !queue_exists(conn, &last).await? {
        let first = names.shard_queue_named(0);
        if !queue_exists(conn, &first).await? {
            return Err(DeclareError::Missing(first));
        }
        return Err(mismatch(format!(
            "queue `{last}` does not exist (the topology has fewer shards)"
        )));
    }
    let beyond = names.shard_queue_named(n);
    if queue_exists(conn, &beyond).await? {
        return Err(mismatch(format!(
            "queue `{beyond}` exists (the topology has more shards)"
        )));
    }
    Ok(())
}

/// Checks that the shard queues that exist carry the arguments `opts`
/// gives them, the only way AMQP allows: a passive declare ignores every
/// field but the name, so each is redeclared non-passively with the
/// expected arguments (a no-op when they agree, a 406 naming the argument
/// when not). A queue that is missing, or whose node is down, is skipped
/// rather than created. A policy is not an argument: it is not seen.
pub async fn check_queue_arguments(
    conn: &Connection,
    names: &Names,
    opts: &TopologyOptions,
) -> Result<(), DeclareError> {
    let args = opts.shard_queue_arguments(names);
    let mut open: Option<Channel> = None;
    for shard in opts.shards.ids() {
        let queue = names.shard_queue(shard);
        match queue_status(conn, &queue).await {
            Ok(_) => {}
            Err(DeclareError::Missing(_) | DeclareError::HomeNodeDown { .. }) => continue,
            Err(e) => return Err(e),
        }
        let ch = match open.take() {
            Some(ch) => ch,
            None => conn.create_channel().await?,
        };
        match declare_queue(&ch, &queue, &args).await {
            Ok(()) => open = Some(ch),
            Err(DeclareError::Conflict {
                queue,
                argument,
                current,
                declared,
            }) => {
                return Err(DeclareError::Mismatch {
                    queue,
                    found: format!("{argument} = {current} but this command expects {declared}"),
                });
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(ch) = open {
        close_quietly(&ch).await;
    }
    Ok(())
}

/// A 404 on `queue`: missing, or (a classic queue on a cluster) its home
/// node is down.
fn not_found(queue: &str, e: lapin::Error) -> DeclareError {
    match soft_error(&e, AMQPSoftError::NOTFOUND) {
        Some(reply) if is_home_node_down(&reply) => DeclareError::HomeNodeDown {
            queue: queue.to_owned(),
            reply,
        },
        Some(_) => DeclareError::Missing(queue.to_owned()),
        None => e.into(),
    }
}

/// RabbitMQ's 404 for a classic queue whose node is down: "home node
/// 'rabbit@b' of durable queue 'q' in vhost '/' is down or inaccessible".
pub fn is_home_node_down(reply: &str) -> bool {
    reply.contains("home node") && reply.contains("is down")
}

/// Whether `queue` exists ([`queue_status`]: a queue whose node is down does).
pub(crate) async fn queue_exists(conn: &Connection, queue: &str) -> Result<bool, DeclareError> {
    match queue_status(conn, queue).await {
        Ok(_) | Err(DeclareError::HomeNodeDown { .. }) => Ok(true),
        Err(DeclareError::Missing(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Depth and consumers of one queue, read with a passive declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardStatus {
    pub queue: String,
    pub messages: u32,
    pub consumers: u32,
}

/// Depth and consumer count of `queue`, on a channel of its own.
pub async fn queue_status(conn: &Connection, queue: &str) -> Result<ShardStatus, DeclareError> {
    let ch = conn.create_channel().await?;
    let status = peek(&ch, queue).await.map_err(|e| not_found(queue, e))?;
    close_quietly(&ch).await;
    Ok(status)
}

/// Depth and consumer count of `queue` by a passive declare on `channel`,
/// which stays open unless the queue is missing (the broker closes it then).
/// For a caller that reads queues again and again on one channel.
pub async fn peek(channel: &Channel, queue: &str) -> Result<ShardStatus, lapin::Error> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?;
    Ok(ShardStatus {
        queue: queue.to_owned(),
        messages: declared.message_count(),
        consumers: declared.consumer_count(),
    })
}

/// Declares a reshard's holding queue (the shard queues' arguments) and
/// binds it with its own routing key. Idempotent.
pub async fn hold_queue(
    conn: &Connection,
    names: &Names,
    opts: &TopologyOptions,
    queue: &str,
    routing_key: &str,
) -> Result<(), DeclareError> {
    let ch = conn.create_channel().await?;
    declare_queue(&ch, queue, &opts.shard_queue_arguments(names)).await?;
    ch.queue_bind(
        queue.into(),
        names.exchange.as_str().into(),
        routing_key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    close_quietly(&ch).await;
    Ok(())
}

/// Unbinds a holding queue, then deletes it if it is empty. `false` (and
/// it stays, unbound) when it still holds messages.
///
/// Emptiness is read (twice, [`RETIRE_SETTLE`] apart, so that a message
/// routed just before the unbind has landed), not asked of the delete:
/// quorum queues refuse `if-empty` with a connection error. What its
/// consumer holds unacked then is its forward of a late event, which the
/// worker completes (confirmed) whatever becomes of the queue.
pub async fn retire_hold_queue(
    conn: &Connection,
    names: &Names,
    queue: &str,
    routing_key: &str,
) -> Result<bool, DeclareError> {
    let ch = conn.create_channel().await?;
    let unbound = ch
        .queue_unbind(
            queue.into(),
            names.exchange.as_str().into(),
            routing_key.into(),
            FieldTable::default(),
        )
        .await;
    match unbound {
        // Deleted before (a reshard run again after this step).
        Err(e) if soft_error(&e, AMQPSoftError::NOTFOUND).is_some() => return Ok(true),
        other => other?,
    }
    for pause in [Duration::ZERO, RETIRE_SETTLE] {
        tokio::time::sleep(pause).await;
        if peek(&ch, queue).await?.messages > 0 {
            close_quietly(&ch).await;
            return Ok(false);
        }
    }
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    close_quietly(&ch).await;
    Ok(true)
}

/// How long a holding queue stays unbound and empty before it is deleted.
pub const RETIRE_SETTLE: Duration = Duration::from_millis(500);

/// Deletes everything `apply` declared under `names`: for throwaway runs.
pub async fn delete(
    conn: &Connection,
    names: &Names,
    shards: ShardCount,
) -> Result<(), DeclareError> {
    let ch = conn.create_channel().await?;
    for shard in shards.ids() {
        ch.queue_delete(
            names.shard_queue(shard).into(),
            QueueDeleteOptions::default(),
        )
        .await?;
    }
    ch.queue_delete(
        names.dead_letter_queue.as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await?;
    for exchange in [&names.exchange, &names.dead_letter_exchange] {
        ch.exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await?;
    }
    close_quietly(&ch).await;
    Ok(())
}

async fn close_quietly(ch: &Channel) {
    if let Err(e) = ch.close(200, "done".into()).await {
        tracing::debug!(error = %e, "closing a declaration channel");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_shard_queues_have_no_arguments() {
        let opts = TopologyOptions::default();
        assert!(
            opts.shard_queue_arguments(&Names::default())
                .inner()
                .is_empty()
        );
        assert!(opts.exclusive_consumers());
    }

    #[test]
    fn quorum_implies_single_active_consumer_and_a_dead_letter_backstop() {
        let opts = TopologyOptions {
            queue_type: QueueType::Quorum,
            ..TopologyOptions::default()
        };
        let args = opts.shard_queue_arguments(&Names::default());
        let keys: Vec<&str> = args.inner().keys().map(|k| k.as_str()).collect();
        for key in [
            "x-single-active-consumer",
            "x-queue-type",
            "x-delivery-limit",
            "x-dead-letter-exchange",
            "x-dead-letter-strategy",
            "x-overflow",
        ] {
            assert!(keys.contains(&key), "{key}");
        }
        assert!(!opts.exclusive_consumers());
    }

    #[test]
    fn conflict_names_queue_argument_and_values() {
        let e = conflict(
            "order.events.shard.0",
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue \
             'order.events.shard.0' in vhost '/': received none but current is the \
             value 'quorum' of type 'longstr'",
        );
        let line = e.to_string();
        assert!(line.contains("`order.events.shard.0`"), "{line}");
        assert!(line.contains("x-queue-type = 'quorum'"), "{line}");
        assert!(line.contains("declares none"), "{line}");
        assert!(!line.contains('\n'));
    }
}
