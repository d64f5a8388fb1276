//! The copy engine: masters publish their position changes as events, followers apply them.
//!
//! * [`master`]: a master's session turns the broker's position stream into events, each
//!   published in one fenced statement that stores the master's snapshot and (epoch, seq) and
//!   issues the NOTIFY from that statement's result.
//! * [`follower`]: a follower's session LISTENs (through the node's [`crate::hub`]) before it reads
//!   a snapshot, reconciles, then applies events in order; a gap, an unknown epoch, a reconnect,
//!   a lapse of trust or a timer sends it back to reconcile.
//! * [`rules`], [`index`] and [`reconcile`]: the pure decisions: a link's rules, the follower's
//!   copies by marker, and what a follower owes its masters (one function for the event path and
//!   reconcile), unit-tested table-style and by a property test.
//!
//! Markers: every copy carries its link's magic number and the comment `mc<masterTicket>`; that
//! is how any node recognises copies that already exist or existed. Every order carries a client
//! order id naming its one intent ([`intent`]).

#[cfg(test)]
mod convergence;
pub mod follower;
pub mod index;
pub mod master;
#[cfg(test)]
mod pending_races;
pub mod reconcile;
pub mod risk;
pub mod rules;

use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};

pub use crate::model::events;
pub use crate::model::{MasterOrder, MasterPosition, marker, parse_marker};

/// A session's periodic timer, `period` apart, whose first tick falls at a random point between
/// half a period and one and a half: a node starts hundreds of sessions in one cycle, and timers
/// started together would fire together (a burst of link reloads and broker reads that holds up
/// the copies of a trade arriving at that moment). A late tick is delayed, never fired in a burst.
pub fn spread_interval(period: Duration) -> Interval {
    let first = period.mul_f64(0.5 + fastrand::f64());
    let mut interval = tokio::time::interval_at(Instant::now() + first, period);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    interval
}

/// Client order ids. Each names one intent, derived only from data any owner of the follower can
/// see (link, master ticket, copy ticket, target volume, the master's published (epoch, seq)),
/// so a new owner after a failover retries an intent under the same id (a deduplicating bridge
/// executes it once) and distinct intents never share one (a deduplicating bridge never
/// swallows the second).
pub mod intent {
    /// Open the copy of `master_ticket` under `link`: once per (link, master ticket), ever.
    pub fn open(link: i64, master_ticket: i64) -> String {
        format!("l{link}-m{master_ticket}-open")
    }

    /// Close copy ticket `copy` entirely: once per copy.
    pub fn close(link: i64, master_ticket: i64, copy: i64) -> String {
        format!("l{link}-m{master_ticket}-c{copy}-close")
    }

    /// Bring copy `copy` down to `target` lots: a copy's volume only falls, so each target is
    /// reached once.
    pub fn trim(link: i64, master_ticket: i64, copy: i64, target: f64) -> String {
        format!("l{link}-m{master_ticket}-c{copy}-trim{target}")
    }

    /// Set copy `copy`'s stops to those of the master's snapshot at (epoch, seq): every change
    /// of the master's stops is a new seq, so stops moved away and back are a new id; the same
    /// snapshot decided again (a retry, a new owner) is the same id.
    pub fn stops(link: i64, master_ticket: i64, copy: i64, at: (i64, i64)) -> String {
        format!("l{link}-m{master_ticket}-c{copy}-stops-e{}s{}", at.0, at.1)
    }

    /// Place the pending copy of master order `master_ticket` under `link`: once, ever.
    pub fn place(link: i64, master_ticket: i64) -> String {
        format!("l{link}-m{master_ticket}-place")
    }

    /// Set pending copy `order`'s price, stops and expiry to those of the master's snapshot at
    /// (epoch, seq) (named like [`stops`]).
    pub fn amend(link: i64, master_ticket: i64, order: i64, at: (i64, i64)) -> String {
        format!("l{link}-m{master_ticket}-p{order}-amend-e{}s{}", at.0, at.1)
    }

    /// Cancel pending copy `order`: once per order.
    pub fn cancel(link: i64, master_ticket: i64, order: i64) -> String {
        format!("l{link}-m{master_ticket}-p{order}-cancel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_round_trip_and_reject_other_comments() {
        assert_eq!(marker(1000042), "mc1000042");
        assert_eq!(parse_marker("mc1000042"), Some(1000042));
        for other in ["", "mc", "mcx1", "hello", "from #5", "MC12"] {
            assert_eq!(parse_marker(other), None, "{other}");
        }
    }

    #[test]
    fn intent_ids_name_one_intent_each() {
        assert_eq!(intent::open(7, 1000042), "l7-m1000042-open");
        // Two copies of one master position: two closes, two ids.
        assert_ne!(intent::close(7, 10, 901), intent::close(7, 10, 902));
        assert_eq!(intent::close(7, 10, 901), "l7-m10-c901-close");
        assert_eq!(intent::trim(7, 10, 901, 0.25), "l7-m10-c901-trim0.25");
        assert_ne!(
            intent::trim(7, 10, 901, 0.25),
            intent::trim(7, 10, 901, 0.2)
        );
        assert_ne!(
            intent::trim(7, 10, 901, 0.25),
            intent::trim(7, 10, 902, 0.25)
        );
        assert_eq!(
            intent::stops(7, 10, 901, (5, 12)),
            "l7-m10-c901-stops-e5s12"
        );
        assert_ne!(
            intent::stops(7, 10, 901, (5, 12)),
            intent::stops(7, 10, 901, (5, 14))
        );
        let all = [
            intent::open(7, 10),
            intent::close(7, 10, 901),
            intent::trim(7, 10, 901, 0.5),
            intent::stops(7, 10, 901, (5, 12)),
            intent::open(71, 0),
            intent::place(7, 10),
            intent::amend(7, 10, 901, (5, 12)),
            intent::cancel(7, 10, 901),
        ];
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
    }

    #[tokio::test(start_paused = true)]
    async fn session_timers_started_together_fire_apart() {
        let period = Duration::from_secs(5);
        let mut firsts = Vec::new();
        for _ in 0..20 {
            let mut timer = spread_interval(period);
            let t0 = Instant::now();
            timer.tick().await;
            let first = t0.elapsed();
            assert!(
                first >= period / 2 && first <= period * 3 / 2,
                "first tick after {first:?}"
            );
            firsts.push(first);
            let t1 = Instant::now();
            timer.tick().await;
            assert_eq!(t1.elapsed(), period, "then one period apart");
        }
        firsts.sort();
        firsts.dedup();
        assert!(firsts.len() >= 15, "first ticks spread: {firsts:?}");
    }
}
