//! Replay: republish dead letters to their order's shard after the fix.
//!
//! The replay plans from the dead-letter index (`plan`): letters of one
//! order go in seq order, each recorded in Redis first (its replay record,
//! `shardline_contract::replay`) and marked `x-shardline-replay` with the
//! record's id (so that the sequence gate of the failed attempt does not
//! undo it, and no publisher can pass the gate by setting the header alone),
//! each confirmed before it leaves the DLQ. It reads the DLQ in passes that
//! hold few letters unacked (`Window`), so that the DLQ stays readable and
//! its depth true while a slow replay runs. An order that a worker keeps in
//! quarantine (`--on-dead-letter quarantine`) is followed in rounds: wait
//! until the worker applied what was replayed, then replay what it
//! quarantined meanwhile, until the quarantine is lifted or its blocker
//! failed again.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString};
use opentelemetry::global::{BoxedSpan, BoxedTracer};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceId, Tracer as _};
use opentelemetry::{Context, KeyValue};
use redis::aio::MultiplexedConnection;
use serde::Serialize;
use shardline_contract::envelope::order_key_of;
use shardline_contract::headers::{self, FailReason, header_str};
use shardline_contract::letters::IndexEntry;
use shardline_contract::telemetry::{self, attr, op};
use shardline_contract::{Envelope, Names, OrderId, ShardId, replay};
use shardline_publisher::Publisher;
use tokio_util::sync::CancellationToken;

use super::lock::ReplayLocks;
use super::plan::{Next, Pass, Plan, Verdict, Window};
use super::reader::Reader;
use super::{Filters, Index, Letter, with_dlq};
use crate::fleet::redis_error;
use crate::letter::LetterRef;
use crate::progress::Blocked;
use crate::{Error, Event, Fleet};

/// Follow-up rounds for quarantined orders at most: a steady stream of new
/// events for one order could otherwise keep a replay going for ever.
pub(crate) const MAX_ROUNDS: usize = 20;

/// How often, and how long apart, a pass that found none of the letters it
/// waits for reads the DLQ again before the replay stops: another reader
/// (a letter page, `dlq show`) may hold them unacked for a moment.
const END_RETRIES: u32 = 5;
const END_PAUSE: Duration = Duration::from_secs(1);

/// How often a replay looks whether the worker applied a quarantined order's events.
const QUARANTINE_POLL: Duration = Duration::from_millis(100);

/// What to replay and how fast.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Which letters (default: all).
    pub filters: Filters,
    /// Only say what would be replayed; the DLQ is left as it was. Default off.
    pub dry_run: bool,
    /// At most this many republishes per second (above 0); `None` (the
    /// default): as fast as the broker confirms them, one at a time.
    pub rate: Option<f64>,
    /// For a quarantined order, how long to wait for a worker to apply the
    /// replayed events before looking for successors quarantined meanwhile;
    /// also how long to wait for another replay of an order to end before
    /// leaving the order's letters for a later run. Default 60 s.
    pub wait: Duration,
    /// How long an order's replay lock outlives the replay (reconcile counts
    /// the order's missing events as pending meanwhile): the time a replayed
    /// event may take to reach a worker and be processed. Default 2 min
    /// (reconcile's default grace).
    pub lock_tail: Duration,
    /// How many letters a pass over the DLQ may hold unacked.
    pub window: Window,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            filters: Filters::default(),
            dry_run: false,
            rate: None,
            wait: Duration::from_secs(60),
            lock_tail: Duration::from_secs(120),
            window: Window::default(),
        }
    }
}

/// What a replay did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReplayReport {
    pub dry_run: bool,
    /// Letters read from the DLQ, each counted once (a dry run reads the
    /// index only: the matching entries).
    pub read: usize,
    /// Matching letters that are not envelopes: left in the DLQ.
    pub skipped: Vec<LetterRef>,
    /// Dry run: the letters in replay order, with their shard.
    pub planned: Vec<(LetterRef, u16)>,
    /// Matching letters that can be replayed (envelopes).
    pub matching: usize,
    /// Letters republished, confirmed and removed, in all rounds.
    pub replayed: usize,
    /// Orders left quarantined (or not applied in time): they need attention.
    pub unresolved: Vec<String>,
    /// Orders another replay was replaying: their letters were left in the DLQ.
    pub locked_elsewhere: Vec<OrderId>,
    /// Stopped because a letter waits for one no pass reached.
    pub blocked: Option<Blocked>,
    /// Stopped by the cancellation token before the end.
    pub cancelled: bool,
}

impl ReplayReport {
    /// An order stays quarantined, its replayed events were not applied, or
    /// the replay stopped at a letter it could not reach.
    pub fn needs_attention(&self) -> bool {
        !self.unresolved.is_empty() || !self.locked_elsewhere.is_empty() || self.blocked.is_some()
    }
}

/// Replays the letters `config` selects; `progress` hears of each letter
/// and round as it happens. Stops between letters when `cancel` fires.
pub async fn replay(
    fleet: &Fleet,
    config: &ReplayConfig,
    cancel: &CancellationToken,
    mut progress: impl FnMut(Event) + Send,
) -> Result<ReplayReport, Error> {
    if let Some(rate) = config.rate
        && !(rate > 0.0 && rate.is_finite())
    {
        return Err(Error::config(&["rate"], "rate must be above 0"));
    }
    let window = config.window;
    if window.size == 0 || window.reach < window.size {
        return Err(Error::config(
            &["window", "reach"],
            "the window must be at least 1 and the reach at least the window",
        ));
    }
    let progress: &mut (dyn FnMut(Event) + Send) = &mut progress;
    let entries = planned_entries(fleet, &config.filters, config.dry_run, cancel, progress).await?;
    let (mut plan, skipped) = Plan::new(&entries);
    let mut report = ReplayReport {
        dry_run: config.dry_run,
        skipped,
        matching: plan.len(),
        ..ReplayReport::default()
    };
    for letter in &report.skipped {
        progress(Event::ReplaySkipped {
            letter: letter.clone(),
        });
    }
    if config.dry_run {
        report.read = entries.len();
        let shards = crate::fleet::OrderShards::read(fleet).await?;
        report.planned = plan
            .in_order()
            .into_iter()
            .map(|l| {
                let shard = shards.of(l.order_id.as_deref().unwrap_or(""));
                (l, shard.get())
            })
            .collect();
        return Ok(report);
    }
    if plan.is_empty() {
        return Ok(report);
    }
    let quarantines = Quarantines::read(fleet, &plan, progress).await;
    with_dlq(fleet, async |conn| {
        let mut replay = Replay {
            fleet,
            conn,
            publisher: Publisher::connect(fleet.publisher("shardline dlq replay")).await?,
            index: Index::open(fleet).await?,
            locks: ReplayLocks::new(fleet, config.lock_tail).await?,
            lock_wait: config.wait,
            audit: Audit::new(&fleet.names),
            pause: config.rate.map(|r| Duration::from_secs_f64(1.0 / r)),
            window,
            cancel,
            seen: HashSet::new(),
            report,
        };
        let matching = plan.len();
        let outcome = replay.run(&mut plan, progress).await;
        progress(Event::ReplayPass {
            replayed: replay.report.replayed,
            matching,
            skipped: replay.report.skipped.len(),
            read: replay.report.read,
        });
        let outcome = match (outcome, quarantines) {
            (Ok(()), Some(q)) => replay.follow(q, config.wait, progress).await,
            (outcome, _) => outcome,
        };
        // Taken apart, so that nothing of it borrows the report any more.
        let Replay {
            publisher,
            locks,
            report,
            ..
        } = replay;
        if let Err(e) = publisher.close().await {
            tracing::debug!(error = %e, "closing the replay publisher");
        }
        let finished = locks.finish().await;
        outcome.and(finished)?;
        Ok(report)
    })
    .await
}

/// The index entries matching `filters`. The DLQ is the truth: when it holds
/// letters the index does not (letters the broker dead-lettered itself, or a
/// lost index), or the index holds entries of letters no longer in it (left
/// by a replay or purge killed between its ack and its index write), a
/// replay first rebuilds the index (`dlq reindex`), unless another replay
/// runs (then the letters not in the index stay in the DLQ this time, and
/// the replay says so). A killed replay's locks are waited out (one lease,
/// 10 s): they are not another replay running.
async fn planned_entries(
    fleet: &Fleet,
    filters: &Filters,
    dry_run: bool,
    cancel: &CancellationToken,
    progress: &mut (dyn FnMut(Event) + Send),
) -> Result<Vec<IndexEntry>, Error> {
    let mut index = Index::open(fleet).await?;
    let indexed = index.count().await?;
    let depth = super::dlq_depth(fleet).await?;
    let missing = depth.saturating_sub(indexed);
    if depth != indexed && dry_run && missing > 0 {
        progress(Event::IndexShort {
            missing,
            cause: "a dry run changes nothing".into(),
        });
    } else if depth != indexed && !dry_run {
        match reindex_once_free(fleet, cancel).await {
            Ok(r) => progress(Event::Reindexed {
                indexed: r.indexed,
                derived: r.derived,
            }),
            Err(Error::Refused(cause)) if missing > 0 => {
                progress(Event::IndexShort { missing, cause });
            }
            // Stale entries only, and another replay runs: a planned letter
            // it took is waited for, then named (exit 3).
            Err(Error::Refused(_)) => {}
            Err(e) => return Err(e),
        }
    }
    index.entries(filters).await
}

/// [`super::reindex`], once no replay holds a lock: a replay that was
/// killed leaves its locks until their lease lapses (a stale index is what
/// it leaves too), while a live one renews them, and then the refusal stands.
async fn reindex_once_free(
    fleet: &Fleet,
    cancel: &CancellationToken,
) -> Result<super::ReindexReport, Error> {
    let deadline = tokio::time::Instant::now() + super::lock::LEASE + LOCK_POLL;
    loop {
        match super::reindex(fleet, cancel).await {
            Err(Error::Refused(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(LOCK_POLL).await;
            }
            other => return other,
        }
    }
}

/// How often a replay looks whether a killed replay's locks lapsed.
const LOCK_POLL: Duration = Duration::from_millis(500);

/// A replay under way: the publisher, audit spans, pace and what it did.
struct Replay<'a> {
    fleet: &'a Fleet,
    /// The DLQ's connection: each pass reads on a channel of its own.
    conn: &'a lapin::Connection,
    publisher: Publisher,
    /// Where a replayed letter's entry is removed, after its ack.
    index: Index<'a>,
    /// The orders this replay holds.
    locks: ReplayLocks<'a>,
    /// How long to wait for another replay's lock of an order.
    lock_wait: Duration,
    audit: Audit,
    pause: Option<Duration>,
    window: Window,
    cancel: &'a CancellationToken,
    /// The index ids of the letters read, for the report's count.
    seen: HashSet<String>,
    report: ReplayReport,
}

impl Replay<'_> {
    /// Replays `plan` in passes over the DLQ until it is done, cancelled,
    /// or no pass can reach the letter an order waits for.
    async fn run(
        &mut self,
        plan: &mut Plan,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Result<(), Error> {
        progress(Event::Replaying {
            letters: plan.len(),
        });
        let mut empty_ends = 0;
        while !plan.is_empty() {
            if self.cancel.is_cancelled() {
                self.report.cancelled = true;
                return Ok(());
            }
            let queue = &self.fleet.names.dead_letter_queue;
            let reader = Reader::open(self.conn, &self.fleet.names)
                .await
                .map_err(Error::amqp(format!("opening {queue}")))?;
            let mut pass = Pass::new(self.window);
            let next = self.pass(&reader, plan, &mut pass, progress).await;
            // Whatever the pass held goes back to the head, in its order.
            reader.release().await;
            if next? == Next::Stop {
                let reached = pass.held_count() >= self.window.reach;
                if !reached && empty_ends < END_RETRIES {
                    empty_ends += 1;
                    tokio::select! {
                        () = tokio::time::sleep(END_PAUSE) => {}
                        () = self.cancel.cancelled() => {}
                    }
                    continue;
                }
                if let Some((letter, waits_for)) = pass.blocked(plan) {
                    let blocked = Blocked {
                        letter,
                        waits_for,
                        reach: reached.then_some(self.window.reach),
                        left: plan.len(),
                    };
                    progress(Event::ReplayBlocked(Box::new(blocked.clone())));
                    self.report.blocked = Some(blocked);
                }
                return Ok(());
            }
        }
        Ok(())
    }

    /// One pass: reads letters from the DLQ's head, replays those the plan
    /// lets go, holds the others; says what comes next.
    async fn pass(
        &mut self,
        reader: &Reader,
        plan: &mut Plan,
        pass: &mut Pass,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Result<Next, Error> {
        loop {
            if self.cancel.is_cancelled() {
                return Ok(Next::Release);
            }
            let Some(letter) = reader.next().await? else {
                return Ok(pass.at_end());
            };
            let id = letter.index_id();
            if self.seen.insert(id.clone()) {
                self.report.read += 1;
            }
            match plan.verdict(&id) {
                Verdict::Ready if self.send(&letter, &id, plan, progress).await? => {
                    pass.replayed();
                }
                Verdict::Ready => pass.held(&id, Verdict::Unplanned),
                other => pass.held(&id, other),
            }
            match pass.next() {
                Next::Read => {}
                other => return Ok(other),
            }
        }
    }

    /// Replays a letter the plan lets go: `false` when it stays (its body is
    /// not an envelope, another replay holds its order, or the replay was
    /// cancelled while waiting for that one).
    async fn send(
        &mut self,
        l: &Letter,
        id: &str,
        plan: &mut Plan,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Result<bool, Error> {
        let started = tokio::time::Instant::now();
        let Some(envelope) = l.envelope.as_ref() else {
            // Its index entry named an order, but the body is no envelope.
            plan.done(id);
            self.report.skipped.push(l.info.clone());
            progress(Event::ReplaySkipped {
                letter: l.info.clone(),
            });
            return Ok(false);
        };
        let order = &envelope.order_id;
        if !self
            .locks
            .take_waiting(order, self.lock_wait, self.cancel)
            .await?
        {
            if !self.cancel.is_cancelled() {
                // Another replay still runs the order: interleaving would
                // reorder its events, so its letters stay for a later run.
                tracing::warn!(order_id = %order, wait = ?self.lock_wait, "another replay is replaying this order; its letters are left in the DLQ");
                plan.drop_order(order.as_str());
                self.report.locked_elsewhere.push(order.clone());
            }
            return Ok(false);
        }
        let shard = self.publisher.shard_of(order);
        let mut span = self.audit.start(l, shard);
        let done = replay_one(&mut self.publisher, &mut self.index, l, envelope, shard).await;
        span.end(done.as_ref().err());
        done?;
        self.index.remove(&[id.to_owned()]).await?;
        plan.done(id);
        self.report.replayed += 1;
        tracing::info!(
            dead_letter_id = l.info.id(),
            linked_trace_id = %span.linked_trace_id.map_or_else(|| "-".to_owned(), |t| t.to_string()),
            order_id = %order,
            seq = l.info.seq,
            shard = shard.get(),
            reason = %l.info.reason,
            traceparent = header_str(l.properties(), headers::TRACEPARENT),
            "dead letter replayed"
        );
        progress(Event::Replayed {
            letter: l.info.clone(),
            shard: shard.get(),
        });
        if let Some(pause) = self.pause {
            tokio::select! {
                () = tokio::time::sleep_until(started + pause) => {}
                () = self.cancel.cancelled() => {}
            }
        }
        Ok(true)
    }

    /// For each replayed order that is quarantined: waits until a worker has
    /// applied (or dead-lettered again) what was replayed, then replays the
    /// order's events quarantined meanwhile, until the quarantine is lifted
    /// or its blocker failed again.
    async fn follow(
        &mut self,
        quarantines: Quarantines<'_>,
        wait: Duration,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Result<(), Error> {
        let Quarantines {
            fleet,
            mut redis,
            mut rounds,
        } = quarantines;
        for _ in 0..MAX_ROUNDS {
            let mut next = Vec::new();
            for (order, ids) in std::mem::take(&mut rounds) {
                let key = fleet.keys.quarantine(&order_key_of(&order));
                let q = Quarantine {
                    fleet,
                    key: &key,
                    cancel: self.cancel,
                };
                if !q.exists(&mut redis).await? {
                    progress(Event::QuarantineLifted { order_id: order });
                    continue;
                }
                if !q.applied(&mut redis, &ids, wait).await? {
                    self.report.unresolved.push(order.clone());
                    progress(Event::NotApplied {
                        order_id: order,
                        wait,
                    });
                    continue;
                }
                match q.head(&mut redis).await? {
                    None => progress(Event::QuarantineLifted { order_id: order }),
                    Some(head) => next.push((order, head)),
                }
            }
            if next.is_empty() || self.cancel.is_cancelled() {
                self.report.cancelled |= self.cancel.is_cancelled();
                return Ok(());
            }
            let mut plan = self.next_round(next, &mut rounds, progress).await?;
            self.run(&mut plan, progress).await?;
        }
        if !rounds.is_empty() {
            let orders: Vec<String> = rounds.into_keys().collect();
            self.report.unresolved.extend(orders.iter().cloned());
            progress(Event::RoundsExhausted {
                rounds: MAX_ROUNDS,
                orders,
            });
        }
        Ok(())
    }

    /// The plan of a quarantine round: for each order still quarantined
    /// behind `head`, its letters in the index, if the head was quarantined
    /// while the replay ran (`decide`); the orders replayed go to `rounds`.
    async fn next_round(
        &mut self,
        next: Vec<(String, String)>,
        rounds: &mut BTreeMap<String, Vec<String>>,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Result<Plan, Error> {
        let wanted: Vec<&str> = next.iter().map(|(o, _)| o.as_str()).collect();
        let mut found = self.index.of_orders(&wanted).await?;
        let mut replaying = Vec::new();
        for (order, head) in next {
            let mut entries = found.remove(&order).unwrap_or_default();
            entries.sort_by_key(|e| (e.seq.unwrap_or(0), e.first_failed_ms));
            let letters: Vec<LetterRef> = entries.iter().map(LetterRef::from).collect();
            match decide(&head, &letters.iter().collect::<Vec<_>>()) {
                Decision::Replay { ids, letters } => {
                    progress(Event::Requarantined {
                        order_id: order.clone(),
                        letters,
                    });
                    rounds.insert(order, ids);
                    replaying.extend(entries);
                }
                Decision::Blocked(blocker) => {
                    self.report.unresolved.push(order.clone());
                    progress(Event::StillQuarantined {
                        order_id: order,
                        head,
                        blocker,
                    });
                }
            }
        }
        Ok(Plan::new(&replaying).0)
    }
}

/// What a round does with an order still quarantined behind dead letter
/// `head`, given the order's letters found in the DLQ.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    /// The head was quarantined while the replay ran (the rest of the order
    /// was applied): replay these letters.
    Replay { ids: Vec<String>, letters: usize },
    /// The head failed again (or is not in the DLQ): the cause needs fixing.
    Blocked(Option<LetterRef>),
}

fn decide(head: &str, letters: &[&LetterRef]) -> Decision {
    match letters.iter().find(|l| l.id.as_deref() == Some(head)) {
        Some(b) if b.reason == FailReason::Quarantined.as_str() => Decision::Replay {
            ids: letters.iter().filter_map(|l| l.id.clone()).collect(),
            letters: letters.len(),
        },
        blocker => Decision::Blocked(blocker.map(|l| (*l).clone())),
    }
}

/// The orders of a replay that are quarantined, with the ids of their
/// replayed letters, and the Redis connection to follow them.
struct Quarantines<'a> {
    fleet: &'a Fleet,
    redis: MultiplexedConnection,
    rounds: BTreeMap<String, Vec<String>>,
}

impl<'a> Quarantines<'a> {
    /// `None` when no order of `letters` is quarantined, or Redis cannot say
    /// (the replay goes on without following quarantines, and says so).
    async fn read(
        fleet: &'a Fleet,
        plan: &Plan,
        progress: &mut (dyn FnMut(Event) + Send),
    ) -> Option<Self> {
        let mut redis = match fleet.redis.connect().await {
            Ok(redis) => redis,
            Err(e) => {
                progress(Event::QuarantinesUnknown {
                    cause: e.to_string(),
                    connected: false,
                });
                return None;
            }
        };
        let rounds: BTreeMap<String, Vec<String>> = plan
            .ids_by_order()
            .map(|(order, ids)| (order.to_owned(), ids))
            .collect();
        // One round trip for every order of the replay.
        let mut pipe = redis::pipe();
        for order in rounds.keys() {
            pipe.cmd("EXISTS")
                .arg(fleet.keys.quarantine(&order_key_of(order)));
        }
        let exists: Vec<bool> = match pipe.query_async(&mut redis).await {
            Ok(exists) => exists,
            Err(e) => {
                progress(Event::QuarantinesUnknown {
                    cause: fleet.redis.scrub(&e.to_string()),
                    connected: true,
                });
                return None;
            }
        };
        let rounds: BTreeMap<String, Vec<String>> = rounds
            .into_iter()
            .zip(exists)
            .filter_map(|(order, quarantined)| quarantined.then_some(order))
            .collect();
        (!rounds.is_empty()).then_some(Self {
            fleet,
            redis,
            rounds,
        })
    }
}

/// One order's quarantine set in Redis.
struct Quarantine<'a> {
    fleet: &'a Fleet,
    key: &'a str,
    cancel: &'a CancellationToken,
}

impl Quarantine<'_> {
    async fn exists(&self, redis: &mut MultiplexedConnection) -> Result<bool, Error> {
        redis::cmd("EXISTS")
            .arg(self.key)
            .query_async(redis)
            .await
            .map_err(redis_error(self.fleet, "reading a quarantine"))
    }

    /// The blocker of the quarantine, `None` when lifted.
    async fn head(&self, redis: &mut MultiplexedConnection) -> Result<Option<String>, Error> {
        let head: Vec<String> = redis::cmd("ZRANGE")
            .arg(self.key)
            .arg(0)
            .arg(0)
            .query_async(redis)
            .await
            .map_err(redis_error(self.fleet, "reading a quarantine"))?;
        Ok(head.into_iter().next())
    }

    /// Waits until none of `ids` holds the quarantine any more (a worker
    /// applied them, or dead-lettered them again under new ids); `false`
    /// after `wait` or on cancellation. Polls: the worker's progress is only
    /// visible in Redis.
    async fn applied(
        &self,
        redis: &mut MultiplexedConnection,
        ids: &[String],
        wait: Duration,
    ) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let scores: Vec<Option<f64>> = redis::cmd("ZMSCORE")
                .arg(self.key)
                .arg(ids)
                .query_async(redis)
                .await
                .map_err(redis_error(self.fleet, "reading a quarantine"))?;
            if scores.iter().all(Option::is_none) {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline || self.cancel.is_cancelled() {
                return Ok(false);
            }
            tokio::select! {
                () = tokio::time::sleep(QUARANTINE_POLL) => {}
                () = self.cancel.cancelled() => {}
            }
        }
    }
}

/// Republishes one letter, waits for the broker's confirm, and only then
/// removes it from the DLQ.
/// Records the replay (`shardline_contract::replay`), republishes the
/// letter marked with the record's id, and removes it from the DLQ once
/// the broker confirmed the republish. A letter the broker dead-lettered
/// itself has no dead-letter id: its replay gets a fresh one, so that no two
/// replays share a record.
async fn replay_one(
    publisher: &mut Publisher,
    index: &mut Index<'_>,
    l: &Letter,
    envelope: &Envelope,
    shard: ShardId,
) -> Result<(), Error> {
    let id = l
        .info
        .id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    index
        .record_replay(&id, &replay::record(envelope, l.body()))
        .await?;
    publisher
        .publish_to_shard(shard, l.body().to_vec(), replay_properties(l, &id))
        .await
        .map_err(Error::publish(format!("republishing {}", l.info)))?;
    publisher.flush().await.map_err(Error::publish(format!(
        "confirming the republish of {}",
        l.info
    )))?;
    // Confirmed: only now may it leave the DLQ.
    Reader::remove(l).await.map_err(|e| match e {
        Error::Amqp { source, .. } => Error::Amqp {
            context: format!("removing {} from the DLQ", l.info),
            source,
        },
        other => other,
    })
}

/// The letter's properties, as the worker dead-lettered them (the `x-fail-*`
/// headers kept for audit; a new failure overwrites them), plus
/// `x-shardline-replay` = the id of its replay record, without the broker's
/// `x-delivery-count` (it would count against the new delivery).
fn replay_properties(letter: &Letter, id: &str) -> lapin::BasicProperties {
    let props = letter.properties().clone();
    let mut inner = props
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    inner.remove(headers::DELIVERY_COUNT);
    let mut h = FieldTable::from(inner);
    h.insert(
        headers::REPLAY.into(),
        AMQPValue::LongString(LongString::from(id.as_bytes().to_vec())),
    );
    props.with_headers(h)
}

/// The audit spans of a replay: one root span per replayed letter
/// (`{dlq} replay`), linked to the failed attempt's context (the letter's
/// `traceparent`/`tracestate`).
struct Audit {
    tracer: BoxedTracer,
    span_name: std::borrow::Cow<'static, str>,
    exchange: String,
}

/// One letter's replay span, and the trace id it links to.
struct AuditSpan {
    span: BoxedSpan,
    linked_trace_id: Option<TraceId>,
}

impl Audit {
    fn new(names: &Names) -> Self {
        Self {
            tracer: opentelemetry::global::tracer_with_scope(telemetry::scope()),
            span_name: telemetry::span::replay(&names.dead_letter_queue),
            exchange: names.exchange.clone(),
        }
    }

    /// Without a tracer provider the span is a no-op: no link, no attributes
    /// are built, only the linked trace id is read for the log line.
    fn start(&self, l: &Letter, shard: ShardId) -> AuditSpan {
        let failed = headers::remote_span_context(l.properties());
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
                KeyValue::new(attr::MESSAGING_ROUTING_KEY, Names::routing_key(shard)),
                KeyValue::new(attr::DEAD_LETTER_ID, l.info.id().to_owned()),
                KeyValue::new(attr::FAIL_REASON, l.info.reason.clone()),
                KeyValue::new(attr::SHARD, i64::from(shard.get())),
            ];
            if let Some(order) = &l.info.order_id {
                attributes.push(KeyValue::new(attr::ORDER_ID, order.clone()));
            }
            if let Some(seq) = l.info.seq.and_then(|s| i64::try_from(s).ok()) {
                attributes.push(KeyValue::new(attr::SEQ, seq));
            }
            if let Some(t) = linked_trace_id {
                attributes.push(KeyValue::new(attr::LINKED_TRACE_ID, t.to_string()));
            }
            span.set_attributes(attributes);
        }
        AuditSpan {
            span,
            linked_trace_id,
        }
    }
}

impl AuditSpan {
    /// Ends the span, failed with `error` when there is one.
    fn end(&mut self, error: Option<&Error>) {
        if let Some(e) = error
            && self.span.is_recording()
        {
            self.span.set_status(Status::error(crate::error::chain(e)));
        }
        self.span.end();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::letter::tests::letter;

    #[test]
    fn a_round_replays_what_was_quarantined_meanwhile_and_stops_at_a_new_failure() {
        let head = letter("q5", "quarantined", Some("A"), Some(5));
        let later = letter("q6", "quarantined", Some("A"), Some(6));
        assert_eq!(
            decide("q5", &[&head, &later]),
            Decision::Replay {
                ids: vec!["q5".into(), "q6".into()],
                letters: 2
            }
        );
        let failed = letter("h5", "handler", Some("A"), Some(5));
        assert_eq!(
            decide("h5", &[&failed, &later]),
            Decision::Blocked(Some(failed.clone()))
        );
        assert_eq!(
            decide("gone", &[&later]),
            Decision::Blocked(None),
            "a head not in the DLQ blocks"
        );
        assert_eq!(decide("q5", &[]), Decision::Blocked(None));
    }

    #[test]
    fn attention_when_an_order_stays_quarantined() {
        let report = ReplayReport {
            unresolved: vec!["A".into()],
            ..ReplayReport::default()
        };
        assert!(report.needs_attention());
        assert!(!ReplayReport::default().needs_attention());
    }

    #[test]
    fn a_replay_future_is_send() {
        fn is_send<T: Send>(_: &T) {}
        let fleet = Fleet::default();
        let config = ReplayConfig::default();
        let cancel = CancellationToken::new();
        let replay = replay(&fleet, &config, &cancel, |_| {});
        is_send(&replay);
    }
}
