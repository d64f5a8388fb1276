//! What an account task acts through: the [`AccountContext`] (the gate before every order, the
//! epoch as the fence, fenced writes, the broker login, re-reading a changed row) and the
//! [`NodeServices`] every task of a node shares. The copy engine's sessions depend on this, not
//! on the task that runs them ([`crate::account`]).

pub(crate) mod handoffs;

use std::sync::Arc;

use anyhow::{Context, bail};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::broker::types::{
    AccountInfo, AmendOrder, CancelOrder, CloseFill, CloseOrder, ClosedPosition, ModifyOrder,
    OpenFill, OpenOrder, PendingOrder, PlaceOrder, Position, SymbolSpec,
};
use crate::broker::{AccountLogin, BoxFuture, BrokerError, Session, TradeApi};
use crate::brokers::BrokerConnector;
use crate::credentials::{self, CredentialsKey};
use crate::db::copy::AccountRow;
use crate::gate::AccountGate;
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::secret::Secret;
use crate::status_writer::{Lost, StatusWriter};
pub(crate) use handoffs::Handoffs;

/// What every account task of a node shares.
#[derive(Debug)]
pub struct NodeServices {
    pub node_id: String,
    pub db: crate::db::Db,
    pub hub: Hub,
    pub brokers: Arc<dyn BrokerConnector>,
    /// Report an account found lost by a fenced write (the supervisor stops its task).
    pub lost: mpsc::UnboundedSender<Lost>,
    pub metrics: Arc<Metrics>,
    /// Decrypts the accounts' broker credentials (`None`: the node has no key).
    pub credentials_key: Option<CredentialsKey>,
    /// Period of each follower's background reconcile.
    pub reconcile_every: std::time::Duration,
    /// The node's orders on their way to a broker (the copy ledger's writer gives way to them).
    pub orders: Arc<crate::db::batch::Orders>,
    /// Writes the copy ledger's rows in batches, after the orders in flight.
    pub copy_ledger: crate::db::copy::ledger::CopyLedgerWriter,
    /// Publishes the masters' events in batches.
    pub master_publisher: crate::db::copy::MasterPublisher,
    /// Reads the followers' links in batches, in background turns.
    pub links: crate::db::copy::LinksReader,
    /// Reads what the followers' reconciles need of the database in batches, in background
    /// turns: the masters' snapshots and the followers' bases and decisions...
    pub reconciles: crate::db::copy::ReconcileReader,
    /// ... and what they ever copied.
    pub ledger_reads: crate::db::copy::LedgerReader,
    /// Reads the masters' published states for the followers taking a new snapshot, in batches,
    /// in background turns (each master once per batch).
    pub master_states: crate::db::copy::MasterStateReader,
    /// Releases the node's accounts in batches (live work on the pool).
    pub releaser: crate::db::lease::Releaser,
    /// Announces again the accounts released to a receiver that has not claimed them
    /// ([`crate::db::lease::announce_unclaimed`]), in batches.
    pub unclaimed: crate::db::lease::UnclaimedAnnouncer,
    /// Sends the node's hand-off offers and answers in batches (live work on the pool).
    pub handoff_notices: crate::db::lease::HandoffAnnouncer,
    /// Reads the account rows of sessions starting (and of accounts offered to this node) in
    /// batches, in background turns.
    pub accounts: crate::db::copy::AccountReader,
    /// Prepared hand-offs: this node's offers and the logins prepared for it.
    pub handoffs: Handoffs,
    /// Sessions still starting (claimed, not yet through login and first reconcile): the lease
    /// loop claims no more than it can start.
    pub starting: Arc<Starting>,
}

impl NodeServices {
    /// Account `id`'s row, read by the node's [`crate::db::copy::AccountReader`] (with the rows
    /// other sessions read at the same time): `None` when the row is gone; the error says why it
    /// could not be read (the database, or a role no session runs).
    pub async fn read_account(&self, id: i64) -> Result<Option<AccountRow>, String> {
        self.accounts
            .write(crate::db::copy::AccountRead(id))
            .await
            .and_then(|read| read)
    }
}

/// How many of the node's sessions are still starting: the gauge `copier_sessions_starting`
/// itself is the count.
#[derive(Debug)]
pub struct Starting {
    gauge: prometheus::IntGauge,
    /// Woken whenever a start-up ends ([`Starting::at_most`]).
    through: tokio::sync::Notify,
}

impl Starting {
    pub fn new(gauge: prometheus::IntGauge) -> Arc<Starting> {
        Arc::new(Starting {
            gauge,
            through: tokio::sync::Notify::new(),
        })
    }

    /// Sessions still starting.
    pub fn count(&self) -> usize {
        self.gauge.get().max(0) as usize
    }

    /// Returns once no more than `n` sessions are still starting (at once if so already): the
    /// lease loop waits here to claim again when its claims wait for the node's own start-ups
    /// (admission), instead of polling with cycles that renew every row it holds.
    pub async fn at_most(&self, n: usize) {
        loop {
            let through = self.through.notified();
            tokio::pin!(through);
            // Registered before the count is read: a start-up ending in between still wakes.
            through.as_mut().enable();
            if self.count() <= n {
                return;
            }
            through.await;
        }
    }

    /// A session begins its start-up; it ends when the session says so or the task ends.
    pub fn begin(self: &Arc<Self>) -> Arc<StartUp> {
        self.gauge.inc();
        Arc::new(StartUp {
            done: std::sync::atomic::AtomicBool::new(false),
            of: self.clone(),
        })
    }
}

/// One session's start-up, counted in [`Starting`] until [`StartUp::done`] or its drop.
#[derive(Debug)]
pub struct StartUp {
    done: std::sync::atomic::AtomicBool,
    of: Arc<Starting>,
}

impl StartUp {
    /// The session is through its start-up (idempotent).
    pub fn done(&self) {
        if !self.done.swap(true, std::sync::atomic::Ordering::Relaxed) {
            self.of.gauge.dec();
            self.of.through.notify_waiters();
        }
    }
}

impl Drop for StartUp {
    fn drop(&mut self) {
        self.done();
    }
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
    /// This task's start-up, counted until [`AccountContext::started`] or the task's end.
    pub startup: Arc<StartUp>,
}

impl AccountContext {
    /// The ownership generation: the fence for broker logins and orders, the epoch of writes.
    pub fn epoch(&self) -> i64 {
        self.gate.epoch()
    }

    /// The session is through its start-up (logged in, first reconcile or publication done):
    /// it no longer counts against the node's claims.
    pub fn started(&self) {
        self.startup.done();
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
        crate::failpoints::failpoint!(
            "COPIERTEST_HOLD_START",
            "account session held before its login (still starting)"
        );
        // Decrypted here, in the session that logs in, and nowhere else.
        let password = row
            .credentials
            .as_ref()
            .map(|stored| credentials::decrypt(self.node.credentials_key.as_ref(), stored))
            .transpose()
            .with_context(|| format!("account {} cannot log in to {}", row.id, row.server))?;
        if let Some(ready) = self
            .node
            .handoffs
            .take(self.account_id, &row.server, &row.login)
        {
            // A login prepared for this hand-off (under way or done): raise its fence to this
            // epoch. The claim has committed, so the old owner's release has too.
            let prepared = tokio::select! {
                _ = self.cancel.cancelled() => return Ok(None),
                p = ready => p.ok().flatten(),
            };
            if let Some(prepared) = prepared {
                match prepared.raise(self.epoch()).await {
                    Ok(session) => {
                        self.node
                            .metrics
                            .handoff_logins
                            .with_label_values(&["raised"])
                            .inc();
                        if session.ahead.is_some() {
                            self.node
                                .metrics
                                .handoff_logins
                                .with_label_values(&["current"])
                                .inc();
                        }
                        info!(server = %row.server, login = %row.login, read_ahead = session.ahead.is_some(), "logged in ahead of the claim (prepared hand-off): fence raised to this epoch");
                        return Ok(Some(counted(session, &self.node.metrics)));
                    }
                    Err(e) => {
                        self.node
                            .metrics
                            .handoff_logins
                            .with_label_values(&["failed"])
                            .inc();
                        warn!(server = %row.server, login = %row.login, error = %e, "raising the prepared login's fence failed; logging in as usual");
                    }
                }
            }
        }
        let client = self.node.brokers.broker(&row.server);
        let account = AccountLogin {
            login: row.login.clone(),
            password,
            fence: Some(self.epoch()),
            account_id: Some(self.account_id),
        };
        let mut retry = crate::retry::BROKER_LOGIN.start();
        loop {
            let attempt = tokio::select! {
                _ = self.cancel.cancelled() => return Ok(None),
                r = client.login(&account) => r,
            };
            match attempt {
                Ok(session) => return Ok(Some(counted(session, &self.node.metrics))),
                Err(BrokerError::Rejected(reason)) => bail!(
                    "the broker at {} refused the login of {}: {reason}",
                    row.server,
                    row.login
                ),
                Err(e) => {
                    // Waiting for an unreachable broker is not starting: it must not hold back
                    // the node's claims of accounts on other servers (admission).
                    self.started();
                    let delay = retry.failed();
                    warn!(server = %row.server, error = %e, retry_in_ms = delay.as_millis() as u64, "broker login failed; retrying");
                    self.set_status(format!("broker unreachable ({}); retrying", row.server));
                    tokio::select! {
                        _ = self.cancel.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}

impl AccountContext {
    /// Ends a session at its broker before the task goes on (to its release, or to a login from
    /// a changed row): see [`TradeApi::logout`].
    pub async fn logout(&self, session: &Session) {
        session.api.logout().await;
    }
}

/// The session with its api counted in `copier_broker_sessions` for as long as it lives (the
/// last clone of the api dropped is the logout).
fn counted(session: Session, metrics: &Arc<Metrics>) -> Session {
    metrics.broker_sessions.inc();
    Session {
        api: Arc::new(Counted {
            inner: session.api,
            metrics: metrics.clone(),
        }),
        ..session
    }
}

struct Counted {
    inner: Arc<dyn TradeApi>,
    metrics: Arc<Metrics>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.metrics.broker_sessions.dec();
    }
}

impl TradeApi for Counted {
    fn positions(&self) -> BoxFuture<'_, Result<Vec<Position>, BrokerError>> {
        self.inner.positions()
    }
    fn history(&self) -> BoxFuture<'_, Result<Vec<ClosedPosition>, BrokerError>> {
        self.inner.history()
    }
    fn account(&self) -> BoxFuture<'_, Result<AccountInfo, BrokerError>> {
        self.inner.account()
    }
    fn symbols(&self) -> BoxFuture<'_, Result<Vec<SymbolSpec>, BrokerError>> {
        self.inner.symbols()
    }
    fn open(&self, order: OpenOrder) -> BoxFuture<'_, Result<OpenFill, BrokerError>> {
        self.inner.open(order)
    }
    fn close(&self, order: CloseOrder) -> BoxFuture<'_, Result<CloseFill, BrokerError>> {
        self.inner.close(order)
    }
    fn modify(&self, order: ModifyOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.modify(order)
    }
    fn places_orders(&self) -> bool {
        self.inner.places_orders()
    }
    fn orders(&self) -> BoxFuture<'_, Result<Vec<PendingOrder>, BrokerError>> {
        self.inner.orders()
    }
    fn place(&self, order: PlaceOrder) -> BoxFuture<'_, Result<i64, BrokerError>> {
        self.inner.place(order)
    }
    fn amend(&self, order: AmendOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.amend(order)
    }
    fn cancel(&self, order: CancelOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.cancel(order)
    }
    fn logout(&self) -> BoxFuture<'_, ()> {
        self.inner.logout()
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
        let read = self.node.read_account(self.account_id).await;
        let new = match read {
            Ok(Some(new)) => new,
            Ok(None) => return None, // deleted: the lease cycle stops the task
            Err(e) => {
                warn!(error = %e, "re-reading the account row after a change failed; the session goes on");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_up_counts_until_done_or_dropped_and_only_once() {
        let starting = Starting::new(prometheus::IntGauge::new("s", "s").unwrap());
        let a = starting.begin();
        let b = starting.begin();
        assert_eq!(starting.count(), 2);
        a.done();
        a.done();
        assert_eq!(starting.count(), 1, "done twice counts once");
        drop(a);
        assert_eq!(
            starting.count(),
            1,
            "dropping a finished start-up changes nothing"
        );
        drop(b);
        assert_eq!(
            starting.count(),
            0,
            "a task that ended unstarted no longer counts"
        );
        assert_eq!(starting.gauge.get(), 0);
    }

    #[tokio::test]
    async fn waiting_for_start_ups_returns_once_few_enough_are_left() {
        let starting = Starting::new(prometheus::IntGauge::new("s", "s").unwrap());
        let ups: Vec<_> = (0..3).map(|_| starting.begin()).collect();
        let wait = starting.at_most(1);
        tokio::pin!(wait);
        assert!(
            futures_now(wait.as_mut()).is_none(),
            "three starting is more than one"
        );
        ups[0].done();
        assert!(
            futures_now(wait.as_mut()).is_none(),
            "two starting is still more than one"
        );
        drop(ups);
        assert!(
            futures_now(wait.as_mut()).is_some(),
            "none left: the wait is over"
        );
        assert!(
            futures_now(std::pin::pin!(starting.at_most(0))).is_some(),
            "already few enough: returns at once"
        );
    }

    /// Polls `f` once: its output if it is ready.
    fn futures_now<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let waker = std::task::Waker::noop();
        match f.poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }
}
