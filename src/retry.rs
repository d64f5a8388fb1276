//! The one way to retry: an exponential [`Backoff`] (first delay, doubling, capped), and the
//! named bounds each retrying place uses, side by side so they can be compared and tuned.

use std::time::Duration;

/// Delays of a retry: `first`, doubling per failure, never above `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    pub(crate) const fn new(first: Duration, max: Duration) -> Self {
        Backoff { first, max }
    }

    /// The delay before retrying after the `failures`-th consecutive failure (1 = the first).
    pub(crate) fn delay(&self, failures: u32) -> Duration {
        self.first
            .saturating_mul(2u32.saturating_pow(failures.saturating_sub(1).min(30)))
            .min(self.max)
    }

    /// A counter of consecutive failures over this backoff.
    pub(crate) fn start(self) -> Retry {
        Retry {
            backoff: self,
            failures: 0,
        }
    }
}

/// Consecutive failures of one retrying loop.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retry {
    backoff: Backoff,
    failures: u32,
}

impl Retry {
    /// Counts a failure; the delay before the next attempt.
    pub(crate) fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.backoff.delay(self.failures)
    }

    /// A success: the next failure starts from the first delay again.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A node waiting for its database at start.
pub(crate) const DATABASE_AT_START: Backoff = Backoff::new(ms(250), ms(5_000));
/// The LISTEN connection.
pub(crate) const LISTEN: Backoff = Backoff::new(ms(200), ms(10_000));
/// A bridge connection to a trade server.
pub(crate) const BROKER_CONNECTION: Backoff = Backoff::new(ms(100), ms(5_000));
/// An account's broker login while the broker is unreachable.
pub(crate) const BROKER_LOGIN: Backoff = Backoff::new(ms(250), ms(30_000));
/// A follower's owed reconcile (an unknown outcome, a refused close, an input not known yet).
pub(crate) const FOLLOWER_RECONCILE: Backoff = Backoff::new(ms(250), ms(30_000));
/// The longest a follower waits before sending again a close the broker refused because the
/// market is closed (the backoff above may have grown to 30 s): the close goes out at most this
/// long after the market opens.
pub(crate) const MARKET_CLOSED: Duration = ms(5_000);
/// A master session reading its published state at start.
pub(crate) const MASTER_PUBLISH: Backoff = Backoff::new(ms(200), ms(5_000));
/// The batched status writes.
pub(crate) const STATUS_WRITE: Backoff = Backoff::new(ms(400), ms(6_400));
/// An account session that failed by itself: restarted, never in a tight loop.
pub(crate) const SESSION_RESTART: Backoff = Backoff::new(ms(1_000), ms(300_000));
/// A release after a session stopped (five attempts; a later cycle retries too).
pub(crate) const RELEASE: Backoff = Backoff::new(ms(100), ms(1_600));
/// The node's departure at shutdown.
pub(crate) const LEAVE: Backoff = Backoff::new(ms(100), ms(2_000));

/// The lease cycle after a failure: a tenth of the cycle period, doubling, at most one period
/// (so a failed cycle is retried at least once a cycle: `/healthz` counts on it).
pub(crate) fn lease_cycle(cycle: Duration) -> Backoff {
    Backoff::new((cycle / 10).max(ms(10)), cycle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_the_first_up_to_the_cap() {
        let b = Backoff::new(ms(250), ms(30_000));
        let delays: Vec<u64> = (1..=9).map(|n| b.delay(n).as_millis() as u64).collect();
        assert_eq!(
            delays,
            vec![250, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]
        );
        assert_eq!(b.delay(u32::MAX), ms(30_000), "no overflow");
        let mut r = b.start();
        assert_eq!((r.failed(), r.failed()), (ms(250), ms(500)));
        r.reset();
        assert_eq!(r.failed(), ms(250));
        assert_eq!(lease_cycle(ms(500)).delay(1), ms(50));
        assert_eq!(lease_cycle(ms(500)).delay(10), ms(500));
    }
}
