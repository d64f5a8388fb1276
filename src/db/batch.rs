//! A node-level batching writer: the writes many account tasks make at about the same time (a
//! master's open copied by a thousand followers, a hundred masters publishing at once) go to the
//! database together, one statement per batch, instead of one statement, one commit and one pooled
//! connection each. Each caller still waits for its own outcome.
//!
//! There is no window: the writer takes whatever is queued when it is free, so a lone write goes
//! at once and a burst gathers behind the statement in flight. A batch the database refuses (one
//! row's account deleted meanwhile, a lock wait past the timeout, a row a constraint rejects) is
//! written again one job at a time, so one bad row costs no other its write; a batch lost with its
//! connection (or never sent: the pool timed out) fails every job at once, as unknown (it may have
//! committed: callers re-read, as after any database error).

use sqlx::PgConnection;
use tokio::sync::{mpsc, oneshot};

use crate::broker::BoxFuture;
use crate::db::Db;

/// A kind of write a [`BatchWriter`] gathers: how a batch of them is written, and what each
/// one's outcome is.
pub trait Batched: Sized + Send + Sync + 'static {
    type Outcome: Send + 'static;
    /// What the writer writes (named in its errors).
    const WHAT: &'static str;
    /// The most writes one statement carries.
    const MAX: usize;
    /// Writes a batch on a connection: one outcome per write, in the writes' order.
    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        writes: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>>;
}

type Job<J> = (J, oneshot::Sender<Result<<J as Batched>::Outcome, String>>);

/// The handle callers write through; the writer ends when the last handle is dropped.
#[derive(Debug)]
pub struct BatchWriter<J: Batched> {
    jobs: mpsc::UnboundedSender<Job<J>>,
}

impl<J: Batched> Clone for BatchWriter<J> {
    fn clone(&self) -> Self {
        BatchWriter {
            jobs: self.jobs.clone(),
        }
    }
}

impl<J: Batched> BatchWriter<J> {
    /// Starts a writer on `db`.
    pub fn spawn(db: Db) -> Self {
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job<J>>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < J::MAX {
                    match rx.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                let (writes, replies): (Vec<J>, Vec<_>) = batch.into_iter().unzip();
                let result = db
                    .run(async |conn| J::write_batch(conn, &writes).await)
                    .await;
                match result {
                    Ok(done) if done.len() == writes.len() => {
                        for (reply, outcome) in replies.into_iter().zip(done) {
                            let _ = reply.send(Ok(outcome));
                        }
                    }
                    // The database itself failed (a lost connection, a pool timeout): every job's
                    // outcome is unknown, and trying each alone would only wait out each in turn.
                    Err(e) if !matches!(e, sqlx::Error::Database(_)) => {
                        let why = crate::db::describe(&e);
                        for reply in replies {
                            let _ = reply.send(Err(why.clone()));
                        }
                    }
                    _ => {
                        for (job, reply) in writes.iter().zip(replies) {
                            let one = std::slice::from_ref(job);
                            let result = db
                                .run(async |conn| J::write_batch(conn, one).await)
                                .await
                                .map_err(|e| crate::db::describe(&e))
                                .and_then(|mut done| {
                                    done.pop().ok_or_else(|| format!("{}: no outcome", J::WHAT))
                                });
                            let _ = reply.send(result);
                        }
                    }
                }
            }
        });
        BatchWriter { jobs }
    }

    /// Writes `job` with whatever else is queued; its own outcome, or the database's error
    /// (whether it committed is then unknown).
    pub async fn write(&self, job: J) -> Result<J::Outcome, String> {
        let (tx, rx) = oneshot::channel();
        let stopped = || format!("the {} writer has stopped", J::WHAT);
        self.jobs.send((job, tx)).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}
