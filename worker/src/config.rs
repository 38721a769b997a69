//! The worker's settings, their defaults and their one validation
//! ([`Config::validate`]). Parsing flags and environment happens in the binary.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use shardline_connect::inbound::Inbound;
use shardline_connect::management::ManagementTarget;
use shardline_connect::probe::Plan;
use shardline_connect::{AmqpTarget, RedisTarget, TopologyOptions};
use shardline_contract::QueueType;
use shardline_contract::status::Thresholds;
use shardline_contract::{Keys, Names, ShardCount, ShardId};

use crate::limits::{BROKER_CHANNEL_MAX, MAX_SHARDS_PER_WORKER, WORKER_NAME_MAX};

/// Everything one worker process needs to consume its shards.
#[derive(Debug, Clone)]
pub struct Config {
    /// The broker: one address or several; `amqps://` for TLS. Default the
    /// local broker's `/` vhost.
    pub amqp: AmqpTarget,
    /// Redis; `rediss://` for TLS. Default the local Redis.
    pub redis: RedisTarget,
    /// Prefix of every Redis key. Default `shardline:`.
    pub redis_prefix: String,
    /// Exchange and queue names. Default: the names of docs/semantics.md §1.
    pub names: Names,
    /// How many shards the topology has. Default 16.
    pub shards: ShardCount,
    /// Shards this worker consumes (or stands by for). Default all. With
    /// [`Config::fleet`] set, the shards the elastic fleet may give it.
    /// At most 2,047 when fixed: each takes a channel of the consume
    /// connection, and RabbitMQ allows 2,047 per connection by default.
    pub assign: Vec<ShardId>,
    /// `--assign auto`: this worker is a member of an elastic fleet that
    /// balances the shards over its members (`membership.rs`). None: it
    /// consumes (or stands by for) all of `assign`.
    pub fleet: Option<FleetPolicy>,
    /// Events read ahead per shard (the consumer's prefetch window). More
    /// read-ahead hides broker round trips. Default 1.
    pub prefetch: u16,
    /// Handler calls in flight per shard, never two of one order: an order's
    /// events run one at a time in delivery order while other orders go ahead.
    /// 1 is strictly serial per shard (with the claim of the next event riding
    /// on the commit); more lifts the shard's ceiling of one call per
    /// downstream latency, at the price of up to this many repeated calls per
    /// shard after a crash. Default 1.
    pub concurrency: u16,
    /// Group commit on serial shards: up to a group of deliveries the broker
    /// has already sent are claimed in one Redis call, run one after another,
    /// committed together with the next group's claims in one call and acked
    /// with one ack (`intake::group`). The price: a worker that dies between
    /// a group's calls and its commit repeats up to a group's calls per
    /// shard, not only the event in the handler. Default
    /// [`GroupCommit::Auto`]: groups as large as the prefetch allows, where
    /// grouping applies ([`Config::grouping`]).
    pub group_commit: GroupCommit,
    /// At most this many handler calls per second for the whole worker
    /// process, shared fairly by its shards (a token bucket whose burst is a
    /// tenth of a second's worth, at least one call). Waiting for a token is
    /// not an attempt. Default none (no limit).
    pub max_rate: Option<f64>,
    /// Take each shard with an exclusive consumer (classic queues without
    /// single-active-consumer). When false the queue's single-active-consumer
    /// decides which consumer is active. Default true.
    pub exclusive: bool,
    /// In-place retries of a failed handler attempt.
    pub retry: RetryPolicy,
    /// The downstream breaker: an outage pauses every shard instead of
    /// spending the events' retries (`breaker.rs`).
    pub breaker: BreakerPolicy,
    /// Longest one handler attempt may take; past it the attempt fails as
    /// retryable (`timeout`). Default 30 s.
    pub handler_timeout: Duration,
    /// On stop, how long the in-flight event may still take before it is left
    /// unacked (and its claim released). Default 10 s.
    pub drain_timeout: Duration,
    /// How long a `done` dedup key lives. Longer catches later duplicates at the
    /// cost of Redis memory (one key per event). Default 7 days.
    pub dedup_ttl: Duration,
    /// Largest body accepted; larger ones are dead-lettered `invalid`. Default 1 MiB.
    pub max_body_bytes: usize,
    /// How often a standby retries taking a shard held by another worker.
    /// Default 1 s.
    pub standby_retry: Duration,
    /// Shown in logs and in the broker's connection list (cut at 64 bytes
    /// there); tags the consumers (`{worker_name}/shard-{i}`), so at most 244
    /// bytes (a consumer tag is at most 255).
    pub worker_name: String,
    /// How long an out-of-sequence event is held for its gap to fill, from its
    /// arrival. Default 2 min (RabbitMQ's consumer timeout, 30 min by default,
    /// caps any hold).
    pub gap_grace: Duration,
    /// How long the first event of an order with no gate state and seq > 1 waits
    /// for earlier ones before it is accepted as the start. Default 5 s.
    pub start_grace: Duration,
    /// Events held per shard at most; at the bound the oldest gap times out
    /// early. Also the consumer's window reserve: the broker window is
    /// `prefetch + concurrency + max_held` (`prefetch + max_held` at
    /// concurrency 1). Default 64.
    pub max_held: u16,
    /// Bytes of event bodies a shard holds decoded at most: held by the gate,
    /// read ahead and waiting to run (not those in flight). At the bound the
    /// shard takes no new delivery until one of them runs; held events stay
    /// held and nothing is given up for bytes (gaps only at `max_held` or
    /// their grace). The next delivery's size is known only once it is taken,
    /// so the last one may go past the bound by its body; one event larger
    /// than the bound is taken when nothing else is held. Default 64 MiB:
    /// `max_held` (64) events at the default body limit (1 MiB).
    pub max_held_bytes: usize,
    /// What to do with held events whose gap never filled. Default dead-letter.
    pub on_gap: OnGap,
    /// What an order's later events do once one of its events is
    /// dead-lettered. Default continue.
    pub on_dead_letter: OnDeadLetter,
    /// How long the processed event kinds of an order are kept (what
    /// `shardline reconcile` checks); zero records none. Default the longer of
    /// 24 h and the dedup TTL.
    pub kinds_ttl: Option<Duration>,
    /// Handler starts that may end with the process dying before the event is
    /// dead-lettered `crash-loop`. Default 5.
    pub max_deliveries: u32,
    /// Quorum queues: the queue's `x-delivery-limit`; the worker dead-letters an
    /// event itself when `x-delivery-count` reaches it − 1. None for classic queues.
    pub delivery_limit: Option<u32>,
    /// Consume although the topology has another shard count (queue N−1
    /// missing or queue N present): a shard-count migration only. Default false.
    pub allow_shard_mismatch: bool,
    /// Consume classic single-active-consumer queues although the broker has
    /// the bug that can stop their failover (rabbitmq-server#5460). Default false.
    pub accept_classic_sac_risk: bool,
    /// RabbitMQ's management API: the broker probe then also checks the
    /// policies on the shard queues and the DLQ. Default none.
    pub management: Option<ManagementTarget>,
    /// Serve `/metrics`, `/healthz` and `/readyz` here. Default none (off).
    pub metrics_addr: Option<SocketAddr>,
    /// The limits of the `metrics_addr` port: header-read and idle timeouts,
    /// the connection cap (counted in the file descriptors checked at start),
    /// the body limit. Default [`Inbound::default`]: 10 s, 5 s, 64, 1 MiB.
    pub metrics_limits: Inbound,
    /// Backlog age from which a shard is at WARN and at PAGE (metrics, status).
    /// Default 30 s and 2 min.
    pub backlog: Thresholds,
    /// An in-flight event worked on longer than this (attempts and backoff
    /// included) marks its shard stuck. Default 60 s.
    pub stuck_after: Duration,
}

/// How many first deliveries a serial shard claims, calls, commits and acks
/// as one group (`--group-commit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupCommit {
    /// Up to `min(prefetch, AUTO_GROUP_MAX)`, where grouping applies: a
    /// user who raises the prefetch to go faster gets groups, and at the
    /// default prefetch of 1 nothing changes. Off, without a refusal, where
    /// it cannot apply ([`Config::grouping`]).
    #[default]
    Auto,
    /// Up to this many; 1 is the strict setting (no groups: a crash repeats
    /// at most the one event in the handler per shard).
    Fixed(u16),
}

impl GroupCommit {
    /// The largest group `auto` forms, whatever the prefetch: past it the
    /// Redis script's arguments grow and the repeat bound with them, for
    /// little more speed (one round trip is already shared by 32 events).
    pub const AUTO_MAX: u16 = 32;

    fn fixed_above_one(self) -> bool {
        matches!(self, Self::Fixed(n) if n > 1)
    }
}

impl fmt::Display for GroupCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Fixed(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for GroupCommit {
    type Err = std::num::ParseIntError;

    /// `auto` or a count.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("auto") {
            Ok(Self::Auto)
        } else {
            s.parse().map(Self::Fixed)
        }
    }
}

/// What [`Config::grouping`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grouping {
    /// Deliveries per group at most; 1: no groups.
    pub size: u16,
    /// Why `auto` formed no groups where the prefetch would allow them: the
    /// setting that rules grouping out, for the start-up line.
    pub off_because: Option<&'static str>,
}

/// What happens to held events when their gap does not fill within the grace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnGap {
    /// Dead-letter them with reason `seq-gap`.
    #[default]
    DeadLetter,
    /// Apply them in order, skipping the gap.
    Apply,
}

/// What happens to an order's later events after one of its events is
/// dead-lettered (docs/semantics.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDeadLetter {
    /// They continue; a replayed event is applied where it lands.
    #[default]
    Continue,
    /// The order is quarantined: its later events are dead-lettered
    /// `quarantined` until its dead letters are replayed or it is released.
    Quarantine,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp: AmqpTarget::default(),
            redis: RedisTarget::default(),
            redis_prefix: "shardline:".into(),
            names: Names::default(),
            shards: ShardCount::default(),
            assign: ShardCount::default().ids().collect(),
            fleet: None,
            prefetch: 1,
            concurrency: 1,
            group_commit: GroupCommit::Auto,
            max_rate: None,
            exclusive: true,
            retry: RetryPolicy::default(),
            breaker: BreakerPolicy::default(),
            handler_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(10),
            dedup_ttl: Duration::from_secs(7 * 24 * 3600),
            max_body_bytes: 1024 * 1024,
            standby_retry: Duration::from_secs(1),
            worker_name: "shardline-worker".into(),
            gap_grace: Duration::from_secs(120),
            start_grace: Duration::from_secs(5),
            max_held: 64,
            max_held_bytes: 64 * 1024 * 1024,
            on_gap: OnGap::DeadLetter,
            on_dead_letter: OnDeadLetter::Continue,
            kinds_ttl: None,
            max_deliveries: 5,
            allow_shard_mismatch: false,
            accept_classic_sac_risk: false,
            management: None,
            delivery_limit: None,
            metrics_addr: None,
            metrics_limits: Inbound::default(),
            backlog: Thresholds::default(),
            stuck_after: Duration::from_secs(60),
        }
    }
}

impl Config {
    /// A [`Config::worker_name`] unique per process on a host: `host-pid`
    /// (what the command line uses when no name is given).
    pub fn host_pid_name() -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", std::process::id())
    }

    /// Checks the settings that no type rules out; [`crate::Worker::new`]
    /// calls it. The first problem found is returned, in the order of the
    /// fields: delivery, then downstream, then fleet settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let delivery = self.delivery_problems();
        let downstream = self.downstream_problems();
        let fleet = self.fleet_problems();
        delivery
            .into_iter()
            .chain(downstream)
            .chain(fleet)
            .flatten()
            .next()
            .map_or(Ok(()), Err)
    }

    /// Retries, read-ahead, concurrency and grouping.
    fn delivery_problems(&self) -> [Option<ConfigError>; 8] {
        let retry = &self.retry;
        let refuse = ConfigError::new;
        let jitter = || Problem::NotIn {
            range: "[0, 1)",
            got: retry.jitter.to_string(),
        };
        let factor = || Problem::Below {
            min: "1",
            got: Some(retry.factor.to_string()),
        };
        [
            (!(0.0..1.0).contains(&retry.jitter)).then(|| refuse("retry.jitter", jitter())),
            (retry.factor < 1.0).then(|| refuse("retry.factor", factor())),
            (retry.max_attempts == 0).then(|| refuse("retry.max_attempts", Problem::AT_LEAST_ONE)),
            (self.prefetch == 0).then(|| refuse("prefetch", Problem::AT_LEAST_ONE)),
            (self.concurrency == 0).then(|| refuse("concurrency", Problem::AT_LEAST_ONE)),
            (self.group_commit == GroupCommit::Fixed(0))
                .then(|| refuse("group_commit", Problem::AT_LEAST_ONE)),
            (self.group_commit.fixed_above_one() && self.concurrency > 1)
                .then(|| refuse("group_commit", Problem::NotWith("concurrency above 1"))),
            (self.group_commit.fixed_above_one()
                && self.on_dead_letter == OnDeadLetter::Quarantine)
                .then(|| {
                    refuse(
                        "group_commit",
                        Problem::NotWith("on_dead_letter quarantine"),
                    )
                }),
        ]
    }

    /// The breaker, the call rate and the quorum delivery limit.
    fn downstream_problems(&self) -> [Option<ConfigError>; 5] {
        let refuse = ConfigError::new;
        [
            (!(self.breaker.failure_ratio > 0.0 && self.breaker.failure_ratio <= 1.0)).then(|| {
                refuse(
                    "breaker.failure_ratio",
                    Problem::NotIn {
                        range: "(0, 1]",
                        got: self.breaker.failure_ratio.to_string(),
                    },
                )
            }),
            (self.breaker.window.is_zero()).then(|| {
                refuse(
                    "breaker.window",
                    Problem::Below {
                        min: "1ms",
                        got: None,
                    },
                )
            }),
            (self.breaker.cooldown_max < self.breaker.cooldown).then(|| {
                refuse(
                    "breaker.cooldown_max",
                    Problem::BelowField("breaker.cooldown"),
                )
            }),
            self.max_rate
                .filter(|r| !(r.is_finite() && *r > 0.0))
                .map(|r| {
                    refuse(
                        "max_rate",
                        Problem::NotIn {
                            range: "(0, ∞)",
                            got: r.to_string(),
                        },
                    )
                }),
            self.delivery_limit
                .filter(|&limit| limit < self.max_deliveries.saturating_add(2))
                .map(|limit| {
                    refuse(
                        "delivery_limit",
                        Problem::Below {
                            min: "max-deliveries + 2 (the worker dead-letters at the limit - 1; reconnects and handovers spend it too)",
                            got: Some(limit.to_string()),
                        },
                    )
                }),
        ]
    }

    /// Backlog levels, the shard selection and the elastic fleet.
    fn fleet_problems(&self) -> [Option<ConfigError>; 6] {
        let refuse = ConfigError::new;
        // An elastic member is given its share, not all of `assign`: it is
        // warned at start instead (`supervisor::check_limits`).
        let over_ceiling = self.fleet.is_none() && self.assign.len() > MAX_SHARDS_PER_WORKER;
        [
            (self.backlog.page < self.backlog.warn)
                .then(|| refuse("backlog.page", Problem::BelowField("backlog.warn"))),
            self.assign
                .is_empty()
                .then(|| refuse("assign", Problem::NoShards)),
            (self.worker_name.len() > WORKER_NAME_MAX).then(|| {
                refuse(
                    "worker_name",
                    Problem::TooLong {
                        max: WORKER_NAME_MAX,
                        got: self.worker_name.len(),
                        why: "each consumer is tagged `{name}/shard-{i}`, and AMQP caps a tag at 255 bytes",
                    },
                )
            }),
            over_ceiling.then(|| {
                refuse(
                    "assign",
                    Problem::OverShardCeiling {
                        got: self.assign.len(),
                        of: self.shards.get(),
                    },
                )
            }),
            self.fleet
                .as_ref()
                .filter(|f| f.heartbeat.saturating_mul(2) > f.lease)
                .map(|_| {
                    refuse(
                        "fleet.lease",
                        Problem::Below {
                            min: "twice the heartbeat",
                            got: None,
                        },
                    )
                }),
            self.fleet
                .as_ref()
                .filter(|f| f.member_id.trim().is_empty())
                .map(|_| {
                    refuse(
                        "fleet.member_id",
                        Problem::Below {
                            min: "one character",
                            got: None,
                        },
                    )
                }),
        ]
    }

    /// The group size in effect. `auto` groups up to
    /// `min(prefetch, GroupCommit::AUTO_MAX)` and turns itself off where a
    /// group cannot apply: calls run concurrently (`concurrency` above 1:
    /// groups are for one call at a time), quarantine mode (an order's
    /// failure must hold its later events, which a group has already
    /// claimed), or a call rate limit (a group's calls would not wait their
    /// turn). An explicit size is used as given ([`Config::validate`]
    /// refuses the first two combinations; under a rate limit groups form
    /// only while no call is waiting for a token).
    pub fn grouping(&self) -> Grouping {
        let fixed = |size| Grouping {
            size,
            off_because: None,
        };
        match self.group_commit {
            GroupCommit::Fixed(n) => fixed(n.max(1)),
            GroupCommit::Auto if self.prefetch <= 1 => fixed(1),
            GroupCommit::Auto => {
                let off_because = if self.concurrency > 1 {
                    Some("--concurrency is above 1")
                } else if self.on_dead_letter == OnDeadLetter::Quarantine {
                    Some("--on-dead-letter is quarantine")
                } else if self.max_rate.is_some() {
                    Some("--max-rate is set")
                } else {
                    None
                };
                match off_because {
                    Some(_) => Grouping {
                        size: 1,
                        off_because,
                    },
                    None => fixed(self.prefetch.min(GroupCommit::AUTO_MAX)),
                }
            }
        }
    }

    /// The Redis keys under [`Config::redis_prefix`].
    pub(crate) fn keys(&self) -> Keys {
        Keys::new(&self.redis_prefix)
    }

    /// The longest one event may be held unacked by its retries: every
    /// attempt timing out, every backoff at its longest (or at the longest
    /// `Retry-After`). An open breaker holds it longer.
    pub fn longest_hold(&self) -> Duration {
        let retry = &self.retry;
        let backoffs: Duration = (1..retry.max_attempts)
            .map(|failed| retry.delay(failed, 1.0).max(retry.retry_after_cap))
            .sum();
        self.handler_timeout * retry.max_attempts + backoffs
    }

    /// The topology these consumers expect: the arguments their shard
    /// queues must have.
    pub fn topology(&self) -> TopologyOptions {
        TopologyOptions {
            shards: self.shards,
            single_active_consumer: !self.exclusive && self.delivery_limit.is_none(),
            queue_type: if self.delivery_limit.is_some() {
                QueueType::Quorum
            } else {
                QueueType::Classic
            },
            delivery_limit: self.delivery_limit.unwrap_or_default(),
            accept_classic_sac_risk: self.accept_classic_sac_risk,
            broker_version: None,
        }
    }

    /// What the broker probe checks for this worker.
    pub fn probe_plan(&self) -> Plan {
        Plan {
            largest_body: Some(self.max_body_bytes),
            delivery_limit: self.delivery_limit,
            longest_hold: Some(self.longest_hold()),
            ..self.topology().plan()
        }
    }

    /// The claim lease: one handler attempt plus 30 s, renewed before each attempt.
    pub fn lease(&self) -> Duration {
        self.handler_timeout + Duration::from_secs(30)
    }

    /// How long an order's processed event kinds are kept: `kinds_ttl`, by
    /// default the longer of 24 h (the reconcile window's default) and the
    /// dedup TTL.
    pub fn kinds_ttl(&self) -> Duration {
        self.kinds_ttl
            .unwrap_or_else(|| self.dedup_ttl.max(Duration::from_secs(24 * 3600)))
    }

    /// The consumer's broker window: read-ahead, the calls in flight beyond the
    /// first, and the gate's hold reserve. At concurrency 1 it is
    /// `prefetch + max_held`, as before concurrency existed.
    pub fn window(&self) -> u16 {
        self.prefetch
            .saturating_add(self.concurrent_calls())
            .saturating_add(self.max_held)
    }

    /// The shard's share of the window for events taken and not held: in
    /// flight, ready or waiting for their order (`prefetch + concurrency`).
    /// At the bound the shard takes no delivery until one of them is settled.
    pub(crate) fn max_taken(&self) -> usize {
        usize::from(self.prefetch) + usize::from(self.concurrent_calls())
    }

    /// Calls in flight beyond the serial one: 0 at concurrency 1.
    fn concurrent_calls(&self) -> u16 {
        if self.concurrency > 1 {
            self.concurrency
        } else {
            0
        }
    }
}

/// A setting [`Config::validate`] refused: which field (as a path from
/// [`Config`], such as `retry.jitter`) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct ConfigError {
    pub field: &'static str,
    pub problem: Problem,
}

impl ConfigError {
    fn new(field: &'static str, problem: Problem) -> Self {
        Self { field, problem }
    }

    /// The message with every field named by `name` instead (a command line
    /// maps fields to its flags: `retry.jitter` to `--retry-jitter`).
    pub fn describe(&self, name: impl Fn(&'static str) -> String) -> String {
        format!("{} {}", name(self.field), self.problem.describe(name))
    }
}

/// What is wrong with a setting.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// Outside `range` (written as an interval, such as `[0, 1)`).
    NotIn { range: &'static str, got: String },
    /// Below `min`; `got` when the value is worth repeating.
    Below {
        min: &'static str,
        got: Option<String>,
    },
    /// Below another field, which it must not be.
    BelowField(&'static str),
    /// The shard selection is empty.
    NoShards,
    /// Above 1 it cannot be combined with this setting (a field, then its value).
    NotWith(&'static str),
    /// Longer than `max` bytes, for the reason `why`.
    TooLong {
        max: usize,
        got: usize,
        why: &'static str,
    },
    /// More shards than one worker can consume: `got` of the topology's `of`
    /// (each takes a channel of a connection, which RabbitMQ caps).
    OverShardCeiling { got: usize, of: u16 },
}

impl Problem {
    const AT_LEAST_ONE: Self = Self::Below {
        min: "1",
        got: None,
    };

    /// The problem in words, other fields named by `name`.
    pub fn describe(&self, name: impl Fn(&'static str) -> String) -> String {
        match self {
            Self::NotIn { range, got } => format!("must be in {range}, got {got}"),
            Self::Below {
                min,
                got: Some(got),
            } => format!("must be at least {min}, got {got}"),
            Self::Below { min, got: None } => format!("must be at least {min}"),
            Self::BelowField(other) => format!("must not be below {}", name(other)),
            Self::NoShards => "selects no shard".to_owned(),
            Self::NotWith(setting) => match setting.split_once(' ') {
                Some((field, value)) => format!("cannot be combined with {} {value}", name(field)),
                None => format!("cannot be combined with {}", name(setting)),
            },
            Self::TooLong { max, got, why } => {
                format!("must be at most {max} bytes ({why}), got {got}")
            }
            Self::OverShardCeiling { got, of } => format!(
                "selects {got} shards (of {} {of}), over the {MAX_SHARDS_PER_WORKER} one worker can \
                 consume: RabbitMQ allows {BROKER_CHANNEL_MAX} channels per connection and the \
                 worker takes one per shard; give each worker at most {MAX_SHARDS_PER_WORKER} with \
                 {} (such as 0-{}), or run several with {} auto",
                name("shards"),
                name("assign"),
                MAX_SHARDS_PER_WORKER - 1,
                name("assign"),
            ),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(|field| field.to_owned()))
    }
}

/// In-place retries: exponential backoff with jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Handler attempts in all, the first included. Default 5.
    pub max_attempts: u32,
    /// Delay after the first failure. Default 100 ms.
    pub base: Duration,
    /// Growth per attempt. Default 2.
    pub factor: f64,
    /// Longest delay. Default 5 s.
    pub cap: Duration,
    /// Each delay is varied by up to ± this fraction. Default 0.3.
    pub jitter: f64,
    /// Longest delay a `Retry-After` answer (429, 503) may ask for; the
    /// answer sets the next delay of that event only. Default 30 s.
    pub retry_after_cap: Duration,
}

/// Membership of an elastic fleet (`--assign auto`): every member renews a
/// lease in Redis each heartbeat and runs one rebalance step
/// (`shardline_contract::assignment::rebalance`) against the shared
/// assignment; the exclusive consumer keeps the broker the judge of who may
/// consume a shard. Defaults: a 5 s lease renewed every second, 3 s of
/// settling before a new member gets shards, 2 shards moved per step.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetPolicy {
    /// The member's id: stable across restarts of one pod or host (a member
    /// back within its lease gets its shards back). Default host name and pid.
    pub member_id: String,
    /// A member whose lease lapsed is gone: its shards are reassigned at once.
    pub lease: Duration,
    /// How often the lease is renewed and a rebalance step runs.
    pub heartbeat: Duration,
    /// How long a new member holds its lease before it is given shards.
    pub settle: Duration,
    /// Shards moved away from live members per rebalance step.
    pub max_moves: usize,
}

impl FleetPolicy {
    /// The defaults, for member `member_id`.
    pub fn new(member_id: impl Into<String>) -> Self {
        Self {
            member_id: member_id.into(),
            lease: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
            settle: Duration::from_secs(3),
            max_moves: 2,
        }
    }
}

/// The downstream breaker's thresholds (`breaker.rs`). The defaults open it
/// after 5 retryable failures across 3 orders within 10 s when they are at
/// least half of the calls, and probe after 1 s, 2 s, 4 s, then every 5 s: calls
/// resume within about 5 s of the downstream's recovery.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerPolicy {
    /// Off: every retryable failure counts toward `max_attempts`, as without
    /// a breaker. Default on.
    pub enabled: bool,
    /// Attempts are judged over this much recent time; it is also how long
    /// an event that used its attempts waits for evidence. Default 10 s.
    pub window: Duration,
    /// Retryable failures in the window before it may open. Default 5.
    pub min_failures: u32,
    /// Share of the window's calls that must have failed. Default 0.5.
    pub failure_ratio: f64,
    /// Wait before the first probe call. Default 1 s.
    pub cooldown: Duration,
    /// The cooldown doubles after each failed probe up to this. Default 5 s.
    pub cooldown_max: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            window: Duration::from_secs(10),
            min_failures: 5,
            failure_ratio: 0.5,
            cooldown: Duration::from_secs(1),
            cooldown_max: Duration::from_secs(5),
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base: Duration::from_millis(100),
            factor: 2.0,
            cap: Duration::from_secs(5),
            jitter: 0.3,
            retry_after_cap: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The delay before attempt `failed + 1`, given `unit` in `[0, 1)` as the
    /// random draw.
    pub fn delay(&self, failed: u32, unit: f64) -> Duration {
        let exponent = i32::try_from(failed.saturating_sub(1)).unwrap_or(i32::MAX);
        let raw = self.base.as_secs_f64() * self.factor.powi(exponent);
        let capped = raw.min(self.cap.as_secs_f64());
        let spread = 1.0 + self.jitter * (2.0 * unit - 1.0);
        Duration::from_secs_f64((capped * spread).max(0.0))
    }

    /// The delay before the next attempt, with a fresh random draw.
    pub fn next_delay(&self, failed: u32) -> Duration {
        self.delay(failed, rand::random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_by_factor_and_stops_at_cap() {
        let p = RetryPolicy::default();
        let mid = 0.5; // no jitter
        assert_eq!(p.delay(1, mid), Duration::from_millis(100));
        assert_eq!(p.delay(2, mid), Duration::from_millis(200));
        assert_eq!(p.delay(4, mid), Duration::from_millis(800));
        assert_eq!(p.delay(10, mid), Duration::from_secs(5));
        assert_eq!(p.delay(1000, mid), Duration::from_secs(5));
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let p = RetryPolicy::default();
        assert_eq!(p.delay(1, 0.0), Duration::from_millis(70));
        let high = p.delay(1, 0.999_999);
        assert!(high > Duration::from_millis(129) && high <= Duration::from_millis(130));
        for _ in 0..100 {
            let d = p.next_delay(3);
            assert!(d >= Duration::from_millis(280) && d <= Duration::from_millis(520));
        }
    }

    #[test]
    fn the_window_adds_the_calls_in_flight_beyond_one() {
        let serial = Config::default();
        assert_eq!(serial.window(), 1 + 64, "concurrency 1: as before");
        let concurrent = Config {
            prefetch: 2,
            concurrency: 16,
            max_held: 10,
            ..Config::default()
        };
        assert_eq!(concurrent.window(), 2 + 16 + 10);
        assert_eq!(concurrent.max_taken(), 18);
    }

    #[test]
    fn lease_covers_one_attempt_plus_margin() {
        let c = Config::default();
        assert_eq!(c.lease(), Duration::from_secs(60));
    }

    #[test]
    fn validation_names_the_field_and_the_problem() {
        assert_eq!(Config::default().validate(), Ok(()));
        let refused = |config: Config| config.validate().unwrap_err().to_string();
        let quorum = |limit| Config {
            delivery_limit: Some(limit),
            ..Config::default()
        };
        assert!(
            refused(quorum(6)).starts_with("delivery_limit must be at least max-deliveries + 2"),
            "{}",
            refused(quorum(6))
        );
        assert_eq!(quorum(7).validate(), Ok(()));
        assert_eq!(
            quorum(shardline_connect::declare::DEFAULT_DELIVERY_LIMIT).validate(),
            Ok(())
        );
        let retry = |retry: RetryPolicy| Config {
            retry,
            ..Config::default()
        };
        assert_eq!(
            refused(retry(RetryPolicy {
                jitter: 1.0,
                ..RetryPolicy::default()
            })),
            "retry.jitter must be in [0, 1), got 1"
        );
        assert_eq!(
            refused(retry(RetryPolicy {
                factor: 0.5,
                ..RetryPolicy::default()
            })),
            "retry.factor must be at least 1, got 0.5"
        );
        assert_eq!(
            refused(Config {
                prefetch: 0,
                ..Config::default()
            }),
            "prefetch must be at least 1"
        );
        assert_eq!(
            refused(Config {
                concurrency: 0,
                ..Config::default()
            }),
            "concurrency must be at least 1"
        );
        let inverted = Config {
            backlog: Thresholds {
                warn: Duration::from_secs(60),
                page: Duration::from_secs(30),
            },
            ..Config::default()
        };
        assert_eq!(
            refused(inverted.clone()),
            "backlog.page must not be below backlog.warn"
        );
        let flag = |field: &str| format!("--{}", field.replace('.', "-"));
        assert_eq!(
            inverted.validate().unwrap_err().describe(flag),
            "--backlog-page must not be below --backlog-warn"
        );
        assert_eq!(
            refused(Config {
                assign: Vec::new(),
                ..Config::default()
            }),
            "assign selects no shard"
        );
    }

    /// One channel per shard on a connection RabbitMQ caps at 2,047: a fixed
    /// assignment over the ceiling is refused in one line naming both settings;
    /// an elastic member's `assign` is only what it may be given.
    #[test]
    fn an_assignment_over_the_channel_ceiling_is_refused() {
        let shards = ShardCount::new(4096).unwrap();
        let all = Config {
            shards,
            assign: shards.ids().collect(),
            ..Config::default()
        };
        let flag = |field: &str| format!("--{}", field.replace('.', "-"));
        let line = all.validate().unwrap_err().describe(flag);
        assert!(
            line.starts_with("--assign selects 4096 shards (of --shards 4096), over the 2047"),
            "{line}"
        );
        assert!(line.contains("such as 0-2046)"), "{line}");
        assert!(!line.contains('\n'), "{line}");
        let at_ceiling = Config {
            assign: shards.ids().take(MAX_SHARDS_PER_WORKER).collect(),
            ..all.clone()
        };
        assert_eq!(at_ceiling.validate(), Ok(()));
        let elastic = Config {
            fleet: Some(FleetPolicy::new("member-1")),
            ..all
        };
        assert_eq!(elastic.validate(), Ok(()));
    }

    /// The name tags every consumer, an AMQP short string: a longer one
    /// would fail every consume (or, in a debug build, panic in lapin).
    #[test]
    fn a_worker_name_too_long_for_a_consumer_tag_is_refused() {
        let named = |worker_name: String| Config {
            worker_name,
            ..Config::default()
        };
        let longest = named("é".repeat(WORKER_NAME_MAX / 2));
        assert_eq!(longest.validate(), Ok(()));
        let tag = format!("{}/shard-4095", longest.worker_name);
        assert_eq!(tag.len(), 255);
        let line = named("w".repeat(WORKER_NAME_MAX + 1))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            line.starts_with("worker_name must be at most 244 bytes (each consumer is tagged"),
            "{line}"
        );
        assert!(line.ends_with("got 245"), "{line}");
    }
}
