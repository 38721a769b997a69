//! The settle stage driven without a broker or Redis (`crate::testing`),
//! under tokio's paused clock for the retry delays.

use std::sync::Arc;

use super::*;
use crate::config::Config;
use crate::dedup::memory::MemoryOrderState;
use crate::handler::HandlerError;
use crate::intake::lookahead::Lookahead;
use crate::testing::{Scripted, Shard, acked, event, record_of, replayed};

fn passed(settled: &Settled, order: &str) -> bool {
    matches!(settled, Settled::Done { order_key: Some(key) } if key == order)
}

#[tokio::test(start_paused = true)]
async fn a_processed_event_is_committed_then_acked() {
    let (handler, shard, mut store) = shard_answering(vec![]);
    let (delivery, acker) = event(1, "A", 1);
    let settled = shard.settle(&mut store, delivery).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 1);
    assert_eq!(shard.order("A").l, Some(1), "the gate moved to seq 1");
    assert!(
        shard.order("A").c.is_none(),
        "the claim is given up with the commit"
    );
    assert!(shard.letters.reasons().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_retryable_failure_is_retried_in_place_after_its_backoff() {
    let (handler, shard, mut store) = shard_answering(vec![
        Err(HandlerError::retryable("503")),
        Err(HandlerError::retryable("503")),
    ]);
    let (delivery, acker) = event(1, "A", 1);
    let started = Instant::now();
    let settled = shard.settle(&mut store, delivery).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 3);
    // Two delays, base then base × factor, each within its jitter.
    let waited = started.elapsed();
    let policy = &shard.config.retry;
    let exact = policy.base.mul_f64(1.0 + policy.factor);
    assert!(waited >= exact.mul_f64(1.0 - policy.jitter), "{waited:?}");
    assert!(waited <= exact.mul_f64(1.0 + policy.jitter), "{waited:?}");
    assert_eq!(shard.order("A").l, Some(1));
}

#[tokio::test(start_paused = true)]
async fn a_spent_budget_dead_letters_then_records_then_acks() {
    let attempts = Config::default().retry.max_attempts;
    let (handler, shard, mut store) = shard_answering(failing(attempts));
    let (delivery, acker) = event(1, "A", 1);
    let settled = shard.settle(&mut store, delivery).await;
    assert!(passed(&settled, "A"), "its order's successors may run");
    assert!(acked(&acker));
    assert_eq!(handler.calls(), attempts);
    assert_eq!(shard.letters.reasons(), ["handler"]);
    let order = shard.order("A");
    assert_eq!(
        (order.l, order.u.as_deref()),
        (Some(1), Some("1")),
        "passed, never processed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_dead_letter_is_published_again_with_its_event_unacked() {
    let (handler, shard, mut store) = shard_answering(vec![Err(HandlerError::permanent("400"))]);
    *shard.letters.refusals.lock().unwrap() = 2;
    let (delivery, acker) = event(1, "A", 1);
    let started = Instant::now();
    let settled = shard.settle(&mut store, delivery).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 1, "a permanent failure is not retried");
    assert_eq!(shard.letters.reasons(), ["handler"]);
    assert!(
        started.elapsed() >= 2 * Duration::from_secs(1),
        "one pause per refusal"
    );
}

#[tokio::test(start_paused = true)]
async fn a_second_copy_of_a_processed_event_is_acked_without_a_call() {
    let (handler, shard, mut store) = shard_answering(vec![]);
    let (first, _) = event(1, "A", 1);
    shard.settle(&mut store, first).await;
    let (copy, acker) = event(2, "A", 1);
    let settled = shard.settle(&mut store, copy).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_event_ahead_of_its_order_is_held_unacked_without_a_call() {
    let (handler, shard, mut store) = shard_answering(vec![]);
    let (first, _) = event(1, "A", 1);
    shard.settle(&mut store, first).await;
    let (ahead, acker) = event(2, "A", 3);
    let settled = shard.settle(&mut store, ahead).await;
    assert!(
        matches!(&settled, Settled::Hold { order_key, seq: 3, start: false, .. } if order_key == "A"),
        "a gap before seq 3"
    );
    assert!(!acked(&acker));
    assert_eq!(handler.calls(), 1);
    let (new_order, _) = event(3, "B", 2);
    let settled = shard.settle(&mut store, new_order).await;
    assert!(
        matches!(
            &settled,
            Settled::Hold {
                seq: 2,
                start: true,
                ..
            }
        ),
        "an order without state waits the start grace"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stale_consumer_is_fenced_and_leaves_its_event_unacked() {
    let (_, shard, mut old) = shard_answering(vec![]);
    let (first, _) = event(1, "A", 1);
    shard.settle(&mut old, first).await;
    // The shard moved to a newer consumer, which wrote the order.
    let newer = shard.consumer();
    newer.new_consumer();
    let mut newer = newer;
    let (second, _) = event(2, "A", 2);
    shard.settle(&mut newer, second).await;
    let (third, acker) = event(3, "A", 3);
    let settled = shard.settle(&mut old, third).await;
    assert!(matches!(settled, Settled::Fenced));
    assert!(!acked(&acker), "left for the newer owner");
    assert_eq!(shard.order("A").l, Some(2));
}

#[tokio::test(start_paused = true)]
async fn a_body_that_is_no_envelope_is_dead_lettered_decode_without_a_call() {
    let (handler, shard, mut store) = shard_answering(vec![]);
    let delivery =
        lapin::message::Delivery::mock(1, "".into(), "".into(), false, b"not json".to_vec());
    let acker = delivery.acker.clone();
    let settled = shard.settle(&mut store, delivery).await;
    assert!(matches!(settled, Settled::Done { order_key: None }));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 0);
    assert_eq!(shard.letters.reasons(), ["decode"]);
}

#[tokio::test(start_paused = true)]
async fn the_commit_claims_the_next_delivery_already_here_in_the_same_call() {
    use futures_util::StreamExt as _;
    let (handler, shard, mut store) = shard_answering(vec![]);
    let (next, _) = event(2, "A", 2);
    let mut lookahead = Lookahead::new(
        futures_util::stream::iter(vec![Ok(next)]).chain(futures_util::stream::pending()),
    );
    let (first, _) = event(1, "A", 1);
    let settled = shard
        .settle_ahead(&mut store, first, Some(&mut lookahead))
        .await;
    assert!(passed(&settled, "A"));
    let claim = shard
        .order("A")
        .c
        .expect("seq 2 claimed with seq 1's commit");
    assert_eq!((claim.seq, claim.starts), (2, 1));
    let ahead = lookahead.peek(&shard.ctx.processor).unwrap();
    assert_eq!(ahead.admitted, Some(crate::dedup::Verdict::Claimed));
    let (next, acker) = {
        let ready = lookahead.next(&shard.ctx.processor).await.unwrap().unwrap();
        let acker = ready.delivery.acker.clone();
        (ready, acker)
    };
    let mut in_flight = None;
    let settled = settle(
        &shard.ctx,
        &shard.letters,
        &mut store,
        next,
        Directive::Normal,
        Some(&mut lookahead),
        &mut in_flight,
    )
    .await
    .unwrap();
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(
        handler.calls(),
        2,
        "the early claim is the attempt's, not a second one"
    );
    assert_eq!(shard.order("A").l, Some(2));
}

/// A shard without the breaker whose handler answers `answers` (then
/// succeeds), and a consumer of its order state.
fn shard_answering(
    answers: Vec<Result<(), HandlerError>>,
) -> (Arc<Scripted>, Shard, MemoryOrderState) {
    let handler = Scripted::answering(answers);
    let shard = Shard::new(handler.clone());
    let store = shard.consumer();
    (handler, shard, store)
}

/// `n` retryable failures.
fn failing(n: u32) -> Vec<Result<(), HandlerError>> {
    (0..n)
        .map(|_| Err(HandlerError::retryable("503")))
        .collect()
}

/// A shard with the breaker whose handler answers `answers`, its consumer,
/// and a read-ahead holding B's first event; A's first event settled with
/// it. A's acker.
async fn a_then_b_with_breaker(
    answers: Vec<Result<(), HandlerError>>,
) -> (
    Arc<Scripted>,
    Shard,
    MemoryOrderState,
    Lookahead<impl crate::intake::lookahead::Deliveries>,
    Settled,
    lapin::Acker,
) {
    let handler = Scripted::answering(answers);
    let shard = Shard::with_breaker(handler.clone());
    let mut store = shard.consumer();
    let (b, _) = event(2, "B", 1);
    let mut lookahead = read_ahead(vec![b]);
    let (a, a_acker) = event(1, "A", 1);
    let settled = shard
        .settle_ahead(&mut store, a, Some(&mut lookahead))
        .await;
    (handler, shard, store, lookahead, settled, a_acker)
}

/// A serial shard's read-ahead holding `sent`, the broker sending nothing more.
fn read_ahead(
    sent: Vec<lapin::message::Delivery>,
) -> Lookahead<impl crate::intake::lookahead::Deliveries> {
    use futures_util::StreamExt as _;
    let sent = sent.into_iter().map(Ok).collect::<Vec<_>>();
    Lookahead::new(futures_util::stream::iter(sent).chain(futures_util::stream::pending()))
}

#[tokio::test(start_paused = true)]
async fn a_poison_event_is_dead_lettered_once_another_orders_event_succeeds_as_evidence() {
    let attempts = Config::default().retry.max_attempts;
    let mut answers = failing(attempts);
    answers.push(Ok(()));
    let (handler, shard, mut store, mut lookahead, settled, a_acker) =
        a_then_b_with_breaker(answers).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&a_acker));
    assert_eq!(
        shard.letters.reasons(),
        ["handler"],
        "B's success made A poison"
    );
    assert_eq!(handler.calls(), attempts + 1);
    // B was tried as the evidence: it comes back first with that outcome and
    // is settled from it, without a second call.
    let b = lookahead.next(&shard.ctx.processor).await.unwrap().unwrap();
    assert!(b.tried.is_some());
    let b_acker = b.delivery.acker.clone();
    let mut in_flight = None;
    let settled = settle(
        &shard.ctx,
        &shard.letters,
        &mut store,
        b,
        Directive::Normal,
        Some(&mut lookahead),
        &mut in_flight,
    )
    .await
    .unwrap();
    assert!(passed(&settled, "B"));
    assert!(acked(&b_acker));
    assert_eq!(handler.calls(), attempts + 1);
}

#[tokio::test(start_paused = true)]
async fn an_outage_seen_in_another_orders_evidence_dead_letters_nothing() {
    let attempts = Config::default().retry.max_attempts;
    // Every call fails until the downstream is back.
    let (handler, shard, _, _, settled, a_acker) =
        a_then_b_with_breaker(failing(attempts + 3)).await;
    assert!(
        passed(&settled, "A"),
        "processed once the downstream is back"
    );
    assert!(acked(&a_acker));
    assert!(
        shard.letters.reasons().is_empty(),
        "an outage dead-letters nothing"
    );
    assert!(
        handler.calls() > attempts + 1,
        "A was tried again after the evidence"
    );
    assert_eq!(shard.order("A").l, Some(1));
}

/// Seq 2 of order A dead-lettered (`handler`), seq 1 processed: a replay of
/// seq 2 is what can run now.
async fn with_seq_2_dead_lettered() -> (Arc<Scripted>, Shard, MemoryOrderState) {
    let (handler, shard, mut store) =
        shard_answering(vec![Ok(()), Err(HandlerError::permanent("400"))]);
    for seq in [1, 2] {
        let (delivery, _) = event(seq, "A", seq);
        shard.settle(&mut store, delivery).await;
    }
    assert_eq!(shard.letters.reasons(), ["handler"]);
    (handler, shard, store)
}

#[tokio::test(start_paused = true)]
async fn a_replay_marker_without_a_record_is_gated_like_a_fresh_event() {
    let (handler, shard, mut store) = shard_answering(vec![]);
    let (ahead, acker) = event(1, "A", 3);
    let settled = shard
        .settle(&mut store, replayed(ahead, "0190-forged"))
        .await;
    assert!(
        matches!(
            &settled,
            Settled::Hold {
                seq: 3,
                start: true,
                ..
            }
        ),
        "a forged marker on seq 3 waits for seq 1 like any event"
    );
    assert!(!acked(&acker));
    assert_eq!(handler.calls(), 0);
    assert!(shard.letters.reasons().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_recorded_replay_passes_the_gate_once_and_spends_its_record() {
    let (handler, shard, mut store) = with_seq_2_dead_lettered().await;
    let (replay, acker) = event(3, "A", 2);
    let replay = replayed(replay, "dl-2");
    shard.store.record_replay("dl-2", &record_of(&replay));
    let settled = shard.settle(&mut store, replay).await;
    assert!(passed(&settled, "A"));
    assert!(acked(&acker));
    assert_eq!(handler.calls(), 3, "the replay ran");
    assert_eq!(shard.order("A").u, None, "seq 2 is processed now");
    assert_eq!(
        shard.store.replay_record("dl-2"),
        None,
        "spent by the commit"
    );
    let (copy, acker) = event(4, "A", 2);
    let settled = shard.settle(&mut store, replayed(copy, "dl-2")).await;
    assert!(passed(&settled, "A") && acked(&acker));
    assert_eq!(handler.calls(), 3, "a copy after the commit is a duplicate");
}

#[tokio::test(start_paused = true)]
async fn a_record_of_another_body_or_order_backs_no_replay() {
    let (other_order, _) = event(3, "B", 2);
    let mut other_body = event(3, "A", 2).0;
    other_body.data = br#"{"order_id":"A","event":"order.paid","seq":2,"data":1}"#.to_vec();
    for recorded_for in [other_order, other_body] {
        let (handler, shard, mut store) = with_seq_2_dead_lettered().await;
        shard.store.record_replay("dl-2", &record_of(&recorded_for));
        let (replay, acker) = event(4, "A", 2);
        let settled = shard.settle(&mut store, replayed(replay, "dl-2")).await;
        assert!(passed(&settled, "A") && acked(&acker));
        assert_eq!(handler.calls(), 2, "gated as a fresh event: seq 2 is late");
        assert_eq!(shard.letters.reasons(), ["handler", "late"]);
        let error = &shard.letters.errors()[1];
        assert!(
            error.contains("\"dl-2\" has no matching replay record"),
            "{error}"
        );
        assert!(error.contains("shardline dlq replay"), "{error}");
        assert!(shard.store.replay_record("dl-2").is_some(), "not spent");
    }
}
