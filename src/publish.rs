//! `shardline publish` (one event from flags, or JSON lines from a file or
//! stdin) and `shardline load` (the load generator). The demo and the bench
//! reuse [`load_events`], [`publish_events`] and [`publisher_config`].

use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};
use clap::{ArgGroup, Args};
use shardline_contract::envelope::MAX_SEQ;
use shardline_contract::{Envelope, NewEvent, OrderId, OrderIdError};
use shardline_publisher::{Config, Publisher};
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, BufReader};
use tokio_util::sync::CancellationToken;

use crate::GlobalArgs;

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
    #[arg(long, env = "SHARDLINE_PUBLISH_WINDOW", default_value_t = Config::default().window)]
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
    #[arg(long, env = "SHARDLINE_PUBLISH_WINDOW", default_value_t = Config::default().window)]
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
        event.to_body().context("not publishing")?;
        let mut publisher = Publisher::connect(config).await?;
        publisher.publish_event(&event).await?;
        if let Some(trace) = publisher.last_trace() {
            println!("trace {}", trace.trace_id());
        }
        return finish(publisher, false).await;
    }
    let Some(path) = args.file else {
        anyhow::bail!("give --order-id and --event, or --file");
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
    println!(
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

fn events(n: u64) -> String {
    if n == 1 {
        "1 event".to_owned()
    } else {
        format!("{n} events")
    }
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
        .ok_or_else(|| anyhow!("--orders × --events-per-order is too large"))?;
    let config = publisher_config(global, args.window, "shardline load");
    let mut publisher = Publisher::connect(config).await?;
    let events = load_events_seeded(
        args.orders,
        args.events_per_order,
        &args.order_prefix,
        args.seed,
    );
    let report = publish_events(&mut publisher, events, total, args.rate, &shutdown).await?;
    publisher.close().await?;
    println!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// Event names by seq; every event after the fifth is an `order.updated`.
pub(crate) const LOAD_EVENT_NAMES: [&str; 5] = [
    "order.created",
    "inventory.reserved",
    "payment.captured",
    "order.fulfilled",
    "order.closed",
];

/// The id of the `i`-th generated order (1-based): `{prefix}ORD-000001`;
/// refused when the prefix makes it no order id (too long, a control character).
pub(crate) fn load_order_id(prefix: &str, i: u64) -> Result<OrderId, OrderIdError> {
    OrderId::new(format!("{prefix}ORD-{i:06}"))
}

/// The load generator's events: `orders` orders with seq `1..=events_per_order`
/// each, interleaved round-robin (seq 1 of every order, then seq 2, …), so each
/// order's events are in order while orders interleave.
#[allow(
    dead_code,
    reason = "the demo and the bench generate their load with it"
)]
pub(crate) fn load_events(
    orders: u64,
    events_per_order: u64,
    prefix: &str,
) -> impl Iterator<Item = Result<NewEvent, OrderIdError>> + Send + 'static {
    load_events_seeded(orders, events_per_order, prefix, 0)
}

/// [`load_events`] with the `data` payloads drawn from `seed`.
pub(crate) fn load_events_seeded(
    orders: u64,
    events_per_order: u64,
    prefix: &str,
    seed: u64,
) -> impl Iterator<Item = Result<NewEvent, OrderIdError>> + Send + 'static {
    let prefix = prefix.to_owned();
    (1..=events_per_order).flat_map(move |seq| {
        let prefix = prefix.clone();
        (1..=orders).map(move |order| {
            let name = usize::try_from(seq - 1)
                .ok()
                .and_then(|i| LOAD_EVENT_NAMES.get(i))
                .copied()
                .unwrap_or("order.updated");
            let amount = splitmix64(seed ^ splitmix64(order) ^ seq) % 100_000;
            Ok(NewEvent {
                order_id: load_order_id(&prefix, order)?,
                event: name.to_owned(),
                seq: Some(seq),
                event_id: None,
                data: serde_json::json!({ "amount_cents": amount }),
            })
        })
    })
}

/// A fast, well-mixed hash for reproducible payloads (not for security).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a load run did.
#[derive(Debug, Clone)]
pub(crate) struct LoadReport {
    /// Events published by this run.
    pub events: u64,
    /// Of those, confirmed by the broker.
    pub confirmed: u64,
    /// From the first publish until every confirm arrived.
    pub elapsed: Duration,
    /// Publish → confirm latency percentiles of the publisher so far.
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    /// Stopped early by the stop signal.
    pub interrupted: bool,
}

impl LoadReport {
    /// Confirmed events per second.
    pub(crate) fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.confirmed as f64 / secs
        } else {
            0.0
        }
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Option<Duration>| {
            d.map_or_else(
                || "n/a".to_owned(),
                |d| format!("{:.1} ms", d.as_secs_f64() * 1000.0),
            )
        };
        write!(
            f,
            "{}published {} ({} confirmed) in {:.2} s: {:.0} events/s; confirm latency p50 {}, p99 {}",
            if self.interrupted {
                "interrupted: "
            } else {
                ""
            },
            events(self.events),
            self.confirmed,
            self.elapsed.as_secs_f64(),
            self.rate(),
            ms(self.p50),
            ms(self.p99),
        )
    }
}

/// Publishes `events` (about `total` of them, for the progress bar), at most
/// `rate` per second, until done or `shutdown`; then flushes. Shows a progress
/// bar on stderr when it is a terminal.
pub(crate) async fn publish_events(
    publisher: &mut Publisher,
    events: impl Iterator<Item = Result<NewEvent, OrderIdError>>,
    total: u64,
    rate: Option<f64>,
    shutdown: &CancellationToken,
) -> anyhow::Result<LoadReport> {
    let before = publisher.counts();
    let progress = crate::progress::bar(total, "events");
    let started = Instant::now();
    let mut pacer = rate.map(Pacer::new);
    let mut interrupted = false;
    let result = async {
        for event in events {
            let event = event.context("--order-prefix")?;
            if shutdown.is_cancelled() {
                interrupted = true;
                break;
            }
            if let Some(pacer) = pacer.as_mut() {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => {
                        interrupted = true;
                        break;
                    }
                    () = pacer.wait() => {}
                }
            }
            publisher.publish_event(&event).await.with_context(|| {
                format!(
                    "stopped after {} events",
                    publisher.counts().published - before.published
                )
            })?;
            progress.inc(1);
        }
        progress.set_message("awaiting confirms");
        publisher.flush().await?;
        anyhow::Ok(())
    }
    .await;
    progress.finish_and_clear();
    result?;
    if interrupted {
        tracing::info!("stop signal: stopped generating, flushed what was sent");
    }
    let after = publisher.counts();
    Ok(LoadReport {
        events: after.published - before.published,
        confirmed: after.confirmed - before.confirmed,
        elapsed: started.elapsed(),
        p50: publisher.latency().percentile(50.0),
        p99: publisher.latency().percentile(99.0),
        interrupted,
    })
}

/// Paces publishing to an average rate with a timer tick, not a sleep per
/// event: at high rates each tick releases a batch.
struct Pacer {
    rate: f64,
    start: tokio::time::Instant,
    granted: u64,
    /// Most events released at once after a stall (a broker pause is not
    /// followed by a flood).
    burst: u64,
    tick: tokio::time::Interval,
}

impl Pacer {
    fn new(rate: f64) -> Self {
        let period = Duration::from_secs_f64((1.0 / rate).max(0.001));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Self {
            rate,
            start: tokio::time::Instant::now(),
            granted: 0,
            burst: ((rate / 20.0).ceil() as u64).max(1),
            tick,
        }
    }

    async fn wait(&mut self) {
        loop {
            let due = due(self.start.elapsed(), self.rate);
            self.granted = self.granted.max(due.saturating_sub(self.burst));
            if self.granted < due {
                self.granted += 1;
                return;
            }
            self.tick.tick().await;
        }
    }
}

/// Events allowed by `elapsed` at `rate` per second (the first at once).
fn due(elapsed: Duration, rate: f64) -> u64 {
    (elapsed.as_secs_f64() * rate) as u64 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_events_interleave_orders_and_keep_each_order_in_seq() {
        let events: Vec<NewEvent> = load_events(3, 7, "run1-")
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(events.len(), 21);
        let firsts: Vec<&str> = events[..3].iter().map(|e| e.order_id.as_str()).collect();
        assert_eq!(
            firsts,
            ["run1-ORD-000001", "run1-ORD-000002", "run1-ORD-000003"]
        );
        let one: Vec<(u64, &str)> = events
            .iter()
            .filter(|e| e.order_id == "run1-ORD-000002")
            .map(|e| (e.seq.unwrap_or(0), e.event.as_str()))
            .collect();
        assert_eq!(
            one,
            [
                (1, "order.created"),
                (2, "inventory.reserved"),
                (3, "payment.captured"),
                (4, "order.fulfilled"),
                (5, "order.closed"),
                (6, "order.updated"),
                (7, "order.updated"),
            ]
        );
        for event in &events {
            assert!(event.to_body().is_ok());
        }
    }

    #[test]
    fn load_payloads_follow_the_seed() {
        let data = |seed| -> Vec<_> {
            load_events_seeded(2, 2, "", seed)
                .map(|e| e.unwrap().data)
                .collect()
        };
        let (a, b, c) = (data(7), data(7), data(8));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn a_prefix_that_makes_no_order_id_is_refused() {
        let long = "p".repeat(300);
        let first = load_events(1, 1, &long).next().unwrap();
        assert!(matches!(first, Err(OrderIdError::TooLong(_))));
        assert!(load_order_id("a\n", 1).is_err());
    }

    #[test]
    fn pacing_allows_rate_per_second() {
        assert_eq!(due(Duration::ZERO, 100.0), 1);
        assert_eq!(due(Duration::from_millis(500), 100.0), 51);
        assert_eq!(due(Duration::from_secs(2), 0.5), 2);
    }

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

    #[test]
    fn report_line_has_rate_and_latency() {
        let report = LoadReport {
            events: 1000,
            confirmed: 1000,
            elapsed: Duration::from_secs(2),
            p50: Some(Duration::from_micros(1500)),
            p99: None,
            interrupted: false,
        };
        assert_eq!(
            report.to_string(),
            "published 1000 events (1000 confirmed) in 2.00 s: 500 events/s; confirm latency p50 1.5 ms, p99 n/a"
        );
    }
}
