//! `shardline topology apply|status`: declare the exchanges and queues, and read
//! them back.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use shardline_topology::declare::{self, QueueType, TopologyOptions};
use shardline_topology::{Names, ShardStatus, redact_url};

use crate::GlobalArgs;

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Declare exchanges, shard queues, bindings and the DLQ (idempotent).
    Apply(ApplyArgs),
    /// Per shard: depth and consumers; DLQ depth.
    Status(StatusArgs),
}

#[derive(Debug, Args)]
pub struct ApplyArgs {
    /// Declare the shard queues with `x-single-active-consumer` (greenfield
    /// topologies only: publishers must then declare the queues identically).
    #[arg(
        long,
        env = "SHARDLINE_SINGLE_ACTIVE_CONSUMER",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub single_active_consumer: bool,
    /// Shard queue type; `quorum` implies single-active-consumer and adds a
    /// delivery limit and a dead-letter backstop.
    #[arg(long, env = "SHARDLINE_QUEUE_TYPE", default_value = "classic")]
    pub queue_type: QueueType,
    /// Quorum queues only: `x-delivery-limit` (reconnects count too, so keep it
    /// well above the worker's `--max-deliveries`).
    #[arg(long, env = "SHARDLINE_DELIVERY_LIMIT", default_value_t = TopologyOptions::default().delivery_limit)]
    pub delivery_limit: u32,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(global: &GlobalArgs, cmd: TopologyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        TopologyCommand::Apply(args) => apply(global, args).await,
        TopologyCommand::Status(args) => status(global, args).await,
    }
}

async fn apply(global: &GlobalArgs, args: ApplyArgs) -> anyhow::Result<ExitCode> {
    let names = global.names();
    let opts = TopologyOptions {
        shards: global.shards,
        single_active_consumer: args.single_active_consumer,
        queue_type: args.queue_type,
        delivery_limit: args.delivery_limit,
    };
    let url = redact_url(&global.amqp_url);
    let conn = shardline_topology::connect(&global.amqp_url, "shardline topology apply").await?;
    let report = declare::apply(&conn, &names, &opts)
        .await
        .with_context(|| format!("topology apply on {url}"))?;
    close(&conn).await;
    print!("{}", describe_apply(&url, &names, &opts, &report));
    Ok(ExitCode::SUCCESS)
}

fn describe_apply(
    url: &str,
    names: &Names,
    opts: &TopologyOptions,
    report: &shardline_topology::ApplyReport,
) -> String {
    let queue_type = match opts.queue_type {
        QueueType::Classic => "classic",
        QueueType::Quorum => "quorum",
    };
    let consumers = if opts.exclusive_consumers() {
        "one exclusive consumer per shard, extra workers wait as standbys"
    } else {
        "single-active-consumer: the broker picks one consumer per shard"
    };
    let mut out = String::new();
    let _ = writeln!(out, "topology applied on {url}");
    let _ = writeln!(out, "  exchange {} (direct, durable)", names.exchange);
    let _ = writeln!(
        out,
        "  exchange {} (topic, durable)",
        names.dead_letter_exchange
    );
    let (first, last) = (
        report.shard_queues.first().map_or("", String::as_str),
        report.shard_queues.last().map_or("", String::as_str),
    );
    let _ = writeln!(
        out,
        "  {} {queue_type} shard queues {first} .. {last} (durable), bound to {} with shard.0 .. shard.{}",
        report.shard_queues.len(),
        names.exchange,
        report.shard_queues.len().saturating_sub(1),
    );
    let _ = writeln!(
        out,
        "  queue {} (classic, durable), bound to {} with #",
        names.dead_letter_queue, names.dead_letter_exchange
    );
    let _ = writeln!(out, "  consumers: {consumers}");
    match &report.publishers_must_declare {
        None => {
            let _ = writeln!(
                out,
                "  shard queue arguments: none (publishers may redeclare them with durable=True and no arguments)"
            );
        }
        Some(args) => {
            let _ = writeln!(out, "  shard queue arguments: {args}");
            let _ = writeln!(
                out,
                "NOTE: publishers that declare the shard queues must now declare them with exactly \
                 these arguments ({args}); a declare without them is refused with 406 PRECONDITION_FAILED."
            );
        }
    }
    out
}

async fn status(global: &GlobalArgs, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let names = global.names();
    let url = redact_url(&global.amqp_url);
    let conn = shardline_topology::connect(&global.amqp_url, "shardline topology status").await?;
    let mut shards = Vec::with_capacity(usize::from(global.shards.get()));
    for shard in global.shards.ids() {
        let queue = names.shard_queue(shard);
        let st = declare::queue_status(&conn, &queue)
            .await
            .with_context(|| format!("topology status on {url}"))?;
        shards.push((shard.get(), st));
    }
    let dlq = declare::queue_status(&conn, &names.dead_letter_queue)
        .await
        .with_context(|| format!("topology status on {url}"))?;
    close(&conn).await;
    if args.json {
        println!("{}", status_json(&shards, &dlq));
    } else {
        print!("{}", status_table(&url, &shards, &dlq));
    }
    Ok(ExitCode::SUCCESS)
}

fn status_json(shards: &[(u16, ShardStatus)], dlq: &ShardStatus) -> serde_json::Value {
    serde_json::json!({
        "shards": shards.iter().map(|(shard, st)| serde_json::json!({
            "shard": shard,
            "queue": st.queue,
            "messages": st.messages,
            "consumers": st.consumers,
        })).collect::<Vec<_>>(),
        "dead_letter_queue": {
            "queue": dlq.queue,
            "messages": dlq.messages,
            "consumers": dlq.consumers,
        },
    })
}

fn status_table(url: &str, shards: &[(u16, ShardStatus)], dlq: &ShardStatus) -> String {
    let width = shards
        .iter()
        .map(|(_, st)| st.queue.len())
        .chain([dlq.queue.len(), "queue".len()])
        .max()
        .unwrap_or(5);
    let mut out = String::new();
    let _ = writeln!(out, "{url}");
    let _ = writeln!(
        out,
        "{:<5}  {:<width$}  {:>9}  {:>9}",
        "shard", "queue", "messages", "consumers"
    );
    let mut total = 0u64;
    let mut unconsumed = 0usize;
    for (shard, st) in shards {
        total += u64::from(st.messages);
        let note = if st.consumers == 0 {
            unconsumed += 1;
            "  no consumer"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{shard:<5}  {:<width$}  {:>9}  {:>9}{note}",
            st.queue, st.messages, st.consumers
        );
    }
    let _ = writeln!(out, "{:<5}  {:<width$}  {total:>9}", "all", "");
    let _ = writeln!(
        out,
        "{:<5}  {:<width$}  {:>9}",
        "dlq", dlq.queue, dlq.messages
    );
    if unconsumed > 0 {
        let _ = writeln!(
            out,
            "{unconsumed} of {} shards have no consumer: their events wait until a worker takes them",
            shards.len()
        );
    }
    out
}

async fn close(conn: &lapin::Connection) {
    if let Err(e) = conn.close(200, "done".into()).await {
        tracing::debug!(error = %e, "closing the topology connection");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(queue: &str, messages: u32, consumers: u32) -> ShardStatus {
        ShardStatus {
            queue: queue.into(),
            messages,
            consumers,
        }
    }

    #[test]
    fn status_table_totals_and_flags_unconsumed_shards() {
        let shards = [
            (0, st("order.events.shard.0", 3, 1)),
            (1, st("order.events.shard.1", 4, 0)),
        ];
        let table = status_table("amqp://h/", &shards, &st("order.events.dlq", 2, 0));
        assert!(table.contains("all"), "{table}");
        assert!(table.contains("        7"), "{table}");
        assert!(table.contains("no consumer"), "{table}");
        assert!(table.contains("1 of 2 shards"), "{table}");
        let json = status_json(&shards, &st("order.events.dlq", 2, 0));
        assert_eq!(json["shards"][1]["messages"], 4);
        assert_eq!(json["dead_letter_queue"]["messages"], 2);
    }

    #[test]
    fn apply_says_when_publishers_must_declare_arguments() {
        let names = Names::default();
        let opts = TopologyOptions {
            queue_type: QueueType::Quorum,
            ..TopologyOptions::default()
        };
        let report = shardline_topology::ApplyReport {
            shard_queues: vec!["order.events.shard.0".into()],
            publishers_must_declare: Some("x-queue-type=quorum".into()),
        };
        let text = describe_apply("amqp://h/", &names, &opts, &report);
        assert!(text.contains("NOTE: publishers"), "{text}");
        assert!(text.contains("x-queue-type=quorum"), "{text}");
        let plain = shardline_topology::ApplyReport {
            publishers_must_declare: None,
            ..report
        };
        let text = describe_apply("amqp://h/", &names, &TopologyOptions::default(), &plain);
        assert!(!text.contains("NOTE"), "{text}");
    }
}
