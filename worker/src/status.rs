//! The status documents in Redis (docs/semantics.md §5): every [`WRITE_EVERY`], with a
//! [`TTL`], each worker writes a [`ShardReport`] per shard it consumes and one
//! [`WorkerReport`] of itself, so that `topology status` can tell owners,
//! backlog age and in-flight events without the broker's management plugin and
//! without depending on the worker. Documents and keys are `shardline-contract`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::Pipeline;
use redis::aio::ConnectionLike;
use shardline_connect::RedisPool;
use shardline_contract::Keys;
use shardline_contract::fleet::StaticRecord;
pub(crate) use shardline_contract::status::WRITE_EVERY;
use shardline_contract::status::{
    BreakerState, FleetBreaker, STOPPED_TTL, ShardReport as Document, TTL, WorkerReport,
};
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::live::{ShardState, unix_ms};
use crate::metrics::Metrics;

/// The shard documents of the consuming shards, and the worker's own, now.
fn reports(
    metrics: &Metrics,
    owner: &str,
    breaker: Option<&Breaker>,
    takes_new_shards: bool,
) -> (Vec<Document>, WorkerReport) {
    let now = unix_ms();
    let mut assigned = Vec::new();
    let mut consuming = Vec::new();
    let mut shards = Vec::new();
    for watch in metrics.watches() {
        let shard = watch.shard.get();
        if watch.is_assigned() {
            assigned.push(shard);
        }
        if watch.state() != ShardState::Consuming {
            continue;
        }
        consuming.push(shard);
        let snap = watch.snapshot(now);
        shards.push(Document {
            forwarded_per_second: 0.0,
            shard,
            owner: owner.to_owned(),
            backlog_age_seconds: round_ms(snap.backlog_age),
            backlog_age_source: snap.backlog_source,
            inflight_age_seconds: snap.inflight_age.map(round_ms),
            inflight_events: snap.inflight,
            waiting_events: snap.waiting,
            held_events: snap.held,
            held: if snap.held > 0 {
                watch.held_refs()
            } else {
                Vec::new()
            },
            updated_at_ms: now,
            stopped_at_ms: None,
        });
    }
    let worker = WorkerReport {
        worker: owner.to_owned(),
        assigned,
        consuming,
        updated_at_ms: now,
        breaker: breaker.map(Breaker::report).unwrap_or_default(),
        knows_markers: true,
        takes_new_shards,
    };
    (shards, worker)
}

/// Each shard's forwarded events at the last write, for their rate.
#[derive(Default)]
struct Forwards {
    last: std::collections::HashMap<u16, (u64, std::time::Instant)>,
}

impl Forwards {
    /// Sets each document's forwarded events a second since the last write.
    fn rates(&mut self, metrics: &Metrics, docs: &mut [Document]) {
        let now = std::time::Instant::now();
        let totals: std::collections::HashMap<u16, u64> = metrics
            .watches()
            .iter()
            .map(|w| (w.shard.get(), w.forwarded()))
            .collect();
        for doc in docs.iter_mut() {
            let total = totals.get(&doc.shard).copied().unwrap_or(0);
            if let Some((before, at)) = self.last.get(&doc.shard) {
                let secs = now.duration_since(*at).as_secs_f64();
                if secs > 0.0 {
                    let rate = total.saturating_sub(*before) as f64 / secs;
                    doc.forwarded_per_second = (rate * 100.0).round() / 100.0;
                }
            }
        }
        self.last = totals.into_iter().map(|(s, t)| (s, (t, now))).collect();
    }
}

fn round_ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// Whether the last status write reached Redis (part of `/readyz`).
#[derive(Debug, Default)]
pub(crate) struct WriterHealth {
    failing: AtomicBool,
}

impl WriterHealth {
    pub(crate) fn redis_ok(&self) -> bool {
        !self.failing.load(Ordering::Relaxed)
    }

    fn set(&self, ok: bool) {
        self.failing.store(!ok, Ordering::Relaxed);
    }
}

/// The status writer: what it writes and where.
pub(crate) struct Writer {
    pub(crate) pool: RedisPool,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) keys: Keys,
    pub(crate) owner: String,
    pub(crate) breaker: Option<Arc<Breaker>>,
    /// A fixed `--assign` (not a member of an elastic fleet).
    pub(crate) fixed: bool,
    /// It consumes the shard queues a reshard adds.
    pub(crate) takes_new_shards: bool,
    pub(crate) health: Arc<WriterHealth>,
}

impl Writer {
    /// Writes the status documents every [`WRITE_EVERY`] until `stopping`
    /// (the worker's stop signal), then waits for `stopped` (its drain is
    /// over) and marks the shards it consumed when the signal came as stopped
    /// ([`write_stopped`]), so that `topology status` and the console show
    /// them without an owner at once, not for the rest of the [`TTL`]. A
    /// failed write is logged once per outage and retried next time.
    pub(crate) async fn run(self, stopping: CancellationToken, stopped: CancellationToken) {
        let mut tick = tokio::time::interval(WRITE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The shards of the last write: those whose documents name this worker.
        let mut written_shards = Vec::new();
        let mut forwards = Forwards::default();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopping.cancelled() => break,
            }
            let (mut shards, worker) = reports(
                &self.metrics,
                &self.owner,
                self.breaker.as_deref(),
                self.takes_new_shards,
            );
            forwards.rates(&self.metrics, &mut shards);
            let written = write(&self.pool, &self.keys, &shards, &worker, self.fixed);
            let result = tokio::time::timeout(WRITE_EVERY, written).await;
            self.health(result.unwrap_or_else(|_| Err("timed out".into())));
            written_shards = shards;
        }
        // Those and the shards consumed when the stop began (the shards' tasks
        // see the signal too, and may have let go already).
        let (mut consumed, _) = reports(&self.metrics, &self.owner, None, self.takes_new_shards);
        for earlier in written_shards {
            if !consumed.iter().any(|now| now.shard == earlier.shard) {
                consumed.push(earlier);
            }
        }
        stopped.cancelled().await;
        let written = write_stopped(&self.pool, &self.keys, consumed, &self.owner);
        if let Ok(Err(e)) | Err(e) = tokio::time::timeout(WRITE_EVERY, written)
            .await
            .map_err(|_| "timed out".to_owned())
        {
            tracing::debug!(error = %e, "cannot mark the shards stopped in Redis; their status expires");
        }
    }

    fn health(&self, result: Result<(), String>) {
        match result {
            Ok(()) => self.health.set(true),
            Err(e) => {
                if self.health.redis_ok() {
                    tracing::warn!(error = %e, "cannot write shard status to Redis");
                }
                self.health.set(false);
            }
        }
    }
}

/// The last documents of a worker that stopped: each shard it consumed, with
/// `stopped_at_ms` (and the events the gate held, which went back to the
/// queue), for [`STOPPED_TTL`]; its own document removed.
async fn write_stopped(
    pool: &RedisPool,
    keys: &Keys,
    consumed: Vec<Document>,
    owner: &str,
) -> Result<(), String> {
    let now = unix_ms();
    let ttl_ms = u64::try_from(STOPPED_TTL.as_millis()).unwrap_or(u64::MAX);
    let mut pipe = redis::pipe();
    for report in consumed {
        let report = Document {
            backlog_age_seconds: 0.0,
            backlog_age_source: None,
            inflight_age_seconds: None,
            inflight_events: 0,
            waiting_events: 0,
            updated_at_ms: now,
            stopped_at_ms: Some(now),
            ..report
        };
        pipe.cmd("SET")
            .arg(keys.shard_status_of(report.shard))
            .arg(json(&report)?)
            .arg("PX")
            .arg(ttl_ms)
            .ignore();
    }
    pipe.cmd("DEL").arg(keys.worker_status(owner)).ignore();
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    send(&mut conn, &pipe).await
}

async fn write(
    pool: &RedisPool,
    keys: &Keys,
    shards: &[Document],
    worker: &WorkerReport,
    fixed: bool,
) -> Result<(), String> {
    let pipe = pipeline(keys, shards, worker, fixed)?;
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    send(&mut conn, &pipe).await
}

/// A tick's documents as one pipeline, so that a worker's status costs one
/// round trip every [`WRITE_EVERY`] however many shards it consumes (1,024
/// shards: 1,026 commands, some 400 KB, in one write), with one key per
/// document as `topology status`, the console and the membership read them.
fn pipeline(
    keys: &Keys,
    shards: &[Document],
    worker: &WorkerReport,
    fixed: bool,
) -> Result<Pipeline, String> {
    let mut pipe = redis::pipe();
    // Also a ping, so that an idle worker notices that Redis went away.
    pipe.cmd("PING").ignore();
    let ttl_ms = u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX);
    let mut set = |key: String, json: String| {
        pipe.cmd("SET")
            .arg(key)
            .arg(json)
            .arg("PX")
            .arg(ttl_ms)
            .ignore();
    };
    for report in shards {
        set(keys.shard_status_of(report.shard), json(report)?);
    }
    set(keys.worker_status(&worker.worker), json(worker)?);
    if worker.breaker.state != BreakerState::Closed {
        let fleet = FleetBreaker {
            worker: worker.worker.clone(),
            breaker: worker.breaker.clone(),
        };
        set(keys.fleet_breaker(), json(&fleet)?);
    }
    // A fixed `--assign`: the shards it consumes, which `auto` members leave alone.
    if fixed && !worker.consuming.is_empty() {
        let record = StaticRecord {
            shards: worker.consuming.clone(),
            until_ms: worker.updated_at_ms + ttl_ms,
        };
        pipe.cmd("HSET")
            .arg(keys.fleet_static())
            .arg(&worker.worker)
            .arg(json(&record)?)
            .ignore();
    }
    Ok(pipe)
}

async fn send(conn: &mut impl ConnectionLike, pipe: &Pipeline) -> Result<(), String> {
    pipe.query_async::<()>(conn)
        .await
        .map_err(|e| e.to_string())
}

/// The fleet's breaker when another worker has it open (read at start).
pub(crate) async fn fleet_breaker(
    pool: &RedisPool,
    keys: &Keys,
) -> Result<Option<FleetBreaker>, String> {
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    let doc: Option<String> = redis::cmd("GET")
        .arg(keys.fleet_breaker())
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(doc.and_then(|d| serde_json::from_str(&d).ok()))
}

fn json(document: &impl serde::Serialize) -> Result<String, String> {
    serde_json::to_string(document).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_contract::ShardCount;
    use shardline_contract::status::{StampSource, Thresholds};

    use crate::live::Stamp;

    #[test]
    fn consuming_shards_are_reported_and_the_worker_lists_them_all() {
        let shards: Vec<_> = ShardCount::new(3).unwrap().ids().collect();
        let metrics = Metrics::new(&shards, Thresholds::default(), Duration::from_secs(60));
        let watch = &metrics.shards()[1].watch;
        watch.set_state(ShardState::Consuming);
        watch.start_inflight(Stamp {
            ms: unix_ms() - 5_000,
            source: StampSource::Publisher,
        });
        metrics.shards()[2].watch.set_state(ShardState::StandingBy);
        let (docs, worker) = reports(&metrics, "w1", None, false);
        assert_eq!(docs.len(), 1);
        assert_eq!((docs[0].shard, docs[0].owner.as_str()), (1, "w1"));
        assert_eq!(docs[0].inflight_events, 1);
        assert!(docs[0].backlog_age_seconds >= 5.0);
        assert_eq!(docs[0].backlog_age_source, Some(StampSource::Publisher));
        assert_eq!(worker.assigned, [0, 1, 2]);
        assert_eq!(worker.consuming, [1]);
        assert_eq!(worker.worker, "w1");
    }

    /// Counts round trips; answers every command with OK.
    #[derive(Default)]
    struct Counted {
        round_trips: usize,
        commands: Vec<Vec<String>>,
    }

    impl ConnectionLike for Counted {
        fn req_packed_command<'a>(
            &'a mut self,
            cmd: &'a redis::Cmd,
        ) -> redis::RedisFuture<'a, redis::Value> {
            self.round_trips += 1;
            self.commands.push(words(cmd));
            Box::pin(async { Ok(redis::Value::Okay) })
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            pipeline: &'a Pipeline,
            _offset: usize,
            count: usize,
        ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
            self.round_trips += 1;
            self.commands.extend(pipeline.cmd_iter().map(words));
            Box::pin(async move { Ok(vec![redis::Value::Okay; count]) })
        }

        fn get_db(&self) -> i64 {
            0
        }
    }

    fn words(cmd: &redis::Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not simple>".into(),
            })
            .collect()
    }

    #[tokio::test]
    async fn a_tick_writes_every_document_in_one_round_trip() {
        let shards: Vec<_> = ShardCount::new(64).unwrap().ids().collect();
        let metrics = Metrics::new(&shards, Thresholds::default(), Duration::from_secs(60));
        for shard in metrics.shards() {
            shard.watch.set_state(ShardState::Consuming);
        }
        let keys = Keys::new("p:");
        let (docs, worker) = reports(&metrics, "w1", None, false);
        let mut conn = Counted::default();
        send(&mut conn, &pipeline(&keys, &docs, &worker, true).unwrap())
            .await
            .unwrap();
        assert_eq!(conn.round_trips, 1);
        let keys_written: Vec<&str> = conn
            .commands
            .iter()
            .filter(|words| words[0] == "SET" || words[0] == "HSET")
            .map(|words| words[1].as_str())
            .collect();
        let mut expected: Vec<String> = (0..64).map(|i| keys.shard_status_of(i)).collect();
        expected.push(keys.worker_status("w1"));
        expected.push(keys.fleet_static());
        assert_eq!(keys_written, expected);
        assert_eq!(conn.commands[0], ["PING"]);
    }
}
