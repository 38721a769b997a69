//! When the depth gauges' passive declares go out (`supervisor::poll_depths`):
//! the shard queues one after another, at most a fixed number a second, and
//! the dead-letter queue every poll period.
//!
//! A passive declare per shard queue every period was N declares in a burst:
//! 1,024 every 5 s from a worker of 1,024 shards, each a round trip the
//! broker answers on the channel's process, for a gauge that is capacity
//! information, not an alert. Paced, a worker spends at most `per_second`
//! shard declares a second (plus the DLQ's one per period), and each shard's
//! gauge is refreshed every max(period, N / `per_second` s): every 5 s up to
//! 125 shards, every 41 s at 1,024 (the defaults: 5 s, 25 a second).

use std::time::Duration;

use tokio::time::Instant;

/// What to read next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Poll {
    /// The shard queue at this index of the worker's assigned shards.
    Shard(usize),
    DeadLetters,
}

/// The depth poll's schedule, as pure state: it takes the time and says what
/// is due when. A caller that falls behind (a slow broker) is given the next
/// declare at once and the ones after it a gap apart again: a late poll
/// never catches up in a burst.
#[derive(Debug)]
pub(crate) struct DepthPacer {
    shards: usize,
    /// Between two shard declares.
    gap: Duration,
    /// Between two DLQ declares.
    period: Duration,
    cursor: usize,
    shard_due: Instant,
    dead_letters_due: Instant,
}

impl DepthPacer {
    /// A schedule for `shards` shard queues and the DLQ, starting at `start`
    /// with both: each shard's gauge every `period`, or every
    /// `shards / per_second` seconds when that is longer.
    pub(crate) fn new(shards: usize, period: Duration, per_second: u32, start: Instant) -> Self {
        let spread = period / u32::try_from(shards).unwrap_or(u32::MAX).max(1);
        let fastest = Duration::from_secs(1) / per_second.max(1);
        Self {
            shards,
            gap: spread.max(fastest),
            period,
            cursor: 0,
            shard_due: start,
            dead_letters_due: start,
        }
    }

    /// How long a round of every shard queue takes: how often each shard's
    /// gauge is refreshed.
    pub(crate) fn round(&self) -> Duration {
        self.gap * u32::try_from(self.shards).unwrap_or(u32::MAX)
    }

    /// The next declare and when to send it (never before `now`); the DLQ
    /// first when both are due.
    pub(crate) fn next(&mut self, now: Instant) -> (Instant, Poll) {
        if self.shards == 0 || self.dead_letters_due <= self.shard_due {
            let at = self.dead_letters_due.max(now);
            self.dead_letters_due = at + self.period;
            return (at, Poll::DeadLetters);
        }
        let at = self.shard_due.max(now);
        self.shard_due = at + self.gap;
        let shard = self.cursor;
        self.cursor = (self.cursor + 1) % self.shards;
        (at, Poll::Shard(shard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(5);

    /// The declares of the first `span`, for a caller that is always on time.
    fn run(shards: usize, span: Duration) -> Vec<(Duration, Poll)> {
        let start = Instant::now();
        let mut pacer = DepthPacer::new(shards, PERIOD, 50, start);
        let mut now = start;
        let mut polls = Vec::new();
        loop {
            let (at, poll) = pacer.next(now);
            if at - start >= span {
                return polls;
            }
            polls.push((at - start, poll));
            now = at;
        }
    }

    fn times_of(polls: &[(Duration, Poll)], wanted: Poll) -> Vec<Duration> {
        polls
            .iter()
            .filter(|(_, poll)| *poll == wanted)
            .map(|(at, _)| *at)
            .collect()
    }

    fn most_shard_declares_in_a_second(polls: &[(Duration, Poll)]) -> usize {
        let shards: Vec<Duration> = polls
            .iter()
            .filter(|(_, poll)| matches!(poll, Poll::Shard(_)))
            .map(|(at, _)| *at)
            .collect();
        (0..shards.len())
            .map(|i| {
                shards[i..]
                    .iter()
                    .take_while(|at| **at - shards[i] < Duration::from_secs(1))
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn many_shards_are_read_at_fifty_a_second_each_every_n_over_fifty_seconds() {
        let polls = run(1024, Duration::from_secs(60));
        assert_eq!(most_shard_declares_in_a_second(&polls), 50);
        let shard_7 = times_of(&polls, Poll::Shard(7));
        assert_eq!(shard_7.len(), 3, "{shard_7:?}");
        for pair in shard_7.windows(2) {
            assert_eq!(pair[1] - pair[0], Duration::from_millis(20_480));
        }
        let dead_letters = times_of(&polls, Poll::DeadLetters);
        let expected: Vec<Duration> = (0..12).map(|i| PERIOD * i).collect();
        assert_eq!(dead_letters, expected, "the DLQ every period");
        let pacer = DepthPacer::new(1024, PERIOD, 50, Instant::now());
        assert_eq!(pacer.round(), Duration::from_millis(20_480));
    }

    #[test]
    fn few_shards_are_read_every_period_spread_over_it() {
        let polls = run(10, Duration::from_secs(20));
        for shard in 0..10_u32 {
            let times = times_of(&polls, Poll::Shard(shard as usize));
            let expected: Vec<Duration> = (0..4)
                .map(|round| PERIOD * round + Duration::from_millis(500) * shard)
                .collect();
            assert_eq!(times, expected, "shard {shard}");
        }
        assert_eq!(times_of(&polls, Poll::DeadLetters).len(), 4);
        assert_eq!(
            DepthPacer::new(250, PERIOD, 50, Instant::now()).round(),
            PERIOD
        );
        assert_eq!(
            DepthPacer::new(10, PERIOD, 50, Instant::now()).round(),
            PERIOD
        );
    }

    #[test]
    fn without_shards_only_the_dead_letter_queue_is_read() {
        let polls = run(0, Duration::from_secs(20));
        let expected: Vec<(Duration, Poll)> =
            (0..4).map(|i| (PERIOD * i, Poll::DeadLetters)).collect();
        assert_eq!(polls, expected);
    }

    #[test]
    fn a_late_caller_gets_one_declare_at_once_and_no_burst() {
        let start = Instant::now();
        let mut pacer = DepthPacer::new(1024, PERIOD, 50, start);
        assert_eq!(pacer.next(start), (start, Poll::DeadLetters));
        assert_eq!(pacer.next(start), (start, Poll::Shard(0)));
        // The broker stalled for 10 s: 500 shard declares are overdue.
        let late = start + Duration::from_secs(10);
        assert_eq!(pacer.next(late), (late, Poll::Shard(1)));
        assert_eq!(pacer.next(late), (late, Poll::DeadLetters));
        let gap = Duration::from_millis(20);
        assert_eq!(pacer.next(late), (late + gap, Poll::Shard(2)));
        assert_eq!(pacer.next(late + gap), (late + gap * 2, Poll::Shard(3)));
    }
}
