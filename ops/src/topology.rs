//! The topology as an operator sees it: what `apply` declared, and the fleet
//! status — per shard depth, consumers, owner, backlog age and level; the
//! DLQ's depth (and, when asked, its letters by reason); the workers.
//!
//! The status is cheap by default: passive declares and one Redis round trip
//! or two, no dead letter read (a page refreshing every few seconds must not
//! hold letters unacked). [`StatusConfig::dlq_browse`] opts into counting
//! letters by reason.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use shardline_connect::declare::{self, DlqKind, TopologyOptions};
use shardline_connect::probe::{self, Finding};
use shardline_connect::publishers::{self, Registered};
use shardline_connect::record;
use shardline_connect::{ApplyReport, ShardStatus};
use shardline_contract::QueueType;
use shardline_contract::Version;
use shardline_contract::fleet::{FleetAssignment, MemberRecord};
use shardline_contract::status::{
    BreakerState, Level, PUBLISHER_CLAIMED, PauseCause, RelayReport, ShardReport, StampSource,
    Thresholds, WorkerReport, unix_ms,
};
use shardline_contract::topology::TopologyRecord;
use shardline_contract::{Keys, Names, ShardCount, ShardId};

use crate::fleet::close;
use crate::{Error, Fleet};

/// How long the status waits for Redis before reporting it unavailable.
const REDIS_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`apply`] declared, for the operator.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The broker, password redacted.
    pub url: String,
    pub names: Names,
    pub options: TopologyOptions,
    pub report: ApplyReport,
    /// What the broker probe found.
    pub broker: Vec<Finding>,
}

/// Declares the exchanges, shard queues, bindings and the DLQ (idempotent),
/// once the broker probe has found nothing to refuse (classic
/// single-active-consumer on a broker with its failover bug).
pub async fn apply(fleet: &Fleet, options: &TopologyOptions) -> Result<Applied, Error> {
    let url = fleet.amqp.to_string();
    let facts = fleet.probe().await;
    let broker = probe::assess(&facts, &options.plan());
    if let Some(line) = probe::refusal(&broker) {
        return Err(Error::Refused(line));
    }
    let options = &TopologyOptions {
        broker_version: facts.lowest_version(),
        ..options.clone()
    };
    // One connection per node given: each declares its share of the shard
    // queues, so that a cluster's queue leaders spread. The probe's warnings
    // are logged once connected: a broker that cannot be reached is the
    // error's one line (the probe's "version unknown" would only repeat it).
    let conns = shardline_connect::connect_each(&fleet.amqp, "shardline topology apply").await?;
    probe::log(&broker);
    let recorded = match conns.first() {
        Some(conn) => record_for_apply(fleet, conn, options.shards).await,
        None => Ok(()),
    };
    let report = match recorded {
        Ok(()) => declare::apply(&conns, &fleet.names, options)
            .await
            .map_err(Error::queue(format!("topology apply on {url}"))),
        Err(e) => Err(e),
    };
    for conn in &conns {
        close(conn).await;
    }
    Ok(Applied {
        url,
        names: fleet.names.clone(),
        options: options.clone(),
        report: report?,
        broker,
    })
}

/// The recorded topology that stands, a topology made before records
/// adopted at the count found on the broker (never a flag's); `None` when
/// there is neither. `who` names the reader in an adoption's record.
pub async fn recorded(fleet: &Fleet, who: &str) -> Result<Option<TopologyRecord>, Error> {
    let mut redis = fleet.redis.connect().await?;
    if let Some(record) = record::read(&mut redis, &fleet.keys)
        .await
        .map_err(crate::fleet::record_error(fleet))?
    {
        return Ok(Some(record));
    }
    // Only a topology made before records needs the broker read.
    let conn = fleet
        .connect(&format!("shardline {who} topology record"))
        .await?;
    let adopted =
        record::read_or_adopt(&mut redis, &fleet.keys, &conn, &fleet.names, who, unix_ms())
            .await
            .map_err(crate::fleet::record_error(fleet));
    close(&conn).await;
    adopted
}

/// Records a new topology of `shards`, or checks the one recorded:
/// `topology apply` never changes the count. Without a record, a topology
/// on the broker with more shard queues is adopted at its count (and
/// refused); one with fewer (queues a legacy publisher declared, an apply
/// that stopped half-way) is completed at `shards`.
async fn record_for_apply(
    fleet: &Fleet,
    conn: &lapin::Connection,
    shards: ShardCount,
) -> Result<(), Error> {
    const WHO: &str = "topology apply";
    let mut redis = fleet.redis.connect().await?;
    let standing = match record::read(&mut redis, &fleet.keys)
        .await
        .map_err(crate::fleet::record_error(fleet))?
    {
        Some(record) => record,
        None => {
            let found = record::shard_count_on_broker(conn, &fleet.names)
                .await
                .map_err(crate::fleet::record_error(fleet))?;
            let count = found.filter(|n| n.get() > shards.get()).unwrap_or(shards);
            let first = TopologyRecord::first(count, WHO, unix_ms());
            record::write_first(&mut redis, &fleet.keys, &first)
                .await
                .map_err(crate::fleet::record_error(fleet))?
        }
    };
    if standing.agrees(shards) {
        Ok(())
    } else {
        Err(Error::Refused(standing.apply_refusal(shards)))
    }
}

impl Applied {
    /// As `topology apply` prints it; says when publishers must declare the
    /// shard queues with arguments.
    pub fn text(&self) -> String {
        let (names, opts, report) = (&self.names, &self.options, &self.report);
        let queue_type = match opts.queue_type {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        };
        let consumers = if opts.exclusive_consumers() {
            "one exclusive consumer per shard, extra workers wait as standbys"
        } else {
            "single-active-consumer: the broker picks one consumer per shard"
        };
        let (first, last) = (
            report.shard_queues.first().map_or("", String::as_str),
            report.shard_queues.last().map_or("", String::as_str),
        );
        let mut out = format!(
            "topology applied on {}\n  exchange {} (direct, durable)\n  exchange {} (topic, durable)\n",
            self.url, names.exchange, names.dead_letter_exchange
        );
        for f in self.broker.iter().filter(|f| f.topic == "version") {
            let _ = writeln!(out, "  broker: {}", f.text);
        }
        let _ = writeln!(
            out,
            "  {} {queue_type} shard queues {first} .. {last} (durable), bound to {} with shard.0 .. shard.{}",
            report.shard_queues.len(),
            names.exchange,
            report.shard_queues.len().saturating_sub(1),
        );
        if report.nodes > 1 {
            let _ = writeln!(
                out,
                "  shard queues declared through {} nodes in turn: their leaders spread over them",
                report.nodes
            );
        }
        let dlq = match report.dead_letter_queue {
            DlqKind::Classic => "classic, durable",
            DlqKind::Quorum
                if opts
                    .broker_version
                    .is_some_and(Version::quorum_limit_by_default) =>
            {
                "quorum, x-delivery-limit -1 (none)"
            }
            DlqKind::Quorum => "quorum, no delivery limit",
            DlqKind::ClassicKept => {
                "classic, durable: kept from an earlier apply; it does not survive its node's loss"
            }
        };
        let _ = writeln!(
            out,
            "  queue {} ({dlq}), bound to {} with #\n  consumers: {consumers}",
            names.dead_letter_queue, names.dead_letter_exchange
        );
        match &report.publishers_must_declare {
            None => out.push_str(
                "  shard queue arguments: none (publishers may redeclare them with durable=True and no arguments)\n",
            ),
            Some(args) => {
                let _ = writeln!(
                    out,
                    "  shard queue arguments: {args}\nNOTE: publishers that declare the shard queues must now declare them with exactly \
                     these arguments ({args}); a declare without them is refused with 406 PRECONDITION_FAILED."
                );
            }
        }
        out
    }
}

/// What the status reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusConfig {
    /// Backlog age levels (default WARN from 30 s, PAGE from 2 min; PAGE
    /// must not be below WARN).
    pub thresholds: Thresholds,
    /// Read (and requeue, in order) at most this many dead letters to count
    /// them by reason. `None` (the default): the DLQ's depth only, no letter
    /// read — the cheap form for a page that refreshes every few seconds.
    pub dlq_browse: Option<u32>,
}

/// One shard as the status reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardLine {
    pub shard: u16,
    pub queue: ShardStatus,
    /// The owner's status from Redis, when fresh (written within the TTL).
    pub report: Option<ShardReport>,
    /// Backlog age now, from the report.
    pub backlog_age: Option<Duration>,
    pub level: Option<Level>,
    /// `publisher-claimed` when the level (WARN or PAGE) rests on a
    /// publisher's claim ([`ShardReport::level_label`]); it pages all the same.
    pub label: Option<&'static str>,
}

impl ShardLine {
    pub fn new(
        shard: u16,
        queue: ShardStatus,
        report: Option<ShardReport>,
        now_ms: u64,
        t: &Thresholds,
    ) -> Self {
        // A stopped owner's shard: its events have waited at least since the
        // stop (those published later are younger).
        let backlog_age = report.as_ref().map(|r| match r.stopped_at_ms {
            None => r.backlog_age_at(now_ms),
            Some(at) if queue.messages > 0 => Duration::from_millis(now_ms.saturating_sub(at)),
            Some(_) => Duration::ZERO,
        });
        let level = backlog_age.map(|age| Level::of(age, t));
        let label = report
            .as_ref()
            .zip(level)
            .and_then(|(r, l)| r.level_label(l));
        Self {
            shard,
            queue,
            level,
            label,
            report,
            backlog_age,
        }
    }

    /// The level as shown: `PAGE`, or `PAGE (publisher-claimed)`.
    pub fn level_text(&self) -> Option<String> {
        let level = self.level?.as_str();
        Some(match self.label {
            Some(label) => format!("{level} ({label})"),
            None => level.to_owned(),
        })
    }

    /// The worker consuming the shard, as its fresh status says; none when
    /// it stopped.
    pub fn owner(&self) -> Option<&str> {
        self.report.as_ref().and_then(ShardReport::owner)
    }

    /// The worker that stopped consuming the shard on a graceful stop, when
    /// no new owner has reported yet.
    pub fn stopped(&self) -> Option<&ShardReport> {
        self.report.as_ref().filter(|r| r.stopped_at_ms.is_some())
    }

    /// Events wait and no worker consumes the shard.
    pub fn unconsumed(&self) -> bool {
        self.queue.messages > 0 && self.queue.consumers == 0
    }

    /// What stands out, empty when nothing does.
    pub fn note(&self) -> &'static str {
        if self.stopped().is_some() {
            return match (self.queue.consumers, self.queue.messages) {
                (0, m) if m > 0 => "its worker stopped: events wait for a new owner",
                (0, _) => "its worker stopped",
                _ => "a new owner is starting",
            };
        }
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

/// Dead-letter queue depth and, when browsed, letters by reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlqLine {
    pub queue: ShardStatus,
    pub by_reason: BTreeMap<String, u64>,
    /// Letters read to count by reason (0 when not browsed).
    pub browsed: u64,
    /// Letters in the dead-letter index (`None`: Redis could not be read).
    pub indexed: Option<u64>,
}

impl DlqLine {
    /// The DLQ holds letters its index does not know: `dlq reindex`.
    pub fn reindex_needed(&self) -> bool {
        self.indexed
            .is_some_and(|n| u64::from(self.queue.messages) > n)
    }
}

/// The fleet's status.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusReport {
    /// The broker, password redacted.
    pub url: String,
    pub shards: Vec<ShardLine>,
    pub dlq: DlqLine,
    /// The workers' own documents, by name.
    pub workers: Vec<WorkerReport>,
    pub thresholds: Thresholds,
    /// Why the workers' documents could not be read (Redis), when they could not.
    pub status_error: Option<String>,
    /// Unix milliseconds when read: how long a breaker has been open is
    /// counted to here.
    pub read_at_ms: u64,
    /// The elastic fleet (`--assign auto`), when it has members or an assignment.
    pub fleet: Option<FleetView>,
    /// What the broker probe found: version, capabilities and their rules.
    pub broker: Vec<Finding>,
    /// The recorded topology, when Redis has one and answered.
    pub topology: Option<TopologyRecord>,
    /// The registered publishers (resharding's confirm barrier), live or
    /// lapsed, as Redis has them.
    pub publishers: Vec<Registered>,
    /// The outbox relays' own documents, by name.
    pub relays: Vec<RelayReport>,
}

/// The elastic fleet as Redis has it: its members and the assignment.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetView {
    pub members: Vec<MemberRecord>,
    pub assignment: FleetAssignment,
}

impl FleetView {
    /// The member a shard is assigned to, and that member's record.
    fn assigned(&self, shard: u16) -> Option<(&str, Option<&MemberRecord>)> {
        let member = self.assignment.assignment.owners.get(&shard)?;
        Some((
            member.as_str(),
            self.members.iter().find(|m| &m.member == member),
        ))
    }
}

/// Reads the status: passive declares on the broker, the status documents
/// in Redis (a Redis failure is reported in the report, not as an error).
pub async fn status(fleet: &Fleet, config: &StatusConfig) -> Result<StatusReport, Error> {
    let t = config.thresholds;
    if t.page < t.warn {
        return Err(Error::config(
            &["thresholds.page", "thresholds.warn"],
            "thresholds.page must not be below thresholds.warn",
        ));
    }
    let url = fleet.amqp.to_string();
    let broker = probe::assess(&fleet.probe().await, &probe::Plan::default());
    let conn = fleet.connect("shardline topology status").await?;
    let (topology, publishers) = topology_within_timeout(fleet).await;
    if let Some(record) = topology.as_ref().filter(|r| !r.agrees(fleet.shards)) {
        close(&conn).await;
        return Err(Error::config(&[], record.status_refusal(fleet.shards)));
    }
    let read = read_queues(fleet, &conn, &url, config.dlq_browse).await;
    close(&conn).await;
    let (queues, mut dlq) = read?;
    dlq.indexed = index_count(fleet).await;

    let shard_ids: Vec<ShardId> = fleet.shards.ids().collect();
    let (reports, workers, elastic, relays, status_error) =
        match read_documents(fleet, &shard_ids).await {
            Ok(Documents {
                shards,
                workers,
                elastic,
                relays,
            }) => (shards, workers, elastic, relays, None),
            Err(e) => (
                vec![None; shard_ids.len()],
                Vec::new(),
                None,
                Vec::new(),
                Some(e),
            ),
        };
    let now = unix_ms();
    let shards = queues
        .into_iter()
        .zip(reports)
        .map(|((shard, queue), report)| ShardLine::new(shard, queue, report, now, &t))
        .collect();
    Ok(StatusReport {
        url,
        shards,
        dlq,
        workers,
        thresholds: t,
        status_error,
        read_at_ms: now,
        fleet: elastic,
        broker,
        topology,
        publishers,
        relays,
    })
}

/// Every shard queue's depth and consumers, and the DLQ's.
async fn read_queues(
    fleet: &Fleet,
    conn: &lapin::Connection,
    url: &str,
    dlq_browse: Option<u32>,
) -> Result<(Vec<(u16, ShardStatus)>, DlqLine), Error> {
    let names = &fleet.names;
    let context = || format!("topology status on {url}");
    let mut queues = Vec::with_capacity(usize::from(fleet.shards.get()));
    for shard in fleet.shards.ids() {
        let st = declare::queue_status(conn, &names.shard_queue(shard))
            .await
            .map_err(Error::queue(context()))?;
        queues.push((shard.get(), st));
    }
    let queue = declare::queue_status(conn, &names.dead_letter_queue)
        .await
        .map_err(Error::queue(context()))?;
    let letters = match dlq_browse {
        Some(limit) if limit > 0 => crate::dlq::browse(conn, names, u64::from(limit))
            .await
            .map_err(|source| Error::Dlq {
                queue: format!("reading {}", names.dead_letter_queue),
                url: url.to_owned(),
                source: Box::new(source),
            })?,
        _ => Vec::new(),
    };
    let mut by_reason = BTreeMap::new();
    for letter in &letters {
        *by_reason.entry(letter.info.reason.clone()).or_insert(0) += 1;
    }
    let dlq = DlqLine {
        queue,
        by_reason,
        browsed: letters.len() as u64,
        indexed: None,
    };
    Ok((queues, dlq))
}

/// The recorded topology and the registered publishers, within
/// [`REDIS_TIMEOUT`]; nothing when Redis does not answer (the documents'
/// error then says why).
async fn topology_within_timeout(fleet: &Fleet) -> (Option<TopologyRecord>, Vec<Registered>) {
    let read = async {
        let mut redis = fleet.redis.connect().await.ok()?;
        let record = record::read(&mut redis, &fleet.keys).await.ok()?;
        let registered = publishers::all(&mut redis, &fleet.keys)
            .await
            .unwrap_or_default();
        Some((record, registered))
    };
    tokio::time::timeout(REDIS_TIMEOUT, read)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// The dead-letter index's count, within [`REDIS_TIMEOUT`]; `None` when
/// Redis does not answer (the documents' error says why).
async fn index_count(fleet: &Fleet) -> Option<u64> {
    let count = async { crate::dlq::Index::open(fleet).await?.count().await };
    match tokio::time::timeout(REDIS_TIMEOUT, count).await {
        Ok(Ok(n)) => Some(n),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading the dead-letter index");
            None
        }
        Err(_) => None,
    }
}

/// The status documents `topology status` reads from Redis.
struct Documents {
    shards: Vec<Option<ShardReport>>,
    workers: Vec<WorkerReport>,
    elastic: Option<FleetView>,
    relays: Vec<RelayReport>,
}

/// The shard, worker and relay status documents, within [`REDIS_TIMEOUT`];
/// the error is fit to print.
async fn read_documents(fleet: &Fleet, shards: &[ShardId]) -> Result<Documents, String> {
    let read = async {
        let mut conn = fleet.redis.connect().await.map_err(|e| e.to_string())?;
        let scrub = |e: redis::RedisError| fleet.redis.scrub(&e.to_string());
        let reports = shard_reports(&mut conn, &fleet.keys, shards)
            .await
            .map_err(scrub)?;
        let workers = worker_reports(&mut conn, &fleet.keys)
            .await
            .map_err(scrub)?;
        let elastic = fleet_view(&mut conn, &fleet.keys).await.map_err(scrub)?;
        let relays = documents(&mut conn, &fleet.keys.relay_status_pattern())
            .await
            .map_err(scrub)?;
        Ok(Documents {
            shards: reports,
            workers,
            elastic,
            relays,
        })
    };
    match tokio::time::timeout(REDIS_TIMEOUT, read).await {
        Ok(result) => result,
        Err(_) => Err("timed out".into()),
    }
}

/// The status documents of `shards`; `None` where no fresh one exists.
pub(crate) async fn shard_reports(
    conn: &mut impl redis::aio::ConnectionLike,
    keys: &Keys,
    shards: &[ShardId],
) -> Result<Vec<Option<ShardReport>>, redis::RedisError> {
    if shards.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = shards.iter().map(|s| keys.shard_status(*s)).collect();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&keys).query_async(conn).await?;
    Ok(values
        .into_iter()
        .map(|v| v.and_then(|json| serde_json::from_str(&json).ok()))
        .collect())
}

/// The elastic fleet's members and assignment; none when it has neither.
async fn fleet_view(
    conn: &mut impl redis::aio::ConnectionLike,
    keys: &Keys,
) -> Result<Option<FleetView>, redis::RedisError> {
    let (members, doc): (Vec<String>, Option<String>) = redis::pipe()
        .cmd("HVALS")
        .arg(keys.fleet_members())
        .cmd("GET")
        .arg(keys.fleet_assignment())
        .query_async(conn)
        .await?;
    let mut members: Vec<MemberRecord> = members
        .iter()
        .filter_map(|json| serde_json::from_str(json).ok())
        .collect();
    members.sort_by(|a, b| a.member.cmp(&b.member));
    let assignment: Option<FleetAssignment> = doc.and_then(|d| serde_json::from_str(&d).ok());
    Ok(
        (!members.is_empty() || assignment.is_some()).then(|| FleetView {
            members,
            assignment: assignment.unwrap_or_default(),
        }),
    )
}

/// Every fresh worker document, by worker name.
pub(crate) async fn worker_reports(
    conn: &mut impl redis::aio::ConnectionLike,
    keys: &Keys,
) -> Result<Vec<WorkerReport>, redis::RedisError> {
    let mut workers: Vec<WorkerReport> = documents(conn, &keys.worker_status_pattern()).await?;
    workers.sort_by(|a, b| a.worker.cmp(&b.worker));
    Ok(workers)
}

/// Every fresh document under `pattern` that parses as `T`, in key order.
async fn documents<T: serde::de::DeserializeOwned>(
    conn: &mut impl redis::aio::ConnectionLike,
    pattern: &str,
) -> Result<Vec<T>, redis::RedisError> {
    let mut found = crate::fleet::scan(conn, pattern).await?;
    if found.is_empty() {
        return Ok(Vec::new());
    }
    found.sort();
    let values: Vec<Option<String>> = redis::cmd("MGET").arg(&found).query_async(conn).await?;
    Ok(values
        .into_iter()
        .filter_map(|v| serde_json::from_str(&v?).ok())
        .collect())
}

fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

impl StatusReport {
    /// The lines about the recorded topology: its count and the routing of
    /// outside publishers, a reshard in progress, retired queues, events
    /// still arriving by an old routing, the registered publishers. None
    /// without a record.
    pub fn topology_lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let Some(record) = &self.topology else {
            return self.relay_lines();
        };
        lines.push(format!(
            "topology: {}; publishers outside shardline route by {}",
            record.describe(),
            record.outside_routing()
        ));
        if let Some(reshard) = &record.reshard {
            lines.push(format!(
                "reshard to {} shards in progress: phase {:?} ({}, started {} s ago); run `topology reshard --to {}` again to resume it if it stopped",
                reshard.to,
                reshard.phase,
                reshard.started_by,
                self.read_at_ms.saturating_sub(reshard.started_at_ms) / 1000,
                reshard.to
            ));
        }
        if !record.retired.is_empty() {
            let queues: Vec<String> = record
                .retired
                .iter()
                .map(|s| format!("shard.{s}"))
                .collect();
            lines.push(format!(
                "retired shard queues (consumed, every event forwarded to its order's shard): {}",
                queues.join(", ")
            ));
        }
        let forwarding: Vec<String> = self
            .shards
            .iter()
            .filter_map(|line| {
                let rate = line.report.as_ref()?.forwarded_per_second;
                (rate > 0.0).then(|| format!("shard.{} {rate}/s", line.shard))
            })
            .collect();
        if !forwarding.is_empty() && record.reshard.is_none() {
            lines.push(format!(
                "events still arrive by an old routing and are forwarded: {}; their publishers route by a shard count of before (keep {}, or use the project's publisher)",
                forwarding.join(", "),
                record.outside_routing()
            ));
        }
        let live: Vec<&Registered> = self
            .publishers
            .iter()
            .filter(|p| p.lease.deadline_ms > self.read_at_ms)
            .collect();
        let behind = live
            .iter()
            .filter(|p| p.lease.acknowledged.0 < record.generation)
            .count();
        lines.push(format!(
            "registered publishers: {} live ({} on an older generation), {} lapsed",
            live.len(),
            behind,
            self.publishers.len() - live.len()
        ));
        lines.extend(self.relay_lines());
        lines
    }

    /// One line per outbox relay reporting: its role, lag and rows relayed,
    /// and why it retries.
    pub fn relay_lines(&self) -> Vec<String> {
        self.relays
            .iter()
            .map(|r| {
                let mut line = format!(
                    "outbox relay {}: {} on {} schema {}, lag {:.1} s, {} rows relayed",
                    r.relay,
                    r.role.as_str(),
                    r.database,
                    r.schema,
                    r.lag_ms as f64 / 1000.0,
                    r.relayed
                );
                if let Some(error) = &r.error {
                    line.push_str(&format!(" ({error})"));
                }
                line
            })
            .collect()
    }

    /// A shard at PAGE, events waiting with nobody consuming them, a
    /// worker's downstream breaker open for the PAGE threshold or longer, or
    /// a worker paused for the downstream's configuration (at once: only an
    /// operator can fix it).
    pub fn needs_attention(&self) -> bool {
        self.shards
            .iter()
            .any(|s| s.level == Some(Level::Page) || s.unconsumed())
            || self.open_breakers().any(|(worker, open)| {
                open >= self.thresholds.page || worker.breaker.cause == PauseCause::Configuration
            })
            || !self.unconsumed_assignments().is_empty()
    }

    /// Shards the elastic fleet assigned longer than the assignee's lease
    /// ago that the assignee does not consume: (shard, member, consumer).
    pub fn unconsumed_assignments(&self) -> Vec<(u16, &str, Option<&str>)> {
        let Some(fleet) = &self.fleet else {
            return Vec::new();
        };
        let decided = fleet.assignment.decided_at_ms;
        self.shards
            .iter()
            .filter_map(|s| {
                let (member, record) = fleet.assigned(s.shard)?;
                let consumer = s.owner();
                let worker = record.map(|r| r.worker.as_str());
                let lease = record.map_or(0, |r| r.lease_ms);
                let overdue = self.read_at_ms.saturating_sub(decided) > lease;
                (overdue && (worker.is_none() || consumer != worker))
                    .then_some((s.shard, member, consumer))
            })
            .collect()
    }

    /// The workers whose downstream breaker is open or half-open, with how
    /// long their calls have been paused.
    pub fn open_breakers(&self) -> impl Iterator<Item = (&WorkerReport, Duration)> {
        self.workers
            .iter()
            .filter(|w| w.breaker.state != BreakerState::Closed)
            .map(|w| (w, w.breaker.paused_for(self.read_at_ms)))
    }

    /// As `topology status --json` prints it.
    pub fn json(&self) -> serde_json::Value {
        let (dlq, t) = (&self.dlq, &self.thresholds);
        serde_json::json!({
            "shards": self.shards.iter().map(|s| serde_json::json!({
                "shard": s.shard,
                "queue": s.queue.queue,
                "messages": s.queue.messages,
                "consumers": s.queue.consumers,
                "owner": s.owner(),
                "stopped": s.stopped().map(|r| serde_json::json!({
                    "owner": r.owner,
                    "at_ms": r.stopped_at_ms,
                })),
                "backlog_age_seconds": s.backlog_age.map(secs),
                "level": s.level.map(Level::as_str),
                "level_label": s.label,
                "backlog_age_source": s.report.as_ref().and_then(|r| r.backlog_age_source).map(StampSource::as_str),
                "inflight_age_seconds": s.report.as_ref().and_then(|r| r.inflight_age_seconds),
                "inflight_events": s.report.as_ref().map(|r| r.inflight_events),
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
                "indexed": dlq.indexed,
                "reindex_needed": dlq.reindex_needed(),
            },
            "workers": self.workers,
            "thresholds": {
                "warn_seconds": t.warn.as_secs_f64(),
                "page_seconds": t.page.as_secs_f64(),
            },
            "status_error": self.status_error,
            "fleet": self.fleet.as_ref().map(|f| serde_json::json!({
                "generation": f.assignment.assignment.generation,
                "decided_at_ms": f.assignment.decided_at_ms,
                "members": f.members.iter().map(|m| serde_json::json!({
                    "member": m.member,
                    "worker": m.worker,
                    "joined_at_ms": m.joined_at_ms,
                    "lease_left_seconds": secs(Duration::from_millis(m.lease_until_ms.saturating_sub(self.read_at_ms))),
                    "lease_lapsed": m.lease_until_ms <= self.read_at_ms,
                    "assigned_shards": f.assignment.assignment.shards_of(&m.member).count(),
                })).collect::<Vec<_>>(),
                "assigned": f.assignment.assignment.owners,
                "unconsumed": self.unconsumed_assignments().iter().map(|(shard, member, consumer)| serde_json::json!({
                    "shard": shard, "assigned": member, "consumed_by": consumer,
                })).collect::<Vec<_>>(),
            })),
            "broker": self.broker.iter().map(|f| serde_json::json!({
                "topic": f.topic,
                "verdict": f.verdict.as_str(),
                "text": f.text,
                "source": f.source.to_string(),
            })).collect::<Vec<_>>(),
            "topology": self.topology.as_ref().map(|r| serde_json::json!({
                "generation": r.generation,
                "shards": r.shards,
                "first_shards": r.first_shards,
                "outside_publishers_route_by": r.outside_routing(),
            })),
            "publishers": self.publishers.iter().map(|p| serde_json::json!({
                "id": p.id,
                "name": p.name,
                "acknowledged_generation": p.lease.acknowledged.0,
                "lease_left_seconds": secs(Duration::from_millis(p.lease.deadline_ms.saturating_sub(self.read_at_ms))),
                "lapsed": p.lease.deadline_ms <= self.read_at_ms,
            })).collect::<Vec<_>>(),
            "outbox_relays": self.relays,
            "needs_attention": self.needs_attention(),
        })
    }

    /// As `topology status` prints it: a line per shard, totals, the DLQ,
    /// then what needs attention.
    pub fn table(&self) -> String {
        let (shards, dlq, t) = (&self.shards, &self.dlq, &self.thresholds);
        let width = shards
            .iter()
            .map(|s| s.queue.queue.len())
            .chain([dlq.queue.queue.len(), "queue".len()])
            .max()
            .unwrap_or(5);
        let owner_width = shards
            .iter()
            .filter_map(|s| s.owner().map(str::len))
            .chain(["owner".len()])
            .max()
            .unwrap_or(5);
        let levels: Vec<String> = shards
            .iter()
            .map(|s| s.level_text().unwrap_or_else(|| "-".to_owned()))
            .collect();
        let level_width = levels
            .iter()
            .map(String::len)
            .chain(["level".len()])
            .max()
            .unwrap_or(5);
        let mut out = format!(
            "{}  (backlog WARN from {}, PAGE from {})\n",
            self.url,
            humantime::format_duration(t.warn),
            humantime::format_duration(t.page)
        );
        for line in self.topology_lines() {
            let _ = writeln!(out, "{line}");
        }
        let _ = writeln!(
            out,
            "{:<5}  {:<width$}  {:>9}  {:>9}  {:<owner_width$}  {:>9}  {:<level_width$}  note",
            "shard", "queue", "messages", "consumers", "owner", "backlog", "level"
        );
        let mut total = 0u64;
        for (s, level) in shards.iter().zip(&levels) {
            total += u64::from(s.queue.messages);
            let owner = s.owner().unwrap_or("-");
            let backlog = s.backlog_age.map_or_else(
                || "-".to_owned(),
                |age| format!("{:.1}s", age.as_secs_f64()),
            );
            // With an elastic fleet: the member the shard is assigned to.
            let assigned = self
                .fleet
                .as_ref()
                .and_then(|f| f.assigned(s.shard))
                .map(|(member, _)| format!("assigned to {member}"));
            let note = [assigned.as_deref().unwrap_or(""), s.note()]
                .into_iter()
                .filter(|n| !n.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            let _ = writeln!(
                out,
                "{:<5}  {:<width$}  {:>9}  {:>9}  {owner:<owner_width$}  {backlog:>9}  {level:<level_width$}  {note}",
                s.shard, s.queue.queue, s.queue.messages, s.queue.consumers,
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
        if dlq.reindex_needed() {
            let _ = writeln!(
                out,
                "reindex needed: the DLQ holds {} letter(s), its index {} (`shardline dlq reindex`)",
                dlq.queue.messages,
                dlq.indexed.unwrap_or(0)
            );
        }
        if let Some(e) = &self.status_error {
            let _ = writeln!(
                out,
                "shard status unavailable (Redis: {e}): owner and backlog unknown"
            );
        }
        let paged = |label: Option<&str>| -> Vec<String> {
            shards
                .iter()
                .filter(|s| s.level == Some(Level::Page) && s.label == label)
                .map(|s| s.shard.to_string())
                .collect()
        };
        let seen = paged(None);
        if !seen.is_empty() {
            let _ = writeln!(
                out,
                "PAGE: shard(s) {} behind by more than {}",
                seen.join(", "),
                humantime::format_duration(t.page)
            );
        }
        let claimed = paged(Some(PUBLISHER_CLAIMED));
        if !claimed.is_empty() {
            let _ = writeln!(
                out,
                "PAGE ({PUBLISHER_CLAIMED}): shard(s) {} behind by more than {} as their publishers claim \
                 (x-published-at-ms or timestamp; no broker stamp vouches for it)",
                claimed.join(", "),
                humantime::format_duration(t.page)
            );
        }
        if let Some(fleet) = &self.fleet {
            let _ = writeln!(
                out,
                "fleet (--assign auto): assignment generation {}, {} member(s)",
                fleet.assignment.assignment.generation,
                fleet.members.len()
            );
            for m in &fleet.members {
                let left = m.lease_until_ms.saturating_sub(self.read_at_ms);
                let lease = if left == 0 {
                    "lease lapsed".to_owned()
                } else {
                    format!(
                        "lease {:.1}s left",
                        Duration::from_millis(left).as_secs_f64()
                    )
                };
                let _ = writeln!(
                    out,
                    "  member {} (worker {}): {} shard(s) assigned, {lease}",
                    m.member,
                    m.worker,
                    fleet.assignment.assignment.shards_of(&m.member).count()
                );
            }
            for (shard, member, consumer) in self.unconsumed_assignments() {
                let _ = writeln!(
                    out,
                    "shard {shard} assigned to member {member} but consumed by {} for longer than its lease",
                    consumer.unwrap_or("nobody")
                );
            }
        }
        for (worker, open) in self.open_breakers() {
            let misconfigured = worker.breaker.cause == PauseCause::Configuration;
            let page = if open >= t.page || misconfigured {
                "PAGE: "
            } else {
                ""
            };
            let what = if misconfigured {
                "misconfigured".to_owned()
            } else {
                format!("breaker {}", worker.breaker.state.as_str())
            };
            let _ = writeln!(
                out,
                "{page}worker {}: downstream {what} for {:.1}s, calls paused ({})",
                worker.worker,
                open.as_secs_f64(),
                worker.breaker.reason
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
        for f in &self.broker {
            let _ = writeln!(
                out,
                "broker {}: {} ({}) [{}]",
                f.topic,
                f.text,
                f.verdict.as_str(),
                f.source
            );
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use shardline_contract::status::BreakerReport;

    fn st(queue: &str, messages: u32, consumers: u32) -> ShardStatus {
        ShardStatus {
            queue: queue.into(),
            messages,
            consumers,
        }
    }

    fn report(shard: u16, backlog: f64, at: u64) -> ShardReport {
        ShardReport {
            forwarded_per_second: 0.0,
            shard,
            owner: "worker-a".into(),
            backlog_age_seconds: backlog,
            backlog_age_source: Some(StampSource::Received),
            inflight_age_seconds: Some(backlog),
            inflight_events: 1,
            waiting_events: 0,
            held_events: 0,
            held: Vec::new(),
            updated_at_ms: at,
            stopped_at_ms: None,
        }
    }

    fn dlq() -> DlqLine {
        DlqLine {
            queue: st("order.events.dlq", 2, 0),
            by_reason: BTreeMap::from([("handler".into(), 1), ("seq-gap".into(), 1)]),
            browsed: 2,
            indexed: Some(2),
        }
    }

    fn status_of(shards: Vec<ShardLine>, t: Thresholds) -> StatusReport {
        StatusReport {
            url: "amqp://h/".into(),
            shards,
            dlq: dlq(),
            workers: Vec::new(),
            thresholds: t,
            status_error: None,
            read_at_ms: 1_000_000,
            fleet: None,
            broker: Vec::new(),
            topology: None,
            publishers: Vec::new(),
            relays: Vec::new(),
        }
    }

    #[test]
    fn status_table_totals_and_flags_unconsumed_shards() {
        let t = Thresholds::default();
        let now = 1_000_000;
        let shards = vec![
            ShardLine::new(
                0,
                st("order.events.shard.0", 3, 1),
                Some(report(0, 31.0, now)),
                now,
                &t,
            ),
            ShardLine::new(1, st("order.events.shard.1", 4, 0), None, now, &t),
        ];
        let mut status = status_of(shards, t);
        let table = status.table();
        assert!(table.contains("all"), "{table}");
        assert!(table.contains("        7"), "{table}");
        assert!(table.contains("no consumer"), "{table}");
        assert!(table.contains("1 of 2 shards"), "{table}");
        assert!(table.contains("worker-a"), "{table}");
        assert!(table.contains("WARN"), "{table}");
        assert!(table.contains("handler 1, seq-gap 1"), "{table}");
        status.workers.push(WorkerReport {
            worker: "worker-a".into(),
            assigned: vec![0, 1],
            consuming: vec![0],
            updated_at_ms: now,
            breaker: BreakerReport::default(),
            knows_markers: true,
            takes_new_shards: false,
        });
        assert_eq!(
            status.table(),
            table,
            "workers with closed breakers do not change the table"
        );
        let json = status.json();
        assert_eq!(json["shards"][1]["messages"], 4);
        assert_eq!(json["shards"][0]["owner"], "worker-a");
        assert_eq!(json["shards"][0]["level"], "WARN");
        assert_eq!(json["shards"][0]["backlog_age_seconds"], 31.0);
        assert_eq!(json["shards"][1]["owner"], serde_json::Value::Null);
        assert_eq!(json["dead_letter_queue"]["messages"], 2);
        assert_eq!(json["dead_letter_queue"]["by_reason"]["seq-gap"], 1);
        assert_eq!(json["workers"][0]["worker"], "worker-a");
        assert_eq!(json["workers"][0]["consuming"], serde_json::json!([0]));
        // Shard 1 has events and no consumer.
        assert_eq!(json["needs_attention"], true);
    }

    /// The topology's lines: a reshard in progress, retired queues, and the
    /// shards where events still arrive by an old routing, with their rate
    /// (only once no reshard runs: during one, forwards are its moves').
    #[test]
    fn the_topology_lines_show_a_reshard_retired_queues_and_old_routing() {
        let t = Thresholds::default();
        let mut forwarding = report(0, 0.0, 1_000_000);
        forwarding.forwarded_per_second = 3.5;
        let shards = vec![
            ShardLine::new(
                0,
                st("order.events.shard.0", 0, 1),
                Some(forwarding),
                1_000_000,
                &t,
            ),
            ShardLine::new(
                1,
                st("order.events.shard.1", 0, 1),
                Some(report(1, 0.0, 1_000_000)),
                1_000_000,
                &t,
            ),
        ];
        let mut status = status_of(shards, t);
        let mut record = TopologyRecord::first(
            shardline_contract::ShardCount::new(4).unwrap(),
            "topology apply",
            0,
        );
        record.retired = vec![6, 7];
        status.topology = Some(record.clone());
        let lines = status.topology_lines().join("\n");
        assert!(lines.contains("shard.6, shard.7"), "{lines}");
        assert!(
            lines.contains(
                "events still arrive by an old routing and are forwarded: shard.0 3.5/s;"
            ),
            "{lines}"
        );
        assert!(!lines.contains("shard.1 "), "{lines}");
        record.reshard = Some(shardline_contract::reshard::ReshardState::planned(
            1, 6, "a test", 0,
        ));
        status.topology = Some(record);
        let lines = status.topology_lines().join("\n");
        assert!(
            lines.contains("reshard to 6 shards in progress: phase Planned (a test"),
            "{lines}"
        );
        assert!(!lines.contains("old routing"), "{lines}");
        assert!(status.table().contains("reshard to 6 shards in progress"));
    }

    #[test]
    fn the_outbox_relays_are_shown_with_their_role_lag_and_error() {
        use shardline_contract::status::RelayRole;
        let mut status = status_of(Vec::new(), Thresholds::default());
        let relay = |name: &str, role, error: Option<&str>| RelayReport {
            relay: name.into(),
            database: "postgres://app:***@db/shop".into(),
            schema: "public".into(),
            role,
            lag_ms: 1_250,
            relayed: 40,
            error: error.map(Into::into),
            updated_at_ms: 1_000_000,
        };
        status.relays = vec![
            relay("a", RelayRole::Active, None),
            relay("b", RelayRole::Retrying, Some("the database: refused")),
        ];
        // Shown with or without a recorded topology.
        let lines = status.topology_lines();
        assert_eq!(
            lines,
            [
                "outbox relay a: active on postgres://app:***@db/shop schema public, lag 1.2 s, 40 rows relayed",
                "outbox relay b: retrying on postgres://app:***@db/shop schema public, lag 1.2 s, 40 rows relayed (the database: refused)",
            ]
        );
        assert_eq!(status.json()["outbox_relays"][1]["role"], "retrying");
    }

    #[test]
    fn a_stopped_owner_is_gone_at_once_and_its_waiting_events_age_from_the_stop() {
        let t = Thresholds::default();
        let now = 1_000_000;
        let stopped = ShardReport {
            stopped_at_ms: Some(now - 45_000),
            backlog_age_seconds: 0.0,
            ..report(0, 0.0, now - 45_000)
        };
        let waiting = ShardLine::new(0, st("q0", 1, 0), Some(stopped.clone()), now, &t);
        assert_eq!(waiting.owner(), None);
        assert_eq!(waiting.backlog_age, Some(Duration::from_secs(45)));
        assert_eq!(waiting.level, Some(Level::Warn));
        assert_eq!(
            waiting.note(),
            "its worker stopped: events wait for a new owner"
        );
        let empty = ShardLine::new(1, st("q1", 0, 0), Some(stopped.clone()), now, &t);
        assert_eq!(empty.backlog_age, Some(Duration::ZERO));
        assert_eq!(empty.note(), "its worker stopped");
        let status = status_of(vec![waiting, empty], t);
        assert!(status.needs_attention());
        let table = status.table();
        assert!(!table.contains("worker-a"), "{table}");
        let json = status.json();
        assert_eq!(json["shards"][0]["owner"], serde_json::Value::Null);
        assert_eq!(json["shards"][0]["stopped"]["owner"], "worker-a");
        assert_eq!(json["shards"][0]["stopped"]["at_ms"], now - 45_000);
        assert_eq!(json["shards"][0]["backlog_age_seconds"], 45.0);
    }

    #[test]
    fn the_fleet_is_listed_and_a_shard_its_assignee_does_not_consume_is_attention() {
        let t = Thresholds::default();
        let now = 1_000_000;
        let shards = vec![
            ShardLine::new(
                0,
                st("order.events.shard.0", 0, 1),
                Some(report(0, 0.0, now)),
                now,
                &t,
            ),
            ShardLine::new(
                1,
                st("order.events.shard.1", 0, 1),
                Some(report(1, 0.0, now)),
                now,
                &t,
            ),
        ];
        let mut status = status_of(shards, t);
        let member = |id: &str, worker: &str| MemberRecord {
            member: id.into(),
            worker: worker.into(),
            joined_at_ms: 0,
            lease_until_ms: now + 4_000,
            lease_ms: 5_000,
            owns: Vec::new(),
        };
        let assigned = |decided_at_ms| FleetView {
            members: vec![member("m-a", "worker-a"), member("m-b", "worker-b")],
            assignment: FleetAssignment {
                assignment: shardline_contract::assignment::Assignment {
                    generation: 4,
                    owners: [(0, "m-a".to_owned()), (1, "m-b".to_owned())].into(),
                },
                decided_at_ms,
            },
        };
        // Both shards are consumed by worker-a (the report's owner): shard 1 is
        // assigned to m-b, which is not consuming it.
        status.fleet = Some(assigned(now - 1_000));
        assert!(
            status.unconsumed_assignments().is_empty(),
            "within the lease"
        );
        assert!(
            status
                .table()
                .contains("member m-b (worker worker-b): 1 shard(s) assigned, lease 4.0s left"),
            "{}",
            status.table()
        );
        status.fleet = Some(assigned(now - 6_000));
        assert_eq!(
            status.unconsumed_assignments(),
            [(1, "m-b", Some("worker-a"))]
        );
        assert!(status.needs_attention());
        assert!(
            status
                .table()
                .contains("shard 1 assigned to member m-b but consumed by worker-a"),
            "{}",
            status.table()
        );
        assert_eq!(status.json()["fleet"]["members"][1]["assigned_shards"], 1);
    }

    #[test]
    fn a_dlq_deeper_than_its_index_says_reindex_needed() {
        let mut status = status_of(Vec::new(), Thresholds::default());
        assert!(!status.table().contains("reindex needed"));
        assert_eq!(status.json()["dead_letter_queue"]["reindex_needed"], false);
        status.dlq.indexed = Some(1);
        assert!(
            status
                .table()
                .contains("reindex needed: the DLQ holds 2 letter(s), its index 1"),
            "{}",
            status.table()
        );
        assert_eq!(status.json()["dead_letter_queue"]["reindex_needed"], true);
        assert_eq!(status.json()["dead_letter_queue"]["indexed"], 1);
        // Redis unread: nothing is claimed either way.
        status.dlq.indexed = None;
        assert!(!status.dlq.reindex_needed());
    }

    /// Worker `name`, its breaker open for `open_ms` with `reason`, for `cause`.
    fn paused_worker(
        status: &StatusReport,
        name: &str,
        open_ms: u64,
        reason: &str,
        cause: PauseCause,
    ) -> WorkerReport {
        WorkerReport {
            worker: name.into(),
            assigned: vec![0],
            consuming: vec![0],
            updated_at_ms: status.read_at_ms,
            breaker: BreakerReport {
                state: BreakerState::Open,
                since_ms: Some(status.read_at_ms - open_ms),
                reason: reason.into(),
                trips: 1,
                cause,
            },
            knows_markers: true,
            takes_new_shards: false,
        }
    }

    #[test]
    fn an_open_breaker_is_shown_and_pages_after_the_page_threshold() {
        let t = Thresholds::default();
        let mut status = status_of(Vec::new(), t);
        let reason = "the probe call failed";
        let worker = |status: &StatusReport, open_ms| {
            paused_worker(status, "worker-b", open_ms, reason, PauseCause::Outage)
        };
        status.workers = vec![worker(&status, 30_000)];
        let table = status.table();
        assert!(
            table.contains("worker worker-b: downstream breaker open for 30.0s, calls paused (the probe call failed)"),
            "{table}"
        );
        assert!(!status.needs_attention());
        status.workers = vec![worker(&status, 120_000)];
        assert!(
            status.table().contains("PAGE: worker worker-b"),
            "{}",
            status.table()
        );
        assert!(status.needs_attention());
        assert_eq!(status.json()["workers"][0]["breaker"]["state"], "open");
        assert_eq!(status.json()["workers"][0]["breaker"]["cause"], "outage");
    }

    #[test]
    fn a_misconfigured_downstream_pages_at_once_and_names_the_answer() {
        let mut status = status_of(Vec::new(), Thresholds::default());
        let reason = "the downstream's configuration: downstream answered 302, a redirect to http://h/landed";
        status.workers = vec![paused_worker(
            &status,
            "worker-c",
            2_000,
            reason,
            PauseCause::Configuration,
        )];
        let table = status.table();
        assert!(
            table.contains("PAGE: worker worker-c: downstream misconfigured for 2.0s, calls paused (the downstream's configuration: downstream answered 302, a redirect to http://h/landed)"),
            "{table}"
        );
        assert!(status.needs_attention());
        assert_eq!(
            status.json()["workers"][0]["breaker"]["cause"],
            "configuration"
        );
    }

    #[test]
    fn the_table_says_when_it_counted_only_the_first_letters() {
        let mut status = status_of(Vec::new(), Thresholds::default());
        status.dlq.queue.messages = 5;
        assert!(
            status
                .table()
                .contains("dead letters by reason (first 2 letters): handler 1, seq-gap 1")
        );
        status.dlq.by_reason.clear();
        status.status_error = Some("timed out".into());
        let table = status.table();
        assert!(!table.contains("dead letters by reason"), "{table}");
        assert!(
            table.contains("shard status unavailable (Redis: timed out)"),
            "{table}"
        );
    }

    #[test]
    fn a_page_on_a_publishers_claim_is_labelled_and_still_pages() {
        let t = Thresholds::default();
        let now = 1_000_000;
        let claimed = |shard: u16, backlog: f64| ShardReport {
            backlog_age_source: Some(StampSource::Publisher),
            ..report(shard, backlog, now)
        };
        let shards = vec![
            ShardLine::new(0, st("q.0", 1, 1), Some(claimed(0, 300.0)), now, &t),
            ShardLine::new(1, st("q.1", 1, 1), Some(claimed(1, 45.0)), now, &t),
            ShardLine::new(2, st("q.2", 1, 1), Some(claimed(2, 1.0)), now, &t),
            ShardLine::new(3, st("q.3", 1, 1), Some(report(3, 300.0, now)), now, &t),
        ];
        let status = status_of(shards, t);
        let text: Vec<_> = status.shards.iter().map(ShardLine::level_text).collect();
        assert_eq!(
            text,
            [
                Some("PAGE (publisher-claimed)".to_owned()),
                Some("WARN (publisher-claimed)".to_owned()),
                Some("OK".to_owned()),
                Some("PAGE".to_owned()),
            ]
        );
        assert!(
            status.needs_attention(),
            "a claimed PAGE exits 3 all the same"
        );
        let table = status.table();
        assert!(
            table.contains("PAGE (publisher-claimed): shard(s) 0 behind by more than 2m"),
            "{table}"
        );
        assert!(table.contains("PAGE: shard(s) 3 behind"), "{table}");
        let row = table.lines().find(|l| l.starts_with("0 ")).unwrap();
        assert!(row.contains("  PAGE (publisher-claimed)  "), "{row}");
        let json = status.json();
        assert_eq!(json["shards"][0]["level"], "PAGE");
        assert_eq!(json["shards"][0]["level_label"], "publisher-claimed");
        assert_eq!(json["shards"][0]["backlog_age_source"], "publisher");
        assert_eq!(json["shards"][2]["level_label"], serde_json::Value::Null);
        assert_eq!(json["shards"][3]["level_label"], serde_json::Value::Null);
        assert_eq!(json["shards"][3]["backlog_age_source"], "received");
        assert_eq!(json["needs_attention"], true);
        let only_claimed = status_of(status.shards[..1].to_vec(), t);
        assert!(only_claimed.needs_attention());
        assert!(!only_claimed.table().contains("PAGE: shard"));
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
        let attention = |lines: Vec<ShardLine>| status_of(lines, t).needs_attention();
        assert!(!attention(vec![line(0.0, 0, 1)]));
        assert!(!attention(vec![line(1.2, 5, 1)]));
        // 1.6 s reported half a second ago: 2.1 s now.
        assert!(attention(vec![line(1.6, 5, 1)]));
        assert!(attention(vec![line(0.0, 5, 0)]));
        let quiet = ShardLine::new(0, st("q", 0, 1), None, now, &t);
        assert!(!attention(vec![quiet.clone()]));
        assert_eq!(quiet.note(), "no fresh status");
    }

    #[test]
    fn apply_says_when_publishers_must_declare_arguments() {
        let applied = Applied {
            url: "amqp://h/".into(),
            names: Names::default(),
            options: TopologyOptions {
                queue_type: QueueType::Quorum,
                ..TopologyOptions::default()
            },
            report: ApplyReport {
                shard_queues: vec!["order.events.shard.0".into()],
                publishers_must_declare: Some("x-queue-type=quorum".into()),
                dead_letter_queue: DlqKind::Quorum,
                nodes: 3,
            },
            broker: Vec::new(),
        };
        let text = applied.text();
        assert!(text.contains("NOTE: publishers"), "{text}");
        assert!(text.contains("through 3 nodes"), "{text}");
        assert!(text.contains("(quorum, no delivery limit)"), "{text}");
        let on_4 = Applied {
            options: TopologyOptions {
                broker_version: Some(Version::new(4, 1, 0)),
                ..applied.options.clone()
            },
            ..applied.clone()
        };
        assert!(
            on_4.text().contains("(quorum, x-delivery-limit -1 (none))"),
            "{}",
            on_4.text()
        );
        assert!(text.contains("x-queue-type=quorum"), "{text}");
        let plain = Applied {
            options: TopologyOptions::default(),
            report: ApplyReport {
                publishers_must_declare: None,
                dead_letter_queue: DlqKind::Classic,
                nodes: 1,
                ..applied.report.clone()
            },
            ..applied
        };
        let text = plain.text();
        assert!(!text.contains("NOTE"), "{text}");
        assert!(
            text.contains("  consumers: one exclusive consumer"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn thresholds_are_checked_before_connecting() {
        let config = StatusConfig {
            thresholds: Thresholds {
                warn: Duration::from_secs(2),
                page: Duration::from_secs(1),
            },
            dlq_browse: None,
        };
        let e = status(&Fleet::default(), &config).await.unwrap_err();
        assert_eq!(
            e.rename_fields(|f| format!("<{f}>")),
            "<thresholds.page> must not be below <thresholds.warn>"
        );
    }
}
