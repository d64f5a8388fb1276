//! The HoldsLease gate: one per (account, epoch), checked right before every order.
//!
//! A gate belongs to one ownership generation of one account. The supervisor creates it when
//! the account is claimed, extends its deadline after every cycle that renewed that same epoch,
//! and closes it for good when the account is lost, released, re-claimed with a new epoch, or
//! when a fenced write finds it lost. A task holding an older epoch holds an older gate, which
//! stays closed: the gate is per (account, epoch) by construction.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::trust::{MonoBase, holds};

/// The gate of one (account, epoch).
#[derive(Debug)]
pub struct AccountGate {
    account_id: i64,
    epoch: i64,
    base: MonoBase,
    /// Trust deadline as nanoseconds since `base`; 0 once closed for good.
    deadline: AtomicU64,
    /// Set by the lease loop when it saw the deadline pass; cleared when trust is restored.
    lapsed: AtomicBool,
    /// How many times trust lapsed and came back (the task must reconcile after each).
    restorations: AtomicU64,
    restored: Notify,
}

impl AccountGate {
    /// A gate trusted until `deadline`.
    pub fn new(account_id: i64, epoch: i64, base: MonoBase, deadline: Instant) -> Self {
        AccountGate {
            account_id,
            epoch,
            base,
            deadline: AtomicU64::new(base.encode(deadline).max(1)),
            lapsed: AtomicBool::new(false),
            restorations: AtomicU64::new(0),
            restored: Notify::new(),
        }
    }

    pub fn account_id(&self) -> i64 {
        self.account_id
    }

    /// The ownership generation this gate belongs to: the fence sent with every order.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// HoldsLease: may this (account, epoch) act right now? Two atomic loads and a clock read.
    pub fn holds(&self) -> bool {
        self.holds_at(Instant::now())
    }

    /// HoldsLease at a given instant (for tests and the simulation).
    pub fn holds_at(&self, now: Instant) -> bool {
        match self.deadline.load(Ordering::Acquire) {
            0 => false,
            nanos => holds(now, self.base.decode(nanos)),
        }
    }

    /// The current trust deadline, or `None` once closed for good.
    pub fn deadline(&self) -> Option<Instant> {
        match self.deadline.load(Ordering::Acquire) {
            0 => None,
            nanos => Some(self.base.decode(nanos)),
        }
    }

    /// Closes the gate for good (lost, released, superseded by a new epoch, shutting down).
    pub fn close(&self) {
        self.deadline.store(0, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.deadline.load(Ordering::Acquire) == 0
    }

    /// Applies a confirmed renewal of this epoch: `acknowledged` is when COMMIT was acknowledged,
    /// `deadline` is `t0 + lease - fence`. Returns true if trust had lapsed and is now restored.
    /// Never reopens a gate closed for good, and never moves the deadline backwards.
    pub fn renew(&self, acknowledged: Instant, deadline: Instant) -> bool {
        let current = self.deadline.load(Ordering::Acquire);
        if current == 0 {
            return false;
        }
        if !holds(acknowledged, self.base.decode(current)) {
            self.lapsed.store(true, Ordering::Release);
        }
        let new = self.base.encode(deadline).max(1);
        if new > current {
            // Only the lease loop writes deadlines; a concurrent close wins the exchange.
            let _ =
                self.deadline
                    .compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire);
        }
        if holds(acknowledged, deadline) && self.lapsed.swap(false, Ordering::AcqRel) {
            self.restorations.fetch_add(1, Ordering::AcqRel);
            self.restored.notify_one();
            return true;
        }
        false
    }

    /// How many times trust lapsed and was restored for this epoch.
    pub fn restorations(&self) -> u64 {
        self.restorations.load(Ordering::Acquire)
    }

    /// Resolves the next time trust is restored after a lapse (a permit is kept if nobody waits).
    pub async fn restored(&self) {
        self.restored.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn gate(deadline_in: Duration) -> (AccountGate, Instant) {
        let now = Instant::now();
        (
            AccountGate::new(7, 42, MonoBase::new(), now + deadline_in),
            now,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn holds_until_the_deadline_then_not() {
        let (g, now) = gate(Duration::from_secs(2));
        assert!(g.holds_at(now));
        assert!(g.holds_at(now + Duration::from_millis(1999)));
        assert!(!g.holds_at(now + Duration::from_secs(2)));
        assert_eq!(g.epoch(), 42);
        assert_eq!(g.account_id(), 7);
    }

    #[tokio::test(start_paused = true)]
    async fn closed_gates_never_reopen() {
        let (g, now) = gate(Duration::from_secs(2));
        g.close();
        assert!(!g.holds_at(now));
        assert!(!g.renew(now, now + Duration::from_secs(10)));
        assert!(!g.holds_at(now + Duration::from_secs(1)));
        assert!(g.deadline().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_in_time_extends_without_a_restoration() {
        let (g, now) = gate(Duration::from_secs(2));
        assert!(!g.renew(now + Duration::from_secs(1), now + Duration::from_secs(3)));
        assert!(g.holds_at(now + Duration::from_millis(2500)));
        assert_eq!(g.restorations(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_after_a_lapse_counts_a_restoration_and_wakes_the_task() {
        let (g, now) = gate(Duration::from_secs(2));
        assert!(g.renew(now + Duration::from_secs(3), now + Duration::from_secs(5)));
        assert_eq!(g.restorations(), 1);
        // The permit is kept for a task that was not waiting yet.
        tokio::time::timeout(Duration::from_millis(1), g.restored())
            .await
            .expect("restoration must be signalled");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_renewal_that_is_already_stale_restores_nothing_yet() {
        let (g, now) = gate(Duration::from_secs(2));
        // Acknowledged at 6 s for a renewal sent at 1 s (deadline 3 s): still lapsed.
        assert!(!g.renew(now + Duration::from_secs(6), now + Duration::from_secs(3)));
        assert!(!g.holds_at(now + Duration::from_secs(6)));
        // The next good renewal restores and signals once.
        assert!(g.renew(now + Duration::from_secs(7), now + Duration::from_secs(9)));
        assert_eq!(g.restorations(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_never_move_backwards() {
        let (g, now) = gate(Duration::from_secs(5));
        g.renew(now, now + Duration::from_secs(3));
        assert!(g.holds_at(now + Duration::from_secs(4)));
    }
}
