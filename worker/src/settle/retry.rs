//! Retries in place: an event's budget of counted failures, the delay before
//! its next attempt, and the dead letter once the budget is spent. Failures
//! during a downstream pause (the breaker open for an outage or for the
//! downstream's configuration) do not count.

use std::time::Duration;

use shardline_contract::headers::FailReason;
use tokio::time::Instant;

use crate::breaker::Breaker;
use crate::config::RetryPolicy;
use crate::delivery::Outcome;
use crate::handler::HandlerError;

/// What follows a retryable failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    Retry(Duration),
    /// The budget is used: dead-letter, unless the breaker calls it an outage.
    Exhausted,
}

/// An event's retry budget: the retryable failures that count toward
/// `--max-attempts` (not those of a downstream outage).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    used: u32,
    /// When its first counted failure happened: a success of another order
    /// since then shows the downstream up.
    pub(crate) since: Instant,
    /// The breaker's epoch it was counted in.
    pub(crate) epoch: u64,
}

impl Budget {
    /// A new budget, in the breaker's current epoch.
    pub(crate) fn new(breaker: Option<&Breaker>) -> Self {
        Self {
            used: 0,
            since: Instant::now(),
            epoch: breaker.map_or(0, Breaker::epoch),
        }
    }

    /// After a retryable failure: counts it — unless the breaker is paused,
    /// or opened since the budget began (then the budget starts again: its
    /// failures were the outage's) — and says what comes next.
    pub(crate) fn after_failure(
        &mut self,
        policy: &RetryPolicy,
        breaker: Option<&Breaker>,
        error: &HandlerError,
    ) -> Next {
        if let Some(breaker) = breaker {
            if breaker.epoch() != self.epoch {
                *self = Self::new(Some(breaker));
            }
            if breaker.is_paused() {
                return Next::Retry(policy.next_delay(1));
            }
        }
        if self.used == 0 {
            self.since = Instant::now();
        }
        self.used += 1;
        if self.used >= policy.max_attempts {
            return Next::Exhausted;
        }
        let after = match error.retry_after() {
            Some(asked) => asked.min(policy.retry_after_cap),
            None => policy.next_delay(self.used),
        };
        Next::Retry(after)
    }
}

/// The dead letter of an event whose retryable attempts are used up.
pub(crate) fn exhausted(error: &HandlerError, attempts: u32) -> Outcome {
    Outcome::DeadLetter {
        reason: match error {
            HandlerError::Timeout { .. } => FailReason::Timeout,
            _ => FailReason::Handler,
        },
        error: error.to_string(),
        attempts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{BreakerMetrics, Verdict};
    use crate::config::BreakerPolicy;

    fn policy() -> RetryPolicy {
        RetryPolicy::default()
    }

    fn unavailable() -> HandlerError {
        HandlerError::retryable("downstream answered 503")
    }

    #[tokio::test(start_paused = true)]
    async fn failures_count_to_max_attempts_with_backoff_within_its_jitter() {
        let p = policy();
        let mut budget = Budget::new(None);
        for failed in 1..p.max_attempts {
            let Next::Retry(after) = budget.after_failure(&p, None, &unavailable()) else {
                panic!("failure {failed} exhausted the budget");
            };
            let exact =
                p.base.as_secs_f64() * p.factor.powi(i32::try_from(failed - 1).unwrap_or(0));
            let exact = exact.min(p.cap.as_secs_f64());
            let (low, high) = (exact * (1.0 - p.jitter), exact * (1.0 + p.jitter));
            let after = after.as_secs_f64();
            assert!(
                after >= low - 1e-9 && after <= high + 1e-9,
                "failure {failed}: {after} outside {low}..{high}"
            );
        }
        assert_eq!(
            budget.after_failure(&p, None, &unavailable()),
            Next::Exhausted
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_sets_the_next_delay_up_to_its_cap() {
        let p = policy();
        let mut budget = Budget::new(None);
        let asked = HandlerError::retryable_after("429", Duration::from_secs(3));
        assert_eq!(
            budget.after_failure(&p, None, &asked),
            Next::Retry(Duration::from_secs(3))
        );
        let too_long = HandlerError::retryable_after("429", Duration::from_secs(3600));
        assert_eq!(
            budget.after_failure(&p, None, &too_long),
            Next::Retry(p.retry_after_cap)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_counted_failure_starts_the_clock() {
        let p = policy();
        let mut budget = Budget::new(None);
        tokio::time::advance(Duration::from_secs(7)).await;
        let before = Instant::now();
        budget.after_failure(&p, None, &unavailable());
        assert!(budget.since >= before);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_while_the_breaker_is_open_do_not_count_and_a_trip_starts_again() {
        let p = RetryPolicy {
            max_attempts: 2,
            ..policy()
        };
        let breaker = Breaker::new(BreakerPolicy::default(), BreakerMetrics::default());
        let mut budget = Budget::new(Some(&breaker));
        assert!(matches!(
            budget.after_failure(&p, Some(&breaker), &unavailable()),
            Next::Retry(_)
        ));
        // An outage: five orders fail, the breaker opens (a new epoch).
        for order in 0..5 {
            breaker
                .admit(&format!("o{order}"))
                .await
                .record(Verdict::Failure {
                    first: true,
                    retry_after: None,
                });
        }
        assert!(breaker.is_paused());
        for _ in 0..10 {
            assert!(matches!(
                budget.after_failure(&p, Some(&breaker), &unavailable()),
                Next::Retry(_)
            ));
        }
        assert_eq!(budget.epoch, breaker.epoch(), "the budget started again");
        assert_eq!(budget.used, 0);
    }

    #[test]
    fn a_spent_budget_is_dead_lettered_for_its_cause() {
        let timeout = exhausted(&HandlerError::timeout(Duration::from_secs(5)), 5);
        assert!(matches!(
            timeout,
            Outcome::DeadLetter {
                reason: FailReason::Timeout,
                attempts: 5,
                ..
            }
        ));
        let answered = exhausted(&unavailable(), 3);
        assert!(matches!(
            &answered,
            Outcome::DeadLetter { reason: FailReason::Handler, error, .. } if error == "downstream answered 503"
        ));
    }
}
