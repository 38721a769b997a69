//! Reconcile: finds orders whose status implies an event the fleet never
//! processed, and publishes a compensation event for each (docs/semantics.md §5).
//!
//! One run, in the order it goes:
//!
//! 1. read the order snapshots updated within the window from PostgreSQL, in
//!    a read-only transaction (the order database is never written; `orders`);
//!    with the transactional outbox, also its unpublished rows of the orders
//!    whose events are missing, in the same `REPEATABLE READ` snapshot
//!    (`outbox`, which says why that is sound);
//! 2. skip orders updated within the grace, and statuses that imply no event;
//! 3. look up whether the workers processed each expected kind (the `kind`
//!    key of [`shardline_contract::Keys`], written with each dedup commit);
//! 4. look for each missing event on its way (`pending`): a compensation
//!    emitted before, a row of its order not relayed from the outbox yet, an
//!    event held by the sequence gate, a dead letter, a shard backlog older
//!    than the grace, or a shard with messages and no worker reporting.
//!    Those are *pending* and never compensated;
//! 5. read the processed kinds once more (the event may have gone through
//!    meanwhile), then claim each drifted (order, kind) in Redis and publish
//!    its compensation, confirmed.
//!
//! [`Metrics`] keeps the Prometheus counters over the runs of a process;
//! `history` keeps a summary of each run at an interval in Redis
//! ([`record_run`], [`runs`]) for the console.

mod history;
mod metrics;
mod orders;
mod outbox;
mod pending;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::TryStreamExt as _;
use redis::aio::MultiplexedConnection;
use shardline_connect::declare;
use shardline_contract::envelope::{MAX_FIELD_BYTES, order_key_of};
use shardline_contract::status::{ShardReport, unix_ms};
use shardline_contract::{Keys, ShardId};
use shardline_publisher::Publisher;
use tokio_postgres::types::ToSql;
use tokio_util::sync::CancellationToken;

pub use history::{RUNS_CAP, RunSummary, record_run, runs};
pub use metrics::{CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics, names};
use orders::{Columns, one_line};
use outbox::Outbox;
use pending::Whereabouts;
use shardline_connect::{redact, scrub};

use crate::error::chain;
pub use crate::findings::{
    Compensation, Drift, Expected, NotEmitted, OnItsWay, Pending, ReconcileReport,
};
use crate::{Error, Event, Fleet};

/// The orders query by default: orders table `orders`, lower bound `$1`.
pub const DEFAULT_QUERY: &str =
    "SELECT order_id, status, updated_at FROM orders WHERE updated_at >= $1";

/// What each status implies by default.
pub const DEFAULT_EXPECT: [(&str, &str); 3] = [
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

/// What reconcile compares, and how far it may go.
#[derive(Clone, PartialEq, Eq)]
pub struct ReconcileConfig {
    /// PostgreSQL URL of the order database (`postgres://user:password@host/db`,
    /// or a key=value string). Only read, in a read-only transaction. Required.
    pub orders_url: String,
    /// Query returning `order_id, status, updated_at` of the orders updated at
    /// or after `$1` (now minus the window). Default [`DEFAULT_QUERY`].
    pub orders_query: String,
    /// Look at orders updated this long ago at most (above 0). Keep it
    /// within the worker's kinds TTL: older processed kinds may have
    /// expired. Default 24 h.
    pub window: Duration,
    /// Skip orders updated less than this long ago (shorter than the
    /// window): their events may still be on their way. Default 2 min.
    pub grace: Duration,
    /// `(status, kind)`: an order in that status must have had an event of
    /// that kind processed. Empty (the default): [`DEFAULT_EXPECT`].
    pub expect: Vec<(String, String)>,
    /// Only report: emit nothing, write nothing. Default off.
    pub dry_run: bool,
    /// Emit nothing in a run that would emit more than this many
    /// compensations: a mass drift is an outage or a misconfiguration, not
    /// something to paper over. Default 1000.
    pub max_emit: usize,
    /// The schema of the transactional outbox (`shardline outbox install
    /// --schema`) in the order database, when the application writes its
    /// events through it. The orders and the outbox are then read in one
    /// `REPEATABLE READ` snapshot, and an order with rows the relay has not
    /// published yet is pending, never drift. Read it on the primary. A
    /// schema name the outbox accepts (lower-case letters, digits, `_`).
    /// Default none: no outbox.
    pub outbox_schema: Option<String>,
}

/// The orders URL shown redacted.
impl std::fmt::Debug for ReconcileConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReconcileConfig")
            .field("orders_url", &redact(&self.orders_url))
            .field("orders_query", &self.orders_query)
            .field("window", &self.window)
            .field("grace", &self.grace)
            .field("expect", &self.expect)
            .field("dry_run", &self.dry_run)
            .field("max_emit", &self.max_emit)
            .field("outbox_schema", &self.outbox_schema)
            .finish()
    }
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            orders_url: String::new(),
            orders_query: DEFAULT_QUERY.into(),
            window: Duration::from_secs(24 * 3600),
            grace: Duration::from_secs(120),
            expect: Vec::new(),
            dry_run: false,
            max_emit: 1000,
            outbox_schema: None,
        }
    }
}

/// `STATUS=KIND` as an expectation; the kind must be a valid envelope `event`.
pub fn parse_expectation(s: &str) -> Result<(String, String), String> {
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

/// The event kinds each order status implies.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expectations(BTreeMap<String, Vec<String>>);

impl Expectations {
    /// From `(status, kind)` pairs; the defaults when there are none.
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

/// A validated reconcile config on a fleet: runs once or at an interval.
pub struct Reconciler {
    fleet: Fleet,
    orders: tokio_postgres::Config,
    /// The orders URL with its password blanked out.
    orders_url: String,
    config: ReconcileConfig,
    expectations: Expectations,
    /// The outbox read in the orders' snapshot, if any.
    outbox: Option<Outbox>,
}

impl Reconciler {
    /// Checks `config` (window, grace, the orders URL, the outbox schema).
    pub fn new(fleet: Fleet, config: ReconcileConfig) -> Result<Self, Error> {
        if config.window.is_zero() {
            return Err(Error::config(&["window"], "window must be above 0"));
        }
        if config.grace >= config.window {
            return Err(Error::config(
                &["grace", "window"],
                format!(
                    "grace ({}) must be shorter than window ({})",
                    humantime::format_duration(config.grace),
                    humantime::format_duration(config.window)
                ),
            ));
        }
        let orders_url = redact(&config.orders_url);
        let mut orders: tokio_postgres::Config = config.orders_url.parse().map_err(|e| {
            Error::config(
                &["orders_url"],
                format!(
                    "orders_url {orders_url}: {} ({})",
                    one_line(&scrub(&chain(&e), &config.orders_url)),
                    shardline_connect::redact::PERCENT_ENCODE
                ),
            )
        })?;
        if orders.get_connect_timeout().is_none() {
            orders.connect_timeout(Duration::from_secs(10));
        }
        if orders.get_application_name().is_none() {
            orders.application_name("shardline reconcile");
        }
        let outbox = match &config.outbox_schema {
            None => None,
            Some(name) => {
                let schema = shardline_outbox::validate_schema(name).map_err(|e| {
                    let why = match e {
                        shardline_outbox::OutboxError::InvalidSchema { reason, .. } => {
                            reason.to_owned()
                        }
                        other => other.to_string(),
                    };
                    Error::config(&["outbox_schema"], format!("outbox_schema {name:?}: {why}"))
                })?;
                Some(Outbox::new(&schema))
            }
        };
        let expectations = Expectations::new(&config.expect);
        tracing::debug!(
            orders = %orders_url,
            expectations = %expectations.describe(),
            outbox = outbox.as_ref().map(Outbox::table),
            "reconcile configured"
        );
        Ok(Self {
            fleet,
            orders,
            orders_url,
            config,
            expectations,
            outbox,
        })
    }

    /// `text` with the orders database's password blanked out, on one line.
    fn scrub_orders(&self, text: &str) -> String {
        let text = scrub(text, &self.config.orders_url);
        let text = match self.orders.get_password() {
            Some(p) if !p.is_empty() => text.replace(&*String::from_utf8_lossy(p), "***"),
            _ => text,
        };
        one_line(&text)
    }

    /// One run. `cancel` stops it from emitting more (what is left is
    /// reported as not emitted).
    pub async fn run_once(&self, cancel: &CancellationToken) -> Result<ReconcileReport, Error> {
        let mut run = Run {
            r: self,
            redis: self.fleet.redis.connect().await?,
            broker: None,
            publisher: None,
        };
        let result = run.go(cancel).await;
        run.close().await;
        result
    }

    /// A run every `interval` until `cancel`, the first at once; each run's
    /// report (or failure) goes to `progress`, and its [`RunSummary`] to
    /// Redis ([`record_run`]; a summary that cannot be written is logged and
    /// the runs go on). A failed run is retried at the next interval.
    pub async fn run_every(
        &self,
        interval: Duration,
        cancel: &CancellationToken,
        mut progress: impl FnMut(Event),
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = cancel.cancelled() => break,
            }
            let started = Instant::now();
            let summary = match self.run_once(cancel).await {
                Ok(report) => {
                    let summary = RunSummary::of(&report, started.elapsed());
                    progress(Event::Reconciled(Box::new(report)));
                    summary
                }
                Err(e) => {
                    let error = chain(&e);
                    tracing::error!(
                        error = %error,
                        next_in = %humantime::format_duration(interval),
                        "reconcile run failed; trying again at the next interval"
                    );
                    let summary = RunSummary {
                        dry_run: self.config.dry_run,
                        ..RunSummary::failed(error.clone(), started.elapsed())
                    };
                    progress(Event::ReconcileFailed { error });
                    summary
                }
            };
            if let Err(e) = record_run(&self.fleet, &summary).await {
                tracing::warn!(
                    error = %chain(&e),
                    "cannot keep the run's summary in Redis; the runs go on"
                );
            }
        }
        tracing::info!("reconcile stopped");
    }
}

/// The connections of one run, opened when first needed.
struct Run<'a> {
    r: &'a Reconciler,
    redis: MultiplexedConnection,
    broker: Option<lapin::Connection>,
    publisher: Option<Publisher>,
}

impl Run<'_> {
    async fn go(&mut self, cancel: &CancellationToken) -> Result<ReconcileReport, Error> {
        let c = &self.r.config;
        let mut report = ReconcileReport {
            dry_run: c.dry_run,
            window: c.window,
            grace: c.grace,
            ..ReconcileReport::default()
        };
        let (missing, outbox) = self.scan(&mut report).await?;
        if !missing.is_empty() {
            let (missing, pending) = self.on_their_way(missing, outbox).await?;
            report.pending = pending;
            // Processed while we looked: not drift.
            let drifted = self.unprocessed(missing.clone()).await?;
            report.processed += (missing.len() - drifted.len()) as u64;
            report.drift = self.compensate(drifted, &mut report, cancel).await?;
        }
        report.at = SystemTime::now();
        Ok(report)
    }

    /// Steps 1–3: the orders query, classified, and the expected events the
    /// fleet has not processed, with what the outbox holds of their orders.
    async fn scan(
        &mut self,
        report: &mut ReconcileReport,
    ) -> Result<(Vec<Expected>, outbox::Seen), Error> {
        let r = self.r;
        let (mut client, connection) =
            r.orders.connect(tokio_postgres::NoTls).await.map_err(|e| {
                Error::target(
                    &["orders_url"],
                    format!(
                        "orders_url {}: cannot connect: {}",
                        r.orders_url,
                        r.scrub_orders(&chain(&e))
                    ),
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
        report: &mut ReconcileReport,
    ) -> Result<(Vec<Expected>, outbox::Seen), Error> {
        let r = self.r;
        let db = |e: tokio_postgres::Error| Error::Orders {
            url: r.orders_url.clone(),
            cause: r.scrub_orders(&chain(&e)),
        };
        let mut tx = client.build_transaction().read_only(true);
        if r.outbox.is_some() {
            // One snapshot for every statement, taken at the first: the
            // orders and the outbox as of one moment.
            tx = tx.isolation_level(tokio_postgres::IsolationLevel::RepeatableRead);
        }
        let tx = tx.start().await.map_err(db)?;
        let outbox = match &r.outbox {
            Some(outbox) => Some(outbox.prepare(&tx).await.map_err(|e| {
                Error::target(
                    &["outbox_schema"],
                    format!(
                        "outbox_schema: reading {}: {}",
                        outbox.table(),
                        r.scrub_orders(&chain(&e))
                    ),
                )
            })?),
            None => None,
        };
        let statement = tx.prepare(&r.config.orders_query).await.map_err(|e| {
            Error::target(
                &["orders_query"],
                format!("orders_query: {}", r.scrub_orders(&chain(&e))),
            )
        })?;
        let columns = Columns::of(&statement)?;
        let now = SystemTime::now();
        let lower = now.checked_sub(r.config.window).unwrap_or(UNIX_EPOCH);
        let params: [&(dyn ToSql + Sync); 1] = [&lower];
        let rows = tx.query_raw(&statement, params).await.map_err(db)?;
        let mut rows = std::pin::pin!(rows);
        let mut candidates = Vec::new();
        let mut missing = Vec::new();
        // An order's events are on its shard by the recorded topology (a
        // reshard moves orders).
        let shards = crate::fleet::OrderShards::read(&r.fleet).await?;
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
                .is_ok_and(|age| age < r.config.grace)
                || snapshot.updated_at > now
            {
                report.skipped_fresh += 1;
                continue;
            }
            let kinds = r.expectations.kinds(&snapshot.status);
            if kinds.is_empty() {
                report.no_expectation += 1;
                continue;
            }
            let order_key = order_key_of(&snapshot.order_id);
            let shard = shards.of(&snapshot.order_id);
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
                missing.extend(self.unprocessed_counted(batch, report).await?);
            }
        }
        missing.extend(self.unprocessed_counted(candidates, report).await?);
        let seen = match outbox {
            Some(statements) if !missing.is_empty() => {
                let orders = orders_of(&missing);
                statements
                    .read(&tx, &orders, r.config.grace)
                    .await
                    .map_err(db)?
            }
            _ => outbox::Seen::default(),
        };
        // Read only: nothing to commit.
        tx.rollback().await.map_err(db)?;
        if report.outside_window > 0 {
            tracing::warn!(
                rows = report.outside_window,
                "the orders query returned rows updated before the window; ignored (does the query use $1?)"
            );
        }
        if report.invalid > 0 {
            tracing::warn!(
                rows = report.invalid,
                "the orders query returned rows without order_id or updated_at; ignored"
            );
        }
        Ok((missing, seen))
    }

    /// [`Self::unprocessed`], counting the processed ones in `report`.
    async fn unprocessed_counted(
        &mut self,
        expected: Vec<Expected>,
        report: &mut ReconcileReport,
    ) -> Result<Vec<Expected>, Error> {
        let n = expected.len();
        let unprocessed = self.unprocessed(expected).await?;
        report.processed += (n - unprocessed.len()) as u64;
        Ok(unprocessed)
    }

    /// The expected events whose kind was not processed for their order.
    async fn unprocessed(&mut self, expected: Vec<Expected>) -> Result<Vec<Expected>, Error> {
        let keys = &self.r.fleet.keys;
        let mut out = Vec::new();
        for chunk in expected.chunks(BATCH) {
            let mut pipe = redis::pipe();
            // The order state's kind field, and the key of the layout before
            // it (processed before an upgrade, within the kinds TTL).
            for e in chunk {
                pipe.cmd("HGET").arg(keys.order(&e.order_key)).arg("k");
                pipe.cmd("EXISTS").arg(keys.kind(&e.order_key, &e.kind));
            }
            let answers: Vec<(Option<String>, bool)> = redis_op(
                &self.r.fleet.redis,
                "reading processed kinds",
                pipe.query_async(&mut self.redis),
            )
            .await?;
            let processed = chunk.iter().zip(answers).map(|(e, (kinds, old))| {
                old || kinds.is_some_and(|k| Keys::has_kind(&k, &Keys::kind_code(&e.kind)))
            });
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
        outbox: outbox::Seen,
    ) -> Result<(Vec<Expected>, Vec<Pending>), Error> {
        let r = self.r;
        let names = &r.fleet.names;
        let url = r.fleet.amqp.to_string();
        // Upstream first: a letter replayed meanwhile shows up in the shard
        // status read next, or as processed. The DLQ's depth before the
        // index's count (a letter is published before it is indexed), the
        // index before the replay locks (a replay takes an order's lock
        // before its letters leave the index, and keeps it for a tail).
        let dlq = &names.dead_letter_queue;
        let depth = declare::queue_status(self.broker().await?, dlq)
            .await
            .map_err(Error::queue(format!("reading {dlq} on {url}")))?
            .messages;
        let mut index = crate::dlq::Index::on(&r.fleet, self.redis.clone());
        let indexed = index.count().await?;
        let orders = orders_of(&missing);
        let mut dead_letters = HashMap::new();
        for (order, entries) in index.of_orders(&orders).await? {
            for entry in entries {
                if let Some(kind) = entry.kind {
                    dead_letters
                        .entry((order.clone(), kind))
                        .or_insert(entry.id);
                }
            }
        }
        let locked = crate::dlq::locked(&r.fleet, &mut self.redis, &orders).await?;
        let replaying = orders
            .iter()
            .zip(locked)
            .filter(|(_, locked)| *locked)
            .map(|(order, _)| (*order).to_owned())
            .collect();
        let shards: Vec<ShardId> = missing
            .iter()
            .map(|e| e.shard)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let read = crate::topology::shard_reports(&mut self.redis, &r.fleet.keys, &shards);
        let reports: HashMap<ShardId, ShardReport> = shards
            .iter()
            .copied()
            .zip(redis_op(&r.fleet.redis, "reading shard status", read).await?)
            .filter_map(|(shard, report)| Some((shard, report?)))
            .collect();
        // Shards nobody reports: whatever waits in their queue is on its way.
        let mut unreported = HashMap::new();
        for shard in shards.iter().filter(|s| !reports.contains_key(s)) {
            let queue = names.shard_queue(*shard);
            let st = declare::queue_status(self.broker().await?, &queue)
                .await
                .map_err(Error::queue(format!("reading {queue} on {url}")))?;
            unreported.insert(*shard, st.messages);
        }
        let mut pipe = redis::pipe();
        for e in &missing {
            pipe.cmd("EXISTS").arg(e.emitted_key(&r.fleet.keys));
        }
        let compensated: Vec<bool> = redis_op(
            &r.fleet.redis,
            "reading emitted compensations",
            pipe.query_async(&mut self.redis),
        )
        .await?;
        let seen = Whereabouts {
            reports,
            unreported,
            dead_letters,
            replaying,
            index_behind: (u64::from(depth) > indexed).then_some((u64::from(depth), indexed)),
            outbox: outbox.unpublished,
            relay_behind: outbox.relay_behind,
            grace: r.config.grace,
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
    /// `max_emit`); a compensation another run is emitting becomes pending.
    async fn compensate(
        &mut self,
        drifted: Vec<Expected>,
        report: &mut ReconcileReport,
        cancel: &CancellationToken,
    ) -> Result<Vec<Drift>, Error> {
        let c = &self.r.config;
        let count = drifted.len();
        let over_limit = count > c.max_emit;
        if over_limit && !c.dry_run {
            tracing::error!(
                drifted = count,
                max_emit = c.max_emit,
                "more drift than max_emit: emitting nothing"
            );
        }
        let mut out = Vec::with_capacity(drifted.len());
        for expected in drifted {
            let compensation = match expected.compensation() {
                Err(e) => Compensation::NotEmitted(NotEmitted::Invalid(e)),
                Ok(_) if c.dry_run => Compensation::WouldEmit,
                Ok(_) if over_limit => Compensation::NotEmitted(NotEmitted::OverLimit {
                    drifted: count,
                    max_emit: c.max_emit,
                }),
                Ok(_) if cancel.is_cancelled() => Compensation::NotEmitted(NotEmitted::Cancelled),
                Ok(body) => {
                    if !self.emit(&expected, body).await? {
                        report.pending.push(Pending {
                            expected,
                            why: OnItsWay::Compensated,
                        });
                        continue;
                    }
                    Compensation::Emitted
                }
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
    async fn emit(&mut self, expected: &Expected, body: Vec<u8>) -> Result<bool, Error> {
        let r = self.r;
        let key = expected.emitted_key(&r.fleet.keys);
        let claimed: Option<String> = redis_op(
            &r.fleet.redis,
            "claiming a compensation",
            redis::cmd("SET")
                .arg(&key)
                .arg("emitting")
                .arg("NX")
                .arg("PX")
                .arg(u64::try_from(CLAIM_TTL.as_millis()).unwrap_or(u64::MAX))
                .query_async(&mut self.redis),
        )
        .await?;
        if claimed.is_none() {
            return Ok(false);
        }
        if let Err(e) = self.publish(body).await {
            // Unclaimed, so that the next run tries again.
            let released: Result<(), Error> = redis_op(
                &r.fleet.redis,
                "releasing a compensation claim",
                redis::cmd("DEL").arg(&key).query_async(&mut self.redis),
            )
            .await;
            if let Err(e) = released {
                tracing::warn!(error = %chain(&e), key, "cannot release the claim; it expires by itself");
            }
            return Err(Error::Publish {
                context: format!("publishing the compensation of {}", expected.describe()),
                source: e,
            });
        }
        redis_op::<()>(
            &r.fleet.redis,
            "recording a compensation",
            redis::cmd("SET")
                .arg(&key)
                .arg(format!("emitted:{}", unix_ms()))
                .arg("EX")
                .arg(r.config.window.as_secs().max(1))
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

    async fn publish(&mut self, body: Vec<u8>) -> Result<(), shardline_publisher::PublishError> {
        let publisher = match &mut self.publisher {
            Some(p) => p,
            None => {
                let config = self.r.fleet.publisher("shardline reconcile");
                self.publisher.insert(Publisher::connect(config).await?)
            }
        };
        publisher.publish(body).await?;
        publisher.flush().await
    }

    async fn broker(&mut self) -> Result<&lapin::Connection, Error> {
        let conn = match self.broker.take() {
            Some(conn) => conn,
            None => self.r.fleet.connect("shardline reconcile").await?,
        };
        Ok(self.broker.insert(conn))
    }

    async fn close(self) {
        if let Some(publisher) = self.publisher
            && let Err(e) = publisher.close().await
        {
            tracing::debug!(error = %e, "closing the reconcile publisher");
        }
        if let Some(conn) = self.broker {
            crate::fleet::close(&conn).await;
        }
    }
}

/// One Redis round trip under [`REDIS_TIMEOUT`], its error naming what it did.
async fn redis_op<T>(
    redis: &shardline_connect::RedisTarget,
    what: &'static str,
    op: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, Error> {
    let cause = match tokio::time::timeout(REDIS_TIMEOUT, op).await {
        Ok(Ok(value)) => return Ok(value),
        Ok(Err(e)) => redis.scrub(&e.to_string()),
        Err(_) => format!("no answer within {REDIS_TIMEOUT:?}"),
    };
    Err(Error::RedisCommand {
        what,
        url: redis.to_string(),
        cause,
    })
}

/// The distinct orders of `missing`, sorted.
fn orders_of(missing: &[Expected]) -> Vec<&str> {
    missing
        .iter()
        .map(|e| e.order_id.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests;
