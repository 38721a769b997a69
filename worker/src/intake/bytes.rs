//! The bytes of event bodies a shard holds decoded — held by the gate
//! (`gate`), read ahead (`lookahead`) and waiting to run — against
//! `--max-held-bytes`: at the bound the shard takes no new delivery. Events
//! in flight are not counted (`--concurrency` bounds them).
//!
//! One counter per shard consumer, shared by its gate and its lookahead: an
//! add or a sub per event, no allocation.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A shard's decoded bytes and their bound.
#[derive(Debug, Clone)]
pub(crate) struct HeldBytes {
    now: Arc<AtomicUsize>,
    max: usize,
}

impl HeldBytes {
    /// Bounded at `max` bytes.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            now: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// Never at the bound (a lookahead of the unit tests).
    #[cfg(test)]
    pub(crate) fn unbounded() -> Self {
        Self::new(usize::MAX)
    }

    pub(crate) fn add(&self, bytes: usize) {
        self.now.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, bytes: usize) {
        // Never below zero: every sub follows its add.
        let _ = self
            .now
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(bytes))
            });
    }

    /// The bytes counted now.
    pub(crate) fn get(&self) -> usize {
        self.now.load(Ordering::Relaxed)
    }

    /// Whether a new delivery may be taken: below the bound. The size of the
    /// next one is not known before it is taken, so the last one taken may
    /// go past the bound by up to its body; an event larger than the bound
    /// is still taken when nothing else is counted (a shard never waits for
    /// room that cannot come).
    pub(crate) fn has_room(&self) -> bool {
        self.has_room_with(0)
    }

    /// [`HeldBytes::has_room`] with `extra` bytes taken besides.
    pub(crate) fn has_room_with(&self, extra: usize) -> bool {
        let now = self.get().saturating_add(extra);
        now == 0 || now < self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_bound_there_is_room_and_at_it_none() {
        let bytes = HeldBytes::new(100);
        assert!(bytes.has_room());
        bytes.add(99);
        assert!(bytes.has_room());
        bytes.add(1);
        assert!(!bytes.has_room(), "at the bound");
        bytes.sub(50);
        assert!(bytes.has_room());
        assert_eq!(bytes.get(), 50);
    }

    #[test]
    fn an_event_larger_than_the_bound_is_taken_when_nothing_is_counted() {
        let bytes = HeldBytes::new(0);
        assert!(bytes.has_room(), "holding nothing");
        bytes.add(1_000);
        assert!(!bytes.has_room());
        bytes.sub(1_000);
        assert!(bytes.has_room());
    }

    #[test]
    fn clones_share_the_count() {
        let bytes = HeldBytes::new(10);
        let other = bytes.clone();
        other.add(10);
        assert!(!bytes.has_room());
        bytes.sub(10);
        assert_eq!(other.get(), 0);
    }
}
