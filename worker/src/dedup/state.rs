//! The order state as the stages see it: [`OrderState`], one consumer's
//! handle on it (its connection and its fence token), and
//! [`RedisOrderState`], the Lua scripts on Redis behind it.
//!
//! Unit tests drive the stages with the in-memory fake (`memory`); the
//! scenario suite (`scenarios`) runs one script of operations against both
//! and fails on the first reply or state they disagree on.

use std::future::Future;

use shardline_contract::letters::IndexEntry;

use super::{
    Admission, Claim, DeadLettered, Dedup, Done, GroupAdmit, GroupReply, Start, Verdict, Written,
};
use shardline_contract::OrderKey;

use crate::store::RedisSlot;

/// One consumer's handle on the order state of its shard: the operations the
/// stages need, each one round trip.
///
/// Mirrors [`Dedup`]'s methods, owning what they are given: a handle holds
/// its connection, and a [`OrderState::fork`] of it, for another call in
/// flight, shares the consumer's fence token. Every write but a release
/// and an index entry takes the fence token first (once per consumer).
pub(crate) trait OrderState: Sized {
    /// Another handle of the same consumer (same fence token, same state),
    /// for a concurrent call of the shard.
    fn fork(&self) -> Self;

    /// A new consumer of the shard: it takes a new fence token with its first write.
    fn new_consumer(&self);

    /// The consumer's fence token, taken from its scope on first use (the
    /// scenario suite compares them; the scripts take it themselves).
    #[cfg(test)]
    fn fence(&mut self) -> impl Future<Output = super::FenceToken> + Send;

    /// Decides whether an event may run now and, if so, claims it.
    fn admit(&mut self, admission: &Admission<'_>) -> impl Future<Output = Verdict> + Send;

    /// Marks the event processed and moves its order's gate, atomically.
    fn commit(&mut self, done: &Done<'_>) -> impl Future<Output = Written> + Send;

    /// Commits one event and admits the next, the admit seeing the commit.
    fn commit_and_admit(
        &mut self,
        done: &Done<'_>,
        next: &Admission<'_>,
    ) -> impl Future<Output = (Written, Verdict)> + Send;

    /// Commits a group's events in order, then admits the next group's
    /// (`--group-commit`).
    fn group(
        &mut self,
        commits: &[Done<'_>],
        admits: &[GroupAdmit<'_>],
    ) -> impl Future<Output = GroupReply> + Send;

    /// Extends the claim's lease, counting a handler start that begins or
    /// ended; a claim that is not this delivery's is left alone.
    fn renew(&mut self, claim: &Claim<'_>, start: Start) -> impl Future<Output = ()> + Send;

    /// Gives the claim up, only this delivery's own.
    fn release(&mut self, claim: &Claim<'_>) -> impl Future<Output = ()> + Send;

    /// Records a confirmed dead letter: its index entry, its seq passed yet
    /// never processed, its claim given up and, in quarantine mode, its
    /// order held behind it.
    fn dead_lettered(&mut self, dead: &DeadLettered<'_>) -> impl Future<Output = Written> + Send;

    /// The index entry of a confirmed dead letter that holds no claim.
    fn index_letter(&mut self, entry: &IndexEntry) -> impl Future<Output = ()> + Send;

    /// Whether the replay record `id` holds `record`: only then is a replay
    /// marker honoured (`shardline_contract::replay`).
    fn replay_recorded(&mut self, id: &str, record: &str) -> impl Future<Output = bool> + Send;

    /// A replay of dead letter `id` found its event applied: the letter no
    /// longer holds its order in quarantine and its record is spent.
    fn replay_applied(&mut self, order_key: &OrderKey, id: &str)
    -> impl Future<Output = ()> + Send;
}

/// The order state on Redis: a shard's [`Dedup`] (its scripts and fence
/// token) and a connection.
pub(crate) struct RedisOrderState {
    dedup: Dedup,
    slot: RedisSlot,
}

impl RedisOrderState {
    pub(crate) fn new(dedup: Dedup, slot: RedisSlot) -> Self {
        Self { dedup, slot }
    }
}

impl OrderState for RedisOrderState {
    fn fork(&self) -> Self {
        Self {
            dedup: self.dedup.clone(),
            slot: self.slot.fork(),
        }
    }

    fn new_consumer(&self) {
        self.dedup.new_consumer();
    }

    #[cfg(test)]
    async fn fence(&mut self) -> super::FenceToken {
        self.dedup.fence_token(&mut self.slot).await
    }

    async fn admit(&mut self, admission: &Admission<'_>) -> Verdict {
        self.dedup.admit(&mut self.slot, admission).await
    }

    async fn commit(&mut self, done: &Done<'_>) -> Written {
        self.dedup.commit(&mut self.slot, done).await
    }

    async fn commit_and_admit(
        &mut self,
        done: &Done<'_>,
        next: &Admission<'_>,
    ) -> (Written, Verdict) {
        self.dedup
            .commit_and_admit(&mut self.slot, done, next)
            .await
    }

    async fn group(&mut self, commits: &[Done<'_>], admits: &[GroupAdmit<'_>]) -> GroupReply {
        self.dedup.group(&mut self.slot, commits, admits).await
    }

    async fn renew(&mut self, claim: &Claim<'_>, start: Start) {
        self.dedup.renew(&mut self.slot, claim, start).await;
    }

    async fn release(&mut self, claim: &Claim<'_>) {
        self.dedup.release(&mut self.slot, claim).await;
    }

    async fn dead_lettered(&mut self, dead: &DeadLettered<'_>) -> Written {
        self.dedup.dead_lettered(&mut self.slot, dead).await
    }

    async fn index_letter(&mut self, entry: &IndexEntry) {
        self.dedup.index_letter(&mut self.slot, entry).await;
    }

    async fn replay_recorded(&mut self, id: &str, record: &str) -> bool {
        self.dedup.replay_recorded(&mut self.slot, id, record).await
    }

    async fn replay_applied(&mut self, order_key: &OrderKey, id: &str) {
        self.dedup
            .replay_applied(&mut self.slot, order_key, id)
            .await;
    }
}
