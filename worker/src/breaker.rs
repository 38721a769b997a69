//! The downstream breaker (`Config::breaker`): tells a downstream outage from
//! a poison event, and while the downstream is out pauses every shard of the
//! worker instead of letting each event burn its retry budget into the DLQ.
//!
//! Every handler attempt of the worker reports its end here ([`Breaker::record`]),
//! as its fault ([`crate::handler::Fault`]) decided it: a success; the
//! downstream's availability (connection refused or reset, timeout, 408, 429,
//! 5xx: outage evidence); its configuration (a redirect: calls pause at once);
//! an unconfirmed answer (401, 403, 404, 405, 410 by default: the
//! configuration's once [`CONFIG_ORDERS`] orders got the same one since the
//! last success); or nothing (the event's own fault says nothing about the
//! downstream, and never opens or reopens the breaker).
//!
//! - **Configuration**: calls pause like an open breaker ([`PauseCause::Configuration`]),
//!   with an error line and the status document naming the answer; the probe
//!   and a success resume them. Never a mass dead letter.
//! - **Closed → open** when, over the last [`BreakerPolicy::window`], at least
//!   [`BreakerPolicy::min_failures`] attempts failed retryably, they are at
//!   least [`BreakerPolicy::failure_ratio`] of the window's attempts, and they
//!   came from at least [`MIN_FAILING_ORDERS`] orders: one order failing again
//!   and again is a poison order, not an outage.
//! - **Thin evidence.** An event that used its retryable attempts asks
//!   [`Breaker::judge`] before it is dead-lettered. A success of another order
//!   since its first failure: poison, dead-letter it. The breaker open (or
//!   opened and closed since its budget began): an outage, its budget starts
//!   again. Otherwise the shard tries one event of another order (outside its
//!   slots); if that event's first attempt fails retryably too, the breaker
//!   opens. With no other order to try within one window, the event is
//!   dead-lettered as without a breaker.
//! - **Open**: no new attempt starts ([`Breaker::admit`] waits). Failures
//!   while open, and those of the event's budget before the trip, do not count
//!   toward `--max-attempts`. After the cooldown (doubling after each failed
//!   probe, capped; at least a `Retry-After` the failures carried, capped too)
//!   it is **half-open**: one attempt, the probe, runs. Its success — or any
//!   success — closes it; its retryable failure opens it again.
//!
//! The state lives behind a plain mutex held for a few field updates, never
//! across an await; the closed fast path of [`Breaker::admit`] is one atomic load.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher as _, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use shardline_contract::status::{BreakerReport, BreakerState, PauseCause};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::BreakerPolicy;
use crate::live::unix_ms;

/// Distinct failing orders in the window before it may open.
pub(crate) const MIN_FAILING_ORDERS: usize = 3;

/// Distinct orders that got the same unconfirmed answer, since the last
/// success and within the window, that make it the configuration's.
pub(crate) const CONFIG_ORDERS: usize = 3;

/// How an attempt ended, as far as the breaker cares.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    Success,
    /// The downstream's availability; `first` when it was the event's first
    /// attempt, with the `Retry-After` it carried.
    Failure {
        first: bool,
        retry_after: Option<Duration>,
    },
    /// The downstream's configuration, whatever the event: `error` says what it answered.
    Misconfigured {
        error: String,
    },
    /// An answer that is the configuration's if other orders get it too.
    Refused {
        answer: String,
        error: String,
    },
    /// The event's own fault: says nothing about the downstream.
    Neutral,
}

/// An unconfirmed answer in the window.
#[derive(Debug, Clone)]
struct Refusal {
    at: Instant,
    order: u64,
    answer: String,
}

/// What [`Breaker::judge`] says about an event that used its retryable attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Judgement {
    /// The downstream answered other orders meanwhile: dead-letter the event.
    Poison,
    /// An outage: the event's failures do not count; its budget starts again.
    Outage,
    /// Not known yet: try an event of another order, then ask again.
    Pending,
}

/// One attempt in the window.
#[derive(Debug, Clone, Copy)]
struct Seen {
    at: Instant,
    order: u64,
    failed: bool,
}

/// The latest moment something happened for an order, and the latest for any
/// other order: enough to answer "did another order than X… since T?".
#[derive(Debug, Clone, Copy, Default)]
struct LastTwo {
    latest: Option<(Instant, u64)>,
    other: Option<(Instant, u64)>,
}

impl LastTwo {
    fn note(&mut self, at: Instant, order: u64) {
        match self.latest {
            Some((_, o)) if o == order => {}
            previous => self.other = previous,
        }
        self.latest = Some((at, order));
    }

    /// Whether an order other than `order` had one at or after `since`.
    fn other_than_since(&self, order: u64, since: Instant) -> bool {
        [self.latest, self.other]
            .into_iter()
            .flatten()
            .any(|(at, o)| o != order && at >= since)
    }
}

/// A state change, for the log line and the metrics.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Transition {
    pub(crate) to: BreakerState,
    pub(crate) reason: String,
    /// Open: when the probe may run.
    pub(crate) probe_in: Option<Duration>,
    /// Closed: how long calls were paused.
    pub(crate) paused_for: Option<Duration>,
    /// Opened from closed (a new epoch), not again after a failed probe.
    pub(crate) trip: bool,
    /// Why calls are paused (open and half-open).
    pub(crate) cause: PauseCause,
}

/// The breaker's rules on an explicit clock, without I/O: unit-tested as is.
#[derive(Debug)]
pub(crate) struct Core {
    policy: BreakerPolicy,
    recent: VecDeque<Seen>,
    failures: usize,
    failing_orders: HashMap<u64, usize>,
    /// Unconfirmed answers since the last success, within the window.
    refusals: VecDeque<Refusal>,
    state: BreakerState,
    /// Why calls are paused, or were last.
    cause: PauseCause,
    /// Open or half-open since (calls paused since).
    paused_since: Option<Instant>,
    /// Open: when it turns half-open.
    probe_at: Instant,
    /// Half-open: the probe is out.
    probing: bool,
    cooldown: Duration,
    /// Times it opened from closed.
    epoch: u64,
    successes: LastTwo,
    first_failures: LastTwo,
    reason: String,
    /// Time calls were paused, over the pauses that ended.
    paused_before: Duration,
}

impl Core {
    pub(crate) fn new(policy: BreakerPolicy, now: Instant) -> Self {
        Self {
            cooldown: policy.cooldown,
            policy,
            recent: VecDeque::new(),
            failures: 0,
            failing_orders: HashMap::new(),
            refusals: VecDeque::new(),
            state: BreakerState::Closed,
            cause: PauseCause::Outage,
            paused_since: None,
            probe_at: now,
            probing: false,
            epoch: 0,
            successes: LastTwo::default(),
            first_failures: LastTwo::default(),
            reason: String::new(),
            paused_before: Duration::ZERO,
        }
    }

    #[cfg(test)]
    pub(crate) fn state(&self) -> BreakerState {
        self.state
    }

    #[cfg(test)]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether an attempt may start now (`Some(probe)`), else until when to
    /// wait (`Err(None)`: until the probe ends).
    pub(crate) fn admit(
        &mut self,
        now: Instant,
    ) -> (Result<bool, Option<Instant>>, Option<Transition>) {
        match self.state {
            BreakerState::Closed => (Ok(false), None),
            BreakerState::Open if now >= self.probe_at => {
                self.state = BreakerState::HalfOpen;
                self.probing = true;
                let t = Transition {
                    to: BreakerState::HalfOpen,
                    reason: "cooldown over: one probe call".into(),
                    probe_in: None,
                    paused_for: None,
                    trip: false,
                    cause: self.cause,
                };
                (Ok(true), Some(t))
            }
            BreakerState::Open => (Err(Some(self.probe_at)), None),
            BreakerState::HalfOpen if !self.probing => {
                self.probing = true;
                (Ok(true), None)
            }
            BreakerState::HalfOpen => (Err(None), None),
        }
    }

    /// The probe ended without a verdict (a permanent failure, or abandoned):
    /// the next attempt probes.
    pub(crate) fn probe_inconclusive(&mut self) {
        if self.state == BreakerState::HalfOpen {
            self.probing = false;
        }
    }

    /// An attempt of `order` ended. `probe` when it was the half-open probe.
    pub(crate) fn record(
        &mut self,
        now: Instant,
        order: u64,
        verdict: Verdict,
        probe: bool,
    ) -> Option<Transition> {
        self.prune(now);
        match verdict {
            Verdict::Neutral => {
                if probe {
                    self.probe_inconclusive();
                }
                None
            }
            Verdict::Success => {
                self.successes.note(now, order);
                self.refusals.clear();
                self.push(Seen {
                    at: now,
                    order,
                    failed: false,
                });
                (self.state != BreakerState::Closed).then(|| {
                    let reason = if probe {
                        "the probe call succeeded"
                    } else {
                        "a call succeeded"
                    };
                    self.close(now, reason)
                })
            }
            Verdict::Failure { first, retry_after } => {
                if first {
                    self.first_failures.note(now, order);
                }
                self.push(Seen {
                    at: now,
                    order,
                    failed: true,
                });
                match self.state {
                    BreakerState::Closed if self.tripped() => {
                        let reason = format!(
                            "{} of the last {} calls failed retryably, across {} orders, within {}",
                            self.failures,
                            self.recent.len(),
                            self.failing_orders.len(),
                            humantime::format_duration(self.policy.window)
                        );
                        Some(self.open(now, PauseCause::Outage, reason, retry_after))
                    }
                    BreakerState::HalfOpen if probe => {
                        let reason = "the probe call failed".into();
                        Some(self.reopen(now, reason, retry_after))
                    }
                    _ => None,
                }
            }
            Verdict::Misconfigured { error } => match self.state {
                BreakerState::Closed => {
                    let reason = format!("the downstream's configuration: {error}");
                    Some(self.open(now, PauseCause::Configuration, reason, None))
                }
                BreakerState::HalfOpen if probe => {
                    let reason = format!("the probe call: {error}");
                    Some(self.reopen(now, reason, None))
                }
                _ => None,
            },
            Verdict::Refused { answer, error } => {
                self.refusals.push_back(Refusal {
                    at: now,
                    order,
                    answer,
                });
                let orders = self.refusing_orders();
                let confirmed = orders >= CONFIG_ORDERS;
                let reason = || {
                    format!(
                        "the downstream's configuration: {error}, the same answer for {orders} orders since the last success"
                    )
                };
                match self.state {
                    BreakerState::Closed if confirmed => {
                        Some(self.open(now, PauseCause::Configuration, reason(), None))
                    }
                    BreakerState::HalfOpen
                        if probe && (confirmed || self.cause == PauseCause::Configuration) =>
                    {
                        self.cause = PauseCause::Configuration;
                        Some(self.reopen(now, reason(), None))
                    }
                    BreakerState::HalfOpen if probe => {
                        self.probe_inconclusive();
                        None
                    }
                    _ => None,
                }
            }
        }
    }

    /// Distinct orders that got the latest unconfirmed answer, since the last
    /// success and within the window.
    fn refusing_orders(&self) -> usize {
        let Some(latest) = self.refusals.back() else {
            return 0;
        };
        let orders: std::collections::HashSet<u64> = self
            .refusals
            .iter()
            .filter(|r| r.answer == latest.answer)
            .map(|r| r.order)
            .collect();
        orders.len()
    }

    /// An event of `order` used its retryable attempts; its budget began at
    /// `budget_since` (breaker epoch `budget_epoch`), it asked at `asked_at`.
    pub(crate) fn judge(
        &mut self,
        now: Instant,
        order: u64,
        budget_since: Instant,
        budget_epoch: u64,
        asked_at: Instant,
    ) -> (Judgement, Option<Transition>) {
        if self.state != BreakerState::Closed || self.epoch != budget_epoch {
            return (Judgement::Outage, None);
        }
        if self.successes.other_than_since(order, budget_since) {
            return (Judgement::Poison, None);
        }
        if self.first_failures.other_than_since(order, asked_at) {
            let reason = "an event of another order failed too, and no call succeeded since".into();
            let opened = self.open(now, PauseCause::Outage, reason, None);
            return (Judgement::Outage, Some(opened));
        }
        (Judgement::Pending, None)
    }

    /// Opens from the fleet's state: another worker's breaker is open, for `cause`.
    pub(crate) fn open_from_fleet(
        &mut self,
        now: Instant,
        cause: PauseCause,
        reason: String,
    ) -> Option<Transition> {
        (self.state == BreakerState::Closed).then(|| self.open(now, cause, reason, None))
    }

    /// The report for the worker's status document.
    pub(crate) fn report(&self, now: Instant, trips: u64) -> BreakerReport {
        BreakerReport {
            state: self.state,
            since_ms: self.paused_since.map(|since| {
                unix_ms().saturating_sub(millis(now.saturating_duration_since(since)))
            }),
            reason: self.reason.clone(),
            trips,
            cause: self.cause,
        }
    }

    /// How long calls have been paused, if they are.
    pub(crate) fn paused_for(&self, now: Instant) -> Option<Duration> {
        self.paused_since
            .map(|since| now.saturating_duration_since(since))
    }

    /// Time calls were paused in all, the pause now included: the gates'
    /// graces are extended by it.
    pub(crate) fn paused_total(&self, now: Instant) -> Duration {
        self.paused_before + self.paused_for(now).unwrap_or_default()
    }

    fn tripped(&self) -> bool {
        let attempts = self.recent.len();
        self.failures >= usize::try_from(self.policy.min_failures.max(1)).unwrap_or(usize::MAX)
            && self.failures as f64 >= self.policy.failure_ratio * attempts as f64
            && self.failing_orders.len() >= MIN_FAILING_ORDERS
    }

    /// A failed probe: open again, the cooldown doubled (capped).
    fn reopen(
        &mut self,
        now: Instant,
        reason: String,
        retry_after: Option<Duration>,
    ) -> Transition {
        self.cooldown = (self.cooldown * 2).min(self.policy.cooldown_max);
        self.open(now, self.cause, reason, retry_after)
    }

    fn open(
        &mut self,
        now: Instant,
        cause: PauseCause,
        reason: String,
        retry_after: Option<Duration>,
    ) -> Transition {
        let trip = self.state == BreakerState::Closed;
        if trip {
            self.epoch += 1;
            self.cooldown = self.policy.cooldown;
            self.paused_since = Some(now);
        }
        self.cause = cause;
        self.state = BreakerState::Open;
        self.probing = false;
        let hinted = retry_after.map_or(Duration::ZERO, |d| d.min(self.policy.cooldown_max));
        let wait = self.cooldown.max(hinted);
        self.probe_at = now + wait;
        self.reason.clone_from(&reason);
        Transition {
            to: BreakerState::Open,
            reason,
            probe_in: Some(wait),
            paused_for: None,
            trip,
            cause,
        }
    }

    fn close(&mut self, now: Instant, reason: &str) -> Transition {
        let paused_for = self.paused_for(now);
        self.paused_before += paused_for.unwrap_or_default();
        self.state = BreakerState::Closed;
        self.paused_since = None;
        self.probing = false;
        self.cooldown = self.policy.cooldown;
        // A fresh window: the outage's failures must not trip it again.
        self.recent.clear();
        self.failures = 0;
        self.failing_orders.clear();
        self.refusals.clear();
        self.reason = reason.to_owned();
        Transition {
            to: BreakerState::Closed,
            reason: reason.to_owned(),
            probe_in: None,
            paused_for,
            trip: false,
            cause: self.cause,
        }
    }

    fn push(&mut self, seen: Seen) {
        if seen.failed {
            self.failures += 1;
            *self.failing_orders.entry(seen.order).or_default() += 1;
        }
        self.recent.push_back(seen);
    }

    fn prune(&mut self, now: Instant) {
        while let Some(oldest) = self.recent.front()
            && now.saturating_duration_since(oldest.at) > self.policy.window
        {
            if oldest.failed {
                self.failures -= 1;
                if let Some(n) = self.failing_orders.get_mut(&oldest.order) {
                    *n -= 1;
                    if *n == 0 {
                        self.failing_orders.remove(&oldest.order);
                    }
                }
            }
            self.recent.pop_front();
        }
        while let Some(oldest) = self.refusals.front()
            && now.saturating_duration_since(oldest.at) > self.policy.window
        {
            self.refusals.pop_front();
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The breaker's metric handles (registered in `metrics.rs`).
#[derive(Debug, Clone, Default)]
pub(crate) struct BreakerMetrics {
    /// 0 closed, 1 open, 2 half-open.
    pub(crate) state: Gauge,
    pub(crate) trips: Counter,
    /// Seconds calls were paused, summed over the pauses that ended.
    pub(crate) paused_seconds: Counter<f64, AtomicU64>,
    /// 1 while calls are paused for the downstream's configuration.
    pub(crate) misconfigured: Gauge,
}

/// The worker's breaker, shared by its shards.
#[derive(Debug)]
pub(crate) struct Breaker {
    core: Mutex<Core>,
    /// False while open or half-open: the closed fast path of [`Breaker::admit`].
    closed: AtomicBool,
    /// `true` while calls are paused (open or half-open): the gates stop
    /// their clocks meanwhile.
    paused: watch::Sender<bool>,
    /// Bumped on every change, and on every recorded attempt while a judge
    /// waits: wakes waiting attempts and judges.
    changes: watch::Sender<u64>,
    /// Judges waiting: only then does a recorded attempt wake anyone.
    judging: AtomicUsize,
    hasher: RandomState,
    metrics: BreakerMetrics,
    /// Mirrors of the core's epoch and ended pauses, read per event without
    /// the lock (updated with the transitions, in `apply`).
    epoch: AtomicU64,
    ended_pauses_ns: AtomicU64,
    window: Duration,
}

/// An admitted attempt: whether it is the probe. Dropped without
/// [`Breaker::record`] (the attempt was abandoned), a probe frees the way for
/// the next one.
pub(crate) struct Permit<'a> {
    breaker: &'a Breaker,
    probe: bool,
    order: u64,
    recorded: bool,
}

impl Permit<'_> {
    /// The attempt ended with `verdict`.
    pub(crate) fn record(mut self, verdict: Verdict) {
        self.recorded = true;
        self.breaker.record(self.order, verdict, self.probe);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe && !self.recorded {
            self.breaker.with_core(|core| core.probe_inconclusive());
            self.breaker.bump();
        }
    }
}

impl Breaker {
    pub(crate) fn new(policy: BreakerPolicy, metrics: BreakerMetrics) -> Arc<Self> {
        Arc::new(Self {
            window: policy.window,
            epoch: AtomicU64::new(0),
            ended_pauses_ns: AtomicU64::new(0),
            core: Mutex::new(Core::new(policy, Instant::now())),
            closed: AtomicBool::new(true),
            paused: watch::channel(false).0,
            changes: watch::channel(0).0,
            judging: AtomicUsize::new(0),
            hasher: RandomState::new(),
            metrics,
        })
    }

    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut core)
    }

    /// The order's key as the window counts it.
    pub(crate) fn order_of(&self, order_key: &str) -> u64 {
        self.hasher.hash_one(order_key)
    }

    /// Whether calls are paused now (open or half-open).
    pub(crate) fn is_paused(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }

    /// Follows [`Breaker::is_paused`].
    pub(crate) fn paused(&self) -> watch::Receiver<bool> {
        self.paused.subscribe()
    }

    /// Times it opened from closed: an event's budget that began in an
    /// earlier epoch was spent (partly) on an outage.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Waits until an attempt of `order_key` may start.
    pub(crate) async fn admit(&self, order_key: &str) -> Permit<'_> {
        let order = self.order_of(order_key);
        let permit = |probe| Permit {
            breaker: self,
            probe,
            order,
            recorded: false,
        };
        if !self.is_paused() {
            return permit(false);
        }
        let mut changes = self.changes.subscribe();
        loop {
            changes.borrow_and_update();
            let (decision, transition) = self.with_core(|core| core.admit(Instant::now()));
            self.apply(transition);
            match decision {
                Ok(probe) => return permit(probe),
                Err(Some(until)) => {
                    tokio::select! {
                        _ = changes.changed() => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                }
                // The sender lives as long as `self`.
                Err(None) => _ = changes.changed().await,
            }
        }
    }

    fn record(&self, order: u64, verdict: Verdict, probe: bool) {
        let transition = self.with_core(|core| core.record(Instant::now(), order, verdict, probe));
        let changed = transition.is_some();
        self.apply(transition);
        if !changed && self.judging.load(Ordering::Acquire) > 0 {
            self.bump();
        }
    }

    fn bump(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Follows every change, and while a judge waits ([`Breaker::judging`])
    /// every recorded attempt.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Marks a judge waiting until the guard drops: recorded attempts then
    /// wake [`Breaker::changes`] receivers.
    pub(crate) fn judging(&self) -> Judging<'_> {
        self.judging.fetch_add(1, Ordering::AcqRel);
        Judging(&self.judging)
    }

    /// The verdict now on an event of `order_key` whose retryable attempts
    /// are used up (its budget began at `budget_since`, in breaker epoch
    /// `budget_epoch`); it asked at `asked_at`.
    pub(crate) fn judge(
        &self,
        order_key: &str,
        budget_since: Instant,
        budget_epoch: u64,
        asked_at: Instant,
    ) -> Judgement {
        let order = self.order_of(order_key);
        let (judgement, transition) = self.with_core(|core| {
            core.judge(Instant::now(), order, budget_since, budget_epoch, asked_at)
        });
        self.apply(transition);
        judgement
    }

    /// Time calls were paused in all, the pause now included.
    pub(crate) fn paused_total(&self) -> Duration {
        if self.is_paused() {
            self.with_core(|core| core.paused_total(Instant::now()))
        } else {
            Duration::from_nanos(self.ended_pauses_ns.load(Ordering::Acquire))
        }
    }

    /// How long an event that used its attempts waits for evidence: one window.
    pub(crate) fn evidence_wait(&self) -> Duration {
        self.window
    }

    /// Starts open when the fleet's breaker is (another worker's status
    /// document says so): a worker restarted during an outage does not
    /// rediscover it with its events' budgets.
    pub(crate) fn open_from_fleet(&self, cause: PauseCause, reason: String) {
        let transition = self.with_core(|core| core.open_from_fleet(Instant::now(), cause, reason));
        self.apply(transition);
    }

    /// The state for the worker's status document.
    pub(crate) fn report(&self) -> BreakerReport {
        let trips = self.metrics.trips.get();
        self.with_core(|core| core.report(Instant::now(), trips))
    }

    /// Logs and counts a state change, and tells whoever waits.
    fn apply(&self, transition: Option<Transition>) {
        let Some(t) = transition else { return };
        let paused = t.to != BreakerState::Closed;
        self.closed.store(!paused, Ordering::Release);
        self.paused.send_if_modified(|was| {
            let changed = *was != paused;
            *was = paused;
            changed
        });
        self.metrics.state.set(i64::from(t.to.value()));
        let misconfigured = paused && t.cause == PauseCause::Configuration;
        self.metrics.misconfigured.set(i64::from(misconfigured));
        match t.to {
            BreakerState::Open => {
                if t.trip {
                    self.metrics.trips.inc();
                    self.epoch.fetch_add(1, Ordering::AcqRel);
                }
                let probe_in = t.probe_in.unwrap_or_default();
                if misconfigured {
                    tracing::error!(reason = %t.reason, probe_in = ?probe_in, "downstream misconfigured: calls paused on every shard until it answers 2xx");
                } else {
                    tracing::warn!(reason = %t.reason, probe_in = ?probe_in, "downstream breaker open: calls paused on every shard");
                }
            }
            BreakerState::HalfOpen => {
                tracing::info!(reason = %t.reason, "downstream breaker half-open");
            }
            BreakerState::Closed => {
                let paused_for = t.paused_for.unwrap_or_default();
                self.metrics.paused_seconds.inc_by(paused_for.as_secs_f64());
                self.ended_pauses_ns
                    .fetch_add(nanos(paused_for), Ordering::AcqRel);
                tracing::info!(reason = %t.reason, paused_for = ?paused_for, "downstream breaker closed: calls resume");
            }
        }
        self.bump();
    }
}

/// A judge waiting; see [`Breaker::judging`].
pub(crate) struct Judging<'a>(&'a AtomicUsize);

impl Drop for Judging<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> BreakerPolicy {
        BreakerPolicy::default()
    }

    fn fail() -> Verdict {
        Verdict::Failure {
            first: true,
            retry_after: None,
        }
    }

    fn retry_fail() -> Verdict {
        Verdict::Failure {
            first: false,
            retry_after: None,
        }
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn failures_across_several_orders_open_it() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        let mut opened = None;
        for i in 0..10_u64 {
            if let Some(t) = core.record(t0 + MS * i as u32, i % 4, fail(), false) {
                opened.get_or_insert((i, t));
            }
        }
        let (at, t) = opened.expect("opens");
        assert_eq!(at, 4, "the fifth failure (min_failures) opens it");
        assert_eq!(t.to, BreakerState::Open);
        assert_eq!(core.epoch(), 1);
    }

    #[test]
    fn one_order_failing_never_opens_it() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        for i in 0..100_u32 {
            assert_eq!(core.record(t0 + MS * i, 7, retry_fail(), false), None);
        }
        // Two poison orders do not either.
        for i in 0..100_u32 {
            assert_eq!(core.record(t0 + MS * i, 8, retry_fail(), false), None);
        }
        assert_eq!(core.state(), BreakerState::Closed);
    }

    #[test]
    fn successes_keep_it_closed_below_the_ratio() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        for i in 0..200_u32 {
            let verdict = if i % 3 == 0 { fail() } else { Verdict::Success };
            assert_eq!(core.record(t0 + MS * i, u64::from(i), verdict, false), None);
        }
    }

    #[test]
    fn old_failures_leave_the_window() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        for i in 0..4_u64 {
            core.record(t0, i, fail(), false);
        }
        let later = t0 + policy().window + MS;
        assert_eq!(
            core.record(later, 5, fail(), false),
            None,
            "only one failure is recent"
        );
    }

    fn open_core(t0: Instant) -> Core {
        let mut core = Core::new(policy(), t0);
        for i in 0..5_u64 {
            core.record(t0, i, fail(), false);
        }
        assert_eq!(core.state(), BreakerState::Open);
        core
    }

    #[test]
    fn cooldown_then_one_probe_whose_success_closes_it() {
        let t0 = Instant::now();
        let mut core = open_core(t0);
        let cooldown = policy().cooldown;
        assert_eq!(core.admit(t0).0, Err(Some(t0 + cooldown)));
        let (probe, t) = core.admit(t0 + cooldown);
        assert_eq!(probe, Ok(true));
        assert_eq!(t.map(|t| t.to), Some(BreakerState::HalfOpen));
        assert_eq!(
            core.admit(t0 + cooldown).0,
            Err(None),
            "one probe at a time"
        );
        let closed = core.record(t0 + cooldown * 2, 99, Verdict::Success, true);
        let closed = closed.expect("closes");
        assert_eq!(closed.to, BreakerState::Closed);
        assert_eq!(closed.paused_for, Some(cooldown * 2));
        assert_eq!(core.admit(t0 + cooldown * 2).0, Ok(false));
    }

    #[test]
    fn failed_probes_double_the_cooldown_up_to_the_cap() {
        let t0 = Instant::now();
        let mut core = open_core(t0);
        let p = policy();
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let Err(Some(at)) = core.admit(now).0 else {
                panic!("open")
            };
            now = at;
            assert_eq!(core.admit(now).0, Ok(true));
            let t = core.record(now, 1, fail(), true).expect("reopens");
            waits.push(t.probe_in.unwrap_or_default());
        }
        assert_eq!(waits[0], p.cooldown * 2);
        assert!(waits.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*waits.last().unwrap_or(&Duration::ZERO), p.cooldown_max);
        assert_eq!(core.epoch(), 1, "a failed probe is not a new trip");
    }

    #[test]
    fn retry_after_lengthens_the_wait_within_the_cap() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        let mut last = None;
        for i in 0..5_u64 {
            let verdict = Verdict::Failure {
                first: true,
                retry_after: Some(Duration::from_secs(3600)),
            };
            last = core.record(t0, i, verdict, false).or(last);
        }
        assert_eq!(last.and_then(|t| t.probe_in), Some(policy().cooldown_max));
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_attempt_probe() {
        let t0 = Instant::now();
        let mut core = open_core(t0);
        let at = t0 + policy().cooldown;
        assert_eq!(core.admit(at).0, Ok(true));
        core.probe_inconclusive();
        assert_eq!(core.admit(at).0, Ok(true));
        // A permanent failure of the probe says nothing either.
        assert_eq!(core.record(at, 3, Verdict::Neutral, true), None);
        assert_eq!(core.admit(at).0, Ok(true));
    }

    #[test]
    fn judge_tells_poison_from_outage() {
        let t0 = Instant::now();
        let later = t0 + MS * 100;
        // Another order succeeded since the budget began: poison.
        let mut core = Core::new(policy(), t0);
        core.record(t0 + MS, 2, Verdict::Success, false);
        assert_eq!(core.judge(later, 1, t0, 0, later).0, Judgement::Poison);
        // Only its own order succeeded (an earlier event): still pending.
        let mut core = Core::new(policy(), t0);
        core.record(t0 + MS, 1, Verdict::Success, false);
        assert_eq!(core.judge(later, 1, t0, 0, later).0, Judgement::Pending);
        // Another order's first attempt failed after it asked: outage, opened.
        let (j, t) = core.judge(later, 1, t0, 0, later);
        assert_eq!((j, t), (Judgement::Pending, None));
        core.record(later + MS, 2, fail(), false);
        let (j, t) = core.judge(later + MS, 1, t0, 0, later);
        assert_eq!(j, Judgement::Outage);
        assert_eq!(t.map(|t| t.to), Some(BreakerState::Open));
        // A budget from before a trip: outage even once closed again.
        let at = later + policy().cooldown * 4;
        assert_eq!(core.admit(at).0, Ok(true), "the probe");
        core.record(at, 3, Verdict::Success, true);
        assert_eq!(core.state(), BreakerState::Closed);
        assert_eq!(core.judge(at, 1, t0, 0, at).0, Judgement::Outage);
    }

    #[test]
    fn a_retry_of_another_order_is_no_evidence() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        core.record(t0 + MS, 2, retry_fail(), false);
        assert_eq!(core.judge(t0 + MS, 1, t0, 0, t0).0, Judgement::Pending);
    }

    fn refused(answer: &str) -> Verdict {
        Verdict::Refused {
            answer: answer.into(),
            error: format!("downstream answered {answer} (POST http://h/events)"),
        }
    }

    #[test]
    fn events_own_faults_never_open_it_whatever_the_orders() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        for i in 0..200_u32 {
            assert_eq!(
                core.record(t0 + MS * i, u64::from(i), Verdict::Neutral, false),
                None
            );
        }
        assert_eq!(core.state(), BreakerState::Closed);
        assert_eq!(
            core.judge(t0 + MS * 300, 1, t0, 0, t0).0,
            Judgement::Pending
        );
    }

    #[test]
    fn a_redirect_pauses_at_once_for_the_configuration_and_a_success_resumes() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        let error = "downstream answered 302, a redirect to http://h/landed".to_owned();
        let t = core
            .record(t0, 1, Verdict::Misconfigured { error }, false)
            .expect("opens on one answer of one order");
        assert_eq!(
            (t.to, t.cause, t.trip),
            (BreakerState::Open, PauseCause::Configuration, true)
        );
        assert!(t.reason.contains("http://h/landed"), "{}", t.reason);
        assert_eq!(core.report(t0, 1).cause, PauseCause::Configuration);
        // The probe is redirected again: open again, the cooldown doubled.
        let at = t0 + policy().cooldown;
        assert_eq!(core.admit(at).0, Ok(true));
        let error = "downstream answered 302".to_owned();
        let again = core
            .record(at, 2, Verdict::Misconfigured { error }, true)
            .expect("reopens");
        assert_eq!(again.probe_in, Some(policy().cooldown * 2));
        assert!(!again.trip);
        // Fixed: the next probe succeeds and closes it.
        let at = at + policy().cooldown * 2;
        assert_eq!(core.admit(at).0, Ok(true));
        let closed = core.record(at, 3, Verdict::Success, true).expect("closes");
        assert_eq!(closed.to, BreakerState::Closed);
        assert_eq!(core.epoch(), 1);
    }

    #[test]
    fn the_same_refusal_for_three_orders_is_the_configurations() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        // One order, again and again: the event's, whatever the count.
        for i in 0..20_u32 {
            assert_eq!(core.record(t0 + MS * i, 1, refused("401"), false), None);
        }
        assert_eq!(core.record(t0 + MS * 30, 2, refused("401"), false), None);
        // A different answer of a third order is no confirmation.
        assert_eq!(core.record(t0 + MS * 31, 3, refused("404"), false), None);
        let t = core
            .record(t0 + MS * 32, 4, refused("401"), false)
            .expect("the third order with 401 confirms it");
        assert_eq!(
            (t.to, t.cause),
            (BreakerState::Open, PauseCause::Configuration)
        );
        assert!(
            t.reason.contains("downstream answered 401") && t.reason.contains("3 orders"),
            "{}",
            t.reason
        );
    }

    #[test]
    fn a_success_or_the_window_makes_refusals_the_events() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        core.record(t0, 1, refused("404"), false);
        core.record(t0 + MS, 2, refused("404"), false);
        // Another order succeeds: the downstream is configured; the two were the events'.
        core.record(t0 + MS * 2, 9, Verdict::Success, false);
        assert_eq!(core.record(t0 + MS * 3, 3, refused("404"), false), None);
        assert_eq!(
            core.judge(t0 + MS * 4, 1, t0, 0, t0 + MS * 4).0,
            Judgement::Poison
        );
        // Refusals older than the window are forgotten.
        let late = t0 + policy().window + MS * 10;
        assert_eq!(core.record(late, 4, refused("404"), false), None);
        assert_eq!(core.record(late + MS, 5, refused("404"), false), None);
        assert_eq!(core.state(), BreakerState::Closed);
    }

    #[test]
    fn refusals_are_no_outage_evidence() {
        let t0 = Instant::now();
        let mut core = Core::new(policy(), t0);
        core.record(t0 + MS, 2, refused("403"), false);
        assert_eq!(core.judge(t0 + MS, 1, t0, 0, t0).0, Judgement::Pending);
        // And refusals from many orders do not count as failures for an outage.
        for i in 10..20_u64 {
            core.record(t0 + MS * 2, i, refused(&i.to_string()), false);
        }
        assert_eq!(core.state(), BreakerState::Closed);
    }

    #[test]
    fn a_refused_probe_of_an_outage_is_inconclusive_unless_confirmed() {
        let t0 = Instant::now();
        let mut core = open_core(t0);
        let at = t0 + policy().cooldown;
        assert_eq!(core.admit(at).0, Ok(true));
        assert_eq!(core.record(at, 7, refused("401"), true), None);
        assert_eq!(core.admit(at).0, Ok(true), "the next attempt probes");
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_attempts_resume_when_the_probe_succeeds() {
        let breaker = Breaker::new(policy(), BreakerMetrics::default());
        for i in 0..5 {
            breaker.admit(&format!("o{i}")).await.record(fail());
        }
        assert!(breaker.is_paused());
        let mut paused = breaker.paused();
        let waiter = {
            let breaker = Arc::clone(&breaker);
            tokio::spawn(async move {
                let permit = breaker.admit("w").await;
                let probe = permit.probe;
                permit.record(Verdict::Success);
                probe
            })
        };
        let other = {
            let breaker = Arc::clone(&breaker);
            tokio::spawn(async move {
                let permit = breaker.admit("x").await;
                let probe = permit.probe;
                drop(permit);
                probe
            })
        };
        let (a, b) = (waiter.await.ok(), other.await.ok());
        assert_eq!(
            [a, b].iter().filter(|p| **p == Some(true)).count(),
            1,
            "exactly one probe"
        );
        assert!(!breaker.is_paused());
        assert!(paused.has_changed().unwrap_or(false));
        assert!(!*paused.borrow_and_update());
        assert_eq!(breaker.metrics.trips.get(), 1);
        assert!(breaker.metrics.paused_seconds.get() >= policy().cooldown.as_secs_f64());
    }
}
