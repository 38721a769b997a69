//! Random operation sequences of two consumers (the first takes the older
//! fence token) over two small orders, on both stores. Leases are the
//! config's (over 30 s): none runs out, so no outcome rests on timing.

use proptest::prelude::*;

use super::*;

const KINDS: [&str; 2] = ["k", "j"];

/// An event delivery: its order, seq (none: unsequenced), kind, and which
/// of its deliveries (the claim token follows from all four).
#[derive(Debug, Clone, Copy)]
struct Pick {
    order: usize,
    seq: Option<u64>,
    kind: usize,
    delivery: u64,
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        who: usize,
        ev: Pick,
        redelivered: bool,
        bypass: bool,
        replay: Option<usize>,
    },
    Commit {
        who: usize,
        ev: Pick,
        replay: Option<usize>,
    },
    Step {
        who: usize,
        done: Pick,
        next: Pick,
    },
    Group {
        who: usize,
        done: Vec<Pick>,
        next: Vec<(Pick, bool)>,
        redelivered: bool,
    },
    Dead {
        who: usize,
        ev: Pick,
        replay: Option<usize>,
    },
    Release {
        who: usize,
        ev: Pick,
    },
    Renew {
        who: usize,
        ev: Pick,
        start: Start,
    },
    NewConsumer {
        who: usize,
    },
}

fn pick_with(seq: impl Strategy<Value = Option<u64>>) -> impl Strategy<Value = Pick> {
    (0..ORDERS.len(), seq, 0..KINDS.len(), 0u64..3).prop_map(|(order, seq, kind, delivery)| Pick {
        order,
        seq,
        kind,
        delivery,
    })
}

fn pick() -> impl Strategy<Value = Pick> {
    pick_with(prop_oneof![1 => Just(None), 7 => (1u64..=5).prop_map(Some)])
}

fn sequenced() -> impl Strategy<Value = Pick> {
    pick_with((1u64..=5).prop_map(Some))
}

fn replay() -> impl Strategy<Value = Option<usize>> {
    prop::option::weighted(0.25, 0usize..8)
}

fn start() -> impl Strategy<Value = Start> {
    prop_oneof![Just(Start::Begins), Just(Start::Ended), Just(Start::Waits)]
}

fn op() -> impl Strategy<Value = Op> {
    let who = 0usize..2;
    prop_oneof![
        6 => (who.clone(), pick(), any::<bool>(), prop::bool::weighted(0.3), replay())
            .prop_map(|(who, ev, redelivered, bypass, replay)| Op::Admit { who, ev, redelivered, bypass, replay }),
        4 => (who.clone(), pick(), replay()).prop_map(|(who, ev, replay)| Op::Commit { who, ev, replay }),
        2 => (who.clone(), pick(), pick()).prop_map(|(who, done, next)| Op::Step { who, done, next }),
        2 => (
            who.clone(),
            prop::collection::vec(pick(), 0..3),
            prop::collection::vec((sequenced(), prop::bool::weighted(0.3)), 0..3),
            any::<bool>(),
        )
            .prop_map(|(who, done, next, redelivered)| Op::Group { who, done, next, redelivered }),
        2 => (who.clone(), pick(), replay()).prop_map(|(who, ev, replay)| Op::Dead { who, ev, replay }),
        1 => (who.clone(), pick()).prop_map(|(who, ev)| Op::Release { who, ev }),
        2 => (who.clone(), pick(), start()).prop_map(|(who, ev, start)| Op::Renew { who, ev, start }),
        1 => who.prop_map(|who| Op::NewConsumer { who }),
    ]
}

impl<W: World> Run<W> {
    /// The delivery `pick` names; a replay of the `replay`-th letter made
    /// so far (modulo their number), if any.
    fn delivery(&self, pick: Pick, replay: Option<usize>) -> Ev {
        let order = ORDERS[pick.order];
        let kind = KINDS[pick.kind];
        let key = match pick.seq {
            Some(seq) => format!("{order}:{kind}:{seq}"),
            None => format!("{order}:{kind}:-"),
        };
        let order_index = u64::try_from(pick.order).unwrap_or_default();
        let kind_index = u64::try_from(pick.kind).unwrap_or_default();
        let token = 1
            + order_index * 10_000
            + pick.seq.unwrap_or(0) * 100
            + kind_index * 10
            + pick.delivery;
        let letters: Vec<&String> = self.letters.iter().collect();
        let replay_of = replay
            .filter(|_| !letters.is_empty())
            .map(|n| letters[n % letters.len()].clone());
        Ev {
            order: shardline_contract::OrderId::new(order)
                .expect("a generated order id")
                .key(),
            kind: kind.to_owned(),
            code: Keys::kind_code(kind),
            seq: pick.seq,
            key,
            token,
            replay_of,
        }
    }

    fn watch(&mut self, ev: &Ev) {
        if ev.seq.is_none() {
            self.events.insert(ev.key.clone());
        }
    }

    async fn apply(&mut self, consumers: &mut [W::State; 2], op: &Op) {
        match op {
            Op::Admit {
                who,
                ev,
                redelivered,
                bypass,
                replay,
            } => {
                let ev = self.delivery(*ev, *replay);
                self.watch(&ev);
                self.admit_as(&mut consumers[*who], &ev, *redelivered, *bypass)
                    .await;
            }
            Op::Commit { who, ev, replay } => {
                let ev = self.delivery(*ev, *replay);
                self.watch(&ev);
                self.commit(&mut consumers[*who], &ev).await;
            }
            Op::Step { who, done, next } => {
                let (done, next) = (self.delivery(*done, None), self.delivery(*next, None));
                self.watch(&done);
                self.watch(&next);
                self.step(&mut consumers[*who], &done, &next).await;
            }
            Op::Group {
                who,
                done,
                next,
                redelivered,
            } => {
                let done: Vec<Ev> = done.iter().map(|p| self.delivery(*p, None)).collect();
                let next: Vec<(Ev, bool)> = next
                    .iter()
                    .map(|(p, chained)| (self.delivery(*p, None), *chained))
                    .collect();
                for ev in &done {
                    self.watch(ev);
                }
                let done: Vec<&Ev> = done.iter().collect();
                let next: Vec<(&Ev, bool)> =
                    next.iter().map(|(ev, chained)| (ev, *chained)).collect();
                self.group_as(&mut consumers[*who], &done, &next, *redelivered)
                    .await;
            }
            Op::Dead { who, ev, replay } => {
                let ev = self.delivery(*ev, *replay);
                self.watch(&ev);
                let id = format!("dl-{:02}", self.letters.len());
                self.dead(&mut consumers[*who], &ev, &id).await;
            }
            Op::Release { who, ev } => {
                let ev = self.delivery(*ev, None);
                self.watch(&ev);
                self.release(&mut consumers[*who], &ev).await;
            }
            Op::Renew { who, ev, start } => {
                let ev = self.delivery(*ev, None);
                self.watch(&ev);
                self.renew(&mut consumers[*who], &ev, *start).await;
            }
            Op::NewConsumer { who } => self.new_consumer(&mut consumers[*who]).await,
        }
    }

    /// Two consumers, the first with the older token, then `ops`.
    async fn play(&mut self, ops: &[Op]) {
        let mut consumers = [self.world.consumer(), self.world.consumer()];
        for consumer in &mut consumers {
            self.fence(consumer).await;
        }
        for op in ops {
            self.apply(&mut consumers, op).await;
        }
    }
}

/// Plays `ops` on both stores and compares their records.
fn compare(ops: &[Op], setup: Setup) {
    let fake = paused_runtime().block_on(async {
        let mut run = Run::new(Fake::new(setup));
        run.play(ops).await;
        run.finish().1
    });
    let lua = runtime().block_on(async {
        let mut run = Run::new(Lua::new("random", setup).await);
        run.play(ops).await;
        let (world, record) = run.finish();
        world.store.clean().await;
        record
    });
    agree(&fake, &lua);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever two consumers do, in any order, the fake answers and
    /// writes what the scripts do.
    #[test]
    fn random_operations_agree(
        ops in prop::collection::vec(op(), 1..40),
        quarantine in any::<bool>(),
        max_deliveries in 1u32..4,
    ) {
        compare(&ops, Setup { quarantine, max_deliveries, lease: None });
    }
}
