//! The publisher's part in resharding's confirm barrier (ARCHITECTURE.md,
//! "Resharding: the protocol"): it registers in `{prefix}publishers`,
//! renews its lease every [`LEASE`] / 3 as it publishes, reads the recorded
//! topology's generation when it renews, and routes by the generation it
//! **acknowledged** — a newer one only after everything it routed by the
//! older map is confirmed. The publisher drives it (`Publisher::keep_lease`);
//! this module holds the registration and the routing it allows.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use shardline_connect::RedisTarget;
use shardline_connect::publishers::{self, LEASE, Registered};
use shardline_connect::record::{self, RecordIoError};
use shardline_contract::Keys;
use shardline_contract::reshard::{Generation, Lease};
use shardline_contract::status::unix_ms as now_ms;
use shardline_contract::topology::{GenerationWatch, Routing, TopologyRecord};

/// After a failed renewal, the next try comes this much later (while the
/// lease holds).
const RETRY: Duration = Duration::from_secs(1);

/// A registered publisher: its lease, and the routing of the generation it
/// acknowledged.
pub(crate) struct Membership {
    redis: RedisTarget,
    keys: Keys,
    link: Option<MultiplexedConnection>,
    me: Registered,
    routing: Routing,
    watch: GenerationWatch,
    /// When the next renewal is due.
    due_at: Instant,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Membership {
    /// Registers a publisher named `name` that starts on `record`'s
    /// generation (it has published nothing yet, so it acknowledges it).
    pub(crate) async fn join(
        redis: &RedisTarget,
        keys: Keys,
        name: &str,
        record: &TopologyRecord,
    ) -> Result<Self, RecordIoError> {
        let routing = record.routing()?;
        let mut watch = GenerationWatch::default();
        watch.observe(record)?;
        let mut membership = Self {
            redis: redis.clone(),
            keys,
            link: None,
            me: Registered {
                id: format!("{name}-{}", uuid::Uuid::new_v4().simple()),
                name: name.to_owned(),
                lease: Lease {
                    deadline_ms: 0,
                    acknowledged: Generation(record.generation),
                },
            },
            routing,
            watch,
            due_at: Instant::now(),
        };
        membership.renew(Generation(record.generation)).await?;
        Ok(membership)
    }

    /// The routing of the acknowledged generation.
    pub(crate) fn routing(&self) -> &Routing {
        &self.routing
    }

    /// The generation acknowledged.
    pub(crate) fn acknowledged(&self) -> Generation {
        self.me.lease.acknowledged
    }

    /// Whether a renewal is due.
    pub(crate) fn due(&self) -> bool {
        Instant::now() >= self.due_at
    }

    /// Whether the lease has ended: since then the barrier may have gone on
    /// without this publisher.
    pub(crate) fn lapsed(&self) -> bool {
        now_ms() >= self.me.lease.deadline_ms
    }

    /// The registration's id in `{prefix}publishers`.
    pub(crate) fn id(&self) -> &str {
        &self.me.id
    }

    async fn link(&mut self) -> Result<&mut MultiplexedConnection, RecordIoError> {
        let link = match self.link.take() {
            Some(link) => link,
            None => self.redis.connect().await?,
        };
        Ok(self.link.insert(link))
    }

    /// The recorded topology now; a generation below one seen stops the
    /// publisher (a failover lost a write its `WAIT` did not cover).
    pub(crate) async fn read(&mut self) -> Result<TopologyRecord, RecordIoError> {
        let keys = self.keys.clone();
        let read = record::read(self.link().await?, &keys).await;
        let read = self.forget_link_on_error(read)?;
        let record = read.ok_or(RecordIoError::Missing)?;
        self.watch.observe(&record)?;
        Ok(record)
    }

    /// Renews the lease, acknowledging `acknowledged`; the lease counts from
    /// before the write, and only once every replica has it.
    pub(crate) async fn renew(&mut self, acknowledged: Generation) -> Result<(), RecordIoError> {
        let next = Registered {
            lease: Lease {
                deadline_ms: now_ms().saturating_add(millis(LEASE)),
                acknowledged,
            },
            ..self.me.clone()
        };
        let keys = self.keys.clone();
        let renewed = publishers::renew(self.link().await?, &keys, &next).await;
        self.forget_link_on_error(renewed)?;
        self.me = next;
        self.due_at = Instant::now() + LEASE / 3;
        Ok(())
    }

    /// Acknowledges `record`'s generation and routes by it from now on. The
    /// caller has confirmed everything it routed by the older map.
    pub(crate) async fn acknowledge(
        &mut self,
        record: &TopologyRecord,
    ) -> Result<(), RecordIoError> {
        let routing = record.routing()?;
        self.renew(Generation(record.generation)).await?;
        self.routing = routing;
        Ok(())
    }

    /// Leaves the registry (a closing publisher).
    pub(crate) async fn leave(&mut self) {
        let (keys, id) = (self.keys.clone(), self.me.id.clone());
        if let Ok(link) = self.link().await
            && let Err(e) = publishers::leave(link, &keys, &id).await
        {
            tracing::debug!(error = %e, "leaving the registered publishers");
        }
    }

    /// After an error the connection is made again, and the next renewal
    /// tried [`RETRY`] later.
    fn forget_link_on_error<T>(
        &mut self,
        result: Result<T, RecordIoError>,
    ) -> Result<T, RecordIoError> {
        if result.is_err() {
            self.link = None;
            self.due_at = Instant::now() + RETRY;
        }
        result
    }
}
