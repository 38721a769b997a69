//! The backlog the recorder samples: confirmed events not yet applied (a 2xx
//! call), by the time of their first confirm.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Confirmed events waiting for their first 2xx call.
#[derive(Debug, Default)]
pub struct Backlog {
    /// Confirmed and not yet applied, with their first confirm's time.
    pending: HashMap<String, Instant>,
    /// Every key applied so far: a confirm seen after the call (a confirm
    /// delayed by a fault), or a second confirm of a key (the publisher sent
    /// it again after a nack or a lost connection; the copy is a duplicate
    /// and never called), adds nothing pending.
    applied: HashSet<String>,
}

impl Backlog {
    /// `key` got a 2xx call.
    pub fn applied(&mut self, key: &str) {
        self.pending.remove(key);
        if !self.applied.contains(key) {
            self.applied.insert(key.to_owned());
        }
    }

    /// `key` was confirmed at `at`.
    pub fn confirmed(&mut self, key: String, at: Instant) {
        if !self.applied.contains(&key) {
            self.pending.entry(key).or_insert(at);
        }
    }

    /// The first confirm time of the oldest event still waiting.
    pub fn oldest(&self) -> Option<Instant> {
        self.pending.values().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn an_event_waits_from_its_first_confirm_until_its_first_call() {
        let t0 = Instant::now();
        let mut backlog = Backlog::default();
        backlog.confirmed("a".into(), t0);
        backlog.confirmed("b".into(), t0 + Duration::from_secs(1));
        backlog.confirmed("a".into(), t0 + Duration::from_secs(2));
        assert_eq!(backlog.oldest(), Some(t0));
        backlog.applied("a");
        assert_eq!(backlog.oldest(), Some(t0 + Duration::from_secs(1)));
        backlog.applied("b");
        assert_eq!(backlog.oldest(), None);
    }

    #[test]
    fn a_confirm_after_the_call_or_a_second_confirm_leaves_nothing_pending() {
        let t0 = Instant::now();
        let mut backlog = Backlog::default();
        // Applied before its confirm was seen.
        backlog.applied("early");
        backlog.confirmed("early".into(), t0);
        // Confirmed, applied, then confirmed again (sent again after a nack).
        backlog.confirmed("resent".into(), t0);
        backlog.applied("resent");
        backlog.confirmed("resent".into(), t0 + Duration::from_secs(5));
        assert_eq!(backlog.oldest(), None);
    }
}
