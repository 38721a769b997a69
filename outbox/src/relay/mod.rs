//! The relay (`shardline outbox relay`): publishes the outbox's committed
//! rows through the project's confirmed publisher, each order's rows in seq
//! order, and deletes them once the broker confirmed them.
//!
//! The read design is polling without a high-water mark (ARCHITECTURE.md,
//! "The outbox relay"): each batch reads every row visible to it, lowest id
//! first, up to `batch` rows; what a transaction commits later is simply
//! read by a later batch. An order's writers serialise on its counter row
//! (the append function), so an order's visible rows are always a prefix of
//! its seqs, in id order: publishing a batch in id order on one channel
//! keeps each order's seqs ascending, and a rolled-back row is never seen.
//!
//! One batch, while this relay holds the outbox's lock (`lock`):
//!
//! 1. check the lock is still this session's;
//! 2. read the rows; none: wait for a `NOTIFY` of the append (at its commit)
//!    or the poll interval;
//! 3. publish them (the current shard map, `mandatory`, confirms), then wait
//!    for every confirm;
//! 4. delete them.
//!
//! A failure at any step stops the batch where it is: nothing is deleted
//! that was not confirmed, the relay names the row it stopped at, counts the
//! stop by cause, waits (backoff 200 ms doubling to 10 s) and starts again
//! from a fresh connection, reading the same rows again. A row published
//! but not deleted (the confirm or the delete lost) goes again: the worker's
//! dedup key `{order}:{event}:{seq}` absorbs the copy.

mod lock;
mod metrics;
mod rows;
mod status;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::StreamExt as _;
use shardline_publisher::{PublishError, Publisher, Written};
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, Client};
use tokio_util::sync::CancellationToken;

pub use metrics::{Cause, Metrics, names};
pub use status::RelayState;

use crate::database::DatabaseUrl;
use crate::error::describe;
use crate::schema::Schema;
use crate::sql::CHANNEL;
use lock::OutboxLock;
use rows::{Row, Statements};
use shardline_contract::status::RelayRole;

/// Rows per batch unless configured.
pub const DEFAULT_BATCH: u32 = 500;
/// How often an idle relay reads without a `NOTIFY`, and how often a
/// standby tries the lock, unless configured.
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);
/// The first pause after a stop; it doubles up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// What a relay relays, and how.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The application's database.
    pub database: DatabaseUrl,
    /// The schema the outbox is installed in.
    pub schema: Schema,
    /// The publisher it publishes through: give it the fleet's Redis
    /// (`redis`), so that it routes by the recorded map and takes part in a
    /// reshard's barriers like every registered publisher.
    pub publisher: shardline_publisher::Config,
    /// The relay's name: its status document, its `x-shardline-relay`
    /// header, its registration.
    pub name: String,
    /// Rows per batch (at least 1).
    pub batch: u32,
    /// How often an idle relay reads without a `NOTIFY`, and how often a
    /// standby tries the lock.
    pub poll: Duration,
}

/// Why a relay stopped a batch; it starts again after a pause.
#[derive(Debug, thiserror::Error)]
enum Stop {
    #[error("the database: {0}")]
    Database(String),
    #[error("{at}: the broker: {cause}")]
    Broker { at: String, cause: String },
    #[error(
        "stopped at {at}: it cannot be published ({cause}); nothing behind it goes out \
         until it is deleted or mended"
    )]
    Row { at: String, cause: String },
    #[error("the outbox lock of schema {0} is no longer this relay's (its session ended)")]
    LockLost(String),
    #[error("stopping")]
    Shutdown,
}

impl Stop {
    fn cause(&self) -> Option<Cause> {
        match self {
            Self::Database(_) => Some(Cause::Database),
            Self::Broker { .. } => Some(Cause::Broker),
            Self::Row { .. } => Some(Cause::Row),
            Self::LockLost(_) => Some(Cause::Lock),
            Self::Shutdown => None,
        }
    }
}

/// A relay: run it until `shutdown`.
pub struct Relay {
    config: RelayConfig,
    metrics: Arc<Metrics>,
    state: Arc<RelayState>,
}

impl Relay {
    pub fn new(config: RelayConfig) -> Self {
        let state = Arc::new(RelayState::new(&config));
        Self {
            config,
            metrics: Arc::new(Metrics::new()),
            state,
        }
    }

    /// Its metrics, to serve.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// Relays until `shutdown`: waits on standby while another relay holds
    /// the lock, publishes while it holds it, and after any failure retries
    /// with backoff. Returns once `shutdown` is cancelled and the batch in
    /// flight is confirmed and deleted (or left for the next relay).
    pub async fn run(&self, shutdown: &CancellationToken) {
        let writer = status::spawn_writer(
            &self.config,
            Arc::clone(&self.state),
            shutdown.child_token(),
        );
        let mut pause = BACKOFF_MIN;
        loop {
            let relayed_before = self.metrics.relayed_total();
            let stop = self.session(shutdown).await;
            self.metrics.active(false);
            if matches!(stop, Stop::Shutdown) || shutdown.is_cancelled() {
                break;
            }
            if self.metrics.relayed_total() > relayed_before {
                pause = BACKOFF_MIN;
            }
            if let Some(cause) = stop.cause() {
                self.metrics.error(cause);
            }
            let line = format!("outbox relay stopped: {stop}; retrying in {pause:?}");
            tracing::warn!("{line}");
            self.state.retrying(line);
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(BACKOFF_MAX);
        }
        self.state.stopped();
        writer.finish().await;
    }

    /// One database session: the lock, then batches until a stop.
    async fn session(&self, shutdown: &CancellationToken) -> Stop {
        let schema = &self.config.schema;
        let (client, wake) = match connect_listening(&self.config.database, schema).await {
            Ok(connected) => connected,
            Err(e) => return Stop::Database(e),
        };
        let lock = OutboxLock::of(schema);
        if let Some(stop) = self.stand_by(&client, lock, shutdown).await {
            return stop;
        }
        tracing::info!(
            relay = %self.config.name,
            schema = %schema,
            "outbox relay active: it holds the outbox lock"
        );
        self.metrics.active(true);
        self.state.role(RelayRole::Active);
        let statements = match Statements::prepare(&client, schema).await {
            Ok(s) => s,
            Err(e) => {
                return Stop::Database(format!("the outbox of schema {schema}: {}", describe(&e)));
            }
        };
        let mut publisher = None;
        let stop = loop {
            if shutdown.is_cancelled() {
                break Stop::Shutdown;
            }
            match self.batch(&client, lock, &statements, &mut publisher).await {
                Ok(0) => {
                    tokio::select! {
                        () = shutdown.cancelled() => break Stop::Shutdown,
                        () = wake.notified() => {}
                        () = tokio::time::sleep(self.config.poll) => {}
                    }
                }
                Ok(_) => {}
                Err(stop) => break stop,
            }
        };
        // On shutdown everything it sent was confirmed (a batch ends
        // flushed); on another stop it is dropped with its window: those
        // rows go again.
        if let Some(publisher) = publisher.take()
            && matches!(stop, Stop::Shutdown)
            && let Err(e) = publisher.close().await
        {
            tracing::debug!(error = %e, "closing the relay's publisher");
        }
        stop
    }

    /// Waits until this session takes the lock; `Some` when it stopped first.
    async fn stand_by(
        &self,
        client: &Client,
        lock: OutboxLock,
        shutdown: &CancellationToken,
    ) -> Option<Stop> {
        let mut said = false;
        loop {
            match lock.try_take(client).await {
                Ok(true) => return None,
                Ok(false) => {}
                Err(e) => return Some(Stop::Database(describe(&e))),
            }
            if !said {
                let holder = lock.holder(client).await.ok().flatten();
                tracing::info!(
                    relay = %self.config.name,
                    holder_pid = holder,
                    "outbox relay on standby: another relay holds the outbox lock"
                );
                said = true;
            }
            self.state.role(RelayRole::Standby);
            tokio::select! {
                () = shutdown.cancelled() => return Some(Stop::Shutdown),
                () = tokio::time::sleep(self.config.poll) => {}
            }
        }
    }

    /// One batch: lock check, read, publish, confirm, delete. Returns the
    /// rows relayed (0: the outbox was empty).
    async fn batch(
        &self,
        client: &Client,
        lock: OutboxLock,
        statements: &Statements,
        publisher: &mut Option<Publisher>,
    ) -> Result<usize, Stop> {
        let schema = &self.config.schema;
        match lock.held(client).await {
            Ok(true) => {}
            Ok(false) => return Err(Stop::LockLost(schema.to_string())),
            Err(e) => return Err(Stop::Database(describe(&e))),
        }
        let rows = statements
            .read(client, i64::from(self.config.batch.max(1)))
            .await
            .map_err(|e| Stop::Database(describe(&e)))?;
        let lag = rows::lag(&rows, SystemTime::now());
        self.metrics.lag(lag.as_secs_f64());
        self.state.lag(lag);
        let Some(first) = rows.first() else {
            return Ok(0);
        };
        let at = first.describe();
        let broker = |cause: String| Stop::Broker {
            at: format!("stopped at {at}"),
            cause,
        };
        let out = match publisher {
            Some(out) => out,
            None => {
                let mut config = self.config.publisher.clone();
                // No reconnecting inside the publisher: a channel or connection
                // it cannot reopen at once fails the batch, so that the relay
                // names the row, counts the stop, backs off and reads the rows
                // again.
                config.reconnect_give_up = Duration::ZERO;
                let connected = Publisher::connect(config)
                    .await
                    .map_err(|e| broker(e.to_string()))?;
                publisher.insert(connected)
            }
        };
        let confirmed = match self.publish(out, &rows).await {
            Ok(()) => out.flush().await.map_err(|e| broker(e.to_string())),
            Err(stop) => Err(stop),
        };
        if let Err(stop) = confirmed {
            // Its window goes with it: the rows are read again.
            *publisher = None;
            return Err(stop);
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        statements.delete(client, &ids).await.map_err(|e| {
            Stop::Database(format!(
                "deleting {} confirmed rows from {at} on (they are published again: \
                 the dedup key absorbs the copies): {}",
                ids.len(),
                describe(&e)
            ))
        })?;
        self.metrics.relayed(ids.len() as u64);
        self.state.relayed(ids.len() as u64);
        Ok(ids.len())
    }

    /// Publishes `rows` in id order (one channel: the broker keeps that
    /// order per queue).
    async fn publish(&self, publisher: &mut Publisher, rows: &[Row]) -> Result<(), Stop> {
        for row in rows {
            let unpublishable = |cause: String| Stop::Row {
                at: row.describe(),
                cause,
            };
            let headers = row.headers(&self.config.name);
            let Some(event) = row.event() else {
                return Err(unpublishable(
                    "its order id is not one the fleet accepts".into(),
                ));
            };
            let written = Written {
                traceparent: row.traceparent.as_deref(),
                headers,
            };
            match publisher
                .publish_written(&event, row.written_at, written)
                .await
            {
                Ok(()) => {}
                Err(PublishError::Envelope(e)) => return Err(unpublishable(e.to_string())),
                Err(e) => {
                    return Err(Stop::Broker {
                        at: format!("stopped at {}", row.describe()),
                        cause: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// A client on the database that listens on the append's channel, and what
/// wakes when a `NOTIFY` for `schema` arrives (at an append's commit).
async fn connect_listening(
    database: &DatabaseUrl,
    schema: &Schema,
) -> Result<(Client, Arc<Notify>), String> {
    let (client, mut connection) = database.connect_raw().await.map_err(|e| e.to_string())?;
    let wake = Arc::new(Notify::new());
    let woken = Arc::clone(&wake);
    let ours = schema.as_str().to_owned();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) if n.payload() == ours => woken.notify_one(),
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "the relay's database connection ended");
                    break;
                }
            }
        }
        // The client's next statement fails: the relay stops and reconnects.
        woken.notify_one();
    });
    client
        .batch_execute(&format!("LISTEN {CHANNEL}"))
        .await
        .map_err(|e| describe(&e))?;
    Ok((client, wake))
}
