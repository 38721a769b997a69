//! Each shard's live state: where its consumer is, the event in flight, the
//! events the gate holds. Written by the shard's task, read by scrapes
//! (`metrics.rs`), the status writer (`status.rs`), `/readyz` and
//! [`crate::Progress`]. Ages come from one monotonic clock anchored to the wall
//! clock once.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use shardline_contract::ShardId;
use shardline_contract::headers;
use shardline_contract::status::HeldRef;

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
    inflight_published_ms: AtomicU64,
    /// Handler calls in flight (retry backoff included).
    inflight: AtomicU64,
    /// Events taken and not started: waiting for their order or a slot.
    waiting: AtomicU64,
    /// When the oldest waiting event was published.
    waiting_oldest_ms: AtomicU64,
    held: AtomicU64,
    /// When the oldest held event was published.
    held_oldest_ms: AtomicU64,
    /// Which events the gate holds (for the status in Redis).
    held_refs: Mutex<Vec<HeldRef>>,
}

impl ShardWatch {
    pub(crate) fn new(shard: ShardId) -> Arc<Self> {
        Arc::new(Self {
            shard,
            state: AtomicU8::new(ShardState::Idle as u8),
            assigned: AtomicBool::new(true),
            inflight_since_ns: AtomicU64::new(0),
            inflight_published_ms: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            waiting_oldest_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
            held_oldest_ms: AtomicU64::new(0),
            held_refs: Mutex::default(),
        })
    }

    pub(crate) fn set_state(&self, state: ShardState) {
        self.state.store(state as u8, Ordering::Relaxed);
        if !state.is_consuming() {
            self.clear_inflight();
            self.set_waiting(0, None);
            self.set_held(0, None);
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

    /// The shard's task starts working on an event published at `published_ms`.
    pub(crate) fn start_inflight(&self, published_ms: u64) {
        self.set_inflight(1, CLOCK.now_ns(), published_ms);
    }

    /// A started event ran at monotonic `since_ns` ([`ShardWatch::now_ns`]).
    /// `count` calls are in flight, the oldest taken at `since_ns`, the oldest
    /// published at `published_ms`.
    pub(crate) fn set_inflight(&self, count: usize, since_ns: u64, published_ms: u64) {
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
        self.inflight_published_ms
            .store(published_ms, Ordering::Relaxed);
    }

    pub(crate) fn clear_inflight(&self) {
        self.inflight.store(0, Ordering::Relaxed);
        self.inflight_since_ns.store(0, Ordering::Relaxed);
        self.inflight_published_ms.store(0, Ordering::Relaxed);
    }

    /// Now on the watch's monotonic clock, for [`ShardWatch::set_inflight`].
    pub(crate) fn now_ns() -> u64 {
        CLOCK.now_ns()
    }

    /// `waiting` events are taken and not started, the oldest published at
    /// `oldest_ms`.
    pub(crate) fn set_waiting(&self, waiting: usize, oldest_ms: Option<u64>) {
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.waiting_oldest_ms
            .store(oldest_ms.unwrap_or(0), Ordering::Relaxed);
    }

    pub(crate) fn inflight_elapsed(&self) -> Option<Duration> {
        match self.inflight_since_ns.load(Ordering::Relaxed) {
            0 => None,
            since => Some(Duration::from_nanos(CLOCK.now_ns().saturating_sub(since))),
        }
    }

    /// The gate holds `held` events, the oldest published at `oldest_ms`.
    pub(crate) fn set_held(&self, held: usize, oldest_ms: Option<u64>) {
        self.held.store(held as u64, Ordering::Relaxed);
        self.held_oldest_ms
            .store(oldest_ms.unwrap_or(0), Ordering::Relaxed);
    }

    /// Events the gate holds, as last set.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
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
        let inflight_published = self.inflight_published_ms.load(Ordering::Relaxed);
        let held_oldest = self.held_oldest_ms.load(Ordering::Relaxed);
        let waiting_oldest = self.waiting_oldest_ms.load(Ordering::Relaxed);
        let head = [inflight_published, held_oldest, waiting_oldest]
            .into_iter()
            .filter(|ms| *ms > 0)
            .min();
        Snapshot {
            state: self.state(),
            backlog_age: head.map_or(Duration::ZERO, |ms| {
                Duration::from_millis(now_ms.saturating_sub(ms))
            }),
            inflight_age: self.inflight_elapsed(),
            inflight: self.inflight.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
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
    /// How long the (oldest) in-flight event has been worked on, if there is one.
    pub(crate) inflight_age: Option<Duration>,
    /// Handler calls in flight.
    pub(crate) inflight: u64,
    /// Events waiting for their order (or a slot).
    pub(crate) waiting: u64,
    pub(crate) held: u64,
}

/// When a delivery was published: `x-published-at-ms`, else the AMQP
/// `timestamp` (seconds), else `received_ms`.
pub(crate) fn published_ms(properties: &BasicProperties, received_ms: u64) -> u64 {
    headers::header_i64(properties, headers::PUBLISHED_AT_MS)
        .and_then(|ms| u64::try_from(ms).ok())
        .or_else(|| properties.timestamp().map(|s| s.saturating_mul(1000)))
        .filter(|ms| *ms > 0)
        .unwrap_or(received_ms)
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

    #[test]
    fn backlog_is_the_oldest_of_in_flight_and_held() {
        let watch = ShardWatch::new(ShardCount::new(1).unwrap().ids().next().unwrap());
        let now = 1_000_000;
        assert_eq!(watch.snapshot(now).backlog_age, Duration::ZERO);
        watch.start_inflight(now - 5_000);
        watch.set_held(2, Some(now - 9_000));
        let snap = watch.snapshot(now);
        assert_eq!(snap.backlog_age, Duration::from_secs(9));
        assert_eq!(snap.held, 2);
        assert!(snap.inflight_age.is_some());
        watch.set_held(0, None);
        assert_eq!(watch.snapshot(now).backlog_age, Duration::from_secs(5));
        watch.set_waiting(3, Some(now - 7_000));
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
        // A publisher clock ahead of ours reads as no age, not a negative one.
        watch.start_inflight(now + 3_000);
        assert_eq!(watch.snapshot(now).backlog_age, Duration::ZERO);
    }

    #[test]
    fn publish_time_falls_back_to_timestamp_then_receipt() {
        let bare = BasicProperties::default();
        assert_eq!(published_ms(&bare, 42), 42);
        let stamped = BasicProperties::default().with_timestamp(1_700_000_000);
        assert_eq!(published_ms(&stamped, 42), 1_700_000_000_000);
        let props = headers::event_properties(
            "id",
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            &headers::new_traceparent(),
        );
        assert_eq!(published_ms(&props, 42), 1_700_000_000_123);
    }
}
