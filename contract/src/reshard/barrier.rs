//! The confirm barrier: a marker goes out only once every registered
//! publisher has acknowledged the generation, or let its lease lapse.

use super::map::Generation;

/// A registered publisher's entry in `{prefix}publishers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// When the lease ends, in milliseconds since the Unix epoch; from then on
    /// the publisher publishes nothing until it registers again.
    pub deadline_ms: u64,
    /// The highest generation it acknowledged: everything it published
    /// before reading it is confirmed.
    pub acknowledged: Generation,
}

/// The barrier's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Barrier {
    /// Every live publisher acknowledged: the marker may go out.
    Open,
    /// This many live publishers have not acknowledged yet.
    Waiting(usize),
}

/// May a marker for `target` go out at `now_ms`, given every registered
/// publisher's lease? A lease that ended at or before `now_ms` does not count.
pub fn barrier<'a>(
    leases: impl IntoIterator<Item = &'a Lease>,
    target: Generation,
    now_ms: u64,
) -> Barrier {
    let waiting = leases
        .into_iter()
        .filter(|lease| lease.deadline_ms > now_ms && lease.acknowledged < target)
        .count();
    if waiting == 0 {
        Barrier::Open
    } else {
        Barrier::Waiting(waiting)
    }
}

/// May a publisher that read `read` acknowledge it, given the generations
/// its unconfirmed messages were routed by? Only when none was routed by an
/// older map.
///
/// A publisher routes by the generation it acknowledged, not by a newer one
/// it only read: were it to send an order's next event by the new route
/// while the previous one, by the old route, is unconfirmed, and its lease
/// lapsed, the barrier would go on without it, the old event could land
/// behind the marker and be forwarded after the new one.
pub fn may_acknowledge(
    read: Generation,
    unconfirmed: impl IntoIterator<Item = Generation>,
) -> bool {
    unconfirmed.into_iter().all(|routed_by| routed_by >= read)
}

/// Must a publisher that registers again after its lease lapsed, having read
/// `read`, publish again (before anything new, by the map it just read) an
/// event it published by `routed_by`?
///
/// Yes when the event is not confirmed, and also when it is confirmed but no
/// acknowledgement of a later generation covers it (`acknowledged ≤
/// routed_by`): its confirm may have come after the lease lapsed, when a
/// barrier had already gone on without this publisher, so the event may sit
/// behind the marker in its old queue and be forwarded after the publisher's
/// next events. Its copy goes by the new route ahead of them; the late
/// original becomes a duplicate.
pub fn must_resend(
    routed_by: Generation,
    confirmed: bool,
    acknowledged: Generation,
    read: Generation,
) -> bool {
    !confirmed || (routed_by < read && acknowledged <= routed_by)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_unacknowledged_publisher_holds_the_barrier() {
        let g = Generation(5);
        let leases = [
            Lease {
                deadline_ms: 100,
                acknowledged: g,
            },
            Lease {
                deadline_ms: 50,
                acknowledged: Generation(4),
            },
        ];
        assert_eq!(barrier(&leases, g, 40), Barrier::Waiting(1));
        assert_eq!(barrier(&leases, g, 50), Barrier::Open);
        assert_eq!(barrier(&[], g, 0), Barrier::Open);
    }

    #[test]
    fn a_lapsed_publisher_resends_what_no_acknowledgement_covered() {
        let (g, next) = (Generation(3), Generation(4));
        // Confirmed, routed by g, never acknowledged past g: resent.
        assert!(must_resend(g, true, g, next));
        // Covered by an acknowledgement of g + 1: its confirm came while the lease held.
        assert!(!must_resend(g, true, next, next));
        // Routed by the map just read: where a resend would go anyway.
        assert!(!must_resend(next, true, next, next));
        assert!(must_resend(next, false, next, next));
    }

    #[test]
    fn acknowledging_waits_for_older_confirms() {
        assert!(may_acknowledge(Generation(3), [Generation(3)]));
        assert!(!may_acknowledge(
            Generation(3),
            [Generation(3), Generation(2)]
        ));
        assert!(may_acknowledge(Generation(3), []));
    }
}
