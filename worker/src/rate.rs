//! `Config::max_rate`: at most R handler calls per second per worker process,
//! shared by all its shards.
//!
//! A token bucket kept as the time the next call may start (the generic cell
//! rate algorithm): each call moves that time on by `1/R`; a bucket that sat
//! idle lets `burst` calls through at once, no more. Callers wait in turn
//! (the lock is FIFO), so a busy shard cannot starve the others. Waiting for a
//! token is not an attempt: it happens right before the handler is called.
//! It reads tokio's clock, so its rule is unit-tested with a paused clock.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

/// A worker-wide token bucket.
#[derive(Debug)]
pub(crate) struct RateLimiter {
    /// Time between two tokens.
    interval: Duration,
    /// How far ahead of the schedule an idle bucket lets calls start.
    burst_span: Duration,
    /// When the next call may start, at the earliest.
    next: Mutex<Instant>,
}

impl RateLimiter {
    /// `per_second` calls per second (finite, above 0: [`crate::Config::validate`]
    /// checks it), at most `burst` at once after an idle spell.
    pub(crate) fn new(per_second: f64, burst: u32) -> Self {
        let interval = Duration::from_secs_f64(1.0 / per_second);
        let burst_span = interval * burst.saturating_sub(1);
        let now = Instant::now();
        Self {
            interval,
            burst_span,
            // Full: the first `burst` calls start at once.
            next: Mutex::new(now.checked_sub(burst_span).unwrap_or(now)),
        }
    }

    /// The burst for a rate: a tenth of a second's worth, at least one call.
    /// A limiter of `rate` calls per second with the default burst, to share
    /// between shards.
    pub(crate) fn shared(rate: f64) -> Arc<Self> {
        Arc::new(Self::new(rate, Self::default_burst(rate)))
    }

    pub(crate) fn default_burst(per_second: f64) -> u32 {
        let tenth = (per_second / 10.0).floor();
        if tenth >= 1.0 {
            // A rate is validated finite; beyond u32 the burst is moot.
            u32::try_from(tenth as u64).unwrap_or(u32::MAX)
        } else {
            1
        }
    }

    /// Waits until a call may start, in turn with the other callers.
    pub(crate) async fn acquire(&self) {
        let mut next = self.next.lock().await;
        let now = Instant::now();
        let earliest = now.checked_sub(self.burst_span).unwrap_or(now);
        let at = (*next).max(earliest);
        *next = at + self.interval;
        // Held while waiting: the next caller's turn comes after this one's.
        tokio::time::sleep_until(at).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls one limiter lets start within `window` of a paused clock, all
    /// callers asking at once.
    async fn started_within(limiter: &RateLimiter, asks: usize, window: Duration) -> usize {
        let start = Instant::now();
        let mut started = 0;
        for _ in 0..asks {
            limiter.acquire().await;
            if Instant::now() - start <= window {
                started += 1;
            }
        }
        started
    }

    #[tokio::test(start_paused = true)]
    async fn calls_never_outrun_the_rate_plus_the_burst() {
        let limiter = RateLimiter::new(50.0, 5);
        // In one second: the burst at once, then one every 20 ms.
        assert_eq!(
            started_within(&limiter, 200, Duration::from_secs(1)).await,
            55
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_bucket_refills_only_up_to_its_burst() {
        let limiter = RateLimiter::new(10.0, 3);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let start = Instant::now();
        for _ in 0..3 {
            limiter.acquire().await;
        }
        assert_eq!(Instant::now(), start, "the burst starts at once");
        limiter.acquire().await;
        assert_eq!(Instant::now() - start, Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn callers_take_turns() {
        let limiter = std::sync::Arc::new(RateLimiter::new(100.0, 1));
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for shard in 0..4u8 {
            let (limiter, order) = (limiter.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    limiter.acquire().await;
                    order.lock().unwrap().push(shard);
                }
            }));
            // Let each caller queue up before the next one starts.
            tokio::task::yield_now().await;
        }
        for task in tasks {
            task.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(order.len(), 12);
        // Nobody gets a third token before everybody got a first.
        let nth = |shard: u8, n: usize| {
            order
                .iter()
                .enumerate()
                .filter(|(_, s)| **s == shard)
                .nth(n)
                .map(|(i, _)| i)
                .unwrap()
        };
        let last_first = (0..4).map(|s| nth(s, 0)).max().unwrap();
        let first_third = (0..4).map(|s| nth(s, 2)).min().unwrap();
        assert!(last_first < first_third, "{order:?}");
    }

    #[test]
    fn bursts_are_a_tenth_of_a_second_at_least_one() {
        assert_eq!(RateLimiter::default_burst(50.0), 5);
        assert_eq!(RateLimiter::default_burst(5.0), 1);
        assert_eq!(RateLimiter::default_burst(0.5), 1);
        assert_eq!(RateLimiter::default_burst(1e12), u32::MAX);
    }
}
