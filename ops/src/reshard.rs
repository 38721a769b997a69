//! `topology reshard --to M --plan`: what a reshard of the recorded topology
//! to M shards would move (ARCHITECTURE.md, "Resharding: the protocol"): the
//! sticky plan of `contract::reshard`, read from the record, described for an
//! operator. Nothing is declared; like every reader of the record, it
//! adopts a topology made before records (at the broker's count) first.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde::Serialize;
use shardline_connect::declare::{self, TopologyOptions};
use shardline_connect::{publishers, record, reshard as stored};
use shardline_contract::reshard::{
    Barrier, Generation, Lease, MAX_TARGET_SHARDS, MarkerId, MarkerKind, MoveId, Phase, Plan,
    Reshard, ReshardState, barrier,
};
use shardline_contract::status::{BreakerState, Thresholds, WorkerReport};
use shardline_contract::topology::TopologyRecord;
use shardline_contract::{Names, ShardId, headers};
use shardline_publisher::ConfirmChannel;

use crate::error::Error;
use crate::fleet::Fleet;

/// One move of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoveLine {
    pub from: u16,
    pub to: u16,
    /// Buckets moving, and their share of all orders (buckets / B).
    pub buckets: usize,
    pub share: f64,
    /// The holding queue the move's new events wait in.
    pub holding_queue: String,
}

/// What a reshard to M shards would do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    pub generation: u64,
    pub from_shards: u16,
    pub to_shards: u16,
    pub buckets: u16,
    pub moves: Vec<MoveLine>,
    /// The share of orders whose shard changes.
    pub moved_share: f64,
    /// Buckets per shard after the reshard, indexed by shard.
    pub loads_after: Vec<usize>,
    /// Shard queues to declare (growing), or to retire (shrinking): kept
    /// consumed and forwarding while legacy publishers still use them.
    pub new_queues: Vec<String>,
    pub retired_queues: Vec<String>,
}

/// The plan of a reshard of `fleet`'s recorded topology to `to` shards.
pub async fn plan(fleet: &Fleet, to: u32) -> Result<PlanReport, Error> {
    if !(1..=MAX_TARGET_SHARDS).contains(&to) {
        return Err(Error::config(
            &["to"],
            format!("to must be 1 to {MAX_TARGET_SHARDS} shards, got {to}"),
        ));
    }
    let record = crate::topology::recorded(fleet, "topology reshard")
        .await?
        .ok_or_else(|| {
            Error::config(
                &[],
                "no topology to reshard: run `shardline topology apply` first",
            )
        })?;
    describe(&record, to, fleet)
}

fn describe(record: &TopologyRecord, to: u32, fleet: &Fleet) -> Result<PlanReport, Error> {
    if let Some(running) = &record.reshard {
        return Err(Error::config(
            &[],
            format!(
                "a reshard to {} shards is in progress (started by {}, phase {:?})",
                running.to, running.started_by, running.phase
            ),
        ));
    }
    let routing = record
        .routing()
        .map_err(|e| Error::config(&[], e.to_string()))?;
    let map = routing.map();
    let plan: Plan = map
        .plan(to)
        .map_err(|e| Error::config(&["to"], e.to_string()))?;
    let b = map.bucket_count().max(1);
    let share = |n: usize| n as f64 / b as f64;
    let g = record.generation;
    let moves: Vec<MoveLine> = plan
        .moves
        .iter()
        .map(|m| MoveLine {
            from: m.from.get(),
            to: m.to.get(),
            buckets: m.buckets.len(),
            share: share(m.buckets.len()),
            holding_queue: fleet.names.hold_queue(g, m.from, m.to),
        })
        .collect();
    let (from_n, to_n) = (map.shard_count().get(), plan.target.shard_count().get());
    let queues = |range: std::ops::Range<u16>| -> Vec<String> {
        range
            .map(|i| fleet.names.shard_queue_named(u32::from(i)))
            .collect()
    };
    Ok(PlanReport {
        generation: g,
        from_shards: from_n,
        to_shards: to_n,
        buckets: u16::try_from(b).unwrap_or(u16::MAX),
        moved_share: share(plan.moved()),
        moves,
        loads_after: plan.target.loads(),
        new_queues: queues(from_n..to_n.max(from_n)),
        retired_queues: queues(to_n..from_n.max(to_n)),
    })
}

impl PlanReport {
    /// As `topology reshard --plan` prints it.
    pub fn text(&self) -> String {
        let mut out = format!(
            "reshard {} → {} shards (generation {}, {} buckets): {:.1} % of orders move, in {} moves\n",
            self.from_shards,
            self.to_shards,
            self.generation,
            self.buckets,
            self.moved_share * 100.0,
            self.moves.len()
        );
        for m in &self.moves {
            let _ = writeln!(
                out,
                "  shard {:>4} → {:<4} {:>5} buckets ({:>5.1} % of orders) through {}",
                m.from,
                m.to,
                m.buckets,
                m.share * 100.0,
                m.holding_queue
            );
        }
        let (least, most) = (
            self.loads_after.iter().min().copied().unwrap_or(0),
            self.loads_after.iter().max().copied().unwrap_or(0),
        );
        let _ = writeln!(
            out,
            "after it: {least} to {most} buckets per shard; orders that do not move never pause"
        );
        if !self.new_queues.is_empty() {
            let _ = writeln!(out, "new shard queues: {}", span(&self.new_queues));
        }
        if !self.retired_queues.is_empty() {
            let _ = writeln!(
                out,
                "retired (forwarding) queues: {} (kept consumed while events still arrive on them)",
                span(&self.retired_queues)
            );
        }
        out
    }
}

/// `a … z (n queues)`, or the one queue.
fn span(queues: &[String]) -> String {
    match queues {
        [] => String::new(),
        [one] => one.clone(),
        [first, .., last] => format!("{first} … {last} ({} queues)", queues.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_contract::ShardCount;

    fn fleet() -> Fleet {
        Fleet::default()
    }

    #[test]
    fn a_plan_names_its_moves_queues_and_share() {
        let record = TopologyRecord::first(ShardCount::new(8).unwrap(), "t", 0);
        let grow = describe(&record, 12, &fleet()).unwrap();
        assert_eq!((grow.from_shards, grow.to_shards), (8, 12));
        assert_eq!(grow.new_queues.len(), 4);
        assert!(grow.retired_queues.is_empty());
        let moved: usize = grow.moves.iter().map(|m| m.buckets).sum();
        assert!((grow.moved_share - moved as f64 / f64::from(grow.buckets)).abs() < 1e-9);
        // Growing 8 → 12 moves a third of the orders, no more.
        assert!(
            (grow.moved_share - 1.0 / 3.0).abs() < 0.01,
            "{}",
            grow.moved_share
        );
        let text = grow.text();
        assert!(
            text.starts_with("reshard 8 → 12 shards (generation 1"),
            "{text}"
        );
        assert!(text.contains("order.events.move.1."), "{text}");

        let shrink = describe(&record, 6, &fleet()).unwrap();
        assert_eq!(shrink.retired_queues.len(), 2);
        assert!(
            shrink.text().contains(
                "retired (forwarding) queues: order.events.shard.6 … order.events.shard.7"
            ),
            "{}",
            shrink.text()
        );
        assert!(describe(&record, 8, &fleet()).is_err(), "the same count");
    }
}

/// How long the reshard's lock lives without renewal: a command killed
/// frees it after this (one on the same host frees it at once).
const LOCK_TTL: Duration = Duration::from_secs(15);
/// How often the reshard's steps poll Redis and the broker.
const POLL: Duration = Duration::from_millis(200);
/// A marker not honoured within this is sent again, with a new id (the old
/// id stays valid: both are behind the barrier).
const MARKER_RESEND: Duration = Duration::from_secs(60);
/// A holding queue at most this deep is read to its end quickly: the
/// moves' buckets switch to their new shard (generation g + 2).
const HOLD_DEPTH_TO_CLOSE: u32 = 200;

/// Takes the lock when free, or held by a process of this host that is gone
/// (a command killed; run again, it resumes at once). KEYS: the lock. ARGV:
/// holder, TTL ms, this host's prefix, whether the holder found is dead.
const TAKE_LOCK: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] and ARGV[3] ~= '1' then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
";

/// Renews the lock only while this holder has it. KEYS: the lock. ARGV:
/// holder, TTL ms.
const RENEW_LOCK: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// What `topology reshard --to M` did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    pub from_shards: u16,
    pub to_shards: u16,
    /// The generation the fleet is on now.
    pub generation: u64,
    pub moves: usize,
    /// Whether it resumed a reshard an earlier run had started.
    pub resumed: bool,
    pub took_ms: u64,
}

impl RunReport {
    pub fn text(&self) -> String {
        format!(
            "resharded {} → {} shards in {:.1} s ({} moves{}); the fleet is on generation {}\n",
            self.from_shards,
            self.to_shards,
            self.took_ms as f64 / 1000.0,
            self.moves,
            if self.resumed { ", resumed" } else { "" },
            self.generation
        )
    }
}

/// This process, as the lock and the record name it: `topology reshard on
/// {host} pid {pid}`.
fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    format!("topology reshard on {host} pid {}", std::process::id())
}

/// Whether `holder` names a process of this host that is gone.
fn holder_is_gone(holder: &str, mine: &str) -> bool {
    let host_of = |h: &str| h.rsplit_once(" pid ").map(|(host, _)| host.to_owned());
    let pid = holder
        .rsplit_once(" pid ")
        .and_then(|(_, pid)| pid.parse::<u32>().ok());
    host_of(holder) == host_of(mine)
        && pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Runs the reshard of the recorded topology to `to` shards online (the
/// steps of ARCHITECTURE.md, "Resharding: the protocol"), or resumes the one
/// an earlier run left; `say` gets a line at each step and for progress.
/// Returns when the fleet is on `to` shards. `options` are the topology's
/// (`topology apply`'s flags): new shard and holding queues are declared
/// with them, and a shard queue that disagrees refuses the run.
pub async fn run(
    fleet: &Fleet,
    to: u32,
    options: &TopologyOptions,
    say: &mut (dyn FnMut(String) + Send),
) -> Result<RunReport, Error> {
    let started = std::time::Instant::now();
    let lock = Lock::take(fleet, say).await?;
    let report = async {
        let run = Steps::new(fleet, options, lock.redis.clone(), &lock.me, to).await?;
        run.drive(say).await
    }
    .await;
    lock.release().await;
    let mut report = report?;
    report.took_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

/// What `topology reshard --abort` did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AbortReport {
    pub shards: u16,
    /// The reshard's target it gave up.
    pub abandoned_target: u16,
    pub generation: u64,
}

impl AbortReport {
    pub fn text(&self) -> String {
        format!(
            "the reshard to {} shards was abandoned; the fleet stays on {} shards (generation {})\n",
            self.abandoned_target, self.shards, self.generation
        )
    }
}

/// Gives up the reshard in progress while it can go back: before its
/// second barrier (phase `Closing`, when publishers start routing moved
/// orders to their new shards). At its first step (phase `Planned`) its
/// holding queues are deleted at once (nothing routed there); from the
/// first barrier on it runs its steps on with each move's events handed
/// back to its old shard (the holding queues drain into them). A grown
/// reshard's new shard queues stay, empty, recorded as retired. From phase
/// `Closing` on it refuses: run the reshard to its end, then back.
pub async fn abort(
    fleet: &Fleet,
    options: &TopologyOptions,
    say: &mut (dyn FnMut(String) + Send),
) -> Result<AbortReport, Error> {
    let lock = Lock::take(fleet, say).await?;
    let aborted = abort_locked(fleet, options, lock.redis.clone(), say).await;
    lock.release().await;
    aborted
}

async fn abort_locked(
    fleet: &Fleet,
    options: &TopologyOptions,
    mut redis: redis::aio::MultiplexedConnection,
    say: &mut (dyn FnMut(String) + Send),
) -> Result<AbortReport, Error> {
    let mut record = crate::topology::recorded(fleet, "topology reshard")
        .await?
        .ok_or_else(|| Error::config(&[], "no topology: nothing to abort"))?;
    let Some(state) = record.reshard.clone() else {
        return Err(Error::Refused(
            "no reshard is in progress: nothing to abort".into(),
        ));
    };
    let report = |record: &TopologyRecord| AbortReport {
        shards: record.shards,
        abandoned_target: state.to,
        generation: record.generation,
    };
    match state.phase {
        Phase::Planned => {
            let reshard = planned(&record)?;
            let conn = fleet.connect("shardline topology reshard").await?;
            let g = reshard.from().0;
            for m in &reshard.plan().moves {
                let queue = fleet.names.hold_queue(g, m.from, m.to);
                let key = Names::hold_routing_key(g, m.from, m.to);
                declare::retire_hold_queue(&conn, &fleet.names, &queue, &key)
                    .await
                    .map_err(Error::queue(format!("deleting {queue}")))?;
            }
            crate::fleet::close(&conn).await;
            let mut retired: BTreeSet<u16> = record.retired.iter().copied().collect();
            retired.extend(record.shards..state.to);
            record.retired = retired.into_iter().collect();
            record.reshard = None;
            record.recorded_by = holder();
            write_record(&mut redis, fleet, &mut record).await?;
            say(format!(
                "holding queues deleted; the record is back on {} shards",
                record.shards
            ));
            Ok(report(&record))
        }
        Phase::Holding | Phase::Draining | Phase::Opening => {
            // The steps run on, handing each move's events back to its old
            // shard: generation g + 2 routes by the old map.
            if let Some(running) = record.reshard.as_mut() {
                running.aborted = true;
            }
            write_record(&mut redis, fleet, &mut record).await?;
            say(format!(
                "the reshard to {} shards is given up at phase {:?}: its moves go back to their old shards",
                state.to, state.phase
            ));
            let steps = Steps {
                fleet,
                options,
                redis,
                record,
                resumed: true,
            };
            let done = steps.drive(say).await?;
            Ok(AbortReport {
                shards: done.to_shards,
                abandoned_target: state.to,
                generation: done.generation,
            })
        }
        Phase::Closing | Phase::Done => Err(Error::Refused(format!(
            "the reshard to {} shards is at phase {:?}: publishers route by its new map already, so it \
             can no longer go back; run `topology reshard --to {}` to finish it, then `--to {}` to return",
            state.to, state.phase, state.to, record.shards
        ))),
    }
}

/// The reshard's lock, held (and renewed) until released.
struct Lock {
    redis: redis::aio::MultiplexedConnection,
    key: String,
    me: String,
    stop: tokio_util::sync::CancellationToken,
}

impl Lock {
    /// Takes the lock, or the lock of a run that died on this host; refuses
    /// naming the holder otherwise.
    async fn take(fleet: &Fleet, say: &mut (dyn FnMut(String) + Send)) -> Result<Self, Error> {
        let redis = fleet.redis.connect().await?;
        let me = holder();
        let key = format!("{}reshard:lock", fleet.keys.prefix());
        let take = |over_a_gone_holder: bool| {
            let mut redis = redis.clone();
            let (key, me) = (key.clone(), me.clone());
            async move {
                redis::Script::new(TAKE_LOCK)
                    .key(key)
                    .arg(me)
                    .arg(LOCK_TTL.as_millis() as u64)
                    .arg("")
                    .arg(if over_a_gone_holder { "1" } else { "0" })
                    .invoke_async::<String>(&mut redis)
                    .await
                    .map_err(crate::fleet::redis_error(
                        fleet,
                        "taking the reshard's lock",
                    ))
            }
        };
        let held = take(false).await?;
        if !held.is_empty() {
            if !holder_is_gone(&held, &me) {
                return Err(Error::Refused(format!(
                    "another reshard holds the lock: {held}; it ends, or its lock lapses {} s after it stopped",
                    LOCK_TTL.as_secs()
                )));
            }
            take(true).await?;
            say(format!(
                "took over the lock of a reshard that stopped ({held})"
            ));
        }
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(renew_lock(
            redis.clone(),
            key.clone(),
            me.clone(),
            stop.clone(),
        ));
        Ok(Self {
            redis,
            key,
            me,
            stop,
        })
    }

    async fn release(mut self) {
        self.stop.cancel();
        let _: Result<i64, _> = redis::cmd("DEL")
            .arg(&self.key)
            .query_async(&mut self.redis)
            .await;
    }
}

async fn renew_lock(
    mut redis: redis::aio::MultiplexedConnection,
    key: String,
    me: String,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(LOCK_TTL / 3) => {}
            () = stop.cancelled() => return,
        }
        let renewed: Result<i64, _> = redis::Script::new(RENEW_LOCK)
            .key(&key)
            .arg(&me)
            .arg(LOCK_TTL.as_millis() as u64)
            .invoke_async(&mut redis)
            .await;
        if let Err(e) = renewed {
            tracing::warn!(error = %e, "cannot renew the reshard's lock");
        }
    }
}

/// Step 0: the fleet can follow a reshard to `to` shards now. Every worker
/// that reports (a fresh status document) knows markers; none is paused
/// (its downstream breaker open or half-open); the target's shards will be
/// consumed (a worker that takes new shards, or fixed assignments that
/// cover them); no shard's backlog is at WARN (a moved key pauses for about
/// its old shard's backlog age). One line says what is not so.
async fn ready_to_start(
    fleet: &Fleet,
    redis: &mut redis::aio::MultiplexedConnection,
    record: &TopologyRecord,
    to: u32,
) -> Result<(), Error> {
    let read = "reading the workers' status documents";
    let workers = crate::topology::worker_reports(redis, &fleet.keys)
        .await
        .map_err(crate::fleet::redis_error(fleet, read))?;
    let names = |filter: &dyn Fn(&WorkerReport) -> bool| -> Vec<&str> {
        workers
            .iter()
            .filter(|w| filter(w))
            .map(|w| w.worker.as_str())
            .collect()
    };
    let refuse = |why: String| Err(Error::Refused(format!("topology reshard refused: {why}")));
    if workers.is_empty() {
        return refuse(
            "no worker reports its status: the fleet's workers must run to follow a reshard".into(),
        );
    }
    let older = names(&|w| !w.knows_markers);
    if !older.is_empty() {
        return refuse(format!(
            "workers of a version before resharding run ({}): they would dead-letter its markers; upgrade them first",
            older.join(", ")
        ));
    }
    let paused = names(&|w| w.breaker.state != BreakerState::Closed);
    if !paused.is_empty() {
        return refuse(format!(
            "workers are paused by their downstream breaker ({}): a move would wait on them",
            paused.join(", ")
        ));
    }
    if !workers.iter().any(|w| w.takes_new_shards) {
        let covered: BTreeSet<u32> = workers
            .iter()
            .flat_map(|w| w.assigned.iter().map(|&s| u32::from(s)))
            .collect();
        let missing: Vec<String> = (0..to)
            .filter(|s| !covered.contains(s))
            .map(|s| s.to_string())
            .collect();
        if !missing.is_empty() {
            return refuse(format!(
                "no worker would consume shards {} of the target (fixed --assign only): run a worker with --assign auto or all, or assign them",
                missing.join(", ")
            ));
        }
    }
    let shards: Vec<ShardId> = record
        .shard_count()
        .map_err(|e| Error::config(&[], e.to_string()))?
        .ids()
        .collect();
    let reports = crate::topology::shard_reports(redis, &fleet.keys, &shards)
        .await
        .map_err(crate::fleet::redis_error(fleet, read))?;
    let now = shardline_contract::status::unix_ms();
    let warn = Thresholds::default().warn;
    if let Some((shard, age)) = reports
        .iter()
        .flatten()
        .filter(|r| r.owner().is_some())
        .map(|r| (r.shard, r.backlog_age_at(now)))
        .max_by_key(|(_, age)| *age)
        .filter(|(_, age)| *age >= warn)
    {
        return refuse(format!(
            "shard {shard}'s backlog is {:.0} s old, at WARN ({} s): a moved order would pause about that long; start when backlogs are below it",
            age.as_secs_f64(),
            warn.as_secs()
        ));
    }
    Ok(())
}

/// Writes `record` over the one that stands, stamped now (the command holds
/// the lock: it is the record's one writer while a reshard runs).
async fn write_record(
    redis: &mut redis::aio::MultiplexedConnection,
    fleet: &Fleet,
    record: &mut TopologyRecord,
) -> Result<(), Error> {
    record.recorded_at_ms = shardline_contract::status::unix_ms();
    record::replace(redis, &fleet.keys, record)
        .await
        .map_err(crate::fleet::record_error(fleet))
}

/// The reshard a record holds.
fn planned(record: &TopologyRecord) -> Result<Reshard, Error> {
    let routing = record
        .routing()
        .map_err(|e| Error::config(&[], e.to_string()))?;
    routing
        .reshard()
        .map(|(r, _)| r.clone())
        .ok_or_else(|| Error::config(&[], "the record holds no reshard"))
}

/// Step 2: the target's shard queues (`topology apply`'s declarations at
/// the larger count) and one holding queue per move, bound. Idempotent.
async fn declare_queues(
    fleet: &Fleet,
    options: &TopologyOptions,
    conn: &lapin::Connection,
    reshard: &Reshard,
) -> Result<(), Error> {
    let larger = reshard
        .old()
        .shard_count()
        .get()
        .max(reshard.plan().target.shard_count().get());
    let options = TopologyOptions {
        shards: shardline_contract::ShardCount::new(u32::from(larger))
            .map_err(|e| Error::config(&["to"], e.to_string()))?,
        ..options.clone()
    };
    declare::apply(std::slice::from_ref(conn), &fleet.names, &options)
        .await
        .map_err(Error::queue("declaring the reshard's shard queues"))?;
    let g = reshard.from().0;
    for m in &reshard.plan().moves {
        declare::hold_queue(
            conn,
            &fleet.names,
            &options,
            &fleet.names.hold_queue(g, m.from, m.to),
            &Names::hold_routing_key(g, m.from, m.to),
        )
        .await
        .map_err(Error::queue("declaring a holding queue"))?;
    }
    Ok(())
}

/// One reshard's steps, from the record as it stands.
struct Steps<'a> {
    fleet: &'a Fleet,
    options: &'a TopologyOptions,
    redis: redis::aio::MultiplexedConnection,
    record: TopologyRecord,
    resumed: bool,
}

impl<'a> Steps<'a> {
    async fn new(
        fleet: &'a Fleet,
        options: &'a TopologyOptions,
        mut redis: redis::aio::MultiplexedConnection,
        me: &str,
        to: u32,
    ) -> Result<Self, Error> {
        let mut record = crate::topology::recorded(fleet, "topology reshard")
            .await?
            .ok_or_else(|| {
                Error::config(
                    &[],
                    "no topology to reshard: run `shardline topology apply` first",
                )
            })?;
        let resumed = match &record.reshard {
            Some(running) if u32::from(running.to) != to => {
                return Err(Error::Refused(format!(
                    "a reshard to {} shards is in progress (started by {}, phase {:?}): run `topology reshard --to {}` to resume it",
                    running.to, running.started_by, running.phase, running.to
                )));
            }
            Some(_) => true,
            None => {
                // Checks the target and the fleet before anything is written.
                describe(&record, to, fleet)?;
                ready_to_start(fleet, &mut redis, &record, to).await?;
                if u32::from(record.shards) == to {
                    return Err(Error::config(
                        &["to"],
                        format!("the topology has {to} shards already"),
                    ));
                }
                let _: () = redis::cmd("DEL")
                    .arg(fleet.keys.reshard_markers())
                    .arg(fleet.keys.reshard_drained())
                    .arg(fleet.keys.reshard_closed())
                    .query_async(&mut redis)
                    .await
                    .map_err(crate::fleet::redis_error(
                        fleet,
                        "clearing an earlier reshard's markers",
                    ))?;
                let to = u16::try_from(to).unwrap_or(u16::MAX);
                record.reshard = Some(ReshardState::planned(
                    record.generation,
                    to,
                    me,
                    shardline_contract::status::unix_ms(),
                ));
                // Declared before the record names them: a worker that
                // follows the record consumes them at once.
                let reshard = planned(&record)?;
                let conn = fleet.connect("shardline topology reshard").await?;
                let declared = declare_queues(fleet, options, &conn, &reshard).await;
                crate::fleet::close(&conn).await;
                declared?;
                write_record(&mut redis, fleet, &mut record).await?;
                false
            }
        };
        Ok(Self {
            fleet,
            options,
            redis,
            record,
            resumed,
        })
    }

    fn reshard(&self) -> Result<(Reshard, Phase), Error> {
        let phase = self.record.reshard.as_ref().map(|r| r.phase);
        Ok((planned(&self.record)?, phase.unwrap_or(Phase::Planned)))
    }

    /// Writes the next phase (and its generation) into the record.
    async fn enter(
        &mut self,
        phase: Phase,
        say: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), Error> {
        let Some(state) = self.record.reshard.as_mut() else {
            return Ok(());
        };
        state.phase = phase;
        self.record.generation = phase.generation(Generation(state.from)).0;
        write_record(&mut self.redis, self.fleet, &mut self.record).await?;
        say(format!(
            "phase {phase:?}: generation {} recorded",
            self.record.generation
        ));
        Ok(())
    }

    async fn drive(mut self, say: &mut (dyn FnMut(String) + Send)) -> Result<RunReport, Error> {
        let (reshard, mut phase) = self.reshard()?;
        let from_shards = reshard.old().shard_count().get();
        let to_shards = reshard.target().shard_count().get();
        let g = reshard.from();
        say(format!(
            "reshard {from_shards} → {to_shards} shards from generation {}: {} moves{}",
            g.0,
            reshard.plan().moves.len(),
            if self.resumed { ", resuming" } else { "" }
        ));
        let conn = self.fleet.connect("shardline topology reshard").await?;
        let result = async {
            loop {
                match phase {
                    Phase::Planned => {
                        declare_queues(self.fleet, self.options, &conn, &reshard).await?;
                        say("new shard queues and holding queues declared".into());
                    }
                    Phase::Holding => self.barrier(g.next(), say).await?,
                    Phase::Draining => {
                        self.markers(&conn, &reshard, MarkerKind::Drain, say)
                            .await?;
                    }
                    Phase::Opening => self.holds_read(&conn, &reshard, say).await?,
                    Phase::Closing => {
                        self.barrier(g.next().next(), say).await?;
                        self.markers(&conn, &reshard, MarkerKind::Close, say)
                            .await?;
                    }
                    Phase::Done => {
                        self.finish(&conn, &reshard, say).await?;
                        return Ok::<(), Error>(());
                    }
                }
                phase = match phase.next() {
                    Some(next) => next,
                    None => return Ok(()),
                };
                if phase != Phase::Done {
                    self.enter(phase, say).await?;
                }
            }
        }
        .await;
        crate::fleet::close(&conn).await;
        result?;
        Ok(RunReport {
            from_shards,
            to_shards,
            generation: self.record.generation,
            moves: reshard.plan().moves.len(),
            resumed: self.resumed,
            took_ms: 0,
        })
    }

    /// Waits until every registered publisher with a live lease has
    /// acknowledged `target` (or let its lease lapse).
    async fn barrier(
        &mut self,
        target: Generation,
        say: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), Error> {
        let mut last = usize::MAX;
        loop {
            let now = shardline_contract::status::unix_ms();
            let registered = publishers::all(&mut self.redis, &self.fleet.keys)
                .await
                .map_err(crate::fleet::record_error(self.fleet))?;
            let leases: Vec<Lease> = registered.iter().map(|p| p.lease).collect();
            match barrier(&leases, target, now) {
                Barrier::Open => {
                    say(format!(
                        "barrier of generation {}: every registered publisher acknowledged it",
                        target.0
                    ));
                    return Ok(());
                }
                Barrier::Waiting(n) => {
                    if n != last {
                        let names: Vec<&str> = registered
                            .iter()
                            .filter(|p| p.lease.deadline_ms > now && p.lease.acknowledged < target)
                            .map(|p| p.name.as_str())
                            .collect();
                        say(format!(
                            "barrier of generation {}: waiting for {n} publishers ({})",
                            target.0,
                            names.join(", ")
                        ));
                        last = n;
                    }
                }
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Steps 4 and 6: one marker per move not yet released, into its old
    /// shard (drain) or its holding queue (close), each recorded pending
    /// before it is sent; returns when every move is released.
    async fn markers(
        &mut self,
        conn: &lapin::Connection,
        reshard: &Reshard,
        kind: MarkerKind,
        say: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), Error> {
        let channel = ConfirmChannel::open(conn).await?;
        let g = reshard.from().0;
        let moves = reshard.plan().moves.len();
        let mut sent_at: Vec<Option<std::time::Instant>> = vec![None; moves];
        loop {
            let (drained, closed) = stored::released(&mut self.redis, &self.fleet.keys)
                .await
                .map_err(crate::fleet::record_error(self.fleet))?;
            let released = match kind {
                MarkerKind::Drain => drained,
                MarkerKind::Close => closed,
            };
            if released.len() >= moves {
                say(format!("{kind:?} markers: all {moves} moves released"));
                return Ok(());
            }
            for (i, m) in reshard.plan().moves.iter().enumerate() {
                let id = MoveId(u16::try_from(i).unwrap_or(u16::MAX));
                if released.contains(&id)
                    || sent_at[i].is_some_and(|at| at.elapsed() < MARKER_RESEND)
                {
                    continue;
                }
                let marker = MarkerId(rand::random::<u64>() >> 1);
                stored::record_marker(&mut self.redis, &self.fleet.keys, marker, id, kind)
                    .await
                    .map_err(crate::fleet::record_error(self.fleet))?;
                let (routing_key, control) = match kind {
                    MarkerKind::Drain => (Names::routing_key(m.from), headers::CONTROL_DRAIN),
                    MarkerKind::Close => (
                        Names::hold_routing_key(g, m.from, m.to),
                        headers::CONTROL_CLOSE,
                    ),
                };
                let mut table = FieldTable::default();
                table.insert(
                    headers::CONTROL.into(),
                    AMQPValue::LongString(control.into()),
                );
                table.insert(
                    headers::MARKER_ID.into(),
                    AMQPValue::LongLongInt(i64::try_from(marker.0).unwrap_or(i64::MAX)),
                );
                table.insert(
                    headers::MARKER_MOVE.into(),
                    AMQPValue::LongLongInt(i64::from(id.0)),
                );
                let properties = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(table);
                channel
                    .publish(&self.fleet.names.exchange, &routing_key, b"", properties)
                    .await
                    .map_err(|e| {
                        Error::Refused(format!("sending a {kind:?} marker to {routing_key}: {e}"))
                    })?;
                sent_at[i] = Some(std::time::Instant::now());
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Step 5's end: every holding queue read down to
    /// [`HOLD_DEPTH_TO_CLOSE`] by its new owner.
    async fn holds_read(
        &mut self,
        conn: &lapin::Connection,
        reshard: &Reshard,
        say: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), Error> {
        let g = reshard.from().0;
        for m in &reshard.plan().moves {
            let queue = self.fleet.names.hold_queue(g, m.from, m.to);
            loop {
                let depth = declare::queue_status(conn, &queue)
                    .await
                    .map_err(Error::queue(format!("reading {queue}")))?;
                if depth.messages <= HOLD_DEPTH_TO_CLOSE && depth.consumers > 0 {
                    break;
                }
                tokio::time::sleep(POLL).await;
            }
        }
        say("holding queues consumed by their new owners".into());
        Ok(())
    }

    /// Step 7: holding queues unbound and deleted once empty, then the new
    /// map recorded (generation g + 2) and the reshard's record cleared.
    async fn finish(
        &mut self,
        conn: &lapin::Connection,
        reshard: &Reshard,
        say: &mut (dyn FnMut(String) + Send),
    ) -> Result<(), Error> {
        let g = reshard.from().0;
        for m in &reshard.plan().moves {
            let queue = self.fleet.names.hold_queue(g, m.from, m.to);
            let key = Names::hold_routing_key(g, m.from, m.to);
            loop {
                match declare::retire_hold_queue(conn, &self.fleet.names, &queue, &key).await {
                    Ok(true) => break,
                    Ok(false) => tokio::time::sleep(POLL).await,
                    Err(e) => return Err(Error::queue(format!("retiring {queue}"))(e)),
                }
            }
        }
        say("holding queues deleted".into());
        let target = reshard.target();
        let old = reshard.old().shard_count().get();
        let new = target.shard_count().get();
        let declared = old.max(reshard.plan().target.shard_count().get());
        let mut retired: BTreeSet<u16> = self.record.retired.iter().copied().collect();
        retired.extend(new..declared);
        retired.retain(|&s| s >= new);
        self.record.retired = retired.into_iter().collect();
        self.record.shards = new;
        self.record.map = Some(target.shard_numbers());
        self.record.generation = Phase::Done.generation(reshard.from()).0;
        self.record.reshard = None;
        self.record.recorded_by = holder();
        write_record(&mut self.redis, self.fleet, &mut self.record).await?;
        say(format!(
            "done: {new} shards, generation {}",
            self.record.generation
        ));
        Ok(())
    }
}
