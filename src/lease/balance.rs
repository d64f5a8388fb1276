//! Fair share, as pure functions: which share of a platform's accounts each live node should
//! own, and how many accounts a node above its share hands off this cycle.
//!
//! Every node computes the shares from the same membership rows (live, not gated nodes and their
//! capacities) and the same total, so they agree without talking; ties break by node id. Moves
//! are bounded per cycle and start only above the share plus a margin (hysteresis), so nodes
//! joining and leaving converge instead of thrashing.

use std::collections::BTreeMap;

/// A live node as the balancer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node_id: String,
    pub capacity: u32,
}

/// Each member's share of `total` accounts: in proportion to capacity, never above a member's
/// capacity (what a capped member cannot take goes to the others), remainders to the largest
/// fractional parts, ties to the lower node id.
pub fn shares(members: &[Member], total: u64) -> BTreeMap<String, u32> {
    let mut out: BTreeMap<String, u32> = members.iter().map(|m| (m.node_id.clone(), 0)).collect();
    let mut open: Vec<&Member> = members.iter().filter(|m| m.capacity > 0).collect();
    open.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    open.dedup_by(|a, b| a.node_id == b.node_id);
    let remaining = total.min(open.iter().map(|m| m.capacity as u64).sum());
    if remaining > 0 && !open.is_empty() {
        let cap_sum: u64 = open.iter().map(|m| m.capacity as u64).sum();
        // A proportional part reaches a member's capacity only if there are at least as many
        // accounts as capacity in all: then everyone is full.
        if remaining >= cap_sum {
            for m in open.drain(..) {
                out.insert(m.node_id.clone(), m.capacity);
            }
            return out;
        }
        let mut parts: Vec<(u64, u64, usize)> = open
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let n = remaining as u128 * m.capacity as u128;
                (
                    (n / cap_sum as u128) as u64,
                    (n % cap_sum as u128) as u64,
                    i,
                )
            })
            .collect();
        let given: u64 = parts.iter().map(|p| p.0).sum();
        let mut left = remaining - given;
        // Largest remainder first; ties to the lower node id (the order of `open`).
        parts.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        for p in parts.iter_mut() {
            if left == 0 {
                break;
            }
            p.0 += 1;
            left -= 1;
        }
        for (n, _, i) in parts {
            out.insert(open[i].node_id.clone(), n as u32);
        }
    }
    out
}

/// How far above its share a node may drift before it hands accounts off, and how many it hands
/// off per cycle, as fractions of the share (each at least one account).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    pub margin: f64,
    pub step: f64,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            margin: 0.1,
            step: 0.1,
        }
    }
}

/// The margin for a share: `knobs.margin` of it, at least one account.
pub fn margin(target: u32, knobs: Knobs) -> u32 {
    ((target as f64 * knobs.margin).round() as u32).max(1)
}

/// How many accounts to hand off this cycle. Hysteresis: handing off starts once `owned` exceeds
/// `target` plus the margin, or exceeds `target` at all while some peer is `starved` (below its
/// own share by more than its margin: a new node that would otherwise wait), and continues
/// (`shedding`) until `owned` is down to `target`.
pub fn to_release(
    owned: u32,
    target: u32,
    starved: bool,
    shedding: &mut bool,
    knobs: Knobs,
) -> u32 {
    let step = ((target as f64 * knobs.step).round() as u32).max(1);
    if !*shedding
        && (owned > target.saturating_add(margin(target, knobs)) || (starved && owned > target))
    {
        *shedding = true;
    }
    if !*shedding {
        return 0;
    }
    if owned <= target {
        *shedding = false;
        return 0;
    }
    (owned - target).min(step)
}

/// Whether `owned` (accounts per node) is a balanced spread of `total` accounts over `members`:
/// every account owned by a member, and every member within its margin of its share. What the
/// demo and the benchmarks wait for after a node joins.
pub fn balanced(
    owned: &BTreeMap<String, u32>,
    members: &[Member],
    total: u64,
    knobs: Knobs,
) -> bool {
    let targets = shares(members, total);
    let held: u64 = targets
        .keys()
        .map(|n| owned.get(n).copied().unwrap_or(0) as u64)
        .sum();
    held == total
        && targets.iter().all(|(n, &target)| {
            owned.get(n).copied().unwrap_or(0).abs_diff(target) <= margin(target, knobs)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_means_everything_owned_by_members_each_within_its_margin() {
        let members = [m("a", 1000), m("b", 1000)];
        let owned = |a: u32, b: u32| BTreeMap::from([("a".to_string(), a), ("b".to_string(), b)]);
        let k = Knobs::default();
        assert!(balanced(&owned(100, 100), &members, 200, k));
        assert!(balanced(&owned(110, 90), &members, 200, k));
        assert!(!balanced(&owned(111, 89), &members, 200, k));
        assert!(!balanced(&owned(100, 99), &members, 200, k), "one unowned");
        let mut with_stranger = owned(100, 90);
        with_stranger.insert("gone".into(), 10);
        assert!(
            !balanced(&with_stranger, &members, 200, k),
            "owned by a non-member"
        );
    }

    fn m(id: &str, capacity: u32) -> Member {
        Member {
            node_id: id.into(),
            capacity,
        }
    }

    fn s(members: &[Member], total: u64) -> Vec<u32> {
        let out = shares(members, total);
        members.iter().map(|x| out[&x.node_id]).collect()
    }

    #[test]
    fn equal_capacities_split_evenly_with_remainders_to_the_lowest_ids() {
        assert_eq!(
            s(&[m("a", 100), m("b", 100), m("c", 100)], 300),
            vec![100, 100, 100]
        );
        assert_eq!(
            s(&[m("c", 200), m("a", 200), m("b", 200)], 301),
            vec![100, 101, 100]
        );
        assert_eq!(
            s(&[m("a", 100), m("b", 100), m("c", 100)], 2),
            vec![1, 1, 0]
        );
    }

    #[test]
    fn unequal_capacities_split_in_proportion() {
        assert_eq!(s(&[m("a", 100), m("b", 200)], 150), vec![50, 100]);
        assert_eq!(s(&[m("a", 10), m("b", 30)], 8), vec![2, 6]);
    }

    #[test]
    fn no_share_exceeds_a_capacity_and_the_rest_goes_to_the_others() {
        assert_eq!(s(&[m("a", 10), m("b", 1000)], 500), vec![5, 495]);
        assert_eq!(s(&[m("a", 10), m("b", 20)], 30), vec![10, 20]);
        assert_eq!(
            s(&[m("a", 10), m("b", 20)], 500),
            vec![10, 20],
            "more accounts than capacity: everyone full"
        );
        assert_eq!(s(&[], 10), Vec::<u32>::new());
    }

    #[test]
    fn shares_are_deterministic_whatever_the_order() {
        let a = shares(&[m("x", 70), m("y", 110), m("z", 130)], 97);
        let b = shares(&[m("z", 130), m("x", 70), m("y", 110)], 97);
        assert_eq!(a, b);
        assert_eq!(a.values().sum::<u32>(), 97);
    }

    #[test]
    fn handing_off_has_hysteresis_and_a_bounded_step() {
        let knobs = Knobs::default();
        let mut shedding = false;
        // Within the margin (target 100, margin 10): nothing moves.
        assert_eq!(to_release(110, 100, false, &mut shedding, knobs), 0);
        assert!(!shedding);
        // Above it: at most 10 per cycle, until the target is reached.
        assert_eq!(to_release(150, 100, false, &mut shedding, knobs), 10);
        assert_eq!(to_release(140, 100, false, &mut shedding, knobs), 10);
        assert_eq!(
            to_release(105, 100, false, &mut shedding, knobs),
            5,
            "continues below the margin, down to the target"
        );
        assert_eq!(to_release(100, 100, false, &mut shedding, knobs), 0);
        assert!(!shedding);
        // Small targets still move one at a time.
        let mut shedding = false;
        assert_eq!(to_release(3, 0, false, &mut shedding, knobs), 1);
    }

    #[test]
    fn a_starved_peer_makes_nodes_within_the_margin_hand_off() {
        let knobs = Knobs::default();
        let mut shedding = false;
        // Eight accounts over four nodes: [2, 3, 3, 0] is within everyone's margin from above,
        // but the fourth node starves: those above their share hand one off each.
        assert_eq!(to_release(3, 2, false, &mut shedding, knobs), 0);
        assert_eq!(to_release(3, 2, true, &mut shedding, knobs), 1);
        assert_eq!(to_release(2, 2, true, &mut shedding, knobs), 0);
        let mut shedding = false;
        assert_eq!(
            to_release(2, 2, true, &mut shedding, knobs),
            0,
            "a node at its share never hands off"
        );
    }
}
