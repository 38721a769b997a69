//! Each shard's live state: where its consumer is, the event in flight, the
//! events the gate holds. Written by the shard's task, read by scrapes
//! (`metrics.rs`), the status writer (`status.rs`), `/readyz` and
//! [`crate::Progress`]. Ages come from one monotonic clock anchored to the wall
//! clock once. An event's age counts from its [`Stamp`]: the broker's, when
//! it stamps messages itself, else the publisher's claim (labelled as such),
//! never later than the worker received it (docs/semantics.md §5).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use shardline_contract::ShardId;
use shardline_contract::headers;
use shardline_contract::status::{HeldRef, StampSource};

/// Where a shard's consumer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShardState {
    /// Not started, or stopped (connection lost, worker stopping).
    Idle = 0,
    /// Another consumer holds the shard; retrying.
    StandingBy = 1,
    /// This worker consumes the shard.
    Consuming = 2,
    /// Registered on a single-active-consumer queue, where the broker picks the
    /// active consumer without telling it: consuming from the first delivery.
    Registered = 3,
}

impl ShardState {
    /// This worker consumes the shard (or, on single-active-consumer queues,
    /// is registered to).
    pub fn is_consuming(self) -> bool {
        matches!(self, Self::Consuming | Self::Registered)
    }
}

/// A shard's live state, written by its task and read by scrapes, the status
/// writer and `/readyz`. Times are unix milliseconds, 0 for none.
#[derive(Debug)]
pub(crate) struct ShardWatch {
    pub(crate) shard: ShardId,
    state: AtomicU8,
    /// This worker should consume the shard (always, with a fixed `--assign`;
    /// as the elastic fleet's assignment says, with `--assign auto`).
    assigned: AtomicBool,
    /// Monotonic nanoseconds (see [`Clock`]) when the in-flight event was taken.
    inflight_since_ns: AtomicU64,
    /// When the in-flight event was published (the oldest of them).
    inflight_published: AtomicStamp,
    /// Handler calls in flight (retry backoff included).
    inflight: AtomicU64,
    /// Events taken and not started: waiting for their order or a slot.
    waiting: AtomicU64,
    /// When the oldest waiting event was published.
    waiting_oldest: AtomicStamp,
    held: AtomicU64,
    /// Bytes of event bodies held decoded: held, read ahead, waiting to run
    /// (`--max-held-bytes`).
    held_bytes: AtomicU64,
    /// When the oldest held event was published.
    held_oldest: AtomicStamp,
    /// Which events the gate holds (for the status in Redis).
    held_refs: Mutex<Vec<HeldRef>>,
    /// Events forwarded from the shard's queues (resharding, old routing).
    forwarded: AtomicU64,
}

impl ShardWatch {
    pub(crate) fn new(shard: ShardId) -> Arc<Self> {
        Arc::new(Self {
            shard,
            state: AtomicU8::new(ShardState::Idle as u8),
            assigned: AtomicBool::new(true),
            inflight_since_ns: AtomicU64::new(0),
            inflight_published: AtomicStamp::default(),
            inflight: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            waiting_oldest: AtomicStamp::default(),
            held: AtomicU64::new(0),
            held_bytes: AtomicU64::new(0),
            held_oldest: AtomicStamp::default(),
            held_refs: Mutex::default(),
            forwarded: AtomicU64::new(0),
        })
    }

    /// An event of the shard's queues was forwarded.
    pub(crate) fn count_forward(&self) {
        self.forwarded.fetch_add(1, Ordering::Relaxed);
    }

    /// Events forwarded from the shard's queues so far.
    pub(crate) fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    pub(crate) fn set_state(&self, state: ShardState) {
        self.state.store(state as u8, Ordering::Relaxed);
        if !state.is_consuming() {
            self.clear_inflight();
            self.set_waiting(0, None);
            self.set_held(0, None);
            self.set_held_bytes(0);
            self.set_held_refs(Vec::new());
        }
    }

    /// Whether this worker should consume the shard now.
    pub(crate) fn is_assigned(&self) -> bool {
        self.assigned.load(Ordering::Relaxed)
    }

    pub(crate) fn set_assigned(&self, assigned: bool) {
        self.assigned.store(assigned, Ordering::Relaxed);
    }

    pub(crate) fn state(&self) -> ShardState {
        match self.state.load(Ordering::Relaxed) {
            1 => ShardState::StandingBy,
            2 => ShardState::Consuming,
            3 => ShardState::Registered,
            _ => ShardState::Idle,
        }
    }

    /// The shard's task starts working on an event published at `published`.
    pub(crate) fn start_inflight(&self, published: Stamp) {
        self.set_inflight(1, CLOCK.now_ns(), published);
    }

    /// A started event ran at monotonic `since_ns` ([`ShardWatch::now_ns`]).
    /// `count` calls are in flight, the oldest taken at `since_ns`, the oldest
    /// published at `published`.
    pub(crate) fn set_inflight(&self, count: usize, since_ns: u64, published: Stamp) {
        if self.state.load(Ordering::Relaxed) == ShardState::Registered as u8 {
            // Deliveries come only to the active consumer.
            let _ = self.state.compare_exchange(
                ShardState::Registered as u8,
                ShardState::Consuming as u8,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        self.inflight.store(count as u64, Ordering::Relaxed);
        self.inflight_since_ns
            .store(since_ns.max(1), Ordering::Relaxed);
        self.inflight_published.store(Some(published));
    }

    pub(crate) fn clear_inflight(&self) {
        self.inflight.store(0, Ordering::Relaxed);
        self.inflight_since_ns.store(0, Ordering::Relaxed);
        self.inflight_published.store(None);
    }

    /// Now on the watch's monotonic clock, for [`ShardWatch::set_inflight`].
    pub(crate) fn now_ns() -> u64 {
        CLOCK.now_ns()
    }

    /// `waiting` events are taken and not started, the oldest published at
    /// `oldest`.
    pub(crate) fn set_waiting(&self, waiting: usize, oldest: Option<Stamp>) {
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.waiting_oldest.store(oldest);
    }

    pub(crate) fn inflight_elapsed(&self) -> Option<Duration> {
        match self.inflight_since_ns.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_nanos(CLOCK.now_ns().saturating_sub(since))),
        }
    }

    /// The gate holds `held` events, the oldest published at `oldest`.
    pub(crate) fn set_held(&self, held: usize, oldest: Option<Stamp>) {
        self.held.store(held as u64, Ordering::Relaxed);
        self.held_oldest.store(oldest);
    }

    /// Events the gate holds, as last set.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// The shard holds `bytes` of event bodies decoded.
    pub(crate) fn set_held_bytes(&self, bytes: usize) {
        self.held_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    /// Bytes of event bodies held decoded, as last set.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Ordering::Relaxed)
    }

    /// The events the gate holds now, by order and kind.
    pub(crate) fn set_held_refs(&self, refs: Vec<HeldRef>) {
        if let Ok(mut held) = self.held_refs.lock() {
            *held = refs;
        }
    }

    /// The events the gate holds, as last set.
    pub(crate) fn held_refs(&self) -> Vec<HeldRef> {
        self.held_refs
            .lock()
            .map(|held| held.clone())
            .unwrap_or_default()
    }

    /// What the shard looks like at `now_ms`.
    pub(crate) fn snapshot(&self, now_ms: u64) -> Snapshot {
        let head = [
            &self.inflight_published,
            &self.held_oldest,
            &self.waiting_oldest,
        ]
        .into_iter()
        .filter_map(AtomicStamp::load)
        .min();
        Snapshot {
            state: self.state(),
            backlog_age: head.map_or(Duration::ZERO, |stamp| {
                Duration::from_millis(now_ms.saturating_sub(stamp.ms))
            }),
            backlog_source: head.map(|stamp| stamp.source),
            inflight_age: self.inflight_elapsed(),
            inflight: self.inflight.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            held_bytes: self.held_bytes.load(Ordering::Relaxed),
        }
    }
}

/// One shard at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Snapshot {
    pub(crate) state: ShardState,
    /// Age of the oldest unprocessed event (in flight, waiting or held); zero
    /// when none.
    pub(crate) backlog_age: Duration,
    /// What that age counts from; none when there is no backlog.
    pub(crate) backlog_source: Option<StampSource>,
    /// How long the (oldest) in-flight event has been worked on, if there is one.
    pub(crate) inflight_age: Option<Duration>,
    /// Handler calls in flight.
    pub(crate) inflight: u64,
    /// Events waiting for their order (or a slot).
    pub(crate) waiting: u64,
    pub(crate) held: u64,
    pub(crate) held_bytes: u64,
}

/// When an event was published, in unix milliseconds, and who says so.
/// Ordered by time first, so that the oldest of several is their `min`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp {
    pub(crate) ms: u64,
    pub(crate) source: StampSource,
}

impl Stamp {
    /// The worker's own receive time.
    pub(crate) fn received(ms: u64) -> Self {
        Self {
            ms,
            source: StampSource::Received,
        }
    }
}

/// A [`Stamp`] shared between the shard's task and its readers: the time
/// and its source in two atomics (a reader may see one set's time with
/// another's source for an instant; the next read is whole).
#[derive(Debug, Default)]
struct AtomicStamp {
    /// Unix milliseconds, 0 for none.
    ms: AtomicU64,
    source: AtomicU8,
}

impl AtomicStamp {
    fn store(&self, stamp: Option<Stamp>) {
        let (ms, source) = stamp.map_or((0, StampSource::Received), |s| (s.ms, s.source));
        self.source.store(source as u8, Ordering::Relaxed);
        self.ms.store(ms, Ordering::Relaxed);
    }

    fn load(&self) -> Option<Stamp> {
        let ms = self.ms.load(Ordering::Relaxed);
        let source = match self.source.load(Ordering::Relaxed) {
            s if s == StampSource::Broker as u8 => StampSource::Broker,
            s if s == StampSource::Publisher as u8 => StampSource::Publisher,
            _ => StampSource::Received,
        };
        (ms > 0).then_some(Stamp { ms, source })
    }
}

/// Whether this worker's broker overwrites `timestamp_in_ms` on every
/// incoming message, as the stamp probe (`shardline_connect::stamps`) last
/// found on connecting.
static BROKER_STAMPS: AtomicBool = AtomicBool::new(false);

/// Trusts the broker's stamps from now on, or stops trusting them; returns
/// whether they were trusted before.
pub(crate) fn trust_broker_stamps(trusted: bool) -> bool {
    BROKER_STAMPS.swap(trusted, Ordering::Relaxed)
}

/// When a delivery received at `received_ms` was published (see [`stamp`]),
/// trusting the broker's stamps as the probe found.
pub(crate) fn published_ms(properties: &BasicProperties, received_ms: u64) -> Stamp {
    stamp(
        properties,
        received_ms,
        BROKER_STAMPS.load(Ordering::Relaxed),
    )
}

/// When a delivery received at `received_ms` was published: the broker's
/// `timestamp_in_ms` when `broker_stamps` (the probe saw the broker overwrite
/// it), else the publisher's `x-published-at-ms`, else the AMQP `timestamp`
/// (seconds), else `received_ms`. A time later than `received_ms` is not
/// believed (the event was here then; a clock ahead of ours, or a forged
/// stamp, would hide its age) and `received_ms` counts instead: no skew
/// allowance is needed, both times being read on the worker's clock.
pub(crate) fn stamp(properties: &BasicProperties, received_ms: u64, broker_stamps: bool) -> Stamp {
    let millis = |name| {
        headers::header_i64(properties, name)
            .and_then(|ms| u64::try_from(ms).ok())
            .filter(|ms| *ms > 0)
    };
    let broker = broker_stamps
        .then(|| millis(headers::BROKER_TIMESTAMP_MS))
        .flatten()
        .map(|ms| (ms, StampSource::Broker));
    let publisher = || {
        millis(headers::PUBLISHED_AT_MS)
            .or_else(|| properties.timestamp().map(|s| s.saturating_mul(1000)))
            .filter(|ms| *ms > 0)
            .map(|ms| (ms, StampSource::Publisher))
    };
    match broker.or_else(publisher) {
        Some((ms, source)) if ms < received_ms => Stamp { ms, source },
        _ => Stamp::received(received_ms),
    }
}

/// Wall-clock unix milliseconds now.
pub(crate) fn unix_ms() -> u64 {
    CLOCK.unix_ms()
}

/// A monotonic clock anchored to the wall clock once, so that durations never
/// jump and ages need no syscall beyond `Instant::now`.
struct Clock {
    anchor: OnceLock<(Instant, u64)>,
}

static CLOCK: Clock = Clock {
    anchor: OnceLock::new(),
};

impl Clock {
    fn anchor(&self) -> (Instant, u64) {
        *self.anchor.get_or_init(|| {
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            (Instant::now(), unix)
        })
    }

    fn now_ns(&self) -> u64 {
        let (at, _) = self.anchor();
        u64::try_from(at.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn unix_ms(&self) -> u64 {
        let (at, unix) = self.anchor();
        unix + u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_contract::ShardCount;
    use shardline_contract::status::StampSource::{Broker, Publisher, Received};

    fn claimed(ms: u64) -> Stamp {
        Stamp {
            ms,
            source: Publisher,
        }
    }

    #[test]
    fn backlog_is_the_oldest_of_in_flight_and_held() {
        let watch = ShardWatch::new(ShardCount::new(1).unwrap().ids().next().unwrap());
        let now = 1_000_000;
        assert_eq!(watch.snapshot(now).backlog_age, Duration::ZERO);
        assert_eq!(watch.snapshot(now).backlog_source, None);
        watch.start_inflight(Stamp::received(now - 5_000));
        watch.set_held(2, Some(claimed(now - 9_000)));
        let snap = watch.snapshot(now);
        assert_eq!(snap.backlog_age, Duration::from_secs(9));
        assert_eq!(snap.backlog_source, Some(Publisher), "the head's source");
        assert_eq!(snap.held, 2);
        assert!(snap.inflight_age.is_some());
        watch.set_held(0, None);
        let snap = watch.snapshot(now);
        assert_eq!(
            (snap.backlog_age, snap.backlog_source),
            (Duration::from_secs(5), Some(Received))
        );
        watch.set_waiting(3, Some(claimed(now - 7_000)));
        let snap = watch.snapshot(now);
        assert_eq!(
            (snap.backlog_age, snap.waiting),
            (Duration::from_secs(7), 3)
        );
        watch.set_waiting(0, None);
        watch.clear_inflight();
        let snap = watch.snapshot(now);
        assert_eq!(snap.backlog_age, Duration::ZERO);
        assert_eq!(snap.inflight_age, None);
        assert_eq!(snap.backlog_source, None);
    }

    fn with_published_at(ms: i64) -> BasicProperties {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(
            headers::PUBLISHED_AT_MS.into(),
            lapin::types::AMQPValue::LongLongInt(ms),
        );
        BasicProperties::default().with_headers(headers)
    }

    fn with_broker_stamp(props: BasicProperties, ms: i64) -> BasicProperties {
        let mut headers = props.headers().clone().unwrap_or_default();
        headers.insert(
            headers::BROKER_TIMESTAMP_MS.into(),
            lapin::types::AMQPValue::LongLongInt(ms),
        );
        props.with_headers(headers)
    }

    #[test]
    fn publish_time_falls_back_to_timestamp_then_receipt() {
        let received = 1_800_000_000_000;
        let bare = BasicProperties::default();
        assert_eq!(stamp(&bare, 42, false), Stamp::received(42));
        let stamped = BasicProperties::default().with_timestamp(1_700_000_000);
        assert_eq!(stamp(&stamped, received, false), claimed(1_700_000_000_000));
        let props = headers::event_properties(
            "id",
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            &headers::new_traceparent(),
        );
        assert_eq!(stamp(&props, received, false), claimed(1_700_000_000_123));
    }

    #[test]
    fn a_claim_later_than_the_receipt_is_ignored() {
        let received = 1_800_000_000_000;
        for later in [received, received + 1, received + 3_600_000] {
            let props = with_published_at(i64::try_from(later).unwrap());
            assert_eq!(stamp(&props, received, false), Stamp::received(received));
            assert_eq!(stamp(&props, received, true), Stamp::received(received));
        }
        let ahead = BasicProperties::default().with_timestamp(received / 1000 + 60);
        assert_eq!(stamp(&ahead, received, false), Stamp::received(received));
        assert_eq!(
            stamp(&with_published_at(-5), received, false),
            Stamp::received(received),
            "a negative claim is no claim"
        );
    }

    #[test]
    fn a_past_claim_counts_as_the_publishers() {
        let received = 1_800_000_000_000;
        let props = with_published_at(1_700_000_000_000);
        assert_eq!(stamp(&props, received, false), claimed(1_700_000_000_000));
    }

    #[test]
    fn the_brokers_stamp_counts_only_once_the_probe_trusted_it() {
        let received = 1_800_000_000_000;
        let props = with_broker_stamp(with_published_at(1_000), 1_799_999_999_000);
        assert_eq!(
            stamp(&props, received, false),
            claimed(1_000),
            "untrusted, timestamp_in_ms is one more header a publisher can set"
        );
        assert_eq!(
            stamp(&props, received, true),
            Stamp {
                ms: 1_799_999_999_000,
                source: Broker
            },
            "trusted, it beats the publisher's claim"
        );
        let ahead = with_broker_stamp(with_published_at(1_000), 1_800_000_005_000);
        assert_eq!(
            stamp(&ahead, received, true),
            Stamp::received(received),
            "a broker clock ahead of ours counts from the receipt"
        );
        let unstamped = with_published_at(1_000);
        assert_eq!(
            stamp(&unstamped, received, true),
            claimed(1_000),
            "a message the broker did not stamp keeps the publisher's claim"
        );
    }
}
