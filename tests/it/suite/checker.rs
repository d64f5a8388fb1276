//! The journal checker: what the simulated broker saw, judged against the guarantees.
//!
//! * S2: no two accepted opens for the same (follower login, magic, comment), a pending copy
//!   that was not cancelled counting as one;
//! * S1 seen from the broker: when the node sending for a follower changes from A to B without a
//!   release by A, B's first order comes at least `fence` (minus a tolerance) after A's last,
//!   unless the broker rejected A's late orders as stale; with a release, B's first order comes
//!   after A's last;
//! * no order accepted with a fence below one the broker had already seen for the login (only
//!   possible with `--no-fence-check`: that count is what the fence check prevents).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

/// One journal line, as the simulated broker writes and reads it.
pub use copier_node::sim_broker::journal::JournalEntry as Line;

pub fn load(path: &Path) -> Vec<Line> {
    copier_node::sim_broker::journal::read(path).unwrap()
}

/// (login, magic, comment) that may have held more than one copy, judged from the journal alone:
/// a node's accepted opens, plus its accepted pending copies (`place`) that no accepted `cancel`
/// of the same ticket took back. A pending copy not cancelled counts as a copy, filled or not
/// (the journal records requests, not fills), so this never counts too few; the suite's pending
/// orders all fill and neither expire nor are cancelled by hand, so it does not count too many.
pub fn duplicates(lines: &[Line]) -> Vec<String> {
    let node = |l: &&Line| l.accepted && l.client != "manual";
    let cancelled: HashSet<(&str, i64)> = lines
        .iter()
        .filter(node)
        .filter(|l| l.action == "cancel")
        .filter_map(|l| Some((l.login.as_str(), l.ticket?)))
        .collect();
    let mut copies: HashMap<(String, Option<i64>, String), usize> = HashMap::new();
    for l in lines.iter().filter(node).filter(|l| {
        l.action == "open"
            || (l.action == "place"
                && !l
                    .ticket
                    .is_some_and(|t| cancelled.contains(&(l.login.as_str(), t))))
    }) {
        *copies
            .entry((
                l.login.clone(),
                l.magic,
                l.comment.clone().unwrap_or_default(),
            ))
            .or_insert(0) += 1;
    }
    let mut out: Vec<String> = copies
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|((login, magic, comment), n)| {
            format!(
                "{login} magic {magic:?} {comment}: {n} accepted opens and standing pending copies"
            )
        })
        .collect();
    out.sort();
    out
}

/// Orders accepted although their fence was below one already seen for the login.
pub fn stale_accepted(lines: &[Line]) -> Vec<String> {
    let mut highest: HashMap<&str, i64> = HashMap::new();
    let mut out = Vec::new();
    for l in lines {
        let Some(f) = l.fence else { continue };
        let h = highest.entry(&l.login).or_insert(f);
        if l.accepted && l.action != "login" && f < *h {
            out.push(format!(
                "{} {} {} fence {f} < {h} accepted at {}",
                l.login, l.client, l.action, l.ts_ms
            ));
        }
        if l.accepted || l.action == "login" {
            *h = (*h).max(f);
        }
    }
    out
}

/// Orders whose fence was below one already seen for the login and that were not stopped by the
/// fence check (with `--no-fence-check`): (executed, caught by client-order-id dedupe instead).
pub fn stale_passed(lines: &[Line]) -> (usize, usize) {
    let mut highest: HashMap<&str, i64> = HashMap::new();
    let (mut executed, mut deduped) = (0, 0);
    for l in lines {
        let Some(f) = l.fence else { continue };
        let h = highest.entry(&l.login).or_insert(f);
        if l.action != "login" && f < *h {
            if l.accepted {
                executed += 1;
            } else if l
                .reason
                .as_deref()
                .is_some_and(|r| r.starts_with("duplicate client_order_id"))
            {
                deduped += 1;
            }
        }
        if l.accepted || l.action == "login" {
            *h = (*h).max(f);
        }
    }
    (executed, deduped)
}

/// Orders rejected as stale (what the fence check stopped).
pub fn stale_rejected(lines: &[Line]) -> usize {
    lines
        .iter()
        .filter(|l| {
            !l.accepted
                && l.reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("stale fence"))
                && l.action != "login"
        })
        .count()
}

/// A change of the node sending orders for a follower.
#[derive(Debug, Clone)]
pub struct Handover {
    pub login: String,
    pub from: String,
    pub to: String,
    /// The old node's last order and the new node's first (broker clock, Unix ms).
    pub last_ms: i64,
    pub first_ms: i64,
    /// From the old node's last order to the new node's first.
    pub gap_ms: i64,
}

/// An account its owner released, as the suite's own observer of the lease rows saw it (the
/// database's clock; never a node's log).
#[derive(Debug, Clone)]
pub struct Release {
    pub login: String,
    pub node: String,
    pub at_ms: i64,
}

/// Every change of sending node per follower login (orders only, accepted or not, from nodes).
pub fn handovers(lines: &[Line]) -> Vec<Handover> {
    let mut by_login: BTreeMap<&str, Vec<&Line>> = BTreeMap::new();
    for l in lines
        .iter()
        .filter(|l| l.client != "manual" && l.action != "login")
    {
        by_login.entry(&l.login).or_default().push(l);
    }
    let mut out = Vec::new();
    for (login, list) in by_login {
        let mut list = list;
        list.sort_by_key(|l| l.ts_ms);
        for pair in list.windows(2) {
            if pair[0].client != pair[1].client {
                out.push(Handover {
                    login: login.to_string(),
                    from: pair[0].client.clone(),
                    to: pair[1].client.clone(),
                    last_ms: pair[0].ts_ms,
                    first_ms: pair[1].ts_ms,
                    gap_ms: pair[1].ts_ms - pair[0].ts_ms,
                });
            }
        }
    }
    out
}

/// S1 seen from the broker. A handover after a release needs only order: `releases` are the
/// releases the suite's observer saw (an account set free by its owner, by the database's
/// clock) between the old node's last order and the new node's first; without one, the new
/// node's first order comes at least the fence after the old one's last. Orders the broker
/// rejected as stale do not count as acting.
pub fn single_owner_violations(
    lines: &[Line],
    fence_ms: i64,
    tolerance_ms: i64,
    releases: &[Release],
) -> Vec<String> {
    let acting: Vec<Line> = lines
        .iter()
        .filter(|l| {
            !(l.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("stale fence")))
        })
        .cloned()
        .collect();
    handovers(&acting)
        .into_iter()
        .filter(|h| {
            let after_release = releases.iter().any(|r| {
                r.login == h.login
                    && r.node == h.from
                    && r.at_ms + tolerance_ms >= h.last_ms
                    && r.at_ms <= h.first_ms + tolerance_ms
            });
            let min = if after_release {
                0
            } else {
                fence_ms - tolerance_ms
            };
            h.gap_ms < min
        })
        .map(|h| {
            format!(
                "{}: {} -> {} only {} ms apart",
                h.login, h.from, h.to, h.gap_ms
            )
        })
        .collect()
}

/// `2026-11-30T04:01:01.123456Z` as Unix milliseconds.
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let time = time.trim_end_matches('Z');
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>());
    let (hh, mm, ss) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let ms: i64 = format!("{:0<3}", &frac[..frac.len().min(3)]).parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + hh) * 60 + mm) * 60_000 + ss * 1000 + ms)
}

/// Epochs (fences) the journal shows in use by more than one (login, node): an epoch names one
/// ownership of one account, so a second user means an epoch was handed out twice (the epoch
/// sequence rewound with a database's lost tail, say).
pub fn epochs_reused(lines: &[Line]) -> Vec<String> {
    let mut users: BTreeMap<i64, BTreeSet<(String, String)>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.client != "manual") {
        if let Some(f) = l.fence {
            users
                .entry(f)
                .or_default()
                .insert((l.login.clone(), l.client.clone()));
        }
    }
    users
        .into_iter()
        .filter(|(_, u)| u.len() > 1)
        .map(|(f, u)| format!("epoch {f} used by {u:?}"))
        .collect()
}

#[cfg(test)]
mod tests {
    fn line(login: &str, client: &str, fence: i64) -> super::Line {
        serde_json::from_value(serde_json::json!({
            "ts_ms": 0, "login": login, "client": client, "action": "open", "ticket": null,
            "symbol": null, "side": null, "volume": null, "magic": null, "comment": null,
            "fence": fence, "client_order_id": null, "accepted": true, "reason": null
        }))
        .unwrap()
    }

    #[test]
    fn an_epoch_seen_on_two_accounts_or_two_nodes_is_reported() {
        let ok = [line("f3", "a", 7), line("f3", "a", 7), line("f4", "a", 8)];
        assert!(super::epochs_reused(&ok).is_empty());
        let two_nodes = [line("f3", "a", 7), line("f3", "b", 7)];
        assert_eq!(super::epochs_reused(&two_nodes).len(), 1);
        let two_accounts = [line("f3", "a", 7), line("f4", "a", 7)];
        assert_eq!(super::epochs_reused(&two_accounts).len(), 1);
    }

    fn order(action: &str, ticket: i64, comment: &str, accepted: bool) -> super::Line {
        serde_json::from_value(serde_json::json!({
            "ts_ms": 0, "login": "f3", "client": "a", "action": action, "ticket": ticket,
            "symbol": "EURUSD", "side": "buy", "volume": 0.1, "magic": 7, "comment": comment,
            "fence": 1, "client_order_id": null, "accepted": accepted, "reason": null
        }))
        .unwrap()
    }

    #[test]
    fn a_standing_pending_copy_counts_as_a_copy_and_a_cancelled_one_does_not() {
        // Placed, cancelled (the master filled first), then copied at market: one copy.
        let cancelled_then_market = [
            order("place", 90, "mc5", true),
            order("cancel", 90, "mc5", true),
            order("open", 91, "mc5", true),
        ];
        assert!(super::duplicates(&cancelled_then_market).is_empty());
        // The cancel refused (the pending copy had filled), then a market copy: two.
        let filled_then_market = [
            order("place", 90, "mc5", true),
            order("cancel", 90, "mc5", false),
            order("open", 91, "mc5", true),
        ];
        assert_eq!(super::duplicates(&filled_then_market).len(), 1);
        // Two pending copies, or two opens: two.
        let placed_twice = [
            order("place", 90, "mc5", true),
            order("place", 91, "mc5", true),
        ];
        assert_eq!(super::duplicates(&placed_twice).len(), 1);
        let opened_twice = [
            order("open", 90, "mc5", true),
            order("open", 91, "mc5", true),
        ];
        assert_eq!(super::duplicates(&opened_twice).len(), 1);
        // A refused place is no copy.
        let refused = [
            order("place", 90, "mc5", false),
            order("open", 91, "mc5", true),
        ];
        assert!(super::duplicates(&refused).is_empty());
    }

    #[test]
    fn log_timestamps_parse() {
        assert_eq!(
            super::parse_rfc3339_ms("1970-01-01T00:00:01.500000Z"),
            Some(1500)
        );
        assert_eq!(
            super::parse_rfc3339_ms("2026-11-30T04:01:01.123456Z"),
            Some(1_796_011_261_123)
        );
    }
}
