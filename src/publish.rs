//! `shardline publish` (one event from flags, or JSON lines from a file or
//! stdin) and `shardline load` (the load generator,
//! [`shardline_bench::load`]). The bench reuses [`publisher_config`].

use crate::out::say;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, anyhow};
use clap::{ArgGroup, Args};
use shardline_bench::LoadProgress;
use shardline_bench::load::{events, load_events_seeded, publish_events};
use shardline_contract::envelope::MAX_SEQ;
use shardline_contract::{Envelope, NewEvent, OrderId};
use shardline_ops::Usage;
use shardline_publisher::{Config, Publisher};
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, BufReader};
use tokio_util::sync::CancellationToken;

use crate::{Flags as _, GlobalArgs};

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("source").required(true).args(["order_id", "file"])))]
pub(crate) struct PublishArgs {
    /// Order the event belongs to (chooses the shard).
    #[arg(long, requires = "event")]
    pub order_id: Option<OrderId>,
    /// Event type, e.g. `payment.captured`.
    #[arg(long, requires = "order_id", conflicts_with = "file")]
    pub event: Option<String>,
    /// Per-order sequence number, 1 to 2^63-1.
    #[arg(long, requires = "order_id", conflicts_with = "file", value_parser = clap::value_parser!(u64).range(1..=MAX_SEQ))]
    pub seq: Option<u64>,
    /// Event id (also the AMQP message id); generated when absent.
    #[arg(long, requires = "order_id", conflicts_with = "file")]
    pub event_id: Option<String>,
    /// The event's `data`, as JSON.
    #[arg(long, requires = "order_id", conflicts_with = "file", value_parser = parse_json)]
    pub data: Option<serde_json::Value>,
    /// JSON lines, one envelope each, published unchanged; `-` reads stdin.
    /// A file is checked whole before anything is published.
    #[arg(long, value_name = "PATH|-")]
    pub file: Option<PathBuf>,
    /// Most events unconfirmed at a time.
    #[arg(long, default_value_t = Config::default().window)]
    pub window: usize,
}

#[derive(Debug, Args)]
pub(crate) struct LoadArgs {
    /// Number of orders K.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub orders: u64,
    /// Events per order E (seq 1..E).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub events_per_order: u64,
    /// Limit to R events per second (default: as fast as confirms allow).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Put in front of every order id (`{prefix}ORD-000001`). The worker treats
    /// a re-run of the same ids as duplicates: give each run its own prefix.
    #[arg(long, default_value = "")]
    pub order_prefix: String,
    /// Seed of the generated `data` payloads (same seed, same payloads).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most events unconfirmed at a time.
    #[arg(long, default_value_t = Config::default().window)]
    pub window: usize,
}

fn parse_json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))
}

pub(crate) fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("expected events per second above 0, got `{s}`")),
    }
}

/// Publisher settings from the global flags.
pub(crate) fn publisher_config(
    global: &GlobalArgs,
    window: usize,
    connection_name: &str,
) -> Config {
    Config {
        amqp: global.amqp_url.clone(),
        names: global.names(),
        shards: global.shards,
        redis: Some(global.redis_url.clone()),
        redis_prefix: global.redis_prefix.clone(),
        window,
        connection_name: connection_name.into(),
        check_shard_count: !global.allow_shard_mismatch,
        ..Config::default()
    }
}

pub(crate) async fn publish(
    global: &GlobalArgs,
    args: PublishArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let config = publisher_config(global, args.window, "shardline publish");
    let max_body = config.max_body_bytes;
    if let Some(order_id) = args.order_id {
        let event = NewEvent {
            order_id,
            event: args.event.unwrap_or_default(),
            seq: args.seq,
            event_id: args.event_id,
            data: args.data.unwrap_or(serde_json::Value::Null),
        };
        // Refuse a bad event before touching the broker.
        event
            .to_body()
            .map_err(|e| Usage(format!("not publishing: {e}")))?;
        let mut publisher = Publisher::connect(config).await?;
        publisher.publish_event(&event).await?;
        if let Some(trace) = publisher.last_trace() {
            say!("trace {}", trace.trace_id());
        }
        return finish(publisher, false).await;
    }
    let Some(path) = args.file else {
        anyhow::bail!(Usage("give --order-id and --event, or --file".into()));
    };
    let stdin = path.as_os_str() == "-";
    let source = if stdin {
        "stdin".to_owned()
    } else {
        path.display().to_string()
    };
    if !stdin {
        let lines = check_file(&path, max_body).await?;
        tracing::debug!(lines, file = %source, "every line is a valid envelope");
    }
    let mut publisher = Publisher::connect(config).await?;
    let mut input = open_input(&path).await?;
    let mut line = Vec::new();
    let mut number = 0u64;
    let mut interrupted = false;
    while read_line(&mut input, &mut line)
        .await
        .with_context(|| format!("reading {source}"))?
    {
        number += 1;
        if shutdown.is_cancelled() {
            interrupted = true;
            break;
        }
        if is_blank(&line) {
            continue;
        }
        let envelope = match Envelope::parse(&line, max_body) {
            Ok(envelope) => envelope,
            Err(e) => {
                publisher.flush().await?;
                let done = publisher.counts().confirmed;
                publisher.close().await?;
                anyhow::bail!(
                    "{source} line {number}: {e} (stopped there; the events before it were published and confirmed: {done})"
                );
            }
        };
        publisher
            .publish_envelope(&envelope, line.clone())
            .await
            .with_context(|| format!("publishing {source} line {number}"))?;
    }
    finish(publisher, interrupted).await
}

/// Flushes, closes and prints the one-line summary.
async fn finish(mut publisher: Publisher, interrupted: bool) -> anyhow::Result<ExitCode> {
    publisher.flush().await?;
    let counts = publisher.counts();
    let exchange = publisher.config().names.exchange.clone();
    let url = publisher.config().amqp.to_string();
    publisher.close().await?;
    say!(
        "{}published {} ({} confirmed) to exchange {exchange} at {url}",
        if interrupted { "interrupted: " } else { "" },
        events(counts.published),
        counts.confirmed,
    );
    Ok(ExitCode::SUCCESS)
}

/// Checks every line of a file before anything is published; returns the
/// number of events.
async fn check_file(path: &PathBuf, max_body: usize) -> anyhow::Result<u64> {
    let mut input = open_input(path).await?;
    let mut line = Vec::new();
    let (mut number, mut events) = (0u64, 0u64);
    while read_line(&mut input, &mut line)
        .await
        .with_context(|| format!("reading {}", path.display()))?
    {
        number += 1;
        if is_blank(&line) {
            continue;
        }
        Envelope::parse(&line, max_body).map_err(|e| {
            anyhow!(
                "{} line {number}: {e} (nothing was published)",
                path.display()
            )
        })?;
        events += 1;
    }
    Ok(events)
}

async fn open_input(path: &PathBuf) -> anyhow::Result<Box<dyn AsyncBufRead + Unpin + Send>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(tokio::io::stdin())));
    }
    let file = tokio::fs::File::open(path)
        .await
        .with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Box::new(BufReader::new(file)))
}

/// Reads one line without its terminator (`\n` or `\r\n`); false at the end.
/// Bytes, not text: a line that is not UTF-8 is reported by the envelope check.
async fn read_line(
    input: &mut (impl AsyncBufRead + Unpin + ?Sized),
    line: &mut Vec<u8>,
) -> std::io::Result<bool> {
    line.clear();
    if input.read_until(b'\n', line).await? == 0 {
        return Ok(false);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
    }
    Ok(true)
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

pub(crate) async fn load(
    global: &GlobalArgs,
    args: LoadArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let total = args
        .orders
        .checked_mul(args.events_per_order)
        .ok_or_else(|| Usage("--orders × --events-per-order is too large".into()))?;
    let config = publisher_config(global, args.window, "shardline load");
    let mut publisher = Publisher::connect(config).await?;
    let events = load_events_seeded(
        args.orders,
        args.events_per_order,
        &args.order_prefix,
        args.seed,
    );
    let progress = crate::progress::bar(total, "events");
    let report = publish_events(
        &mut publisher,
        events,
        args.rate,
        &shutdown,
        |step| match step {
            LoadProgress::Published => progress.inc(1),
            LoadProgress::AwaitingConfirms => progress.set_message("awaiting confirms"),
            _ => {}
        },
    )
    .await;
    progress.finish_and_clear();
    let report = report.flags()?;
    publisher.close().await?;
    say!("{report}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_and_json_flags_are_checked() {
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-3").is_err());
        assert!(parse_rate("inf").is_err());
        assert_eq!(parse_rate("250"), Ok(250.0));
        assert!(
            parse_json("{\"a\":")
                .unwrap_err()
                .contains("not valid JSON")
        );
    }
}
