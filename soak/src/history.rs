//! What the orchestrator recorded during a soak: plain data, filled in by it.
//!
//! Every time is an offset from the soak's start.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::schedule::Fault;

/// A poison or hostile event the publisher sent on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoisonKind {
    /// A body that is not UTF-8 JSON: must be dead-lettered `decode`.
    Undecodable,
    /// JSON that is not a valid envelope: must be dead-lettered `invalid`.
    InvalidEnvelope,
    /// A valid event with malformed trace headers: must be processed normally.
    HostileHeaders,
}

/// An event the publisher got a broker confirm for.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// `{order}:{event}:{seq}`, the downstream's `Idempotency-Key`.
    pub key: String,
    /// The order it belongs to.
    pub order: String,
    /// Its sequence number in the order.
    pub seq: u64,
    /// The shard it was routed to.
    pub shard: u16,
    /// When the confirm arrived.
    pub confirmed_at: Duration,
    /// `Some` for an event sent as poison or hostile.
    pub poison: Option<PoisonKind>,
}

/// A call the downstream saw.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The `Idempotency-Key` it carried.
    pub key: String,
    /// The order of its event.
    pub order: String,
    /// The seq of its event.
    pub seq: u64,
    /// The shard that processed it: the order's shard by the map that stood
    /// when the call started (the old one until a reshard ended).
    pub shard: u16,
    /// When the downstream received it.
    pub started: Duration,
    /// When the downstream answered, or the connection ended.
    pub ended: Duration,
    /// The HTTP status answered; 0 when the connection was refused or dropped.
    pub status: u16,
}

impl Call {
    /// Whether the call applied its event: a 2xx answer.
    #[must_use]
    pub fn applied(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// A message left in the DLQ at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct Letter {
    /// The event's `Idempotency-Key`, when it can be known.
    pub key: Option<String>,
    /// The event's order, when it can be known.
    pub order: Option<String>,
    /// The event's seq, when it can be known.
    pub seq: Option<u64>,
    /// Its `x-fail-reason`: `decode`, `invalid`, `handler`, `timeout`, `seq-gap`,
    /// `late`, `crash-loop`, `quarantined`, `control`.
    pub reason: String,
    /// The shard it came from, when it can be known.
    pub shard: Option<u16>,
}

/// A fault as it happened: the times measured, which may differ from the schedule's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRecord {
    /// The scheduled fault.
    pub fault: Fault,
    /// When it was injected.
    pub began: Duration,
    /// When it was ended, healed or what it stopped restarted.
    pub ended: Duration,
}

/// The fleet's numbers, sampled once a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When it was taken.
    pub at: Duration,
    /// Events processed over the last second, by the whole fleet.
    pub processed_per_sec: f64,
    /// Age of the oldest unprocessed event, in seconds.
    pub backlog_age_secs: f64,
    /// The machine's CPU use, in percent.
    pub cpu_percent: f64,
}

/// Shard → the names of its consumers at the end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FinalConsumers(pub BTreeMap<u16, Vec<String>>);

/// One worker's flags that the bounds depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerFlags {
    /// `--concurrency`, K.
    pub concurrency: u32,
    /// `--prefetch`, P.
    pub prefetch: u32,
    /// The group-commit size G: `min(P, 32)` with the default `--group-commit auto`.
    pub group: u32,
}

impl WorkerFlags {
    /// The calls per shard a kill -9 of this worker may repeat: max(1, K, G)
    /// (`docs/failures.md`, "worker killed (kill -9, OOM) mid-handler").
    #[must_use]
    pub fn crash_bound(&self) -> u64 {
        u64::from(self.concurrency.max(self.group).max(1))
    }
}

/// The fleet's flags that the check's bounds and windows use.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    /// Per worker, indexed by the worker number of the faults.
    pub workers: Vec<WorkerFlags>,
    /// `--standby-retry`.
    pub standby_retry: Duration,
    /// `--member-lease`.
    pub member_lease: Duration,
    /// `--member-heartbeat`.
    pub member_heartbeat: Duration,
    /// The cluster's `net_ticktime`.
    pub net_ticktime: Duration,
    /// The backlog age at which `topology status` warns.
    pub warn_backlog_age: Duration,
}

impl Fleet {
    /// The soak's fleet: worker 0 `--concurrency 4`, worker 1 `--prefetch 32` (G = 32),
    /// worker 2 the defaults; default leases, `net_ticktime` 10 s, WARN at 30 s.
    #[must_use]
    pub fn soak() -> Fleet {
        let defaults = WorkerFlags {
            concurrency: 1,
            prefetch: 1,
            group: 1,
        };
        Fleet {
            workers: vec![
                WorkerFlags {
                    concurrency: 4,
                    ..defaults
                },
                WorkerFlags {
                    prefetch: 32,
                    group: 32,
                    ..defaults
                },
                defaults,
            ],
            standby_retry: Duration::from_secs(1),
            member_lease: Duration::from_secs(5),
            member_heartbeat: Duration::from_secs(1),
            net_ticktime: Duration::from_secs(10),
            warn_backlog_age: Duration::from_secs(30),
        }
    }

    /// The largest crash bound over the workers (1 for an empty fleet).
    #[must_use]
    pub fn largest_crash_bound(&self) -> u64 {
        self.workers
            .iter()
            .map(WorkerFlags::crash_bound)
            .max()
            .unwrap_or(1)
    }
}

/// Everything recorded in one soak.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    /// The recorded topology's shard count at the end: shards are `0..shards`.
    pub shards: u16,
    /// The queues a shrink retired, still consumed (and forwarding) at the end.
    pub retired: Vec<u16>,
    /// Every confirmed event.
    pub published: Vec<Published>,
    /// Every call the downstream saw.
    pub calls: Vec<Call>,
    /// Every message left in the DLQ.
    pub letters: Vec<Letter>,
    /// Every fault injected.
    pub faults: Vec<FaultRecord>,
    /// One sample a second.
    pub samples: Vec<Sample>,
    /// The consumers of each shard at the end.
    pub final_consumers: FinalConsumers,
    /// The fleet's flags.
    pub fleet: Fleet,
}

#[cfg(test)]
impl FaultRecord {
    /// A fault of `kind` that ran from second `began` to second `ended`, as
    /// scheduled (a test fixture).
    pub(crate) fn at_secs(kind: crate::FaultKind, began: u64, ended: u64) -> FaultRecord {
        let secs = Duration::from_secs;
        FaultRecord {
            fault: Fault {
                kind,
                start: secs(began),
                length: secs(ended - began),
            },
            began: secs(began),
            ended: secs(ended),
        }
    }
}
