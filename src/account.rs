//! One task per owned (account, epoch): the place an account's broker session lives.
//!
//! The supervisor starts the task when the account is claimed and stops it (gate closed first,
//! then cancellation, then it waits for the task to return) when the account is lost, released,
//! disabled or re-claimed with a new epoch. Everything a task does for its account goes through
//! its [`AccountContext`]: the gate before every order, the epoch as the fence, the fenced status
//! writer, and the signal that trust lapsed and came back (reconcile before acting).
//!
//! The lease core holds accounts without a broker session: the task reports its status and
//! waits. The copy engine (master and follower sessions) runs its session here.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::lease::gate::AccountGate;
use crate::status_writer::StatusWriter;

/// Everything an account task may use.
#[derive(Debug, Clone)]
pub struct AccountContext {
    pub account_id: i64,
    /// HoldsLease for this (account, epoch); check it right before anything reaches a broker.
    pub gate: Arc<AccountGate>,
    /// Fires when the supervisor stops this task; return promptly after the work in flight.
    pub cancel: CancellationToken,
    pub status: StatusWriter,
}

impl AccountContext {
    /// The ownership generation: the fence for broker logins and orders, the epoch of writes.
    pub fn epoch(&self) -> i64 {
        self.gate.epoch()
    }
}

/// The task body for an owned account in the lease core.
pub async fn run(ctx: AccountContext) -> anyhow::Result<()> {
    info!("account session started");
    ctx.status.status(ctx.account_id, ctx.epoch(), "active");
    loop {
        tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            _ = ctx.gate.restored() => {
                // Orders refused while the gate was closed are not queued: a session reconciles
                // here before it acts again (the copy engine's reconcile runs at this point).
                info!(restorations = ctx.gate.restorations(), "lease trust restored after a lapse; reconcile due before acting");
                ctx.status.status(ctx.account_id, ctx.epoch(), "active (trust restored after a lapse)");
            }
        }
    }
    info!("account session stopped");
    Ok(())
}
