//! `shardline dlq list|show|replay|purge`: the dead-letter queue tool, and the
//! non-destructive DLQ reader `topology status` shares.
//!
//! Every command reads the DLQ with `basic.get` without acking on one channel;
//! what it removes (a confirmed replay, a purge) it acks on that channel, and
//! closing the channel returns everything else to the queue in its order
//! (RabbitMQ marks those letters redelivered).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::{AMQPValue, LongString};
use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceId, Tracer as _};
use opentelemetry::{Context, KeyValue};
use redis::aio::MultiplexedConnection;
use shardline_publisher::{Config, Publisher};
use shardline_topology::headers::{self, FailReason, header_i64, header_str};
use shardline_topology::telemetry::{self, attr, op};
use shardline_topology::{Envelope, Names, ShardId};

use crate::GlobalArgs;

/// Exit code of `dlq purge` without `--yes`.
const EXIT_REFUSED: u8 = 2;
/// Longest error text in the `list` table (JSON carries it whole).
const ERROR_CHARS: usize = 60;

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Every dead letter (or the matching ones) and a summary by reason and by
    /// error. Non-destructive: the DLQ is left as it was, in the same order.
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
}

/// Which dead letters a command acts on (all of them without a filter).
#[derive(Debug, Clone, Default, Args)]
pub struct Filters {
    /// Only letters with this `x-fail-reason` (decode, invalid, handler, timeout,
    /// seq-gap, late, crash-loop, quarantined; `unknown` for letters without one).
    #[arg(long)]
    pub reason: Option<String>,
    /// Only letters whose envelope's `order_id` is this.
    #[arg(long)]
    pub order_id: Option<String>,
    /// Only letters dead-lettered from this shard (`x-shard`).
    #[arg(long)]
    pub shard: Option<u16>,
    /// At most this many matching letters (reading stops there).
    #[arg(long)]
    pub limit: Option<usize>,
}

impl Filters {
    fn matches(&self, letter: &Letter) -> bool {
        self.reason.as_ref().is_none_or(|r| *r == letter.reason)
            && self
                .order_id
                .as_ref()
                .is_none_or(|o| letter.order_id.as_ref() == Some(o))
            && self
                .shard
                .is_none_or(|s| letter.shard == Some(i64::from(s)))
    }
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub filters: Filters,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The letter's `x-dead-letter-id`.
    pub id: String,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
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
    /// meanwhile.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// The quarantined order.
    #[arg(long)]
    pub order_id: String,
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub filters: Filters,
    /// Really delete them.
    #[arg(long)]
    pub yes: bool,
}

/// One dead letter as read from the DLQ (not acked yet), with its
/// dead-letter headers and, when its body is an envelope, the order and seq.
pub struct Letter {
    pub delivery: Delivery,
    pub id: Option<String>,
    /// `x-fail-reason`, `unknown` without one.
    pub reason: String,
    pub error: Option<String>,
    /// `x-retry-count`: handler attempts made.
    pub attempts: Option<i64>,
    pub shard: Option<i64>,
    pub original_routing_key: Option<String>,
    pub first_failed_at: Option<String>,
    pub envelope: Option<Envelope>,
    pub order_id: Option<String>,
    pub seq: Option<u64>,
}

impl Letter {
    fn new(delivery: Delivery) -> Self {
        let props = &delivery.properties;
        let text = |name| header_str(props, name).map(str::to_owned);
        let envelope = Envelope::parse(&delivery.data, Config::default().max_body_bytes).ok();
        // A body that is JSON but not a valid envelope may still name its order.
        let loose: Option<serde_json::Value> = envelope
            .is_none()
            .then(|| serde_json::from_slice(&delivery.data).ok())
            .flatten();
        let order_id = envelope.as_ref().map(|e| e.order_id.clone()).or_else(|| {
            loose
                .as_ref()
                .and_then(|j| j.get("order_id")?.as_str().map(str::to_owned))
        });
        let seq = envelope
            .as_ref()
            .and_then(|e| e.seq)
            .or_else(|| loose.as_ref().and_then(|j| j.get("seq")?.as_u64()));
        Self {
            id: text(headers::DEAD_LETTER_ID),
            reason: text(headers::FAIL_REASON).unwrap_or_else(|| "unknown".into()),
            error: text(headers::ERROR),
            attempts: header_i64(props, headers::RETRY_COUNT),
            shard: header_i64(props, headers::SHARD),
            original_routing_key: text(headers::ORIGINAL_ROUTING_KEY),
            first_failed_at: text(headers::FIRST_FAILED_AT),
            envelope,
            order_id,
            seq,
            delivery,
        }
    }

    /// Time since `x-first-failed-at`.
    fn age(&self, now: SystemTime) -> Option<Duration> {
        let at = humantime::parse_rfc3339_weak(self.first_failed_at.as_deref()?).ok()?;
        Some(now.duration_since(at).unwrap_or_default())
    }

    fn id(&self) -> &str {
        self.id.as_deref().unwrap_or("-")
    }

    fn describe(&self) -> String {
        format!(
            "{} reason={} order={} seq={} shard={}",
            self.id(),
            self.reason,
            self.order_id.as_deref().unwrap_or("-"),
            opt(self.seq),
            opt(self.shard)
        )
    }

    fn json(&self, now: SystemTime) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "reason": self.reason,
            "error": self.error,
            "attempts": self.attempts,
            "order_id": self.order_id,
            "event": self.envelope.as_ref().map(|e| e.event.as_str()),
            "seq": self.seq,
            "shard": self.shard,
            "original_routing_key": self.original_routing_key,
            "first_failed_at": self.first_failed_at,
            "age_seconds": self.age(now).map(|a| a.as_secs_f64().round()),
            "body_bytes": self.delivery.data.len(),
        })
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Reads the DLQ on its own channel without acking.
pub struct Reader {
    channel: lapin::Channel,
    queue: String,
}

impl Reader {
    pub async fn open(conn: &lapin::Connection, names: &Names) -> anyhow::Result<Self> {
        Ok(Self {
            channel: conn.create_channel().await?,
            queue: names.dead_letter_queue.clone(),
        })
    }

    /// The next letter, `None` when the queue has nothing left to hand out.
    pub async fn next(&self) -> anyhow::Result<Option<Letter>> {
        let got = self
            .channel
            .basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?;
        Ok(got.map(|m| Letter::new(m.delivery)))
    }

    /// Reads until the queue is empty or `limit` letters matched; the others
    /// are kept (unacked) until [`Self::release`]. Returns the matching ones
    /// and how many were read.
    pub async fn select(
        &self,
        filters: &Filters,
    ) -> anyhow::Result<(Vec<Letter>, usize, Vec<Letter>)> {
        self.select_by(|l| filters.matches(l), filters.limit).await
    }

    /// [`Self::select`] with any predicate.
    async fn select_by(
        &self,
        matches: impl Fn(&Letter) -> bool,
        limit: Option<usize>,
    ) -> anyhow::Result<(Vec<Letter>, usize, Vec<Letter>)> {
        let mut matched = Vec::new();
        let mut others = Vec::new();
        let mut read = 0;
        while limit.is_none_or(|l| matched.len() < l) {
            let Some(letter) = self.next().await? else {
                break;
            };
            read += 1;
            if matches(&letter) {
                matched.push(letter);
            } else {
                others.push(letter);
            }
        }
        Ok((matched, read, others))
    }

    /// Closes the channel: every letter read and not acked returns to the
    /// queue, in its order.
    pub async fn release(self) {
        if let Err(e) = self.channel.close(200, "browsed".into()).await {
            tracing::debug!(error = %e, "closing the DLQ channel");
        }
    }
}

/// Reads at most `limit` dead letters and returns them all to the queue, in
/// order (the DLQ is left as it was).
pub async fn browse(
    conn: &lapin::Connection,
    names: &Names,
    limit: u64,
) -> anyhow::Result<Vec<Letter>> {
    let reader = Reader::open(conn, names).await?;
    let mut letters = Vec::new();
    let read = async {
        while (letters.len() as u64) < limit {
            let Some(letter) = reader.next().await? else {
                break;
            };
            letters.push(letter);
        }
        anyhow::Ok(())
    }
    .await;
    reader.release().await;
    read.map(|()| letters)
}

pub async fn run(global: &GlobalArgs, cmd: DlqCommand) -> anyhow::Result<ExitCode> {
    if let DlqCommand::Purge(args) = &cmd
        && !args.yes
    {
        eprintln!(
            "error: `dlq purge` deletes dead letters for good; add --yes to do it (see `dlq list` first)"
        );
        return Ok(ExitCode::from(EXIT_REFUSED));
    }
    let names = global.names();
    let url = global.amqp_url.to_string();
    let conn = shardline_topology::connect(&global.amqp_url, "shardline dlq").await?;
    let reader = Reader::open(&conn, &names)
        .await
        .with_context(|| format!("opening {} on {url}", names.dead_letter_queue))?;
    let result = match cmd {
        DlqCommand::List(args) => list(&reader, &args).await,
        DlqCommand::Show(args) => show(&reader, &args).await,
        DlqCommand::Replay(args) => replay(global, &reader, &args).await,
        DlqCommand::Purge(args) => purge(&reader, &args).await,
        DlqCommand::Release(args) => release(global, &reader, &args).await,
    }
    .with_context(|| format!("{} on {url}", names.dead_letter_queue));
    // Everything read and not acked goes back, in order.
    reader.release().await;
    if let Err(e) = conn.close(200, "done".into()).await {
        tracing::debug!(error = %e, "closing the dlq connection");
    }
    result
}

async fn list(reader: &Reader, args: &ListArgs) -> anyhow::Result<ExitCode> {
    let (letters, read, _others) = reader.select(&args.filters).await?;
    let now = SystemTime::now();
    let summary = Summary::of(&letters, now);
    if args.json {
        let json = serde_json::json!({
            "read": read,
            "matched": letters.len(),
            "dead_letters": letters.iter().map(|l| l.json(now)).collect::<Vec<_>>(),
            "summary": summary.json(),
        });
        println!("{json:#}");
    } else {
        print!("{}", list_table(&letters, read, &summary, now));
    }
    Ok(ExitCode::SUCCESS)
}

/// Counts and oldest age per reason and per (reason, error).
struct Summary {
    by_reason: BTreeMap<String, Group>,
    by_error: BTreeMap<(String, String), Group>,
}

#[derive(Default)]
struct Group {
    count: u64,
    oldest: Option<Duration>,
}

impl Group {
    fn add(&mut self, age: Option<Duration>) {
        self.count += 1;
        self.oldest = self.oldest.max(age);
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count,
            "oldest_age_seconds": self.oldest.map(|a| a.as_secs_f64().round()),
        })
    }
}

impl Summary {
    fn of(letters: &[Letter], now: SystemTime) -> Self {
        let mut by_reason: BTreeMap<String, Group> = BTreeMap::new();
        let mut by_error: BTreeMap<(String, String), Group> = BTreeMap::new();
        for l in letters {
            let age = l.age(now);
            by_reason.entry(l.reason.clone()).or_default().add(age);
            let error = l.error.clone().unwrap_or_else(|| "-".into());
            by_error
                .entry((l.reason.clone(), error))
                .or_default()
                .add(age);
        }
        Self {
            by_reason,
            by_error,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "by_reason": self.by_reason.iter().map(|(reason, g)| {
                let mut v = g.json();
                v["reason"] = reason.as_str().into();
                v
            }).collect::<Vec<_>>(),
            "by_error": self.by_error.iter().map(|((reason, error), g)| {
                let mut v = g.json();
                v["reason"] = reason.as_str().into();
                v["error"] = error.as_str().into();
                v
            }).collect::<Vec<_>>(),
        })
    }
}

fn age_text(age: Option<Duration>) -> String {
    age.map_or_else(
        || "-".into(),
        |a| humantime::format_duration(Duration::from_secs(a.as_secs())).to_string(),
    )
}

fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

fn list_table(letters: &[Letter], read: usize, summary: &Summary, now: SystemTime) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} dead letter(s) matched of {read} read",
        letters.len()
    );
    if letters.is_empty() {
        return out;
    }
    let id_w = letters
        .iter()
        .map(|l| l.id().len())
        .max()
        .unwrap_or(2)
        .max(2);
    let order_w = letters
        .iter()
        .map(|l| l.order_id.as_deref().map_or(1, str::len))
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        out,
        "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  error",
        "id", "reason", "attempts", "order", "seq", "shard", "first failed", "age"
    );
    for l in letters {
        let _ = writeln!(
            out,
            "{:<id_w$}  {:<11}  {:>8}  {:<order_w$}  {:>5}  {:>5}  {:<24}  {:>10}  {}",
            l.id(),
            l.reason,
            opt(l.attempts),
            l.order_id.as_deref().unwrap_or("-"),
            opt(l.seq),
            opt(l.shard),
            l.first_failed_at.as_deref().unwrap_or("-"),
            age_text(l.age(now)),
            cut(l.error.as_deref().unwrap_or("-"), ERROR_CHARS),
        );
    }
    let _ = writeln!(out, "by reason:");
    for (reason, g) in &summary.by_reason {
        let _ = writeln!(
            out,
            "  {reason:<11}  {:>6}  oldest {}",
            g.count,
            age_text(g.oldest)
        );
    }
    let _ = writeln!(out, "by error:");
    for ((reason, error), g) in &summary.by_error {
        let _ = writeln!(
            out,
            "  {reason:<11}  {:>6}  oldest {:>10}  {}",
            g.count,
            age_text(g.oldest),
            cut(error, ERROR_CHARS)
        );
    }
    out
}

async fn show(reader: &Reader, args: &ShowArgs) -> anyhow::Result<ExitCode> {
    let letter = loop {
        let Some(letter) = reader.next().await? else {
            anyhow::bail!("no dead letter with x-dead-letter-id {}", args.id);
        };
        if letter.id.as_deref() == Some(args.id.as_str()) {
            break letter;
        }
    };
    print!("{}", show_text(&letter));
    Ok(ExitCode::SUCCESS)
}

fn value_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        other => match shardline_topology::headers::value_i64(other) {
            Some(n) => n.to_string(),
            None => format!("{other:?}"),
        },
    }
}

fn show_text(letter: &Letter) -> String {
    let d = &letter.delivery;
    let p = &d.properties;
    let mut out = String::new();
    let _ = writeln!(out, "dead letter {}", letter.id());
    let _ = writeln!(out, "routing key: {}", d.routing_key.as_str());
    let _ = writeln!(
        out,
        "message id: {}",
        p.message_id().as_ref().map_or("-", |s| s.as_str())
    );
    let _ = writeln!(
        out,
        "content type: {}",
        p.content_type().as_ref().map_or("-", |s| s.as_str())
    );
    let _ = writeln!(out, "delivery mode: {}", opt(*p.delivery_mode()));
    let _ = writeln!(out, "timestamp: {}", opt(*p.timestamp()));
    let _ = writeln!(out, "headers:");
    if let Some(h) = p.headers() {
        for (name, value) in h.inner() {
            let _ = writeln!(out, "  {}: {}", name.as_str(), value_text(value));
        }
    }
    let _ = writeln!(out, "body ({} bytes):", d.data.len());
    let _ = writeln!(out, "{}", String::from_utf8_lossy(&d.data));
    out
}

/// The order a replay publishes in: letters of one order by seq (letters
/// without a seq keep their place before the others), orders in the order
/// their first letter was read.
fn replay_order(letters: Vec<Letter>) -> Vec<Letter> {
    let mut orders: Vec<(String, Vec<Letter>)> = Vec::new();
    for l in letters {
        let key = l.order_id.clone().unwrap_or_default();
        match orders.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(l),
            None => orders.push((key, vec![l])),
        }
    }
    orders
        .into_iter()
        .flat_map(|(_, mut v)| {
            v.sort_by_key(|l| l.seq.unwrap_or(0));
            v
        })
        .collect()
}

async fn replay(
    global: &GlobalArgs,
    reader: &Reader,
    args: &ReplayArgs,
) -> anyhow::Result<ExitCode> {
    if let Some(rate) = args.rate {
        anyhow::ensure!(rate > 0.0 && rate.is_finite(), "--rate must be above 0");
    }
    let (matched, read, _others) = reader.select(&args.filters).await?;
    let (replayable, skipped): (Vec<Letter>, Vec<Letter>) =
        matched.into_iter().partition(|l| l.envelope.is_some());
    for l in &skipped {
        println!(
            "skipped {}: body is not an order event envelope, nothing to route (left in the DLQ; `dlq show` it, then `dlq purge` or republish a fixed copy)",
            l.describe()
        );
    }
    let letters = replay_order(replayable);
    if args.dry_run {
        for l in &letters {
            println!(
                "would replay {} to shard {}",
                l.describe(),
                global
                    .shards
                    .shard_of(l.order_id.as_deref().unwrap_or(""))
                    .get()
            );
        }
        println!(
            "dry run: {} would be replayed, {} skipped, of {read} read; nothing changed",
            letters.len(),
            skipped.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if letters.is_empty() {
        println!(
            "nothing to replay: 0 replayable of {read} read ({} skipped)",
            skipped.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let quarantines = Quarantines::read(global, &letters).await;
    let config = crate::publish::publisher_config(global, 1, "shardline dlq replay");
    let mut replay = Replay {
        publisher: Publisher::connect(config).await?,
        audit: ReplayAudit::new(global),
        pause: args.rate.map(|r| Duration::from_secs_f64(1.0 / r)),
        replayed: 0,
    };
    let outcome = replay.publish(&letters).await;
    println!(
        "replayed {} of {} matching, {} skipped (not envelopes), {} read; {} left in the DLQ unreplayed",
        replay.replayed,
        letters.len(),
        skipped.len(),
        read,
        read - replay.replayed
    );
    let outcome = match outcome {
        Ok(()) => match quarantines {
            Some(q) => replay.follow_quarantines(reader, q, args.wait).await,
            None => Ok(ExitCode::SUCCESS),
        },
        Err(e) => Err(e),
    };
    if let Err(e) = replay.publisher.close().await {
        tracing::debug!(error = %e, "closing the replay publisher");
    }
    outcome
}

/// Rounds of a replay: a publisher, the audit spans, the pace.
struct Replay {
    publisher: Publisher,
    audit: ReplayAudit,
    pause: Option<Duration>,
    replayed: usize,
}

/// Follow-up rounds for quarantined orders at most: a steady stream of new
/// events for one order could otherwise keep a replay going for ever.
const MAX_ROUNDS: usize = 20;

impl Replay {
    /// Replays `letters` in their order, each confirmed before it leaves the DLQ.
    async fn publish(&mut self, letters: &[Letter]) -> anyhow::Result<()> {
        let progress = crate::progress::bar(letters.len() as u64, "dead letters");
        let outcome = async {
            for l in letters {
                let started = tokio::time::Instant::now();
                let order = l.order_id.as_deref().unwrap_or("");
                let shard = self.publisher.shard_of(order);
                let mut span = self.audit.start(l, shard);
                let done = replay_one(&mut self.publisher, l, shard).await;
                match &done {
                    Ok(()) => span.end(),
                    Err(e) => span.fail(e),
                }
                done?;
                self.replayed += 1;
                progress.inc(1);
                tracing::info!(
                    dead_letter_id = l.id(),
                    linked_trace_id = %span.linked_trace_id.map_or_else(|| "-".to_owned(), |t| t.to_string()),
                    order_id = order,
                    seq = l.seq,
                    shard = shard.get(),
                    reason = %l.reason,
                    traceparent = header_str(&l.delivery.properties, headers::TRACEPARENT),
                    "dead letter replayed"
                );
                progress.suspend(|| println!("replayed {} to shard {}", l.describe(), shard.get()));
                if let Some(pause) = self.pause {
                    tokio::time::sleep_until(started + pause).await;
                }
            }
            anyhow::Ok(())
        }
        .await;
        progress.finish_and_clear();
        outcome
    }

    /// For each replayed order that is quarantined: waits until a worker has
    /// applied (or dead-lettered again) what was replayed, then replays the
    /// order's events that were quarantined meanwhile, until the quarantine
    /// is lifted or its blocker failed again. Exit 3 when an order stays
    /// quarantined.
    async fn follow_quarantines(
        &mut self,
        reader: &Reader,
        quarantines: Quarantines,
        wait: Duration,
    ) -> anyhow::Result<ExitCode> {
        let Quarantines {
            mut redis,
            redis_prefix,
            mut rounds,
        } = quarantines;
        let mut attention = false;
        for _ in 0..MAX_ROUNDS {
            let mut next = Vec::new();
            for (order, ids) in std::mem::take(&mut rounds) {
                let key = quarantine_key(&redis_prefix, &order);
                if !quarantined(&mut redis, &key).await? {
                    println!("order {order}: quarantine lifted");
                    continue;
                }
                if !applied(&mut redis, &key, &ids, wait).await? {
                    println!(
                        "order {order}: the replayed events were not applied within {} (is a worker with --on-dead-letter quarantine running?); run `dlq replay --order-id {order}` again later",
                        humantime::format_duration(wait)
                    );
                    attention = true;
                    continue;
                }
                match quarantine_head(&mut redis, &key).await? {
                    None => println!("order {order}: quarantine lifted"),
                    Some(head) => next.push((order, head)),
                }
            }
            if next.is_empty() {
                break;
            }
            let wanted: Vec<&str> = next.iter().map(|(o, _)| o.as_str()).collect();
            let (found, _, _) = reader
                .select_by(
                    |l| l.order_id.as_deref().is_some_and(|o| wanted.contains(&o)),
                    None,
                )
                .await?;
            let found = replay_order(found);
            let mut replaying = Vec::new();
            for (order, head) in &next {
                let letters: Vec<&Letter> = found
                    .iter()
                    .filter(|l| l.order_id.as_deref() == Some(order))
                    .collect();
                let blocker = letters
                    .iter()
                    .find(|l| l.id.as_deref() == Some(head.as_str()));
                match blocker {
                    // The head of the quarantine is an event quarantined while
                    // the replay ran: the rest of the order was applied.
                    Some(b) if b.reason == FailReason::Quarantined.as_str() => {
                        println!(
                            "order {order}: {} event(s) quarantined during the replay; replaying them",
                            letters.len()
                        );
                        rounds.insert(
                            order.clone(),
                            letters.iter().filter_map(|l| l.id.clone()).collect(),
                        );
                        replaying.push(order.clone());
                    }
                    blocker => {
                        println!(
                            "order {order}: still quarantined behind dead letter {head}{}; fix the cause and replay the order again",
                            blocker.map_or_else(String::new, |l| format!(" ({})", l.describe()))
                        );
                        attention = true;
                    }
                }
            }
            let batch: Vec<Letter> = found
                .into_iter()
                .filter(|l| l.order_id.as_ref().is_some_and(|o| replaying.contains(o)))
                .collect();
            self.publish(&batch).await?;
        }
        if !rounds.is_empty() {
            println!(
                "stopped after {MAX_ROUNDS} rounds; the orders still quarantined: {}",
                rounds.into_keys().collect::<Vec<_>>().join(", ")
            );
            attention = true;
        }
        Ok(if attention {
            ExitCode::from(crate::EXIT_ATTENTION)
        } else {
            ExitCode::SUCCESS
        })
    }
}

/// The orders of a replay that are quarantined, with the ids of their
/// replayed letters, and the Redis connection to follow them.
struct Quarantines {
    redis: MultiplexedConnection,
    redis_prefix: String,
    rounds: BTreeMap<String, Vec<String>>,
}

impl Quarantines {
    /// `None` when no order of `letters` is quarantined, or Redis cannot say
    /// (the replay goes on without following quarantines; it says so).
    async fn read(global: &GlobalArgs, letters: &[Letter]) -> Option<Self> {
        let mut redis = match global.redis().await {
            Ok(redis) => redis,
            Err(e) => {
                println!(
                    "cannot read quarantines ({e}); replaying without following them (check a quarantined order with `dlq list --order-id` afterwards)"
                );
                return None;
            }
        };
        let mut rounds: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for l in letters {
            if let (Some(order), Some(id)) = (&l.order_id, &l.id) {
                rounds.entry(order.clone()).or_default().push(id.clone());
            }
        }
        // One round trip for every order of the replay.
        let mut pipe = redis::pipe();
        for order in rounds.keys() {
            pipe.cmd("EXISTS")
                .arg(quarantine_key(&global.redis_prefix, order));
        }
        let exists: Vec<bool> = match pipe.query_async(&mut redis).await {
            Ok(exists) => exists,
            Err(e) => {
                println!(
                    "cannot read quarantines ({}); replaying without following them",
                    global.redis_url.scrub(&e.to_string())
                );
                return None;
            }
        };
        let quarantined_orders: BTreeMap<String, Vec<String>> = rounds
            .into_iter()
            .zip(exists)
            .filter_map(|(order, quarantined)| quarantined.then_some(order))
            .collect();
        (!quarantined_orders.is_empty()).then(|| Self {
            redis,
            redis_prefix: global.redis_prefix.clone(),
            rounds: quarantined_orders,
        })
    }
}

fn quarantine_key(redis_prefix: &str, order_id: &str) -> String {
    shardline_worker::quarantine::key(
        redis_prefix,
        &shardline_topology::envelope::order_key_of(order_id),
    )
}

/// Whether an order's quarantine set exists.
async fn quarantined(redis: &mut MultiplexedConnection, key: &str) -> anyhow::Result<bool> {
    Ok(redis::cmd("EXISTS")
        .arg(key)
        .query_async::<bool>(redis)
        .await?)
}

/// The blocker of a quarantine, `None` when lifted.
async fn quarantine_head(
    redis: &mut MultiplexedConnection,
    key: &str,
) -> anyhow::Result<Option<String>> {
    let head: Vec<String> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(0)
        .query_async(redis)
        .await?;
    Ok(head.into_iter().next())
}

/// Waits until none of `ids` holds the quarantine any more (a worker applied
/// them, or dead-lettered them again under new ids); `false` after `wait`.
/// Polls: the worker's progress is only visible in Redis.
async fn applied(
    redis: &mut MultiplexedConnection,
    key: &str,
    ids: &[String],
    wait: Duration,
) -> anyhow::Result<bool> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let scores: Vec<Option<f64>> = redis::cmd("ZMSCORE")
            .arg(key)
            .arg(ids)
            .query_async(redis)
            .await?;
        if scores.iter().all(Option::is_none) {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(QUARANTINE_POLL).await;
    }
}

/// How often a replay looks whether the worker applied a quarantined order's events.
const QUARANTINE_POLL: Duration = Duration::from_millis(100);

async fn release(
    global: &GlobalArgs,
    reader: &Reader,
    args: &ReleaseArgs,
) -> anyhow::Result<ExitCode> {
    let order = &args.order_id;
    let key = quarantine_key(&global.redis_prefix, order);
    let mut redis = global.redis().await.map_err(|e| anyhow::anyhow!(e))?;
    let held: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut redis)
        .await?;
    redis::cmd("DEL")
        .arg(&key)
        .query_async::<i64>(&mut redis)
        .await?;
    let filters = Filters {
        order_id: Some(order.clone()),
        ..Filters::default()
    };
    let (letters, _, _) = reader.select(&filters).await?;
    match held.first() {
        None => println!("order {order} was not quarantined; nothing to release"),
        Some((id, _)) => println!(
            "released order {order}: it was quarantined behind dead letter {id} ({} dead letter(s) held it); its later events flow again",
            held.len()
        ),
    }
    println!(
        "{} dead letter(s) of order {order} stay in the DLQ (`dlq replay --order-id {order}` applies them where they land, `dlq purge --order-id {order} --yes` drops them)",
        letters.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// Republishes one letter, waits for the broker's confirm, and only then
/// removes it from the DLQ.
async fn replay_one(publisher: &mut Publisher, l: &Letter, shard: ShardId) -> anyhow::Result<()> {
    publisher
        .publish_to_shard(shard, l.delivery.data.clone(), replay_properties(l))
        .await
        .with_context(|| format!("republishing {}", l.describe()))?;
    publisher
        .flush()
        .await
        .with_context(|| format!("confirming the republish of {}", l.describe()))?;
    // Confirmed: only now may it leave the DLQ.
    l.delivery
        .ack(BasicAckOptions::default())
        .await
        .with_context(|| format!("removing {} from the DLQ", l.describe()))?;
    Ok(())
}

/// The audit spans of a replay: one root span per replayed letter
/// (`{dlq} replay`), linked to the failed attempt's context (the letter's
/// `traceparent`/`tracestate`).
struct ReplayAudit {
    tracer: BoxedTracer,
    span_name: std::borrow::Cow<'static, str>,
    exchange: String,
}

/// One letter's replay span, and the trace id it links to.
struct ReplaySpan {
    span: opentelemetry::global::BoxedSpan,
    linked_trace_id: Option<TraceId>,
}

impl ReplayAudit {
    fn new(global: &GlobalArgs) -> Self {
        let names = global.names();
        Self {
            tracer: opentelemetry::global::tracer_with_scope(telemetry::scope()),
            span_name: telemetry::span::replay(&names.dead_letter_queue),
            exchange: names.exchange,
        }
    }

    /// Without a tracer provider the span is a no-op: no link, no attributes
    /// are built, only the linked trace id is read for the log line.
    fn start(&self, l: &Letter, shard: ShardId) -> ReplaySpan {
        let failed = headers::remote_span_context(&l.delivery.properties);
        let linked_trace_id = failed.as_ref().map(|sc| sc.trace_id());
        let mut span = self
            .tracer
            .span_builder(self.span_name.clone())
            .with_kind(SpanKind::Producer)
            .start_with_context(&self.tracer, &Context::new());
        if span.is_recording() {
            if let Some(sc) = failed {
                span.add_link(sc, Vec::new());
            }
            let mut attributes = vec![
                KeyValue::new(attr::MESSAGING_SYSTEM, attr::MESSAGING_SYSTEM_RABBITMQ),
                KeyValue::new(attr::MESSAGING_OPERATION, op::REPLAY),
                KeyValue::new(attr::MESSAGING_DESTINATION_NAME, self.exchange.clone()),
                KeyValue::new(
                    attr::MESSAGING_ROUTING_KEY,
                    shardline_topology::Names::routing_key(shard),
                ),
                KeyValue::new(attr::DEAD_LETTER_ID, l.id().to_owned()),
                KeyValue::new(attr::FAIL_REASON, l.reason.clone()),
                KeyValue::new(attr::SHARD, i64::from(shard.get())),
            ];
            if let Some(order) = &l.order_id {
                attributes.push(KeyValue::new(attr::ORDER_ID, order.clone()));
            }
            if let Some(seq) = l.seq.and_then(|s| i64::try_from(s).ok()) {
                attributes.push(KeyValue::new(attr::SEQ, seq));
            }
            if let Some(t) = linked_trace_id {
                attributes.push(KeyValue::new(attr::LINKED_TRACE_ID, t.to_string()));
            }
            span.set_attributes(attributes);
        }
        ReplaySpan {
            span,
            linked_trace_id,
        }
    }
}

impl ReplaySpan {
    fn end(&mut self) {
        self.span.end();
    }

    fn fail(&mut self, e: &anyhow::Error) {
        if self.span.is_recording() {
            self.span.set_status(Status::error(format!("{e:#}")));
        }
        self.span.end();
    }
}

/// The letter's properties, as the worker dead-lettered them (the `x-fail-*`
/// headers kept for audit; a new failure overwrites them), plus
/// `x-shardline-replay` = the dead-letter id, without the broker's
/// `x-delivery-count` (it would count against the new delivery).
fn replay_properties(letter: &Letter) -> lapin::BasicProperties {
    let props = letter.delivery.properties.clone();
    let mut inner = props
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    inner.remove(headers::DELIVERY_COUNT);
    let mut h = lapin::types::FieldTable::from(inner);
    h.insert(
        headers::REPLAY.into(),
        AMQPValue::LongString(LongString::from(letter.id().as_bytes().to_vec())),
    );
    props.with_headers(h)
}

async fn purge(reader: &Reader, args: &PurgeArgs) -> anyhow::Result<ExitCode> {
    let (matched, read, _others) = reader.select(&args.filters).await?;
    let mut removed = 0usize;
    for l in &matched {
        l.delivery
            .ack(BasicAckOptions::default())
            .await
            .with_context(|| format!("removing {}", l.describe()))?;
        removed += 1;
        println!("removed {}", l.describe());
    }
    println!(
        "purged {removed} dead letter(s) of {read} read; {} left in the DLQ",
        read - removed
    );
    Ok(ExitCode::SUCCESS)
}
