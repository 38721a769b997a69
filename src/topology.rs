//! `shardline topology apply|status`: declare the exchanges and queues, and read
//! them back.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use shardline_topology::declare::{self, QueueType, TopologyOptions};
use shardline_topology::{Names, ShardStatus};
use shardline_worker::metrics::unix_ms;
use shardline_worker::status::{self, Level, ShardReport, Thresholds};

use crate::{EXIT_ATTENTION, GlobalArgs};

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Declare exchanges, shard queues, bindings and the DLQ (idempotent).
    Apply(ApplyArgs),
    /// Per shard: depth, consumers, owner, backlog age and level; DLQ depth by
    /// reason. Exit code 3 when a shard is at PAGE or has events and no consumer.
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
    /// Backlog age from which a shard is at WARN.
    #[arg(long, env = "SHARDLINE_BACKLOG_WARN", default_value = "30s", value_parser = humantime::parse_duration)]
    pub backlog_warn: Duration,
    /// Backlog age from which a shard is at PAGE (exit code 3).
    #[arg(long, env = "SHARDLINE_BACKLOG_PAGE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub backlog_page: Duration,
    /// Dead letters read (and requeued) at most to count them by reason.
    #[arg(long, default_value_t = 1000)]
    pub dlq_browse: u32,
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
    let url = global.amqp_url.to_string();
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

/// One shard as `topology status` reports it.
#[derive(Debug, Clone, PartialEq)]
struct ShardLine {
    shard: u16,
    queue: ShardStatus,
    /// The owner's status from Redis, when fresh (written within the TTL).
    report: Option<ShardReport>,
    /// Backlog age now, from the report.
    backlog_age: Option<Duration>,
    level: Option<Level>,
}

impl ShardLine {
    fn new(
        shard: u16,
        queue: ShardStatus,
        report: Option<ShardReport>,
        now_ms: u64,
        t: &Thresholds,
    ) -> Self {
        let backlog_age = report.as_ref().map(|r| r.backlog_age_at(now_ms));
        Self {
            shard,
            queue,
            level: backlog_age.map(|age| Level::of(age, t)),
            report,
            backlog_age,
        }
    }

    /// Events wait and no worker consumes the shard.
    fn unconsumed(&self) -> bool {
        self.queue.messages > 0 && self.queue.consumers == 0
    }

    fn note(&self) -> &'static str {
        match (&self.report, self.queue.consumers, self.queue.messages) {
            (_, 0, m) if m > 0 => "no consumer: events are not moving",
            (_, 0, _) => "no consumer",
            (None, _, m) if m > 0 => {
                "messages but no fresh status (worker without status, or just started)"
            }
            (None, _, _) => "no fresh status",
            _ => "",
        }
    }
}

/// Dead-letter queue depth and, from browsing it, letters by reason.
#[derive(Debug, Clone, PartialEq)]
struct DlqLine {
    queue: ShardStatus,
    by_reason: BTreeMap<String, u64>,
    /// Letters read to count by reason (all of them unless over the limit).
    browsed: u64,
}

async fn status(global: &GlobalArgs, args: StatusArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.backlog_page >= args.backlog_warn,
        "--backlog-page must not be below --backlog-warn"
    );
    let thresholds = Thresholds {
        warn: args.backlog_warn,
        page: args.backlog_page,
    };
    let names = global.names();
    let url = global.amqp_url.to_string();
    let conn = shardline_topology::connect(&global.amqp_url, "shardline topology status").await?;
    let mut queues = Vec::with_capacity(usize::from(global.shards.get()));
    for shard in global.shards.ids() {
        let queue = names.shard_queue(shard);
        let st = declare::queue_status(&conn, &queue)
            .await
            .with_context(|| format!("topology status on {url}"))?;
        queues.push((shard.get(), st));
    }
    let dlq = declare::queue_status(&conn, &names.dead_letter_queue)
        .await
        .with_context(|| format!("topology status on {url}"))?;
    let (by_reason, browsed) = browse_dead_letters(&conn, &names, args.dlq_browse)
        .await
        .with_context(|| format!("reading {} on {url}", names.dead_letter_queue))?;
    close(&conn).await;
    let dlq = DlqLine {
        queue: dlq,
        by_reason,
        browsed,
    };

    let shard_ids: Vec<_> = global.shards.ids().collect();
    let (reports, redis_error) = match read_reports(global, &shard_ids).await {
        Ok(reports) => (reports, None),
        Err(e) => (vec![None; shard_ids.len()], Some(e)),
    };
    let now = unix_ms();
    let shards: Vec<ShardLine> = queues
        .into_iter()
        .zip(reports)
        .map(|((shard, queue), report)| ShardLine::new(shard, queue, report, now, &thresholds))
        .collect();
    if args.json {
        println!(
            "{}",
            status_json(&shards, &dlq, &thresholds, redis_error.as_deref())
        );
    } else {
        print!(
            "{}",
            status_table(&url, &shards, &dlq, &thresholds, redis_error.as_deref())
        );
    }
    Ok(if needs_attention(&shards) {
        ExitCode::from(EXIT_ATTENTION)
    } else {
        ExitCode::SUCCESS
    })
}

/// A shard at PAGE, or events waiting with nobody consuming them.
fn needs_attention(shards: &[ShardLine]) -> bool {
    shards
        .iter()
        .any(|s| s.level == Some(Level::Page) || s.unconsumed())
}

/// The shard status reports the workers wrote to Redis.
async fn read_reports(
    global: &GlobalArgs,
    shards: &[shardline_topology::ShardId],
) -> Result<Vec<Option<ShardReport>>, String> {
    let read = async {
        let mut conn = global.redis().await?;
        status::read(&mut conn, &global.redis_prefix, shards)
            .await
            .map_err(|e| global.redis_url.scrub(&e.to_string()))
    };
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(result) => result,
        Err(_) => Err("timed out".into()),
    }
}

/// Counts dead letters by `x-fail-reason`, reading at most `limit` of them
/// without acking and returning them to the queue in their order
/// ([`crate::dlq::browse`]).
async fn browse_dead_letters(
    conn: &lapin::Connection,
    names: &Names,
    limit: u32,
) -> anyhow::Result<(BTreeMap<String, u64>, u64)> {
    let letters = crate::dlq::browse(conn, names, u64::from(limit)).await?;
    let mut by_reason = BTreeMap::new();
    for letter in &letters {
        *by_reason.entry(letter.reason.clone()).or_insert(0) += 1;
    }
    Ok((by_reason, letters.len() as u64))
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

fn status_json(
    shards: &[ShardLine],
    dlq: &DlqLine,
    t: &Thresholds,
    redis_error: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({
        "shards": shards.iter().map(|s| serde_json::json!({
            "shard": s.shard,
            "queue": s.queue.queue,
            "messages": s.queue.messages,
            "consumers": s.queue.consumers,
            "owner": s.report.as_ref().map(|r| r.owner.as_str()),
            "backlog_age_seconds": s.backlog_age.map(secs),
            "level": s.level.map(Level::as_str),
            "inflight_age_seconds": s.report.as_ref().and_then(|r| r.inflight_age_seconds),
            "held_events": s.report.as_ref().map(|r| r.held_events),
            "status_updated_at_ms": s.report.as_ref().map(|r| r.updated_at_ms),
            "note": Some(s.note()).filter(|n| !n.is_empty()),
        })).collect::<Vec<_>>(),
        "dead_letter_queue": {
            "queue": dlq.queue.queue,
            "messages": dlq.queue.messages,
            "consumers": dlq.queue.consumers,
            "by_reason": dlq.by_reason,
            "browsed": dlq.browsed,
        },
        "thresholds": {
            "warn_seconds": t.warn.as_secs_f64(),
            "page_seconds": t.page.as_secs_f64(),
        },
        "status_error": redis_error,
        "needs_attention": needs_attention(shards),
    })
}

fn status_table(
    url: &str,
    shards: &[ShardLine],
    dlq: &DlqLine,
    t: &Thresholds,
    redis_error: Option<&str>,
) -> String {
    let width = shards
        .iter()
        .map(|s| s.queue.queue.len())
        .chain([dlq.queue.queue.len(), "queue".len()])
        .max()
        .unwrap_or(5);
    let owner_width = shards
        .iter()
        .filter_map(|s| s.report.as_ref().map(|r| r.owner.len()))
        .chain(["owner".len()])
        .max()
        .unwrap_or(5);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{url}  (backlog WARN from {}, PAGE from {})",
        humantime::format_duration(t.warn),
        humantime::format_duration(t.page)
    );
    let _ = writeln!(
        out,
        "{:<5}  {:<width$}  {:>9}  {:>9}  {:<owner_width$}  {:>9}  {:<5}  note",
        "shard", "queue", "messages", "consumers", "owner", "backlog", "level"
    );
    let mut total = 0u64;
    for s in shards {
        total += u64::from(s.queue.messages);
        let owner = s.report.as_ref().map_or("-", |r| r.owner.as_str());
        let backlog = s.backlog_age.map_or_else(
            || "-".to_owned(),
            |age| format!("{:.1}s", age.as_secs_f64()),
        );
        let level = s.level.map_or("-", Level::as_str);
        let _ = writeln!(
            out,
            "{:<5}  {:<width$}  {:>9}  {:>9}  {owner:<owner_width$}  {backlog:>9}  {level:<5}  {}",
            s.shard,
            s.queue.queue,
            s.queue.messages,
            s.queue.consumers,
            s.note()
        );
    }
    let _ = writeln!(out, "{:<5}  {:<width$}  {total:>9}", "all", "");
    let _ = writeln!(
        out,
        "{:<5}  {:<width$}  {:>9}",
        "dlq", dlq.queue.queue, dlq.queue.messages
    );
    if !dlq.by_reason.is_empty() {
        let reasons: Vec<String> = dlq
            .by_reason
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        let partial = if dlq.browsed < u64::from(dlq.queue.messages) {
            format!(" (first {} letters)", dlq.browsed)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "dead letters by reason{partial}: {}",
            reasons.join(", ")
        );
    }
    if let Some(e) = redis_error {
        let _ = writeln!(
            out,
            "shard status unavailable (Redis: {e}): owner and backlog unknown"
        );
    }
    let paged: Vec<String> = shards
        .iter()
        .filter(|s| s.level == Some(Level::Page))
        .map(|s| s.shard.to_string())
        .collect();
    if !paged.is_empty() {
        let _ = writeln!(
            out,
            "PAGE: shard(s) {} behind by more than {}",
            paged.join(", "),
            humantime::format_duration(t.page)
        );
    }
    let unconsumed = shards.iter().filter(|s| s.queue.consumers == 0).count();
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

    fn report(shard: u16, backlog: f64, at: u64) -> ShardReport {
        ShardReport {
            shard,
            owner: "worker-a".into(),
            backlog_age_seconds: backlog,
            inflight_age_seconds: Some(backlog),
            held_events: 0,
            held: Vec::new(),
            updated_at_ms: at,
        }
    }

    fn dlq() -> DlqLine {
        DlqLine {
            queue: st("order.events.dlq", 2, 0),
            by_reason: BTreeMap::from([("handler".into(), 1), ("seq-gap".into(), 1)]),
            browsed: 2,
        }
    }

    #[test]
    fn status_table_totals_and_flags_unconsumed_shards() {
        let t = Thresholds::default();
        let now = 1_000_000;
        let shards = [
            ShardLine::new(
                0,
                st("order.events.shard.0", 3, 1),
                Some(report(0, 31.0, now)),
                now,
                &t,
            ),
            ShardLine::new(1, st("order.events.shard.1", 4, 0), None, now, &t),
        ];
        let table = status_table("amqp://h/", &shards, &dlq(), &t, None);
        assert!(table.contains("all"), "{table}");
        assert!(table.contains("        7"), "{table}");
        assert!(table.contains("no consumer"), "{table}");
        assert!(table.contains("1 of 2 shards"), "{table}");
        assert!(table.contains("worker-a"), "{table}");
        assert!(table.contains("WARN"), "{table}");
        assert!(table.contains("handler 1, seq-gap 1"), "{table}");
        let json = status_json(&shards, &dlq(), &t, None);
        assert_eq!(json["shards"][1]["messages"], 4);
        assert_eq!(json["shards"][0]["owner"], "worker-a");
        assert_eq!(json["shards"][0]["level"], "WARN");
        assert_eq!(json["shards"][0]["backlog_age_seconds"], 31.0);
        assert_eq!(json["shards"][1]["owner"], serde_json::Value::Null);
        assert_eq!(json["dead_letter_queue"]["messages"], 2);
        assert_eq!(json["dead_letter_queue"]["by_reason"]["seq-gap"], 1);
        // Shard 1 has events and no consumer.
        assert_eq!(json["needs_attention"], true);
    }

    #[test]
    fn attention_at_page_or_when_events_have_no_consumer() {
        let t = Thresholds {
            warn: Duration::from_secs(1),
            page: Duration::from_secs(2),
        };
        let now = 1_000_000;
        let line = |backlog: f64, messages, consumers| {
            ShardLine::new(
                0,
                st("q", messages, consumers),
                Some(report(0, backlog, now - 500)),
                now,
                &t,
            )
        };
        assert!(!needs_attention(&[line(0.0, 0, 1)]));
        assert!(!needs_attention(&[line(1.2, 5, 1)]));
        // 1.6 s reported half a second ago: 2.1 s now.
        assert!(needs_attention(&[line(1.6, 5, 1)]));
        assert!(needs_attention(&[line(0.0, 5, 0)]));
        let quiet = ShardLine::new(0, st("q", 0, 1), None, now, &t);
        assert!(!needs_attention(std::slice::from_ref(&quiet)));
        assert_eq!(quiet.note(), "no fresh status");
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
