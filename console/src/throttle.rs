//! Failed token checks (the login form, a wrong `Authorization: Bearer`),
//! throttled. Per client address (an IPv6 client by its /64, what one host
//! is usually given): after [`Limits::free`] failures each further attempt
//! waits, [`Limits::base`] doubling to [`Limits::cap`], before it is even
//! checked; a success forgets the address. Over every address, a token
//! bucket of failures ([`Limits::per_second`], [`Limits::burst`]) refuses
//! attempts while it is empty. The table of addresses holds at most
//! [`Limits::addresses`], the one failed longest ago evicted. Pure: every
//! call is given the time.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The throttle's numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Limits {
    /// Failures an address may make before it waits (5).
    pub(crate) free: u32,
    /// The first wait (1 s); each further failure doubles it.
    pub(crate) base: Duration,
    /// The longest wait (5 min).
    pub(crate) cap: Duration,
    /// Addresses remembered (10,000); the one failed longest ago goes first.
    pub(crate) addresses: usize,
    /// Failures per second over every address, sustained (10).
    pub(crate) per_second: f64,
    /// Failures over every address in a burst (100).
    pub(crate) burst: f64,
    /// An address without a failure for this long starts afresh (1 h).
    pub(crate) forget: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            free: 5,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(5 * 60),
            addresses: 10_000,
            per_second: 10.0,
            burst: 100.0,
            forget: Duration::from_secs(60 * 60),
        }
    }
}

/// An attempt refused unchecked: it may come back after this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wait(pub(crate) Duration);

impl Wait {
    /// Whole seconds, at least 1, for `Retry-After`.
    pub(crate) fn seconds(self) -> u64 {
        let whole = self.0.as_secs();
        (whole + u64::from(self.0.subsec_nanos() > 0)).max(1)
    }
}

#[derive(Debug)]
struct Record {
    failures: u32,
    last: Instant,
    until: Option<Instant>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Option<Instant>,
}

#[derive(Debug)]
struct Inner {
    addresses: HashMap<IpAddr, Record>,
    bucket: Bucket,
}

/// The throttle of one console.
#[derive(Debug)]
pub(crate) struct Throttle {
    limits: Limits,
    inner: Mutex<Inner>,
}

impl Default for Throttle {
    fn default() -> Self {
        Self::new(Limits::default())
    }
}

/// What an address is throttled by: an IPv4 address, an IPv6 /64.
fn key(addr: IpAddr) -> IpAddr {
    match addr.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(bits.into())
        }
        v4 => v4,
    }
}

impl Throttle {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            inner: Mutex::new(Inner {
                addresses: HashMap::new(),
                bucket: Bucket {
                    tokens: limits.burst,
                    at: None,
                },
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Whether an attempt from `addr` may be checked at `now`.
    pub(crate) fn admit(&self, addr: IpAddr, now: Instant) -> Result<(), Wait> {
        let limits = self.limits;
        self.with(|inner| {
            if let Some(until) = inner.addresses.get(&key(addr)).and_then(|r| r.until)
                && until > now
            {
                return Err(Wait(until - now));
            }
            let bucket = &mut inner.bucket;
            refill(bucket, &limits, now);
            if bucket.tokens < 1.0 {
                let missing = 1.0 - bucket.tokens;
                return Err(Wait(Duration::from_secs_f64(missing / limits.per_second)));
            }
            Ok(())
        })
    }

    /// A failed attempt from `addr` at `now`; the wait it imposes on the
    /// address's next attempt, if any.
    pub(crate) fn failed(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let limits = self.limits;
        self.with(|inner| {
            refill(&mut inner.bucket, &limits, now);
            inner.bucket.tokens = (inner.bucket.tokens - 1.0).max(0.0);
            let key = key(addr);
            if !inner.addresses.contains_key(&key) && inner.addresses.len() >= limits.addresses {
                let oldest = inner
                    .addresses
                    .iter()
                    .min_by_key(|(_, r)| r.last)
                    .map(|(k, _)| *k);
                if let Some(oldest) = oldest {
                    inner.addresses.remove(&oldest);
                }
            }
            let record = inner.addresses.entry(key).or_insert(Record {
                failures: 0,
                last: now,
                until: None,
            });
            if now.saturating_duration_since(record.last) >= limits.forget {
                record.failures = 0;
            }
            record.failures = record.failures.saturating_add(1);
            record.last = now;
            let over = record.failures.checked_sub(limits.free)?;
            let wait = limits
                .base
                .saturating_mul(1u32 << over.min(20))
                .min(limits.cap);
            record.until = Some(now + wait);
            Some(wait)
        })
    }

    /// A successful attempt from `addr`: its failures are forgotten.
    pub(crate) fn succeeded(&self, addr: IpAddr) {
        self.with(|inner| inner.addresses.remove(&key(addr)));
    }
}

fn refill(bucket: &mut Bucket, limits: &Limits, now: Instant) {
    if let Some(at) = bucket.at {
        let gained = now.saturating_duration_since(at).as_secs_f64() * limits.per_second;
        bucket.tokens = (bucket.tokens + gained).min(limits.burst);
    }
    bucket.at = Some(now);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_address_waits_after_five_failures_doubling_to_the_cap() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        let a = ip("198.51.100.7");
        for _ in 0..4 {
            assert_eq!(throttle.admit(a, t0), Ok(()));
            assert_eq!(throttle.failed(a, t0), None);
        }
        assert_eq!(throttle.failed(a, t0), Some(S), "the fifth failure: 1 s");
        assert_eq!(throttle.admit(a, t0), Err(Wait(S)));
        let half = t0 + S / 2;
        assert_eq!(throttle.admit(a, half).unwrap_err().seconds(), 1);
        assert_eq!(
            throttle.admit(ip("198.51.100.8"), half),
            Ok(()),
            "others are not held"
        );
        let mut now = t0 + S;
        let mut waits = Vec::new();
        for _ in 0..12 {
            assert_eq!(
                throttle.admit(a, now),
                Ok(()),
                "checked once the wait is over"
            );
            let wait = throttle.failed(a, now).unwrap();
            waits.push(wait.as_secs());
            now += wait;
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]);
        // A success forgets the address.
        throttle.succeeded(a);
        assert_eq!(throttle.admit(a, now), Ok(()));
        assert_eq!(throttle.failed(a, now), None);
    }

    #[test]
    fn an_address_quiet_for_an_hour_starts_afresh() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        let a = ip("198.51.100.7");
        for _ in 0..5 {
            throttle.failed(a, t0);
        }
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(throttle.admit(a, later), Ok(()));
        assert_eq!(throttle.failed(a, later), None, "a first failure again");
    }

    #[test]
    fn an_ipv6_client_is_throttled_by_its_64() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        for host in 1..=5 {
            throttle.failed(ip(&format!("2001:db8:1:2::{host}")), t0);
        }
        assert!(throttle.admit(ip("2001:db8:1:2:ffff::9"), t0).is_err());
        assert_eq!(throttle.admit(ip("2001:db8:1:3::1"), t0), Ok(()));
        assert_eq!(key(ip("::ffff:192.0.2.1")), ip("192.0.2.1"));
    }

    #[test]
    fn every_address_shares_the_global_bucket() {
        let throttle = Throttle::new(Limits {
            per_second: 2.0,
            burst: 10.0,
            ..Limits::default()
        });
        let t0 = Instant::now();
        // Ten addresses, one failure each: the burst is spent.
        for n in 0..10 {
            let a = ip(&format!("203.0.113.{n}"));
            assert_eq!(throttle.admit(a, t0), Ok(()));
            throttle.failed(a, t0);
        }
        let fresh = ip("192.0.2.200");
        assert_eq!(
            throttle.admit(fresh, t0),
            Err(Wait(S / 2)),
            "one token in 0.5 s"
        );
        assert_eq!(throttle.admit(fresh, t0 + S / 2), Ok(()));
        throttle.failed(fresh, t0 + S / 2);
        assert!(throttle.admit(fresh, t0 + S / 2).is_err());
        // Refilled at 2 a second, up to the burst.
        assert_eq!(throttle.admit(fresh, t0 + 60 * S), Ok(()));
        for n in 0..10 {
            throttle.failed(ip(&format!("198.18.0.{n}")), t0 + 60 * S);
        }
        assert!(
            throttle.admit(fresh, t0 + 60 * S).is_err(),
            "no more than the burst"
        );
    }

    #[test]
    fn the_table_evicts_the_address_failed_longest_ago() {
        let throttle = Throttle::new(Limits {
            addresses: 3,
            free: 1,
            base: Duration::from_secs(3600),
            cap: Duration::from_secs(3600),
            ..Limits::default()
        });
        let t0 = Instant::now();
        let (a, b, c, d) = (
            ip("192.0.2.1"),
            ip("192.0.2.2"),
            ip("192.0.2.3"),
            ip("192.0.2.4"),
        );
        throttle.failed(a, t0);
        throttle.failed(b, t0 + S);
        throttle.failed(c, t0 + 2 * S);
        throttle.failed(d, t0 + 3 * S);
        let len = throttle.with(|inner| inner.addresses.len());
        assert_eq!(len, 3);
        assert_eq!(throttle.admit(a, t0 + 3 * S), Ok(()), "a was evicted");
        for held in [b, c, d] {
            assert!(throttle.admit(held, t0 + 3 * S).is_err());
        }
    }
}
