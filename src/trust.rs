//! The trust computation, pure over instants passed in (guarantee S1, docs/guarantees.md).
//!
//! A node trusts a lease until `t0 + lease - fence`, where `t0` is a monotonic instant read
//! *before* the cycle's statement was sent. The database computes `lease_until = now() + lease`
//! at some moment after `t0`, so the node stops trusting at least `fence` before any peer can
//! see the row expired, however long the statement took. Only elapsed time on the node's own
//! monotonic clock enters: no comparison with the database's or another node's clock, and a
//! stepped wall clock changes nothing.

use std::time::Duration;
use tokio::time::Instant;

/// The instant until which a renewal sent at `t0` may be trusted.
pub(crate) fn deadline(t0: Instant, lease: Duration, fence: Duration) -> Instant {
    t0 + lease.saturating_sub(fence)
}

/// Whether a deadline still holds at `now`. The deadline itself is already untrusted.
pub(crate) fn holds(now: Instant, deadline: Instant) -> bool {
    now < deadline
}

/// Instants as nanoseconds since a fixed base, so a deadline fits in an `AtomicU64` that hundreds
/// of account tasks read before every order without a lock.
#[derive(Debug, Clone, Copy)]
pub struct MonoBase(Instant);

impl MonoBase {
    /// A base slightly in the past, so that no instant of this process maps to 0 (0 = closed).
    pub fn new() -> Self {
        let now = Instant::now();
        MonoBase(now.checked_sub(Duration::from_secs(1)).unwrap_or(now))
    }

    pub fn encode(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.0)
            .as_nanos()
            .min(u64::MAX as u128) as u64
    }

    pub fn decode(&self, nanos: u64) -> Instant {
        self.0 + Duration::from_nanos(nanos)
    }
}

impl Default for MonoBase {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(60);
    const FENCE: Duration = Duration::from_secs(15);

    #[tokio::test(start_paused = true)]
    async fn trust_ends_lease_minus_fence_after_t0_however_slow_the_renewal() {
        let t0 = Instant::now();
        // The statement took 40 s to come back: trust still ends at t0 + 45 s, not ack + 45 s.
        tokio::time::advance(Duration::from_secs(40)).await;
        let acknowledged = Instant::now();
        let d = deadline(t0, LEASE, FENCE);
        assert_eq!(d, t0 + Duration::from_secs(45));
        assert!(d < acknowledged + (LEASE - FENCE));
        assert!(holds(acknowledged, d));
        assert!(holds(t0 + Duration::from_millis(44_999), d));
        assert!(
            !holds(t0 + Duration::from_secs(45), d),
            "the deadline itself is untrusted"
        );
        assert!(!holds(t0 + Duration::from_secs(46), d));
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_slower_than_the_window_gives_no_trust() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(50)).await;
        assert!(!holds(Instant::now(), deadline(t0, LEASE, FENCE)));
    }

    #[tokio::test(start_paused = true)]
    async fn encoding_round_trips_and_never_yields_zero() {
        let base = MonoBase::new();
        let now = Instant::now();
        assert!(base.encode(now) > 0);
        let later = now + Duration::from_millis(1234);
        assert_eq!(base.decode(base.encode(later)), later);
    }
}
