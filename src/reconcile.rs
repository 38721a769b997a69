//! `shardline reconcile`: flags to [`shardline_ops::reconcile`], once or every
//! `--interval`; each run's report printed as text or one JSON object, and
//! with `--metrics-addr` its counts served on `/metrics`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use shardline_ops::reconcile::{self, Metrics};
use shardline_ops::{Event, ReconcileConfig, ReconcileReport, Reconciler};
use tokio_util::sync::CancellationToken;

use crate::{EXIT_ATTENTION, Flags as _, GlobalArgs};

#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// PostgreSQL URL of the order database (`postgres://user:password@host/db`,
    /// or a key=value string). Only read, in a read-only transaction.
    #[arg(long)]
    pub orders_url: shardline_connect::redact::Redacted,
    #[command(flatten)]
    pub orders: OrdersArgs,
    /// Run every INTERVAL until SIGTERM or Ctrl-C (a failed run is logged and
    /// retried at the next one); without it, run once. Each run's summary
    /// is kept in Redis for the console.
    #[arg(long, value_parser = parse_interval)]
    pub interval: Option<Duration>,
    /// Only report: emit nothing, write nothing (exit 3 when something drifted).
    #[arg(long)]
    pub dry_run: bool,
    /// Print one JSON object per run instead of text.
    #[arg(long)]
    pub json: bool,
    /// Emit nothing in a run that would emit more than this many compensations
    /// (report them and exit 3): a mass drift is an outage or a
    /// misconfiguration, not something to paper over.
    #[arg(long, default_value_t = 1000)]
    pub max_emit: usize,
}

/// How reconcile reads the order database, besides its URL: shared by
/// `shardline reconcile` and the console's dry run.
#[derive(Debug, Clone, Args)]
pub(crate) struct OrdersArgs {
    /// Query returning `order_id, status, updated_at` of the orders updated at
    /// or after `$1` (a timestamp: now minus `--window`).
    #[arg(long, default_value = reconcile::DEFAULT_QUERY)]
    pub orders_query: String,
    /// Look at orders updated this long ago at most. Keep it within the
    /// worker's `--kinds-ttl`: older processed kinds may have expired.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub window: Duration,
    /// Skip orders updated less than this long ago: their events may still be
    /// on their way.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub grace: Duration,
    /// `STATUS=KIND`: an order in STATUS must have had an event KIND processed.
    /// Repeatable (a status may expect several kinds); replaces the defaults
    /// INVENTORY_RESERVED=inventory.reserved, PAID=payment.captured,
    /// FULFILLED=order.fulfilled.
    #[arg(
        long = "expect",
        value_name = "STATUS=KIND",
        value_delimiter = ',',
        value_parser = reconcile::parse_expectation
    )]
    pub expect: Vec<(String, String)>,
    /// The schema of the transactional outbox (`shardline outbox install
    /// --schema`) in the order database, when the application writes its
    /// events through it: the orders and the outbox are then read in one
    /// REPEATABLE READ snapshot, and an order with rows the relay has not
    /// published yet is pending, not drift. Point `--orders-url` at the
    /// primary.
    #[arg(long, value_name = "SCHEMA")]
    pub outbox_schema: Option<String>,
}

impl OrdersArgs {
    /// The reconcile config of these flags on the order database at `orders_url`.
    pub(crate) fn config(
        self,
        orders_url: String,
        dry_run: bool,
        max_emit: usize,
    ) -> ReconcileConfig {
        ReconcileConfig {
            orders_url,
            orders_query: self.orders_query,
            window: self.window,
            grace: self.grace,
            expect: self.expect,
            dry_run,
            max_emit,
            outbox_schema: self.outbox_schema,
        }
    }
}

pub(crate) fn parse_interval(s: &str) -> Result<Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("the interval must be above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

pub(crate) async fn run(
    global: &GlobalArgs,
    args: ReconcileArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let config = args
        .orders
        .config(args.orders_url.into_inner(), args.dry_run, args.max_emit);
    let reconciler = Reconciler::new(global.fleet(), config).flags()?;
    let metrics = Arc::new(Metrics::new());
    if let Some(addr) = global.metrics_addr {
        // Bound before the first run: a port in use fails the start naming the flag.
        let listener = shardline_worker::http::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("--metrics-addr {e}"))?;
        let served = Arc::clone(&metrics);
        tokio::spawn(crate::metrics_http::serve(
            listener,
            shutdown.clone(),
            move || served.encode(),
        ));
    }
    let print = |report: &ReconcileReport| {
        if args.json {
            println!("{}", report.json(&crate::flag));
        } else {
            crate::out::text(&report.text(&crate::flag));
        }
    };
    let Some(interval) = args.interval else {
        let report = reconciler.run_once(&shutdown).await;
        metrics.record(report.as_ref().ok());
        let report = report.flags()?;
        print(&report);
        return Ok(if report.needs_attention() {
            ExitCode::from(EXIT_ATTENTION)
        } else {
            ExitCode::SUCCESS
        });
    };
    reconciler
        .run_every(interval, &shutdown, |event| match event {
            Event::Reconciled(report) => {
                metrics.record(Some(&report));
                print(&report);
            }
            Event::ReconcileFailed { .. } => metrics.record(None),
            _ => {}
        })
        .await;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_checked() {
        assert!(parse_interval("0s").is_err());
        assert!(parse_interval("soon").is_err());
        assert_eq!(parse_interval("5m"), Ok(Duration::from_secs(300)));
    }

    #[test]
    fn expect_flag_is_checked() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ReconcileArgs,
        }
        let parse = |expect: &str| {
            Cli::try_parse_from(["x", "--orders-url", "postgres://db/o", "--expect", expect])
                .map(|c| c.args.orders.expect)
        };
        assert_eq!(
            parse("PAID=payment.captured,SHIPPED=order.shipped").ok(),
            Some(vec![
                ("PAID".into(), "payment.captured".into()),
                ("SHIPPED".into(), "order.shipped".into())
            ])
        );
        assert!(parse("PAID").is_err());
        assert!(parse("PAID=a\u{7}b").is_err());
    }

    #[test]
    fn the_outbox_schema_reaches_the_config() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ReconcileArgs,
        }
        let config = |extra: &[&str]| {
            let args = ["x", "--orders-url", "postgres://db/o"].iter().chain(extra);
            let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
            Ok::<_, String>(
                cli.args
                    .orders
                    .config(String::new(), false, 1)
                    .outbox_schema,
            )
        };
        assert_eq!(config(&[]), Ok(None), "no outbox unless asked");
        assert_eq!(
            config(&["--outbox-schema", "shop"]),
            Ok(Some("shop".to_owned()))
        );
    }
}
