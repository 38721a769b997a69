//! `shardline reconcile`: finds orders whose status implies an event the fleet
//! never processed, and publishes a compensation event for each (SPEC §5).
//!
//! One run, in the order it goes:
//!
//! 1. read the order snapshots updated within `--window` from PostgreSQL, in a
//!    read-only transaction (the order database is never written);
//! 2. skip orders updated within `--grace`, and statuses that imply no event;
//! 3. look up whether the workers processed each expected kind (the Redis key
//!    `{prefix}kind:{order}:{kind}`, written with each dedup commit);
//! 4. look for each missing event on its way: a compensation this command
//!    emitted before, an event held by the sequence gate, a dead letter, a
//!    shard backlog older than the grace, or a shard with messages and no
//!    worker reporting. Those are *pending* and never compensated, so that a
//!    compensation cannot double an event that is merely late;
//! 5. read the processed kinds once more (the event may have gone through
//!    meanwhile), then claim each drifted (order, kind) in Redis and publish
//!    its compensation, confirmed.
//!
//! The counts go to stdout (`--json`: one JSON object per run) and, with
//! `--metrics-addr`, to Prometheus.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, anyhow};
use clap::Args;
use futures_util::TryStreamExt as _;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use redis::aio::MultiplexedConnection;
use shardline_publisher::Publisher;
use shardline_topology::broker::scrub;
use shardline_topology::envelope::{MAX_FIELD_BYTES, key_field, order_key_of};
use shardline_topology::{Envelope, ShardId, declare, redact_url};
use shardline_worker::dedup::kind_key;
use shardline_worker::metrics::unix_ms;
use shardline_worker::status::{self, ShardReport};
use tokio::net::TcpListener;
use tokio_postgres::types::{FromSql, ToSql, Type};
use tokio_util::sync::CancellationToken;

use crate::{EXIT_ATTENTION, GlobalArgs};

/// The query without `--orders-query`: orders table `orders`, lower bound `$1`.
pub const DEFAULT_QUERY: &str =
    "SELECT order_id, status, updated_at FROM orders WHERE updated_at >= $1";

/// What each status implies without `--expect`.
const DEFAULT_EXPECT: [(&str, &str); 3] = [
    ("INVENTORY_RESERVED", "inventory.reserved"),
    ("PAID", "payment.captured"),
    ("FULFILLED", "order.fulfilled"),
];

/// How long an emission claim lives until its publish is confirmed. A run that
/// dies in between leaves the claim to expire, and a later run emits again;
/// the worker absorbs such a copy by its event id.
const CLAIM_TTL: Duration = Duration::from_secs(60);

/// Bound on one Redis round trip.
const REDIS_TIMEOUT: Duration = Duration::from_secs(10);

/// Expected events looked up in Redis per round trip.
const BATCH: usize = 500;

/// Metric names, as registered. Counters get `_total` appended on exposition,
/// so `SCANNED` is scraped as `shardline_reconcile_scanned_total`.
pub mod names {
    /// Counter: rows the orders query returned.
    pub const SCANNED: &str = "shardline_reconcile_scanned";
    /// Counter: orders skipped because they were updated within `--grace`.
    pub const SKIPPED_FRESH: &str = "shardline_reconcile_skipped_fresh";
    /// Counter: orders whose status implies no event.
    pub const NO_EXPECTATION: &str = "shardline_reconcile_no_expectation";
    /// Counter: expected events the fleet had processed.
    pub const PROCESSED: &str = "shardline_reconcile_processed";
    /// Counter: expected events missing and not on their way (compensated
    /// unless `--dry-run`).
    pub const DRIFTED: &str = "shardline_reconcile_drifted";
    /// Counter: compensation events published and confirmed.
    pub const EMITTED: &str = "shardline_reconcile_emitted";
    /// Counter: expected events missing but possibly on their way (not compensated).
    pub const PENDING: &str = "shardline_reconcile_pending";
    /// Counter `{outcome}`: runs, `ok` or `error`.
    pub const RUNS: &str = "shardline_reconcile_runs";
    /// Gauge: Unix time at which the last successful run ended.
    pub const LAST_RUN: &str = "shardline_reconcile_last_run_timestamp_seconds";
}

/// What `/metrics` is served as.
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// PostgreSQL URL of the order database (`postgres://user:password@host/db`,
    /// or a key=value string). Only read, in a read-only transaction.
    #[arg(long, env = "SHARDLINE_ORDERS_URL", hide_env_values = true)]
    pub orders_url: String,
    /// Query returning `order_id, status, updated_at` of the orders updated at
    /// or after `$1` (a timestamp: now minus `--window`).
    #[arg(long, env = "SHARDLINE_ORDERS_QUERY", default_value = DEFAULT_QUERY)]
    pub orders_query: String,
    /// Look at orders updated this long ago at most. Keep it within the
    /// worker's `--kinds-ttl`: older processed kinds may have expired.
    #[arg(long, env = "SHARDLINE_WINDOW", default_value = "24h", value_parser = humantime::parse_duration)]
    pub window: Duration,
    /// Skip orders updated less than this long ago: their events may still be
    /// on their way.
    #[arg(long, env = "SHARDLINE_GRACE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub grace: Duration,
    /// `STATUS=KIND`: an order in STATUS must have had an event KIND processed.
    /// Repeatable (a status may expect several kinds); replaces the defaults
    /// INVENTORY_RESERVED=inventory.reserved, PAID=payment.captured,
    /// FULFILLED=order.fulfilled.
    #[arg(
        long = "expect",
        value_name = "STATUS=KIND",
        env = "SHARDLINE_EXPECT",
        value_delimiter = ',',
        value_parser = parse_expect
    )]
    pub expect: Vec<(String, String)>,
    /// Run every INTERVAL until SIGTERM or Ctrl-C (a failed run is logged and
    /// retried at the next one); without it, run once.
    #[arg(long, env = "SHARDLINE_INTERVAL", value_parser = parse_interval)]
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
    #[arg(long, env = "SHARDLINE_MAX_EMIT", default_value_t = 1000)]
    pub max_emit: usize,
    /// Dead letters read at most (and requeued, in order) to find missing
    /// events in the DLQ. When the DLQ holds more, nothing is compensated.
    #[arg(long, default_value_t = 10_000)]
    pub dlq_browse: u64,
}

fn parse_expect(s: &str) -> Result<(String, String), String> {
    let Some((status, kind)) = s.split_once('=') else {
        return Err(format!("expected STATUS=KIND, got `{s}`"));
    };
    let (status, kind) = (status.trim(), kind.trim());
    if status.is_empty() || kind.is_empty() {
        return Err(format!("expected STATUS=KIND, both non-empty, got `{s}`"));
    }
    if kind.len() > MAX_FIELD_BYTES || kind.chars().any(char::is_control) {
        return Err(format!(
            "event kind `{kind}` is not a valid `event` (at most {MAX_FIELD_BYTES} bytes, no control characters)"
        ));
    }
    Ok((status.to_owned(), kind.to_owned()))
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("the interval must be above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The event kinds each order status implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectations(BTreeMap<String, Vec<String>>);

impl Expectations {
    /// From `--expect` pairs; the defaults when there are none.
    fn new(pairs: &[(String, String)]) -> Self {
        let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let defaults = DEFAULT_EXPECT.map(|(s, k)| (s.to_owned(), k.to_owned()));
        let pairs = if pairs.is_empty() {
            &defaults[..]
        } else {
            pairs
        };
        for (status, kind) in pairs {
            let kinds = map.entry(status.clone()).or_default();
            if !kinds.contains(kind) {
                kinds.push(kind.clone());
            }
        }
        Self(map)
    }

    /// What an order in `status` must have had processed (exact match).
    fn kinds(&self, status: &str) -> &[String] {
        self.0.get(status).map_or(&[], Vec::as_slice)
    }

    fn describe(&self) -> String {
        let mut out = Vec::new();
        for (status, kinds) in &self.0 {
            for kind in kinds {
                out.push(format!("{status}={kind}"));
            }
        }
        out.join(", ")
    }
}

/// The run's settings, resolved from the flags.
struct Settings {
    orders: tokio_postgres::Config,
    /// `--orders-url` with its password blanked out.
    orders_url: String,
    query: String,
    window: Duration,
    grace: Duration,
    expectations: Expectations,
    dry_run: bool,
    max_emit: usize,
    dlq_browse: u64,
}

impl Settings {
    fn new(args: &ReconcileArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(!args.window.is_zero(), "--window must be above 0");
        anyhow::ensure!(
            args.grace < args.window,
            "--grace ({}) must be shorter than --window ({})",
            humantime::format_duration(args.grace),
            humantime::format_duration(args.window)
        );
        let orders_url = redact_orders_url(&args.orders_url);
        let mut orders: tokio_postgres::Config = args.orders_url.parse().map_err(|e| {
            anyhow!(
                "--orders-url {orders_url}: {}",
                one_line(&scrub(&chain(&e), &args.orders_url))
            )
        })?;
        if orders.get_connect_timeout().is_none() {
            orders.connect_timeout(Duration::from_secs(10));
        }
        if orders.get_application_name().is_none() {
            orders.application_name("shardline reconcile");
        }
        Ok(Self {
            orders,
            orders_url,
            query: args.orders_query.clone(),
            window: args.window,
            grace: args.grace,
            expectations: Expectations::new(&args.expect),
            dry_run: args.dry_run,
            max_emit: args.max_emit,
            dlq_browse: args.dlq_browse,
        })
    }

    /// `text` with the orders database's password blanked out, on one line.
    fn scrub_orders(&self, text: &str) -> String {
        let text = match self.orders.get_password() {
            Some(p) if !p.is_empty() => text.replace(&*String::from_utf8_lossy(p), "***"),
            _ => text.to_owned(),
        };
        one_line(&text)
    }
}

/// A connection URL or key=value string with its password blanked out.
fn redact_orders_url(url: &str) -> String {
    let mut out = redact_url(url);
    // key=value strings and URL parameters can carry the password too.
    let mut from = 0;
    while let Some(at) = out[from..].to_ascii_lowercase().find("password=") {
        let start = from + at + "password=".len();
        let end = out[start..]
            .find([' ', '&', '#'])
            .map_or(out.len(), |n| start + n);
        out.replace_range(start..end, "***");
        from = start + 3;
    }
    out
}

/// An error with its causes: tokio-postgres says only "db error" at the top
/// and puts the server's message in the source.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            let _ = write!(text, ": {cause_text}");
        }
        source = cause.source();
    }
    text
}

fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

pub async fn run(
    global: &GlobalArgs,
    args: ReconcileArgs,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let settings = Settings::new(&args)?;
    let metrics = Arc::new(Metrics::new());
    if let Some(addr) = global.metrics_addr {
        // Bound before the first run: a port in use fails the start naming the flag.
        let listener = shardline_worker::http::bind(addr).await?;
        tokio::spawn(serve(listener, Arc::clone(&metrics), shutdown.clone()));
    }
    tracing::debug!(
        orders = %settings.orders_url,
        expectations = %settings.expectations.describe(),
        "reconcile starting"
    );
    let Some(interval) = args.interval else {
        let report = run_once(global, &settings, &shutdown).await;
        metrics.record(report.as_ref().ok());
        let report = report?;
        print_report(&report, &settings, args.json);
        return Ok(if report.needs_attention() {
            ExitCode::from(EXIT_ATTENTION)
        } else {
            ExitCode::SUCCESS
        });
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        match run_once(global, &settings, &shutdown).await {
            Ok(report) => {
                metrics.record(Some(&report));
                print_report(&report, &settings, args.json);
            }
            Err(e) => {
                metrics.record(None);
                tracing::error!(
                    error = %format!("{e:#}"),
                    next_in = %humantime::format_duration(interval),
                    "reconcile run failed; trying again at the next interval"
                );
            }
        }
    }
    tracing::info!("reconcile stopped");
    Ok(ExitCode::SUCCESS)
}

/// An event an order's status implies.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    order_id: String,
    order_key: String,
    status: String,
    kind: String,
    shard: ShardId,
}

impl Expected {
    /// The compensation's `event_id`, which the worker dedups it by.
    fn event_id(&self) -> String {
        format!("reconcile:{}:{}", self.order_id, self.kind)
    }

    /// `{prefix}reconcile:{order}:{kind}`: this command's record of having
    /// emitted the compensation (or of emitting it right now).
    fn emitted_key(&self, redis_prefix: &str) -> String {
        format!(
            "{redis_prefix}reconcile:{}:{}",
            self.order_key,
            key_field(&self.kind)
        )
    }

    /// The compensation event's body: an envelope without `seq` (so the
    /// sequence gate lets it through), marked `compensation`.
    fn compensation(&self) -> Result<Vec<u8>, String> {
        let body = serde_json::json!({
            "order_id": self.order_id,
            "event": self.kind,
            "event_id": self.event_id(),
            "compensation": true,
            "reason": format!("status={} missing={}", self.status, self.kind),
            "occurred_at": humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        });
        let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
        Envelope::parse(&body, usize::MAX).map_err(|e| format!("no valid compensation: {e}"))?;
        Ok(body)
    }

    fn describe(&self) -> String {
        format!(
            "order={} event={} status={} shard={}",
            self.order_id,
            self.kind,
            self.status,
            self.shard.get()
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "order_id": self.order_id,
            "status": self.status,
            "event": self.kind,
            "shard": self.shard.get(),
        })
    }
}

/// Why a missing event may still arrive.
#[derive(Debug, Clone, PartialEq)]
enum OnItsWay {
    /// This command emitted its compensation before; not processed yet.
    Compensated,
    /// The sequence gate holds it (or released it and it has not run yet).
    Held,
    /// In the DLQ, waiting for a replay.
    DeadLettered { id: String },
    /// The order's shard is behind by more than the grace.
    Backlog { age: Duration },
    /// The order's shard has messages and no worker reports it.
    Unconsumed { messages: u32 },
    /// The DLQ holds more letters than `--dlq-browse`: it could be there.
    DlqNotRead { limit: u64 },
}

impl OnItsWay {
    fn reason(&self) -> &'static str {
        match self {
            Self::Compensated => "compensation_emitted",
            Self::Held => "held",
            Self::DeadLettered { .. } => "dead_lettered",
            Self::Backlog { .. } => "backlog",
            Self::Unconsumed { .. } => "unconsumed",
            Self::DlqNotRead { .. } => "dlq_not_read",
        }
    }

    fn detail(&self) -> String {
        match self {
            Self::Compensated => "compensation already emitted, not processed yet".into(),
            Self::Held => "held by the sequence gate".into(),
            Self::DeadLettered { id } => format!("in the DLQ (dead letter {id})"),
            Self::Backlog { age } => format!(
                "the shard's backlog is {} old",
                humantime::format_duration(Duration::from_secs(age.as_secs()))
            ),
            Self::Unconsumed { messages } => {
                format!("the shard has {messages} message(s) and no worker reporting it")
            }
            Self::DlqNotRead { limit } => {
                format!("the DLQ holds more than --dlq-browse {limit} letters, not all were read")
            }
        }
    }
}

/// Where one run looked for missing events on their way.
struct Whereabouts {
    /// The shard status reports (absent: no worker reports the shard).
    reports: HashMap<ShardId, ShardReport>,
    /// Ready messages of the shards no worker reports.
    unreported: HashMap<ShardId, u32>,
    /// Dead letters by (order id, event kind): a dead-letter id.
    dead_letters: HashMap<(String, String), String>,
    /// Whether the DLQ was read to its end (it held at most `dlq_limit`).
    dlq_read_whole: bool,
    dlq_limit: u64,
    grace: Duration,
    now_ms: u64,
}

impl Whereabouts {
    /// Why `e` may still arrive (the first reason found), `None` when nothing
    /// suggests it will. `compensated`: this command emitted it before.
    fn on_its_way(&self, e: &Expected, compensated: bool) -> Option<OnItsWay> {
        let report = self.reports.get(&e.shard);
        if compensated {
            return Some(OnItsWay::Compensated);
        }
        if report.is_some_and(|r| {
            r.held
                .iter()
                .any(|h| h.order_key == e.order_key && h.event == e.kind)
        }) {
            return Some(OnItsWay::Held);
        }
        if let Some(id) = self.dead_letters.get(&(e.order_id.clone(), e.kind.clone())) {
            return Some(OnItsWay::DeadLettered { id: id.clone() });
        }
        if let Some(age) = report
            .map(|r| r.backlog_age_at(self.now_ms))
            .filter(|age| *age > self.grace)
        {
            return Some(OnItsWay::Backlog { age });
        }
        if let Some(&messages) = self.unreported.get(&e.shard).filter(|m| **m > 0) {
            return Some(OnItsWay::Unconsumed { messages });
        }
        if !self.dlq_read_whole {
            return Some(OnItsWay::DlqNotRead {
                limit: self.dlq_limit,
            });
        }
        None
    }
}

/// A missing event that may still arrive.
#[derive(Debug, Clone)]
struct Pending {
    expected: Expected,
    why: OnItsWay,
}

/// What became of a drifted event.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Compensation {
    Emitted,
    /// `--dry-run`.
    WouldEmit,
    NotEmitted(String),
}

/// A missing event not on its way.
#[derive(Debug, Clone)]
struct Drift {
    expected: Expected,
    compensation: Compensation,
}

/// What one run found.
#[derive(Debug, Default)]
struct Report {
    dry_run: bool,
    /// Rows the query returned.
    scanned: u64,
    /// Rows updated before the window (a query that ignores `$1`): ignored.
    outside_window: u64,
    /// Rows without `order_id` or `updated_at`: ignored.
    invalid: u64,
    skipped_fresh: u64,
    no_expectation: u64,
    /// Expected events the fleet had processed.
    processed: u64,
    pending: Vec<Pending>,
    drift: Vec<Drift>,
}

impl Report {
    fn emitted(&self) -> u64 {
        self.drift
            .iter()
            .filter(|d| d.compensation == Compensation::Emitted)
            .count() as u64
    }

    /// Drift that was not compensated (a dry run, or emission refused).
    fn needs_attention(&self) -> bool {
        self.drift
            .iter()
            .any(|d| d.compensation != Compensation::Emitted)
    }

    fn summary(&self) -> String {
        let mut out = format!(
            "scanned {}, skipped fresh {}, no expectation {}, processed {}, pending {}, drifted {}, emitted {}",
            self.scanned,
            self.skipped_fresh,
            self.no_expectation,
            self.processed,
            self.pending.len(),
            self.drift.len(),
            self.emitted(),
        );
        if self.outside_window > 0 {
            let _ = write!(out, ", outside window {}", self.outside_window);
        }
        if self.invalid > 0 {
            let _ = write!(out, ", invalid rows {}", self.invalid);
        }
        out
    }

    fn text(&self) -> String {
        let mut out = String::new();
        for d in &self.drift {
            let _ = match &d.compensation {
                Compensation::Emitted => writeln!(
                    out,
                    "emitted      {} event_id={}",
                    d.expected.describe(),
                    d.expected.event_id()
                ),
                Compensation::WouldEmit => writeln!(
                    out,
                    "would emit   {} event_id={}",
                    d.expected.describe(),
                    d.expected.event_id()
                ),
                Compensation::NotEmitted(why) => {
                    writeln!(out, "not emitted  {}: {why}", d.expected.describe())
                }
            };
        }
        for p in &self.pending {
            let _ = writeln!(
                out,
                "pending      {}: {}",
                p.expected.describe(),
                p.why.detail()
            );
        }
        let _ = writeln!(
            out,
            "{}: {}{}",
            if self.dry_run {
                "reconcile (dry run)"
            } else {
                "reconcile"
            },
            self.summary(),
            if self.dry_run {
                "; nothing emitted"
            } else {
                ""
            }
        );
        out
    }

    fn json(&self, settings: &Settings) -> serde_json::Value {
        serde_json::json!({
            "at": humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            "dry_run": self.dry_run,
            "window_seconds": settings.window.as_secs(),
            "grace_seconds": settings.grace.as_secs(),
            "counts": {
                "scanned": self.scanned,
                "outside_window": self.outside_window,
                "invalid": self.invalid,
                "skipped_fresh": self.skipped_fresh,
                "no_expectation": self.no_expectation,
                "processed": self.processed,
                "pending": self.pending.len(),
                "drifted": self.drift.len(),
                "emitted": self.emitted(),
            },
            "drift": self.drift.iter().map(|d| {
                let mut v = d.expected.json();
                v["event_id"] = d.expected.event_id().into();
                let (outcome, error) = match &d.compensation {
                    Compensation::Emitted => ("emitted", None),
                    Compensation::WouldEmit => ("would_emit", None),
                    Compensation::NotEmitted(e) => ("not_emitted", Some(e.as_str())),
                };
                v["compensation"] = outcome.into();
                v["error"] = error.into();
                v
            }).collect::<Vec<_>>(),
            "pending": self.pending.iter().map(|p| {
                let mut v = p.expected.json();
                v["reason"] = p.why.reason().into();
                v["detail"] = p.why.detail().into();
                v
            }).collect::<Vec<_>>(),
        })
    }
}

fn print_report(report: &Report, settings: &Settings, json: bool) {
    if json {
        println!("{}", report.json(settings));
    } else {
        print!("{}", report.text());
    }
}

/// The connections of one run, opened when first needed.
struct Run<'a> {
    global: &'a GlobalArgs,
    settings: &'a Settings,
    redis: MultiplexedConnection,
    broker: Option<lapin::Connection>,
    publisher: Option<Publisher>,
}

async fn run_once(
    global: &GlobalArgs,
    settings: &Settings,
    shutdown: &CancellationToken,
) -> anyhow::Result<Report> {
    let redis = global.redis().await.map_err(|e| anyhow!(e))?;
    let mut run = Run {
        global,
        settings,
        redis,
        broker: None,
        publisher: None,
    };
    let result = run.go(shutdown).await;
    run.close().await;
    result
}

impl Run<'_> {
    async fn go(&mut self, shutdown: &CancellationToken) -> anyhow::Result<Report> {
        let mut report = Report {
            dry_run: self.settings.dry_run,
            ..Report::default()
        };
        let missing = self.scan(&mut report).await?;
        if missing.is_empty() {
            return Ok(report);
        }
        let (missing, pending) = self.on_their_way(missing).await?;
        report.pending = pending;
        // Processed while we looked: not drift.
        let drifted = self.unprocessed(missing.clone()).await?;
        report.processed += (missing.len() - drifted.len()) as u64;
        report.drift = self.compensate(drifted, &mut report, shutdown).await?;
        Ok(report)
    }

    /// Steps 1–3: the orders query, classified, and the expected events the
    /// fleet has not processed.
    async fn scan(&mut self, report: &mut Report) -> anyhow::Result<Vec<Expected>> {
        let s = self.settings;
        let (mut client, connection) =
            s.orders.connect(tokio_postgres::NoTls).await.map_err(|e| {
                anyhow!(
                    "--orders-url {}: cannot connect: {}",
                    s.orders_url,
                    s.scrub_orders(&chain(&e))
                )
            })?;
        let connection = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "the orders database connection ended");
            }
        });
        let scanned = self.scan_with(&mut client, report).await;
        drop(client);
        let _ = connection.await;
        scanned
    }

    async fn scan_with(
        &mut self,
        client: &mut tokio_postgres::Client,
        report: &mut Report,
    ) -> anyhow::Result<Vec<Expected>> {
        let s = self.settings;
        let db = |e: tokio_postgres::Error| {
            anyhow!(
                "orders database {}: {}",
                s.orders_url,
                s.scrub_orders(&chain(&e))
            )
        };
        let tx = client
            .build_transaction()
            .read_only(true)
            .start()
            .await
            .map_err(db)?;
        let statement = tx
            .prepare(&s.query)
            .await
            .map_err(|e| anyhow!("--orders-query: {}", s.scrub_orders(&chain(&e))))?;
        let columns = Columns::of(&statement)?;
        let now = SystemTime::now();
        let lower = now.checked_sub(s.window).unwrap_or(UNIX_EPOCH);
        let params: [&(dyn ToSql + Sync); 1] = [&lower];
        let rows = tx.query_raw(&statement, params).await.map_err(db)?;
        let mut rows = std::pin::pin!(rows);
        let mut candidates = Vec::new();
        let mut missing = Vec::new();
        while let Some(row) = rows.try_next().await.map_err(db)? {
            report.scanned += 1;
            let Some(snapshot) = columns.read(&row).map_err(db)? else {
                report.invalid += 1;
                continue;
            };
            if snapshot.updated_at < lower {
                report.outside_window += 1;
                continue;
            }
            // Also an order updated "in the future" (clock skew): fresh.
            if now
                .duration_since(snapshot.updated_at)
                .is_ok_and(|age| age < s.grace)
                || snapshot.updated_at > now
            {
                report.skipped_fresh += 1;
                continue;
            }
            let kinds = s.expectations.kinds(&snapshot.status);
            if kinds.is_empty() {
                report.no_expectation += 1;
                continue;
            }
            let order_key = order_key_of(&snapshot.order_id);
            let shard = self.global.shards.shard_of(&snapshot.order_id);
            for kind in kinds {
                candidates.push(Expected {
                    order_id: snapshot.order_id.clone(),
                    order_key: order_key.clone(),
                    status: snapshot.status.clone(),
                    kind: kind.clone(),
                    shard,
                });
            }
            if candidates.len() >= BATCH {
                let batch = std::mem::take(&mut candidates);
                let n = batch.len();
                let unprocessed = self.unprocessed(batch).await?;
                report.processed += (n - unprocessed.len()) as u64;
                missing.extend(unprocessed);
            }
        }
        let n = candidates.len();
        let unprocessed = self.unprocessed(candidates).await?;
        report.processed += (n - unprocessed.len()) as u64;
        missing.extend(unprocessed);
        // Read only: nothing to commit.
        tx.rollback().await.map_err(db)?;
        if report.outside_window > 0 {
            tracing::warn!(
                rows = report.outside_window,
                "the orders query returned rows updated before the window; ignored (does --orders-query use $1?)"
            );
        }
        if report.invalid > 0 {
            tracing::warn!(
                rows = report.invalid,
                "the orders query returned rows without order_id or updated_at; ignored"
            );
        }
        Ok(missing)
    }

    /// The expected events whose kind was not processed for their order.
    async fn unprocessed(&mut self, expected: Vec<Expected>) -> anyhow::Result<Vec<Expected>> {
        let prefix = &self.global.redis_prefix;
        let mut out = Vec::new();
        for chunk in expected.chunks(BATCH) {
            let mut pipe = redis::pipe();
            for e in chunk {
                pipe.cmd("EXISTS")
                    .arg(kind_key(prefix, &e.order_key, &e.kind));
            }
            let processed: Vec<bool> = redis_op(
                self.global,
                "reading processed kinds",
                pipe.query_async(&mut self.redis),
            )
            .await?;
            out.extend(
                chunk
                    .iter()
                    .zip(processed)
                    .filter(|(_, processed)| !processed)
                    .map(|(e, _)| e.clone()),
            );
        }
        Ok(out)
    }

    /// Step 4: splits the missing events into those not on their way and the
    /// pending ones, with the first reason found for each.
    async fn on_their_way(
        &mut self,
        missing: Vec<Expected>,
    ) -> anyhow::Result<(Vec<Expected>, Vec<Pending>)> {
        let (global, settings) = (self.global, self.settings);
        let prefix = global.redis_prefix.as_str();
        let names = global.names();
        let url = global.amqp_url.to_string();
        // Upstream first: a letter replayed meanwhile shows up in the shard
        // status read next, or as processed.
        let dlq_limit = settings.dlq_browse;
        let letters = crate::dlq::browse(self.broker().await?, &names, dlq_limit.saturating_add(1))
            .await
            .with_context(|| format!("reading {} on {url}", names.dead_letter_queue))?;
        let mut dead_letters = HashMap::new();
        for letter in &letters {
            if let (Some(order), Some(event)) = (&letter.order_id, letter_event(letter)) {
                dead_letters
                    .entry((order.clone(), event))
                    .or_insert_with(|| letter.id.clone().unwrap_or_else(|| "-".into()));
            }
        }
        let shards: Vec<ShardId> = missing
            .iter()
            .map(|e| e.shard)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let reports: HashMap<ShardId, ShardReport> = shards
            .iter()
            .copied()
            .zip(
                redis_op(
                    global,
                    "reading shard status",
                    status::read(&mut self.redis, prefix, &shards),
                )
                .await?,
            )
            .filter_map(|(shard, report)| Some((shard, report?)))
            .collect();
        // Shards nobody reports: whatever waits in their queue is on its way.
        let mut unreported = HashMap::new();
        for shard in shards.iter().filter(|s| !reports.contains_key(s)) {
            let queue = names.shard_queue(*shard);
            let st = declare::queue_status(self.broker().await?, &queue)
                .await
                .with_context(|| format!("reading {queue} on {url}"))?;
            unreported.insert(*shard, st.messages);
        }
        let mut pipe = redis::pipe();
        for e in &missing {
            pipe.cmd("EXISTS").arg(e.emitted_key(prefix));
        }
        let compensated: Vec<bool> = redis_op(
            global,
            "reading emitted compensations",
            pipe.query_async(&mut self.redis),
        )
        .await?;
        let seen = Whereabouts {
            reports,
            unreported,
            dead_letters,
            dlq_read_whole: letters.len() as u64 <= dlq_limit,
            dlq_limit,
            grace: settings.grace,
            now_ms: unix_ms(),
        };
        let mut drifted = Vec::new();
        let mut pending = Vec::new();
        for (e, compensated) in missing.into_iter().zip(compensated) {
            match seen.on_its_way(&e, compensated) {
                Some(why) => pending.push(Pending { expected: e, why }),
                None => drifted.push(e),
            }
        }
        Ok((drifted, pending))
    }

    /// Step 5: a compensation per drifted event (none in a dry run, none past
    /// `--max-emit`); a compensation another run is emitting becomes pending.
    async fn compensate(
        &mut self,
        drifted: Vec<Expected>,
        report: &mut Report,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Vec<Drift>> {
        let s = self.settings;
        let count = drifted.len();
        let over_limit = count > s.max_emit;
        if over_limit && !s.dry_run {
            tracing::error!(
                drifted = count,
                max_emit = s.max_emit,
                "more drift than --max-emit: emitting nothing"
            );
        }
        let mut out = Vec::with_capacity(drifted.len());
        for expected in drifted {
            let body = match expected.compensation() {
                Ok(body) => body,
                Err(e) => {
                    out.push(Drift {
                        expected,
                        compensation: Compensation::NotEmitted(e),
                    });
                    continue;
                }
            };
            let compensation = if s.dry_run {
                Compensation::WouldEmit
            } else if over_limit {
                Compensation::NotEmitted(format!("{count} drifted, over --max-emit {}", s.max_emit))
            } else if shutdown.is_cancelled() {
                Compensation::NotEmitted("stopped by a signal".into())
            } else if self.emit(&expected, body).await? {
                Compensation::Emitted
            } else {
                report.pending.push(Pending {
                    expected,
                    why: OnItsWay::Compensated,
                });
                continue;
            };
            out.push(Drift {
                expected,
                compensation,
            });
        }
        Ok(out)
    }

    /// Claims the compensation in Redis, publishes it and waits for the
    /// broker's confirm, then records it for the window. False when another
    /// run holds the claim.
    async fn emit(&mut self, expected: &Expected, body: Vec<u8>) -> anyhow::Result<bool> {
        let key = expected.emitted_key(&self.global.redis_prefix);
        let claimed: Option<String> = redis_op(
            self.global,
            "claiming a compensation",
            redis::cmd("SET")
                .arg(&key)
                .arg("emitting")
                .arg("NX")
                .arg("PX")
                .arg(millis(CLAIM_TTL))
                .query_async(&mut self.redis),
        )
        .await?;
        if claimed.is_none() {
            return Ok(false);
        }
        if let Err(e) = self.publish(body).await {
            // Unclaimed, so that the next run tries again.
            let released: anyhow::Result<()> = redis_op(
                self.global,
                "releasing a compensation claim",
                redis::cmd("DEL").arg(&key).query_async(&mut self.redis),
            )
            .await;
            if let Err(r) = released {
                tracing::warn!(error = %format!("{r:#}"), key, "cannot release the claim; it expires by itself");
            }
            return Err(e.context(format!(
                "publishing the compensation of {}",
                expected.describe()
            )));
        }
        let emitted_at = format!("emitted:{}", unix_ms());
        redis_op::<()>(
            self.global,
            "recording a compensation",
            redis::cmd("SET")
                .arg(&key)
                .arg(emitted_at)
                .arg("EX")
                .arg(self.settings.window.as_secs().max(1))
                .query_async(&mut self.redis),
        )
        .await?;
        tracing::info!(
            order_id = %expected.order_id,
            event = %expected.kind,
            status = %expected.status,
            shard = expected.shard.get(),
            event_id = %expected.event_id(),
            "compensation emitted"
        );
        Ok(true)
    }

    async fn publish(&mut self, body: Vec<u8>) -> anyhow::Result<()> {
        let publisher = match &mut self.publisher {
            Some(p) => p,
            None => {
                let config =
                    crate::publish::publisher_config(self.global, 1, "shardline reconcile");
                self.publisher.insert(Publisher::connect(config).await?)
            }
        };
        publisher.publish(body).await?;
        publisher.flush().await?;
        Ok(())
    }

    async fn broker(&mut self) -> anyhow::Result<&lapin::Connection> {
        let conn = match self.broker.take() {
            Some(conn) => conn,
            None => {
                shardline_topology::connect(&self.global.amqp_url, "shardline reconcile").await?
            }
        };
        Ok(self.broker.insert(conn))
    }

    async fn close(self) {
        if let Some(publisher) = self.publisher
            && let Err(e) = publisher.close().await
        {
            tracing::debug!(error = %e, "closing the reconcile publisher");
        }
        if let Some(conn) = self.broker
            && let Err(e) = conn.close(200, "done".into()).await
        {
            tracing::debug!(error = %e, "closing the reconcile connection");
        }
    }
}

/// The event kind of a dead letter: its envelope's, else the `event` of a body
/// that is JSON but not a valid envelope.
fn letter_event(letter: &crate::dlq::Letter) -> Option<String> {
    if let Some(envelope) = &letter.envelope {
        return Some(envelope.event.clone());
    }
    let json: serde_json::Value = serde_json::from_slice(&letter.delivery.data).ok()?;
    json.get("event")?.as_str().map(str::to_owned)
}

/// Where the three columns are in the query's rows, and how to read them.
struct Columns {
    order_id: (usize, IdType),
    status: usize,
    updated_at: usize,
}

/// SQL types an `order_id` may have.
#[derive(Debug, Clone, Copy)]
enum IdType {
    Text,
    Int2,
    Int4,
    Int8,
}

/// One usable row of the orders query.
struct Snapshot {
    order_id: String,
    status: String,
    updated_at: SystemTime,
}

impl Columns {
    fn of(statement: &tokio_postgres::Statement) -> anyhow::Result<Self> {
        let params = statement.params();
        anyhow::ensure!(
            params.len() == 1,
            "--orders-query must take exactly one parameter, $1 (the lower bound of updated_at); it takes {}",
            params.len()
        );
        let find = |name: &str| -> anyhow::Result<(usize, &Type)> {
            statement
                .columns()
                .iter()
                .enumerate()
                .find(|(_, c)| c.name() == name)
                .map(|(i, c)| (i, c.type_()))
                .ok_or_else(|| {
                    anyhow!("--orders-query returns no column `{name}` (it must return order_id, status, updated_at)")
                })
        };
        let (id_at, id_type) = find("order_id")?;
        let id_type = if <String as FromSql>::accepts(id_type) {
            IdType::Text
        } else if *id_type == Type::INT2 {
            IdType::Int2
        } else if *id_type == Type::INT4 {
            IdType::Int4
        } else if *id_type == Type::INT8 {
            IdType::Int8
        } else {
            anyhow::bail!(
                "--orders-query: column order_id is of type {id_type}; select it as text (order_id::text)"
            );
        };
        let (status, status_type) = find("status")?;
        anyhow::ensure!(
            <String as FromSql>::accepts(status_type),
            "--orders-query: column status is of type {status_type}; select it as text (status::text)"
        );
        let (updated_at, updated_type) = find("updated_at")?;
        anyhow::ensure!(
            <SystemTime as FromSql>::accepts(updated_type),
            "--orders-query: column updated_at is of type {updated_type}; it must be a timestamptz or timestamp"
        );
        Ok(Self {
            order_id: (id_at, id_type),
            status,
            updated_at,
        })
    }

    /// The row's snapshot; `None` when it has no order id or no `updated_at`.
    fn read(&self, row: &tokio_postgres::Row) -> Result<Option<Snapshot>, tokio_postgres::Error> {
        let (at, ty) = self.order_id;
        let order_id = match ty {
            IdType::Text => row.try_get::<_, Option<String>>(at)?,
            IdType::Int2 => row.try_get::<_, Option<i16>>(at)?.map(|n| n.to_string()),
            IdType::Int4 => row.try_get::<_, Option<i32>>(at)?.map(|n| n.to_string()),
            IdType::Int8 => row.try_get::<_, Option<i64>>(at)?.map(|n| n.to_string()),
        };
        // A NULL status implies nothing, like any status without an expectation.
        let status = row
            .try_get::<_, Option<String>>(self.status)?
            .map(|s| s.trim_end().to_owned())
            .unwrap_or_default();
        let updated_at = row.try_get::<_, Option<SystemTime>>(self.updated_at)?;
        Ok(match (order_id, updated_at) {
            (Some(order_id), Some(updated_at)) if !order_id.is_empty() => Some(Snapshot {
                order_id,
                status,
                updated_at,
            }),
            _ => None,
        })
    }
}

/// One Redis round trip under [`REDIS_TIMEOUT`], its error naming what it did.
async fn redis_op<T>(
    global: &GlobalArgs,
    what: &str,
    op: impl Future<Output = redis::RedisResult<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(REDIS_TIMEOUT, op).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(anyhow!(
            "{what} in Redis {}: {}",
            global.redis_url,
            global.redis_url.scrub(&e.to_string())
        )),
        Err(_) => Err(anyhow!(
            "{what} in Redis {}: no answer within {REDIS_TIMEOUT:?}",
            global.redis_url
        )),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabel {
    outcome: &'static str,
}

/// The reconcile metrics: totals over the runs of this process.
struct Metrics {
    registry: Registry,
    scanned: Counter,
    skipped_fresh: Counter,
    no_expectation: Counter,
    processed: Counter,
    drifted: Counter,
    emitted: Counter,
    pending: Counter,
    runs: Family<RunLabel, Counter>,
    last_run: Gauge<f64, AtomicU64>,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let scanned = counter(
            &mut registry,
            names::SCANNED,
            "Rows the orders query returned",
        );
        let skipped_fresh = counter(
            &mut registry,
            names::SKIPPED_FRESH,
            "Orders skipped because they were updated within the grace",
        );
        let no_expectation = counter(
            &mut registry,
            names::NO_EXPECTATION,
            "Orders whose status implies no event",
        );
        let processed = counter(
            &mut registry,
            names::PROCESSED,
            "Expected events the fleet had processed",
        );
        let drifted = counter(
            &mut registry,
            names::DRIFTED,
            "Expected events never processed and not on their way",
        );
        let emitted = counter(
            &mut registry,
            names::EMITTED,
            "Compensation events published and confirmed",
        );
        let pending = counter(
            &mut registry,
            names::PENDING,
            "Expected events missing but possibly on their way (held, dead-lettered, behind a backlog, compensated earlier)",
        );
        let runs = Family::<RunLabel, Counter>::default();
        for outcome in ["ok", "error"] {
            let _ = runs.get_or_create(&RunLabel { outcome });
        }
        registry.register(names::RUNS, "Reconcile runs, by outcome", runs.clone());
        let last_run = Gauge::<f64, AtomicU64>::default();
        registry.register(
            names::LAST_RUN,
            "Unix time at which the last successful run ended",
            last_run.clone(),
        );
        Self {
            registry,
            scanned,
            skipped_fresh,
            no_expectation,
            processed,
            drifted,
            emitted,
            pending,
            runs,
            last_run,
        }
    }

    /// Adds a run's counts; `None` for a failed run.
    fn record(&self, report: Option<&Report>) {
        let Some(r) = report else {
            self.runs
                .get_or_create(&RunLabel { outcome: "error" })
                .inc();
            return;
        };
        self.scanned.inc_by(r.scanned);
        self.skipped_fresh.inc_by(r.skipped_fresh);
        self.no_expectation.inc_by(r.no_expectation);
        self.processed.inc_by(r.processed);
        self.drifted.inc_by(r.drift.len() as u64);
        self.emitted.inc_by(r.emitted());
        self.pending.inc_by(r.pending.len() as u64);
        self.runs.get_or_create(&RunLabel { outcome: "ok" }).inc();
        self.last_run.set(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
    }

    fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(2048);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Serves `/metrics` on `listener` until `shutdown`.
async fn serve(listener: TcpListener, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    shardline_worker::http::serve_with(listener, shutdown, move |req| {
        respond(Arc::clone(&metrics), req)
    })
    .await;
}

async fn respond(
    metrics: Arc<Metrics>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&hyper::Method::GET | &hyper::Method::HEAD, "/metrics") => match metrics.encode() {
            Ok(text) => (StatusCode::OK, METRICS_CONTENT_TYPE, text),
            Err(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "cannot encode metrics\n".into(),
            ),
        },
        (&hyper::Method::GET | &hyper::Method::HEAD, "/healthz") => (
            StatusCode::OK,
            "application/json",
            "{\"alive\":true}\n".into(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_topology::ShardCount;
    use shardline_worker::status::HeldRef;

    fn expected(order_id: &str, kind: &str) -> Expected {
        Expected {
            order_id: order_id.into(),
            order_key: order_key_of(order_id),
            status: "PAID".into(),
            kind: kind.into(),
            shard: ShardCount::default().shard_of(order_id),
        }
    }

    #[test]
    fn expectations_default_and_replace() {
        let defaults = Expectations::new(&[]);
        assert_eq!(defaults.kinds("PAID"), ["payment.captured"]);
        assert_eq!(defaults.kinds("INVENTORY_RESERVED"), ["inventory.reserved"]);
        assert_eq!(defaults.kinds("FULFILLED"), ["order.fulfilled"]);
        assert!(defaults.kinds("CREATED").is_empty());
        assert!(defaults.kinds("paid").is_empty(), "statuses match exactly");

        let pairs = [
            parse_expect("SHIPPED=order.shipped").unwrap(),
            parse_expect("SHIPPED = order.packed").unwrap(),
            parse_expect("SHIPPED=order.shipped").unwrap(),
        ];
        let custom = Expectations::new(&pairs);
        assert_eq!(custom.kinds("SHIPPED"), ["order.shipped", "order.packed"]);
        assert!(
            custom.kinds("PAID").is_empty(),
            "--expect replaces the defaults"
        );
        assert_eq!(
            custom.describe(),
            "SHIPPED=order.shipped, SHIPPED=order.packed"
        );
    }

    #[test]
    fn expect_flag_is_checked() {
        assert!(parse_expect("PAID").is_err());
        assert!(parse_expect("=payment.captured").is_err());
        assert!(parse_expect("PAID=").is_err());
        assert!(parse_expect("PAID=a\u{7}b").is_err());
        assert!(parse_expect(&format!("PAID={}", "x".repeat(300))).is_err());
        assert!(parse_interval("0s").is_err());
        assert_eq!(parse_interval("5m"), Ok(Duration::from_secs(300)));
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact_orders_url("postgres://app:s3cret@db:5432/orders?sslmode=disable"),
            "postgres://app:***@db:5432/orders?sslmode=disable"
        );
        assert_eq!(
            redact_orders_url("postgres://db/orders?user=app&password=s3cret&x=1"),
            "postgres://db/orders?user=app&password=***&x=1"
        );
        assert_eq!(
            redact_orders_url("host=db user=app password=s3cret dbname=orders"),
            "host=db user=app password=*** dbname=orders"
        );
        assert_eq!(
            redact_orders_url("postgres://db/orders"),
            "postgres://db/orders"
        );
        let args = |url: &str| ReconcileArgs {
            orders_url: url.into(),
            orders_query: DEFAULT_QUERY.into(),
            window: Duration::from_secs(86_400),
            grace: Duration::from_secs(120),
            expect: Vec::new(),
            interval: None,
            dry_run: false,
            json: false,
            max_emit: 1000,
            dlq_browse: 10,
        };
        let settings = Settings::new(&args("postgres://app:s3cret@db/orders")).unwrap();
        assert_eq!(
            settings.scrub_orders("failed for s3cret\nDETAIL: s3cret"),
            "failed for ***; DETAIL: ***"
        );
        let bad = Settings::new(&args("postgres://app:s3cret@db:notaport/orders"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            bad.starts_with("--orders-url postgres://app:***@db:notaport/orders: "),
            "{bad}"
        );
        assert!(!bad.contains("s3cret") && !bad.contains('\n'), "{bad}");
        let mut grace_too_long = args("postgres://db/orders");
        grace_too_long.grace = grace_too_long.window;
        assert!(Settings::new(&grace_too_long).is_err());
    }

    #[test]
    fn compensation_is_a_seqless_envelope_with_a_stable_id() {
        let e = expected("A:1%", "payment.captured");
        assert_eq!(e.event_id(), "reconcile:A:1%:payment.captured");
        assert_eq!(e.emitted_key("p:"), "p:reconcile:A%3A1%25:payment.captured");
        let body = e.compensation().unwrap();
        let envelope = Envelope::parse(&body, usize::MAX).unwrap();
        assert_eq!(envelope.order_id, "A:1%");
        assert_eq!(envelope.event, "payment.captured");
        assert_eq!(
            envelope.seq, None,
            "seq-less: the sequence gate lets it through"
        );
        assert_eq!(
            envelope.event_id.as_deref(),
            Some("reconcile:A:1%:payment.captured")
        );
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["compensation"], true);
        assert_eq!(json["reason"], "status=PAID missing=payment.captured");

        let long = expected(&"x".repeat(250), "payment.captured");
        assert!(long.compensation().unwrap_err().contains("event_id"));
    }

    #[test]
    fn pending_reasons_in_their_order() {
        let e = expected("A1", "payment.captured");
        let report = |backlog: f64, held: Vec<HeldRef>| ShardReport {
            shard: e.shard.get(),
            owner: "w".into(),
            backlog_age_seconds: backlog,
            inflight_age_seconds: None,
            held_events: held.len() as u64,
            held,
            updated_at_ms: 1_000_000,
        };
        let mut seen = Whereabouts {
            reports: HashMap::from([(e.shard, report(0.0, Vec::new()))]),
            unreported: HashMap::new(),
            dead_letters: HashMap::new(),
            dlq_read_whole: true,
            dlq_limit: 10,
            grace: Duration::from_secs(120),
            now_ms: 1_000_000,
        };
        assert_eq!(
            seen.on_its_way(&e, false),
            None,
            "nothing suggests it will arrive"
        );
        assert_eq!(seen.on_its_way(&e, true), Some(OnItsWay::Compensated));

        // Behind by the grace exactly: not yet; the report ages from when it was written.
        seen.reports.insert(e.shard, report(120.0, Vec::new()));
        assert_eq!(seen.on_its_way(&e, false), None);
        seen.now_ms += 1_000;
        assert_eq!(
            seen.on_its_way(&e, false),
            Some(OnItsWay::Backlog {
                age: Duration::from_secs(121)
            })
        );

        seen.dead_letters
            .insert(("A1".into(), "payment.captured".into()), "dl-1".into());
        assert_eq!(
            seen.on_its_way(&e, false),
            Some(OnItsWay::DeadLettered { id: "dl-1".into() })
        );
        let other_kind = expected("A1", "order.fulfilled");
        assert!(matches!(
            seen.on_its_way(&other_kind, false),
            Some(OnItsWay::Backlog { .. })
        ));

        let held = |order_key: &str, event: &str| HeldRef {
            order_key: order_key.into(),
            event: event.into(),
        };
        seen.reports.insert(
            e.shard,
            report(
                0.0,
                vec![held("A2", "payment.captured"), held("A1", "order.packed")],
            ),
        );
        seen.dead_letters.clear();
        assert_eq!(seen.on_its_way(&e, false), None, "held events of others");
        seen.reports
            .insert(e.shard, report(0.0, vec![held("A1", "payment.captured")]));
        assert_eq!(seen.on_its_way(&e, false), Some(OnItsWay::Held));

        // Nobody reports the shard: its queued messages may hold the event.
        seen.reports.clear();
        seen.unreported.insert(e.shard, 0);
        assert_eq!(seen.on_its_way(&e, false), None);
        seen.unreported.insert(e.shard, 3);
        assert_eq!(
            seen.on_its_way(&e, false),
            Some(OnItsWay::Unconsumed { messages: 3 })
        );
        seen.unreported.clear();
        seen.dlq_read_whole = false;
        assert_eq!(
            seen.on_its_way(&e, false),
            Some(OnItsWay::DlqNotRead { limit: 10 })
        );
    }

    #[test]
    fn report_counts_and_attention() {
        let mut report = Report {
            scanned: 4,
            skipped_fresh: 1,
            no_expectation: 1,
            processed: 1,
            drift: vec![Drift {
                expected: expected("A1", "payment.captured"),
                compensation: Compensation::Emitted,
            }],
            ..Report::default()
        };
        assert_eq!(report.emitted(), 1);
        assert!(!report.needs_attention());
        assert!(
            report.text().ends_with(
                "reconcile: scanned 4, skipped fresh 1, no expectation 1, processed 1, pending 0, drifted 1, emitted 1\n"
            ),
            "{}",
            report.text()
        );
        report.dry_run = true;
        report.drift[0].compensation = Compensation::WouldEmit;
        assert_eq!(report.emitted(), 0);
        assert!(report.needs_attention(), "drift left alone needs attention");
        assert!(
            report
                .text()
                .contains("would emit   order=A1 event=payment.captured")
        );
        report.pending.push(Pending {
            expected: expected("A2", "payment.captured"),
            why: OnItsWay::DeadLettered { id: "dl-1".into() },
        });
        assert!(
            report
                .text()
                .contains("pending      order=A2 event=payment.captured status=PAID")
        );
        assert!(report.text().contains("in the DLQ (dead letter dl-1)"));
    }

    #[test]
    fn metrics_are_exposed_under_their_names() {
        let metrics = Metrics::new();
        let report = Report {
            scanned: 4,
            skipped_fresh: 1,
            drift: vec![Drift {
                expected: expected("A1", "payment.captured"),
                compensation: Compensation::Emitted,
            }],
            ..Report::default()
        };
        metrics.record(Some(&report));
        metrics.record(None);
        let text = metrics.encode().unwrap();
        for line in [
            "shardline_reconcile_scanned_total 4",
            "shardline_reconcile_skipped_fresh_total 1",
            "shardline_reconcile_no_expectation_total 0",
            "shardline_reconcile_drifted_total 1",
            "shardline_reconcile_emitted_total 1",
            "shardline_reconcile_pending_total 0",
            "shardline_reconcile_runs_total{outcome=\"ok\"} 1",
            "shardline_reconcile_runs_total{outcome=\"error\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("shardline_reconcile_last_run_timestamp_seconds ")),
            "{text}"
        );
    }
}
