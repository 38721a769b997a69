//! The publisher: routes each event to its shard and publishes it confirmed,
//! in call order, re-sending what was unconfirmed after a connection loss.
//!
//! One channel carries every event, so the broker sees them in call order; the
//! unconfirmed ones are kept (see `window.rs`) and after a loss are
//! re-sent, in that order, on a fresh channel before anything new. This loop is
//! the only owner of reconnection (lapin's auto-recover stays off). Re-sending
//! may duplicate an event whose confirm was lost in flight; the worker's dedup
//! absorbs that, while a gap or a reordering would not be absorbed.

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Instant, SystemTime};

use lapin::options::ExchangeDeclareOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ErrorKind, ExchangeKind, PublisherConfirm};
use opentelemetry::global::{self, BoxedTracer};
use opentelemetry::trace::{SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use shardline_connect::broker::{BlockedWatch, soft_error};
use shardline_connect::{probe, record};
use shardline_contract::reshard::Generation;
use shardline_contract::telemetry::{self, attr, op};
use shardline_contract::{Envelope, EnvelopeError, NewEvent, OrderId, ShardId, headers, w3c};

use crate::config::Config;
use crate::confirm::{self, ConfirmChannel, Refusal};
use crate::error::PublishError;
use crate::latency::LatencyHistogram;
use crate::lease::Membership;
use crate::window::{Outgoing, Unconfirmed};

/// Running totals of one publisher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Events accepted by a publish call (sent, or queued to be re-sent).
    pub published: u64,
    /// Events the broker confirmed (acked and routed).
    pub confirmed: u64,
    /// Sends repeated on a new channel after a loss.
    pub resent: u64,
    /// Channels (and, when needed, connections) re-opened after a loss.
    pub reconnects: u64,
}

/// A confirmed, ordered publisher over one connection and one channel.
///
/// Not cancel-safe in the strict sense: dropping a publish future half way may
/// re-send some events on the next call (in order); it never loses or reorders them.
pub struct Publisher {
    config: Config,
    /// The registration in resharding's confirm barrier and the routing of
    /// the generation it acknowledged; `None`: `config.shards` routes (a
    /// legacy publisher, served by forwarding after a reshard).
    membership: Option<Membership>,
    exchange: ShortString,
    conn: Option<Connection>,
    /// The connection's flow control (a memory or disk alarm blocks it).
    blocked: Option<BlockedWatch>,
    channel: Option<ConfirmChannel>,
    unconfirmed: Unconfirmed<PublisherConfirm>,
    /// True while the channel may hold a send we did not see complete (a
    /// failed or abandoned send): the next operation starts on a fresh channel.
    channel_suspect: bool,
    counts: Counts,
    latency: LatencyHistogram,
    /// The global tracer as it was at connect (a no-op without a provider).
    tracer: BoxedTracer,
    span_name: std::borrow::Cow<'static, str>,
    /// The trace context sent with the last traced event.
    last_trace: Option<SpanContext>,
    /// Nacks of the oldest event in a row (an ack resets it), and when the
    /// window may be re-sent after the last one.
    nacks: u32,
    resend_after: Option<Instant>,
}

/// Longest a channel or connection close may wait for the broker's close-ok:
/// on a connection whose node stopped answering (frozen, partitioned) it
/// never comes.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What settling the oldest confirm did.
enum Settled {
    /// The event left the window, confirmed.
    Done,
    /// It was nacked and stays at the window's head: the connection was
    /// dropped, and the window is re-sent on a new one after a pause.
    Resend,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("amqp", &self.config.amqp)
            .field("exchange", &self.config.names.exchange)
            .field("unconfirmed", &self.unconfirmed.len())
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Connects, checks that the exchange exists and turns on publisher confirms.
    /// Fails at once (no retry) when the broker cannot be reached.
    pub async fn connect(config: Config) -> Result<Self, PublishError> {
        // Boxed: connecting reads the recorded topology and registers, which
        // would deepen every caller's future.
        Box::pin(Self::connect_unboxed(config)).await
    }

    async fn connect_unboxed(config: Config) -> Result<Self, PublishError> {
        let exchange = short("exchange", &config.names.exchange)?;
        let conn = shardline_connect::connect(&config.amqp, &config.connection_name).await?;
        let channel = open_channel(&conn, &exchange, &config.names.exchange).await?;
        let membership = match (&config.redis, config.check_shard_count) {
            (_, false) => None,
            (Some(redis), true) => {
                let keys = config.keys();
                // Boxed: the record's reads would deepen every caller's future.
                let standing = Box::pin(record::standing(
                    redis,
                    &keys,
                    &conn,
                    &config.names,
                    config.shards,
                    "publisher",
                ))
                .await
                .map_err(Box::new)?;
                match standing {
                    Some(record) => {
                        // (The command line follows the record before it gets here.)
                        if !record.agrees(config.shards) {
                            let line =
                                record.config_disagreement(config.shards, "routing by the record");
                            tracing::warn!("{line}");
                        }
                        let joined = Box::pin(Membership::join(
                            redis,
                            keys,
                            &config.connection_name,
                            &record,
                        ))
                        .await
                        .map_err(Box::new)?;
                        Some(joined)
                    }
                    None => None,
                }
            }
            (None, true) => {
                shardline_connect::declare::check_shard_count(&conn, &config.names, config.shards)
                    .await?;
                None
            }
        };
        // Nothing a publisher does depends on the broker's version: it is
        // read in the background and logged for the operator (the worker and
        // `topology apply` decide on it).
        let amqp = config.amqp.clone();
        tokio::spawn(async move {
            let facts = probe::read_facts(&amqp).await;
            probe::log(&probe::assess(&facts, &probe::Plan::default()));
        });
        tracing::debug!(
            amqp = %config.amqp,
            exchange = %config.names.exchange,
            window = config.window,
            "publisher connected"
        );
        let span_name = telemetry::span::publish(&config.names.exchange);
        Ok(Self {
            unconfirmed: Unconfirmed::new(config.window),
            config,
            membership,
            exchange,
            blocked: Some(BlockedWatch::new(&conn, "publishing")),
            conn: Some(conn),
            channel: Some(channel),
            channel_suspect: false,
            counts: Counts::default(),
            latency: LatencyHistogram::default(),
            tracer: global::tracer_with_scope(telemetry::scope()),
            span_name,
            last_trace: None,
            nacks: 0,
            resend_after: None,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Publish → confirm latency of every confirmed event.
    pub fn latency(&self) -> &LatencyHistogram {
        &self.latency
    }

    /// The trace context (`traceparent`) the last event published by
    /// [`publish`](Self::publish), [`publish_envelope`](Self::publish_envelope)
    /// or [`publish_event`](Self::publish_event) carries: where to look it up.
    pub fn last_trace(&self) -> Option<&SpanContext> {
        self.last_trace.as_ref()
    }

    /// Events sent or queued but not confirmed yet.
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed.len()
    }

    /// The shard an order's events go to: its bucket's in the recorded map,
    /// or without a record `md5 mod shards`.
    pub fn shard_of(&self, order_id: &OrderId) -> ShardId {
        match &self.membership {
            Some(m) => m.routing().shard_of(order_id),
            None => self.config.shards.shard_of(order_id),
        }
    }

    /// An order's shard and the routing key of its event now: `shard.{i}`,
    /// or during a reshard's move `move.{g}.{i}-{j}` (one hash of the id).
    fn route(&self, order_id: &OrderId) -> (ShardId, String) {
        match &self.membership {
            Some(m) => m.routing().route(order_id),
            None => {
                let shard = self.config.shards.shard_of(order_id);
                (shard, shardline_contract::Names::routing_key(shard))
            }
        }
    }

    /// The id this publisher is registered under in `{prefix}publishers`
    /// (resharding's confirm barrier); `None` for a publisher without the
    /// recorded topology.
    pub fn registration(&self) -> Option<&str> {
        self.membership.as_ref().map(Membership::id)
    }

    /// Renews the lease when due, following a newer generation of the
    /// recorded topology: everything routed by the older map is confirmed
    /// first, then the new one is acknowledged and routed by. A lease that
    /// lapsed (Redis unreachable, or the publisher idle past it) sends its
    /// window again by the route read on registering again.
    async fn keep_lease(&mut self) -> Result<(), PublishError> {
        if !self.membership.as_ref().is_some_and(Membership::due) {
            return Ok(());
        }
        let Some(mut membership) = self.membership.take() else {
            return Ok(());
        };
        // Boxed: rare, and deep enough to deepen every publish's future.
        let kept = Box::pin(self.follow_topology(&mut membership)).await;
        self.membership = Some(membership);
        kept
    }

    async fn follow_topology(&mut self, m: &mut Membership) -> Result<(), PublishError> {
        if m.lapsed() {
            return self.register_again(m).await;
        }
        let unreadable = |e: record::RecordIoError| PublishError::Record(Box::new(e));
        let read = match m.read().await {
            Ok(record) => record,
            Err(e @ record::RecordIoError::Record(_)) => return Err(unreadable(e)),
            Err(e) => return not_renewed(&e),
        };
        if Generation(read.generation) <= m.acknowledged() {
            return match m.renew(m.acknowledged()).await {
                Ok(()) => Ok(()),
                Err(e) => not_renewed(&e),
            };
        }
        // A newer map: confirm what was routed by the older one first, with
        // the lease renewed for it; should it lapse while the confirms come,
        // their events go again, by the new route.
        if let Err(e) = m.renew(m.acknowledged()).await {
            return not_renewed(&e);
        }
        let copies = self.unconfirmed.copies();
        self.flush_window().await?;
        if m.lapsed() {
            for copy in copies {
                self.unconfirmed.push(copy);
            }
        }
        if let Err(e) = m.acknowledge(&read).await {
            return not_renewed(&e);
        }
        self.reroute(m, false);
        tracing::info!(
            generation = read.generation,
            "the topology changed: routing by its new generation"
        );
        Ok(())
    }

    /// The lease lapsed: the barrier may have gone on without this
    /// publisher. It gives its channel up, registers again on the
    /// generation it reads (retrying, like a reconnect, for at most
    /// `reconnect_give_up`), and sends its whole window again by that
    /// generation's route.
    async fn register_again(&mut self, m: &mut Membership) -> Result<(), PublishError> {
        tracing::warn!(
            unconfirmed = self.unconfirmed.len(),
            "this publisher's lease lapsed: registering again, then sending its window again"
        );
        self.drop_connection("publisher lease lapsed");
        let started = Instant::now();
        let mut delay = self.config.reconnect_min;
        loop {
            let joined = match m.read().await {
                Ok(record) => m.acknowledge(&record).await,
                Err(e) => Err(e),
            };
            match joined {
                Ok(()) => {
                    self.reroute(m, true);
                    tracing::info!(
                        generation = m.acknowledged().0,
                        "publisher registered again"
                    );
                    return Ok(());
                }
                Err(e @ record::RecordIoError::Record(_)) => {
                    return Err(PublishError::Record(Box::new(e)));
                }
                Err(e) if started.elapsed() + delay > self.config.reconnect_give_up => {
                    return Err(PublishError::Lease {
                        cause: e.to_string(),
                        unconfirmed: self.unconfirmed.len(),
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot register this publisher again");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(self.config.reconnect_max);
                }
            }
        }
    }

    /// Routes the window's events of orders by `m`'s acknowledged
    /// generation: those not sent yet, or with `all` every one.
    fn reroute(&mut self, m: &Membership, all: bool) {
        let routing = m.routing();
        self.unconfirmed.reroute(all, |order| {
            short("routing key", &routing.routing_key(order)).ok()
        });
    }

    /// Publishes an envelope body to its order's shard, unchanged (unknown fields
    /// are kept). A body that is not a valid envelope is refused, nothing sent.
    ///
    /// Returns once the event is sent; its confirm is awaited later (when the
    /// window is full, or by [`flush`](Self::flush)), and a negative confirm is
    /// returned by whichever call settles it.
    pub async fn publish(&mut self, body: Vec<u8>) -> Result<(), PublishError> {
        let envelope = Envelope::parse(&body, self.config.max_body_bytes)?;
        self.publish_envelope(&envelope, body).await
    }

    /// Like [`publish`](Self::publish) for a body already parsed into `envelope`.
    pub async fn publish_envelope(
        &mut self,
        envelope: &Envelope,
        body: Vec<u8>,
    ) -> Result<(), PublishError> {
        let about = About::of(envelope);
        self.publish_traced(&about, body, &Context::current(), FieldTable::default())
            .await
    }

    /// Publishes an event written elsewhere before it is published (an
    /// outbox row): its body with `occurred_at` the time of writing, its
    /// producer span continuing the writer's trace (`written.traceparent`,
    /// when valid; otherwise the current context), `written.headers` added.
    /// A body over `max_body_bytes` is refused, nothing sent.
    pub async fn publish_written(
        &mut self,
        event: &NewEvent,
        occurred_at: SystemTime,
        written: Written<'_>,
    ) -> Result<(), PublishError> {
        let body = event.to_body_at(occurred_at)?;
        if body.len() > self.config.max_body_bytes {
            return Err(EnvelopeError::Invalid(format!(
                "{} bytes, over the publisher's limit of {}",
                body.len(),
                self.config.max_body_bytes
            ))
            .into());
        }
        let parent = match w3c::decode(written.traceparent, None) {
            Some(remote) => Context::new().with_remote_span_context(remote),
            None => Context::current(),
        };
        self.publish_traced(&About::of_event(event), body, &parent, written.headers)
            .await
    }

    /// Publishes a generated event (the `publish` flags, the load generator).
    pub async fn publish_event(&mut self, event: &NewEvent) -> Result<(), PublishError> {
        let body = event.to_body()?;
        self.publish_traced(
            &About::of_event(event),
            body,
            &Context::current(),
            FieldTable::default(),
        )
        .await
    }

    /// Opens the event's producer span (a child of `parent`) and publishes
    /// the event with that span's context and `extra` in its headers.
    async fn publish_traced(
        &mut self,
        about: &About<'_>,
        body: Vec<u8>,
        parent: &Context,
        extra: FieldTable,
    ) -> Result<(), PublishError> {
        self.keep_lease().await?;
        let (shard, routing_key) = self.route(about.order_id);
        let message_id = message_id(about.event_id);
        let (trace, recording) =
            self.publish_span(about, parent, shard, &routing_key, &message_id, body.len());
        let mut props = headers::traced_event_properties(&message_id, SystemTime::now(), &trace);
        if !extra.inner().is_empty() {
            let mut all = props.headers().clone().unwrap_or_default();
            for (name, value) in extra.inner() {
                all.insert(name.clone(), value.clone());
            }
            props = props.with_headers(all);
        }
        self.last_trace = Some(trace);
        let outgoing = Outgoing {
            routing_key: short("routing key", &routing_key)?,
            order: Some(about.order_id.to_owned()),
            body,
            properties: props,
            trace: recording,
        };
        self.push(outgoing).await
    }

    /// The producer span of one event: the context to send and, when the span
    /// records, the span itself (ended on the broker's confirm). Attributes are
    /// only built for a recording span, so without a tracer provider an event
    /// costs one no-op span and a random id.
    fn publish_span(
        &self,
        about: &About<'_>,
        parent: &Context,
        shard: ShardId,
        routing_key: &str,
        message_id: &str,
        body_len: usize,
    ) -> (SpanContext, Option<Context>) {
        let span = self
            .tracer
            .span_builder(self.span_name.clone())
            .with_kind(SpanKind::Producer)
            .start_with_context(&self.tracer, parent);
        let cx = parent.with_span(span);
        let trace = w3c::propagated(&cx);
        if !cx.span().is_recording() {
            return (trace, None);
        }
        let mut attributes = vec![
            KeyValue::new(attr::MESSAGING_SYSTEM, attr::MESSAGING_SYSTEM_RABBITMQ),
            KeyValue::new(attr::MESSAGING_OPERATION, op::PUBLISH),
            KeyValue::new(
                attr::MESSAGING_DESTINATION_NAME,
                self.config.names.exchange.clone(),
            ),
            KeyValue::new(attr::MESSAGING_ROUTING_KEY, routing_key.to_owned()),
            KeyValue::new(attr::MESSAGING_MESSAGE_ID, message_id.to_owned()),
            KeyValue::new(
                attr::MESSAGING_BODY_SIZE,
                i64::try_from(body_len).unwrap_or(i64::MAX),
            ),
            KeyValue::new(attr::ORDER_ID, about.order_id.to_string()),
            KeyValue::new(attr::EVENT, about.event.to_owned()),
            KeyValue::new(attr::SHARD, i64::from(shard.get())),
        ];
        if let Some(seq) = about.seq.and_then(|s| i64::try_from(s).ok()) {
            attributes.push(KeyValue::new(attr::SEQ, seq));
        }
        cx.span().set_attributes(attributes);
        (trace, Some(cx))
    }

    /// Publishes any body with the given properties to one shard: for bodies that
    /// are not envelopes (tests, demos) and for republishing stored properties
    /// (DLQ replay). No validation; `properties` are sent as given.
    pub async fn publish_to_shard(
        &mut self,
        shard: ShardId,
        body: Vec<u8>,
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.keep_lease().await?;
        let outgoing = Outgoing {
            routing_key: short(
                "routing key",
                &shardline_contract::Names::routing_key(shard),
            )?,
            order: None,
            body,
            properties,
            trace: None,
        };
        self.push(outgoing).await
    }

    /// Forwards a delivered message, its properties and body as they are,
    /// to its order's route, and waits for its confirm: a worker's forward
    /// of an event its queue does not process (resharding, legacy routing).
    /// The route is this publisher's, by the generation it acknowledged,
    /// which is first brought to `at_least` (the generation the worker
    /// decided by). Returns the routing key it went to.
    pub async fn forward(
        &mut self,
        order_id: &OrderId,
        body: Vec<u8>,
        properties: BasicProperties,
        at_least: Generation,
    ) -> Result<String, PublishError> {
        if let Some(mut membership) = self.membership.take() {
            let behind = membership.acknowledged() < at_least;
            let followed = if behind {
                Box::pin(self.follow_topology(&mut membership)).await
            } else {
                Ok(())
            };
            self.membership = Some(membership);
            followed?;
        }
        self.keep_lease().await?;
        let (_, routing_key) = self.route(order_id);
        let outgoing = Outgoing {
            routing_key: short("routing key", &routing_key)?,
            order: Some(order_id.to_owned()),
            body,
            properties,
            trace: None,
        };
        self.push(outgoing).await?;
        self.flush_window().await?;
        Ok(routing_key)
    }

    async fn push(&mut self, outgoing: Outgoing) -> Result<(), PublishError> {
        self.settle_ready()?;
        while self.unconfirmed.is_full() {
            self.settle_oldest().await?;
        }
        self.unconfirmed.push(outgoing);
        self.counts.published += 1;
        self.send_unsent().await
    }

    /// Waits until every event sent so far is confirmed; the first negative
    /// confirm is returned as an error.
    pub async fn flush(&mut self) -> Result<(), PublishError> {
        self.keep_lease().await?;
        self.flush_window().await
    }

    async fn flush_window(&mut self) -> Result<(), PublishError> {
        while !self.unconfirmed.is_empty() {
            self.settle_oldest().await?;
        }
        Ok(())
    }

    /// Flushes, then leaves the registered publishers and closes the channel
    /// and the connection.
    pub async fn close(mut self) -> Result<(), PublishError> {
        self.flush().await?;
        if let Some(membership) = self.membership.as_mut() {
            Box::pin(membership.leave()).await;
        }
        if let Some(channel) = self.channel.take() {
            let closing = channel.channel().close(200, "publisher closing".into());
            if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, closing).await {
                tracing::debug!(error = %e, "closing the publisher channel");
            }
        }
        if let Some(conn) = self.conn.take() {
            let closing = conn.close(200, "publisher closing".into());
            if let Ok(Err(e)) = tokio::time::timeout(CLOSE_TIMEOUT, closing).await {
                tracing::debug!(error = %e, "closing the publisher connection");
            }
        }
        tracing::debug!(
            published = self.counts.published,
            confirmed = self.counts.confirmed,
            "publisher closed"
        );
        Ok(())
    }

    /// Sends every unsent event in order, re-opening the channel first when needed.
    async fn send_unsent(&mut self) -> Result<(), PublishError> {
        loop {
            if self.channel_suspect || self.channel.is_none() {
                self.reconnect().await?;
            }
            let Some(channel) = self.channel.clone() else {
                continue;
            };
            while let Some(event) = self.unconfirmed.next_unsent() {
                self.channel_suspect = true;
                let sent = channel
                    .send(
                        self.exchange.clone(),
                        event.routing_key.clone(),
                        &event.body,
                        event.properties.clone(),
                    )
                    .await;
                match sent {
                    Ok(confirm) => {
                        self.unconfirmed.mark_sent(confirm, Instant::now());
                        self.channel_suspect = false;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "publish failed: the channel is gone");
                        // The reason the channel closed is on the confirms of what
                        // was sent before; settle those to learn whether a new
                        // channel can help.
                        self.settle_before_loss().await?;
                        break;
                    }
                }
            }
            if !self.channel_suspect {
                return Ok(());
            }
        }
    }

    /// Awaits the oldest event's confirm and accounts for it.
    async fn settle_oldest(&mut self) -> Result<(), PublishError> {
        loop {
            if self.unconfirmed.is_empty() {
                return Ok(());
            }
            if self.channel_suspect || self.unconfirmed.first_unsent() == 0 {
                self.send_unsent().await?;
            }
            match self.oldest_confirmed().await {
                Some(Ok(confirmation)) => match self.settled(confirmation)? {
                    Settled::Done => return Ok(()),
                    Settled::Resend => {}
                },
                Some(Err(e)) => {
                    self.check_recoverable(e)?;
                    self.channel_suspect = true;
                }
                None => {}
            }
        }
    }

    /// The oldest event's confirm, waited for at most `confirm_timeout` of
    /// time the connection was not blocked. `None` when it was not
    /// confirmed by then: the connection is dropped, to be made again (to
    /// whichever address answers) and the window re-sent.
    async fn oldest_confirmed(&mut self) -> Option<Result<Confirmation, lapin::Error>> {
        const TICK: std::time::Duration = std::time::Duration::from_secs(1);
        let timeout = self.config.confirm_timeout;
        let blocked = self.blocked.as_ref();
        let confirm = self.unconfirmed.oldest_confirm()?;
        let mut waited = std::time::Duration::ZERO;
        loop {
            tokio::select! {
                confirmed = &mut *confirm => return Some(confirmed),
                () = tokio::time::sleep(TICK) => {}
            }
            if blocked.is_some_and(|b| b.blocked().is_some()) {
                continue;
            }
            waited += TICK;
            if waited >= timeout {
                break;
            }
        }
        tracing::warn!(after = ?timeout, unconfirmed = self.unconfirmed.len(), "no publisher confirm in time: reconnecting (to any address that answers) and re-sending the window");
        self.drop_connection("no publisher confirms");
        None
    }

    /// Gives the connection up (closed in the background, for at most a
    /// second: its node may not answer), so that the next send reconnects to
    /// whichever address answers and re-sends the window.
    fn drop_connection(&mut self, why: &'static str) {
        // Its channel goes with it: closing the channel first would wait for
        // a node that may not answer.
        self.channel = None;
        if let Some(conn) = self.conn.take() {
            tokio::spawn(async move {
                let closing = conn.close(200, why.into());
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), closing).await;
            });
        }
        self.blocked = None;
        self.channel_suspect = true;
    }

    /// Settles the confirms that have already arrived, without waiting, so that
    /// the recorded latency is publish → confirm, not publish → window full.
    /// (Its resolution is the time between two publish calls.)
    fn settle_ready(&mut self) -> Result<(), PublishError> {
        let mut cx = TaskContext::from_waker(Waker::noop());
        while let Some(confirm) = self.unconfirmed.oldest_confirm() {
            match Pin::new(confirm).poll(&mut cx) {
                Poll::Pending => break,
                Poll::Ready(Ok(confirmation)) => match self.settled(confirmation)? {
                    Settled::Done => {}
                    // The resolved confirm is forgotten when the window is re-sent.
                    Settled::Resend => break,
                },
                Poll::Ready(Err(e)) => {
                    self.check_recoverable(e)?;
                    self.channel_suspect = true;
                    break;
                }
            }
        }
        Ok(())
    }

    /// After a failed send: settles the confirms that resolve on the lost
    /// channel (acks count as confirmed) up to the first channel error.
    async fn settle_before_loss(&mut self) -> Result<(), PublishError> {
        while let Some(confirm) = self.unconfirmed.oldest_confirm() {
            match confirm.await {
                Ok(confirmation) => match self.settled(confirmation)? {
                    Settled::Done => {}
                    Settled::Resend => return Ok(()),
                },
                Err(e) => return self.check_recoverable(e),
            }
        }
        Ok(())
    }

    /// Removes the oldest event and turns its confirmation into a result;
    /// a nack within [`Config::nack_retries`] keeps it for a re-send instead.
    fn settled(&mut self, confirmation: Confirmation) -> Result<Settled, PublishError> {
        let nacked = confirm::outcome(&confirmation) == Err(Refusal::Nacked);
        if nacked && self.nacks < self.config.nack_retries {
            self.nacks += 1;
            let pause = std::time::Duration::from_secs(u64::from(self.nacks.min(5)));
            tracing::warn!(
                attempt = self.nacks,
                of = self.config.nack_retries,
                ?pause,
                unconfirmed = self.unconfirmed.len(),
                "broker nacked an event: re-sending the window on a new connection"
            );
            self.drop_connection("nacked");
            self.resend_after = Some(Instant::now() + pause);
            return Ok(Settled::Resend);
        }
        if !nacked {
            self.nacks = 0;
        }
        let Some(entry) = self.unconfirmed.pop_oldest() else {
            return Ok(Settled::Done);
        };
        let exchange = || self.config.names.exchange.clone();
        let routing_key = || entry.event.routing_key.to_string();
        let outcome = confirm::outcome(&confirmation);
        if let Some(cx) = &entry.event.trace {
            let span = cx.span();
            match outcome {
                Ok(()) => {}
                Err(Refusal::Unroutable) => {
                    span.set_status(Status::error("unroutable: topology not applied?"));
                }
                Err(Refusal::Nacked) => span.set_status(Status::error("nacked by the broker")),
            }
            span.end();
        }
        match outcome {
            Ok(()) => {
                self.counts.confirmed += 1;
                if let Some(sent) = entry.first_sent {
                    self.latency.record(sent.elapsed());
                }
                Ok(Settled::Done)
            }
            Err(Refusal::Unroutable) => Err(PublishError::Unroutable {
                exchange: exchange(),
                routing_key: routing_key(),
            }),
            Err(Refusal::Nacked) => Err(PublishError::Nacked {
                exchange: exchange(),
                routing_key: routing_key(),
            }),
        }
    }

    /// Whether a new channel can cure `e`; the error to return when it cannot.
    fn check_recoverable(&self, e: lapin::Error) -> Result<(), PublishError> {
        if soft_error(&e, AMQPSoftError::NOTFOUND).is_some() {
            return Err(PublishError::ExchangeMissing {
                exchange: self.config.names.exchange.clone(),
            });
        }
        match e.kind() {
            // A channel-level refusal (permissions, size) repeats on any channel.
            ErrorKind::ProtocolError(p) if matches!(p.kind(), AMQPErrorKind::Soft(_)) => {
                Err(PublishError::Refused {
                    reply: p.get_message().to_string(),
                })
            }
            _ if !e.can_be_recovered() => Err(PublishError::Broker(e)),
            _ => {
                tracing::warn!(error = %e, unconfirmed = self.unconfirmed.len(), "publisher channel lost");
                Ok(())
            }
        }
    }

    /// Opens a new channel (and connection, when that is gone too) with capped
    /// exponential backoff; every unconfirmed event becomes unsent again.
    async fn reconnect(&mut self) -> Result<(), PublishError> {
        self.channel_suspect = true;
        if let Some(at) = self.resend_after.take() {
            tokio::time::sleep_until(at.into()).await;
        }
        let resend = self.unconfirmed.forget_confirms();
        if let Some(old) = self.channel.take()
            && old.is_open()
        {
            // An abandoned send may still be in this channel: close it so that
            // nothing it holds can overtake the re-sends. Bounded: on a
            // connection whose node stopped answering the close-ok never comes.
            let closing = old.channel().close(200, "publisher re-opening".into());
            match tokio::time::timeout(CLOSE_TIMEOUT, closing).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(error = %e, "closing the old publisher channel"),
                Err(_) => tracing::debug!("the old publisher channel did not close in time"),
            }
        }
        let started = Instant::now();
        let mut delay = self.config.reconnect_min;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.reopen().await {
                Ok(()) => {
                    self.counts.reconnects += 1;
                    self.counts.resent += resend as u64;
                    self.channel_suspect = false;
                    tracing::info!(attempt, resend, "publisher reconnected");
                    return Ok(());
                }
                Err(e @ (PublishError::ExchangeMissing { .. } | PublishError::Name { .. })) => {
                    return Err(e);
                }
                Err(e) => {
                    if started.elapsed() + delay > self.config.reconnect_give_up {
                        return Err(PublishError::Disconnected {
                            url: self.config.amqp.to_string(),
                            after: self.config.reconnect_give_up,
                            unconfirmed: self.unconfirmed.len(),
                            cause: e.to_string(),
                        });
                    }
                    tracing::warn!(attempt, error = %e, retry_in = ?delay, "publisher reconnect failed");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(self.config.reconnect_max);
                }
            }
        }
    }

    /// A new channel on the current connection if it is alive, else a new connection.
    async fn reopen(&mut self) -> Result<(), PublishError> {
        let alive = self.conn.as_ref().is_some_and(|c| c.status().connected());
        if !alive {
            self.conn = None;
            let conn =
                shardline_connect::connect(&self.config.amqp, &self.config.connection_name).await?;
            self.blocked = Some(BlockedWatch::new(&conn, "publishing"));
            self.conn = Some(conn);
        }
        let Some(conn) = self.conn.as_ref() else {
            return Ok(());
        };
        let channel = open_channel(conn, &self.exchange, &self.config.names.exchange).await?;
        self.channel = Some(channel);
        Ok(())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if !self.unconfirmed.is_empty() {
            tracing::warn!(
                unconfirmed = self.unconfirmed.len(),
                "publisher dropped with unconfirmed events (call flush or close first)"
            );
        }
    }
}

/// A renewal that failed while the lease still holds: publishing goes on,
/// and the renewal is tried again shortly.
fn not_renewed(e: &shardline_connect::record::RecordIoError) -> Result<(), PublishError> {
    tracing::warn!(error = %e, "cannot renew this publisher's lease: trying again");
    Ok(())
}

/// The AMQP message id of a new event: its event id, else a fresh uuid.
fn message_id(event_id: Option<&str>) -> std::borrow::Cow<'_, str> {
    match event_id {
        Some(id) => id.into(),
        None => uuid::Uuid::new_v4().to_string().into(),
    }
}

/// What an event written before its publish brings to it (see
/// [`Publisher::publish_written`]).
#[derive(Debug, Default)]
pub struct Written<'a> {
    /// The writer's W3C `traceparent`, continued when valid.
    pub traceparent: Option<&'a str>,
    /// Headers added to the event's own (a stamp of when it was written).
    pub headers: FieldTable,
}

/// What the publish span says about an event.
struct About<'a> {
    order_id: &'a OrderId,
    event: &'a str,
    seq: Option<u64>,
    event_id: Option<&'a str>,
}

impl<'a> About<'a> {
    fn of_event(event: &'a NewEvent) -> Self {
        Self {
            order_id: &event.order_id,
            event: &event.event,
            seq: event.seq,
            event_id: event.event_id.as_deref(),
        }
    }

    fn of(envelope: &'a Envelope) -> Self {
        Self {
            order_id: &envelope.order_id,
            event: &envelope.event,
            seq: envelope.seq,
            event_id: envelope.event_id.as_deref(),
        }
    }
}

/// A confirm-mode channel, after checking that `exchange` exists (a publish to a
/// missing exchange would only show as a channel closed later).
async fn open_channel(
    conn: &Connection,
    exchange: &ShortString,
    exchange_name: &str,
) -> Result<ConfirmChannel, PublishError> {
    let confirms = ConfirmChannel::open(conn).await?;
    let channel = confirms.channel();
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            exchange.clone(),
            ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        )
        .await
        .map_err(|e| match soft_error(&e, AMQPSoftError::NOTFOUND) {
            Some(_) => PublishError::ExchangeMissing {
                exchange: exchange_name.to_owned(),
            },
            None => e.into(),
        })?;
    Ok(confirms)
}

fn short(what: &'static str, value: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(value).map_err(|_| PublishError::Name {
        what,
        value: value.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo, the bench and the DLQ replay drive a publisher from spawned tasks.
    #[test]
    fn publisher_and_its_futures_are_send() {
        fn is_send<T: Send>(_: &T) {}
        #[allow(dead_code, reason = "compile-time check only")]
        fn check(p: &mut Publisher) {
            is_send(&p.publish(Vec::new()));
            is_send(&p.flush());
        }
        is_send(&Publisher::connect(Config::default()));
    }

    #[test]
    fn new_events_get_their_event_id_or_a_fresh_message_id() {
        assert_eq!(message_id(Some("e-1")), "e-1");
        let (a, b) = (message_id(None), message_id(None));
        assert!(!a.is_empty());
        assert_ne!(a, b);
    }
}
