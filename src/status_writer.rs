//! The batched, fenced status writer. Account tasks hand it their latest status, balance and
//! equity; it coalesces per (account, epoch) and writes each batch in one fenced statement. A
//! row that no longer matches (node, epoch) is reported to the supervisor as lost, which closes
//! that account's gate and stops its task. A row another statement holds (the lease cycle
//! renewing it) is passed over, not waited for, and stays queued for the next batch. A report of the balance, equity and currency already
//! written at the account's epoch, with no status, writes nothing ([`Written`]).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::db;
pub(crate) use crate::db::status::StatusUpdate;
use crate::model::trade::Currency;

/// How long updates are gathered before a batch is written: status is for operators and
/// dashboards, so a fifth of a second of delay buys one statement for many accounts.
const BATCH_WINDOW: Duration = Duration::from_millis(200);

/// Largest batch per statement.
const MAX_BATCH: usize = 1000;

/// A handle account tasks use to report their status.
#[derive(Debug, Clone)]
pub struct StatusWriter {
    tx: mpsc::UnboundedSender<StatusUpdate>,
}

impl StatusWriter {
    /// Queues a status text for (account, epoch).
    pub fn status(&self, account_id: i64, epoch: i64, status: impl Into<String>) {
        self.send(StatusUpdate {
            account_id,
            epoch,
            status: Some(status.into()),
            balance: None,
            equity: None,
            currency: None,
        });
    }

    /// Queues any update; `None` fields keep what is stored.
    pub fn send(&self, update: StatusUpdate) {
        // The writer outlives every account task; a send after shutdown has nothing to write to.
        let _ = self.tx.send(update);
    }
}

/// A row the writer found no longer owned by (this node, epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    pub account_id: i64,
    pub epoch: i64,
}

/// Starts the writer. It runs until `cancel` fires and the queue is drained (one last attempt).
pub(crate) fn spawn(
    pool: db::Db,
    node_id: String,
    lost: mpsc::UnboundedSender<Lost>,
    cancel: CancellationToken,
) -> (StatusWriter, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = tokio::spawn(run(pool, node_id, rx, lost, cancel));
    (StatusWriter { tx }, handle)
}

async fn run(
    pool: db::Db,
    node_id: String,
    mut rx: mpsc::UnboundedReceiver<StatusUpdate>,
    lost: mpsc::UnboundedSender<Lost>,
    cancel: CancellationToken,
) {
    let mut pending: HashMap<(i64, i64), StatusUpdate> = HashMap::new();
    let mut written = Written::default();
    let mut failures = 0u32;
    loop {
        while pending.is_empty() {
            tokio::select! {
                update = rx.recv() => match update {
                    Some(u) => offer(&mut pending, &written, u),
                    None => return,
                },
                _ = cancel.cancelled() => return,
            }
        }
        let window = tokio::time::sleep(BATCH_WINDOW);
        tokio::pin!(window);
        while pending.len() < MAX_BATCH {
            tokio::select! {
                update = rx.recv() => match update {
                    Some(u) => offer(&mut pending, &written, u),
                    None => break,
                },
                _ = &mut window => break,
                _ = cancel.cancelled() => break,
            }
        }
        let batch: Vec<StatusUpdate> = pending.values().take(MAX_BATCH).cloned().collect();
        match write(&pool, &node_id, &batch).await {
            Ok(outcome) => {
                failures = 0;
                let busy_only = outcome.written.is_empty() && !outcome.busy.is_empty();
                for l in settle(&mut pending, &mut written, &batch, &outcome) {
                    info!(
                        account_id = l.account_id,
                        epoch = l.epoch,
                        "status write found the account no longer ours: lost"
                    );
                    let _ = lost.send(l);
                }
                if cancel.is_cancelled() {
                    // One last attempt: rows still held by another statement are left.
                    for pair in &outcome.busy {
                        pending.remove(pair);
                    }
                } else if busy_only {
                    // Every row of the batch is held (a lease cycle renewing them): give it
                    // a window rather than asking again at once.
                    tokio::select! {
                        _ = tokio::time::sleep(BATCH_WINDOW) => {}
                        _ = cancel.cancelled() => {}
                    }
                }
            }
            Err(e) => {
                failures += 1;
                let backoff = crate::retry::STATUS_WRITE.delay(failures);
                warn!(accounts = batch.len(), error = %db::describe(&e), retry_in_ms = backoff.as_millis() as u64, "status write failed; keeping the latest values and retrying");
                if cancel.is_cancelled() {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = cancel.cancelled() => {}
                }
            }
        }
        if cancel.is_cancelled() && pending.is_empty() {
            // Drain what is already queued, then stop.
            while let Ok(u) = rx.try_recv() {
                offer(&mut pending, &written, u);
            }
            if pending.is_empty() {
                return;
            }
        }
    }
}

/// Takes a batch's outcome: a written update leaves the queue and its figures are noted; a busy
/// one stays queued for a later batch (its row was held by another statement, not lost); the
/// rest no longer own their rows and are returned as lost.
fn settle(
    pending: &mut HashMap<(i64, i64), StatusUpdate>,
    written: &mut Written,
    batch: &[StatusUpdate],
    outcome: &db::status::Outcome,
) -> Vec<Lost> {
    let busy: HashSet<&(i64, i64)> = outcome.busy.iter().collect();
    let done: HashSet<&(i64, i64)> = outcome.written.iter().collect();
    let mut lost = Vec::new();
    for u in batch {
        let pair = (u.account_id, u.epoch);
        if busy.contains(&pair) {
            continue;
        }
        pending.remove(&pair);
        if done.contains(&pair) {
            written.note(u);
        } else {
            written.0.remove(&u.account_id);
            lost.push(Lost {
                account_id: u.account_id,
                epoch: u.epoch,
            });
        }
    }
    lost
}

/// The balance, equity and currency last written for each account, at its epoch. Every follower
/// and master reports its figures every 30 s whether they moved or not; written each time, the
/// rows of a node's idle accounts were rewritten a few hundred times a second at 100,000 accounts,
/// each batch holding its rows' locks, and the lease cycle renewing those rows waited behind them.
#[derive(Debug, Default)]
struct Written(HashMap<i64, Figures>);

/// An account's epoch, and the balance, equity and currency written at it.
type Figures = (i64, Option<f64>, Option<f64>, Option<Currency>);

impl Written {
    /// `u` would change nothing: it carries no status, and every figure it carries is the one
    /// written at its epoch.
    fn unchanged(&self, u: &StatusUpdate) -> bool {
        u.status.is_none()
            && self
                .0
                .get(&u.account_id)
                .is_some_and(|(epoch, balance, equity, currency)| {
                    *epoch == u.epoch
                        && (u.balance.is_none() || u.balance == *balance)
                        && (u.equity.is_none() || u.equity == *equity)
                        && (u.currency.is_none() || u.currency == *currency)
                })
    }

    /// `u` was written.
    fn note(&mut self, u: &StatusUpdate) {
        let entry = self
            .0
            .entry(u.account_id)
            .or_insert((u.epoch, None, None, None));
        if entry.0 != u.epoch {
            *entry = (u.epoch, None, None, None);
        }
        if u.balance.is_some() {
            entry.1 = u.balance;
        }
        if u.equity.is_some() {
            entry.2 = u.equity;
        }
        if u.currency.is_some() {
            entry.3 = u.currency;
        }
    }
}

/// Queues `u` unless it would change nothing: nothing of its (account, epoch) is queued, and
/// its figures are the ones written.
fn offer(pending: &mut HashMap<(i64, i64), StatusUpdate>, written: &Written, u: StatusUpdate) {
    if pending.contains_key(&(u.account_id, u.epoch)) || !written.unchanged(&u) {
        merge(pending, u);
    }
}

/// Keeps the newest value of each field per (account, epoch).
fn merge(pending: &mut HashMap<(i64, i64), StatusUpdate>, u: StatusUpdate) {
    match pending.get_mut(&(u.account_id, u.epoch)) {
        Some(old) => {
            if u.status.is_some() {
                old.status = u.status;
            }
            if u.balance.is_some() {
                old.balance = u.balance;
            }
            if u.currency.is_some() {
                old.currency = u.currency;
            }
            if u.equity.is_some() {
                old.equity = u.equity;
            }
        }
        None => {
            pending.insert((u.account_id, u.epoch), u);
        }
    }
}

async fn write(
    pool: &db::Db,
    node_id: &str,
    batch: &[StatusUpdate],
) -> Result<db::status::Outcome, sqlx::Error> {
    pool.run(async |c| db::status::write_batch(c, node_id, batch).await)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upd(status: Option<&str>, balance: Option<f64>) -> StatusUpdate {
        StatusUpdate {
            account_id: 1,
            epoch: 2,
            status: status.map(Into::into),
            balance,
            equity: None,
            currency: None,
        }
    }

    #[test]
    fn merging_keeps_the_newest_value_of_each_field() {
        let mut pending = HashMap::new();
        merge(&mut pending, upd(Some("a"), Some(1.0)));
        merge(&mut pending, upd(None, Some(2.0)));
        merge(&mut pending, upd(Some("b"), None));
        let u = &pending[&(1, 2)];
        assert_eq!(u.status.as_deref(), Some("b"));
        assert_eq!(u.balance, Some(2.0));
        assert_eq!(pending.len(), 1);
    }

    #[test]
    fn a_row_held_by_another_statement_stays_queued_and_is_not_lost() {
        let update = |account_id: i64| StatusUpdate {
            account_id,
            ..upd(Some("connected"), Some(1.0))
        };
        let batch = vec![update(1), update(2), update(3)];
        let mut pending: HashMap<(i64, i64), StatusUpdate> = batch
            .iter()
            .map(|u| ((u.account_id, u.epoch), u.clone()))
            .collect();
        let mut written = Written::default();
        let outcome = db::status::Outcome {
            written: vec![(1, 2)],
            busy: vec![(2, 2)],
        };
        let lost = settle(&mut pending, &mut written, &batch, &outcome);
        assert_eq!(
            lost,
            vec![Lost {
                account_id: 3,
                epoch: 2
            }],
            "only the row that matched nothing is lost"
        );
        assert_eq!(
            pending.keys().collect::<Vec<_>>(),
            vec![&(2, 2)],
            "the busy row waits for the next batch; the written and the lost ones leave"
        );
        assert!(written.unchanged(&StatusUpdate {
            status: None,
            ..update(1)
        }));
        assert!(!written.unchanged(&StatusUpdate {
            status: None,
            ..update(2)
        }));
    }

    #[test]
    fn a_report_of_the_figures_already_written_queues_nothing() {
        let funds = |epoch: i64, balance: f64, equity: f64| StatusUpdate {
            account_id: 1,
            epoch,
            status: None,
            balance: Some(balance),
            equity: Some(equity),
            currency: Some("USD".parse().unwrap()),
        };
        let mut written = Written::default();
        let mut pending = HashMap::new();
        offer(&mut pending, &written, funds(2, 100.0, 90.0));
        assert_eq!(pending.len(), 1, "nothing written yet");
        written.note(&pending.remove(&(1, 2)).unwrap());
        offer(&mut pending, &written, funds(2, 100.0, 90.0));
        assert!(pending.is_empty(), "the same figures again: {pending:?}");
        offer(&mut pending, &written, upd(None, Some(100.0)));
        assert!(pending.is_empty(), "a figure already written alone");
        offer(&mut pending, &written, funds(2, 100.0, 91.0));
        assert_eq!(pending[&(1, 2)].equity, Some(91.0), "the equity moved");
        // Back to what was written while the change is still queued: the queue takes it.
        offer(&mut pending, &written, funds(2, 100.0, 90.0));
        assert_eq!(pending[&(1, 2)].equity, Some(90.0));
        pending.clear();
        offer(&mut pending, &written, upd(Some("a status"), Some(100.0)));
        assert_eq!(pending.len(), 1, "a status is always written");
        pending.clear();
        offer(&mut pending, &written, funds(3, 100.0, 90.0));
        assert_eq!(pending.len(), 1, "another epoch: written again");
        pending.clear();
        let mut other_currency = funds(2, 100.0, 90.0);
        other_currency.currency = Some("EUR".parse().unwrap());
        offer(&mut pending, &written, other_currency);
        assert_eq!(pending.len(), 1, "the currency changed");
    }
}
