//! One task per owned (account, epoch): the place an account's broker session lives.
//!
//! The supervisor starts the task when the account is claimed and stops it (gate closed first,
//! then cancellation, then it waits for the task to return) when the account is lost, released,
//! disabled or re-claimed with a new epoch. Everything a task does for its account goes through
//! its [`AccountContext`]: the gate before every order, the epoch as the fence, fenced writes,
//! and the signal that trust lapsed and came back (reconcile before acting).
//!
//! The task reads its row, logs in to its broker with the epoch as the fence, and runs the
//! master or follower session of the copy engine.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::broker::{AccountLogin, BrokerError, Session};
use crate::brokers::BrokerConnector;
use crate::config::Secret;
use crate::copier;
use crate::credentials::{self, CredentialsKey};
use crate::db;
use crate::db::copy::{AccountRow, Role};
use crate::hub::Hub;
use crate::lease::gate::AccountGate;
use crate::metrics::Metrics;
use crate::status_writer::{Lost, StatusWriter};

/// What every account task of a node shares.
#[derive(Debug)]
pub struct NodeServices {
    pub node_id: String,
    pub pool: PgPool,
    pub hub: Hub,
    pub brokers: Arc<dyn BrokerConnector>,
    /// Report an account found lost by a fenced write (the supervisor stops its task).
    pub lost: mpsc::UnboundedSender<Lost>,
    pub metrics: Arc<Metrics>,
    /// Decrypts the accounts' broker credentials (`None`: the node has no key).
    pub credentials_key: Option<CredentialsKey>,
    /// Period of each follower's background reconcile.
    pub reconcile_every: std::time::Duration,
}

/// Everything an account task may use.
#[derive(Debug, Clone)]
pub struct AccountContext {
    pub account_id: i64,
    /// HoldsLease for this (account, epoch); check it right before anything reaches a broker.
    pub gate: Arc<AccountGate>,
    /// Fires when the supervisor stops this task; return promptly after the work in flight.
    pub cancel: CancellationToken,
    pub status: StatusWriter,
    pub node: Arc<NodeServices>,
}

impl AccountContext {
    /// The ownership generation: the fence for broker logins and orders, the epoch of writes.
    pub fn epoch(&self) -> i64 {
        self.gate.epoch()
    }

    pub fn set_status(&self, status: impl Into<String>) {
        self.status.status(self.account_id, self.epoch(), status);
    }

    /// A fenced write matched nothing: tell the supervisor (which closes the gate and stops this
    /// task), then wait to be stopped.
    pub async fn lost(&self) {
        let _ = self.node.lost.send(Lost {
            account_id: self.account_id,
            epoch: self.epoch(),
        });
        self.cancel.cancelled().await;
    }

    /// Logs the account in to its broker with the epoch as the fence, retrying while the broker
    /// is unreachable. `None` if the task was stopped meanwhile; an error if the broker refused
    /// the login (bad credentials, a newer owner's fence).
    pub async fn login(&self, row: &AccountRow) -> anyhow::Result<Option<Session>> {
        // Decrypted here, in the session that logs in, and nowhere else.
        let password = row
            .credentials
            .as_ref()
            .map(|stored| credentials::decrypt(self.node.credentials_key.as_ref(), stored))
            .transpose()
            .with_context(|| format!("account {} cannot log in to {}", row.id, row.server))?;
        let client = self.node.brokers.broker(&row.server);
        let account = AccountLogin {
            login: row.login.clone(),
            password,
            fence: Some(self.epoch()),
        };
        let mut delay = Duration::from_millis(250);
        loop {
            let attempt = tokio::select! {
                _ = self.cancel.cancelled() => return Ok(None),
                r = client.login(&account) => r,
            };
            match attempt {
                Ok(session) => return Ok(Some(session)),
                Err(BrokerError::Rejected(reason)) => bail!(
                    "the broker at {} refused the login of {}: {reason}",
                    row.server,
                    row.login
                ),
                Err(e) => {
                    warn!(server = %row.server, error = %e, retry_in_ms = delay.as_millis() as u64, "broker login failed; retrying");
                    self.set_status(format!("broker unreachable ({}); retrying", row.server));
                    tokio::select! {
                        _ = self.cancel.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(30));
                }
            }
        }
    }
}

/// Why a session returned.
#[derive(Debug)]
pub enum Ended {
    /// The task was stopped.
    Stopped,
    /// The row's server, login, role or credentials changed: the session logged out and must
    /// start again from this row.
    RowChanged(Box<AccountRow>),
}

impl AccountContext {
    /// Re-reads the row after an announced change; `Some(new row)` when what the session logged
    /// in with changed (server, login, role, or the decrypted credentials: a key rotation that
    /// re-encrypts the same password changes nothing).
    pub async fn changed_row(&self, current: &AccountRow) -> Option<AccountRow> {
        let read = async {
            let mut conn = self.node.pool.acquire().await?;
            db::copy::load_account(&mut conn, self.account_id).await
        }
        .await;
        let new = match read {
            Ok(Some(new)) => new,
            Ok(None) => return None, // deleted: the lease cycle stops the task
            Err(e) => {
                warn!(error = %db::describe(&e), "re-reading the account row after a change failed; the session goes on");
                return None;
            }
        };
        let key = self.node.credentials_key.as_ref();
        let password = |c: &Option<Secret>| {
            c.as_ref()
                .map(|s| credentials::decrypt(key, s).map(|p| p.expose().to_string()))
        };
        let same_credentials = match (password(&current.credentials), password(&new.credentials)) {
            (Some(Ok(a)), Some(Ok(b))) => a == b,
            _ => {
                current.credentials.as_ref().map(Secret::expose)
                    == new.credentials.as_ref().map(Secret::expose)
            }
        };
        let same = current.server == new.server
            && current.login == new.login
            && current.role == new.role
            && same_credentials;
        (!same).then_some(new)
    }
}

/// The task body: read the row, then run the session for its role; start again from the new row
/// when the row's connection (server, login, role, credentials) changes.
pub async fn run(ctx: AccountContext) -> anyhow::Result<()> {
    let row = {
        let mut conn = ctx
            .node
            .pool
            .acquire()
            .await
            .context("reading the account row")?;
        db::copy::load_account(&mut conn, ctx.account_id)
            .await
            .context("reading the account row")?
    };
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
