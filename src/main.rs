//! The `shardline` command line: parses flags (with `SHARDLINE_*` environment
//! fallbacks), sets up logging and dispatches to one module per subcommand group.

mod bench;
mod console;
mod demo;
mod dlq;
mod environment;
mod metrics_http;
mod out;
mod outbox;
mod progress;
mod publish;
mod receive;
mod reconcile;
#[cfg(test)]
mod reference;
mod telemetry;
mod topology;
mod worker;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use shardline_connect::management::ManagementTarget;
use shardline_connect::{AddressOrder, AmqpTarget, RedisTarget};
use shardline_contract::{Keys, Names, ShardCount};
use shardline_ops::{Fleet, Usage};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "shardline",
    version,
    about = "RabbitMQ shard-per-queue worker fleet"
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Flags every subcommand accepts, before or after its name.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// RabbitMQ URL (`amqps://` for TLS); the vhost is the URL's path.
    #[arg(
        long,
        global = true,
        help_heading = "Connection",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        value_parser = UrlParser::<AmqpTarget>::new()
    )]
    pub amqp_url: AmqpTarget,
    /// In which order the addresses of --amqp-url are tried at every connect:
    /// `random` (a fleet spreads over a cluster's nodes) or `given` (as listed:
    /// the first that answers, the others as fallbacks).
    #[arg(
        long,
        global = true,
        help_heading = "Connection",
        default_value_t = AddressOrder::Random
    )]
    pub amqp_address_order: AddressOrder,
    /// Redis URL (`rediss://` for TLS); a path `/N` selects database N;
    /// `redis+sentinel://host[:port],…/service[/N]` finds the primary through Sentinels.
    #[arg(
        long,
        global = true,
        help_heading = "Connection",
        default_value = "redis://127.0.0.1:6379",
        value_parser = UrlParser::<RedisTarget>::new()
    )]
    pub redis_url: RedisTarget,
    /// RabbitMQ's management API, `http(s)://user:password@host:15672`
    /// (optional): the broker probe then also checks the policies in effect
    /// on the shard queues and the DLQ, which AMQP cannot show.
    #[arg(
        long,
        global = true,
        help_heading = "Connection",
        value_parser = UrlParser::<ManagementTarget>::new()
    )]
    pub management_url: Option<ManagementTarget>,
    /// Prefix of every Redis key shardline writes.
    #[arg(
        long,
        global = true,
        help_heading = "Names",
        default_value = "shardline:"
    )]
    pub redis_prefix: String,
    /// Number of shards N. Queue arguments are immutable, so growing N is a migration.
    #[arg(long, global = true, help_heading = "Names", default_value_t = ShardCount::default())]
    pub shards: ShardCount,
    /// Publish and consume although the topology has another shard count than
    /// --shards (queue N-1 missing or queue N present): only during a
    /// shard-count migration; otherwise one order's events would land in two queues.
    #[arg(long, global = true, help_heading = "Names")]
    pub allow_shard_mismatch: bool,
    /// Serve Prometheus metrics and health on this address (off unless given).
    #[arg(long, global = true, help_heading = "Logging and metrics")]
    pub metrics_addr: Option<SocketAddr>,
    /// Log lines as text or as JSON objects (stderr).
    #[arg(long, global = true, help_heading = "Logging and metrics", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Direct exchange events are published to.
    #[arg(
        long,
        global = true,
        help_heading = "Names",
        default_value = "order.sharding"
    )]
    pub exchange: String,
    /// Shard queue `i` is named `{queue-prefix}{i}`.
    #[arg(
        long,
        global = true,
        help_heading = "Names",
        default_value = "order.events.shard."
    )]
    pub queue_prefix: String,
    /// Topic exchange dead letters are published to (routing key = the reason).
    #[arg(
        long,
        global = true,
        help_heading = "Names",
        default_value = "order.sharding.dlx"
    )]
    pub dead_letter_exchange: String,
    /// Queue the dead-letter exchange delivers to.
    #[arg(
        long,
        global = true,
        help_heading = "Names",
        default_value = "order.events.dlq"
    )]
    pub dead_letter_queue: String,
}

/// Parses a URL flag without quoting it: clap's own "invalid value" message
/// would show the value as given, passwords included; the target's error
/// shows the URL redacted.
#[derive(Clone)]
struct UrlParser<T>(std::marker::PhantomData<fn() -> T>);

impl<T> UrlParser<T> {
    const fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T> clap::builder::TypedValueParser for UrlParser<T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Display,
{
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let flag = arg
            .and_then(clap::Arg::get_long)
            .map_or_else(|| "URL".to_owned(), |long| format!("--{long}"));
        let parsed = match value.to_str() {
            Some(text) => text.parse::<T>().map_err(|e| format!("{flag}: {e}")),
            None => Err(format!("{flag}: not UTF-8")),
        };
        parsed.map_err(|message| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("{message}\n"),
            )
            .with_cmd(cmd)
        })
    }
}

impl GlobalArgs {
    pub fn names(&self) -> Names {
        Names {
            exchange: self.exchange.clone(),
            queue_prefix: self.queue_prefix.clone(),
            dead_letter_exchange: self.dead_letter_exchange.clone(),
            dead_letter_queue: self.dead_letter_queue.clone(),
        }
    }

    /// The fleet the operator commands work on.
    pub fn fleet(&self) -> Fleet {
        Fleet {
            amqp: self.amqp_url.clone(),
            redis: self.redis_url.clone(),
            keys: Keys::new(&self.redis_prefix),
            names: self.names(),
            shards: self.shards,
            allow_shard_mismatch: self.allow_shard_mismatch,
            management: self.management_url.clone(),
        }
    }

    /// Takes the recorded topology's shard count, with one warning when
    /// `--shards` disagrees (a pod restarted with an old `SHARDLINE_SHARDS`
    /// follows the record). Without a record `--shards` stands and the
    /// broker's shard-count check decides; with `--allow-shard-mismatch`
    /// nothing is read.
    async fn follow_record(&mut self, who: &str) {
        if self.allow_shard_mismatch {
            return;
        }
        match shardline_ops::topology::recorded(&self.fleet(), who).await {
            Ok(Some(record)) => match record.shard_count() {
                Ok(recorded) if recorded != self.shards => {
                    tracing::warn!("{}", record.follow_warning(self.shards));
                    self.shards = recorded;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "the recorded topology: using --shards"),
            },
            Ok(None) => {}
            // The command's own connection says so, once.
            Err(shardline_ops::Error::Connect(e)) => {
                tracing::debug!(error = %e, "cannot read the recorded topology")
            }
            Err(e) => tracing::warn!(
                "cannot read the recorded topology ({}): using --shards {}",
                e.rename_fields(flag),
                self.shards
            ),
        }
    }
}

/// The flag that sets an ops config field, for messages that name one (and
/// how the command line words a cancellation).
pub fn flag(field: &str) -> String {
    match field {
        "thresholds.warn" => "--backlog-warn".into(),
        "thresholds.page" => "--backlog-page".into(),
        "cancelled" => "stopped by a signal".into(),
        field => format!("--{}", field.replace('_', "-")),
    }
}

/// An ops error as the command line shows it: config fields named as flags;
/// a setting refused as given is a usage error.
pub trait Flags<T> {
    fn flags(self) -> anyhow::Result<T>;
}

/// `message`, a [`Usage`] error (exit 2) when `usage`.
pub fn usage_if(usage: bool, message: String) -> anyhow::Error {
    match usage {
        true => Usage(message).into(),
        false => anyhow::Error::msg(message),
    }
}

impl<T> Flags<T> for Result<T, shardline_ops::Error> {
    fn flags(self) -> anyhow::Result<T> {
        self.map_err(|e| usage_if(e.is_usage(), e.rename_fields(flag)))
    }
}

impl<T> Flags<T> for Result<T, shardline_bench::Error> {
    fn flags(self) -> anyhow::Result<T> {
        self.map_err(|e| usage_if(e.is_usage(), e.rename_fields(flag)))
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Declare or inspect the exchanges and queues.
    #[command(subcommand)]
    Topology(topology::TopologyCommand),
    /// Publish one event from flags, or JSON lines from a file or stdin.
    Publish(publish::PublishArgs),
    /// Generate load: K orders with E events each, interleaved.
    Load(publish::LoadArgs),
    /// Consume shards: decode, deduplicate, call the handler, ack or dead-letter.
    Worker(Box<worker::WorkerArgs>),
    /// Run the whole pipeline end to end on throwaway names, with a report.
    Demo(demo::DemoArgs),
    /// Measure the worker draining a fixed load against a raw consume loop.
    Bench(bench::BenchArgs),
    /// The paced publisher `bench --latency` runs as a child process.
    #[command(hide = true)]
    BenchPublisher(bench::PacedArgs),
    /// Inspect, replay or purge the dead-letter queue.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Compare order snapshots in PostgreSQL with the events the fleet
    /// processed; publish a compensation event for each one missing.
    Reconcile(reconcile::ReconcileArgs),
    /// The transactional outbox: applications append events in their own
    /// PostgreSQL transactions.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Serve the operator web console (fleet and dead letters) behind a token.
    Console(console::ConsoleArgs),
    /// A stand-in for your service while trying shardline out: answer every
    /// POST with 200 and print each event.
    Receive(receive::ReceiveArgs),
}

/// Exit code 3: a check found something to alert on.
pub const EXIT_ATTENTION: u8 = 3;

/// A failed command's exit code: 2 for a [`Usage`] error (as clap's own), else 1.
fn exit_code(e: &anyhow::Error) -> u8 {
    if e.is::<Usage>() { 2 } else { 1 }
}

fn main() -> ExitCode {
    let mut cli = environment::parse();
    // Every command reads the target from here, so each one honours the order.
    cli.global.amqp_url = cli
        .global
        .amqp_url
        .with_order(cli.global.amqp_address_order);
    // Held to the end: dropping it flushes the last spans.
    let _telemetry = telemetry::init(cli.global.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    let result = runtime.block_on(async {
        tokio::spawn(shardline_worker::cancel_on_signal(shutdown.clone()));
        let mut global = cli.global;
        // The commands that route or consume by shard follow the record.
        let follows = match &cli.command {
            Command::Publish(_) => Some("publish"),
            Command::Load(_) => Some("load"),
            Command::Worker(_) => Some("worker"),
            Command::Dlq(_) => Some("dlq"),
            Command::Reconcile(_) => Some("reconcile"),
            Command::Console(_) => Some("console"),
            _ => None,
        };
        if let Some(who) = follows {
            global.follow_record(who).await;
        }
        match cli.command {
            Command::Topology(cmd) => topology::run(&global, cmd).await,
            Command::Publish(args) => publish::publish(&global, args, shutdown).await,
            Command::Load(args) => publish::load(&global, args, shutdown).await,
            Command::Worker(args) => worker::run(&global, *args, shutdown).await,
            Command::Demo(args) => demo::run(&global, args, shutdown).await,
            Command::Bench(args) => bench::run(&global, args, shutdown).await,
            Command::BenchPublisher(args) => bench::run_publisher(&global, args, shutdown).await,
            Command::Dlq(cmd) => dlq::run(&global, cmd, shutdown).await,
            Command::Reconcile(args) => reconcile::run(&global, args, shutdown).await,
            Command::Outbox(cmd) => outbox::run(&global, cmd, shutdown).await,
            Command::Console(args) => console::run(&global, args, shutdown).await,
            Command::Receive(args) => receive::run(args, shutdown).await,
        }
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", out::error_line(&format!("{e:#}")));
            ExitCode::from(exit_code(&e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usage_error_exits_2_and_any_other_1() {
        let usage = anyhow::Error::from(Usage("--prefetch must be at least 1".into()));
        assert_eq!(usage.to_string(), "--prefetch must be at least 1");
        assert_eq!(exit_code(&usage), 2);
        let wrapped = usage.context("starting the worker");
        assert_eq!(exit_code(&wrapped), 2, "a cause that is a usage error");
        assert_eq!(exit_code(&anyhow::anyhow!("cannot connect")), 1);
        assert_eq!(exit_code(&usage_if(true, "--rate x".into())), 2);
        assert_eq!(exit_code(&usage_if(false, "--peer x".into())), 1);
        let refused = Err::<(), _>(shardline_ops::Error::Refused("version unknown".into()));
        assert_eq!(exit_code(&refused.flags().unwrap_err()), 1);
        let window = Err::<(), _>(shardline_ops::Error::Config {
            fields: &["window"],
            message: "window must be above 0".into(),
        });
        let window = window.flags().unwrap_err();
        assert_eq!(
            (window.to_string(), exit_code(&window)),
            ("--window must be above 0".into(), 2)
        );
    }
}
