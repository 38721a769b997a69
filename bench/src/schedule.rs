//! The open-loop publishing schedule of `bench --latency`: event `i` is due
//! at `start + i / rate`, whenever it is actually sent. Its latency is
//! measured from that intended time, so a publisher (or broker) that falls
//! behind shows up in the latencies instead of hiding them (no coordinated
//! omission). The index and the due time travel in the event's `event_id`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch: the clock both processes share.
pub(crate) fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Schedule {
    /// When event 0 is due, µs since the epoch.
    pub(crate) start_us: u64,
    /// Events per second.
    pub(crate) rate: f64,
}

impl Schedule {
    /// When event `i` is due, µs since the epoch.
    pub(crate) fn due_us(&self, i: u64) -> u64 {
        self.start_us + (i as f64 * 1e6 / self.rate).round() as u64
    }

    /// Events due within `span` from the start.
    pub(crate) fn events_within(&self, span: Duration) -> u64 {
        (span.as_secs_f64() * self.rate).ceil() as u64
    }
}

/// The `event_id` of event `i` due at `due_us`.
pub(crate) fn event_id(i: u64, due_us: u64) -> String {
    format!("{i}@{due_us}")
}

/// The index and due time an [`event_id`] carries.
pub(crate) fn parse_event_id(id: &str) -> Option<(u64, u64)> {
    let (i, due) = id.split_once('@')?;
    Some((i.parse().ok()?, due.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_due_at_fixed_intervals_from_the_start() {
        let s = Schedule {
            start_us: 1_000_000,
            rate: 4000.0,
        };
        assert_eq!(s.due_us(0), 1_000_000);
        assert_eq!(s.due_us(1), 1_000_250);
        assert_eq!(s.due_us(4000), 2_000_000);
        let third = Schedule {
            start_us: 0,
            rate: 3.0,
        };
        assert_eq!(third.due_us(1), 333_333);
        assert_eq!(third.due_us(2), 666_667);
    }

    #[test]
    fn the_due_time_does_not_depend_on_when_earlier_events_went_out() {
        // A late publisher catches up: the due times are the schedule's, not
        // the previous send plus an interval.
        let s = Schedule {
            start_us: 0,
            rate: 1000.0,
        };
        let dues: Vec<u64> = (0..5).map(|i| s.due_us(i)).collect();
        assert_eq!(dues, [0, 1000, 2000, 3000, 4000]);
    }

    #[test]
    fn counts_within_a_span_round_up() {
        let s = Schedule {
            start_us: 0,
            rate: 2500.0,
        };
        assert_eq!(s.events_within(Duration::from_secs(5)), 12_500);
        assert_eq!(s.events_within(Duration::from_millis(1)), 3);
        assert_eq!(s.events_within(Duration::ZERO), 0);
    }

    #[test]
    fn event_ids_round_trip() {
        let id = event_id(42, 1_700_000_000_123_456);
        assert_eq!(parse_event_id(&id), Some((42, 1_700_000_000_123_456)));
        assert_eq!(parse_event_id("42"), None);
        assert_eq!(parse_event_id("x@1"), None);
        assert_eq!(parse_event_id("1@"), None);
    }
}
