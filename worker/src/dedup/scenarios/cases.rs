//! The scenarios, one per script and path; each expects what the scripts
//! do and is run on both stores.

use std::time::Duration;

use super::*;
use crate::quarantine::Blocker;

/// Admit of a sequenced event: claimed, claimed again by its own delivery,
/// duplicate, gap, start, late (a given-up seq, an unprocessed kind), a
/// replay of a late one.
async fn admit_order<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let one = run.a(1);
    let v = run.admit(&mut c, &one).await;
    run.expect(&v, &Verdict::Claimed);
    let v = run.admit(&mut c, &one).await;
    run.expect(&v, &Verdict::Claimed);
    run.commit(&mut c, &one).await;
    let copy = run.copy(&one);
    let v = run.admit(&mut c, &copy).await;
    run.expect(&v, &Verdict::Duplicate);
    let other_kind = run.ev("A", "other", Some(1));
    let v = run.admit(&mut c, &other_kind).await;
    run.expect(&v, &Verdict::Late);
    let four = run.a(4);
    let v = run.admit(&mut c, &four).await;
    run.expect(&v, &Verdict::Gap);
    let v = run.admit_as(&mut c, &four, false, true).await;
    run.expect(&v, &Verdict::Claimed);
    run.commit(&mut c, &four).await;
    let a = run.order("A").await;
    run.expect(&(a.l, a.u), &(Some(4), Some("2-3".to_owned())));

    let b5 = run.ev("B", "k", Some(5));
    let v = run.admit(&mut c, &b5).await;
    run.expect(&v, &Verdict::Start);
    let v = run.admit_as(&mut c, &b5, false, true).await;
    run.expect(&v, &Verdict::Claimed);
    run.commit(&mut c, &b5).await;
    let b3 = run.ev("B", "k", Some(3));
    let v = run.admit(&mut c, &b3).await;
    run.expect(&v, &Verdict::Late);
    run.dead(&mut c, &b3, "dl-3").await;
    let replay = run.replay(&b3, "dl-3");
    let v = run.admit(&mut c, &replay).await;
    run.expect(&v, &Verdict::Claimed);
    run.commit(&mut c, &replay).await;
    let b = run.order("B").await;
    run.expect(&b.u, &Some("1-2,4".to_owned()));
    let again = run.replay(&b3, "dl-3b");
    let v = run.admit(&mut c, &again).await;
    run.expect(&v, &Verdict::Duplicate);
}

#[test]
fn admit_order_agrees() {
    on_both!("admit-order", Setup::default(), admit_order);
}

const SHORT: Duration = Duration::from_millis(500);
const PAST: Duration = Duration::from_millis(700);

/// A live lease makes a first delivery of another copy wait; a redelivery,
/// or any copy once the lease ran out, takes the claim over.
async fn leases<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let one = run.a(1);
    let v = run.admit(&mut c, &one).await;
    run.expect(&v, &Verdict::Claimed);
    let second = run.copy(&one);
    let v = run.admit(&mut c, &second).await;
    run.check(
        matches!(v, Verdict::Wait(d) if d <= SHORT),
        "a live lease waits",
    );
    run.pass(PAST).await;
    let v = run.admit(&mut c, &second).await;
    run.expect(&v, &Verdict::TakenOver);
    let third = run.copy(&one);
    let v = run.admit_as(&mut c, &third, true, false).await;
    run.expect(&v, &Verdict::TakenOver);
    let claim = run.order("A").await.c.map(|c| (c.starts, c.token));
    run.expect(&claim, &Some((3, third.token)));
    // The order's one claim, of another seq: replaced, not waited on.
    let two = run.a(2);
    let v = run.admit_as(&mut c, &two, false, true).await;
    run.expect(&v, &Verdict::Claimed);
}

#[test]
fn leases_agree() {
    let setup = Setup {
        lease: Some(SHORT),
        ..Setup::default()
    };
    on_both!("leases", setup, leases);
}

/// Handler starts that never finished are counted across takeovers; one
/// that ended is not; at the limit the event is a crash loop.
async fn crash_loop<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let one = run.a(1);
    let v = run.admit(&mut c, &one).await;
    run.expect(&v, &Verdict::Claimed);
    let second = run.copy(&one);
    let v = run.admit_as(&mut c, &second, true, false).await;
    run.expect(&v, &Verdict::TakenOver);
    run.renew(&mut c, &second, Start::Ended).await;
    let third = run.copy(&one);
    let v = run.admit_as(&mut c, &third, true, false).await;
    run.expect(&v, &Verdict::TakenOver);
    run.renew(&mut c, &third, Start::Begins).await;
    let fourth = run.copy(&one);
    let v = run.admit_as(&mut c, &fourth, true, false).await;
    run.expect(&v, &Verdict::CrashLoop(3));
}

#[test]
fn crash_loop_agrees() {
    let setup = Setup {
        max_deliveries: 3,
        ..Setup::default()
    };
    on_both!("crash-loop", setup, crash_loop);
}

/// Unsequenced events: claimed, own claim again, wait on a live lease,
/// takeovers up to a crash loop, expiry, commit (the order's `f` and `k`),
/// duplicate.
async fn admit_event<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let note = run.ev("A", "note", None);
    let v = run.admit(&mut c, &note).await;
    run.expect(&v, &Verdict::Claimed);
    let v = run.admit(&mut c, &note).await;
    run.expect(&v, &Verdict::Claimed);
    let copy = run.copy(&note);
    let v = run.admit(&mut c, &copy).await;
    run.check(matches!(v, Verdict::Wait(_)), "a live lease waits");
    for want in [
        Verdict::TakenOver,
        Verdict::TakenOver,
        Verdict::CrashLoop(3),
    ] {
        let copy = run.copy(&note);
        let v = run.admit_as(&mut c, &copy, true, false).await;
        run.expect(&v, &want);
    }
    let ping = run.ev("B", "ping", None);
    let v = run.admit(&mut c, &ping).await;
    run.expect(&v, &Verdict::Claimed);
    run.pass(PAST).await;
    let late = run.copy(&ping);
    let v = run.admit(&mut c, &late).await;
    run.expect(&v, &Verdict::TakenOver);
    let w = run.commit(&mut c, &late).await;
    run.expect(&w, &Written::Done);
    let again = run.copy(&ping);
    let v = run.admit_as(&mut c, &again, true, false).await;
    run.expect(&v, &Verdict::Duplicate);
}

#[test]
fn admit_event_agrees() {
    let setup = Setup {
        lease: Some(SHORT),
        max_deliveries: 3,
        ..Setup::default()
    };
    on_both!("admit-event", setup, admit_event);
}

/// Commits: the gate moves (skipped seqs marked), a replay clears its mark,
/// another delivery's commit leaves the claim alone; the step: commit then
/// admit, claimed, duplicate, gap, an unsequenced next.
async fn commit_and_step<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let (one, two) = (run.a(1), run.a(2));
    run.admit(&mut c, &one).await;
    let r = run.step(&mut c, &one, &two).await;
    run.expect(&r, &(Written::Done, Verdict::Claimed));
    let copy = run.copy(&two);
    let r = run.step(&mut c, &two, &copy).await;
    run.expect(&r, &(Written::Done, Verdict::Duplicate));
    let (three, five) = (run.a(3), run.a(5));
    run.admit(&mut c, &three).await;
    let r = run.step(&mut c, &three, &five).await;
    run.expect(&r, &(Written::Done, Verdict::Gap));
    run.admit_as(&mut c, &five, false, true).await;
    run.commit(&mut c, &five).await;
    let four = run.a(4);
    let v = run.admit(&mut c, &four).await;
    run.expect(&v, &Verdict::Late);
    run.dead(&mut c, &four, "dl-4").await;
    let replay = run.replay(&four, "dl-4");
    run.admit(&mut c, &replay).await;
    run.commit(&mut c, &replay).await;
    let got = run.order("A").await.u;
    run.expect(&got, &None);

    let six = run.a(6);
    run.admit(&mut c, &six).await;
    let other = run.copy(&six);
    let w = run.commit(&mut c, &other).await;
    run.expect(&w, &Written::Done);
    let held = run.order("A").await.c.map(|c| c.token);
    run.expect(&held, &Some(six.token));
    let (seven, note) = (run.a(7), run.ev("A", "note", None));
    run.admit(&mut c, &seven).await;
    let r = run.step(&mut c, &seven, &note).await;
    run.expect(&r, &(Written::Done, Verdict::Claimed));
    let copy = run.copy(&note);
    let r = run.step(&mut c, &note, &copy).await;
    run.expect(&r, &(Written::Done, Verdict::Duplicate));
}

#[test]
fn commit_and_step_agree() {
    on_both!("commit-step", Setup::default(), commit_and_step);
}

/// A group's admits (chained under the first's claim), its commits in
/// order before the next group's admits, which stop at the first that is
/// not a claim (a gap, a wait, a takeover).
async fn group<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let evs: Vec<Ev> = (1..=4).map(|seq| run.a(seq)).collect();
    let six = run.a(6);
    let r = run
        .group(
            &mut c,
            &[],
            &[(&evs[0], false), (&evs[1], true), (&evs[2], true)],
        )
        .await;
    run.expect(&r.verdicts, &vec![Verdict::Claimed; 3]);
    let done: Vec<&Ev> = evs[..3].iter().collect();
    let r = run
        .group(
            &mut c,
            &done,
            &[(&evs[3], false), (&six, false), (&evs[0], false)],
        )
        .await;
    run.expect(&(r.committed, r.fenced), &(3, false));
    run.expect(&r.verdicts, &vec![Verdict::Claimed, Verdict::Gap]);
    let copy = run.copy(&evs[1]);
    let r = run.group(&mut c, &[&evs[3]], &[(&copy, false)]).await;
    run.expect(&r.verdicts, &vec![Verdict::Duplicate]);

    let b1 = run.ev("B", "k", Some(1));
    let b2 = run.ev("B", "k", Some(2));
    run.admit(&mut c, &b1).await;
    let r = run.group(&mut c, &[], &[(&b1, false), (&b2, true)]).await;
    run.expect(&r.verdicts, &vec![Verdict::Claimed; 2]);
    let copy = run.copy(&b1);
    let r = run.group(&mut c, &[], &[(&copy, false), (&b2, true)]).await;
    run.check(
        matches!(r.verdicts.as_slice(), [Verdict::Wait(_)]),
        "a live claim of another delivery waits, and the group stops",
    );
    let copy = run.copy(&b1);
    let r = run
        .group_as(&mut c, &[], &[(&copy, false), (&b2, true)], true)
        .await;
    run.expect(&r.verdicts, &vec![Verdict::TakenOver]);
}

#[test]
fn group_agrees() {
    on_both!("group", Setup::default(), group);
}

/// A stale consumer (the older fence token) after a newer one wrote the
/// order: its admit, commit, step, renewal and dead letter change nothing
/// (the letter is indexed all the same); a release is by token only.
async fn fencing<W: World>(run: &mut Run<W>) {
    let (mut stale, mut owner) = (run.world.consumer(), run.world.consumer());
    let t = run.fence(&mut stale).await;
    run.expect(&t, &1);
    let t = run.fence(&mut owner).await;
    run.expect(&t, &2);
    // A fork of a consumer, for another call in flight, shares its token.
    let mut fork = owner.fork();
    let t = run.fence(&mut fork).await;
    run.expect(&t, &2);
    let one = run.a(1);
    run.admit(&mut stale, &one).await;
    let again = run.copy(&one);
    let v = run.admit_as(&mut owner, &again, true, false).await;
    run.expect(&v, &Verdict::TakenOver);
    run.commit(&mut owner, &again).await;
    let two = run.a(2);
    run.admit(&mut owner, &two).await;

    let w = run.commit(&mut stale, &one).await;
    run.expect(&w, &Written::Fenced);
    let three = run.a(3);
    let w = run.commit(&mut stale, &three).await;
    run.expect(&w, &Written::Fenced);
    let copy = run.copy(&two);
    let v = run.admit_as(&mut stale, &copy, true, false).await;
    run.expect(&v, &Verdict::Fenced);
    let r = run.step(&mut stale, &one, &three).await;
    run.expect(&r, &(Written::Fenced, Verdict::Fenced));
    run.renew(&mut stale, &one, Start::Begins).await;
    run.release(&mut stale, &one).await;
    let w = run.dead(&mut stale, &one, "dl-stale").await;
    run.expect(&w, &Written::Fenced);
    let a = run.order("A").await;
    run.expect(&(a.l, a.u, a.f), &(Some(1), None, Some(2)));
    run.expect(&a.c.map(|c| c.token), &Some(two.token));

    // Unsequenced: the admit is not fenced, the commit and dead letter are.
    let note = run.ev("A", "note", None);
    let v = run.admit(&mut stale, &note).await;
    run.expect(&v, &Verdict::Claimed);
    let w = run.commit(&mut stale, &note).await;
    run.expect(&w, &Written::Fenced);
    let w = run.dead(&mut stale, &note, "dl-note").await;
    run.expect(&w, &Written::Fenced);

    // The stale consumer's own claim, on an order the owner wrote since:
    // not renewed; released (by its token).
    let b1 = run.ev("B", "k", Some(1));
    run.admit(&mut stale, &b1).await;
    let ping = run.ev("B", "ping", None);
    run.admit(&mut owner, &ping).await;
    run.commit(&mut owner, &ping).await;
    run.renew(&mut stale, &b1, Start::Begins).await;
    let got = run.order("B").await.c.map(|c| c.starts);
    run.expect(&got, &Some(1));
    run.release(&mut stale, &b1).await;
    let got = run.order("B").await.c;
    run.expect(&got, &None);

    // A new consumer on the stale handle takes the newest token.
    run.new_consumer(&mut stale).await;
    let t = run.fence(&mut stale).await;
    run.expect(&t, &3);
    let w = run.commit(&mut owner, &two).await;
    run.expect(&w, &Written::Done);
    run.admit(&mut stale, &three).await;
    let w = run.commit(&mut owner, &three).await;
    run.expect(&w, &Written::Fenced);
}

#[test]
fn fencing_agrees() {
    on_both!("fencing", Setup::default(), fencing);
}

/// A move of an order's keys between shards (simulated: consumers of two
/// shards writing one order). Shard 1's consumer counted epochs per shard
/// before the fleet-wide counter (its record is at 57, shard 3's at 2): the
/// first epoch taken raises the fleet's counter above the shard's record. The
/// order's old owner (shard 1) wrote it; its new owner (shard 3) takes a new
/// epoch when it takes the keys over (after the old queue drained), above
/// every epoch before it on any shard. After its first write, each of the old
/// owner's writes (admit, commit, renewal, dead letter) changes nothing, and
/// the new owner's are never refused.
async fn moved_keys<W: World>(run: &mut Run<W>) {
    run.world.set_shard_epoch(1, 57).await;
    run.world.set_shard_epoch(3, 2).await;
    let (mut old, mut new) = (run.world.consumer_of(1), run.world.consumer_of(3));
    let t = run.fence(&mut new).await;
    run.expect(&t, &3);
    let t = run.fence(&mut old).await;
    run.expect(&t, &58);
    let one = run.a(1);
    run.admit(&mut old, &one).await;
    let w = run.commit(&mut old, &one).await;
    run.expect(&w, &Written::Done);
    let two = run.a(2);
    run.admit(&mut old, &two).await;
    // The move: shard 3's consumer takes the keys over with a new epoch.
    run.new_consumer(&mut new).await;
    let t = run.fence(&mut new).await;
    run.expect(&t, &59);
    let epochs = run.world.fleet_epochs().await;
    run.expect(&epochs, &Some(59));
    let again = run.copy(&two);
    let v = run.admit_as(&mut new, &again, true, false).await;
    run.expect(&v, &Verdict::TakenOver);
    // The old owner, late: its commit, renewal, next admit and dead letter
    // change nothing of the order.
    let before = run.world.order("A").await;
    let w = run.commit(&mut old, &two).await;
    run.expect(&w, &Written::Fenced);
    run.renew(&mut old, &two, Start::Waits).await;
    let three = run.a(3);
    let v = run.admit(&mut old, &three).await;
    run.expect(&v, &Verdict::Fenced);
    let w = run.dead(&mut old, &three, "dl-late").await;
    run.expect(&w, &Written::Fenced);
    let after = run.world.order("A").await;
    run.expect(&after, &before);
    // The new owner goes on.
    let w = run.commit(&mut new, &again).await;
    run.expect(&w, &Written::Done);
    let v = run.admit(&mut new, &three).await;
    run.expect(&v, &Verdict::Claimed);
    let w = run.commit(&mut new, &three).await;
    run.expect(&w, &Written::Done);
}

#[test]
fn moved_keys_agree() {
    on_both!("moved-keys", Setup::default(), moved_keys);
}

/// A group fenced part way: the commits before the first fenced one are
/// written, nothing after it, no admit.
async fn group_fenced<W: World>(run: &mut Run<W>) {
    let (mut stale, mut owner) = (run.world.consumer(), run.world.consumer());
    run.fence(&mut stale).await;
    run.fence(&mut owner).await;
    let (a1, b1, b2) = (
        run.a(1),
        run.ev("B", "k", Some(1)),
        run.ev("B", "k", Some(2)),
    );
    let r = run
        .group(&mut stale, &[], &[(&a1, false), (&b1, false)])
        .await;
    run.expect(&r.verdicts, &vec![Verdict::Claimed; 2]);
    let again = run.copy(&a1);
    run.admit_as(&mut owner, &again, true, false).await;
    run.commit(&mut owner, &again).await;
    let a2 = run.a(2);
    let r = run
        .group(&mut stale, &[&b1, &a1, &a2], &[(&b2, false)])
        .await;
    run.expect(&(r.committed, r.fenced, r.verdicts.len()), &(1, true, 0));
    let got = run.order("B").await.l;
    run.expect(&got, &Some(1));
    let got = run.order("A").await.l;
    run.expect(&got, &Some(1));
}

#[test]
fn group_fenced_agrees() {
    on_both!("group-fenced", Setup::default(), group_fenced);
}

/// Dead letters without quarantine: the seq passes and stays marked, the
/// own claim goes (never another's), the index entry is written; a letter
/// without a claim is indexed alone.
async fn dead<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let one = run.a(1);
    run.admit(&mut c, &one).await;
    let w = run.dead(&mut c, &one, "dl-1").await;
    run.expect(&w, &Written::Done);
    let note = run.ev("A", "note", None);
    run.admit(&mut c, &note).await;
    let other = run.copy(&note);
    run.dead(&mut c, &other, "dl-2").await;
    run.dead(&mut c, &note, "dl-3").await;
    let five = run.a(5);
    run.admit_as(&mut c, &five, false, true).await;
    let copy = run.copy(&five);
    run.dead(&mut c, &copy, "dl-5").await;
    let a = run.order("A").await;
    run.expect(&(a.l, a.u), &(Some(5), Some("1-5".to_owned())));
    run.expect(&a.c.map(|c| c.token), &Some(five.token));
    let got = run.world.quarantine("A").await;
    run.expect(&got, &Vec::new());
    let bare = IndexEntry {
        id: "dl-bare".to_owned(),
        reason: "decode".to_owned(),
        error: "not UTF-8 JSON".to_owned(),
        ..IndexEntry::default()
    }
    .grouped();
    run.index(&mut c, &bare).await;
}

#[test]
fn dead_agrees() {
    on_both!("dead", Setup::default(), dead);
}

/// Quarantine mode: a dead letter holds its order; later events are
/// quarantined (their claim given back), a successor's replay too; the
/// blocker's replay runs, fails again (re-entering under its new id), runs
/// and clears; a step's admit is checked too; a stale dead letter holds
/// nothing.
async fn quarantine<W: World>(run: &mut Run<W>) {
    let (mut stale, mut c) = (run.world.consumer(), run.world.consumer());
    run.fence(&mut stale).await;
    let one = run.a(1);
    run.admit(&mut c, &one).await;
    run.dead(&mut c, &one, "dl-1").await;
    let blocked = |id: &str, seq| {
        Verdict::Quarantined(Blocker {
            id: id.to_owned(),
            seq,
        })
    };
    let two = run.a(2);
    let v = run.admit(&mut c, &two).await;
    run.expect(&v, &blocked("dl-1", 1));
    let got = run.order("A").await.c;
    run.expect(&got, &None);
    run.dead(&mut c, &two, "dl-2").await;
    let successor = run.replay(&two, "dl-2");
    let v = run.admit(&mut c, &successor).await;
    run.expect(&v, &blocked("dl-1", 1));
    let first = run.replay(&one, "dl-1");
    let v = run.admit(&mut c, &first).await;
    run.expect(&v, &Verdict::Claimed);
    run.dead(&mut c, &first, "dl-3").await;
    let got = run.world.quarantine("A").await;
    run.expect(&got, &vec!["dl-3".to_owned(), "dl-2".to_owned()]);
    let first = run.replay(&one, "dl-3");
    run.admit(&mut c, &first).await;
    run.commit(&mut c, &first).await;
    let successor = run.replay(&two, "dl-2");
    let v = run.admit(&mut c, &successor).await;
    run.expect(&v, &Verdict::Claimed);
    run.commit(&mut c, &successor).await;
    let got = run.world.quarantine("A").await;
    run.expect(&got, &Vec::new());

    let ping = run.ev("B", "ping", None);
    run.admit(&mut c, &ping).await;
    run.dead(&mut c, &ping, "dl-b").await;
    let (three, b1) = (run.a(3), run.ev("B", "k", Some(1)));
    run.admit(&mut c, &three).await;
    let r = run.step(&mut c, &three, &b1).await;
    run.expect(&r, &(Written::Done, blocked("dl-b", 0)));
    let four = run.a(4);
    let w = run.dead(&mut stale, &four, "dl-stale").await;
    run.expect(&w, &Written::Fenced);
    let got = run.world.quarantine("A").await;
    run.expect(&got, &Vec::new());
}

#[test]
fn quarantine_agrees() {
    let setup = Setup {
        quarantine: true,
        ..Setup::default()
    };
    on_both!("quarantine", setup, quarantine);
}

/// Replay records: one backs only the record it holds; a replay's commit
/// spends it, so does its dead letter (fenced writes spend nothing), and
/// so does a replay that finds its event applied (leaving the quarantine).
async fn replay_records<W: World>(run: &mut Run<W>) {
    let (mut stale, mut c) = (run.world.consumer(), run.world.consumer());
    run.fence(&mut stale).await;
    let (one, two, three) = (run.a(1), run.a(2), run.a(3));
    for (ev, id) in [(&one, "dl-1"), (&two, "dl-2"), (&three, "dl-3")] {
        run.admit(&mut c, ev).await;
        run.dead(&mut c, ev, id).await;
        run.record_replay(id, &format!("r-{id}")).await;
    }
    let backed = run.replay_recorded(&mut c, "dl-1", "r-dl-1").await;
    run.check(backed, "the record backs its own event");
    for (id, record) in [("dl-1", "r-dl-2"), ("dl-9", "r-dl-9"), ("dl-1", "")] {
        let backed = run.replay_recorded(&mut c, id, record).await;
        run.check(!backed, "no other record, no missing one");
    }
    let replay = run.replay(&one, "dl-1");
    run.admit(&mut c, &replay).await;
    let w = run.commit(&mut stale, &replay).await;
    run.expect(&w, &Written::Fenced);
    let kept = run.world.replay_record("dl-1").await;
    run.expect(&kept, &Some("r-dl-1".to_owned()));
    run.commit(&mut c, &replay).await;
    let spent = run.world.replay_record("dl-1").await;
    run.expect(&spent, &None);
    let replay = run.replay(&two, "dl-2");
    run.admit(&mut c, &replay).await;
    run.dead(&mut c, &replay, "dl-2b").await;
    let spent = run.world.replay_record("dl-2").await;
    run.expect(&spent, &None);
    run.replay_applied(&mut c, &three, "dl-3").await;
    let spent = run.world.replay_record("dl-3").await;
    run.expect(&spent, &None);
}

#[test]
fn replay_records_agree() {
    let setup = Setup {
        quarantine: true,
        ..Setup::default()
    };
    on_both!("replay-records", setup, replay_records);
}

/// Renewals count starts (never below zero) and releases give the claim
/// up, only by the claim's own delivery; a renewal after the claim went
/// writes it again; a `done` unsequenced event is never renewed or released.
async fn renew_and_release<W: World>(run: &mut Run<W>) {
    let mut c = run.world.consumer();
    let one = run.a(1);
    run.admit(&mut c, &one).await;
    let copy = run.copy(&one);
    run.admit(&mut c, &copy).await;
    run.release(&mut c, &copy).await;
    run.renew(&mut c, &copy, Start::Ended).await;
    let got = run.order("A").await.c.map(|c| c.token);
    run.expect(&got, &Some(one.token));
    for (start, want) in [
        (Start::Begins, 2),
        (Start::Ended, 1),
        (Start::Ended, 0),
        (Start::Ended, 0),
        (Start::Waits, 0),
    ] {
        run.renew(&mut c, &one, start).await;
        let got = run.order("A").await.c.map(|c| c.starts);
        run.expect(&got, &Some(want));
    }
    run.release(&mut c, &one).await;
    let got = run.order("A").await.c;
    run.expect(&got, &None);
    run.renew(&mut c, &one, Start::Waits).await;
    run.commit(&mut c, &one).await;

    let note = run.ev("A", "note", None);
    run.admit(&mut c, &note).await;
    run.renew(&mut c, &note, Start::Begins).await;
    let copy = run.copy(&note);
    run.release(&mut c, &copy).await;
    run.renew(&mut c, &copy, Start::Begins).await;
    run.release(&mut c, &note).await;
    run.renew(&mut c, &note, Start::Waits).await;
    run.commit(&mut c, &note).await;
    run.renew(&mut c, &note, Start::Begins).await;
    run.release(&mut c, &note).await;
}

#[test]
fn renew_and_release_agree() {
    on_both!("renew-release", Setup::default(), renew_and_release);
}
