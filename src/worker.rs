//! `shardline worker`: flags → `shardline_worker::Config`, then run until stopped.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use shardline_contract::QueueType;
use shardline_contract::ShardSet;
use shardline_ops::Usage;
use shardline_worker::{
    BreakerPolicy, Config, ConfigError, FleetPolicy, GroupCommit, HandlerSpecError, OnDeadLetter,
    OnGap, RetryPolicy, Thresholds, WorkerError,
};
use tokio_util::sync::CancellationToken;

use crate::GlobalArgs;

/// A library default as `--help` shows it.
fn shown(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// Shards to consume: `all`, or ids and ranges such as `0-3,7` (shards held
    /// by another worker are waited for: standby); or `auto`: join the elastic
    /// fleet, which balances the shards over its members.
    #[arg(long, default_value = "all")]
    pub assign: AssignArg,
    /// `--assign auto`: this member's id, stable across restarts (on
    /// Kubernetes the pod name). Default the worker name.
    #[arg(long, help_heading = "Elastic fleet (--assign auto)")]
    pub member_id: Option<String>,
    /// A member whose lease lapsed is gone: its shards are reassigned at once.
    #[arg(long, default_value = shown(FleetPolicy::new("").lease), value_parser = humantime::parse_duration, help_heading = "Elastic fleet (--assign auto)")]
    pub member_lease: Duration,
    /// How often the lease is renewed and a rebalance step runs.
    #[arg(long, default_value = shown(FleetPolicy::new("").heartbeat), value_parser = humantime::parse_duration, help_heading = "Elastic fleet (--assign auto)")]
    pub member_heartbeat: Duration,
    /// How long a new member holds its lease before it is given shards (a
    /// crash-looping member does not reshuffle the fleet).
    #[arg(long, default_value = shown(FleetPolicy::new("").settle), value_parser = humantime::parse_duration, help_heading = "Elastic fleet (--assign auto)")]
    pub member_settle: Duration,
    /// Shards moved away from live members per rebalance step.
    #[arg(long, default_value_t = FleetPolicy::new("").max_moves, help_heading = "Elastic fleet (--assign auto)")]
    pub rebalance_max_moves: usize,
    /// `http(s)://…` (POST each event), `log` (JSON lines on stdout) or `noop`.
    #[arg(long)]
    pub handler: shardline_connect::redact::Redacted,
    /// Events read ahead per shard.
    #[arg(long, default_value_t = Config::default().prefetch)]
    pub prefetch: u16,
    /// Handler calls in flight per shard, never two of one order (1: serial).
    /// More lifts a slow downstream's ceiling of one call per latency per shard;
    /// a crash then repeats up to this many calls per shard.
    #[arg(long, default_value_t = Config::default().concurrency)]
    pub concurrency: u16,
    /// Group commit (serial shards): up to N deliveries already read ahead
    /// are claimed in one Redis call, run in turn, then committed and acked
    /// together; a crash may repeat up to N calls per shard. `auto`: N is the
    /// prefetch (at most 32), off with --concurrency above 1, quarantine mode
    /// or --max-rate. 1: strict (a crash repeats at most one call per shard).
    #[arg(long, value_name = "auto|N", default_value_t = Config::default().group_commit)]
    pub group_commit: GroupCommit,
    /// At most R handler calls per second for this worker process, shared by
    /// its shards (off unless given). Waiting for a call's turn is not an attempt.
    #[arg(long, value_name = "R")]
    pub max_rate: Option<f64>,
    /// Handler attempts per event, the first included.
    #[arg(long, default_value_t = RetryPolicy::default().max_attempts, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Delay after the first failed attempt.
    #[arg(long, default_value = shown(RetryPolicy::default().base), value_parser = humantime::parse_duration)]
    pub retry_base: Duration,
    /// Longest delay between attempts.
    #[arg(long, default_value = shown(RetryPolicy::default().cap), value_parser = humantime::parse_duration)]
    pub retry_cap: Duration,
    /// Growth of the delay per attempt.
    #[arg(long, default_value_t = RetryPolicy::default().factor)]
    pub retry_factor: f64,
    /// Random variation of each delay, as a fraction (0.3 = ±30%).
    #[arg(long, default_value_t = RetryPolicy::default().jitter)]
    pub retry_jitter: f64,
    /// Longest delay a downstream's `Retry-After` (on 429 and 503) may set
    /// for that event's next attempt.
    #[arg(long, default_value = shown(RetryPolicy::default().retry_after_cap), value_parser = humantime::parse_duration)]
    pub retry_after_cap: Duration,
    /// The downstream breaker: `on` pauses every shard while the downstream
    /// is out, so that an outage fills no DLQ; `off` counts every failure
    /// toward --max-attempts.
    #[arg(long, value_enum, default_value_t = BreakerArg::On, help_heading = "Downstream breaker")]
    pub breaker: BreakerArg,
    /// Calls are judged over this much recent time (also how long an event
    /// that used its attempts waits for evidence of an outage).
    #[arg(long, default_value = shown(BreakerPolicy::default().window), value_parser = humantime::parse_duration, help_heading = "Downstream breaker")]
    pub breaker_window: Duration,
    /// Retryable failures within the window before the breaker may open
    /// (they must also come from at least 3 orders).
    #[arg(long, default_value_t = BreakerPolicy::default().min_failures, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Downstream breaker")]
    pub breaker_min_failures: u32,
    /// Share of the window's calls that must have failed for it to open.
    #[arg(long, default_value_t = BreakerPolicy::default().failure_ratio, help_heading = "Downstream breaker")]
    pub breaker_failure_ratio: f64,
    /// Wait after opening before one probe call.
    #[arg(long, default_value = shown(BreakerPolicy::default().cooldown), value_parser = humantime::parse_duration, help_heading = "Downstream breaker")]
    pub breaker_cooldown: Duration,
    /// The cooldown doubles after each failed probe up to this: calls resume
    /// at most this long after the downstream recovers.
    #[arg(long, default_value = shown(BreakerPolicy::default().cooldown_max), value_parser = humantime::parse_duration, help_heading = "Downstream breaker")]
    pub breaker_cooldown_max: Duration,
    /// HTTP answers that are the downstream's configuration, not the event's,
    /// when three or more orders get the same one within the breaker window
    /// (a rotated token, a wrong path): calls pause instead of dead-lettering
    /// the stream. Until then they are retried; other 4xx are the event's.
    #[arg(long, value_name = "CODES", value_delimiter = ',', default_value = "401,403,404,405,410", value_parser = clap::value_parser!(u16).range(400..500), help_heading = "Downstream breaker")]
    pub config_statuses: Vec<u16>,
    /// Longest one handler attempt may take (then it counts as a retryable failure).
    #[arg(long, default_value = shown(Config::default().handler_timeout), value_parser = humantime::parse_duration)]
    pub handler_timeout: Duration,
    /// On stop, how long the in-flight event may still take.
    #[arg(long, default_value = shown(Config::default().drain_timeout), value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long a processed event's dedup key is kept.
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    pub dedup_ttl: Duration,
    /// Largest accepted body; larger ones, and bodies nested deeper than 64
    /// levels, are dead-lettered `invalid`.
    #[arg(long, default_value_t = Config::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// How often a standby retries taking a shard another worker holds.
    #[arg(long, default_value = shown(Config::default().standby_retry), value_parser = humantime::parse_duration)]
    pub standby_retry: Duration,
    /// Shard queue type, as applied by `topology apply` (quorum implies
    /// single-active-consumer).
    #[arg(long, default_value = "classic")]
    pub queue_type: QueueType,
    /// The shard queues were applied with `--single-active-consumer`.
    #[arg(long)]
    pub single_active_consumer: bool,
    /// Consume with `--single-active-consumer` although the broker is older
    /// than 3.10.13 (3.11.5), whose classic-queue single-active-consumer can
    /// crash the queue when the active consumer changes (rabbitmq-server#5460).
    #[arg(long)]
    pub accept_classic_sac_risk: bool,
    /// How long an event that arrived ahead of its order's sequence waits for
    /// the gap to fill (from its arrival).
    #[arg(long, default_value = shown(Config::default().gap_grace), value_parser = humantime::parse_duration)]
    pub gap_grace: Duration,
    /// How long the first event of an unknown order with seq > 1 waits for
    /// earlier ones before it is accepted as the start.
    #[arg(long, default_value = shown(Config::default().start_grace), value_parser = humantime::parse_duration)]
    pub start_grace: Duration,
    /// Events held per shard at most (also the consumer window's reserve).
    #[arg(long, default_value_t = Config::default().max_held, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_held: u16,
    /// Bytes of event bodies held per shard at most: held, read ahead and
    /// waiting to run. At the bound the shard takes no new delivery (held
    /// events stay; gaps are given up only at `--max-held` or their grace);
    /// one event larger than the bound is taken when nothing else is held.
    #[arg(long, default_value_t = Config::default().max_held_bytes, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_held_bytes: usize,
    /// Held events whose gap never filled: `dead-letter` (reason `seq-gap`) or
    /// `apply` (skip the gap).
    #[arg(long, value_enum, default_value_t = OnGapArg::DeadLetter)]
    pub on_gap: OnGapArg,
    /// An order's later events once one of its events is dead-lettered:
    /// `continue` (applied; a replay lands out of order) or `quarantine`
    /// (dead-lettered `quarantined` until the order is replayed or released).
    #[arg(long, value_enum, default_value_t = OnDeadLetterArg::Continue)]
    pub on_dead_letter: OnDeadLetterArg,
    /// How long the event kinds processed per order are kept for `shardline
    /// reconcile` (default: the longer of 24h and --dedup-ttl; 0s records none).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub kinds_ttl: Option<Duration>,
    /// Handler starts that end with the process dying before an event is
    /// dead-lettered `crash-loop`.
    #[arg(long, default_value_t = Config::default().max_deliveries, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_deliveries: u32,
    /// Quorum queues: the `x-delivery-limit` they were applied with (at least
    /// --max-deliveries + 2: the worker dead-letters at the limit − 1).
    #[arg(long, default_value_t = shardline_connect::declare::DEFAULT_DELIVERY_LIMIT)]
    pub delivery_limit: u32,
    /// Backlog age (oldest unprocessed event of a shard) from which the shard
    /// is at WARN (`shardline_backlog_level` 1).
    #[arg(long, default_value = shown(Thresholds::default().warn), value_parser = humantime::parse_duration)]
    pub backlog_warn: Duration,
    /// Backlog age from which the shard is at PAGE (`shardline_backlog_level` 2).
    #[arg(long, default_value = shown(Thresholds::default().page), value_parser = humantime::parse_duration)]
    pub backlog_page: Duration,
    /// An in-flight event worked on longer than this marks its shard stuck
    /// (`shardline_stuck`).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub stuck_after: Duration,
    /// Name in logs, consumer tags and the broker's connection list (cut at
    /// 64 bytes there); at most 244 bytes (default host-pid).
    #[arg(long)]
    pub worker_name: Option<String>,
}

/// `--assign`: a fixed shard set, or `auto`.
#[derive(Debug, Clone)]
pub(crate) enum AssignArg {
    Auto,
    Fixed(ShardSet),
}

impl std::str::FromStr for AssignArg {
    type Err = shardline_contract::shard::ShardError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(Self::Auto)
        } else {
            s.parse().map(Self::Fixed)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BreakerArg {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum OnGapArg {
    DeadLetter,
    Apply,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum OnDeadLetterArg {
    Continue,
    Quarantine,
}

impl From<OnDeadLetterArg> for OnDeadLetter {
    fn from(arg: OnDeadLetterArg) -> Self {
        match arg {
            OnDeadLetterArg::Continue => Self::Continue,
            OnDeadLetterArg::Quarantine => Self::Quarantine,
        }
    }
}

impl WorkerArgs {
    /// The library configuration these flags describe, checked by the
    /// library ([`Config::validate`]) and reported in flag names.
    pub(crate) fn config(&self, global: &GlobalArgs) -> anyhow::Result<Config> {
        let shards = match &self.assign {
            AssignArg::Auto => &ShardSet::All,
            AssignArg::Fixed(set) => set,
        };
        let assign = shards
            .resolve(global.shards)
            .map_err(|e| Usage(format!("--assign: {e}")));
        let worker_name = self
            .worker_name
            .clone()
            .unwrap_or_else(Config::host_pid_name);
        let fleet = matches!(self.assign, AssignArg::Auto).then(|| FleetPolicy {
            member_id: self
                .member_id
                .clone()
                .unwrap_or_else(|| worker_name.clone()),
            lease: self.member_lease,
            heartbeat: self.member_heartbeat,
            settle: self.member_settle,
            max_moves: self.rebalance_max_moves,
        });
        let exclusive = shardline_connect::TopologyOptions {
            shards: global.shards,
            single_active_consumer: self.single_active_consumer,
            queue_type: self.queue_type,
            ..Default::default()
        }
        .exclusive_consumers();
        let mut config = Config {
            amqp: global.amqp_url.clone(),
            redis: global.redis_url.clone(),
            redis_prefix: global.redis_prefix.clone(),
            names: global.names(),
            shards: global.shards,
            assign: assign.clone().unwrap_or_default(),
            prefetch: self.prefetch,
            concurrency: self.concurrency,
            group_commit: self.group_commit,
            max_rate: self.max_rate,
            exclusive,
            retry: RetryPolicy {
                max_attempts: self.max_attempts,
                base: self.retry_base,
                factor: self.retry_factor,
                cap: self.retry_cap,
                jitter: self.retry_jitter,
                retry_after_cap: self.retry_after_cap,
            },
            breaker: BreakerPolicy {
                enabled: self.breaker == BreakerArg::On,
                window: self.breaker_window,
                min_failures: self.breaker_min_failures,
                failure_ratio: self.breaker_failure_ratio,
                cooldown: self.breaker_cooldown,
                cooldown_max: self.breaker_cooldown_max,
            },
            handler_timeout: self.handler_timeout,
            drain_timeout: self.drain_timeout,
            dedup_ttl: self.dedup_ttl,
            max_body_bytes: self.max_body_bytes,
            standby_retry: self.standby_retry,
            worker_name,
            fleet,
            gap_grace: self.gap_grace,
            start_grace: self.start_grace,
            max_held: self.max_held,
            max_held_bytes: self.max_held_bytes,
            on_gap: match self.on_gap {
                OnGapArg::DeadLetter => OnGap::DeadLetter,
                OnGapArg::Apply => OnGap::Apply,
            },
            on_dead_letter: self.on_dead_letter.into(),
            kinds_ttl: self.kinds_ttl,
            max_deliveries: self.max_deliveries,
            allow_shard_mismatch: global.allow_shard_mismatch,
            accept_classic_sac_risk: self.accept_classic_sac_risk,
            management: global.management_url.clone(),
            delivery_limit: (self.queue_type == QueueType::Quorum).then_some(self.delivery_limit),
            metrics_addr: global.metrics_addr,
            metrics_limits: shardline_worker::Inbound::default(),
            backlog: Thresholds {
                warn: self.backlog_warn,
                page: self.backlog_page,
            },
            stuck_after: self.stuck_after,
        };
        // A shard selection that did not parse is reported after the other
        // settings, as it always was.
        match config.validate() {
            Err(e) if e.field != "assign" || assign.is_ok() => return Err(refused(&e)),
            _ => config.assign = assign?,
        }
        Ok(config)
    }
}

/// The flag that sets a [`Config`] field.
fn flag(field: &'static str) -> String {
    let name = match field {
        "retry.jitter" => "retry-jitter",
        "retry.factor" => "retry-factor",
        "retry.max_attempts" => "max-attempts",
        "backlog.warn" => "backlog-warn",
        "backlog.page" => "backlog-page",
        "fleet.lease" => "member-lease",
        "fleet.member_id" => "member-id",
        other => return format!("--{}", other.replace(['_', '.'], "-")),
    };
    format!("--{name}")
}

/// A configuration the library refused, in flag names: a usage error.
fn refused(e: &ConfigError) -> anyhow::Error {
    Usage(e.describe(flag)).into()
}

/// A library error, in flag names where it names a setting.
fn in_flags(e: WorkerError) -> anyhow::Error {
    match e {
        WorkerError::Config(e) => refused(&e),
        WorkerError::MetricsAddr(e) => anyhow::anyhow!("--metrics-addr {e}"),
        other => other.into(),
    }
}

/// A `--handler` value that names no handler: a usage error.
fn handler_error(e: HandlerSpecError) -> anyhow::Error {
    match e {
        HandlerSpecError::Unknown(spec) => Usage(format!(
            "--handler must be an http(s):// URL, `log` or `noop`, got `{spec}`"
        )),
        HandlerSpecError::Url { url, cause } => {
            Usage(format!("--handler URL `{url}` is not valid: {cause}"))
        }
        other => return other.into(),
    }
    .into()
}

/// The handler `--handler` names; an HTTP one with `--config-statuses`.
fn handler_of(
    args: &WorkerArgs,
) -> Result<std::sync::Arc<dyn shardline_worker::Handler>, HandlerSpecError> {
    let spec = args.handler.expose();
    if spec.starts_with("http://") || spec.starts_with("https://") {
        let http = shardline_worker::Http::new(spec)?
            .with_config_statuses(args.config_statuses.iter().copied());
        return Ok(std::sync::Arc::new(http));
    }
    shardline_worker::from_spec(spec)
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: WorkerArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let config = args.config(global)?;
    let handler = handler_of(&args).map_err(handler_error)?;
    shardline_worker::run(config, handler, shutdown)
        .await
        .map_err(in_flags)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        global: GlobalArgs,
        #[command(flatten)]
        worker: WorkerArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<Config> {
        let cli = Cli::try_parse_from(["shardline", "--handler", "noop"].iter().chain(args))?;
        cli.worker.config(&cli.global)
    }

    #[test]
    fn flag_defaults_are_the_library_defaults() {
        let parsed = config(&[]).unwrap();
        let library = Config::default();
        assert_eq!(parsed.retry, library.retry);
        assert_eq!(parsed.dedup_ttl, library.dedup_ttl);
        assert_eq!(parsed.stuck_after, library.stuck_after);
        assert_eq!(parsed.backlog, library.backlog);
        assert_eq!(parsed.concurrency, library.concurrency);
        assert_eq!(parsed.group_commit, library.group_commit);
        assert_eq!(
            (parsed.gap_grace, parsed.start_grace, parsed.max_held),
            (library.gap_grace, library.start_grace, library.max_held)
        );
        assert_eq!(parsed.max_held_bytes, library.max_held_bytes);
    }

    #[test]
    fn refusals_name_the_flags() {
        for (args, message) in [
            (
                ["--retry-jitter", "1.5"],
                "--retry-jitter must be in [0, 1), got 1.5",
            ),
            (
                ["--retry-factor", "0.5"],
                "--retry-factor must be at least 1, got 0.5",
            ),
            (["--prefetch", "0"], "--prefetch must be at least 1"),
            (["--concurrency", "0"], "--concurrency must be at least 1"),
            (["--max-rate", "0"], "--max-rate must be in (0, ∞), got 0"),
            (
                ["--backlog-warn", "5m"],
                "--backlog-page must not be below --backlog-warn",
            ),
        ] {
            assert_eq!(config(&args).unwrap_err().to_string(), message);
        }
        for (args, message) in [
            (
                ["--group-commit", "0", "--prefetch", "1"],
                "--group-commit must be at least 1",
            ),
            (
                ["--group-commit", "8", "--concurrency", "4"],
                "--group-commit cannot be combined with --concurrency above 1",
            ),
            (
                ["--group-commit", "8", "--on-dead-letter", "quarantine"],
                "--group-commit cannot be combined with --on-dead-letter quarantine",
            ),
        ] {
            assert_eq!(config(&args).unwrap_err().to_string(), message);
        }
    }

    #[test]
    fn group_commit_is_auto_or_a_count() {
        let size = |args: &[&str]| config(args).unwrap().grouping().size;
        assert_eq!(size(&[]), 1, "the default prefetch groups nothing");
        assert_eq!(size(&["--prefetch", "8"]), 8);
        assert_eq!(size(&["--prefetch", "100"]), GroupCommit::AUTO_MAX);
        assert_eq!(size(&["--prefetch", "32", "--group-commit", "1"]), 1);
        assert_eq!(size(&["--prefetch", "32", "--group-commit", "AUTO"]), 32);
        assert_eq!(size(&["--prefetch", "2", "--group-commit", "6"]), 6);
        // Where a group cannot apply, auto turns itself off; it never refuses.
        for off in [
            ["--concurrency", "4"],
            ["--on-dead-letter", "quarantine"],
            ["--max-rate", "100"],
        ] {
            let args = [&["--prefetch", "32"][..], &off[..]].concat();
            let grouping = config(&args).unwrap().grouping();
            assert_eq!(grouping.size, 1, "{off:?}");
            assert!(grouping.off_because.is_some(), "{off:?}");
        }
        let bad = Cli::try_parse_from(["shardline", "--handler", "noop", "--group-commit", "many"]);
        assert!(bad.unwrap_err().to_string().contains("--group-commit"));
    }

    /// The worker command lines of the README and docs/ (fenced code, not
    /// the synopses with `[…]`), with their placeholders filled in.
    fn documented_worker_commands() -> Vec<Vec<String>> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut pages = vec![root.join("README.md")];
        let mut folders = vec![root.join("docs")];
        while let Some(folder) = folders.pop() {
            for entry in std::fs::read_dir(folder).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    folders.push(path);
                } else {
                    pages.push(path);
                }
            }
        }
        let mut commands = Vec::new();
        for page in pages
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
        {
            let text = std::fs::read_to_string(page).unwrap().replace(" \\\n", " ");
            let mut fenced = false;
            for line in text.lines() {
                if line.trim_start().starts_with("```") {
                    fenced = !fenced;
                    continue;
                }
                let Some(at) = line.find("shardline ").filter(|_| fenced) else {
                    continue;
                };
                let command = line[at..].split(" #").next().unwrap_or_default();
                let command = command
                    .trim_end_matches(['&', ' '])
                    .replace("http://…", "http://127.0.0.1:8080/events")
                    .replace("--handler URL", "--handler http://127.0.0.1:8080/events")
                    .replace("\"$POD_NAME\"", "pod-0");
                if command.contains('[') || command.contains('…') {
                    continue;
                }
                let words = shlex::split(&command).unwrap();
                if words.iter().any(|w| w == "worker") {
                    commands.push(words.into_iter().filter(|w| w != "worker").collect());
                }
            }
        }
        commands
    }

    #[test]
    fn the_body_limits_help_names_the_nesting_limit() {
        use clap::CommandFactory as _;
        let max = shardline_contract::envelope::MAX_DEPTH;
        let cli = Cli::command();
        let help = cli
            .get_arguments()
            .find(|a| a.get_id() == "max_body_bytes")
            .and_then(|a| a.get_help())
            .map(ToString::to_string)
            .unwrap();
        assert!(
            help.contains(&format!("nested deeper than {max} levels")),
            "{help}"
        );
    }

    #[test]
    fn the_config_statuses_default_is_the_handlers() {
        let cli = Cli::try_parse_from(["shardline", "--handler", "noop"]).unwrap();
        assert_eq!(
            cli.worker.config_statuses,
            shardline_worker::handler::DEFAULT_CONFIG_STATUSES
        );
    }

    #[test]
    fn every_flag_set_the_documentation_shows_starts() {
        let commands = documented_worker_commands();
        assert!(commands.len() >= 3, "{commands:?}");
        for words in commands {
            let cli = Cli::try_parse_from(&words)
                .unwrap_or_else(|e| panic!("{words:?} does not parse: {e}"));
            cli.worker
                .config(&cli.global)
                .unwrap_or_else(|e| panic!("{words:?} is refused: {e}"));
            shardline_worker::from_spec(cli.worker.handler.expose())
                .unwrap_or_else(|e| panic!("{words:?}: the handler is refused: {e}"));
        }
    }
}
