//! `dlq reindex`: rebuilds the dead-letter index from the DLQ, for letters
//! made before the index existed, after a Redis loss, and for letters the
//! broker dead-lettered itself (the quorum backstop: `x-death`, no
//! `x-dead-letter-id`).

use std::collections::HashSet;

use serde::Serialize;
use shardline_contract::letters::{self, IndexEntry};
use tokio_util::sync::CancellationToken;

use super::{Index, with_reader};
use crate::{Error, Fleet};

/// Entries written per round trip while reading.
const WRITE_BATCH: usize = 500;

/// What a reindex found and wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReindexReport {
    /// Letters read from the DLQ (all of them, unless cancelled).
    pub read: u64,
    /// Entries written (letters with one id count once).
    pub indexed: u64,
    /// Of them, letters without `x-dead-letter-id` (given a derived id).
    pub derived: u64,
    /// Entries removed: indexed before the run, not in the DLQ.
    pub removed: u64,
    /// Failure groups in the index afterwards.
    pub groups: u64,
    /// Stopped before the end of the queue: nothing was removed.
    pub cancelled: bool,
}

/// Refuses while a replay runs (its lock `run:…` in Redis). Reads every
/// letter (without acking: they all return to the queue, in
/// order, when the reader closes), writes its entry as the worker would have
/// (over an entry of another group or order), then removes the entries that were in the index before the run but whose
/// letter was not read. A letter another reader holds at that moment (a
/// replay in progress) is not read: if it was indexed, its entry is removed,
/// and if that reader puts it back, the index's count falls short of the
/// DLQ's depth and asks for another reindex.
pub async fn reindex(fleet: &Fleet, cancel: &CancellationToken) -> Result<ReindexReport, Error> {
    let mut redis = fleet.redis.connect().await?;
    if let Some(lock) = super::lock::running(fleet, &mut redis).await? {
        return Err(Error::Refused(format!(
            "a replay is running (it holds {lock}): reindex once it ends — the letters it holds unacked cannot be read now, and their index entries would be removed"
        )));
    }
    let mut index = Index::on(fleet, redis);
    let before: HashSet<String> = index.all_ids().await?.into_iter().collect();
    let mut report = ReindexReport::default();
    let mut seen = HashSet::new();
    with_reader(fleet, async |reader| {
        let mut batch: Vec<IndexEntry> = Vec::with_capacity(WRITE_BATCH);
        loop {
            if cancel.is_cancelled() {
                report.cancelled = true;
                break;
            }
            // The delivery stays unacked on the broker when its letter is
            // dropped here: only the entry is kept.
            let Some(letter) = reader.next().await? else {
                break;
            };
            report.read += 1;
            let entry = letters::entry_of(letter.properties(), letter.body());
            if letter.info.id.is_none() {
                report.derived += 1;
            }
            if seen.insert(entry.id.clone()) {
                batch.push(entry);
            }
            if batch.len() == WRITE_BATCH {
                index.rewrite(&batch).await?;
                report.indexed += batch.len() as u64;
                batch.clear();
            }
        }
        index.rewrite(&batch).await?;
        report.indexed += batch.len() as u64;
        Ok(())
    })
    .await?;
    if !report.cancelled {
        let gone: Vec<String> = before.difference(&seen).cloned().collect();
        index.remove(&gone).await?;
        report.removed = gone.len() as u64;
    }
    report.groups = index.groups().await?.len() as u64;
    Ok(report)
}
