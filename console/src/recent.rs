//! Letters an admin opened lately, as read from the DLQ: at most
//! [`RECENT_LETTERS`] (16), each for [`RECENT_FOR`] (5 s), so that a
//! reload or the page and its API together read the DLQ once. Only found
//! letters are kept. Pure: every call is given the time.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::letter::Detail;

/// Letters kept at most.
pub(crate) const RECENT_LETTERS: usize = 16;
/// How long a letter is kept after it was read.
pub(crate) const RECENT_FOR: Duration = Duration::from_secs(5);

/// The letters read lately, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Recent {
    letters: Mutex<Vec<(Instant, Arc<Detail>)>>,
}

impl Recent {
    fn with<R>(&self, f: impl FnOnce(&mut Vec<(Instant, Arc<Detail>)>) -> R) -> R {
        f(&mut self.letters.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The letter `id`, if it was read less than [`RECENT_FOR`] before `now`.
    pub(crate) fn get(&self, id: &str, now: Instant) -> Option<Arc<Detail>> {
        self.with(|letters| {
            letters.retain(|(at, _)| now.saturating_duration_since(*at) < RECENT_FOR);
            letters
                .iter()
                .find(|(_, d)| d.entry.id == id)
                .map(|(_, d)| Arc::clone(d))
        })
    }

    /// Keeps `detail`, read at `now`; the oldest goes at the cap.
    pub(crate) fn put(&self, detail: Arc<Detail>, now: Instant) {
        self.with(|letters| {
            letters.retain(|(at, d)| {
                d.entry.id != detail.entry.id && now.saturating_duration_since(*at) < RECENT_FOR
            });
            if letters.len() >= RECENT_LETTERS {
                letters.remove(0);
            }
            letters.push((now, detail));
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use shardline_contract::letters::IndexEntry;

    use super::*;
    use crate::letter::{Body, Contents};

    fn detail(id: &str) -> Arc<Detail> {
        Arc::new(Detail {
            entry: IndexEntry {
                id: id.into(),
                ..IndexEntry::default()
            },
            contents: Some(Contents {
                routing_key: "rk".into(),
                headers: vec![],
                body: Body::of(b"{}"),
            }),
        })
    }

    #[test]
    fn a_letter_is_kept_five_seconds() {
        let recent = Recent::default();
        let t0 = Instant::now();
        recent.put(detail("d1"), t0);
        assert!(recent.get("d1", t0 + Duration::from_millis(4900)).is_some());
        assert!(recent.get("d2", t0).is_none());
        assert!(recent.get("d1", t0 + RECENT_FOR).is_none());
    }

    #[test]
    fn at_most_sixteen_the_oldest_goes_first() {
        let recent = Recent::default();
        let t0 = Instant::now();
        for n in 0..=RECENT_LETTERS {
            recent.put(
                detail(&format!("d{n}")),
                t0 + Duration::from_millis(n as u64),
            );
        }
        let now = t0 + Duration::from_secs(1);
        assert!(recent.get("d0", now).is_none(), "the oldest went");
        assert!(recent.get("d1", now).is_some());
        assert!(recent.get(&format!("d{RECENT_LETTERS}"), now).is_some());
        assert_eq!(recent.with(|l| l.len()), RECENT_LETTERS);
    }
}
