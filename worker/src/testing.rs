//! Test fixtures for driving the stages without a broker or Redis: mock
//! deliveries (their ackers show whether they were acked), the in-memory
//! order state, a dead-letter sink that records, and a handler that answers
//! from a script.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use lapin::message::Delivery;
use shardline_contract::headers;
use shardline_contract::{ShardCount, ShardId};
use shardline_publisher::ConfirmError;
use tokio::sync::Notify;

use crate::attempt::Processor;
use crate::breaker::Breaker;
use crate::config::Config;
use crate::context::ShardContext;
use crate::dedup::Dedup;
use crate::dedup::memory::{MemoryOrderState, MemoryStore, OrderView};
use crate::delivery::{Directive, Ready};
use crate::era::RedisEra;
use crate::handler::{Event, Handler, HandlerError};
use crate::intake::lookahead::{Deliveries, Lookahead};
use crate::metrics::Metrics;
use crate::settle::{DeadLetters, Settled, settle};

/// Answers each call with the next scripted result (then success), and
/// counts the calls.
#[derive(Default)]
pub(crate) struct Scripted {
    answers: Mutex<VecDeque<Result<(), HandlerError>>>,
    calls: Mutex<u32>,
}

impl Scripted {
    pub(crate) fn answering(answers: Vec<Result<(), HandlerError>>) -> Arc<Self> {
        Arc::new(Self {
            answers: Mutex::new(answers.into()),
            calls: Mutex::new(0),
        })
    }

    pub(crate) fn calls(&self) -> u32 {
        *self.calls.lock().unwrap()
    }
}

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, _event: &Event<'_>) -> Result<(), HandlerError> {
        *self.calls.lock().unwrap() += 1;
        self.answers.lock().unwrap().pop_front().unwrap_or(Ok(()))
    }
}

/// Records dead letters (reason, `x-error`); refuses the first `refusals`.
#[derive(Default)]
pub(crate) struct Letters {
    published: Mutex<Vec<(String, String)>>,
    pub(crate) refusals: Mutex<u32>,
}

impl DeadLetters for Letters {
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        _body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Result<(), ConfirmError> {
        let mut refusals = self.refusals.lock().unwrap();
        if *refusals > 0 {
            *refusals -= 1;
            return Err(ConfirmError::Nacked {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            });
        }
        let mut published = self.published.lock().unwrap();
        let error = headers::header_str(&properties, headers::ERROR).unwrap_or_default();
        published.push((routing_key.to_owned(), error.to_owned()));
        Ok(())
    }
}

impl Letters {
    pub(crate) fn reasons(&self) -> Vec<String> {
        let published = self.published.lock().unwrap();
        published.iter().map(|(reason, _)| reason.clone()).collect()
    }

    /// The `x-error` of each dead letter, in order.
    pub(crate) fn errors(&self) -> Vec<String> {
        let published = self.published.lock().unwrap();
        published.iter().map(|(_, error)| error.clone()).collect()
    }
}

/// One shard's context with `handler`, and its order state in memory.
pub(crate) struct Shard {
    pub(crate) ctx: ShardContext,
    pub(crate) config: Config,
    pub(crate) store: MemoryStore,
    pub(crate) letters: Letters,
}

impl Shard {
    /// A shard with the default settings and no breaker.
    pub(crate) fn new(handler: Arc<dyn Handler>) -> Self {
        Self::build(Config::default(), handler, false)
    }

    /// A shard whose worker has the downstream breaker (default policy).
    pub(crate) fn with_breaker(handler: Arc<dyn Handler>) -> Self {
        Self::build(Config::default(), handler, true)
    }

    fn build(config: Config, handler: Arc<dyn Handler>, breaker: bool) -> Self {
        let shard = ShardId::new(3, ShardCount::default()).expect("shard 3 of 16");
        let metrics = Metrics::new(&[shard], config.backlog, config.stuck_after);
        let shard_metrics = metrics.shards()[0].clone();
        let breaker = breaker.then(|| Breaker::new(config.breaker.clone(), metrics.breaker()));
        let processor = Processor::new(
            &config,
            shard,
            handler,
            shard_metrics.clone(),
            None,
            breaker,
        );
        let ctx = ShardContext {
            processor,
            dedup: Dedup::new(
                &config,
                shard,
                Arc::new(RedisEra::new(config.keys().redis_era())),
            ),
            names: config.names.clone(),
            shard,
            metrics: shard_metrics,
            evidence: Notify::new(),
        };
        Self {
            ctx,
            store: MemoryStore::new(),
            config,
            letters: Letters::default(),
        }
    }

    pub(crate) fn consumer(&self) -> MemoryOrderState {
        self.store.consumer(&self.config, self.ctx.shard)
    }

    /// Settles `delivery` as a concurrent shard does (no read-ahead).
    pub(crate) async fn settle(&self, store: &mut MemoryOrderState, delivery: Delivery) -> Settled {
        self.settle_ahead(store, delivery, None::<&mut Lookahead>)
            .await
    }

    /// Settles `delivery` as a serial shard does, with its read-ahead.
    pub(crate) async fn settle_ahead(
        &self,
        store: &mut MemoryOrderState,
        delivery: Delivery,
        lookahead: Option<&mut Lookahead<impl Deliveries>>,
    ) -> Settled {
        let ready = self.ready(delivery);
        let mut in_flight = None;
        let settled = settle(
            &self.ctx,
            &self.letters,
            store,
            ready,
            Directive::Normal,
            lookahead,
            &mut in_flight,
        )
        .await
        .expect("a mock delivery acks");
        assert!(in_flight.is_none(), "no claim is left in flight");
        settled
    }

    /// `delivery` as intake hands it on: decoded.
    pub(crate) fn ready(&self, delivery: Delivery) -> Ready {
        crate::intake::lookahead::ready(delivery, &self.ctx.processor)
    }

    pub(crate) fn order(&self, order: &str) -> OrderView {
        self.store.order(order)
    }
}

/// Seq `seq` of order `order`; its acker tells whether it was acked.
pub(crate) fn event(tag: u64, order: &str, seq: u64) -> (Delivery, lapin::Acker) {
    let body = format!(r#"{{"order_id":"{order}","event":"order.paid","seq":{seq}}}"#);
    let delivery = Delivery::mock(
        tag,
        "order.sharding".into(),
        "shard.3".into(),
        false,
        body.into_bytes(),
    );
    let acker = delivery.acker.clone();
    (delivery, acker)
}

/// `delivery` marked as the replay of dead letter `id` (`x-shardline-replay`).
pub(crate) fn replayed(mut delivery: Delivery, id: &str) -> Delivery {
    let mut table = lapin::types::FieldTable::default();
    table.insert(
        headers::REPLAY.into(),
        lapin::types::AMQPValue::LongString(id.into()),
    );
    delivery.properties = lapin::BasicProperties::default().with_headers(table);
    delivery
}

/// The replay record the replay tool writes for `delivery`.
pub(crate) fn record_of(delivery: &Delivery) -> String {
    let envelope = shardline_contract::Envelope::parse(&delivery.data, usize::MAX)
        .expect("a test event is an envelope");
    shardline_contract::replay::record(&envelope, &delivery.data)
}

pub(crate) fn acked(acker: &lapin::Acker) -> bool {
    !acker.usable()
}
