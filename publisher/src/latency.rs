//! Confirm latency (publish → broker confirm) as a compact histogram, so that
//! a long load run costs kilobytes, not a sample per event.
//!
//! Buckets are log-linear over microseconds: exact below 64 µs, then 64
//! sub-buckets per power of two, so any percentile is within 1.6 % of the truth.

use std::time::Duration;

const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Largest recorded value, 2^40 µs (about 12 days); longer ones are clamped.
const MAX_BITS: u32 = 40;
const BUCKETS: usize = (SUB + (MAX_BITS - SUB_BITS) as u64 * SUB) as usize;

#[derive(Debug, Clone, Default)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    max_us: u64,
}

impl LatencyHistogram {
    pub fn record(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .min((1 << MAX_BITS) - 1);
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        self.counts[bucket_of(us)] += 1;
        self.total += 1;
        self.max_us = self.max_us.max(us);
    }

    /// Number of recorded latencies.
    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> Option<Duration> {
        (self.total > 0).then(|| Duration::from_micros(self.max_us))
    }

    /// The `q`-th percentile (`0.0..=100.0`), `None` when nothing was recorded.
    pub fn percentile(&self, q: f64) -> Option<Duration> {
        if self.total == 0 {
            return None;
        }
        let q = q.clamp(0.0, 100.0);
        // Nearest-rank: the smallest value with at least q % of samples at or below it.
        let rank = ((q / 100.0 * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (bucket, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(Duration::from_micros(value_of(bucket).min(self.max_us)));
            }
        }
        Some(Duration::from_micros(self.max_us))
    }
}

fn bucket_of(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    let octave = 63 - us.leading_zeros();
    let sub = (us >> (octave - SUB_BITS)) - SUB;
    (SUB + u64::from(octave - SUB_BITS) * SUB + sub) as usize
}

/// The middle of `bucket`'s range.
fn value_of(bucket: usize) -> u64 {
    let bucket = bucket as u64;
    if bucket < SUB {
        return bucket;
    }
    let octave = (bucket - SUB) / SUB + u64::from(SUB_BITS);
    let sub = (bucket - SUB) % SUB;
    let width = 1u64 << (octave - u64::from(SUB_BITS));
    (SUB + sub) * width + width / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn empty_has_no_percentiles() {
        let h = LatencyHistogram::default();
        assert_eq!(h.percentile(50.0), None);
        assert_eq!(h.max(), None);
        assert_eq!(h.count(), 0);
    }

    #[test]
    fn small_values_are_exact() {
        let mut h = LatencyHistogram::default();
        for us in [5, 1, 3] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.percentile(0.0), Some(Duration::from_micros(1)));
        assert_eq!(h.percentile(50.0), Some(Duration::from_micros(3)));
        assert_eq!(h.percentile(100.0), Some(Duration::from_micros(5)));
    }

    #[test]
    fn percentiles_are_within_bucket_precision() {
        let mut h = LatencyHistogram::default();
        for n in 1..=1000 {
            h.record(ms(n));
        }
        for (q, want) in [(50.0, 500.0), (99.0, 990.0), (90.0, 900.0)] {
            let got = h.percentile(q).unwrap().as_secs_f64() * 1000.0;
            assert!((got - want).abs() / want < 0.016, "p{q}: {got} vs {want}");
        }
        assert_eq!(h.percentile(100.0), Some(ms(1000)));
        assert_eq!(h.max(), Some(ms(1000)));
        assert_eq!(h.count(), 1000);
    }

    #[test]
    fn one_slow_event_shows_in_p99_not_p50() {
        let mut h = LatencyHistogram::default();
        for _ in 0..99 {
            h.record(ms(2));
        }
        h.record(ms(900));
        assert!(h.percentile(50.0).unwrap() < ms(3));
        assert!(h.percentile(99.0).unwrap() < ms(3));
        assert!(h.percentile(99.9).unwrap() > ms(800));
    }

    #[test]
    fn buckets_are_monotonic_and_bounded() {
        let mut values: Vec<u64> = (0..MAX_BITS)
            .flat_map(|shift| [1u64 << shift, (1u64 << shift) + 7, (2u64 << shift) - 1])
            .collect();
        values.sort_unstable();
        let mut last = 0;
        for us in values {
            let b = bucket_of(us);
            assert!(b >= last && b < BUCKETS, "{us}");
            last = b;
            let v = value_of(b);
            assert!(
                v.abs_diff(us) as f64 <= us as f64 / 64.0 + 1.0,
                "{us} -> {v}"
            );
        }
        let mut h = LatencyHistogram::default();
        h.record(Duration::from_secs(100 * 24 * 3600));
        assert!(h.percentile(50.0).is_some());
    }
}
