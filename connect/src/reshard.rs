//! A reshard's marker ids and the moves they released, in Redis beside the
//! recorded topology (ARCHITECTURE.md, "Resharding: the protocol"):
//!
//! - `{prefix}reshard:markers`: marker id → `{move}:{drain|close}:{pending|spent}`,
//!   written by the reshard before it sends the marker;
//! - `{prefix}reshard:drained` and `reshard:closed`: the moves whose drain
//!   (old shard) or close (holding queue) marker a consumer honoured.
//!
//! A consumer honours a marker with one script that finds its id pending,
//! marks it spent and adds its move to the set, in one step; so a forged,
//! stale or repeated marker releases nothing. Every write waits for the
//! replicas (`WAIT`), as the record's do.

use std::collections::BTreeSet;

use redis::aio::ConnectionLike;
use shardline_contract::Keys;
use shardline_contract::reshard::{Honour, MarkerError, MarkerId, MarkerKind, MoveId};
use shardline_contract::topology::TopologyRecord;

use crate::record::{RecordIoError, wait_for_replicas};

/// KEYS: markers, drained, closed. ARGV: id, move, kind.
const HONOUR: &str = r"
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 'unknown' end
local mv, kind, state = string.match(v, '^(%d+):(%a+):(%a+)$')
if mv ~= ARGV[2] or kind ~= ARGV[3] then return 'mismatch' end
if state == 'spent' then return 'already' end
redis.call('HSET', KEYS[1], ARGV[1], mv .. ':' .. kind .. ':spent')
if kind == 'drain' then redis.call('SADD', KEYS[2], mv) else redis.call('SADD', KEYS[3], mv) end
return 'honoured'
";

fn kind_name(kind: MarkerKind) -> &'static str {
    match kind {
        MarkerKind::Drain => "drain",
        MarkerKind::Close => "close",
    }
}

/// Records `id` as a pending marker of `move_id`'s `kind` hand-over (kept as
/// it is when already recorded), before the marker is sent.
pub async fn record_marker(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    id: MarkerId,
    move_id: MoveId,
    kind: MarkerKind,
) -> Result<(), RecordIoError> {
    let _: i64 = redis::cmd("HSETNX")
        .arg(keys.reshard_markers())
        .arg(id.0)
        .arg(format!("{}:{}:pending", move_id.0, kind_name(kind)))
        .query_async(redis)
        .await?;
    wait_for_replicas(redis).await
}

/// Honours a marker read from a queue: its id pending → spent and its move
/// drained (or closed), in one step, then waits for the replicas.
pub async fn honour(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
    id: MarkerId,
    move_id: MoveId,
    kind: MarkerKind,
) -> Result<Result<Honour, MarkerError>, RecordIoError> {
    let answer: String = redis::Script::new(HONOUR)
        .key(keys.reshard_markers())
        .key(keys.reshard_drained())
        .key(keys.reshard_closed())
        .arg(id.0)
        .arg(move_id.0)
        .arg(kind_name(kind))
        .invoke_async(redis)
        .await?;
    let honour = match answer.as_str() {
        "honoured" => Ok(Honour::Honoured(move_id, kind)),
        "already" => Ok(Honour::AlreadyHonoured),
        "mismatch" => Err(MarkerError::Mismatch(id)),
        _ => Err(MarkerError::Unknown(id)),
    };
    if matches!(honour, Ok(Honour::Honoured(..))) {
        wait_for_replicas(redis).await?;
    }
    Ok(honour)
}

/// The moves drained and closed so far.
pub async fn released(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
) -> Result<(BTreeSet<MoveId>, BTreeSet<MoveId>), RecordIoError> {
    let (drained, closed): (Vec<u16>, Vec<u16>) = redis::pipe()
        .cmd("SMEMBERS")
        .arg(keys.reshard_drained())
        .cmd("SMEMBERS")
        .arg(keys.reshard_closed())
        .query_async(redis)
        .await?;
    Ok((moves(drained), moves(closed)))
}

fn moves(ids: Vec<u16>) -> BTreeSet<MoveId> {
    ids.into_iter().map(MoveId).collect()
}

/// What a follower of the topology reads, in one step (`MULTI`): the record
/// (if one was written) and the moves drained and closed so far.
pub type Standing = (Option<TopologyRecord>, BTreeSet<MoveId>, BTreeSet<MoveId>);

/// Reads the record and the released moves together, so that a move seen
/// drained belongs to the reshard the record holds.
pub async fn standing(
    redis: &mut impl ConnectionLike,
    keys: &Keys,
) -> Result<Standing, RecordIoError> {
    let (text, drained, closed): (Option<String>, Vec<u16>, Vec<u16>) = redis::pipe()
        .atomic()
        .cmd("GET")
        .arg(keys.topology())
        .cmd("SMEMBERS")
        .arg(keys.reshard_drained())
        .cmd("SMEMBERS")
        .arg(keys.reshard_closed())
        .query_async(redis)
        .await?;
    let record = text.as_deref().map(TopologyRecord::decode).transpose()?;
    Ok((record, moves(drained), moves(closed)))
}
