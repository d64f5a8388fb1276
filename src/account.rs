//! One task per owned (account, epoch): the place an account's broker session lives.
//!
//! The supervisor starts the task when the account is claimed and stops it (gate closed first,
//! then cancellation, then it waits for the task to return) when the account is lost, released,
//! disabled or re-claimed with a new epoch. Everything a task does for its account goes through
//! its [`AccountContext`] ([`crate::session`]): the gate before every order, the epoch as the
//! fence, fenced writes, and the signal that trust lapsed and came back (reconcile before acting).
//!
//! The task reads its row, logs in to its broker with the epoch as the fence, and runs the
//! master or follower session of the copy engine.

use anyhow::bail;
use tracing::info;

use crate::copier;
use crate::db::copy::Role;
pub(crate) use crate::session::{AccountContext, Ended, NodeServices};

/// The task body: read the row (`asked`: asked for already, with the rows of the sessions
/// starting beside it), then run the session for its role; start again from the new row when the
/// row's connection (server, login, role, credentials) changes.
pub(crate) async fn run(
    ctx: AccountContext,
    asked: Option<crate::db::copy::AccountRowAsked>,
) -> anyhow::Result<()> {
    let read = async {
        match asked {
            Some(asked) => asked.outcome().await.and_then(|read| read),
            None => ctx.node.read_account(ctx.account_id).await,
        }
    };
    // Stopped meanwhile (a shutdown, a lost lease), the task does not wait for the read: on a
    // database that stopped answering it may never come.
    let row = tokio::select! {
        read = read => read,
        () = ctx.cancel.cancelled() => {
            info!("account session stopped before its row was read");
            return Ok(());
        }
    }
    .map_err(|e| anyhow::anyhow!("reading the account row: {e}"))?;
    let Some(mut row) = row else {
        bail!("account {} no longer exists", ctx.account_id);
    };
    loop {
        info!(role = %row.role, server = %row.server, login = %row.login, "account session starting");
        let ended = match row.role {
            Role::Master => copier::master::run(&ctx, &row).await?,
            Role::Follower => copier::follower::run(&ctx, &row).await?,
        };
        match ended {
            Ended::Stopped => {
                info!("account session stopped");
                return Ok(());
            }
            Ended::RowChanged(new) => {
                info!(
                    old_server = %row.server, old_login = %row.login, old_role = %row.role,
                    server = %new.server, login = %new.login, role = %new.role,
                    "account row changed: logged out; starting again from the new row (copies held on the old login are left as they are)"
                );
                row = *new;
            }
        }
    }
}
