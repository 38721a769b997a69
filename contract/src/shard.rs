//! Shard count, shard ids and the shard of an order.
//!
//! The shard of an order is `int(md5(order_id_utf8).hexdigest(), 16) % N`, the
//! expression of the classic pika recipe, so Python publishers and shardline agree.

use std::fmt;
use std::str::FromStr;

use md5::{Digest, Md5};

/// Upper bound on the shard count: queue-per-shard topologies beyond this are a
/// misconfiguration, not a plan.
pub const MAX_SHARDS: u16 = 4096;

/// Number of shards `N`, `1..=MAX_SHARDS`. Default 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardCount(u16);

impl ShardCount {
    pub fn new(n: u32) -> Result<Self, ShardError> {
        match u16::try_from(n) {
            Ok(n) if (1..=MAX_SHARDS).contains(&n) => Ok(Self(n)),
            _ => Err(ShardError::Count(n)),
        }
    }

    pub fn get(self) -> u16 {
        self.0
    }

    /// Every shard id, `0..N`.
    pub fn ids(self) -> impl Iterator<Item = ShardId> {
        (0..self.0).map(ShardId)
    }

    /// The shard an order belongs to: [`order_hash`] mod N.
    pub fn shard_of(self, order_id: &str) -> ShardId {
        // The remainder is below N <= MAX_SHARDS, so it fits in u16.
        ShardId((order_hash(order_id) % u128::from(self.0)) as u16)
    }
}

/// `int(md5(order_id))`, big-endian, as Python's
/// `int(hashlib.md5(order_id.encode()).hexdigest(), 16)`: the one place an
/// order is hashed (shards and resharding's buckets are remainders of it).
pub fn order_hash(order_id: &str) -> u128 {
    let digest = Md5::digest(order_id.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest);
    u128::from_be_bytes(bytes)
}

impl Default for ShardCount {
    fn default() -> Self {
        Self(16)
    }
}

impl fmt::Display for ShardCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for ShardCount {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let n = s
            .trim()
            .parse::<u32>()
            .map_err(|_| ShardError::Syntax(s.to_owned()))?;
        Self::new(n)
    }
}

/// One shard, `0..N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(u16);

impl ShardId {
    /// A shard id within `count`.
    pub fn new(id: u32, count: ShardCount) -> Result<Self, ShardError> {
        if id < u32::from(count.0) {
            Ok(Self(id as u16))
        } else {
            Err(ShardError::OutOfRange { id, count: count.0 })
        }
    }

    pub fn get(self) -> u16 {
        self.0
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The shards one worker consumes: `all`, or a list of ids and ranges (`0-3,7`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSet {
    All,
    Some(Vec<u32>),
}

impl ShardSet {
    /// The assigned shard ids, sorted and deduplicated, checked against `count`.
    pub fn resolve(&self, count: ShardCount) -> Result<Vec<ShardId>, ShardError> {
        match self {
            Self::All => Ok(count.ids().collect()),
            Self::Some(ids) => {
                let mut out = ids
                    .iter()
                    .map(|&id| ShardId::new(id, count))
                    .collect::<Result<Vec<_>, _>>()?;
                out.sort_unstable();
                out.dedup();
                Ok(out)
            }
        }
    }
}

impl FromStr for ShardSet {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        let syntax = || ShardError::Syntax(s.to_owned());
        let mut ids = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            match part.split_once('-') {
                Some((lo, hi)) => {
                    let lo: u32 = lo.trim().parse().map_err(|_| syntax())?;
                    let hi: u32 = hi.trim().parse().map_err(|_| syntax())?;
                    if lo > hi || hi >= u32::from(MAX_SHARDS) {
                        return Err(syntax());
                    }
                    ids.extend(lo..=hi);
                }
                None => ids.push(part.parse().map_err(|_| syntax())?),
            }
        }
        if ids.is_empty() {
            return Err(syntax());
        }
        Ok(Self::Some(ids))
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("shard count must be between 1 and {MAX_SHARDS}, got {0}")]
    Count(u32),
    #[error("shard {id} does not exist with {count} shards (ids are 0..{count})")]
    OutOfRange { id: u32, count: u16 },
    #[error("expected `all` or shard ids and ranges such as `0-3,7`, got `{0}`")]
    Syntax(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(n: u32) -> ShardCount {
        ShardCount::new(n).unwrap()
    }

    /// Computed with Python 3.11:
    /// `int(hashlib.md5(i.encode()).hexdigest(), 16) % n` for n in 16, 8, 7, 1024.
    #[test]
    fn shard_of_agrees_with_python_hashlib() {
        let long = "x".repeat(300);
        let vectors: [(&str, [u16; 4]); 9] = [
            ("A1024", [3, 3, 1, 563]),
            ("order-1", [4, 4, 2, 836]),
            ("", [14, 6, 1, 638]),
            ("é", [15, 7, 1, 879]),
            ("注文-42", [15, 7, 5, 959]),
            ("🦀crab", [14, 6, 0, 286]),
            ("A1", [10, 2, 1, 138]),
            ("ORD-000001", [4, 4, 0, 500]),
            (&long, [8, 0, 6, 808]),
        ];
        for (id, expected) in vectors {
            for (n, want) in [16, 8, 7, 1024].into_iter().zip(expected) {
                assert_eq!(count(n).shard_of(id).get(), want, "id {id:?} n {n}");
            }
        }
    }

    #[test]
    fn shard_count_bounds() {
        assert!(ShardCount::new(0).is_err());
        assert!(ShardCount::new(u32::from(MAX_SHARDS) + 1).is_err());
        assert_eq!("8".parse::<ShardCount>().unwrap().get(), 8);
        assert!("eight".parse::<ShardCount>().is_err());
        assert_eq!(ShardCount::default().get(), 16);
    }

    #[test]
    fn shard_set_parses_lists_and_ranges() {
        let set: ShardSet = "0-3, 7,2".parse().unwrap();
        let ids: Vec<u16> = set
            .resolve(count(8))
            .unwrap()
            .iter()
            .map(|s| s.get())
            .collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 7]);
        assert_eq!(
            "ALL"
                .parse::<ShardSet>()
                .unwrap()
                .resolve(count(3))
                .unwrap()
                .len(),
            3
        );
        assert!("3-1".parse::<ShardSet>().is_err());
        assert!("".parse::<ShardSet>().is_err());
        assert!("a-b".parse::<ShardSet>().is_err());
        assert_eq!(
            "9".parse::<ShardSet>().unwrap().resolve(count(8)),
            Err(ShardError::OutOfRange { id: 9, count: 8 })
        );
    }
}
