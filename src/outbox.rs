//! `shardline outbox install`: flags to [`shardline_outbox::install`], its
//! report printed as one line; `shardline outbox relay`: flags to a
//! [`shardline_outbox::relay::Relay`], run until a signal, its metrics
//! served on `--metrics-addr`.

use std::process::ExitCode;

use std::time::Duration;

use clap::{Args, Subcommand};
use shardline_outbox::relay::{self, Relay, RelayConfig};
use shardline_outbox::{DatabaseUrl, OutboxError, Schema};
use tokio_util::sync::CancellationToken;

use crate::out::say;
use crate::{GlobalArgs, UrlParser, usage_if};

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Create the outbox in the application's database (idempotent, safe to
    /// run twice at once): the table `shardline_outbox`, the per-order
    /// counter, and the functions `shardline_outbox_append` (which the
    /// application calls in its own transaction) and `shardline_outbox_seed`.
    Install(InstallArgs),
    /// Publish the outbox's committed rows to the shard queues, each order's
    /// rows in seq order, and delete each row once the broker confirmed it.
    /// One relay at a time holds the outbox: start several, the others
    /// stand by and take over within `--poll` of its end.
    Relay(RelayArgs),
}

/// Where the outbox is: shared by the outbox commands.
#[derive(Debug, Clone, Args)]
pub(crate) struct DatabaseArgs {
    /// PostgreSQL URL of the application's database
    /// (`postgres://user:password@host/db`, or a key=value string). Plain TCP
    /// or a Unix socket: TLS to PostgreSQL is not built in.
    #[arg(long, value_parser = UrlParser::<DatabaseUrl>::new())]
    pub database_url: DatabaseUrl,
    /// The schema the outbox lives in: lower-case letters, digits and `_`.
    #[arg(long, default_value = shardline_outbox::DEFAULT_SCHEMA)]
    pub schema: Schema,
}

#[derive(Debug, Args)]
pub(crate) struct InstallArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
}

#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The relay's name: its status document in `topology status`, the
    /// `x-shardline-relay` header of what it publishes (default:
    /// `{host}-{pid}`).
    #[arg(long)]
    pub name: Option<String>,
    /// Rows read, published, confirmed and deleted at a time; at most this
    /// many go again after a crash.
    #[arg(long, default_value_t = relay::DEFAULT_BATCH, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch: u32,
    /// How often an idle relay reads without a `NOTIFY`, and how often a
    /// standby tries the lock.
    #[arg(long, default_value = "1s", value_parser = crate::reconcile::parse_interval)]
    pub poll: Duration,
}

pub(crate) async fn run(
    global: &GlobalArgs,
    cmd: OutboxCommand,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    match cmd {
        OutboxCommand::Install(args) => install(args).await,
        OutboxCommand::Relay(args) => run_relay(global, args, shutdown).await,
    }
}

async fn run_relay(
    global: &GlobalArgs,
    args: RelayArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let name = args
        .name
        .unwrap_or_else(shardline_worker::Config::host_pid_name);
    let mut publisher = crate::publish::publisher_config(
        global,
        shardline_publisher::Config::default().window,
        &format!("shardline outbox relay {name}"),
    );
    // Refused at start, naming the flag: the relay cannot route by a map it
    // cannot read, and the broker or Redis being down is retried instead.
    publisher.check_shard_count = !global.allow_shard_mismatch;
    let relay = Relay::new(RelayConfig {
        database: args.database.database_url,
        schema: args.database.schema,
        publisher,
        name,
        batch: args.batch,
        poll: args.poll,
    });
    if let Some(addr) = global.metrics_addr {
        let listener = shardline_worker::http::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-addr {e}"))?;
        let metrics = relay.metrics();
        tokio::spawn(crate::metrics_http::serve(
            listener,
            shutdown.clone(),
            move || metrics.encode(),
        ));
    }
    relay.run(&shutdown).await;
    Ok(ExitCode::SUCCESS)
}

async fn install(args: InstallArgs) -> anyhow::Result<ExitCode> {
    let InstallArgs { database } = args;
    let mut client = database.database_url.connect().await.map_err(flags)?;
    let installed = shardline_outbox::install(&mut client, database.schema.as_str())
        .await
        .map_err(flags)?;
    say!("{installed}");
    Ok(ExitCode::SUCCESS)
}

/// An outbox error as the command line shows it: led by the flag of the
/// setting it is about; a setting refused as given is a usage error.
fn flags(e: OutboxError) -> anyhow::Error {
    let message = match e.field() {
        Some(field) => format!("{}: {e}", crate::flag(field)),
        None => e.to_string(),
    };
    usage_if(e.is_usage(), message)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: OutboxCommand,
    }

    fn parse(args: &[&str]) -> Result<InstallArgs, String> {
        let args = ["x", "install"].iter().chain(args);
        match Cli::try_parse_from(args) {
            Ok(Cli {
                command: OutboxCommand::Install(args),
            }) => Ok(args),
            Ok(_) => Err("not `install`".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn the_schema_defaults_to_public_and_is_checked() {
        let args = parse(&["--database-url", "postgres://db/shop"]).unwrap();
        assert_eq!(args.database.schema.as_str(), "public");
        let args = parse(&["--database-url", "postgres://db/shop", "--schema", "shop"]).unwrap();
        assert_eq!(args.database.schema.as_str(), "shop");
        let e = parse(&["--database-url", "postgres://db/shop", "--schema", "Shop"]).unwrap_err();
        assert!(e.contains("--schema"), "{e}");
        assert!(e.contains("lower-case"), "{e}");
    }

    #[test]
    fn a_bad_url_names_the_flag_and_no_password() {
        let e = parse(&["--database-url", "postgres://app:Canary9z@db:port/shop"]).unwrap_err();
        assert!(!e.contains("Canary9z"), "{e}");
        assert!(
            e.contains("--database-url: PostgreSQL address `postgres://app:***@db:port/shop`"),
            "{e}"
        );
        let args = parse(&["--database-url", "postgres://app:Canary9z@db/shop"]).unwrap();
        assert!(!format!("{args:?}").contains("Canary9z"));
    }

    #[test]
    fn an_unreachable_database_is_a_failure_naming_the_flag() {
        let e = flags(OutboxError::Connect {
            url: "postgres://app:***@db/shop".into(),
            cause: "connection refused".into(),
        });
        assert_eq!(
            e.to_string(),
            "--database-url: cannot connect to PostgreSQL at postgres://app:***@db/shop: connection refused"
        );
        assert!(!e.is::<shardline_ops::Usage>());
        let e = flags(OutboxError::InvalidSchema {
            name: "Shop".into(),
            reason: "no",
        });
        assert!(e.is::<shardline_ops::Usage>());
        assert_eq!(e.to_string(), "--schema: schema \"Shop\": no");
    }
}
