//! The pending rules: why an event the fleet has not processed may still
//! arrive, in the order they are checked. A pending event is never
//! compensated, so that a compensation cannot double an event that is
//! merely late. With the transactional outbox, an order's unpublished rows
//! come first after reconcile's own compensation: an event not relayed yet
//! is nowhere in the fleet (`outbox` says why the snapshot makes that sound).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use shardline_contract::status::ShardReport;
use shardline_contract::{Envelope, Keys, ShardId};

use super::outbox::Unpublished;
use crate::findings::{Expected, OnItsWay};

/// Reconcile's own side of an expected event: its claim and its
/// compensation (the type is in `findings`, with the report).
impl Expected {
    /// Reconcile's record of having emitted the compensation (or of
    /// emitting it right now).
    pub(super) fn emitted_key(&self, keys: &Keys) -> String {
        keys.reconcile_emitted(&self.order_key, &self.kind)
    }

    /// The compensation event's body: an envelope without `seq` (so the
    /// sequence gate lets it through), marked `compensation`.
    pub(super) fn compensation(&self) -> Result<Vec<u8>, String> {
        let body = serde_json::json!({
            "order_id": self.order_id,
            "event": self.kind,
            "event_id": self.event_id(),
            "compensation": true,
            "reason": format!("status={} missing={}", self.status, self.kind),
            "occurred_at": humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        });
        let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
        Envelope::parse(&body, usize::MAX).map_err(|e| format!("no valid compensation: {e}"))?;
        Ok(body)
    }
}

/// Where one run looked for missing events on their way.
#[derive(Debug, Clone, Default)]
pub(super) struct Whereabouts {
    /// The shard status reports (absent: no worker reports the shard).
    pub reports: HashMap<ShardId, ShardReport>,
    /// Ready messages of the shards no worker reports.
    pub unreported: HashMap<ShardId, u32>,
    /// Dead letters by (order id, event kind): a dead-letter id (from the index).
    pub dead_letters: HashMap<(String, String), String>,
    /// Orders a replay holds the lock of.
    pub replaying: HashSet<String>,
    /// The DLQ's depth and the index's count, when the DLQ holds more.
    pub index_behind: Option<(u64, u64)>,
    /// The missing orders' unpublished outbox rows, by order id (none
    /// without an outbox).
    pub outbox: HashMap<String, Unpublished>,
    /// The age of the outbox's oldest unpublished row, when over the grace.
    pub relay_behind: Option<Duration>,
    pub grace: Duration,
    pub now_ms: u64,
}

impl Whereabouts {
    /// Why `e` may still arrive (the first reason found), `None` when nothing
    /// suggests it will. `compensated`: reconcile emitted it before.
    pub(super) fn on_its_way(&self, e: &Expected, compensated: bool) -> Option<OnItsWay> {
        let report = self.reports.get(&e.shard);
        if compensated {
            return Some(OnItsWay::Compensated);
        }
        if let Some(rows) = self.outbox.get(&e.order_id) {
            return Some(OnItsWay::Outbox {
                rows: rows.rows,
                of_kind: rows.of_kind(&e.kind),
                oldest: rows.oldest,
            });
        }
        if report.is_some_and(|r| {
            r.held
                .iter()
                .any(|h| h.order_key == e.order_key && h.event == e.kind)
        }) {
            return Some(OnItsWay::Held);
        }
        if let Some(id) = self.dead_letters.get(&(e.order_id.clone(), e.kind.clone())) {
            return Some(OnItsWay::DeadLettered { id: id.clone() });
        }
        if self.replaying.contains(&e.order_id) {
            return Some(OnItsWay::Replaying);
        }
        if let Some(age) = report
            .map(|r| r.backlog_age_at(self.now_ms))
            .filter(|age| *age > self.grace)
        {
            return Some(OnItsWay::Backlog { age });
        }
        if let Some(&messages) = self.unreported.get(&e.shard).filter(|m| **m > 0) {
            return Some(OnItsWay::Unconsumed { messages });
        }
        if let Some((depth, indexed)) = self.index_behind {
            return Some(OnItsWay::IndexBehind { depth, indexed });
        }
        if let Some(lag) = self.relay_behind {
            return Some(OnItsWay::RelayBehind { lag });
        }
        None
    }
}
