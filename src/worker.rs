//! `shardline worker`: flags → `shardline_worker::Config`, then run until stopped.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use shardline_topology::{QueueType, ShardSet};
use shardline_worker::status::Thresholds;
use shardline_worker::{Config, OnDeadLetter, OnGap, RetryPolicy, handler};
use tokio_util::sync::CancellationToken;

use crate::GlobalArgs;

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Shards to consume: `all`, or ids and ranges such as `0-3,7`. Shards held by
    /// another worker are waited for (standby).
    #[arg(long, env = "SHARDLINE_ASSIGN", default_value = "all")]
    pub assign: ShardSet,
    /// `http(s)://…` (POST each event), `log` (JSON lines on stdout) or `noop`.
    #[arg(long, env = "SHARDLINE_HANDLER")]
    pub handler: String,
    /// Events read ahead per shard; processing stays serial.
    #[arg(long, env = "SHARDLINE_PREFETCH", default_value_t = 1)]
    pub prefetch: u16,
    /// Handler attempts per event, the first included.
    #[arg(long, env = "SHARDLINE_MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Delay after the first failed attempt.
    #[arg(long, env = "SHARDLINE_RETRY_BASE", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub retry_base: Duration,
    /// Longest delay between attempts.
    #[arg(long, env = "SHARDLINE_RETRY_CAP", default_value = "5s", value_parser = humantime::parse_duration)]
    pub retry_cap: Duration,
    /// Growth of the delay per attempt.
    #[arg(long, env = "SHARDLINE_RETRY_FACTOR", default_value_t = 2.0)]
    pub retry_factor: f64,
    /// Random variation of each delay, as a fraction (0.3 = ±30%).
    #[arg(long, env = "SHARDLINE_RETRY_JITTER", default_value_t = 0.3)]
    pub retry_jitter: f64,
    /// Longest one handler attempt may take (then it counts as a retryable failure).
    #[arg(long, env = "SHARDLINE_HANDLER_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub handler_timeout: Duration,
    /// On stop, how long the in-flight event may still take.
    #[arg(long, env = "SHARDLINE_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// How long a processed event's dedup key is kept.
    #[arg(long, env = "SHARDLINE_DEDUP_TTL", default_value = "7d", value_parser = humantime::parse_duration)]
    pub dedup_ttl: Duration,
    /// Largest accepted body; larger ones are dead-lettered `invalid`.
    #[arg(long, env = "SHARDLINE_MAX_BODY_BYTES", default_value_t = 1024 * 1024)]
    pub max_body_bytes: usize,
    /// How often a standby retries taking a shard another worker holds.
    #[arg(long, env = "SHARDLINE_STANDBY_RETRY", default_value = "1s", value_parser = humantime::parse_duration)]
    pub standby_retry: Duration,
    /// Shard queue type, as applied by `topology apply` (quorum implies
    /// single-active-consumer).
    #[arg(long, env = "SHARDLINE_QUEUE_TYPE", default_value = "classic")]
    pub queue_type: QueueType,
    /// The shard queues were applied with `--single-active-consumer`.
    #[arg(long, env = "SHARDLINE_SINGLE_ACTIVE_CONSUMER")]
    pub single_active_consumer: bool,
    /// How long an event that arrived ahead of its order's sequence waits for
    /// the gap to fill (from its arrival).
    #[arg(long, env = "SHARDLINE_GAP_GRACE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub gap_grace: Duration,
    /// How long the first event of an unknown order with seq > 1 waits for
    /// earlier ones before it is accepted as the start.
    #[arg(long, env = "SHARDLINE_START_GRACE", default_value = "5s", value_parser = humantime::parse_duration)]
    pub start_grace: Duration,
    /// Events held per shard at most (also the consumer window's reserve).
    #[arg(long, env = "SHARDLINE_MAX_HELD", default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_held: u16,
    /// Held events whose gap never filled: `dead-letter` (reason `seq-gap`) or
    /// `apply` (skip the gap).
    #[arg(long, env = "SHARDLINE_ON_GAP", value_enum, default_value_t = OnGapArg::DeadLetter)]
    pub on_gap: OnGapArg,
    /// An order's later events once one of its events is dead-lettered:
    /// `continue` (applied; a replay lands out of order) or `quarantine`
    /// (dead-lettered `quarantined` until the order is replayed or released).
    #[arg(long, env = "SHARDLINE_ON_DEAD_LETTER", value_enum, default_value_t = OnDeadLetterArg::Continue)]
    pub on_dead_letter: OnDeadLetterArg,
    /// How long the event kinds processed per order are kept for `shardline
    /// reconcile` (default: the longer of 24h and --dedup-ttl; 0s records none).
    #[arg(long, env = "SHARDLINE_KINDS_TTL", value_parser = humantime::parse_duration)]
    pub kinds_ttl: Option<Duration>,
    /// Handler starts that end with the process dying before an event is
    /// dead-lettered `crash-loop`.
    #[arg(long, env = "SHARDLINE_MAX_DELIVERIES", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_deliveries: u32,
    /// Quorum queues: the `x-delivery-limit` they were applied with.
    #[arg(long, env = "SHARDLINE_DELIVERY_LIMIT", default_value_t = 20)]
    pub delivery_limit: u32,
    /// Backlog age (oldest unprocessed event of a shard) from which the shard
    /// is at WARN (`shardline_backlog_level` 1).
    #[arg(long, env = "SHARDLINE_BACKLOG_WARN", default_value = "30s", value_parser = humantime::parse_duration)]
    pub backlog_warn: Duration,
    /// Backlog age from which the shard is at PAGE (`shardline_backlog_level` 2).
    #[arg(long, env = "SHARDLINE_BACKLOG_PAGE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub backlog_page: Duration,
    /// An in-flight event worked on longer than this marks its shard stuck
    /// (`shardline_stuck`).
    #[arg(long, env = "SHARDLINE_STUCK_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    pub stuck_after: Duration,
    /// Name in logs and in the broker's connection list (default host-pid).
    #[arg(long, env = "SHARDLINE_WORKER_NAME")]
    pub worker_name: Option<String>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum OnGapArg {
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
    /// The library configuration these flags describe.
    pub fn config(&self, global: &GlobalArgs) -> anyhow::Result<Config> {
        if !(0.0..1.0).contains(&self.retry_jitter) {
            anyhow::bail!(
                "--retry-jitter must be in [0, 1), got {}",
                self.retry_jitter
            );
        }
        if self.retry_factor < 1.0 {
            anyhow::bail!(
                "--retry-factor must be at least 1, got {}",
                self.retry_factor
            );
        }
        if self.prefetch == 0 {
            anyhow::bail!("--prefetch must be at least 1");
        }
        if self.backlog_page < self.backlog_warn {
            anyhow::bail!("--backlog-page must not be below --backlog-warn");
        }
        let assign = self
            .assign
            .resolve(global.shards)
            .map_err(|e| anyhow::anyhow!("--assign: {e}"))?;
        let exclusive = shardline_topology::TopologyOptions {
            shards: global.shards,
            single_active_consumer: self.single_active_consumer,
            queue_type: self.queue_type,
            ..Default::default()
        }
        .exclusive_consumers();
        Ok(Config {
            amqp: global.amqp_url.clone(),
            redis: global.redis_url.clone(),
            redis_prefix: global.redis_prefix.clone(),
            names: global.names(),
            shards: global.shards,
            assign,
            prefetch: self.prefetch,
            exclusive,
            retry: RetryPolicy {
                max_attempts: self.max_attempts,
                base: self.retry_base,
                factor: self.retry_factor,
                cap: self.retry_cap,
                jitter: self.retry_jitter,
            },
            handler_timeout: self.handler_timeout,
            drain_timeout: self.drain_timeout,
            dedup_ttl: self.dedup_ttl,
            max_body_bytes: self.max_body_bytes,
            standby_retry: self.standby_retry,
            worker_name: self.worker_name.clone().unwrap_or_else(default_worker_name),
            gap_grace: self.gap_grace,
            start_grace: self.start_grace,
            max_held: self.max_held,
            on_gap: match self.on_gap {
                OnGapArg::DeadLetter => OnGap::DeadLetter,
                OnGapArg::Apply => OnGap::Apply,
            },
            on_dead_letter: self.on_dead_letter.into(),
            kinds_ttl: self.kinds_ttl,
            max_deliveries: self.max_deliveries,
            delivery_limit: (self.queue_type == QueueType::Quorum).then_some(self.delivery_limit),
            metrics_addr: global.metrics_addr,
            backlog: Thresholds {
                warn: self.backlog_warn,
                page: self.backlog_page,
            },
            stuck_after: self.stuck_after,
        })
    }
}

/// `host-pid`, unique per process on a host.
pub fn default_worker_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "worker".into());
    format!("{host}-{}", std::process::id())
}

pub async fn run(
    global: &GlobalArgs,
    args: WorkerArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let config = args.config(global)?;
    let handler = handler::from_spec(&args.handler)?;
    shardline_worker::run(config, handler, shutdown).await?;
    Ok(ExitCode::SUCCESS)
}
