//! A node-level batching writer: the writes many account tasks make at about the same time (a
//! master's open copied by a thousand followers, a hundred masters publishing at once) go to the
//! database together, one statement per batch, instead of one statement, one commit and one pooled
//! connection each. Each caller still gets its own outcome. Reads gather the same way (the
//! followers' links, [`crate::db::copy::LinksReader`]): a batch of them in a background turn of
//! the node's pool ([`BatchWriter::spawn_background`]). A node's releases gather too
//! ([`crate::db::lease::Releaser`]), as live work on the pool ([`BatchWriter::spawn_pooled`]).
//!
//! There is no window: the writer takes whatever is queued when it is free, so a lone write goes
//! at once and a burst gathers behind the statement in flight. A writer on the node's pool first
//! lets the tasks woken beside the first job's sender run (one turn of the runtime), so jobs
//! their tasks send at the same moment go in one batch; jobs handed over at once go together
//! anyway ([`BatchWriter::submit_all`]). A writer may give way to orders
//! ([`Orders`]): the copy ledger's writer waits, at most [`GIVE_WAY`], until no order of the
//! node has been on its way to a broker for [`QUIET`], so a thousand followers' ledger rows are
//! written after their orders rather than between them; a caller that cannot go on until its
//! writes are in (a session ending, whose release waits for them) hurries the writer
//! ([`BatchWriter::hurry`]) and its queue goes at once. A batch the database refuses (one row's account deleted
//! meanwhile, a lock wait past the timeout, a row a constraint rejects) is written again one job
//! at a time, so one bad row costs no other its write (a batch of reads, whose rows fail one by
//! one inside the answer, fails every job at once instead: [`Batched::ALONE_WHEN_REFUSED`]); a
//! batch lost with its connection (or never sent: the pool timed out) fails every job at once, as
//! unknown (it may have committed: callers re-read, as after any database error).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::PgConnection;
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::debug;

use crate::db::Db;
use crate::future::BoxFuture;

/// A kind of write a [`BatchWriter`] gathers: how a batch of them is written, and what each
/// one's outcome is. A write must be safe to repeat: a batch whose connection was lost is
/// written once more on a new connection.
pub trait Batched: Sized + Send + Sync + 'static {
    type Outcome: Send + 'static;
    /// What the writer writes (named in its errors).
    const WHAT: &'static str;
    /// The most writes one statement carries.
    const MAX: usize;
    /// A batch the database refuses is written again one job at a time, so one bad row costs no
    /// other its write. Reads, whose rows fail one by one inside the batch's answer, set this
    /// false: a batch the database refuses (a timeout under load) then fails every job at once,
    /// as a lost connection does, instead of reading each job alone again while its session
    /// waits for its turn.
    const ALONE_WHEN_REFUSED: bool = true;
    /// Writes a batch on a connection: one outcome per write, in the writes' order.
    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        writes: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>>;
}

/// Each job's outcome when a statement answers with the ids it did something for (released,
/// found still free): whether the job's id is among them, in the jobs' order.
pub fn among<T>(jobs: &[T], id: impl Fn(&T) -> i64, ids: Vec<i64>) -> Vec<bool> {
    let ids: std::collections::HashSet<i64> = ids.into_iter().collect();
    jobs.iter().map(|j| ids.contains(&id(j))).collect()
}

/// The longest a writer that gives way to orders waits for them before it writes anyway (a node
/// always busy still writes its ledger at least this often).
pub const GIVE_WAY: Duration = Duration::from_millis(50);

/// How long no order of the node must have been on its way before a writer that gives way writes
/// (within [`GIVE_WAY`]): a fan-out's orders leave a node as their followers decide, so the count
/// touches zero between them, and the other nodes' orders of the same master event are still at
/// the broker when this node's are done. Measured (A/B, 100 followers over 4 nodes on one 2-core
/// machine): the last follower served 1.70-1.90x the N-orders floor with no quiet period, 1.34-1.46x
/// with this one. A ledger row lands at most this much later; a follower's next order waits for its
/// earlier rows, so a close right behind its open waits as much.
pub const QUIET: Duration = Duration::from_millis(10);

/// The node's orders on their way to a broker: counted by [`Orders::sending`] for as long as an
/// order waits for its broker's answer, so a writer can give way to them.
#[derive(Debug, Default)]
pub struct Orders {
    in_flight: AtomicUsize,
    /// Orders started, ever: an order that came and went during a quiet period breaks it.
    started: AtomicUsize,
    none_left: Notify,
}

/// One order on its way ([`Orders::sending`]); the count drops when it is dropped.
#[derive(Debug)]
pub struct Sending(Arc<Orders>);

impl Drop for Sending {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.none_left.notify_waiters();
        }
    }
}

impl Orders {
    /// An order starts its way to the broker; it is counted until the returned guard drops.
    pub fn sending(self: &Arc<Self>) -> Sending {
        self.started.fetch_add(1, Ordering::AcqRel);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Sending(self.clone())
    }

    /// Orders on their way now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Returns once no order has been on its way for `quiet` (none started meanwhile), or after
    /// `at_most`; true when the quiet held.
    pub async fn quiet_for(&self, quiet: Duration, at_most: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if !self.settled(left).await {
                return false;
            }
            let started = self.started.load(Ordering::Acquire);
            let until = (tokio::time::Instant::now() + quiet).min(deadline);
            tokio::time::sleep_until(until).await;
            if self.in_flight() == 0 && self.started.load(Ordering::Acquire) == started {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// Returns once no order is on its way, or after `at_most`; true when none was left.
    pub async fn settled(&self, at_most: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            let none_left = self.none_left.notified();
            tokio::pin!(none_left);
            // Registered before the count is read: a last order finishing in between still wakes.
            none_left.as_mut().enable();
            if self.in_flight() == 0 {
                return true;
            }
            tokio::select! {
                _ = &mut none_left => {}
                _ = tokio::time::sleep_until(deadline) => return self.in_flight() == 0,
            }
        }
    }
}

type Reply<J> = oneshot::Sender<Result<<J as Batched>::Outcome, String>>;
type Job<J> = (J, Reply<J>);

/// The handle callers write through; the writer ends when the last handle is dropped.
#[derive(Debug)]
pub struct BatchWriter<J: Batched> {
    /// Jobs handed over together arrive together ([`BatchWriter::submit_all`]).
    jobs: mpsc::UnboundedSender<Vec<Job<J>>>,
    /// Ends a writer's wait for orders ([`BatchWriter::hurry`]).
    hurried: Arc<Notify>,
}

impl<J: Batched> Clone for BatchWriter<J> {
    fn clone(&self) -> Self {
        BatchWriter {
            jobs: self.jobs.clone(),
            hurried: self.hurried.clone(),
        }
    }
}

/// A write handed to the writer ([`BatchWriter::submit`]): its outcome when awaited.
#[derive(Debug)]
pub struct Submitted<O> {
    what: &'static str,
    reply: Option<oneshot::Receiver<Result<O, String>>>,
}

impl<O> Submitted<O> {
    /// The outcome if it is known already (the write finished), without waiting.
    pub fn try_outcome(&mut self) -> Option<Result<O, String>> {
        let reply = self.reply.as_mut()?;
        match reply.try_recv() {
            Ok(outcome) => {
                self.reply = None;
                Some(outcome)
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.reply = None;
                Some(Err(format!("the {} writer has stopped", self.what)))
            }
        }
    }

    /// Waits for the outcome without giving the handle up: cancel-safe (dropped before the
    /// write finishes, the write stays submitted and this can be awaited again).
    pub async fn outcome_mut(&mut self) -> Result<O, String> {
        let what = self.what;
        let Some(reply) = self.reply.as_mut() else {
            return Err(format!("the {what} write's outcome was taken already"));
        };
        let outcome = reply
            .await
            .unwrap_or_else(|_| Err(format!("the {what} writer has stopped")));
        self.reply = None;
        outcome
    }

    /// Waits for the outcome.
    pub async fn outcome(mut self) -> Result<O, String> {
        let what = self.what;
        match self.reply.take() {
            Some(reply) => reply
                .await
                .unwrap_or_else(|_| Err(format!("the {what} writer has stopped"))),
            None => Err(format!("the {what} write's outcome was taken already")),
        }
    }
}

impl<J: Batched> BatchWriter<J> {
    /// Starts a writer on `db` (a connection of its own: [`crate::db::writer_pool`]). Idle, it
    /// pings that connection every [`crate::db::KEEPALIVE`], so a write never waits for the
    /// pool's ping of an idle connection and one that died meanwhile is replaced before a write
    /// needs it.
    pub fn spawn(db: Db) -> Self {
        Self::start(db, None, On::Own)
    }

    /// As [`BatchWriter::spawn`], giving way to `orders`: a batch waits, at most [`GIVE_WAY`],
    /// until no order has been on its way to a broker for [`QUIET`] (or until a caller hurries
    /// it: [`BatchWriter::hurry`]), and then takes everything queued meanwhile.
    pub fn spawn_giving_way(db: Db, orders: Arc<Orders>) -> Self {
        Self::spawn_giving_way_within(db, orders, GIVE_WAY)
    }

    /// As [`BatchWriter::spawn_giving_way`], waiting for the orders at most `at_most`.
    pub fn spawn_giving_way_within(db: Db, orders: Arc<Orders>, at_most: Duration) -> Self {
        Self::start(db, Some((orders, at_most)), On::Own)
    }

    /// As [`BatchWriter::spawn`] on the node's pool, each batch taking a background turn
    /// ([`Db::background`]): for reads that can wait, gathered instead of one unit of
    /// background work each.
    pub fn spawn_background(db: Db) -> Self {
        Self::start(db, None, On::Background)
    }

    /// As [`BatchWriter::spawn`] on the node's pool, each batch one unit of live work
    /// ([`Db::run`]): for work that must not wait for background turns, but would take every
    /// pooled connection if each job ran alone (a shutdown's thousands of releases).
    pub fn spawn_pooled(db: Db) -> Self {
        Self::start(db, None, On::Pool)
    }

    fn start(db: Db, orders: Option<(Arc<Orders>, Duration)>, on: On) -> Self {
        let (jobs, rx) = mpsc::unbounded_channel::<Vec<Job<J>>>();
        let hurried = Arc::new(Notify::new());
        let giving_way = orders.map(|(orders, at_most)| GivingWay {
            orders,
            at_most,
            hurried: hurried.clone(),
        });
        tokio::spawn(run(db.batching(), rx, giving_way, on));
        BatchWriter { jobs, hurried }
    }

    /// The writes queued now go without waiting for the node's orders (a writer that gives way
    /// to them: [`BatchWriter::spawn_giving_way`]; others write at once anyway): for a caller
    /// that waits for its writes before it can go on, as a session ending does (its account is
    /// released only after them, and a hand-off's receiver waits for that release). At most
    /// the writer's next batch goes early: a hurry that finds nothing queued may hurry the
    /// next write that comes.
    pub fn hurry(&self) {
        self.hurried.notify_one();
    }

    /// Hands `job` to the writer now (it goes with whatever else is queued); its outcome, or the
    /// database's error (whether it committed is then unknown), when the returned handle is
    /// awaited.
    pub fn submit(&self, job: J) -> Submitted<J::Outcome> {
        self.submit_all(vec![job])
            .pop()
            .expect("one handle per job")
    }

    /// Hands `jobs` to the writer at once: they go in the same batch (up to [`Batched::MAX`] a
    /// batch), even to a writer that is idle, which would otherwise send the first alone as it
    /// arrives and the rest behind it, a statement later. One handle per job, in order.
    pub fn submit_all(&self, jobs: Vec<J>) -> Vec<Submitted<J::Outcome>> {
        let (queued, handles): (Vec<Job<J>>, Vec<_>) = jobs
            .into_iter()
            .map(|job| {
                let (tx, rx) = oneshot::channel();
                let handle = Submitted {
                    what: J::WHAT,
                    reply: Some(rx),
                };
                ((job, tx), handle)
            })
            .unzip();
        // A stopped writer drops the jobs with their replies: the handles then say so.
        let _ = self.jobs.send(queued);
        handles
    }

    /// Writes `job` with whatever else is queued and waits for its own outcome.
    pub fn write(&self, job: J) -> impl Future<Output = Result<J::Outcome, String>> + use<J> {
        self.submit(job).outcome()
    }
}

/// Where a writer's batches run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum On {
    /// Its own connection (a pool of one), kept alive while idle.
    Own,
    /// The node's pool, in a background turn.
    Background,
    /// The node's pool, as live work.
    Pool,
}

impl On {
    async fn run<T>(
        self,
        db: &Db,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        match self {
            On::Own | On::Pool => db.run(work).await,
            On::Background => db.background(work).await,
        }
    }
}

/// What a writer that gives way waits for: the node's orders, at most `at_most`, unless hurried.
struct GivingWay {
    orders: Arc<Orders>,
    at_most: Duration,
    hurried: Arc<Notify>,
}

async fn run<J: Batched>(
    db: Db,
    mut rx: mpsc::UnboundedReceiver<Vec<Job<J>>>,
    giving_way: Option<GivingWay>,
    on: On,
) {
    // Jobs received and not yet written: what a batch of more than [`Batched::MAX`] left.
    let mut queued: std::collections::VecDeque<Job<J>> = std::collections::VecDeque::new();
    loop {
        // A pooled connection is the pool's to keep alive.
        let idle = match on {
            On::Own => crate::db::KEEPALIVE,
            On::Background | On::Pool => Duration::MAX,
        };
        let arrived = if !queued.is_empty() {
            Vec::new()
        } else {
            match tokio::time::timeout(idle, rx.recv()).await {
                Ok(Some(arrived)) => arrived,
                Ok(None) => return,
                Err(_) => {
                    if let Err(e) = db
                        .run(async |conn| sqlx::Connection::ping(conn).await)
                        .await
                    {
                        debug!(what = J::WHAT, error = %crate::db::describe(&e), "the writer's idle connection failed its ping; it is replaced");
                    }
                    continue;
                }
            }
        };
        let fresh = !arrived.is_empty();
        queued.extend(arrived);
        if queued.is_empty() {
            // An empty hand-over (nothing submitted).
            continue;
        }
        if fresh && on != On::Own {
            // Woken by the first job, the writer would run before the tasks woken beside the
            // one that sent it (the runtime runs the task last woken first): sessions whose
            // fence raises were answered together would send their reads as one batch of one
            // and one of the rest, a round trip apart. The writer lets them run first. Not on a
            // writer of its own connection (the master's events, the copy ledger), which goes
            // at once on the live path.
            tokio::task::yield_now().await;
        }
        if let Some(way) = &giving_way {
            tokio::select! {
                _ = way.orders.quiet_for(QUIET, way.at_most) => {}
                () = way.hurried.notified() => {}
            }
        }
        while let Ok(arrived) = rx.try_recv() {
            queued.extend(arrived);
        }
        let take = queued.len().min(J::MAX);
        let (writes, replies): (Vec<J>, Vec<_>) = queued.drain(..take).unzip();
        let mut result = on
            .run(&db, async |conn| J::write_batch(conn, &writes).await)
            .await;
        if result.as_ref().is_err_and(connection_lost) {
            // The writer's one connection died since its last use (a database restart): it was
            // closed, and the batch goes again once on a new one. Both kinds of write are safe
            // to repeat (a ledger row already in is kept; an event already stored is refused as
            // out of sequence, and its master re-reads).
            debug!(
                what = J::WHAT,
                "the writer's connection was lost; writing the batch again on a new one"
            );
            result = on
                .run(&db, async |conn| J::write_batch(conn, &writes).await)
                .await;
        }
        match result {
            Ok(done) if done.len() == writes.len() => {
                for (reply, outcome) in replies.into_iter().zip(done) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            // The database itself failed (a lost connection, a pool timeout), or refused a batch
            // of reads: every job's outcome is unknown, and trying each alone would only wait out
            // each in turn.
            Err(e) if !matches!(e, sqlx::Error::Database(_)) || !J::ALONE_WHEN_REFUSED => {
                let why = crate::db::describe(&e);
                for reply in replies {
                    let _ = reply.send(Err(why.clone()));
                }
            }
            _ => {
                for (job, reply) in writes.iter().zip(replies) {
                    let one = std::slice::from_ref(job);
                    let result = on
                        .run(&db, async |conn| J::write_batch(conn, one).await)
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
}

/// The connection itself failed (not the statement, not the pool's wait for a connection).
fn connection_lost(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn settled_waits_for_the_last_order_or_the_bound() {
        let orders = Arc::new(Orders::default());
        assert!(
            orders.settled(Duration::from_millis(5)).await,
            "none in flight"
        );
        let one = orders.sending();
        let two = orders.sending();
        assert_eq!(orders.in_flight(), 2);
        // Still in flight at the bound.
        assert!(!orders.settled(Duration::from_millis(5)).await);
        let waiter = {
            let orders = orders.clone();
            tokio::spawn(async move { orders.settled(Duration::from_secs(3600)).await })
        };
        tokio::task::yield_now().await;
        drop(one);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one order is still on its way");
        drop(two);
        assert!(waiter.await.unwrap(), "woken when the last order finished");
        assert_eq!(orders.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn quiet_for_waits_until_no_order_has_been_on_its_way_for_the_period() {
        let orders = Arc::new(Orders::default());
        let quiet = Duration::from_millis(10);
        let start = tokio::time::Instant::now();
        assert!(orders.quiet_for(quiet, GIVE_WAY).await, "none in flight");
        assert_eq!(start.elapsed(), quiet, "a full quiet period first");
        // An order that comes and goes inside the period starts it again.
        let waiter = {
            let orders = orders.clone();
            tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                (orders.quiet_for(quiet, GIVE_WAY).await, start.elapsed())
            })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(orders.sending());
        let (held, took) = waiter.await.unwrap();
        assert!(held);
        assert_eq!(
            took,
            Duration::from_millis(20),
            "the period an order broke, then a whole one"
        );
        // Orders all the time: the bound.
        let _busy = orders.sending();
        let start = tokio::time::Instant::now();
        assert!(!orders.quiet_for(quiet, GIVE_WAY).await);
        assert_eq!(start.elapsed(), GIVE_WAY);
    }
}
