//! The batched, fenced status writer. Account tasks hand it their latest status, balance and
//! equity; it coalesces per (account, epoch) and writes each batch in one fenced statement. A
//! row that no longer matches (node, epoch) is reported to the supervisor as lost, which closes
//! that account's gate and stops its task.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::db;
pub(crate) use crate::db::status::StatusUpdate;

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
    let mut failures = 0u32;
    loop {
        if pending.is_empty() {
            tokio::select! {
                update = rx.recv() => match update {
                    Some(u) => merge(&mut pending, u),
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
                    Some(u) => merge(&mut pending, u),
                    None => break,
                },
                _ = &mut window => break,
                _ = cancel.cancelled() => break,
            }
        }
        let batch: Vec<StatusUpdate> = pending.values().take(MAX_BATCH).cloned().collect();
        match write(&pool, &node_id, &batch).await {
            Ok(matched) => {
                failures = 0;
                for u in &batch {
                    pending.remove(&(u.account_id, u.epoch));
                    if !matched.contains(&(u.account_id, u.epoch)) {
                        info!(
                            account_id = u.account_id,
                            epoch = u.epoch,
                            "status write found the account no longer ours: lost"
                        );
                        let _ = lost.send(Lost {
                            account_id: u.account_id,
                            epoch: u.epoch,
                        });
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
                merge(&mut pending, u);
            }
            if pending.is_empty() {
                return;
            }
        }
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
) -> Result<Vec<(i64, i64)>, sqlx::Error> {
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
}
