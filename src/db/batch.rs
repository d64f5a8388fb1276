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

/// Writes a batch on a connection: one outcome per job, in the jobs' order.
pub type WriteBatch<J, O> =
    for<'a> fn(&'a mut PgConnection, &'a [J]) -> BoxFuture<'a, Result<Vec<O>, sqlx::Error>>;

type Job<J, O> = (J, oneshot::Sender<Result<O, String>>);

/// The handle callers write through; the writer ends when the last handle is dropped.
#[derive(Debug)]
pub struct BatchWriter<J, O> {
    jobs: mpsc::UnboundedSender<Job<J, O>>,
    what: &'static str,
}

impl<J, O> Clone for BatchWriter<J, O> {
    fn clone(&self) -> Self {
        BatchWriter {
            jobs: self.jobs.clone(),
            what: self.what,
        }
    }
}

impl<J, O> BatchWriter<J, O>
where
    J: Send + Sync + 'static,
    O: Send + 'static,
{
    /// Starts a writer of `what` (named in its errors) on `db`, at most `max` jobs a statement.
    pub fn spawn(db: Db, what: &'static str, max: usize, write: WriteBatch<J, O>) -> Self {
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job<J, O>>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < max {
                    match rx.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                let (writes, replies): (Vec<J>, Vec<_>) = batch.into_iter().unzip();
                let result = db.run(async |conn| write(conn, &writes).await).await;
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
                                .run(async |conn| write(conn, one).await)
                                .await
                                .map_err(|e| crate::db::describe(&e))
                                .and_then(|mut done| {
                                    done.pop().ok_or_else(|| format!("{what}: no outcome"))
                                });
                            let _ = reply.send(result);
                        }
                    }
                }
            }
        });
        BatchWriter { jobs, what }
    }

    /// Writes `job` with whatever else is queued; its own outcome, or the database's error
    /// (whether it committed is then unknown).
    pub async fn write(&self, job: J) -> Result<O, String> {
        let (tx, rx) = oneshot::channel();
        let stopped = || format!("the {} writer has stopped", self.what);
        self.jobs.send((job, tx)).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}
