//! Reading the DLQ without removing: `basic.get` without ack on one channel.
//! What an operation removes (a confirmed replay, a purge) it acks on that
//! channel; closing the channel returns everything else to the queue in its
//! order (RabbitMQ marks those letters redelivered).

use lapin::options::{BasicAckOptions, BasicGetOptions};
use shardline_contract::Names;

use super::Letter;
use crate::Error;

/// Reads the DLQ on its own channel without acking.
pub(crate) struct Reader {
    channel: lapin::Channel,
    queue: String,
}

/// What [`Reader::select`] read: the matching letters, how many were read,
/// and the others (held unacked until the reader is released).
pub(crate) struct Selection {
    pub matched: Vec<Letter>,
    pub read: usize,
}

impl Reader {
    pub(super) async fn open(
        conn: &lapin::Connection,
        names: &Names,
    ) -> Result<Self, lapin::Error> {
        Ok(Self {
            channel: conn.create_channel().await?,
            queue: names.dead_letter_queue.clone(),
        })
    }

    /// The next letter, `None` when the queue has nothing left to hand out.
    pub(super) async fn next(&self) -> Result<Option<Letter>, Error> {
        let got = self
            .channel
            .basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await?;
        Ok(got.map(|m| Letter::new(m.delivery)))
    }

    /// Reads until the queue is empty or `limit` letters matched; the others
    /// stay read (unacked) until [`Self::release`], so that they are not
    /// handed out twice.
    pub(super) async fn select(
        &self,
        matches: impl Fn(&Letter) -> bool,
        limit: Option<usize>,
    ) -> Result<Selection, Error> {
        let mut matched = Vec::new();
        let mut read = 0;
        while limit.is_none_or(|l| matched.len() < l) {
            let Some(letter) = self.next().await? else {
                break;
            };
            read += 1;
            if matches(&letter) {
                matched.push(letter);
            }
        }
        Ok(Selection { matched, read })
    }

    /// Removes a letter read on this reader's channel from the DLQ.
    pub(super) async fn remove(letter: &Letter) -> Result<(), Error> {
        letter
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(Error::amqp(format!("removing {}", letter.info)))?;
        Ok(())
    }

    /// Closes the channel: every letter read and not acked returns to the
    /// queue, in its order.
    pub(super) async fn release(self) {
        if let Err(e) = self.channel.close(200, "browsed".into()).await {
            tracing::debug!(error = %e, "closing the DLQ channel");
        }
    }
}

/// Reads at most `limit` dead letters and returns them all to the queue, in
/// order (the DLQ is left as it was).
pub(crate) async fn browse(
    conn: &lapin::Connection,
    names: &Names,
    limit: u64,
) -> Result<Vec<Letter>, Error> {
    let reader = Reader::open(conn, names)
        .await
        .map_err(Error::amqp(format!("opening {}", names.dead_letter_queue)))?;
    let mut letters = Vec::new();
    let read = async {
        while (letters.len() as u64) < limit {
            let Some(letter) = reader.next().await? else {
                break;
            };
            letters.push(letter);
        }
        Ok::<_, Error>(())
    }
    .await;
    reader.release().await;
    read.map(|()| letters)
}
