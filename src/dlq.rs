//! `shardline dlq list|show|replay|purge|release|reindex`: flags to
//! [`shardline_ops::dlq`], its reports and progress printed as they come.

use crate::out::say;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use indicatif::ProgressBar;
use shardline_contract::OrderId;
use shardline_ops::dlq::Window;
use shardline_ops::{Event, ReplayConfig, Usage, dlq};
use tokio_util::sync::CancellationToken;

use crate::{EXIT_ATTENTION, Flags as _, GlobalArgs};

#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// Every dead letter (or the matching ones) and a summary by reason and by
    /// failure group, from the dead-letter index in Redis (the DLQ is not
    /// read; says "reindex needed" when the DLQ holds more letters).
    List(ListArgs),
    /// Headers and body of the dead letter whose `x-dead-letter-id` is ID.
    Show(ShowArgs),
    /// Republish the matching dead letters to their order's shard, per order in
    /// seq order, marked `x-shardline-replay`; each leaves the DLQ only once its
    /// republish is confirmed. Non-envelope bodies are skipped (they stay).
    Replay(ReplayArgs),
    /// Delete the matching dead letters (requires `--yes`).
    Purge(PurgeArgs),
    /// Lift the quarantine of an order (`worker --on-dead-letter quarantine`):
    /// its later events flow again; its dead letters stay in the DLQ.
    Release(ReleaseArgs),
    /// Rebuild the dead-letter index from the DLQ (read without taking, as
    /// `show` does): letters from before the index, after a Redis loss, and
    /// letters the broker dead-lettered itself.
    Reindex,
}

/// Which dead letters a command acts on (all of them without a filter).
#[derive(Debug, Clone, Default, Args)]
pub struct Filters {
    /// Only letters with this reason: their `x-fail-reason` (decode, invalid,
    /// handler, timeout, seq-gap, late, crash-loop, quarantined, control), the
    /// broker's `x-death` reason for letters it dead-lettered itself
    /// (delivery-limit, expired, maxlen, rejected), or `unknown` for letters
    /// without one.
    #[arg(long)]
    pub reason: Option<String>,
    /// Only letters whose envelope's `order_id` is this.
    #[arg(long)]
    pub order_id: Option<OrderId>,
    /// Only letters dead-lettered from this shard (`x-shard`).
    #[arg(long)]
    pub shard: Option<u16>,
    /// Only letters of this failure group (the id `dlq list` shows).
    #[arg(long)]
    pub group: Option<String>,
    /// At most this many matching letters (reading stops there).
    #[arg(long)]
    pub limit: Option<usize>,
}

impl From<Filters> for dlq::Filters {
    fn from(f: Filters) -> Self {
        Self {
            reason: f.reason,
            order_id: f.order_id,
            shard: f.shard,
            group: f.group,
            ids: None,
            limit: f.limit,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub filters: Filters,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// The letter's `x-dead-letter-id`.
    pub id: String,
}

#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub filters: Filters,
    /// Only print what would be replayed; the DLQ is left as it was.
    #[arg(long)]
    pub dry_run: bool,
    /// At most this many republishes per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// For a quarantined order, how long to wait for a worker to apply the
    /// replayed events before looking for successors that were quarantined
    /// meanwhile; also how long to wait for another replay of an order to end
    /// (its replay lock) before leaving the order's letters in the DLQ.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// Letters a pass over the DLQ may read past its last replay (holding
    /// them unacked) before it gives them back and starts again.
    #[arg(long, default_value_t = 100)]
    pub window: usize,
    /// Letters a pass may hold at most: when an order's next letter is not
    /// within this many of the DLQ's head, the replay stops and names it.
    #[arg(long, default_value_t = 10_000)]
    pub reach: usize,
}

#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    /// The quarantined order.
    #[arg(long)]
    pub order_id: OrderId,
}

#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    #[command(flatten)]
    pub filters: Filters,
    /// Really delete them.
    #[arg(long)]
    pub yes: bool,
}

pub(crate) async fn run(
    global: &GlobalArgs,
    cmd: DlqCommand,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let fleet = global.fleet();
    match cmd {
        DlqCommand::List(args) => {
            let report = dlq::list(&fleet, &args.filters.into()).await.flags()?;
            if args.json {
                println!("{:#}", report.json());
            } else {
                crate::out::text(&report.table());
            }
        }
        DlqCommand::Show(args) => {
            crate::out::text(&dlq::show(&fleet, &args.id).await.flags()?.text())
        }
        DlqCommand::Replay(args) => return replay(&fleet, args, &shutdown).await,
        DlqCommand::Purge(args) if !args.yes => anyhow::bail!(Usage(
            "`dlq purge` deletes dead letters for good; add --yes to do it (see `dlq list` first)"
                .into()
        )),
        DlqCommand::Purge(args) => {
            let report = dlq::purge(&fleet, &args.filters.into()).await.flags()?;
            for letter in &report.removed {
                say!("removed {letter}");
            }
            let removed = report.removed.len();
            say!(
                "purged {removed} dead letter(s) of {} read; {} left in the DLQ",
                report.read,
                report.read - removed
            );
        }
        DlqCommand::Reindex => {
            let report = dlq::reindex(&fleet, &shutdown).await.flags()?;
            say!(
                "reindexed {} dead letter(s) of {} read ({} without a dead-letter id, given a derived one); {} stale entr(y/ies) removed; {} failure group(s){}",
                report.indexed,
                report.read,
                report.derived,
                report.removed,
                report.groups,
                if report.cancelled {
                    "; cancelled before the end of the queue"
                } else {
                    ""
                }
            );
        }
        DlqCommand::Release(args) => {
            let report = dlq::release(&fleet, &args.order_id).await.flags()?;
            let order = &report.order_id;
            match report.held_by.first() {
                None => say!("order {order} was not quarantined; nothing to release"),
                Some(id) => say!(
                    "released order {order}: it was quarantined behind dead letter {id} ({} dead letter(s) held it); its later events flow again",
                    report.held_by.len()
                ),
            }
            say!(
                "{} dead letter(s) of order {order} stay in the DLQ (`dlq replay --order-id {order}` applies them where they land, `dlq purge --order-id {order} --yes` drops them)",
                report.letters_in_dlq
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn replay(
    fleet: &shardline_ops::Fleet,
    args: ReplayArgs,
    shutdown: &CancellationToken,
) -> anyhow::Result<ExitCode> {
    let config = ReplayConfig {
        filters: args.filters.into(),
        dry_run: args.dry_run,
        rate: args.rate,
        wait: args.wait,
        window: Window {
            size: args.window,
            reach: args.reach,
        },
        ..ReplayConfig::default()
    };
    let mut bar = None;
    let report = dlq::replay(fleet, &config, shutdown, |e| print_event(e, &mut bar)).await;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let report = report.flags()?;
    for order in &report.locked_elsewhere {
        say!(
            "order {order}: another replay was replaying it for longer than --wait; its letters stay in the DLQ (run again later)"
        );
    }
    if report.dry_run {
        for (letter, shard) in &report.planned {
            say!("would replay {letter} to shard {shard}");
        }
        say!(
            "dry run: {} would be replayed, {} skipped, of {} read; nothing changed",
            report.planned.len(),
            report.skipped.len(),
            report.read
        );
    } else if report.matching == 0 {
        say!(
            "nothing to replay: 0 replayable of {} read ({} skipped)",
            report.read,
            report.skipped.len()
        );
    }
    Ok(if report.needs_attention() {
        ExitCode::from(EXIT_ATTENTION)
    } else {
        ExitCode::SUCCESS
    })
}

/// Prints a replay's progress; a bar on stderr (when it is a terminal)
/// counts the letters of each pass.
fn print_event(event: Event, bar: &mut Option<ProgressBar>) {
    if let Event::Replayed { .. } = &event {
        let line = event.to_string();
        match bar {
            Some(bar) => {
                bar.inc(1);
                bar.suspend(|| say!("{line}"));
            }
            None => say!("{line}"),
        }
        return;
    }
    if let Some(bar) = bar.take() {
        bar.finish_and_clear();
    }
    if let Event::Replaying { letters } = event {
        *bar = Some(crate::progress::bar(letters as u64, "dead letters"));
        return;
    }
    say!("{event}");
}
