//! Acks: the one door through which settled deliveries are acked. A group's
//! events are acked with one `multiple` ack when that covers exactly them;
//! the invariant, unit-tested below: a `multiple` ack never covers a
//! delivery still unacked that is not settled (held by the gate, waiting in
//! the read-ahead, in flight).

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;

/// How settled deliveries are acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acks {
    /// One `multiple` ack of this tag: every delivery up to it is settled or
    /// acked before.
    UpTo(u64),
    /// One ack per settled delivery.
    Each,
}

/// How to ack `settled` (delivery tags, ascending): one `multiple` ack of the
/// last when they are consecutive and no other unacked delivery of the
/// channel lies below it (`unsettled_below(tag)`); else one by one. `None`
/// when nothing is settled.
pub(crate) fn plan(settled: &[u64], unsettled_below: impl FnOnce(u64) -> bool) -> Option<Acks> {
    let (&low, &high) = (settled.first()?, settled.last()?);
    let consecutive = high.checked_sub(low) == Some(settled.len() as u64 - 1);
    if consecutive && !unsettled_below(high) {
        Some(Acks::UpTo(high))
    } else {
        Some(Acks::Each)
    }
}

/// Acks one settled delivery.
pub(crate) async fn ack_one(delivery: &Delivery) -> Result<(), lapin::Error> {
    delivery.ack(BasicAckOptions::default()).await?;
    Ok(())
}

/// Acks `settled` (in delivery order) as [`plan`] says.
pub(crate) async fn ack_all(
    settled: &[&Delivery],
    unsettled_below: impl FnOnce(u64) -> bool,
) -> Result<(), lapin::Error> {
    let tags: Vec<u64> = settled.iter().map(|d| d.delivery_tag).collect();
    match plan(&tags, unsettled_below) {
        None => {}
        Some(Acks::UpTo(_)) => {
            if let Some(last) = settled.last() {
                last.ack(BasicAckOptions { multiple: true }).await?;
            }
        }
        Some(Acks::Each) => {
            for delivery in settled {
                ack_one(delivery).await?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Where a delivery of the channel is when a batch is acked.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum State {
        AckedBefore,
        Settled,
        /// Held by the gate, waiting in the read-ahead or in flight.
        Unsettled,
    }

    fn state() -> impl Strategy<Value = State> {
        prop_oneof![
            Just(State::AckedBefore),
            Just(State::Settled),
            Just(State::Unsettled)
        ]
    }

    fn tags(channel: &[State], of: State) -> Vec<u64> {
        (1u64..)
            .zip(channel)
            .filter(|(_, s)| **s == of)
            .map(|(tag, _)| tag)
            .collect()
    }

    proptest! {
        #[test]
        fn a_multiple_ack_covers_only_settled_or_acked_deliveries(
            channel in prop::collection::vec(state(), 1..40)
        ) {
            let settled = tags(&channel, State::Settled);
            let unsettled = tags(&channel, State::Unsettled);
            let plan = plan(&settled, |high| unsettled.iter().any(|&t| t < high));
            match plan {
                None => prop_assert!(settled.is_empty()),
                Some(Acks::UpTo(high)) => {
                    prop_assert_eq!(Some(&high), settled.last());
                    prop_assert!(unsettled.iter().all(|&t| t > high), "{:?}", channel);
                }
                Some(Acks::Each) => prop_assert!(!settled.is_empty()),
            }
        }
    }

    #[test]
    fn a_run_of_settled_deliveries_with_nothing_below_is_one_ack() {
        assert_eq!(plan(&[4, 5, 6], |_| false), Some(Acks::UpTo(6)));
    }

    #[test]
    fn a_held_delivery_below_or_a_hole_makes_it_one_ack_each() {
        assert_eq!(plan(&[4, 5, 6], |high| high > 3), Some(Acks::Each));
        assert_eq!(plan(&[4, 6], |_| false), Some(Acks::Each));
        assert_eq!(plan(&[], |_| false), None);
    }

    #[tokio::test]
    async fn each_settled_delivery_is_acked_once() {
        let deliveries: Vec<Delivery> = (1..=3)
            .map(|tag| Delivery::mock(tag, "".into(), "".into(), false, Vec::new()))
            .collect();
        let refs: Vec<&Delivery> = deliveries.iter().collect();
        ack_all(&refs, |_| true).await.unwrap();
        assert!(deliveries.iter().all(|d| !d.acker.usable()), "all acked");
        let more = Delivery::mock(4, "".into(), "".into(), false, Vec::new());
        ack_all(&[&more], |_| false).await.unwrap();
        assert!(!more.acker.usable());
    }
}
