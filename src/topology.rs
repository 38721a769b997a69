//! `shardline topology apply|status|reshard`: flags to
//! [`shardline_ops::topology`] and [`shardline_ops::reshard`], their reports
//! printed as text or JSON.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use shardline_connect::declare::TopologyOptions;
use shardline_contract::QueueType;
use shardline_contract::status::Thresholds;
use shardline_ops::StatusConfig;
use shardline_ops::topology;

use crate::{EXIT_ATTENTION, Flags as _, GlobalArgs};

#[derive(Debug, Subcommand)]
pub(crate) enum TopologyCommand {
    /// Declare exchanges, shard queues, bindings and the DLQ (idempotent).
    Apply(ApplyArgs),
    /// Per shard: depth, consumers, owner, backlog age and level; DLQ depth by
    /// reason. Exit code 3 when a shard is at PAGE or has events and no consumer.
    Status(StatusArgs),
    /// Change the shard count to M online, or print the plan (`--plan`).
    /// Run again after an interruption, it resumes (ARCHITECTURE.md,
    /// "Resharding: the protocol").
    Reshard(ReshardArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ReshardArgs {
    /// The target shard count M (1 to 1,024).
    #[arg(long, required_unless_present = "abort")]
    pub to: Option<u32>,
    /// Give up the reshard in progress and return to the current count:
    /// possible until its second barrier (phase Closing); its moves go back
    /// to their old shards through the same steps.
    #[arg(long, conflicts_with_all = ["to", "plan"])]
    pub abort: bool,
    /// Print the plan (the moves, their share of orders, the queues) and
    /// change nothing.
    #[arg(long)]
    pub plan: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The topology's flags, as `topology apply` was given them: new shard
    /// queues and holding queues are declared with them.
    #[command(flatten)]
    pub topology: ApplyArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ApplyArgs {
    /// Declare the shard queues with `x-single-active-consumer` (greenfield
    /// topologies only: publishers must then declare the queues identically).
    #[arg(long)]
    pub single_active_consumer: bool,
    /// Shard queue type; `quorum` implies single-active-consumer and adds a
    /// delivery limit and a dead-letter backstop.
    #[arg(long, default_value = "classic")]
    pub queue_type: QueueType,
    /// Quorum queues only: `x-delivery-limit` (reconnects count too, so keep it
    /// well above the worker's `--max-deliveries`).
    #[arg(long, default_value_t = TopologyOptions::default().delivery_limit)]
    pub delivery_limit: u32,
    /// Apply `--single-active-consumer` although the broker is older than
    /// 3.10.13 (3.11.5), whose classic-queue single-active-consumer can crash
    /// the queue when the active consumer changes (rabbitmq-server#5460).
    #[arg(long)]
    pub accept_classic_sac_risk: bool,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Backlog age from which a shard is at WARN.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub backlog_warn: Duration,
    /// Backlog age from which a shard is at PAGE (exit code 3).
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub backlog_page: Duration,
    /// Dead letters read (and requeued) at most to count them by reason.
    #[arg(long, default_value_t = 1000)]
    pub dlq_browse: u32,
}

/// A report as JSON (`--json`) or as its text.
fn print_report(json: bool, report: &impl serde::Serialize, text: String) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{text}");
    }
    Ok(())
}

/// The topology's options from `apply`'s flags.
fn options(global: &GlobalArgs, args: &ApplyArgs) -> TopologyOptions {
    TopologyOptions {
        shards: global.shards,
        single_active_consumer: args.single_active_consumer,
        queue_type: args.queue_type,
        delivery_limit: args.delivery_limit,
        accept_classic_sac_risk: args.accept_classic_sac_risk,
        broker_version: None,
    }
}

pub(crate) async fn run(global: &GlobalArgs, cmd: TopologyCommand) -> anyhow::Result<ExitCode> {
    let fleet = global.fleet();
    match cmd {
        TopologyCommand::Apply(args) => {
            let options = options(global, &args);
            print!(
                "{}",
                topology::apply(&fleet, &options).await.flags()?.text()
            );
            Ok(ExitCode::SUCCESS)
        }
        TopologyCommand::Reshard(args) => {
            let mut say = |line: String| println!("{line}");
            if args.abort {
                let options = options(global, &args.topology);
                let report = shardline_ops::reshard::abort(&fleet, &options, &mut say)
                    .await
                    .flags()?;
                print_report(args.json, &report, report.text())?;
                return Ok(ExitCode::SUCCESS);
            }
            let Some(to) = args.to else {
                return Err(shardline_ops::Usage(
                    "topology reshard needs --to M (or --abort)".into(),
                )
                .into());
            };
            if args.plan {
                let report = shardline_ops::reshard::plan(&fleet, to).await.flags()?;
                print_report(args.json, &report, report.text())?;
            } else {
                let options = options(global, &args.topology);
                let report = shardline_ops::reshard::run(&fleet, to, &options, &mut say)
                    .await
                    .flags()?;
                print_report(args.json, &report, report.text())?;
            }
            Ok(ExitCode::SUCCESS)
        }
        TopologyCommand::Status(args) => {
            let config = StatusConfig {
                thresholds: Thresholds {
                    warn: args.backlog_warn,
                    page: args.backlog_page,
                },
                dlq_browse: Some(args.dlq_browse),
            };
            let report = topology::status(&fleet, &config).await.flags()?;
            if args.json {
                println!("{}", report.json());
            } else {
                crate::out::text(&report.table());
            }
            Ok(if report.needs_attention() {
                ExitCode::from(EXIT_ATTENTION)
            } else {
                ExitCode::SUCCESS
            })
        }
    }
}
