//! Capped lists in Redis, newest first: the audit log and reconcile's run
//! summaries. A push and its trim are one `MULTI`, so a list never holds
//! more than its cap, whoever writes at the same time.

use std::time::Duration;

use crate::fleet::redis_error;
use crate::{Error, Fleet};

/// Bound on one round trip (the connection has its own, 5 s).
const TIMEOUT: Duration = Duration::from_secs(10);

/// Pushes `item` onto the list `key` and trims the list to its `cap` newest items.
pub(crate) async fn push(
    fleet: &Fleet,
    key: &str,
    item: &str,
    cap: usize,
    what: &'static str,
) -> Result<(), Error> {
    let mut redis = fleet.redis.connect().await?;
    let last = isize::try_from(cap.max(1)).unwrap_or(isize::MAX) - 1;
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("LPUSH")
        .arg(key)
        .arg(item)
        .ignore()
        .cmd("LTRIM")
        .arg(key)
        .arg(0)
        .arg(last)
        .ignore();
    bounded(fleet, what, pipe.query_async::<()>(&mut redis)).await
}

/// The `limit` newest items of the list `key` (at most `cap`), newest first.
pub(crate) async fn newest(
    fleet: &Fleet,
    key: &str,
    limit: usize,
    cap: usize,
    what: &'static str,
) -> Result<Vec<String>, Error> {
    let limit = limit.min(cap);
    if limit == 0 {
        return Ok(Vec::new());
    }
    let mut redis = fleet.redis.connect().await?;
    let last = isize::try_from(limit).unwrap_or(isize::MAX) - 1;
    let mut cmd = redis::cmd("LRANGE");
    cmd.arg(key).arg(0).arg(last);
    bounded(fleet, what, cmd.query_async::<Vec<String>>(&mut redis)).await
}

/// `op` under [`TIMEOUT`], its error naming `what`.
async fn bounded<T>(
    fleet: &Fleet,
    what: &'static str,
    op: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, Error> {
    match tokio::time::timeout(TIMEOUT, op).await {
        Ok(result) => result.map_err(redis_error(fleet, what)),
        Err(_) => Err(Error::RedisCommand {
            what,
            url: fleet.redis.to_string(),
            cause: format!("no answer within {TIMEOUT:?}"),
        }),
    }
}

/// `text` cut to `max` characters, for a record that does not parse.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}
