//! B buckets, fixed when the topology is first recorded, and the bucket of an order.

use crate::shard::{ShardCount, order_hash};

/// How many buckets the first shard count's multiple is rounded up to.
const MIN_BUCKETS: u32 = 4096;

/// One bucket, `0..B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket(u16);

impl Bucket {
    /// The bucket's number.
    pub fn get(self) -> u16 {
        self.0
    }

    pub(crate) fn index(self) -> usize {
        usize::from(self.0)
    }

    pub(crate) fn from_index(index: usize) -> Option<Self> {
        u16::try_from(index).ok().map(Self)
    }
}

/// The bucket space: B = N₀ · ⌈4096 / N₀⌉ buckets, a multiple of the first shard
/// count N₀, so `bucket mod N₀` is today's `md5 mod N₀` shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets {
    first: ShardCount,
    count: u16,
}

impl Buckets {
    /// The buckets of a topology first recorded with `first` shards.
    pub fn new(first: ShardCount) -> Result<Self, BucketsError> {
        let n0 = u32::from(first.get());
        let b = n0 * MIN_BUCKETS.div_ceil(n0);
        let count = u16::try_from(b).map_err(|_| BucketsError::Modulus(b))?;
        Ok(Self { first, count })
    }

    /// The first shard count N₀.
    pub fn first(&self) -> ShardCount {
        self.first
    }

    /// B, the number of buckets.
    pub fn count(&self) -> u16 {
        self.count
    }

    /// Every bucket, `0..B`.
    pub fn all(&self) -> impl Iterator<Item = Bucket> + use<> {
        (0..self.count).map(Bucket)
    }

    /// The bucket of an order: `int(md5(order_id)) mod B`.
    pub fn bucket_of(&self, order_id: &str) -> Bucket {
        // The remainder is below B, which fits in u16.
        Bucket((order_hash(order_id) % u128::from(self.count)) as u16)
    }

    /// The bucket numbered `n`, if it is below B.
    pub fn bucket(&self, n: u16) -> Option<Bucket> {
        (n < self.count).then_some(Bucket(n))
    }
}

/// Why the bucket space could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BucketsError {
    /// B does not fit a bucket number (never for a valid first shard count;
    /// a test checks every one).
    #[error("{0} buckets do not fit a bucket number")]
    Modulus(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(n: u32) -> ShardCount {
        ShardCount::new(n).unwrap()
    }

    #[test]
    fn b_is_the_first_multiple_of_n0_from_4096() {
        for (n0, b) in [
            (1, 4096),
            (6, 4098),
            (16, 4096),
            (20, 4100),
            (1024, 4096),
            (3, 4098),
        ] {
            assert_eq!(Buckets::new(count(n0)).unwrap().count(), b, "n0 {n0}");
        }
    }

    #[test]
    fn every_first_shard_count_has_buckets() {
        for n0 in 1..=u32::from(crate::shard::MAX_SHARDS) {
            let buckets = Buckets::new(count(n0)).unwrap();
            let b = u32::from(buckets.count());
            assert!(
                (4096..4096 + n0).contains(&b) || n0 == 4096 && b == 4096,
                "n0 {n0}"
            );
            assert_eq!(b % n0, 0);
        }
    }

    #[test]
    fn bucket_mod_n0_is_todays_shard() {
        for n0 in [1, 2, 3, 6, 7, 16, 20, 24, 100, 1000, 4095] {
            let buckets = Buckets::new(count(n0)).unwrap();
            for i in 0..500 {
                let id = format!("order-{i}");
                let bucket = buckets.bucket_of(&id);
                assert!(bucket.get() < buckets.count());
                assert_eq!(
                    bucket.get() % count(n0).get(),
                    count(n0).shard_of(&id).get(),
                    "n0 {n0} id {id}"
                );
            }
        }
    }

    /// When B is itself a shard count, the bucket is `ShardCount(B).shard_of`.
    #[test]
    fn bucket_is_md5_mod_b() {
        let buckets = Buckets::new(count(16)).unwrap();
        for id in ["A1024", "order-1", "", "é", "注文-42"] {
            assert_eq!(buckets.bucket_of(id).get(), count(4096).shard_of(id).get());
        }
        // n0 = 6: B = 4098 = 2·3·683, each residue is that factor's shard.
        let six = Buckets::new(count(6)).unwrap();
        for i in 0..300 {
            let id = format!("k{i}");
            let b = six.bucket_of(&id).get();
            for q in [2u16, 3, 683] {
                assert_eq!(b % q, count(u32::from(q)).shard_of(&id).get());
            }
        }
    }
}
