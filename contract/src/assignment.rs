//! Which member of an elastic fleet should own each shard: one pure rebalance
//! step over the shared assignment.
//!
//! Workers that take their shards from the fleet, rather than from a fixed
//! list, register as members. A shared [`Assignment`], kept with a generation
//! number, names the member that should own each shard; every member
//! periodically runs [`rebalance`] over it and the members it sees, and writes
//! the result back when it changed. Nothing here enforces ownership (the
//! broker's exclusive consumer keeps a second worker off a queue): this only
//! decides who should hold it.
//!
//! One step:
//! 1. A shard without a live owner goes at once to the settled member holding
//!    the fewest shards, or to the live member holding the fewest if none has
//!    settled.
//! 2. A live member that has not settled keeps what it owns and gets nothing
//!    new, so a worker that restarts within its lease takes its shards back and
//!    nobody else moves.
//! 3. Settled members are brought to within one shard of each other, at most
//!    [`Rules::max_moves`] shards per step, and no shard moves twice on the way.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Who should own each shard, and the generation it was decided in.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Assignment {
    /// One more than the generation this one was computed from, whenever
    /// [`rebalance`] changed the owners; a writer compares it to detect a
    /// concurrent write.
    pub generation: u64,
    /// Shard id -> member id; a shard absent here has no owner.
    pub owners: BTreeMap<u16, String>,
}

impl Assignment {
    /// The shards `member` should own, ascending.
    pub fn shards_of(&self, member: &str) -> impl Iterator<Item = u16> {
        self.owners
            .iter()
            .filter(move |(_, owner)| *owner == member)
            .map(|(&shard, _)| shard)
    }
}

/// The members as the rebalancer sees them. Order and repeats do not matter.
#[derive(Debug, Clone, Copy)]
pub struct Members<'a> {
    /// Members whose lease is valid (alive). Only they may own shards.
    pub live: &'a [String],
    /// Of `live`, those that have held their lease past the settle time: only
    /// they are given shards they do not own yet. Ids not in `live` are ignored.
    pub settled: &'a [String],
}

/// How far one [`rebalance`] step may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// At most this many shards move away from live members per step.
    /// Default 1: a member that joins takes over its share one shard per step,
    /// so the fleet never pauses many shards at once; higher converges sooner.
    /// 0 only reassigns shards without a live owner. Shards of gone members and
    /// unowned shards are (re)assigned at once and not counted against this.
    pub max_moves: usize,
}

impl Default for Rules {
    fn default() -> Self {
        Self { max_moves: 1 }
    }
}

/// One rebalance step over `shards` (the shards the fleet's members manage;
/// entries of `current` for other shards are dropped from the result).
///
/// Returns the next assignment; its generation is `current.generation + 1` if
/// the owners changed, else equal. Same inputs, same output: ties are broken by
/// the smallest member id, and the highest-numbered shards of a member move
/// first. On a balanced assignment with the same members it returns `current`
/// unchanged.
pub fn rebalance(
    current: &Assignment,
    shards: &[u16],
    members: &Members<'_>,
    rules: &Rules,
) -> Assignment {
    let shards: BTreeSet<u16> = shards.iter().copied().collect();
    let live: BTreeSet<&str> = members.live.iter().map(String::as_str).collect();
    let settled: BTreeSet<&str> = members
        .settled
        .iter()
        .map(String::as_str)
        .filter(|member| live.contains(member))
        .collect();

    let mut owners: BTreeMap<u16, String> = current
        .owners
        .iter()
        .filter(|&(shard, owner)| shards.contains(shard) && live.contains(owner.as_str()))
        .map(|(&shard, owner)| (shard, owner.clone()))
        .collect();
    let heirs = if settled.is_empty() { &live } else { &settled };
    assign_orphans(&mut owners, &shards, heirs);
    balance(&mut owners, &settled, rules.max_moves);

    let generation = if owners == current.owners {
        current.generation
    } else {
        // Counting never gets near the top; saturating keeps a corrupt stored
        // value from panicking.
        current.generation.saturating_add(1)
    };
    Assignment { generation, owners }
}

/// Shard counts per member, for status displays. Members without a shard are
/// absent.
pub fn counts(a: &Assignment) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for owner in a.owners.values() {
        *counts.entry(owner.as_str()).or_insert(0) += 1;
    }
    counts
}

/// Gives each shard of `shards` without an owner, in ascending order, to the
/// heir holding the fewest shards.
fn assign_orphans(
    owners: &mut BTreeMap<u16, String>,
    shards: &BTreeSet<u16>,
    heirs: &BTreeSet<&str>,
) {
    let mut held: BTreeMap<&str, usize> = heirs.iter().map(|&heir| (heir, 0)).collect();
    for owner in owners.values() {
        if let Some(n) = held.get_mut(owner.as_str()) {
            *n += 1;
        }
    }
    for &shard in shards {
        if owners.contains_key(&shard) {
            continue;
        }
        // The first of equal minimums in id order: the smallest id wins ties.
        let Some((heir, n)) = held.iter_mut().min_by_key(|(_, n)| **n) else {
            return;
        };
        *n += 1;
        owners.insert(shard, (*heir).to_owned());
    }
}

/// A settled member's shards (ascending) and the count it should end with.
struct Load<'a> {
    member: &'a str,
    shards: Vec<u16>,
    target: usize,
}

impl Load<'_> {
    fn excess(&self) -> usize {
        self.shards.len().saturating_sub(self.target)
    }

    fn deficit(&self) -> usize {
        self.target.saturating_sub(self.shards.len())
    }
}

/// Moves up to `max_moves` shards from settled members above their target to
/// those below it.
///
/// The targets split the shards settled members hold evenly; the members that
/// hold most get the remainder, so a member at or above the larger target only
/// ever gives shards up and one at or below the smaller only ever takes them,
/// step after step: no shard moves twice, and the moves add up to the fewest
/// that balance the fleet.
fn balance(owners: &mut BTreeMap<u16, String>, settled: &BTreeSet<&str>, max_moves: usize) {
    let mut loads: Vec<Load<'_>> = settled
        .iter()
        .map(|&member| Load {
            member,
            shards: Vec::new(),
            target: 0,
        })
        .collect();
    if loads.is_empty() {
        return;
    }
    for (&shard, owner) in owners.iter() {
        if let Ok(i) = loads.binary_search_by(|load| load.member.cmp(owner.as_str())) {
            loads[i].shards.push(shard);
        }
    }

    let total: usize = loads.iter().map(|load| load.shards.len()).sum();
    let (even, remainder) = (total / loads.len(), total % loads.len());
    loads.sort_by(|a, b| {
        b.shards
            .len()
            .cmp(&a.shards.len())
            .then_with(|| a.member.cmp(b.member))
    });
    for (rank, load) in loads.iter_mut().enumerate() {
        load.target = even + usize::from(rank < remainder);
    }

    for _ in 0..max_moves {
        let (Some(from), Some(to)) = (most(&loads, Load::excess), most(&loads, Load::deficit))
        else {
            break;
        };
        // Pushed in ascending order, so this is the donor's highest shard.
        let Some(shard) = loads[from].shards.pop() else {
            break;
        };
        loads[to].shards.push(shard);
        owners.insert(shard, loads[to].member.to_owned());
    }
}

/// The index of the load with the largest positive `by`, smallest id on ties.
fn most<'a>(loads: &[Load<'a>], by: impl Fn(&Load<'a>) -> usize) -> Option<usize> {
    loads
        .iter()
        .enumerate()
        .filter(|(_, load)| by(load) > 0)
        .max_by(|(_, a), (_, b)| by(a).cmp(&by(b)).then_with(|| b.member.cmp(a.member)))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|&name| name.to_owned()).collect()
    }

    fn assignment(generation: u64, owners: &[(u16, &str)]) -> Assignment {
        Assignment {
            generation,
            owners: owners
                .iter()
                .map(|&(shard, owner)| (shard, owner.to_owned()))
                .collect(),
        }
    }

    fn all_to(member: &str, shards: &[u16]) -> Assignment {
        let owners: Vec<(u16, &str)> = shards.iter().map(|&shard| (shard, member)).collect();
        assignment(0, &owners)
    }

    fn step(
        current: &Assignment,
        shards: &[u16],
        live: &[String],
        settled: &[String],
        max_moves: usize,
    ) -> Assignment {
        rebalance(
            current,
            shards,
            &Members { live, settled },
            &Rules { max_moves },
        )
    }

    fn shards_of(a: &Assignment, member: &str) -> Vec<u16> {
        a.shards_of(member).collect()
    }

    #[test]
    fn a_second_member_gets_half_of_twelve_shards_one_per_step() {
        let shards: Vec<u16> = (0..12).collect();
        let both = ids(&["a", "b"]);
        let mut a = all_to("a", &shards);

        a = step(&a, &shards, &both, &both, 1);
        assert_eq!(shards_of(&a, "b"), vec![11]);
        assert_eq!(a.generation, 1);
        for _ in 1..6 {
            a = step(&a, &shards, &both, &both, 1);
        }
        assert_eq!(shards_of(&a, "a"), (0..6).collect::<Vec<_>>());
        assert_eq!(shards_of(&a, "b"), (6..12).collect::<Vec<_>>());
        assert_eq!(a.generation, 6);
        assert_eq!(step(&a, &shards, &both, &both, 1), a);
    }

    #[test]
    fn a_member_gets_nothing_until_it_settles() {
        let shards: Vec<u16> = (0..12).collect();
        let a = all_to("a", &shards);
        let next = step(&a, &shards, &ids(&["a", "b"]), &ids(&["a"]), 1);
        assert_eq!(next, a);
    }

    #[test]
    fn a_member_that_restarts_within_its_lease_keeps_its_shards() {
        let shards: Vec<u16> = (0..12).collect();
        let mut owners: Vec<(u16, &str)> = (0..6).map(|shard| (shard, "a")).collect();
        owners.extend((6..12).map(|shard| (shard, "b")));
        let before = assignment(4, &owners);
        // Back under the same id before its lease ran out: live, and settled or not
        // yet, it owns what it owned and nobody moves.
        for settled in [ids(&["a"]), ids(&["a", "b"])] {
            assert_eq!(
                step(&before, &shards, &ids(&["a", "b"]), &settled, 1),
                before
            );
        }
    }

    #[test]
    fn a_gone_members_shards_go_to_the_others_at_once() {
        let shards: Vec<u16> = (0..12).collect();
        let owners: Vec<(u16, &str)> = shards
            .iter()
            .map(|&shard| (shard, ["a", "b", "c"][usize::from(shard / 4)]))
            .collect();
        let survivors = ids(&["a", "b"]);
        let next = step(&assignment(9, &owners), &shards, &survivors, &survivors, 1);
        assert_eq!(shards_of(&next, "a"), vec![0, 1, 2, 3, 8, 10]);
        assert_eq!(shards_of(&next, "b"), vec![4, 5, 6, 7, 9, 11]);
        assert_eq!(next.generation, 10);
    }

    #[test]
    fn with_no_settled_member_orphans_go_to_the_live_one_with_fewest() {
        let shards: Vec<u16> = (0..6).collect();
        let before = assignment(0, &[(0, "a"), (1, "a"), (2, "a")]);
        let next = step(&before, &shards, &ids(&["b", "a"]), &[], 1);
        assert_eq!(shards_of(&next, "a"), vec![0, 1, 2]);
        assert_eq!(shards_of(&next, "b"), vec![3, 4, 5]);
    }

    #[test]
    fn with_no_live_member_every_shard_is_unowned() {
        let before = assignment(2, &[(0, "a"), (1, "b")]);
        let next = step(&before, &[0, 1], &[], &[], 1);
        assert!(next.owners.is_empty());
        assert_eq!(next.generation, 3);
    }

    #[test]
    fn shards_outside_the_managed_set_are_dropped() {
        let before = assignment(0, &[(0, "a"), (1, "a"), (7, "a")]);
        let live = ids(&["a"]);
        let next = step(&before, &[0, 1], &live, &live, 1);
        assert_eq!(shards_of(&next, "a"), vec![0, 1]);
        assert_eq!(next.generation, 1);
    }

    #[test]
    fn max_moves_zero_only_reassigns_orphans() {
        let before = assignment(0, &[(0, "a"), (1, "a"), (2, "a"), (3, "gone")]);
        let live = ids(&["a", "b"]);
        let next = step(&before, &[0, 1, 2, 3], &live, &live, 0);
        assert_eq!(shards_of(&next, "a"), vec![0, 1, 2]);
        assert_eq!(shards_of(&next, "b"), vec![3]);
    }

    #[test]
    fn the_members_holding_most_keep_the_remainder() {
        // 4 shards over 3: targets 2, 1, 1. "c" holds most, so it keeps the 2 and
        // one shard moves; giving the 2 to "a" (smaller id) would take two moves.
        let before = assignment(0, &[(0, "a"), (1, "c"), (2, "c"), (3, "c")]);
        let live = ids(&["a", "b", "c"]);
        let next = step(&before, &[0, 1, 2, 3], &live, &live, 4);
        assert_eq!(shards_of(&next, "a"), vec![0]);
        assert_eq!(shards_of(&next, "b"), vec![3]);
        assert_eq!(shards_of(&next, "c"), vec![1, 2]);
        assert_eq!(step(&next, &[0, 1, 2, 3], &live, &live, 4), next);
    }

    #[test]
    fn counts_per_member() {
        let a = assignment(0, &[(0, "a"), (1, "b"), (2, "a")]);
        assert_eq!(counts(&a), BTreeMap::from([("a", 2), ("b", 1)]));
        assert!(counts(&Assignment::default()).is_empty());
    }

    #[test]
    fn an_assignment_is_json_keyed_by_shard_id() {
        let a = assignment(3, &[(0, "a"), (12, "b")]);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, r#"{"generation":3,"owners":{"0":"a","12":"b"}}"#);
        assert_eq!(serde_json::from_str::<Assignment>(&json).unwrap(), a);
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Status {
        Gone,
        Joining,
        Settled,
    }

    /// A fleet at one moment: the stored assignment and the members one member sees.
    #[derive(Debug, Clone)]
    struct Case {
        current: Assignment,
        shards: Vec<u16>,
        live: Vec<String>,
        settled: Vec<String>,
        max_moves: usize,
    }

    impl Case {
        fn step(&self, from: &Assignment, max_moves: usize) -> Assignment {
            step(from, &self.shards, &self.live, &self.settled, max_moves)
        }

        fn live(&self) -> BTreeSet<&str> {
            self.live.iter().map(String::as_str).collect()
        }

        fn settled(&self) -> BTreeSet<&str> {
            self.settled.iter().map(String::as_str).collect()
        }

        fn all_settled(&self) -> Self {
            Self {
                settled: self.live.clone(),
                ..self.clone()
            }
        }

        /// Steps from `from` until nothing changes, within the bound the
        /// convergence property promises; the assignments visited, `from` first.
        fn run(&self, from: &Assignment) -> Result<Vec<Assignment>, TestCaseError> {
            let bound = self.shards.len().div_ceil(self.max_moves) + 2;
            let mut run = vec![from.clone()];
            for _ in 0..bound {
                let last = &run[run.len() - 1];
                let next = self.step(last, self.max_moves);
                if next == *last {
                    return Ok(run);
                }
                run.push(next);
            }
            Err(TestCaseError::fail(format!(
                "no fixed point within {bound} steps"
            )))
        }
    }

    fn member(i: usize) -> String {
        format!("w{i}")
    }

    /// 1..=64 shards (a few of them not managed, and a few owned shards beyond
    /// them), 1..=8 member ids each gone, joining or settled, owners drawn from
    /// all of them or absent, `max_moves` 1..=4.
    fn case() -> impl Strategy<Value = Case> {
        (1u16..=64, 1usize..=8)
            .prop_flat_map(|(n, m)| {
                let status = prop_oneof![
                    1 => Just(Status::Gone),
                    1 => Just(Status::Joining),
                    2 => Just(Status::Settled),
                ];
                (
                    prop::collection::vec(status, m),
                    prop::collection::vec(prop::option::weighted(0.8, 0..m), usize::from(n) + 4),
                    prop::collection::vec(prop::bool::weighted(0.9), usize::from(n)),
                    1usize..=4,
                    0u64..1000,
                )
            })
            .prop_map(|(statuses, owners, managed, max_moves, generation)| {
                let with = |keep: fn(Status) -> bool| -> Vec<String> {
                    // Reversed, so the function's own sorting is exercised.
                    (0..statuses.len())
                        .rev()
                        .filter(|&i| keep(statuses[i]))
                        .map(member)
                        .collect()
                };
                Case {
                    current: Assignment {
                        generation,
                        owners: (0u16..)
                            .zip(owners)
                            .filter_map(|(shard, owner)| Some((shard, member(owner?))))
                            .collect(),
                    },
                    shards: (0u16..)
                        .zip(managed)
                        .filter_map(|(shard, managed)| managed.then_some(shard))
                        .collect(),
                    live: with(|s| s != Status::Gone),
                    settled: with(|s| s == Status::Settled),
                    max_moves,
                }
            })
    }

    /// Shards whose owner in `before` is live and different in `after`.
    fn moved(before: &Assignment, after: &Assignment, live: &BTreeSet<&str>) -> Vec<u16> {
        before
            .owners
            .iter()
            .filter(|(shard, owner)| {
                live.contains(owner.as_str()) && after.owners.get(*shard) != Some(*owner)
            })
            .map(|(&shard, _)| shard)
            .collect()
    }

    /// Shard counts of the settled members, zeros included.
    fn settled_counts<'c>(a: &Assignment, settled: &BTreeSet<&'c str>) -> BTreeMap<&'c str, usize> {
        settled
            .iter()
            .map(|&member| (member, a.shards_of(member).count()))
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn every_managed_shard_has_one_live_owner(case in case()) {
            let next = case.step(&case.current, case.max_moves);
            let live = case.live();
            for (shard, owner) in &next.owners {
                prop_assert!(case.shards.contains(shard), "unmanaged shard {shard} owned");
                prop_assert!(live.contains(owner.as_str()), "shard {shard} owned by {owner}");
            }
            if !live.is_empty() {
                let owned: Vec<u16> = next.owners.keys().copied().collect();
                prop_assert_eq!(owned, case.shards.clone());
            }
        }

        #[test]
        fn one_step_reassigns_every_orphan(case in case()) {
            let next = case.step(&case.current, case.max_moves);
            let (live, settled) = (case.live(), case.settled());
            for &shard in &case.shards {
                let was_live = case
                    .current
                    .owners
                    .get(&shard)
                    .is_some_and(|owner| live.contains(owner.as_str()));
                if was_live || live.is_empty() {
                    continue;
                }
                let owner = next.owners.get(&shard).map(String::as_str);
                prop_assert!(owner.is_some_and(|o| live.contains(o)), "orphan {shard}: {owner:?}");
                if !settled.is_empty() {
                    prop_assert!(owner.is_some_and(|o| settled.contains(o)), "orphan {shard}: {owner:?}");
                }
            }
        }

        #[test]
        fn one_step_moves_at_most_max_moves_and_spares_joining_members(case in case()) {
            let next = case.step(&case.current, case.max_moves);
            let (live, settled) = (case.live(), case.settled());
            let moved = moved(&case.current, &next, &live);
            let managed_moved = moved.iter().filter(|shard| case.shards.contains(shard)).count();
            prop_assert!(managed_moved <= case.max_moves, "{managed_moved} moves");
            for joining in live.difference(&settled) {
                let before: BTreeSet<u16> = case
                    .current
                    .shards_of(joining)
                    .filter(|shard| case.shards.contains(shard))
                    .collect();
                let after: BTreeSet<u16> = next.shards_of(joining).collect();
                prop_assert!(before.is_subset(&after), "{joining} lost shards");
                if !settled.is_empty() {
                    prop_assert_eq!(&before, &after, "{} gained shards", joining);
                }
            }
        }

        #[test]
        fn repeated_steps_reach_a_balanced_fixed_point(case in case()) {
            for case in [case.clone(), case.all_settled()] {
                let run = case.run(&case.current)?;
                let fixed = &run[run.len() - 1];
                let settled = case.settled();
                let counts = settled_counts(fixed, &settled);
                let (Some(&lo), Some(&hi)) = (counts.values().min(), counts.values().max()) else {
                    continue;
                };
                let held: usize = counts.values().sum();
                prop_assert!(hi - lo <= 1, "unbalanced: {counts:?}");
                prop_assert!(lo >= held / counts.len(), "below an even share: {counts:?}");
            }
        }

        #[test]
        fn no_shard_moves_twice_or_needlessly(case in case()) {
            let case = if case.settled.is_empty() { case.all_settled() } else { case };
            let (live, settled) = (case.live(), case.settled());
            if settled.is_empty() {
                return Ok(());
            }
            let start = case.step(&case.current, 0);
            let run = case.run(&start)?;

            let mut moves: BTreeMap<u16, usize> = BTreeMap::new();
            let (mut gained, mut lost) = (BTreeSet::new(), BTreeSet::new());
            for pair in run.windows(2) {
                let (before, after) = (&pair[0], &pair[1]);
                for shard in moved(before, after, &live) {
                    *moves.entry(shard).or_insert(0) += 1;
                    lost.insert(before.owners[&shard].clone());
                    gained.insert(after.owners[&shard].clone());
                }
            }
            prop_assert!(moves.values().all(|&n| n == 1), "moved more than once: {moves:?}");
            prop_assert!(gained.is_disjoint(&lost), "gained {gained:?}, lost {lost:?}");

            // The fewest moves that balance the settled members: the even split,
            // with the remainder to those holding most at the start.
            let mut held: Vec<usize> = settled_counts(&start, &settled).into_values().collect();
            held.sort_unstable_by(|a, b| b.cmp(a));
            let total: usize = held.iter().sum();
            let (even, remainder) = (total / held.len(), total % held.len());
            let fewest: usize = held
                .iter()
                .enumerate()
                .map(|(rank, &n)| n.saturating_sub(even + usize::from(rank < remainder)))
                .sum();
            prop_assert_eq!(moves.len(), fewest);
        }

        #[test]
        fn generation_counts_changes(case in case()) {
            let mut current = case.current.clone();
            for _ in 0..3 {
                let next = case.step(&current, case.max_moves);
                let changed = next.owners != current.owners;
                prop_assert_eq!(next.generation, current.generation + u64::from(changed));
                current = next;
            }
            let run = case.run(&current)?;
            let fixed = &run[run.len() - 1];
            prop_assert_eq!(&case.step(fixed, case.max_moves), fixed);
        }

        #[test]
        fn member_order_and_repeats_do_not_matter(case in case()) {
            let next = case.step(&case.current, case.max_moves);
            let mut live = case.live.clone();
            live.reverse();
            live.extend(case.live.iter().cloned());
            let mut settled = case.settled.clone();
            settled.reverse();
            settled.extend(case.settled.iter().cloned());
            // Settled but not live counts for nothing.
            settled.push(member(99));
            let shards: Vec<u16> = case.shards.iter().rev().chain(&case.shards).copied().collect();
            prop_assert_eq!(step(&case.current, &shards, &live, &settled, case.max_moves), next);
        }
    }
}
